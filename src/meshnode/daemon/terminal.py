"""Admin methods for the CLI at the terminal (issue #18): following a task as it
runs, and events and feeds from a terminal, all as the node's CLI identity.

* ``Tasks.Follow {task_id, responder?, stream?, timeout?}`` (streaming): the
  task's signed updates and, with ``stream``, its chunk data, each as it
  arrives, then its end::

      {"kind": "update", "state", "message"?, "id", "ts"}
      {"kind": "chunk", "index", "data"}
      {"kind": "result", "status", "output", "error", "task_id", "from", "message"?, "problems"?}

  It replays from the task's start (the requester's consumer on MESH_TASKS
  delivers all), so a follow opened after ``Call {wait_task: false}`` misses
  nothing. It ends at a terminal state or a pause (input_required,
  auth_required), like ``Call``. ``responder`` defaults to the one the task
  manager recorded.
* ``Events.Publish {domain, event_type, data?}`` -> ``{subject, from}``: an emit
  signed by the CLI identity (§6.6).
* ``Events.Subscribe {pattern} | {owner, topic?}`` (streaming): each event on
  ``mesh.event.{pattern}`` (or each entry of the feed ``mesh.feed.{owner}.{topic}``)
  as it arrives, its signature verified; ``{subject, id, from, ts, domain?,
  event_type?, topic?, data}``, after a first ``{kind: "subscribed", subject}``
  once the subscription is in place. Live only: nothing is buffered for a terminal.

These live apart from the core methods so that the daemon's own modules stay
as they are; :func:`register_terminal_methods` adds them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from meshnode.admin.protocol import InvalidParameter, NotFound, NotReady, Refused
from meshnode.admin.server import CallContext, MethodRegistry
from meshnode.aio import wait_for
from meshnode.node.builtin import CLI_AGENT_NAME
from meshnode.node.context import AgentContext
from meshnode.node.tasks import RequesterTask, StreamBroken
from meshnode.protocol import subjects
from meshnode.protocol.envelope import decode_envelope, new_root_trace
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.subjects import SubjectError

if TYPE_CHECKING:
    from meshnode.daemon.main import Daemon

__all__ = ["register_terminal_methods"]

log = logging.getLogger("meshnode.daemon")

#: Task states after which nothing more happens, and the pauses a caller answers.
_TERMINAL = frozenset({"completed", "failed", "canceled", "rejected", "exhausted"})
_PAUSED = frozenset({"input_required", "auth_required"})
#: After the terminal update, how long the rest of a stream may still take to
#: arrive (chunks and updates travel on different subjects); shorter when no
#: chunk came at all (the responder answered without streaming).
_STREAM_GRACE_S = 5.0
_NO_STREAM_GRACE_S = 1.0
#: Subscribed events a slow terminal may fall behind by before older ones are dropped.
_EVENT_BACKLOG = 1000


def register_terminal_methods(daemon: Daemon, methods: MethodRegistry) -> None:
    """Add ``Tasks.Follow``, ``Events.Publish`` and ``Events.Subscribe`` (module docstring)."""
    ops = _Terminal(daemon)
    methods.add(
        "Tasks.Follow", ops.tasks_follow, level="operator", streaming=True,
        doc="params {task_id, responder?, stream?, timeout?} -> a stream of {kind: update|chunk|result, ...} "
        "for a task the CLI identity requested, from its start until it ends or pauses",
    )
    methods.add(
        "Events.Publish", ops.events_publish, level="operator",
        doc="params {domain, event_type, data?} -> {id, subject}: an event signed as the CLI identity",
    )
    methods.add(
        "Events.Subscribe", ops.events_subscribe, level="operator", streaming=True,
        doc="params {pattern} | {owner, topic?} -> a stream of verified events (or feed entries) "
        "{subject, id, from, ts, data, ...} as they arrive (live only)",
    )


class _Terminal:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def _cli(self) -> Any:
        node = self.daemon.node
        if node is None:
            raise NotReady("the node is not running yet")
        return node.agents[CLI_AGENT_NAME]

    # ----------------------------------------------------------------- tasks

    async def _responder_of(self, cli: Any, task_id: str) -> str:
        try:
            record: Mapping[str, Any] = await cli.node.service_call(
                cli, f"mesh.task.get.{task_id}", "request", {"task_id": task_id}
            )
        except ProtocolError as exc:
            raise Refused(exc.message, exc.to_object()) from None
        responder = record.get("responder")
        if not isinstance(responder, str):
            raise NotFound(f"the task manager names no responder for {task_id}")
        return responder

    async def tasks_follow(self, params: dict[str, Any], call: CallContext) -> AsyncIterator[dict[str, Any]]:
        cli = self._cli()
        task_id, responder = params.get("task_id"), params.get("responder")
        if not isinstance(task_id, str):
            raise InvalidParameter("task_id is required", {"parameter": "task_id"})
        if responder is not None and not isinstance(responder, str):
            raise InvalidParameter("responder is an agent id", {"parameter": "responder"})
        timeout = params.get("timeout", 300)
        if not isinstance(timeout, int | float) or not 0 < timeout <= 86400:
            raise InvalidParameter("timeout must be seconds in (0, 86400]", {"parameter": "timeout"})
        if responder is None:
            responder = await self._responder_of(cli, task_id)
        # A handle on the task as its requester (the CLI identity): only the
        # updates and chunks of its parties are passed on (RequesterTask checks).
        task = RequesterTask(cli, {"task_id": task_id, "from": responder, "payload": {"status": "submitted"}})
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        async def pump_updates() -> None:
            async for env in task.updates(float(timeout)):
                payload = env.get("payload") if isinstance(env.get("payload"), Mapping) else {}
                assert isinstance(payload, Mapping)
                state = payload.get("status")
                if env.get("from") != responder or not isinstance(state, str):
                    continue
                if state in _TERMINAL or state in _PAUSED:
                    await queue.put(_result(env, task_id))
                    return
                item: dict[str, Any] = {"kind": "update", "state": state, "id": env.get("id"), "ts": env.get("ts")}
                if isinstance(payload.get("message"), str):
                    item["message"] = payload["message"]
                await queue.put(item)

        async def pump_stream() -> None:
            index = 0
            async for data in task.stream(float(timeout)):
                await queue.put({"kind": "chunk", "index": index, "data": data})
                index += 1
            await queue.put({"kind": "stream_end", "chunks": index})

        updates = asyncio.create_task(pump_updates())
        stream = asyncio.create_task(pump_stream()) if params.get("stream") is True else None
        result: dict[str, Any] | None = None
        stream_done = stream is None
        chunks = 0
        try:
            while result is None or not stream_done:
                waiting = None if result is None else _STREAM_GRACE_S if chunks else _NO_STREAM_GRACE_S
                try:
                    item = await wait_for(self._next(queue, updates, stream), timeout=waiting)
                except TimeoutError:
                    break  # the result is in; the stream's tail never came
                if item is None:
                    break
                if item["kind"] == "stream_end":
                    stream_done = True
                elif item["kind"] == "result":
                    result = item
                else:
                    chunks += item["kind"] == "chunk"
                    yield item
        except StreamBroken as exc:
            raise Refused(f"the stream of task {task_id} broke: {exc}", {"code": "DEPENDENCY_FAILED",
                          "message": str(exc), "retryable": False}) from None
        finally:
            for pump in (updates, stream):
                if pump is not None and not pump.done():
                    pump.cancel()
                    with contextlib.suppress(BaseException):
                        await pump
        if result is not None:
            yield result

    @staticmethod
    async def _next(
        queue: asyncio.Queue[dict[str, Any] | None], updates: asyncio.Task[None], stream: asyncio.Task[None] | None
    ) -> dict[str, Any] | None:
        """The next queued item; a pump's failure is raised here; None when both pumps ended."""
        while True:
            if not queue.empty():
                return queue.get_nowait()
            for pump in (updates, stream):
                failure = pump.exception() if pump is not None and pump.done() else None
                if isinstance(failure, TimeoutError):
                    # Told apart from the stream's grace running out (a TimeoutError too).
                    raise NotReady("no update of the task in time (the responder may be slow or gone)")
                if failure is not None:
                    raise failure
            if updates.done() and (stream is None or stream.done()):
                return None if queue.empty() else queue.get_nowait()
            getter = asyncio.ensure_future(queue.get())
            pumps = {p for p in (updates, stream) if p is not None and not p.done()}
            done, _ = await asyncio.wait({getter, *pumps}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                return getter.result()
            getter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await getter

    # ----------------------------------------------------------------- events

    async def events_publish(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        cli = self._cli()
        domain, event_type = params.get("domain"), params.get("event_type")
        if not isinstance(domain, str) or not isinstance(event_type, str):
            raise InvalidParameter("domain and event_type are required strings")
        try:
            subject = subjects.event_subject(domain, event_type)
        except SubjectError as exc:
            raise InvalidParameter(str(exc), {"parameter": "domain"}) from None
        ctx = AgentContext(cli, trace=new_root_trace())
        try:
            await ctx.emit(domain, event_type, params.get("data"))
        except ProtocolError as exc:
            raise Refused(exc.message, exc.to_object()) from None
        return {"subject": subject, "from": cli.agent_id}

    async def events_subscribe(self, params: dict[str, Any], call: CallContext) -> AsyncIterator[dict[str, Any]]:
        cli = self._cli()
        pattern, owner = params.get("pattern"), params.get("owner")
        topic = params.get("topic", "*")
        try:
            if isinstance(owner, str):
                if not isinstance(topic, str):
                    raise InvalidParameter("topic is a string", {"parameter": "topic"})
                subject = subjects.feed_pattern(owner, topic)
            elif isinstance(pattern, str):
                subject = subjects.event_filter(pattern)
            else:
                raise InvalidParameter("pattern, or owner (and topic), is required")
        except SubjectError as exc:
            raise InvalidParameter(str(exc)) from None
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=_EVENT_BACKLOG)

        async def on_msg(msg: Any) -> None:
            try:
                env = decode_envelope(msg.data)  # parsed, validated and verified
            except ProtocolError as exc:
                log.debug("Events.Subscribe: dropped an envelope on %s: %s", msg.subject, exc)
                return
            payload = env.get("payload") if isinstance(env.get("payload"), Mapping) else {}
            assert isinstance(payload, Mapping)
            item: dict[str, Any] = {"subject": msg.subject, "id": env["id"], "from": env["from"], "ts": env["ts"]}
            for key in ("domain", "event_type", "topic", "kind", "seq"):
                if key in payload:
                    item[key] = payload[key]
            item["data"] = payload.get("data")
            if queue.full():
                queue.get_nowait()  # a terminal that cannot keep up sees the newest
            queue.put_nowait(item)

        sub = await cli.node.connection.subscribe(subject, on_msg)
        try:
            # First, that the subscription is in place: a publish after this is seen.
            yield {"kind": "subscribed", "subject": subject}
            while True:
                yield await queue.get()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


def _result(env: Mapping[str, Any], task_id: str) -> dict[str, Any]:
    """A task's last update as ``Call`` answers it."""
    payload = env.get("payload") if isinstance(env.get("payload"), Mapping) else {}
    assert isinstance(payload, Mapping)
    answer: dict[str, Any] = {
        "kind": "result",
        "status": payload.get("status"),
        "output": payload.get("output"),
        "error": env.get("error"),
        "from": env.get("from"),
        "task_id": task_id,
    }
    for key in ("message", "problems"):
        if payload.get(key) is not None:
            answer[key] = payload[key]
    if env.get("context_id") is not None:
        answer["context_id"] = env["context_id"]
    return answer
