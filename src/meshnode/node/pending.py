"""The pending-request table: the caller's side of a request (§6.4, §6.4a, §6.5, D.2).

A request's answers arrive where every answer arrives: at the requester's own
inbox, through the same inbound pipeline as everything else, correlated by
``(in_reply_to, sender)``. This module keeps the table of requests in flight
and the rules for waiting on them: an accept resets the wait but is not the
answer; the first respond whose status is not ``accepted`` is; silence past
the wait means *possibly queued*, not lost.

Beside the table: :class:`DeliveryWatch`, the delivery-status signals of the
requests in flight (§18.7: no responders, a queued ack), and :class:`SendPacer`,
the recipient's published rate limits kept by the sender (§6.4b).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from meshnode.agent import Reply, RequestQueued, RequestTimeout
from meshnode.protocol.accept import is_queued_ack
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.preflight import next_allowed_at, prune_history
from meshnode.transport.connection import MeshConnection, Msg

__all__ = ["DeliveryWatch", "PendingRequests", "SendPacer"]


@dataclass
class _Pending:
    target: str
    future: asyncio.Future[Reply]
    accepted: bool = False
    queued: bool = False
    unavailable: bool = False
    # The wait is one timer, re-armed once by the first accept: no task or
    # asyncio.wait per request (they were a visible share of a round trip).
    timeout: float = 0.0
    timer: asyncio.TimerHandle | None = None


class PendingRequests:
    """Requests in flight, keyed by (requester, request id)."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, str], _Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def open(self, requester: str, request_id: str, target: str) -> None:
        loop = asyncio.get_running_loop()
        self._pending[(requester, request_id)] = _Pending(target, loop.create_future())

    def close(self, requester: str, request_id: str) -> None:
        self._pending.pop((requester, request_id), None)

    def deliver(self, requester: str, envelope: Mapping[str, Any]) -> bool:
        """Offer a verified, checked respond to the table. True when it matched.

        A respond matches only if it answers a request this agent sent *to its
        sender*: correlation is the pair (in_reply_to, sender), never the id
        alone, so a third party cannot answer someone else's request.
        """
        in_reply_to = envelope.get("in_reply_to")
        if not isinstance(in_reply_to, str):
            return False
        pending = self._pending.get((requester, in_reply_to))
        if pending is None or pending.target != envelope.get("from"):
            return False
        payload = envelope.get("payload")
        status = payload.get("status") if isinstance(payload, Mapping) else None
        if status == "accepted" and envelope.get("error") is None:
            if not pending.accepted:
                pending.accepted = True
                if pending.timer is not None:  # being waited on: the wait restarts, once
                    pending.timer.cancel()
                    pending.timer = self._arm(pending, in_reply_to)
            return True
        if not pending.future.done():
            pending.future.set_result(Reply(envelope, pending.accepted))
        return True

    def mark_queued(self, requester: str, request_id: str, inbox_id: str | None = None, *, acked: bool = False) -> None:
        """The recipient's buffer may hold the request (no responders), or its node
        answered with a queued ack (``acked``): then the wait ends now."""
        pending = self._pending.get((requester, request_id))
        if pending is not None:
            pending.queued = True
            if acked and not pending.future.done():
                pending.future.set_exception(RequestQueued(request_id, inbox_id))

    def mark_unavailable(self, requester: str, request_id: str) -> None:
        """No responders and no buffer: the request cannot be delivered (§6.4)."""
        pending = self._pending.get((requester, request_id))
        if pending is not None:
            pending.unavailable = True
            if not pending.future.done():
                pending.future.set_exception(
                    ProtocolError("AGENT_UNAVAILABLE", "the agent is not connected and has no buffer")
                )

    async def wait(self, requester: str, request_id: str, timeout: float) -> Reply:
        """Wait for the substantive reply; the first accept restarts the wait."""
        pending = self._pending[(requester, request_id)]
        pending.timeout = timeout
        # An accept that arrived before the wait began (local delivery) is the
        # same reset: the wait runs its full length from here.
        pending.timer = self._arm(pending, request_id)
        try:
            return await pending.future
        finally:
            if pending.timer is not None:
                pending.timer.cancel()
                pending.timer = None
            self.close(requester, request_id)

    @staticmethod
    def _arm(pending: _Pending, request_id: str) -> asyncio.TimerHandle:
        def expire() -> None:
            if not pending.future.done():
                pending.future.set_exception(
                    RequestTimeout(
                        request_id,
                        accepted=pending.accepted,
                        possibly_queued=pending.queued or not pending.accepted,
                    )
                )

        return asyncio.get_running_loop().call_later(pending.timeout, expire)


class DeliveryWatch:
    """Delivery-status signals of the requests in flight (§18.7).

    A request is published with a reply subject used only as a delivery-status
    signal: ``{status prefix}.{request id}`` under one wildcard subscription
    the node holds for all requests — no task, future or timer per request
    (each request used to keep a nats-py request alive until its timeout). The
    entry is dropped when the request's wait ends (:meth:`forget`).
    """

    def __init__(self, connection: MeshConnection, pending: PendingRequests) -> None:
        self._connection = connection
        self._pending = pending
        # request id -> (requester, whether the target has a buffer)
        self._waiters: dict[str, tuple[str, bool]] = {}
        self._prefix: str | None = None
        self._lock = asyncio.Lock()

    async def publish(self, requester: str, request_id: str, inbox: str, data: bytes, *, buffered: bool) -> None:
        """Publish a request to ``inbox`` with its delivery-status reply subject."""
        prefix = self._prefix or await self._open()
        self._waiters[request_id] = (requester, buffered)
        await self._connection.publish(inbox, data, reply=f"{prefix}.{request_id}")

    def forget(self, request_id: str) -> None:
        self._waiters.pop(request_id, None)

    async def _open(self) -> str:
        async with self._lock:
            if self._prefix is None:
                prefix = self._connection.new_inbox()
                await self._connection.subscribe(f"{prefix}.*", self._on_status)
                self._prefix = prefix
            return self._prefix

    async def _on_status(self, msg: Msg) -> None:
        """A delivery-status signal: no responders, or a node's queued ack."""
        request_id = msg.subject.rpartition(".")[2]
        waiter = self._waiters.pop(request_id, None)
        if waiter is None:
            return  # the request's wait already ended
        requester, buffered = waiter
        headers = msg.headers
        if headers and headers.get("Status") == "503":  # the server's no-responders signal
            if buffered:
                self._pending.mark_queued(requester, request_id)
            else:
                self._pending.mark_unavailable(requester, request_id)
            return
        try:
            ack = orjson.loads(msg.data)
        except orjson.JSONDecodeError:
            return
        if is_queued_ack(ack):
            inbox_id = ack.get("inbox_id")
            self._pending.mark_queued(requester, request_id, str(inbox_id) if inbox_id is not None else None, acked=True)


class SendPacer:
    """Keeps to each recipient's published ``rate_limits`` (§6.4b), per (requester, target)."""

    #: (requester, target) pairs remembered; the oldest are forgotten past it.
    MAX_PAIRS = 10_000

    def __init__(self, clock: Callable[[], int]) -> None:
        self._clock = clock
        self._sent: dict[tuple[str, str], list[int]] = {}

    async def wait_turn(
        self, requester: str, target: str, manifest: Mapping[str, Any], timeout: float, counters: Counter[str]
    ) -> None:
        """Wait our turn, or refuse locally with RATE_LIMITED when the turn is beyond
        the caller's wait (``counters["throttled"]`` counts the waits)."""
        limits = manifest.get("rate_limits")
        if not isinstance(limits, Mapping) or not limits:
            return
        key = (requester, target)
        history = prune_history(self._sent.get(key, ()), limits, self._clock())
        wait_ms = next_allowed_at(history, limits, self._clock()) - self._clock()
        if wait_ms > timeout * 1000:
            raise ProtocolError(
                "RATE_LIMITED",
                "the recipient's published rate limit allows no request before the wait ends",
                {"limit": "rate_limits"},
                retry_after_ms=wait_ms,
            )
        if wait_ms > 0:
            counters["throttled"] += 1
            await asyncio.sleep(wait_ms / 1000)
        history.append(self._clock())
        self._sent[key] = history
        if len(self._sent) > self.MAX_PAIRS:  # bounded: forget the oldest pairs
            self._sent.pop(next(iter(self._sent)))
