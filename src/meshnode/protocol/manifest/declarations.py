"""Declarations dropped rather than served when unreadable (§8.5.2, §8.10, §8.11).

An offering's ``reporting`` cadence, the card's ``data_use`` and its
``compliance`` list: each is read whole, and one the registry cannot read is
dropped whole, because a partially readable claim misleads a stranger.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from ..timeutil import try_parse_rfc3339
from .shapes import _is_nonblank, _one_of, _whole

__all__ = ["DATA_USE_PROMISES", "REPORTING_LEVELS", "parse_cadence_ms"]

#: §8.5.2 / Agent SoW §5.12, in rank order.
REPORTING_LEVELS = ("records_only", "on_change", "check_ins")
#: §8.10 / Agent SoW §5.11: the closed promise vocabulary.
DATA_USE_PROMISES = frozenset({"no_training", "no_third_party_sharing", "no_human_reading"})

_STANDARD_TOKEN = re.compile(r"[a-z0-9]+(?:[._-][a-z0-9]+)*")
_COUNTRY = re.compile(r"[a-z]{2}")
_DATE_ONLY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
_CADENCE = re.compile(
    r"P(?:(?P<W>[0-9]{1,6})W|(?:(?P<D>[0-9]{1,6})D)?"
    r"(?P<T>T(?:(?P<H>[0-9]{1,6})H)?(?:(?P<M>[0-9]{1,6})M)?(?:(?P<S>[0-9]{1,6})S)?)?)"
)
_CADENCE_UNIT_MS = {
    "W": 604_800_000,
    "D": 86_400_000,
    "H": 3_600_000,
    "M": 60_000,
    "S": 1_000,
}

# Data-use backstops (Agent SoW §5.11, which the card-level shape mirrors).
_MAX_PROCESSORS = 16
_MAX_PROCESSOR_SERVICE = 120
_MAX_PROCESSOR_PURPOSE = 300


# ── §8.5.2 the reporting cadence ────────────────────────────────────────────


def parse_cadence_ms(text: object) -> int | None:
    """Milliseconds of a §8.5.2 / SoW §5.12 cadence, or None when it is not one.

    The grammar is ISO 8601 restricted to fixed-length spans: ``PnW`` alone, or
    days, then ``T`` with hours, minutes, seconds in that order; whole units,
    at most six digits each; uppercase; nonzero. Months and years are refused
    because they are not fixed spans.
    """
    if not isinstance(text, str):
        return None
    match = _CADENCE.fullmatch(text)
    if match is None:
        return None
    parts = {unit: match.group(unit) for unit in _CADENCE_UNIT_MS}
    if match.group("T") is not None and not any(parts[u] for u in "HMS"):
        return None  # a T that introduces nothing
    if not any(parts.values()):
        return None  # names no span
    total = sum(int(v) * _CADENCE_UNIT_MS[u] for u, v in parts.items() if v)
    return total or None


def _readable_reporting(value: object) -> dict[str, Any] | None:
    """The normalized §8.5.2 reporting value, or None when it must be dropped."""
    if not isinstance(value, Mapping):
        return None
    level = value.get("level")
    if not _one_of(level, REPORTING_LEVELS):
        return None
    has_every = "every" in value
    if level == "check_ins":
        if not has_every or parse_cadence_ms(value["every"]) is None:
            return None  # a calendar level without a calendar advertises nothing testable
        return {"level": level, "every": value["every"]}
    if has_every:
        return None  # a cadence below check_ins is a malformed declaration
    return {"level": level}


# ── §8.10 data_use and §8.11 compliance (dropped whole when unreadable) ─────


def _readable_promises(value: object) -> bool:
    # A promise is spelled only by presence, as the literal true (§8.10).
    return isinstance(value, Mapping) and all(
        _one_of(name, DATA_USE_PROMISES) and flag is True for name, flag in value.items()
    )


def _readable_retention(value: object) -> bool:
    if not isinstance(value, Mapping) or set(value) != {"max_days"}:
        return False
    days = _whole(value["max_days"])
    return days is not None and days > 0


def _readable_processors(value: object) -> bool:
    if not isinstance(value, list) or len(value) > _MAX_PROCESSORS:
        return False
    seen: set[tuple[str, str]] = set()
    for entry in value:
        if not isinstance(entry, Mapping) or not set(entry) <= {"service", "domain", "purpose"}:
            return False
        service, domain = entry.get("service"), entry.get("domain", "")
        if not isinstance(service, str) or not service.strip():
            return False
        if len(service) > _MAX_PROCESSOR_SERVICE or not isinstance(domain, str):
            return False
        if "domain" in entry and not domain.strip():
            return False
        purpose = entry.get("purpose", "")
        if not isinstance(purpose, str) or len(purpose) > _MAX_PROCESSOR_PURPOSE:
            return False
        pair = (service, domain)
        if pair in seen:
            return False
        seen.add(pair)
    return True


def _readable_jurisdictions(value: object) -> bool:
    return (
        isinstance(value, list)
        and all(isinstance(c, str) and _COUNTRY.fullmatch(c) for c in value)
        and len(set(value)) == len(value)
    )


def _readable_data_use(value: object) -> bool:
    """§8.10: the SoW §5.11 clause shape minus grades and transport."""
    checks: dict[str, Callable[[object], bool]] = {
        "promises": _readable_promises,
        "retention": _readable_retention,
        "processors": _readable_processors,
        "processed_in": _readable_jurisdictions,
    }
    if not isinstance(value, Mapping) or not set(value) <= set(checks):
        return False
    return all(checks[name](member) for name, member in value.items())


def _readable_compliance_attestation(value: object) -> bool:
    if not isinstance(value, Mapping) or not set(value) <= {"by", "url", "expires_at"}:
        return False
    if any(not _is_nonblank(v) for v in value.values()):
        return False
    expires = value.get("expires_at")
    return expires is None or _is_date_or_datetime(expires)


def _is_date_or_datetime(value: str) -> bool:
    return bool(_DATE_ONLY.fullmatch(value)) or try_parse_rfc3339(value) is not None


def _readable_compliance(value: object) -> bool:
    """§8.11: each entry a lowercase standard token, a non-blank scope, a pointer."""
    if not isinstance(value, list):
        return False
    for entry in value:
        if not isinstance(entry, Mapping) or not set(entry) <= {"standard", "scope", "attestation"}:
            return False
        standard = entry.get("standard")
        if not isinstance(standard, str) or not _STANDARD_TOKEN.fullmatch(standard):
            return False
        if "scope" in entry and not _is_nonblank(entry["scope"]):
            return False
        if "attestation" in entry and not _readable_compliance_attestation(entry["attestation"]):
            return False
    return True


def _drop_unreadable_declarations(
    obj: dict[str, Any], prefix: str, dropped: list[str]
) -> None:
    for member, readable in (("data_use", _readable_data_use), ("compliance", _readable_compliance)):
        if member in obj and not readable(obj[member]):
            del obj[member]  # dropped whole: a partially readable claim misleads
            dropped.append(f"{prefix}{member}")

