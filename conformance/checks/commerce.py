"""commerce.json: §19.1 SKUs and prices, the SKU digest, §19.5 agreements and
enforcement, §19.6 rating.

Each invalid SKU / price must be refused for its stated rule (the pinned
``details.reason`` below); the agreement is a standard signed vector under
``agentmesh-agreement-v1``; the two prose-only agreement cases are built here
(a wrong-key signature from a key generated on the spot, so no second seed
enters the repository; one flipped digest byte). Rating cases carry only
``{meter, quantity, refused?}`` events and a bare price: the check wraps the
price in a SKU, completes each event into a §13.5 meter event, and signs an
agreement to the SKU's digest unless the case says ``agreement: null``.
"""

from __future__ import annotations

import copy
from typing import Any

from meshnode.protocol.attestations import verify_signed_vector
from meshnode.protocol.budget import Money
from meshnode.protocol.canonical import canonical_text
from meshnode.protocol.commerce import (
    AGREEMENT_TAG,
    SKU_DIGEST_TAG,
    ChargeOutcome,
    approval_url,
    check_agreement,
    make_agreement,
    parse_agreement,
    parse_price,
    parse_sku,
    parse_skus,
    rate_events,
    sign_agreement,
    sku_digest,
    verify_agreement,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.signing import b64url_decode
from meshnode.protocol.timeutil import parse_rfc3339_ms

from .. import Recorder

FILES = ["commerce.json"]

#: Fixture invalid case → the reason meshnode gives (details.reason, details.member).
SKU_REASONS: dict[str, tuple[str, str]] = {
    "uppercase_id": ("bad_sku_id", "sku"),
    "covers_both": ("covers_both", "covers"),
    "covers_empty_offerings": ("covers_empty_offerings", "covers.offerings"),
    "missing_provider": ("missing_provider", "provider"),
}
PRICE_REASONS: dict[str, tuple[str, str]] = {
    "unknown_model": ("unknown_model", "price.model"),
    "free_with_amount": ("foreign_field", "price.amount_micro"),
    "flat_with_meter": ("foreign_field", "price.meter"),
    "per_unit_missing_meter": ("missing_meter", "price.meter"),
    "float_money": ("float_money", "price.amount_micro"),
    "package_without_period": ("missing_period", "price.period"),
    "tiered_without_period": ("missing_period", "price.period"),
    "tiers_bounded_tail": ("tiers_bounded_tail", "price.tiers[0].up_to"),
    "tiers_non_monotonic": ("tiers_non_monotonic", "price.tiers[1].up_to"),
    "included_without_period": ("included_without_period", "price.included.period"),
}
AGREEMENT_REASONS = {"missing_digest": "missing_digest", "wrong_version": "wrong_version"}

#: The instant rating events are stamped with (inside the signed agreement's life).
RATING_TS = "2026-08-03T12:00:00.000Z"
APPROVAL_SURFACE = "https://console.example.com/agreements/approve"


def _raises(code: str, call: Any) -> ProtocolError:
    try:
        call()
    except ProtocolError as exc:
        assert exc.code == code, f"got {exc.code} {exc.details}, want {code}"
        return exc
    raise AssertionError(f"expected {code}, nothing was raised")


def _check_reason(exc: ProtocolError, want: tuple[str, str]) -> None:
    got = (exc.details.get("reason"), exc.details.get("member"))
    assert got == want, f"refused for {got}, want {want}"


def _skus(fixture: dict[str, Any], rec: Recorder) -> None:
    for i, obj in enumerate(fixture["sku"]["valid"]):
        with rec.case(f"sku/valid/{i}"):
            sku = parse_sku(obj)
            assert sku.to_object() == obj and sku.digest == sku_digest(obj)
            assert sku.price.to_object() == obj["price"], "a valid price must round-trip"
    with rec.case("sku/valid/as_manifest_list"):
        parsed = parse_skus(fixture["sku"]["valid"][:2])
        assert [s.sku for s in parsed] == ["caselaw-metered", "everything-flat"]
    for case in fixture["sku"]["invalid"]:
        with rec.case(f"sku/invalid/{case['case']}"):
            exc = _raises("INVALID_MANIFEST", lambda o=case["sku"]: parse_sku(o))
            _check_reason(exc, SKU_REASONS[case["case"]])

    for i, obj in enumerate(fixture["price"]["valid"]):
        with rec.case(f"price/valid/{i}"):
            price = parse_price(obj)
            assert price.to_object() == obj, price.to_object()
    for case in fixture["price"]["invalid"]:
        with rec.case(f"price/invalid/{case['case']}"):
            exc = _raises("INVALID_MANIFEST", lambda o=case["price"]: parse_price(o))
            _check_reason(exc, PRICE_REASONS[case["case"]])


def _digest(fixture: dict[str, Any], rec: Recorder) -> None:
    block = fixture["digest"]
    with rec.case("digest/prefix"):
        assert block["digest_bytes_prefix"] == SKU_DIGEST_TAG + "\n"
    with rec.case("digest/canonical"):
        assert canonical_text(block["sku"]) == block["canonical"]
    with rec.case("digest/sku_digest"):
        assert sku_digest(block["sku"]) == block["sku_digest"]
        assert parse_sku(block["sku"]).digest == block["sku_digest"]
    with rec.case("digest/one_micro_unit_moved"):
        moved = copy.deepcopy(block["sku"])
        moved["price"]["amount_micro"] = 1501
        assert sku_digest(moved) == block["one_micro_unit_moved"]["sku_digest"]
        assert sku_digest(moved) != block["sku_digest"]


def _agreement(fixture: dict[str, Any], rec: Recorder) -> None:
    ids = fixture["identities"]
    block = fixture["agreement"]
    signed = block["signed"]
    owner = ids["sender"]
    with rec.case("agreement/prefix"):
        assert block["signed_bytes_prefix"] == AGREEMENT_TAG + "\n"
    with rec.case("agreement/signed_vector"):
        verify_signed_vector(
            signed, tag=block["signed_bytes_prefix"], signer=owner, canonical=block["canonical"],
            seed=ids["sender_seed"],
        )
    with rec.case("agreement/verify"):
        agreement = verify_agreement(signed, consumer_owner=owner)
        assert agreement.consumer_owner == owner and agreement.seller_agent == ids["recipient"]
        assert agreement.sku_digest == fixture["digest"]["sku_digest"]
        assert agreement.to_object() == signed
    with rec.case("agreement/resign"):
        again = sign_agreement({k: v for k, v in signed.items() if k != "sig"}, KeyPair.from_seed(ids["sender_seed"]))
        assert again == signed, "re-signing gave another document"

    for case in block["invalid"]:
        name = case["case"]
        with rec.case(f"agreement/invalid/{name}"):
            if name in AGREEMENT_REASONS:
                exc = _raises("INVALID_ENVELOPE", lambda d=case["document"]: parse_agreement(d))
                assert exc.details["reason"] == AGREEMENT_REASONS[name], exc.details
                _raises("INVALID_ENVELOPE", lambda d=case["document"]: verify_agreement(d))
            elif name == "agent_signed":
                # A genuine signature by another key (made now, never stored)
                # over a document naming the owner: the signer IS the account.
                other = KeyPair.generate()
                forged = sign_agreement(signed, other)
                forged["consumer_owner"] = owner
                exc = _raises("IDENTITY_MISMATCH", lambda d=forged: verify_agreement(d))
                assert exc.details["reason"] == "bad_signature"
                # The owner's genuine signature does not make another key the signer.
                moved = dict(signed, consumer_owner=ids["recipient"])
                exc = _raises("IDENTITY_MISMATCH", lambda d=moved: verify_agreement(d))
                assert exc.details["reason"] == "bad_signature"
            elif name == "tampered_terms":
                tampered = copy.deepcopy(signed)
                raw = bytearray(tampered["sku_digest"].encode("ascii"))
                raw[5] = ord("A") if raw[5] != ord("A") else ord("B")
                tampered["sku_digest"] = raw.decode("ascii")
                assert len(b64url_decode(tampered["sku_digest"])) == 32
                exc = _raises("IDENTITY_MISMATCH", lambda d=tampered: verify_agreement(d))
                assert exc.details["reason"] == "bad_signature"
            else:
                raise AssertionError(f"no judgement for agreement case {name!r}")

    with rec.case("agreement/stale_digest_case"):
        stale = block["stale_digest_case"]
        assert agreement.sku_digest == stale["holds_agreement_for"]
        moved = copy.deepcopy(fixture["digest"]["sku"])
        moved["price"]["amount_micro"] = 1501
        current = parse_sku(moved)
        assert current.digest == stale["sku_current_digest"]
        now = parse_rfc3339_ms("2026-08-03T00:00:00Z")
        exc = _raises(
            stale["expect"],
            lambda: check_agreement(
                [current], "caselaw-summary", consumer_owner=owner, seller_agent=ids["recipient"],
                agreements=[agreement], now_ms=now, approval_surface=APPROVAL_SURFACE,
            ),
        )
        assert exc.details["sku_digest"] == stale["sku_current_digest"]
        # At the digest the owner agreed to, the same request is admitted.
        original = parse_sku(fixture["digest"]["sku"])
        assert check_agreement(
            [original], "caselaw-summary", consumer_owner=owner, seller_agent=ids["recipient"],
            agreements=[agreement], now_ms=now,
        ) == original


def _enforcement(fixture: dict[str, Any], rec: Recorder) -> None:
    ids = fixture["identities"]
    spec = fixture["enforcement"]["refusal"]
    sku = parse_sku(fixture["digest"]["sku"])
    now = parse_rfc3339_ms("2026-08-03T00:00:00Z")
    with rec.case("enforcement/refusal"):
        exc = _raises(
            spec["error_code"],
            lambda: check_agreement(
                [sku], "caselaw-cite-check", consumer_owner=ids["sender"], seller_agent=ids["recipient"],
                agreements=[], now_ms=now, approval_surface=APPROVAL_SURFACE,
            ),
        )
        assert exc.details == spec["details"], exc.details
        assert exc.to_object()["retryable"] is False
        assert approval_url(sku, APPROVAL_SURFACE) == spec["details"]["approval_url"]
    with rec.case("enforcement/unresolvable_owner_holds_nothing"):
        agreement = parse_agreement(fixture["agreement"]["signed"])
        exc = _raises(
            spec["error_code"],
            lambda: check_agreement(
                [sku], "caselaw-summary", consumer_owner=None, seller_agent=ids["recipient"],
                agreements=[agreement], now_ms=now, approval_surface=APPROVAL_SURFACE,
            ),
        )
        assert exc.details == spec["details"]
    with rec.case("enforcement/free_offering_case"):
        case = fixture["enforcement"]["free_offering_case"]
        skus = parse_skus([fixture["digest"]["sku"]])
        assert check_agreement(
            skus, case["offering"], consumer_owner=ids["sender"], seller_agent=ids["recipient"],
            agreements=[], now_ms=now,
        ) is None


def _rating(fixture: dict[str, Any], rec: Recorder) -> None:
    ids = fixture["identities"]
    owner_key = KeyPair.from_seed(ids["sender_seed"])
    ts_ms = parse_rfc3339_ms(RATING_TS)
    for case in fixture["rating"]["cases"]:
        with rec.case(f"rating/{case['case']}"):
            sku = parse_sku({
                "sku": "rated", "covers": {"agent": True}, "price": case["price"], "provider": {"id": "internal"},
            })
            agreements = []
            if case.get("agreement", "held") is not None:
                doc = make_agreement(
                    owner_key, seller_agent=ids["recipient"], sku=sku, agreed_at_ms=ts_ms - 86_400_000
                )
                agreements.append(verify_agreement(doc))
            events = []
            for i, e in enumerate(case["events"]):
                event = {
                    "meter": e["meter"],
                    "class": "observed" if e["meter"] == "requests" else "declared",
                    "quantity": e["quantity"],
                    "provider": ids["recipient"],
                    "consumer": ids["sender"],
                    "envelope_id": f"env-{i}",
                    "ts": RATING_TS,
                }
                if e.get("refused"):
                    event |= {"refused": True, "refusal_code": "AGREEMENT_REQUIRED"}
                events.append(event)
            ceiling = None
            if "budget_cost_ceiling_micro" in case:
                ceiling = Money(case["budget_cost_ceiling_micro"], case["price"].get("currency", "USD"))

            def replay(evts: list[dict[str, Any]] = events, s: Any = sku, a: Any = agreements,
                       c: Money | None = ceiling) -> list[Any]:
                return rate_events(evts, sku=s, consumer_owner=ids["sender"], agreements=a, ceiling=c)

            charges = replay()
            total = sum(c.amount_micro for c in charges)
            assert total == case["expect_charge_micro"], (total, case["expect_charge_micro"])
            assert replay() == charges, "a replay gave other charges"
            for charge, e in zip(charges, case["events"], strict=True):
                if e.get("refused"):
                    assert charge.outcome is ChargeOutcome.REFUSED and charge.amount_micro == 0
            if case.get("agreement", "held") is None:
                assert all(c.outcome is ChargeOutcome.NO_AGREEMENT for c in charges)


def run(fixture: dict[str, Any], rec: Recorder) -> None:
    _skus(fixture, rec)
    _digest(fixture, rec)
    _agreement(fixture, rec)
    _enforcement(fixture, rec)
    _rating(fixture, rec)
