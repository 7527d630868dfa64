"""Two registry instances serving one mesh at once (§9.4): same key, one queue group, one KV.

Each request reaches one instance; a registration through either is seen by
both (the KV watch); and concurrent registrations of one agent resolve to the
newest vouch whichever instance writes last (revision-checked writes).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
import pytest

from meshnode.protocol.attestations import make_vouch
from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.protocol.ratelimit import SlidingWindowLimiter
from meshnode.protocol.timeutil import parse_rfc3339
from meshnode.services.base import ServiceContext
from meshnode.services.registry import RegistryService
from meshnode.services.streams import ensure_mesh_streams
from meshnode.testing import eventually_async
from meshnode.transport.connection import MeshConnection
from meshnode.transport.embedded import EmbeddedNatsServer

from .conftest import connect
from .test_services import call, make_manifest, now_ms, signed

pytestmark = pytest.mark.integration


@dataclass
class Pair:
    """Two registry instances on two connections, plus a participant node."""

    registries: list[RegistryService]
    node: KeyPair
    agent: KeyPair
    conn: MeshConnection


@pytest.fixture
async def pair(mesh: EmbeddedNatsServer) -> AsyncIterator[Pair]:
    shared = KeyPair.generate(Prefix.USER)  # the registry's one identity
    conns: list[MeshConnection] = []
    registries: list[RegistryService] = []
    try:
        for _ in range(2):
            key = KeyPair.generate(Prefix.USER)
            conn = await connect(mesh, key, mesh.mint_node_credential(key.public_key, [], 300, role="service"))
            conns.append(conn)
            await ensure_mesh_streams(conn.js, 1)
            ctx = ServiceContext(
                connection=conn, key=shared, node_id=key.public_key,
                limiter=SlidingWindowLimiter(limit=10_000, window_ms=60_000),
            )
            registry = RegistryService(ctx)
            await registry.start()
            registries.append(registry)
        node, agent = KeyPair.generate(Prefix.USER), KeyPair.generate(Prefix.USER)
        conn = await connect(mesh, node, mesh.mint_node_credential(node.public_key, [agent.public_key], 300))
        conns.append(conn)
        yield Pair(registries, node, agent, conn)
    finally:
        for registry in registries:
            await registry.stop()
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.close(drain_timeout=1)


def _manifest(p: Pair, issued_ms: int) -> dict[str, object]:
    vouch = make_vouch(p.node, p.agent.public_key, issued_ms, issued_ms + 3_600_000)
    manifest = make_manifest(p.agent, p.node)
    manifest["node"] = {"id": p.node.public_key, "attestation": vouch}
    return manifest


async def _register(p: Pair, issued_ms: int) -> dict[str, object]:
    env = signed("register", p.agent, _manifest(p, issued_ms))
    reply = await call(p.conn, f"mesh.registry.register.{p.node.public_key}", env)
    assert "error" not in reply, reply.get("error")
    return dict(reply["payload"])


async def test_a_registration_through_either_instance_is_served_by_both(pair: Pair) -> None:
    await _register(pair, now_ms() - 1000)
    agent_id = pair.agent.public_key
    await eventually_async(lambda: all(r.manifest(agent_id) is not None for r in pair.registries))
    # Discovery answers the same whichever instance the queue group picks.
    for _ in range(6):
        env = signed("discover", pair.agent, {})
        reply = await call(pair.conn, "mesh.registry.discover", env)
        assert [a["id"] for a in reply["payload"]["agents"]] == [agent_id]


async def test_concurrent_registrations_keep_the_newest_vouch(pair: Pair) -> None:
    base = now_ms() - 30_000
    issued = [base + i * 1000 for i in range(12)]
    order = issued[:]
    random.Random(3).shuffle(order)
    replies = await asyncio.gather(*(_register(pair, t) for t in order))
    assert all(r["status"] == "registered" for r in replies)
    kv = pair.registries[0]._kv
    assert kv is not None
    entry = await kv.get(pair.agent.public_key)
    stored = orjson.loads(entry.value or b"{}")
    assert parse_rfc3339(stored["node"]["attestation"]["issued_at"]) == max(issued) * 1000
    # An older registration arriving late leaves the newer one in place.
    await _register(pair, base - 5000)
    entry = await kv.get(pair.agent.public_key)
    stored = orjson.loads(entry.value or b"{}")
    assert parse_rfc3339(stored["node"]["attestation"]["issued_at"]) == max(issued) * 1000
