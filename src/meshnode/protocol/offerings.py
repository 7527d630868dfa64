"""Offerings (AgentMesh §8.5): the skill→offering renames and mode resolution.

Earlier drafts called an offering a *skill*. During the deprecation window an
implementation MUST accept the legacy names on inbound messages and manifests
and MUST emit only the new ones. The normalizers here turn any legacy member
name that contains the token ``skill``/``skills`` (``skills``, ``skill``,
``skill_details``, ``skill_output_modes``, ``skill_id``, ``requested_skill``…)
into its ``offering`` spelling, at the protocol-defined positions only: an
offering's own ``input`` is application data and is never rewritten.

All normalizers copy; the signed envelope an input came from stays verbatim.
Where a legacy and a current name are both present, the current one wins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .errors import normalize_code

__all__ = [
    "ModeSource",
    "ResolvedModes",
    "current_key",
    "declared_needs",
    "find_offering",
    "need_reference",
    "normalize_discover_query",
    "normalize_error_object",
    "normalize_keys",
    "normalize_manifest_aliases",
    "normalize_request_payload",
    "offering_id_of",
    "resolve_modes",
]

_LEGACY_TOKENS = {"skill": "offering", "skills": "offerings"}

ModeSource = Literal["offering", "defaults", "unstated"]


def current_key(key: str) -> str:
    """The current spelling of a member name: each ``_``-separated ``skill`` /
    ``skills`` token becomes ``offering`` / ``offerings``; other names pass."""
    if "skill" not in key:
        return key
    return "_".join(_LEGACY_TOKENS.get(token, token) for token in key.split("_"))


def normalize_keys(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``obj`` with its own member names (not nested ones) renamed.

    A current name present in ``obj`` wins over a legacy alias of it.
    """
    try:
        # Every request payload passes here twice; almost none uses a legacy name.
        # (Joined with NUL, no "skill" can span two keys.)
        legacy_free = "skill" not in "\0".join(obj)
    except TypeError:  # a key that is not a string: the careful loop below
        legacy_free = False
    if legacy_free:
        return dict(obj)
    out: dict[str, Any] = {}
    legacy: dict[str, Any] = {}
    for key, value in obj.items():
        new = current_key(key)
        if new == key:
            out[key] = value
        else:
            legacy.setdefault(new, value)
    for key, value in legacy.items():
        out.setdefault(key, value)
    return out


def normalize_request_payload(payload: Any) -> Any:
    """A request payload with ``skill`` read as ``offering`` (and any other
    legacy top-level member renamed). Non-object payloads pass unchanged; the
    offering's ``input`` and the ``config`` values are never touched."""
    if not isinstance(payload, Mapping):
        return payload
    return normalize_keys(payload)


def offering_id_of(payload: Any) -> str | None:
    """The offering a request payload names (``offering``, or legacy ``skill``)."""
    normalized = normalize_request_payload(payload)
    if isinstance(normalized, Mapping):
        value = normalized.get("offering")
        if isinstance(value, str):
            return value
    return None


def _normalize_entries(value: Any) -> Any:
    if isinstance(value, list):
        return [normalize_keys(v) if isinstance(v, Mapping) else v for v in value]
    return value


def normalize_manifest_aliases(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A manifest with every legacy name read as its offering spelling.

    Renames the manifest's own members (``skills`` → ``offerings``), each
    offering entry's members, the public block's members (``skills``,
    ``skill_details``) and each ``offering_details`` entry.
    """
    out = normalize_keys(manifest)
    if "offerings" in out:
        out["offerings"] = _normalize_entries(out["offerings"])
    public = out.get("public")
    if isinstance(public, Mapping):
        block = normalize_keys(public)
        if "offering_details" in block:
            block["offering_details"] = _normalize_entries(block["offering_details"])
        out["public"] = block
    return out


def normalize_discover_query(query: Any) -> Any:
    """A discover payload with legacy filter names renamed (``skill_id`` → ``offering_id``)."""
    if not isinstance(query, Mapping):
        return query
    return normalize_keys(query)


def normalize_error_object(error: Mapping[str, Any]) -> dict[str, Any]:
    """An error object with SKILL_NOT_FOUND read as OFFERING_NOT_FOUND and the
    legacy names among ``details``' members renamed (``requested_skill``…)."""
    out = dict(error)
    code = out.get("code")
    if isinstance(code, str):
        out["code"] = normalize_code(code)
    details = out.get("details")
    if isinstance(details, Mapping):
        out["details"] = normalize_keys(details)
    return out


def find_offering(manifest: Mapping[str, Any], offering_id: str) -> dict[str, Any] | None:
    """The offering entry with ``id == offering_id`` (legacy names accepted), or None."""
    offerings = normalize_keys(manifest).get("offerings")
    if not isinstance(offerings, list):
        return None
    for entry in offerings:
        if isinstance(entry, Mapping) and entry.get("id") == offering_id:
            return normalize_keys(entry)
    return None


def _modes(value: Any) -> tuple[str, ...] | None:
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        modes = tuple(m for m in value if isinstance(m, str))
        if modes:
            return modes
    return None


@dataclass(frozen=True, slots=True)
class ResolvedModes:
    """What an offering takes and returns, and where each answer came from.

    ``None`` means unstated: the agent has not said, which a caller reads as
    text and MUST NOT read as a refusal of other types (§8.5).
    """

    input_modes: tuple[str, ...] | None
    output_modes: tuple[str, ...] | None
    input_source: ModeSource
    output_source: ModeSource


def _resolve_one(
    offering: Mapping[str, Any] | None,
    manifest: Mapping[str, Any],
    field: str,
) -> tuple[tuple[str, ...] | None, ModeSource]:
    if offering is not None:
        own = _modes(offering.get(field))
        if own is not None:
            return own, "offering"
    defaults = _modes(manifest.get(f"default_{field}"))
    if defaults is None:
        # The public block carries the registry-materialized copy of the card
        # defaults (§8.7); a describe document may be all a caller has.
        public = manifest.get("public")
        if isinstance(public, Mapping):
            defaults = _modes(public.get(f"default_{field}"))
    if defaults is not None:
        return defaults, "defaults"
    return None, "unstated"


def resolve_modes(manifest: Mapping[str, Any], offering_id: str | None) -> ResolvedModes:
    """Resolve an offering's input/output modes (§8.5): the offering's own, then
    the card-level ``default_input_modes`` / ``default_output_modes``, then
    unstated. An unknown or absent offering resolves through the defaults."""
    normalized = normalize_manifest_aliases(manifest)
    offering = find_offering(normalized, offering_id) if offering_id is not None else None
    input_modes, input_source = _resolve_one(offering, normalized, "input_modes")
    output_modes, output_source = _resolve_one(offering, normalized, "output_modes")
    return ResolvedModes(input_modes, output_modes, input_source, output_source)


# --- needs (§8.5.1) -------------------------------------------------------------

_NEED_KINDS = ("resource", "file", "credential", "text")


def need_reference(need: Any) -> str | None:
    """The ``"<kind>:<value>"`` reference of one ``needs`` entry, or None when the
    entry is not one of the four §8.5.1 kinds with a non-empty string value."""
    if not isinstance(need, Mapping):
        return None
    for kind in _NEED_KINDS:
        value = need.get(kind)
        if isinstance(value, str) and value:
            return f"{kind}:{value}"
    return None


def declared_needs(
    manifest: Any, offering_id: str | None = None
) -> frozenset[str] | None:
    """Every need declared on a manifest's offerings, as ``"<kind>:<value>"``.

    With ``offering_id``, only that offering's needs. Returns None when the
    manifest cannot be read (not an object, or no offerings array), which
    attribution treats as unverifiable and so fails closed (§10.8a).
    """
    if not isinstance(manifest, Mapping):
        return None
    offerings = normalize_keys(manifest).get("offerings")
    if not isinstance(offerings, list):
        return None
    refs: set[str] = set()
    for entry in offerings:
        if not isinstance(entry, Mapping):
            continue
        if offering_id is not None and entry.get("id") != offering_id:
            continue
        needs = entry.get("needs")
        if isinstance(needs, list):
            refs.update(r for r in (need_reference(n) for n in needs) if r is not None)
    return frozenset(refs)
