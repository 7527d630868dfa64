"""Registration intake (§6.2): the checks in the order the registry runs them.

Identity, descriptive fields and endpoints, the node and its vouch, offerings,
card-level members, ownership, the encryption key and sealing, then the
declarations and public block (:mod:`.declarations`, :mod:`.public_block`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..attestations import (
    AVAILABILITY_CLASSES,
    key_claim_verifies,
    verify_key_claim,
    verify_owner_attestation,
    verify_vouch,
)
from ..errors import ProtocolError
from ..json_copy import copy_json
from ..nkeys import Prefix, is_valid_public
from .declarations import _drop_unreadable_declarations, _readable_reporting
from .public_block import _check_public, clamp_for_sandbox, materialize_public_block
from .shapes import (
    _check_optional,
    _check_strings,
    _invalid,
    _is_concrete_subject,
    _is_non_negative_number,
    _is_nonblank,
    _is_text,
    _is_x25519_public,
    _one_of,
    _require_list,
    _require_object,
    _whole,
)

__all__ = [
    "INTERACTION_STYLES",
    "SEALING_POSTURES",
    "VISIBILITIES",
    "RegistrationResult",
    "check_registration",
    "derive_sealing",
    "validate_registration",
]

INTERACTION_STYLES = frozenset({"service", "interactive"})
#: §8.6, from widest to narrowest listing.
VISIBILITIES = ("public", "unlisted", "private")
SEALING_POSTURES = frozenset({"required", "preferred"})

_NEED_KINDS = ("resource", "file", "credential", "text", "tool")
_REACHABILITY = frozenset({"direct", "leaf"})
#: §9.7: attested attributes a node MUST NOT self-declare. ``enrolment`` is the
#: registry's word on how the node was enrolled (``sdk`` for an SDK agent's
#: enrolment token), set from the operator's records only.
_ATTESTED_PROFILE_ATTRIBUTES = ("trust_tier", "role", "enrolment")

#: §8.4: liveness is presence's, never the manifest's.
_LIVENESS_MEMBERS = ("availability", "last_heartbeat")

_SEMVER = re.compile(
    r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)"
    r"(?:-[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?"
)
_PROTOCOL_VERSION = re.compile(r"[0-9]+\.[0-9]+(?:\.[0-9]+)?(?:[-+][0-9A-Za-z.+-]*)?")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


# ── result and errors ───────────────────────────────────────────────────────


@dataclass
class RegistrationResult:
    """What intake produced: the manifest to store, and what was dropped on the
    way in (member paths such as ``data_use`` or ``offerings[0].reporting``),
    for the registry to log or report."""

    manifest: dict[str, Any]
    dropped: list[str] = field(default_factory=list)



def _unauthorized(field_path: str, reason: str, message: str) -> ProtocolError:
    return ProtocolError("UNAUTHORIZED", message, {"field": field_path, "reason": reason})


def _refield(exc: ProtocolError, prefix: str) -> ProtocolError:
    """Re-raise an attestation refusal with its field placed inside the manifest."""
    details = dict(exc.details)
    inner = details.get("field")
    details["field"] = f"{prefix}.{inner}" if inner else prefix
    return ProtocolError(exc.code, exc.message, details)


# ── identity, descriptive fields and endpoints (§6.2, §8.2, §14.4) ──────────


def _apply_legacy_aliases(manifest: dict[str, Any]) -> dict[str, Any]:
    """Read ``skills``/``skill_details`` as the offering names (§8.5); emit only the new ones.

    Overlaps ``offerings.normalize_manifest_aliases``; kept local so intake has
    no dependency on the request-side normalizers.
    """
    legacy = manifest.pop("skills", None)
    if "offerings" not in manifest and legacy is not None:
        manifest["offerings"] = legacy
    public = manifest.get("public")
    if isinstance(public, dict):
        for old, new in (("skills", "offerings"), ("skill_details", "offering_details")):
            value = public.pop(old, None)
            if new not in public and value is not None:
                public[new] = value
    return manifest


def _check_identity(manifest: Mapping[str, Any], sender: str) -> str:
    agent_id = manifest.get("id")
    if not is_valid_public(agent_id, Prefix.USER):
        raise _invalid("id", "must be the agent's public key (a user nkey)")
    assert isinstance(agent_id, str)
    if sender != agent_id:
        raise ProtocolError(
            "IDENTITY_MISMATCH",
            "the registration's from does not match the manifest id",
            {"field": "id", "from": sender if isinstance(sender, str) else None, "id": agent_id},
        )
    return agent_id


def _check_descriptive_fields(manifest: Mapping[str, Any]) -> None:
    if not _is_nonblank(manifest.get("name")):
        raise _invalid("name", "is required: a non-empty string")
    if not _is_text(manifest.get("description")):
        raise _invalid("description", "is required: a string")
    version = manifest.get("version")
    if not isinstance(version, str) or not _SEMVER.fullmatch(version):
        raise _invalid("version", "is required: a semantic version (MAJOR.MINOR.PATCH)")
    protocol = manifest.get("protocol_version")
    if not isinstance(protocol, str) or not _PROTOCOL_VERSION.fullmatch(protocol):
        raise _invalid("protocol_version", "is required: a protocol version such as 0.3.0")
    if "provider" in manifest:
        provider = _require_object(manifest["provider"], "provider")
        if not _is_nonblank(provider.get("name")):
            raise _invalid("provider.name", "must be a non-empty string")
        _check_optional(provider, "url", "provider", _is_text, "a string")


OWN_ENDPOINT_ROOTS = ("mesh.agent.{agent}.", "mesh.feed.{agent}.")
"""Where an agent's own endpoints live (§14.1): under its inbox and feed roots only."""


def _check_own_endpoint(name: str, subject: str, agent_id: str) -> None:
    """Refuse an endpoint that is not the registering agent's own subject (§8.2, §14.4).

    Callers address the carried values verbatim (§14.4), so a manifest whose
    endpoint named another agent's inbox would redirect their traffic to that
    agent: the registry stores only subjects rooted at the agent's own id.
    """
    inbox = f"mesh.agent.{agent_id}.inbox"
    if name in ("endpoint", "endpoints.inbox"):
        own, expected = subject == inbox, inbox
    else:
        own = any(subject.startswith(root.format(agent=agent_id)) for root in OWN_ENDPOINT_ROOTS)
        expected = f"a subject under mesh.agent.{agent_id}. or mesh.feed.{agent_id}."
    if not own:
        raise ProtocolError(
            "UNAUTHORIZED",
            f"{name} {subject!r} is not this agent's own subject (expected {expected}); "
            "the operator can accept foreign endpoints with [registry] allow_foreign_endpoints",
            {"field": name, "reason": "endpoint_not_own", "expected": expected},
        )


def _check_endpoints(manifest: dict[str, Any], agent_id: str, *, own_only: bool = True) -> None:
    endpoint = manifest.get("endpoint")
    if not _is_concrete_subject(endpoint):
        raise _invalid("endpoint", "is required: a concrete subject (no wildcards)")
    assert isinstance(endpoint, str)
    if own_only:
        _check_own_endpoint("endpoint", endpoint, agent_id)
    if "endpoints" not in manifest:
        # §8.2: stamped at register time so a stored manifest never lacks it.
        manifest["endpoints"] = {"inbox": endpoint}
        return
    endpoints = dict(_require_object(manifest["endpoints"], "endpoints"))
    for name, subject in endpoints.items():
        if not _is_concrete_subject(subject):
            raise _invalid(f"endpoints.{name}", "must be a concrete subject")
        if own_only:
            _check_own_endpoint(f"endpoints.{name}", subject, agent_id)
    endpoints.setdefault("inbox", endpoint)
    manifest["endpoints"] = endpoints


# ── §4.4 node and vouch, §9.7 declared profile ──────────────────────────────


def _check_profile(profile: object, dropped: list[str]) -> dict[str, Any]:
    """§9.7 declared attributes only: attested ones and unreadable hints are dropped."""
    if not isinstance(profile, Mapping):
        raise _invalid("node.profile", "must be an object")
    out = dict(profile)
    for name in _ATTESTED_PROFILE_ATTRIBUTES:
        if out.pop(name, None) is not None:
            dropped.append(f"node.profile.{name}")
    rules: dict[str, Callable[[object], bool]] = {
        "availability_class": lambda v: _one_of(v, AVAILABILITY_CLASSES),
        "reachability": lambda v: _one_of(v, _REACHABILITY),
        "capacity": lambda v: isinstance(v, Mapping)
        and all((n := _whole(x)) is not None and n >= 0 for x in v.values()),
    }
    for name, ok in rules.items():
        if name in out and not ok(out[name]):
            del out[name]
            dropped.append(f"node.profile.{name}")
    return out


def _check_connection_binding(
    node_id: str, subject_node: str | None, require_connection_bound: bool
) -> None:
    if subject_node is None:
        if require_connection_bound:
            raise _unauthorized(
                "node.id",
                "untokenized_registration",
                "registration must arrive on mesh.registry.register.<node_id>",
            )
        return
    if subject_node != node_id:
        raise _unauthorized(
            "node.id",
            "subject_node_mismatch",
            "the registering credential's node is not the manifest's node",
        )


def _check_node(
    manifest: dict[str, Any],
    agent_id: str,
    *,
    now_ms: int,
    subject_node: str | None,
    require_connection_bound: bool,
    accept_legacy_untagged_vouch: bool,
    dropped: list[str],
) -> str:
    node = dict(_require_object(manifest.get("node"), "node"))
    node_id = node.get("id")
    if not is_valid_public(node_id, Prefix.USER):
        raise _invalid("node.id", "must be the hosting node's public key (a user nkey)")
    assert isinstance(node_id, str)
    attestation = _require_object(node.get("attestation"), "node.attestation")
    for member in ("node", "agent", "issued_at", "expires_at", "sig"):
        if not _is_nonblank(attestation.get(member)):
            raise _invalid(f"node.attestation.{member}", "must be a non-empty string")
    _check_connection_binding(node_id, subject_node, require_connection_bound)
    try:
        verify_vouch(
            attestation,
            now_ms=now_ms,
            expected_node=node_id,
            expected_agent=agent_id,
            accept_legacy_untagged=accept_legacy_untagged_vouch,
        )
    except ProtocolError as exc:
        raise _refield(exc, "node.attestation") from None
    if "profile" in node:
        node["profile"] = _check_profile(node["profile"], dropped)
    manifest["node"] = node
    return node_id


# ── §8.5 offerings ──────────────────────────────────────────────────────────


def _check_need(need: object, path: str) -> None:
    if not isinstance(need, Mapping):
        raise _invalid(path, "must be an object")
    kinds = [kind for kind in _NEED_KINDS if kind in need]
    if len(kinds) != 1:
        raise _invalid(path, f"must carry exactly one of {', '.join(_NEED_KINDS)}")
    if not _is_nonblank(need[kinds[0]]):
        raise _invalid(f"{path}.{kinds[0]}", "must be a non-empty string")
    if "access" in need and not _one_of(need["access"], ("read", "read-write")):
        raise _invalid(f"{path}.access", "must be read or read-write")
    for member in ("description", "scope", "protocol"):
        _check_optional(need, member, path, _is_text, "a string")


def _check_delivers(delivers: object, path: str) -> None:
    obj = _require_object(delivers, path)
    _check_optional(obj, "final", path, _is_text, "a string")
    _check_optional(obj, "interim", path, lambda v: isinstance(v, bool), "a boolean")
    _check_optional(obj, "in_resource", path, lambda v: isinstance(v, bool), "a boolean")


def _check_offering(entry: object, path: str, dropped: list[str]) -> dict[str, Any]:
    offering = dict(_require_object(entry, path))
    if not _is_nonblank(offering.get("id")):
        raise _invalid(f"{path}.id", "is required: a non-empty string")
    for member in ("name", "description"):
        _check_optional(offering, member, path, _is_text, "a string")
    for member in ("tags", "input_modes", "output_modes"):
        if member in offering:
            _check_strings(offering[member], f"{path}.{member}")
    for member in ("input_schema", "output_schema"):
        _check_optional(offering, member, path, lambda v: isinstance(v, Mapping), "an object")
    _check_optional(offering, "examples", path, lambda v: isinstance(v, list), "an array")
    _check_optional(offering, "streaming", path, lambda v: isinstance(v, bool), "a boolean")
    _check_optional(
        offering,
        "estimated_duration_ms",
        path,
        lambda v: (n := _whole(v)) is not None and n >= 0,
        "a non-negative integer",
    )
    if "needs" in offering:
        for j, need in enumerate(_require_list(offering["needs"], f"{path}.needs")):
            _check_need(need, f"{path}.needs[{j}]")
    if "delivers" in offering:
        _check_delivers(offering["delivers"], f"{path}.delivers")
    if "reporting" in offering:
        reporting = _readable_reporting(offering["reporting"])
        if reporting is None:
            del offering["reporting"]  # §8.5.2: dropped, never served
            dropped.append(f"{path}.reporting")
        else:
            offering["reporting"] = reporting
    return offering


def _check_offerings(manifest: dict[str, Any], dropped: list[str]) -> None:
    if "offerings" not in manifest:
        raise _invalid("offerings", "is required: an array (it may be empty)")
    entries = _require_list(manifest["offerings"], "offerings")
    checked: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        offering = _check_offering(entry, f"offerings[{i}]", dropped)
        if offering["id"] in seen:
            raise _invalid(f"offerings[{i}].id", f"duplicates offering id {offering['id']!r}")
        seen.add(offering["id"])
        checked.append(offering)
    manifest["offerings"] = checked


# ── card-level members (§8.1, §8.2, §8.3a, §8.8) ────────────────────────────


def _check_card_members(manifest: Mapping[str, Any]) -> None:
    if "capabilities" not in manifest:
        raise _invalid("capabilities", "is required: an array of capability tags")
    _check_strings(manifest["capabilities"], "capabilities")
    for member in ("default_input_modes", "default_output_modes", "accepts", "emits"):
        if member in manifest:
            _check_strings(manifest[member], member)
    if "interaction" in manifest and not _one_of(manifest["interaction"], INTERACTION_STYLES):
        raise _invalid("interaction", "must be service or interactive")
    if "limits" in manifest:
        limits = _require_object(manifest["limits"], "limits")
        _check_optional(
            limits,
            "max_inbound_chars",
            "limits",
            lambda v: (n := _whole(v)) is not None and n >= 0,
            "a non-negative integer",
        )
    if "rate_limits" in manifest:
        rate_limits = _require_object(manifest["rate_limits"], "rate_limits")
        for member in ("requests_per_second", "requests_per_minute", "concurrent_tasks"):
            _check_optional(
                rate_limits, member, "rate_limits", _is_non_negative_number, "a non-negative number"
            )
    _check_extensions(manifest)
    for member in ("meta",):
        if member in manifest:
            _require_object(manifest[member], member)
    if "skus" in manifest:
        for i, sku in enumerate(_require_list(manifest["skus"], "skus")):
            _require_object(sku, f"skus[{i}]")
    _check_works_with(manifest)


def _check_extensions(manifest: Mapping[str, Any]) -> None:
    if "extensions" not in manifest:
        return
    for i, ext in enumerate(_require_list(manifest["extensions"], "extensions")):
        path = f"extensions[{i}]"
        obj = _require_object(ext, path)
        if not _is_nonblank(obj.get("uri")):
            raise _invalid(f"{path}.uri", "is required: a non-empty string")
        _check_optional(obj, "required", path, lambda v: isinstance(v, bool), "a boolean")
        for member in ("version", "description"):
            _check_optional(obj, member, path, _is_text, "a string")


def _check_works_with(manifest: Mapping[str, Any]) -> None:
    if "works_with" not in manifest:
        return
    for i, entry in enumerate(_require_list(manifest["works_with"], "works_with")):
        path = f"works_with[{i}]"
        obj = _require_object(entry, path)
        if not _is_nonblank(obj.get("service")):
            raise _invalid(f"{path}.service", "is required: a non-empty string")
        for member in ("domain", "description"):
            _check_optional(obj, member, path, _is_text, "a string")


# ── §8.6 ownership and visibility ───────────────────────────────────────────


def _check_visibility(manifest: dict[str, Any]) -> None:
    visibility = manifest.get("visibility", "public")
    if visibility == "organization":
        # An SDK-only tier narrower than public: read it as the narrowest tier
        # so nothing becomes more visible than its registrant asked.
        visibility = "private"
    if not _one_of(visibility, VISIBILITIES):
        raise _invalid("visibility", "must be public, unlisted or private")
    manifest["visibility"] = visibility


def _check_owner(
    manifest: dict[str, Any],
    agent_id: str,
    node_id: str,
    *,
    now_ms: int,
    accept_legacy_untagged: bool,
) -> None:
    owner = manifest.get("owner", node_id)
    if not is_valid_public(owner, None):
        raise _invalid("owner", "must be a public key")
    manifest["owner"] = owner
    if owner == node_id:
        return
    if "owner_attestation" not in manifest:
        raise _invalid("owner_attestation", "is required when owner differs from the hosting node")
    attestation = _require_object(manifest["owner_attestation"], "owner_attestation")
    signer = "owner" if "owner" in attestation else "node"
    for member in (signer, "agent", "issued_at", "expires_at", "sig"):
        if not _is_nonblank(attestation.get(member)):
            raise _invalid(f"owner_attestation.{member}", "must be a non-empty string")
    verify_owner_attestation(
        manifest["owner_attestation"],
        now_ms=now_ms,
        owner=owner,
        agent=agent_id,
        accept_legacy_untagged=accept_legacy_untagged,
    )


# ── §4.3/§8.3 encryption key and claim, §8.9 sealing ────────────────────────


def _check_trust(manifest: dict[str, Any], agent_id: str, dropped: list[str]) -> None:
    if "trust" in manifest:
        trust = _require_object(manifest["trust"], "trust")
        for member in ("tenant", "issued_at", "signature"):
            _check_optional(trust, member, "trust", _is_text, "a string")
    if "encryption_key" in manifest:
        if not _is_x25519_public(manifest["encryption_key"]):
            raise _invalid("encryption_key", "must be a 32-byte X25519 public key in base64url")
        # §8.2: REQUIRED with an encryption key; a reader MUST NOT seal to an unverifiable one.
        verify_key_claim(manifest, expected_agent=agent_id)
        return
    current = manifest.get("trust")
    if isinstance(current, Mapping) and "signature" in current and not key_claim_verifies(
        manifest, expected_agent=agent_id
    ):
        # No key to protect: an unverifiable claim (often a pre-§8.3 whole-manifest
        # signature) is not stored, so nothing reads it as a claim.
        manifest["trust"] = {
            k: v for k, v in current.items() if k not in ("signature", "issued_at")
        }
        dropped.append("trust.signature")


def derive_sealing(manifest: Mapping[str, Any]) -> str | None:
    """The §8.9 default posture for a manifest that declared none (steps 2-5).

    No encryption key: nothing. An offering needing a credential: ``required``.
    A non-empty ``works_with``: ``preferred``. Otherwise nothing.
    """
    if not manifest.get("encryption_key"):
        return None
    for offering in manifest.get("offerings") or ():
        needs = offering.get("needs") if isinstance(offering, Mapping) else None
        if isinstance(needs, list) and any(
            isinstance(need, Mapping) and "credential" in need for need in needs
        ):
            return "required"
    works_with = manifest.get("works_with")
    if isinstance(works_with, list) and works_with:
        return "preferred"
    return None


def _check_sealing(manifest: dict[str, Any], derive: bool) -> None:
    if "sealing" in manifest:
        sealing = manifest["sealing"]
        if sealing is None:
            del manifest["sealing"]  # an explicit decision to declare none wins (§8.9 step 1)
            return
        if not _one_of(sealing, SEALING_POSTURES):
            raise _invalid("sealing", "must be required or preferred")
        if "encryption_key" not in manifest:
            raise _invalid("sealing", "requires encryption_key")
        return
    if derive:
        posture = derive_sealing(manifest)
        if posture is not None:
            manifest["sealing"] = posture


# ── §8.13 descriptor ────────────────────────────────────────────────────────


def _check_descriptor(manifest: dict[str, Any], descriptor_digest: str | None) -> None:
    if descriptor_digest is not None:
        if not _SHA256_HEX.fullmatch(descriptor_digest):
            raise ValueError("descriptor_digest must be 64 lowercase hex characters")
        manifest["descriptor"] = {"digest": descriptor_digest}
        return
    if "descriptor" in manifest:
        descriptor = _require_object(manifest["descriptor"], "descriptor")
        digest = descriptor.get("digest")
        if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
            raise _invalid("descriptor.digest", "must be a SHA-256 hex digest")


# ── intake ──────────────────────────────────────────────────────────────────


def check_registration(
    manifest: object,
    *,
    sender: str,
    now_ms: int,
    subject_node: str | None = None,
    require_connection_bound: bool = False,
    sandbox: bool = False,
    derive_sealing_posture: bool = True,
    descriptor_digest: str | None = None,
    accept_legacy_untagged: bool = False,
    enrolment: str | None = None,
    own_endpoints_only: bool = True,
) -> RegistrationResult:
    """:func:`validate_registration`, also reporting what was dropped on the way in.

    ``enrolment`` is the node's enrolment profile as the registry learned it
    from the operator's records (``"sdk"``): stored as ``node.profile.enrolment``.
    A registrant's own value of that member is always dropped.
    """
    if not isinstance(manifest, Mapping):
        raise _invalid("manifest", "must be an object")
    working: dict[str, Any] = _apply_legacy_aliases(copy_json(dict(manifest)))
    dropped: list[str] = []
    agent_id = _check_identity(working, sender)
    _check_descriptive_fields(working)
    _check_endpoints(working, agent_id, own_only=own_endpoints_only)
    node_id = _check_node(
        working,
        agent_id,
        now_ms=now_ms,
        subject_node=subject_node,
        require_connection_bound=require_connection_bound,
        accept_legacy_untagged_vouch=accept_legacy_untagged,
        dropped=dropped,
    )
    _check_offerings(working, dropped)
    _check_card_members(working)
    _check_visibility(working)
    _check_owner(
        working, agent_id, node_id, now_ms=now_ms, accept_legacy_untagged=accept_legacy_untagged
    )
    _check_trust(working, agent_id, dropped)
    _check_sealing(working, derive_sealing_posture)
    _drop_unreadable_declarations(working, "", dropped)
    _check_descriptor(working, descriptor_digest)
    _check_public(working, dropped)
    stored = materialize_public_block(working)
    for member in _LIVENESS_MEMBERS:
        stored.pop(member, None)
    stored.pop("sandbox", None)  # server-controlled: set from the node's attested tier only
    if sandbox:
        stored = clamp_for_sandbox(stored)
        stored["sandbox"] = True
    if enrolment is not None:
        node = dict(stored["node"])
        node["profile"] = {**dict(node.get("profile") or {}), "enrolment": enrolment}
        stored["node"] = node
    return RegistrationResult(stored, dropped)


def validate_registration(
    manifest: object,
    *,
    sender: str,
    now_ms: int,
    subject_node: str | None = None,
    require_connection_bound: bool = False,
    sandbox: bool = False,
    derive_sealing_posture: bool = True,
    descriptor_digest: str | None = None,
    accept_legacy_untagged: bool = False,
    own_endpoints_only: bool = True,
) -> dict[str, Any]:
    """Validate a registration (§6.2) and return the normalized manifest to store.

    ``sender`` is the register envelope's verified ``from``; ``now_ms`` the
    registry's clock. ``subject_node`` is the trailing token of
    ``mesh.registry.register.{node_id}`` when the registration arrived on the
    connection-bound subject (§4.4 (b)); it must equal ``node.id``, and with
    ``require_connection_bound`` an untokenized registration is refused.
    ``sandbox`` is the hosting node's attested sandbox tier (§9.7): it sets
    ``sandbox`` and clamps visibility. ``descriptor_digest`` is the digest
    of the agent's current stored descriptor (§8.13), which replaces any
    registrant-typed pointer. ``accept_legacy_untagged`` admits untagged
    vouch/owner signatures (0.2 window only). ``own_endpoints_only`` refuses
    an ``endpoint``/``endpoints`` member that is not the agent's own subject.

    Raises ProtocolError:

    * ``INVALID_MANIFEST`` (``details.field`` names the member) when the
      schema fails, including a missing or unverifiable key claim beside an
      ``encryption_key``, ``sealing`` without ``encryption_key``, and a
      missing ``owner_attestation`` for an owner other than the node;
    * ``IDENTITY_MISMATCH`` when ``sender`` is not the manifest ``id``;
    * ``UNAUTHORIZED`` when the vouch or owner attestation does not hold
      (forged, for another agent/node, expired), or the connection binding
      fails, or an endpoint is not the agent's own (``endpoint_not_own``);
      ``details.reason`` says which.
    """
    return check_registration(
        manifest,
        sender=sender,
        now_ms=now_ms,
        subject_node=subject_node,
        require_connection_bound=require_connection_bound,
        sandbox=sandbox,
        derive_sealing_posture=derive_sealing_posture,
        descriptor_digest=descriptor_digest,
        accept_legacy_untagged=accept_legacy_untagged,
        own_endpoints_only=own_endpoints_only,
    ).manifest
