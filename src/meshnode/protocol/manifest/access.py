"""The §8.12 access block: shapes a stranger may read, never the bindings behind them.

A block is normalized to the members it names (admission policy, security
schemes) or dropped whole: when a scheme is unreadable, and when anything in
it looks like a credential, key, identifier or per-caller location.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from .shapes import _is_nonblank, _is_text, _one_of

__all__ = ["ACCESS_ADMISSION_POLICIES"]

#: §8.12: who is let in.
ACCESS_ADMISSION_POLICIES = frozenset({"open", "allowlist", "screened", "negotiated"})

_HTTP_SCHEME_TYPES = frozenset({"apiKey", "http", "oauth2", "openIdConnect", "mutualTLS"})
_MESH_SCHEME_TYPE = "mesh-identity"


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
