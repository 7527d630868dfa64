"""The credential control plane: enrolment, renewal and revocation of node credentials.

AgentMesh §4.8 requires node credentials to expire and renewal to work without
the transport: a node whose credential lapsed cannot reach anything over NATS,
so it renews over a separate channel — this small HTTP/1.1 service, run beside
the embedded mesh, holding the account signing key that never leaves the host.

Wire contract (WIRE-NOTES, "Credential renewal"; §18.10):

``POST /v1/node-credential``
    Body ``{node_id, ts, node_sig, agents: [{id, sig}]}``. ``ts`` is unix
    seconds; ``node_sig`` is standard base64 of the node key's Ed25519
    signature over ``mesh-node-cred-v1:{ts}:{node_id}:{sorted agent ids joined
    by ","}``; each agent ``sig`` is the agent key's signature over
    ``mesh-node-agent-v1:{ts}:{node_id}:{agent_id}``. Authority to renew is
    possession of the node key and of every hosted agent's key, never the
    credential being renewed, which may long have expired.
    ``200 {jwt, node_id, agents, expires_at, mesh: {name, protocol,
    nats_endpoints, endpoints}}`` (``endpoints`` repeats ``nats_endpoints`` for
    clients of the other implementations, which read that name). Any other
    status carries ``{error, code?}``.
``GET /v1/mesh``
    ``200 {name, protocol, nats_endpoints, control_plane}``: public, no secrets.

Refusal is the revocation mechanism (§4.8): a retired node, or a roster with a
retired or paused agent, is refused its next renewal (403 with ``code``
``node_retired``, ``node_unknown``, ``agent_terminated`` or ``agent_paused``).
A credential already issued stays usable until its own expiry, and
:meth:`ControlPlaneServer.retire_node` says so, with the date.

Enrolment state lives in ``<state_dir>/nodes.json`` (owner-only, replaced
atomically, read-modify-write under an advisory lock so a CLI process and the
daemon can both change it). It is re-read for every request, so a retirement
made by another process takes effect on the next renewal.

An invite is a standard NATS credentials file (:func:`write_invite`) with the
mesh's addresses in ``#`` comment lines outside the BEGIN/END blocks, which
NATS tools skip.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import datetime as _dt
import json
import logging
import math
import os
import re
import ssl as _ssl
import stat
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NamedTuple, Protocol, Self
from urllib.parse import urlsplit

from meshnode.protocol.attestations import TRUST_TIERS, make_trust_attestation
from meshnode.protocol.nkeys import KeyPair, NkeyError, Prefix, is_valid_public, verify
from meshnode.protocol.ratelimit import SlidingWindowLimiter

from .embedded import (
    DEFAULT_TENANT,
    EmbeddedMeshError,
    MeshKeys,
    _read_private_file,
    _write_private_file,
    check_tenant_name,
)
from .jwt import JwtError, decode_jwt, format_creds, parse_creds
from .permissions import Role

if sys.platform != "win32":
    import fcntl

__all__ = [
    "AGENT_SIG_TAG",
    "DEFAULT_PORT",
    "MAX_REQUEST_BODY",
    "MAX_REQUEST_HEAD",
    "MAX_ROSTER",
    "NODE_SIG_TAG",
    "PROTOCOL_VERSION",
    "REVOCATION_CODES",
    "ControlPlaneBadResponse",
    "ControlPlaneClient",
    "ControlPlaneError",
    "ControlPlaneServer",
    "ControlPlaneStateError",
    "ControlPlaneUnreachable",
    "CredentialGrant",
    "CredentialRefused",
    "CredentialRequestError",
    "EnrolledNode",
    "Invite",
    "InviteBundle",
    "InviteError",
    "MeshInfo",
    "agent_signing_input",
    "node_credential_request",
    "node_signing_input",
    "parse_invite",
    "read_invite",
    "verify_node_credential_request",
    "write_invite",
]

log = logging.getLogger(__name__)

PROTOCOL_VERSION = "0.3"
DEFAULT_PORT = 7422
NODE_SIG_TAG = "mesh-node-cred-v1"
AGENT_SIG_TAG = "mesh-node-agent-v1"

MAX_REQUEST_HEAD = 16 * 1024
"""Request line plus headers, CRLFs included."""
MAX_REQUEST_BODY = 256 * 1024
MAX_ROSTER = 512
"""Agents per credential: each adds about 1 KiB of grants to the JWT, and the
broker refuses a CONNECT line beyond its ``max_control_line`` (1 MiB embedded)."""

REVOCATION_CODES = frozenset(
    {"node_retired", "node_unknown", "agent_paused", "agent_terminated", "agent_unnamed",
     "tenant_unknown"}
)
"""Refusal codes that mean "do not retry with this roster": revocation reaching a node."""

_DEFAULT_SKEW_S = 300
_DEFAULT_INVITE_TTL_S = 7 * 24 * 3600
_STATE_FILE = "nodes.json"
_LOCK_FILE = ".nodes.json.lock"
_STATE_VERSION = 1
_MAX_HEADERS = 64
_MAX_INVITE_BYTES = 64 * 1024
_MAX_RESPONSE_HEAD = 64 * 1024
_MAX_RESPONSE_BODY = 4 * 1024 * 1024
_LINGER_BYTES = MAX_REQUEST_BODY + MAX_REQUEST_HEAD
_LINGER_S = 1.0

_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,62}")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_REQUEST_LINE = re.compile(r"([A-Z]{1,16}) (/[!-~]*) HTTP/1\.([01])")
_STATUS_LINE = re.compile(r"HTTP/1\.[01] ([1-5][0-9]{2})(?: [\t !-~\x80-\xff]*)?")
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_INVITE_COMMENT = re.compile(r"^#[ \t]*meshnode-([a-z][a-z0-9-]*):[ \t]*(\S(?:.*\S)?)[ \t]*$")
_B64_STD = re.compile(r"[A-Za-z0-9+/]+")
_B64_URL = re.compile(r"[A-Za-z0-9_-]+")

_NATS_SCHEMES = frozenset({"nats", "tls", "ws", "wss"})
_HTTP_SCHEMES = frozenset({"http", "https"})

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}


# --- errors -------------------------------------------------------------------


class ControlPlaneError(Exception):
    """Base of every control-plane failure."""


class CredentialRequestError(ControlPlaneError):
    """A request the control plane answers with a non-2xx status and ``{error, code?}``.

    Raised by :func:`verify_node_credential_request` (400 malformed, 401 bad or
    stale signature) and by the server's enrolment checks (403 with a
    :data:`REVOCATION_CODES` code).
    """

    def __init__(
        self, status: int, error: str, code: str | None = None, *, retry_after_ms: int | None = None
    ) -> None:
        super().__init__(f"{status} {code}: {error}" if code else f"{status}: {error}")
        self.status = status
        self.error = error
        self.code = code
        self.retry_after_ms = retry_after_ms

    def body(self) -> dict[str, Any]:
        """The JSON body of the refusal."""
        out: dict[str, Any] = {"error": self.error}
        if self.code is not None:
            out["code"] = self.code
        if self.retry_after_ms is not None:
            out["retry_after_ms"] = self.retry_after_ms
        return out


class CredentialRefused(ControlPlaneError):
    """The control plane answered a credential request with a non-2xx status.

    ``revoked`` means the roster will not be renewed as it stands (the node was
    retired or is unknown, or an agent was retired or paused): retrying the
    same request is pointless. ``retryable`` means a later attempt may succeed
    (rate limit, server trouble); wait ``retry_after_ms`` when given.
    """

    def __init__(
        self, status: int, error: str, code: str | None = None, *, retry_after_ms: int | None = None
    ) -> None:
        super().__init__(f"control plane refused the credential ({status}"
                         f"{', ' + code if code else ''}): {error}")
        self.status = status
        self.error = error
        self.code = code
        self.retry_after_ms = retry_after_ms

    @property
    def revoked(self) -> bool:
        return self.code in REVOCATION_CODES

    @property
    def retryable(self) -> bool:
        return self.status in (408, 425, 429) or self.status >= 500


class ControlPlaneUnreachable(ControlPlaneError):
    """No usable answer: connection refused or reset, timeout, TLS failure."""


class ControlPlaneBadResponse(ControlPlaneUnreachable):
    """The control plane answered, but not with a well-formed HTTP/JSON response."""


class ControlPlaneStateError(ControlPlaneError):
    """The enrolment state file is unreadable or malformed.

    Never papered over with an empty state: that would silently un-retire
    every retired node.
    """


class InviteError(ValueError):
    """An invite or credentials file that cannot be used."""


# --- request signing (pure) -------------------------------------------------------


def node_signing_input(ts: int, node_id: str, agent_ids: Iterable[str]) -> bytes:
    """The bytes the node key signs: ``mesh-node-cred-v1:{ts}:{node_id}:{sorted ids}``."""
    return f"{NODE_SIG_TAG}:{ts}:{node_id}:{','.join(sorted(agent_ids))}".encode("ascii")


def agent_signing_input(ts: int, node_id: str, agent_id: str) -> bytes:
    """The bytes an agent key signs: ``mesh-node-agent-v1:{ts}:{node_id}:{agent_id}``."""
    return f"{AGENT_SIG_TAG}:{ts}:{node_id}:{agent_id}".encode("ascii")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def node_credential_request(
    node_key: KeyPair, agent_keys: Iterable[KeyPair], ts: int
) -> dict[str, Any]:
    """The signed body of ``POST /v1/node-credential`` for ``node_key`` hosting ``agent_keys``.

    ``ts`` is unix seconds. Signatures are standard (padded) base64. Raises
    ValueError for a non-user key, a repeated agent or an oversized roster.
    """
    agents = list(agent_keys)
    if node_key.role != Prefix.USER or any(a.role != Prefix.USER for a in agents):
        raise ValueError("node and agent keys are user nkeys")
    if not _is_int(ts) or ts <= 0:
        raise ValueError("ts must be positive unix seconds")
    ids = [a.public_key for a in agents]
    if len(set(ids)) != len(ids):
        raise ValueError("an agent appears twice in the roster")
    if len(ids) > MAX_ROSTER:
        raise ValueError(f"a roster holds at most {MAX_ROSTER} agents")
    node_id = node_key.public_key
    return {
        "node_id": node_id,
        "ts": ts,
        "node_sig": base64.b64encode(node_key.sign(node_signing_input(ts, node_id, ids))).decode(),
        "agents": [
            {
                "id": agent.public_key,
                "sig": base64.b64encode(
                    agent.sign(agent_signing_input(ts, node_id, agent.public_key))
                ).decode(),
            }
            for agent in agents
        ],
    }


def _decode_signature(text: str) -> bytes | None:
    # Standard base64 is what we send; base64url and unpadded forms are
    # accepted on input (the envelope signatures of the other SDKs are
    # base64url): the signature check, not the spelling, is the gate.
    if len(text) > 128 or not text.isascii():
        return None
    core = text[:-2] if text.endswith("==") else text[:-1] if text.endswith("=") else text
    padded = core + "=" * (-len(core) % 4)
    try:
        if _B64_STD.fullmatch(core):
            raw = base64.b64decode(padded, validate=True)
        elif _B64_URL.fullmatch(core):
            raw = base64.urlsafe_b64decode(padded)
        else:
            return None
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == 64 else None


def _malformed(error: str) -> CredentialRequestError:
    return CredentialRequestError(400, error, "malformed_request")


def verify_node_credential_request(
    body: object, now_s: int, max_skew_s: int = _DEFAULT_SKEW_S
) -> tuple[str, list[str]]:
    """Check a credential request and return ``(node_id, agent_ids)`` in request order.

    Raises CredentialRequestError: 400 ``malformed_request`` for a body of the
    wrong shape (unknown field, non-nkey id, repeated agent, roster over
    :data:`MAX_ROSTER`); 401 ``stale_request`` when ``ts`` is more than
    ``max_skew_s`` from ``now_s`` either way; 401 ``bad_signature`` when the
    node signature or any agent's does not verify. A request replayed within
    the skew window earns only a credential that is useless without the node
    key, so no nonce is kept.
    """
    if not isinstance(body, dict):
        raise _malformed("request body must be a JSON object")
    unknown = set(body) - {"node_id", "ts", "node_sig", "agents"}
    if unknown:
        raise _malformed(f"unknown field(s): {', '.join(sorted(unknown))}")
    node_id, ts, node_sig, agents = (body.get(k) for k in ("node_id", "ts", "node_sig", "agents"))
    if not isinstance(node_id, str) or not is_valid_public(node_id, Prefix.USER):
        raise _malformed("node_id must be a user nkey")
    if not isinstance(ts, int) or isinstance(ts, bool) or ts <= 0:
        raise _malformed("ts must be unix seconds (an integer)")
    if not isinstance(node_sig, str):
        raise _malformed("node_sig must be a string")
    if not isinstance(agents, list):
        raise _malformed("agents must be a list")
    if len(agents) > MAX_ROSTER:
        raise _malformed(f"a roster holds at most {MAX_ROSTER} agents")
    roster: list[tuple[str, str]] = []
    for entry in agents:
        if not isinstance(entry, dict) or set(entry) != {"id", "sig"}:
            raise _malformed("each agent is an object {id, sig}")
        agent_id, sig = entry["id"], entry["sig"]
        if not is_valid_public(agent_id, Prefix.USER):
            raise _malformed("agent id must be a user nkey")
        if not isinstance(sig, str):
            raise _malformed("agent sig must be a string")
        roster.append((agent_id, sig))
    ids = [agent_id for agent_id, _ in roster]
    if len(set(ids)) != len(ids):
        raise _malformed("an agent appears twice in the roster")

    if abs(now_s - ts) > max_skew_s:
        raise CredentialRequestError(
            401, f"ts is more than {max_skew_s} s from the control plane's clock", "stale_request"
        )
    raw = _decode_signature(node_sig)
    if raw is None or not verify(node_id, node_signing_input(ts, node_id, ids), raw, Prefix.USER):
        raise CredentialRequestError(401, "node signature does not verify", "bad_signature")
    for agent_id, sig in roster:
        raw = _decode_signature(sig)
        if raw is None or not verify(
            agent_id, agent_signing_input(ts, node_id, agent_id), raw, Prefix.USER
        ):
            raise CredentialRequestError(
                401, f"signature of agent {agent_id} does not verify", "bad_signature"
            )
    return node_id, ids


# --- enrolment state ----------------------------------------------------------------


AgentStatus = Literal["active", "paused", "retired"]


@dataclass(frozen=True, slots=True)
class EnrolledNode:
    """A node the control plane knows. Times are unix seconds."""

    node_id: str
    name: str
    enrolled_at: int
    retired_at: int | None = None
    credential_expires_at: int | None = None
    """Latest expiry of any credential issued to the node (invite included)."""
    last_issued_at: int | None = None
    trust_tier: str = "standard"
    """The operator-attested tier (§9.7) carried in every credential issued to the node."""
    tenant: str = DEFAULT_TENANT
    """The tenant (NATS account, §15) whose account signs the node's credentials."""

    @property
    def retired(self) -> bool:
        return self.retired_at is not None


@dataclass(slots=True)
class _AgentRecord:
    status: AgentStatus = "active"
    changed_at: int | None = None
    credential_expires_at: int | None = None


@dataclass(slots=True)
class _State:
    nodes: dict[str, EnrolledNode] = field(default_factory=dict)
    agents: dict[str, _AgentRecord] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": _STATE_VERSION,
                "nodes": {
                    node_id: {
                        "name": n.name,
                        "enrolled_at": n.enrolled_at,
                        "retired_at": n.retired_at,
                        "credential_expires_at": n.credential_expires_at,
                        "last_issued_at": n.last_issued_at,
                        "trust_tier": n.trust_tier,
                        "tenant": n.tenant,
                    }
                    for node_id, n in self.nodes.items()
                },
                "agents": {
                    agent_id: {
                        "status": a.status,
                        "changed_at": a.changed_at,
                        "credential_expires_at": a.credential_expires_at,
                    }
                    for agent_id, a in self.agents.items()
                },
            },
            indent=2,
            sort_keys=True,
        ) + "\n"

    @classmethod
    def from_json(cls, text: str, where: Path) -> _State:
        def bad(why: str) -> ControlPlaneStateError:
            return ControlPlaneStateError(f"{where}: {why}")

        def opt_int(record: Mapping[str, Any], key: str) -> int | None:
            value = record.get(key)
            if value is None:
                return None
            if not isinstance(value, int) or isinstance(value, bool):
                raise bad(f"{key} must be an integer or null")
            return value

        try:
            data = json.loads(text)
        except ValueError as exc:
            raise bad(f"not JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("version") != _STATE_VERSION:
            raise bad(f"not a version {_STATE_VERSION} enrolment state")
        nodes, agents = data.get("nodes", {}), data.get("agents", {})
        if not isinstance(nodes, dict) or not isinstance(agents, dict):
            raise bad("nodes and agents must be objects")
        state = cls()
        for node_id, record in nodes.items():
            if not is_valid_public(node_id, Prefix.USER) or not isinstance(record, dict):
                raise bad(f"bad node entry {node_id!r}")
            name, enrolled_at = record.get("name"), opt_int(record, "enrolled_at")
            if not isinstance(name, str) or enrolled_at is None:
                raise bad(f"node {node_id} lacks a name or enrolled_at")
            # Absent in state written before tiers existed: those nodes were standard.
            tier = record.get("trust_tier", "standard")
            if tier not in TRUST_TIERS:
                raise bad(f"node {node_id} has unknown trust_tier {tier!r}")
            # Absent in state written before tenants existed: the mesh's own account.
            tenant = record.get("tenant", DEFAULT_TENANT)
            try:
                check_tenant_name(tenant)
            except ValueError as exc:
                raise bad(f"node {node_id}: {exc}") from None
            state.nodes[node_id] = EnrolledNode(
                node_id,
                name,
                enrolled_at,
                opt_int(record, "retired_at"),
                opt_int(record, "credential_expires_at"),
                opt_int(record, "last_issued_at"),
                tier,
                tenant,
            )
        for agent_id, record in agents.items():
            if not is_valid_public(agent_id, Prefix.USER) or not isinstance(record, dict):
                raise bad(f"bad agent entry {agent_id!r}")
            status = record.get("status")
            if status not in ("active", "paused", "retired"):
                raise bad(f"agent {agent_id} has unknown status {status!r}")
            state.agents[agent_id] = _AgentRecord(
                status, opt_int(record, "changed_at"), opt_int(record, "credential_expires_at")
            )
        return state


class _EnrolmentStore:
    """``nodes.json``: read on every use, changed under an exclusive advisory lock."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.path = state_dir / _STATE_FILE

    def load(self) -> _State:
        try:
            text = _read_private_file(self.path)
        except FileNotFoundError:
            return _State()
        except (OSError, UnicodeDecodeError) as exc:
            raise ControlPlaneStateError(f"cannot read {self.path}: {exc}") from None
        return _State.from_json(text, self.path)

    @contextlib.contextmanager
    def update(self) -> Iterator[_State]:
        """Yield the current state; write it back if the block exits normally."""
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.state_dir / _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if sys.platform != "win32":
                fcntl.flock(fd, fcntl.LOCK_EX)
            state = self.load()
            yield state
            _write_private_file(self.path, state.to_json(), replace=True)
        finally:
            os.close(fd)  # closing releases the lock


# --- invites -----------------------------------------------------------------------


class InviteBundle(NamedTuple):
    """What :meth:`ControlPlaneServer.invite` hands out: a new node identity and
    its starter credential. ``node_seed`` is the node's secret key."""

    node_name: str
    node_seed: str
    jwt: str

    @property
    def node_id(self) -> str:
        return KeyPair.from_seed(self.node_seed).public_key

    def __repr__(self) -> str:
        return f"InviteBundle(node_name={self.node_name!r}, node_id={self.node_id!r})"


@dataclass(frozen=True, slots=True)
class Invite:
    """A parsed invite (or plain NATS credentials) file.

    ``nats_urls``, ``control_plane_url`` and ``name`` are None when the file
    carries no meshnode comment lines (a plain ``.creds`` file).
    """

    node_seed: str = field(repr=False)
    jwt: str = field(repr=False)
    nats_urls: tuple[str, ...] | None
    control_plane_url: str | None
    name: str | None

    @property
    def node_key(self) -> KeyPair:
        return KeyPair.from_seed(self.node_seed)

    @property
    def node_id(self) -> str:
        return self.node_key.public_key


def _check_url(url: object, schemes: frozenset[str], what: str) -> str:
    if not isinstance(url, str) or not url or _CONTROL_CHARS.search(url) or any(
        c.isspace() for c in url
    ):
        raise ValueError(f"{what} {url!r} is not a URL")
    # Keeps the comment lines of an invite from looking like a creds block to
    # the line-oriented parsers of the NATS clients.
    if "--" in url or "BEGIN" in url.upper() or "," in url:
        raise ValueError(f"{what} {url!r} holds characters an invite cannot carry")
    parts = urlsplit(url)
    if parts.scheme not in schemes or not parts.hostname:
        raise ValueError(f"{what} {url!r} must be {'/'.join(sorted(schemes))}://host[:port]")
    return url


def _check_node_name(name: object) -> str:
    if not isinstance(name, str) or not _NODE_NAME.fullmatch(name) or "--" in name:
        raise ValueError(
            f"node name {name!r} must be 1-63 of A-Z a-z 0-9 . _ @ - (no '--'), "
            "starting with a letter or digit"
        )
    return name


def write_invite(
    path: str | os.PathLike[str],
    bundle: InviteBundle,
    nats_urls: Sequence[str],
    control_plane_url: str | None,
    *,
    overwrite: bool = False,
) -> None:
    """Write ``bundle`` as a NATS credentials file with the mesh's addresses in comments.

    The file is owner-only (0600) from the moment it exists. Without
    ``overwrite`` an existing file is left alone: FileExistsError.
    """
    name = _check_node_name(bundle.node_name)
    urls = [_check_url(u, _NATS_SCHEMES, "NATS URL") for u in nats_urls]
    lines = [
        f"# meshnode invite for node {name}. This is a standard NATS credentials file",
        "# (any NATS client can load it); the meshnode lines say where the mesh is.",
        "# It holds the node's secret key: hand it over privately, keep it 0600.",
        "# meshnode-invite: 1",
        f"# meshnode-node-name: {name}",
        f"# meshnode-node-id: {bundle.node_id}",
        *(f"# meshnode-nats: {url}" for url in urls),
    ]
    if control_plane_url is not None:
        lines.append(
            "# meshnode-control-plane: "
            + _check_url(control_plane_url, _HTTP_SCHEMES, "control-plane URL")
        )
    text = "\n".join(lines) + "\n\n" + format_creds(bundle.jwt, bundle.node_seed)
    _write_private_file(Path(path), text, replace=overwrite)


def parse_invite(text: str) -> Invite:
    """Parse invite text, or a plain NATS ``.creds`` text (then URLs and name are None).

    Raises InviteError when the credential blocks are missing, the seed is not
    a user seed, the JWT is not for that seed's key, or a meshnode line is
    malformed.
    """
    try:
        jwt, seed = parse_creds(text)
        node_key = KeyPair.from_seed(seed)
        _, claims = decode_jwt(jwt)
    except (JwtError, NkeyError) as exc:
        raise InviteError(f"not a usable credentials file: {exc}") from None
    if node_key.role != Prefix.USER:
        raise InviteError("the credentials file does not hold a user seed")
    if claims.get("sub") != node_key.public_key:
        raise InviteError("the credential in the file was not issued to the file's key")

    nats_urls: list[str] = []
    control_plane: str | None = None
    name: str | None = None
    for line in text.splitlines():
        match = _INVITE_COMMENT.match(line)
        if match is None:
            continue
        key, value = match.groups()
        try:
            if key == "nats":
                nats_urls += [
                    _check_url(u, _NATS_SCHEMES, "NATS URL") for u in re.split(r"[\s,]+", value)
                ]
            elif key == "control-plane":
                if control_plane is not None:
                    raise ValueError("two control-plane lines")
                control_plane = _check_url(value, _HTTP_SCHEMES, "control-plane URL")
            elif key == "node-name":
                name = _check_node_name(value)
            elif key == "node-id" and value != node_key.public_key:
                raise ValueError("node-id line does not match the seed")
            # Other keys are ignored: later versions may add lines.
        except ValueError as exc:
            raise InviteError(f"invalid meshnode-{key} line: {exc}") from None
    return Invite(
        node_seed=seed,
        jwt=jwt,
        nats_urls=tuple(nats_urls) if nats_urls else None,
        control_plane_url=control_plane,
        name=name,
    )


def read_invite(path: str | os.PathLike[str]) -> Invite:
    """Read an invite or plain credentials file; see :func:`parse_invite`."""
    with open(path, "rb") as handle:
        mode = stat.S_IMODE(os.fstat(handle.fileno()).st_mode)
        raw = handle.read(_MAX_INVITE_BYTES + 1)
    if len(raw) > _MAX_INVITE_BYTES:
        raise InviteError(f"{path} is larger than any credentials file")
    if mode & 0o077:
        log.warning(
            "%s is readable by other users (mode %o): treat the node key in it as exposed",
            path, mode,
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InviteError(f"{path} is not text") from None
    return parse_invite(text)


# --- HTTP/1.1 (server side) ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


def _parse_head_lines(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    """Split a head (without its final blank line) into its first line and headers."""
    text = head.decode("latin-1")
    lines = text.split("\r\n")
    if any("\r" in line or "\n" in line or "\x00" in line for line in lines):
        raise CredentialRequestError(400, "bare CR or LF in the header section", "malformed_request")
    if len(lines) - 1 > _MAX_HEADERS:
        raise CredentialRequestError(431, "too many header fields", "headers_too_large")
    fields: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN.fullmatch(name):
            # Also refuses obsolete line folding (a line starting with SP/HT).
            raise CredentialRequestError(400, "malformed header field", "malformed_request")
        value = value.strip(" \t")
        if _CONTROL_CHARS.search(value):
            raise CredentialRequestError(400, "control character in a header", "malformed_request")
        fields.append((name.lower(), value))
    return lines[0], fields


async def _read_request(reader: asyncio.StreamReader) -> _Request:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise CredentialRequestError(
            431, f"request line and headers exceed {MAX_REQUEST_HEAD} bytes", "headers_too_large"
        ) from None
    if len(head) > MAX_REQUEST_HEAD:
        raise CredentialRequestError(
            431, f"request line and headers exceed {MAX_REQUEST_HEAD} bytes", "headers_too_large"
        )
    first, fields = _parse_head_lines(head[:-4])
    match = _REQUEST_LINE.fullmatch(first)
    if match is None:
        raise CredentialRequestError(400, "malformed request line", "malformed_request")
    method, target, minor = match.groups()
    headers: dict[str, str] = {}
    for name, value in fields:
        if name in headers:
            if name in ("content-length", "transfer-encoding", "host", "content-type"):
                raise CredentialRequestError(400, f"repeated {name} header", "malformed_request")
            headers[name] += ", " + value
        else:
            headers[name] = value
    if minor == "1" and "host" not in headers:
        raise CredentialRequestError(400, "HTTP/1.1 request without Host", "malformed_request")
    if "transfer-encoding" in headers:
        # Only Content-Length framing: one framing, no request smuggling.
        raise CredentialRequestError(
            501, "Transfer-Encoding is not supported; send Content-Length", "not_implemented"
        )
    length = 0
    if "content-length" in headers:
        text = headers["content-length"]
        if not text.isdigit() or len(text) > 9:
            raise CredentialRequestError(400, "malformed Content-Length", "malformed_request")
        length = int(text)
        if length > MAX_REQUEST_BODY:
            raise CredentialRequestError(
                413, f"request body exceeds {MAX_REQUEST_BODY} bytes", "payload_too_large"
            )
    elif method == "POST":
        raise CredentialRequestError(411, "POST requires Content-Length", "length_required")
    body = await reader.readexactly(length) if length else b""
    return _Request(method, target.split("?", 1)[0], headers, body)


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _json_body(request: _Request) -> object:
    content_type = request.headers.get("content-type")
    if content_type is not None and content_type.split(";")[0].strip().lower() != "application/json":
        raise CredentialRequestError(
            415, "the request body must be application/json", "unsupported_media_type"
        )
    try:
        return json.loads(request.body, object_pairs_hook=_reject_duplicate_keys)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise _malformed("request body is not a JSON object") from None


def _response_bytes(
    status: int, payload: Mapping[str, Any], extra: Mapping[str, str] | None = None
) -> bytes:
    body = json.dumps(payload, separators=(",", ":")).encode("utf-8")
    headers = {
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
        "Cache-Control": "no-store",
        "Connection": "close",
        **(extra or {}),
    }
    head = f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items()
    )
    return head.encode("latin-1") + b"\r\n" + body


def _utc(epoch_s: int) -> str:
    return _dt.datetime.fromtimestamp(epoch_s, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _remaining(expires_at: int | None, now: int) -> str | None:
    if expires_at is None or expires_at <= now:
        return None
    hours = math.ceil((expires_at - now) / 3600)
    return f"until {_utc(expires_at)} (up to {hours} h)"


def _participant(node_id: str) -> Role:
    return "participant"


# --- the server ----------------------------------------------------------------------


class CredentialIssuer(Protocol):
    """What the control plane needs from a mesh: where it listens and a way to mint
    node credentials (an :class:`EmbeddedNatsServer` or a
    :class:`~meshnode.transport.cluster.NatsCluster`)."""

    @property
    def urls(self) -> list[str]: ...

    @property
    def keys(self) -> MeshKeys: ...

    @property
    def tenants(self) -> tuple[str, ...]: ...

    def mint_node_credential(
        self,
        node_id: str,
        agent_ids: Iterable[str],
        expires_in_s: int,
        *,
        role: Role = "participant",
        trust_tier: str = "standard",
        now: int | None = None,
        tenant: str | None = None,
    ) -> str: ...


class ControlPlaneServer:
    """The control plane of an embedded mesh: enrols nodes, renews and refuses credentials.

    ``role_of(node_id)`` picks the §14.3 role of each credential. The mesh's
    NATS URLs come from the running ``embedded`` broker unless ``nats_urls``
    names the addresses nodes should use (e.g. a public name for a broker bound
    to 0.0.0.0); ``public_url`` likewise overrides the advertised control-plane
    URL. ``ssl`` serves HTTPS. ``clock`` (unix seconds) is for tests.

    The enrolment methods (:meth:`invite`, :meth:`retire_node`, ...) work
    whether or not the HTTP listener runs; they need only the mesh's keys.
    """

    def __init__(
        self,
        embedded: CredentialIssuer,
        state_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        credential_ttl_s: int = 86400,
        mesh_name: str = "meshnode-local",
        role_of: Callable[[str], Role] = _participant,
        invite_ttl_s: int = _DEFAULT_INVITE_TTL_S,
        nats_urls: Sequence[str] | None = None,
        public_url: str | None = None,
        ssl: _ssl.SSLContext | None = None,
        max_skew_s: int = _DEFAULT_SKEW_S,
        rate_limit: int = 30,
        rate_window_ms: int = 60_000,
        max_connections: int = 64,
        request_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if credential_ttl_s <= 0 or invite_ttl_s <= 0:
            raise ValueError("credential lifetimes must be positive (§4.8)")
        self._embedded = embedded
        self._store = _EnrolmentStore(Path(state_dir).absolute())
        self.host = host
        self._port = port
        self.credential_ttl_s = credential_ttl_s
        self.invite_ttl_s = invite_ttl_s
        self.mesh_name = mesh_name
        self._role_of = role_of
        self._nats_urls = (
            None if nats_urls is None
            else [_check_url(u, _NATS_SCHEMES, "NATS URL") for u in nats_urls]
        )
        self._public_url = (
            None if public_url is None
            else _check_url(public_url, _HTTP_SCHEMES, "control-plane URL").rstrip("/")
        )
        self._ssl = ssl
        self.max_skew_s = max_skew_s
        self._limiter = SlidingWindowLimiter(rate_limit, rate_window_ms, max_keys=10_000)
        self._last_sweep_ms = 0
        self._max_connections = max_connections
        self._request_timeout_s = request_timeout_s
        self._clock = clock
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[Any]] = set()

    # -- addresses --

    @property
    def state_path(self) -> Path:
        return self._store.path

    @property
    def port(self) -> int:
        """The listening port (the bound one, once started with ``port=0``)."""
        return self._port

    @property
    def url(self) -> str:
        """The control-plane URL nodes should use."""
        if self._public_url is not None:
            return self._public_url
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self._ssl else 'http'}://{host}:{self._port}"

    def nats_endpoints(self) -> list[str]:
        """The mesh's NATS URLs, in preference order. Raises EmbeddedMeshError before
        the broker has started (unless ``nats_urls`` was given)."""
        return list(self._nats_urls) if self._nats_urls is not None else self._embedded.urls

    def mesh_info(self) -> dict[str, Any]:
        """The body of ``GET /v1/mesh``."""
        return {
            "name": self.mesh_name,
            "protocol": PROTOCOL_VERSION,
            "nats_endpoints": self.nats_endpoints(),
            "control_plane": self.url,
        }

    # -- enrolment --

    def list_nodes(self) -> list[EnrolledNode]:
        """Every node ever enrolled, retired ones included, oldest first."""
        return sorted(self._store.load().nodes.values(), key=lambda n: (n.enrolled_at, n.name))

    def _check_tenant(self, tenant: str) -> str:
        check_tenant_name(tenant)
        if tenant != DEFAULT_TENANT and tenant not in self._embedded.tenants:
            known = ", ".join([DEFAULT_TENANT, *self._embedded.tenants])
            raise ValueError(f"no tenant named {tenant!r} is configured (known: {known})")
        return tenant

    def enrol_node(
        self,
        node_id: str,
        name: str,
        trust_tier: str = "standard",
        tenant: str = DEFAULT_TENANT,
    ) -> EnrolledNode:
        """Enrol an existing node key (one the node generated itself) under ``name``.

        ``trust_tier`` is the operator's attestation of the host (§9.7):
        ``sandbox`` makes the registry clamp every agent the node registers
        (never listed, no redelivery buffer). ``tenant`` is the account the
        node joins (§15): its agents are found and reached only within it,
        unless an export says otherwise. Raises ValueError for a malformed
        id, name or tier, an unknown tenant, a name already in use by an
        active node, or a retired node id (retirement is permanent).
        """
        if not is_valid_public(node_id, Prefix.USER):
            raise ValueError("node_id must be a user nkey")
        if trust_tier not in TRUST_TIERS:
            raise ValueError(f"trust_tier must be one of {', '.join(sorted(TRUST_TIERS))}")
        self._check_tenant(tenant)
        _check_node_name(name)
        now = int(self._clock())
        with self._store.update() as state:
            existing = state.nodes.get(node_id)
            if existing is not None:
                if existing.retired:
                    raise ValueError(f"node {node_id} was retired; enrol a new key")
                if existing.name != name:
                    raise ValueError(f"node {node_id} is already enrolled as {existing.name}")
                if existing.tenant != tenant:
                    raise ValueError(
                        f"node {node_id} is enrolled in tenant {existing.tenant}; "
                        "a node changes tenant only under a new key"
                    )
                return existing
            if any(n.name == name and not n.retired for n in state.nodes.values()):
                raise ValueError(f"an active node is already named {name}")
            record = EnrolledNode(node_id, name, now, trust_tier=trust_tier, tenant=tenant)
            state.nodes[node_id] = record
        log.info("control plane: enrolled node %s as %s (tenant %s)", node_id, name, tenant)
        return record

    def trust_attestation(
        self, node_id: str, trust_tier: str, role: Role, issued_at: int, expires_at: int
    ) -> dict[str, Any]:
        """The operator-signed portable attestation (§9.7) of ``node_id``'s tier and role.

        Signed by the operator key (the mesh's root, §4.1), so a verifier in
        any tenant, or on another mesh, needs only the operator's public key.
        """
        return make_trust_attestation(
            self._embedded.keys.operator,
            node_id,
            {"trust_tier": trust_tier, "role": role},
            issued_at * 1000,
            expires_at * 1000,
        )

    def trust_tier_of(self, node_id: str) -> str | None:
        """The attested tier of an enrolled node, or None for a node never enrolled."""
        node = self._store.load().nodes.get(node_id)
        return None if node is None else node.trust_tier

    def is_sandbox_node(self, node_id: str) -> bool:
        """Whether the operator attested ``node_id`` as a sandbox host (§9.7, §8.6)."""
        return self.trust_tier_of(node_id) == "sandbox"

    def invite(
        self, name: str, trust_tier: str = "standard", tenant: str = DEFAULT_TENANT
    ) -> InviteBundle:
        """Create a node identity, enrol it as ``name`` and mint its starter credential.

        The starter credential carries participant permissions for the node
        alone (an empty roster) and lives ``invite_ttl_s``; the node renews for
        its real roster as soon as it joins. The returned seed is the node's
        secret key: write it with :func:`write_invite`, never log it.
        """
        key = KeyPair.generate(Prefix.USER)
        self.enrol_node(key.public_key, name, trust_tier, tenant)
        now = int(self._clock())
        jwt = self._embedded.mint_node_credential(
            key.public_key, [], self.invite_ttl_s, role="participant",
            trust_tier=trust_tier, now=now, tenant=tenant,
        )
        with self._store.update() as state:
            self._record_issue(state, key.public_key, [], now, now + self.invite_ttl_s)
        log.info(
            "control plane: invited node %s as %s (starter credential expires %s)",
            key.public_key, name, _utc(now + self.invite_ttl_s),
        )
        return InviteBundle(name, key.seed, jwt)

    def retire_node(self, node_id: str) -> str:
        """Refuse every further renewal for ``node_id``; idempotent.

        Returns a plain sentence stating how long the node's last credential
        stays usable, because refusal is all this mesh can do (§4.8): the
        broker keeps honouring an issued credential until it expires. Raises
        LookupError for a node that was never enrolled.
        """
        now = int(self._clock())
        with self._store.update() as state:
            node = state.nodes.get(node_id)
            if node is None:
                raise LookupError(f"node {node_id} is not enrolled")
            if node.retired_at is None:
                node = dataclasses.replace(node, retired_at=now)
                state.nodes[node_id] = node
        window = _remaining(node.credential_expires_at, now)
        log.warning("control plane: retired node %s (%s)", node_id, node.name)
        if window is None:
            return (
                f"node {node.name} ({node_id}) retired: no credential issued to it is still "
                "valid; renewal is now refused"
            )
        return (
            f"node {node.name} ({node_id}) retired: its credential stays usable {window}; "
            "renewal is now refused"
        )

    def retire_agent(self, agent_id: str) -> str:
        """Refuse every further credential whose roster holds ``agent_id``; permanent.

        Returns a sentence stating how long credentials already covering the
        agent stay usable (§4.8: a retirement is not reported as though the
        credential were dead).
        """
        return self._set_agent_status(agent_id, "retired")

    def agent_retired(self, agent_id: str) -> bool:
        """Whether ``agent_id`` was retired (the registry answers its key as revoked)."""
        record = self._store.load().agents.get(agent_id)
        return record is not None and record.status == "retired"

    def pause_agent(self, agent_id: str) -> str:
        """Refuse credentials covering ``agent_id`` until :meth:`resume_agent`."""
        return self._set_agent_status(agent_id, "paused")

    def resume_agent(self, agent_id: str) -> None:
        """Undo :meth:`pause_agent`. A retired agent stays retired: ValueError."""
        if not is_valid_public(agent_id, Prefix.USER):
            raise ValueError("agent id must be a user nkey")
        with self._store.update() as state:
            record = state.agents.get(agent_id)
            if record is None or record.status == "active":
                return
            if record.status == "retired":
                raise ValueError(f"agent {agent_id} was retired; retirement is permanent")
            record.status, record.changed_at = "active", int(self._clock())
        log.info("control plane: resumed agent %s", agent_id)

    def _set_agent_status(self, agent_id: str, status: AgentStatus) -> str:
        if not is_valid_public(agent_id, Prefix.USER):
            raise ValueError("agent id must be a user nkey")
        now = int(self._clock())
        with self._store.update() as state:
            record = state.agents.setdefault(agent_id, _AgentRecord())
            if record.status != "retired" and record.status != status:
                record.status, record.changed_at = status, now
            expires_at = record.credential_expires_at
            effective = record.status
        verb = "retired" if effective == "retired" else "paused"
        log.warning("control plane: %s agent %s", verb, agent_id)
        window = _remaining(expires_at, now)
        if window is None:
            return (
                f"agent {agent_id} {verb}: no credential covering it is still valid; "
                "renewal of any credential covering it is now refused"
            )
        return (
            f"agent {agent_id} {verb}: credentials covering it stay usable {window}; "
            "renewal of any credential covering it is now refused"
        )

    @staticmethod
    def _record_issue(
        state: _State, node_id: str, agent_ids: Sequence[str], now: int, expires_at: int
    ) -> None:
        node = state.nodes[node_id]
        state.nodes[node_id] = dataclasses.replace(
            node,
            credential_expires_at=max(node.credential_expires_at or 0, expires_at),
            last_issued_at=now,
        )
        for agent_id in agent_ids:
            record = state.agents.setdefault(agent_id, _AgentRecord())
            record.credential_expires_at = max(record.credential_expires_at or 0, expires_at)

    # -- issuing --

    def issue_credential(self, body: object, *, peer: str = "-") -> dict[str, Any]:
        """Verify a ``POST /v1/node-credential`` body and mint the credential.

        Returns the 200 body; raises CredentialRequestError for every refusal
        (and ControlPlaneStateError when the state cannot be read: fail closed).
        """
        now = int(self._clock())
        try:
            node_id, agent_ids = verify_node_credential_request(body, now, self.max_skew_s)
        except CredentialRequestError as exc:
            log.warning("control plane: refused a credential request from %s: %s", peer, exc.error)
            raise
        try:
            endpoints = self.nats_endpoints()
        except EmbeddedMeshError:
            raise CredentialRequestError(
                503, "the mesh has not started yet", "mesh_unavailable", retry_after_ms=1000
            ) from None
        with self._store.update() as state:
            refusal = self._refusal(state, node_id, agent_ids)
            if refusal is not None:
                log.warning(
                    "control plane: refused a credential to node %s (%d agents) from %s: %s (%s)",
                    node_id, len(agent_ids), peer, refusal.error, refusal.code,
                )
                raise refusal
            role = self._role_of(node_id)
            node = state.nodes[node_id]
            try:
                jwt = self._embedded.mint_node_credential(
                    node_id, agent_ids, self.credential_ttl_s, role=role,
                    trust_tier=node.trust_tier, now=now, tenant=node.tenant,
                )
            except ValueError:
                # The node's tenant was removed from the configuration: its
                # account is no longer served, so no credential can be useful.
                raise CredentialRequestError(
                    403, f"tenant {node.tenant} is not served by this mesh", "tenant_unknown"
                ) from None
            expires_at = now + self.credential_ttl_s
            self._record_issue(state, node_id, agent_ids, now, expires_at)
        log.info(
            "control plane: issued a %s credential to node %s (%s) for %d agent(s), "
            "expires %s, requested from %s",
            role, node_id, state.nodes[node_id].name, len(agent_ids), _utc(expires_at), peer,
        )
        return {
            "jwt": jwt,
            "node_id": node_id,
            "agents": agent_ids,
            "expires_at": expires_at,
            # The same claims as the JWT's tags, as a portable §9.7 object any
            # party can verify against the operator key alone; it lives exactly
            # as long as the credential and is re-issued with it.
            "trust_attestation": self.trust_attestation(
                node_id, node.trust_tier, role, now, expires_at
            ),
            "mesh": {
                "name": self.mesh_name,
                "protocol": PROTOCOL_VERSION,
                "nats_endpoints": endpoints,
                "endpoints": endpoints,
            },
        }

    @staticmethod
    def _refusal(
        state: _State, node_id: str, agent_ids: Sequence[str]
    ) -> CredentialRequestError | None:
        node = state.nodes.get(node_id)
        if node is None:
            return CredentialRequestError(403, "node is not enrolled in this mesh", "node_unknown")
        if node.retired:
            return CredentialRequestError(403, "node was retired", "node_retired")
        for agent_id in agent_ids:
            record = state.agents.get(agent_id)
            if record is None or record.status == "active":
                continue
            if record.status == "retired":
                return CredentialRequestError(
                    403, f"agent {agent_id} was retired", "agent_terminated"
                )
            return CredentialRequestError(403, f"agent {agent_id} is paused", "agent_paused")
        return None

    # -- lifecycle --

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start listening. Raises OSError when the port is taken."""
        if self._server is not None:
            raise RuntimeError("the control plane is already running")
        self._store.load()  # fail at start, not at the first renewal, on a broken state file
        self._server = await asyncio.start_server(
            self._handle, self.host, self._port, limit=MAX_REQUEST_HEAD, ssl=self._ssl
        )
        self._port = self._server.sockets[0].getsockname()[1]
        if self._ssl is None and not _is_loopback(self.host):
            log.warning(
                "control plane serves plain HTTP on %s: rosters travel in clear text "
                "(credentials still need the node key to be used); prefer TLS", self.host,
            )
        log.info("control plane listening on %s", self.url)

    async def stop(self) -> None:
        """Stop listening and drop connections in progress. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.wait(list(self._handlers))
        await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if len(self._handlers) >= self._max_connections or task is None:
            writer.close()
            return
        self._handlers.add(task)
        try:
            await self._serve_one(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except Exception:
            log.exception("control plane: unexpected error while serving a request")
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else "unknown"
        now_ms = int(time.monotonic() * 1000)
        if now_ms - self._last_sweep_ms > self._limiter.window_ms:
            self._limiter.sweep(now_ms)
            self._last_sweep_ms = now_ms
        decision = self._limiter.check(peer, now_ms)

        status: int
        payload: Mapping[str, Any]
        extra: dict[str, str] = {}
        request: _Request | None = None
        try:
            async with asyncio.timeout(self._request_timeout_s):
                request = await _read_request(reader)
        except TimeoutError:
            status, payload = 408, {"error": "request not received in time", "code": "timeout"}
        except CredentialRequestError as exc:
            status, payload = exc.status, exc.body()
        if not decision.allowed:
            status = 429
            payload = {
                "error": "too many requests from this address",
                "code": "rate_limited",
                "retry_after_ms": decision.retry_after_ms,
            }
            extra["Retry-After"] = str(math.ceil(decision.retry_after_ms / 1000))
            log.warning("control plane: rate-limited %s", peer)
        elif request is not None:
            status, payload, extra = self._dispatch(request, peer)
        writer.write(_response_bytes(status, payload, extra))
        async with asyncio.timeout(self._request_timeout_s):
            await writer.drain()
        if request is None:
            await _linger(reader, writer)

    def _dispatch(
        self, request: _Request, peer: str
    ) -> tuple[int, Mapping[str, Any], dict[str, str]]:
        routes = {"/v1/node-credential": "POST", "/v1/mesh": "GET"}
        allowed = routes.get(request.path)
        if allowed is None:
            return 404, {"error": f"no such endpoint {request.path}", "code": "not_found"}, {}
        if request.method != allowed:
            return (
                405,
                {"error": f"{request.path} accepts {allowed} only", "code": "method_not_allowed"},
                {"Allow": allowed},
            )
        try:
            if allowed == "GET":
                try:
                    return 200, self.mesh_info(), {}
                except EmbeddedMeshError:
                    raise CredentialRequestError(
                        503, "the mesh has not started yet", "mesh_unavailable"
                    ) from None
            return 200, self.issue_credential(_json_body(request), peer=peer), {}
        except CredentialRequestError as exc:
            extra = {}
            if exc.retry_after_ms is not None:
                extra["Retry-After"] = str(math.ceil(exc.retry_after_ms / 1000))
            return exc.status, exc.body(), extra
        except ControlPlaneStateError as exc:
            log.error("control plane: %s; refusing every credential until it is fixed", exc)
            return 500, {"error": "enrolment state unreadable", "code": "internal_error"}, {}
        except Exception:
            log.exception("control plane: failed to serve %s %s", request.method, request.path)
            return 500, {"error": "internal error", "code": "internal_error"}, {}


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    # After answering a request whose body we did not read, half-close and
    # swallow what the client is still sending: closing with unread data makes
    # the kernel reset the connection, and a reset can destroy the answer
    # before the client reads it.
    if not writer.can_write_eof():
        return
    with contextlib.suppress(Exception):
        writer.write_eof()
        async with asyncio.timeout(_LINGER_S):
            swallowed = 0
            while swallowed < _LINGER_BYTES:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                swallowed += len(chunk)


# --- the client ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CredentialGrant:
    """A renewed node credential and where to use it (§18.10: re-read on every renewal)."""

    jwt: str = field(repr=False)
    expires_at: int
    nats_endpoints: tuple[str, ...]
    mesh_name: str | None
    trust_attestation: dict[str, Any] | None = None
    """The operator's §9.7 attestation of the node, unverified here (the
    registry and other readers verify it); None from a control plane that issues none."""


@dataclass(frozen=True, slots=True)
class MeshInfo:
    """The public description of a mesh (``GET /v1/mesh``)."""

    name: str | None
    protocol: str | None
    nats_endpoints: tuple[str, ...]
    control_plane: str | None


def _endpoint_list(mesh: Mapping[str, Any]) -> tuple[str, ...]:
    endpoints = mesh.get("nats_endpoints", mesh.get("endpoints"))
    if endpoints is None:
        return ()
    if not isinstance(endpoints, list) or not all(isinstance(e, str) for e in endpoints):
        raise ControlPlaneBadResponse("mesh endpoints must be a list of URLs")
    return tuple(endpoints)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head[:-4].decode("latin-1").split("\r\n")
        match = _STATUS_LINE.fullmatch(lines[0])
        if match is None:
            raise ControlPlaneBadResponse("not an HTTP/1.x response")
        status = int(match.group(1))
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon or not _TOKEN.fullmatch(name):
                raise ControlPlaneBadResponse("malformed response header")
            name = name.lower()
            if name == "content-length" and name in headers:
                raise ControlPlaneBadResponse("repeated Content-Length")
            headers[name] = (headers[name] + ", " if name in headers else "") + value.strip()
        if status >= 200 or status == 101:
            break  # interim 1xx answers precede the real one
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return status, headers, await _read_chunked(reader)
    if "content-length" in headers:
        text = headers["content-length"]
        if not text.isdigit() or int(text) > _MAX_RESPONSE_BODY:
            raise ControlPlaneBadResponse("bad or oversized Content-Length")
        return status, headers, await reader.readexactly(int(text))
    body = bytearray()
    while chunk := await reader.read(65536):
        body += chunk
        if len(body) > _MAX_RESPONSE_BODY:
            raise ControlPlaneBadResponse("response body too large")
    return status, headers, bytes(body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size_line = (await reader.readuntil(b"\r\n"))[:-2].split(b";", 1)[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise ControlPlaneBadResponse("malformed chunk size") from None
        if size < 0 or len(body) + size > _MAX_RESPONSE_BODY:
            raise ControlPlaneBadResponse("response body too large")
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass  # trailer fields
            return bytes(body)
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise ControlPlaneBadResponse("malformed chunk")


class ControlPlaneClient:
    """Talks to a control plane over HTTP(S), with no NATS connection (§4.8).

    ``url`` is the control plane's base URL (``http[s]://host[:port][/prefix]``);
    ``/v1/...`` is appended to its path.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10.0,
        ssl_context: _ssl.SSLContext | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in _HTTP_SCHEMES or not parts.hostname:
            raise ValueError(f"control-plane URL {url!r} must be http(s)://host[:port][/path]")
        if parts.username or parts.password or parts.query or parts.fragment:
            raise ValueError("control-plane URL must not carry credentials, query or fragment")
        self.url = url
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._host_header = parts.netloc
        self._prefix = parts.path.rstrip("/")
        self._ssl: _ssl.SSLContext | None = None
        if parts.scheme == "https":
            self._ssl = ssl_context or _ssl.create_default_context()
        self._timeout_s = timeout_s
        self._clock = clock

    async def request_credential(
        self, node_key: KeyPair, agent_keys: Iterable[KeyPair]
    ) -> CredentialGrant:
        """Renew the node credential for ``node_key`` hosting ``agent_keys``.

        Raises CredentialRefused for any non-2xx answer (``revoked`` tells a
        revocation from a passing failure), ControlPlaneUnreachable when no
        usable answer arrives.
        """
        body = node_credential_request(node_key, agent_keys, int(self._clock()))
        status, payload = await self._call("POST", "/v1/node-credential", body)
        jwt = payload.get("jwt")
        if not isinstance(jwt, str):
            raise ControlPlaneBadResponse("credential response without a jwt")
        try:
            _, claims = decode_jwt(jwt)
        except JwtError as exc:
            raise ControlPlaneBadResponse(f"credential response holds a bad jwt: {exc}") from None
        if claims.get("sub") != node_key.public_key:
            raise ControlPlaneBadResponse("the credential was issued to another key")
        # The broker enforces the JWT's own exp; a differing expires_at field
        # would only mislead the renewal schedule.
        expires_at = claims.get("exp", payload.get("expires_at"))
        if not isinstance(expires_at, int) or isinstance(expires_at, bool):
            raise ControlPlaneBadResponse("credential response without an expiry")
        mesh = payload.get("mesh") or {}
        if not isinstance(mesh, dict):
            raise ControlPlaneBadResponse("mesh must be an object")
        name = mesh.get("name")
        attestation = payload.get("trust_attestation")
        return CredentialGrant(
            jwt=jwt,
            expires_at=expires_at,
            nats_endpoints=_endpoint_list(mesh),
            mesh_name=name if isinstance(name, str) else None,
            trust_attestation=attestation if isinstance(attestation, dict) else None,
        )

    async def mesh_info(self) -> MeshInfo:
        """``GET /v1/mesh``. Raises CredentialRefused or ControlPlaneUnreachable."""
        _, payload = await self._call("GET", "/v1/mesh", None)

        def text(key: str) -> str | None:
            value = payload.get(key)
            return value if isinstance(value, str) else None

        return MeshInfo(
            name=text("name"),
            protocol=text("protocol"),
            nats_endpoints=_endpoint_list(payload),
            control_plane=text("control_plane"),
        )

    async def _call(
        self, method: str, path: str, body: Mapping[str, Any] | None
    ) -> tuple[int, dict[str, Any]]:
        data = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        head = [
            f"{method} {self._prefix}{path} HTTP/1.1",
            f"Host: {self._host_header}",
            "Accept: application/json",
            "User-Agent: meshnode",
            "Connection: close",
        ]
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + data

        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(self._timeout_s):
                reader, writer = await asyncio.open_connection(
                    self._host, self._port, ssl=self._ssl, limit=_MAX_RESPONSE_HEAD
                )
                writer.write(request)
                await writer.drain()
                status, headers, raw = await _read_response(reader)
        except TimeoutError:
            raise ControlPlaneUnreachable(f"{self.url}: no answer within {self._timeout_s} s") from None
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise ControlPlaneBadResponse(f"{self.url}: truncated or oversized answer") from exc
        except OSError as exc:  # refused, reset, unreachable, TLS failures
            raise ControlPlaneUnreachable(f"{self.url}: {exc}") from exc
        finally:
            if writer is not None:
                writer.close()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(writer.wait_closed(), 1.0)

        try:
            payload = json.loads(raw) if raw else {}
        except (ValueError, UnicodeDecodeError, RecursionError):
            payload = None
        if 200 <= status < 300:
            if not isinstance(payload, dict):
                raise ControlPlaneBadResponse(f"{self.url}: answer is not a JSON object")
            return status, payload
        raise _refusal_from(status, headers, payload)


def _refusal_from(status: int, headers: Mapping[str, str], payload: object) -> CredentialRefused:
    error: str = _REASONS.get(status, "refused")
    code: str | None = None
    retry_after_ms: int | None = None
    if isinstance(payload, dict):
        raw_error, raw_code = payload.get("error"), payload.get("code")
        if isinstance(raw_error, dict):  # {error: {code, message}}, as some services answer
            raw_code = raw_code or raw_error.get("code")
            raw_error = raw_error.get("message")
        if isinstance(raw_error, str) and raw_error:
            error = raw_error[:500]
        if isinstance(raw_code, str) and raw_code:
            code = raw_code[:64].lower()
        retry = payload.get("retry_after_ms")
        if isinstance(retry, int) and not isinstance(retry, bool) and retry >= 0:
            retry_after_ms = retry
    if retry_after_ms is None and headers.get("retry-after", "").isdigit():
        retry_after_ms = int(headers["retry-after"]) * 1000
    return CredentialRefused(status, error, code, retry_after_ms=retry_after_ms)
