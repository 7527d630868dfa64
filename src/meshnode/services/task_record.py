"""The task manager's record and the pure folds that change it (§7.1, §7.3, §7.7, §10.8, §13.5, §19.2).

No I/O and no clock here: the task manager reads a record with its KV
revision, runs one fold, writes the fold's record revision-checked, and only
after that write commits publishes the fold's events and notice. A writer that
loses the race re-reads and runs the fold again, so an event is emitted by
exactly the write that made it true.

The record (KV ``mesh_tasks``, key = task id) — the §7.1 Task object plus
what the platform observed::

    {
      "id", "context_id"?, "requester", "responder", "offering"?,
      "state", "created_at", "updated_at",
      "history": [envelope, ...],        # accepted updates as received, newest last,
                                         # capped (oldest dropped, §16.4)
      "artifacts": [artifact, ...],      # merged by artifact id, later wins
      "budget"?: {revision, deadline?, cost_ceiling?},   # the current (highest) revision
      "output"?: ...,                    # latest payload.output (the way back to a
                                         # streamed result, §11.3 step 6)
      "error"?: {...},                   # latest §12.1 error object the responder sent
      "meta": {
        "first_state"?,                  # when the first update seen was not ``submitted``
        "status_message"?,               # latest payload.message
        "ended_at"?, "terminal_envelope_id"?,
        "cancel_reason"? | "failure_reason"?, "note"?, "unmet_need"?, "dependency"?,
        "attribution"?,                  # failed Tasks: "client" | "provider" (§10.8a)
        "overdue"?, "overdue_at"?, "overdue_lifted_at"?,           # §7.7 central clock
        "completed_late"?, "late"?: {"code": "DEADLINE_EXCEEDED", "deadline", "completed_at"},
        "stranded"?, "stranded_at"?, "stranded_parent"?,           # §10.8a
        "stranded_check"?: "pending" | "done", "stranded_children"?,
        "usage"?: {"envelope_id", "usage": [{meter, quantity}]},   # latest report (§13.5)
        "cost"?: {amount_micro, currency},                         # latest payload.cost
        "rejected_updates"?: [{envelope_id, from, status?, code, message, at}],  # capped
        "history_dropped"?: n            # entries dropped to fit the broker's value limit
      }
    }

Who may say what on ``mesh.task.{id}.update``: the responder moves the state
(any legal §7.3 move, restatements of a non-terminal state as progress, and
artifact deliveries without a status); the requester may only cancel (§7.3
"requester or responder cancels", §10.8 step 2: the canceling party publishes
the canceled update and the task manager records it); either party may revise
the budget (§7.7). An update from anyone else is refused and not recorded.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from meshnode.protocol.budget import (
    DEADLINE_SKEW_TOLERANCE_MS,
    Budget,
    Money,
    check_revision,
    deadline_passed,
    parse_budget,
    parse_money,
)
from meshnode.protocol.cancel import StopFields, attribute, stop_fields_of_update
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.metering import MeterClass, meter_event, parse_usage_report, task_receipt
from meshnode.protocol.nkeys import is_valid_public
from meshnode.protocol.offerings import declared_needs
from meshnode.protocol.tasks import (
    TERMINAL_STATES,
    TaskState,
    check_state_update,
    parse_state,
)
from meshnode.protocol.timeutil import format_ts, try_parse_rfc3339

__all__ = [
    "DEFAULT_HISTORY_CAP",
    "REJECTED_CAP",
    "Event",
    "FoldSettings",
    "IndexEntry",
    "Outcome",
    "Verdict",
    "apply_update",
    "finish_stranded_check",
    "fit_record",
    "flag_stranded",
    "index_entry",
    "mark_overdue",
    "overdue_due",
    "stranded_due",
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


# --- updates ------------------------------------------------------------------------------


def _append_history(record: Record, env: Envelope, cap: int) -> None:
    history = record.setdefault("history", [])
    history.append(dict(env))
    if cap >= 0 and len(history) > cap:
        del history[: len(history) - cap]


def _reject(
    record: Record, env: Envelope, code: str, message: str, now_ms: int, settings: FoldSettings
) -> Outcome:
    meta = _meta(record)
    entry: dict[str, Any] = {"envelope_id": env["id"], "from": env["from"], "code": code, "message": message,
                             "at": format_ts(now_ms)}
    status = _payload(env).get("status")
    if isinstance(status, str):
        entry["status"] = status
    rejected = meta.setdefault("rejected_updates", [])
    rejected.append(entry)
    if len(rejected) > settings.rejected_cap:
        del rejected[: len(rejected) - settings.rejected_cap]
    record["updated_at"] = format_ts(now_ms)
    return Outcome(Verdict.REJECTED, record, code=code, message=message)


def _merge_artifacts(record: Record, env: Envelope) -> None:
    artifacts = env.get("artifacts")
    if not isinstance(artifacts, list) or not artifacts:
        return
    current: list[Any] = record.setdefault("artifacts", [])
    for artifact in artifacts:
        key = artifact.get("id") if isinstance(artifact, Mapping) else None
        if key is not None:
            for i, existing in enumerate(current):
                if isinstance(existing, Mapping) and existing.get("id") == key:
                    current[i] = artifact
                    break
            else:
                current.append(artifact)
        else:
            current.append(artifact)


def _merge_content(record: Record, env: Envelope) -> None:
    """What an accepted responder update carries beside its status."""
    payload = _payload(env)
    meta = _meta(record)
    _merge_artifacts(record, env)
    if "output" in payload:
        record["output"] = payload["output"]
    if isinstance(env.get("error"), Mapping):
        record["error"] = dict(env["error"])
    if isinstance(payload.get("message"), str):
        meta["status_message"] = payload["message"]
    if "usage" in payload:
        # Cumulative, superseding (§13.5): the latest report is the whole truth.
        entries, _ = parse_usage_report(payload["usage"])
        meta["usage"] = {"envelope_id": env["id"], "usage": [e.to_object() for e in entries]}
    cost = _money(payload.get("cost"))
    if cost is not None:
        meta["cost"] = cost.to_object()
    if record.get("offering") is None and _offering_of(env) is not None:
        record["offering"] = _offering_of(env)
    if record.get("context_id") is None and isinstance(env.get("context_id"), str):
        record["context_id"] = env["context_id"]


def _usage_events(record: Mapping[str, Any], env: Envelope, ended_ms: int, state: TaskState) -> list[Event]:
    """Declared meters from the last usage report, plus the observed tasks_completed / task_ms."""
    requester, responder = _parties(record)
    common: dict[str, Any] = {
        "provider": responder,
        "consumer": requester,
        "task_id": record["id"],
        "ts_ms": ended_ms,
        "offering": record.get("offering"),
    }
    events: list[Event] = []
    meta = record.get("meta")
    report = meta.get("usage") if isinstance(meta, Mapping) else None
    if isinstance(report, Mapping):
        for line in report.get("usage", []):
            events.append(Event("metering", "usage", meter_event(
                line["meter"], MeterClass.DECLARED, line["quantity"],
                envelope_id=str(report["envelope_id"]), **common,
            )))
    # Events not derived from one envelope use the Task's terminal envelope id (§13.5).
    if state is TaskState.COMPLETED:
        events.append(Event("metering", "usage", meter_event(
            "tasks_completed", MeterClass.OBSERVED, 1, envelope_id=str(env["id"]), **common,
        )))
    started = _ms(record.get("created_at"), ended_ms)
    events.append(Event("metering", "usage", meter_event(
        "task_ms", MeterClass.OBSERVED, max(0, ended_ms - started), envelope_id=str(env["id"]), **common,
    )))
    return events


def _end(
    record: Record,
    env: Envelope,
    state: TaskState,
    stop: StopFields | None,
    received_ms: int,
    settings: FoldSettings,
    manifest_of: ManifestOf | None,
) -> list[Event]:
    """Record an ending and return the events it owes."""
    meta = _meta(record)
    meta["ended_at"] = format_ts(received_ms)
    meta["terminal_envelope_id"] = env["id"]
    requester, responder = _parties(record)
    started = _ms(record.get("created_at"), received_ms)
    budget = _budget_of(record)
    cost = meta.get("cost")
    events: list[Event] = []
    if stop is not None and state in (TaskState.CANCELED, TaskState.FAILED):
        meta.update(stop.record_fields(state))
    if state is TaskState.COMPLETED:
        late = (
            budget is not None
            and budget.deadline_ms is not None
            and deadline_passed(budget.deadline_ms, received_ms, tolerance_ms=settings.deadline_tolerance_ms)
        )
        if late:
            assert budget is not None
            # A marker, not a failure (§7.7): the completion stands.
            meta["completed_late"] = True
            meta["late"] = {"code": "DEADLINE_EXCEEDED", "deadline": budget.deadline,
                            "completed_at": format_ts(received_ms)}
        events.append(Event("metering", "task_completed", task_receipt(
            "completed", task_id=record["id"], requester=requester, responder=responder,
            offering=record.get("offering"), started_ms=started, ended_ms=received_ms,
            cost=cost, budget=budget.to_object() if budget else None, completed_late=late,
        )))
    elif state is TaskState.CANCELED:
        assert stop is not None and stop.reason is not None
        meta["stranded_check"] = "pending"
        events.append(Event("metering", "task_canceled", task_receipt(
            "canceled", task_id=record["id"], requester=requester, responder=responder,
            offering=record.get("offering"), started_ms=started, ended_ms=received_ms,
            cost=cost, budget=budget.to_object() if budget else None, cancel_reason=stop.reason.value,
        )))
    elif state is TaskState.FAILED:
        needs = _declared_needs(manifest_of, responder, record.get("offering"))
        reason = stop.reason if stop is not None else None
        verdict = attribute(reason, stop.unmet_need if stop else None, needs)
        meta["attribution"] = verdict
        data = _common(record)
        if stop is not None:
            data.update({k: v for k, v in stop.members().items() if k != "note"})
        data.update({"attribution": verdict, "failed_at": format_ts(received_ms), "envelope_id": env["id"]})
        events.append(Event("task", "failed", data))
    events.extend(_usage_events(record, env, received_ms, state))
    return events


def _declared_needs(manifest_of: ManifestOf | None, responder: str, offering: object) -> frozenset[str] | None:
    if manifest_of is None:
        return None
    try:
        manifest = manifest_of(responder)
    except Exception:  # an unreadable declaration fails closed (§10.8a)
        return None
    if manifest is None:
        return None
    return declared_needs(manifest, offering if isinstance(offering, str) else None)


def _create(
    env: Envelope, task_id: str, received_ms: int, now_ms: int, settings: FoldSettings,
    manifest_of: ManifestOf | None,
) -> Outcome:
    payload = _payload(env)
    status = payload.get("status")
    if status is None or status == TaskState.CANCELED.value:
        # A revision or a cancel names no roles we can trust (either party may
        # send them); wait for the responder's own first update.
        return Outcome(Verdict.ORPHAN, code="TASK_NOT_FOUND", message="no record yet")
    state = parse_state(status)
    if state is None:
        return Outcome(Verdict.REFUSED, code="TASK_INVALID_TRANSITION", message=f"{status!r} is not a task state")
    requester = env.get("to")
    if not is_valid_public(requester) or requester == env["from"]:
        return Outcome(Verdict.REFUSED, code="INVALID_ENVELOPE",
                       message="the first update must name the requester in to")
    try:
        stop = stop_fields_of_update(payload)
    except ProtocolError as exc:
        return Outcome(Verdict.REFUSED, code=exc.code, message=exc.message)
    record: Record = {"id": task_id}
    if isinstance(env.get("context_id"), str):
        record["context_id"] = env["context_id"]
    record.update({"requester": requester, "responder": env["from"]})
    offering = _offering_of(env)
    if offering is not None:
        record["offering"] = offering
    record.update({
        "state": state.value,
        "created_at": format_ts(received_ms),
        "updated_at": format_ts(now_ms),
        "history": [],
        "artifacts": [],
        "meta": {},
    })
    meta = _meta(record)
    if state is not TaskState.SUBMITTED:
        # The §10.5 opening is ``working``; a manager that joined late also lands here.
        meta["first_state"] = state.value
    if isinstance(env.get("in_reply_to"), str):
        meta["request_id"] = env["in_reply_to"]
    if env.get("budget") is not None:
        # The Task inherits the request's budget (§7.7), echoed on its first update.
        try:
            record["budget"] = parse_budget(env["budget"]).to_object()
        except ProtocolError as exc:
            meta["budget_refused"] = {"code": exc.code, "message": exc.message}
    _append_history(record, env, settings.history_cap)
    _merge_content(record, env)
    events: list[Event] = []
    if state in TERMINAL_STATES:
        events = _end(record, env, state, stop, received_ms, settings, manifest_of)
    return Outcome(Verdict.CREATED, record, events)


def _revise(
    record: Record, env: Envelope, block: object, received_ms: int, now_ms: int, settings: FoldSettings
) -> Outcome:
    requester, responder = _parties(record)
    meta = _meta(record)
    try:
        revision = check_revision(
            sender=str(env["from"]), requester=requester, responder=responder,
            task_state=str(record["state"]), current=_budget_of(record), block=block,
            now_ms=received_ms, spent=_money(meta.get("cost")),
        )
    except ProtocolError as exc:
        return _reject(record, env, exc.code, exc.message, now_ms, settings)
    record["budget"] = revision.to_object()
    meta["budget_revised_at"] = format_ts(received_ms)
    if meta.get("overdue") and not (
        revision.deadline_ms is not None
        and deadline_passed(revision.deadline_ms, received_ms, tolerance_ms=settings.deadline_tolerance_ms)
    ):
        # The requester chose to keep listening on new terms: no longer overdue.
        meta["overdue"] = False
        meta["overdue_lifted_at"] = format_ts(received_ms)
    _append_history(record, env, settings.history_cap)
    record["updated_at"] = format_ts(now_ms)
    return Outcome(Verdict.REVISED, record)


def apply_update(
    record: Mapping[str, Any] | None,
    env: Envelope,
    *,
    task_id: str,
    received_ms: int,
    now_ms: int,
    settings: FoldSettings = FoldSettings(),
    manifest_of: ManifestOf | None = None,
) -> Outcome:
    """Fold one verified update envelope from ``mesh.task.{task_id}.update`` into ``record``.

    ``received_ms`` is when the mesh received the update (the stream's
    timestamp): deadlines and durations are judged against it, so a manager
    that runs behind does not make a punctual completion late. ``now_ms``
    stamps ``updated_at``. ``manifest_of`` looks up the responder's registered
    manifest for attribution; None (or a lookup that fails) attributes every
    failure to the provider. ``record`` is not modified; the outcome holds a copy.
    """
    if env.get("type") != "respond":
        return Outcome(Verdict.REFUSED, code="INVALID_ENVELOPE", message="a task update is a respond")
    if env.get("task_id") != task_id:
        return Outcome(Verdict.REFUSED, code="INVALID_ENVELOPE",
                       message="the envelope's task_id is not the subject's")
    if record is None:
        return _create(env, task_id, received_ms, now_ms, settings, manifest_of)

    rec: Record = copy.deepcopy(dict(record))
    if env["id"] in _seen_ids(rec):
        return Outcome(Verdict.DUPLICATE)
    requester, responder = _parties(rec)
    sender = env["from"]
    if sender not in (requester, responder):
        return Outcome(Verdict.REFUSED, code="UNAUTHORIZED", message="not a party to the Task")
    payload = _payload(env)
    status = payload.get("status")

    if status is None:
        block = payload.get("budget", env.get("budget"))
        if block is not None:
            return _revise(rec, env, block, received_ms, now_ms, settings)
        if sender == responder and env.get("artifacts"):
            if parse_state(rec["state"]) in TERMINAL_STATES:
                return _reject(rec, env, "TASK_INVALID_TRANSITION", "the Task has ended", now_ms, settings)
            _append_history(rec, env, settings.history_cap)
            _merge_content(rec, env)
            rec["updated_at"] = format_ts(now_ms)
            return Outcome(Verdict.PROGRESS, rec)
        return _reject(rec, env, "INVALID_ENVELOPE", "an update carries a status, a budget or artifacts",
                       now_ms, settings)

    if sender == requester and sender != responder and status != TaskState.CANCELED.value:
        return _reject(rec, env, "UNAUTHORIZED", "only the responder moves the Task; the requester may cancel",
                       now_ms, settings)
    try:
        stop = stop_fields_of_update(payload)
    except ProtocolError as exc:
        return _reject(rec, env, exc.code, exc.message, now_ms, settings)
    current = str(rec["state"])
    current_state = parse_state(current)
    if current_state in TERMINAL_STATES:
        if status == current:
            _append_history(rec, env, settings.history_cap)
            rec["updated_at"] = format_ts(now_ms)
            return Outcome(Verdict.CONFIRMED, rec)
        code = "TASK_NOT_CANCELABLE" if status == TaskState.CANCELED.value else "TASK_INVALID_TRANSITION"
        return _reject(rec, env, code, f"the Task already ended {current}; the first ending stands",
                       now_ms, settings)
    try:
        moved = check_state_update(current, str(status))
    except ProtocolError as exc:
        return _reject(rec, env, exc.code, exc.message, now_ms, settings)
    _append_history(rec, env, settings.history_cap)
    if sender == responder:
        _merge_content(rec, env)
    rec["updated_at"] = format_ts(now_ms)
    if not moved:
        return Outcome(Verdict.PROGRESS, rec)
    state = TaskState(str(status))
    rec["state"] = state.value
    events: list[Event] = []
    if state in TERMINAL_STATES:
        events = _end(rec, env, state, stop, received_ms, settings, manifest_of)
    return Outcome(Verdict.APPLIED, rec, events)


# --- the central clock (§7.7) --------------------------------------------------------------


def mark_overdue(
    record: Mapping[str, Any] | None, *, now_ms: int, settings: FoldSettings = FoldSettings()
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


# --- the broker's value limit -------------------------------------------------------------------


def fit_record(record: Record, max_bytes: int, encode: Callable[[Any], bytes]) -> bytes:
    """Encode ``record`` within ``max_bytes``, dropping the oldest history entries
    (counted in ``meta.history_dropped``) until it fits.

    Raises ValueError when even an empty history does not fit.
    """
    data = encode(record)
    if len(data) <= max_bytes:
        return data
    history = record.get("history", [])
    dropped = 0
    while history and len(data) > max_bytes:
        # Drop as many of the oldest entries as cover the excess, then re-measure.
        excess = len(data) - max_bytes
        step = 1
        total = 0
        for entry in history:
            total += len(encode(entry))
            if total >= excess:
                break
            step += 1
        step = min(step, len(history))
        del history[:step]
        dropped += step
        meta = _meta(record)
        meta["history_dropped"] = int(meta.get("history_dropped", 0)) + step
        data = encode(record)
    if len(data) > max_bytes:
        raise ValueError(f"the task record needs {len(data)} bytes; the limit is {max_bytes}")
    return data
