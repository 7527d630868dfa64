"""The discover query (§6.3, §9.3): parse, match, page. Pure: no I/O, no clock.

Filters combine with AND semantics. Every filter is optional; an empty list
is read as absent (an empty ``capabilities`` list is a subset of anything,
and an empty ``agent_ids`` or ``tags`` list is what a client sends when it
has nothing to say). Member names from earlier drafts (``skill_id``…) are
read through :func:`meshnode.protocol.offerings.normalize_discover_query`.

=====================  ========  =========================================
filter                 type      matches when
=====================  ========  =========================================
capabilities           string[]  the manifest has every one (subset)
offering_id            string    some offering has this id
tags                   string[]  some offering carries at least one of them
version                string    the manifest version satisfies the range
                                 (:mod:`.semver`)
protocol_version       string    equal, or a prefix of MAJOR.MINOR.PATCH
                                 (``0.3`` matches ``0.3.0``, ``0.3.1``)
node                   string    ``node.id`` equals it
owner                  string    ``owner`` equals it
tenant                 string    ``trust.tenant`` equals it
agent_ids              string[]  ``id`` is one of them
name                   string    ``name`` (the display name) equals it; a
                                 meshnode extension of §9.3, which other
                                 registries ignore (callers filter again)
availability           enum      joined presence equals it (online, busy,
                                 degraded, offline)
trust_tier             enum      the node's standing is at least this
                                 (sandbox < standard < verified); only the
                                 sandbox flag is known to the registry, so
                                 every other agent counts as ``standard``
availability_class     enum      ``node.profile.availability_class`` (declared)
reachability           enum      ``node.profile.reachability`` (declared)
limit                  integer   page size, default 50, at most 500
cursor                 string    opaque, from the previous page's reply
=====================  ========  =========================================

A type error or an unknown enum value is ``INVALID_QUERY`` naming the field.
Unknown members are ignored (forward compatibility).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import is_valid_public
from meshnode.protocol.offerings import normalize_discover_query

from .semver import VersionRange

__all__ = [
    "AVAILABILITY_VALUES",
    "DEFAULT_LIMIT",
    "MAX_LIMIT",
    "TRUST_TIERS",
    "DiscoverQuery",
    "decode_cursor",
    "encode_cursor",
    "listed_for",
    "parse_discover_query",
]

#: §8.4 presence values.
AVAILABILITY_VALUES = ("online", "busy", "degraded", "offline")
#: §9.7 node standing, lowest first.
TRUST_TIERS = ("sandbox", "standard", "verified")
_AVAILABILITY_CLASSES = ("always_on", "intermittent", "on_demand")
_REACHABILITY = ("direct", "leaf")

DEFAULT_LIMIT = 50
MAX_LIMIT = 500


def _invalid(field: str, message: str) -> ProtocolError:
    return ProtocolError("INVALID_QUERY", f"{field}: {message}", {"field": field})


def encode_cursor(agent_id: str) -> str:
    """The opaque cursor that resumes a listing after ``agent_id``."""
    return base64.urlsafe_b64encode(agent_id.encode("ascii")).decode("ascii").rstrip("=")


def decode_cursor(cursor: str) -> str | None:
    """The agent id a cursor resumes after, or None when it is not one of ours."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        agent_id = raw.decode("ascii")
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    return agent_id if is_valid_public(agent_id) else None


@dataclass(frozen=True)
class DiscoverQuery:
    """A validated discover query; None or empty means the filter is absent."""

    capabilities: frozenset[str] = frozenset()
    offering_id: str | None = None
    tags: frozenset[str] = frozenset()
    version: VersionRange | None = None
    protocol_version: str | None = None
    node: str | None = None
    owner: str | None = None
    tenant: str | None = None
    agent_ids: frozenset[str] | None = None
    name: str | None = None
    availability: str | None = None
    trust_tier: str | None = None
    availability_class: str | None = None
    reachability: str | None = None
    limit: int = DEFAULT_LIMIT
    after: str | None = None

    def matches(self, manifest: Mapping[str, Any], node_tier: str | None = None) -> bool:
        """True when every registry-side filter holds (availability is joined
        by the caller, visibility by :func:`listed_for`). ``node_tier`` is the
        hosting node's operator-attested tier (§9.7) when the registry knows
        it; a sandboxed registration is sandbox whatever it is given."""
        if self.agent_ids is not None and manifest.get("id") not in self.agent_ids:
            return False
        if self.name is not None and manifest.get("name") != self.name:
            return False
        if self.capabilities and not self.capabilities <= _strings(manifest.get("capabilities")):
            return False
        offerings = [o for o in manifest.get("offerings") or () if isinstance(o, Mapping)]
        if self.offering_id is not None and not any(
            o.get("id") == self.offering_id for o in offerings
        ):
            return False
        if self.tags and not any(self.tags & _strings(o.get("tags")) for o in offerings):
            return False
        if self.version is not None and not self.version.contains(str(manifest.get("version"))):
            return False
        if self.protocol_version is not None and not _protocol_matches(
            self.protocol_version, manifest.get("protocol_version")
        ):
            return False
        node = _member(manifest, "node")
        if self.node is not None and node.get("id") != self.node:
            return False
        if self.owner is not None and manifest.get("owner") != self.owner:
            return False
        trust = _member(manifest, "trust")
        if self.tenant is not None and trust.get("tenant") != self.tenant:
            return False
        if self.trust_tier is not None:
            if manifest.get("sandbox") is True:
                tier = "sandbox"
            else:
                tier = node_tier if node_tier in TRUST_TIERS else "standard"
            if TRUST_TIERS.index(tier) < TRUST_TIERS.index(self.trust_tier):
                return False
        profile = _member(node, "profile")
        if self.availability_class is not None and (
            profile.get("availability_class") != self.availability_class
        ):
            return False
        return self.reachability is None or profile.get("reachability") == self.reachability


def listed_for(manifest: Mapping[str, Any], caller_owners: Collection[str]) -> bool:
    """§8.6 listing tiers: public for everyone, private only for its own owner,
    unlisted for nobody (an unlisted agent is reached by id, never listed)."""
    visibility = manifest.get("visibility", "public")
    if visibility == "public":
        return True
    if visibility == "private":
        return manifest.get("owner") in caller_owners
    return False


def _member(obj: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = obj.get(name)
    return value if isinstance(value, Mapping) else {}


def _strings(value: object) -> frozenset[str]:
    if not isinstance(value, list):
        return frozenset()
    return frozenset(v for v in value if isinstance(v, str))


def _core_parts(version: str) -> list[str]:
    core = version.split("+", 1)[0].split("-", 1)[0]
    return core.split(".")


def _protocol_matches(wanted: str, actual: object) -> bool:
    if not isinstance(actual, str):
        return False
    if wanted == actual:
        return True
    if "-" in wanted or "+" in wanted:
        return False  # a pre-release is asked for exactly
    want, have = _core_parts(wanted), _core_parts(actual)
    have += ["0"] * (len(want) - len(have))
    return have[: len(want)] == want


def _string(query: Mapping[str, Any], name: str) -> str | None:
    value = query.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _invalid(name, "must be a non-empty string")
    return value


def _string_list(query: Mapping[str, Any], name: str) -> frozenset[str] | None:
    value = query.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _invalid(name, "must be an array of non-empty strings")
    return frozenset(value) if value else None


def _choice(query: Mapping[str, Any], name: str, choices: tuple[str, ...]) -> str | None:
    value = _string(query, name)
    if value is not None and value not in choices:
        raise _invalid(name, f"must be one of {', '.join(choices)}")
    return value


def _limit(query: Mapping[str, Any]) -> int:
    value = query.get("limit")
    if value is None:
        return DEFAULT_LIMIT
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # a JavaScript peer's integer
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _invalid("limit", "must be a positive integer")
    return min(value, MAX_LIMIT)


def parse_discover_query(payload: object) -> DiscoverQuery:
    """Validate a discover payload (absent or ``{}`` lists everything listable).

    Raises ProtocolError ``INVALID_QUERY`` with ``details.field``.
    """
    if payload is None:
        return DiscoverQuery()
    if not isinstance(payload, Mapping):
        raise _invalid("query", "must be an object")
    query = normalize_discover_query(payload)
    version_text = _string(query, "version")
    version = None
    if version_text is not None:
        try:
            version = VersionRange.parse(version_text)
        except ValueError as exc:
            raise _invalid("version", f"not a version range ({exc})") from None
    after = None
    cursor = _string(query, "cursor")
    if cursor is not None:
        after = decode_cursor(cursor)
        if after is None:
            raise _invalid("cursor", "is not a cursor this registry issued")
    return DiscoverQuery(
        capabilities=_string_list(query, "capabilities") or frozenset(),
        offering_id=_string(query, "offering_id"),
        name=_string(query, "name"),
        tags=_string_list(query, "tags") or frozenset(),
        version=version,
        protocol_version=_string(query, "protocol_version"),
        node=_string(query, "node"),
        owner=_string(query, "owner"),
        tenant=_string(query, "tenant"),
        agent_ids=_string_list(query, "agent_ids"),
        availability=_choice(query, "availability", AVAILABILITY_VALUES),
        trust_tier=_choice(query, "trust_tier", TRUST_TIERS),
        availability_class=_choice(query, "availability_class", _AVAILABILITY_CLASSES),
        reachability=_choice(query, "reachability", _REACHABILITY),
        limit=_limit(query),
        after=after,
    )
