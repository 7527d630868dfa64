"""Error table (§12), RFC 3339 instants, tagged signatures (§4.4, §5.3)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnode.protocol.errors import (
    ERROR_CODES,
    ProtocolError,
    error_object,
    is_retryable,
    normalize_code,
)
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.signing import (
    ENVELOPE_TAG,
    VOUCH_TAG,
    b64url_decode,
    b64url_encode,
    sign_object,
    signed_bytes,
    verify_object,
)
from meshnode.protocol.timeutil import format_ts, parse_rfc3339, try_parse_rfc3339


@pytest.mark.parametrize(
    "code,retryable",
    [("TRANSPORT_TIMEOUT", True), ("RATE_LIMITED", True), ("INTERNAL_ERROR", True), ("AGENT_OVERLOADED", True),
     ("CONTEXT_TOO_LARGE", False), ("OFFERING_NOT_FOUND", False), ("ARTIFACT_GONE", False), ("UNKNOWN_X", False)],
)
def test_retryability_follows_the_table(code: str, retryable: bool) -> None:
    assert is_retryable(code) is retryable


def test_legacy_code_is_read_as_the_new_one_and_never_emitted() -> None:
    assert normalize_code("SKILL_NOT_FOUND") == "OFFERING_NOT_FOUND"
    assert ProtocolError("SKILL_NOT_FOUND").code == "OFFERING_NOT_FOUND"
    assert "SKILL_NOT_FOUND" not in ERROR_CODES


def test_error_object_omits_absent_members() -> None:
    assert error_object("INPUT_INVALID", "bad") == {"code": "INPUT_INVALID", "message": "bad", "retryable": False}
    obj = error_object("RATE_LIMITED", "slow down", {"limit": 60}, retry_after_ms=1500)
    assert obj == {"code": "RATE_LIMITED", "message": "slow down", "retryable": True,
                   "details": {"limit": 60}, "retry_after_ms": 1500}


@pytest.mark.parametrize(
    "text,us",
    [("2026-07-26T12:00:00.000Z", 1785067200000000), ("2026-07-26T13:00:00+01:00", 1785067200000000),
     ("2026-07-26t12:00:00.123456z", 1785067200123456), ("2026-07-26T11:00:00-01:00", 1785067200000000),
     ("2016-12-31T23:59:60Z", 1483228800000000)],
)
def test_rfc3339_any_form(text: str, us: int) -> None:
    assert parse_rfc3339(text) == us


@pytest.mark.parametrize("bad", ["", "2026-07-26", "2026-07-26 12:00:00Z", "2026-13-01T00:00:00Z", "2026-07-26T12:00:00", "x",
                                 "9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+00:01"])
def test_rfc3339_refuses_everything_else(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_rfc3339(bad)
    assert try_parse_rfc3339(bad) is None


@given(st.integers(min_value=0, max_value=4_000_000_000_000))
def test_format_round_trips(ms: int) -> None:
    text = format_ts(ms)
    assert text.endswith("Z") and len(text) == 24
    assert parse_rfc3339(text) == ms * 1000


@given(st.binary(max_size=80))
def test_b64url_round_trip_without_padding(raw: bytes) -> None:
    text = b64url_encode(raw)
    assert "=" not in text and "+" not in text and "/" not in text
    assert b64url_decode(text) == raw


def test_tags_separate_domains() -> None:
    key = KeyPair.generate()
    obj = {"node": key.public_key, "agent": "x", "issued_at": "a", "expires_at": "b"}
    obj["sig"] = sign_object(obj, VOUCH_TAG, key)
    assert verify_object(obj, VOUCH_TAG, key.public_key)
    assert not verify_object(obj, ENVELOPE_TAG, key.public_key)  # same bytes, other meaning: refused
    assert signed_bytes(obj, VOUCH_TAG).startswith(b"agentmesh-vouch-v1\n{")
    assert not verify_object(dict(obj, sig="!!!"), VOUCH_TAG, key.public_key)
    assert not verify_object({k: v for k, v in obj.items() if k != "sig"}, VOUCH_TAG, key.public_key)
