"""sender-preflight.json (+ .ts-sdk): §6.4b local refusals before publishing."""

from __future__ import annotations

from typing import Any

from meshnode.protocol.envelope import build_envelope, encode_envelope, sign_envelope
from meshnode.protocol.errors import ProtocolError, is_retryable
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.offerings import normalize_keys
from meshnode.protocol.preflight import (
    DEFAULT_MAX_INBOUND_CHARS,
    check_envelope_size,
    preflight_envelope,
    preflight_request,
)
from meshnode.protocol.protections import utf16_length

from .. import Recorder

FILES = ["sender-preflight.json", "sender-preflight.ts-sdk.json"]

_NOW_MS = 1_785_164_400_000  # 2026-07-27T15:00:00Z; any instant serves


def _expect(case: dict[str, Any], call: Any) -> ProtocolError | None:
    """Run ``call`` and compare its outcome to the case's verdict, code and retryable."""
    try:
        call()
    except ProtocolError as exc:
        assert case["verdict"] == "refuse_local", f"refused ({exc.code}) but the verdict is publish"
        assert exc.code == case["error_code"], (exc.code, case["error_code"])
        assert exc.retryable is case["retryable"]
        assert exc.to_object()["retryable"] is case["retryable"]
        return exc
    assert case["verdict"] == "publish", "published but the verdict is refuse_local"
    return None


def _sized_envelope(key: KeyPair, recipient: str, size: int) -> dict[str, Any]:
    """A signed request whose wire encoding is exactly ``size`` bytes."""

    def build(pad: int) -> dict[str, Any]:
        env = build_envelope(
            "request",
            key.public_key,
            now_ms=_NOW_MS,
            to=recipient,
            payload={"offering": "chat", "input": {"text": "x" * pad}},
        )
        return sign_envelope(env, key)

    base = len(encode_envelope(build(0)))
    env = build(size - base)
    assert len(encode_envelope(env)) == size
    return env


def run(fixture: dict[str, Any], rec: Recorder) -> None:
    identities = fixture["identities"]

    with rec.case("measurement/unit"):
        assert utf16_length("\U0001f600") == 2 and utf16_length("\U0001f600a") == 3
        assert "UTF-16" in fixture["measurement"]["unit"]

    section = fixture["sender_text"]
    with rec.case("sender_text/default_max_inbound_chars"):
        assert section["default_max_inbound_chars"] == DEFAULT_MAX_INBOUND_CHARS

    for case in section["cases"]:
        with rec.case(f"sender_text/{case['id']}"):
            text = case.get("text", "x" * case["text_utf16_len"])
            assert utf16_length(text) == case["text_utf16_len"]
            manifest: dict[str, Any] = {"id": identities["recipient"], "offerings": []}
            if case["declared_cap"] is not None:
                manifest["limits"] = {"max_inbound_chars": case["declared_cap"]}
            payload = {"offering": "chat", "input": {"text": text}}
            exc = _expect(case, lambda p=payload, m=manifest: preflight_request(p, m))
            if exc is not None:
                assert exc.details["limit"] == "max_inbound_chars"
                assert exc.details["measured"] == case["text_utf16_len"]

    for case in fixture["envelope_size"]["cases"]:
        with rec.case(f"envelope_size/{case['id']}"):
            limit = case["max_payload_bytes"]
            exc = _expect(case, lambda c=case, m=limit: check_envelope_size(c["envelope_bytes"], m))
            if exc is not None:
                assert exc.details["limit"] == case["details_limit"]

        with rec.case(f"envelope_size/{case['id']}/end_to_end"):
            key = KeyPair.from_seed(identities["sender_seed"])
            env = _sized_envelope(key, identities["recipient"], case["envelope_bytes"])
            # A recipient with the text cap off, so only the transport bound can fire.
            manifest = {"limits": {"max_inbound_chars": 0}}
            exc = _expect(
                case,
                lambda e=env, m=manifest, lim=case["max_payload_bytes"]: preflight_envelope(e, m, lim),
            )
            if exc is not None:
                assert exc.details["limit"] == case["details_limit"]
                assert exc.details["envelope_bytes"] == case["envelope_bytes"]

    for case in fixture["content_type"]["cases"]:
        with rec.case(f"content_type/{case['id']}"):
            # The spec copy names the field skill_output_modes: a legacy alias (§8.5).
            modes = normalize_keys(case)["offering_output_modes"]
            manifest = {"offerings": [{"id": "target", "output_modes": modes}]}
            payload = {
                "offering": "target",
                "input": {"text": "hi"},
                "config": {"accepted_output": case["accepted_output"]},
            }
            _expect(case, lambda p=payload, m=manifest: preflight_request(p, m))

    mirror = fixture["mirror"]
    with rec.case("mirror/same_code_same_retryable"):
        assert mirror["same_code"] and mirror["same_retryable"]
        refusals = [
            c
            for c in (*section["cases"], *fixture["envelope_size"]["cases"], *fixture["content_type"]["cases"])
            if c["verdict"] == "refuse_local"
        ]
        assert refusals
        for c in refusals:
            # The recipient answers with the §12.2 retryability of the same code.
            assert c["retryable"] is is_retryable(c["error_code"]), c["id"]
        # §22.5's own refusal code is the sender-text refusal's code.
        assert {c["error_code"] for c in section["cases"] if c["verdict"] == "refuse_local"} == {
            "CONTEXT_TOO_LARGE"
        }

    with rec.case("mirror/nothing_published_on_refusal"):
        assert mirror["nothing_published_on_refusal"]
        key = KeyPair.from_seed(identities["sender_seed"])
        env = _sized_envelope(key, identities["recipient"], 2048)
        published: list[int] = []
        try:
            published.append(preflight_envelope(env, None, 1024))
        except ProtocolError as exc:
            assert exc.code == "CONTEXT_TOO_LARGE"
        assert published == [], "a refused envelope yielded a size to publish"
