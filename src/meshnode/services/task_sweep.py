"""The sweep's folds and index: the central clock (§7.7), stranded delegates (§10.8a).

Pure, like every fold (see :mod:`.task_record`); the task manager keeps an
:class:`IndexEntry` per record from a KV watch and asks :func:`overdue_due` and
:func:`stranded_due` what to fold next. Split out of :mod:`.task_record`, which
re-exports these names.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from meshnode.protocol.budget import (
    deadline_passed,
)
from meshnode.protocol.tasks import (
    TERMINAL_STATES,
    parse_state,
)
from meshnode.protocol.timeutil import format_ts, try_parse_rfc3339

from .task_fold import (
    Event,
    FoldSettings,
    Outcome,
    Record,
    Verdict,
    _budget_of,
    _common,
    _meta,
    _parties,
)

__all__ = [
    "IndexEntry",
    "finish_stranded_check",
    "flag_stranded",
    "index_entry",
    "mark_overdue",
    "overdue_due",
    "stranded_due",
]


# --- the central clock (§7.7) --------------------------------------------------------------


def mark_overdue(
    record: Mapping[str, Any] | None, *, now_ms: int, settings: FoldSettings = FoldSettings()  # noqa: B008 (frozen, so one shared default is safe)
) -> Outcome:
    """Mark a live Task overdue once its deadline has passed (under the tolerance).

    Emits ``task.overdue`` and owes the requester a notice whose payload is
    ``{status: <current state>, overdue: true, deadline, overdue_at}``.
    Unchanged for an ended Task, one already marked, or one not yet due.
    """
    if record is None or parse_state(record.get("state")) in TERMINAL_STATES:
        return Outcome(Verdict.UNCHANGED)
    budget = _budget_of(record)
    meta = record.get("meta") if isinstance(record.get("meta"), Mapping) else {}
    assert isinstance(meta, Mapping)
    if (
        meta.get("overdue")
        or budget is None
        or budget.deadline_ms is None
        or not deadline_passed(budget.deadline_ms, now_ms, tolerance_ms=settings.deadline_tolerance_ms)
    ):
        return Outcome(Verdict.UNCHANGED)
    rec: Record = copy.deepcopy(dict(record))
    at = format_ts(now_ms)
    _meta(rec).update({"overdue": True, "overdue_at": at})
    rec["updated_at"] = at
    data = _common(rec)
    data.update({"state": rec["state"], "deadline": budget.deadline, "overdue_at": at})
    notice = {"status": rec["state"], "overdue": True, "deadline": budget.deadline, "overdue_at": at}
    return Outcome(Verdict.APPLIED, rec, [Event("task", "overdue", data)], notice=notice)


# --- stranded delegates (§10.8a) -------------------------------------------------------------


def flag_stranded(
    child: Mapping[str, Any] | None, parent: Mapping[str, Any], *, now_ms: int
) -> Outcome:
    """Flag ``child`` as a stranded delegate of the canceled ``parent``.

    A child qualifies while it is live, shares the parent's context_id, and was
    requested by the parent's responder. Emits ``task.stranded``. Unchanged
    when it does not qualify or is already flagged.
    """
    if child is None or parse_state(child.get("state")) in TERMINAL_STATES:
        return Outcome(Verdict.UNCHANGED)
    meta = child.get("meta") if isinstance(child.get("meta"), Mapping) else {}
    assert isinstance(meta, Mapping)
    if (
        meta.get("stranded")
        or child.get("id") == parent.get("id")
        or parent.get("context_id") is None
        or child.get("context_id") != parent.get("context_id")
        or child.get("requester") != parent.get("responder")
    ):
        return Outcome(Verdict.UNCHANGED)
    rec: Record = copy.deepcopy(dict(child))
    at = format_ts(now_ms)
    _meta(rec).update({"stranded": True, "stranded_at": at, "stranded_parent": parent["id"]})
    rec["updated_at"] = at
    data = _common(rec)
    data.update({"parent_task_id": parent["id"], "state": rec["state"], "stranded_at": at})
    parent_meta = parent.get("meta")
    if isinstance(parent_meta, Mapping) and parent_meta.get("cancel_reason"):
        data["parent_cancel_reason"] = parent_meta["cancel_reason"]
    return Outcome(Verdict.APPLIED, rec, [Event("task", "stranded", data)])


def finish_stranded_check(
    parent: Mapping[str, Any] | None, stranded: Iterable[str], *, now_ms: int
) -> Outcome:
    """Close the canceled parent's pending stranded check, listing what it flagged."""
    if parent is None:
        return Outcome(Verdict.UNCHANGED)
    meta = parent.get("meta") if isinstance(parent.get("meta"), Mapping) else {}
    assert isinstance(meta, Mapping)
    if meta.get("stranded_check") != "pending":
        return Outcome(Verdict.UNCHANGED)
    rec: Record = copy.deepcopy(dict(parent))
    rec_meta = _meta(rec)
    rec_meta["stranded_check"] = "done"
    children = sorted(set(stranded))
    if children:
        rec_meta["stranded_children"] = children
    rec["updated_at"] = format_ts(now_ms)
    return Outcome(Verdict.APPLIED, rec)


# --- the sweep's index -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """What the sweep needs to know of one record, kept in memory from a KV watch."""

    task_id: str
    state: str
    requester: str
    responder: str
    context_id: str | None
    deadline_ms: int | None
    overdue: bool
    stranded_check_pending: bool
    ended_ms: int | None

    @property
    def live(self) -> bool:
        return parse_state(self.state) not in TERMINAL_STATES


def index_entry(record: object) -> IndexEntry | None:
    """The index entry of a stored record, or None when the sweep has nothing to
    do with it (ended, and no stranded check pending) or it is unreadable."""
    if not isinstance(record, Mapping):
        return None
    try:
        task_id, state = str(record["id"]), str(record["state"])
        requester, responder = _parties(record)
    except KeyError:
        return None
    meta = record.get("meta") if isinstance(record.get("meta"), Mapping) else {}
    assert isinstance(meta, Mapping)
    pending = meta.get("stranded_check") == "pending"
    if parse_state(state) in TERMINAL_STATES and not pending:
        return None
    budget = _budget_of(record)
    ended = try_parse_rfc3339(meta.get("ended_at"))
    context_id = record.get("context_id")
    return IndexEntry(
        task_id=task_id,
        state=state,
        requester=requester,
        responder=responder,
        context_id=context_id if isinstance(context_id, str) else None,
        deadline_ms=budget.deadline_ms if budget else None,
        overdue=bool(meta.get("overdue")),
        stranded_check_pending=pending,
        ended_ms=None if ended is None else ended // 1000,
    )


def overdue_due(entries: Iterable[IndexEntry], *, now_ms: int, tolerance_ms: int) -> list[str]:
    """Ids of live, unmarked Tasks whose deadline has passed."""
    return sorted(
        e.task_id
        for e in entries
        if e.live
        and not e.overdue
        and e.deadline_ms is not None
        and deadline_passed(e.deadline_ms, now_ms, tolerance_ms=tolerance_ms)
    )


def stranded_due(
    entries: Iterable[IndexEntry], *, now_ms: int, grace_ms: int
) -> list[tuple[IndexEntry, list[IndexEntry]]]:
    """Canceled Tasks whose stranded check is due (``grace_ms`` after the cancel was
    recorded, time for the performer to forward its cancels), each with the live
    delegates still standing: same context_id, requested by the parent's responder."""
    items = list(entries)
    by_context: dict[str, list[IndexEntry]] = {}
    for e in items:
        if e.live and e.context_id is not None:
            by_context.setdefault(e.context_id, []).append(e)
    due: list[tuple[IndexEntry, list[IndexEntry]]] = []
    for parent in items:
        if not parent.stranded_check_pending or parent.live:
            continue
        if parent.ended_ms is not None and now_ms - parent.ended_ms < grace_ms:
            continue
        children = [
            c for c in by_context.get(parent.context_id or "", [])
            if c.requester == parent.responder and c.task_id != parent.task_id
        ] if parent.context_id is not None else []
        due.append((parent, sorted(children, key=lambda c: c.task_id)))
    return sorted(due, key=lambda item: item[0].task_id)
