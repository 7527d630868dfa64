"""metering.json: §13.5 meters, meter events, the idempotent fold, the usage receipt; §19.2."""

from __future__ import annotations

import re
from typing import Any

from meshnode.protocol.metering import (
    METER_NAME_PATTERN,
    OBSERVED_METERS,
    fold_meter_events,
    is_valid_meter_event,
    meter_event_problems,
    parse_usage_report,
)

from .. import Recorder
from ._signed_envelope import check_signed_envelope

FILES = ["metering.json"]


def _latest(reports: list[dict[str, Any]]) -> dict[str, int]:
    """The supersede rule: the last report is the whole truth (cumulative, not additive)."""
    entries, complaints = parse_usage_report(reports[-1]["usage"])
    assert not complaints, complaints
    return {e.meter: e.quantity for e in entries}


def run(fixture: dict[str, Any], rec: Recorder) -> None:
    observed = fixture["observed_meters"]
    with rec.case("observed_meters/set"):
        assert set(observed["meters"]) == OBSERVED_METERS, sorted(OBSERVED_METERS ^ set(observed["meters"]))
    with rec.case("observed_meters/name_pattern"):
        assert observed["name_pattern"] == f"^{METER_NAME_PATTERN.pattern}$"
        for meter in observed["meters"]:
            assert re.fullmatch(METER_NAME_PATTERN, meter)

    for i, event in enumerate(fixture["event"]["valid"]):
        with rec.case(f"event/valid/{i}"):
            assert is_valid_meter_event(event), meter_event_problems(event)
    for case in fixture["event"]["invalid"]:
        with rec.case(f"event/invalid/{case['case']}"):
            problems = meter_event_problems(case["event"])
            assert case["case"] in problems, (case["case"], problems)

    idempotency = fixture["idempotency"]
    with rec.case("idempotency/fold"):
        assert fold_meter_events(idempotency["events"]) == idempotency["expect_folded"]

    receipt = fixture["receipt"]
    with rec.case("receipt/supersede"):
        case = receipt["supersede_case"]
        assert _latest(case["reports_in_order"]) == case["expect_final"]
    vector = receipt["signed_envelope"]
    check_signed_envelope(rec, "receipt/signed_envelope", vector, fixture["identities"]["sender_seed"],
                          tamper_path=("payload", "output"))
    with rec.case("receipt/signed_envelope/usage"):
        entries, complaints = parse_usage_report(vector["signed"]["payload"]["usage"])
        assert not complaints, complaints
        assert {e.meter: e.quantity for e in entries} == {"tokens_out": 4210, "tool_calls": 3}
