"""The message envelope (AgentMesh §5): build, sign, verify, validate, encode, decode.

An envelope is held as a plain ``dict`` — exactly the JSON object on the wire —
because the signature covers that object's canonical bytes, and a model class
that re-serializes would be one more place for absent-vs-null to drift (§5.3).
Optional members are *absent* unless set; ``trace.parent_span_id`` is the one
member that is explicitly ``null`` (on a root span).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from typing import Any

import orjson

from .canonical import CanonicalJSONError, parse_json
from .errors import ProtocolError
from .nkeys import KeyPair, NkeyError, decode_public
from .random_bits import random_hex16, random_hex32, random_u64
from .signing import ENVELOPE_TAG, sign_object, verify_object
from .timeutil import format_ts

__all__ = [
    "ENVELOPE_TYPES",
    "PROTOCOL_VERSION",
    "IdGenerator",
    "Trace",
    "build_envelope",
    "child_trace",
    "decode_envelope",
    "encode_envelope",
    "hops",
    "new_root_trace",
    "sign_envelope",
    "trace_from_traceparent",
    "trace_to_traceparent",
    "validate_envelope",
    "valid_trace",
    "verify_envelope",
]

PROTOCOL_VERSION = "0.3.0"
SUPPORTED_MAJOR = 0

ENVELOPE_TYPES = frozenset({"register", "discover", "request", "respond", "emit", "subscribe"})

_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_SEMVER_MAJOR = re.compile(r"(\d+)\.\d+(?:\.\d+)?(?:[-+][0-9A-Za-z.+-]*)?")
_OPTIONAL_STRINGS = ("to", "task_id", "in_reply_to", "context_id")

Trace = dict[str, Any]


class IdGenerator:
    """UUIDv7 message ids: 48-bit millisecond time, 12-bit per-process counter, random.

    The counter keeps ids from one process strictly increasing within a
    millisecond; the time comes from the caller (the core reads no clock).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_ms = -1
        self._counter = 0

    def new_id(self, now_ms: int) -> str:
        with self._lock:
            if now_ms <= self._last_ms:
                now_ms = self._last_ms
                self._counter += 1
                if self._counter > 0xFFF:  # counter exhausted: borrow the next millisecond
                    now_ms += 1
                    self._counter = 0
            else:
                self._counter = random_u64() & 0x3FF
            self._last_ms = now_ms
            counter = self._counter
        value = (
            ((now_ms & ((1 << 48) - 1)) << 80)
            | (0x7 << 76)
            | (counter << 64)
            | (0b10 << 62)
            | (random_u64() & ((1 << 62) - 1))
        )
        h = value.to_bytes(16, "big").hex()
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


_default_ids = IdGenerator()


def new_root_trace(tracestate: str | None = None) -> Trace:
    """A fresh root trace context: new trace_id and span_id, parent_span_id null."""
    trace: Trace = {
        "trace_id": random_hex32(),
        "span_id": random_hex16(),
        "parent_span_id": None,
    }
    if tracestate:
        trace["tracestate"] = tracestate
    return trace


def valid_trace(trace: object) -> bool:
    """True when ``trace`` is a well-formed W3C context as §5.2 and §13.1 define it."""
    # dict first: an ABC isinstance costs 7x, and every trace read off the wire is a dict
    if not isinstance(trace, dict) and not isinstance(trace, Mapping):
        return False
    if not (isinstance(trace.get("trace_id"), str) and _HEX32.fullmatch(trace["trace_id"])):
        return False
    if trace["trace_id"] == "0" * 32:
        return False
    if not (isinstance(trace.get("span_id"), str) and _HEX16.fullmatch(trace["span_id"])):
        return False
    if trace["span_id"] == "0" * 16:
        return False
    parent = trace.get("parent_span_id")
    if parent is not None and not (isinstance(parent, str) and _HEX16.fullmatch(parent)):
        return False
    ts = trace.get("tracestate")
    return ts is None or isinstance(ts, str)


def child_trace(parent: Mapping[str, Any] | None) -> Trace:
    """The context for an operation caused by ``parent`` (§13.1).

    Keeps trace_id and tracestate, mints a new span_id, and sets parent_span_id
    to the parent's span. An invalid or missing parent yields a fresh root: an
    inbound trace is never copied unless it is well-formed.
    """
    if parent is None or not valid_trace(parent):
        return new_root_trace()
    trace: Trace = {
        "trace_id": parent["trace_id"],
        "span_id": random_hex16(),
        "parent_span_id": parent["span_id"],
    }
    if parent.get("tracestate"):
        trace["tracestate"] = parent["tracestate"]
    return trace


def trace_to_traceparent(trace: Mapping[str, Any], sampled: bool = True) -> str:
    """A version-00 traceparent header for ``trace`` (§13.1)."""
    if not valid_trace(trace):
        raise ValueError("not a valid trace context")
    return f"00-{trace['trace_id']}-{trace['span_id']}-{'01' if sampled else '00'}"


_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def trace_from_traceparent(header: str, tracestate: str | None = None) -> Trace | None:
    """Parse a traceparent into an envelope trace (as received: the remote span is
    ``span_id``; call :func:`child_trace` to continue it). None when malformed."""
    m = _TRACEPARENT.fullmatch(header.strip().lower()) if isinstance(header, str) else None
    if m is None or m.group(1) == "ff":
        return None
    trace: Trace = {"trace_id": m.group(2), "span_id": m.group(3), "parent_span_id": None}
    if tracestate:
        trace["tracestate"] = tracestate
    return trace if valid_trace(trace) else None


def build_envelope(
    type: str,
    sender: str,
    *,
    now_ms: int,
    to: str | None = None,
    payload: Any = None,
    trace: Mapping[str, Any] | None = None,
    task_id: str | None = None,
    in_reply_to: str | None = None,
    context_id: str | None = None,
    budget: Mapping[str, Any] | None = None,
    error: Mapping[str, Any] | None = None,
    artifacts: list[Any] | None = None,
    meta: Mapping[str, Any] | None = None,
    id: str | None = None,
    ids: IdGenerator | None = None,
    include_payload: bool = True,
) -> dict[str, Any]:
    """Build an unsigned envelope. Unset optional members are absent, not null.

    ``payload=None`` with ``include_payload`` omits the payload member; pass
    ``include_payload=True`` and a value to send it (a JSON ``null`` payload is
    not something the protocol needs).
    """
    if type not in ENVELOPE_TYPES:
        raise ValueError(f"unknown envelope type {type!r}")
    env: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "id": id if id is not None else (ids or _default_ids).new_id(now_ms),
        "type": type,
        "ts": format_ts(now_ms),
        "from": sender,
        "trace": dict(trace) if trace is not None else new_root_trace(),
    }
    if to is not None:
        env["to"] = to
    if task_id is not None:
        env["task_id"] = task_id
    if in_reply_to is not None:
        env["in_reply_to"] = in_reply_to
    if context_id is not None:
        env["context_id"] = context_id
    if budget is not None:
        env["budget"] = dict(budget)
    if error is not None:
        env["error"] = dict(error)
    if payload is not None and include_payload:
        env["payload"] = payload
    if artifacts is not None:
        env["artifacts"] = list(artifacts)
    if meta:
        env["meta"] = dict(meta)
    return env


def sign_envelope(env: dict[str, Any], key: KeyPair) -> dict[str, Any]:
    """Sign ``env`` in place with the sender's key (tag ``agentmesh-envelope-v1``)."""
    if env.get("from") != key.public_key:
        raise ValueError("an envelope is signed by the key named in its from")
    env.pop("sig", None)
    env["sig"] = sign_object(env, ENVELOPE_TAG, key)
    return env


def _invalid(message: str, **details: Any) -> ProtocolError:
    return ProtocolError("INVALID_ENVELOPE", message, dict(details))


def validate_envelope(env: object) -> dict[str, Any]:
    """Structural validation (§5.1, §5.2, §20.2).

    Raises ProtocolError INVALID_ENVELOPE (naming the member) or INVALID_VERSION.
    Returns the envelope typed as a dict.
    """
    if not isinstance(env, dict):
        raise _invalid("envelope is not a JSON object")
    v = env.get("v")
    if not isinstance(v, str):
        raise _invalid("member 'v' is required and must be a string", member="v")
    m = _SEMVER_MAJOR.fullmatch(v)
    if m is None:
        raise _invalid("member 'v' is not a semantic version", member="v")
    if int(m.group(1)) != SUPPORTED_MAJOR:
        raise ProtocolError(
            "INVALID_VERSION",
            f"protocol major version {m.group(1)} is not supported",
            {"supported_major": SUPPORTED_MAJOR, "v": v},
        )
    for member in ("id", "type", "ts", "from", "sig"):
        value = env.get(member)
        if not isinstance(value, str) or not value:
            raise _invalid(f"member {member!r} is required and must be a non-empty string", member=member)
    if env["type"] not in ENVELOPE_TYPES:
        raise _invalid(f"unknown envelope type {env['type']!r}", member="type")
    try:
        decode_public(env["from"])
    except NkeyError as exc:
        raise _invalid(f"member 'from' is not an agent key: {exc}", member="from") from None
    trace = env.get("trace")
    if not isinstance(trace, dict):
        raise _invalid("member 'trace' is required and must be an object", member="trace")
    for member in _OPTIONAL_STRINGS:
        value = env.get(member)
        if value is not None and not isinstance(value, str):
            raise _invalid(f"member {member!r} must be a string", member=member)
    for member in ("meta", "budget", "error"):
        value = env.get(member)
        if value is not None and not isinstance(value, dict):
            raise _invalid(f"member {member!r} must be an object", member=member)
    artifacts = env.get("artifacts")
    if artifacts is not None and not isinstance(artifacts, list):
        raise _invalid("member 'artifacts' must be an array", member="artifacts")
    meta = env.get("meta")
    if meta is not None and "hops" in meta:
        h = meta["hops"]
        if type(h) is not int or h < 0:
            raise _invalid("meta.hops must be a non-negative integer", member="meta.hops")
    return env


def verify_envelope(env: Mapping[str, Any], *, accept_legacy_untagged: bool = False) -> None:
    """Check the envelope signature against ``from`` (§5.3 step 1).

    Raises ProtocolError IDENTITY_MISMATCH when it does not verify. The legacy
    untagged form is accepted only when explicitly enabled (the 0.2 window).
    """
    try:
        ok = verify_object(
            env, ENVELOPE_TAG, env["from"], accept_legacy_untagged=accept_legacy_untagged
        )
    except (CanonicalJSONError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ProtocolError("IDENTITY_MISMATCH", "envelope signature does not verify against from")


def hops(env: Mapping[str, Any]) -> int:
    """The relay counter meta.hops (§21.2); 0 when absent."""
    meta = env.get("meta")
    if meta is not None and isinstance(meta, Mapping):  # most envelopes carry no meta
        h = meta.get("hops")
        if type(h) is int:
            return h
    return 0


def encode_envelope(env: Mapping[str, Any]) -> bytes:
    """Wire bytes of an envelope (compact JSON; key order is free on the wire)."""
    return orjson.dumps(env)


def decode_envelope(
    data: bytes | bytearray | memoryview | str,
    *,
    verify: bool = True,
    accept_legacy_untagged: bool = False,
) -> dict[str, Any]:
    """Parse, validate and (by default) verify an envelope from wire bytes.

    Raises ProtocolError: INVALID_ENVELOPE for bytes that are not a valid
    envelope, INVALID_VERSION for an unsupported major version,
    IDENTITY_MISMATCH for a signature that does not verify.
    """
    scanned: bool | str | None = None
    try:
        if isinstance(data, (bytes, bytearray, memoryview)):
            try:
                obj = orjson.loads(data)
                scanned = _scan(obj)
                if scanned is True:  # same shape, read with a peer's number semantics
                    obj = parse_json(data)
            except orjson.JSONDecodeError:
                obj = parse_json(data)  # orjson refuses >64-bit ints; the stdlib path does not
        else:
            obj = parse_json(data)
    except (ValueError, CanonicalJSONError) as exc:
        raise _invalid(f"not JSON: {exc}") from None
    except RecursionError:
        # The stdlib parser recurses per level: text nested thousands deep.
        raise _too_deep() from None
    if scanned is None:
        scanned = _scan(obj)
    if scanned is _TOO_DEEP:
        raise _too_deep()
    env = validate_envelope(obj)
    if verify:
        verify_envelope(env, accept_legacy_untagged=accept_legacy_untagged)
    return env


_MAX_SAFE = 2**53 - 1

#: How deeply an inbound envelope may nest (objects and arrays, the envelope
#: itself being level 1). Far beyond any real message, far below what the
#: recursive steps after decoding (canonical JSON for the signature, the §22.5
#: measurement, schema validation, framing) can take: without it a stranger's
#: 900-deep payload raised RecursionError out of signature verification.
MAX_NESTING = 100

_TOO_DEEP = "too deep"


def _too_deep() -> ProtocolError:
    return _invalid(f"nested deeper than {MAX_NESTING} levels", max_nesting=MAX_NESTING)


def _scan(value: Any) -> bool | str:
    """One iterative walk: ``_TOO_DEEP`` when nested beyond MAX_NESTING, else
    True when an integer lies outside ±(2^53 − 1) (re-parse as a peer would)."""
    unsafe = False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        t = type(item)
        if t is int:
            if not -_MAX_SAFE <= item <= _MAX_SAFE:
                unsafe = True
            continue
        if t is dict:
            children: Any = item.values()
        elif t is list:
            children = item
        else:
            continue
        if depth > MAX_NESTING:
            return _TOO_DEEP
        for child in children:
            tc = type(child)
            if tc is dict or tc is list or tc is int:
                stack.append((child, depth + 1))
    return unsafe
