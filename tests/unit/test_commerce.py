"""Commerce (§19.1, §19.5, §19.6): prices, SKUs, agreements, enforcement, rating.

The fixture cases run in the conformance runner (conformance/checks/commerce.py);
these are the edges around them and the properties rating must keep.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from fractions import Fraction
from functools import partial
from typing import Any, TypedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.protocol.budget import Money
from meshnode.protocol.commerce import (
    Agreement,
    AgreementRecord,
    ChargeOutcome,
    Evidence,
    Period,
    PriceModel,
    Rater,
    Sku,
    Tier,
    agreement_applies,
    approval_url,
    check_agreement,
    ledger_totals,
    make_agreement,
    package_charge,
    parse_agreement,
    parse_price,
    parse_sku,
    parse_skus,
    per_unit_charge,
    period_key,
    public_sku,
    rate_events,
    rate_stream,
    sign_agreement,
    sku_digest,
    sku_for,
    tiered_charge,
    verify_agreement,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.timeutil import format_ts, parse_rfc3339_ms

OWNER_SEED = "SUAEGDPNTWXACIF45CA23BUY36RIMWZXW5LEHSEOK2ONS5JWJ7PBC2EWBA"
OWNER = KeyPair.from_seed(OWNER_SEED)
SELLER = "UAKQRYZBYFOC65OQZVJ3QPCIERDTRNNZPMOJUYXC3DGPRCDWSKD4HV5A"
T0 = parse_rfc3339_ms("2026-08-02T15:00:00Z")
DAY = 86_400_000
SURFACE = "https://console.example.com/agreements/approve"

PER_UNIT = {"model": "per_unit", "currency": "USD", "meter": "tokens_out", "per": 1000, "amount_micro": 1500}
TIERED = {
    "model": "tiered", "currency": "USD", "meter": "tokens_out", "per": 1000, "period": "month",
    "tiers": [{"up_to": 100000, "amount_micro": 2000}, {"up_to": 1000000, "amount_micro": 1500},
              {"amount_micro": 1000}],
}
PACKAGE = {"model": "package", "currency": "USD", "meter": "requests", "size": 100,
           "amount_micro": 250000, "period": "day"}


def raises(code: str, call: Callable[[], object]) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        call()
    assert info.value.code == code, info.value
    return info.value


def reason(call: Callable[[], object], code: str = "INVALID_MANIFEST") -> str:
    return str(raises(code, call).details["reason"])


def sku_of(price: dict[str, Any], *, sku: str = "rated", covers: Any = None, **provider: str) -> Sku:
    return parse_sku({
        "sku": sku,
        "covers": covers if covers is not None else {"agent": True},
        "price": price,
        "provider": {"id": "internal", **provider},
    })


def agreement_to(sku: Sku, *, at_ms: int = T0, **kw: Any) -> Agreement:
    return verify_agreement(make_agreement(OWNER, seller_agent=SELLER, sku=sku, agreed_at_ms=at_ms, **kw))


def event(meter: str, quantity: int, i: int, *, ts_ms: int = T0 + 3_600_000, **extra: Any) -> dict[str, Any]:
    return {
        "meter": meter,
        "class": "observed" if meter == "requests" else "declared",
        "quantity": quantity,
        "provider": SELLER,
        "consumer": OWNER.public_key,
        "envelope_id": f"env-{i}",
        "ts": format_ts(ts_ms),
        **extra,
    }


# --- prices ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("price", "want"),
    [
        ({"model": "flat", "currency": "USD", "amount_micro": 1, "meter": "requests"}, "foreign_field"),
        ({"model": "flat", "currency": "USD", "amount_micro": True}, "missing_amount"),
        ({"model": "flat", "currency": "USD"}, "missing_amount"),
        ({"model": "flat", "currency": "USD", "amount_micro": -1}, "negative_money"),
        ({"model": "flat", "amount_micro": 1}, "missing_currency"),
        ({"model": "flat", "currency": "usd", "amount_micro": 1}, "bad_currency"),
        ({"model": "per_unit", "currency": "USD", "meter": "Tokens", "amount_micro": 1}, "bad_meter"),
        (PER_UNIT | {"per": 0}, "bad_per"),
        (PER_UNIT | {"per": 10.0}, "bad_per"),
        (PER_UNIT | {"included": {"quantity": -1, "period": "day"}}, "bad_included"),
        (PER_UNIT | {"included": {"quantity": 1, "period": "week"}}, "bad_period"),
        (PACKAGE | {"size": 0}, "bad_size"),
        (PACKAGE | {"period": "year"}, "bad_period"),
        (TIERED | {"tiers": []}, "missing_tiers"),
        (TIERED | {"tiers": [{"amount_micro": 1}, {"amount_micro": 2}]}, "bad_tier"),
        (TIERED | {"tiers": [{"up_to": 1.5, "amount_micro": 1}, {"amount_micro": 2}]}, "bad_tier"),
        (TIERED | {"tiers": [{"up_to": 10, "amount_micro": 1, "x": 1}, {"amount_micro": 2}]}, "bad_tier"),
        (TIERED | {"amount_micro": 1}, "foreign_field"),
        ("free", "not_an_object"),
    ],
)
def test_price_refusals(price: Any, want: str) -> None:
    assert reason(lambda: parse_price(price)) == want


def test_prices_round_trip_and_expose_the_meter_they_rate() -> None:
    for obj in (PER_UNIT, TIERED, PACKAGE, PACKAGE | {"included": {"quantity": 10, "period": "month"}}):
        assert parse_price(obj).to_object() == obj
    flat = parse_price({"model": "flat", "currency": "XCR", "amount_micro": 0})
    assert flat.rated_meter == "requests" and not flat.is_free
    free = parse_price({"model": "free"})
    assert free.is_free and free.rated_meter is None and free.to_object() == {"model": "free"}
    assert parse_price({"model": "per_unit", "currency": "USD", "meter": "m", "amount_micro": 2}).unit_per == 1
    tiered = parse_price(TIERED)
    assert tiered.model is PriceModel.TIERED and tiered.period is Period.MONTH
    assert tiered.tiers[-1] == Tier(1000) and tiered.amount_micro is None


# --- SKUs ---------------------------------------------------------------------------


def test_sku_refusals_name_the_member() -> None:
    base = {"sku": "x", "covers": {"agent": True}, "price": {"model": "free"}, "provider": {"id": "internal"}}
    cases: list[tuple[dict[str, Any], str, str]] = [
        (base | {"sku": "x" * 65}, "bad_sku_id", "sku"),
        (base | {"covers": {"agent": False}}, "bad_covers", "covers.agent"),
        (base | {"covers": {}}, "bad_covers", "covers"),
        (base | {"covers": {"offerings": "a"}}, "bad_covers", "covers.offerings"),
        (base | {"covers": {"offerings": ["a", ""]}}, "bad_offering", "covers.offerings[1]"),
        (base | {"provider": {"id": ""}}, "bad_provider", "provider.id"),
        (base | {"provider": {"id": "stripe", "checkout_url": 3}}, "bad_provider", "provider.checkout_url"),
        (base | {"price": {"model": "free", "currency": "USD"}}, "foreign_field", "price.currency"),
    ]
    for obj, want, member in cases:
        exc = raises("INVALID_MANIFEST", partial(parse_sku, obj))
        assert (exc.details["reason"], exc.details["member"]) == (want, member)


def test_legacy_skills_cover_is_read_and_digested_as_declared() -> None:
    obj = {"sku": "old", "covers": {"skills": ["a"]}, "price": {"model": "free"}, "provider": {"id": "internal"}}
    sku = parse_sku(obj)
    assert sku.offerings == ("a",) and sku.digest == sku_digest(obj)
    assert sku.to_object() == obj


def test_unknown_members_bind_the_digest() -> None:
    obj = {"sku": "x", "covers": {"agent": True}, "price": {"model": "free"}, "provider": {"id": "internal"}}
    with_note = obj | {"note": "v2 terms"}
    assert parse_sku(with_note).digest != parse_sku(obj).digest


def test_the_manifest_list_is_unambiguous() -> None:
    def sku(name: str, covers: dict[str, Any]) -> dict[str, Any]:
        return {"sku": name, "covers": covers, "price": {"model": "free"}, "provider": {"id": "internal"}}

    assert reason(lambda: parse_skus([sku("a", {"agent": True}), sku("a", {"offerings": ["o"]})])) == "duplicate_sku"
    assert reason(lambda: parse_skus([sku("a", {"agent": True}), sku("b", {"agent": True})])) == "ambiguous_cover"
    assert reason(lambda: parse_skus([sku("a", {"offerings": ["o"]}), sku("b", {"offerings": ["p", "o"]})])) == (
        "ambiguous_cover"
    )
    exc = raises("INVALID_MANIFEST", lambda: parse_skus([sku("a", {"agent": True}), sku("B", {"agent": True})]))
    assert exc.details["member"] == "skus[1].sku"
    assert reason(lambda: parse_skus({})) == "not_an_object"


def test_most_specific_cover_wins() -> None:
    skus = parse_skus([
        {"sku": "all", "covers": {"agent": True}, "price": {"model": "free"}, "provider": {"id": "internal"}},
        {"sku": "one", "covers": {"offerings": ["summary"]}, "price": PER_UNIT, "provider": {"id": "internal"}},
    ])
    assert sku_for(skus, "summary") is skus[1]
    assert sku_for(skus, "other") is skus[0]
    assert sku_for(skus[1:], "other") is None
    assert public_sku(skus[1]) == {"sku": "one", "price": PER_UNIT, "digest": skus[1].digest}


# --- agreements ------------------------------------------------------------------------


def test_agreement_round_trip_with_expiry_and_evidence() -> None:
    sku = sku_of(PER_UNIT)
    doc = make_agreement(OWNER, seller_agent=SELLER, sku=sku, agreed_at_ms=T0, expires_at_ms=T0 + DAY,
                         evidence=Evidence("stripe", "cs_123"))
    agreement = verify_agreement(doc, consumer_owner=OWNER.public_key)
    assert agreement.sku_digest == sku.digest and agreement.evidence == Evidence("stripe", "cs_123")
    assert agreement.expires_at_ms == T0 + DAY
    assert not agreement.is_expired(T0 + DAY - 1) and agreement.is_expired(T0 + DAY)
    assert sign_agreement(doc, OWNER) == doc


@pytest.mark.parametrize(
    ("change", "want"),
    [
        ({"v": True}, "wrong_version"),
        ({"v": 1.0}, "wrong_version"),
        ({"consumer_owner": "UNOTAKEY"}, "bad_consumer_owner"),
        ({"seller_agent": None}, "bad_seller_agent"),
        ({"sku": "Caselaw"}, "bad_sku"),
        ({"sku_digest": ""}, "missing_digest"),
        ({"sku_digest": "sha256:abc"}, "bad_digest"),
        ({"agreed_at": "2026-08-02"}, "bad_agreed_at"),
        ({"expires_at": "2026-08-01T00:00:00Z"}, "bad_expires_at"),
        ({"evidence": {"ref": "x"}}, "bad_evidence"),
        ({"evidence": {"provider": "p", "ref": 3}}, "bad_evidence"),
        ({"sig": ""}, "missing_sig"),
    ],
)
def test_agreement_shape_refusals(change: dict[str, Any], want: str) -> None:
    doc = make_agreement(OWNER, seller_agent=SELLER, sku=sku_of(PER_UNIT), agreed_at_ms=T0) | change
    assert reason(lambda: parse_agreement(doc), "INVALID_ENVELOPE") == want


def test_agreement_signature_binds_every_member() -> None:
    doc = make_agreement(OWNER, seller_agent=SELLER, sku=sku_of(PER_UNIT), agreed_at_ms=T0)
    for member, value in (("sku", "other"), ("agreed_at", format_ts(T0 + 1)), ("seller_agent", OWNER.public_key)):
        exc = raises("IDENTITY_MISMATCH", partial(verify_agreement, doc | {member: value}))
        assert exc.details["reason"] == "bad_signature"
    exc = raises("IDENTITY_MISMATCH", lambda: verify_agreement(doc, consumer_owner=SELLER))
    assert exc.details["reason"] == "wrong_owner"
    unsafe = doc | {"note": 2**60}  # no canonical form: it signs nothing, and is refused as such
    assert raises("IDENTITY_MISMATCH", lambda: verify_agreement(unsafe)).details["reason"] == "bad_signature"


class _Match(TypedDict):
    """What :func:`agreement_applies` matches an agreement against, besides the time."""

    consumer_owner: str
    seller_agent: str
    sku: str
    sku_digest: str


def test_agreement_applies_only_inside_its_life() -> None:
    sku = sku_of(PER_UNIT)
    agreement = agreement_to(sku, expires_at_ms=T0 + DAY)
    want: _Match = {"consumer_owner": OWNER.public_key, "seller_agent": SELLER, "sku": sku.sku,
                    "sku_digest": sku.digest}
    assert agreement_applies(agreement, **want, at_ms=T0)
    assert agreement_applies(agreement, **want, at_ms=T0 - 300_000), "owner clock ahead within §22.3 skew"
    assert not agreement_applies(agreement, **want, at_ms=T0 - 300_001)
    assert not agreement_applies(agreement, **want, at_ms=T0 + DAY)
    revoked = AgreementRecord(agreement, revoked_at_ms=T0 + 1000)
    assert agreement_applies(revoked, **want, at_ms=T0 + 999)
    assert not agreement_applies(revoked, **want, at_ms=T0 + 1000), "revocation is prospective only"
    assert not agreement_applies(agreement, **(want | {"seller_agent": OWNER.public_key}), at_ms=T0)
    assert not agreement_applies(agreement, **(want | {"sku": "other"}), at_ms=T0)
    assert not agreement_applies(agreement, **(want | {"sku_digest": "x" * 43}), at_ms=T0)


# --- enforcement -------------------------------------------------------------------------


def test_check_agreement_refuses_paid_work_without_a_live_agreement() -> None:
    sku = sku_of(PER_UNIT, covers={"offerings": ["summary"]})
    args: dict[str, Any] = {"consumer_owner": OWNER.public_key, "seller_agent": SELLER, "approval_surface": SURFACE}
    exc = raises("AGREEMENT_REQUIRED", lambda: check_agreement([sku], "summary", agreements=[], now_ms=T0, **args))
    assert exc.details == {"sku": "rated", "sku_digest": sku.digest, "approval_url": f"{SURFACE}?sku=rated"}
    live = agreement_to(sku, expires_at_ms=T0 + DAY)
    assert check_agreement([sku], "summary", agreements=[live], now_ms=T0, **args) is sku
    raises("AGREEMENT_REQUIRED", lambda: check_agreement([sku], "summary", agreements=[live], now_ms=T0 + DAY, **args))
    revoked = AgreementRecord(live, revoked_at_ms=T0)
    raises("AGREEMENT_REQUIRED", lambda: check_agreement([sku], "summary", agreements=[revoked], now_ms=T0, **args))
    assert check_agreement([sku], "free-one", agreements=[], now_ms=T0, **args) is None


def test_free_terms_gate_only_when_asked() -> None:
    free = sku_of({"model": "free"}, terms_url="https://example.com/terms")
    args: dict[str, Any] = {"consumer_owner": OWNER.public_key, "seller_agent": SELLER, "agreements": [], "now_ms": T0}
    assert check_agreement([free], "any", **args) is free
    exc = raises("AGREEMENT_REQUIRED", lambda: check_agreement([free], "any", gate_free_terms=True, **args))
    assert exc.details["approval_url"] == "https://example.com/terms"


def test_approval_url_precedence() -> None:
    checkout = sku_of(PER_UNIT, checkout_url="https://pay.example/c/1", terms_url="https://t")
    assert approval_url(checkout, SURFACE) == "https://pay.example/c/1"
    internal = sku_of(PER_UNIT, sku="a-b")
    assert approval_url(internal, f"{SURFACE}?tenant=1") == f"{SURFACE}?tenant=1&sku=a-b"
    with pytest.raises(ValueError):
        approval_url(internal)


# --- rating arithmetic -------------------------------------------------------------------


def test_arithmetic_helpers() -> None:
    assert per_unit_charge(999, 1500, 1000) == 1498
    assert package_charge(0, 100, 5) == 0 and package_charge(1, 100, 5) == 5 and package_charge(100, 100, 5) == 5
    tiers = parse_price(TIERED).tiers
    assert tiered_charge(1_250_000, tiers, 1000) == 1_800_000
    assert tiered_charge(100_000, tiers, 1000) == 200_000
    assert tiered_charge(100_001, tiers, 1000) == 200_001
    assert tiered_charge(0, tiers, 1000) == 0
    assert period_key(Period.DAY, parse_rfc3339_ms("2026-08-31T23:59:59.999Z")) == "2026-08-31"
    assert period_key(Period.MONTH, parse_rfc3339_ms("2026-09-01T00:00:00Z")) == "2026-09"


def _exact_tiered(quantity: int, tiers: tuple[Tier, ...], per: int) -> int:
    total, lower = 0, 0
    for tier in tiers:
        upper = quantity if tier.up_to is None else min(quantity, tier.up_to)
        if upper > lower:
            total += int(Fraction((upper - lower) * tier.amount_micro, per))  # floor for non-negative
        lower = max(lower, upper)
    return total


@given(st.integers(0, 10**7), st.integers(0, 10**6), st.integers(1, 10**4))
def test_per_unit_is_the_exact_floor(quantity: int, amount: int, per: int) -> None:
    assert per_unit_charge(quantity, amount, per) == int(Fraction(quantity * amount, per))


@given(st.integers(0, 5 * 10**6))
def test_tiered_matches_the_span_definition(quantity: int) -> None:
    price = parse_price(TIERED)
    assert tiered_charge(quantity, price.tiers, 1000) == _exact_tiered(quantity, price.tiers, 1000)


def rate(sku: Sku, events: list[dict[str, Any]], *, agreements: Any = None, ceiling: Money | None = None) -> list[Any]:
    held = [agreement_to(sku)] if agreements is None else agreements
    return rate_events(events, sku=sku, consumer_owner=OWNER.public_key, agreements=held, ceiling=ceiling)


quantities = st.lists(st.integers(0, 300_000), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(quantities, st.sampled_from([PER_UNIT, TIERED, PACKAGE | {"meter": "tokens_out"},
                                    PER_UNIT | {"included": {"quantity": 5000, "period": "day"}}]))
def test_rating_replays_to_the_same_integer_charges(qs: list[int], price: dict[str, Any]) -> None:
    sku = sku_of(price)
    events = [event("tokens_out", q, i, ts_ms=T0 + i * 7 * 3_600_000) for i, q in enumerate(qs)]
    first = rate(sku, events)
    assert rate(sku, copy.deepcopy(events)) == first
    assert all(type(c.amount_micro) is int and c.amount_micro >= 0 for c in first)


@settings(max_examples=60, deadline=None)
@given(quantities, st.sampled_from([TIERED, PACKAGE | {"meter": "tokens_out"}]))
def test_aggregating_shapes_charge_the_aggregate_however_it_is_split(qs: list[int], price: dict[str, Any]) -> None:
    sku = sku_of(price)
    split = rate(sku, [event("tokens_out", q, i) for i, q in enumerate(qs)])
    whole = rate(sku, [event("tokens_out", sum(qs), 0)])
    assert sum(c.amount_micro for c in split) == sum(c.amount_micro for c in whole)


@settings(max_examples=60, deadline=None)
@given(quantities, st.integers(0, 2_000_000))
def test_the_ceiling_binds(qs: list[int], ceiling: int) -> None:
    sku = sku_of(PER_UNIT)
    events = [event("tokens_out", q, i) for i, q in enumerate(qs)]
    charges = rate(sku, events, ceiling=Money(ceiling, "USD"))
    unclamped = sum(c.amount_micro for c in rate(sku, events))
    assert sum(c.amount_micro for c in charges) == min(ceiling, unclamped)


def test_duplicates_refusals_other_meters_and_currencies_rate_to_zero() -> None:
    sku = sku_of(PER_UNIT)
    rater = Rater([agreement_to(sku)])
    kw: dict[str, Any] = {"sku": sku, "consumer_owner": OWNER.public_key}
    first = rater.rate(event("tokens_out", 1000, 1), **kw)
    assert first is not None and first.amount_micro == 1500 and first.outcome is ChargeOutcome.CHARGED
    assert rater.rate(event("tokens_out", 9000, 1), **kw) is None, "(meter, envelope_id) is the idempotency key"
    other = rater.rate(event("tool_calls", 5, 1), **kw)
    assert other is not None and other.outcome is ChargeOutcome.UNRATED_METER and other.amount_micro == 0
    refused = rater.rate(event("tokens_out", 0, 2, refused=True, refusal_code="BUDGET_INSUFFICIENT"), **kw)
    assert refused is not None and refused.outcome is ChargeOutcome.REFUSED
    eur = rater.rate(event("tokens_out", 1000, 3), ceiling=Money(10**9, "EUR"), interaction="t", **kw)
    assert eur is not None and eur.outcome is ChargeOutcome.CEILING_CURRENCY and eur.amount_micro == 0
    nobody = rater.rate(event("tokens_out", 1000, 4), sku=sku, consumer_owner=None)
    assert nobody is not None and nobody.outcome is ChargeOutcome.NO_AGREEMENT
    free = rate(sku_of({"model": "free"}), [event("requests", 1, 5)])
    assert free[0].outcome is ChargeOutcome.FREE and free[0].amount_micro == 0


def test_ceilings_bind_per_interaction() -> None:
    sku = sku_of(PER_UNIT)
    rater = Rater([agreement_to(sku)])
    kw: dict[str, Any] = {"sku": sku, "consumer_owner": OWNER.public_key, "ceiling": Money(2000, "USD")}
    a1 = rater.rate(event("tokens_out", 1000, 1, task_id="a"), **kw)
    a2 = rater.rate(event("tokens_out", 1000, 2, task_id="a"), **kw)
    b1 = rater.rate(event("tokens_out", 1000, 3, task_id="b"), **kw)
    assert a1 and a2 and b1
    assert (a1.amount_micro, a2.amount_micro, b1.amount_micro) == (1500, 500, 1500)
    assert a2.outcome is ChargeOutcome.CLAMPED and a2.computed_micro == 1500
    assert rater.spent("a") == 2000 and rater.spent("b") == 1500


def test_included_resets_each_period_and_new_terms_start_fresh() -> None:
    price = PER_UNIT | {"included": {"quantity": 1000, "period": "day"}}
    sku = sku_of(price)
    events = [event("tokens_out", 1500, 0), event("tokens_out", 1500, 1, ts_ms=T0 + DAY)]
    charges = rate(sku, events)
    assert [c.amount_micro for c in charges] == [750, 750]
    covered = rate(sku, [event("tokens_out", 400, 0)])
    assert covered[0].outcome is ChargeOutcome.INCLUDED

    # The seller re-prices; the owner re-approves; the month's tiers restart under the new digest.
    old, new = sku_of(TIERED), sku_of(TIERED | {"currency": "EUR"})
    rater = Rater([agreement_to(old), agreement_to(new)])
    rater.rate(event("tokens_out", 100_000, 0), sku=old, consumer_owner=OWNER.public_key)
    fresh = rater.rate(event("tokens_out", 1000, 1), sku=new, consumer_owner=OWNER.public_key)
    assert fresh is not None and fresh.amount_micro == 2000, "first-tier rate again under new terms"


def test_forgetting_lines_lets_go_of_the_state_only_they_needed() -> None:
    """A rating service lets go of the lines whose events its stream discarded
    (the ledger's horizon): the fold forgets their duplicate keys, the spend
    of interactions only they belonged to and the periods before the oldest
    line it keeps, and keeps what the held lines' interactions and periods need."""
    sku = sku_of(PER_UNIT | {"included": {"quantity": 1000, "period": "day"}})
    rater = Rater([agreement_to(sku)])
    kw: dict[str, Any] = {"sku": sku, "consumer_owner": OWNER.public_key, "ceiling": Money(10**9, "USD")}
    plan = [("a", 0), ("b", 0), ("b", DAY), ("c", DAY), ("c", 2 * DAY)]  # (interaction, day offset)
    events = [event("tokens_out", 1500, i, ts_ms=T0 + at, task_id=task) for i, (task, at) in enumerate(plan)]
    lines = [rater.rate(e, **kw) for e in events]
    assert all(lines) and rater.spent("a") == 750 and rater.spent("b") == 2250 + 750  # day 0 included 1000 once
    whole = rater.state_size()

    # The first day's events leave: "a" is forgotten, "b" is kept (a later line of it is held).
    dropped, held = [c for c in lines[:2] if c], [c for c in lines[2:] if c]
    rater.forget(dropped, held)
    assert rater.spent("a") == 0 and rater.spent("b") == 3000 and rater.state_size() < whole
    again = rater.rate(events[0], **kw)
    assert again is not None and again.amount_micro == 750, "a forgotten event (and day) rates as new"
    assert rater.rate(events[2], **kw) is None, "a held line's event is still a duplicate"
    # The second day's included quantity was used by the held lines, and is still.
    late = rater.rate(event("tokens_out", 1000, 9, ts_ms=T0 + DAY + 1), **kw)
    assert late is not None and late.amount_micro == 1500

    rater.forget([*held, again, late], [])
    assert rater.state_size() == 0


def test_revocation_stops_future_charges_only() -> None:
    sku = sku_of(PER_UNIT)
    record = AgreementRecord(agreement_to(sku), revoked_at_ms=T0 + 2 * 3_600_000)
    charges = rate(sku, [event("tokens_out", 1000, 0, ts_ms=T0 + 3_600_000),
                         event("tokens_out", 1000, 1, ts_ms=T0 + 3 * 3_600_000)], agreements=[record])
    assert [c.outcome for c in charges] == [ChargeOutcome.CHARGED, ChargeOutcome.NO_AGREEMENT]
    assert charges[0].to_object()["amount_micro"] == 1500 and charges[0].money == Money(1500, "USD")


def test_rate_stream_routes_events_to_skus_owners_and_ceilings() -> None:
    skus = parse_skus([
        {"sku": "flat-all", "covers": {"agent": True}, "price": {"model": "flat", "currency": "USD",
                                                              "amount_micro": 100},
         "provider": {"id": "internal"}},
        {"sku": "tokens", "covers": {"offerings": ["summary"]}, "price": PER_UNIT, "provider": {"id": "internal"}},
    ])
    consumer_agent = "UBMBH4BK6EIHQFVMHLSABFSQXB3JXUFZOXVZQTIERO33AD4HHAI3D7QP"
    agreements = [agreement_to(skus[0]), agreement_to(skus[1])]
    events = [
        event("requests", 1, 0, offering="other"),
        event("tokens_out", 4210, 1, offering="summary", task_id="t"),
        event("tokens_out", 4210, 2, offering="summary", task_id="t"),
        event("tokens_out", 10, 3, provider=OWNER.public_key),  # a seller with no SKUs: free, no line
        event("requests", 1, 4, consumer="UNKNOWN"),
    ]
    kw: dict[str, Any] = {
        "skus_of": {SELLER: skus},
        "owner_of": {consumer_agent: OWNER.public_key},
        "agreements": agreements,
        "ceilings": {"t": Money(10_000, "USD")},
    }
    charges = rate_stream(events, **kw)
    assert [(c.sku, c.amount_micro, c.outcome) for c in charges] == [
        ("flat-all", 100, ChargeOutcome.CHARGED),
        ("tokens", 6315, ChargeOutcome.CHARGED),
        ("tokens", 3685, ChargeOutcome.CLAMPED),
        ("flat-all", 0, ChargeOutcome.NO_AGREEMENT),
    ]
    assert rate_stream(events, **kw) == charges
    totals = ledger_totals(charges)
    assert totals == {(OWNER.public_key, SELLER, "USD", "2026-08"): 10_100, (None, SELLER, "USD", "2026-08"): 0}


@given(price=st.integers(0, 10**9), ceiling=st.integers(0, 10**9))
def test_a_flat_price_is_admitted_exactly_when_the_ceiling_covers_it(price: int, ceiling: int) -> None:
    from meshnode.protocol.commerce import admission_estimate, check_price_within_ceiling

    flat = parse_price({"model": "flat", "currency": "USD", "amount_micro": price})
    assert admission_estimate(flat) == Money(price, "USD")
    if ceiling >= price:
        check_price_within_ceiling(flat, Money(ceiling, "USD"))  # equality admits
    else:
        with pytest.raises(ProtocolError) as info:
            check_price_within_ceiling(flat, Money(ceiling, "USD"))
        assert info.value.code == "BUDGET_INSUFFICIENT"
        assert info.value.details == {"estimate": {"amount_micro": price, "currency": "USD"}}
    # No rate between currencies: never compared, refused with the price.
    with pytest.raises(ProtocolError):
        check_price_within_ceiling(flat, Money(max(ceiling, price), "EUR"))
    check_price_within_ceiling(flat, None)


def test_a_metered_price_has_no_estimate_before_the_work() -> None:
    from meshnode.protocol.commerce import admission_estimate, check_price_within_ceiling

    metered = parse_price({"model": "per_unit", "currency": "USD", "meter": "tokens_out", "amount_micro": 3})
    assert admission_estimate(metered) is None
    assert admission_estimate(parse_price({"model": "free"})) is None
    check_price_within_ceiling(metered, Money(0, "USD"))  # judged by the rating's ceiling instead (§19.6)
