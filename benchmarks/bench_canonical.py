"""Canonical JSON and envelope sign/verify against rfc8785 and raw PyNaCl (the crypto floor)."""

from __future__ import annotations

import copy
from typing import Any

import nacl.signing
import rfc8785

from meshnode.protocol.canonical import canonicalize
from meshnode.protocol.envelope import (
    build_envelope,
    decode_envelope,
    encode_envelope,
    sign_envelope,
    verify_envelope,
)
from meshnode.protocol.nkeys import KeyPair

from .harness import measure, print_table, write_result


def typical_request(key: KeyPair) -> dict[str, Any]:
    """A ~700-byte request envelope as a chat-style caller sends it."""
    env = build_envelope(
        "request",
        key.public_key,
        now_ms=1_785_000_000_000,
        to=KeyPair.generate().public_key,
        payload={
            "offering": "summarize",
            "input": {"text": "Summarise the attached quarterly report for the board in five bullet points.",
                      "max_words": 120, "style": "brief"},
            "config": {"timeout_ms": 30000, "stream": False, "accepted_output": ["text/plain"]},
        },
        context_id="019894f0-0000-7000-8000-00000000c0de",
        meta={"idempotency_key": "report-q3-summary", "priority": "normal"},
    )
    return sign_envelope(env, key)


def run(quick: bool = False) -> dict[str, Any]:
    scale = 1 if not quick else 10
    key = KeyPair.generate()
    env = typical_request(key)
    body = {k: v for k, v in env.items() if k != "sig"}
    size = len(encode_envelope(env))
    assert canonicalize(body) == rfc8785.dumps(body), "fast path must be byte-identical"

    raw_sk = nacl.signing.SigningKey.generate()
    raw_vk = raw_sk.verify_key
    msg = b"agentmesh-envelope-v1\n" + canonicalize(body)
    raw_sig = raw_sk.sign(msg).signature
    wire = encode_envelope(env)
    env_copy = copy.deepcopy(env)

    ours = measure("canonicalize (meshnode)", lambda: canonicalize(body), batch=20000 // scale)
    base = measure("rfc8785.dumps", lambda: rfc8785.dumps(body), batch=2000 // scale)
    sign_floor = measure("PyNaCl sign (floor)", lambda: raw_sk.sign(msg), batch=2000 // scale)
    verify_floor = measure("PyNaCl verify (floor)", lambda: raw_vk.verify(msg, raw_sig), batch=2000 // scale)

    def sign_once() -> None:
        env_copy.pop("sig", None)
        sign_envelope(env_copy, key)

    sign_env = measure("sign envelope (meshnode)", sign_once, batch=2000 // scale)
    verify_env = measure("verify envelope (meshnode)", lambda: verify_envelope(env), batch=2000 // scale)
    decode_env = measure("decode+validate+verify (meshnode)", lambda: decode_envelope(wire), batch=2000 // scale)

    rows = [("measurement", "ops/s", "µs/op", "ratio")]
    rows.append((ours.name, f"{ours.ops_per_s:,.0f}", f"{ours.us_per_op:.2f}", f"{base.us_per_op / ours.us_per_op:.1f}x faster than rfc8785"))
    rows.append((base.name, f"{base.ops_per_s:,.0f}", f"{base.us_per_op:.2f}", "baseline"))
    rows.append((sign_env.name, f"{sign_env.ops_per_s:,.0f}", f"{sign_env.us_per_op:.2f}", f"{sign_env.us_per_op / sign_floor.us_per_op:.2f}x the floor"))
    rows.append((sign_floor.name, f"{sign_floor.ops_per_s:,.0f}", f"{sign_floor.us_per_op:.2f}", "floor"))
    rows.append((verify_env.name, f"{verify_env.ops_per_s:,.0f}", f"{verify_env.us_per_op:.2f}", f"{verify_env.us_per_op / verify_floor.us_per_op:.2f}x the floor"))
    rows.append((decode_env.name, f"{decode_env.ops_per_s:,.0f}", f"{decode_env.us_per_op:.2f}", f"{decode_env.us_per_op / verify_floor.us_per_op:.2f}x the floor"))
    rows.append((verify_floor.name, f"{verify_floor.ops_per_s:,.0f}", f"{verify_floor.us_per_op:.2f}", "floor"))
    print_table(f"canonical JSON and signatures ({size}-byte request envelope)", rows)
    result = {
        "envelope_bytes": size,
        "canonical_speedup_vs_rfc8785": base.us_per_op / ours.us_per_op,
        "sign_vs_floor": sign_env.us_per_op / sign_floor.us_per_op,
        "verify_vs_floor": verify_env.us_per_op / verify_floor.us_per_op,
        "decode_verify_vs_floor": decode_env.us_per_op / verify_floor.us_per_op,
        "measurements": [ours, base, sign_env, sign_floor, verify_env, decode_env, verify_floor],
    }
    path = write_result("canonical", result)
    print(f"written {path}")
    return result
