"""The encodings of the AGBoss mesh extension (A2A-MESH-EXTENSION.md): ISO 8601
durations of seconds, USD decimal strings, Ed25519 keys as configured, RFC 3339
instants, and compact JWS (EdDSA over Ed25519, or ``alg: none``) whose header
and payload are RFC 8785 canonical JSON. Pure: no I/O, the clock passed in.
:mod:`meshnode.protocol.a2a_extension` builds the envelope and the run report
on these."""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import nacl.exceptions
import nacl.signing

from meshnode.protocol.canonical import canonicalize
from meshnode.protocol.nkeys import decode_public, is_valid_public
from meshnode.protocol.timeutil import format_ts, try_parse_rfc3339

__all__ = [
    "ParsedJWS",
    "format_duration",
    "format_instant",
    "format_usd",
    "instant_s",
    "jws",
    "parse_duration",
    "parse_jws",
    "parse_usd",
    "parse_verify_key",
    "verify_signature",
]


# --- small value helpers -------------------------------------------------------

_DURATION = re.compile(
    r"P(?:(?P<d>\d+(?:\.\d+)?)D)?"
    r"(?:T(?:(?P<h>\d+(?:\.\d+)?)H)?(?:(?P<m>\d+(?:\.\d+)?)M)?(?:(?P<s>\d+(?:\.\d+)?)S)?)?"
)


def parse_duration(text: str) -> float:
    """Seconds of an ISO 8601 duration of days/hours/minutes/seconds
    (``PT60S``, ``PT1.5S``, ``P1DT2H``). Years, months and weeks have no fixed
    length and are refused. Raises ValueError."""
    if not isinstance(text, str):
        raise ValueError("a duration is a string")
    m = _DURATION.fullmatch(text)
    if m is None or text in ("P", "PT") or text.endswith("T"):
        raise ValueError(f"not an ISO 8601 duration of seconds: {text!r}")
    d, h, mi, s = (float(m.group(g) or 0) for g in ("d", "h", "m", "s"))
    return d * 86400 + h * 3600 + mi * 60 + s


def format_duration(seconds: float) -> str:
    """``PT<n>S`` with the seconds as a plain decimal (``PT86400S``, ``PT1.5S``)."""
    if seconds < 0:
        raise ValueError("a duration is not negative")
    text = format(Decimal(repr(float(seconds))).normalize(), "f")
    return f"PT{text}S"


_USD = re.compile(r"\d+(?:\.\d+)?")


def parse_usd(text: object) -> Decimal:
    """A non-negative USD decimal string (``"0.25"``) as a Decimal. The wire
    carries money as a string, never a float; raises ValueError otherwise."""
    if not isinstance(text, str) or _USD.fullmatch(text) is None:
        raise ValueError(f"not a non-negative decimal string: {text!r}")
    try:
        return Decimal(text)
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
        raise ValueError(f"not a decimal: {text!r}") from None


def format_usd(amount: Decimal | int | str) -> str:
    """A Decimal as a plain decimal string without exponent (``"0.25"``, ``"3"``)."""
    value = Decimal(amount)
    if not value.is_finite() or value < 0:
        raise ValueError(f"not a non-negative finite amount: {amount!r}")
    text = format(value, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text or "0"


def _b64e(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _b64d(text: str) -> bytes:
    if not text.isascii() or "=" in text:
        raise ValueError("not unpadded base64url")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"malformed base64url: {exc}") from None


def parse_verify_key(text: str) -> nacl.signing.VerifyKey:
    """An Ed25519 public key from configuration: a user nkey (``U…``), or the 32
    raw bytes in base64url/base64 (optionally prefixed ``ed25519:``)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("a key is a non-empty string")
    text = text.strip()
    if is_valid_public(text, None):
        return nacl.signing.VerifyKey(decode_public(text, None))
    body = text.removeprefix("ed25519:")
    decoders: tuple[Callable[[str], bytes], ...] = (
        lambda t: _b64d(t.rstrip("=")),
        lambda t: base64.b64decode(t, validate=True),
    )
    for decode in decoders:
        try:
            raw = decode(body)
        except (ValueError, binascii.Error):
            continue
        if len(raw) == 32:
            return nacl.signing.VerifyKey(raw)
    raise ValueError(
        "not an Ed25519 public key: expected a user nkey (U…) or 32 bytes in base64url"
    )


# --- JWS --------------------------------------------------------------------------


def jws(
    header: Mapping[str, Any], claims: Mapping[str, Any], key: nacl.signing.SigningKey | None
) -> str:
    head = _b64e(canonicalize(dict(header)))
    body = _b64e(canonicalize(dict(claims)))
    signing_input = f"{head}.{body}".encode("ascii")
    sig = "" if key is None else _b64e(key.sign(signing_input).signature)
    return f"{head}.{body}.{sig}"


@dataclass(frozen=True, slots=True)
class ParsedJWS:
    header: dict[str, Any]
    claims: dict[str, Any]
    signing_input: bytes
    signature: bytes


def parse_jws(token: object) -> ParsedJWS:
    if not isinstance(token, str):
        raise ValueError("a JWS is a string")
    parts = token.split(".")
    if len(parts) != 3:
        raise ValueError("a compact JWS has three parts")
    head_b, body_b, sig_b = parts
    try:
        header = json.loads(_b64d(head_b))
        claims = json.loads(_b64d(body_b))
        signature = _b64d(sig_b) if sig_b else b""
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed JWS: {exc}") from None
    if not isinstance(header, dict) or not isinstance(claims, dict):
        raise ValueError("JWS header and payload are JSON objects")
    return ParsedJWS(header, claims, f"{head_b}.{body_b}".encode("ascii"), signature)


def verify_signature(parsed: ParsedJWS, key: nacl.signing.VerifyKey) -> bool:
    if len(parsed.signature) != 64:
        return False
    try:
        key.verify(parsed.signing_input, parsed.signature)
    except (nacl.exceptions.BadSignatureError, ValueError):
        return False
    return True


def instant_s(value: object) -> float | None:
    """issuedAt as epoch seconds: an RFC 3339 string or a JSON number (seconds)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    us = try_parse_rfc3339(value)
    return None if us is None else us / 1_000_000


def format_instant(now: float) -> str:
    """Epoch seconds as the RFC 3339 ``issuedAt`` this module writes."""
    return format_ts(int(now * 1000))
