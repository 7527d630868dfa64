"""The task folds' shared vocabulary: the record type, verdicts, outcomes, settings and small record readers.

The record itself and who may say what are described in :mod:`.task_record`,
which re-exports the public names here (split out of it, issue #16).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from meshnode.protocol.budget import (
    DEADLINE_SKEW_TOLERANCE_MS,
    Budget,
    Money,
    parse_budget,
    parse_money,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.timeutil import try_parse_rfc3339

__all__ = [
    "DEFAULT_HISTORY_CAP",
    "REJECTED_CAP",
    "Envelope",
    "Event",
    "FoldSettings",
    "ManifestOf",
    "Outcome",
    "Record",
    "Verdict",
]

Record = dict[str, Any]
Envelope = Mapping[str, Any]
ManifestOf = Callable[[str], Mapping[str, Any] | None]

DEFAULT_HISTORY_CAP = 50
#: Refused updates kept in ``meta.rejected_updates``; a chatty party cannot grow a record.
REJECTED_CAP = 20


class Verdict(StrEnum):
    """What one fold decided."""

    CREATED = "created"  # the first update of a Task made its record
    APPLIED = "applied"  # the state moved
    PROGRESS = "progress"  # a restated non-terminal state, or an artifact delivery
    REVISED = "revised"  # a budget revision was recorded
    CONFIRMED = "confirmed"  # the ending restated (the performer confirming a cancel)
    REJECTED = "rejected"  # a party's update refused; kept in meta.rejected_updates
    REFUSED = "refused"  # not recorded at all (a non-party, or no record to hold it)
    DUPLICATE = "duplicate"  # this envelope is already in the record
    ORPHAN = "orphan"  # no record yet, and this update cannot create one
    UNCHANGED = "unchanged"  # a sweep fold with nothing to do


@dataclass(frozen=True, slots=True)
class Event:
    """An event to emit on ``mesh.event.{domain}.{event_type}`` once the write commits."""

    domain: str
    event_type: str
    data: dict[str, Any]


@dataclass
class Outcome:
    """A fold's result: the record to write (None = write nothing), what to
    publish after the write, and why."""

    verdict: Verdict
    record: Record | None = None
    events: list[Event] = field(default_factory=list)
    #: The payload of a task-manager notice to the requester on the Task's
    #: update subject (the overdue mark), or None.
    notice: dict[str, Any] | None = None
    code: str | None = None
    message: str = ""


@dataclass(frozen=True, slots=True)
class FoldSettings:
    history_cap: int = DEFAULT_HISTORY_CAP
    #: Deadlines are compared under §22.3's skew tolerance (§7.7).
    deadline_tolerance_ms: int = DEADLINE_SKEW_TOLERANCE_MS
    rejected_cap: int = REJECTED_CAP


# --- small readers ------------------------------------------------------------------


def _payload(env: Envelope) -> Mapping[str, Any]:
    payload = env.get("payload")
    return payload if isinstance(payload, Mapping) else {}


def _meta(record: Record) -> dict[str, Any]:
    meta = record.get("meta")
    if not isinstance(meta, dict):
        meta = {}
        record["meta"] = meta
    return meta


def _budget_of(record: Mapping[str, Any]) -> Budget | None:
    block = record.get("budget")
    if block is None:
        return None
    try:
        return parse_budget(block)
    except ProtocolError:
        return None


def _money(value: object) -> Money | None:
    try:
        return parse_money(value) if value is not None else None
    except ProtocolError:
        return None


def _offering_of(env: Envelope) -> str | None:
    offering = _payload(env).get("offering")
    if not isinstance(offering, str):
        meta = env.get("meta")
        offering = meta.get("offering") if isinstance(meta, Mapping) else None
    return offering if isinstance(offering, str) and offering else None


def _parties(record: Mapping[str, Any]) -> tuple[str, str]:
    return str(record["requester"]), str(record["responder"])


def _ms(text: object, fallback: int) -> int:
    us = try_parse_rfc3339(text)
    return fallback if us is None else us // 1000


def _seen_ids(record: Mapping[str, Any]) -> set[str]:
    ids = {str(h.get("id")) for h in record.get("history", []) if isinstance(h, Mapping)}
    meta = record.get("meta")
    if isinstance(meta, Mapping):
        ids.update(str(r.get("envelope_id")) for r in meta.get("rejected_updates", []) if isinstance(r, Mapping))
    return ids


def _common(record: Mapping[str, Any]) -> dict[str, Any]:
    """The members every task event starts with."""
    data: dict[str, Any] = {
        "task_id": record["id"],
        "requester": record["requester"],
        "responder": record["responder"],
    }
    for key in ("context_id", "offering"):
        if record.get(key) is not None:
            data[key] = record[key]
    return data
