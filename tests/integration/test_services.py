"""Registry and presence as service-role components on a real (embedded) nats-server.

A service-role connection hosts the services; participant connections act as
nodes hosting agents, each with the §14.3 credential of its roster, so every
request below also passes the broker's permission checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from nats.js.api import DiscardPolicy, RetentionPolicy
from nats.js.errors import NotFoundError

from meshnode.daemon.platform import PlatformServices, PlatformSettings, start_platform_services
from meshnode.protocol.attestations import make_vouch
from meshnode.protocol.envelope import (
    build_envelope,
    decode_envelope,
    encode_envelope,
    sign_envelope,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.protocol.ratelimit import SlidingWindowLimiter
from meshnode.services import (
    PresenceService,
    RegistryService,
    ServiceContext,
    ensure_mesh_streams,
)
from meshnode.services.query import decode_cursor, encode_cursor, parse_discover_query
from meshnode.services.semver import VersionRange
from meshnode.testing import eventually_async
from meshnode.transport.connection import MeshConnection, Message
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.permissions import node_permissions

from .conftest import connect

pytestmark = pytest.mark.integration

HEARTBEAT_S = 0.5


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# --- mesh parties ----------------------------------------------------------------


@dataclass
class Participant:
    """A node hosting agents, on its own participant credential."""

    key: KeyPair
    agents: list[KeyPair]
    conn: MeshConnection

    @property
    def node_id(self) -> str:
        return self.key.public_key

    def manifest(self, agent: KeyPair, **members: Any) -> dict[str, Any]:
        return make_manifest(agent, self.key, **members)

    async def register(self, agent: KeyPair, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
        env = signed("register", agent, manifest if manifest is not None else self.manifest(agent))
        return await call(self.conn, f"mesh.registry.register.{self.node_id}", env)

    async def beat(self, payload: dict[str, Any] | None = None, *, signer: KeyPair | None = None,
                   subject: str | None = None) -> None:
        key = signer or self.key
        env = signed("emit", key, payload if payload is not None else {"availability": "online"})
        await self.conn.publish(subject or f"mesh.heartbeat.{self.node_id}", encode_envelope(env))
        await self.conn.flush()


@dataclass
class Mesh:
    server: EmbeddedNatsServer
    service_key: KeyPair
    service_conn: MeshConnection
    connections: list[MeshConnection] = field(default_factory=list)

    def context(self, **overrides: Any) -> ServiceContext:
        return ServiceContext(
            connection=self.service_conn,
            key=overrides.pop("key", KeyPair.generate(Prefix.USER)),
            node_id=self.service_key.public_key,
            **overrides,
        )

    async def participant(self, agent_count: int = 1) -> Participant:
        key = KeyPair.generate(Prefix.USER)
        agents = [KeyPair.generate(Prefix.USER) for _ in range(agent_count)]
        jwt = self.server.mint_node_credential(key.public_key, [a.public_key for a in agents], 300)
        conn = await connect(self.server, key, jwt)
        self.connections.append(conn)
        return Participant(key, agents, conn)

    async def unbound_participant(self) -> Participant:
        """A node whose credential also grants the untokenized register subject."""
        key = KeyPair.generate(Prefix.USER)
        agent = KeyPair.generate(Prefix.USER)
        perms = node_permissions(key.public_key, [agent.public_key], require_connection_bound=False)
        jwt = self.server.mint_user("legacy node", key.public_key, perms.pub_allow, perms.sub_allow, 300)
        conn = await connect(self.server, key, jwt)
        self.connections.append(conn)
        return Participant(key, [agent], conn)


@pytest.fixture
async def net(mesh: EmbeddedNatsServer) -> AsyncIterator[Mesh]:
    service_key = KeyPair.generate(Prefix.USER)
    jwt = mesh.mint_node_credential(service_key.public_key, [], 300, role="service")
    service_conn = await connect(mesh, service_key, jwt)
    world = Mesh(mesh, service_key, service_conn)
    await ensure_mesh_streams(service_conn.jetstream, 1)
    try:
        yield world
    finally:
        for conn in world.connections:
            with contextlib.suppress(Exception):
                await conn.close(drain_timeout=1)
        with contextlib.suppress(Exception):
            await service_conn.close(drain_timeout=1)


@pytest.fixture
async def platform(net: Mesh) -> AsyncIterator[PlatformServices]:
    services = await start_platform_services(net.context(), PlatformSettings(heartbeat_interval_s=HEARTBEAT_S))
    try:
        yield services
    finally:
        await services.stop()


# --- envelopes -----------------------------------------------------------------


def make_manifest(agent: KeyPair, node: KeyPair, **members: Any) -> dict[str, Any]:
    t = now_ms()
    manifest: dict[str, Any] = {
        "id": agent.public_key,
        "name": "echo",
        "description": "says back what it hears",
        "version": "1.2.3",
        "protocol_version": "0.3.0",
        "endpoint": f"mesh.agent.{agent.public_key}.inbox",
        "node": {
            "id": node.public_key,
            "attestation": make_vouch(node, agent.public_key, t - 1000, t + 3_600_000),
        },
        "capabilities": ["echo"],
        "offerings": [
            {"id": "echo", "name": "Echo", "tags": ["text"], "input_modes": ["text/plain"],
             "examples": [{"input": "hi", "output": "hi"}]},
        ],
        "public": {"description": "An echo", "offerings": ["echo", "not-declared"],
                   "offering_details": [{"id": "forged"}]},
    }
    manifest.update(members)
    return manifest


def signed(kind: str, key: KeyPair, payload: Any = None) -> dict[str, Any]:
    return sign_envelope(build_envelope(kind, key.public_key, now_ms=now_ms(), payload=payload), key)


async def call(conn: MeshConnection, subject: str, env: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """Send ``env`` as a request and return the verified reply, checked to be bound to it.

    Every use expects an answer, so the deadline only bounds a hang: 3 s (as it
    was) is missed by a registry answering in-process on a loaded machine (seen
    as registry timeouts in combined runs), and a generous one costs nothing."""
    msg = await conn.request(subject, encode_envelope(env), timeout=timeout)
    reply = decode_envelope(msg.data)  # verifies the signature against reply["from"]
    assert reply["type"] == "respond"
    assert reply["in_reply_to"] == env["id"]
    assert reply["to"] == env["from"]
    assert reply["trace"]["trace_id"] == env["trace"]["trace_id"]
    return reply


def error_code(reply: dict[str, Any]) -> str:
    assert reply["payload"] == {"status": "failed"}
    return str(reply["error"]["code"])


async def discover(p: Participant, agent: KeyPair, query: dict[str, Any] | None = None) -> dict[str, Any]:
    reply = await call(p.conn, "mesh.registry.discover", signed("discover", agent, query or {}))
    assert "error" not in reply, reply.get("error")
    return dict(reply["payload"])


async def stream_exists(conn: MeshConnection, name: str) -> bool:
    try:
        await conn.jetstream.native.stream_info(name)
    except NotFoundError:
        return False
    return True


async def collect(conn: MeshConnection, subject: str) -> tuple[list[dict[str, Any]], Callable[[], Awaitable[None]]]:
    seen: list[dict[str, Any]] = []

    async def on(msg: Message) -> None:
        seen.append(decode_envelope(msg.data))

    sub = await conn.subscribe(subject, on)
    await conn.flush()
    return seen, sub.unsubscribe


# --- streams -----------------------------------------------------------------------


async def test_mesh_streams_are_created_once_with_the_spec_settings(net: Mesh) -> None:
    js = net.service_conn.jetstream.native
    # The fixture already ran it once: a second run changes nothing.
    again = await ensure_mesh_streams(net.service_conn.jetstream, 1)
    assert set(again.values()) == {"unchanged"}, again
    assert set(again) == {
        "MESH_REGISTRY", "MESH_TASKS", "MESH_EVENTS", "MESH_HEARTBEAT", "MESH_METERING", "mesh_registry",
        "mesh_tasks",
    }
    registry = (await js.stream_info("MESH_REGISTRY")).config
    assert registry.subjects == ["mesh.registry.>"] and registry.no_ack is True
    events = (await js.stream_info("MESH_EVENTS")).config
    assert events.retention == RetentionPolicy.INTEREST and events.duplicate_window >= 120
    tasks = (await js.stream_info("MESH_TASKS")).config
    assert tasks.max_age == 7 * 86400 and tasks.duplicate_window >= 120
    heartbeat = (await js.stream_info("MESH_HEARTBEAT")).config
    assert heartbeat.max_age == 300 and heartbeat.no_ack is True
    # The rating service's replay source: a limits-retention copy of the metering events.
    metering = (await js.stream_info("MESH_METERING")).config
    assert metering.retention == RetentionPolicy.LIMITS and not metering.subjects
    assert [(s.name, s.filter_subject) for s in metering.sources or []] == [("MESH_EVENTS", "mesh.event.metering.>")]
    kv_registry = (await js.stream_info("KV_mesh_registry")).config
    assert kv_registry.max_msgs_per_subject == 1 and not kv_registry.max_age
    kv_tasks = (await js.stream_info("KV_mesh_tasks")).config
    assert kv_tasks.max_age == 7 * 86400

    # Drift in a field we own is repaired in place.
    await js.update_stream(dataclasses.replace(events, duplicate_window=30))
    assert (await ensure_mesh_streams(net.service_conn.jetstream, 1))["MESH_EVENTS"] == "updated"
    assert (await js.stream_info("MESH_EVENTS")).config.duplicate_window == 120


# --- register ------------------------------------------------------------------------


async def test_register_on_the_bound_subject_stores_the_normalized_manifest(
    net: Mesh, platform: PlatformServices
) -> None:
    node = await net.participant()
    agent = node.agents[0]
    events, _ = await collect(node.conn, "mesh.event.registry.>")

    reply = await node.register(agent)
    assert reply["from"] == platform.registry.ctx.service_id
    assert reply["payload"]["status"] == "registered"
    assert reply["payload"]["agent_id"] == agent.public_key
    assert reply["payload"]["node_binding"] == "connection_bound"

    entry = await (await net.service_conn.jetstream.native.key_value("mesh_registry")).get(agent.public_key)
    stored = decode_json(entry.value)
    assert stored["owner"] == node.node_id  # §8.6 default owner
    assert stored["visibility"] == "public"
    assert stored["endpoints"] == {"inbox": f"mesh.agent.{agent.public_key}.inbox"}
    # §8.7: the storefront is rebuilt from declared offerings, never taken as sent.
    assert stored["public"]["offerings"] == ["echo"]
    assert stored["public"]["offering_details"] == [
        {"id": "echo", "name": "Echo", "tags": ["text"], "input_modes": ["text/plain"]}
    ]
    assert stored["meta"]["registry"]["node_binding"] == "connection_bound"

    # The redelivery buffer exists, as WIRE-NOTES and §18.3 shape it.
    inbox = (await net.service_conn.jetstream.native.stream_info(f"MESH_INBOX_{agent.public_key}")).config
    assert inbox.subjects == [f"mesh.agent.{agent.public_key}.inbox"]
    assert inbox.no_ack is True and inbox.max_age == 7 * 86400 and inbox.max_bytes == 8 * 1024 * 1024
    assert inbox.max_msgs == 2000 and inbox.discard == DiscardPolicy.NEW  # a flood cannot evict (#22.4)
    assert inbox.retention == RetentionPolicy.LIMITS

    await eventually_async(lambda: len(events) == 1)
    event = events[0]
    assert event["type"] == "emit" and event["from"] == platform.registry.ctx.service_id
    assert event["payload"] == {
        "domain": "registry", "event_type": "agent_registered",
        "data": {"agent_id": agent.public_key, "node": node.node_id},
    }

    # Deregistration (Rust form) removes the manifest and the buffer.
    bye = await call(node.conn, "mesh.registry.deregister", signed("register", agent, {"agent_id": agent.public_key}))
    assert bye["payload"] == {"status": "deregistered", "agent_id": agent.public_key, "existed": True}
    assert not await stream_exists(net.service_conn, f"MESH_INBOX_{agent.public_key}")
    got = await call(node.conn, f"mesh.registry.get.{agent.public_key}", signed("discover", agent, {}))
    assert error_code(got) == "NOT_FOUND"
    await eventually_async(lambda: len(events) == 2)
    assert events[1]["payload"]["event_type"] == "agent_deregistered"


def decode_json(value: bytes | None) -> dict[str, Any]:
    assert value is not None
    result = orjson.loads(value)
    assert isinstance(result, dict)
    return result


async def test_refusals_answer_with_their_codes(net: Mesh, platform: PlatformServices) -> None:
    node = await net.participant(2)
    agent, other = node.agents

    # A vouch that claims this node but was signed by another key.
    forged = node.manifest(agent)
    impostor = KeyPair.generate(Prefix.USER)
    vouch = make_vouch(impostor, agent.public_key, now_ms() - 1000, now_ms() + 60_000)
    vouch["node"] = node.node_id
    forged["node"]["attestation"] = vouch
    reply = await node.register(agent, forged)
    assert error_code(reply) == "UNAUTHORIZED"
    assert reply["error"]["retryable"] is False

    # from ≠ manifest id.
    reply = await call(
        node.conn, f"mesh.registry.register.{node.node_id}", signed("register", other, node.manifest(agent))
    )
    assert error_code(reply) == "IDENTITY_MISMATCH"

    # Schema failure names the field.
    reply = await node.register(agent, node.manifest(agent, version="one"))
    assert error_code(reply) == "INVALID_MANIFEST"
    assert reply["error"]["details"]["field"] == "version"

    # Nothing refused left a trace.
    assert platform.registry.manifest(agent.public_key) is None
    assert not await stream_exists(net.service_conn, f"MESH_INBOX_{agent.public_key}")

    # Deregistering somebody else is refused.
    reply = await call(node.conn, "mesh.registry.deregister", signed("register", other, {"agent_id": agent.public_key}))
    assert error_code(reply) == "UNAUTHORIZED"

    # A malformed query and a missing agent.
    reply = await call(node.conn, "mesh.registry.discover", signed("discover", agent, {"capabilities": "echo"}))
    assert error_code(reply) == "INVALID_QUERY" and reply["error"]["details"]["field"] == "capabilities"
    reply = await call(node.conn, f"mesh.registry.get.{other.public_key}", signed("discover", agent))
    assert error_code(reply) == "NOT_FOUND"


async def test_garbage_and_forged_envelopes_get_no_answer(net: Mesh, platform: PlatformServices) -> None:
    node = await net.participant()
    agent = node.agents[0]
    with pytest.raises(asyncio.TimeoutError):
        await node.conn.request("mesh.registry.discover", b"not an envelope", timeout=0.5)
    tampered = signed("discover", agent, {})
    tampered["payload"] = {"capabilities": ["x"]}
    with pytest.raises(asyncio.TimeoutError):
        await node.conn.request("mesh.registry.discover", encode_envelope(tampered), timeout=0.5)
    # A replay of an answered request is a duplicate (§22.2): dropped, not re-run.
    env = signed("discover", agent, {})
    await call(node.conn, "mesh.registry.discover", env)
    with pytest.raises(asyncio.TimeoutError):
        await node.conn.request("mesh.registry.discover", encode_envelope(env), timeout=0.5)


async def test_untokenized_registration_is_refused_unless_configured(net: Mesh) -> None:
    node = await net.unbound_participant()
    agent = node.agents[0]

    strict = RegistryService(net.context())
    await strict.start()
    try:
        reply = await call(node.conn, "mesh.registry.register", signed("register", agent, node.manifest(agent)))
        assert error_code(reply) == "UNAUTHORIZED"
        assert reply["error"]["details"]["reason"] == "untokenized_registration"
    finally:
        await strict.stop()

    lenient = RegistryService(net.context(), require_connection_bound=False)
    await lenient.start()
    try:
        reply = await call(node.conn, "mesh.registry.register", signed("register", agent, node.manifest(agent)))
        assert reply["payload"]["status"] == "registered"
        assert reply["payload"]["node_binding"] == "self_asserted"
        stored = lenient.manifest(agent.public_key)
        assert stored is not None
        assert stored["meta"]["registry"]["node_binding"] == "self_asserted"
        # The bound subject still works, and its token must be the vouching node.
        reply = await node.register(agent)
        assert reply["payload"]["node_binding"] == "connection_bound"
    finally:
        await lenient.stop()


async def test_untokenized_registration_from_an_sdk_enrolment(net: Mesh) -> None:
    # A participant credential stands in for the transport: what is under test
    # is the registry's rule, which reads the enrolment, never the subject.
    node = await net.participant(agent_count=2)
    enrolled, stranger = node.agents
    enrolments = {node.node_id: enrolled.public_key}
    registry = RegistryService(net.context(), sdk_agent_of=enrolments.get)
    await registry.start()
    try:
        manifest = node.manifest(enrolled)
        manifest["node"]["profile"] = {"client": "sdk-test", "enrolment": "self-declared"}
        reply = await call(node.conn, "mesh.registry.register", signed("register", enrolled, manifest))
        assert reply["payload"]["node_binding"] == "sdk_enrolled"
        stored = registry.manifest(enrolled.public_key)
        assert stored is not None
        assert stored["node"]["profile"] == {"client": "sdk-test", "enrolment": "sdk"}
        # The enrolment names one agent: the node cannot register another untokenized.
        other = signed("register", stranger, node.manifest(stranger))
        reply = await call(node.conn, "mesh.registry.register", other)
        assert error_code(reply) == "UNAUTHORIZED"
        assert reply["error"]["details"]["reason"] == "sdk_enrolment_mismatch"
        # A vouch by another key naming the enrolled node does not verify.
        forged = make_manifest(enrolled, KeyPair.generate(Prefix.USER))
        forged["node"]["id"] = node.node_id
        reply = await call(node.conn, "mesh.registry.register", signed("register", enrolled, forged))
        assert error_code(reply) == "UNAUTHORIZED"
        # Retired (the enrolment gone): the ordinary refusal, with its way out.
        enrolments.clear()
        reply = await call(node.conn, "mesh.registry.register", signed("register", enrolled, manifest))
        assert reply["error"]["details"]["reason"] == "untokenized_registration"
        assert "meshnode mesh token" in reply["error"]["message"]
    finally:
        await registry.stop()


async def test_rate_limit_is_per_sender_and_shared_across_services(net: Mesh) -> None:
    ctx = net.context(limiter=SlidingWindowLimiter(limit=3, window_ms=60_000))
    presence = PresenceService(ctx, HEARTBEAT_S, seed_from_stream=False)
    registry = RegistryService(ctx, presence=presence)
    await registry.start()
    await presence.start()
    try:
        node = await net.participant(2)
        agent, other = node.agents
        await discover(node, agent)
        await discover(node, agent)
        reply = await call(node.conn, "mesh.presence.get", signed("request", agent, {}))
        assert "error" not in reply  # third request, on another service's subject
        limited = await call(node.conn, "mesh.registry.discover", signed("discover", agent, {}))
        assert error_code(limited) == "RATE_LIMITED"
        assert limited["error"]["retryable"] is True
        assert 0 < limited["error"]["retry_after_ms"] <= 60_000
        assert limited["from"] == ctx.service_id
        # Another sender has its own budget.
        await discover(node, other)
    finally:
        await registry.stop()
        await presence.stop()


async def test_sandbox_nodes_get_no_buffer_and_are_never_listed(net: Mesh) -> None:
    node = await net.participant(1)
    agent = node.agents[0]
    registry = RegistryService(net.context(), trust_tier_of=lambda n: "sandbox" if n == node.node_id else None)
    await registry.start()
    try:
        reply = await node.register(agent)
        assert reply["payload"]["status"] == "registered"
        stored = registry.manifest(agent.public_key)
        assert stored is not None and stored["sandbox"] is True
        assert stored["visibility"] == "unlisted"  # §8.6 clamp
        assert not await stream_exists(net.service_conn, f"MESH_INBOX_{agent.public_key}")
        assert (await discover(node, agent))["total"] == 0
        # Without presence, an availability filter cannot be joined.
        reply = await call(node.conn, "mesh.registry.discover", signed("discover", agent, {"availability": "online"}))
        assert error_code(reply) == "INVALID_QUERY"
    finally:
        await registry.stop()


# --- discover and get --------------------------------------------------------------------


async def test_discover_filters_with_and_semantics(net: Mesh, platform: PlatformServices) -> None:
    node = await net.participant(4)
    a, b, c, d = node.agents
    await node.register(a, node.manifest(a, capabilities=["search", "scrape"], version="1.2.0",
                                         offerings=[{"id": "web.search", "tags": ["web", "fast"]}],
                                         trust={"tenant": "ACME"}))
    await node.register(b, node.manifest(b, capabilities=["search"], version="2.0.0",
                                         offerings=[{"id": "web.search", "tags": ["slow"]}]))
    await node.register(c, node.manifest(c, capabilities=["scrape"], version="1.4.1", protocol_version="0.2.0"))
    await node.register(d, node.manifest(d, capabilities=["search", "scrape", "summarize"], version="0.9.0"))
    caller = a

    def ids(result: dict[str, Any]) -> set[str]:
        return {m["id"] for m in result["agents"]}

    assert ids(await discover(node, caller, {"capabilities": ["search", "scrape"]})) == {a.public_key, d.public_key}
    assert ids(await discover(node, caller, {"offering_id": "web.search"})) == {a.public_key, b.public_key}
    assert ids(await discover(node, caller, {"tags": ["fast", "slow"]})) == {a.public_key, b.public_key}
    assert ids(await discover(node, caller, {"version": "^1.2"})) == {a.public_key, c.public_key}
    assert ids(await discover(node, caller, {"version": ">=1.3.0"})) == {b.public_key, c.public_key}
    assert ids(await discover(node, caller, {"version": "~1.2"})) == {a.public_key}
    assert ids(await discover(node, caller, {"version": "2.0.0"})) == {b.public_key}
    assert ids(await discover(node, caller, {"protocol_version": "0.2"})) == {c.public_key}
    assert ids(await discover(node, caller, {"tenant": "ACME"})) == {a.public_key}
    assert ids(await discover(node, caller, {"agent_ids": [b.public_key, c.public_key]})) == {b.public_key, c.public_key}
    # AND: every filter must hold.
    result = await discover(node, caller, {"capabilities": ["search"], "version": "<1.0.0", "node": node.node_id,
                                           "owner": node.node_id})
    assert ids(result) == {d.public_key} and result["total"] == 1
    assert ids(await discover(node, caller, {"capabilities": ["search"], "version": "<1.0.0",
                                             "node": KeyPair.generate().public_key})) == set()
    # Legacy alias (skill_id → offering_id).
    assert ids(await discover(node, caller, {"skill_id": "web.search"})) == {a.public_key, b.public_key}
    # Every listed manifest carries joined availability (nobody has beaten).
    assert {m["availability"] for m in (await discover(node, caller))["agents"]} == {"offline"}


async def test_visibility_tiers(net: Mesh, platform: PlatformServices) -> None:
    home = await net.participant(3)
    public, unlisted, private = home.agents
    stranger = await net.participant(1)
    outsider = stranger.agents[0]
    await home.register(public)
    await home.register(unlisted, home.manifest(unlisted, visibility="unlisted"))
    await home.register(private, home.manifest(private, visibility="private"))
    await stranger.register(outsider)

    listed = {m["id"] for m in (await discover(stranger, outsider))["agents"]}
    assert listed == {public.public_key, outsider.public_key}
    # The owner (the hosting node, by default) sees its private agent, never the unlisted one.
    own = {m["id"] for m in (await discover(home, public))["agents"]}
    assert own == {public.public_key, private.public_key, outsider.public_key}

    # get is by id: an unlisted agent is returned to anybody ...
    got = await call(stranger.conn, f"mesh.registry.get.{unlisted.public_key}",
                     signed("discover", outsider, {"agent_id": unlisted.public_key}))
    assert got["payload"]["id"] == unlisted.public_key and got["payload"]["visibility"] == "unlisted"
    # ... a private one in full only to its owner; others learn only where to
    # answer it and who vouches for it, never its description.
    got = await call(stranger.conn, f"mesh.registry.get.{private.public_key}", signed("discover", outsider))
    assert set(got["payload"]) <= {"id", "endpoint", "endpoints", "node", "visibility", "protocol_version"}
    assert got["payload"]["node"]["attestation"]["agent"] == private.public_key
    assert "description" not in got["payload"] and "offerings" not in got["payload"]
    got = await call(home.conn, f"mesh.registry.get.{private.public_key}", signed("discover", public))
    assert got["payload"]["id"] == private.public_key and "offerings" in got["payload"]


async def test_discover_pages_with_a_cursor(net: Mesh, platform: PlatformServices) -> None:
    node = await net.participant(5)
    for agent in node.agents:
        await node.register(agent)
    caller = node.agents[0]
    seen: list[str] = []
    query: dict[str, Any] = {"limit": 2}
    pages = 0
    while True:
        result = await discover(node, caller, query)
        assert result["total"] == 5
        assert len(result["agents"]) <= 2
        seen += [m["id"] for m in result["agents"]]
        pages += 1
        if "cursor" not in result:
            break
        query = {"limit": 2, "cursor": result["cursor"]}
    assert pages == 3
    assert seen == sorted(a.public_key for a in node.agents)
    bad = await call(node.conn, "mesh.registry.discover", signed("discover", caller, {"cursor": "!!"}))
    assert error_code(bad) == "INVALID_QUERY"


async def test_registry_instances_share_the_bucket(net: Mesh, platform: PlatformServices) -> None:
    second = RegistryService(net.context())
    await second.start()
    try:
        node = await net.participant(1)
        agent = node.agents[0]
        await node.register(agent)  # served by either instance (one queue group)
        await eventually_async(lambda: platform.registry.manifest(agent.public_key) is not None
                         and second.manifest(agent.public_key) is not None)
        await call(node.conn, "mesh.registry.deregister", signed("register", agent, {"deregister": True}))
        await eventually_async(lambda: platform.registry.manifest(agent.public_key) is None
                         and second.manifest(agent.public_key) is None)
    finally:
        await second.stop()

    # A late starter loads what is already stored.
    node = await net.participant(1)
    await node.register(node.agents[0])
    third = RegistryService(net.context())
    await third.start()
    try:
        assert third.manifest(node.agents[0].public_key) is not None
    finally:
        await third.stop()


async def _send_in_order(conn: MeshConnection, subject: str, envs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Publish every envelope on ``subject`` back to back (one connection: the
    registry reads them in this order), then collect each one's verified reply."""
    replies: list[asyncio.Future[dict[str, Any]]] = []
    subs = []
    for _ in envs:
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

        async def on(msg: Message, future: asyncio.Future[dict[str, Any]] = future) -> None:
            if not future.done():
                future.set_result(decode_envelope(msg.data))

        inbox = conn.new_inbox()
        subs.append(await conn.subscribe(inbox, on))
        replies.append(future)
    await conn.flush()
    for env, sub in zip(envs, subs, strict=True):
        await conn.publish(subject, encode_envelope(env), reply=sub.subject)
    await conn.flush()
    try:
        answers = [await asyncio.wait_for(f, 10) for f in replies]
    finally:
        for sub in subs:
            await sub.unsubscribe()
    for env, answer in zip(envs, answers, strict=True):
        assert answer["in_reply_to"] == env["id"]
    return answers


async def test_concurrent_registrations_are_all_stored_and_one_agents_stay_in_order(
    net: Mesh, platform: PlatformServices
) -> None:
    """The registry serves registrations side by side (bounded); nothing is lost
    or mixed up between agents, and one agent's requests are served in order."""
    node = await net.participant(24)
    replies = await asyncio.gather(*(node.register(a) for a in node.agents))
    assert [r["payload"]["agent_id"] for r in replies] == [a.public_key for a in node.agents]
    assert {r["payload"]["status"] for r in replies} == {"registered"}
    kv = await net.service_conn.jetstream.native.key_value("mesh_registry")
    for agent in node.agents:
        stored = decode_json((await kv.get(agent.public_key)).value)
        assert stored["id"] == agent.public_key
        assert stored["endpoints"] == {"inbox": f"mesh.agent.{agent.public_key}.inbox"}
        assert await stream_exists(net.service_conn, f"MESH_INBOX_{agent.public_key}")
    gate = platform.registry.registrations
    assert 1 <= gate.peak <= gate.limit
    await eventually_async(lambda: gate.running == 0)

    # One agent, three requests at once on one subject: a registration, a newer
    # one, a deregistration. Served in arrival order, so the deregistration
    # lands last and wins: no manifest, no buffer left behind by a registration
    # still creating its stream while the deregistration ran.
    agent = node.agents[0]
    t = now_ms()

    def vouched(issued_ms: int) -> dict[str, Any]:
        manifest = node.manifest(agent)
        manifest["node"] = {
            "id": node.node_id, "attestation": make_vouch(node.key, agent.public_key, issued_ms, t + 3_600_000)}
        return manifest

    subject = f"mesh.registry.register.{node.node_id}"
    first, second, bye = await _send_in_order(node.conn, subject, [
        signed("register", agent, vouched(t - 900)),
        signed("register", agent, vouched(t - 800)),
        signed("register", agent, {"deregister": True}),
    ])
    assert first["payload"]["status"] == second["payload"]["status"] == "registered"
    assert bye["payload"] == {"status": "deregistered", "agent_id": agent.public_key, "existed": True}
    assert not await stream_exists(net.service_conn, f"MESH_INBOX_{agent.public_key}")
    got = await call(node.conn, f"mesh.registry.get.{agent.public_key}", signed("discover", agent, {}))
    assert error_code(got) == "NOT_FOUND"

    # Two registrations of one agent at once, the newer vouch first: both are
    # answered, and the stored record is the newer one (never the older, never torn).
    newer, older = await _send_in_order(node.conn, subject, [
        signed("register", agent, vouched(t - 100)),
        signed("register", agent, vouched(t - 700)),
    ])
    assert newer["payload"]["status"] == older["payload"]["status"] == "registered"
    stored = decode_json((await kv.get(agent.public_key)).value)
    assert stored["node"]["attestation"] == vouched(t - 100)["node"]["attestation"]
    assert platform.registry.manifest(agent.public_key) == stored


# --- presence ----------------------------------------------------------------------------------


async def test_presence_tracks_heartbeats(net: Mesh, platform: PlatformServices) -> None:
    presence = platform.presence
    node = await net.participant(1)
    agent = node.agents[0]
    await node.register(agent)
    events, _ = await collect(node.conn, "mesh.event.presence.>")

    await node.beat({"availability": "busy", "active_tasks": 3, "capacity": 10, "load": 0.3,
                     "node": KeyPair.generate().public_key})
    await eventually_async(lambda: presence.availability_of_node(node.node_id) == "busy")
    view = await call(node.conn, "mesh.presence.get", signed("request", agent, {"node": node.node_id}))
    assert view["from"] == presence.ctx.service_id
    assert view["payload"]["node"] == node.node_id
    assert view["payload"]["availability"] == "busy"
    assert view["payload"]["active_tasks"] == 3 and view["payload"]["load"] == 0.3
    assert isinstance(view["payload"]["last_seen"], str)
    everyone = await call(node.conn, "mesh.presence.get", signed("request", agent, {}))
    assert [n["node"] for n in everyone["payload"]["nodes"]] == [node.node_id]
    by_agent = await call(node.conn, "mesh.presence.get", signed("request", agent, {"agent": agent.public_key}))
    assert by_agent["payload"]["node"] == node.node_id and by_agent["payload"]["agent"] == agent.public_key

    # An unknown availability is absent, which reads as online; an agent the node
    # vouched for may beat for it.
    await node.beat({"availability": "sleepy"}, signer=agent)
    await eventually_async(lambda: presence.availability_of_node(node.node_id) == "online")
    assert (await discover(node, agent, {"availability": "online"}))["total"] == 1
    assert (await discover(node, agent, {"availability": "busy"}))["total"] == 0

    # Silence beyond 2 × interval: offline, announced, and the manifest stays.
    # The verdict is computed from the record's age when asked, so this holds from
    # 2 × interval on; the deadline only bounds a hang (4 × interval + 2 s was missable).
    await eventually_async(lambda: presence.availability_of_node(node.node_id) == "offline", timeout=30)
    assert (await discover(node, agent, {"availability": "online"}))["total"] == 0
    assert (await discover(node, agent, {"availability": "offline"}))["total"] == 1
    await eventually_async(lambda: [e["payload"]["event_type"] for e in events] == ["node_online", "node_offline"])
    assert events[1]["payload"]["data"]["node"] == node.node_id

    unknown = KeyPair.generate().public_key
    never = await call(node.conn, "mesh.presence.get", signed("request", agent, {"node": unknown}))
    assert never["payload"] == {"node": unknown, "availability": "offline"}
    missing = await call(node.conn, "mesh.presence.get", signed("request", agent, {"agent": unknown}))
    assert error_code(missing) == "NOT_FOUND"


async def test_presence_ignores_beats_not_from_the_node_or_its_agents(
    net: Mesh, platform: PlatformServices
) -> None:
    presence = platform.presence
    victim = await net.participant(1)
    elsewhere = await net.participant(1)
    await elsewhere.register(elsewhere.agents[0])
    other_node = KeyPair.generate(Prefix.USER)

    # Published on the victim's own subject (its credential allows that), but
    # signed by another node, by an agent vouched by another node, unsigned,
    # or as a non-emit: all dropped.
    await victim.beat(signer=other_node)
    await victim.beat(signer=elsewhere.agents[0])
    await victim.conn.publish(f"mesh.heartbeat.{victim.node_id}", b'{"availability":"online"}')
    wrong_type = signed("request", victim.key, {"availability": "online"})
    await victim.conn.publish(f"mesh.heartbeat.{victim.node_id}", encode_envelope(wrong_type))
    # A per-agent override for an agent the victim does not host.
    await victim.beat(subject=f"mesh.heartbeat.{victim.node_id}.{elsewhere.agents[0].public_key}")
    await victim.conn.flush()

    # A genuine beat from another node proves the forged ones were processed first.
    await elsewhere.beat()
    await eventually_async(lambda: presence.availability_of_node(elsewhere.node_id) == "online")
    assert presence.availability_of_node(victim.node_id) == "offline"
    assert victim.node_id not in {n["node"] for n in presence.nodes()}


async def test_presence_seeds_from_the_heartbeat_stream(net: Mesh, platform: PlatformServices) -> None:
    node = await net.participant(1)
    await node.beat({"availability": "degraded"})
    await eventually_async(lambda: platform.presence.availability_of_node(node.node_id) == "degraded")
    late = PresenceService(net.context(), 30.0)
    await late.start()
    try:
        assert late.availability_of_node(node.node_id) == "degraded"
    finally:
        await late.stop()


# --- interop with the other SDKs' legacy shapes ---------------------------------------------------


async def test_legacy_wire_shapes(net: Mesh, platform: PlatformServices) -> None:
    node = await net.participant(2)
    ts_agent, rust_agent = node.agents

    # A manifest that still says "skills".
    legacy = node.manifest(ts_agent)
    legacy["skills"] = legacy.pop("offerings")
    reply = await node.register(ts_agent, legacy)
    assert reply["payload"]["status"] == "registered"
    stored = platform.registry.manifest(ts_agent.public_key)
    assert stored is not None and "skills" not in stored
    assert [o["id"] for o in stored["offerings"]] == ["echo"]

    # TS/Python deregistration: type register, payload {deregister: true}, on
    # either the deregister or the register subject.
    reply = await call(node.conn, "mesh.registry.deregister", signed("register", ts_agent, {"deregister": True}))
    assert reply["payload"]["status"] == "deregistered" and reply["payload"]["existed"] is True
    await node.register(ts_agent, legacy)
    reply = await call(node.conn, f"mesh.registry.register.{node.node_id}",
                       signed("register", ts_agent, {"deregister": True}))
    assert reply["payload"]["status"] == "deregistered"
    assert not await stream_exists(net.service_conn, f"MESH_INBOX_{ts_agent.public_key}")

    # Rust deregistration: payload {agent_id}; and a repeat is harmless.
    await node.register(rust_agent)
    for existed in (True, False):
        reply = await call(node.conn, "mesh.registry.deregister",
                           signed("request", rust_agent, {"agent_id": rust_agent.public_key}))
        assert reply["payload"] == {"status": "deregistered", "agent_id": rust_agent.public_key,
                                    "existed": existed}

    # SDK heartbeat payload {node, availability}; get with payload {agent_id}.
    await node.register(rust_agent)
    await node.beat({"node": node.node_id, "availability": "online"})
    await eventually_async(lambda: platform.presence.availability_of_node(node.node_id) == "online")
    got = await call(node.conn, f"mesh.registry.get.{rust_agent.public_key}",
                     signed("discover", rust_agent, {"agent_id": rust_agent.public_key}))
    assert got["payload"]["id"] == rust_agent.public_key and got["payload"]["availability"] == "online"


# --- pure parts ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "version", "expected"),
    [
        ("1.2.3", "1.2.3", True), ("1.2.3", "1.2.4", False), ("=1.2.3", "1.2.3", True),
        (">=1.2.0", "1.3.0", True), (">=1.2.0", "1.1.9", False), (">1.2", "1.2.9", False),
        ("^1.2", "1.9.0", True), ("^1.2", "2.0.0", False), ("^1.2", "2.0.0-rc.1", False),
        ("^0.2.3", "0.2.9", True), ("^0.2.3", "0.3.0", False), ("^0.0.3", "0.0.4", False),
        ("~1.2", "1.2.9", True), ("~1.2", "1.3.0", False), ("~1.2.3", "1.2.2", False),
        ("1.x", "1.5.0", True), ("1.2", "1.2.7", True), ("*", "0.0.1", True),
        (">=1.0.0 <2.0.0", "1.5.0", True), (">=1.0.0 <2.0.0", "2.0.0", False),
        ("<1.0.0 || >=3.0.0", "3.1.0", True), (">=1.2.3-beta", "1.2.3-beta.2", True),
        ("<=1.2", "1.2.9", True), ("<=1.2", "1.3.0", False),
    ],
)
def test_version_ranges(spec: str, version: str, expected: bool) -> None:
    assert VersionRange.parse(spec).contains(version) is expected


@pytest.mark.parametrize("query", [
    "x", {"capabilities": "a"}, {"tags": [1]}, {"limit": 0}, {"limit": True}, {"limit": "5"},
    {"availability": "asleep"}, {"version": "not a range"}, {"cursor": "zzz"}, {"node": 5},
])
def test_invalid_queries(query: object) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_discover_query(query)
    assert info.value.code == "INVALID_QUERY"


def test_query_defaults_and_cursor() -> None:
    assert parse_discover_query(None).limit == 50
    assert parse_discover_query({"limit": 10_000}).limit == 500
    agent = KeyPair.generate().public_key
    assert decode_cursor(encode_cursor(agent)) == agent
    assert parse_discover_query({"cursor": encode_cursor(agent)}).after == agent
