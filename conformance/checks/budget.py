"""budget.json (+ .ts-sdk): §7.7 / §19.3 blocks, signed envelope, revisions, refusals, deadlines."""

from __future__ import annotations

import copy
from functools import reduce
from typing import Any

from meshnode.protocol.budget import (
    Budget,
    Money,
    apply_revision,
    budget_exhausted_pause,
    budget_insufficient,
    check_admission,
    check_revision,
    deadline_passed,
    deadline_unmeetable,
    is_late,
    parse_budget,
    parse_money,
)
from meshnode.protocol.envelope import verify_envelope
from meshnode.protocol.errors import ERROR_CODES, ProtocolError
from meshnode.protocol.offerings import normalize_request_payload
from meshnode.protocol.timeutil import parse_rfc3339_ms

from .. import Recorder
from ._signed_envelope import check_signed_envelope

FILES = ["budget.json", "budget.ts-sdk.json"]


def _raises(code: str, call: Any) -> ProtocolError:
    try:
        call()
    except ProtocolError as exc:
        assert exc.code == code, f"got {exc.code}, want {code}"
        return exc
    raise AssertionError(f"expected {code}, nothing was raised")


def _revise(identities: dict[str, Any], current: Budget, block: Any) -> Budget:
    """A revision sent by the requester while the Task is working, judged at 15:00Z."""
    return check_revision(
        sender=identities["sender"],
        requester=identities["sender"],
        responder=identities["recipient"],
        task_state="working",
        current=current,
        block=block,
        now_ms=parse_rfc3339_ms("2026-07-27T15:00:00Z"),
    )


def run(fixture: dict[str, Any], rec: Recorder) -> None:
    identities = fixture["identities"]

    for i, block in enumerate(fixture["block"]["valid"]):
        with rec.case(f"block/valid/{i}"):
            budget = parse_budget(block)
            assert budget.to_object() == block, "a valid block must round-trip with absent axes omitted"

    for case in fixture["block"]["invalid"]:
        with rec.case(f"block/invalid/{case['case']}"):
            exc = _raises("INVALID_ENVELOPE", lambda b=case["block"]: parse_budget(b))
            assert exc.details["reason"] == case["case"], (exc.details, case["case"])

    vector = fixture["envelope"]
    check_signed_envelope(
        rec, "envelope", vector, identities["sender_seed"], tamper_path=("budget", "cost_ceiling", "currency")
    )
    with rec.case("envelope/budget_block"):
        env = vector["signed"]
        budget = parse_budget(env["budget"])
        assert budget.to_object() == env["budget"]
        assert budget.cost_ceiling == Money(2_000_000, "USD")
        # The spec copy signs payload.skill: a legacy alias read as offering (§8.5).
        payload = normalize_request_payload(env["payload"])
        assert payload["offering"] == "caselaw-summary" and "skill" not in payload
        assert env["from"] == identities["sender"] and env["to"] == identities["recipient"]

    with rec.case("envelope/changed_micro_unit_fails"):
        tampered = copy.deepcopy(vector["signed"])
        tampered["budget"]["cost_ceiling"]["amount_micro"] += 1
        _raises("IDENTITY_MISMATCH", lambda: verify_envelope(tampered))

    for name in ("ordering_case", "absolute_case"):
        case = fixture["revisions"][name]
        steps = [parse_budget(b) for b in case["applied_in_order"]]
        with rec.case(f"revisions/{name}"):
            current = reduce(apply_revision, steps[1:], steps[0])
            assert current.to_object() == case["expect_current"], current.to_object()

        with rec.case(f"revisions/{name}/task_manager"):
            # The same sequence at the task manager, from the requester, at the
            # time the request was made: lower and equal revisions are refused.
            held: Budget = steps[0]
            for block in case["applied_in_order"][1:]:
                if parse_budget(block).revision > held.revision:
                    held = _revise(identities, held, block)
                else:
                    _raises("TASK_INVALID_TRANSITION", lambda b=block, h=held: _revise(identities, h, b))
            assert held.to_object() == case["expect_current"]

    refusals = fixture["refusals"]
    with rec.case("refusals/budget_insufficient"):
        spec = refusals["budget_insufficient"]
        estimate = parse_money(spec["details"]["estimate"])
        obj = budget_insufficient(estimate).to_object()
        assert obj["code"] == spec["error_code"] and obj["details"] == spec["details"]
        assert obj["retryable"] is False
        # Through admission: a price above the offered ceiling refuses with it.
        offered = parse_budget({"revision": 0, "cost_ceiling": {"amount_micro": 2_000_000, "currency": "USD"}})
        exc = _raises(spec["error_code"], lambda: check_admission(offered, 0, price=estimate))
        assert exc.details == spec["details"]

    with rec.case("refusals/deadline_unmeetable"):
        spec = refusals["deadline_unmeetable"]
        earliest = parse_rfc3339_ms(spec["details"]["earliest_completion"])
        obj = deadline_unmeetable(earliest).to_object()
        assert obj["code"] == spec["error_code"]
        assert set(obj["details"]) == set(spec["details"]) == {"earliest_completion"}
        assert parse_rfc3339_ms(obj["details"]["earliest_completion"]) == earliest
        assert "estimate" not in obj["details"]
        offered = parse_budget({"revision": 0, "deadline": "2026-07-27T16:00:00Z"})
        exc = _raises(
            spec["error_code"],
            lambda: check_admission(
                offered, parse_rfc3339_ms("2026-07-27T15:00:00Z"), earliest_completion_ms=earliest
            ),
        )
        assert parse_rfc3339_ms(exc.details["earliest_completion"]) == earliest

    with rec.case("refusals/budget_exhausted_pause"):
        spec = refusals["budget_exhausted_pause"]
        pause = budget_exhausted_pause(
            parse_money(spec["details"]["spent"]), parse_money(spec["details"]["estimate_to_finish"])
        )
        assert pause["payload"]["status"] == spec["status"]
        assert pause["error"]["code"] == spec["error_code"]
        assert pause["error"]["details"] == spec["details"]
        assert pause["error"]["retryable"] is False

    with rec.case("refusals/deadline_exceeded_marker"):
        spec = refusals["deadline_exceeded_marker"]
        assert spec["error_code"] in ERROR_CODES and ERROR_CODES[spec["error_code"]] is False
        offered = parse_budget({"revision": 0, "deadline": "2026-07-27T16:00:00Z"})
        assert is_late(offered, parse_rfc3339_ms("2026-07-27T16:05:01Z"))
        assert not is_late(offered, parse_rfc3339_ms("2026-07-27T16:00:00Z"))

    deadline = fixture["deadline"]
    for i, case in enumerate(deadline["cases"]):
        with rec.case(f"deadline/{i}/{case['now']}"):
            deadline_ms = parse_rfc3339_ms(case["deadline"])
            now_ms = parse_rfc3339_ms(case["now"])
            got = deadline_passed(
                deadline_ms,
                now_ms,
                tolerance_ms=deadline["skew_tolerance_ms"],
                granularity_ms=deadline["granularity_ms"],
            )
            assert got is case["past"], (got, case["past"])
            # The defaults are the fixture's numbers, and admission refuses a
            # past deadline on its own.
            assert deadline_passed(deadline_ms, now_ms) is case["past"]
            offered = parse_budget({"revision": 0, "deadline": case["deadline"]})
            if case["past"]:
                _raises("DEADLINE_UNMEETABLE", lambda b=offered, n=now_ms: check_admission(b, n))
            else:
                check_admission(offered, now_ms)
