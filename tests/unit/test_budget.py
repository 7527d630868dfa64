"""The budget (§7.7, §19.3): blocks, deadlines, admission, revisions, the exhausted pause."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnode.protocol.budget import (
    DEADLINE_GRANULARITY_MS,
    DEADLINE_SKEW_TOLERANCE_MS,
    Budget,
    BudgetInvalid,
    Money,
    apply_revision,
    budget_exhausted_error,
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
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.timeutil import parse_rfc3339_ms
from tests.conftest import load_fixture

REQ = "UBMBH4BK6EIHQFVMHLSABFSQXB3JXUFZOXVZQTIERO33AD4HHAI3D7QP"
RESP = "UAKQRYZBYFOC65OQZVJ3QPCIERDTRNNZPMOJUYXC3DGPRCDWSKD4HV5A"
T15 = parse_rfc3339_ms("2026-07-27T15:00:00Z")
T16 = parse_rfc3339_ms("2026-07-27T16:00:00Z")
USD = "USD"


def raises(code: str, call: Callable[[], object]) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        call()
    assert info.value.code == code, info.value
    return info.value


# --- blocks --------------------------------------------------------------------


def test_valid_blocks_round_trip() -> None:
    block = {"deadline": "2026-07-27T16:00:00Z", "revision": 0, "cost_ceiling": {"amount_micro": 4_000_000, "currency": USD}}
    budget = parse_budget(block)
    assert budget == Budget(0, "2026-07-27T16:00:00Z", T16, Money(4_000_000, USD))
    assert budget.to_object() == block
    only_money = parse_budget({"revision": 2, "cost_ceiling": {"amount_micro": 0, "currency": "EUR"}})
    assert only_money.deadline is None and only_money.deadline_ms is None
    assert only_money.to_object() == {"revision": 2, "cost_ceiling": {"amount_micro": 0, "currency": "EUR"}}
    offset = parse_budget({"deadline": "2026-07-27T11:00:00-05:00", "revision": 1})
    assert offset.deadline_ms == T16 and offset.deadline == "2026-07-27T11:00:00-05:00"
    # Unknown members are ignored, not refused.
    assert parse_budget({"revision": 0, "deadline": "2026-07-27T16:00:00Z", "x": 1}).revision == 0


@pytest.mark.parametrize(
    ("block", "reason", "member"),
    [
        ({"revision": 0}, "no_axes", "budget"),
        ({"deadline": "2026-07-27T16:00:00Z"}, "missing_revision", "revision"),
        ({"revision": "0", "deadline": "2026-07-27T16:00:00Z"}, "bad_revision", "revision"),
        ({"revision": True, "deadline": "2026-07-27T16:00:00Z"}, "bad_revision", "revision"),
        ({"revision": 1.5, "deadline": "2026-07-27T16:00:00Z"}, "float_revision", "revision"),
        ({"revision": 1.0, "deadline": "2026-07-27T16:00:00Z"}, "float_revision", "revision"),
        ({"revision": -1, "deadline": "2026-07-27T16:00:00Z"}, "negative_revision", "revision"),
        ({"revision": 0, "deadline": "2026-07-27"}, "date_only_deadline", "deadline"),
        ({"revision": 0, "deadline": "2026-07-27T16:00:00"}, "bad_deadline", "deadline"),
        ({"revision": 0, "deadline": 1785168000}, "bad_deadline", "deadline"),
        ({"revision": 0, "deadline": None, "cost_ceiling": {"amount_micro": 1, "currency": USD}}, "null_axis", "deadline"),
        ({"revision": 0, "cost_ceiling": None, "deadline": "2026-07-27T16:00:00Z"}, "null_axis", "cost_ceiling"),
        ({"revision": 0, "cost_ceiling": {"amount_micro": 2.5, "currency": USD}}, "float_money", "cost_ceiling.amount_micro"),
        ({"revision": 0, "cost_ceiling": {"amount_micro": -1, "currency": USD}}, "negative_money", "cost_ceiling.amount_micro"),
        ({"revision": 0, "cost_ceiling": {"amount_micro": 100}}, "missing_currency", "cost_ceiling.currency"),
        ({"revision": 0, "cost_ceiling": {"amount_micro": 100, "currency": "usd"}}, "bad_currency", "cost_ceiling.currency"),
        ({"revision": 0, "cost_ceiling": {"currency": USD}}, "bad_cost_ceiling", "cost_ceiling.amount_micro"),
        ({"revision": 0, "cost_ceiling": "4 USD"}, "bad_cost_ceiling", "cost_ceiling"),
        ("not an object", "not_an_object", "budget"),
    ],
)
def test_invalid_blocks_name_their_reason(block: Any, reason: str, member: str) -> None:
    exc = raises("INVALID_ENVELOPE", lambda: parse_budget(block))
    assert exc.details == {"reason": reason, "member": member}
    assert BudgetInvalid(reason).value == reason
    assert not exc.retryable


def test_fixture_blocks() -> None:
    fixture = load_fixture("budget.ts-sdk.json")
    for block in fixture["block"]["valid"]:
        assert parse_budget(block).to_object() == block
    for case in fixture["block"]["invalid"]:
        exc = raises("INVALID_ENVELOPE", partial(parse_budget, case["block"]))
        assert exc.details["reason"] == case["case"]


@given(st.integers(min_value=0, max_value=2**53 - 1), st.sampled_from(["USD", "EUR", "JPY"]))
def test_money_round_trips(amount: int, currency: str) -> None:
    money = parse_money({"amount_micro": amount, "currency": currency})
    assert money.to_object() == {"amount_micro": amount, "currency": currency}


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_floats_never_touch_money(amount: float) -> None:
    with pytest.raises(ProtocolError):
        parse_money({"amount_micro": amount, "currency": USD})


# --- deadlines -------------------------------------------------------------------


def test_deadline_boundaries() -> None:
    assert DEADLINE_SKEW_TOLERANCE_MS == 300_000 and DEADLINE_GRANULARITY_MS == 1_000
    assert not deadline_passed(T16, T16 - 1_000)
    assert not deadline_passed(T16, T16)
    assert not deadline_passed(T16, T16 + 299_000)
    assert not deadline_passed(T16, T16 + 300_000)  # inclusive bound
    assert not deadline_passed(T16, T16 + 300_999)  # not yet a full second beyond it
    assert deadline_passed(T16, T16 + 301_000)
    assert deadline_passed(T16, T16 + 1, tolerance_ms=0, granularity_ms=1)


def test_fixture_deadline_cases() -> None:
    fixture = load_fixture("budget.ts-sdk.json")["deadline"]
    for case in fixture["cases"]:
        got = deadline_passed(parse_rfc3339_ms(case["deadline"]), parse_rfc3339_ms(case["now"]))
        assert got is case["past"], case


@given(st.integers(min_value=-10**6, max_value=10**6))
def test_deadline_passed_is_monotonic(offset: int) -> None:
    if deadline_passed(T16, T16 + offset):
        assert deadline_passed(T16, T16 + offset + 1)
    else:
        assert not deadline_passed(T16, T16 + offset - 1)


def test_is_late() -> None:
    budget = parse_budget({"revision": 0, "deadline": "2026-07-27T16:00:00Z"})
    assert is_late(budget, T16 + 301_000)
    assert not is_late(budget, T16)
    assert not is_late(None, T16 + 10**9)
    assert not is_late(parse_budget({"revision": 0, "cost_ceiling": {"amount_micro": 1, "currency": USD}}), T16 + 10**9)


# --- admission ----------------------------------------------------------------------

OFFER = parse_budget({"revision": 0, "deadline": "2026-07-27T16:00:00Z", "cost_ceiling": {"amount_micro": 2_000_000, "currency": USD}})


def test_admission_admits_within_budget() -> None:
    check_admission(None, T15)
    check_admission(OFFER, T15)
    check_admission(OFFER, T15, price=Money(2_000_000, USD))  # equality admits
    check_admission(OFFER, T15, earliest_completion_ms=T16)
    check_admission(parse_budget({"revision": 0, "deadline": "2026-07-27T16:00:00Z"}), T15, price=Money(10**9, USD))


def test_past_deadline_is_refused_automatically() -> None:
    exc = raises("DEADLINE_UNMEETABLE", lambda: check_admission(OFFER, T16 + 301_000))
    assert set(exc.details) == {"earliest_completion"}
    assert parse_rfc3339_ms(exc.details["earliest_completion"]) == T16 + 301_000
    exc = raises(
        "DEADLINE_UNMEETABLE",
        lambda: check_admission(OFFER, T16 + 400_000, earliest_completion_ms=T16 + 900_000),
    )
    assert parse_rfc3339_ms(exc.details["earliest_completion"]) == T16 + 900_000


def test_price_over_ceiling_or_other_currency_is_insufficient() -> None:
    exc = raises("BUDGET_INSUFFICIENT", lambda: check_admission(OFFER, T15, price=Money(2_000_001, USD)))
    assert exc.details == {"estimate": {"amount_micro": 2_000_001, "currency": USD}}
    exc = raises("BUDGET_INSUFFICIENT", lambda: check_admission(OFFER, T15, price=Money(1, "EUR")))
    assert exc.details["estimate"]["currency"] == "EUR"


def test_estimate_past_the_deadline_is_unmeetable() -> None:
    exc = raises("DEADLINE_UNMEETABLE", lambda: check_admission(OFFER, T15, earliest_completion_ms=T16 + 3_600_000))
    assert exc.details["earliest_completion"] == "2026-07-27T17:00:00.000Z"


def test_refusal_builders() -> None:
    assert budget_insufficient(Money(5, USD)).to_object() == {
        "code": "BUDGET_INSUFFICIENT",
        "message": "the work cannot be done within the offered cost ceiling",
        "retryable": False,
        "details": {"estimate": {"amount_micro": 5, "currency": USD}},
    }
    assert deadline_unmeetable(T16).details == {"earliest_completion": "2026-07-27T16:00:00.000Z"}


# --- revisions --------------------------------------------------------------------------


def test_apply_revision_strictly_greater_wins_whole() -> None:
    r0 = OFFER
    r2 = parse_budget({"revision": 2, "cost_ceiling": {"amount_micro": 6_000_000, "currency": USD}})
    r1 = parse_budget({"revision": 1, "deadline": "2026-07-27T15:40:00Z"})
    assert apply_revision(None, r0) is r0
    assert apply_revision(r0, r2) is r2
    assert apply_revision(r2, r1) is r2  # lower: ignored
    again = parse_budget({"revision": 2, "cost_ceiling": {"amount_micro": 9, "currency": USD}})
    assert apply_revision(r2, again) is r2  # equal: first writer wins
    assert apply_revision(r0, r2).deadline is None  # nothing inherited from revision 0


@given(st.lists(st.integers(min_value=0, max_value=20), min_size=1, max_size=15))
def test_fold_keeps_the_first_highest_revision(revisions: list[int]) -> None:
    blocks = [parse_budget({"revision": r, "cost_ceiling": {"amount_micro": i, "currency": USD}}) for i, r in enumerate(revisions)]
    current: Budget | None = None
    for block in blocks:
        current = apply_revision(current, block)
    assert current is not None
    top = max(revisions)
    assert current.revision == top
    assert current.cost_ceiling == Money(revisions.index(top), USD)


def revise(block: Any, **overrides: Any) -> Budget:
    kwargs: dict[str, Any] = {
        "sender": REQ,
        "requester": REQ,
        "responder": RESP,
        "task_state": "input_required",
        "current": OFFER,
        "block": block,
        "now_ms": T15,
    }
    kwargs.update(overrides)
    return check_revision(**kwargs)


RAISE = {"revision": 1, "deadline": "2026-07-27T16:00:00Z", "cost_ceiling": {"amount_micro": 6_000_000, "currency": USD}}


def test_revision_accepted_from_either_party() -> None:
    assert revise(RAISE).revision == 1
    assert revise(RAISE, sender=RESP).cost_ceiling == Money(6_000_000, USD)
    assert revise(RAISE, current=None).revision == 1
    assert revise(RAISE, spent=Money(6_000_000, USD)).revision == 1  # at the ceiling is not over it


def test_revision_refusals_in_order() -> None:
    raises("INVALID_ENVELOPE", lambda: revise({"revision": 1}, sender="someone else"))
    raises("UNAUTHORIZED", lambda: revise(RAISE, sender="UOTHER"))
    for terminal in ("completed", "failed", "canceled", "rejected", "exhausted"):
        raises("TASK_INVALID_TRANSITION", partial(revise, RAISE, task_state=terminal))
    exc = raises("TASK_INVALID_TRANSITION", lambda: revise({**RAISE, "revision": 0}))
    assert exc.details == {"revision": 0, "current_revision": 0}
    raises("TASK_INVALID_TRANSITION", lambda: revise(RAISE, now_ms=T16 + 301_000))
    raises("TASK_INVALID_TRANSITION", lambda: revise(RAISE, spent=Money(6_000_001, USD)))
    raises("TASK_INVALID_TRANSITION", lambda: revise(RAISE, spent=Money(1, "EUR")))


def test_revision_without_deadline_is_not_retroactive() -> None:
    money_only = {"revision": 3, "cost_ceiling": {"amount_micro": 7, "currency": USD}}
    assert revise(money_only, now_ms=T16 + 10**9).deadline is None


# --- the pause ------------------------------------------------------------------------------


def test_budget_exhausted_pause_shape() -> None:
    pause = budget_exhausted_pause(Money(900_000, USD), Money(2_500_000, USD))
    assert pause["payload"] == {"status": "input_required"}
    error = pause["error"]
    assert error["code"] == "BUDGET_EXHAUSTED" and error["retryable"] is False
    assert error["details"] == {
        "spent": {"amount_micro": 900_000, "currency": USD},
        "estimate_to_finish": {"amount_micro": 2_500_000, "currency": USD},
    }
    assert budget_exhausted_error(Money(1, USD), Money(2, USD))["details"]["spent"]["amount_micro"] == 1
