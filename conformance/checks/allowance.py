"""allowance.json: the EXT-8 owner allowance: signed documents, floor metering,
smallest-remaining ceiling precedence, the refusal shape, both exhaustion modes.

Valid documents are standard signed vectors (prefix ``agentmesh-allowance-v1``,
signer ``owner_key``). Every invalid document but ``missing_sig`` carries a
genuine signature, so each is checked twice: the signature verifies, and the
shape refuses it for exactly its case name. Precedence cases are judged from
their ceilings and spend; exhaustion through a policy and a ledger.
"""

from __future__ import annotations

from typing import Any

from meshnode.protocol.allowance import (
    ALLOWANCE_TAG,
    Ceiling,
    CeilingStanding,
    OnExhausted,
    Scope,
    SpendLedger,
    Verdict,
    ceiling_applies,
    decide,
    load_allowance,
    make_allowance,
    meter_cost,
    parse_allowance,
    sign_allowance,
    verify_allowance,
)
from meshnode.protocol.attestations import verify_signed_vector
from meshnode.protocol.budget import Money, budget_insufficient
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair, verify
from meshnode.protocol.signing import b64url_decode, signed_bytes
from meshnode.protocol.timeutil import parse_rfc3339_ms

from .. import Recorder

FILES = ["allowance.json"]

#: The Task the precedence cases are judged in (their task ceilings are unnarrowed).
TASK = "0198c001-0000-7000-8000-0000000000aa"


def _raises(code: str, call: Any) -> ProtocolError:
    try:
        call()
    except ProtocolError as exc:
        assert exc.code == code, f"got {exc.code} {exc.details}, want {code}"
        return exc
    raise AssertionError(f"expected {code}, nothing was raised")


def _documents(fixture: dict[str, Any], rec: Recorder) -> None:
    ids = fixture["identities"]
    block = fixture["document"]
    prefix = block["signed_bytes_prefix"]
    with rec.case("document/prefix"):
        assert prefix == ALLOWANCE_TAG + "\n"
    for case in block["valid"]:
        name = case["case"]
        signed = case["signed"]
        with rec.case(f"document/valid/{name}"):
            verify_signed_vector(signed, tag=prefix, signer=ids["sender"], canonical=case["canonical"],
                                 seed=ids["sender_seed"])
            allowance = verify_allowance(signed, agent=ids["recipient"])
            assert allowance.owner_key == ids["sender"] and allowance.to_object() == signed
            again = sign_allowance({k: v for k, v in signed.items() if k != "sig"},
                                   KeyPair.from_seed(ids["sender_seed"]))
            assert again == signed, "re-signing gave another document"
            policy = load_allowance(signed, agent=ids["recipient"])
            assert policy.valid and policy.on_exhausted.value == signed["on_exhausted"]
            # One flipped byte of the document no longer verifies.
            tampered = dict(signed, updated_at=signed["updated_at"].replace("2026", "2027"))
            _raises("IDENTITY_MISMATCH", lambda t=tampered: verify_allowance(t))
    for case in block["invalid"]:
        name = case["case"]
        doc = case["document"]
        with rec.case(f"document/invalid/{name}"):
            if "sig" in doc:
                # The signature is genuine: the shape is the only fault.
                assert verify(ids["sender"], signed_bytes(doc, ALLOWANCE_TAG), b64url_decode(doc["sig"]))
            exc = _raises("INVALID_ENVELOPE", lambda d=doc: parse_allowance(d))
            assert exc.details["reason"] == name, exc.details
            policy = load_allowance(doc)
            assert not policy.valid and policy.error is not None
            # Fail closed: every ceiling exhausted, even for a zero estimate.
            decision = policy.admit(SpendLedger(), estimate_micro=0, task_id=TASK, context_id=None,
                                    now_ms=parse_rfc3339_ms("2026-07-28T16:00:00Z"), currency="USD")
            assert not decision.admitted and decision.binding is None


def _metering(fixture: dict[str, Any], rec: Recorder) -> None:
    assert fixture["metering"]["rounding"] == "floor"
    for i, case in enumerate(fixture["metering"]["cases"]):
        with rec.case(f"metering/{i}/{case['tokens']}x{case['per_1k_tokens_micro']}"):
            got = meter_cost(case["tokens"], case["per_1k_tokens_micro"])
            assert got == case["cost_micro"], (got, case["cost_micro"])


def _precedence(fixture: dict[str, Any], rec: Recorder) -> None:
    for case in fixture["precedence"]["cases"]:
        with rec.case(f"precedence/{case['case']}"):
            context = case.get("request_context_id")
            standings = []
            for c in case["applicable"]:
                ceiling = Ceiling(Scope(c["scope"]), c["amount_micro"], c.get("task_id"), c.get("context_id"))
                if ceiling_applies(ceiling, task_id=TASK, context_id=context):
                    standings.append(CeilingStanding(ceiling, c["spent_micro"]))
            decision = decide(standings, Money(case["estimate_micro"], "USD"))
            assert decision.binding is not None
            got = (decision.binding.scope.value, decision.binding.remaining_micro,
                   "accept" if decision.admitted else "refuse")
            want = (case["binding_scope"], case["remaining_micro"], case["expect"])
            assert got == want, (got, want)


def _refusal_and_exhaustion(fixture: dict[str, Any], rec: Recorder) -> None:
    ids = fixture["identities"]
    owner = KeyPair.from_seed(ids["sender_seed"])
    spec = fixture["refusal"]["budget_insufficient"]
    estimate = Money(spec["details"]["estimate"]["amount_micro"], spec["details"]["estimate"]["currency"])
    with rec.case("refusal/budget_insufficient"):
        standing = CeilingStanding(Ceiling(Scope.TASK, 100_000), 0)
        decision = decide([standing], estimate)
        assert decision.verdict is Verdict.REFUSE
        obj = decision.refusal().to_object()
        assert obj["code"] == spec["error_code"] and obj["details"] == spec["details"]
        assert obj["retryable"] is False
        # Byte-identical on the wire to budget.json's too-low-offer refusal.
        assert obj["details"] == budget_insufficient(estimate).to_object()["details"]

    now = parse_rfc3339_ms("2026-07-28T16:00:00Z")
    for mode in ("refuse", "ask_owner"):
        with rec.case(f"exhaustion/{mode}"):
            assert fixture["exhaustion"][mode]["on_exhausted"] == mode
            doc = make_allowance(
                owner, agent=ids["recipient"], cost_model=parse_allowance(
                    fixture["document"]["valid"][0]["signed"]).cost_model,
                ceilings=[Ceiling(Scope.DAY, 1_000_000)], on_exhausted=mode, updated_at_ms=now,
            )
            policy = load_allowance(doc, agent=ids["recipient"])
            ledger = SpendLedger()
            ledger.record(task_id="earlier", context_id=None, at_ms=now, tokens=400_000,
                          cost_model=policy.cost_model)  # 600000 micro spent today
            fits = policy.admit(ledger, estimate_micro=400_000, task_id=TASK, context_id=None, now_ms=now)
            assert fits.verdict is Verdict.ADMIT, "equality admits"
            over = policy.admit(ledger, estimate_micro=estimate.amount_micro, task_id=TASK, context_id=None,
                                now_ms=now)
            want = Verdict.REFUSE if mode == "refuse" else Verdict.ASK_OWNER
            assert over.verdict is want, over
            assert over.binding is not None and over.binding.remaining_micro == 400_000
            # Refused outright, or after the owner declines: the same shape.
            obj = over.refusal().to_object()
            assert obj["code"] == spec["error_code"] and obj["details"] == spec["details"]
            if mode == "ask_owner":
                # The owner raises the ceiling: a replacement document, the same
                # ledger (raising a ceiling forgives no spend), and the held
                # work is admitted.
                raised = make_allowance(
                    owner, agent=ids["recipient"], cost_model=policy.cost_model or _never(),
                    ceilings=[Ceiling(Scope.DAY, 2_000_000)], on_exhausted=OnExhausted.ASK_OWNER,
                    updated_at_ms=now + 60_000,
                )
                again = load_allowance(raised, agent=ids["recipient"]).admit(
                    ledger, estimate_micro=estimate.amount_micro, task_id=TASK, context_id=None, now_ms=now
                )
                assert again.admitted


def _never() -> Any:
    raise AssertionError("a valid policy has a cost model")


def run(fixture: dict[str, Any], rec: Recorder) -> None:
    _documents(fixture, rec)
    _metering(fixture, rec)
    _precedence(fixture, rec)
    _refusal_and_exhaustion(fixture, rec)
