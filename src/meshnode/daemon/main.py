"""The daemon: configuration in, a running node out, and a clean way back down.

Start-up runs in named stages (keys → plugins → mesh → connect → services →
agents → a2a → admin); any failure is fatal and reported with its stage.
Agents are hosted one by one and a failing one is stopped alone. Each stage
pushes the undo of what it started onto :class:`~.lifecycle.Shutdown`, under
the budgeted shutdown stage it belongs to, so stopping is start-up in reverse.

The pieces live beside this module: :mod:`.mesh` (embedded server, control
plane, credentials, connections), :mod:`.platform` (the platform services),
:mod:`.hosting` (keys, plugins, the node and its agents), :mod:`.gateways`
(A2A), :mod:`.methods`, :mod:`.operations` and :mod:`.artifacts` (the admin
API; :mod:`.operations` also applies a reloaded configuration).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import stat
import sys
import time
from pathlib import Path
from typing import Any

import meshnode
from meshnode.admin.protocol import AdminError, NotReady, Refused
from meshnode.admin.server import AdminServer, MethodRegistry
from meshnode.aio import BackgroundTasks, SharedRuns, wait_for
from meshnode.config import AgentConfig, Config, ConfigError, ConfigProblem
from meshnode.control_plane import ControlPlaneServer, CredentialRefused
from meshnode.daemon.agreements import register_agreement_methods
from meshnode.daemon.allowance import open_allowances, register_allowance_methods
from meshnode.daemon.artifacts import register_artifact_methods
from meshnode.daemon.broker import broker_watch
from meshnode.daemon.credentials import CredentialUnavailable
from meshnode.daemon.datalock import DataDirBusy, DataDirLock
from meshnode.daemon.gateways import A2AGateways
from meshnode.daemon.hosting import AgentHost, load_plugin_catalog, ms, node_settings
from meshnode.daemon.lifecycle import DaemonState, Shutdown, Stage, StageFailed, run_stage
from meshnode.daemon.mesh import MeshLink, MeshUnreachable, credential_profile
from meshnode.daemon.methods import CoreMethods, register_core_methods
from meshnode.daemon.operations import register_operations, reload_config
from meshnode.daemon.platform import (
    PlatformServices,
    PlatformSettings,
    start_platform_services,
    stream_limits,
)
from meshnode.daemon.sdnotify import Notifier
from meshnode.daemon.startup_gc import start_up_heap
from meshnode.daemon.statusboard import LISTED_AGENTS_MAX, StatusBoard
from meshnode.daemon.storewatch import StoreWatch
from meshnode.daemon.taskdump import dump_tasks
from meshnode.daemon.terminal import register_terminal_methods
from meshnode.keystore import KeyStore, KeyStoreUnavailable, open_keystore
from meshnode.node.agreement_lookup import PlatformAgreements
from meshnode.node.commerce import AgreementGate, AgreementStore
from meshnode.node.hosted import HostedAgent
from meshnode.node.inbox import InboxStore
from meshnode.node.meter_outbox import MeterJournal, MeterOutbox
from meshnode.node.observe import ObservabilitySettings, install
from meshnode.node.open_tasks import OpenTask, OpenTaskJournal, end_left_open
from meshnode.node.periodic import PeriodicJob
from meshnode.node.pipeline import RefusalCounter
from meshnode.node.runtime import Node
from meshnode.node.states import AgentState
from meshnode.node.usage_log import UsageLog
from meshnode.plugins import PluginLoadError, PluginManager
from meshnode.protocol.attestations import same_standing_until
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.ratelimit import SlidingWindowLimiter
from meshnode.services.base import NodeBudget, ServiceBase, ServiceContext
from meshnode.transport.connection import MeshConnection
from meshnode.transport.embedded import EmbeddedNatsServer, imported_agents
from meshnode.transport.errors import NoResponders, NotConnected, TransportTimeout, Unavailable
from meshnode.transport.liveness import BrokerWatch

__all__ = ["RELAUNCH", "Daemon", "credential_profile", "relaunch_process", "run_daemon"]

log = logging.getLogger("meshnode.daemon")

#: Through a roster change the manifests keep the attestation they carry while
#: it expires at most this share of the credential's lifetime before the new
#: credential does (2 h of the default 24 h).
ATTESTATION_SLACK = 1 / 12

#: What a joined node's platform start retries: the states of a cluster that is
#: still electing stream leaders (timeouts, 503s, nobody answering yet).
_TRANSIENT_BROKER_ERRORS = (TimeoutError, TransportTimeout, Unavailable, NoResponders, NotConnected)


class Daemon:
    """One meshnode process: embedded or joined mesh, services, agents, admin socket.

    Plugins' admin methods receive this object (``meshnode_admin_methods``).
    """

    def __init__(self, config: Config, *, notifier: Notifier | None = None) -> None:
        self._config = config
        self.notifier = notifier or Notifier()
        self.data_dir = Path(config.node.data_dir)
        # Held from the first start stage until the very end of stop (module datalock).
        self.data_lock: DataDirLock | None = None
        self.state = DaemonState.CREATED
        self.keystore: KeyStore | None = None
        self.hosting: AgentHost | None = None
        self.plugin_manager = PluginManager()
        self.mesh: MeshLink | None = None
        self.node: Node | None = None
        #: Inbound refusals of the node and of the services it hosts: one counter.
        self.refusals = RefusalCounter()
        self.platforms: list[PlatformServices] = []
        self.admin: AdminServer | None = None
        self.inbox: InboxStore | None = None
        self.meter_outbox: MeterOutbox | None = None
        self.gateways = A2AGateways()
        self.methods = CoreMethods(self)
        #: What the status socket answers from while the loop is blocked (#23 item 10).
        self.status_board = StatusBoard(lambda: self.node.watchdog if self.node is not None else None)
        self._shutdown = Shutdown()
        self._failed_agents: dict[str, str] = {}
        #: Tasks the last process left open (read at the inbox stage), ended after the agents start.
        self._tasks_left_open: list[OpenTask] = []
        self._watchdog: asyncio.Task[None] | None = None
        #: Is the broker still answering (issue #23 item 11); from the connect stage on.
        self.broker_watch: BrokerWatch | None = None
        self._stop = asyncio.Event()
        self._signal_tasks = BackgroundTasks()
        #: Roster changes at once share one credential and one reconnect (issue #21).
        self._credential_refreshes = SharedRuns(self._refresh_credential_now)
        #: The store reading of a service node (None elsewhere), issue #22.3.
        self.store_watch: StoreWatch | None = None
        #: One per tenant beside the mesh's own (each is an account with its own store).
        self.tenant_store_watches: dict[str, StoreWatch] = {}
        #: Set when the connection was lost for good: the process re-executes itself.
        self.relaunch = False
        #: Set when the mesh refused this node for good while it ran: the exit status.
        self.exit_code: int | None = None
        self._reauthorize_not_before = 0.0
        self._reauthorize_backoff_s = REAUTHORIZE_FIRST_RETRY_S
        self._force = 0
        #: The start-up stage in flight (None outside start-up).
        self.stage: str | None = None

    # -- what the parts hold (for the admin methods and plugins) ----------------

    @property
    def config(self) -> Config:
        return self._config

    @config.setter
    def config(self, config: Config) -> None:
        # A reload swaps the configuration; the mesh link reads it at each renewal.
        self._config = config
        if self.mesh is not None:
            self.mesh.config = config

    @property
    def started(self) -> bool:
        return self.state in (DaemonState.SERVING, DaemonState.RELOADING)

    @property
    def embedded_mode(self) -> bool:
        return not self.config.mesh.servers

    @property
    def runs_services(self) -> bool:
        """Whether this node serves the platform services: ``[services] run``,
        by default only the embedded-mesh node."""
        run = self.config.services.run
        return self.embedded_mode if run is None else run

    @property
    def node_key(self) -> KeyPair | None:
        return self.hosting.node_key if self.hosting is not None else None

    @property
    def failed_agents(self) -> dict[str, str]:
        return self.hosting.failed_agents if self.hosting is not None else self._failed_agents

    def hold_out_of_reloads(self, name: str) -> None:
        """``agents remove`` of an agent the file still has: reloads leave it removed."""
        self._hosting().removed_by_hand.add(name)

    def agent_status(self, hosted: HostedAgent) -> dict[str, Any]:
        """A hosted agent for Status, Agents.List and Agents.Show: the node's view,
        and for one whose start failed, why (the node keeps only the state)."""
        assert self.node is not None, "a hosted agent has its node"
        entry = self.node.agent_status(hosted)
        if hosted.state is AgentState.FAILED:
            entry["failure"] = self.failed_agents.get(hosted.name)
        return entry

    @property
    def embedded(self) -> EmbeddedNatsServer | None:
        return self.mesh.embedded if self.mesh is not None else None

    @property
    def control_plane(self) -> ControlPlaneServer | None:
        return self.mesh.control_plane if self.mesh is not None else None

    @property
    def connection(self) -> MeshConnection | None:
        return self.mesh.connection if self.mesh is not None else None

    @property
    def services(self) -> list[ServiceBase]:
        return [s for platform in self.platforms for s in platform.all()]

    def mesh_urls(self) -> list[str]:
        return self.mesh.mesh_urls() if self.mesh is not None else list(self.config.mesh.servers)

    def control_plane_url(self) -> str | None:
        if self.mesh is not None:
            return self.mesh.control_plane_url()
        return str(self.config.mesh.control_plane) if self.config.mesh.control_plane else None

    def credential_status(self) -> dict[str, Any] | None:
        return self.mesh.credential_status() if self.mesh is not None else None

    def replicas(self) -> int:
        return self.mesh.replicas() if self.mesh is not None else 1

    # -- start -----------------------------------------------------------------

    async def start(self) -> None:
        self.state = DaemonState.STARTING
        # Budgets guard against hangs; the per-agent stages grow with the roster
        # (a first start of 10,000 agents writes 10,000 keys and registrations).
        n_agents = len(self.config.agents)
        stages = [
            Stage("keys", 30.0 + 0.01 * n_agents, self._stage_keys),
            Stage("plugins", 30.0, self._stage_plugins),
            Stage("mesh", 60.0, self._stage_mesh),
            Stage("connect", 5.0 + self.config.mesh.connect_timeout.total_seconds(), self._stage_connect),
            # Joined: a cluster restarted moments ago answers before its streams
            # have leaders; the platform start retries through that (see
            # _start_platform), so the stage allows it the time.
            Stage("services", 30.0 if self.embedded_mode else 120.0, self._stage_services),
            # The admin socket comes up before the agents start (issue #23 item 2):
            # an operator can see (Status, state "starting") and stop a daemon
            # whose plugins are slow or stuck in on_start.
            Stage("inbox", 30.0, self._stage_inbox),
            Stage("admin", 10.0, self._stage_admin),
            Stage("agents", 120.0 + 0.05 * n_agents, self._stage_agents),
            Stage("a2a", 30.0, self._stage_a2a),
        ]
        try:
            with start_up_heap():
                for stage in stages:
                    self.stage = stage.name
                    self.notifier.status(f"starting: {stage.name}")
                    await run_stage(stage, critical=True)
        except asyncio.CancelledError:
            # A stop asked for during start-up (start_unless_stopped): not a
            # failure; the shutdown stages undo what did start.
            self.state = DaemonState.STOPPING
            raise
        except BaseException:
            self.state = DaemonState.FAILED
            raise
        finally:
            self.stage = None
        self.state = DaemonState.SERVING
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

    async def start_unless_stopped(self) -> bool:
        """:meth:`start`, abandoned as soon as a stop is asked for (SIGTERM, SIGINT).

        Returns True once serving, False when a stop came first: the stage in
        flight is cancelled (its task, and with it every agent's ``on_start``
        and registration still waiting) and the stages after it never run. What
        did start has pushed its undo onto the shutdown stages as it came up, so
        the caller's :meth:`stop` unwinds exactly that, the inbox's final write
        included (issue #23: a daemon registering hundreds of agents used to
        finish the whole ``agents`` stage, up to its budget, before it stopped).
        Raises what :meth:`start` raised (StageFailed).
        """
        start = asyncio.ensure_future(self.start())
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if start.done():
            start.result()
            return True
        stage = self.stage
        log.info("stop requested during start-up (stage %s): cancelling it", stage or "?")
        start.cancel()
        # What the cancelled stage awaits unwinds (an agent's start is given
        # supervise's own grace); one that swallows the cancellation is left
        # behind rather than holding the process.
        await asyncio.wait({start}, timeout=START_CANCEL_GRACE_S)
        if not start.done():
            log.warning("start-up stage %s did not unwind within %g s; stopping anyway", stage, START_CANCEL_GRACE_S)
        elif not start.cancelled() and start.exception() is not None:
            log.info("start-up stage %s ended while cancelled: %s", stage, start.exception())
        return False

    async def _stage_keys(self) -> None:
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            # The operator's setting to fix (exit 78), said like every configuration error.
            source = self.config.source_file
            raise ConfigError([ConfigProblem(
                str(source) if source is not None else "the configuration", "node.data_dir",
                f"cannot create the data directory {self.data_dir}: {exc.strerror or exc}",
            )], source) from None
        # Before anything in the directory is touched: one daemon per data directory.
        self.data_lock = DataDirLock.acquire(self.data_dir)
        tighten_data_dir(self.data_dir, self.config)
        self.keystore = await asyncio.to_thread(open_keystore, self.config.keystore.backend, self.data_dir)
        self.hosting = await AgentHost.open(
            self.config, self.keystore, runs_services=self.runs_services, embedded=self.embedded_mode
        )
        self.hosting.failed_agents.update(self._failed_agents)

    async def _stage_plugins(self) -> None:
        hosting = self._hosting()
        self.plugin_manager, hosting.catalog = load_plugin_catalog(self.config, hosting.failed_agents)

    async def _stage_mesh(self) -> None:
        hosting = self._hosting()
        self.mesh = MeshLink(self.config, self.data_dir, hosting.node_key, hosting.roster)
        await self.mesh.start(self._shutdown)

    async def _stage_connect(self) -> None:
        mesh = self._mesh()
        # A joined node the broker refuses asks its control plane (_on_mesh_error),
        # from the first attempt on: a node that was off while its mesh node was
        # rebuilt is refused at start.
        joined = not mesh.embedded_mode and bool(self.config.mesh.control_plane)
        connection = await mesh.connect(
            self._shutdown, self._on_connection_lost, self._on_mesh_error if joined else None
        )
        if joined:
            connection.on_reconnect(self._on_mesh_back)
            self._reauthorize_reset()
        job = mesh.renewal_job(self._renew_credential)
        job.start()
        self._shutdown.push("close-connection", job.stop)
        self.broker_watch = broker_watch(self.config.mesh, connection, mesh.embedded)
        self.broker_watch.start()
        self._shutdown.push("close-connection", self.broker_watch.stop)

    async def _stage_services(self) -> None:
        if not self.runs_services:
            return
        mesh, hosting = self._mesh(), self._hosting()
        assert mesh.connection is not None
        # §16.1: one per-sender counter across every service subject (and tenant).
        registry = self.config.registry
        window_ms = ms(registry.rate_window)
        limiter = SlidingWindowLimiter(limit=registry.rate_limit, window_ms=window_ms)
        # Beside it, per node (fresh sender keys do not multiply a node's budget).
        self._node_limiter = SlidingWindowLimiter(registry.node_rate_limit, window_ms, max_keys=10_000)
        self._unvouched_limiter = SlidingWindowLimiter(registry.unvouched_rate_limit, window_ms)
        await self._start_platform(mesh.connection, limiter, "mesh", hosting)
        self.store_watch = self._watch_store(mesh.connection)
        # §15: every tenant is its own account, so its own registry, presence,
        # task records, feeds and artifacts (streams and KV are account-scoped).
        # The services keep the same keys in every tenant: one platform, whose
        # replies an exported discovery query can pin like any other.
        for tenant in mesh.embedded.tenants if mesh.embedded is not None else ():
            connection = await mesh.connect_tenant(tenant, self._shutdown, self._on_connection_lost)
            await self._start_platform(connection, limiter, tenant, hosting)
            # Its store fills apart from the mesh's (its agents' mailboxes, its
            # tasks): watched and reported the same way, under its name.
            self.tenant_store_watches[tenant] = self._watch_store(connection, label=f"tenant {tenant}")
            log.info("platform services serve tenant %s", tenant)

    def _watch_store(self, connection: MeshConnection, label: str = "") -> StoreWatch:
        """Watch one account's JetStream store, from now until the intake stops
        (before the connection closes)."""
        s = self.config.storage
        watch = StoreWatch(
            connection.jetstream, threshold=s.low_store_warning,
            interval_s=s.check_interval.total_seconds(), label=label,
        )
        watch.start()
        self._shutdown.push("stop-intake", watch.stop)
        return watch

    async def _start_platform(
        self, connection: MeshConnection, limiter: SlidingWindowLimiter, tenant: str, hosting: AgentHost
    ) -> None:
        """Registry, presence, artifacts, task manager and feeds on ``tenant``'s account."""
        mesh = self._mesh()
        replicas = mesh.replicas()
        log.info("platform services (%s): JetStream objects with %d replica(s)", tenant, replicas)

        limits = stream_limits(self.config)
        # One node budget per account: each tenant's registry knows its own nodes;
        # the limiters are shared, so a node is one node across tenants.
        budget = NodeBudget(self._node_limiter, self._unvouched_limiter)

        def context(name: str) -> ServiceContext:
            return ServiceContext(
                connection=connection,
                key=hosting.service_key(name),
                node_id=hosting.node_key.public_key,
                now_ms=lambda: time.time_ns() // 1_000_000,
                log=logging.getLogger(f"meshnode.service.{name}"),
                replicas=replicas,
                limiter=limiter,
                node_budget=budget,
                refusals=self.refusals,
                stream_limits=limits,
            )

        plane = mesh.control_plane
        attempt = 0
        while True:
            try:
                platform = await self._start_platform_once(context, mesh, plane, tenant)
                break
            except _TRANSIENT_BROKER_ERRORS as exc:
                if self.embedded_mode:
                    raise  # our own broker, started just now: not a state that passes
                attempt += 1
                log.warning(
                    "platform services (%s) could not start yet, JetStream not ready (%s: %s); "
                    "retry %d (the 'services' stage gives up after its budget)",
                    tenant, type(exc).__name__, exc, attempt,
                )
                await asyncio.sleep(min(5.0, 0.5 * 2 ** (attempt - 1)))
        self.platforms.append(platform)
        self._shutdown.push("close-connection", platform.stop)

    async def _start_platform_once(
        self, context: Any, mesh: MeshLink, plane: Any, tenant: str
    ) -> PlatformServices:
        return await start_platform_services(
            context,
            PlatformSettings.from_config(self.config),
            is_revoked=plane.agent_retired if plane is not None else None,
            # The operator-attested tier from enrolment (§9.7), known only to the
            # control plane: the sandbox clamp and discovery's tier filter.
            trust_tier_of=plane.trust_tier_of if plane is not None else None,
            # Portable attestations (§9.7) are believed from this mesh's operator only.
            trusted_issuers=mesh.trusted_issuers(),
            # Agents other tenants exported here resolve through their own registry.
            imported=imported_agents(tenant, mesh.embedded.exports) if mesh.embedded is not None else {},
            wait_ready=not self.embedded_mode,
            # SDK agents' enrolments (§14.1 untokenized registration), from the control plane.
            sdk_agent_of=plane.sdk_agent_of if plane is not None else None,
        )

    async def _stage_inbox(self) -> None:
        # Its own stage, before admin: the inbox is open (and a forced exit can
        # do its final write) by the time the admin socket answers.
        p = self.config.protections
        inbox = InboxStore(self.data_dir / "inbox.sqlite3", seen_max_age_ms=ms(p.mailbox_max_age))
        self._shutdown.push("final-write", inbox.close)
        await inbox.open()
        self.inbox = inbox
        recovered = await inbox.recover_interrupted(time.time_ns() // 1_000_000)
        if recovered:
            log.warning("%d inbox message(s) were being handled when the node last stopped; kept as interrupted", recovered)
        # Before any agent runs: every task in the journal now is one the last
        # process left open; they are ended once their agents are back.
        self._tasks_left_open = OpenTaskJournal(inbox).left_open()

    async def _stage_agents(self) -> None:
        mesh, hosting = self._mesh(), self._hosting()
        assert mesh.connection is not None
        p = self.config.protections
        inbox = self.inbox
        assert inbox is not None
        await self.gateways.open_outbound(self.config, self.data_dir, hosting.node_key, self._shutdown)
        node = Node(
            settings=node_settings(self.config),
            node_key=hosting.node_key,
            connection=mesh.connection,
            inbox=inbox,
            check_sender_vouch=p.check_sender_vouch,
            trust_attestation=mesh.trust_attestation(),
            a2a=self.gateways.outbound,
            refusals=self.refusals,
            grants=mesh.grants,
        )
        # §19.5: agreements this node enforces at admission (node-local store).
        c = self.config.commerce
        # §13.5: the meter events also go on the mesh, for the rating service:
        # queued, published off the request path, retried while JetStream is
        # away; the usage log is the outbox's journal (what a stop or a crash
        # left unpublished goes out after the next start, once the agents are hosted).
        usage = UsageLog(self.data_dir / "usage.jsonl", max_bytes=c.usage_log_max_bytes)
        outbox = self.meter_outbox = MeterOutbox(journal=MeterJournal(usage)) if c.publish_usage else None
        if outbox is None:
            MeterJournal(usage).forget()  # what is logged meanwhile stays the node's, even once publishing again
        node.commerce = AgreementGate(
            AgreementStore(self.data_dir / "agreements.json"),
            approval_surface=c.approval_url, gate_free_terms=c.gate_free_terms,
            usage=usage,
            publisher=outbox,
        )
        if outbox is not None:
            self.gateways.publish_charges(node, outbox)  # A2A charges land in the same ledger (§19.6)
            # After the agents stopped (their last events are queued), while the
            # connection is still up: flush what the stage's budget allows.
            self._shutdown.push("final-write", lambda: outbox.close(timeout=3.0))
        if c.platform_agreements:
            # ... and those owners registered with the platform (§19.5), asked
            # once per (owner, seller, SKU) and remembered, dropped on its events.
            platform_agreements = PlatformAgreements(node, ttl_s=c.agreement_cache_ttl.total_seconds())
            await platform_agreements.start()
            self._shutdown.push("stop-intake", platform_agreements.close)
            node.commerce.platform = platform_agreements
        # EXT-8: the owners' allowances of the hosted agents, their spend persisted.
        node.allowance = open_allowances(self.config, self.data_dir, node.now_ms)
        keeper = node.allowance

        async def close_allowances() -> None:
            keeper.close()

        self._shutdown.push("final-write", close_allowances)
        self.node = hosting.node = node
        # The services this daemon runs emit platform events (§5.3 step 2 exempts them).
        node.platform_keys.update(k.public_key for n, k in hosting.agent_keys.items() if n.startswith("service."))
        # Broker refusals counted always; spans/logs/metrics only when enabled (§13).
        o = self.config.observability
        install(node, ObservabilitySettings(
            spans=o.spans, logs=o.logs, log_level=logging.getLevelName(o.log_level.upper()),
            metrics=o.metrics, metrics_interval_s=o.metrics_interval.total_seconds(),
        ))
        sweep = PeriodicJob("inbox-sweep", lambda: self._sweep(inbox), 3600.0, jitter=0.1, first_delay=60.0)
        sweep.start()
        # Agents stop while the connection is up; their inbox subscriptions first.
        self._shutdown.push("stop-intake", hosting.stop_intake)
        self._shutdown.push("stop-agents", hosting.stop_all)
        self._shutdown.push("final-write", sweep.stop)
        # Before the agents: an on_start that blocks the loop is seen too.
        node.start_watchdog()
        await hosting.host_roster(self.config)
        if self._tasks_left_open and node.open_tasks is not None:
            left, self._tasks_left_open = self._tasks_left_open, []
            ended = await end_left_open(left, node.by_id, node.open_tasks)
            log.warning("%d task(s) were left open when the node last stopped; %d ended, their requesters told",
                        len(left), ended)
        if outbox is not None:
            outbox.resume(node.by_id.get)
            await self.gateways.republish_charges(node)
        node.start_heartbeat()
        node.start_registration_check()

    async def _sweep(self, inbox: InboxStore) -> None:
        result = await inbox.sweep(time.time_ns() // 1_000_000)
        if result.get("trimmed_seen") or result.get("expired_seen"):
            log.info("inbox sweep: %d remembered pairs past their age and %d past the per-agent bound deleted",
                     result["expired_seen"], result["trimmed_seen"])

    async def _stage_a2a(self) -> None:
        """The inbound A2A bridge (off unless ``[a2a] listen`` is set)."""
        if self.node is None:
            return
        await self.gateways.start_bridge(self.config, self.node, self.failed_agents, self.data_dir, self._shutdown)

    async def _stage_admin(self) -> None:
        methods = MethodRegistry()
        self.methods = register_core_methods(self, methods)
        register_operations(self, methods)
        register_artifact_methods(self, methods)
        register_agreement_methods(self, methods)
        register_allowance_methods(self, methods)
        register_terminal_methods(self, methods)  # #18: Tasks.Follow, Events.*
        self.plugin_manager.add_admin_methods(methods, self)
        admin = AdminServer(
            self.config.admin.socket,
            group=self.config.admin.group,
            mode=self.config.admin.effective_mode,
            methods=methods,
            info=lambda: {"node_id": self.node_key.public_key if self.node_key else None},
            status_answer=self.status_board.answer,
        )
        self.admin = admin
        self._shutdown.push("stop-intake", lambda: admin.close(timeout=2.0))
        await admin.start()
        board = self.status_board
        self._shutdown.push("stop-intake", board.stop)
        board.start(self._board_snapshot)

    def _board_snapshot(self) -> dict[str, Any]:
        listed = self.node is None or len(self.node.agents) <= LISTED_AGENTS_MAX
        return self.status(agents_listed=listed)

    def _hosting(self) -> AgentHost:
        assert self.hosting is not None, "the keys stage runs first"
        return self.hosting

    def _mesh(self) -> MeshLink:
        assert self.mesh is not None, "the mesh stage runs first"
        return self.mesh

    # -- credentials -----------------------------------------------------------

    async def _renew_credential(self) -> None:
        # Never beside a roster change's refresh: a renewal that read the roster
        # before an agent was added, and adopted its credential after that
        # agent's, would take the agent's grants away until the next change.
        async with self._credential_refreshes.alone():
            mesh = self._mesh()
            if not await mesh.renew_if_due():
                return
            await self._follow_credential(mesh)
            await mesh.present()

    async def _refresh_credential(self, *, force: bool = False) -> None:
        """A credential for the current roster, presented by a reconnect (§14.3);
        none when it would grant exactly what the one in force grants (a
        service-role node's grants name no agent), unless ``force``.

        Roster changes made at once share it: a joined node asks the control
        plane for each credential, which allows ``node_rate_limit`` a minute
        per node, and each one costs a reconnect. Twenty agents added side by
        side asked twenty times, and past the limit each waited out a minute.
        Now a change waits for the refresh under way, if any, and the next one
        serves every change made meanwhile."""
        await self._credential_refreshes(force)

    async def _refresh_credential_now(self, force: bool) -> None:
        mesh = self._mesh()
        if not await mesh.reissue(force=force):
            log.debug("the roster change leaves the node credential's grants as they are: no reconnect")
            return
        await self._follow_credential(mesh)
        await mesh.present(wait=True)

    async def _follow_credential(self, mesh: MeshLink) -> None:
        """The node takes what comes with a new credential: the grants it carries,
        and the attestation re-issued with it, which every manifest then carries
        (a re-registration of every agent). Kept instead: an attestation of the
        same standing that expires at most :data:`ATTESTATION_SLACK` of the
        credential's lifetime before the new credential does.

        Why: a roster change (an agent added or removed) re-mints the credential,
        and with it an attestation that differs only in its lifetime.
        Re-registering every agent for that made adding or removing one agent
        O(roster): 22-26 s each at 10,000 agents. Now a burst of roster changes
        re-registers every agent at most once per slack; a renewal (two thirds
        through the credential's life) always brings a fresh one, and the
        manifests' attestation outlives a late renewal by all but the slack of
        the last third, as before.
        """
        if self.node is None:
            return
        fresh = mesh.trust_attestation()
        span = mesh.credential_span_ms()
        held = self.node.trust_attestation
        keep_until = None if span is None else span[1] - int((span[1] - span[0]) * ATTESTATION_SLACK)
        if keep_until is None or not same_standing_until(held, fresh, keep_until):
            await self.node.set_trust_attestation(fresh)
        self.node.grants = mesh.grants

    # -- operations (admin methods, reload and plugins call these) ---------------

    def status(self, *, agents_listed: bool = True) -> dict[str, Any]:
        """Node and agent status (the admin ``Status`` result), with the whole
        agent list: no reply's size bounds a caller in this process."""
        return self.methods.snapshot(agents_listed=agents_listed, page_bytes=None)

    async def add_agent(self, name: str, table: dict[str, Any]) -> dict[str, Any]:
        """Host a new agent at runtime: key, re-minted credential and reconnect (when
        its grants change), register."""
        return await self._hosting().add(self.config, name, table, self._refresh_credential)

    async def add_agents(self, tables: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any] | Exception]:
        """Host new agents at runtime with one credential for them all: each name's
        status, or the admin error saying why it is not hosted."""
        return await self._hosting().add_many(self.config, tables, self._refresh_credential)

    async def remove_agent(self, name: str, *, deregister: bool = True, reconnect: bool = True) -> None:
        """Stop an agent (deregistering it by default: its broker buffer goes too).

        ``reconnect=False`` keeps the connection: the credential still covers the
        removed agent's subjects until the next renewal, which narrows it.
        """
        if not reconnect:
            await self._hosting().remove(name, deregister=deregister)
            return
        _, failed = await self.remove_agents([name], deregister=deregister)
        if failed:
            raise failed[name]

    async def remove_agents(
        self, names: list[str], *, deregister: bool = True
    ) -> tuple[list[str], dict[str, AdminError]]:
        """Stop several agents, then present one credential without them all:
        the names removed, and why each other one was not (not hosted).

        Raises :class:`NotReady` when the credential could not be renewed: the
        agents are gone from this node either way (named in its ``params``)."""
        hosting = self._hosting()
        removed: list[str] = []
        failed: dict[str, AdminError] = {}
        for name in names:
            try:
                await hosting.remove(name, deregister=deregister)
            except AdminError as exc:
                failed[name] = exc
            else:
                removed.append(name)
        if removed:
            try:
                await self._refresh_credential()
            except (ConnectionError, CredentialUnavailable) as exc:
                # The agents are gone from this node either way; only the credential lags.
                which = f"agent {removed[0]}" if len(removed) == 1 else f"{len(removed)} agents"
                raise NotReady(
                    f"{which} removed, but the node credential still covers {'it' if len(removed) == 1 else 'them'} "
                    f"until it is renewed: {exc}",
                    {"removed": removed, "failed": {n: e.to_wire() for n, e in failed.items()}},
                ) from None
        return removed, failed

    async def restart_agent(self, name: str, agent_cfg: AgentConfig | None = None) -> dict[str, Any]:
        """Stop and start one agent with its key kept (and its registration, inbox)."""
        return await self._hosting().restart(self.config, name, agent_cfg)

    async def renew_now(self) -> dict[str, Any]:
        """Re-vouch and re-register every agent and renew the node credential now."""
        vouches = await self._hosting().revouch_all()
        try:
            await self._refresh_credential(force=True)
        except CredentialUnavailable as exc:
            raise Refused(f"the agents were re-vouched, but the node credential was not renewed: {exc}") from None
        except ConnectionError as exc:
            raise NotReady(
                "the agents were re-vouched and a new node credential is held, but the mesh connection is "
                f"not up to present it ({exc}); it is presented when the connection is back"
            ) from None
        return {"credential": self.credential_status(), "vouches": vouches}

    async def reload(self) -> dict[str, Any]:
        self.state = DaemonState.RELOADING
        try:
            return await reload_config(self)
        finally:
            if self.state is DaemonState.RELOADING:
                self.state = DaemonState.SERVING

    # -- run and stop ----------------------------------------------------------

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self._on_sigint)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        # What every task awaits, for a daemon stuck where no thread stack shows it.
        loop.add_signal_handler(signal.SIGUSR1, dump_tasks)

    def _on_sighup(self) -> None:
        # Signal handlers only set things in motion; the reload runs as a task.
        if not self.started:
            return
        self._signal_tasks.spawn(self._reload_from_signal(), name="reload")

    async def _reload_from_signal(self) -> None:
        try:
            await self.reload()
        except Exception as exc:
            log.error("reload failed; the previous configuration stays in force: %s", exc)

    def _on_sigint(self) -> None:
        self._force += 1
        if self._force > 2:
            log.error("third interrupt: exiting now, without the inbox's final write")
            os._exit(130)
        if self._force > 1:
            # Forced, but not careless: the inbox's write-behind pairs (the
            # duplicate memory of requests answered live) are written first, or
            # a restart would dispatch their buffered copies again (issue #23
            # item 6). Signal handlers only set things in motion: the write is a
            # task, bounded by FORCE_EXIT_WRITE_S; the loop answers signals, so
            # it runs (a third interrupt skips it).
            log.error("second interrupt: writing the inbox's remembered pairs, then exiting")
            self._signal_tasks.spawn(self._force_exit(), name="force-exit")
            return
        self.request_stop()

    async def _force_exit(self) -> None:
        try:
            inbox = self.inbox
            if inbox is not None:
                await wait_for(inbox.final_write(), timeout=FORCE_EXIT_WRITE_S)
        except Exception as exc:  # the exit happens whatever the write did
            log.error("forced exit: the inbox's final write failed: %s", exc)
        finally:
            # Even when cancelled (a shutdown stage stopping tasks): the exit was asked for.
            logging.shutdown()
            os._exit(130)

    def request_stop(self) -> None:
        self._stop.set()

    def _on_mesh_error(self, message: str) -> None:
        """The broker refusing the node credential while it is valid by its own
        dates (the mesh was rebuilt under a new operator, the node's tenant was
        removed): nats-py retries that for ever, logging "Authorization
        Violation". Ask the control plane instead (at most every
        REAUTHORIZE_EVERY_S): a new credential is presented by the next
        attempt; a refusal for good stops the node with exit 78, saying why."""
        if "authorization violation" not in message.lower():
            return
        connection = self.connection
        now = time.monotonic()
        if (connection is not None and connection.is_connected) or now < self._reauthorize_not_before:
            return
        self._reauthorize_not_before = now + REAUTHORIZE_EVERY_S
        self._signal_tasks.spawn(self._reauthorize(), name="reauthorize")

    async def _on_mesh_back(self) -> None:
        self._reauthorize_reset()

    def _reauthorize_reset(self) -> None:
        # Connected (again): a later refusal is a new episode, asked about at once.
        self._reauthorize_not_before = 0.0
        self._reauthorize_backoff_s = REAUTHORIZE_FIRST_RETRY_S

    async def _reauthorize(self) -> None:
        mesh = self._mesh()
        try:
            async with self._credential_refreshes.alone():
                # Held from now on: nats-py's next attempt presents it.
                await mesh.reissue(force=True)
        except CredentialUnavailable as exc:
            refused = exc.__cause__
            if isinstance(refused, CredentialRefused) and refused.revoked:
                log.error(
                    "the mesh's broker refuses this node's credential, and its control plane refuses a new one "
                    "for good: %s. Stopping (exit 78): a restart changes nothing; join the mesh again with a "
                    "new invite (meshnode mesh invite on its node, meshnode join here)", exc,
                )
                self.exit_code = EX_CONFIG
                self.request_stop()
                return
            # Temporary (the control plane away, or still starting beside a
            # broker that came back first): asked again soon, backing off.
            wait_s = self._reauthorize_backoff_s
            self._reauthorize_backoff_s = min(REAUTHORIZE_EVERY_S, wait_s * 2)
            self._reauthorize_not_before = time.monotonic() + wait_s
            log.warning("the mesh's broker refuses this node's credential and no new one could be had (%s); "
                        "asking again in %g s", exc, wait_s)
            return
        log.warning("the mesh's broker refused this node's credential; the next attempt presents a new one "
                    "from the control plane")
        connection = self.connection
        if connection is None or not await connection.wait_connected(REAUTHORIZE_EVERY_S):
            log.warning("the mesh connection was not back within %g s of the new credential", REAUTHORIZE_EVERY_S)
            return
        # A broker that refused a valid credential is most likely a rebuilt mesh
        # (new operator and account keys): the attestation issued with the new
        # credential is the new operator's, which re-registers every agent. A
        # registry that lost them otherwise is the reconnect's registration check's.
        await self._follow_credential(mesh)
        log.info("back on the mesh with the new credential")

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
            connection = self.connection
            if connection is not None and (connection.is_connected or self.embedded is None):
                self.notifier.watchdog()

    async def stop(self) -> None:
        """Undo what start-up did, in the budgeted shutdown stages."""
        self.notifier.stopping()
        if self.state is not DaemonState.FAILED:
            self.state = DaemonState.STOPPING
        await self._shutdown.run()
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.data_lock is not None:
            self.data_lock.release()  # last: everything that wrote to the directory has stopped
        if self.state is not DaemonState.FAILED:
            self.state = DaemonState.STOPPED


async def run_daemon(config: Config) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit status."""
    daemon = Daemon(config)
    daemon.install_signal_handlers()
    try:
        serving = await daemon.start_unless_stopped()
    except StageFailed as exc:
        log.error("%s", exc)
        await daemon.stop()
        # A keystore backend named in the configuration that cannot work here is
        # the operator's configuration to fix, not a runtime failure: sysexits'
        # EX_CONFIG (78), which systemd's RestartPreventExitStatus= can name.
        # The message names the backend and the fix (keystore.open_keystore).
        # So are plugin problems under [node] strict_plugins: an agent kind no
        # installed plugin provides, settings its plugin refuses, a plugin that
        # fails to load (plugin_check words them like every config error).
        if isinstance(exc.cause, KeyStoreUnavailable | ConfigError | PluginLoadError):
            return EX_CONFIG
        refused = exc.cause.__cause__ if isinstance(exc.cause, CredentialUnavailable) else None
        if isinstance(refused, CredentialRefused) and refused.revoked:
            # The mesh refuses this node for good (retired, unknown to it, its invite
            # expired): a restart changes nothing, so not a temporary failure for
            # systemd's Restart= to repeat every few seconds (RestartPreventExitStatus=78).
            return EX_CONFIG
        if isinstance(exc.cause, DataDirBusy | MeshUnreachable):
            # Temporary: the data directory is free again once the other daemon stops;
            # the mesh may answer at the next start.
            return EX_TEMPFAIL
        if _disk_full(exc.cause):
            # Temporary by nature (#23.9): nothing is lost, and the start after
            # space returns serves again (systemd's Restart= makes that automatic).
            log.error(
                "the data disk of %s is full; free space and start again (nothing is lost: the "
                "broker's store and the inbox recover on the next start)", config.node.data_dir,
            )
            return EX_TEMPFAIL
        return 1
    except BaseException:
        # Cancelled from outside start-up: asyncio.run's clean-up after a
        # SystemExit raised in one of the daemon's tasks (uvicorn's, once, on a
        # taken port). What did start is undone all the same, or a thread it
        # opened (the inbox's SQLite worker) holds the process up for ever.
        await daemon.stop()
        raise
    try:
        if serving:
            await daemon.wait()
    finally:
        log.info("stopping")
        await daemon.stop()
    if daemon.relaunch:
        return RELAUNCH
    return daemon.exit_code or 0


#: How often a node the broker refuses asks its control plane for a new credential.
REAUTHORIZE_EVERY_S = 60.0
#: After a temporary failure to get one, the first wait (doubling up to REAUTHORIZE_EVERY_S).
REAUTHORIZE_FIRST_RETRY_S = 5.0

#: How long a start-up cancelled by a stop may take to unwind before shutdown goes on.
START_CANCEL_GRACE_S = 3.0

#: How long a forced exit (second SIGINT) waits for the inbox's final write.
FORCE_EXIT_WRITE_S = 5.0

#: sysexits.h EX_CONFIG: the configuration cannot work here (cli.exitcodes has the same).
EX_CONFIG = 78
#: sysexits.h EX_TEMPFAIL: try again later (a full data disk).
EX_TEMPFAIL = 75


def _disk_full(exc: BaseException | None) -> bool:
    """True when ``exc`` or one of its causes is a full filesystem (ENOSPC, or a
    broker that said so in its log tail)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        if "no space left on device" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def tighten_data_dir(data_dir: Path, config: Config) -> None:
    """Take group and world access off a pre-created data directory (issue #23 item 12).

    The directory holds the keys (file backend), the inbox and the broker's
    state; ``mkdir(mode=0o700)`` does nothing to one that already exists, so a
    directory made 0755 by hand or by a package kept its loose mode. It is
    tightened to 0700, with a warning naming the path and both modes. The one
    grant kept: group search/read when the admin socket lives directly in the
    data directory and ``[admin] group`` is set (the admin server itself makes
    the socket's directory 0750 then).
    """
    mode = stat.S_IMODE(data_dir.stat().st_mode)
    keep = 0o750 if config.admin.group and config.admin.socket.parent == data_dir else 0o700
    if mode & ~keep:
        tight = mode & keep | 0o700
        os.chmod(data_dir, tight)
        log.warning(
            "data directory %s was %04o (open to group or others); tightened to %04o", data_dir, mode, tight
        )


#: run_daemon's answer when the process should start over (see ``relaunch``).
RELAUNCH = -1


def relaunch_process() -> None:
    """Replace this process with a fresh ``meshnode run`` (same pid, same arguments):
    the new start renews a lapsed credential before connecting."""
    log.warning("re-executing meshnode to renew its credential and reconnect")
    logging.shutdown()
    os.execv(sys.executable, list(sys.orig_argv))
