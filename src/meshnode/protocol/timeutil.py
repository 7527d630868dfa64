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
    # Every inbound envelope's ts is parsed; nearly all are in the form this
    # implementation writes (``...SS.mmmZ``) and share their second with the
    # previous one, whose fully parsed value is kept.
    short = len(text) == 24 and text[19] == "." and text[23] == "Z"
    if short:
        cached_prefix, cached_us = _last_prefix
        millis = text[20:23]
        if text[:19] == cached_prefix and millis.isascii() and millis.isdigit():
            return cached_us + int(millis) * 1000
    us = _parse_full(text)
    if short:
        _remember_prefix(text[:19], us - int(text[20:23]) * 1000)
    return us


_last_prefix: tuple[str, int] = ("", 0)


def _remember_prefix(prefix: str, us: int) -> None:
    global _last_prefix
    _last_prefix = (prefix, us)


def _parse_full(text: str) -> int:
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
        try:
            base -= sign * _dt.timedelta(hours=oh, minutes=om)
        except OverflowError:
            # 9999-12-31T23:59:59-23:59 is well-formed text for an instant no
            # datetime holds; it is refused like any other unreadable ts.
            raise ValueError(f"date-time out of range: {text!r}") from None
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


_last_second: tuple[int, str] = (-1, "")


def format_ts(epoch_ms: int) -> str:
    """Format epoch milliseconds as ``YYYY-MM-DDTHH:MM:SS.mmmZ`` (UTC)."""
    global _last_second
    seconds, millis = divmod(int(epoch_ms), 1000)
    # Every envelope is stamped: the date-time part is formatted once per second.
    cached_second, prefix = _last_second
    if cached_second != seconds:
        prefix = f"{_EPOCH + _dt.timedelta(seconds=seconds):%Y-%m-%dT%H:%M:%S}"
        _last_second = (seconds, prefix)
    return f"{prefix}.{millis:03d}Z"
