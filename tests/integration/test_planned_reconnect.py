"""A planned reconnect (a new credential to present) is not held back by the
client's back-off for failing servers (the soak's churn found it).

nats-py stamps a server at every connect and waits ``reconnect_wait`` before
connecting again to a server stamped within that time. Here the wait is an
hour: a second planned reconnect right after the first must still come back
within the test's ordinary timeout, against a real nats-server.
"""

from __future__ import annotations

from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.testing import eventually_async
from meshnode.transport.connection import MeshConnection
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.permissions import node_inbox_prefix

HOUR_S = 3600.0


async def test_planned_reconnects_back_to_back_skip_the_failure_back_off(mesh: EmbeddedNatsServer) -> None:
    key = KeyPair.generate(Prefix.USER)
    jwt = mesh.mint_node_credential(key.public_key, [], 300, role="service")
    conn = MeshConnection(
        [mesh.url],
        node_key=key,
        jwt_source=lambda: jwt,
        name="planned reconnect",
        inbox_prefix=node_inbox_prefix(key.public_key),
        connect_timeout=2.0,
        reconnect_wait=HOUR_S,
    )
    reconnects: list[int] = []

    async def counted() -> None:
        reconnects.append(len(reconnects) + 1)

    conn.on_reconnect(counted)
    await conn.connect()
    try:
        for expected in (1, 2, 3):
            await conn.reconnect()

            def back(n: int = expected) -> bool:
                return len(reconnects) >= n and conn.is_connected

            await eventually_async(back, what=f"planned reconnect {expected} back")
        # A working connection: a PING answered by the broker.
        await conn.ping(timeout=10.0)
    finally:
        await conn.close()


async def test_a_ping_while_a_planned_reconnect_runs_waits_for_it(mesh: EmbeddedNatsServer) -> None:
    """The broker watch pings every few seconds; one that finds the client between
    servers because of a planned reconnect must not report the broker unresponsive
    (the soak's churn logged an error and counted an episode for it)."""
    key = KeyPair.generate(Prefix.USER)
    jwt = mesh.mint_node_credential(key.public_key, [], 300, role="service")
    conn = MeshConnection([mesh.url], node_key=key, jwt_source=lambda: jwt, name="ping while reconnecting",
                          inbox_prefix=node_inbox_prefix(key.public_key), connect_timeout=2.0)
    await conn.connect()
    try:
        for _ in range(3):
            await conn.reconnect()
            assert not conn.is_connected  # the ping below finds the client between servers
            await conn.ping(timeout=10.0)
            assert conn.is_connected
    finally:
        await conn.close()
