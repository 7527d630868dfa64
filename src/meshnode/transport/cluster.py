"""A routed cluster of nats-servers with JetStream, on one host (tests, demos, staging).

:class:`NatsCluster` runs ``size`` supervised nats-servers (each an
:class:`~meshnode.transport.embedded.EmbeddedNatsServer`) sharing one trust
chain: the operator, system-account and mesh-account keys live once under
``<data_dir>/mesh/`` and every member preloads the same accounts. Each member
has its own directory (``<data_dir>/n<i>/mesh/``: config, log, JetStream store)
and the members route to each other on loopback, so JetStream runs clustered
and streams can be created with three replicas.

Ports are chosen once and recorded in ``<data_dir>/cluster.json``, so a
cluster started again from the same directory listens where its nodes'
configurations say it does. A port not given (or given as 0) is picked by
nats-server itself and read back from it (never bound and released here
beforehand, which races with every other process choosing ports); see
:meth:`NatsCluster.start` for how members then find each other's routes.

The cluster offers what the control plane needs from a mesh (``urls`` and
:meth:`mint_node_credential`), so a :class:`~meshnode.control_plane.ControlPlaneServer`
enrols and renews nodes against it exactly as against the embedded mesh.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import nats
from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig

from meshnode.protocol.nkeys import KeyPair, Prefix

from .embedded import (
    ClusterRoutes,
    EmbeddedMeshError,
    EmbeddedNatsServer,
    MeshKeys,
    load_or_create_mesh_keys,
)
from .jwt import ResponsePermission, nats_auth_callbacks
from .lifecycle import AsyncService
from .permissions import Profile, Role, node_inbox_prefix
from .serverconf import url_host

__all__ = ["NatsCluster", "cluster_size_of"]

log = logging.getLogger(__name__)

_PORTS_FILE = "cluster.json"
_REPLY_ONCE = ResponsePermission()
# A route that never resolves (RFC 2606 reserves .invalid): it lets the first
# member of a fresh cluster start with one configured route, which clustered
# JetStream requires, before any peer's route port is known. The member keeps
# retrying it (logging the failure) until its next start, whose config lists
# the real routes.
_PLACEHOLDER_ROUTE = "nats-route://meshnode-peers-not-started.invalid:1"


def _host_port(url: str) -> str:
    """``host:port`` of a NATS URL (``nats://h:p``, ``h:p``), for comparing server lists."""
    rest = url.split("://", 1)[-1].rstrip("/")
    rest = rest.rsplit("@", 1)[-1]
    return rest if ":" in rest.rsplit("]", 1)[-1] else f"{rest}:4222"


def cluster_size_of(configured: Iterable[str], known: Iterable[str]) -> int:
    """How many servers the mesh has, as far as a client can tell: the distinct
    servers it was configured with and those the servers announced (INFO
    ``connect_urls``), at least 1."""
    return max(1, len({_host_port(u) for u in (*configured, *known)}))


class NatsCluster(AsyncService):
    """``size`` nats-servers routed into one JetStream cluster on ``host``.

    Use ``async with NatsCluster(path) as cluster:`` or :meth:`start` and
    :meth:`stop`. ``members[i]`` is each server, to stop, kill or restart one.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        size: int = 3,
        host: str = "127.0.0.1",
        name: str = "meshnode",
        client_ports: Sequence[int] | None = None,
        route_ports: Sequence[int] | None = None,
        ready_timeout_s: float = 30.0,
        stop_timeout_s: float = 10.0,
        restart_backoff_s: tuple[float, float] = (0.5, 30.0),
        binary: str | os.PathLike[str] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("a cluster has at least one server")
        self.data_dir = Path(data_dir).absolute()
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.size = size
        self.host = host
        self.name = name
        self.ready_timeout_s = ready_timeout_s
        self.keys: MeshKeys = load_or_create_mesh_keys(self.data_dir / "mesh")
        # Tenancy (§15) is an embedded-mesh feature; a cluster serves the mesh account.
        self.tenants: tuple[str, ...] = ()
        clients, routes = self._ports(client_ports, route_ports)
        route_urls = self._route_urls(routes)
        self.members: list[EmbeddedNatsServer] = [
            EmbeddedNatsServer(
                self.data_dir / f"n{i + 1}",
                host=host,
                port=clients[i],
                server_name=f"{name}-n{i + 1}",
                keys=self.keys,
                cluster=ClusterRoutes(
                    name=name,
                    host=host,
                    port=routes[i],
                    routes=tuple(u for j, u in enumerate(route_urls) if j != i),
                ),
                ready_timeout_s=ready_timeout_s,
                stop_timeout_s=stop_timeout_s,
                restart_backoff_s=restart_backoff_s,
                binary=binary,
            )
            for i in range(size)
        ]

    def _route_urls(self, ports: Sequence[int]) -> list[str]:
        return [f"nats-route://{url_host(self.host)}:{port}" for port in ports]

    def _ports(
        self, client_ports: Sequence[int] | None, route_ports: Sequence[int] | None
    ) -> tuple[list[int], list[int]]:
        """The client and route port of each member: given, else recorded by an
        earlier start, else 0 (nats-server picks one at the first start)."""
        recorded: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            loaded = json.loads((self.data_dir / _PORTS_FILE).read_text(encoding="utf-8"))
            if isinstance(loaded, dict):
                recorded = loaded
        clients = [int(p) for p in client_ports or recorded.get("client_ports") or []]
        routes = [int(p) for p in route_ports or recorded.get("route_ports") or []]
        if len(clients) != self.size:
            clients = [0] * self.size
        if len(routes) != self.size:
            routes = [0] * self.size
        return clients, routes

    def _record_ports(self) -> None:
        """Write the bound ports to ``cluster.json`` and give every member the real
        routes of all the others, for its restarts and the cluster's next start."""
        clients = [m.port or 0 for m in self.members]
        routes = [m.cluster_port or 0 for m in self.members]
        urls = self._route_urls(routes)
        for i, member in enumerate(self.members):
            assert member.cluster is not None
            member.cluster = replace(
                member.cluster, routes=tuple(u for j, u in enumerate(urls) if j != i)
            )
        (self.data_dir / _PORTS_FILE).write_text(
            json.dumps({"client_ports": clients, "route_ports": routes}) + "\n", encoding="utf-8"
        )

    # -- what clients and the control plane need --

    @property
    def urls(self) -> list[str]:
        """Every member's client URL, in member order."""
        return [f"nats://{url_host(self.host)}:{m.port}" for m in self.members]

    @property
    def operator_public_key(self) -> str:
        return self.keys.operator.public_key

    @property
    def account_public_key(self) -> str:
        return self.keys.mesh_account.public_key

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
    ) -> str:
        """A user JWT in the mesh account (see :meth:`EmbeddedNatsServer.mint_user`)."""
        return self.members[0].mint_user(
            name, user_public_key, pub_allow, sub_allow, expires_in_s,
            response=response, now=now, tags=tags,
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
        """A node credential valid on every member (one account, one operator)."""
        return self.members[0].mint_node_credential(
            node_id, agent_ids, expires_in_s, role=role, trust_tier=trust_tier, now=now,
            tenant=tenant, profile=profile,
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
        """An invite's starter credential (grants nothing), valid on every member."""
        return self.members[0].mint_starter_credential(
            node_id, expires_in_s, trust_tier=trust_tier, now=now, tenant=tenant
        )

    # -- lifecycle --

    async def start(self) -> None:
        """Start every member and return once JetStream answers (a meta leader exists).

        When every route port is known (given, recorded, or bound by an earlier
        start), the members start together, each routing to all the others.
        Otherwise they start one after another on route port 0: each routes to
        the members already up, whose bound ports it reads back from them, and
        the first gets a placeholder route (clustered JetStream refuses to start
        with none). Once all are up the real ports are recorded, so restarts
        and later starts use the full route lists.
        """
        try:
            if all(m.cluster_port for m in self.members):
                await asyncio.gather(*(m.start() for m in self.members))
            else:
                await self._start_in_turn()
            self._record_ports()
            await self.wait_jetstream()
        except BaseException:
            await self.stop()
            raise

    async def _start_in_turn(self) -> None:
        started: list[str] = []
        for member in self.members:
            assert member.cluster is not None
            routes = tuple(started) if started else (_PLACEHOLDER_ROUTE,)
            member.cluster = replace(member.cluster, routes=routes)
            await member.start()
            started += self._route_urls([member.cluster_port or 0])

    async def stop(self) -> None:
        """Stop every member (SIGTERM, SIGKILL on overrun). Idempotent."""
        await asyncio.gather(*(m.stop() for m in self.members), return_exceptions=True)

    async def wait_jetstream(self, timeout: float | None = None) -> None:
        """Return once the cluster's JetStream accepts API calls: a fresh cluster
        (or one restarted whole) needs a moment to elect its meta leader, and a
        stream created before that is refused. With several members it also
        waits until a stream of ``min(3, size)`` replicas can be placed: members
        started one after another (route ports picked by nats-server) join the
        meta group one by one, and an R3 stream created before the third is
        known is refused ("no suitable peers for placement")."""
        key = KeyPair.generate(Prefix.USER)
        jwt = self.mint_node_credential(key.public_key, [], 300, role="service")
        user_jwt_cb, signature_cb = nats_auth_callbacks(lambda: jwt, key)
        deadline = time.monotonic() + (timeout or self.ready_timeout_s)
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                nc = await nats.connect(
                    self.urls,
                    user_jwt_cb=user_jwt_cb,
                    signature_cb=signature_cb,
                    inbox_prefix=node_inbox_prefix(key.public_key),
                    allow_reconnect=False,
                    connect_timeout=2,
                    max_reconnect_attempts=0,
                )
            except Exception as exc:
                last = exc
                await asyncio.sleep(0.2)
                continue
            try:
                js = nc.jetstream()
                await js.account_info()
                if self.size > 1:
                    await self._probe_placement(js)
                return
            except Exception as exc:
                last = exc
                await asyncio.sleep(0.2)
            finally:
                with contextlib.suppress(Exception):
                    await nc.close()
        raise EmbeddedMeshError(f"the cluster's JetStream did not become available: {last}")

    async def _probe_placement(self, js: JetStreamContext) -> None:
        """Create and delete a throw-away in-memory stream of ``min(3, size)`` replicas."""
        name = f"MESHNODE_PLACEMENT_PROBE_{secrets.token_hex(4).upper()}"
        await js.add_stream(
            StreamConfig(
                name=name,
                subjects=[f"meshnode.placement-probe.{name}"],
                storage=StorageType.MEMORY,
                num_replicas=min(3, self.size),
            )
        )
        with contextlib.suppress(Exception):
            await js.delete_stream(name)
