"""The daemon's link to the mesh: the embedded server and control plane (when it
runs the mesh itself), the node credential, and the connections.

An embedded-mesh node mints its own credential (and one per tenant account
its services serve, §15); a joined node obtains it from the control plane it
enrolled with, renewing before it lapses (§4.8). Either way the credential is
re-issued for the current roster (§14.3) and presented by a reconnect.
"""

from __future__ import annotations

import errno
import logging
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from meshnode.aio import wait_for
from meshnode.config import Config, ConfigError, ConfigProblem, EmbeddedMeshConfig
from meshnode.control_plane import ControlPlaneServer
from meshnode.daemon.credentials import obtain_credential, stored_trust_attestation
from meshnode.daemon.lifecycle import Shutdown
from meshnode.daemon.plugin_check import config_file_label
from meshnode.node.periodic import PeriodicJob
from meshnode.protocol.nkeys import KeyPair
from meshnode.transport.connection import WEBSOCKET_EXTRA, MeshConnection, websocket_unsupported
from meshnode.transport.embedded import EmbeddedNatsServer, TenantExport
from meshnode.transport.errors import PortInUse
from meshnode.transport.grants import Grants, InboxChoice, choose_inbox_prefix
from meshnode.transport.jwt import decode_jwt, renew_at
from meshnode.transport.permissions import Role, node_inbox_prefix
from meshnode.transport.serverconf import TlsFiles, is_loopback_host
from meshnode.transport.tenants import DEFAULT_TENANT
from meshnode.transport.tls import client_context, pinned_context, server_context

__all__ = ["MeshLink", "credential_profile"]

log = logging.getLogger("meshnode.daemon")

#: How long a reconnect that presents a new credential may take.
_RECONNECT_WAIT_S = 30.0


def credential_profile(claims: Mapping[str, Any]) -> dict[str, str]:
    """``{role, trust_tier, tenant}`` from a node credential's ``agentmesh:*`` tags.

    The control plane writes them (§9.7: attested, never self-declared); a
    credential minted without them reads as a standard participant of the
    mesh's own account, which is what such a credential was issued as.
    """
    profile = {"role": "participant", "trust_tier": "standard", "tenant": "mesh"}
    nats = claims.get("nats")
    tags = nats.get("tags") if isinstance(nats, Mapping) else None
    for tag in tags if isinstance(tags, list) else ():
        if not isinstance(tag, str):
            continue
        # nats-server lowercases tags it stores; every value we write is lowercase.
        parts = tag.lower().split(":")
        if len(parts) == 3 and parts[0] == "agentmesh" and parts[1] in profile and parts[2]:
            profile[parts[1]] = parts[2]
    return profile


def server_problems(config: Config) -> list[ConfigProblem]:
    """``[mesh] servers`` this process cannot dial, as configuration problems
    (``meshnode check-config`` and the daemon's start report them)."""
    unsupported = set(websocket_unsupported(config.mesh.servers))
    return [
        ConfigProblem(
            config_file_label(config), f"mesh.servers[{index}]",
            f"{url!r} is a WebSocket URL, and nats-py's WebSocket transport needs aiohttp, "
            f"which is not installed: {WEBSOCKET_EXTRA} (or give the server's nats:// or tls:// URL)",
        )
        for index, url in enumerate(config.mesh.servers)
        if url in unsupported
    ]


def next_renewal_check(jwt: str, now: float) -> float:
    """Seconds until the renewal job next looks at ``jwt``: when it is due (two
    thirds through its life), at most an hour away; 5 s while it is overdue (a
    renewal failed and is tried again); a minute when it cannot be read.

    Why not at least 5 s always, as before: a credential expires a third of
    its life after it is due, and a 6 s one (the tests' shortest) was then
    renewed 1 s before it expired. On a loaded machine the broker closed the
    connection first, and an embedded node re-executed itself, on new ports.
    """
    try:
        due = renew_at(decode_jwt(jwt)[1]) - now
    except Exception:
        return 60.0
    return min(due, 3600.0) if due > 0 else 5.0


class MeshLink:
    """Embedded server, control plane, credentials and connections of one node.

    ``roster`` returns the keys the node credential must cover (the hosted
    agents, not the services): it is read at every (re-)issue.
    """

    def __init__(
        self,
        config: Config,
        data_dir: Path,
        node_key: KeyPair,
        roster: Callable[[], list[KeyPair]],
    ) -> None:
        self.config = config
        self.data_dir = data_dir
        self.node_key = node_key
        self._roster = roster
        self.embedded: EmbeddedNatsServer | None = None
        self.control_plane: ControlPlaneServer | None = None
        self.connection: MeshConnection | None = None
        #: The embedded node's service connections into each tenant's account (§15).
        self.tenant_connections: dict[str, MeshConnection] = {}
        self.jwt = ""
        self._tenant_jwts: dict[str, str] = {}
        #: What the node's own credential grants (§14.3), read at connect: the
        #: reply prefix and registration subjects follow from it.
        self.grants = Grants.unrestricted()
        self.inbox: InboxChoice | None = None

    @property
    def embedded_mode(self) -> bool:
        return not self.config.mesh.servers

    def replicas(self) -> int:
        """JetStream replicas for what the services create: ``[mesh] replicas``, else
        ``min(3, cluster size)`` (§9.4, §18.3: R3 in production); 1 when embedded."""
        if self.embedded_mode:
            return 1
        if self.config.mesh.replicas is not None:
            return self.config.mesh.replicas
        size = self.connection.cluster_size() if self.connection is not None else 1
        return min(3, size)

    def mesh_urls(self) -> list[str]:
        """The mesh's NATS URLs as other nodes are given them (advertised)."""
        if self.embedded is not None:
            return list(self.embedded.urls)
        return list(self.config.mesh.servers)

    def _dial_urls(self) -> list[str]:
        """Where this node's own connections go: its embedded broker's bound
        address (the advertised name need not resolve here), else the servers."""
        if self.embedded is not None:
            return [self.embedded.url]
        return list(self.config.mesh.servers)

    def control_plane_url(self) -> str | None:
        if self.control_plane is not None:
            return str(self.control_plane.url)
        return str(self.config.mesh.control_plane) if self.config.mesh.control_plane else None

    def reach_notes(self) -> list[str]:
        """What limits who can use an invite or an enrolment token this node hands
        out (:func:`reach_notes`); empty on a joined node."""
        if self.embedded is None:
            return []
        return reach_notes(self.config.mesh.embedded, list(self.embedded.urls), self.control_plane_url())

    # -- start -----------------------------------------------------------------

    async def start(self, shutdown: Shutdown) -> None:
        """The ``mesh`` stage: start the embedded server and control plane, or
        obtain the joined node's credential."""
        if not self.embedded_mode:
            problems = server_problems(self.config)
            if problems:
                raise ConfigError(problems, self.config.source_file)
            self.jwt = await self._obtain_joined_jwt()
            profile = credential_profile(decode_jwt(self.jwt)[1])
            log.info(
                "the mesh attests this node as %s, trust tier %s, tenant %s",
                profile["role"], profile["trust_tier"], profile["tenant"],
            )
            if profile["trust_tier"] == "sandbox":
                log.warning(
                    "this node is attested sandbox (§9.7): the registry lists none of its agents "
                    "and keeps no offline buffer for them; requesters may avoid it for sensitive work"
                )
            return
        cfg = self.config.mesh.embedded
        embedded = EmbeddedNatsServer(
            self.data_dir,
            host=cfg.host,
            advertise_host=advertised_host(cfg.host, cfg.advertise_host, "host"),
            port=cfg.port or None,
            max_payload=cfg.max_payload,
            max_store=cfg.jetstream_max_store,
            account_max_store=cfg.account_max_store,
            tenants=cfg.tenants,
            exports=[TenantExport(e.from_, e.to, tuple(e.agents), e.discover) for e in cfg.exports],
            monitor_port=cfg.monitor_port,
            websocket_port=cfg.websocket_port,
            tls=TlsFiles(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert and cfg.tls_key else None,
        )
        self.embedded = embedded
        if embedded.tls is None and not is_loopback_host(cfg.host):
            log.warning(
                "the embedded NATS listener is bound to %s without TLS: set [mesh.embedded] "
                "tls_cert and tls_key before exposing it beyond loopback", cfg.host,
            )
        if not is_loopback_host(cfg.host) and is_loopback_host(cfg.control_host):
            # A node on another machine trades its invite for a credential there
            # first: NATS alone beyond loopback lets it reach nothing.
            log.warning(
                "[mesh.embedded] host = %r, but control_host = %r: nodes on other machines cannot reach the "
                "control plane to get their credentials (nor SDK agents to enrol); set control_host too",
                cfg.host, cfg.control_host,
            )
        shutdown.push("stop-mesh-server", embedded.stop)
        try:
            await embedded.start()
        except PortInUse as exc:
            key = "monitor_port" if exc.listener == "monitoring" else "port"
            raise exc.with_hint(f"set [mesh.embedded] {key} in {self._config_file()}") from None
        self.jwt = self._mint_own_jwt()
        limits = cfg.control_plane
        plane = ControlPlaneServer(
            embedded,
            self.data_dir / "mesh",
            host=cfg.control_host,
            advertise_host=advertised_host(cfg.control_host, cfg.advertise_host, "control_host"),
            port=cfg.control_port,
            credential_ttl_s=int(cfg.credential_ttl.total_seconds()),
            invite_ttl_s=max(1, int(cfg.invite_ttl.total_seconds())),
            invite_valid_s=int(cfg.invite_valid_for.total_seconds()) or None,
            mesh_name=self.config.node.name,
            ssl=server_context(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert and cfg.tls_key else None,
            rate_limit=limits.rate_limit,
            node_rate_limit=limits.node_rate_limit,
            rate_window_ms=max(1, int(limits.rate_window.total_seconds() * 1000)),
            max_connections=limits.max_connections,
            head_timeout_s=limits.head_timeout.total_seconds(),
            request_timeout_s=limits.request_timeout.total_seconds(),
        )
        self.control_plane = plane
        self._warn_of_nodes_without_tenant(plane, cfg.tenants)
        shutdown.push("stop-services", plane.stop)
        try:
            await plane.start()
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise PortInUse(
                cfg.control_port, "control",
                f"set [mesh.embedded] control_port in {self._config_file()}",
            ) from None

    def _warn_of_nodes_without_tenant(self, plane: ControlPlaneServer, tenants: list[str]) -> None:
        """Nodes enrolled in a tenant since removed from [mesh.embedded] tenants
        can neither connect nor renew (tenant_unknown): say so once, at start."""
        served = {DEFAULT_TENANT, *tenants}
        stranded = [n for n in plane.list_nodes() if not n.retired and n.tenant not in served]
        if stranded:
            names = ", ".join(f"{n.name} ({n.tenant})" for n in stranded[:5])
            more = f" and {len(stranded) - 5} more" if len(stranded) > 5 else ""
            log.warning(
                "%d enrolled node(s) belong to tenants no longer in [mesh.embedded] tenants: %s%s. They cannot "
                "connect or renew (tenant_unknown): add the tenant back, or meshnode mesh retire --node NAME",
                len(stranded), names, more,
            )

    def _config_file(self) -> str:
        source = self.config.source_file
        return str(source) if source is not None else "the configuration"

    def nats_tls(self) -> ssl.SSLContext | None:
        """TLS to the broker: the embedded node pins its own certificate; a joined
        node verifies against ``[mesh] ca_file`` (else nats-py's defaults)."""
        embedded = self.config.mesh.embedded
        if self.embedded_mode:
            return pinned_context(embedded.tls_cert) if embedded.tls_cert else None
        return client_context(self.config.mesh.ca_file) if self.config.mesh.ca_file else None

    async def connect(
        self, shutdown: Shutdown, on_lost: Callable[[], None], on_error: Callable[[str], None] | None = None,
    ) -> MeshConnection:
        """The ``connect`` stage: the node's one connection, with the reply prefix
        its credential grants (:meth:`_choose_inbox`). ``on_error`` hears the
        client's errors from the first attempt on (a broker refusing the
        credential at start is one)."""
        inbox = self._choose_inbox()
        connection = MeshConnection(
            self._dial_urls(),
            node_key=self.node_key,
            jwt_source=lambda: self.jwt,
            name=f"meshnode {self.config.node.name}",
            inbox_prefix=inbox.prefix,
            tls=self.nats_tls(),
        )
        self.connection = connection
        if on_error is not None:
            connection.on_error(on_error)
        shutdown.push("close-connection", lambda: connection.close(drain_timeout=3.0))
        limit = self.config.mesh.connect_timeout.total_seconds()
        try:
            await wait_for(connection.connect(), limit)
        except TimeoutError:
            if "authorization violation" in (connection.last_error or "").lower():
                raise MeshUnreachable(
                    f"the mesh at {', '.join(connection.servers)} refuses this node's credential (Authorization "
                    f"Violation) and no new one came from the control plane within {limit:g} s (the log says "
                    "why); a mesh node rebuilt under new keys needs this node joined again with a new invite"
                ) from None
            raise MeshUnreachable(
                f"cannot reach the mesh at {', '.join(connection.servers)} within {limit:g} s "
                f"(last error: {connection.last_error or 'none'}): is it running, and reachable from here? "
                f"([mesh] servers, [mesh] connect_timeout in {self._config_file()})"
            ) from None
        connection.on_lost(on_lost)
        return connection

    def _choose_inbox(self) -> InboxChoice:
        """Read the credential's grants and pick the reply prefix (module
        :mod:`meshnode.transport.grants`). Every credential meshnode mints grants
        the private prefix; a mesh built elsewhere may grant only ``_INBOX.>``."""
        node_id = self.node_key.public_key
        try:
            self.grants = Grants.from_claims(decode_jwt(self.jwt)[1])
        except Exception as exc:  # an unreadable JWT fails at connect, with the broker's reason
            log.warning("cannot read the node credential's permissions (%s); assuming meshnode's grants", exc)
            self.grants = Grants.unrestricted()
        choice = choose_inbox_prefix(self.grants, node_id, self.config.mesh.inbox_prefix)
        self.inbox = choice
        if choice.source == "shared":
            log.info(
                "the node credential grants the shared reply prefix _INBOX.> and not %s.>: "
                "replies to this node use _INBOX (as in spec §14.3's example); set [mesh] inbox_prefix to override",
                node_inbox_prefix(node_id),
            )
        elif choice.source == "granted":
            log.info("the node credential grants the reply prefix %s.>; replies to this node use it", choice.prefix)
        elif choice.source == "ungranted":
            log.warning(
                "the node credential grants no reply prefix (neither %s.> nor _INBOX.>): replies to this "
                "node's requests will not arrive; ask the mesh operator for one, or set [mesh] inbox_prefix",
                choice.prefix,
            )
        elif choice.source == "configured" and not self.grants.can_subscribe(f"{choice.prefix}.>"):
            log.warning(
                "[mesh] inbox_prefix = %r, but the node credential does not grant subscribing to %s.>",
                choice.prefix, choice.prefix,
            )
        return choice

    async def connect_tenant(self, tenant: str, shutdown: Shutdown, on_lost: Callable[[], None]) -> MeshConnection:
        """The service connection into ``tenant``'s account (same node key, its own
        credential). ``on_lost`` as for :meth:`connect`: a tenant connection the
        client gave up for good leaves that tenant's platform services deaf until
        the node starts over."""
        self._tenant_jwts[tenant] = self._mint_tenant_jwt(tenant)
        connection = MeshConnection(
            self._dial_urls(),
            node_key=self.node_key,
            jwt_source=lambda: self._tenant_jwts[tenant],
            name=f"meshnode {self.config.node.name} tenant {tenant}",
            inbox_prefix=node_inbox_prefix(self.node_key.public_key),
            tls=self.nats_tls(),
        )
        shutdown.push("close-connection", lambda: connection.close(drain_timeout=3.0))
        await connection.connect()
        connection.on_lost(on_lost)
        self.tenant_connections[tenant] = connection
        return connection

    def renewal_job(self, renew: Callable[[], Any]) -> PeriodicJob:
        """The periodic credential check; ``renew`` runs when one is due."""
        return PeriodicJob("credential-renewal", renew, self._next_check, jitter=0.02)

    # -- credentials -------------------------------------------------------------

    def _mint_own_jwt(self) -> str:
        assert self.embedded is not None
        ttl = int(self.config.mesh.embedded.credential_ttl.total_seconds())
        roster = [k.public_key for k in self._roster()]
        return self.embedded.mint_node_credential(self.node_key.public_key, roster, ttl, role="service")

    def _mint_tenant_jwt(self, tenant: str) -> str:
        assert self.embedded is not None
        ttl = int(self.config.mesh.embedded.credential_ttl.total_seconds())
        return self.embedded.mint_node_credential(
            self.node_key.public_key, [], ttl, role="service", tenant=tenant
        )

    async def _obtain_joined_jwt(self, *, covering: bool = False, renew: bool = False) -> str:
        """Renew before connecting when due or lapsed (§4.8), or now (``renew``); fall
        back to the stored one (for a roster change, ``covering``, only if it names
        every agent; for ``renew`` never)."""
        return await obtain_credential(
            self.config, self.data_dir, self.node_key, self._roster(), covering=covering, renew=renew
        )

    def credential_span_ms(self) -> tuple[int, int] | None:
        """When the current credential was issued and when it expires (ms since
        the epoch), or None when it cannot be read."""
        try:
            claims = decode_jwt(self.jwt)[1]
            return int(claims["iat"]) * 1000, int(claims["exp"]) * 1000
        except Exception:
            return None

    def _next_check(self) -> float:
        return next_renewal_check(self.jwt, time.time())

    async def renew_if_due(self) -> bool:
        """Re-issue the node credential (and the tenants') when due; True if renewed.
        The caller presents it with :meth:`present`."""
        _, claims = decode_jwt(self.jwt)
        if time.time() < renew_at(claims):
            return False
        if self.embedded is not None:
            self._adopt(self._mint_own_jwt())
            for tenant, connection in self.tenant_connections.items():
                self._tenant_jwts[tenant] = self._mint_tenant_jwt(tenant)
                if connection.is_connected:
                    await connection.reconnect()
        else:
            self._adopt(await self._obtain_joined_jwt())
        log.info("node credential renewed")
        return True

    async def reissue(self, *, force: bool = True) -> bool:
        """A credential for the current roster now (§14.3): True when it is to be
        :meth:`present`-ed.

        Without ``force``, one whose permissions are exactly those of the
        credential in force is dropped and False returned (the credential in
        force stays, with its own expiry, which renewal watches). A
        service-role node's grants name no agent, so a roster change leaves
        them as they were; its reconnect only opened a gap in every live
        subscription, and each agent's drain then looked into its mailbox for
        what the gap missed: at 10,000 agents one roster change cost 10,025
        JetStream calls and 4.4 s of the daemon's CPU. With ``force`` (an
        operator's ``meshnode renew``) a joined node asks its control plane
        even while the stored credential is fresh.
        """
        jwt = (
            self._mint_own_jwt() if self.embedded is not None
            else await self._obtain_joined_jwt(covering=True, renew=force)
        )
        if not force and _same_permissions(self.jwt, jwt):
            return False
        self._adopt(jwt)
        return True

    def _adopt(self, jwt: str) -> None:
        """Hold ``jwt`` as the node credential, and what it grants with it.

        A participant's credential grants each agent's subjects and mailbox by
        name, so a roster change changes its grants: an agent added at runtime
        was judged against the credential read at start, which does not name
        it, and got no drain (its offline mail stayed in the broker until the
        daemon restarted; the soak's log said so). The reply prefix stays what
        the connection was opened with.
        """
        self.jwt = jwt
        try:
            self.grants = Grants.from_claims(decode_jwt(jwt)[1])
        except Exception as exc:  # kept as they were: the broker judges the credential itself
            log.warning("cannot read the renewed node credential's permissions (%s); keeping the previous", exc)

    async def present(self, *, wait: bool = False) -> None:
        """Present the current credential by a reconnect.

        The broker closes a connection whose credential expires, and nats-py
        treats that authorization error as final, so a renewed credential must
        be in place well before the old one lapses (§4.8). ``wait`` waits for
        the connection to be back (a roster change needs it for what follows).
        """
        connection = self.connection
        if connection is None:
            return
        if not wait:
            if connection.is_connected:
                await connection.reconnect()
            return
        # A reconnect already under way may have sent the previous credential,
        # and nats-py ignores a reconnect asked for meanwhile: let that one end,
        # then present this credential with a reconnect of our own.
        await self._until_connected(connection, "before presenting the new credential")
        await connection.reconnect()
        await self._until_connected(connection, "after presenting the new credential")

    @staticmethod
    async def _until_connected(connection: MeshConnection, when: str) -> None:
        # Woken by the reconnect itself: a poll every 50 ms was up to 100 ms of
        # every roster change's ~70 ms-to-1 s (issue #21).
        if not await connection.wait_connected(_RECONNECT_WAIT_S):
            raise ConnectionError(
                f"the mesh connection was not back within {_RECONNECT_WAIT_S:g} s {when} "
                f"(server {connection.connected_url or 'none'}); the roster change is not in force"
            )

    def trust_attestation(self) -> dict[str, Any] | None:
        """The §9.7 attestation this node's manifests carry: minted by the embedded
        mesh for itself, else the one issued with the current credential."""
        if self.embedded is None:
            return stored_trust_attestation(self.data_dir)
        if self.control_plane is None or not self.jwt:
            return None
        _, claims = decode_jwt(self.jwt)
        profile = credential_profile(claims)
        # The embedded node mints its own credential with the service role.
        role: Role = "service" if profile["role"] == "service" else "participant"
        attestation: dict[str, Any] = self.control_plane.trust_attestation(
            claims["sub"], profile["trust_tier"], role, claims["iat"], claims["exp"]
        )
        return attestation

    def trusted_issuers(self) -> tuple[str, ...]:
        """Whose §9.7 attestations the registry believes: this mesh's operator. A
        joined service node learns that key from the attestation issued with its
        own credential (none stored: it believes none and applies no tier)."""
        if self.embedded is not None:
            return (self.embedded.operator_public_key,)
        own = stored_trust_attestation(self.data_dir)
        issuer = own.get("issuer") if isinstance(own, dict) else None
        return (issuer,) if isinstance(issuer, str) else ()

    def credential_status(self) -> dict[str, Any] | None:
        if not self.jwt:
            return None
        try:
            _, claims = decode_jwt(self.jwt)
        except Exception:
            return None
        return {
            "expires_at": claims.get("exp"),
            "renew_at": int(renew_at(claims)),
            # The account that signed it, and the operator-attested profile
            # claims it carries (§9.7, §15): what the mesh says this node is.
            "account": claims.get("iss"),
            # The reply prefix chosen from its grants (or [mesh] inbox_prefix).
            "inbox_prefix": self.inbox.prefix if self.inbox is not None else None,
            **credential_profile(claims),
        }


def _same_permissions(current: str, candidate: str) -> bool:
    """Whether two user JWTs grant the same (their ``nats`` claims are equal:
    permissions, response rights, limits and tags; issue and expiry times and
    the JWT id are outside it)."""
    try:
        return bool(decode_jwt(current)[1].get("nats") == decode_jwt(candidate)[1].get("nats"))
    except Exception:
        return False


class MeshUnreachable(RuntimeError):
    """The node's first connection to the mesh did not succeed within ``[mesh]
    connect_timeout``: temporary (exit 75), the message names servers and error."""


#: Bind addresses that mean "every interface": no other machine can dial them.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", "*"})


def advertised_host(bound: str, configured: str | None, key: str) -> str | None:
    """The host to give other machines for a listener bound to ``bound``:
    ``[mesh.embedded] advertise_host`` when set; for a wildcard bind, this
    machine's name (said once at start, naming the setting); else None (the
    bound host is what they dial)."""
    if configured:
        return configured
    if bound not in WILDCARD_HOSTS:
        return None
    name = socket.getfqdn()
    log.warning(
        "[mesh.embedded] %s = %r listens on every interface: invites and `meshnode mesh info` give "
        "other machines this machine's name, %r; set [mesh.embedded] advertise_host to the name or "
        "address they reach it by", key, bound, name,
    )
    return name


def reach_notes(embedded: EmbeddedMeshConfig, nats_urls: list[str], control_plane: str | None) -> list[str]:
    """The caveats on URLs an embedded mesh hands out in invites and tokens: a
    port picked at start (the next start picks another, so they go stale), and
    a listener advertised on loopback only (no other machine can dial it; a
    joining node needs both: the control plane for its credential, then NATS)."""
    notes = []
    picked = [key for key, port in (("port", embedded.port), ("control_port", embedded.control_port)) if port == 0]
    if picked:
        notes.append(
            f"[mesh.embedded] {' and '.join(picked)} = 0: the port was picked at this start and the "
            "next start picks another, so these URLs stop working when the node restarts; set a "
            "fixed port before handing this out"
        )
    nats_here = bool(nats_urls) and all(is_loopback_host(urlsplit(url).hostname or "") for url in nats_urls)
    control_here = control_plane is not None and is_loopback_host(urlsplit(control_plane).hostname or "")
    beyond = "see docs/operations/security.md for TLS"
    if nats_here and (control_here or control_plane is None):
        notes.append(
            f"the mesh is reachable on loopback only ({nats_urls[0]}): this works on this machine; "
            "another machine needs [mesh.embedded] host and control_host beyond loopback (and "
            f"advertise_host), {beyond}"
        )
    elif nats_here:
        notes.append(
            f"the mesh's NATS listener is reachable on loopback only ({nats_urls[0]}): a node on another "
            f"machine gets its credential but cannot connect; set [mesh.embedded] host (and advertise_host), {beyond}"
        )
    elif control_here:
        notes.append(
            f"the control plane is reachable on loopback only ({control_plane}): a node on another machine "
            "cannot trade its invite for a credential, nor an SDK agent its token; set "
            f"[mesh.embedded] control_host (and advertise_host), {beyond}"
        )
    return notes
