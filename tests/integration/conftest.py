"""Fixtures for tests against a real nats-server: an embedded mesh and its clients."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import nats
import pytest
from nats.aio.client import Client

from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.testing import DEFAULT_TIMEOUT_S, eventually_async
from meshnode.transport.connection import MeshConnection
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.jwt import nats_auth_callbacks
from meshnode.transport.permissions import Role, node_inbox_prefix

T = TypeVar("T")


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


async def connect(mesh: EmbeddedNatsServer, key: KeyPair, jwt: str) -> MeshConnection:
    """A MeshConnection for ``key`` on ``jwt``, replies under the node's own inbox prefix."""
    conn = MeshConnection(
        [mesh.url],
        node_key=key,
        jwt_source=lambda: jwt,
        name=f"test {key.public_key[:8]}",
        inbox_prefix=node_inbox_prefix(key.public_key),
        connect_timeout=2.0,
    )
    await conn.connect()
    return conn


@dataclass
class ClientErrors:
    """Errors nats-py reports asynchronously (permission violations arrive here)."""

    seen: list[Exception] = field(default_factory=list)

    async def callback(self, error: Exception) -> None:
        self.seen.append(error)

    def messages(self) -> list[str]:
        return [str(error) for error in self.seen]

    async def wait_for(self, fragment: str, timeout: float = DEFAULT_TIMEOUT_S) -> str:
        """The first error message containing ``fragment``, waiting for it to arrive.

        Case-insensitive: nats-py lowercases the server's -ERR text, subject included.
        """

        def found() -> str | None:
            return next((m for m in self.messages() if fragment.lower() in m.lower()), None)

        return await eventually_async(found, timeout=timeout, what=f"a client error containing {fragment!r}",
                                      detail=self.messages)


@dataclass
class Node:
    """A node's identity and its live connection to the embedded mesh."""

    key: KeyPair
    agents: list[KeyPair]
    client: Client
    errors: ClientErrors

    @property
    def node_id(self) -> str:
        return self.key.public_key

    @property
    def agent_ids(self) -> list[str]:
        return [agent.public_key for agent in self.agents]


async def connect_with_jwt(
    url: str,
    user: KeyPair,
    jwt: str,
    *,
    inbox_prefix: str | None = None,
    errors: ClientErrors | None = None,
    allow_reconnect: bool = False,
    **options: object,
) -> Client:
    """A nats-py client authenticated with ``jwt`` and the user key's nonce signature."""
    user_jwt_cb, signature_cb = nats_auth_callbacks(lambda: jwt, user)
    error_sink = errors or ClientErrors()
    return await nats.connect(
        url,
        user_jwt_cb=user_jwt_cb,
        signature_cb=signature_cb,
        inbox_prefix=inbox_prefix or "_INBOX",
        error_cb=error_sink.callback,
        allow_reconnect=allow_reconnect,
        connect_timeout=2,
        **options,
    )


NodeFactory = Callable[..., Awaitable[Node]]


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[EmbeddedNatsServer]:
    """A running embedded mesh with its data under a fresh directory."""
    server = EmbeddedNatsServer(tmp_path / "data", ready_timeout_s=10.0, stop_timeout_s=5.0)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def node_factory(mesh: EmbeddedNatsServer) -> AsyncIterator[NodeFactory]:
    """Connect nodes to ``mesh``, each with a credential for its own roster."""
    nodes: list[Node] = []

    async def make(
        agent_count: int = 1, *, role: Role = "participant", expires_in_s: int = 300
    ) -> Node:
        key = KeyPair.generate(Prefix.USER)
        agents = [KeyPair.generate(Prefix.USER) for _ in range(agent_count)]
        jwt = mesh.mint_node_credential(
            key.public_key, _public_keys(agents), expires_in_s, role=role
        )
        errors = ClientErrors()
        client = await connect_with_jwt(
            mesh.url, key, jwt, inbox_prefix=node_inbox_prefix(key.public_key), errors=errors
        )
        node = Node(key, agents, client, errors)
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        with contextlib.suppress(Exception):
            await node.client.close()


def _public_keys(keys: Iterable[KeyPair]) -> list[str]:
    return [key.public_key for key in keys]


# --------------------------------------------------------------------------- a NATS cluster


class ClusterThread:
    """A :class:`~meshnode.testing.cluster.LocalCluster` (3 routed nats-servers with
    JetStream + control plane) whose event loop runs in a thread of its own.

    The members' supervisors therefore keep working while a synchronous test
    drives daemon processes, and a killed member is restarted by its
    supervisor (after ``restart_backoff_s``) whatever the test is doing.
    Tests in any loop reach the cluster over TCP only.
    """

    def __init__(self, root: Path, *, restart_backoff_s: tuple[float, float]) -> None:
        from meshnode.testing.cluster import LocalCluster

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="nats-cluster", daemon=True)
        self.thread.start()

        async def make() -> LocalCluster:
            cluster = LocalCluster(root, restart_backoff_s=restart_backoff_s)
            await cluster.start()
            return cluster

        self.cluster = self.run(make())

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        """Run ``coro`` on the cluster's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def urls(self) -> list[str]:
        return self.cluster.urls

    def member_index(self, url: str | None) -> int:
        """Which member serves client URL ``url`` (``nats://host:port``)."""
        port = int(str(url).rsplit(":", 1)[1])
        return next(i for i, m in enumerate(self.cluster.nats.members) if m.port == port)

    def kill_member(self, index: int) -> None:
        """SIGKILL one nats-server; its supervisor restarts it after the backoff."""
        pid = self.cluster.nats.members[index].pid
        assert pid is not None, f"member {index} is not running"
        os.kill(pid, signal.SIGKILL)

    def all_ready(self) -> bool:
        return all(m.is_ready for m in self.cluster.nats.members)

    def restart_all(self) -> None:
        """Stop every member (SIGTERM) and start the cluster again from its stores."""
        self.run(self.cluster.nats.stop())
        self.run(self.cluster.nats.start())

    def close(self) -> None:
        try:
            self.run(self.cluster.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterThread]:
    """One 3-server cluster per test module (it takes seconds to form).

    A killed member stays down 3 s before its supervisor restarts it, so a
    fault test sees both the outage and the rejoin.
    """
    cluster = ClusterThread(tmp_path_factory.mktemp("cluster"), restart_backoff_s=(3.0, 10.0))
    try:
        yield cluster
    finally:
        cluster.close()
