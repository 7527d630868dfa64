"""Sender pre-flight (§6.4b): the sender-side mirror of the recipient's limits."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnode.protocol.envelope import build_envelope, encode_envelope, sign_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.preflight import (
    DEFAULT_MAX_INBOUND_CHARS,
    check_content_type,
    check_envelope_size,
    check_sender_text,
    media_type_matches,
    next_allowed_at,
    preflight_envelope,
    preflight_request,
    prune_history,
    recipient_text_cap,
)
from meshnode.protocol.protections import ABSENT, utf16_length
from meshnode.protocol.protections import measure_sender_text as measure
from tests.conftest import load_fixture

NOW = 1_785_164_400_000


def refusal(call: Callable[[], object]) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        call()
    return info.value


# --- measurement -----------------------------------------------------------------


def test_sender_measures_with_the_receivers_ladder() -> None:
    """The pre-flight counts exactly what §22.5's receiver counts (one function)."""
    for body in ("hello", {"text": "hi", "message": "longer"}, {"text": 42}, {"rows": [1, 2, 3]}, None):
        expected = measure(body).length
        assert check_sender_text(body, expected) == expected
        with pytest.raises(ProtocolError):
            check_sender_text(body, expected - 1)
    assert check_sender_text(ABSENT, 1) == 0


def test_request_body_is_what_the_handler_receives() -> None:
    cap = {"limits": {"max_inbound_chars": 5}}
    preflight_request({"offering": "chat", "input": {"text": "hello"}}, cap)  # input measured: 5
    exc = refusal(lambda: preflight_request({"offering": "chat", "input": {"text": "hello!"}}, cap))
    assert exc.details["measured"] == 6
    # No input: the whole payload is the body, as the receiver measures it.
    wide = {"limits": {"max_inbound_chars": 100}}
    preflight_request({"offering": "chat"}, wide)
    exc = refusal(lambda: preflight_request({"offering": "chat"}, {"limits": {"max_inbound_chars": 5}}))
    assert exc.details["measured"] == len('{"offering":"chat"}')


# --- the sender-text cap ----------------------------------------------------------


def test_recipient_text_cap() -> None:
    assert recipient_text_cap(None) == DEFAULT_MAX_INBOUND_CHARS == 65536
    assert recipient_text_cap({}) == 65536
    assert recipient_text_cap({"limits": {}}) == 65536
    assert recipient_text_cap({"limits": {"max_inbound_chars": 100}}) == 100
    assert recipient_text_cap({"limits": {"max_inbound_chars": 0}}) == 0
    for malformed in (-1, "100", None, True, float("inf")):
        assert recipient_text_cap({"limits": {"max_inbound_chars": malformed}}) == 65536


def test_sender_text_boundary() -> None:
    assert check_sender_text({"text": "x" * 100}, 100) == 100
    exc = refusal(lambda: check_sender_text({"text": "x" * 101}, 100))
    assert exc.code == "CONTEXT_TOO_LARGE" and exc.retryable is False
    assert exc.details == {"limit": "max_inbound_chars", "cap": 100, "measured": 101}
    assert exc.to_object()["retryable"] is False
    assert check_sender_text("x" * 10_000, 0) == 10_000  # 0 disables the cap


@given(st.text(max_size=60), st.integers(min_value=1, max_value=80))
def test_sender_text_refuses_iff_strictly_greater(text: str, cap: int) -> None:
    try:
        check_sender_text(text, cap)
    except ProtocolError:
        assert utf16_length(text) > cap
    else:
        assert utf16_length(text) <= cap


def test_sender_preflight_fixture_cases() -> None:
    fixture = load_fixture("sender-preflight.ts-sdk.json")
    for case in fixture["sender_text"]["cases"]:
        text = case.get("text", "x" * case["text_utf16_len"])
        manifest = {} if case["declared_cap"] is None else {"limits": {"max_inbound_chars": case["declared_cap"]}}
        payload = {"offering": "chat", "input": {"text": text}}
        if case["verdict"] == "publish":
            preflight_request(payload, manifest)
        else:
            exc = refusal(partial(preflight_request, payload, manifest))
            assert (exc.code, exc.retryable) == (case["error_code"], case["retryable"])


# --- envelope size ------------------------------------------------------------------


def test_envelope_size_bound_is_inclusive() -> None:
    check_envelope_size(1_048_576, 1_048_576)
    exc = refusal(lambda: check_envelope_size(1_048_577, 1_048_576))
    assert exc.code == "CONTEXT_TOO_LARGE" and not exc.retryable
    assert exc.details == {"limit": "transport_max_payload", "max_payload": 1_048_576, "envelope_bytes": 1_048_577}
    check_envelope_size(10**9, None)  # unknown bound: nothing to enforce
    check_envelope_size(10**9, 0)


def _request(key: KeyPair, text: str, **payload: object) -> dict[str, object]:
    env = build_envelope(
        "request", key.public_key, now_ms=NOW, payload={"offering": "chat", "input": {"text": text}, **payload}
    )
    return sign_envelope(env, key)


def test_preflight_envelope_runs_every_check() -> None:
    key = KeyPair.generate()
    env = _request(key, "hello")
    size = len(encode_envelope(env))
    assert preflight_envelope(env, None, size) == size
    assert refusal(lambda: preflight_envelope(env, None, size - 1)).details["limit"] == "transport_max_payload"
    tight = {"limits": {"max_inbound_chars": 3}}
    assert refusal(lambda: preflight_envelope(env, tight, None)).details["limit"] == "max_inbound_chars"
    # The text cap is judged before the transport bound.
    assert refusal(lambda: preflight_envelope(env, tight, 10)).details["limit"] == "max_inbound_chars"
    # Non-request envelopes only meet the transport bound.
    emit = sign_envelope(build_envelope("emit", key.public_key, now_ms=NOW, payload={"text": "x" * 500}), key)
    preflight_envelope(emit, tight, None)


# --- content types -------------------------------------------------------------------


def test_media_type_matching() -> None:
    assert media_type_matches("application/json", "application/json")
    assert media_type_matches("Application/JSON; charset=utf-8", "application/json")
    assert media_type_matches("text/*", "text/plain")
    assert media_type_matches("text/plain", "*/*")
    assert media_type_matches("*", "image/png")
    assert not media_type_matches("image/png", "text/plain")
    assert not media_type_matches("text/html", "text/plain")


MANIFEST = {
    "offerings": [
        {"id": "md", "output_modes": ["text/markdown"], "input_modes": ["text/plain", "application/pdf"]},
        {"id": "silent"},
    ],
    "default_output_modes": ["application/json"],
}


def test_accepted_output() -> None:
    check_content_type(MANIFEST, "md", ["image/png", "text/markdown"])
    exc = refusal(lambda: check_content_type(MANIFEST, "md", ["image/png"]))
    assert exc.code == "CONTENT_TYPE_NOT_SUPPORTED" and not exc.retryable
    assert exc.details == {"offering": "md", "accepted_output": ["image/png"], "output_modes": ["text/markdown"]}
    # Falls back to the card-level defaults.
    check_content_type(MANIFEST, "silent", ["application/json"])
    refusal(lambda: check_content_type(MANIFEST, "silent", ["text/plain"]))


def test_unknowable_locally_refuses_nothing() -> None:
    check_content_type(None, "md", ["image/png"])  # no manifest at hand
    check_content_type(MANIFEST, "md", [])  # nothing requested
    check_content_type({"offerings": [{"id": "x"}]}, "x", ["image/png"])  # modes unstated


def test_input_types() -> None:
    check_content_type(MANIFEST, "md", None, ["application/pdf"])
    exc = refusal(lambda: check_content_type(MANIFEST, "md", None, ["image/png"]))
    assert exc.details["input_type"] == "image/png"
    check_content_type({"offerings": [{"id": "x"}]}, "x", None, ["image/png"])


def test_preflight_request_reads_config_files_and_legacy_skill() -> None:
    payload = {"skill": "md", "input": {"text": "hi"}, "config": {"accepted_output": ["image/png"]}}
    assert refusal(lambda: preflight_request(payload, MANIFEST)).code == "CONTENT_TYPE_NOT_SUPPORTED"
    with_file = {
        "offering": "md",
        "input": {"text": "summarise"},
        "files": [{"name": "a.png", "media_type": "image/png", "ref": "mesh:artifacts:x", "size": 1}],
    }
    assert refusal(lambda: preflight_request(with_file, MANIFEST)).details["input_type"] == "image/png"
    preflight_request({"offering": "md", "input": {"text": "x"}}, MANIFEST, input_types=["application/pdf"])
    preflight_request({"offering": "md"}, MANIFEST)
    preflight_request("bare text", {"limits": {"max_inbound_chars": 9}})
    assert refusal(lambda: preflight_request("x" * 10, {"limits": {"max_inbound_chars": 9}})).code == (
        "CONTEXT_TOO_LARGE"
    )


def test_content_type_fixture_legacy_and_current_copies() -> None:
    for name, field in (("sender-preflight.json", "skill_output_modes"), ("sender-preflight.ts-sdk.json", "offering_output_modes")):
        fixture = load_fixture(name)
        for case in fixture["content_type"]["cases"]:
            manifest = {"offerings": [{"id": "t", "output_modes": case[field]}]}
            if case["verdict"] == "publish":
                check_content_type(manifest, "t", case["accepted_output"])
            else:
                exc = refusal(partial(check_content_type, manifest, "t", case["accepted_output"]))
                assert exc.code == case["error_code"]


# --- rate-limit self-throttle -----------------------------------------------------------


def test_next_allowed_at_per_second() -> None:
    limits = {"requests_per_second": 2}
    assert next_allowed_at([], limits, NOW) == NOW
    assert next_allowed_at([NOW - 10], limits, NOW) == NOW
    assert next_allowed_at([NOW - 300, NOW - 10], limits, NOW) == NOW - 300 + 1000
    assert next_allowed_at([NOW - 1000, NOW - 10], limits, NOW) == NOW  # left the window


def test_next_allowed_at_takes_the_binding_window() -> None:
    limits = {"requests_per_second": 10, "requests_per_minute": 3, "concurrent_tasks": 1}
    history = [NOW - 50_000, NOW - 20_000, NOW - 5]
    assert next_allowed_at(history, limits, NOW) == NOW - 50_000 + 60_000
    assert next_allowed_at(history, {}, NOW) == NOW
    assert next_allowed_at(history, None, NOW) == NOW
    assert next_allowed_at(history, {"requests_per_second": 0, "requests_per_minute": "3"}, NOW) == NOW


def test_prune_history() -> None:
    limits = {"requests_per_minute": 5}
    assert prune_history([NOW - 70_000, NOW - 60_000, NOW - 59_999, NOW], limits, NOW) == [NOW - 59_999, NOW]
    assert prune_history([NOW], {}, NOW) == []


@given(
    st.lists(st.integers(min_value=0, max_value=120_000), max_size=40),
    st.integers(min_value=1, max_value=5),
    st.integers(min_value=1, max_value=8),
)
def test_throttle_never_exceeds_the_published_rate(gaps: list[int], per_second: int, per_minute: int) -> None:
    """Sending exactly when allowed never puts more than the rate into any window."""
    limits = {"requests_per_second": per_second, "requests_per_minute": per_minute}
    sent: list[int] = []
    now = 0
    for gap in gaps:
        now += gap
        at = next_allowed_at(sent, limits, now)
        assert at >= now
        sent.append(at)
        now = at
    for t in sent:
        assert sum(1 for s in sent if t - 1000 < s <= t) <= per_second
        assert sum(1 for s in sent if t - 60_000 < s <= t) <= per_minute
    # Pruning keeps the answer unchanged.
    assert next_allowed_at(prune_history(sent, limits, now), limits, now) == next_allowed_at(sent, limits, now)
