"""Tenancy on a real embedded mesh (§15): each tenant is a NATS account with its
own registry; nothing crosses an account boundary but what an export names.

One broker serves three accounts: the mesh's own (tenant ``mesh``, "A"), ``b``
and ``c``. The mesh exports one agent's inbox and its discovery to ``b``;
``c`` gets nothing. Every party is a participant on the §14.3 credential of
its roster, so every refusal below is the broker's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats.errors
import pytest

from meshnode.admin.protocol import Refused
from meshnode.daemon.platform import PlatformServices, start_platform_services
from meshnode.protocol.attestations import verify_trust_attestation
from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.services import ServiceContext
from meshnode.testing import DaemonProcess, DaemonSet, eventually, eventually_async, render_toml
from meshnode.transport.connection import MeshConnection, Message
from meshnode.transport.embedded import (
    EmbeddedNatsServer,
    TenantExport,
    external_discover_subject,
    imported_agents,
)
from meshnode.transport.jwt import decode_jwt

from .conftest import connect
from .sdk_client import SdkClient
from .test_services import Participant, call, signed
from .wire_client import UserKey, WireAgent

pytestmark = pytest.mark.integration


@dataclass
class Tenants:
    server: EmbeddedNatsServer
    exported: KeyPair
    """An agent of the mesh tenant whose inbox is exported to ``b``."""
    private: KeyPair
    """An agent of the mesh tenant exported to nobody."""
    a: Participant
    b: Participant
    c: Participant


async def _participant(
    server: EmbeddedNatsServer, tenant: str | None, agents: list[KeyPair], opened: list[MeshConnection]
) -> Participant:
    key = KeyPair.generate(Prefix.USER)
    jwt = server.mint_node_credential(
        key.public_key, [a.public_key for a in agents], 300, tenant=tenant
    )
    conn = await connect(server, key, jwt)
    opened.append(conn)
    return Participant(key, agents, conn)


@pytest.fixture
async def tenants(tmp_path: Path) -> AsyncIterator[Tenants]:
    exported, private = KeyPair.generate(Prefix.USER), KeyPair.generate(Prefix.USER)
    server = EmbeddedNatsServer(
        tmp_path / "data",
        ready_timeout_s=10.0,
        stop_timeout_s=5.0,
        tenants=("b", "c"),
        exports=[TenantExport("mesh", "b", agents=(exported.public_key,), discover=True)],
    )
    await server.start()
    opened: list[MeshConnection] = []
    platforms: list[PlatformServices] = []
    try:
        # One registry per account, as the daemon runs them (§15.1: subjects,
        # streams and KV buckets are account-scoped).
        for tenant in (None, "b", "c"):
            service_key = KeyPair.generate(Prefix.USER)
            jwt = server.mint_node_credential(
                service_key.public_key, [], 300, role="service", tenant=tenant
            )
            conn = await connect(server, service_key, jwt)
            opened.append(conn)
            ctx = ServiceContext(
                connection=conn, key=KeyPair.generate(Prefix.USER), node_id=service_key.public_key
            )
            platforms.append(await start_platform_services(
                ctx, imported=imported_agents(tenant or "mesh", server.exports)
            ))
        world = Tenants(
            server,
            exported,
            private,
            a=await _participant(server, None, [exported, private], opened),
            b=await _participant(server, "b", [KeyPair.generate(Prefix.USER)], opened),
            c=await _participant(server, "c", [KeyPair.generate(Prefix.USER)], opened),
        )
        for party in (world.a, world.b, world.c):
            for agent in party.agents:
                reply = await party.register(agent)
                assert "error" not in reply, reply.get("error")
        yield world
    finally:
        for platform in platforms:
            with contextlib.suppress(Exception):
                await platform.stop()
        for conn in opened:
            with contextlib.suppress(Exception):
                await conn.close(drain_timeout=1)
        await server.stop()


async def _discover(party: Participant, subject: str = "mesh.registry.discover") -> set[str]:
    reply = await call(party.conn, subject, signed("discover", party.agents[0], {}))
    assert "error" not in reply, reply.get("error")
    return {entry["id"] for entry in reply["payload"]["agents"]}


async def test_credentials_are_signed_by_the_tenant_account(tenants: Tenants) -> None:
    server = tenants.server
    key = KeyPair.generate(Prefix.USER)
    _, claims = decode_jwt(server.mint_node_credential(key.public_key, [], 60, tenant="b"))
    assert claims["iss"] == server.tenant_account_public_key("b") != server.account_public_key
    assert "agentmesh:tenant:b" in claims["nats"]["tags"]
    with pytest.raises(ValueError, match="no tenant named"):
        server.mint_node_credential(key.public_key, [], 60, tenant="nobody")


async def test_each_tenant_discovers_only_its_own_agents(tenants: Tenants) -> None:
    a_ids = {tenants.exported.public_key, tenants.private.public_key}
    assert await _discover(tenants.a) == a_ids
    assert await _discover(tenants.b) == {tenants.b.agents[0].public_key}
    assert await _discover(tenants.c) == {tenants.c.agents[0].public_key}


async def test_exported_discovery_reaches_the_exporting_registry_only_where_imported(
    tenants: Tenants,
) -> None:
    subject = external_discover_subject("mesh")
    # b imported the mesh tenant's discovery under a subject of its own (§15.2)...
    assert await _discover(tenants.b, subject) == {
        tenants.exported.public_key, tenants.private.public_key,
    }
    # ...c did not: the subject leads nowhere in its account.
    with pytest.raises(nats.errors.NoRespondersError):
        await tenants.c.conn.nc.request(subject, b"{}", timeout=3.0)


async def test_an_exported_agent_resolves_through_the_importing_tenants_own_registry(
    tenants: Tenants,
) -> None:
    exported, private = tenants.exported.public_key, tenants.private.public_key
    asker = tenants.b.agents[0]
    got = await call(tenants.b.conn, f"mesh.registry.get.{exported}", signed("discover", asker, {}))
    assert got["payload"]["id"] == exported and "error" not in got
    for party, agent in ((tenants.b, private), (tenants.c, exported)):
        reply = await call(party.conn, f"mesh.registry.get.{agent}", signed("discover", party.agents[0], {}))
        assert reply["error"]["code"] == "NOT_FOUND"


async def test_only_an_exported_inbox_is_reachable_from_another_tenant(tenants: Tenants) -> None:
    received: list[str] = []

    async def on(msg: Message) -> None:
        received.append(msg.subject)
        if msg.reply:
            await tenants.a.conn.publish(msg.reply, b'{"delivered":true}')

    for agent in (tenants.exported, tenants.private):
        await tenants.a.conn.subscribe(f"mesh.agent.{agent.public_key}.inbox", on)
    await tenants.a.conn.flush()
    exported = f"mesh.agent.{tenants.exported.public_key}.inbox"
    private = f"mesh.agent.{tenants.private.public_key}.inbox"

    # Within the tenant both inboxes are reachable.
    for subject in (exported, private):
        assert (await tenants.a.conn.request(subject, b"{}", timeout=3.0)).data == b'{"delivered":true}'
    received.clear()

    # From b the exported inbox answers, through the account boundary...
    reply = await tenants.b.conn.request(exported, b"{}", timeout=3.0)
    assert reply.data == b'{"delivered":true}'
    await eventually_async(lambda: received == [exported])
    # ...and the private one has no route at all; nor has anything from c.
    for party, subject in ((tenants.b, private), (tenants.c, exported), (tenants.c, private)):
        with pytest.raises(nats.errors.NoRespondersError):
            await party.conn.nc.request(subject, b"{}", timeout=3.0)
    # An export is one-way: the mesh tenant cannot reach b's agent.
    b_inbox = f"mesh.agent.{tenants.b.agents[0].public_key}.inbox"
    seen_in_b: list[Message] = []

    async def in_b(msg: Message) -> None:
        seen_in_b.append(msg)

    await tenants.b.conn.subscribe(b_inbox, in_b)
    await tenants.b.conn.flush()
    with pytest.raises(nats.errors.NoRespondersError):
        await tenants.a.conn.nc.request(b_inbox, b"{}", timeout=3.0)
    assert received == [exported] and seen_in_b == []


# --- the daemon: tenants from configuration, a node invited into one ----------------


def _discovered(daemon: DaemonProcess) -> set[str]:
    return {entry["id"] for entry in daemon.admin("Discover", {})["agents"]}


def test_a_node_invited_into_a_tenant_lives_in_that_tenant_only(meshnode_daemons: DaemonSet) -> None:
    a = meshnode_daemons.embedded(
        "a",
        agents={"echo": {"plugin": "echo"}},
        extra={"mesh.embedded": {"tenants": ["family"]}},
    )
    f = meshnode_daemons.joined(
        "f", via=a, agents={"echo_f": {"plugin": "echo"}},
        invite_args=("--tenant", "family", "--trust-tier", "verified"),
    )
    echo, echo_f = a.agent_id("echo"), f.agent_id("echo_f")

    # The joined node reads what the operator attested from its own credential.
    credential = f.status()["credential"]
    assert credential["tenant"] == "family" and credential["trust_tier"] == "verified"
    assert credential["role"] == "participant"
    assert {n["name"]: n["tenant"] for n in a.admin("Mesh.Nodes")["nodes"]} == {"f": "family"}
    assert a.status()["mesh"]["tenants"] == ["family"]
    # Family's account has a store of its own, watched and reported beside the mesh's.
    eventually(lambda: a.status()["tenant_storage"]["family"]["state"] == "ok", what="family's store read")
    assert a.status()["tenant_storage"]["family"]["limit_bytes"] > 0
    prometheus = a.admin("Metrics", {"format": "prometheus"})["text"]
    assert 'meshnode_tenant_jetstream_store_limit_bytes{tenant="family"}' in prometheus

    # Each registers with its own tenant's registry and finds only its own tenant.
    assert all(agent.get("registered") for agent in f.status()["agents"])
    assert echo_f in _discovered(f) and echo not in _discovered(f)
    # Its manifests carry the operator's portable attestation issued with the credential (§9.7).
    manifest = f.admin("Discover", {"trust_tier": "verified"})["agents"][0]
    assert manifest["id"] in {agent["id"] for agent in f.status()["agents"]}
    assert verify_trust_attestation(
        manifest["node"]["trust_attestation"], now_ms=time.time_ns() // 1_000_000,
        expected_subject=f.status()["node"]["id"],
    ) == {"trust_tier": "verified", "role": "participant"}
    assert echo in _discovered(a) and echo_f not in _discovered(a)

    # Nor can one reach the other: there is not even a manifest to resolve.
    refused = a.call(echo_f, "echo", "hi", timeout=5)
    assert refused["status"] == "failed", refused
    assert refused["error"]["code"] in ("NOT_FOUND", "AGENT_UNAVAILABLE"), refused
    assert f.call("echo_f", "echo", "hi")["status"] == "completed"


def test_agents_exported_both_ways_converse_across_tenants(meshnode_daemons: DaemonSet) -> None:
    # The embedded node restarts below on the same broker and control-plane ports,
    # so the joined node reconnects to the addresses it knows: ports no connection
    # can take while it is down (a port-0 one could be).
    ports = {"port": meshnode_daemons.port_for_restarts(), "control_port": meshnode_daemons.port_for_restarts()}
    a = meshnode_daemons.embedded(
        "a", agents={"echo": {"plugin": "echo"}, "hidden": {"plugin": "echo"}},
        extra={"mesh.embedded": {"tenants": ["family"], **ports}},
    )
    f = meshnode_daemons.joined(
        "f", via=a, agents={"finder": {"plugin": "finder"}},
        node={"plugin_modules": ["tests.agents.finder:plugin"]}, invite_args=("--tenant", "family"),
    )
    echo, f_cli, finder = a.agent_id("echo"), f.agent_id("cli"), f.agent_id("finder")
    before = f.call(echo, "echo", "hi", timeout=5)
    assert before["status"] == "failed", before  # not exported: not even resolvable
    assert before["error"]["code"] == "NOT_FOUND", before
    # Nor is the mesh tenant's discovery: the refusal names the export that opens it.
    with pytest.raises(Refused, match=r'from = "mesh", to = this tenant, discover = true'):
        f.admin("Discover", {"exported_by": "mesh"})

    # The operator exports a's echo and its discovery to family and f's agents
    # back to mesh (an answer travels to the requester's inbox), then restarts
    # the mesh node.
    a.stop()
    a.config["mesh.embedded"]["exports"] = [
        {"from": "mesh", "to": "family", "agents": [echo], "discover": True},
        {"from": "family", "to": "mesh", "agents": [f_cli, finder]},
    ]
    a.config_path.write_text(render_toml(a.config), encoding="utf-8")
    a.start()

    answer: dict[str, Any] = {}

    def answered() -> bool:
        answer.update(f.call(echo, "echo", "hi", timeout=5))
        return answer.get("status") == "completed"

    info = a.admin("Mesh.Info")  # what runs: the exports the account JWTs were minted with
    assert info["tenants"] == ["mesh", "family"]
    assert info["exports"] == [
        {"from": "mesh", "to": "family", "agents": [echo], "discover": True},
        {"from": "family", "to": "mesh", "agents": [f_cli, finder], "discover": False},
    ]

    # f reconnects and re-registers on its own schedule.
    eventually(answered, timeout=60, interval=0.5, what="f's call across the export answered")
    assert answer["status"] == "completed", answer
    assert answer["from"] == echo and "hi" in str(answer["output"]), answer

    # Discovery across the export (§15.2): family asks the mesh tenant's registry,
    # from the CLI and from a handler, and what it finds answers a call.
    assert echo in {m["id"] for m in f.admin("Discover", {"exported_by": "mesh"})["agents"]}
    assert echo not in {m["id"] for m in f.admin("Discover", {})["agents"]}  # its own registry: own agents
    found = f.call("finder", "discover", {"exported_by": "mesh", "offering": "echo"})
    assert found["status"] == "completed", found
    hidden = a.agent_id("hidden")
    assert sorted((m["id"], m["local"]) for m in found["output"]) == sorted([(echo, False), (hidden, False)])
    assert f.call("finder", "ask", {"name": echo, "offering": "echo", "input": "via discovery"})["status"] == "completed"
    # Listed by the exported discovery, but its inbox is not exported: refused at
    # once by family's registry, not a request left to time out with no route.
    refused = f.call("finder", "ask", {"name": hidden, "offering": "echo", "input": "x"})
    assert refused["status"] == "failed" and refused["error"]["code"] == "NOT_FOUND", refused
    assert "not exported to this one" in refused["error"]["message"], refused


def _twice(input: Any, request: Any) -> Any:
    return {"twice": input}


async def test_an_sdk_agent_enrolled_into_a_tenant_lives_there(meshnode_daemons: DaemonSet) -> None:
    """`mesh token NAME --tenant family`: the SDK agent's credential is family's, it
    registers with family's registry, family's nodes find and call it, and the
    mesh's own tenant neither lists nor reaches it."""
    hub = await asyncio.to_thread(
        meshnode_daemons.embedded, "hub", agents={"echo": {"plugin": "echo"}},
        extra={"mesh.embedded": {"tenants": ["family"]}},
    )
    f = await asyncio.to_thread(
        meshnode_daemons.joined, "f", via=hub, agents={"fecho": {"plugin": "echo"}},
        invite_args=("--tenant", "family"),
    )
    token = await asyncio.to_thread(hub.admin, "Mesh.Token", {"name": "bot", "tenant": "family"})
    assert token["tenant"] == "family"
    control_plane = (await asyncio.to_thread(hub.admin, "Mesh.Info"))["control_plane"]
    bot = SdkClient(control_plane, WireAgent(UserKey.generate(), "bot", offerings={"twice": _twice}))
    await bot.start(token["token"])
    try:
        bot_id = bot.agent.id
        assert "agentmesh:tenant:family" in decode_jwt(bot.jwt)[1]["nats"]["tags"]
        assert {m["name"] for m in await bot.discover({})} >= {"bot", "fecho"}
        assert "echo" not in {m["name"] for m in await bot.discover({})}
        nodes = {n["name"]: n for n in (await asyncio.to_thread(hub.admin, "Mesh.Nodes"))["nodes"]}
        assert (nodes["bot"]["tenant"], nodes["bot"]["profile"]) == ("family", "sdk")
        answer = await asyncio.to_thread(f.call, bot_id, "twice", {"x": 1}, 10)
        assert answer["status"] == "completed" and answer["output"] == {"twice": {"x": 1}}, answer
        refused = await asyncio.to_thread(hub.call, bot_id, "twice", {"x": 1}, 10)
        assert refused["status"] == "failed" and refused["error"]["code"] == "NOT_FOUND", refused
    finally:
        await bot.disconnect()


def test_nodes_of_a_removed_tenant_are_named_at_start(meshnode_daemons: DaemonSet) -> None:
    """A tenant taken out of [mesh.embedded] tenants strands the nodes enrolled in
    it (no account: they can neither connect nor renew); the mesh node says so."""
    a = meshnode_daemons.embedded("a", extra={"mesh.embedded": {"tenants": ["family"]}})
    a.admin("Mesh.Invite", {"name": "grandma", "tenant": "family"})
    assert a.stop() == 0
    a.config["mesh.embedded"]["tenants"] = []
    a.config_path.write_text(render_toml(a.config), encoding="utf-8")
    a.start()
    assert "1 enrolled node(s) belong to tenants no longer in [mesh.embedded] tenants: grandma (family)" in (
        a.log_text())
