"""The envelope (§5): build, sign, verify, validate, decode, ids and trace context."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnode.protocol.canonical import canonicalize
from meshnode.protocol.envelope import (
    IdGenerator,
    build_envelope,
    child_trace,
    decode_envelope,
    encode_envelope,
    hops,
    new_root_trace,
    sign_envelope,
    trace_from_traceparent,
    trace_to_traceparent,
    valid_trace,
    validate_envelope,
    verify_envelope,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.signing import ENVELOPE_TAG, b64url_encode
from meshnode.protocol.timeutil import parse_rfc3339
from tests.conftest import load_fixture

NOW = 1_785_000_000_123
UUID7 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


@pytest.fixture
def key() -> KeyPair:
    return KeyPair.generate()


def signed(key: KeyPair, **kw: Any) -> dict[str, Any]:
    env = build_envelope("request", key.public_key, now_ms=NOW, payload={"offering": "echo", "input": {"text": "hi"}}, **kw)
    return sign_envelope(env, key)


def test_build_has_required_members_and_no_nulls(key: KeyPair) -> None:
    env = build_envelope("emit", key.public_key, now_ms=NOW)
    assert set(env) == {"v", "id", "type", "ts", "from", "trace"}
    assert env["ts"] == "2026-07-25T17:20:00.123Z"
    assert parse_rfc3339(env["ts"]) == NOW * 1000
    assert UUID7.fullmatch(env["id"])
    assert env["trace"]["parent_span_id"] is None  # explicit null on a root


def test_uuid7_time_prefix_and_monotonic() -> None:
    gen = IdGenerator()
    ids = [gen.new_id(NOW) for _ in range(5000)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert int(ids[0].replace("-", "")[:12], 16) >= NOW
    assert all(UUID7.fullmatch(i) for i in ids)


def test_sign_verify_round_trip(key: KeyPair) -> None:
    env = signed(key, to=KeyPair.generate().public_key)
    back = decode_envelope(encode_envelope(env))
    assert back == env


def test_signature_covers_tagged_canonical_bytes(key: KeyPair) -> None:
    env = signed(key)
    body = {k: v for k, v in env.items() if k != "sig"}
    expected = b64url_encode(key.sign(ENVELOPE_TAG.encode() + b"\n" + canonicalize(body)))
    assert env["sig"] == expected


@pytest.mark.parametrize("member,value", [("payload", {"offering": "echo", "input": {"text": "hj"}}), ("to", "x"), ("ts", "2026-07-25T17:20:00.124Z")])
def test_any_change_breaks_the_signature(key: KeyPair, member: str, value: object) -> None:
    env = signed(key)
    env[member] = value
    with pytest.raises(ProtocolError) as info:
        verify_envelope(env)
    assert info.value.code == "IDENTITY_MISMATCH"


def test_signature_by_another_key_is_identity_mismatch(key: KeyPair) -> None:
    env = signed(key)
    other = KeyPair.generate()
    env["sig"] = b64url_encode(other.sign(b"whatever"))
    with pytest.raises(ProtocolError, match="IDENTITY_MISMATCH"):
        decode_envelope(json.dumps(env))


def test_legacy_untagged_refused_by_default_accepted_when_enabled(key: KeyPair) -> None:
    env = build_envelope("request", key.public_key, now_ms=NOW, payload={"offering": "x"})
    env["sig"] = b64url_encode(key.sign(canonicalize(env)))
    with pytest.raises(ProtocolError, match="IDENTITY_MISMATCH"):
        verify_envelope(env)
    verify_envelope(env, accept_legacy_untagged=True)


@pytest.mark.parametrize(
    "mutate,member",
    [
        (lambda e: e.pop("id"), "id"),
        (lambda e: e.__setitem__("type", "shout"), "type"),
        (lambda e: e.__setitem__("from", "Uxyz"), "from"),
        (lambda e: e.pop("trace"), "trace"),
        (lambda e: e.__setitem__("meta", []), "meta"),
        (lambda e: e.__setitem__("task_id", 5), "task_id"),
        (lambda e: e.__setitem__("meta", {"hops": "2"}), "meta.hops"),
        (lambda e: e.pop("sig"), "sig"),
    ],
)
def test_structural_refusals_name_the_member(key: KeyPair, mutate, member: str) -> None:  # type: ignore[no-untyped-def]
    env = signed(key)
    mutate(env)
    with pytest.raises(ProtocolError) as info:
        validate_envelope(env)
    assert info.value.code == "INVALID_ENVELOPE"
    assert info.value.details.get("member") == member


@pytest.mark.parametrize("v,ok", [("0.3.0", True), ("0.2.0", True), ("0.9.1-rc.1", True), ("1.0.0", False), ("2.1", False)])
def test_major_version_check(key: KeyPair, v: str, ok: bool) -> None:
    env = signed(key)
    env["v"] = v
    if ok:
        validate_envelope(env)
    else:
        with pytest.raises(ProtocolError) as info:
            validate_envelope(env)
        assert info.value.code == "INVALID_VERSION"


@pytest.mark.parametrize("data", [b"", b"not json", b"[]", b'{"v":"0.3.0"}', b"\xff\xfe", b'{"a":NaN}'])
def test_decode_refuses_garbage_as_invalid_envelope(data: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_envelope(data)
    assert info.value.code == "INVALID_ENVELOPE"


def test_decode_with_big_integer_uses_double_semantics(key: KeyPair) -> None:
    env = signed(key)
    raw = encode_envelope(env).replace(b'"payload":{', b'"payload":{"big":18446744073709551616,', 1)
    with pytest.raises(ProtocolError, match="IDENTITY_MISMATCH"):
        decode_envelope(raw)  # the big member was not signed; decoding did not crash


def test_fixture_envelopes_decode_and_verify() -> None:
    for name in ("inbound-protections.json", "inbound-protections.ts-sdk.json"):
        fixture = load_fixture(name)
        for entry in fixture["envelopes"].values():
            if isinstance(entry, dict) and "envelope" in entry:
                env = decode_envelope(json.dumps(entry["envelope"]))
                assert canonicalize({k: v for k, v in env.items() if k != "sig"}).decode() == entry["canonical"]
                tampered = copy.deepcopy(entry["envelope"])
                tampered["id"] = tampered["id"][:-1] + ("0" if tampered["id"][-1] != "0" else "1")
                with pytest.raises(ProtocolError):
                    decode_envelope(json.dumps(tampered))


def test_hops(key: KeyPair) -> None:
    assert hops(signed(key)) == 0
    assert hops(signed(key, meta={"hops": 4})) == 4


# --- trace context (§13.1) -------------------------------------------------


def test_child_trace_keeps_trace_id_and_links_parent() -> None:
    root = new_root_trace(tracestate="vendor=1")
    child = child_trace(root)
    assert child["trace_id"] == root["trace_id"]
    assert child["parent_span_id"] == root["span_id"]
    assert child["span_id"] != root["span_id"]
    assert child["tracestate"] == "vendor=1"
    assert valid_trace(child)


@pytest.mark.parametrize(
    "bad",
    [None, {}, {"trace_id": "X" * 32, "span_id": "a" * 16}, {"trace_id": "a" * 32, "span_id": "0" * 16},
     {"trace_id": "a" * 32, "span_id": "b" * 16, "parent_span_id": "short"}],
)
def test_invalid_inbound_trace_becomes_fresh_root(bad: object) -> None:
    child = child_trace(bad)  # type: ignore[arg-type]
    assert valid_trace(child) and child["parent_span_id"] is None
    if isinstance(bad, dict) and "trace_id" in bad:
        assert child["trace_id"] != bad["trace_id"]


@given(st.binary(min_size=16, max_size=16), st.binary(min_size=8, max_size=8))
def test_traceparent_round_trip(tid: bytes, sid: bytes) -> None:
    trace = {"trace_id": tid.hex(), "span_id": sid.hex(), "parent_span_id": None}
    if not valid_trace(trace):
        return  # all-zero ids are invalid in W3C and are refused on both sides
    header = trace_to_traceparent(trace)
    assert header == f"00-{tid.hex()}-{sid.hex()}-01"
    assert trace_from_traceparent(header) == trace


@pytest.mark.parametrize("header", ["", "00-xyz", "ff-" + "a" * 32 + "-" + "b" * 16 + "-01", "00-" + "0" * 32 + "-" + "b" * 16 + "-01"])
def test_bad_traceparent_is_none(header: str) -> None:
    assert trace_from_traceparent(header) is None


def test_nesting_beyond_the_bound_is_an_invalid_envelope_not_a_recursion_error() -> None:
    from meshnode.protocol.envelope import MAX_NESTING

    for text in (b"[" * 100_000, b'{"a":' * 900 + b"1" + b"}" * 900, b"[" * (MAX_NESTING + 1) + b"]" * (MAX_NESTING + 1)):
        with pytest.raises(ProtocolError) as info:
            decode_envelope(text)
        assert info.value.code == "INVALID_ENVELOPE"
