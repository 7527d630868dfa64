"""Metering (AgentMesh §13.5, §19.2): meters, meter events, usage receipts, task receipts.

A meter event is the atom of usage: who consumed how much of one meter from
whom, derived from one envelope. ``(meter, envelope_id)`` is its idempotency
key. A usage receipt is ``payload.usage`` on a respond, an array of
``{meter, quantity}`` entries the envelope signature already covers; a later
report supersedes an earlier one (cumulative, never additive). A task receipt
(§19.2) is the one-message summary of an ended Task.

Everything here is pure: shapes are built and judged, nothing is published.
Problem codes returned by :func:`meter_event_problems` are the case names of
``conformance/metering.json`` where the fixture has one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from .nkeys import is_valid_public
from .timeutil import format_ts, try_parse_rfc3339

__all__ = [
    "METER_NAME_PATTERN",
    "OBSERVED_METERS",
    "MeterClass",
    "UsageEntry",
    "fold_meter_events",
    "is_meter_name",
    "is_valid_meter_event",
    "meter_event",
    "meter_event_problems",
    "parse_usage_report",
    "task_receipt",
]

#: §13.5: meter names are ``[a-z0-9_]{1,64}``.
METER_NAME_PATTERN = re.compile(r"[a-z0-9_]{1,64}")

#: The closed set of observed meters a metering deployment must produce (§13.5).
OBSERVED_METERS: frozenset[str] = frozenset(
    {"requests", "responses", "events", "bytes_in", "bytes_out", "tasks_completed", "task_ms"}
)


class MeterClass(StrEnum):
    """Whose word a meter event is: the platform's (observed) or the responder's (declared)."""

    OBSERVED = "observed"
    DECLARED = "declared"


def is_meter_name(value: object) -> bool:
    """True for a string matching ``^[a-z0-9_]{1,64}$``."""
    return isinstance(value, str) and METER_NAME_PATTERN.fullmatch(value) is not None


def _is_quantity(value: object) -> bool:
    return type(value) is int and value >= 0


def meter_event_problems(event: object) -> list[str]:
    """Everything wrong with one meter event, as short codes; empty when valid.

    Codes: ``not_an_object``, ``bad_meter``, ``unknown_class``,
    ``declared_using_observed_name``, ``undeclared_observed_meter`` (an
    observed event naming a meter outside the observed set),
    ``missing_quantity``, ``float_quantity``, ``negative_quantity``,
    ``missing_provider``, ``missing_consumer``, ``missing_envelope_id``,
    ``bad_ts``, ``bad_task_id``, ``bad_offering``, ``refusal_with_quantity``,
    ``refusal_without_code``, ``refusal_code_without_refused``.
    """
    if not isinstance(event, Mapping):
        return ["not_an_object"]
    problems: list[str] = []
    meter = event.get("meter")
    if not is_meter_name(meter):
        problems.append("bad_meter")
    cls = event.get("class")
    if cls not in (MeterClass.OBSERVED.value, MeterClass.DECLARED.value):
        problems.append("unknown_class")
    elif cls == MeterClass.DECLARED.value and meter in OBSERVED_METERS:
        problems.append("declared_using_observed_name")
    elif cls == MeterClass.OBSERVED.value and is_meter_name(meter) and meter not in OBSERVED_METERS:
        problems.append("undeclared_observed_meter")
    quantity = event.get("quantity")
    if "quantity" not in event:
        problems.append("missing_quantity")
    elif type(quantity) is not int:
        is_number = isinstance(quantity, float) and not isinstance(quantity, bool)
        problems.append("float_quantity" if is_number else "missing_quantity")
    elif quantity < 0:
        problems.append("negative_quantity")
    for side in ("provider", "consumer"):
        if not is_valid_public(event.get(side)):
            problems.append(f"missing_{side}")
    envelope_id = event.get("envelope_id")
    if not (isinstance(envelope_id, str) and envelope_id):
        problems.append("missing_envelope_id")
    if try_parse_rfc3339(event.get("ts")) is None:
        problems.append("bad_ts")
    if "task_id" in event and not (isinstance(event["task_id"], str) and event["task_id"]):
        problems.append("bad_task_id")
    if "offering" in event and not (isinstance(event["offering"], str) and event["offering"]):
        problems.append("bad_offering")
    refused = event.get("refused")
    if "refused" in event:
        if refused is not True:
            problems.append("refusal_code_without_refused")
        else:
            if quantity != 0:
                problems.append("refusal_with_quantity")
            if not (isinstance(event.get("refusal_code"), str) and event["refusal_code"]):
                problems.append("refusal_without_code")
    elif "refusal_code" in event:
        problems.append("refusal_code_without_refused")
    return problems


def is_valid_meter_event(event: object) -> bool:
    """True when ``event`` is a well-formed §13.5 meter event."""
    return not meter_event_problems(event)


def meter_event(
    meter: str,
    meter_class: MeterClass | str,
    quantity: int,
    *,
    provider: str,
    consumer: str,
    envelope_id: str,
    ts_ms: int,
    offering: str | None = None,
    task_id: str | None = None,
    refusal_code: str | None = None,
) -> dict[str, Any]:
    """Build one meter event; unset optional members are omitted, never null.

    ``refusal_code`` makes it a refusal event (``refused: true``; its quantity
    must be 0). Raises ValueError naming every problem of the result.
    """
    event: dict[str, Any] = {
        "meter": meter,
        "class": str(meter_class),
        "quantity": quantity,
        "provider": provider,
        "consumer": consumer,
    }
    if offering is not None:
        event["offering"] = offering
    if task_id is not None:
        event["task_id"] = task_id
    event["envelope_id"] = envelope_id
    event["ts"] = format_ts(ts_ms)
    if refusal_code is not None:
        event["refused"] = True
        event["refusal_code"] = refusal_code
    problems = meter_event_problems(event)
    if problems:
        raise ValueError(f"not a valid meter event: {', '.join(problems)}")
    return event


def fold_meter_events(events: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Total quantity per meter, deduplicated on ``(meter, envelope_id)``.

    The first event seen for a key wins; a later one with the same key is a
    redelivery (or a conflicting duplicate) and is dropped, whatever its
    quantity. The same envelope id under two meters is two distinct facts.
    """
    seen: set[tuple[str, str]] = set()
    totals: dict[str, int] = {}
    for event in events:
        key = (str(event["meter"]), str(event["envelope_id"]))
        if key in seen:
            continue
        seen.add(key)
        totals[key[0]] = totals.get(key[0], 0) + int(event["quantity"])
    return totals


# --- the usage receipt (payload.usage) -----------------------------------------


@dataclass(frozen=True, slots=True)
class UsageEntry:
    """One ``{meter, quantity}`` line of a usage receipt (a declared meter)."""

    meter: str
    quantity: int

    def to_object(self) -> dict[str, Any]:
        return {"meter": self.meter, "quantity": self.quantity}


def parse_usage_report(usage: object) -> tuple[list[UsageEntry], list[str]]:
    """Split a ``payload.usage`` array into valid declared entries and complaints.

    An entry is valid when its meter is a meter name outside the observed set
    (a declared name must not launder a claim as an observation) and its
    quantity a non-negative integer. A meter repeated within one report keeps
    its first entry. Invalid entries are skipped, each named in a complaint;
    a report that is not an array yields no entries and one complaint.
    """
    if not isinstance(usage, list):
        return [], ["usage must be an array of {meter, quantity}"]
    entries: list[UsageEntry] = []
    complaints: list[str] = []
    seen: set[str] = set()
    for i, item in enumerate(usage):
        if not isinstance(item, Mapping):
            complaints.append(f"usage[{i}] is not an object")
            continue
        meter, quantity = item.get("meter"), item.get("quantity")
        if not is_meter_name(meter):
            complaints.append(f"usage[{i}].meter is not a meter name")
        elif meter in OBSERVED_METERS:
            complaints.append(f"usage[{i}].meter {meter!r} is an observed meter, not a declared one")
        elif not _is_quantity(quantity):
            complaints.append(f"usage[{i}].quantity must be a non-negative integer")
        elif meter in seen:
            complaints.append(f"usage[{i}].meter {meter!r} is repeated")
        else:
            assert isinstance(meter, str) and isinstance(quantity, int)
            seen.add(meter)
            entries.append(UsageEntry(meter, quantity))
    return entries, complaints


# --- the task receipt (§19.2) ---------------------------------------------------------


def task_receipt(
    status: Literal["completed", "canceled"],
    *,
    task_id: str,
    requester: str,
    responder: str,
    started_ms: int,
    ended_ms: int,
    offering: str | None = None,
    cost: Mapping[str, Any] | None = None,
    budget: Mapping[str, Any] | None = None,
    completed_late: bool = False,
    cancel_reason: str | None = None,
) -> dict[str, Any]:
    """The §19.2 receipt of an ended Task.

    ``completed``: ``completed_at`` and ``completed_late``. ``canceled``:
    ``canceled_at`` and ``cancel_reason`` (required), no ``completed_late``,
    and never the cancel's free-text note. ``cost`` is the responder's
    reported spend, ``budget`` the final (highest-revision) block; both are
    omitted when unknown, as is ``offering``.
    """
    receipt: dict[str, Any] = {"task_id": task_id, "requester": requester, "responder": responder}
    if offering is not None:
        receipt["offering"] = offering
    receipt["started_at"] = format_ts(started_ms)
    if status == "completed":
        receipt["completed_at"] = format_ts(ended_ms)
    elif status == "canceled":
        if not cancel_reason:
            raise ValueError("a canceled receipt carries the cancel_reason")
        receipt["canceled_at"] = format_ts(ended_ms)
    else:
        raise ValueError(f"no receipt for status {status!r}")
    receipt["duration_ms"] = max(0, ended_ms - started_ms)
    if cost is not None:
        receipt["cost"] = dict(cost)
    if budget is not None:
        receipt["budget"] = dict(budget)
    if status == "completed":
        receipt["completed_late"] = completed_late
    else:
        receipt["cancel_reason"] = cancel_reason
    receipt["status"] = status
    return receipt
