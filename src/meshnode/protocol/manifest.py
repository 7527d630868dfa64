"""The agent manifest at registration (AgentMesh §8, with §4.4, §6.2, §8.6, §9.7).

:func:`validate_registration` is what the registry runs on intake: it refuses
a manifest that fails the schema (``INVALID_MANIFEST``, with ``details.field``
naming the member at fault), a registration whose ``from`` is not the
manifest's ``id`` (``IDENTITY_MISMATCH``), and one whose vouch or owner
attestation does not hold (``UNAUTHORIZED``, see :mod:`.attestations`). It
returns the manifest to store, normalized:

* legacy names (``skills``, ``skill_details``) are read and only the new names
  are emitted (§8.5);
* declarations that must be *dropped rather than served* when unreadable are
  dropped: an offering's ``reporting`` (§8.5.2), ``data_use`` (§8.10),
  ``compliance`` (§8.11), and ``public.access`` (§8.12, also when it carries
  anything secret-shaped);
* server-controlled members are set by the registry, never taken from the
  registrant: ``owner`` (defaults to the node), ``visibility`` (defaults to
  public), ``sandbox``, ``endpoints`` (stamped from ``endpoint``), and the
  public block's ``offering_details`` / default modes (§8.7);
* ``sealing`` is derived per §8.9 when the operator did not declare one.

Everything here is pure: the clock is ``now_ms`` and nothing is read or written.
"""

from __future__ import annotations

import base64
import binascii
import copy
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from .attestations import (
    AVAILABILITY_CLASSES,
    key_claim_verifies,
    verify_key_claim,
    verify_owner_attestation,
    verify_vouch,
)
from .errors import ProtocolError
from .nkeys import Prefix, is_valid_public
from .timeutil import try_parse_rfc3339

__all__ = [
    "ACCESS_ADMISSION_POLICIES",
    "DATA_USE_PROMISES",
    "INTERACTION_STYLES",
    "REPORTING_LEVELS",
    "SEALING_POSTURES",
    "VISIBILITIES",
    "RegistrationResult",
    "check_registration",
    "clamp_for_sandbox",
    "derive_sealing",
    "describe_document",
    "materialize_public_block",
    "parse_cadence_ms",
    "validate_registration",
]

INTERACTION_STYLES = frozenset({"service", "interactive"})
#: §8.6, from widest to narrowest listing.
VISIBILITIES = ("public", "unlisted", "private")
SEALING_POSTURES = frozenset({"required", "preferred"})
#: §8.5.2 / Agent SoW §5.12, in rank order.
REPORTING_LEVELS = ("records_only", "on_change", "check_ins")
#: §8.10 / Agent SoW §5.11: the closed promise vocabulary.
DATA_USE_PROMISES = frozenset({"no_training", "no_third_party_sharing", "no_human_reading"})
#: §8.12: who is let in.
ACCESS_ADMISSION_POLICIES = frozenset({"open", "allowlist", "screened", "negotiated"})

_HTTP_SCHEME_TYPES = frozenset({"apiKey", "http", "oauth2", "openIdConnect", "mutualTLS"})
_MESH_SCHEME_TYPE = "mesh-identity"
_NEED_KINDS = ("resource", "file", "credential", "text", "tool")
_UI_AUDIENCES = frozenset({"public", "client", "operator"})
_UI_ACCESS = frozenset({"open", "authenticated"})
_REACHABILITY = frozenset({"direct", "leaf"})
#: §9.7: attested attributes a node MUST NOT self-declare.
_ATTESTED_PROFILE_ATTRIBUTES = ("trust_tier", "role")

#: §8.7: what the registry builds and a registrant may never supply.
_REGISTRY_MATERIALIZED = ("offering_details", "default_input_modes", "default_output_modes")
#: §8.7: the offering members copied into the storefront (``examples`` is not).
_PUBLIC_OFFERING_MEMBERS = (
    "id",
    "name",
    "description",
    "tags",
    "input_modes",
    "output_modes",
    "input_schema",
    "output_schema",
    "streaming",
    "estimated_duration_ms",
    "needs",
    "delivers",
    "reporting",
)
#: Members outside the public block that a stranger reads pre-admission
#: (§8.7: name, works_with, sealing; §8.10/§8.11: data_use, compliance; the
#: five questions of §3.3.1 answer "who" with the owner and "how" with
#: interaction).
_DESCRIBE_TRAVELLERS = (
    "name",
    "owner",
    "interaction",
    "sealing",
    "works_with",
    "data_use",
    "compliance",
)
#: §8.4: liveness is presence's, never the manifest's.
_LIVENESS_MEMBERS = ("availability", "last_heartbeat")

_SEMVER = re.compile(
    r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)"
    r"(?:-[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?"
)
_PROTOCOL_VERSION = re.compile(r"[0-9]+\.[0-9]+(?:\.[0-9]+)?(?:[-+][0-9A-Za-z.+-]*)?")
_SUBJECT_TOKEN = re.compile(r"[\x21-\x7e]+")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
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


# ── result and errors ───────────────────────────────────────────────────────


@dataclass
class RegistrationResult:
    """What intake produced: the manifest to store, and what was dropped on the
    way in (member paths such as ``data_use`` or ``offerings[0].reporting``),
    for the registry to log or report."""

    manifest: dict[str, Any]
    dropped: list[str] = field(default_factory=list)


def _invalid(field_path: str, message: str) -> ProtocolError:
    return ProtocolError("INVALID_MANIFEST", f"{field_path}: {message}", {"field": field_path})


def _unauthorized(field_path: str, reason: str, message: str) -> ProtocolError:
    return ProtocolError("UNAUTHORIZED", message, {"field": field_path, "reason": reason})


def _refield(exc: ProtocolError, prefix: str) -> ProtocolError:
    """Re-raise an attestation refusal with its field placed inside the manifest."""
    details = dict(exc.details)
    inner = details.get("field")
    details["field"] = f"{prefix}.{inner}" if inner else prefix
    return ProtocolError(exc.code, exc.message, details)


# ── small shape predicates ──────────────────────────────────────────────────


def _one_of(value: object, choices: Collection[str]) -> bool:
    """Membership for untrusted JSON: only a string can be one of a vocabulary."""
    return isinstance(value, str) and value in choices


def _is_text(value: object) -> bool:
    return isinstance(value, str)


def _is_nonblank(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _whole(value: object) -> int | None:
    """An integer JSON number (an integral double counts, as a JS peer sends it)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _is_non_negative_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def _require_list(value: object, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise _invalid(path, "must be an array")
    return value


def _require_object(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _invalid(path, "must be an object")
    return value


def _check_strings(value: object, path: str, *, nonblank: bool = True) -> list[str]:
    items = _require_list(value, path)
    for i, item in enumerate(items):
        if not (_is_nonblank(item) if nonblank else _is_text(item)):
            raise _invalid(f"{path}[{i}]", "must be a non-empty string")
    return items


def _check_optional(
    obj: Mapping[str, Any], key: str, path: str, ok: Callable[[object], bool], what: str
) -> None:
    if key in obj and not ok(obj[key]):
        raise _invalid(f"{path}.{key}" if path else key, f"must be {what}")


def _is_concrete_subject(value: object) -> bool:
    if not isinstance(value, str) or not value:
        return False
    return all(
        _SUBJECT_TOKEN.fullmatch(token) is not None and "*" not in token and ">" not in token
        for token in value.split(".")
    )


def _is_x25519_public(value: object) -> bool:
    """An X25519 public key as the SDKs publish it: 32 bytes, base64url (or base64)."""
    if not isinstance(value, str) or not value.isascii() or not value or value.strip() != value:
        return False
    padded = value + "=" * (-len(value) % 4)
    for decode in (base64.urlsafe_b64decode, base64.standard_b64decode):
        try:
            raw = decode(padded)
        except (binascii.Error, ValueError):
            continue
        if len(raw) == 32 and re.fullmatch(r"[A-Za-z0-9_+/=-]+", value):
            return True
    return False


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


# ── §8.12 access: shapes, never bindings ────────────────────────────────────

#: Member names that are shapes by definition (§8.12 and OpenAPI security schemes).
_ACCESS_SHAPE_KEYS = frozenset(
    {
        "admission",
        "schemes",
        "id",
        "transport",
        "type",
        "description",
        "in",
        "name",
        "scheme",
        "bearerFormat",
        "flows",
        "openIdConnectUrl",
        "authorizationUrl",
        "tokenUrl",
        "refreshUrl",
        "scopes",
    }
)
_SECRET_KEY_MARKERS = (
    "secret",
    "token",
    "passw",
    "apikey",
    "privatekey",
    "credential",
    "bearer",
    "authorization",
    "session",
    "signature",
    "tenant",
    "account",
    "seed",
    "clientid",
    "accesskey",
    "value",
    "jwt",
    "cookie",
    "username",
    "userid",
    "filepath",
)
_SECRET_KEY_EXACT = frozenset({"key", "sig", "pin", "user", "path", "auth", "code"})
_SECRET_QUERY_MARKERS = (
    "key",
    "token",
    "secret",
    "sig",
    "pass",
    "code",
    "tenant",
    "account",
    "client",
    "auth",
    "session",
    "user",
)
_SECRET_VALUE_PATTERNS = tuple(
    re.compile(p)
    for p in (
        r"-----BEGIN [A-Z ]*(?:PRIVATE KEY|CERTIFICATE)",  # PEM material
        r"\beyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}",  # a JWT
        # an Authorization value: the scheme word followed by an opaque run with a digit
        r"(?i)\b(?:bearer|basic)\s+(?=[A-Za-z0-9._~+/=-]*[0-9])[A-Za-z0-9._~+/=-]{12,}",
        r"\bS[OANUC][A-Z2-7]{56}\b",  # an nkey seed
        r"\b[OANUC][A-Z2-7]{55}\b",  # an nkey: account, operator or user identifier
        r"\b(?:sk|pk|rk)[-_](?:live|test|proj)[-_][A-Za-z0-9_-]{8,}",
        r"\bsk-[A-Za-z0-9_-]{16,}",
        r"\bgh[pousr]_[A-Za-z0-9]{20,}",
        r"\bxox[abposr]-[A-Za-z0-9-]{10,}",
        r"\bAKIA[0-9A-Z]{16}\b",
        r"\bAIza[0-9A-Za-z_-]{35}\b",
    )
)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]+")
_OPAQUE_RUN = re.compile(r"[A-Za-z0-9+/=_-]{32,}")
_PATH_LIKE = re.compile(r"(?:~[/\\]|/(?!/)|[A-Za-z]:[\\/]|\\\\)\S*")


def _secret_key(key: str) -> bool:
    if key in _ACCESS_SHAPE_KEYS:
        return False
    folded = re.sub(r"[^a-z0-9]", "", key.lower())
    return folded in _SECRET_KEY_EXACT or any(marker in folded for marker in _SECRET_KEY_MARKERS)


def _secret_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
        userinfo = parts.username is not None or parts.password is not None
    except ValueError:
        return True  # unparseable: not something a stranger should be handed
    if userinfo or parts.scheme.lower() == "file" or "{" in url or "%7b" in url.lower():
        return True  # credentials in the URL, a filesystem path, or a per-caller template
    names = [name.lower() for name, _ in parse_qsl(parts.query, keep_blank_values=True)]
    return any(marker in name for name in names for marker in _SECRET_QUERY_MARKERS)


def _secret_text(text: str) -> bool:
    """True when a string carries a credential, key, identifier or per-caller location."""
    if any(p.search(text) for p in _SECRET_VALUE_PATTERNS):
        return True
    if any(_secret_url(url) for url in _URL.findall(text)):
        return True
    if _PATH_LIKE.fullmatch(text.strip()):
        return True
    without_urls = _URL.sub(" ", text)
    # A long opaque run with letters and digits is what a key or token looks like.
    return any(
        re.search(r"[A-Za-z]", run) and re.search(r"[0-9]", run)
        for run in _OPAQUE_RUN.findall(without_urls)
    )


def _carries_secret(value: object, parent: str | None = None) -> bool:
    """§8.12: does anything in this subtree look like a binding rather than a shape?"""
    if isinstance(value, Mapping):
        for key, member in value.items():
            # OAuth flow names ("password") and scope names are vocabulary, not members.
            if parent not in ("flows", "scopes") and _secret_key(str(key)):
                return True
            if _carries_secret(member, str(key)):
                return True
        return False
    if isinstance(value, list):
        return any(_carries_secret(item, parent) for item in value)
    if isinstance(value, str):
        return _secret_text(value)
    return False


def _readable_url(value: object) -> bool:
    if not _is_nonblank(value):
        return False
    assert isinstance(value, str)
    try:
        parts = urlsplit(value)
    except ValueError:
        return False
    return parts.scheme in ("https", "http") and bool(parts.netloc)


_OAUTH_FLOW_URLS = {
    "implicit": ("authorizationUrl",),
    "password": ("tokenUrl",),
    "clientCredentials": ("tokenUrl",),
    "authorizationCode": ("authorizationUrl", "tokenUrl"),
}


def _readable_flows(value: object) -> dict[str, Any] | None:
    if not isinstance(value, Mapping) or not value:
        return None
    flows: dict[str, Any] = {}
    for name, flow in value.items():
        required = _OAUTH_FLOW_URLS.get(name)
        if required is None or not isinstance(flow, Mapping):
            return None
        out: dict[str, Any] = {}
        for member in ("authorizationUrl", "tokenUrl", "refreshUrl"):
            if member in flow:
                if not _readable_url(flow[member]):
                    return None
                out[member] = flow[member]
        if any(member not in out for member in required):
            return None
        scopes = flow.get("scopes", {})
        if not isinstance(scopes, Mapping) or not all(_is_text(v) for v in scopes.values()):
            return None
        out["scopes"] = dict(scopes)
        flows[name] = out
    return flows


def _readable_http_members(scheme: Mapping[str, Any]) -> dict[str, Any] | None:
    """The OpenAPI members of an http-transport scheme, by type, or None."""
    kind = scheme["type"]
    if kind == "apiKey":
        if not _one_of(scheme.get("in"), ("header", "query", "cookie")) or not _is_nonblank(scheme.get("name")):
            return None
        return {"in": scheme["in"], "name": scheme["name"]}
    if kind == "http":
        if not _is_nonblank(scheme.get("scheme")):
            return None
        out: dict[str, Any] = {"scheme": scheme["scheme"]}
        if "bearerFormat" in scheme:
            if not _is_text(scheme["bearerFormat"]):
                return None
            out["bearerFormat"] = scheme["bearerFormat"]
        return out
    if kind == "oauth2":
        flows = _readable_flows(scheme.get("flows"))
        return None if flows is None else {"flows": flows}
    if kind == "openIdConnect":
        url = scheme.get("openIdConnectUrl")
        return {"openIdConnectUrl": url} if _readable_url(url) else None
    return {}  # mutualTLS carries nothing further


def _readable_scheme(scheme: object) -> dict[str, Any] | None:
    if not isinstance(scheme, Mapping):
        return None
    scheme_id, transport, kind = scheme.get("id"), scheme.get("transport"), scheme.get("type")
    if not _is_nonblank(scheme_id):
        return None
    if "description" in scheme and not _is_text(scheme["description"]):
        return None
    out: dict[str, Any] = {"id": scheme_id, "transport": transport, "type": kind}
    if transport == "mesh":
        if kind != _MESH_SCHEME_TYPE:
            return None
    elif transport == "http":
        if not _one_of(kind, _HTTP_SCHEME_TYPES):
            return None
        members = _readable_http_members(scheme)
        if members is None:
            return None
        out.update(members)
    else:
        return None
    if "description" in scheme:
        out["description"] = scheme["description"]
    return out


def _readable_access(value: object) -> dict[str, Any] | None:
    """The §8.12 block normalized to its member list, or None to drop it whole."""
    if not isinstance(value, Mapping) or _carries_secret(value):
        return None
    out: dict[str, Any] = {}
    if "admission" in value:
        admission = value["admission"]
        if not isinstance(admission, str):
            return None
        # An unrecognized policy is unstated, never open (§8.12).
        if _one_of(admission, ACCESS_ADMISSION_POLICIES):
            out["admission"] = admission
    if "schemes" in value:
        if not isinstance(value["schemes"], list):
            return None
        schemes = [_readable_scheme(s) for s in value["schemes"]]
        if any(s is None for s in schemes):
            return None
        ids = [s["id"] for s in schemes if s is not None]
        if len(set(ids)) != len(ids):
            return None
        out["schemes"] = schemes
    return out or None


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


def _check_endpoints(manifest: dict[str, Any]) -> None:
    endpoint = manifest.get("endpoint")
    if not _is_concrete_subject(endpoint):
        raise _invalid("endpoint", "is required: a concrete subject (no wildcards)")
    if "endpoints" not in manifest:
        # §8.2: stamped at register time so a stored manifest never lacks it.
        manifest["endpoints"] = {"inbox": endpoint}
        return
    endpoints = dict(_require_object(manifest["endpoints"], "endpoints"))
    for name, subject in endpoints.items():
        if not _is_concrete_subject(subject):
            raise _invalid(f"endpoints.{name}", "must be a concrete subject")
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


# ── §8.10, §8.11 declarations, §8.13 descriptor ─────────────────────────────


def _drop_unreadable_declarations(
    obj: dict[str, Any], prefix: str, dropped: list[str]
) -> None:
    for member, readable in (("data_use", _readable_data_use), ("compliance", _readable_compliance)):
        if member in obj and not readable(obj[member]):
            del obj[member]  # dropped whole: a partially readable claim misleads
            dropped.append(f"{prefix}{member}")


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


# ── §8.7 the public block ───────────────────────────────────────────────────


def _check_uis(uis: object, offering_ids: set[str]) -> None:
    for i, entry in enumerate(_require_list(uis, "public.uis")):
        path = f"public.uis[{i}]"
        obj = _require_object(entry, path)
        url = obj.get("url")
        if not isinstance(url, str) or urlsplit(url).scheme != "https" or not urlsplit(url).netloc:
            raise _invalid(f"{path}.url", "is required: an https URL")
        if not _is_nonblank(obj.get("label")):
            raise _invalid(f"{path}.label", "is required: a non-empty string")
        _check_optional(obj, "purpose", path, _is_text, "a string")
        _check_optional(obj, "kind", path, _is_text, "a string")
        _check_optional(obj, "audience", path, lambda v: _one_of(v, _UI_AUDIENCES), "public, client or operator")
        _check_optional(obj, "access", path, lambda v: _one_of(v, _UI_ACCESS), "open or authenticated")
        _check_optional(obj, "offering", path, lambda v: _one_of(v, offering_ids), "a declared offering id")


def _check_links(links: object) -> None:
    for i, entry in enumerate(_require_list(links, "public.links")):
        path = f"public.links[{i}]"
        obj = _require_object(entry, path)
        if not _is_nonblank(obj.get("handle")):
            raise _invalid(f"{path}.handle", "is required: a non-empty string")
        _check_optional(obj, "rel", path, _is_text, "a string")


def _check_public(manifest: dict[str, Any], dropped: list[str]) -> None:
    if "public" not in manifest:
        return
    public = dict(_require_object(manifest["public"], "public"))
    for member in ("description", "admission"):
        _check_optional(public, member, "public", _is_text, "a string")
    for member in ("offerings", "example_queries"):
        if member in public:
            _check_strings(public[member], f"public.{member}")
    if "links" in public:
        _check_links(public["links"])
    if "skus" in public:
        for i, sku in enumerate(_require_list(public["skus"], "public.skus")):
            _require_object(sku, f"public.skus[{i}]")
    if "uis" in public:
        _check_uis(public["uis"], {o["id"] for o in manifest["offerings"]})
    if "access" in public:
        access = _readable_access(public["access"])
        if access is None:
            del public["access"]
            dropped.append("public.access")
        else:
            public["access"] = access
    _drop_unreadable_declarations(public, "public.", dropped)
    manifest["public"] = public


def _public_offering(offering: Mapping[str, Any]) -> dict[str, Any]:
    return {
        member: copy.deepcopy(offering[member])
        for member in _PUBLIC_OFFERING_MEMBERS
        if member in offering
    }


def materialize_public_block(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``manifest`` whose public block is rebuilt by the registry (§8.7).

    Registrant-supplied ``offering_details``, ``default_input_modes`` and
    ``default_output_modes`` are discarded. ``public.offerings`` keeps only
    advertised ids that name a declared offering (first occurrence, in
    order); ``offering_details`` is copied from those offerings (without
    ``examples``); the default modes are copied from the card level. A
    manifest without a public block gets none.
    """
    out = dict(manifest)
    public = manifest.get("public")
    if not isinstance(public, Mapping):
        return out
    block = {
        k: copy.deepcopy(v)
        for k, v in public.items()
        if k not in _REGISTRY_MATERIALIZED and k not in ("skills", "skill_details")
    }
    declared: dict[str, Mapping[str, Any]] = {}
    for offering in manifest.get("offerings") or ():
        if isinstance(offering, Mapping) and isinstance(offering.get("id"), str):
            declared.setdefault(offering["id"], offering)
    advertised = block.get("offerings")
    if isinstance(advertised, list):
        kept = list(dict.fromkeys(i for i in advertised if isinstance(i, str) and i in declared))
        block["offerings"] = kept
        block["offering_details"] = [_public_offering(declared[i]) for i in kept]
    for member in ("default_input_modes", "default_output_modes"):
        if isinstance(manifest.get(member), list):
            block[member] = copy.deepcopy(manifest[member])
    out["public"] = block
    return out


# ── §8.6 sandbox clamp, §10.14 describe ─────────────────────────────────────


def clamp_for_sandbox(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A copy with visibility clamped to at most ``unlisted`` (§8.6, §9.7).

    Sandbox-attested registrations are never listed openly: ``public`` (or an
    absent visibility, which means public) becomes ``unlisted``; ``unlisted``
    and ``private`` stand.
    """
    out = dict(manifest)
    if out.get("visibility", "public") not in ("unlisted", "private"):
        out["visibility"] = "unlisted"
    return out


def describe_document(
    manifest: Mapping[str, Any], *, card: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The §10.14 describe response for a stored manifest.

    ``agent_id``; the registrar-signed ``card`` when the agent holds a handle;
    the public block verbatim under ``public``; and the members that travel
    with the storefront pre-admission (§8.7 name, works_with, sealing; §8.10
    data_use; §8.11 compliance; the owner and interaction that answer the
    five questions, §3.3.1). Absent parts are omitted, never nulled. Served
    from declared bytes: nothing here consults the agent.
    """
    doc: dict[str, Any] = {"agent_id": manifest["id"]}
    if card is not None:
        doc["card"] = copy.deepcopy(dict(card))
    for member in _DESCRIBE_TRAVELLERS:
        if member in manifest and manifest[member] is not None:
            doc[member] = copy.deepcopy(manifest[member])
    public = manifest.get("public")
    if isinstance(public, Mapping):
        doc["public"] = copy.deepcopy(dict(public))
    return doc


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
) -> RegistrationResult:
    """:func:`validate_registration`, also reporting what was dropped on the way in."""
    if not isinstance(manifest, Mapping):
        raise _invalid("manifest", "must be an object")
    working: dict[str, Any] = _apply_legacy_aliases(copy.deepcopy(dict(manifest)))
    dropped: list[str] = []
    agent_id = _check_identity(working, sender)
    _check_descriptive_fields(working)
    _check_endpoints(working)
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
    vouch/owner signatures (0.2 window only).

    Raises ProtocolError:

    * ``INVALID_MANIFEST`` (``details.field`` names the member) when the
      schema fails, including a missing or unverifiable key claim beside an
      ``encryption_key``, ``sealing`` without ``encryption_key``, and a
      missing ``owner_attestation`` for an owner other than the node;
    * ``IDENTITY_MISMATCH`` when ``sender`` is not the manifest ``id``;
    * ``UNAUTHORIZED`` when the vouch or owner attestation does not hold
      (forged, for another agent/node, expired), or the connection binding
      fails (``details.reason`` says which).
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
    ).manifest
