"""The caller's handle on a streamed (or resumed) outbound A2A call."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from a2a.extensions.common import get_requested_extensions
from a2a.types.a2a_pb2 import Message, SendMessageConfiguration, SendMessageRequest

from meshnode.a2a.client import (
    Ambiguous,
    Unsent,
    answer_dict,
    classify,
    ints_from_wire,
    peer_client,
    stream_results,
)
from meshnode.a2a.mapping import ints_as_sent
from meshnode.a2a.peers import (
    INTERRUPTED_STATES,
    OPEN_STATES,
    TERMINAL_STATES,
    Sent,
    output_of_parts,
    report_of,
)
from meshnode.aio import wait_for
from meshnode.protocol.a2a_extension import A2A_TARGET_PREFIX, EXTENSION_URI
from meshnode.protocol.errors import ProtocolError

if TYPE_CHECKING:
    from meshnode.a2a.outbound import A2AOutbound

__all__ = ["A2AStreamTask"]

log = logging.getLogger("meshnode.a2a.outbound")


class A2AStreamTask:
    """The caller's handle on a streamed A2A call — the A2A twin of
    :class:`meshnode.node.tasks.RequesterTask`, so a handler consumes a peer's
    stream as it consumes a mesh one::

        reply = await ctx.request("a2a:weather", "forecast", input, config={"stream": True})
        if reply.task is not None:
            async for data in reply.task.stream():   # one item per artifact update
                ...
            final = await reply.task.result()        # the closing envelope (status, output, meta)

    Each ``artifactUpdate`` of the peer is one chunk (its parts read as
    :func:`output_of_parts` reads them); the stream's last status update is the
    result, and its run report is verified and charged once (as on the plain
    path). ``cancel()`` sends CancelTask; cancelling a handler while it waits in
    ``stream()`` or ``result()`` does too (once, best-effort).
    """

    def __init__(self, bridge: A2AOutbound, sent: Sent) -> None:
        self._bridge = bridge
        self._sent = sent
        self.responder = A2A_TARGET_PREFIX + sent.name
        self.chunks: list[Any] = []
        self._parts: list[dict[str, Any]] = []
        self._status_parts: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None
        self.last_update: dict[str, Any] = {}
        self._error: ProtocolError | None = None
        self._first = asyncio.Event()
        self._changed = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None
        #: When following the task by GetTask stops (monotonic seconds).
        self._watch_until = time.monotonic() + 300.0

    @property
    def task_id(self) -> str | None:
        return self._sent.task_id

    @property
    def state(self) -> str:
        payload = self.last_update.get("payload")
        status = payload.get("status") if isinstance(payload, Mapping) else None
        return str(status) if isinstance(status, str) else "submitted"

    # -- fed by the pump ---------------------------------------------------------

    def _notify(self) -> None:
        self._first.set()
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _fail(self, error: ProtocolError) -> None:
        if self.final is None and self._error is None:
            self._error = error
        self._sent.finished = True
        self._notify()

    async def _event(self, event: Mapping[str, Any]) -> None:
        sent = self._sent
        if "message" in event:
            parts = list(event["message"].get("parts") or [])
            output = output_of_parts(parts)
            self.chunks.append(output)
            self.final = await self._bridge._finish(sent, "TASK_STATE_COMPLETED", output, None, None,
                                                    len(self.chunks))
            self.last_update = self.final
            self._notify()
            return
        state = ""
        token: str | None = None
        status: Mapping[str, Any] = {}
        if "task" in event:
            task = event["task"]
            sent.task_id = sent.task_id or (str(task.get("id")) if task.get("id") else None)
            if not self._parts:  # a task snapshot (first event, or a GetTask poll) brings its artifacts
                for artifact in task.get("artifacts") or []:
                    parts = list(artifact.get("parts") or [])
                    self._parts.extend(parts)
                    self.chunks.append(output_of_parts(parts))
            status = task.get("status") or {}
            state = str(status.get("state") or "")
            token = report_of(task)
        elif "artifactUpdate" in event:
            parts = list((event["artifactUpdate"].get("artifact") or {}).get("parts") or [])
            if not parts:
                return  # a chunk that only closes the artifact (lastChunk) carries no data
            self._parts.extend(parts)
            self.chunks.append(output_of_parts(parts))
            self._notify()
            return
        elif "statusUpdate" in event:
            update = event["statusUpdate"]
            sent.task_id = sent.task_id or (str(update.get("taskId")) if update.get("taskId") else None)
            status = update.get("status") or {}
            state = str(status.get("state") or "")
            token = report_of(update)
        else:
            return
        self._status_parts = list((status.get("message") or {}).get("parts") or [])
        status_meta = ((status.get("message") or {}).get("metadata") or {}).get(EXTENSION_URI)
        if state in TERMINAL_STATES or state in INTERRUPTED_STATES:
            output = output_of_parts(self._parts or self._status_parts)
            self.final = await self._bridge._finish(sent, state, output, token, status_meta, len(self.chunks))
            self.last_update = self.final
        else:
            info = {"peer": sent.name, "mesh": sent.mesh, "message_id": sent.message_id, "attempts": 1,
                    "task_id": sent.task_id, "report": None, "charge": None, "streamed": True}
            self.last_update = self._bridge._envelope(sent.name, sent.call, OPEN_STATES.get(state, "working"),
                                                      None, info, None)
        self._notify()

    async def _wait_first(self, timeout: float) -> None:
        try:
            await wait_for(self._first.wait(), timeout=max(timeout, 0.001))
        except TimeoutError:
            raise ProtocolError(
                "TRANSPORT_TIMEOUT", f"no answer from A2A peer {self._sent.name!r}; the message may have arrived",
                {"peer": self._sent.name, "message_id": self._sent.message_id, "ambiguous": True, "resent": 0},
            ) from None
        if self._error is not None and self.final is None:
            raise self._error

    # -- the pump: one task owns the peer's HTTP stream ----------------------------

    def start(self, build: Callable[[], Awaitable[Message]] | None, *, watch_until: float, name: str) -> None:
        """Start reading: the message ``build`` makes is sent as SendStreamingMessage
        (None: a resumed task, only followed by GetTask until ``watch_until``)."""
        self._watch_until = watch_until
        self._reader = asyncio.get_running_loop().create_task(self._pump(build), name=name)

    async def _read(self, msg: Message) -> None:
        sent, handle = self._sent, self
        echoed: list[str] = []
        bodies: list[Any] = []
        streamed = bytearray()
        async with peer_client(sent.peer.card, sent.headers, timeout=sent.settings.timeout_s, streaming=True,
                               echoed=echoed, bodies=bodies, streamed=streamed) as (client, ctx):
            request = SendMessageRequest(message=msg, configuration=SendMessageConfiguration())
            try:
                raw: list[Any] = []  # the events' results as the peer sent them, in order
                index = 0
                async for event in client.send_message(request, context=ctx):
                    sent.mesh = sent.peer.mesh and EXTENSION_URI in get_requested_extensions(echoed)
                    answer = answer_dict(event)
                    # The numbers as the peer sent them: its event stream as read so
                    # far (or, from a peer that answered at once, its JSON body).
                    more, read_to = stream_results(streamed)
                    del streamed[:read_to]  # parsed: only an incomplete event is kept
                    raw.extend(more)
                    if index < len(raw) and isinstance(raw[index], dict):
                        answer = ints_as_sent(answer, raw[index])
                    elif bodies:
                        answer = ints_from_wire(answer, bodies)
                    index += 1
                    await handle._event(answer)
                    if handle.final is not None:
                        return
            except Exception as exc:
                classify(exc)

    async def _pump(self, build: Callable[[], Awaitable[Message]] | None) -> None:
        """Read the peer's event stream into ``handle`` (one task owns the HTTP stream);
        with no ``build`` (a resumed task) only follow the task by GetTask."""
        sent, handle, bridge = self._sent, self, self._bridge
        try:
            if build is not None:
                await self._read(await build())
            # The stream ended (or the peer does not stream and answered once, or
            # this is a resumed task) with the task still open: follow it by GetTask.
            first = True
            while handle.final is None and sent.task_id:
                if time.monotonic() >= handle._watch_until:
                    bridge._remember_open(sent)
                    raise ProtocolError(
                        "TRANSPORT_TIMEOUT",
                        f"A2A task {sent.task_id} of peer {sent.name!r} did not finish before the wait ended"
                        " (follow it with ctx.a2a_task)",
                        {"peer": sent.name, "task_id": sent.task_id, "ambiguous": False,
                         "message_id": sent.message_id})
                if not first or build is not None:
                    await asyncio.sleep(bridge.poll_interval_s)
                first = False
                polled = await bridge._poll(sent, handle._watch_until)
                if polled:
                    await handle._event({"task": polled})
            if handle.final is None:
                raise ProtocolError("DEPENDENCY_FAILED", f"the A2A stream of peer {sent.name!r} ended early",
                                    {"peer": sent.name, "message_id": sent.message_id})
        except Unsent:
            handle._fail(ProtocolError("AGENT_UNAVAILABLE", f"A2A peer {sent.name!r} could not be reached",
                                       {"peer": sent.name, "message_id": sent.message_id}))
        except Ambiguous:
            # A stream is not resent: its chunks may have been seen already.
            handle._fail(ProtocolError(
                "TRANSPORT_TIMEOUT", f"the A2A stream of peer {sent.name!r} broke off",
                {"peer": sent.name, "message_id": sent.message_id, "task_id": sent.task_id,
                 "ambiguous": True, "resent": 0}))
        except ProtocolError as exc:
            handle._fail(exc)
        except asyncio.CancelledError:
            handle._fail(ProtocolError("TRANSPORT_TIMEOUT", "the A2A stream was closed",
                                       {"peer": sent.name, "task_id": sent.task_id}))
            raise
        except Exception as exc:
            log.exception("the A2A stream of peer %s failed", sent.name)
            handle._fail(ProtocolError("DEPENDENCY_FAILED", f"the A2A stream failed: {type(exc).__name__}",
                                       {"peer": sent.name}))

    # -- the caller's side -------------------------------------------------------

    async def stream(self, timeout: float = 60.0) -> AsyncIterator[Any]:
        """Chunk data in order, until the task ends; raises the stream's failure
        (a ProtocolError) if it broke off. ``timeout``: the wait for each chunk."""
        index = 0
        try:
            while True:
                changed = self._changed
                if index < len(self.chunks):
                    index += 1
                    yield self.chunks[index - 1]
                    continue
                if self._error is not None:
                    raise self._error
                if self.final is not None:
                    return
                await wait_for(changed.wait(), timeout=timeout)
        except asyncio.CancelledError:
            await self._abandon()
            raise

    async def result(self, timeout: float = 300.0) -> Mapping[str, Any]:
        """The closing envelope (``payload.status`` completed, failed, canceled,
        rejected, input_required or auth_required; ``meta[uri]`` the charge)."""
        try:
            deadline = time.monotonic() + timeout
            while self.final is None:
                if self._error is not None:
                    raise self._error
                changed = self._changed
                await wait_for(changed.wait(), timeout=max(0.001, deadline - time.monotonic()))
            return self.final
        except asyncio.CancelledError:
            await self._abandon()
            raise

    async def cancel(self, reason: str = "caller_abandoned", note: str | None = None) -> Mapping[str, Any]:
        """CancelTask for the peer's task (once); the stream ends canceled.
        ``reason``/``note`` are recorded with the call (A2A's CancelTask has no reason)."""
        why = f"canceled by the caller ({reason}{': ' + note if note else ''})"
        await self._bridge._cancel_peer(self._sent, why)
        self._end_canceled(why)
        return {"task_id": self.task_id, "status": "canceled"}

    def close(self) -> None:
        """Stop reading the peer's stream (the peer's task is not canceled)."""
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()

    async def _abandon(self) -> None:
        if self.final is None:
            await self._bridge._abandon(self._sent)
            self._end_canceled("the calling mesh work was canceled")

    def _end_canceled(self, why: str) -> None:
        self.close()
        if self.final is None:
            sent = self._sent
            info = {"peer": sent.name, "mesh": sent.mesh, "message_id": sent.message_id, "attempts": 1,
                    "task_id": sent.task_id, "report": "canceled", "charge": None, "streamed": True,
                    "chunks": len(self.chunks), "note": why}
            self.final = self._bridge._envelope(sent.name, sent.call, "canceled", None, info, None)
            self.last_update = self.final
            self._notify()

