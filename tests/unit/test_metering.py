"""Meter events, usage receipts and task receipts (§13.5, §19.2): pure shapes."""

from __future__ import annotations

from typing import Any

import pytest

from meshnode.protocol.metering import (
    OBSERVED_METERS,
    MeterClass,
    UsageEntry,
    fold_meter_events,
    is_meter_name,
    is_valid_meter_event,
    meter_event,
    meter_event_problems,
    parse_usage_report,
    task_receipt,
)
from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.protocol.timeutil import format_ts

PROVIDER = KeyPair.generate(Prefix.USER).public_key
CONSUMER = KeyPair.generate(Prefix.USER).public_key
T0 = 1_800_000_000_000


def event(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "meter": "tokens_out", "class": "declared", "quantity": 4, "provider": PROVIDER,
        "consumer": CONSUMER, "envelope_id": "e1", "ts": format_ts(T0),
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def test_meter_names() -> None:
    assert is_meter_name("tokens_out") and is_meter_name("a" * 64)
    for bad in ("", "a" * 65, "Tokens", "tokens-out", 3, None):
        assert not is_meter_name(bad)
    assert "task_ms" in OBSERVED_METERS and "tokens_out" not in OBSERVED_METERS


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"quantity": -1}, "negative_quantity"),
        ({"quantity": 1.5}, "float_quantity"),
        ({"quantity": True}, "missing_quantity"),
        ({"envelope_id": None}, "missing_envelope_id"),
        ({"consumer": None}, "missing_consumer"),
        ({"provider": "not a key"}, "missing_provider"),
        ({"meter": "requests"}, "declared_using_observed_name"),
        ({"class": "estimated"}, "unknown_class"),
        ({"class": "observed"}, "undeclared_observed_meter"),
        ({"meter": "Bad"}, "bad_meter"),
        ({"ts": "yesterday"}, "bad_ts"),
        ({"task_id": ""}, "bad_task_id"),
        ({"refused": True, "refusal_code": "BUDGET_INSUFFICIENT"}, "refusal_with_quantity"),
        ({"meter": "requests", "class": "observed", "quantity": 0, "refused": True}, "refusal_without_code"),
        ({"refusal_code": "X"}, "refusal_code_without_refused"),
    ],
)
def test_meter_event_problems(overrides: dict[str, Any], problem: str) -> None:
    assert problem in meter_event_problems(event(**overrides))


def test_valid_events_and_the_builder() -> None:
    assert is_valid_meter_event(event())
    assert meter_event_problems("nope") == ["not_an_object"]
    built = meter_event("task_ms", MeterClass.OBSERVED, 10, provider=PROVIDER, consumer=CONSUMER,
                        envelope_id="e", ts_ms=T0, task_id="t", offering=None)
    assert built == {"meter": "task_ms", "class": "observed", "quantity": 10, "provider": PROVIDER,
                     "consumer": CONSUMER, "task_id": "t", "envelope_id": "e", "ts": format_ts(T0)}
    refusal = meter_event("requests", "observed", 0, provider=PROVIDER, consumer=CONSUMER, envelope_id="e",
                          ts_ms=T0, refusal_code="AGREEMENT_REQUIRED")
    assert refusal["refused"] is True and is_valid_meter_event(refusal)
    with pytest.raises(ValueError, match="declared_using_observed_name"):
        meter_event("requests", "declared", 1, provider=PROVIDER, consumer=CONSUMER, envelope_id="e", ts_ms=T0)


def test_the_fold_deduplicates_on_meter_and_envelope_id() -> None:
    events = [
        {"meter": "tokens_out", "envelope_id": "E1", "quantity": 4210},
        {"meter": "tokens_out", "envelope_id": "E1", "quantity": 4210},
        {"meter": "tool_calls", "envelope_id": "E1", "quantity": 3},
        {"meter": "tokens_out", "envelope_id": "E2", "quantity": 1000},
        {"meter": "tokens_out", "envelope_id": "E2", "quantity": 999},
    ]
    assert fold_meter_events(events) == {"tokens_out": 5210, "tool_calls": 3}


def test_usage_reports_keep_valid_declared_entries() -> None:
    entries, complaints = parse_usage_report([
        {"meter": "tokens_out", "quantity": 4210},
        {"meter": "tool_calls", "quantity": 3},
        {"meter": "requests", "quantity": 1},
        {"meter": "model_ms", "quantity": 1.5},
        {"meter": "tokens_out", "quantity": 1},
        {"meter": "BAD", "quantity": 1},
        "garbage",
    ])
    assert entries == [UsageEntry("tokens_out", 4210), UsageEntry("tool_calls", 3)]
    assert len(complaints) == 5
    assert parse_usage_report({"tokens_out": 1}) == ([], ["usage must be an array of {meter, quantity}"])


def test_task_receipts() -> None:
    completed = task_receipt("completed", task_id="t", requester=CONSUMER, responder=PROVIDER,
                             started_ms=T0, ended_ms=T0 + 1234, offering="o",
                             cost={"amount_micro": 1, "currency": "USD"}, budget={"revision": 2}, completed_late=True)
    assert list(completed) == ["task_id", "requester", "responder", "offering", "started_at", "completed_at",
                               "duration_ms", "cost", "budget", "completed_late", "status"]
    assert completed["duration_ms"] == 1234 and completed["completed_late"] is True
    canceled = task_receipt("canceled", task_id="t", requester=CONSUMER, responder=PROVIDER,
                            started_ms=T0, ended_ms=T0 + 5, cancel_reason="superseded")
    assert canceled == {"task_id": "t", "requester": CONSUMER, "responder": PROVIDER,
                        "started_at": format_ts(T0), "canceled_at": format_ts(T0 + 5), "duration_ms": 5,
                        "cancel_reason": "superseded", "status": "canceled"}
    with pytest.raises(ValueError):
        task_receipt("canceled", task_id="t", requester=CONSUMER, responder=PROVIDER, started_ms=T0, ended_ms=T0)
    with pytest.raises(ValueError):
        task_receipt("failed", task_id="t", requester=CONSUMER, responder=PROVIDER,  # type: ignore[arg-type]
                     started_ms=T0, ended_ms=T0)
