"""Compact JSON exactly as an ECMAScript peer's ``JSON.stringify`` writes it.

What §22.5 measures a non-prose payload as: the reference implementation is
JavaScript, so a length must agree with ``JSON.stringify`` to the character
(member order as given, ``1.0`` as ``1``, NaN as ``null``, a lone surrogate
escaped). Unlike :mod:`.canonical` (JCS: sorted keys, refusals), this never
refuses: a value with no JSON form is written as its type's name.
"""

from __future__ import annotations

import json.encoder
import math
import re
from collections.abc import Mapping
from enum import Enum
from typing import Any, Final
from uuid import UUID

import orjson

from .canonical import MAX_SAFE_INTEGER, format_number

__all__ = ["compact_json"]


class _Unserializable(Exception):
    pass


_SURROGATE = re.compile("[\ud800-\udfff]")
_encode_string = json.encoder.encode_basestring


def _escape_string(text: str) -> str:
    encoded = _encode_string(text)
    if not text.isascii() and _SURROGATE.search(encoded) is not None:
        # Well-formed JSON.stringify escapes a lone surrogate; raw it is not UTF-8.
        encoded = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", encoded)
    return encoded


# orjson writes what JSON.stringify writes for plain JSON values except numbers
# that are floats (1.0 vs 1, 1e21 vs 1e+21) or integers beyond 2^53 (which an
# ECMAScript peer holds as doubles). Both leave a trace in the output: a digit
# followed by '.', 'e' or 'E', or a run of 16+ digits. Strings can match too,
# which only costs a trip through the careful path. The search runs over a
# translated copy (digits -> '0', '.eE' -> '.', the rest -> ' ') because two
# substring tests there are several times faster than a regex over the output.
_NUMBER_MASK: Final = bytes(
    0x30 if 0x30 <= b <= 0x39 else 0x2E if b in b".eE" else 0x20 for b in range(256)
)


def _may_hold_non_js_number(encoded: bytes) -> bool:
    mask = encoded.translate(_NUMBER_MASK)
    return b"0." in mask or b"0000000000000000" in mask


# Types orjson would render that are not JSON values (and str/int/dict/list
# subclasses) are sent to the careful path, which judges them.
_ORJSON_STRICT = (
    orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_SUBCLASS
)


def _holds_non_js_number(value: Any) -> bool:
    """Whether a value orjson serialized holds a float or an integer beyond 2^53
    (or a type only the careful path judges), by its types alone.

    The byte test above is cheap but also trips on strings: every RFC 3339
    timestamp with a fraction ("…:05.123Z") and every "0.3" version reads as a
    number there, so every manifest (a vouch carries two timestamps) and most
    envelopes went through the careful serializer, ~0.3 ms each (issue #21).
    Walking the types is several times cheaper than writing the JSON again.
    An explicit stack: orjson already refused anything nested too deep.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is str or kind is bool or item is None:
            continue
        if kind is int:
            if -MAX_SAFE_INTEGER <= item <= MAX_SAFE_INTEGER:
                continue
            return True
        if kind is dict:
            stack.extend(item.values())
        elif kind is list or kind is tuple:
            stack.extend(item)
        else:
            return True  # a float, or a UUID, Enum, ...: the careful path decides
    return False


def _refuse_type(value: Any) -> Any:
    raise TypeError(type(value).__name__)


def _number_text(value: int | float) -> str:
    if isinstance(value, int):
        if -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
            return str(int(value))
        try:
            value = float(value)  # what an ECMAScript peer holds
        except OverflowError:
            return "null"
    if not math.isfinite(value):
        return "null"  # JSON.stringify writes NaN and ±Infinity as null
    return format_number(value)


# Work items of the explicit-stack serializer.
_EMIT, _VALUE, _LEAVE = 0, 1, 2


def _careful_json(value: Any) -> str:
    """Compact JSON as JSON.stringify writes it, with an explicit stack so no
    nesting depth can turn a large payload into a small "unserializable" one.
    Raises _Unserializable for a non-JSON type or a cycle."""
    out: list[str] = []
    work: list[tuple[int, Any]] = [(_VALUE, value)]
    open_containers: set[int] = set()
    while work:
        kind, item = work.pop()
        if kind == _EMIT:
            out.append(item)
            continue
        if kind == _LEAVE:
            open_containers.discard(item)
            continue
        if item is None:
            out.append("null")
        elif item is True:
            out.append("true")
        elif item is False:
            out.append("false")
        elif isinstance(item, str):
            out.append(_escape_string(item))
        elif isinstance(item, (int, float)):
            out.append(_number_text(item))
        elif isinstance(item, (Mapping, list, tuple)):
            marker = id(item)
            if marker in open_containers:
                raise _Unserializable("cycle")
            open_containers.add(marker)
            work.append((_LEAVE, marker))
            if isinstance(item, Mapping):
                pairs = list(item.items())
                for k, _ in pairs:
                    if not isinstance(k, str):
                        raise _Unserializable("non-string key")
                work.append((_EMIT, "}"))
                for index in range(len(pairs) - 1, -1, -1):
                    k, v = pairs[index]
                    work.append((_VALUE, v))
                    prefix = "," if index else ""
                    work.append((_EMIT, f"{prefix}{_escape_string(k)}:"))
                work.append((_EMIT, "{"))
            else:
                elements = list(item)
                work.append((_EMIT, "]"))
                for index in range(len(elements) - 1, -1, -1):
                    work.append((_VALUE, elements[index]))
                    if index:
                        work.append((_EMIT, ","))
                work.append((_EMIT, "["))
        elif isinstance(item, UUID):
            out.append(f'"{item}"')  # as orjson writes it on the fast path
        elif isinstance(item, Enum):
            work.append((_VALUE, item.value))  # as orjson writes it on the fast path
        else:
            raise _Unserializable(type(item).__name__)
    return "".join(out)


def compact_json(value: Any) -> str:
    """``value`` as compact JSON, the way the reference measures it (§22.5).

    Member order is the mapping's own (order cannot change a length);
    numbers are formatted as ECMAScript does (``1.0`` is ``1``, NaN is
    ``null``); a lone surrogate is escaped; a UUID or an Enum member is written
    as its string or value; any other value with no JSON form (a set, bytes,
    a cycle, ...) is measured as its type's name. Nesting depth is unbounded.
    """
    try:
        fast = orjson.dumps(value, default=_refuse_type, option=_ORJSON_STRICT)
    except TypeError:
        pass  # a lone surrogate, a deep nest, a non-JSON type: the careful path decides
    else:
        if not _may_hold_non_js_number(fast) or not _holds_non_js_number(value):
            return fast.decode("utf-8")
    try:
        return _careful_json(value)
    except _Unserializable:
        return type(value).__name__
