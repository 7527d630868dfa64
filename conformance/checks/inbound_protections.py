"""inbound-protections.json (spec copy) and its TypeScript-SDK copy: §22 and the §21.2 relay guard.

Both copies share every behavioural case; their signed envelopes differ (the
TS copy says ``offering`` where the spec copy says ``skill``), and both must
verify. Clock-dependent cases carry their own ``now``.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from meshnode.protocol.canonical import canonical_text
from meshnode.protocol.envelope import decode_envelope
from meshnode.protocol.fencing import (
    DoubleFramingError,
    FrameProvenance,
    build_frame,
    fence_sender_text,
    frame_payload,
)
from meshnode.protocol.nkeys import KeyPair, verify
from meshnode.protocol.protections import (
    DEFAULT_DEDUP_CAPACITY,
    DEFAULT_FRESHNESS_WINDOW,
    DEFAULT_MAX_HOPS,
    DEFAULT_MAX_INBOUND_CHARS,
    REFUSAL_RULES,
    DedupMemory,
    InboundGuard,
    InboundVerdict,
    Protection,
    check_addressing,
    check_freshness,
    exceeds_size_cap,
    measure_sender_text,
)
from meshnode.protocol.signing import ENVELOPE_TAG, b64url_decode, b64url_encode, verify_object
from meshnode.protocol.timeutil import parse_rfc3339_ms

from .. import Recorder

FILES = ["inbound-protections.json", "inbound-protections.ts-sdk.json"]

# The fixture's `refused_by` / `refusals` vocabulary, mapped onto ours.
_REFUSED_BY = {
    "duplicate": Protection.DUPLICATE,
    "freshness": Protection.FRESHNESS,
    "addressing": Protection.ADDRESSING,
    "hops": Protection.HOPS,
    "size_cap": Protection.SIZE_CAP,
}
_REFUSAL_ROWS = {
    "duplicate": Protection.DUPLICATE,
    "stale": Protection.FRESHNESS,
    "misaddressed": Protection.ADDRESSING,
    "hops_exceeded": Protection.HOPS,
    "size_cap": Protection.SIZE_CAP,
}


def _envelope_names(fixture: dict[str, Any]) -> list[str]:
    return [k for k, v in fixture["envelopes"].items() if isinstance(v, dict) and "envelope" in v]


def _decoded(fixture: dict[str, Any], name: str) -> dict[str, Any]:
    """Decode (validate + verify sig) a named fixture envelope from its wire JSON."""
    wire = json.dumps(fixture["envelopes"][name]["envelope"], ensure_ascii=False)
    return decode_envelope(wire.encode("utf-8"))


def _expect(verdict: InboundVerdict, want: str, refused_by: str | None = None) -> None:
    if want == "accept":
        assert verdict.accepted, f"refused by {verdict.protection}, want accept"
        return
    assert not verdict.accepted, "accepted, want refuse"
    if refused_by is not None:
        assert verdict.protection == _REFUSED_BY[refused_by], (
            f"refused by {verdict.protection}, want {refused_by}"
        )


def _synthetic(delivery: dict[str, Any], default_ts: str) -> dict[str, Any]:
    """A minimal verified-shape envelope for a dedup delivery (no `to`, no payload)."""
    return {
        "v": "0.2.0",
        "id": delivery["id"],
        "type": "request",
        "ts": delivery.get("ts", default_ts),
        "from": delivery["from"],
    }


def _run_dedup(fixture: dict[str, Any], rec: Recorder) -> None:
    section = fixture["duplicate_rejection"]
    self_id = fixture["identities"]["recipient"]
    # A delivery with no clock of its own is judged at the fixture's reference
    # instant with a ts equal to it: those cases test the memory, not the window.
    reference = fixture["envelopes"]["addressed_to_recipient"]["envelope"]["ts"]
    with rec.case("duplicate_rejection/min_entries"):
        assert section["key"] == "(from, id)"
        assert section["min_entries"] <= DEFAULT_DEDUP_CAPACITY
        assert InboundGuard(self_id).memory.capacity == DEFAULT_DEDUP_CAPACITY
    for case in section["cases"]:
        with rec.case(f"duplicate_rejection/{case['id']}"):
            guard = InboundGuard(self_id)
            deliveries: list[dict[str, Any]] = list(case.get("deliveries", []))
            generated = case.get("generated_deliveries")
            if generated is not None:
                for i in range(generated["i_from"], generated["i_to"] + 1):
                    deliveries.append(
                        {
                            "from": generated["from"],
                            "id": generated["id_template"].format(i=i),
                            "verdict": generated["each_verdict"],
                        }
                    )
                assert len(deliveries) > section["min_entries"]
            _deliver_in_sequence(guard, deliveries, reference)
            # `then` entries are alternative continuations of the same state, each
            # judged against the memory as the generated deliveries left it: run in
            # sequence, the second would be refused as a duplicate of the first
            # (remember-before-judging), yet the fixture pins `refused_by: freshness`
            # for it. Each continuation gets a copy of the memory in that state.
            for n, delivery in enumerate(case.get("then", [])):
                branch = InboundGuard(self_id, memory=guard.memory.copy())
                try:
                    _deliver_in_sequence(branch, [delivery], reference)
                except AssertionError as exc:
                    raise AssertionError(f"then[{n}]: {exc}") from None
            # The same verdicts from the memory alone, where no clock is involved.
            if all("ts" not in d for d in deliveries):
                memory = DedupMemory()
                for delivery in deliveries:
                    dup = memory.check_and_remember(delivery["from"], delivery["id"])
                    assert dup == (delivery["verdict"] == "refuse")


def _deliver_in_sequence(
    guard: InboundGuard, deliveries: list[dict[str, Any]], reference: str
) -> None:
    for n, delivery in enumerate(deliveries):
        now_ms = parse_rfc3339_ms(delivery.get("now", reference))
        verdict = guard.check(
            _synthetic(delivery, reference),
            source=delivery.get("source", "live"),
            now_ms=now_ms,
        )
        try:
            _expect(verdict, delivery["verdict"], delivery.get("refused_by"))
        except AssertionError as exc:
            raise AssertionError(f"delivery {n} ({delivery['id']}): {exc}") from None
        assert verdict.answer is None, "a dedup-case refusal must be silent"
        assert len(guard.memory) <= guard.memory.capacity


def _run_freshness(fixture: dict[str, Any], rec: Recorder) -> None:
    section = fixture["freshness"]
    with rec.case("freshness/defaults"):
        window = DEFAULT_FRESHNESS_WINDOW
        assert window.max_clock_skew_ahead_ms == section["max_clock_skew_ahead_ms"]
        assert window.max_age_live_ms == section["max_clock_skew_behind_ms"]
        assert window.max_age_mailbox_ms == section["max_mailbox_age_ms"]
    self_id = fixture["identities"]["recipient"]
    sender = fixture["identities"]["sender"]
    for n, case in enumerate(section["cases"]):
        with rec.case(f"freshness/{case['id']}"):
            now_ms = parse_rfc3339_ms(case["now"])
            want = case["verdict"] == "accept"
            got = check_freshness(case["ts"], now_ms, case["source"])
            assert got == want, f"check_freshness gave {got}, want {case['verdict']}"
            envelope = {
                "v": "0.2.0",
                "id": f"freshness-{n}",
                "type": "request",
                "ts": case["ts"],
                "from": sender,
            }
            verdict = InboundGuard(self_id).check(envelope, source=case["source"], now_ms=now_ms)
            _expect(verdict, case["verdict"], None if want else "freshness")
            assert verdict.answer is None


def _run_addressing(fixture: dict[str, Any], rec: Recorder) -> None:
    section = fixture["addressing"]
    self_id = section["self"]
    for case in section["cases"]:
        with rec.case(f"addressing/{case['id']}"):
            envelope = _decoded(fixture, case["envelope"])
            want = case["verdict"] == "accept"
            assert check_addressing(envelope, self_id) == want
            verdict = InboundGuard(self_id).check(
                envelope, source="live", now_ms=parse_rfc3339_ms(envelope["ts"])
            )
            _expect(verdict, case["verdict"], None if want else "addressing")
            assert verdict.answer is None


def _run_size_cap(fixture: dict[str, Any], rec: Recorder) -> None:
    section = fixture["size_cap"]
    self_id = fixture["identities"]["recipient"]
    sender = fixture["identities"]["sender"]
    with rec.case("size_cap/default_max_inbound_chars"):
        assert section["default_max_inbound_chars"] == DEFAULT_MAX_INBOUND_CHARS
        assert InboundGuard(self_id).max_inbound_chars == DEFAULT_MAX_INBOUND_CHARS
    for n, case in enumerate(section["cases"]):
        with rec.case(f"size_cap/{case['id']}"):
            measured = measure_sender_text(case["input"])
            assert measured.length == case["measured_chars"], (
                f"measured {measured.length}, want {case['measured_chars']}"
            )
            cap = case["max_inbound_chars"]
            want_accept = case["verdict"] == "accept"
            assert exceeds_size_cap(measured.length, cap) != want_accept
            # End to end: a request carrying the input, through the guard.
            ts = "2026-07-26T12:00:00.000Z"
            envelope = {
                "v": "0.2.0",
                "id": f"size-{n}",
                "type": "request",
                "ts": ts,
                "from": sender,
                "to": self_id,
                "payload": {"offering": "chat", "input": case["input"]},
            }
            guard = InboundGuard(self_id, max_inbound_chars=cap)
            verdict = guard.check(envelope, source="live", now_ms=parse_rfc3339_ms(ts))
            _expect(verdict, case["verdict"], None if want_accept else "size_cap")
            assert verdict.measurement is not None
            assert verdict.measurement.length == case["measured_chars"]
            if not want_accept:
                assert verdict.answer is not None
                assert verdict.answer.error["code"] == "CONTEXT_TOO_LARGE"
                assert verdict.answer.error["retryable"] is False


def _fixture_provenance(p: dict[str, Any]) -> FrameProvenance:
    trace = p.get("trace")
    return FrameProvenance(
        sender=p["from"],
        received_at_ms=parse_rfc3339_ms(p["received_at"]),
        trace_id=trace["trace_id"] if trace else None,
        handle=p.get("handle"),
        operator=p.get("operator"),
    )


def _run_fencing(fixture: dict[str, Any], rec: Recorder) -> None:
    section = fixture["fencing"]
    with rec.case("fencing/markers"):
        frame = build_frame("", _fixture_provenance(section["frame_cases"][0]["provenance"]))
        lines = frame.split("\n")
        assert lines[-2:] == [section["markers"]["begin"], section["markers"]["end"]]
    for case in section["sender_text_cases"]:
        with rec.case(f"fencing/sender_text_cases/{case['id']}"):
            got = fence_sender_text(case["input"])
            assert got == case["expected"], f"got {got!r}, want {case['expected']!r}"
    for case in section["frame_cases"]:
        with rec.case(f"fencing/frame_cases/{case['id']}"):
            prov = case["provenance"]
            provenance = _fixture_provenance(prov)
            # received_at goes through epoch ms and back; the byte comparison checks both ways.
            got = build_frame(case["text"], provenance)
            assert got == case["expected"], f"got {got!r}, want {case['expected']!r}"
            if "trace" in prov:
                from_env = FrameProvenance.from_envelope(
                    {"from": prov["from"], "trace": prov["trace"]}, provenance.received_at_ms
                )
                assert build_frame(case["text"], from_env) == case["expected"]
    # Shape cases carry no provenance; their expected frames are the plain
    # unresolved form of the first frame case's provenance.
    shape_provenance = _fixture_provenance(section["frame_cases"][0]["provenance"])
    for case in section["payload_shape_cases"]:
        with rec.case(f"fencing/payload_shape_cases/{case['id']}"):
            payload = case["input"]
            before = copy.deepcopy(payload)
            measured = measure_sender_text(payload)
            assert measured.measured == case["sender_text"], (
                f"measured {measured.measured!r}, want {case['sender_text']!r}"
            )
            assert measured.field == case["sender_text_field"]
            assert measured.text == (case["sender_text"] if case["sender_text_field"] else None)
            result = frame_payload(payload, shape_provenance)
            assert result.framed == case["framed"]
            if case["framed"]:
                assert result.field == case.get("framed_field", case["sender_text_field"])
                assert result.payload is not payload, "framing must work on a copy"
            else:
                assert result.payload is payload
            assert _same_json(result.payload, case["expected"]), (
                f"got {result.payload!r}, want {case['expected']!r}"
            )
            assert _same_json(payload, before), "the input payload was mutated"
    with rec.case("fencing/double_fencing"):
        once = frame_payload({"text": "hello"}, shape_provenance)
        try:
            frame_payload(once.payload, shape_provenance)
        except DoubleFramingError:
            pass
        else:
            raise AssertionError("framing an already-framed payload must be refused")
        try:
            build_frame(build_frame("hello", shape_provenance), shape_provenance)
        except DoubleFramingError:
            pass
        else:
            raise AssertionError("framing an already-framed string must be refused")


def _same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values, with member order ignored and types compared exactly."""
    return canonical_text(a) == canonical_text(b)


def _run_refusals(fixture: dict[str, Any], rec: Recorder) -> None:
    section = fixture["refusals"]
    self_id = fixture["identities"]["recipient"]
    sender = fixture["identities"]["sender"]
    fresh = _decoded(fixture, "addressed_to_recipient")
    now_ms = parse_rfc3339_ms(fresh["ts"])

    def verdict_for(row: str) -> InboundVerdict:
        if row == "duplicate":
            guard = InboundGuard(self_id)
            first = guard.check(fresh, source="live", now_ms=now_ms)
            assert first.accepted
            return guard.check(fresh, source="live", now_ms=now_ms)
        if row == "stale":
            envelope = _decoded(fixture, "stale_by_two_hours")
            return InboundGuard(self_id).check(envelope, source="live", now_ms=now_ms)
        if row == "misaddressed":
            envelope = _decoded(fixture, "addressed_to_a_third_party")
            return InboundGuard(self_id).check(envelope, source="live", now_ms=now_ms)
        if row == "hops_exceeded":
            envelope = _decoded(fixture, "hops_over_the_relay_bound")
            return InboundGuard(self_id).check(envelope, source="live", now_ms=now_ms)
        if row == "size_cap":
            guard = InboundGuard(self_id, max_inbound_chars=4)
            return guard.check(fresh, source="mailbox", now_ms=now_ms)  # "hello" is 5
        raise AssertionError(f"unknown refusal row {row!r}")

    for row, spec in section.items():
        if row == "comment":
            continue
        with rec.case(f"refusals/{row}"):
            protection = _REFUSAL_ROWS[row]
            rule = REFUSAL_RULES[protection]
            assert rule.refusal == row
            to_sender = spec["to_sender"]
            assert rule.answers_sender == (to_sender is not None)
            verdict = verdict_for(row)
            assert not verdict.accepted and verdict.protection == protection
            assert verdict.rule is rule
            assert verdict.local_signal == rule.local_signal
            if to_sender is None:
                assert verdict.answer is None and not verdict.answers_sender
                continue
            assert to_sender["type"] == "respond"
            assert rule.error_code == to_sender["error_code"]
            assert rule.retryable is to_sender["retryable"]
            assert verdict.answer is not None
            assert verdict.answer.error["code"] == to_sender["error_code"]
            assert verdict.answer.error["retryable"] is to_sender["retryable"]
            assert verdict.answer.in_reply_to == fresh["id"]  # the request `id`
            assert verdict.answer.to == sender  # the request `from`
            assert rule.local_signal == spec["to_recipient"]["local_warning"]
            assert rule.local_signal_required and verdict.local_signal_required
            assert rule.handler_invoked is spec["handler_invoked"]
    with rec.case("refusals/hops_relay_bound"):
        assert DEFAULT_MAX_HOPS == 3
        envelope = _decoded(fixture, "hops_over_the_relay_bound")
        assert envelope["meta"]["hops"] > DEFAULT_MAX_HOPS
        at_bound = dict(envelope, meta={"hops": DEFAULT_MAX_HOPS}, id="hops-at-bound")
        assert InboundGuard(self_id).check(at_bound, source="live", now_ms=now_ms).accepted


def _run_envelopes(fixture: dict[str, Any], rec: Recorder) -> None:
    section = fixture["envelopes"]
    identities = fixture["identities"]
    prefix = section["signed_bytes_prefix"]
    key = KeyPair.from_seed(identities["sender_seed"])
    with rec.case("identities/sender_seed_matches_sender"):
        assert key.public_key == identities["sender"]
        assert prefix == ENVELOPE_TAG + "\n"
    for name in _envelope_names(fixture):
        vector = section[name]
        envelope = vector["envelope"]
        signer = envelope["from"]
        body = {k: v for k, v in envelope.items() if k != "sig"}
        signed = prefix.encode("utf-8") + vector["canonical"].encode("utf-8")
        sig = b64url_decode(envelope["sig"])
        with rec.case(f"envelopes/{name}/canonical"):
            got = canonical_text(body)
            assert got == vector["canonical"], f"got {got!r}"
        with rec.case(f"envelopes/{name}/signature"):
            assert verify(signer, signed, sig), "signature does not verify over prefix + canonical"
            assert verify_object(envelope, ENVELOPE_TAG, signer)
            decoded = _decoded(fixture, name)  # validates and verifies
            assert decoded == envelope
        with rec.case(f"envelopes/{name}/resign"):
            assert signer == key.public_key
            assert b64url_encode(key.sign(signed)) == envelope["sig"]
        with rec.case(f"envelopes/{name}/tamper"):
            for position in (len(prefix) - 1, len(prefix), len(signed) // 2, len(signed) - 1):
                flipped = bytearray(signed)
                flipped[position] ^= 0x01
                assert not verify(signer, bytes(flipped), sig), f"byte {position} flip verified"
            bad_sig = bytearray(sig)
            bad_sig[0] ^= 0x01
            assert not verify(signer, signed, bytes(bad_sig))
            altered = copy.deepcopy(envelope)
            altered["id"] = altered["id"][:-1] + ("0" if altered["id"][-1] != "0" else "1")
            assert not verify_object(altered, ENVELOPE_TAG, signer)


def run(fixture: dict[str, Any], rec: Recorder) -> None:
    _run_envelopes(fixture, rec)
    _run_dedup(fixture, rec)
    _run_freshness(fixture, rec)
    _run_addressing(fixture, rec)
    _run_size_cap(fixture, rec)
    _run_fencing(fixture, rec)
    _run_refusals(fixture, rec)
    with rec.case("suspected_gaps/none_open"):
        # Every suspected gap has been ruled on; the fixture pins nothing as suspected.
        assert fixture["suspected_gaps"]["cases"] == []
