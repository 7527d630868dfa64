"""What a statement rests on (AgentMesh §5.6): the ``rests_on`` list and its freshness verdict.

A statement that was computed from other bytes (a deliverable from its input
files, a usage receipt from a rate schedule) declares them::

    "rests_on": [
      {"digest": "sha256:<64 lowercase hex>", "ref": "mesh:artifacts:…", "name": "in.csv", "role": "input"},
      {"digest": "sha256:<64 lowercase hex>", "role": "rate-schedule"}
    ]

:func:`validate_rests_on` is the shape rule (a non-empty list of at most 64
entries; ``digest`` required and exact; ``ref``/``name``/``role`` strings when
present, ``ref`` never empty; one ref never cited with two digests).

:func:`freshness` is the verdict a verifier computes by comparing what was
declared with what it can observe now. Five outcomes, because they are
different facts:

``fresh``
    every entry was observed and every digest matched;
``stale``
    at least one entry was observed with a *different* digest: true when made,
    no longer a safe basis. Not a signature failure, not bad faith;
``unchecked``
    nothing seen to change, but something could not be obtained (an entry
    without a ``ref``, a store out of reach, an observation that is not a
    digest): absent evidence is not agreement;
``undeclared``
    the statement declared nothing (the member is absent): unverifiable,
    never "rested on nothing";
``not_applicable``
    a countersigned agreement, which §5.6 excludes: it is not compared, and
    its refs are not even looked up.

Stale beats unchecked. Comparison is exact (the declared string is inside the
signed bytes). Pure: no I/O; the caller supplies the observations.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import ProtocolError

__all__ = [
    "CARRIAGE_NOT_SITES",
    "CARRIAGE_SITES",
    "MAX_ENTRIES",
    "FreshnessState",
    "Observation",
    "Verdict",
    "carriage_allowed",
    "digest_of",
    "entry_for",
    "freshness",
    "is_valid_digest",
    "validate_rests_on",
]

#: §5.6: more entries than this is a way to spend a verifier's bandwidth.
MAX_ENTRIES = 64

#: Where the member may ride (§5.6 "Where it is carried, today").
CARRIAGE_SITES = ("artifact.rests_on", "payload.rests_on")
#: Where it must not: a message is not a claim about other bytes.
CARRIAGE_NOT_SITES = ("envelope.rests_on", "manifest.rests_on", "task.rests_on")

FreshnessState = Literal["fresh", "stale", "unchecked", "undeclared", "not_applicable"]

#: What a verifier saw at a ref now: a digest string, or None for "could not obtain".
Observation = str | None

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def is_valid_digest(value: object) -> bool:
    """True for ``sha256:`` + exactly 64 lowercase hex digits (§5.6, §7.5.1)."""
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


def digest_of(data: bytes | bytearray | memoryview) -> str:
    """The §5.6 / §7.5.1 digest spelling of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def carriage_allowed(site: str) -> bool:
    """Whether ``rests_on`` may appear at ``site`` (``"artifact.rests_on"``, ...)."""
    return site in CARRIAGE_SITES


def _refuse(message: str, member: str, reason: str) -> ProtocolError:
    return ProtocolError("INPUT_INVALID", message, {"member": member, "reason": reason})


def validate_rests_on(value: object, *, member: str = "rests_on") -> list[dict[str, Any]]:
    """Check the shape of a declared ``rests_on`` and return its entries (copies).

    Raises :class:`ProtocolError` ``INPUT_INVALID`` with ``details.member``
    naming the offending member and ``details.reason``. An absent member is the
    caller's business (it means *undeclared*); an empty list is refused,
    because it would be a second spelling of the same state.
    """
    if not isinstance(value, list):
        raise _refuse("rests_on is a list of entries", member, "not_an_array")
    if not value:
        raise _refuse("rests_on is omitted, not empty, when nothing is declared", member, "empty_array")
    if len(value) > MAX_ENTRIES:
        raise _refuse(f"rests_on has more than {MAX_ENTRIES} entries", member, "too_many_entries")
    entries: list[dict[str, Any]] = []
    digest_by_ref: dict[str, str] = {}
    for i, entry in enumerate(value):
        where = f"{member}[{i}]"
        if not isinstance(entry, Mapping):
            raise _refuse("a rests_on entry is an object", where, "entry_not_an_object")
        if "digest" not in entry:
            raise _refuse("a rests_on entry needs a digest", f"{where}.digest", "missing_digest")
        if not is_valid_digest(entry["digest"]):
            raise _refuse("digest is sha256:<64 lowercase hex>", f"{where}.digest", "bad_digest")
        for name in ("ref", "name", "role"):
            if name in entry and not isinstance(entry[name], str):
                raise _refuse(f"{name} is a string", f"{where}.{name}", f"{name}_not_a_string")
        ref = entry.get("ref")
        if ref is not None:
            if ref == "":
                raise _refuse("an empty ref resolves to nothing", f"{where}.ref", "empty_ref")
            seen = digest_by_ref.setdefault(ref, entry["digest"])
            if seen != entry["digest"]:
                raise _refuse(
                    "one ref is cited with two different digests", f"{where}.ref", "same_ref_two_digests"
                )
        entries.append(dict(entry))
    return entries


def entry_for(
    part: Mapping[str, Any], *, role: str | None = None, name: str | None = None
) -> dict[str, Any]:
    """A ``rests_on`` entry for a ref part or file attachment that carries a digest.

    ``ref`` and ``name`` are taken from ``part`` when present; ``role`` (e.g.
    ``"input"``) and ``name`` may be given. Raises ``INPUT_INVALID`` when the
    part has no valid digest: an entry must be checkable by its digest.
    """
    digest = part.get("digest")
    if not is_valid_digest(digest):
        raise _refuse("the part carries no sha256 digest to rest on", "digest", "bad_digest")
    entry: dict[str, Any] = {"digest": digest}
    ref = part.get("ref")
    if isinstance(ref, str) and ref:
        entry["ref"] = ref
    label = name if name is not None else part.get("name")
    if isinstance(label, str):
        entry["name"] = label
    if role is not None:
        entry["role"] = role
    return entry


@dataclass(frozen=True)
class Verdict:
    """A freshness verdict: the state, and which refs changed or could not be reached.

    ``unreachable`` holds ``None`` for an entry that carried no ref. Both lists
    follow declaration order.
    """

    state: FreshnessState
    changed: list[str] = field(default_factory=list)
    unreachable: list[str | None] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "changed": list(self.changed), "unreachable": list(self.unreachable)}


def freshness(
    declared: Sequence[Mapping[str, Any]] | None,
    observe: Mapping[str, Observation] | Callable[[str], Observation],
    *,
    countersigned: bool = False,
) -> Verdict:
    """The §5.6 verdict for ``declared`` against what ``observe`` reports.

    ``declared`` is the statement's ``rests_on`` (None when absent; it is
    validated first). ``observe`` maps a ref to the digest seen there now, or
    None when the bytes could not be obtained; a ref missing from a mapping
    counts as unobtainable. For a countersigned agreement nothing is compared
    and ``observe`` is never consulted.
    """
    if countersigned:
        return Verdict("not_applicable")
    if declared is None:
        return Verdict("undeclared")
    entries = validate_rests_on(list(declared))
    look: Callable[[str], Observation]
    if isinstance(observe, Mapping):
        table = observe

        def look(ref: str) -> Observation:
            return table.get(ref)
    else:
        look = observe
    changed: list[str] = []
    unreachable: list[str | None] = []
    for entry in entries:
        ref = entry.get("ref")
        if ref is None:
            unreachable.append(None)  # nothing to resolve, so nothing to compare
            continue
        seen = look(ref)
        if not is_valid_digest(seen):
            # Unobtainable, or a value we cannot read as a digest: the
            # verifier's fault or its store's, never evidence of a change.
            unreachable.append(ref)
        elif seen != entry["digest"]:
            changed.append(ref)
    if changed:
        return Verdict("stale", changed, unreachable)
    if unreachable:
        return Verdict("unchecked", changed, unreachable)
    return Verdict("fresh")
