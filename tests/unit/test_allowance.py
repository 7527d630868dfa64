"""The owner allowance (EXT-8): documents, metering, precedence, fail-closed policy.

The fixture cases run in the conformance runner (conformance/checks/allowance.py);
these are the edges around them and the arithmetic's properties.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnode.protocol.allowance import (
    Ceiling,
    CeilingStanding,
    CostModel,
    OnExhausted,
    Scope,
    SpendLedger,
    Verdict,
    binding_ceiling,
    ceiling_applies,
    day_of,
    decide,
    load_allowance,
    make_allowance,
    meter_cost,
    parse_allowance,
    verify_allowance,
)
from meshnode.protocol.budget import Money
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.timeutil import parse_rfc3339_ms

OWNER = KeyPair.from_seed("SUAEGDPNTWXACIF45CA23BUY36RIMWZXW5LEHSEOK2ONS5JWJ7PBC2EWBA")
AGENT = "UAKQRYZBYFOC65OQZVJ3QPCIERDTRNNZPMOJUYXC3DGPRCDWSKD4HV5A"
NOW = parse_rfc3339_ms("2026-07-28T15:00:00Z")
USD = CostModel(1500, "USD")


def raises(code: str, call: Callable[[], object]) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        call()
    assert info.value.code == code, info.value
    return info.value


def document(*ceilings: Ceiling, on_exhausted: OnExhausted = OnExhausted.REFUSE) -> dict[str, Any]:
    return make_allowance(OWNER, agent=AGENT, cost_model=USD, ceilings=ceilings or (Ceiling(Scope.DAY, 10**6),),
                          on_exhausted=on_exhausted, updated_at_ms=NOW)


# --- documents -------------------------------------------------------------------


def test_make_and_verify_round_trip() -> None:
    doc = document(Ceiling(Scope.TASK, 0, task_id="t1"), Ceiling(Scope.CONTEXT, 5, context_id="c"))
    allowance = verify_allowance(doc, agent=AGENT)
    assert allowance.ceilings == (Ceiling(Scope.TASK, 0, "t1"), Ceiling(Scope.CONTEXT, 5, None, "c"))
    assert allowance.cost_model == USD and allowance.on_exhausted is OnExhausted.REFUSE
    assert allowance.updated_at_ms == NOW and allowance.to_object() == doc


@pytest.mark.parametrize(
    ("change", "want"),
    [
        ({"v": 2}, "wrong_version"),
        ({"v": True}, "wrong_version"),
        ({"agent": "x"}, "bad_agent"),
        ({"owner_key": None}, "bad_owner_key"),
        ({"cost_model": []}, "bad_cost_model"),
        ({"cost_model": {"per_1k_tokens_micro": 1.5, "currency": "USD"}}, "float_money"),
        ({"cost_model": {"per_1k_tokens_micro": -1, "currency": "USD"}}, "negative_amount"),
        ({"cost_model": {"per_1k_tokens_micro": 1, "currency": "dollars"}}, "bad_currency"),
        ({"ceilings": []}, "missing_ceilings"),
        ({"ceilings": ["day"]}, "bad_ceiling"),
        ({"ceilings": [{"scope": "day"}]}, "bad_ceiling"),
        ({"ceilings": [{"scope": "task", "amount_micro": 1, "task_id": ""}]}, "bad_ceiling"),
        ({"ceilings": [{"scope": None, "amount_micro": 1}]}, "unknown_scope"),
        ({"on_exhausted": "ignore"}, "bad_on_exhausted"),
        ({"updated_at": "yesterday"}, "bad_updated_at"),
        ({"sig": 5}, "missing_sig"),
    ],
)
def test_shape_refusals(change: dict[str, Any], want: str) -> None:
    exc = raises("INVALID_ENVELOPE", lambda: parse_allowance(document() | change))
    assert exc.details["reason"] == want


def test_signature_and_agent_binding() -> None:
    doc = document()
    tampered = doc | {"ceilings": [{"scope": "day", "amount_micro": 10**9}]}
    assert raises("IDENTITY_MISMATCH", lambda: verify_allowance(tampered)).details["reason"] == "bad_signature"
    other = OWNER.public_key
    assert raises("IDENTITY_MISMATCH", lambda: verify_allowance(doc, agent=other)).details["reason"] == "wrong_agent"


def test_a_broken_document_fails_closed_keeping_what_it_can() -> None:
    broken = document(on_exhausted=OnExhausted.ASK_OWNER) | {"updated_at": "2026-07-28T15:00:01.000Z"}
    policy = load_allowance(broken, agent=AGENT)
    assert not policy.valid and policy.error is not None and policy.error.code == "IDENTITY_MISMATCH"
    assert policy.on_exhausted is OnExhausted.ASK_OWNER and policy.cost_model == USD
    decision = policy.admit(SpendLedger(), estimate_micro=0, task_id="t", context_id=None, now_ms=NOW)
    assert decision.verdict is Verdict.ASK_OWNER and decision.binding is None
    assert decision.estimate == Money(0, "USD")
    nothing = load_allowance("not a document")
    assert not nothing.valid and nothing.on_exhausted is OnExhausted.REFUSE and nothing.cost_model is None
    with pytest.raises(ValueError):
        nothing.admit(SpendLedger(), estimate_micro=1, task_id="t", context_id=None, now_ms=NOW)
    refused = nothing.admit(SpendLedger(), estimate_micro=1, task_id="t", context_id=None, now_ms=NOW,
                            currency="EUR")
    assert refused.verdict is Verdict.REFUSE
    assert refused.refusal().to_object()["details"] == {"estimate": {"amount_micro": 1, "currency": "EUR"}}


# --- metering ---------------------------------------------------------------------


@given(st.integers(0, 10**9), st.integers(0, 10**7))
def test_meter_cost_is_the_integer_floor(tokens: int, rate: int) -> None:
    cost = meter_cost(tokens, rate)
    assert type(cost) is int
    assert cost * 1000 <= tokens * rate < (cost + 1) * 1000


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**5))
def test_meter_cost_is_monotonic_and_never_overcharges_a_split(a: int, b: int, rate: int) -> None:
    assert meter_cost(a, rate) <= meter_cost(a + b, rate)
    # Metering two invocations apart never charges more than metering them together.
    assert meter_cost(a, rate) + meter_cost(b, rate) <= meter_cost(a + b, rate)


@pytest.mark.parametrize(("tokens", "rate"), [(1.0, 1), (-1, 1), (1, 0.5), (1, -1), (True, 1)])
def test_meter_cost_refuses_non_integers(tokens: Any, rate: Any) -> None:
    with pytest.raises(ValueError):
        meter_cost(tokens, rate)


def test_ledger_accounts_each_scope_and_the_utc_day() -> None:
    ledger = SpendLedger()
    late = parse_rfc3339_ms("2026-07-28T23:59:59.999Z")
    ledger.record(task_id="t1", context_id="c", at_ms=late, tokens=1000, cost_model=USD)
    ledger.record(task_id="t1", context_id=None, at_ms=late + 1, cost_micro=7)
    assert ledger.by_task == {"t1": 1507} and ledger.by_context == {"c": 1500}
    assert ledger.by_day == {"2026-07-28": 1500, "2026-07-29": 7} and ledger.total_micro == 1507
    assert ledger.entries[0].to_object()["tokens"] == 1000 and "context_id" not in ledger.entries[1].to_object()
    assert ledger.spent(Ceiling(Scope.DAY, 1), task_id=None, context_id=None, now_ms=late) == 1500
    assert ledger.spent(Ceiling(Scope.CONTEXT, 1), task_id="t1", context_id=None, now_ms=late) == 0
    assert day_of(late + 1) == "2026-07-29"
    with pytest.raises(ValueError):
        ledger.record(task_id="t", context_id=None, at_ms=NOW, tokens=5)
    with pytest.raises(ValueError):
        ledger.record(task_id="t", context_id=None, at_ms=NOW, cost_micro=-1)


# --- precedence -----------------------------------------------------------------------


def test_which_ceilings_apply() -> None:
    assert ceiling_applies(Ceiling(Scope.TASK, 1), task_id="t", context_id=None)
    assert not ceiling_applies(Ceiling(Scope.TASK, 1, task_id="u"), task_id="t", context_id=None)
    assert not ceiling_applies(Ceiling(Scope.CONTEXT, 1), task_id="t", context_id=None)
    assert ceiling_applies(Ceiling(Scope.CONTEXT, 1), task_id="t", context_id="c")
    assert not ceiling_applies(Ceiling(Scope.CONTEXT, 1, context_id="d"), task_id="t", context_id="c")
    assert ceiling_applies(Ceiling(Scope.DAY, 1), task_id=None, context_id=None)


def test_ties_go_to_the_more_specific_ceiling() -> None:
    day = CeilingStanding(Ceiling(Scope.DAY, 100), 0)
    task = CeilingStanding(Ceiling(Scope.TASK, 100), 0)
    binding = binding_ceiling([day, task])
    assert binding is not None and binding.scope is Scope.TASK
    assert binding_ceiling([]) is None
    assert decide([], Money(10**12, "USD")).admitted, "no applicable ceiling constrains nothing"


standing = st.builds(
    CeilingStanding,
    st.builds(Ceiling, st.sampled_from(list(Scope)), st.integers(0, 10**7)),
    st.integers(0, 2 * 10**7),
)


@given(st.lists(standing, min_size=1, max_size=6), st.integers(0, 2 * 10**7))
def test_admitted_exactly_when_every_ceiling_has_room(standings: list[CeilingStanding], estimate: int) -> None:
    decision = decide(standings, Money(estimate, "USD"), OnExhausted.ASK_OWNER)
    fits = all(estimate <= s.remaining_micro for s in standings)
    assert decision.admitted is fits
    assert decision.binding is not None
    assert decision.binding.remaining_micro == min(s.remaining_micro for s in standings)
    if not fits:
        assert decision.verdict is Verdict.ASK_OWNER


def test_a_pinned_shut_task_ceiling_only_shuts_its_task() -> None:
    policy = load_allowance(document(Ceiling(Scope.TASK, 0, task_id="t1")), agent=AGENT)
    ledger = SpendLedger()
    assert policy.admit(ledger, estimate_micro=0, task_id="t1", context_id=None, now_ms=NOW).admitted
    shut = policy.admit(ledger, estimate_micro=1, task_id="t1", context_id=None, now_ms=NOW)
    assert shut.verdict is Verdict.REFUSE and shut.binding is not None and shut.binding.remaining_micro == 0
    assert policy.admit(ledger, estimate_micro=10**9, task_id="t2", context_id=None, now_ms=NOW).admitted


def test_spend_counts_against_task_context_and_day_at_once() -> None:
    policy = load_allowance(
        document(Ceiling(Scope.TASK, 5000), Ceiling(Scope.CONTEXT, 4000), Ceiling(Scope.DAY, 3000)), agent=AGENT
    )
    ledger = SpendLedger()
    ledger.record(task_id="t", context_id="c", at_ms=NOW, cost_micro=2500)
    decision = policy.admit(ledger, estimate_micro=600, task_id="t", context_id="c", now_ms=NOW)
    assert decision.verdict is Verdict.REFUSE
    assert decision.binding is not None and decision.binding.scope is Scope.DAY
    assert decision.binding.remaining_micro == 500
    tomorrow = policy.admit(ledger, estimate_micro=600, task_id="t", context_id="c", now_ms=NOW + 86_400_000)
    assert tomorrow.admitted and tomorrow.binding is not None and tomorrow.binding.scope is Scope.CONTEXT


def test_headroom_is_the_mid_task_check() -> None:
    policy = load_allowance(document(Ceiling(Scope.TASK, 5000), Ceiling(Scope.DAY, 3000)), agent=AGENT)
    ledger = SpendLedger()
    assert policy.headroom(ledger, task_id="t", context_id=None, now_ms=NOW) == 3000
    ledger.record(task_id="t", context_id=None, at_ms=NOW, cost_micro=2900)
    assert policy.headroom(ledger, task_id="t", context_id=None, now_ms=NOW) == 100
    only_context = load_allowance(document(Ceiling(Scope.CONTEXT, 1)), agent=AGENT)
    assert only_context.headroom(ledger, task_id="t", context_id=None, now_ms=NOW) is None
    assert load_allowance({}).headroom(ledger, task_id="t", context_id=None, now_ms=NOW) == 0
