"""RFC 3339 instants as integers (AgentMesh §5.2 ``ts``, §22.3).

The protocol core never reads a clock: callers pass ``now`` in. Instants are
held as integer microseconds since the Unix epoch so that millisecond window
boundaries compare exactly; ``now`` is usually given in milliseconds.
"""

from __future__ import annotations

import datetime as _dt
import re

__all__ = ["format_ts", "ms_to_us", "parse_rfc3339", "parse_rfc3339_ms", "try_parse_rfc3339"]

_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?([Zz]|[+-]\d{2}:\d{2})"
)
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)


def parse_rfc3339(text: str) -> int:
    """Parse any RFC 3339 date-time (``Z`` or a numeric offset) to epoch microseconds.

    Raises ValueError for anything else, including a date without a time.
    """
    if not isinstance(text, str):
        raise ValueError("timestamp is not a string")
    m = _RFC3339.fullmatch(text)
    if m is None:
        raise ValueError(f"not an RFC 3339 date-time: {text!r}")
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    frac, zone = m.group(7), m.group(8)
    leap = second == 60  # RFC 3339 permits a leap second; count it as :59 + 1 s
    try:
        base = _dt.datetime(year, month, day, hour, minute, 59 if leap else second, tzinfo=_dt.UTC)
    except ValueError as exc:
        raise ValueError(f"not a valid date-time: {text!r} ({exc})") from None
    if zone not in ("Z", "z"):
        sign = 1 if zone[0] == "+" else -1
        oh, om = int(zone[1:3]), int(zone[4:6])
        if oh > 23 or om > 59:
            raise ValueError(f"bad UTC offset in {text!r}")
        base -= sign * _dt.timedelta(hours=oh, minutes=om)
    delta = base - _EPOCH
    us = (delta.days * 86400 + delta.seconds + (1 if leap else 0)) * 1_000_000
    if frac:
        us += int((frac + "000000")[:6])
    return us


def try_parse_rfc3339(text: object) -> int | None:
    """Like :func:`parse_rfc3339` but returns None instead of raising."""
    if not isinstance(text, str):
        return None
    try:
        return parse_rfc3339(text)
    except ValueError:
        return None


def parse_rfc3339_ms(text: str) -> int:
    """Epoch milliseconds (floor) of an RFC 3339 date-time."""
    return parse_rfc3339(text) // 1000


def ms_to_us(ms: int) -> int:
    return ms * 1000


def format_ts(epoch_ms: int) -> str:
    """Format epoch milliseconds as ``YYYY-MM-DDTHH:MM:SS.mmmZ`` (UTC)."""
    seconds, millis = divmod(int(epoch_ms), 1000)
    t = _EPOCH + _dt.timedelta(seconds=seconds)
    return f"{t:%Y-%m-%dT%H:%M:%S}.{millis:03d}Z"
