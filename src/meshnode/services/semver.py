"""A small semantic-version comparator for the discover ``version`` filter (§9.3).

Versions are ``MAJOR.MINOR.PATCH`` with an optional pre-release and build
(SemVer 2.0.0; build metadata is ignored for ordering). A range is what
npm-style tooling writes, reduced to the forms agents actually send:

* an exact version, optionally with ``=`` or a ``v`` prefix: ``1.2.3``;
* a partial or wildcard version: ``1.2`` / ``1.2.x`` / ``1`` / ``*``;
* comparators ``>=``, ``>``, ``<=``, ``<`` on full or partial versions;
* caret and tilde: ``^1.2.3``, ``^1.2``, ``~1.2.3``, ``~1.2``;
* whitespace-separated comparators (all must hold) and ``||`` alternatives.

Hyphen ranges (``1.2.3 - 2.0.0``) are not supported; write ``>=1.2.3 <=2.0.0``.

Pre-releases follow npm's rule: a pre-release version satisfies a comparator
set only if some comparator in that set names the same ``MAJOR.MINOR.PATCH``
with a pre-release of its own, so ``^1.2`` never matches ``2.0.0-rc.1``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Version", "VersionRange", "compare_versions", "parse_version"]

_VERSION = re.compile(
    r"v?(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?"
)
_PARTIAL = re.compile(
    r"v?(\d+|[xX*])(?:\.(\d+|[xX*]))?(?:\.(\d+|[xX*]))?"
    r"(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?"
)
_COMPARATOR = re.compile(r"(>=|<=|>|<|=|\^|~>?)?\s*(\S+)")

PreRelease = tuple[int | str, ...]


@dataclass(frozen=True, order=False, slots=True)
class Version:
    major: int
    minor: int
    patch: int
    prerelease: PreRelease = ()

    @property
    def core(self) -> tuple[int, int, int]:
        return (self.major, self.minor, self.patch)


def _prerelease(text: str | None) -> PreRelease:
    if not text:
        return ()
    return tuple(int(p) if p.isdigit() else p for p in text.split("."))


def parse_version(text: object) -> Version | None:
    """The version ``text`` names, or None when it is not a full semantic version."""
    if not isinstance(text, str):
        return None
    m = _VERSION.fullmatch(text.strip())
    if m is None:
        return None
    return Version(int(m.group(1)), int(m.group(2)), int(m.group(3)), _prerelease(m.group(4)))


def _compare_prerelease(a: PreRelease, b: PreRelease) -> int:
    if a == b:
        return 0
    if not a:
        return 1  # a release sorts after its pre-releases
    if not b:
        return -1
    for x, y in zip(a, b, strict=False):
        if x == y:
            continue
        if isinstance(x, int) and isinstance(y, int):
            return -1 if x < y else 1
        if isinstance(x, int):
            return -1  # numeric identifiers sort before alphanumeric ones
        if isinstance(y, int):
            return 1
        return -1 if x < y else 1
    return -1 if len(a) < len(b) else 1


def compare_versions(a: Version, b: Version) -> int:
    """-1, 0 or 1 as ``a`` sorts before, with, or after ``b`` (SemVer precedence)."""
    if a.core != b.core:
        return -1 if a.core < b.core else 1
    return _compare_prerelease(a.prerelease, b.prerelease)


@dataclass(frozen=True, slots=True)
class _Bound:
    op: str  # one of >=, >, <=, <, ==
    version: Version

    def holds(self, v: Version) -> bool:
        c = compare_versions(v, self.version)
        if self.op == ">=":
            return c >= 0
        if self.op == ">":
            return c > 0
        if self.op == "<=":
            return c <= 0
        if self.op == "<":
            return c < 0
        return c == 0


_ANY: tuple[_Bound, ...] = ()


def _partial(text: str) -> tuple[int | None, int | None, int | None, PreRelease]:
    m = _PARTIAL.fullmatch(text)
    if m is None:
        raise ValueError(f"not a version: {text!r}")
    parts: list[int | None] = []
    wild = False
    for group in m.group(1, 2, 3):
        if group is None or group in ("x", "X", "*"):
            wild = True
            parts.append(None)
        elif wild:
            raise ValueError(f"a number after a wildcard: {text!r}")
        else:
            parts.append(int(group))
    pre = _prerelease(m.group(4))
    if pre and None in parts:
        raise ValueError(f"a pre-release needs a full version: {text!r}")
    return parts[0], parts[1], parts[2], pre


def _bounds(op: str, text: str) -> tuple[_Bound, ...]:
    major, minor, patch, pre = _partial(text)
    if major is None:
        # "*", ">=*", "^*": anything; "<*" and ">*" match nothing sensible.
        if op in ("<", ">"):
            raise ValueError(f"an empty range: {op}{text}")
        return _ANY
    lo_minor = minor or 0
    lo_patch = patch or 0
    low = Version(major, lo_minor, lo_patch, pre)
    full = minor is not None and patch is not None

    def upper_of_partial() -> Version:
        if minor is None:
            return Version(major + 1, 0, 0)
        return Version(major, minor + 1, 0)

    if op in ("", "="):
        if full:
            return (_Bound("==", low),)
        return (_Bound(">=", low), _Bound("<", upper_of_partial()))
    if op == ">=":
        return (_Bound(">=", low),)
    if op == ">":
        return (_Bound(">", low),) if full else (_Bound(">=", upper_of_partial()),)
    if op == "<":
        return (_Bound("<", low),)
    if op == "<=":
        return (_Bound("<=", low),) if full else (_Bound("<", upper_of_partial()),)
    if op in ("~", "~>"):
        if minor is None:
            return (_Bound(">=", low), _Bound("<", Version(major + 1, 0, 0)))
        return (_Bound(">=", low), _Bound("<", Version(major, minor + 1, 0)))
    if op == "^":
        if major > 0 or minor is None:
            upper = Version(major + 1, 0, 0)
        elif minor > 0 or patch is None:
            upper = Version(0, minor + 1, 0)
        else:
            upper = Version(0, 0, lo_patch + 1)
        return (_Bound(">=", low), _Bound("<", upper))
    raise ValueError(f"unknown operator {op!r}")


def _comparator_set(text: str) -> tuple[_Bound, ...]:
    bounds: list[_Bound] = []
    rest = text.strip()
    if not rest:
        return _ANY
    pos = 0
    while pos < len(rest):
        m = _COMPARATOR.match(rest, pos)
        if m is None:
            raise ValueError(f"not a range: {text!r}")
        bounds.extend(_bounds(m.group(1) or "", m.group(2)))
        pos = m.end()
        while pos < len(rest) and rest[pos].isspace():
            pos += 1
    return tuple(bounds)


@dataclass(frozen=True, slots=True)
class VersionRange:
    """A parsed range; :meth:`contains` tests a version string against it."""

    text: str
    alternatives: tuple[tuple[_Bound, ...], ...]

    @classmethod
    def parse(cls, text: str) -> VersionRange:
        """Parse ``text``; raises ValueError for anything outside the grammar above."""
        if not isinstance(text, str) or not text.strip() or len(text) > 256:
            raise ValueError("a version range is a non-empty string")
        alternatives = tuple(_comparator_set(part) for part in text.split("||"))
        return cls(text, alternatives)

    def contains(self, version: str | Version) -> bool:
        v = version if isinstance(version, Version) else parse_version(version)
        if v is None:
            return False
        return any(self._set_holds(bounds, v) for bounds in self.alternatives)

    @staticmethod
    def _set_holds(bounds: tuple[_Bound, ...], v: Version) -> bool:
        if not all(b.holds(v) for b in bounds):
            return False
        if v.prerelease:
            return any(b.version.prerelease and b.version.core == v.core for b in bounds)
        return True
