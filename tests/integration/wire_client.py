"""A minimal AgentMesh client written from the spec alone, for interoperability tests.

It deliberately imports nothing from ``meshnode``: every byte it puts on the
wire and every check it makes on what comes back is derived here from
AGENTMESH-SPEC.md and WIRE-NOTES.md, so a test that passes with it shows the
daemon speaks the protocol, not merely that it agrees with its own library.

Dependencies: nats-py (transport), PyNaCl (Ed25519), ``rfc8785`` (canonical
JSON, §5.3), and the standard library.

What it implements:

* nkeys (WIRE-NOTES "Identities"): user public keys and seeds, base32 with a
  CRC-16/XMODEM checksum, encoded and decoded here;
* the invite file: a NATS creds file plus ``# meshnode-nats:`` /
  ``# meshnode-control-plane:`` comment lines;
* credential renewal over plain HTTP (``POST /v1/node-credential``, §4.8);
* a NATS connection authenticated by the node key (JWT + nonce signature),
  with the node's private reply prefix ``_INBOX_{node_id}``;
* envelopes (§5): UUIDv7 ids, millisecond UTC timestamps, W3C trace ids,
  tagged Ed25519 signatures over RFC 8785 canonical JSON, base64url unpadded;
* the node → agent vouch (§4.4) and a hand-built manifest (§8.1, §8.2);
* registration on the connection-bound subject (§6.2, §4.4 b), manifest
  lookup (``mesh.registry.get.{id}``), requests to a resolved inbox with a
  reply subject used only as a liveness signal (§6.4, §18.7), responds taken
  on the agent's own inbox (§6.5) and verified with this module's own code;
* serving offerings: a request to the client's agent gets an accept and then
  a signed ``completed`` respond at the requester's inbox (§6.4a, §6.5).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import copy
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nacl.exceptions
import nacl.signing
import nats
import rfc8785
from nats.aio.client import Client
from nats.aio.msg import Msg

__all__ = [
    "CredentialRefused",
    "ENVELOPE_TAG",
    "Handler",
    "Inbound",
    "Invite",
    "PROTOCOL_VERSION",
    "SentRequest",
    "ServiceError",
    "UserKey",
    "VOUCH_TAG",
    "WireAgent",
    "WireClient",
    "b64url",
    "b64url_decode",
    "build_envelope",
    "canonical_json",
    "child_trace",
    "crc16_xmodem",
    "credential_request_body",
    "decode_user_public",
    "decode_user_seed",
    "encode_user_public",
    "encode_user_seed",
    "format_ts",
    "make_manifest",
    "make_vouch",
    "new_id",
    "new_trace",
    "now_ms",
    "parse_invite",
    "read_invite",
    "request_credential",
    "sign_object",
    "verify_ed25519",
    "verify_envelope",
    "verify_object",
]

PROTOCOL_VERSION = "0.3.0"
ENVELOPE_TAG = "agentmesh-envelope-v1"
VOUCH_TAG = "agentmesh-vouch-v1"
NODE_CRED_TAG = "mesh-node-cred-v1"
NODE_AGENT_TAG = "mesh-node-agent-v1"

# ---------------------------------------------------------------------------- nkeys

_PREFIX_USER = 20 << 3  # 'U'
_PREFIX_SEED = 18 << 3  # 'S'
_USER_PUBLIC = re.compile(r"U[A-Z2-7]{55}")


def crc16_xmodem(data: bytes) -> int:
    """CRC-16/XMODEM: polynomial 0x1021, initial value 0, no reflection."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
            crc &= 0xFFFF
    return crc


def _b32encode(raw: bytes) -> str:
    return base64.b32encode(raw).decode("ascii").rstrip("=")


def _b32decode(text: str) -> bytes:
    try:
        return base64.b32decode(text + "=" * (-len(text) % 8))
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not base32: {exc}") from None


def _with_checksum(body: bytes) -> bytes:
    return body + crc16_xmodem(body).to_bytes(2, "little")


def _checked_body(raw: bytes) -> bytes:
    if len(raw) < 3:
        raise ValueError("nkey too short")
    body, crc = raw[:-2], int.from_bytes(raw[-2:], "little")
    if crc16_xmodem(body) != crc:
        raise ValueError("nkey checksum mismatch")
    return body


def encode_user_public(raw: bytes) -> str:
    """``U…``: base32 of prefix byte 20<<3, the 32-byte key, CRC-16 little-endian."""
    if len(raw) != 32:
        raise ValueError("an Ed25519 public key is 32 bytes")
    return _b32encode(_with_checksum(bytes([_PREFIX_USER]) + raw))


def decode_user_public(key: str) -> bytes:
    """The 32-byte Ed25519 public key inside a ``U…`` nkey; ValueError when malformed."""
    if not isinstance(key, str) or not _USER_PUBLIC.fullmatch(key):
        raise ValueError(f"not a user public nkey: {key!r}")
    body = _checked_body(_b32decode(key))
    if len(body) != 33 or body[0] != _PREFIX_USER:
        raise ValueError("not a user public nkey")
    return body[1:]


def encode_user_seed(raw: bytes) -> str:
    """``SU…``: two prefix bytes (seed | user role spread over 10 bits), the
    32-byte Ed25519 seed, CRC-16 little-endian."""
    if len(raw) != 32:
        raise ValueError("an Ed25519 seed is 32 bytes")
    prefix = bytes([_PREFIX_SEED | (_PREFIX_USER >> 5), (_PREFIX_USER & 31) << 3])
    return _b32encode(_with_checksum(prefix + raw))


def decode_user_seed(seed: str) -> bytes:
    """The 32-byte Ed25519 seed inside an ``SU…`` seed; ValueError when malformed."""
    if not isinstance(seed, str) or not seed.startswith("SU"):
        raise ValueError("not a user seed")
    body = _checked_body(_b32decode(seed))
    if len(body) != 34:
        raise ValueError("a user seed holds 32 bytes")
    seed_prefix = body[0] & 0xF8
    role = ((body[0] & 0x07) << 5) | ((body[1] & 0xF8) >> 3)
    if seed_prefix != _PREFIX_SEED or role != _PREFIX_USER:
        raise ValueError("not a user seed")
    return body[2:]


@dataclass(frozen=True)
class UserKey:
    """An Ed25519 key pair addressed as a NATS user nkey (an agent or a node)."""

    signing_key: nacl.signing.SigningKey = field(repr=False)

    @classmethod
    def generate(cls) -> UserKey:
        return cls(nacl.signing.SigningKey.generate())

    @classmethod
    def from_seed(cls, seed: str) -> UserKey:
        return cls(nacl.signing.SigningKey(decode_user_seed(seed)))

    @property
    def public_key(self) -> str:
        return encode_user_public(bytes(self.signing_key.verify_key))

    @property
    def seed(self) -> str:
        return encode_user_seed(bytes(self.signing_key))

    def sign(self, data: bytes) -> bytes:
        return bytes(self.signing_key.sign(data).signature)


def verify_ed25519(public_key: str, data: bytes, signature: bytes) -> bool:
    try:
        nacl.signing.VerifyKey(decode_user_public(public_key)).verify(data, signature)
    except (ValueError, nacl.exceptions.BadSignatureError):
        return False
    return True


# -------------------------------------------------------------- canonical signatures


def b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    if not isinstance(text, str) or not re.fullmatch(r"[A-Za-z0-9_-]*", text):
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def canonical_json(value: Any) -> bytes:
    """RFC 8785 (JCS) bytes of a JSON value (§5.3)."""
    return rfc8785.dumps(value)


def _signed_bytes(obj: Mapping[str, Any], tag: str) -> bytes:
    return tag.encode("ascii") + b"\n" + canonical_json({k: v for k, v in obj.items() if k != "sig"})


def sign_object(obj: Mapping[str, Any], tag: str, key: UserKey) -> dict[str, Any]:
    """A copy of ``obj`` with ``sig``: base64url(Ed25519(tag LF canonical(obj − sig)))."""
    out = {k: v for k, v in obj.items() if k != "sig"}
    out["sig"] = b64url(key.sign(_signed_bytes(out, tag)))
    return out


def verify_object(obj: Mapping[str, Any], tag: str, public_key: str) -> bool:
    """True when ``obj['sig']`` is ``public_key``'s tagged signature over ``obj``."""
    sig = obj.get("sig")
    if not isinstance(sig, str):
        return False
    try:
        raw = b64url_decode(sig)
        data = _signed_bytes(obj, tag)
    except (ValueError, rfc8785.CanonicalizationError):
        return False
    return verify_ed25519(public_key, data, raw)


# ------------------------------------------------------------ ids, times and traces

_id_lock = threading.Lock()
_id_state = {"ms": -1, "counter": 0}


def new_id(now_ms: int | None = None) -> str:
    """A UUIDv7: 48-bit millisecond time, version 7, 12-bit counter, variant 10, random."""
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    with _id_lock:
        if ms <= _id_state["ms"]:
            ms = _id_state["ms"]
            _id_state["counter"] += 1
            if _id_state["counter"] > 0xFFF:
                ms += 1
                _id_state["counter"] = 0
        else:
            _id_state["counter"] = int.from_bytes(os.urandom(2), "big") & 0x3FF
        _id_state["ms"] = ms
        counter = _id_state["counter"]
    rand = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | counter << 64 | 0b10 << 62 | rand
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def format_ts(ms: int) -> str:
    """UTC with milliseconds and ``Z``: ``2026-07-27T15:00:00.250Z``."""
    moment = datetime.fromtimestamp(ms / 1000, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def new_trace() -> dict[str, Any]:
    """A root W3C trace context: parent_span_id explicitly null (§5.3 rule b)."""
    return {"trace_id": os.urandom(16).hex(), "span_id": os.urandom(8).hex(), "parent_span_id": None}


def child_trace(parent: Mapping[str, Any] | None) -> dict[str, Any]:
    """Continue ``parent``'s trace with a new span; a root when it is unusable."""
    if not isinstance(parent, Mapping):
        return new_trace()
    trace_id, span_id = parent.get("trace_id"), parent.get("span_id")
    if not (isinstance(trace_id, str) and re.fullmatch(r"[0-9a-f]{32}", trace_id)):
        return new_trace()
    if not (isinstance(span_id, str) and re.fullmatch(r"[0-9a-f]{16}", span_id)):
        return new_trace()
    return {"trace_id": trace_id, "span_id": os.urandom(8).hex(), "parent_span_id": span_id}


# ------------------------------------------------------------------------- envelopes


def build_envelope(
    type: str,
    sender: UserKey,
    *,
    to: str | None = None,
    payload: Any = None,
    in_reply_to: str | None = None,
    trace: Mapping[str, Any] | None = None,
    meta: Mapping[str, Any] | None = None,
    error: Mapping[str, Any] | None = None,
    ts_ms: int | None = None,
    ts: str | None = None,
    v: str = PROTOCOL_VERSION,
    id: str | None = None,
    sign_with: UserKey | None = None,
) -> dict[str, Any]:
    """A signed envelope (§5.1). Unset optional members are absent, never null.

    ``ts`` is sent verbatim when given (any RFC 3339 form), else ``ts_ms``
    (default now) is formatted. ``sign_with`` signs with another key than
    ``from`` (a forgery, for tests).
    """
    stamp = now_ms() if ts_ms is None else ts_ms
    env: dict[str, Any] = {
        "v": v,
        "id": id or new_id(),
        "type": type,
        "ts": ts if ts is not None else format_ts(stamp),
        "from": sender.public_key,
        "trace": dict(trace) if trace is not None else new_trace(),
    }
    if to is not None:
        env["to"] = to
    if in_reply_to is not None:
        env["in_reply_to"] = in_reply_to
    if error is not None:
        env["error"] = dict(error)
    if payload is not None:
        env["payload"] = payload
    if meta is not None:
        env["meta"] = dict(meta)
    return sign_object(env, ENVELOPE_TAG, sign_with or sender)


def verify_envelope(env: object) -> str | None:
    """None when ``env`` is a well-formed envelope whose sig verifies against its
    ``from``; otherwise the reason it is not."""
    if not isinstance(env, dict):
        return "not an object"
    for member in ("v", "id", "type", "ts", "from", "sig"):
        if not isinstance(env.get(member), str):
            return f"missing {member}"
    if not env["v"].startswith("0."):
        return "unsupported major version"
    if not isinstance(env.get("trace"), dict):
        return "missing trace"
    if not verify_object(env, ENVELOPE_TAG, env["from"]):
        return "signature does not verify"
    return None


# -------------------------------------------------------------------- vouch, manifest


def make_vouch(node: UserKey, agent_id: str, issued_ms: int, expires_ms: int) -> dict[str, Any]:
    """The node → agent attestation of §4.4, signed under ``agentmesh-vouch-v1``."""
    body = {
        "node": node.public_key,
        "agent": agent_id,
        "issued_at": format_ts(issued_ms),
        "expires_at": format_ts(expires_ms),
    }
    return sign_object(body, VOUCH_TAG, node)


def make_manifest(
    agent: UserKey,
    node: UserKey,
    *,
    name: str,
    description: str,
    offerings: Sequence[Mapping[str, Any]],
    capabilities: Sequence[str] = (),
    vouch_ttl_ms: int = 3_600_000,
) -> dict[str, Any]:
    """A manifest with the §8.2 REQUIRED members, by hand."""
    issued = now_ms()
    inbox = f"mesh.agent.{agent.public_key}.inbox"
    return {
        "id": agent.public_key,
        "name": name,
        "description": description,
        "version": "1.0.0",
        "protocol_version": PROTOCOL_VERSION,
        "endpoint": inbox,
        "node": {
            "id": node.public_key,
            "attestation": make_vouch(node, agent.public_key, issued, issued + vouch_ttl_ms),
        },
        "capabilities": list(capabilities),
        "offerings": [dict(o) for o in offerings],
    }


# ---------------------------------------------------------------------------- invite


@dataclass(frozen=True)
class Invite:
    """An invite file: a standard NATS creds file plus the mesh's addresses."""

    jwt: str = field(repr=False)
    seed: str = field(repr=False)
    nats_urls: tuple[str, ...]
    control_plane: str | None
    node_name: str | None

    @property
    def node_key(self) -> UserKey:
        return UserKey.from_seed(self.seed)


_CREDS_BLOCK = re.compile(r"-{3,}BEGIN ([A-Z ]+)-{3,}\s*\n\s*(\S+)\s*\n\s*-{3,}END \1-{3,}")
_MESHNODE_LINE = re.compile(r"^#\s*meshnode-([a-z-]+):\s*(.+?)\s*$")


def parse_invite(text: str) -> Invite:
    blocks = dict(_CREDS_BLOCK.findall(text))
    jwt, seed = blocks.get("NATS USER JWT"), blocks.get("USER NKEY SEED")
    if jwt is None or seed is None:
        raise ValueError("an invite holds a user JWT block and a user seed block")
    UserKey.from_seed(seed)  # validates the seed encoding
    urls: list[str] = []
    control_plane: str | None = None
    name: str | None = None
    for line in text.splitlines():
        match = _MESHNODE_LINE.match(line)
        if match is None:
            continue
        key, value = match.groups()
        if key == "nats":
            urls += [u for u in re.split(r"[\s,]+", value) if u]
        elif key == "control-plane":
            control_plane = value
        elif key == "node-name":
            name = value
    return Invite(jwt=jwt, seed=seed, nats_urls=tuple(urls), control_plane=control_plane, node_name=name)


def read_invite(path: str | os.PathLike[str]) -> Invite:
    return parse_invite(Path(path).read_text(encoding="utf-8"))


# ------------------------------------------------------------------- control plane


class CredentialRefused(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"control plane answered {status}: {body!r}")
        self.status = status
        self.body = body


def credential_request_body(node: UserKey, agents: Sequence[UserKey], ts: int) -> dict[str, Any]:
    """``{node_id, ts, node_sig, agents:[{id, sig}]}``; standard base64 signatures."""
    node_id = node.public_key
    ids = sorted(a.public_key for a in agents)
    node_text = f"{NODE_CRED_TAG}:{ts}:{node_id}:{','.join(ids)}"
    return {
        "node_id": node_id,
        "ts": ts,
        "node_sig": base64.b64encode(node.sign(node_text.encode("ascii"))).decode("ascii"),
        "agents": [
            {
                "id": a.public_key,
                "sig": base64.b64encode(
                    a.sign(f"{NODE_AGENT_TAG}:{ts}:{node_id}:{a.public_key}".encode("ascii"))
                ).decode("ascii"),
            }
            for a in agents
        ],
    }


def request_credential(
    control_plane: str, node: UserKey, agents: Sequence[UserKey], timeout: float = 10.0
) -> dict[str, Any]:
    """``POST {control_plane}/v1/node-credential`` (blocking; run it in a thread)."""
    body = json.dumps(credential_request_body(node, agents, int(time.time()))).encode("utf-8")
    request = urllib.request.Request(
        control_plane.rstrip("/") + "/v1/node-credential",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            detail: Any = json.loads(raw)
        except ValueError:
            detail = raw.decode("utf-8", "replace")
        raise CredentialRefused(exc.code, detail) from None
    if not isinstance(answer, dict) or not isinstance(answer.get("jwt"), str):
        raise ValueError(f"credential answer without a jwt: {answer!r}")
    return answer


# ----------------------------------------------------------------------- the client


class ServiceError(Exception):
    """A platform service answered with an error object."""

    def __init__(self, reply: Mapping[str, Any]) -> None:
        error = reply.get("error") or {}
        super().__init__(f"{error.get('code')}: {error.get('message')}")
        self.reply = reply
        self.code = error.get("code")


@dataclass
class Inbound:
    """One message that arrived on a subject this client watches."""

    subject: str
    reply: str | None
    data: bytes
    envelope: dict[str, Any] | None
    problem: str | None  # why it was not accepted as a verified envelope

    @property
    def verified(self) -> bool:
        return self.envelope is not None and self.problem is None


Handler = Callable[[Any, Mapping[str, Any]], Any | Awaitable[Any]]


@dataclass
class WireAgent:
    """An agent this client hosts: its key, its offerings and what its inbox received."""

    key: UserKey
    name: str
    offerings: dict[str, Handler] = field(default_factory=dict)
    inbox: list[Inbound] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.key.public_key

    @property
    def inbox_subject(self) -> str:
        # Our own endpoint, as our manifest declares it.
        return f"mesh.agent.{self.id}.inbox"

    def manifest(self, node: UserKey) -> dict[str, Any]:
        return make_manifest(
            self.key,
            node,
            name=self.name,
            description="an agent of the independent wire client",
            offerings=[{"id": o, "input_modes": ["application/json"], "output_modes": ["application/json"]}
                       for o in self.offerings],
        )

    def responds_to(self, request_id: str) -> list[dict[str, Any]]:
        """Verified responds addressed to this agent and correlated to ``request_id``."""
        return [
            m.envelope
            for m in self.inbox
            if m.verified
            and m.envelope is not None
            and m.envelope.get("type") == "respond"
            and m.envelope.get("in_reply_to") == request_id
        ]


@dataclass
class SentRequest:
    envelope: dict[str, Any]
    subject: str
    reply_subject: str
    reply_traffic: list[Msg]


class WireClient:
    """One node connection, built from an invite, hosting :class:`WireAgent` s."""

    def __init__(self, invite: Invite) -> None:
        self.invite = invite
        self.node_key = invite.node_key
        self.node_id = self.node_key.public_key
        self.jwt = invite.jwt
        self.nats_urls: list[str] = list(invite.nats_urls)
        self.nc: Client | None = None
        self.service_keys: dict[str, str] = {}
        self.errors: list[Exception] = []
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def inbox_prefix(self) -> str:
        # The node's private reply prefix: it may subscribe under it only.
        return f"_INBOX_{self.node_id}"

    # -- joining ---------------------------------------------------------------

    async def join(self, agents: Sequence[WireAgent]) -> dict[str, Any]:
        """Renew the invite's credential for ``agents`` and connect with it."""
        if not self.invite.control_plane:
            raise ValueError("the invite names no control plane")
        grant = await asyncio.to_thread(
            request_credential, self.invite.control_plane, self.node_key, [a.key for a in agents]
        )
        if grant.get("node_id") != self.node_id:
            raise ValueError("credential issued for another node")
        self.jwt = grant["jwt"]
        mesh = grant.get("mesh") or {}
        endpoints = mesh.get("nats_endpoints") or mesh.get("endpoints")
        if endpoints:
            self.nats_urls = list(endpoints)
        await self.connect()
        return grant

    async def connect(self) -> None:
        def user_jwt_cb() -> bytes:
            return self.jwt.encode("ascii")

        def signature_cb(nonce: str) -> bytes:
            return b64url(self.node_key.sign(nonce.encode("ascii"))).encode("ascii")

        async def error_cb(error: Exception) -> None:
            self.errors.append(error)

        self.nc = await nats.connect(
            self.nats_urls,
            user_jwt_cb=user_jwt_cb,
            signature_cb=signature_cb,
            inbox_prefix=self.inbox_prefix,
            error_cb=error_cb,
            allow_reconnect=False,
            connect_timeout=3,
        )

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.close()

    @property
    def conn(self) -> Client:
        if self.nc is None:
            raise RuntimeError("not connected")
        return self.nc

    async def barrier(self) -> None:
        """Return once the broker has read all this client sent.

        ``Client.flush`` alone is not that: its PING skips the client's write
        buffer, so a SUB or PUB still buffered can reach the broker after it.
        The private ``_flush_pending(force_flush=True)`` writes the buffer out.
        """
        await self.conn._flush_pending(force_flush=True)
        await self.conn.flush(timeout=5)

    # -- platform services -------------------------------------------------------

    async def service_request(
        self, subject: str, kind: str, sender: WireAgent, payload: Any, timeout: float = 5.0
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """A signed request to a platform service; returns (request, verified reply).

        The reply must verify, be bound to the request (``in_reply_to``, ``to``)
        and come from the key this service answered with the first time.
        """
        request = build_envelope(kind, sender.key, payload=payload)
        msg = await self.conn.request(subject, json.dumps(request).encode("utf-8"), timeout=timeout)
        reply = json.loads(msg.data)
        problem = verify_envelope(reply)
        if problem is not None:
            raise AssertionError(f"service reply on {subject}: {problem}")
        bound = (reply.get("type"), reply.get("in_reply_to"), reply.get("to"))
        if bound != ("respond", request["id"], sender.id):
            raise AssertionError(f"service reply on {subject} is not bound to the request: {reply!r}")
        service = subject.split(".")[1]
        pinned = self.service_keys.setdefault(service, reply["from"])
        if reply["from"] != pinned:
            raise AssertionError(f"{service} answered with an unpinned key")
        if reply.get("error"):
            raise ServiceError(reply)
        return request, reply

    async def register(self, agent: WireAgent) -> tuple[dict[str, Any], dict[str, Any]]:
        """Register on the connection-bound subject ``mesh.registry.register.{node_id}``."""
        return await self.service_request(
            f"mesh.registry.register.{self.node_id}", "register", agent, agent.manifest(self.node_key)
        )

    async def get_manifest(self, requester: WireAgent, agent_id: str) -> dict[str, Any]:
        _, reply = await self.service_request(
            f"mesh.registry.get.{agent_id}", "discover", requester, {"agent_id": agent_id}
        )
        manifest = reply.get("payload")
        if not isinstance(manifest, dict) or manifest.get("id") != agent_id:
            raise AssertionError(f"registry answered for another agent: {manifest!r}")
        return manifest

    async def resolve_inbox(self, requester: WireAgent, agent_id: str) -> str:
        """The agent's inbox as its manifest carries it (§14.4).

        An agent the registry will not show us (a private one answers NOT_FOUND
        to strangers) is answered at the §6.1 inbox subject, which an SDK is
        the legitimate constructor of.
        """
        try:
            manifest = await self.get_manifest(requester, agent_id)
        except ServiceError as exc:
            if exc.code != "NOT_FOUND":
                raise
            return f"mesh.agent.{agent_id}.inbox"
        endpoints = manifest.get("endpoints") or {}
        inbox = endpoints.get("inbox") or manifest.get("endpoint")
        if not isinstance(inbox, str):
            raise AssertionError(f"manifest of {agent_id} names no inbox")
        return inbox

    # -- agent traffic -------------------------------------------------------------

    async def serve(self, agent: WireAgent) -> None:
        """Subscribe the agent's inbox: record (and verify) everything, answer requests."""

        async def on_message(msg: Msg) -> None:
            arrival = self._judge(agent, msg)
            agent.inbox.append(arrival)
            env = arrival.envelope
            if arrival.verified and env is not None and env.get("type") == "request":
                self._spawn(self._handle_request(agent, env))

        await self.conn.subscribe(agent.inbox_subject, cb=on_message)
        await self.barrier()

    @staticmethod
    def _judge(agent: WireAgent, msg: Msg) -> Inbound:
        try:
            env = json.loads(msg.data)
        except ValueError:
            return Inbound(msg.subject, msg.reply or None, msg.data, None, "not JSON")
        problem = verify_envelope(env)
        if problem is None and "to" in env and env["to"] != agent.id:
            problem = "addressed to another agent"
        envelope = env if isinstance(env, dict) else None
        return Inbound(msg.subject, msg.reply or None, msg.data, envelope, problem)

    def _spawn(self, coro: Awaitable[None]) -> None:
        async def run() -> None:
            try:
                await coro
            except Exception as exc:  # recorded for the test to see
                self.errors.append(exc)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle_request(self, agent: WireAgent, request: dict[str, Any]) -> None:
        raw_payload = request.get("payload")
        payload: dict[str, Any] = raw_payload if isinstance(raw_payload, dict) else {}
        offering = payload.get("offering")
        inbox = await self.resolve_inbox(agent, request["from"])
        handler = agent.offerings.get(offering) if isinstance(offering, str) else None
        if handler is None:
            await self.respond(agent, request, inbox, status="failed", error={
                "code": "OFFERING_NOT_FOUND",
                "message": f"no offering {offering!r}",
                "retryable": False,
            })
            return
        await self.respond(agent, request, inbox, status="accepted")
        output = handler(payload.get("input"), request)
        if asyncio.iscoroutine(output):
            output = await output
        await self.respond(agent, request, inbox, status="completed", output=output)

    async def respond(
        self,
        agent: WireAgent,
        request: Mapping[str, Any],
        inbox: str,
        *,
        status: str,
        output: Any = None,
        error: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A signed respond at the requester's inbox, bound by ``in_reply_to`` (§6.5)."""
        payload: dict[str, Any] = {"status": status}
        if output is not None:
            payload["output"] = output
        env = build_envelope(
            "respond",
            agent.key,
            to=request["from"],
            in_reply_to=request["id"],
            trace=child_trace(request.get("trace")),
            payload=payload,
            error=error,
        )
        await self.conn.publish(inbox, json.dumps(env).encode("utf-8"))
        return env

    async def publish_request(self, envelope: Mapping[str, Any] | bytes, subject: str) -> SentRequest:
        """Publish a request (already built and signed, or raw bytes) to ``subject``
        with a reply subject, and record whatever arrives on that reply subject:
        for agent traffic it is a liveness channel, never a response path (§18.7)."""
        data = envelope if isinstance(envelope, bytes) else json.dumps(envelope).encode("utf-8")
        reply_subject = self.conn.new_inbox()
        traffic: list[Msg] = []

        async def on_reply(msg: Msg) -> None:
            traffic.append(msg)

        await self.conn.subscribe(reply_subject, cb=on_reply)
        await self.conn.publish(subject, data, reply=reply_subject)
        await self.barrier()
        env = json.loads(data)
        return SentRequest(env, subject, reply_subject, traffic)

    def request_envelope(
        self,
        agent: WireAgent,
        target: str,
        offering: str,
        input: Any = None,
        *,
        config: Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> dict[str, Any]:
        """A signed request from ``agent`` to ``target`` (``overrides`` go to
        :func:`build_envelope`: ``to``, ``ts_ms``, ``meta``, ``sign_with`` …)."""
        payload: dict[str, Any] = {"offering": offering}
        if input is not None:
            payload["input"] = input
        if config is not None:
            payload["config"] = dict(config)
        overrides.setdefault("to", target)
        return build_envelope("request", agent.key, payload=payload, **overrides)

    # -- waiting -----------------------------------------------------------------------

    @staticmethod
    async def wait_for(agent: WireAgent, request_id: str, *, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Verified responds to ``request_id`` up to the first substantive one
        (status other than ``accepted``), in arrival order."""
        async with asyncio.timeout(timeout):
            while True:
                responds = agent.responds_to(request_id)
                for index, env in enumerate(responds):
                    status = (env.get("payload") or {}).get("status")
                    if status != "accepted":
                        return copy.deepcopy(responds[: index + 1])
                await asyncio.sleep(0.01)

    @staticmethod
    async def quiet(agent: WireAgent, *, seconds: float = 1.5) -> list[Inbound]:
        """Everything that arrives at the agent's inbox during the next ``seconds``."""
        start = len(agent.inbox)
        await asyncio.sleep(seconds)
        return agent.inbox[start:]
