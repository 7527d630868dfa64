"""What a request comes back with, as the plugin author sees it (§6.4, §6.4a, §12).

``await ctx.request(...)`` returns a :class:`Reply` (the substantive answer,
never the accept signal) or raises one of the errors here: the recipient's §12
error (:class:`RemoteError`), no answer within the wait (:class:`RequestTimeout`:
possibly queued, not lost), or held for a person's session (:class:`RequestQueued`).
Defined by the agent API; the node (:mod:`meshnode.node.pending`) produces them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshnode.protocol.errors import ProtocolError

__all__ = ["RemoteError", "Reply", "RequestQueued", "RequestTimeout"]


@dataclass(frozen=True)
class Reply:
    """The substantive answer to a request (never the accept signal).

    When the request became a Task (a non-terminal status with a task id),
    ``task`` is the caller's handle on it: ``await reply.task.result()``,
    ``async for data in reply.task.stream()``, ``await reply.task.cancel(reason)``.
    """

    envelope: Mapping[str, Any]
    accepted: bool  # whether an accept preceded it (a live handler ran)
    #: The caller's handle when the answer opened a Task: a :class:`RequesterTask`
    #: (for an ``a2a:`` target, the bridge's task handle). Any, so that code
    #: reaching into a handle's last update need not narrow it first.
    task: Any = None

    @property
    def status(self) -> str:
        payload = self.envelope.get("payload")
        status = payload.get("status") if isinstance(payload, Mapping) else None
        return str(status) if isinstance(status, str) else "completed"

    @property
    def output(self) -> Any:
        payload = self.envelope.get("payload")
        return payload.get("output") if isinstance(payload, Mapping) else None

    @property
    def task_id(self) -> str | None:
        task_id = self.envelope.get("task_id")
        return task_id if isinstance(task_id, str) else None

    @property
    def error(self) -> Mapping[str, Any] | None:
        error = self.envelope.get("error")
        return error if isinstance(error, Mapping) else None


class RemoteError(ProtocolError):
    """The recipient answered with a §12 error; ``envelope`` is its signed respond."""

    def __init__(self, envelope: Mapping[str, Any]) -> None:
        error = envelope.get("error")
        error = error if isinstance(error, Mapping) else {}
        super().__init__(
            str(error.get("code") or "INTERNAL_ERROR"),
            str(error.get("message") or ""),
            dict(error.get("details") or {}),
            error.get("retry_after_ms") if isinstance(error.get("retry_after_ms"), int) else None,
        )
        self.envelope = envelope


class RequestTimeout(ProtocolError):
    """No substantive answer within the wait. The request may still be queued
    (the recipient's buffer holds it) and its answer may arrive later (§6.4)."""

    def __init__(self, request_id: str, *, accepted: bool, possibly_queued: bool) -> None:
        if accepted:
            message = "accepted, but no answer arrived before the wait ended"
        elif possibly_queued:
            message = "no answer yet; the request may be queued for the recipient"
        else:
            message = "no answer arrived before the wait ended"
        super().__init__("TRANSPORT_TIMEOUT", message, {"request_id": request_id})
        self.request_id = request_id
        self.accepted = accepted
        self.possibly_queued = possibly_queued


class RequestQueued(Exception):
    """The recipient's node holds the request for a person's session (§6.4a queued
    ack): its answer will arrive later at the requester's own inbox."""

    def __init__(self, request_id: str, inbox_id: str | None) -> None:
        super().__init__(f"request {request_id} is queued for a person (inbox {inbox_id})")
        self.request_id = request_id
        self.inbox_id = inbox_id
