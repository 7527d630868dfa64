"""The budget (AgentMesh §7.7, §19.3): block validation, admission, revisions, pauses.

A budget is the requester's offer: an absolute deadline and (Economics
extension) a cost ceiling in integer micro-units, plus a revision counter.
This module judges blocks and decisions; it holds no clock (``now_ms`` is a
parameter) and no task (callers pass the state they hold).

Refusal shapes are the fixture's (conformance/budget.json ``refusals``):
BUDGET_INSUFFICIENT carries ``details.estimate`` (money), DEADLINE_UNMEETABLE
``details.earliest_completion`` (an RFC 3339 instant), and the BUDGET_EXHAUSTED
pause ``details.spent`` and ``details.estimate_to_finish`` on a non-terminal
``input_required`` respond.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .errors import ProtocolError, error_object, shape_error
from .tasks import TaskState, is_terminal
from .timeutil import format_ts, parse_rfc3339

__all__ = [
    "DEADLINE_GRANULARITY_MS",
    "DEADLINE_SKEW_TOLERANCE_MS",
    "Budget",
    "BudgetInvalid",
    "Money",
    "apply_revision",
    "budget_exhausted_error",
    "budget_exhausted_pause",
    "budget_insufficient",
    "check_admission",
    "check_revision",
    "deadline_passed",
    "deadline_unmeetable",
    "is_late",
    "parse_budget",
    "parse_money",
]

#: §22.3's max_clock_skew_ahead, the tolerance deadlines are compared under.
DEADLINE_SKEW_TOLERANCE_MS = 300_000
#: §7.7: deadlines SHOULD NOT be finer than one second; comparisons are too.
DEADLINE_GRANULARITY_MS = 1_000

_CURRENCY = re.compile(r"[A-Z]{3}")


class BudgetInvalid(StrEnum):
    """Why a budget block is malformed; the value is ``details.reason`` of the
    INVALID_ENVELOPE refusal (names follow conformance/budget.json)."""

    NOT_AN_OBJECT = "not_an_object"
    MISSING_REVISION = "missing_revision"
    BAD_REVISION = "bad_revision"
    FLOAT_REVISION = "float_revision"
    NEGATIVE_REVISION = "negative_revision"
    NO_AXES = "no_axes"
    NULL_AXIS = "null_axis"
    DATE_ONLY_DEADLINE = "date_only_deadline"
    BAD_DEADLINE = "bad_deadline"
    BAD_COST_CEILING = "bad_cost_ceiling"
    FLOAT_MONEY = "float_money"
    NEGATIVE_MONEY = "negative_money"
    MISSING_CURRENCY = "missing_currency"
    BAD_CURRENCY = "bad_currency"


def _invalid(reason: BudgetInvalid, member: str, message: str) -> ProtocolError:
    return shape_error("INVALID_ENVELOPE", f"invalid budget: {message}", reason, member)


@dataclass(frozen=True, slots=True)
class Money:
    """An amount in integer micro-units of an ISO 4217 currency (§19.3)."""

    amount_micro: int
    currency: str

    def to_object(self) -> dict[str, Any]:
        return {"amount_micro": self.amount_micro, "currency": self.currency}


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_money(obj: object, member: str = "cost_ceiling") -> Money:
    """Validate a ``{amount_micro, currency}`` object: a non-negative integer
    (never a float, however integral) and a three-letter ISO 4217 code.

    Raises INVALID_ENVELOPE whose ``details.reason`` is a :class:`BudgetInvalid`.
    """
    if not isinstance(obj, Mapping):
        raise _invalid(BudgetInvalid.BAD_COST_CEILING, member, f"{member} must be an object")
    amount = obj.get("amount_micro")
    if type(amount) is not int:
        if _is_number(amount):
            raise _invalid(BudgetInvalid.FLOAT_MONEY, f"{member}.amount_micro", "amount_micro must be an integer")
        raise _invalid(BudgetInvalid.BAD_COST_CEILING, f"{member}.amount_micro", "amount_micro is required")
    if amount < 0:
        raise _invalid(BudgetInvalid.NEGATIVE_MONEY, f"{member}.amount_micro", "amount_micro must be non-negative")
    currency = obj.get("currency")
    if currency is None:
        raise _invalid(BudgetInvalid.MISSING_CURRENCY, f"{member}.currency", "currency is required")
    if not (isinstance(currency, str) and _CURRENCY.fullmatch(currency)):
        raise _invalid(BudgetInvalid.BAD_CURRENCY, f"{member}.currency", "currency must be an ISO 4217 code")
    return Money(amount, currency)


@dataclass(frozen=True, slots=True)
class Budget:
    """A validated budget block. ``deadline`` keeps the sender's exact string
    (offset forms included); ``deadline_ms`` is the same instant in epoch ms."""

    revision: int
    deadline: str | None = None
    deadline_ms: int | None = None
    cost_ceiling: Money | None = None

    def to_object(self) -> dict[str, Any]:
        """The block as it goes on the wire: unset axes are omitted, never null."""
        obj: dict[str, Any] = {"revision": self.revision}
        if self.deadline is not None:
            obj["deadline"] = self.deadline
        if self.cost_ceiling is not None:
            obj["cost_ceiling"] = self.cost_ceiling.to_object()
        return obj


_DATE_ONLY = re.compile(r"\d{4}-\d{2}-\d{2}")


def parse_budget(block: object) -> Budget:
    """Validate a budget block (§7.7, §19.3) and return it as a :class:`Budget`.

    Rules: ``revision`` required, a non-negative integer; at least one of
    ``deadline`` / ``cost_ceiling``; an axis present as explicit null is
    malformed (absent is omitted, never null); ``deadline`` a full RFC 3339
    date-time (any offset; a date alone is refused); ``cost_ceiling`` per
    :func:`parse_money`. Unknown members are ignored.

    Raises ProtocolError INVALID_ENVELOPE with ``details.reason`` (a
    :class:`BudgetInvalid` value) and ``details.member``.
    """
    if not isinstance(block, Mapping):
        raise _invalid(BudgetInvalid.NOT_AN_OBJECT, "budget", "the budget must be an object")
    for axis in ("deadline", "cost_ceiling"):
        if axis in block and block[axis] is None:
            raise _invalid(BudgetInvalid.NULL_AXIS, axis, f"{axis} is null; an unset axis is omitted")
    if "revision" not in block:
        raise _invalid(BudgetInvalid.MISSING_REVISION, "revision", "revision is required")
    revision = block["revision"]
    if type(revision) is not int:
        reason = BudgetInvalid.FLOAT_REVISION if _is_number(revision) else BudgetInvalid.BAD_REVISION
        raise _invalid(reason, "revision", "revision must be an integer")
    if revision < 0:
        raise _invalid(BudgetInvalid.NEGATIVE_REVISION, "revision", "revision must be >= 0")
    if "deadline" not in block and "cost_ceiling" not in block:
        raise _invalid(BudgetInvalid.NO_AXES, "budget", "at least one of deadline / cost_ceiling is required")
    deadline: str | None = None
    deadline_ms: int | None = None
    if "deadline" in block:
        raw = block["deadline"]
        if isinstance(raw, str) and _DATE_ONLY.fullmatch(raw):
            raise _invalid(BudgetInvalid.DATE_ONLY_DEADLINE, "deadline", "deadline must be a full RFC 3339 date-time")
        try:
            deadline_ms = parse_rfc3339(raw) // 1000
        except ValueError:
            raise _invalid(BudgetInvalid.BAD_DEADLINE, "deadline", "deadline is not an RFC 3339 date-time") from None
        deadline = raw
    ceiling = parse_money(block["cost_ceiling"]) if "cost_ceiling" in block else None
    return Budget(revision, deadline, deadline_ms, ceiling)


# --- deadlines -----------------------------------------------------------------


def deadline_passed(
    deadline_ms: int,
    now_ms: int,
    *,
    tolerance_ms: int = DEADLINE_SKEW_TOLERANCE_MS,
    granularity_ms: int = DEADLINE_GRANULARITY_MS,
) -> bool:
    """True once ``now`` exceeds deadline + tolerance by a full granule (§7.7).

    Bounds are inclusive: exactly at deadline + tolerance is not past, and
    neither is anything less than one second beyond it.
    """
    return now_ms - deadline_ms - tolerance_ms >= granularity_ms


def is_late(budget: Budget | None, completed_ms: int) -> bool:
    """True when a completion at ``completed_ms`` arrived after the deadline, and
    so is recorded as completed late with DEADLINE_EXCEEDED (a marker, not a failure)."""
    return (
        budget is not None
        and budget.deadline_ms is not None
        and deadline_passed(budget.deadline_ms, completed_ms)
    )


# --- admission -------------------------------------------------------------------


def budget_insufficient(estimate: Money, message: str = "") -> ProtocolError:
    """BUDGET_INSUFFICIENT carrying the responder's price as ``details.estimate``."""
    return ProtocolError(
        "BUDGET_INSUFFICIENT",
        message or "the work cannot be done within the offered cost ceiling",
        {"estimate": estimate.to_object()},
    )


def deadline_unmeetable(earliest_completion_ms: int, message: str = "") -> ProtocolError:
    """DEADLINE_UNMEETABLE carrying ``details.earliest_completion`` (RFC 3339)."""
    return ProtocolError(
        "DEADLINE_UNMEETABLE",
        message or "the work cannot be completed by the offered deadline",
        {"earliest_completion": format_ts(earliest_completion_ms)},
    )


def check_admission(
    budget: Budget | None,
    now_ms: int,
    *,
    price: Money | None = None,
    earliest_completion_ms: int | None = None,
) -> None:
    """Admit or refuse a request's budget before any work (§7.7).

    * A deadline already past (under the skew tolerance) is refused with
      DEADLINE_UNMEETABLE without asking the responder; the estimate is its
      ``earliest_completion_ms`` when given, else ``now_ms``.
    * A ``price`` above the ceiling, or in another currency (no rate is held,
      so the two are not compared; §21), is refused with BUDGET_INSUFFICIENT
      carrying the price. Equality admits. No ceiling admits any price.
    * An ``earliest_completion_ms`` that would land past the deadline is
      refused with DEADLINE_UNMEETABLE carrying it.

    A refusal happens instead of an accept, never after one (§6.4a).
    """
    if budget is None:
        return
    estimate_ms = max(now_ms, earliest_completion_ms if earliest_completion_ms is not None else now_ms)
    if budget.deadline_ms is not None and deadline_passed(budget.deadline_ms, now_ms):
        raise deadline_unmeetable(estimate_ms, "the offered deadline has already passed")
    ceiling = budget.cost_ceiling
    if (
        price is not None
        and ceiling is not None
        and (price.currency != ceiling.currency or price.amount_micro > ceiling.amount_micro)
    ):
        raise budget_insufficient(price)
    if (
        earliest_completion_ms is not None
        and budget.deadline_ms is not None
        and deadline_passed(budget.deadline_ms, earliest_completion_ms)
    ):
        raise deadline_unmeetable(estimate_ms)


# --- revisions -------------------------------------------------------------------


def apply_revision(current: Budget | None, revision: Budget) -> Budget:
    """The receiver-side fold: the strictly greater revision wins and replaces the
    whole budget (absolute, never a delta); an equal or lower one is ignored."""
    if current is None or revision.revision > current.revision:
        return revision
    return current


def _refuse_revision(message: str, **details: Any) -> ProtocolError:
    return ProtocolError("TASK_INVALID_TRANSITION", f"budget revision refused: {message}", details)


def check_revision(
    *,
    sender: str,
    requester: str,
    responder: str,
    task_state: TaskState | str,
    current: Budget | None,
    block: object,
    now_ms: int,
    spent: Money | None = None,
) -> Budget:
    """The task manager's judgement of a budget revision (§7.7). Returns the new budget.

    In order: the block must be valid (INVALID_ENVELOPE); only the Task's
    requester or responder may revise (UNAUTHORIZED); a terminal Task cannot
    be revised; the revision number must be strictly greater than the current
    one; a deadline already past, or a ceiling already below reported
    ``spent`` (or in another currency, so not comparable) cannot be made
    retroactive. The last three raise TASK_INVALID_TRANSITION.
    """
    revision = parse_budget(block)
    if sender not in (requester, responder):
        raise ProtocolError(
            "UNAUTHORIZED", "only the Task's requester or responder may revise its budget"
        )
    if is_terminal(task_state):
        raise _refuse_revision("the Task is in a terminal state", state=str(task_state))
    if current is not None and revision.revision <= current.revision:
        raise _refuse_revision(
            "the revision number must increase",
            revision=revision.revision,
            current_revision=current.revision,
        )
    if revision.deadline_ms is not None and deadline_passed(revision.deadline_ms, now_ms):
        raise _refuse_revision("the revised deadline has already passed", deadline=revision.deadline)
    ceiling = revision.cost_ceiling
    if (
        ceiling is not None
        and spent is not None
        and (ceiling.currency != spent.currency or ceiling.amount_micro < spent.amount_micro)
    ):
        raise _refuse_revision(
            "the revised ceiling is already exceeded by reported spend",
            cost_ceiling=ceiling.to_object(),
            spent=spent.to_object(),
        )
    return revision


# --- the BUDGET_EXHAUSTED pause -------------------------------------------------------


def budget_exhausted_error(spent: Money, estimate_to_finish: Money) -> dict[str, Any]:
    """The §12.1 error object of the pause: BUDGET_EXHAUSTED with
    ``details.spent`` and ``details.estimate_to_finish``."""
    return error_object(
        "BUDGET_EXHAUSTED",
        "the cost ceiling was reached; raise the budget by revision or cancel",
        {"spent": spent.to_object(), "estimate_to_finish": estimate_to_finish.to_object()},
    )


def budget_exhausted_pause(spent: Money, estimate_to_finish: Money) -> dict[str, Any]:
    """The envelope members of the pause respond: a NON-terminal
    ``payload.status = "input_required"`` plus the BUDGET_EXHAUSTED error.

    Merge into a respond on the Task (on a bare request, the respond that
    carries the promoting task_id, §7.0).
    """
    return {
        "payload": {"status": TaskState.INPUT_REQUIRED.value},
        "error": budget_exhausted_error(spent, estimate_to_finish),
    }
