"""The task manager's pure folds (services/task_record.py), without a broker."""

from __future__ import annotations

import json
from typing import Any

import pytest

from meshnode.protocol.envelope import build_envelope, sign_envelope
from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.protocol.tasks import TRANSITIONS, TaskState
from meshnode.protocol.timeutil import format_ts
from meshnode.services.task_record import (
    FoldSettings,
    Outcome,
    Verdict,
    apply_update,
    finish_stranded_check,
    fit_record,
    flag_stranded,
    index_entry,
    mark_overdue,
    overdue_due,
    stranded_due,
)

REQUESTER = KeyPair.generate(Prefix.USER)
RESPONDER = KeyPair.generate(Prefix.USER)
STRANGER = KeyPair.generate(Prefix.USER)
T0 = 1_800_000_000_000
NO_TOLERANCE = FoldSettings(deadline_tolerance_ms=0)


def update(
    sender: KeyPair = RESPONDER,
    payload: dict[str, Any] | None = None,
    *,
    task_id: str = "t1",
    to: KeyPair | None = None,
    at: int = T0,
    **members: Any,
) -> dict[str, Any]:
    to = to or (REQUESTER if sender is not REQUESTER else RESPONDER)
    env = build_envelope("respond", sender.public_key, now_ms=at, to=to.public_key, task_id=task_id,
                         in_reply_to="req-1", payload=payload, **members)
    return sign_envelope(env, sender)


def fold(record: dict[str, Any] | None, env: dict[str, Any], at: int = T0, **options: Any) -> Outcome:
    options.setdefault("settings", NO_TOLERANCE)
    return apply_update(record, env, task_id=env.get("task_id", "t1"), received_ms=at, now_ms=at, **options)


def run(*steps: dict[str, Any], **options: Any) -> tuple[dict[str, Any], list[Outcome]]:
    record: dict[str, Any] | None = None
    outcomes = []
    for env in steps:
        outcome = fold(record, env, **options)
        outcomes.append(outcome)
        if outcome.record is not None:
            record = outcome.record
    assert record is not None
    return record, outcomes


def events(outcome: Outcome, kind: str) -> list[dict[str, Any]]:
    domain, _, event_type = kind.partition(".")
    return [e.data for e in outcome.events if e.domain == domain and e.event_type == event_type]


# --- creation --------------------------------------------------------------------------------


def test_the_first_update_creates_the_record_with_the_parties_from_the_envelope() -> None:
    env = update(payload={"status": "submitted", "offering": "summarize"}, context_id="c1",
                 budget={"revision": 0, "deadline": format_ts(T0 + 60_000)})
    outcome = fold(None, env)
    assert outcome.verdict is Verdict.CREATED and not outcome.events
    record = outcome.record
    assert record is not None
    assert record["id"] == "t1" and record["context_id"] == "c1" and record["offering"] == "summarize"
    assert record["requester"] == REQUESTER.public_key and record["responder"] == RESPONDER.public_key
    assert record["state"] == "submitted" and record["history"] == [env] and record["artifacts"] == []
    assert record["budget"] == {"revision": 0, "deadline": format_ts(T0 + 60_000)}
    assert record["created_at"] == record["updated_at"] == format_ts(T0)
    assert record["meta"] == {"request_id": "req-1"}


@pytest.mark.parametrize(
    ("payload", "verdict"),
    [
        ({"status": "canceled", "reason": "user_requested"}, Verdict.ORPHAN),
        ({"budget": {"revision": 1, "deadline": "2030-01-01T00:00:00Z"}}, Verdict.ORPHAN),
        ({"status": "accepted"}, Verdict.REFUSED),
        ({"status": "failed", "reason": "nope"}, Verdict.REFUSED),
    ],
)
def test_what_cannot_create_a_record(payload: dict[str, Any], verdict: Verdict) -> None:
    outcome = fold(None, update(payload=payload))
    assert outcome.verdict is verdict and outcome.record is None


def test_creation_needs_a_requester_and_a_respond_on_the_right_task() -> None:
    no_to = update(payload={"status": "submitted"})
    del no_to["to"]
    assert fold(None, no_to).verdict is Verdict.REFUSED
    assert fold(None, update(payload={"status": "submitted"}, to=RESPONDER)).verdict is Verdict.REFUSED
    wrong = update(payload={"status": "submitted"}, task_id="t2")
    assert apply_update(None, wrong, task_id="t1", received_ms=T0, now_ms=T0).code == "INVALID_ENVELOPE"
    request = sign_envelope(build_envelope("request", RESPONDER.public_key, now_ms=T0, task_id="t1",
                                           payload={"status": "submitted"}), RESPONDER)
    assert fold(None, request).verdict is Verdict.REFUSED


def test_a_late_joiner_or_a_stream_opening_records_the_first_state_seen() -> None:
    record = fold(None, update(payload={"status": "working"})).record
    assert record is not None and record["meta"]["first_state"] == "working"


# --- transitions ---------------------------------------------------------------------------------

PATHS = {
    "submitted": [],
    "working": ["working"],
    "input_required": ["working", "input_required"],
    "auth_required": ["working", "auth_required"],
}


@pytest.mark.parametrize(("frm", "to"), sorted((f, t) for f, t in TRANSITIONS if f is not None))
def test_every_legal_transition_applies(frm: TaskState, to: TaskState) -> None:
    steps = [update(payload={"status": "submitted"})]
    steps += [update(payload={"status": s}) for s in PATHS[frm.value]]
    last = {"status": to.value, **({"reason": "policy"} if to is TaskState.CANCELED else {})}
    steps.append(update(payload=last))
    record, outcomes = run(*steps)
    assert outcomes[-1].verdict is Verdict.APPLIED and record["state"] == to.value


@pytest.mark.parametrize(("frm", "to"), [("submitted", "completed"), ("working", "submitted"),
                                         ("input_required", "completed"), ("working", "accepted")])
def test_an_illegal_move_is_rejected_and_kept_in_meta(frm: str, to: str) -> None:
    steps = [update(payload={"status": "submitted"})] + [update(payload={"status": s}) for s in PATHS[frm]]
    record, _ = run(*steps)
    bad = update(payload={"status": to})
    outcome = fold(record, bad)
    assert outcome.verdict is Verdict.REJECTED and outcome.code == "TASK_INVALID_TRANSITION"
    assert outcome.record is not None and outcome.record["state"] == frm
    assert outcome.record["meta"]["rejected_updates"][-1]["envelope_id"] == bad["id"]
    assert len(outcome.record["history"]) == len(steps)


def test_restating_a_live_state_is_progress_and_carries_content() -> None:
    record, outcomes = run(
        update(payload={"status": "working"}),
        update(payload={"status": "working", "message": "m", "output": {"partial": 1},
                        "usage": [{"meter": "tokens_out", "quantity": 10}],
                        "cost": {"amount_micro": 5, "currency": "USD"}},
               artifacts=[{"id": "a", "parts": [{"text": "1"}]}, {"parts": [{"text": "no id"}]}]),
        update(payload={"status": "working"}, artifacts=[{"id": "a", "parts": [{"text": "2"}]}],
               error={"code": "INTERNAL_ERROR", "message": "retrying"}),
    )
    assert [o.verdict for o in outcomes] == [Verdict.CREATED, Verdict.PROGRESS, Verdict.PROGRESS]
    assert record["artifacts"] == [{"id": "a", "parts": [{"text": "2"}]}, {"parts": [{"text": "no id"}]}]
    assert record["output"] == {"partial": 1} and record["error"]["code"] == "INTERNAL_ERROR"
    assert record["meta"]["status_message"] == "m" and record["meta"]["cost"]["amount_micro"] == 5
    assert record["meta"]["usage"]["usage"] == [{"meter": "tokens_out", "quantity": 10}]


def test_an_artifact_delivery_without_a_status_is_progress_from_the_responder_only() -> None:
    record, _ = run(update(payload={"status": "working"}))
    delivery = update(payload={}, artifacts=[{"id": "x", "parts": []}])
    assert fold(record, delivery).verdict is Verdict.PROGRESS
    from_requester = update(REQUESTER, payload={}, artifacts=[{"id": "x", "parts": []}])
    assert fold(record, from_requester).code == "INVALID_ENVELOPE"


def test_who_may_say_what() -> None:
    record, _ = run(update(payload={"status": "working"}))
    stranger = fold(record, update(STRANGER, {"status": "completed"}, to=REQUESTER))
    assert stranger.verdict is Verdict.REFUSED and stranger.code == "UNAUTHORIZED" and stranger.record is None
    requester_moves = fold(record, update(REQUESTER, {"status": "completed"}))
    assert requester_moves.verdict is Verdict.REJECTED and requester_moves.code == "UNAUTHORIZED"
    requester_cancels = fold(record, update(REQUESTER, {"status": "canceled", "reason": "user_requested"}))
    assert requester_cancels.verdict is Verdict.APPLIED
    assert requester_cancels.record is not None and requester_cancels.record["state"] == "canceled"


def test_the_first_ending_stands_and_a_confirmation_is_recorded() -> None:
    record, _ = run(
        update(payload={"status": "working"}),
        update(REQUESTER, {"status": "canceled", "reason": "user_requested", "note": "n"}),
    )
    confirm = fold(record, update(payload={"status": "canceled", "reason": "user_requested"}))
    assert confirm.verdict is Verdict.CONFIRMED and not confirm.events
    late = fold(record, update(payload={"status": "completed"}))
    assert late.verdict is Verdict.REJECTED and late.code == "TASK_INVALID_TRANSITION"
    done, _ = run(update(payload={"status": "working"}), update(payload={"status": "completed"}))
    cancel = fold(done, update(REQUESTER, {"status": "canceled", "reason": "superseded"}))
    assert cancel.code == "TASK_NOT_CANCELABLE"


def test_a_duplicate_envelope_is_recognised_from_the_record() -> None:
    env = update(payload={"status": "working"})
    record, _ = run(env)
    assert fold(record, env).verdict is Verdict.DUPLICATE
    bad = update(payload={"status": "submitted"})
    folded = fold(record, bad).record
    assert folded is not None and fold(folded, bad).verdict is Verdict.DUPLICATE


def test_history_and_rejections_are_capped_oldest_first() -> None:
    steps = [update(payload={"status": "working"}, at=T0 + i) for i in range(8)]
    record, _ = run(*steps, settings=FoldSettings(history_cap=3, rejected_cap=2, deadline_tolerance_ms=0))
    assert [h["id"] for h in record["history"]] == [s["id"] for s in steps[-3:]]
    rejects = [update(payload={"status": "submitted"}, at=T0 + 100 + i) for i in range(4)]
    settings = FoldSettings(history_cap=3, rejected_cap=2)
    for env in rejects:
        out = fold(record, env, settings=settings).record
        assert out is not None
        record = out
    assert [r["envelope_id"] for r in record["meta"]["rejected_updates"]] == [e["id"] for e in rejects[-2:]]


def test_the_input_record_is_never_modified() -> None:
    record, _ = run(update(payload={"status": "working"}))
    frozen = json.dumps(record, sort_keys=True)
    fold(record, update(payload={"status": "completed"}))
    fold(record, update(payload={"status": "submitted"}))
    mark_overdue(record, now_ms=T0)
    assert json.dumps(record, sort_keys=True) == frozen


# --- endings, receipts, meters ---------------------------------------------------------------------


def test_completion_emits_the_receipt_and_meter_events() -> None:
    budget = {"revision": 0, "deadline": format_ts(T0 + 60_000)}
    created = update(payload={"status": "submitted", "offering": "o"}, budget=budget)
    cumulative = update(payload={"status": "working", "usage": [{"meter": "tokens_out", "quantity": 1}]})
    done = update(payload={"status": "completed", "cost": {"amount_micro": 7, "currency": "USD"},
                           "usage": [{"meter": "tokens_out", "quantity": 9}]}, at=T0 + 5000)
    record, outcomes = run(created, cumulative)
    outcome = fold(record, done, at=T0 + 5000)
    assert events(outcome, "metering.task_completed") == [{
        "task_id": "t1", "requester": REQUESTER.public_key, "responder": RESPONDER.public_key,
        "offering": "o", "started_at": format_ts(T0), "completed_at": format_ts(T0 + 5000),
        "duration_ms": 5000, "cost": {"amount_micro": 7, "currency": "USD"}, "budget": budget,
        "completed_late": False, "status": "completed",
    }]
    usage = {e["meter"]: e for e in events(outcome, "metering.usage")}
    assert usage["tokens_out"]["quantity"] == 9 and usage["tokens_out"]["envelope_id"] == done["id"]
    assert usage["tasks_completed"]["quantity"] == 1 and usage["task_ms"]["quantity"] == 5000
    assert {e["class"] for e in usage.values()} == {"declared", "observed"}
    assert outcome.record is not None and "completed_late" not in outcome.record["meta"]


def test_a_completion_after_the_deadline_is_recorded_late() -> None:
    record, _ = run(update(payload={"status": "working"}, budget={"revision": 0, "deadline": format_ts(T0)}))
    outcome = fold(record, update(payload={"status": "completed"}, at=T0 + 1000), at=T0 + 1000)
    assert outcome.record is not None
    meta = outcome.record["meta"]
    assert meta["completed_late"] is True
    assert meta["late"] == {"code": "DEADLINE_EXCEEDED", "deadline": format_ts(T0),
                            "completed_at": format_ts(T0 + 1000)}
    assert events(outcome, "metering.task_completed")[0]["completed_late"] is True
    # Under the default §22.3 tolerance the same completion is punctual.
    punctual = apply_update(record, update(payload={"status": "completed"}, at=T0 + 1000),
                            task_id="t1", received_ms=T0 + 1000, now_ms=T0 + 1000)
    assert punctual.record is not None and "completed_late" not in punctual.record["meta"]


def test_cancellation_receipt_without_note_and_with_pending_stranded_check() -> None:
    record, _ = run(update(payload={"status": "working"}))
    outcome = fold(record, update(REQUESTER, {"status": "canceled", "reason": "policy", "note": "secret"}))
    assert outcome.record is not None
    meta = outcome.record["meta"]
    assert meta["cancel_reason"] == "policy" and meta["note"] == "secret"
    assert meta["stranded_check"] == "pending"
    receipt = events(outcome, "metering.task_canceled")[0]
    assert receipt["cancel_reason"] == "policy" and receipt["status"] == "canceled"
    assert "note" not in receipt and "completed_late" not in receipt and "canceled_at" in receipt
    assert [e["meter"] for e in events(outcome, "metering.usage")] == ["task_ms"]


@pytest.mark.parametrize(
    ("fields", "needs", "attribution"),
    [
        ({"reason": "needs_not_furnished", "unmet_need": "credential:Salesforce"}, ["Salesforce"], "client"),
        ({"reason": "needs_not_furnished", "unmet_need": "credential:Salesforce"}, ["Stripe"], "provider"),
        ({"reason": "needs_not_furnished", "unmet_need": "credential:Salesforce"}, None, "provider"),
        ({"reason": "dependency_failed", "dependency": "X", "attribution": "client"}, ["Salesforce"], "provider"),
        ({"attribution": "client"}, ["Salesforce"], "provider"),
    ],
)
def test_failure_attribution_is_computed_from_the_declared_needs(
    fields: dict[str, Any], needs: list[str] | None, attribution: str
) -> None:
    manifest = None if needs is None else {
        "offerings": [{"id": "o", "needs": [{"credential": n} for n in needs]},
                      {"id": "other", "needs": [{"credential": "Salesforce"}]}],
    }
    record, _ = run(update(payload={"status": "working", "offering": "o"}))
    outcome = fold(record, update(payload={"status": "failed", **fields}),
                   manifest_of=lambda agent: manifest if agent == RESPONDER.public_key else None)
    failed = events(outcome, "task.failed")
    assert len(failed) == 1 and failed[0]["attribution"] == attribution
    assert outcome.record is not None and outcome.record["meta"]["attribution"] == attribution


def test_attribution_fails_closed_when_the_lookup_fails() -> None:
    def broken(agent: str) -> dict[str, Any]:
        raise RuntimeError("registry down")

    record, _ = run(update(payload={"status": "working"}))
    outcome = fold(record, update(payload={"status": "failed", "reason": "needs_not_furnished",
                                           "unmet_need": "file:text/csv"}), manifest_of=broken)
    assert events(outcome, "task.failed")[0]["attribution"] == "provider"


# --- budget revisions ---------------------------------------------------------------------------------


def test_budget_revisions() -> None:
    far = format_ts(T0 + 3_600_000)
    record, _ = run(update(payload={"status": "working"}, budget={"revision": 0, "deadline": far}))
    revised = fold(record, update(REQUESTER, {"budget": {"revision": 1, "deadline": far}}))
    assert revised.verdict is Verdict.REVISED and revised.record is not None
    assert revised.record["budget"]["revision"] == 1
    record = revised.record
    by_envelope = fold(record, update(payload={}, budget={"revision": 2, "deadline": far}))
    assert by_envelope.verdict is Verdict.REVISED
    assert fold(record, update(STRANGER, {"budget": {"revision": 5, "deadline": far}})).verdict is Verdict.REFUSED
    assert fold(record, update(REQUESTER, {"budget": {"revision": 1, "deadline": far}})).code == \
        "TASK_INVALID_TRANSITION"
    past = {"revision": 2, "deadline": format_ts(T0 - 3_600_000)}
    assert fold(record, update(REQUESTER, {"budget": past})).code == "TASK_INVALID_TRANSITION"
    assert fold(record, update(REQUESTER, {"budget": {"revision": 2}})).code == "INVALID_ENVELOPE"
    spent, _ = run(update(payload={"status": "working", "cost": {"amount_micro": 10, "currency": "USD"}}))
    below = {"revision": 1, "cost_ceiling": {"amount_micro": 5, "currency": "USD"}}
    assert fold(spent, update(REQUESTER, {"budget": below})).code == "TASK_INVALID_TRANSITION"
    ended, _ = run(update(payload={"status": "working"}), update(payload={"status": "completed"}))
    assert fold(ended, update(REQUESTER, {"budget": {"revision": 1, "deadline": far}})).code == \
        "TASK_INVALID_TRANSITION"


# --- the central clock and stranded delegates -------------------------------------------------------------


def test_overdue_mark() -> None:
    record, _ = run(update(payload={"status": "input_required"}, context_id="c",
                           budget={"revision": 0, "deadline": format_ts(T0)}))
    assert mark_overdue(record, now_ms=T0 + 999, settings=NO_TOLERANCE).verdict is Verdict.UNCHANGED
    outcome = mark_overdue(record, now_ms=T0 + 1000, settings=NO_TOLERANCE)
    assert outcome.verdict is Verdict.APPLIED and outcome.record is not None
    assert outcome.record["meta"]["overdue"] is True
    assert outcome.notice == {"status": "input_required", "overdue": True, "deadline": format_ts(T0),
                              "overdue_at": format_ts(T0 + 1000)}
    assert events(outcome, "task.overdue")[0]["context_id"] == "c"
    assert mark_overdue(outcome.record, now_ms=T0 + 5000, settings=NO_TOLERANCE).verdict is Verdict.UNCHANGED
    assert mark_overdue(None, now_ms=T0).verdict is Verdict.UNCHANGED
    ended, _ = run(update(payload={"status": "working"}, budget={"revision": 0, "deadline": format_ts(T0)}),
                   update(payload={"status": "completed"}))
    assert mark_overdue(ended, now_ms=T0 + 10_000, settings=NO_TOLERANCE).verdict is Verdict.UNCHANGED


def _task(task_id: str, requester: KeyPair, responder: KeyPair, context: str | None, *statuses: str) -> dict[str, Any]:
    steps = [update(responder, {"status": s, **({"reason": "user_requested"} if s == "canceled" else {})},
                    task_id=task_id, to=requester, context_id=context) for s in statuses]
    record, _ = run(*steps)
    return record


def test_stranded_flags_and_the_parents_check() -> None:
    delegate = KeyPair.generate(Prefix.USER)
    parent = _task("p", REQUESTER, RESPONDER, "c", "working", "canceled")
    child = _task("c1", RESPONDER, delegate, "c", "working")
    stranger_child = _task("c2", STRANGER, delegate, "c", "working")
    elsewhere = _task("c3", RESPONDER, delegate, "other", "working")
    ended = _task("c4", RESPONDER, delegate, "c", "working", "completed")

    flagged = flag_stranded(child, parent, now_ms=T0)
    assert flagged.verdict is Verdict.APPLIED and flagged.record is not None
    assert flagged.record["meta"]["stranded"] is True
    assert events(flagged, "task.stranded")[0]["parent_cancel_reason"] == "user_requested"
    assert flag_stranded(flagged.record, parent, now_ms=T0).verdict is Verdict.UNCHANGED
    for other in (stranger_child, elsewhere, ended, None):
        assert flag_stranded(other, parent, now_ms=T0).verdict is Verdict.UNCHANGED

    closed = finish_stranded_check(parent, ["c1"], now_ms=T0)
    assert closed.record is not None and closed.record["meta"]["stranded_check"] == "done"
    assert closed.record["meta"]["stranded_children"] == ["c1"]
    assert finish_stranded_check(closed.record, [], now_ms=T0).verdict is Verdict.UNCHANGED

    entries = [e for e in map(index_entry, (parent, child, stranger_child, elsewhere, ended)) if e is not None]
    assert {e.task_id for e in entries} == {"p", "c1", "c2", "c3"}  # the completed child is of no interest
    due = stranded_due(entries, now_ms=T0 + 10, grace_ms=0)
    assert [(p.task_id, [c.task_id for c in cs]) for p, cs in due] == [("p", ["c1"])]
    assert stranded_due(entries, now_ms=T0, grace_ms=30_000) == []
    assert index_entry(closed.record) is None


def test_overdue_due_reads_the_index() -> None:
    due_now = _task("a", REQUESTER, RESPONDER, None, "working")
    due_now["budget"] = {"revision": 0, "deadline": format_ts(T0)}
    later = dict(due_now, id="b", budget={"revision": 0, "deadline": format_ts(T0 + 60_000)})
    marked = dict(due_now, id="c", meta={"overdue": True})
    entries = [e for e in map(index_entry, (due_now, later, marked, {"garbage": 1}, None)) if e is not None]
    assert overdue_due(entries, now_ms=T0 + 1000, tolerance_ms=0) == ["a"]


def test_fit_record_drops_the_oldest_history_to_fit() -> None:
    record, _ = run(*[update(payload={"status": "working", "message": "x" * 200}, at=T0 + i) for i in range(10)])
    last = record["history"][-1]["id"]

    def encode(value: Any) -> bytes:
        return json.dumps(value).encode()

    full = len(encode(record))
    data = fit_record(record, full - 500, encode)
    assert len(data) <= full - 500
    assert record["meta"]["history_dropped"] >= 1 and record["history"][-1]["id"] == last
    with pytest.raises(ValueError):
        fit_record(record, 100, encode)
