"""The control plane's wire contract: limits, errors and the signed credential request (pure)."""

from __future__ import annotations

import base64
import binascii
import logging
import re
from collections.abc import Iterable
from typing import Any

from meshnode.protocol.nkeys import KeyPair, Prefix, is_valid_public, verify

log = logging.getLogger("meshnode.transport.control_plane")  # the name operators filter on

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
     "tenant_unknown", "invite_expired"}
)
"""Refusal codes that mean "do not retry with this roster": revocation reaching a node."""

DEFAULT_SKEW_S = 300
DEFAULT_INVITE_TTL_S = 3600
"""An invite's starter credential lives an hour: it grants nothing, and the node's first
start exchanges the invite's key for a real credential over HTTP."""
DEFAULT_INVITE_VALID_S = 7 * 86400
"""An invite not used for a first start within a week expires: it holds the node's key."""
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
    body: object, now_s: int, max_skew_s: int = DEFAULT_SKEW_S
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
