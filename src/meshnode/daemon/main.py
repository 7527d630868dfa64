"""The daemon: configuration in, a running node out, and a clean way back down.

Start-up runs in named stages (keys → plugins → mesh → connect → services →
agents → heartbeat → admin); any failure before ``agents`` is fatal and
reported with its stage. Agents are hosted one by one and a failing one is
stopped alone. Shutdown runs the budgeted stages of
:mod:`meshnode.daemon.lifecycle`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import meshnode
from meshnode.a2a.extension import EXTENSION_URI as A2A_URI
from meshnode.admin.protocol import InvalidParameter, NotFound
from meshnode.admin.server import AdminServer, CallContext, MethodRegistry
from meshnode.config import Config
from meshnode.daemon.lifecycle import SHUTDOWN_BUDGETS, Stage, StageFailed, run_stage
from meshnode.daemon.sdnotify import Notifier
from meshnode.daemon.terminal import register_terminal_methods
from meshnode.keystore import KeyStore, open_keystore
from meshnode.node.builtin import BRIDGE_AGENT_NAME, CLI_AGENT_NAME, BuiltinAgents
from meshnode.node.hosted import HostedAgent
from meshnode.node.outbound import RemoteError, RequestQueued
from meshnode.node.periodic import PeriodicJob
from meshnode.node.runtime import Node, NodeSettings
from meshnode.plugins import AgentCatalog, PluginManager, load_plugins
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair, is_valid_public
from meshnode.protocol.protections import FreshnessWindow
from meshnode.transport.connection import MeshConnection
from meshnode.transport.jwt import decode_jwt, renew_at
from meshnode.transport.permissions import node_inbox_prefix

__all__ = ["Daemon", "credential_profile"]

log = logging.getLogger("meshnode.daemon")


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


#: Agents started at once at start-up (see _stage_agents).
HOST_CONCURRENCY = 32


def _ms(td: Any) -> int:
    return int(td.total_seconds() * 1000)


class Daemon:
    """One meshnode process: embedded or joined mesh, services, agents, admin socket."""

    def __init__(self, config: Config, *, notifier: Notifier | None = None) -> None:
        self.config = config
        self.notifier = notifier or Notifier()
        self.data_dir = Path(config.node.data_dir)
        self.keystore: KeyStore | None = None
        self.node_key: KeyPair | None = None
        self.agent_keys: dict[str, KeyPair] = {}
        self.catalog = AgentCatalog()
        self.plugin_manager = PluginManager()
        self.embedded: Any = None  # EmbeddedNatsServer when the mesh is embedded
        self.control_plane: Any = None
        self.connection: MeshConnection | None = None
        #: The embedded node's service connections into each tenant's account (§15).
        self.tenant_connections: dict[str, MeshConnection] = {}
        self._tenant_jwts: dict[str, str] = {}
        self.node: Node | None = None
        self.services: list[Any] = []
        self.admin: AdminServer | None = None
        self.failed_agents: dict[str, str] = {}
        self.inbox: Any = None
        self.a2a: Any = None  # meshnode.a2a.server.A2ABridge when [a2a] listen is set
        self.a2a_charges: Any = None  # meshnode.a2a.charges.ChargeStore when [a2a.peers] is set
        self._sweep_job: PeriodicJob | None = None
        self._jwt = ""
        self._jwt_job: PeriodicJob | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._signal_tasks: set[asyncio.Task[None]] = set()
        #: Set when the connection was lost for good: the process re-executes itself.
        self.relaunch = False
        self._force = 0
        self.started = False

    # -- start ---------------------------------------------------------------

    @property
    def embedded_mode(self) -> bool:
        return not self.config.mesh.servers

    @property
    def runs_services(self) -> bool:
        """Whether this node serves the platform services: ``[services] run``,
        by default only the embedded-mesh node."""
        run = self.config.services.run
        return self.embedded_mode if run is None else run

    def replicas(self) -> int:
        """JetStream replicas for what the services create: ``[mesh] replicas``, else
        ``min(3, cluster size)`` (§9.4, §18.3: R3 in production); 1 when embedded."""
        if self.embedded_mode:
            return 1
        if self.config.mesh.replicas is not None:
            return self.config.mesh.replicas
        size = self.connection.cluster_size() if self.connection is not None else 1
        return min(3, size)

    async def start(self) -> None:
        # Budgets guard against hangs; the per-agent stages grow with the roster
        # (a first start of 10,000 agents writes 10,000 keys and registrations).
        n_agents = len(self.config.agents)
        stages = [
            Stage("keys", 30.0 + 0.01 * n_agents, self._stage_keys),
            Stage("plugins", 30.0, self._stage_plugins),
            Stage("mesh", 60.0, self._stage_mesh),
            Stage("connect", 30.0, self._stage_connect),
            Stage("services", 30.0, self._stage_services),
            Stage("agents", 120.0 + 0.05 * n_agents, self._stage_agents),
            Stage("a2a", 30.0, self._stage_a2a),
            Stage("admin", 10.0, self._stage_admin),
        ]
        for stage in stages:
            self.notifier.status(f"starting: {stage.name}")
            await run_stage(stage, critical=True)
        self.started = True
        self.notifier.ready(f"serving {len(self.node.agents) if self.node else 0} agents")
        if self.notifier.watchdog_interval:
            self._watchdog = asyncio.get_running_loop().create_task(self._watchdog_loop())
        log.info(
            "meshnode %s ready: node %s, %d agents, mesh %s",
            meshnode.__version__,
            self.node_key.public_key if self.node_key else "?",
            len(self.node.agents) if self.node else 0,
            ", ".join(self.mesh_urls()),
        )

    async def _stage_keys(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.keystore = await asyncio.to_thread(
            open_keystore, self.config.keystore.backend, self.data_dir
        )
        store = self.keystore
        self.node_key = await asyncio.to_thread(store.get_or_create, "node")
        names = [CLI_AGENT_NAME, *(n for n, a in self.config.agents.items() if a.enabled)]
        if self.config.a2a.listen is not None:
            names.append(BRIDGE_AGENT_NAME)  # config refuses [agents.a2a-bridge] then
        # One worker-thread hop for the whole roster, not one per agent.
        keys = await asyncio.to_thread(lambda: [store.get_or_create(f"agent.{name}") for name in names])
        self.agent_keys.update(zip(names, keys, strict=True))
        if self.runs_services:
            from meshnode.services.identity import SERVICE_NAMES, load_service_keys

            key_dir = self.config.services.key_dir
            if key_dir is not None:
                # Shared with the mesh's other service nodes: callers pin these keys.
                shared = await asyncio.to_thread(load_service_keys, key_dir)
                for name, key in shared.items():
                    self.agent_keys[f"service.{name}"] = key
            else:
                if not self.embedded_mode:
                    log.warning(
                        "[services] run = true without [services] key_dir: this node's services "
                        "sign with keys of their own, so a second service node on this mesh "
                        "would be refused by callers that pinned these (set key_dir on each)"
                    )
                for name in SERVICE_NAMES:
                    self.agent_keys[f"service.{name}"] = await asyncio.to_thread(
                        store.get_or_create, f"service.{name}"
                    )
        log.info("keys held by %s", store.describe())

    async def _stage_plugins(self) -> None:
        self.plugin_manager, self.catalog = load_plugins(
            strict=self.config.node.strict_plugins,
            builtins=[("meshnode.builtin", BuiltinAgents())],
            extra_modules=self.config.node.plugin_modules,
        )
        for name, agent_cfg in self.config.agents.items():
            if agent_cfg.enabled and agent_cfg.plugin not in self.catalog.kinds:
                message = f"no installed plugin provides agent kind {agent_cfg.plugin!r}"
                if self.config.node.strict_plugins:
                    raise RuntimeError(f"[agents.{name}]: {message}")
                self.failed_agents[name] = message
                log.error("agent %s not hosted: %s", name, message)

    def _roster(self) -> list[str]:
        return [k.public_key for n, k in self.agent_keys.items() if not n.startswith("service.")]

    async def _stage_mesh(self) -> None:
        assert self.node_key is not None
        if self.embedded_mode:
            from meshnode.transport.embedded import EmbeddedNatsServer

            cfg = self.config.mesh.embedded
            from meshnode.transport.embedded import TenantExport

            self.embedded = EmbeddedNatsServer(
                self.data_dir,
                host=cfg.host,
                port=cfg.port or None,
                max_payload=cfg.max_payload,
                tenants=cfg.tenants,
                exports=[
                    TenantExport(e.from_, e.to, tuple(e.agents), e.discover) for e in cfg.exports
                ],
                monitor_port=cfg.monitor_port,
            )
            await self.embedded.start()
            self._jwt = self._mint_own_jwt()
            await self._start_control_plane()
        else:
            self._jwt = await self._obtain_joined_jwt()
            profile = credential_profile(decode_jwt(self._jwt)[1])
            log.info(
                "the mesh attests this node as %s, trust tier %s, tenant %s",
                profile["role"], profile["trust_tier"], profile["tenant"],
            )
            if profile["trust_tier"] == "sandbox":
                log.warning(
                    "this node is attested sandbox (§9.7): the registry lists none of its agents "
                    "and keeps no offline buffer for them; requesters may avoid it for sensitive work"
                )

    def _own_trust_attestation(self) -> dict[str, Any] | None:
        """The §9.7 attestation this node's manifests carry: minted by the embedded
        mesh for itself, else the one issued with the current credential."""
        if self.embedded is None:
            from meshnode.daemon.credentials import stored_trust_attestation

            return stored_trust_attestation(self.data_dir)
        if self.control_plane is None or not self._jwt:
            return None
        _, claims = decode_jwt(self._jwt)
        profile = credential_profile(claims)
        attestation: dict[str, Any] = self.control_plane.trust_attestation(
            claims["sub"], profile["trust_tier"], profile["role"], claims["iat"], claims["exp"]
        )
        return attestation

    def _mint_own_jwt(self) -> str:
        assert self.node_key is not None
        ttl = int(self.config.mesh.embedded.credential_ttl.total_seconds())
        jwt: str = self.embedded.mint_node_credential(
            self.node_key.public_key, self._roster(), ttl, role="service"
        )
        return jwt

    async def _start_control_plane(self) -> None:
        try:
            from meshnode.transport.control_plane import ControlPlaneServer
        except ImportError:  # pragma: no cover - shipped together
            return
        cfg = self.config.mesh.embedded
        self.control_plane = ControlPlaneServer(
            self.embedded,
            self.data_dir / "mesh",
            host=cfg.control_host,
            port=cfg.control_port,
            credential_ttl_s=int(cfg.credential_ttl.total_seconds()),
            mesh_name=self.config.node.name,
        )
        await self.control_plane.start()

    async def _obtain_joined_jwt(self) -> str:
        """Renew before connecting when due or lapsed (§4.8); fall back to the stored one."""
        from meshnode.daemon.credentials import obtain_credential

        assert self.node_key is not None
        return await obtain_credential(
            self.config, self.data_dir, self.node_key, [self.agent_keys[n] for n in self.agent_keys if not n.startswith("service.")]
        )

    def mesh_urls(self) -> list[str]:
        if self.embedded is not None:
            return list(self.embedded.urls)
        return list(self.config.mesh.servers)

    async def _stage_connect(self) -> None:
        assert self.node_key is not None
        self.connection = MeshConnection(
            self.mesh_urls(),
            node_key=self.node_key,
            jwt_source=lambda: self._jwt,
            name=f"meshnode {self.config.node.name}",
            inbox_prefix=node_inbox_prefix(self.node_key.public_key),
        )
        await self.connection.connect()
        self.connection.on_lost(self._on_connection_lost)
        self._jwt_job = PeriodicJob("credential-renewal", self._renew_jwt, self._next_jwt_check, jitter=0.02)
        self._jwt_job.start()

    def _next_jwt_check(self) -> float:
        try:
            _, claims = decode_jwt(self._jwt)
            due = renew_at(claims) - time.time()
        except Exception:
            due = 60.0
        return max(5.0, min(due, 3600.0))

    async def _renew_jwt(self) -> None:
        _, claims = decode_jwt(self._jwt)
        if time.time() < renew_at(claims):
            return
        if self.embedded is not None:
            self._jwt = self._mint_own_jwt()
            for tenant, connection in self.tenant_connections.items():
                self._tenant_jwts[tenant] = self._mint_tenant_jwt(tenant)
                if connection.is_connected:
                    await connection.reconnect()
        else:
            self._jwt = await self._obtain_joined_jwt()
        log.info("node credential renewed")
        if self.node is not None:
            # The attestation is re-issued with the credential (same lifetime):
            # the manifests carry the fresh one before the old one lapses.
            await self.node.set_trust_attestation(self._own_trust_attestation())
        # Present it now: the broker closes a connection whose credential expires,
        # and nats-py treats that authorization error as final, so the renewed
        # credential must be in place well before the old one lapses (§4.8).
        if self.connection is not None and self.connection.is_connected:
            await self.connection.reconnect()

    async def _stage_services(self) -> None:
        if not self.runs_services:
            return
        from meshnode.protocol.ratelimit import SlidingWindowLimiter

        assert self.connection is not None
        # §16.1: one per-sender counter across every service subject (and tenant).
        limiter = SlidingWindowLimiter(
            limit=self.config.registry.rate_limit, window_ms=_ms(self.config.registry.rate_window)
        )
        self.services = await self._start_services(self.connection, limiter, "mesh")
        # §15: every tenant is its own account, so its own registry, presence,
        # task records, feeds and artifacts (streams and KV are account-scoped).
        # The services keep the same keys in every tenant: one platform, whose
        # replies an exported discovery query can pin like any other.
        for tenant in self.embedded.tenants if self.embedded is not None else ():
            connection = await self._connect_tenant(tenant)
            self.services += await self._start_services(connection, limiter, tenant)
            log.info("platform services serve tenant %s", tenant)

    def _mint_tenant_jwt(self, tenant: str) -> str:
        assert self.node_key is not None
        ttl = int(self.config.mesh.embedded.credential_ttl.total_seconds())
        jwt: str = self.embedded.mint_node_credential(
            self.node_key.public_key, [], ttl, role="service", tenant=tenant
        )
        return jwt

    async def _connect_tenant(self, tenant: str) -> MeshConnection:
        """The service connection into ``tenant``'s account (same node key, its own credential)."""
        assert self.node_key is not None
        self._tenant_jwts[tenant] = self._mint_tenant_jwt(tenant)
        connection = MeshConnection(
            self.mesh_urls(),
            node_key=self.node_key,
            jwt_source=lambda: self._tenant_jwts[tenant],
            name=f"meshnode {self.config.node.name} tenant {tenant}",
            inbox_prefix=node_inbox_prefix(self.node_key.public_key),
        )
        await connection.connect()
        self.tenant_connections[tenant] = connection
        return connection

    async def _start_services(self, connection: MeshConnection, limiter: Any, tenant: str) -> list[Any]:
        """Registry, presence, artifacts, task manager and feeds on ``tenant``'s account."""
        from meshnode.services.base import ServiceContext
        from meshnode.services.presence import PresenceService
        from meshnode.services.registry import RegistryService
        from meshnode.services.streams import ensure_mesh_streams
        from meshnode.transport.embedded import imported_agents

        assert self.node_key is not None
        replicas = self.replicas()
        log.info("platform services (%s): JetStream objects with %d replica(s)", tenant, replicas)
        if not self.embedded_mode:
            # A cluster (re)started moments ago answers before its streams have leaders.
            from meshnode.services.streams import wait_jetstream_ready

            await wait_jetstream_ready(connection.js, timeout=20.0)
        await ensure_mesh_streams(connection.js, replicas)
        node_id = self.node_key.public_key

        def context(name: str) -> ServiceContext:
            return ServiceContext(
                connection=connection,
                key=self.agent_keys[f"service.{name}"],
                node_id=node_id,
                now_ms=lambda: time.time_ns() // 1_000_000,
                ids=self._ids(),
                log=logging.getLogger(f"meshnode.service.{name}"),
                replicas=replicas,
                limiter=limiter,
            )

        presence = PresenceService(
            context("presence"),
            heartbeat_interval_s=self.config.node.heartbeat_interval.total_seconds(),
        )
        registry = RegistryService(
            context("registry"),
            require_connection_bound=self.config.registry.require_connection_bound,
            inbox_max_age_s=int(self.config.inbox.buffer_max_age.total_seconds()),
            inbox_max_bytes=self.config.inbox.buffer_max_bytes,
            presence=presence,
            is_revoked=self.control_plane.agent_retired if self.control_plane is not None else None,
            # The operator-attested tier from enrolment (§9.7), known only to the
            # control plane: the sandbox clamp and discovery's tier filter.
            trust_tier_of=self.control_plane.trust_tier_of if self.control_plane is not None else None,
            # Portable attestations (§9.7) are believed from this mesh's operator only.
            trusted_issuers=self._trusted_issuers(),
            # Agents other tenants exported here resolve through their own registry.
            imported=imported_agents(tenant, self.embedded.exports) if self.embedded is not None else {},
        )
        presence.vouched_by = registry.vouched_by
        await registry.start()
        await presence.start()
        services: list[Any] = [registry, presence]
        # The artifact store (§7.5, §18.5), owners resolved from the registry.
        from meshnode.daemon.artifacts import start_artifact_service

        services.append(await start_artifact_service(context("artifacts"), registry, self.config.artifacts))
        from meshnode.services.tasks import TaskManagerService

        # Attribution (§10.8a) reads the responder's needs from the registry's cache.
        tasks = TaskManagerService(context("tasks"), manifest_of=registry.manifest)
        await tasks.start()
        services.append(tasks)
        # Feeds (§6.6a, §18.3): MESH_FEED, the state-feed KV and mesh.feed.get.
        from meshnode.services.feeds import FeedService

        feeds = FeedService(context("feeds"))
        await feeds.start()
        services.append(feeds)
        return services

    def _trusted_issuers(self) -> tuple[str, ...]:
        """Whose §9.7 attestations the registry believes: this mesh's operator. A
        joined service node learns that key from the attestation issued with its
        own credential (none stored: it believes none and applies no tier)."""
        if self.embedded is not None:
            return (self.embedded.operator_public_key,)
        from meshnode.daemon.credentials import stored_trust_attestation

        own = stored_trust_attestation(self.data_dir)
        issuer = own.get("issuer") if isinstance(own, dict) else None
        return (issuer,) if isinstance(issuer, str) else ()

    def _ids(self) -> Any:
        from meshnode.protocol.envelope import IdGenerator

        return IdGenerator()

    async def _stage_agents(self) -> None:
        assert self.connection is not None and self.node_key is not None
        p = self.config.protections
        settings = NodeSettings(
            name=self.config.node.name,
            heartbeat_interval_s=self.config.node.heartbeat_interval.total_seconds(),
            availability_class=self.config.node.availability_class,
            vouch_ttl_ms=_ms(self.config.node.vouch_ttl) if self.config.node.vouch_ttl else None,
            freshness=FreshnessWindow(
                max_clock_skew_ahead_ms=_ms(p.clock_skew_ahead),
                max_age_live_ms=_ms(p.live_max_age),
                max_age_mailbox_ms=_ms(p.mailbox_max_age),
            ),
            max_inbound_chars=p.max_inbound_chars,
            dedup_entries=p.dedup_entries,
            emit_limit=self.config.events.emit_limit,
            emit_window_ms=_ms(self.config.events.emit_window),
        )
        self.node = Node(settings=settings, node_key=self.node_key, connection=self.connection)
        self.node.trust_attestation = self._own_trust_attestation()
        # Broker refusals counted always; spans/logs/metrics only when enabled (§13).
        from meshnode.node.observe import ObservabilitySettings, install

        o = self.config.observability
        install(self.node, ObservabilitySettings(
            spans=o.spans, logs=o.logs, log_level=logging.getLevelName(o.log_level.upper()),
            metrics=o.metrics, metrics_interval_s=o.metrics_interval.total_seconds(),
        ))
        if p.check_sender_vouch:
            from meshnode.node.trust import VouchMemo

            self.node.trust = VouchMemo(self.node)
        from meshnode.node.inbox import InboxStore

        self.inbox = InboxStore(
            self.data_dir / "inbox.sqlite3",
            seen_max_age_ms=_ms(p.mailbox_max_age),
        )
        await self.inbox.open()
        recovered = await self.inbox.recover_interrupted(self.node.now_ms())
        if recovered:
            log.warning("%d inbox message(s) were being handled when the node last stopped; kept as interrupted", recovered)
        self.node.inbox = self.inbox
        self.node.drain_interval_s = self.config.inbox.drain_interval.total_seconds()
        inbox = self.inbox
        self._sweep_job = PeriodicJob(
            "inbox-sweep", lambda: self._sweep(inbox), 3600.0, jitter=0.1, first_delay=60.0
        )
        self._sweep_job.start()
        await self._open_a2a_outbound()
        await self._host(CLI_AGENT_NAME, "builtin:cli", {}, None)
        if self.config.a2a.listen is not None:
            await self._host(BRIDGE_AGENT_NAME, "builtin:a2a-bridge", {}, None)
        # Agents start side by side, a bounded number at a time: each start is
        # mostly waiting (the registry's answer, the mailbox stream it creates),
        # so one after another made a 1,000-agent node take minutes to register.
        gate = asyncio.Semaphore(HOST_CONCURRENCY)

        async def host_one(name: str, agent_cfg: Any) -> None:
            async with gate:
                await self._host(name, agent_cfg.plugin, agent_cfg.settings, agent_cfg.interaction)

        await asyncio.gather(*(
            host_one(name, agent_cfg)
            for name, agent_cfg in self.config.agents.items()
            if agent_cfg.enabled and name not in self.failed_agents
        ))
        self.node.start_heartbeat()

    async def _open_a2a_outbound(self) -> None:
        """The outbound A2A bridge, when ``[a2a.peers]`` names any peer (issue #8)."""
        assert self.node is not None and self.node_key is not None
        cfg = self.config.a2a
        if not cfg.peers:
            return
        try:
            from meshnode.a2a.outbound import A2AOutbound
        except ImportError as exc:
            raise RuntimeError(f"[a2a.peers] needs the a2a-sdk: install meshnode[a2a] ({exc})") from exc
        from meshnode.a2a.charges import ChargeStore

        self.a2a_charges = ChargeStore(self.data_dir / "a2a-charges.sqlite3")
        await self.a2a_charges.open()
        self.node.a2a = A2AOutbound.from_config(
            cfg, default_application=self.config.node.name, charges=self.a2a_charges, node_key=self.node_key
        )

    async def _admin_a2a_charges(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        if self.a2a_charges is None:
            return {"charges": [], "totals": {}}
        peer = params.get("peer")
        if peer is not None and not isinstance(peer, str):
            raise InvalidParameter("peer must be a string")
        limit = params.get("limit", 200)
        if not isinstance(limit, int) or not 0 < limit <= 10_000:
            raise InvalidParameter("limit must be an integer in (0, 10000]")
        rows = await self.a2a_charges.recent(peer=peer, limit=limit)
        return {"charges": [r.to_object() for r in rows], "totals": await self.a2a_charges.totals()}

    async def _host(self, name: str, kind: str, settings: dict[str, Any], interaction: str | None) -> None:
        assert self.node is not None
        agent_class = self.catalog.kinds.get(kind)
        if agent_class is None:
            self.failed_agents[name] = f"unknown agent kind {kind!r}"
            return
        try:
            await self.node.host(
                name=name,
                kind=kind,
                agent_class=agent_class,
                settings=settings,
                key=self.agent_keys[name],
                interaction=interaction,
            )
        except Exception as exc:  # one agent failing never takes the node down
            self.failed_agents[name] = f"{type(exc).__name__}: {exc}"
            log.error("agent %s (%s) failed to start: %s", name, kind, exc)
            if self.config.node.strict_plugins:
                raise

    async def _stage_a2a(self) -> None:
        """The inbound A2A bridge (off unless ``[a2a] listen`` is set)."""
        a2a = self.config.a2a
        if a2a.listen is None or self.node is None:
            return
        bridge = self.node.agents.get(BRIDGE_AGENT_NAME)
        if bridge is None:
            raise RuntimeError(
                f"[a2a]: the bridge identity did not start: {self.failed_agents.get(BRIDGE_AGENT_NAME)}"
            )
        try:
            from meshnode.a2a.extension import IssuerTrust, parse_verify_key
            from meshnode.a2a.server import A2ABridge, BridgeSettings
        except ImportError as exc:
            raise RuntimeError(
                f"[a2a] listen is set but the A2A dependencies are missing ({exc}): "
                "install meshnode[a2a]"
            ) from None
        host, _, port = a2a.listen.rpartition(":")
        trust = IssuerTrust(
            {name: parse_verify_key(issuer.key) for name, issuer in a2a.issuers.items()},
            allow=a2a.allow_issuers,
        )
        settings = BridgeSettings(
            host=host,
            port=int(port),
            application=a2a.application or self.config.node.name,
            expose=tuple(a2a.expose),
            public_url=a2a.public_url,
            max_mesh_hops=a2a.max_mesh_hops,
            idempotency_retention_s=a2a.idempotency_retention.total_seconds(),
            send_wait_s=a2a.send_wait.total_seconds(),
            task_timeout_s=a2a.task_timeout.total_seconds(),
            trust=trust,
        )
        self.a2a = A2ABridge(node=self.node, bridge=bridge, settings=settings, data_dir=self.data_dir)
        await self.a2a.start()

    async def _stage_admin(self) -> None:
        methods = MethodRegistry()
        methods.add("Status", self._admin_status, level="operator", doc="node and agent status")
        methods.add("Call", self._admin_call, level="operator", doc="params {agent, offering, input?, timeout?, config?, budget?, wait_task?, task_id?, context_id?} -> the answer; a task paused for input comes back with status input_required/auth_required, task_id and problems: answer it with task_id")
        methods.add("Presence", self._admin_presence, level="operator", doc="presence of a node or agent (or all nodes)")
        methods.add("Discover", self._admin_discover, level="operator", doc="query the registry (§9.3 filters)")
        methods.add("Agents.Add", self._admin_agents_add, level="admin", doc="host a new agent now (re-mints the credential)")
        methods.add("Agents.Remove", self._admin_agents_remove, level="admin", doc="stop and deregister an agent")
        methods.add("Inbox.List", self._admin_inbox_list, level="operator", doc="held, interrupted and recent inbox messages")
        methods.add("Inbox.Show", self._admin_inbox_show, level="operator", doc="one inbox message in full")
        methods.add("Inbox.Reply", self._admin_inbox_reply, level="operator", doc="answer a held request as its agent")
        methods.add("Inbox.Ack", self._admin_inbox_ack, level="operator", doc="dismiss a held message")
        methods.add(
            "A2A.Charges", self._admin_a2a_charges, level="operator",
            doc="params {peer?, limit?} -> charges recorded for calls to external A2A agents, newest first, and totals per peer",
        )
        methods.add("Mesh.Info", self._admin_mesh_info, level="operator", doc="NATS URLs and control-plane URL")
        methods.add(
            "Mesh.Nodes", self._admin_mesh_nodes, level="operator",
            doc="-> {nodes: [{node_id, name, trust_tier, tenant, enrolled_at, retired_at, last_issued_at, "
            "credential_expires_at}]} every node the control plane enrolled (unix seconds; nulls when never)",
        )
        methods.add("Mesh.Invite", self._admin_mesh_invite, level="admin", doc="params {name, trust_tier?, tenant?} -> enrol a new node (tier standard|verified|sandbox, attested in its credentials; tenant: an account from [mesh.embedded] tenants, default mesh); returns its invite (secret)")
        from meshnode.daemon.operations import register_operations

        register_operations(self, methods)
        from meshnode.daemon.artifacts import register_artifact_methods

        register_artifact_methods(self, methods)
        register_terminal_methods(self, methods)  # #18: Tasks.Follow, Events.*
        self.plugin_manager.add_admin_methods(methods, self)
        self.admin = AdminServer(
            self.config.admin.socket,
            group=self.config.admin.group,
            mode=self.config.admin.effective_mode,
            methods=methods,
            info=lambda: {"node_id": self.node_key.public_key if self.node_key else None},
        )
        await self.admin.start()

    # -- admin methods -------------------------------------------------------

    def status(self, *, agents_listed: bool = True) -> dict[str, Any]:
        """Node and agent status. ``agents_listed=False`` leaves out the per-agent
        list (the counts in ``agent_summary`` remain): at 10,000 agents the list
        is larger than an admin reply may be."""
        node = self.node
        agents: list[dict[str, Any]] = []
        hosted = list(node.agents.values()) if node is not None else []
        if agents_listed and node is not None:
            agents = [node.agent_status(h) for h in hosted]
        if agents_listed:
            for name, why in self.failed_agents.items():
                agents.append({"name": name, "state": "failed", "failure": why})
        summary = {
            "hosted": len(hosted),
            "registered": sum(1 for h in hosted if h.registered),
            "failed": len(set(self.failed_agents) | {h.name for h in hosted if h.state == "failed"}),
        }
        return {
            "product": "meshnode",
            "version": meshnode.__version__,
            "node": {
                "id": self.node_key.public_key if self.node_key else None,
                "name": self.config.node.name,
                "data_dir": str(self.data_dir),
            },
            "mesh": {
                "mode": "embedded" if self.embedded_mode else "joined",
                "urls": self.mesh_urls(),
                "control_plane": self.control_plane_url(),
                # Tenants this embedded mesh serves beside its own account (§15).
                "tenants": list(self.embedded.tenants) if self.embedded is not None else [],
                "connected": bool(self.connection and self.connection.is_connected),
                "connected_url": self.connection.connected_url if self.connection else None,
                "known_servers": self.connection.known_servers if self.connection else [],
                "last_error": self.connection.last_error if self.connection else None,
            },
            "credential": self._credential_status(),
            # writable false: disk full or read-only; nothing is acked until it clears.
            "inbox": self.inbox.health() if self.inbox is not None else None,
            "keystore": self.keystore.describe() if self.keystore else None,
            "agents": agents,
            "agent_summary": summary,
            "services": [type(s).__name__ for s in self.services],
            "replicas": self.services[0].ctx.replicas if self.services else None,
            "observability": self.node.observability.status() if self.node and self.node.observability else None,
            "a2a": self.a2a.status() if self.a2a is not None else None,
        }

    def control_plane_url(self) -> str | None:
        if self.control_plane is not None:
            return str(getattr(self.control_plane, "url", None))
        return str(self.config.mesh.control_plane) if self.config.mesh.control_plane else None

    def _credential_status(self) -> dict[str, Any] | None:
        if not self._jwt:
            return None
        try:
            _, claims = decode_jwt(self._jwt)
        except Exception:
            return None
        return {
            "expires_at": claims.get("exp"),
            "renew_at": int(renew_at(claims)),
            # The account that signed it, and the operator-attested profile
            # claims it carries (§9.7, §15): what the mesh says this node is.
            "account": claims.get("iss"),
            **credential_profile(claims),
        }

    async def _admin_status(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        listed = params.get("agents", True)
        if not isinstance(listed, bool):
            raise InvalidParameter("agents must be true or false")
        return self.status(agents_listed=listed)

    async def _admin_call(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        if self.node is None:
            raise NotFound("the node is not running")
        target = params.get("agent")
        offering = params.get("offering")
        if not isinstance(target, str) or not isinstance(offering, str):
            raise InvalidParameter("agent and offering are required strings")
        timeout = params.get("timeout", 30)
        if not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise InvalidParameter("timeout must be a number of seconds in (0, 3600]")
        local = self.node.agents.get(target)
        target_id = local.agent_id if local is not None else target
        if local is None and not is_valid_public(target) and not target.startswith("a2a:"):
            raise InvalidParameter(
                f"{target!r} is neither a local agent name, an agent id (U...) nor an A2A peer (a2a:<name>)"
            )
        cli: HostedAgent = self.node.agents[CLI_AGENT_NAME]
        from meshnode.node.context import AgentContext
        from meshnode.protocol.envelope import new_root_trace

        ctx = AgentContext(cli, trace=new_root_trace())
        config = params.get("config") if isinstance(params.get("config"), dict) else None
        task_id = params.get("task_id")
        if task_id is not None and not isinstance(task_id, str):
            raise InvalidParameter("task_id must be a string (the task to answer)")
        context_id = params.get("context_id") if isinstance(params.get("context_id"), str) else None
        try:
            budget = params.get("budget") if isinstance(params.get("budget"), dict) else None
            reply = await ctx.request(
                target_id, offering, params.get("input"), timeout=float(timeout), config=config, budget=budget,
                task_id=task_id, context_id=context_id,
            )
            if reply.task is not None and params.get("wait_task", True):
                # A task paused for input or auth comes back as such, with its
                # problems: answer it with another Call naming its task_id (§6.5).
                try:
                    final = await reply.task.result(timeout=float(timeout), until_paused=True)
                except TimeoutError:
                    # No update for the whole wait (the responder may have died
                    # mid-task, or is just slow): a plain answer, not an internal
                    # error, naming the task so the caller can follow it up.
                    return {
                        "status": "failed",
                        "error": {
                            "code": "TRANSPORT_TIMEOUT",
                            "message": f"no update of task {reply.task.task_id} within {float(timeout):g} s;"
                            f" last known state {reply.task.state}",
                            "retryable": True,
                            "details": {"task_id": reply.task.task_id, "last_state": reply.task.state},
                        },
                        "accepted": reply.accepted,
                        "task_id": reply.task.task_id,
                    }
                payload = final.get("payload") if isinstance(final.get("payload"), dict) else {}
                answer: dict[str, Any] = {
                    "status": payload.get("status"),
                    "output": payload.get("output"),
                    "error": final.get("error"),
                    "from": final.get("from"),
                    "accepted": reply.accepted,
                    "task_id": reply.task.task_id,
                }
                for key in ("message", "problems"):
                    if payload.get(key) is not None:
                        answer[key] = payload[key]
                if final.get("context_id") is not None:
                    answer["context_id"] = final["context_id"]
                return answer
        except RemoteError as exc:
            return {"status": "failed", "error": exc.to_object(), "from": exc.envelope.get("from")}
        except RequestQueued as exc:
            return {"status": "queued", "inbox_id": exc.inbox_id, "to": target_id}
        except ProtocolError as exc:
            return {"status": "failed", "error": exc.to_object(), "local": True}
        return {
            "status": reply.status,
            "output": reply.output,
            "from": reply.envelope.get("from"),
            "accepted": reply.accepted,
            "task_id": reply.task_id,
            # Deliverables (§7.5), e.g. an output too large for one message (§18.9).
            **({"artifacts": reply.envelope["artifacts"]} if reply.envelope.get("artifacts") else {}),
            # An A2A peer's answer (a2a:<name>): mesh, report, charge, message/task ids.
            **({"a2a": reply.envelope["meta"][A2A_URI]}
               if isinstance(reply.envelope.get("meta"), dict) and A2A_URI in reply.envelope["meta"] else {}),
        }

    async def _refresh_credential(self) -> None:
        """A credential for the current roster, presented by a reconnect (§14.3)."""
        assert self.connection is not None
        if self.embedded is not None:
            self._jwt = self._mint_own_jwt()
        else:
            self._jwt = await self._obtain_joined_jwt()
        if self.node is not None:
            # Keep the attestation in step with the credential it was issued with.
            await self.node.set_trust_attestation(self._own_trust_attestation())
        await self.connection.reconnect()
        for _ in range(200):
            if self.connection.is_connected:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError("the mesh connection did not come back after presenting the new credential")

    async def add_agent(self, name: str, table: dict[str, Any]) -> dict[str, Any]:
        """Host a new agent at runtime: key, re-minted credential, reconnect, register."""
        from meshnode.config import AgentConfig

        if self.node is None or self.keystore is None:
            raise NotFound("the node is not running")
        if name in self.node.agents or name in (CLI_AGENT_NAME, BRIDGE_AGENT_NAME):
            raise InvalidParameter(f"an agent named {name!r} is already hosted")
        if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,63}", name):
            raise InvalidParameter("agent names match [a-z0-9][a-z0-9_-]{0,63}")
        try:
            agent_cfg = AgentConfig.model_validate({"plugin": name, **table})
        except ValueError as exc:
            raise InvalidParameter(f"[agents.{name}]: {exc}") from None
        if agent_cfg.plugin not in self.catalog.kinds:
            raise InvalidParameter(f"no installed plugin provides agent kind {agent_cfg.plugin!r}")
        store = self.keystore
        self.agent_keys[name] = await asyncio.to_thread(store.get_or_create, f"agent.{name}")
        self.failed_agents.pop(name, None)
        await self._refresh_credential()
        await self._host(name, agent_cfg.plugin, agent_cfg.settings, agent_cfg.interaction)
        if name in self.failed_agents:
            raise InvalidParameter(f"agent {name} failed to start: {self.failed_agents.pop(name)}")
        return self.node.agent_status(self.node.agents[name])

    async def remove_agent(self, name: str, *, deregister: bool = True, reconnect: bool = True) -> None:
        """Stop an agent (deregistering it by default: its broker buffer goes too).

        ``reconnect=False`` keeps the connection: the credential still covers the
        removed agent's subjects until the next renewal, which narrows it.
        """
        if self.node is None:
            raise NotFound("the node is not running")
        if name in (CLI_AGENT_NAME, BRIDGE_AGENT_NAME) or name not in self.node.agents:
            raise NotFound(f"no hosted agent named {name!r}")
        await self.node.unhost(name, deregister=deregister)
        self.agent_keys.pop(name, None)
        if reconnect:
            await self._refresh_credential()

    async def restart_agent(self, name: str, agent_cfg: Any = None) -> dict[str, Any]:
        """Stop and start one agent with its key kept (and its registration, inbox)."""
        if self.node is None:
            raise NotFound("the node is not running")
        hosted = self.node.agents.get(name)
        if hosted is None:
            raise NotFound(f"no hosted agent named {name!r}")
        cfg = agent_cfg or self.config.agents.get(name)
        kind = cfg.plugin if cfg is not None else hosted.kind
        settings = cfg.settings if cfg is not None else {}
        interaction = cfg.interaction if cfg is not None else hosted.interaction
        await self.node.unhost(name, deregister=False)
        self.failed_agents.pop(name, None)
        await self._host(name, kind, settings, interaction)
        if name in self.failed_agents:
            raise InvalidParameter(f"agent {name} failed to start: {self.failed_agents[name]}")
        return self.node.agent_status(self.node.agents[name])

    async def renew_now(self) -> dict[str, Any]:
        """Re-vouch and re-register every agent and renew the node credential now."""
        if self.node is None:
            raise NotFound("the node is not running")
        vouches = {}
        for hosted in list(self.node.agents.values()):
            await self.node.revouch(hosted)
            vouches[hosted.name] = hosted.vouch.get("expires_at")
        await self._refresh_credential()
        return {"credential": self._credential_status(), "vouches": vouches}

    async def reload(self) -> dict[str, Any]:
        from meshnode.daemon.operations import reload_config

        return await reload_config(self)

    async def _admin_agents_add(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        name, table = params.get("name"), params.get("config", {})
        if not isinstance(name, str) or not isinstance(table, dict):
            raise InvalidParameter("name (string) and config (object) are required")
        return await self.add_agent(name, table)

    async def _admin_agents_remove(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        name = params.get("name")
        if not isinstance(name, str):
            raise InvalidParameter("name is required")
        await self.remove_agent(name, deregister=bool(params.get("deregister", True)))
        return {"removed": name}

    # -- inbox (§8.3a, §16.4) --------------------------------------------------

    def _agent_name(self, agent_id: str) -> str:
        if self.node is not None:
            hosted = self.node.by_id.get(agent_id)
            if hosted is not None:
                return hosted.name
        return agent_id

    def _inbox_summary(self, row: Any, *, full: bool = False) -> dict[str, Any]:
        from meshnode.protocol.canonical import parse_json
        from meshnode.protocol.fencing import FrameProvenance, frame_payload
        from meshnode.protocol.protections import sender_body

        now = time.time_ns() // 1_000_000
        summary: dict[str, Any] = {
            "id": row.inbox_id,
            "agent": self._agent_name(row.agent),
            "agent_id": row.agent,
            "sender": row.sender,
            "kind": row.kind,
            "state": row.state,
            "age_s": max(0, (now - row.received_ms) // 1000),
            "msg_id": row.msg_id,
        }
        if row.note:
            summary["note"] = row.note
        try:
            env = parse_json(row.envelope)
        except ValueError:
            return summary
        if not isinstance(env, dict):
            return summary
        raw_payload = env.get("payload")
        payload: dict[str, Any] = raw_payload if isinstance(raw_payload, dict) else {}
        if row.kind == "request":
            summary["offering"] = payload.get("offering")
            # Sender text is shown only inside its provenance frame (§22.6).
            framed = frame_payload(sender_body(env), FrameProvenance.from_envelope(env, row.received_ms))
            if framed.field is not None:
                body = framed.payload
                summary["text"] = body.get(framed.field) if isinstance(body, dict) else body
        else:
            summary["in_reply_to"] = env.get("in_reply_to")
            summary["status"] = payload.get("status")
            summary["output"] = payload.get("output")
            if env.get("error"):
                summary["error"] = env.get("error")
        if full:
            summary["envelope"] = env
        return summary

    def _require_inbox(self) -> Any:
        if self.inbox is None or self.node is None:
            raise NotFound("the node inbox is not open")
        return self.inbox

    async def _admin_inbox_list(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        inbox = self._require_inbox()
        agent = params.get("agent")
        agent_id = None
        if isinstance(agent, str):
            hosted = self.node.agents.get(agent) if self.node else None
            agent_id = hosted.agent_id if hosted else agent
        states = params.get("states") or ["held", "interrupted"]
        if params.get("all"):
            states = None
        limit = params.get("limit", 100)
        if not isinstance(limit, int) or not 0 < limit <= 1000:
            raise InvalidParameter("limit must be an integer in 1..1000")
        rows = await inbox.rows(agent=agent_id, states=states, limit=limit)
        return {"messages": [self._inbox_summary(r) for r in rows], "counts": await inbox.counts()}

    async def _inbox_row(self, params: dict[str, Any]) -> Any:
        inbox = self._require_inbox()
        inbox_id = params.get("id")
        if not isinstance(inbox_id, int):
            raise InvalidParameter("id (an integer) is required")
        row = await inbox.get(inbox_id)
        if row is None:
            raise NotFound(f"no inbox message {inbox_id}")
        return row

    async def _admin_inbox_show(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        return self._inbox_summary(await self._inbox_row(params), full=True)

    async def _admin_inbox_reply(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        from meshnode.protocol.canonical import parse_json

        row = await self._inbox_row(params)
        if row.kind != "request" or row.state not in ("held", "interrupted"):
            raise InvalidParameter(f"message {row.inbox_id} is a {row.state} {row.kind}; only held requests take a reply")
        assert self.node is not None
        hosted = self.node.by_id.get(row.agent)
        if hosted is None:
            raise NotFound("the agent this message was for is not hosted any more")
        output = params.get("output")
        if output is None and isinstance(params.get("text"), str):
            output = {"text": params["text"]}
        status = params.get("status", "completed")
        if status not in ("completed", "failed"):
            raise InvalidParameter("status is completed or failed")
        request = parse_json(row.envelope)
        error = None
        if status == "failed":
            from meshnode.protocol.errors import error_object

            error = error_object(str(params.get("code", "UNAUTHORIZED")), str(params.get("message", "declined")))
        await hosted.answer(request, status=status, output=output, error=error)
        await self.inbox.set_state(row.inbox_id, "replied", time.time_ns() // 1_000_000)
        return {"replied": row.inbox_id, "to": row.sender}

    async def _admin_inbox_ack(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        row = await self._inbox_row(params)
        await self.inbox.set_state(row.inbox_id, "dismissed", time.time_ns() // 1_000_000)
        return {"dismissed": row.inbox_id}

    async def _admin_presence(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        if self.node is None:
            raise NotFound("the node is not running")
        query = {k: v for k, v in params.items() if k in ("node", "agent") and isinstance(v, str)}
        return await self._service(call, "mesh.presence.get", "request", query)

    async def _admin_discover(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        return await self._service(call, "mesh.registry.discover", "discover", dict(params))

    async def _service(self, call: CallContext, subject: str, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        if self.node is None:
            raise NotFound("the node is not running")
        cli = self.node.agents[CLI_AGENT_NAME]
        return await self.node.service_call(cli, subject, kind, payload)

    async def _admin_mesh_nodes(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        if self.control_plane is None:
            raise NotFound("this node runs no control plane (only the embedded-mesh node enrols nodes)")
        nodes = await asyncio.to_thread(self.control_plane.list_nodes)
        return {
            "nodes": [
                {
                    "node_id": n.node_id,
                    "name": n.name,
                    "trust_tier": n.trust_tier,
                    "tenant": n.tenant,
                    "enrolled_at": n.enrolled_at,
                    "retired_at": n.retired_at,
                    "last_issued_at": n.last_issued_at,
                    "credential_expires_at": n.credential_expires_at,
                }
                for n in nodes
            ]
        }

    async def _admin_mesh_info(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        return {
            "mode": "embedded" if self.embedded_mode else "joined",
            "name": self.config.node.name,
            "nats_urls": self.mesh_urls(),
            "control_plane": self.control_plane_url(),
            "node_id": self.node_key.public_key if self.node_key else None,
            # Set only when [mesh.embedded] monitor_port asks for it.
            "monitor_url": self.embedded.monitor_url if self.embedded is not None else None,
        }

    async def _admin_mesh_invite(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        if self.control_plane is None:
            raise NotFound("this node runs no control plane (only the embedded-mesh node invites)")
        name = params.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidParameter("name is required")
        trust_tier = params.get("trust_tier", "standard")
        if not isinstance(trust_tier, str):
            raise InvalidParameter("trust_tier must be a string")
        tenant = params.get("tenant") or "mesh"
        if not isinstance(tenant, str):
            raise InvalidParameter("tenant must be a string")
        try:
            bundle = await asyncio.to_thread(self.control_plane.invite, name, trust_tier, tenant)
        except ValueError as exc:
            raise InvalidParameter(str(exc)) from None
        log.info("invited node %s as %s (trust tier %s, tenant %s)", name, bundle.node_id, trust_tier, tenant)
        return {
            "trust_tier": trust_tier,
            "tenant": tenant,
            "name": bundle.node_name,
            "node_id": bundle.node_id,
            "node_seed": bundle.node_seed,
            "jwt": bundle.jwt,
            "nats_urls": self.mesh_urls(),
            "control_plane": self.control_plane_url(),
        }

    # -- run and stop ----------------------------------------------------------

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self._on_sigint)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)

    def _on_sighup(self) -> None:
        # Signal handlers only set things in motion; the reload runs as a task.
        if not self.started:
            return
        task = asyncio.get_running_loop().create_task(self._reload_from_signal())
        self._signal_tasks.add(task)
        task.add_done_callback(self._signal_tasks.discard)

    async def _reload_from_signal(self) -> None:
        try:
            await self.reload()
        except Exception as exc:
            log.error("reload failed; the previous configuration stays in force: %s", exc)

    def _on_sigint(self) -> None:
        self._force += 1
        if self._force > 1:
            log.error("second interrupt: exiting now")
            os._exit(130)
        self.request_stop()

    def request_stop(self) -> None:
        self._stop.set()

    def _on_connection_lost(self) -> None:
        # Start over in a fresh process image: start-up renews the credential
        # before connecting (§4.8), which is exactly what a lapsed one needs.
        self.relaunch = True
        self.request_stop()

    async def wait(self) -> None:
        await self._stop.wait()

    async def _watchdog_loop(self) -> None:
        interval = (self.notifier.watchdog_interval or 60.0) / 2
        while True:
            await asyncio.sleep(interval)
            # Ping only while the core is alive: a wedged connection must not look healthy.
            if self.connection is not None and (self.connection.is_connected or self.embedded is None):
                self.notifier.watchdog()

    async def stop(self) -> None:
        self.notifier.stopping()
        stages = [
            Stage("stop-intake", SHUTDOWN_BUDGETS["stop-intake"], self._shutdown_intake),
            Stage("stop-agents", SHUTDOWN_BUDGETS["stop-agents"], self._shutdown_agents),
            Stage("final-write", SHUTDOWN_BUDGETS["final-write"], self._shutdown_final_write),
            Stage("close-connection", SHUTDOWN_BUDGETS["close-connection"], self._shutdown_connection),
            Stage("stop-services", SHUTDOWN_BUDGETS["stop-services"], self._shutdown_services),
            Stage("stop-mesh-server", SHUTDOWN_BUDGETS["stop-mesh-server"], self._shutdown_mesh),
        ]
        for stage in stages:
            await run_stage(stage, critical=False)
        if self._watchdog is not None:
            self._watchdog.cancel()

    async def _shutdown_intake(self) -> None:
        if self.a2a is not None:
            await self.a2a.stop_intake()
        if self.admin is not None:
            await self.admin.close(timeout=2.0)
        if self.node is not None:
            for hosted in self.node.agents.values():
                for sub in list(hosted.subscriptions):
                    try:
                        await sub.unsubscribe()
                    except Exception:
                        pass
                hosted.subscriptions.clear()

    async def _shutdown_agents(self) -> None:
        if self.node is None:
            return
        await self.node.stop_jobs()
        for name in list(self.node.agents):
            await self.node.unhost(name, grace=3.0)

    async def _sweep(self, inbox: Any) -> None:
        result = await inbox.sweep(time.time_ns() // 1_000_000)
        if result.get("trimmed_seen"):
            log.info("inbox sweep trimmed %d remembered pairs", result["trimmed_seen"])

    async def _shutdown_final_write(self) -> None:
        """Flush the inbox's write-behind and checkpoint its WAL."""
        if self._sweep_job is not None:
            await self._sweep_job.stop()
        if self.a2a is not None:
            await self.a2a.close()
        if self.inbox is not None:
            await self.inbox.close()
        if self.a2a_charges is not None:
            await self.a2a_charges.close()

    async def _shutdown_connection(self) -> None:
        if self._jwt_job is not None:
            await self._jwt_job.stop()
        for service in reversed(self.services):
            try:
                await service.stop()
            except Exception as exc:
                log.warning("stopping %s failed: %s", type(service).__name__, exc)
        for connection in self.tenant_connections.values():
            await connection.close(drain_timeout=3.0)
        if self.connection is not None:
            await self.connection.close(drain_timeout=3.0)

    async def _shutdown_services(self) -> None:
        if self.control_plane is not None:
            await self.control_plane.stop()

    async def _shutdown_mesh(self) -> None:
        if self.embedded is not None:
            await self.embedded.stop()


async def run_daemon(config: Config) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit status."""
    daemon = Daemon(config)
    daemon.install_signal_handlers()
    try:
        await daemon.start()
    except StageFailed as exc:
        log.error("%s", exc)
        await daemon.stop()
        return 1
    try:
        await daemon.wait()
    finally:
        log.info("stopping")
        await daemon.stop()
    if daemon.relaunch:
        return RELAUNCH
    return 0


#: run_daemon's answer when the process should start over (see ``relaunch``).
RELAUNCH = -1


def relaunch_process() -> None:
    """Replace this process with a fresh ``meshnode run`` (same pid, same arguments):
    the new start renews a lapsed credential before connecting."""
    import sys

    log.warning("re-executing meshnode to renew its credential and reconnect")
    logging.shutdown()
    os.execv(sys.executable, list(sys.orig_argv))
