"""Canonical JSON (AgentMesh §5.3): RFC 8785 (JCS) plus the two AgentMesh rules.

The AgentMesh rules govern which value reaches the serializer: a member that was
never set is simply absent from the dict (never ``None``), and ``None`` where
present is the JSON value ``null``. This module serializes what it is given.

Every envelope sent and received goes through :func:`canonicalize`, so it has a
fast path: for plain dicts/lists of strings, safe integers, booleans and null
with keys inside the Basic Multilingual Plane, orjson's sorted-key output is
byte-for-byte JCS (minimal escaping with lowercase ``\\u00hh``, raw UTF-8
otherwise; code-point order equals UTF-16 code-unit order within the BMP). One
cheap walk sends everything else (floats, non-BMP keys, subclasses, invalid
values) through a careful serializer that formats numbers per ECMAScript and
sorts keys by UTF-16 code units.

Numbers on the wire are IEEE-754 doubles. :func:`parse_json` reads JSON text the
way an ECMAScript peer does (an integer literal beyond 2^53 becomes the nearest
double), while :func:`canonicalize` refuses a Python ``int`` outside
±(2^53 − 1): a program that builds such a value has a bug that would otherwise
be silently rounded under a signature.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

__all__ = [
    "MAX_SAFE_INTEGER",
    "CanonicalJSONError",
    "canonicalize",
    "canonical_text",
    "format_number",
    "parse_json",
]

MAX_SAFE_INTEGER = 2**53 - 1


class CanonicalJSONError(ValueError):
    """A value that has no canonical JSON form (NaN, Infinity, an unsafe integer,
    a non-JSON type, a lone surrogate). ``path`` names where it was found."""

    def __init__(self, message: str, path: str = "$") -> None:
        super().__init__(f"{message} at {path}")
        self.path = path


# The C encoder that serves as the fast path. orjson's output for sorted keys,
# integers within ±(2^53-1), strings and literals is byte-identical to JCS
# (verified against the fixture and by property tests); floats and non-BMP keys
# are the two things it does differently, and _needs_slow_path routes those elsewhere.
_FAST_OPTIONS = orjson.OPT_SORT_KEYS | orjson.OPT_STRICT_INTEGER

# The stdlib encoder serves for single strings on the slow path.
_encode_string = json.JSONEncoder(ensure_ascii=False, check_circular=False).encode

_BMP_MAX = "\uffff"


def _needs_slow_path(value: Any) -> bool:
    """True when ``value`` holds a float, a non-BMP object key, or any type the
    slow path must judge (subclasses, non-JSON types). Plain str/int/bool/None
    leaves and plain dict/list containers are what the fast path takes."""
    t = type(value)
    if t is dict:
        for k in value:
            if type(k) is not str or (not k.isascii() and max(k) > _BMP_MAX):
                return True
        items: Any = value.values()
    elif t is list:
        items = value
    else:
        return not (t is str or t is int or t is bool or value is None)
    for v in items:
        tv = type(v)
        if tv is str or tv is int or tv is bool or v is None:
            continue
        if tv is dict or tv is list:
            if _needs_slow_path(v):
                return True
        else:
            return True
    return False


def format_number(value: float | int) -> str:
    """Serialize a number as ECMAScript's Number::toString does (ECMA-262 7.1.12.1)."""
    if isinstance(value, bool):
        raise CanonicalJSONError("a boolean is not a number")
    if isinstance(value, int):
        if not -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
            raise CanonicalJSONError(
                f"integer {value} is outside ±(2^53-1); carry it as a string"
            )
        return str(int(value))
    x = float(value)
    if not math.isfinite(x):
        raise CanonicalJSONError("NaN and Infinity are not JSON values")
    if x == 0.0:
        return "0"  # includes negative zero
    sign = "-" if x < 0 else ""
    # repr() gives the shortest digit string that round-trips (same as ES).
    r = repr(abs(x))
    mantissa, _, exp_part = r.partition("e")
    exponent = int(exp_part) if exp_part else 0
    int_part, _, frac_part = mantissa.partition(".")
    if frac_part == "0":
        frac_part = ""
    digits = (int_part + frac_part).lstrip("0")
    # Position of the decimal point relative to the start of `digits`.
    leading_zeros = len(int_part + frac_part) - len((int_part + frac_part).lstrip("0"))
    n = len(int_part) - leading_zeros + exponent
    digits = digits.rstrip("0")
    k = len(digits)
    if k <= n <= 21:
        out = digits + "0" * (n - k)
    elif 0 < n <= 21:
        out = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        out = "0." + "0" * (-n) + digits
    else:
        e = n - 1
        exp_str = ("+" if e >= 0 else "-") + str(abs(e))
        out = digits + "e" + exp_str if k == 1 else digits[0] + "." + digits[1:] + "e" + exp_str
    return sign + out


def _utf16_key(s: str) -> bytes:
    return s.encode("utf-16-be", "surrogatepass")


def _slow(value: Any, path: str, out: list[str]) -> None:
    """Serialize with full validation; the path for floats, non-BMP keys,
    subclasses and errors."""
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, str):
        out.append(_encode_string(str(value)))
    elif isinstance(value, (int, float)):
        try:
            out.append(format_number(value))
        except CanonicalJSONError as exc:
            raise CanonicalJSONError(str(exc).rsplit(" at ", 1)[0], path) from None
    elif isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise CanonicalJSONError(f"object key {k!r} is not a string", path)
        out.append("{")
        first = True
        for k in sorted(value, key=_utf16_key):
            if not first:
                out.append(",")
            first = False
            out.append(_encode_string(str(k)))
            out.append(":")
            _slow(value[k], f"{path}.{k}", out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for i, v in enumerate(value):
            if i:
                out.append(",")
            _slow(v, f"{path}[{i}]", out)
        out.append("]")
    else:
        raise CanonicalJSONError(f"{type(value).__name__} is not a JSON type", path)


def canonical_text(value: Any) -> str:
    """The canonical JSON text of ``value`` (a ``str``)."""
    return canonicalize(value).decode("utf-8")


def canonicalize(value: Any) -> bytes:
    """The canonical JSON bytes of ``value`` (UTF-8), as signatures cover them.

    Raises CanonicalJSONError (naming the path) for a value with no canonical
    form: NaN/Infinity, an integer outside ±(2^53-1), a non-string key, a
    non-JSON type, or a string holding a lone surrogate.
    """
    if not _needs_slow_path(value):
        try:
            return orjson.dumps(value, option=_FAST_OPTIONS)
        except (orjson.JSONEncodeError, TypeError):
            pass  # the slow path names what is wrong and where
    parts: list[str] = []
    _slow(value, "$", parts)
    try:
        return "".join(parts).encode("utf-8")
    except UnicodeEncodeError:
        raise CanonicalJSONError("a string holds a lone surrogate (not valid Unicode)") from None
def _parse_int(literal: str) -> int | float:
    n = int(literal)
    if -MAX_SAFE_INTEGER <= n <= MAX_SAFE_INTEGER:
        return n
    return float(literal)  # what an ECMAScript parser holds


def _refuse_constant(name: str) -> Any:
    raise CanonicalJSONError(f"{name} is not a JSON value")


def parse_json(data: str | bytes | bytearray | memoryview) -> Any:
    """Parse JSON text with the number semantics of an ECMAScript peer.

    Integer literals beyond ±(2^53 − 1) become doubles (as JSON.parse makes
    them), and the non-standard constants NaN/Infinity are refused. Raises
    ``ValueError`` (``json.JSONDecodeError`` or CanonicalJSONError) on bad input.
    """
    if isinstance(data, memoryview):
        data = bytes(data)
    return json.loads(data, parse_int=_parse_int, parse_constant=_refuse_constant)
