"""The embedded mesh against a real nats-server: operator-mode auth, §14.3
permissions enforced by the broker, JetStream in the mesh account, and a child
process that never outlives its owner."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig

from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.testing import eventually_async
from meshnode.transport.cluster import NatsCluster
from meshnode.transport.connection import flush_written
from meshnode.transport.embedded import (
    ClusterRoutes,
    EmbeddedNatsServer,
    find_nats_server,
)
from meshnode.transport.errors import PortInUse
from meshnode.transport.jwt import decode_jwt, verify_jwt
from meshnode.transport.permissions import node_denials, node_inbox_prefix

from .conftest import (
    ClientErrors,
    NodeFactory,
    connect_with_jwt,
    process_alive,
)

pytestmark = pytest.mark.integration


def _mailbox_stream(agent_id: str) -> StreamConfig:
    # MESH_INBOX_{agent} as WIRE-NOTES describes it (§18.3).
    return StreamConfig(
        name=f"MESH_INBOX_{agent_id}",
        subjects=[f"mesh.agent.{agent_id}.inbox"],
        max_age=7 * 24 * 3600,
        max_bytes=25 * 1024 * 1024,
        no_ack=True,
    )


def _inbox_consumer(agent_id: str) -> ConsumerConfig:
    # inbox_{agent}: durable pull, explicit ack, deliver all (§18.6).
    return ConsumerConfig(
        durable_name=f"inbox_{agent_id}",
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=30,
        max_deliver=5,
    )


# --- operator mode and authentication -----------------------------------------


async def test_server_runs_in_operator_mode(mesh: EmbeddedNatsServer) -> None:
    assert find_nats_server().is_file()
    assert mesh.pid is not None and process_alive(mesh.pid)
    assert mesh.url == f"nats://127.0.0.1:{mesh.port}"
    config = (mesh.mesh_dir / "nats-server.conf").read_text()
    assert "resolver: MEMORY" in config
    assert f'system_account: "{mesh.keys.system_account.public_key}"' in config

    anonymous_errors = ClientErrors()
    with pytest.raises(NatsError, match="Authorization Violation"):
        await nats.connect(
            mesh.url, allow_reconnect=False, connect_timeout=2,
            error_cb=anonymous_errors.callback,
        )


async def test_node_credential_chain_verifies(mesh: EmbeddedNatsServer) -> None:
    node = KeyPair.generate(Prefix.USER)
    jwt = mesh.mint_node_credential(node.public_key, [], 60)
    claims = verify_jwt(jwt, mesh.account_public_key, now=int(time.time()))
    assert claims["sub"] == node.public_key
    assert claims["exp"] - claims["iat"] == 60
    _, claims = decode_jwt(jwt)
    # The reserved relay prefix, and acks for the platform's consumers (#22).
    assert claims["nats"]["pub"]["deny"] == ["mesh.peer.>", *node_denials("participant")]
    assert "$JS.ACK.MESH_TASKS.mesh_task_manager.>" in node_denials("participant")
    assert claims["nats"]["sub"]["deny"] == ["mesh.peer.>"]


async def test_nodes_exchange_within_their_permissions(node_factory: NodeFactory) -> None:
    requester = await node_factory()
    responder = await node_factory()
    responder_agent = responder.agent_ids[0]
    requester_agent = requester.agent_ids[0]

    inbox = await responder.client.subscribe(f"mesh.agent.{responder_agent}.inbox")
    replies = await requester.client.subscribe(f"mesh.agent.{requester_agent}.inbox")
    await flush_written(responder.client)
    await flush_written(requester.client)

    # A request with a reply subject in the requester's private inbox prefix:
    # the responder may publish there once (the credential's resp permission),
    # though its publish allow list does not name that prefix.
    liveness = requester.client.new_inbox()
    assert liveness.startswith(node_inbox_prefix(requester.node_id) + ".")
    signal_sub = await requester.client.subscribe(liveness)
    await requester.client.publish(
        f"mesh.agent.{responder_agent}.inbox", b"request", reply=liveness
    )
    request = await inbox.next_msg(timeout=10)
    assert request.data == b"request"
    await responder.client.publish(request.reply, b"queued")
    assert (await signal_sub.next_msg(timeout=10)).data == b"queued"

    # Every respond goes to the requester's inbox (§6.5).
    await responder.client.publish(f"mesh.agent.{requester_agent}.inbox", b"respond")
    assert (await replies.next_msg(timeout=10)).data == b"respond"

    # Own heartbeat, own feed, shared event bus.
    events = await requester.client.subscribe("mesh.event.>")
    await flush_written(requester.client)
    await responder.client.publish(f"mesh.heartbeat.{responder.node_id}", b"beat")
    await responder.client.publish(f"mesh.feed.{responder_agent}.status", b"feed")
    await responder.client.publish("mesh.event.demo.happened", b"event")
    assert (await events.next_msg(timeout=10)).data == b"event"
    await flush_written(responder.client)
    assert responder.errors.seen == []
    assert requester.errors.seen == []


async def test_services_answer_requests_through_the_response_permission(
    node_factory: NodeFactory,
) -> None:
    registry = await node_factory(0, role="service")
    node = await node_factory()

    async def answer(msg: Msg) -> None:
        await msg.respond(b"discovered")

    await registry.client.subscribe("mesh.registry.discover", cb=answer)
    await flush_written(registry.client)
    # flush_written, not the client's flush: that one can send its PING ahead of
    # the SUB still in the client's buffer, and this request then finds no
    # responders (seen about once in fifty runs).
    reply = await node.client.request("mesh.registry.discover", b"query", timeout=10)
    assert reply.data == b"discovered"

    # A participant's JetStream publish gets its PubAck on its private inbox.
    await registry.client.jetstream(timeout=10).add_stream(
        StreamConfig(name="MESH_EVENTS", subjects=["mesh.event.>"], duplicate_window=120)
    )
    ack = await node.client.jetstream(timeout=10).publish(
        "mesh.event.demo.happened", b"event", headers={"Nats-Msg-Id": "e1"}
    )
    assert (ack.stream, ack.seq) == ("MESH_EVENTS", 1)
    assert registry.errors.seen == [] and node.errors.seen == []


async def test_broker_refuses_another_nodes_subjects(
    mesh: EmbeddedNatsServer, node_factory: NodeFactory
) -> None:
    mallory = await node_factory()
    victim = await node_factory()
    victim_agent = victim.agent_ids[0]

    # An observer entitled to everything, to see what actually gets through.
    observer_key = KeyPair.generate(Prefix.USER)
    observer = await connect_with_jwt(
        mesh.url, observer_key, mesh.mint_user("observer", observer_key.public_key, [">"], [">"], 60)
    )
    seen = await observer.subscribe("mesh.>")
    await flush_written(observer)

    forged = {
        f"mesh.registry.register.{victim.node_id}": "register under another node",
        f"mesh.heartbeat.{victim.node_id}": "beat for another node",
        f"mesh.feed.{victim_agent}.status": "publish another agent's feed",
        "mesh.peer.other.hello": "reserved federation subject",
    }
    # The untokenized mesh.registry.register is granted to every credential
    # (the registry refuses it UNAUTHORIZED: transport.permissions' note), so
    # it is not among the forgeries the broker stops.
    for subject in forged:
        await mallory.client.publish(subject, b"forged")
    await flush_written(mallory.client)
    for subject in forged:
        await mallory.errors.wait_for(f'permissions violation for publish to "{subject}"')

    # Nothing forged reached a subscriber entitled to all of mesh.>.
    await mallory.client.publish(f"mesh.heartbeat.{mallory.node_id}", b"own beat")
    message = await seen.next_msg(timeout=10)
    assert (message.subject, message.data) == (f"mesh.heartbeat.{mallory.node_id}", b"own beat")
    await observer.close()

    # Reading another node's mail, live or through its reply inbox, is refused.
    for subject in (
        f"mesh.agent.{victim_agent}.inbox",
        f"{node_inbox_prefix(victim.node_id)}.>",
        "_INBOX.>",
        "mesh.registry.>",
    ):
        await mallory.client.subscribe(subject)
        await flush_written(mallory.client)
        await mallory.errors.wait_for(f'permissions violation for subscription to "{subject}"')


async def test_jetstream_mailbox_for_its_node_only(node_factory: NodeFactory) -> None:
    service = await node_factory(0, role="service")
    host = await node_factory()
    mallory = await node_factory()
    agent = host.agent_ids[0]

    # The registry creates the agent's mailbox stream (§18.3) ...
    admin = service.client.jetstream(timeout=10)
    await admin.add_stream(_mailbox_stream(agent))

    # ... captures a request sent while nobody listens ...
    await mallory.client.publish(f"mesh.agent.{agent}.inbox", b"while you were out")
    await flush_written(mallory.client)
    async def captured() -> bool:  # the stream stores asynchronously to the publish
        return bool((await admin.stream_info(f"MESH_INBOX_{agent}")).state.last_seq == 1)

    await eventually_async(captured, what="the request captured by the mailbox stream")

    # ... and the hosting node drains it through its durable consumer (§18.6),
    # with nothing but its participant grants.
    host_js = host.client.jetstream(timeout=10)
    stream = await host_js.stream_info(f"MESH_INBOX_{agent}")
    assert stream.state.last_seq == 1
    await host_js.add_consumer(f"MESH_INBOX_{agent}", _inbox_consumer(agent))
    drain = await host_js.pull_subscribe_bind(f"inbox_{agent}", stream=f"MESH_INBOX_{agent}")
    [mail] = await drain.fetch(1, timeout=10)
    assert mail.data == b"while you were out"
    await mail.ack_sync(timeout=10)
    assert host.errors.seen == []

    # Another node can neither attach a consumer to that mailbox nor manage streams.
    mallory_js = mallory.client.jetstream(timeout=0.5)
    with pytest.raises(NatsTimeoutError):
        await mallory_js.add_consumer(
            f"MESH_INBOX_{agent}", ConsumerConfig(durable_name="peek", ack_policy=AckPolicy.NONE)
        )
    await mallory.errors.wait_for("permissions violation for publish to \"$JS.API.CONSUMER.")
    with pytest.raises(NatsTimeoutError):
        await mallory_js.delete_stream(f"MESH_INBOX_{agent}")
    await mallory.errors.wait_for(
        f'permissions violation for publish to "$JS.API.STREAM.DELETE.MESH_INBOX_{agent}"'
    )
    assert (await admin.stream_info(f"MESH_INBOX_{agent}")).config.name == f"MESH_INBOX_{agent}"


async def test_jetstream_enabled_for_mesh_account(node_factory: NodeFactory) -> None:
    service = await node_factory(0, role="service")
    js = service.client.jetstream(timeout=10)
    account = await js.account_info()
    assert account.limits.max_streams == -1
    await js.add_stream(StreamConfig(name="MESH_EVENTS", subjects=["mesh.event.>"]))
    ack = await js.publish("mesh.event.demo.happened", b"persisted", headers={"Nats-Msg-Id": "1"})
    assert ack.seq == 1
    again = await js.publish("mesh.event.demo.happened", b"persisted", headers={"Nats-Msg-Id": "1"})
    assert again.duplicate
    stored = await js.get_msg("MESH_EVENTS", 1)
    assert stored.data == b"persisted"


async def test_large_roster_credential_fits_the_connect_line(node_factory: NodeFactory) -> None:
    # About 1 KiB of JWT per agent: far past nats-server's default 4 KiB
    # control line, which the embedded config raises.
    node = await node_factory(50)
    last_agent = node.agent_ids[-1]
    inbox = await node.client.subscribe(f"mesh.agent.{last_agent}.inbox")
    await node.client.publish(f"mesh.agent.{last_agent}.inbox", b"hello")
    assert (await inbox.next_msg(timeout=10)).data == b"hello"


async def test_monitoring_is_opt_in(mesh: EmbeddedNatsServer, tmp_path: Path) -> None:
    assert mesh.monitor_url is None
    async with EmbeddedNatsServer(tmp_path / "monitored", monitor_port=0) as monitored:
        assert monitored.monitor_url is not None
        varz = await asyncio.to_thread(_get_json, f"{monitored.monitor_url}/varz")
        assert varz["system_account"] == monitored.keys.system_account.public_key
        assert varz["max_payload"] == 1024 * 1024
        health = await asyncio.to_thread(_get_json, f"{monitored.monitor_url}/healthz")
        assert health["status"] == "ok"


async def test_port_zero_reads_every_bound_port_back_from_nats_server(tmp_path: Path) -> None:
    # 0 means "any free port" for each listener; what the server bound is read
    # back from the ports file nats-server writes, and kept for a restart.
    server = EmbeddedNatsServer(
        tmp_path / "data",
        port=0,
        monitor_port=0,
        cluster=ClusterRoutes("solo", "127.0.0.1", 0, routes=("nats-route://x.invalid:1",)),
        restart_backoff_s=(0.05, 0.5),
    )
    async with server:
        ports = server.ports
        assert ports is not None and ports.monitoring is not None and ports.cluster is not None
        assert ports.client > 0 and server.port == ports.client
        assert server.url == f"nats://127.0.0.1:{ports.client}"
        assert server.monitor_port == ports.monitoring
        assert server.monitor_url == f"http://127.0.0.1:{ports.monitoring}"
        assert server.cluster_port == ports.cluster
        assert len({ports.client, ports.monitoring, ports.cluster}) == 3
        varz = await asyncio.to_thread(_get_json, f"{server.monitor_url}/varz")
        assert varz["port"] == ports.client
        assert varz["cluster"]["cluster_port"] == ports.cluster
        pid = server.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await eventually_async(lambda: server.restarts == 1 and server.is_ready, timeout=15)
        assert server.ports == ports


async def test_a_cluster_on_port_zero_routes_its_members_to_each_others_bound_ports(
    tmp_path: Path,
) -> None:
    async with NatsCluster(tmp_path / "c", size=3, ready_timeout_s=20) as cluster:
        client_ports = [m.port for m in cluster.members]
        route_ports = [m.cluster_port for m in cluster.members]
        assert all(client_ports) and all(route_ports)
        assert cluster.urls == [f"nats://127.0.0.1:{p}" for p in client_ports]
        recorded = json.loads((tmp_path / "c" / "cluster.json").read_text())
        assert recorded == {"client_ports": client_ports, "route_ports": route_ports}
        # Every member now knows the real routes of the others, for its restarts.
        for i, member in enumerate(cluster.members):
            assert member.cluster is not None
            assert sorted(member.cluster.routes) == sorted(
                f"nats-route://127.0.0.1:{p}" for j, p in enumerate(route_ports) if j != i
            )
    # Started again from the same directory, it listens where it did.
    async with NatsCluster(tmp_path / "c", size=3, ready_timeout_s=20) as again:
        assert [m.port for m in again.members] == client_ports
        assert [m.cluster_port for m in again.members] == route_ports


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=2) as response:
        body: dict[str, Any] = json.load(response)
    return body


async def test_max_payload_is_one_mebibyte(node_factory: NodeFactory) -> None:
    node = await node_factory()
    assert node.client.max_payload == 1024 * 1024


# --- credential lifetime --------------------------------------------------------


async def test_expired_credential_is_refused_at_connect(mesh: EmbeddedNatsServer) -> None:
    node = KeyPair.generate(Prefix.USER)
    issued = int(time.time()) - 120
    jwt = mesh.mint_user("lapsed", node.public_key, [">"], [">"], 60, now=issued)
    with pytest.raises(NatsError, match="Authorization Violation"):
        await connect_with_jwt(mesh.url, node, jwt)


async def test_credential_signed_by_another_account_is_refused(
    mesh: EmbeddedNatsServer, tmp_path: Path
) -> None:
    stranger = EmbeddedNatsServer(tmp_path / "elsewhere")
    node = KeyPair.generate(Prefix.USER)
    jwt = stranger.mint_user("stranger", node.public_key, [">"], [">"], 60)
    with pytest.raises(NatsError, match="Authorization Violation"):
        await connect_with_jwt(mesh.url, node, jwt)


async def test_broker_disconnects_when_credential_expires(mesh: EmbeddedNatsServer) -> None:
    node = KeyPair.generate(Prefix.USER)
    # 3 s, not 1: on a loaded machine connecting can take a second or more, and a
    # credential that lapses during the handshake fails the connect instead.
    jwt = mesh.mint_node_credential(node.public_key, [], 3)
    client = await connect_with_jwt(
        mesh.url, node, jwt, inbox_prefix=node_inbox_prefix(node.public_key)
    )
    try:
        await eventually_async(lambda: client.is_closed, what="the broker closing the expired connection")
        assert "expired" in str(client.last_error)
    finally:
        await client.close()


# --- keys -------------------------------------------------------------------------


async def test_keys_are_private_and_survive_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    node = KeyPair.generate(Prefix.USER)
    async with EmbeddedNatsServer(data) as first:
        jwt = first.mint_node_credential(node.public_key, [], 300)
        operator = first.operator_public_key
    mesh_dir = data / "mesh"
    assert stat.S_IMODE(mesh_dir.stat().st_mode) == 0o700
    for name in ("operator.nk", "system-account.nk", "mesh-account.nk"):
        assert stat.S_IMODE((mesh_dir / name).stat().st_mode) == 0o600
    assert (mesh_dir / "operator.nk").read_text().startswith("SO")

    async with EmbeddedNatsServer(data) as second:
        assert second.operator_public_key == operator
        client = await connect_with_jwt(
            second.url, node, jwt, inbox_prefix=node_inbox_prefix(node.public_key)
        )
        await client.close()


async def test_key_files_are_created_owner_only_under_any_umask(tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        keys = EmbeddedNatsServer(tmp_path / "data").keys
    finally:
        os.umask(previous)
    assert keys.operator.role is Prefix.OPERATOR
    for path in (tmp_path / "data" / "mesh").glob("*.nk"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


# --- the child process ------------------------------------------------------------


async def test_stop_leaves_no_process(mesh: EmbeddedNatsServer) -> None:
    pid = mesh.pid
    assert pid is not None
    await mesh.stop()
    assert not process_alive(pid)
    assert mesh.pid is None
    await mesh.stop()  # idempotent


async def test_cancelling_the_owning_task_stops_the_server(tmp_path: Path) -> None:
    server = EmbeddedNatsServer(tmp_path / "data")

    async def own_the_mesh() -> None:
        async with server:
            await asyncio.Event().wait()

    owner = asyncio.create_task(own_the_mesh())
    await eventually_async(lambda: server.is_ready)
    pid = server.pid
    assert pid is not None and process_alive(pid)
    owner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await owner
    assert not process_alive(pid)


async def test_cancelling_the_supervisor_stops_the_server(tmp_path: Path) -> None:
    # What asyncio.run does to leftover tasks at shutdown.
    server = EmbeddedNatsServer(tmp_path / "data")
    await server.start()
    pid = server.pid
    assert pid is not None and server._supervisor is not None
    server._supervisor.cancel()
    await asyncio.wait([server._supervisor])
    await eventually_async(lambda: not process_alive(pid), timeout=30)
    await server.stop()


async def test_unresponsive_server_is_killed_after_the_budget(tmp_path: Path) -> None:
    server = EmbeddedNatsServer(tmp_path / "data", stop_timeout_s=0.3)
    await server.start()
    pid = server.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # SIGTERM now stays pending; only SIGKILL ends it
    started = time.monotonic()
    await server.stop()
    assert not process_alive(pid)
    assert time.monotonic() - started < 3


async def test_crashed_server_is_restarted_on_the_same_port(tmp_path: Path) -> None:
    server = EmbeddedNatsServer(tmp_path / "data", restart_backoff_s=(0.05, 0.5))
    async with server:
        port, first_pid = server.port, server.pid
        assert first_pid is not None
        node = KeyPair.generate(Prefix.USER)
        jwt = server.mint_node_credential(node.public_key, [], 300, role="service")
        client = await connect_with_jwt(
            server.url, node, jwt, inbox_prefix=node_inbox_prefix(node.public_key),
            allow_reconnect=True, reconnect_time_wait=0.05, max_reconnect_attempts=-1,
        )
        try:
            js = client.jetstream(timeout=10)
            await js.add_stream(StreamConfig(name="MESH_TASKS", subjects=["mesh.task.>"]))
            await js.publish("mesh.task.t1.update", b"before the crash")

            os.kill(first_pid, signal.SIGKILL)
            await eventually_async(lambda: server.restarts == 1 and server.is_ready, timeout=30)
            assert server.port == port
            assert server.pid not in (None, first_pid)
            assert not process_alive(first_pid)

            await eventually_async(lambda: client.is_connected, timeout=30)
            stored = await js.get_msg("MESH_TASKS", 1)
            assert stored.data == b"before the crash"
        finally:
            await client.close()


_ORPHAN_PROBE = """
import asyncio, sys
from meshnode.transport.embedded import EmbeddedNatsServer

async def main() -> None:
    server = EmbeddedNatsServer(sys.argv[1])
    await server.start()
    print(server.pid, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
async def test_server_dies_with_a_killed_parent(tmp_path: Path) -> None:
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _ORPHAN_PROBE, str(tmp_path / "data"),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert parent.stdout is not None
        line = await asyncio.wait_for(parent.stdout.readline(), timeout=15)
        child = int(line)
        assert process_alive(child)
        parent.kill()  # SIGKILL: no cleanup code runs in the parent
        await parent.wait()
        await eventually_async(lambda: not process_alive(child), timeout=30)
    finally:
        if parent.returncode is None:
            parent.kill()
            await parent.wait()


async def test_start_failure_names_a_taken_port(tmp_path: Path) -> None:
    # nats-server's log starts with a banner; the error is its fatal line, made
    # into "port N in use" (issue #18), not the banner's last lines.
    async with EmbeddedNatsServer(tmp_path / "one") as first:
        clash = EmbeddedNatsServer(tmp_path / "two", port=first.port, ready_timeout_s=5)
        with pytest.raises(PortInUse, match=rf"^port {first.port} in use: another nats-server\?") as caught:
            await clash.start()
        assert caught.value.listener == "client" and caught.value.port == first.port
        assert "JETSTREAM" not in str(caught.value)
        assert clash.pid is None
