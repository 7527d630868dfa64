"""The pending-request table: the caller's side of a request (§6.4, §6.4a, §6.5, D.2).

A request's answers arrive where every answer arrives: at the requester's own
inbox, through the same inbound pipeline as everything else, correlated by
``(in_reply_to, sender)``. This module keeps the table of requests in flight
and the rules for waiting on them: an accept resets the wait but is not the
answer; the first respond whose status is not ``accepted`` is; silence past
the wait means *possibly queued*, not lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshnode.agent import Reply, RequestQueued, RequestTimeout
from meshnode.protocol.errors import ProtocolError

__all__ = ["PendingRequests"]


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
