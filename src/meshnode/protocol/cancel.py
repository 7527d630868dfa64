"""Cancel and the endings vocabulary (AgentMesh §10.8, §10.8a, §7.3).

A cancel travels twice: a ``task.cancel`` request to the performer's inbox,
and a ``canceled`` respond on the Task's update subject. Both carry a reason
from a closed enum of eight; a ``failed`` update MAY carry the same
vocabulary. This module validates those members at the door (INVALID_ENVELOPE,
before any state is touched), builds the shapes, formats the propagated
cancel for delegates, says from which states a Task can still be canceled,
and computes attribution, which only the platform ever decides.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from .errors import ProtocolError
from .offerings import normalize_request_payload
from .tasks import TERMINAL_STATES, TaskState, check_task_id, parse_state

__all__ = [
    "CANCELABLE_STATES",
    "CANCEL_OFFERING",
    "CANCEL_REASONS",
    "NEED_KINDS",
    "Attribution",
    "CancelReason",
    "CancelRequest",
    "StopFields",
    "attribute",
    "attribute_failed_update",
    "build_cancel_request_payload",
    "build_canceled_update_payload",
    "build_failed_update_payload",
    "check_cancelable",
    "is_cancel_request",
    "is_unmet_need",
    "parse_cancel_input",
    "parse_cancel_request",
    "propagate",
    "propagated_note",
    "stop_fields_of_update",
    "validate_stop_fields",
]

CANCEL_OFFERING = "task.cancel"


class CancelReason(StrEnum):
    """The closed §10.8 enum; the values are the exact wire bytes."""

    USER_REQUESTED = "user_requested"
    SUPERSEDED = "superseded"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    BUDGET_EXHAUSTED = "budget_exhausted"
    UPSTREAM_CANCELLED = "upstream_cancelled"
    POLICY = "policy"
    NEEDS_NOT_FURNISHED = "needs_not_furnished"
    DEPENDENCY_FAILED = "dependency_failed"


CANCEL_REASONS: tuple[str, ...] = tuple(r.value for r in CancelReason)
_REASON_VALUES = frozenset(CANCEL_REASONS)

#: The §8.5.1 need kinds an ``unmet_need`` reference may name.
NEED_KINDS: tuple[str, ...] = ("resource", "file", "credential", "text")

#: States a cancel may still reach (§7.3); every terminal state refuses.
CANCELABLE_STATES: frozenset[TaskState] = frozenset(TaskState) - TERMINAL_STATES

Attribution = Literal["client", "provider"]


def _invalid(message: str, member: str) -> ProtocolError:
    return ProtocolError("INVALID_ENVELOPE", f"invalid cancel (§10.8): {message}", {"member": member})


def is_unmet_need(value: object) -> bool:
    """True for ``"<kind>:<value>"`` with kind one of the four need kinds and a
    non-blank value. The split is at the first colon: a value may hold colons."""
    if not isinstance(value, str):
        return False
    kind, sep, rest = value.partition(":")
    return bool(sep) and kind in NEED_KINDS and rest.strip() != ""


@dataclass(frozen=True, slots=True)
class StopFields:
    """Why work stopped, validated: the reason and the fields that qualify it.

    ``reason`` is None only on a bare failure. ``unmet_need`` is present exactly
    with needs_not_furnished; ``dependency`` at most with dependency_failed.
    """

    reason: CancelReason | None = None
    note: str | None = None
    unmet_need: str | None = None
    dependency: str | None = None

    def members(self) -> dict[str, Any]:
        """The wire members (``reason``, ``note``, ``unmet_need``, ``dependency``);
        unset ones are omitted, never null."""
        out: dict[str, Any] = {}
        if self.reason is not None:
            out["reason"] = self.reason.value
        if self.note is not None:
            out["note"] = self.note
        if self.unmet_need is not None:
            out["unmet_need"] = self.unmet_need
        if self.dependency is not None:
            out["dependency"] = self.dependency
        return out

    def record_fields(self, ending: TaskState | str) -> dict[str, Any]:
        """The task record's members for this ending: the reason is stored as
        ``cancel_reason`` on a canceled Task and ``failure_reason`` on a failed
        one, so a reader never guesses which ending a stored reason belonged to."""
        state = parse_state(ending)
        if state not in (TaskState.CANCELED, TaskState.FAILED):
            raise ValueError(f"{ending!r} is not an ending that carries a reason")
        out = self.members()
        reason = out.pop("reason", None)
        if reason is not None:
            key = "cancel_reason" if state is TaskState.CANCELED else "failure_reason"
            out[key] = reason
        return out


def validate_stop_fields(fields: Mapping[str, Any], *, reason_required: bool) -> StopFields:
    """The shared door for the §10.8 vocabulary wherever it appears.

    ``fields`` holds the raw ``reason``/``note``/``unmet_need``/``dependency`` as
    received (other members are ignored). ``reason_required`` is True on a
    cancel and False on a failed update, where a bare failure is complete.
    Raises INVALID_ENVELOPE naming the member: a missing (when required),
    null or unknown reason (exact bytes, no case folding); a non-string note;
    a needs_not_furnished without a well-formed ``unmet_need``; an
    ``unmet_need`` or ``dependency`` beside any other reason, or beside none.
    """
    note = fields.get("note")
    if "note" in fields and not isinstance(note, str):
        raise _invalid("note, when present, is a string", "note")
    if "reason" not in fields:
        if reason_required:
            raise _invalid("reason is required on every cancel", "reason")
        if "unmet_need" in fields:
            raise _invalid("unmet_need needs the reason needs_not_furnished", "unmet_need")
        if "dependency" in fields:
            raise _invalid("dependency needs the reason dependency_failed", "dependency")
        return StopFields(note=note)
    raw_reason = fields["reason"]
    if not (isinstance(raw_reason, str) and raw_reason in _REASON_VALUES):
        raise _invalid(f"reason must be one of {', '.join(CANCEL_REASONS)}", "reason")
    reason = CancelReason(raw_reason)
    unmet_need: str | None = None
    if reason is CancelReason.NEEDS_NOT_FURNISHED:
        value = fields.get("unmet_need")
        if not is_unmet_need(value):
            raise _invalid(
                'needs_not_furnished requires unmet_need "<kind>:<value>" with kind one of '
                + ", ".join(NEED_KINDS),
                "unmet_need",
            )
        assert isinstance(value, str)
        unmet_need = value
    elif "unmet_need" in fields:
        raise _invalid(f"unmet_need is meaningful only with needs_not_furnished, not {reason}", "unmet_need")
    dependency: str | None = None
    if "dependency" in fields:
        value = fields["dependency"]
        if reason is not CancelReason.DEPENDENCY_FAILED:
            raise _invalid(f"dependency is meaningful only with dependency_failed, not {reason}", "dependency")
        if not (isinstance(value, str) and value.strip()):
            raise _invalid("dependency, when present, names the service", "dependency")
        dependency = value
    return StopFields(reason, note, unmet_need, dependency)


# --- the task.cancel request ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class CancelRequest:
    """A validated ``task.cancel`` input."""

    task_id: str
    stop: StopFields

    @property
    def reason(self) -> CancelReason:
        assert self.stop.reason is not None
        return self.stop.reason


def parse_cancel_input(input_obj: object, envelope_task_id: str | None = None) -> CancelRequest:
    """Validate a ``task.cancel`` request's ``payload.input``
    (``{task_id, reason, note?, unmet_need?, dependency?}``).

    ``envelope_task_id`` is used when the input names no task. Raises
    INVALID_ENVELOPE.
    """
    if not isinstance(input_obj, Mapping):
        raise _invalid("input must be an object", "input")
    task_id = input_obj.get("task_id", envelope_task_id)
    if task_id is None:
        raise _invalid("task_id is required", "task_id")
    check_task_id(task_id, "task_id")
    assert isinstance(task_id, str)
    return CancelRequest(task_id, validate_stop_fields(input_obj, reason_required=True))


def is_cancel_request(payload: object) -> bool:
    """True when a request payload names the ``task.cancel`` offering (legacy
    ``skill`` accepted)."""
    normalized = normalize_request_payload(payload)
    return isinstance(normalized, Mapping) and normalized.get("offering") == CANCEL_OFFERING


def parse_cancel_request(payload: object, envelope_task_id: str | None = None) -> CancelRequest:
    """Validate a whole ``task.cancel`` request payload (``{offering, input}``).

    Raises INVALID_ENVELOPE when it is not a cancel or its input is malformed.
    """
    if not is_cancel_request(payload):
        raise _invalid("the payload does not name the task.cancel offering", "offering")
    normalized = normalize_request_payload(payload)
    return parse_cancel_input(normalized.get("input"), envelope_task_id)


def build_cancel_request_payload(
    task_id: str,
    reason: CancelReason | str,
    *,
    note: str | None = None,
    unmet_need: str | None = None,
    dependency: str | None = None,
) -> dict[str, Any]:
    """``{"offering": "task.cancel", "input": {task_id, reason, ...}}``, validated.

    Unset members are omitted. Raises INVALID_ENVELOPE for a combination a
    receiver would refuse.
    """
    stop = _stop(reason, note, unmet_need, dependency, reason_required=True)
    check_task_id(task_id, "task_id")
    return {"offering": CANCEL_OFFERING, "input": {"task_id": task_id, **stop.members()}}


def _stop(
    reason: CancelReason | str | None,
    note: str | None,
    unmet_need: str | None,
    dependency: str | None,
    *,
    reason_required: bool,
) -> StopFields:
    fields: dict[str, Any] = {}
    for key, value in (("reason", reason), ("note", note), ("unmet_need", unmet_need), ("dependency", dependency)):
        if value is not None:
            fields[key] = str(value)
    return validate_stop_fields(fields, reason_required=reason_required)


def build_canceled_update_payload(
    reason: CancelReason | str,
    *,
    note: str | None = None,
    unmet_need: str | None = None,
    dependency: str | None = None,
) -> dict[str, Any]:
    """The canceled task-update payload ``{"status": "canceled", "reason", ...}``."""
    stop = _stop(reason, note, unmet_need, dependency, reason_required=True)
    return {"status": TaskState.CANCELED.value, **stop.members()}


def build_failed_update_payload(
    reason: CancelReason | str | None = None,
    *,
    note: str | None = None,
    unmet_need: str | None = None,
    dependency: str | None = None,
) -> dict[str, Any]:
    """The failed task-update payload ``{"status": "failed", reason?, ...}``."""
    stop = _stop(reason, note, unmet_need, dependency, reason_required=False)
    return {"status": TaskState.FAILED.value, **stop.members()}


def stop_fields_of_update(payload: object) -> StopFields | None:
    """Validate the endings vocabulary on a task-update payload.

    ``canceled`` requires a reason; ``failed`` takes one optionally, validated
    identically when present. Returns None for any other status (nothing to
    validate). Raises INVALID_ENVELOPE at the door for a malformed ending.
    """
    if not isinstance(payload, Mapping):
        return None
    status = payload.get("status")
    if status == TaskState.CANCELED.value:
        return validate_stop_fields(payload, reason_required=True)
    if status == TaskState.FAILED.value:
        return validate_stop_fields(payload, reason_required=False)
    return None


# --- cancelability --------------------------------------------------------------


def check_cancelable(state: TaskState | str) -> None:
    """Raise TASK_NOT_CANCELABLE when the Task is already terminal (completed,
    failed, canceled, rejected or exhausted): the ending that arrived first stands.
    Raises ValueError for a string that is not a Task state."""
    parsed = parse_state(state)
    if parsed is None:
        raise ValueError(f"{state!r} is not a task state")
    if parsed in TERMINAL_STATES:
        raise ProtocolError(
            "TASK_NOT_CANCELABLE",
            f"the Task is already {parsed.value}",
            {"state": parsed.value},
        )


# --- propagation to delegates ------------------------------------------------------


def propagated_note(reason: CancelReason | str, note: str | None = None) -> str:
    """The note a forwarded cancel carries: the original reason, then ``": "`` and
    the original note when there was one (``"deadline_exceeded: overdue"``)."""
    text = str(reason)
    return text if note is None else f"{text}: {note}"


def propagate(original: StopFields) -> StopFields:
    """The cancel to forward to each still-live delegate: reason
    ``upstream_cancelled``, the original reason (and note) carried in the note.

    The original's ``unmet_need``/``dependency`` do not travel: they qualify
    only their own reasons, and the forwarded reason is neither.
    """
    if original.reason is None:
        raise ValueError("only a cancel with a reason can be propagated")
    return StopFields(
        CancelReason.UPSTREAM_CANCELLED, propagated_note(original.reason, original.note)
    )


# --- attribution (§10.8a) -----------------------------------------------------------


def attribute(
    reason: CancelReason | str | None,
    unmet_need: str | None,
    declared_needs: Collection[str] | None,
) -> Attribution:
    """Whose failure this was, as the platform computes it.

    ``client`` only when the reason is needs_not_furnished AND ``unmet_need``
    names a need the responder actually declared (``declared_needs``, as
    ``"<kind>:<value>"`` references; see
    :func:`meshnode.protocol.offerings.declared_needs`). Everything else is
    ``provider``, including an unreadable declaration (``None``): an unbacked
    or uncheckable claim fails closed.
    """
    if reason != CancelReason.NEEDS_NOT_FURNISHED.value or declared_needs is None:
        return "provider"
    if not is_unmet_need(unmet_need) or unmet_need not in declared_needs:
        return "provider"
    return "client"


def attribute_failed_update(
    payload: object, declared_needs: Collection[str] | None
) -> Attribution:
    """Attribution of a failed (or canceled) ending from its update payload.

    Any ``attribution`` member in the payload is a party's assertion and is
    ignored. A malformed ending is attributed to the provider.
    """
    try:
        stop = stop_fields_of_update(payload)
    except ProtocolError:
        return "provider"
    if stop is None:
        return "provider"
    return attribute(stop.reason, stop.unmet_need, declared_needs)
