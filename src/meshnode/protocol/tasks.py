"""The Task model's pure rules (AgentMesh §7.2, §7.3, §6.5).

The nine states, which of them are terminal, the closed transition table, the
task_id token rule, and the shape of an ``input_required`` problem report.
Nothing here holds a Task: the task manager and the agent runtime keep the
records and ask these functions whether a move is legal.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .errors import ProtocolError

__all__ = [
    "PAUSED_STATES",
    "PROBLEM_CODES",
    "TASK_ID_PATTERN",
    "TERMINAL_STATES",
    "TRANSITIONS",
    "TaskState",
    "check_state_update",
    "check_task_id",
    "PausedTask",
    "check_follow_up",
    "check_transition",
    "is_terminal",
    "is_valid_problem",
    "is_valid_task_id",
    "legal_targets",
    "parse_state",
    "problem_complaints",
    "validate_problems",
]


class TaskState(StrEnum):
    """A Task's state (§7.2). ``accepted`` is deliberately not one (§6.4a)."""

    SUBMITTED = "submitted"
    WORKING = "working"
    INPUT_REQUIRED = "input_required"
    AUTH_REQUIRED = "auth_required"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELED = "canceled"
    REJECTED = "rejected"
    EXHAUSTED = "exhausted"


TERMINAL_STATES: frozenset[TaskState] = frozenset(
    {
        TaskState.COMPLETED,
        TaskState.FAILED,
        TaskState.CANCELED,
        TaskState.REJECTED,
        TaskState.EXHAUSTED,
    }
)

_S = TaskState

#: Every legal (from, to) pair of the §7.3 table. ``None`` as ``from`` is the
#: creation row "(none) → submitted". Anything absent from this set is invalid.
TRANSITIONS: frozenset[tuple[TaskState | None, TaskState]] = frozenset(
    {
        (None, _S.SUBMITTED),
        (_S.SUBMITTED, _S.WORKING),
        (_S.SUBMITTED, _S.CANCELED),
        (_S.SUBMITTED, _S.EXHAUSTED),
        (_S.SUBMITTED, _S.REJECTED),
        (_S.WORKING, _S.COMPLETED),
        (_S.WORKING, _S.FAILED),
        (_S.WORKING, _S.INPUT_REQUIRED),
        (_S.WORKING, _S.AUTH_REQUIRED),
        (_S.WORKING, _S.CANCELED),
        (_S.WORKING, _S.EXHAUSTED),
        (_S.INPUT_REQUIRED, _S.WORKING),
        (_S.INPUT_REQUIRED, _S.CANCELED),
        (_S.INPUT_REQUIRED, _S.EXHAUSTED),
        (_S.AUTH_REQUIRED, _S.WORKING),
        (_S.AUTH_REQUIRED, _S.CANCELED),
        (_S.AUTH_REQUIRED, _S.EXHAUSTED),
    }
)

_STATE_VALUES = frozenset(s.value for s in TaskState)


def parse_state(value: object) -> TaskState | None:
    """The TaskState named by ``value``, or None when it names none (exact bytes)."""
    if isinstance(value, str) and value in _STATE_VALUES:
        return TaskState(value)
    return None


def is_terminal(state: TaskState | str) -> bool:
    """True for completed, failed, canceled, rejected and exhausted.

    Raises ValueError for a string that is not a Task state.
    """
    parsed = parse_state(state)
    if parsed is None:
        raise ValueError(f"{state!r} is not a task state")
    return parsed in TERMINAL_STATES


def legal_targets(state: TaskState | str | None) -> frozenset[TaskState]:
    """Every state the table allows a Task in ``state`` to move to (None = creation)."""
    source = None if state is None else parse_state(state)
    if state is not None and source is None:
        return frozenset()
    return frozenset(to for frm, to in TRANSITIONS if frm == source)


def _invalid_transition(from_state: object, to_state: object, why: str) -> ProtocolError:
    return ProtocolError(
        "TASK_INVALID_TRANSITION",
        f"{why}: {from_state!s} -> {to_state!s}",
        {"from": from_state if from_state is None else str(from_state), "to": str(to_state)},
    )


def check_transition(from_state: TaskState | str | None, to_state: TaskState | str) -> TaskState:
    """Check one move of the §7.3 table and return the target state.

    ``from_state=None`` is Task creation. Raises ProtocolError
    TASK_INVALID_TRANSITION for any pair the table does not list, including an
    unknown state on either side and a repeat of the current state.
    """
    source = None if from_state is None else parse_state(from_state)
    target = parse_state(to_state)
    if (from_state is not None and source is None) or target is None:
        raise _invalid_transition(from_state, to_state, "not a task state")
    if (source, target) not in TRANSITIONS:
        raise _invalid_transition(from_state, to_state, "transition not in the §7.3 table")
    return target


def check_state_update(from_state: TaskState | str, to_state: TaskState | str) -> bool:
    """Judge a task update's status against the stored state.

    Returns True when the update moves the Task (a legal transition) and False
    when it restates the current non-terminal state (a progress update, such as
    a ``working`` stream chunk while working, which moves nothing). Raises
    TASK_INVALID_TRANSITION otherwise; a terminal state cannot be restated.
    """
    source, target = parse_state(from_state), parse_state(to_state)
    if source is not None and source == target and source not in TERMINAL_STATES:
        return False
    check_transition(from_state, to_state)
    return True


# --- task_id -----------------------------------------------------------------

#: A task_id is interpolated into mesh.task.{task_id}.update, so it must be one
#: subject token (WIRE-NOTES "Agent traffic").
TASK_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,128}")


def is_valid_task_id(value: object) -> bool:
    """True when ``value`` matches ``^[A-Za-z0-9_-]{1,128}$``."""
    return isinstance(value, str) and TASK_ID_PATTERN.fullmatch(value) is not None


def check_task_id(value: object, member: str = "task_id") -> str:
    """Return ``value`` when it is a valid task_id; else INVALID_ENVELOPE naming ``member``."""
    if not is_valid_task_id(value):
        raise ProtocolError(
            "INVALID_ENVELOPE",
            f"{member} must match ^[A-Za-z0-9_-]{{1,128}}$",
            {"member": member},
        )
    assert isinstance(value, str)
    return value


# --- §6.5 problem reports ----------------------------------------------------

#: The closed set of ``problem`` codes (§6.5). ``other`` is first-class.
PROBLEM_CODES: frozenset[str] = frozenset(
    {"missing", "unreadable", "wrong_format", "no_permission", "other"}
)


def _nonblank(value: object) -> bool:
    return isinstance(value, str) and value.strip() != ""


def problem_complaints(report: object) -> list[str]:
    """Everything wrong with one ``{input, problem, description, expected?}`` report.

    An empty list means the report is well-formed.
    """
    if not isinstance(report, Mapping):
        return ["a problem report must be an object"]
    complaints: list[str] = []
    if not _nonblank(report.get("input")):
        complaints.append("input must be a non-empty string naming the input")
    if report.get("problem") not in PROBLEM_CODES:
        complaints.append(f"problem must be one of {', '.join(sorted(PROBLEM_CODES))}")
    if not _nonblank(report.get("description")):
        complaints.append("description is required on every problem code")
    if "expected" in report and not isinstance(report["expected"], str):
        complaints.append("expected, when present, must be a string")
    return complaints


def is_valid_problem(report: object) -> bool:
    """True when ``report`` is a well-formed §6.5 problem report."""
    return not problem_complaints(report)


def validate_problems(reports: object) -> list[dict[str, Any]]:
    """Check a ``payload.problems`` list before it is sent.

    Returns the reports unchanged (as plain dicts). Raises ValueError naming
    every complaint: a malformed report sent to a counterparty is worse than a
    loud local error, because acting on it is its whole purpose.
    """
    if not isinstance(reports, Sequence) or isinstance(reports, (str, bytes)) or not reports:
        raise ValueError("problems must be a non-empty array of problem reports")
    complaints = [
        f"problems[{i}]: {c}" for i, report in enumerate(reports) for c in problem_complaints(report)
    ]
    if complaints:
        raise ValueError("; ".join(complaints))
    return [dict(report) for report in reports]


# --- follow-ups: answering input_required / auth_required (§6.5, §7.3) --------

#: The states a requester's follow-up request moves back to ``working``.
PAUSED_STATES: frozenset[TaskState] = frozenset({TaskState.INPUT_REQUIRED, TaskState.AUTH_REQUIRED})


@dataclass(frozen=True)
class PausedTask:
    """What the follow-up rule needs to know of a Task the responder holds."""

    task_id: str
    requester: str
    state: str
    context_id: str | None = None
    offering: str | None = None


def check_follow_up(
    task: PausedTask | None,
    *,
    task_id: str,
    sender: str,
    context_id: object = None,
    offering: object = None,
) -> None:
    """Judge a request carrying ``task_id``: the requester answering a paused Task.

    §6.5: "the requester SHOULD send a new request with the same task_id and
    context_id"; §7.3: that follow-up is the one trigger of
    ``input_required``/``auth_required`` → ``working``. The rules, in order:

    * unknown task (never here, ended, or lost when the node restarted) →
      TASK_NOT_FOUND;
    * a sender other than the Task's requester → the very same TASK_NOT_FOUND,
      so a stranger learns nothing about which task ids exist (the A2A
      bridge's ownership rule, on the mesh);
    * a ``context_id`` other than the Task's → TASK_NOT_FOUND (the named task
      is not in the named context, CAS §5.6); an absent one is accepted (SHOULD);
    * an ``offering`` other than the Task's → INVALID_ENVELOPE naming
      ``payload.offering`` (absent is accepted);
    * a Task not paused (submitted, working, or terminal) →
      TASK_INVALID_TRANSITION ``{from: <state>, to: working}``.

    Returns None when the follow-up may resume the Task.
    """
    if task is None or sender != task.requester:
        raise ProtocolError(
            "TASK_NOT_FOUND",
            f"no task {task_id} waits here for this sender "
            "(it never existed, has ended, or was lost when the responder's node restarted)",
            {"task_id": task_id},
        )
    if context_id is not None and context_id != task.context_id:
        raise ProtocolError(
            "TASK_NOT_FOUND",
            f"task {task_id} is not in context {context_id!s}",
            {"task_id": task_id, "context_id": context_id if isinstance(context_id, str) else None},
        )
    if offering is not None and offering != task.offering:
        raise ProtocolError(
            "INVALID_ENVELOPE",
            f"a follow-up to task {task_id} names offering {offering!s}, the task's is {task.offering!s}",
            {"member": "payload.offering", "task_id": task_id},
        )
    if parse_state(task.state) not in PAUSED_STATES:
        raise ProtocolError(
            "TASK_INVALID_TRANSITION",
            f"task {task_id} is {task.state}, not waiting for input: {task.state} -> working",
            {"task_id": task_id, "from": task.state, "to": "working"},
        )
