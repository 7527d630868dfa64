"""A hostile participant against everybody's JetStream consumers (#22 holes 1-2, #23 items 3-4).

One mesh for the module: node A runs the embedded mesh and the platform
services, node B joins it with an invite and hosts a listener and a stream
consumer. Mallory is invited like anybody (``meshnode mesh invite``) and
attacks with both credentials a participant holds: the invite's starter
credential and the roster credential the control plane renews it for.
Every refusal below is the broker's or the consumer service's.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest
from nats.aio.client import Client

from meshnode.control_plane import ControlPlaneClient, read_invite
from meshnode.protocol import subjects
from meshnode.protocol.envelope import (
    build_envelope,
    decode_envelope,
    encode_envelope,
    sign_envelope,
)
from meshnode.protocol.nkeys import KeyPair
from meshnode.testing import DaemonProcess, DaemonSet, eventually, run_cli
from meshnode.transport.connection import flush_written
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.jetstream import ConsumerSpec
from meshnode.transport.permissions import node_inbox_prefix
from meshnode.transport.streams import ensure_mesh_streams

from .conftest import ClientErrors, connect, connect_with_jwt

pytestmark = pytest.mark.integration

PLUGINS = {"plugin_modules": ["tests.agents:listener_plugin", "tests.agents:streams_plugin",
                              "tests.agents:tasks_plugin", "tests.agents:feeder_plugin"]}
QUOTA = 4  # services.max_consumers_per_agent on this mesh: small, so the flood is quick


@dataclass
class World:
    a: DaemonProcess
    b: DaemonProcess
    node_key: KeyPair  # Mallory's node
    agent: KeyPair  # Mallory's agent (on her roster)
    starter_jwt: str
    roster_jwt: str
    url: str


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    daemons = DaemonSet()
    try:
        a = daemons.embedded(
            "a", agents={"producer": {"plugin": "test-streams"}, "worker": {"plugin": "test-tasks"},
                         "talker": {"plugin": "test-listener"}},
            node=PLUGINS, extra={"services": {"max_consumers_per_agent": QUOTA}},
        )
        b = daemons.joined("b", via=a, agents={"listener": {"plugin": "test-listener"},
                                               "consumer": {"plugin": "test-streams"},
                                               "feeder": {"plugin": "test-feeder"}}, node=PLUGINS)
        path = daemons.root / "mallory.creds"
        run_cli("mesh", "invite", "mallory", "--out", str(path), "--socket", a.socket_path)
        invite = read_invite(path)
        agent = KeyPair.generate()
        assert invite.control_plane_url is not None
        grant = asyncio.run(ControlPlaneClient(invite.control_plane_url).request_credential(invite.node_key, [agent]))
        assert invite.nats_urls
        yield World(a, b, invite.node_key, agent, invite.jwt, grant.jwt, invite.nats_urls[0])
    finally:
        daemons.close()


async def _mallory(world: World, jwt: str) -> tuple[Client, ClientErrors]:
    errors = ClientErrors()
    client = await connect_with_jwt(
        world.url, world.node_key, jwt, inbox_prefix=node_inbox_prefix(world.node_key.public_key), errors=errors
    )
    return client, errors


async def _ask(client: Client, world: World, op: str, payload: dict[str, Any], *, node: str | None = None) -> dict[str, Any]:
    """A signed consumer-service request from Mallory's agent; the reply envelope."""
    env = build_envelope("request", world.agent.public_key, now_ms=_now_ms(), payload=payload)
    sign_envelope(env, world.agent)
    node_id = node or world.node_key.public_key
    subject = subjects.consumers_ensure(node_id) if op == "ensure" else subjects.consumers_delete(node_id)
    msg = await client.request(subject, encode_envelope(env), timeout=10)
    return decode_envelope(msg.data)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _task_manager_filter(client: Client) -> Any:
    return client.jetstream().consumer_info(subjects.MESH_TASKS, "mesh_task_manager")


@pytest.mark.parametrize("credential", ["starter", "roster"])
def test_platform_and_other_agents_consumers_are_out_of_reach(world: World, credential: str) -> None:
    jwt = world.starter_jwt if credential == "starter" else world.roster_jwt
    victim = subjects.event_consumer_name(world.b.agent_id("listener"), "demo.*")
    b_node = world.b.status()["node"]["id"]
    asyncio.run(_attack_consumers(world, jwt, victim, b_node))

    # The platform keeps recording tasks and other agents keep receiving events.
    result = world.a.call("worker", "slow", {"steps": 2, "pause": 0.01})
    task_id = result["task_id"]
    record = eventually(lambda: (r := world.a.admin("Tasks.Show", {"task_id": task_id})).get("state") == "completed" and r,
                        what="the task record reaching completed")
    assert record["state"] == "completed"
    before = len(world.b.call("listener", "seen")["output"])
    world.a.call("talker", "emit", {"domain": "demo", "event_type": credential})
    eventually(lambda: len(world.b.call("listener", "seen")["output"]) > before, what="b's listener receiving the event")
    # ... and the feed-state writer keeps writing.
    feeder = world.b.agent_id("feeder")
    world.b.call("feeder", "publish", {"topic": "status", "data": {"after": credential}})
    eventually(lambda: world.b.call("feeder", "read_state", {"owner": feeder, "topic": "status"})["output"].get("data")
               == {"after": credential}, what="the feed state recorded")


async def _attack_consumers(world: World, jwt: str, victim: str, b_node: str) -> None:
    client, errors = await _mallory(world, jwt)
    retarget = json.dumps({"stream_name": "MESH_TASKS", "config": {
        "durable_name": "mesh_task_manager", "filter_subject": "mesh.task.mallory.update", "ack_policy": "explicit"}})
    attacks = {
        # Retarget the task manager, the feed-state writer and another agent's event consumer.
        "$JS.API.CONSUMER.DURABLE.CREATE.MESH_TASKS.mesh_task_manager": retarget,
        "$JS.API.CONSUMER.CREATE.MESH_TASKS.mesh_task_manager.mesh.task.mallory.update": retarget,
        "$JS.API.CONSUMER.DURABLE.CREATE.MESH_FEED.mesh_feed_state_writer": "{}",
        f"$JS.API.CONSUMER.DURABLE.CREATE.MESH_EVENTS.{victim}": "{}",
        f"$JS.API.CONSUMER.CREATE.MESH_EVENTS.{victim}.mesh.event.nothing": "{}",
        f"$JS.API.CONSUMER.DELETE.MESH_EVENTS.{victim}": "",
        # Steal the task manager's updates, or ack them away.
        "$JS.API.CONSUMER.MSG.NEXT.MESH_TASKS.mesh_task_manager": '{"batch": 10}',
        "$JS.ACK.MESH_TASKS.mesh_task_manager.1.1.1.1.0": "+TERM",
        # Flood the shared streams with consumers of her own naming.
        "$JS.API.CONSUMER.CREATE.MESH_EVENTS": "{}",
        "$JS.API.CONSUMER.DURABLE.CREATE.MESH_EVENTS.mine": "{}",
        # The consumer service on another node's subject.
        subjects.consumers_ensure(b_node): "{}",
    }
    try:
        for subject, body in attacks.items():
            await client.publish(subject, body.encode(), reply=client.new_inbox())
        await flush_written(client)
        for subject in attacks:
            await errors.wait_for(f'permissions violation for publish to "{subject}"')
        if jwt == world.roster_jwt:  # the starter credential grants nothing at all, not even reads
            # Reading is allowed, and shows nothing moved.
            info = await _task_manager_filter(client)
            assert info.config.filter_subject == "mesh.task.*.update"
    finally:
        await client.close()


def test_a_participant_runs_its_own_consumers_within_its_quota(world: World) -> None:
    asyncio.run(_own_consumers(world, world.b.status()["node"]["id"]))

    # Everybody else is unaffected by her flood: a new agent with accepts still starts.
    world.b.admin("Agents.Add", {"name": "late", "config": {"plugin": "test-listener"}})
    late: dict[str, Any] = eventually(
        lambda: next((a for a in world.b.status()["agents"] if a["name"] == "late" and a.get("registered")), {}),
        what="the late listener registered")
    assert late["state"] == "running", late


async def _own_consumers(world: World, b_node: str) -> None:
    client, errors = await _mallory(world, world.roster_jwt)
    prefix = node_inbox_prefix(world.node_key.public_key)
    try:
        # Her own event consumer: made by the service, delivered to her, acked by her.
        deliver = f"{prefix}.c.mine"
        sub = await client.subscribe(deliver)
        answer = await _ask(client, world, "ensure", {"kind": "event", "pattern": "mallory.x", "deliver_subject": deliver})
        assert answer["payload"]["action"] == "created", answer
        name = answer["payload"]["name"]
        assert name == subjects.event_consumer_name(world.agent.public_key, "mallory.x")
        await client.publish("mesh.event.mallory.x", b"hello")
        delivered = await sub.next_msg(timeout=10)
        assert delivered.data == b"hello" and delivered.reply.startswith(f"$JS.ACK.MESH_EVENTS.{name}.")
        await delivered.ack()
        # Asked again: bound as it is, not re-created.
        again = await _ask(client, world, "ensure", {"kind": "event", "pattern": "mallory.x", "deliver_subject": deliver})
        assert again["payload"]["action"] == "bound"

        # A deliver subject outside her own inbox prefix is refused, naming the member.
        elsewhere = f"{node_inbox_prefix(b_node)}.c.steal"
        refused = await _ask(client, world, "ensure", {"kind": "event", "pattern": "demo.*", "deliver_subject": elsewhere})
        assert refused["error"]["code"] == "INVALID_ENVELOPE" and "deliver_subject" in refused["error"]["message"]

        # The flood: bounded per agent, and the refusal says why and which setting.
        codes = []
        for i in range(QUOTA + 2):
            flood = await _ask(client, world, "ensure", {"kind": "event", "pattern": f"flood.{i}",
                                                         "deliver_subject": f"{prefix}.c.f{i}"})
            codes.append(flood["error"]["code"] if flood.get("error") else "ok")
        assert codes == ["ok"] * (QUOTA - 1) + ["QUOTA_EXCEEDED"] * 3, codes
        assert "max_consumers_per_agent" in flood["error"]["message"]

        # Deleting her own works; the quota frees up.
        gone = await _ask(client, world, "delete", {"kind": "event", "pattern": "flood.0"})
        assert gone["payload"] == {"stream": "MESH_EVENTS", "name": subjects.event_consumer_name(
            world.agent.public_key, "flood.0"), "deleted": True}
        room = await _ask(client, world, "ensure", {"kind": "event", "pattern": "flood.again",
                                                    "deliver_subject": f"{prefix}.c.again"})
        assert room["payload"]["action"] == "created", room
        full = await _ask(client, world, "ensure", {"kind": "event", "pattern": "flood.more",
                                                    "deliver_subject": f"{prefix}.c.more"})
        assert full["error"]["code"] == "QUOTA_EXCEEDED", full
        assert errors.seen == []
    finally:
        await client.close()


def test_foreign_chunks_are_dropped_and_the_task_consumer_is_gone_after_the_wait(world: World) -> None:
    producer = world.a.agent_id("producer")
    before = world.b.admin("Metrics")["refusals"].get("task_stream", {})
    result = world.b.call("consumer", "consume", {"target": producer, "offering": "forged", "report_task": True}, timeout=30)
    assert result["status"] == "completed", result
    assert result["output"]["chunks"] == ["c0"]
    after = world.b.admin("Metrics")["refusals"]["task_stream"]
    assert after.get("not_a_party", 0) == before.get("not_a_party", 0) + 1
    assert after.get("identity_mismatch", 0) == before.get("identity_mismatch", 0) + 1

    # The participant's task consumer was deleted when its wait ended (by the consumer service).
    name = subjects.task_update_consumer_name(result["output"]["task_id"], world.b.agent_id("consumer")) + "_stream"
    asyncio.run(_consumer_gone(world, name))
    metrics = world.b.admin("Metrics")["agents"]["consumer"]["counters"]
    assert metrics.get("consumers.release_failed", 0) == 0


async def _consumer_gone(world: World, name: str) -> None:
    client, _ = await _mallory(world, world.roster_jwt)
    try:
        with pytest.raises(nats.js.errors.NotFoundError):
            await client.jetstream().consumer_info(subjects.MESH_TASKS, name)
    finally:
        await client.close()


async def test_a_drifted_consumer_is_repaired_when_it_is_bound(mesh: EmbeddedNatsServer, tmp_path: Path) -> None:
    """Damage done while a node was away does not survive its next bind."""
    key = KeyPair.generate()
    conn = await connect(mesh, key, mesh.mint_node_credential(key.public_key, [], 600, role="service"))
    try:
        js = conn.jetstream
        await ensure_mesh_streams(js, 1)
        spec = ConsumerSpec("mesh_task_manager", "mesh.task.*.update", max_deliver=-1)
        assert await js.ensure_consumer(subjects.MESH_TASKS, spec) == "created"
        assert await js.ensure_consumer(subjects.MESH_TASKS, spec) == "bound"
        # Retargeted behind its back (as a participant could before #22).
        drifted = ConsumerSpec("mesh_task_manager", "mesh.task.mallory.update", max_deliver=-1)
        await js.native.add_consumer(subjects.MESH_TASKS, config=drifted.config())
        assert await js.ensure_consumer(subjects.MESH_TASKS, spec) in ("updated", "recreated")
        info = await js.native.consumer_info(subjects.MESH_TASKS, "mesh_task_manager")
        assert info.config.filter_subject == "mesh.task.*.update"
        # The durable pull a service binds asserts the same way.
        await js.native.add_consumer(subjects.MESH_TASKS, config=drifted.config())
        await js.durable_pull("mesh.task.*.update", stream=subjects.MESH_TASKS, durable="mesh_task_manager")
        info = await js.native.consumer_info(subjects.MESH_TASKS, "mesh_task_manager")
        assert info.config.filter_subject == "mesh.task.*.update"
    finally:
        await conn.close()
