"""The update fold (§7.3, §7.7, §10.8, §13.5): one ``mesh.task.{id}.update`` envelope applied to a task record.

Pure, like every fold (see :mod:`.task_record` for the record and who may say
what); split out of :mod:`.task_record`, which re-exports :func:`apply_update`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from meshnode.protocol.budget import (
    check_revision,
    deadline_passed,
    parse_budget,
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
from meshnode.protocol.timeutil import format_ts

from .task_fold import (
    Envelope,
    Event,
    FoldSettings,
    ManifestOf,
    Outcome,
    Record,
    Verdict,
    _budget_of,
    _common,
    _meta,
    _money,
    _ms,
    _offering_of,
    _parties,
    _payload,
    _seen_ids,
)

__all__ = ["apply_update"]



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
    settings: FoldSettings = FoldSettings(),  # noqa: B008 (frozen, so one shared default is safe)
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
