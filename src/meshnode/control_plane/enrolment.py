"""Enrolment: enrolling nodes, minting, renewing and refusing credentials (no HTTP)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import secrets
import ssl as _ssl
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from meshnode.protocol.attestations import TRUST_TIERS, make_trust_attestation
from meshnode.protocol.nkeys import KeyPair, Prefix, is_valid_public
from meshnode.transport.errors import EmbeddedMeshError
from meshnode.transport.jwt import format_creds
from meshnode.transport.meshkeys import MeshKeys
from meshnode.transport.permissions import SDK_INBOX_PREFIX, Profile, Role, inbox_prefix_for
from meshnode.transport.serverconf import url_host
from meshnode.transport.tenants import DEFAULT_TENANT, check_tenant_name

from .http import _remaining, _utc
from .invites import InviteBundle, _check_node_name, _check_url
from .state import AgentStatus, EnrolledNode, EnrolmentToken, _AgentRecord, _EnrolmentStore, _State
from .wire import (
    _HTTP_SCHEMES,
    _NATS_SCHEMES,
    DEFAULT_INVITE_TTL_S,
    DEFAULT_INVITE_VALID_S,
    DEFAULT_PORT,
    DEFAULT_SKEW_S,
    PROTOCOL_VERSION,
    CredentialRequestError,
    _malformed,
    verify_node_credential_request,
)

log = logging.getLogger("meshnode.transport.control_plane")  # the name operators filter on

DEFAULT_TOKEN_TTL_S = 7 * 24 * 3600
"""An SDK enrolment token's lifetime unless ``mesh token --ttl`` says otherwise."""
TOKEN_PREFIX = "am_"
_MAX_TOKEN_CHARS = 200

INBOX_PREFIXES = {"node": "_INBOX_{node_id}", "sdk": SDK_INBOX_PREFIX}
"""The reply prefix of each profile, as ``GET /v1/mesh`` and ``mesh info`` show it."""


def token_digest(token: str) -> str:
    """How a token is stored and looked up: its SHA-256, hex (the token itself never is)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def participant(node_id: str) -> Role:
    """The default role of every credential: participant (§14.3)."""
    return "participant"



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
        profile: Profile = "node",
    ) -> str: ...

    def mint_starter_credential(
        self,
        node_id: str,
        expires_in_s: int,
        *,
        trust_tier: str = "standard",
        now: int | None = None,
        tenant: str | None = None,
    ) -> str: ...


class Enrolment:
    """The enrolment state of an embedded mesh: enrols nodes, renews and refuses
    credentials, mints invites. No HTTP: :class:`~.server.ControlPlaneServer`
    serves these methods; they work whether or not it listens.

    ``role_of(node_id)`` picks the §14.3 role of each credential. The mesh's
    NATS URLs come from the running ``embedded`` broker unless ``nats_urls``
    names the addresses nodes should use (e.g. a public name for a broker bound
    to 0.0.0.0); ``public_url`` likewise overrides the advertised control-plane
    URL, and ``advertise_host`` only its host (the bound port kept). ``host``,
    ``port`` and ``ssl`` say where the control plane is reached (the URL invites
    and renewals carry). ``clock`` (unix seconds) is for tests.
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
        role_of: Callable[[str], Role] = participant,
        invite_ttl_s: int = DEFAULT_INVITE_TTL_S,
        invite_valid_s: int | None = DEFAULT_INVITE_VALID_S,
        nats_urls: Sequence[str] | None = None,
        public_url: str | None = None,
        advertise_host: str | None = None,
        ssl: _ssl.SSLContext | None = None,
        max_skew_s: int = DEFAULT_SKEW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if credential_ttl_s <= 0 or invite_ttl_s <= 0:
            raise ValueError("credential lifetimes must be positive (§4.8)")
        self._embedded = embedded
        self._store = _EnrolmentStore(Path(state_dir).absolute())
        self.host = host
        self.advertise_host = advertise_host
        self._port = port
        self.credential_ttl_s = credential_ttl_s
        self.invite_ttl_s = invite_ttl_s
        #: How long an invite can be used for a first start (None: for ever).
        self.invite_valid_s = invite_valid_s if invite_valid_s else None
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
        self._clock = clock

    # -- addresses --

    @property
    def state_path(self) -> Path:
        return self._store.path

    @property
    def port(self) -> int:
        """The listening port (the bound one, read back from the socket, once the
        server started with ``port=0``)."""
        return self._port

    @property
    def url(self) -> str:
        """The control-plane URL nodes should use."""
        if self._public_url is not None:
            return self._public_url
        return f"{'https' if self._ssl else 'http'}://{url_host(self.advertise_host or self.host)}:{self._port}"

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
            # The reply prefix each enrolment profile's credential may subscribe
            # under (nats.connect(inbox_prefix=...)); the credential response
            # carries the one that applies as mesh.inbox_prefix.
            "inbox_prefixes": dict(INBOX_PREFIXES),
        }

    # -- enrolment --

    def list_nodes(self) -> list[EnrolledNode]:
        """Every node ever enrolled, retired ones included, oldest first."""
        return sorted(self._store.current().nodes.values(), key=lambda n: (n.enrolled_at, n.name))

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
                raise ValueError(
                    f"a node is already named {name} (meshnode mesh nodes lists it; "
                    f"meshnode mesh retire --node {name} frees the name)"
                )
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
        """The attested tier of an enrolled node, or None for a node never enrolled.

        A self-vouching SDK agent's key (see :meth:`sdk_agent_of`) has its
        enrolment's tier: a sandbox token's agent stays sandboxed.
        """
        state = self._store.current()
        node = state.nodes.get(node_id) or _sdk_enrolment(state, node_id)[0]
        return None if node is None else node.trust_tier

    def is_sandbox_node(self, node_id: str) -> bool:
        """Whether the operator attested ``node_id`` as a sandbox host (§9.7, §8.6)."""
        return self.trust_tier_of(node_id) == "sandbox"

    def invite(
        self, name: str, trust_tier: str = "standard", tenant: str = DEFAULT_TENANT
    ) -> InviteBundle:
        """Create a node identity, enrol it as ``name`` and mint its starter credential.

        The starter credential grants nothing on the mesh
        (:data:`~meshnode.transport.permissions.STARTER_PERMISSIONS`) and lives
        ``invite_ttl_s`` (one hour by default): it only gives the invite the
        shape of a NATS credentials file. Enrolment needs no NATS — the node's
        first start proves the invite's key over HTTP and receives its roster
        credential — so a retired node's unexpired starter opens a connection
        that can do nothing. The returned seed is the node's secret key: write
        it with :func:`write_invite`, never log it.
        """
        key = KeyPair.generate(Prefix.USER)
        self.enrol_node(key.public_key, name, trust_tier, tenant)
        now = int(self._clock())
        jwt = self._embedded.mint_starter_credential(
            key.public_key, self.invite_ttl_s, trust_tier=trust_tier, now=now, tenant=tenant,
        )
        with self._store.update() as state:
            # Recorded like any credential, so a retirement states its bound too.
            self._record_issue(state, key.public_key, [], now, now + self.invite_ttl_s)
            if self.invite_valid_s is not None:
                # The invite holds the node's key: unused, it would enrol whoever
                # holds the file for ever. The first start must come before this.
                state.nodes[key.public_key] = dataclasses.replace(
                    state.nodes[key.public_key], invite_expires_at=now + self.invite_valid_s
                )
        log.info(
            "control plane: invited node %s as %s (starter credential, no grants, expires %s)",
            key.public_key, name, _utc(now + self.invite_ttl_s),
        )
        return InviteBundle(name, key.seed, jwt)

    def retire_node(self, node_id: str) -> str:
        """Refuse every further renewal for ``node_id`` (its id, or the name it
        was invited under when that names one node); idempotent.

        Returns a plain sentence stating how long the node's last credential
        stays usable, because refusal is all this mesh can do (§4.8): the
        broker keeps honouring an issued credential until it expires. Raises
        LookupError for a node that was never enrolled, or a name several share.
        """
        now = int(self._clock())
        with self._store.update() as state:
            node = state.nodes.get(node_id)
            if node is None:
                named = sorted(key for key, n in state.nodes.items() if n.name == node_id)
                # A name is unique among active nodes; a retired one may share it.
                active = [key for key in named if state.nodes[key].retired_at is None]
                named = active or named
                if len(named) > 1:
                    raise LookupError(f"{len(named)} nodes were invited as {node_id!r} ({', '.join(named)}): "
                                      "name the one to retire by its id")
                if not named:
                    raise LookupError(f"no node with the id or name {node_id!r} is enrolled "
                                      "(meshnode mesh nodes lists them)")
                node_id = named[0]
                node = state.nodes[node_id]
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
        record = self._store.current().agents.get(agent_id)
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
            refusal = self._refusal(state, node_id, agent_ids, now)
            if refusal is not None:
                log.warning(
                    "control plane: refused a credential to node %s (%d agents) from %s: %s (%s)",
                    node_id, len(agent_ids), peer, refusal.error, refusal.code,
                )
                raise refusal
            node = state.nodes[node_id]
            profile: Profile = "sdk" if node.profile == "sdk" else "node"
            # An SDK agent is a participant whatever role_of says of other nodes.
            role: Role = "participant" if profile == "sdk" else self._role_of(node_id)
            if profile == "sdk" and list(agent_ids) != [node.agent_id]:
                raise CredentialRequestError(
                    403,
                    f"node {node_id} is an sdk enrolment for agent {node.agent_id} alone; "
                    "its roster cannot change (enrol another agent with `meshnode mesh token`)",
                    "roster_mismatch",
                )
            try:
                jwt = self._embedded.mint_node_credential(
                    node_id, agent_ids, self.credential_ttl_s, role=role,
                    trust_tier=node.trust_tier, now=now, tenant=node.tenant, profile=profile,
                )
            except ValueError:
                # The node's tenant was removed from the configuration: its
                # account is no longer served, so no credential can be useful.
                raise CredentialRequestError(
                    403, f"tenant {node.tenant} is not served by this mesh", "tenant_unknown"
                ) from None
            expires_at = now + self.credential_ttl_s
            self._record_issue(state, node_id, agent_ids, now, expires_at)
            if state.nodes[node_id].invite_expires_at is not None:
                state.nodes[node_id] = dataclasses.replace(state.nodes[node_id], invite_expires_at=None)  # used
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
                # The reply prefix this credential may subscribe under.
                "inbox_prefix": inbox_prefix_for(profile, node_id),
            },
        }

    # -- SDK enrolment (POST /v1/bootstrap) --

    def create_token(
        self,
        name: str,
        ttl_s: int = DEFAULT_TOKEN_TTL_S,
        trust_tier: str = "standard",
        tenant: str = DEFAULT_TENANT,
    ) -> tuple[str, EnrolmentToken]:
        """Mint a single-use ``am_…`` token that enrols one SDK agent as ``name``.

        Returns ``(token, record)``. Only the token's SHA-256 is stored: the
        token itself is shown once, to the operator, and never logged. Raises
        ValueError for a bad name, tier, tenant or lifetime, or a name already
        used by an active node or a pending token.
        """
        _check_node_name(name)
        if trust_tier not in TRUST_TIERS:
            raise ValueError(f"trust_tier must be one of {', '.join(sorted(TRUST_TIERS))}")
        self._check_tenant(tenant)
        if ttl_s <= 0:
            raise ValueError("a token's lifetime (--ttl) must be positive")
        now = int(self._clock())
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        record = EnrolmentToken(token_digest(token), name, now, now + ttl_s, trust_tier, tenant)
        with self._store.update() as state:
            if any(n.name == name and not n.retired for n in state.nodes.values()):
                raise ValueError(
                    f"a node is already named {name} (meshnode mesh nodes lists it; "
                    f"meshnode mesh retire --node {name} frees the name)"
                )
            if any(t.name == name and t.state(now) == "pending" for t in state.tokens.values()):
                raise ValueError(f"a pending token is already named {name}; revoke it first")
            state.tokens[record.digest] = record
        log.info(
            "control plane: minted an sdk enrolment token %s (tier %s, tenant %s, expires %s)",
            name, trust_tier, tenant, _utc(record.expires_at),
        )
        return token, record

    def list_tokens(self) -> list[EnrolmentToken]:
        """Every token ever minted (pending, used, revoked, expired), oldest first."""
        return sorted(self._store.current().tokens.values(), key=lambda t: (t.created_at, t.name))

    def revoke_token(self, name: str) -> str:
        """Revoke the pending token named ``name``. Raises LookupError when none is pending."""
        now = int(self._clock())
        with self._store.update() as state:
            for digest, token in state.tokens.items():
                if token.name == name and token.state(now) == "pending":
                    state.tokens[digest] = dataclasses.replace(token, revoked_at=now)
                    break
            else:
                raise LookupError(f"no pending enrolment token is named {name}")
        log.warning("control plane: revoked the sdk enrolment token %s", name)
        return f"enrolment token {name} revoked: it can no longer be exchanged"

    def sdk_agent_of(self, node_id: str) -> str | None:
        """The agent ``node_id`` may vouch for untokenized as an ``sdk`` enrolment, else None.

        The registry asks this before it accepts an untokenized registration.
        ``node_id`` is an active sdk enrolment's node key (the credential key,
        which the SDKs can vouch with), or that enrolment's agent key itself:
        the Python SDK's default node key is the agent's own, so its vouch is
        a self-vouch. Either way only the holder of that enrolment's keys can
        sign the vouch.
        """
        return _sdk_enrolment(self._store.current(), node_id)[1]

    def bootstrap(self, body: object, *, peer: str = "-") -> dict[str, Any]:
        """Exchange an enrolment token: the ``POST /v1/bootstrap`` of the AgentMesh SDKs.

        Body ``{token, agent_id}``. Mints a node key for that one agent,
        records the ``sdk`` enrolment and returns ``{jwt, seed, creds, node_id,
        agent_id, label, expires_at (RFC 3339), renew_url, trust_attestation,
        mesh: {name, protocol, endpoints, nats_endpoints, inbox_prefix}}``.
        ``seed`` is the credential's (= the node's) key, which also vouches for
        the agent. Refusals: 400 ``malformed_request``; 403 ``token_invalid``
        (unknown), ``token_used``, ``token_expired``, ``token_revoked``,
        ``agent_terminated``, ``agent_paused``; 503 ``mesh_unavailable``.
        """
        if not isinstance(body, dict):
            raise _malformed("the bootstrap body must be a JSON object {token, agent_id}")
        token, agent_id = body.get("token"), body.get("agent_id")
        if not isinstance(token, str) or not token.startswith(TOKEN_PREFIX) or len(token) > _MAX_TOKEN_CHARS:
            raise _malformed("token must be the am_... string from `meshnode mesh token`")
        if not is_valid_public(agent_id, Prefix.USER):
            raise _malformed("agent_id must be the agent's public key (a user nkey)")
        assert isinstance(agent_id, str)
        now = int(self._clock())
        try:
            endpoints = self.nats_endpoints()
        except EmbeddedMeshError:
            raise CredentialRequestError(
                503, "the mesh has not started yet", "mesh_unavailable", retry_after_ms=1000
            ) from None
        key = KeyPair.generate(Prefix.USER)
        node_id = key.public_key
        digest = token_digest(token)
        with self._store.update() as state:
            record = state.tokens.get(digest)
            refusal = self._token_refusal(record, now)
            if refusal is None:
                refusal = self._refusal_for_agents(state, [agent_id])
            if refusal is not None:
                log.warning(
                    "control plane: refused a bootstrap from %s: %s (%s)", peer, refusal.error, refusal.code
                )
                raise refusal
            assert record is not None
            # The token names the enrolment; a name an active node took since is refused.
            if any(n.name == record.name and not n.retired for n in state.nodes.values()):
                raise CredentialRequestError(
                    403, f"an active node is already named {record.name}", "name_taken"
                )
            state.nodes[node_id] = EnrolledNode(
                node_id, record.name, now, trust_tier=record.trust_tier, tenant=record.tenant,
                profile="sdk", agent_id=agent_id,
            )
            state.tokens[digest] = dataclasses.replace(record, used_at=now, node_id=node_id)
            try:
                jwt = self._embedded.mint_node_credential(
                    node_id, [agent_id], self.credential_ttl_s, role="participant",
                    trust_tier=record.trust_tier, now=now, tenant=record.tenant, profile="sdk",
                )
            except ValueError:
                raise CredentialRequestError(
                    403, f"tenant {record.tenant} is not served by this mesh", "tenant_unknown"
                ) from None
            expires_at = now + self.credential_ttl_s
            self._record_issue(state, node_id, [agent_id], now, expires_at)
        log.info(
            "control plane: enrolled sdk agent %s as %s on node %s (token exchanged from %s), "
            "credential expires %s", agent_id, record.name, node_id, peer, _utc(expires_at),
        )
        return {
            "jwt": jwt,
            "seed": key.seed,
            "creds": format_creds(jwt, key.seed),
            "node_id": node_id,
            "agent_id": agent_id,
            "label": record.name,
            "expires_at": _utc(expires_at),
            "renew_url": f"{self.url}/v1/node-credential",
            "trust_attestation": self.trust_attestation(
                node_id, record.trust_tier, "participant", now, expires_at
            ),
            "mesh": {
                "name": self.mesh_name,
                "protocol": PROTOCOL_VERSION,
                "endpoints": endpoints,
                "nats_endpoints": endpoints,
                "inbox_prefix": SDK_INBOX_PREFIX,
            },
        }

    @staticmethod
    def _token_refusal(record: EnrolmentToken | None, now: int) -> CredentialRequestError | None:
        if record is None:
            return CredentialRequestError(403, "this enrolment token is not known here", "token_invalid")
        state = record.state(now)
        if state == "pending":
            return None
        why = {
            "used": ("this enrolment token was already exchanged (tokens are single-use)", "token_used"),
            "revoked": ("this enrolment token was revoked", "token_revoked"),
            "expired": (f"this enrolment token expired {_utc(record.expires_at)}", "token_expired"),
        }[state]
        return CredentialRequestError(403, *why)

    @staticmethod
    def _refusal_for_agents(state: _State, agent_ids: Sequence[str]) -> CredentialRequestError | None:
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

    @staticmethod
    def _refusal(
        state: _State, node_id: str, agent_ids: Sequence[str], now: int
    ) -> CredentialRequestError | None:
        node = state.nodes.get(node_id)
        if node is None:
            return CredentialRequestError(403, "node is not enrolled in this mesh", "node_unknown")
        if node.retired:
            return CredentialRequestError(403, "node was retired", "node_retired")
        if node.invite_expired(now):
            return CredentialRequestError(
                403,
                f"the invite of node {node.name} expired unused at {_utc(node.invite_expires_at or now)} "
                f"([mesh.embedded] invite_valid_for on the mesh's first node): ask its operator for a new "
                f"one (meshnode mesh invite {node.name})",
                "invite_expired",
            )
        return Enrolment._refusal_for_agents(state, agent_ids)



def _sdk_enrolment(state: _State, key: str) -> tuple[EnrolledNode | None, str | None]:
    """The active sdk enrolment whose node key or agent key is ``key``, and its agent."""
    node = state.nodes.get(key)
    if node is not None:
        if node.retired or node.profile != "sdk":
            return None, None
        return node, node.agent_id
    for node in state.nodes.values():
        if node.profile == "sdk" and not node.retired and node.agent_id == key:
            return node, key
    return None, None
