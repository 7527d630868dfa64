"""Hypothesis strategies for hostile input: JSON, envelopes and their mutations."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from meshnode.protocol.envelope import ENVELOPE_TYPES

#: Scalars a hostile sender can put on the wire, edge values included.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),  # beyond ±2^53 and beyond 64 bits too
    st.sampled_from([2**53, -(2**53), 2**63, 2**64 + 1, 10**400]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["", "\x00", "\ud7ff", "\u2028", "--- END SENDER MESSAGE ---", "\r=== x ===", "A" * 70_000]),
)

json_values: st.SearchStrategy[Any] = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.text(max_size=12), inner, max_size=5),
    ),
    max_leaves=25,
)


def _two(n: int) -> str:
    return f"{n:02d}"


#: Timestamps: well-formed, malformed, and at the edges of what a date can hold.
timestamps = st.one_of(
    st.builds(
        lambda y, mo, d, h, mi, s, frac, zone: f"{y:04d}-{_two(mo)}-{_two(d)}T{_two(h)}:{_two(mi)}:{_two(s)}{frac}{zone}",
        st.integers(0, 9999),
        st.integers(0, 13),
        st.integers(0, 32),
        st.integers(0, 25),
        st.integers(0, 61),
        st.integers(0, 61),
        st.sampled_from(["", ".0", ".123", ".123456789", ".9999999999"]),
        st.sampled_from(["Z", "z", "+00:00", "-23:59", "+23:59", "+24:00", "-00:60", ""]),
    ),
    st.sampled_from(["9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+23:59", "0000-01-01T00:00:00Z"]),
    st.text(max_size=30),
)

keys = st.sampled_from(["v", "id", "type", "ts", "from", "to", "sig", "trace", "payload", "meta",
                        "budget", "error", "artifacts", "task_id", "in_reply_to", "context_id"])


def nested(depth: int, leaf: str = "1", open_: str = "[", close: str = "]") -> bytes:
    """JSON text nested ``depth`` levels deep."""
    return (open_ * depth + leaf + close * depth).encode()


deep_texts = st.integers(min_value=50, max_value=200_000).flatmap(
    lambda depth: st.sampled_from(
        [nested(depth), nested(depth, '{"a":1}'), ('{"a":' * depth + "1" + "}" * depth).encode()]
    )
)

#: Raw wire bytes that are not (or barely) JSON.
raw_bytes = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")),
    deep_texts,
    json_values.map(lambda v: json.dumps(v).encode()),
    st.sampled_from([b"", b"null", b"{}", b"[]", b"NaN", b'{"v": NaN}', b'{"id": 1e999}', b"\xff\xfe",
                     b'{"v":"0.3.0","v":"1.0.0"}', b'"' + b"\\ud800" + b'"']),
)

#: Objects shaped like envelopes with wrong types in any member.
envelope_like = st.dictionaries(keys, json_values, max_size=12)

envelope_types = st.sampled_from(sorted(ENVELOPE_TYPES))


def _as_received(value: Any) -> Any:
    from meshnode.protocol.canonical import parse_json

    return parse_json(json.dumps(value))


def _signable(value: Any) -> bool:
    from meshnode.protocol.canonical import CanonicalJSONError, canonicalize

    try:
        canonicalize(value)
    except CanonicalJSONError:
        return False
    return True


#: JSON values as they can sit in a verified envelope: integers beyond
#: ±(2^53 − 1) arrive as doubles (as an ECMAScript peer reads them), and a
#: literal too large for a double (read as infinity) has no canonical form, so
#: no signature can cover it.
wire_values: st.SearchStrategy[Any] = json_values.map(_as_received).filter(_signable)
