"""The accept signal and the queued acknowledgement (AgentMesh §6.4a).

Two delivery signals that certify different things and must never be confused:

* the **accept**: a non-terminal respond, ``payload.status = "accepted"``,
  ``in_reply_to`` the request id and **no** ``task_id`` member, emitted by a
  live handler's SDK the moment the request is admitted (the §22 checks and
  §7.7 budget admission have passed) and before the handler runs. It asserts
  admission and a handler about to run; it chooses no response mode and moves
  no budget.
* the **queued ack**: the node-level ``{queued: true, inbox_id, text?}`` reply
  on the transport reply channel, for a request held in a node inbox for an
  attended session. It asserts only that a mailbox holds the message.

Ordering: a refusal of *admission* happens instead of an accept, never after
one; a failure of the *work* may follow an accept. :func:`plan_first_reply`
and :func:`may_follow_accept` encode that for the runtime.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .envelope import IdGenerator, build_envelope, child_trace
from .errors import ProtocolError, normalize_code

__all__ = [
    "ACCEPTED",
    "ADMISSION_ONLY_CODES",
    "CallerAction",
    "DeliveryPath",
    "FirstReply",
    "InboundOutcome",
    "ReplyPlan",
    "Stage",
    "build_accept",
    "build_queued_ack",
    "caller_action",
    "check_accept_shape",
    "check_reply_order",
    "is_accept",
    "is_queued_ack",
    "is_substantive_reply",
    "may_follow_accept",
    "plan_first_reply",
]

#: The accept's ``payload.status``. Not a Task state (§7.2).
ACCEPTED = "accepted"


def build_accept(
    request: Mapping[str, Any],
    responder: str,
    *,
    now_ms: int,
    ids: IdGenerator | None = None,
) -> dict[str, Any]:
    """The unsigned accept for an admitted ``request`` (sign it with the responder's key).

    ``to`` is the requester, ``in_reply_to`` the request's id, the trace
    continues the request's, and ``task_id`` is absent: no Task exists yet and
    the accept never creates one.
    """
    request_id = request.get("id")
    requester = request.get("from")
    if not isinstance(request_id, str) or not request_id:
        raise ValueError("the request has no id to reply to")
    if not isinstance(requester, str) or not requester:
        raise ValueError("the request has no from to address the accept to")
    trace = request.get("trace")
    return build_envelope(
        "respond",
        responder,
        now_ms=now_ms,
        to=requester,
        in_reply_to=request_id,
        payload={"status": ACCEPTED},
        trace=child_trace(trace if isinstance(trace, Mapping) else None),
        ids=ids,
    )


def _status(env: Mapping[str, Any]) -> object:
    payload = env.get("payload")
    return payload.get("status") if isinstance(payload, Mapping) else None


def is_accept(env: Mapping[str, Any]) -> bool:
    """True for a respond whose ``payload.status`` is ``"accepted"``.

    Recognition is by status alone, because the caller rule is keyed on it: a
    request stays outstanding until the first respond whose status is not
    ``accepted``. :func:`check_accept_shape` judges the full wire shape.
    """
    return env.get("type") == "respond" and _status(env) == ACCEPTED


def check_accept_shape(env: Mapping[str, Any]) -> None:
    """Check an accept's wire shape (accept-signal.json ``accept.required``).

    Raises INVALID_ENVELOPE (naming the member) unless: type ``respond``;
    ``payload.status`` ``"accepted"``; ``in_reply_to`` a non-empty string;
    ``task_id`` absent (not even null: §5.3's absent-members rule); no ``error``.
    """

    def bad(message: str, member: str) -> ProtocolError:
        return ProtocolError("INVALID_ENVELOPE", f"not an accept: {message}", {"member": member})

    if env.get("type") != "respond":
        raise bad("type must be respond", "type")
    if _status(env) != ACCEPTED:
        raise bad('payload.status must be "accepted"', "payload.status")
    in_reply_to = env.get("in_reply_to")
    if not isinstance(in_reply_to, str) or not in_reply_to:
        raise bad("in_reply_to must name the admitted request", "in_reply_to")
    if "task_id" in env:
        raise bad("task_id must be absent: the accept creates no Task", "task_id")
    if "error" in env:
        raise bad("an accept carries no error", "error")


def is_substantive_reply(env: Mapping[str, Any]) -> bool:
    """True for a respond that answers the request (any status but ``accepted``).

    The first such respond tells the requester the mode (§7.0): a terminal
    status without a task_id is a bare answer; a task_id with a non-terminal
    status is a Task.
    """
    return env.get("type") == "respond" and _status(env) != ACCEPTED


class CallerAction(StrEnum):
    """What a requester does with a respond correlated to an outstanding request."""

    #: An accept: keep waiting, reset the local response timeout; the §7.7
    #: deadline is absolute and does not move.
    RESET_TIMEOUT = "reset_timeout"
    #: The first substantive reply: the request completes with it.
    RESOLVE = "resolve"


def caller_action(env: Mapping[str, Any]) -> CallerAction:
    """The requester rule: an accept is never the substantive reply (§6.4a).

    Responds deduplicate on (from, id) like any envelope before reaching here.
    Raises ValueError for a non-respond.
    """
    if env.get("type") != "respond":
        raise ValueError("only a respond answers a request")
    return CallerAction.RESET_TIMEOUT if is_accept(env) else CallerAction.RESOLVE


# --- the queued acknowledgement ----------------------------------------------------


def build_queued_ack(inbox_id: str, text: str | None = None) -> dict[str, Any]:
    """The node-level queued ack payload ``{queued: true, inbox_id, text?}``.

    It rides the transport reply subject and certifies only that a mailbox
    holds the message, deliberately not admission.
    """
    if not isinstance(inbox_id, str) or not inbox_id:
        raise ValueError("a queued ack needs a non-empty inbox_id")
    ack: dict[str, Any] = {"queued": True, "inbox_id": inbox_id}
    if text is not None:
        ack["text"] = text
    return ack


def is_queued_ack(obj: object) -> bool:
    """True for ``{queued: true, inbox_id: <non-empty string>, text?}``.

    ``queued`` must be the boolean true (not a string). ``text`` is informative
    prose and never part of the contract, so it is not judged. An object that
    also claims ``status: "accepted"`` is neither signal: the two are disjoint.
    """
    if not isinstance(obj, Mapping):
        return False
    if obj.get("queued") is not True:
        return False
    inbox_id = obj.get("inbox_id")
    if not isinstance(inbox_id, str) or not inbox_id:
        return False
    return obj.get("status") != ACCEPTED


# --- ordering ------------------------------------------------------------------------


class Stage(StrEnum):
    """Where in a request's life a refusal or failure arose."""

    #: §22 inbound checks and §7.7 budget admission: before any accept.
    ADMISSION = "admission"
    #: Dispatch and execution, after admission (OFFERING_NOT_FOUND at dispatch,
    #: INPUT_INVALID, a plain failure).
    WORK = "work"


#: Codes that are refusals of admission by definition (§12.2 "Refused at
#: admission"), whatever stage a caller claims for them.
ADMISSION_ONLY_CODES: frozenset[str] = frozenset(
    {"BUDGET_INSUFFICIENT", "DEADLINE_UNMEETABLE", "AGREEMENT_REQUIRED"}
)


def may_follow_accept(stage: Stage, error_code: str | None = None) -> bool:
    """True when a reply of this stage (and code) may be sent after an accept.

    A failure of the work may follow an accept; a refusal of admission may not.
    """
    if error_code is not None and normalize_code(error_code) in ADMISSION_ONLY_CODES:
        return False
    return stage is Stage.WORK


def check_reply_order(accept_sent: bool, stage: Stage, error_code: str | None = None) -> None:
    """Raise RuntimeError when sending this reply now would put an admission
    refusal after an accept: the accept already asserted admission."""
    if accept_sent and not may_follow_accept(stage, error_code):
        raise RuntimeError(
            f"an admission refusal ({error_code or stage.value}) cannot follow an accept (§6.4a)"
        )


class DeliveryPath(StrEnum):
    """How an inbound request reached the node."""

    #: The live inbox subscription (or local delivery) to a live handler.
    LIVE = "live"
    #: The bounded drain of the transport's redelivery buffer (§16.4).
    MAILBOX_DRAIN = "mailbox_drain"
    #: Held in a node inbox for an attended (interactive) session; no handler
    #: runs at delivery time.
    ATTENDED_INBOX = "attended_inbox"


class InboundOutcome(StrEnum):
    """The result of the admission pipeline for one request."""

    ADMITTED = "admitted"
    #: Duplicate, stale or misaddressed (§22.2-22.4): refused in silence.
    SILENT_REFUSAL = "silent_refusal"
    #: Over the §22.5 size cap: CONTEXT_TOO_LARGE answers the sender.
    SIZE_REFUSAL = "size_refusal"
    #: §7.7 admission refused: BUDGET_INSUFFICIENT or DEADLINE_UNMEETABLE.
    BUDGET_REFUSAL = "budget_refusal"


class FirstReply(StrEnum):
    """What the requester receives first."""

    ACCEPT = "accept"
    ADMISSION_REFUSAL = "admission_refusal"
    QUEUED_ACK = "queued_ack"
    SUBSTANTIVE = "substantive"
    NOTHING = "nothing"


@dataclass(frozen=True, slots=True)
class ReplyPlan:
    """Whether an accept is sent, and what the requester sees first."""

    accept: bool
    first_reply: FirstReply


def plan_first_reply(path: DeliveryPath, outcome: InboundOutcome) -> ReplyPlan:
    """The accept-signal ordering rule for one delivery.

    * Silent §22 refusals answer nothing, on every path.
    * A size or budget refusal is itself the first reply; no accept precedes it.
      On an attended inbox the size refusal still answers (§22.7 MUST), while
      budget admission is not run at delivery time.
    * An attended inbox answers the queued ack, never ``accepted``.
    * Only a live delivery that was admitted sends an accept; a mailbox drain
      runs the handler but sends none (its first reply is the substantive one).
    """
    if outcome is InboundOutcome.SILENT_REFUSAL:
        return _NOTHING
    if outcome is InboundOutcome.SIZE_REFUSAL:
        return _REFUSAL
    if path is DeliveryPath.ATTENDED_INBOX:
        return _QUEUED
    if outcome is InboundOutcome.BUDGET_REFUSAL:
        return _REFUSAL
    if path is DeliveryPath.LIVE:
        return _ACCEPT
    return _SUBSTANTIVE


# The five plans, built once: the runtime asks for one on every request.
_NOTHING = ReplyPlan(False, FirstReply.NOTHING)
_REFUSAL = ReplyPlan(False, FirstReply.ADMISSION_REFUSAL)
_QUEUED = ReplyPlan(False, FirstReply.QUEUED_ACK)
_ACCEPT = ReplyPlan(True, FirstReply.ACCEPT)
_SUBSTANTIVE = ReplyPlan(False, FirstReply.SUBSTANTIVE)
