"""A participant trying to break everyone else's work (#22 holes 5-8), against one live
embedded-mesh daemon: endpoint hijack, control-plane denial, per-node service budget,
starter-credential scope. Each is refused or bounded while legitimate nodes keep working.

One daemon for the whole module (limits lowered in its configuration so the floods
stay short); every participant is enrolled the way an operator does it (``Mesh.Invite``)
and renews over HTTP like a joined node.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest
from nats.aio.client import Client

from meshnode.control_plane import ControlPlaneClient, CredentialRefused
from meshnode.protocol.attestations import make_vouch
from meshnode.protocol.envelope import (
    build_envelope,
    decode_envelope,
    encode_envelope,
    sign_envelope,
)
from meshnode.protocol.nkeys import KeyPair
from meshnode.testing import DaemonProcess, DaemonSet, eventually_async
from meshnode.transport.connection import flush_written
from meshnode.transport.jwt import decode_jwt
from meshnode.transport.permissions import node_inbox_prefix

from .conftest import ClientErrors, connect_with_jwt

pytestmark = pytest.mark.integration

NODE_LIMIT = 25  # [registry] node_rate_limit and unvouched_rate_limit, per minute
ADDRESS_LIMIT = 5  # [mesh.embedded.control_plane] rate_limit, per minute


@pytest.fixture(scope="module")
def host() -> Iterator[DaemonProcess]:
    daemons = DaemonSet()
    try:
        yield daemons.embedded(
            "host",
            agents={"echo": {"plugin": "echo"}},
            extra={
                "registry": {"node_rate_limit": NODE_LIMIT, "unvouched_rate_limit": NODE_LIMIT},
                # A long head timeout: idle connections are then dropped by eviction only.
                "mesh.embedded.control_plane": {"rate_limit": ADDRESS_LIMIT, "head_timeout": "60s"},
            },
        )
    finally:
        daemons.close()


@dataclass
class Participant:
    key: KeyPair
    agents: list[KeyPair]
    client: Client
    errors: ClientErrors

    @property
    def node_id(self) -> str:
        return self.key.public_key

    async def close(self) -> None:
        await self.client.close()


async def _admin(host: DaemonProcess, method: str, params: dict[str, Any] | None = None) -> Any:
    # The admin client runs its own event loop: call it off this one.
    return await asyncio.to_thread(host.admin, method, params)


async def _control_url(host: DaemonProcess) -> str:
    return str((await _admin(host, "Mesh.Info"))["control_plane"])


async def _join(host: DaemonProcess, name: str, agent_count: int = 1) -> Participant:
    """Enrol ``name`` with an invite, renew for a roster over HTTP, connect to NATS."""
    invite = await _admin(host, "Mesh.Invite", {"name": name})
    key = KeyPair.from_seed(invite["node_seed"])
    agents = [KeyPair.generate() for _ in range(agent_count)]
    grant = await ControlPlaneClient(await _control_url(host)).request_credential(key, agents)
    errors = ClientErrors()
    client = await connect_with_jwt(
        grant.nats_endpoints[0], key, grant.jwt,
        inbox_prefix=node_inbox_prefix(key.public_key), errors=errors,
    )
    return Participant(key, agents, client, errors)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _signed(kind: str, key: KeyPair, payload: Any = None) -> dict[str, Any]:
    return sign_envelope(build_envelope(kind, key.public_key, now_ms=now_ms(), payload=payload), key)


async def _request(client: Client, subject: str, env: dict[str, Any]) -> dict[str, Any]:
    msg = await client.request(subject, encode_envelope(env), timeout=5.0)
    reply = decode_envelope(msg.data)
    assert reply["in_reply_to"] == env["id"]
    return reply


def _manifest(agent: KeyPair, node: KeyPair, **members: Any) -> dict[str, Any]:
    t = now_ms()
    manifest: dict[str, Any] = {
        "id": agent.public_key,
        "name": "mallory",
        "description": "not what it seems",
        "version": "1.0.0",
        "protocol_version": "0.3.0",
        "endpoint": f"mesh.agent.{agent.public_key}.inbox",
        "node": {"id": node.public_key, "attestation": make_vouch(node, agent.public_key, t - 1000, t + 3_600_000)},
        "capabilities": ["echo"],
        "offerings": [{"id": "echo", "name": "Echo", "tags": ["text"], "input_modes": ["text/plain"]}],
    }
    manifest.update(members)
    return manifest


async def _register(p: Participant, agent: KeyPair, manifest: dict[str, Any]) -> dict[str, Any]:
    return await _request(p.client, f"mesh.registry.register.{p.node_id}", _signed("register", agent, manifest))


def _error(reply: dict[str, Any]) -> dict[str, Any] | None:
    error = reply.get("error")
    return error if isinstance(error, dict) else None


# --- #22.5 endpoint hijack ------------------------------------------------------------


async def test_an_endpoint_pointing_at_another_agents_inbox_is_refused(host: DaemonProcess) -> None:
    victim_inbox = f"mesh.agent.{await asyncio.to_thread(host.agent_id, 'echo')}.inbox"
    mallory = await _join(host, "hijacker")
    agent = mallory.agents[0]
    try:
        for hijack in ({"endpoint": victim_inbox}, {"endpoints": {"inbox": victim_inbox}}):
            reply = await _register(mallory, agent, _manifest(agent, mallory.key, **hijack))
            error = _error(reply)
            assert error is not None, reply
            assert error["code"] == "UNAUTHORIZED"
            assert error["details"]["reason"] == "endpoint_not_own"
            assert "allow_foreign_endpoints" in error["message"]
        # Nothing was stored: the victim's callers still resolve the victim only.
        got = await _request(mallory.client, f"mesh.registry.get.{agent.public_key}",
                             _signed("discover", agent, {}))
        assert _error(got) is not None and _error(got)["code"] == "NOT_FOUND"  # type: ignore[index]
        # The same node registering its agent with its own endpoint works.
        reply = await _register(mallory, agent, _manifest(agent, mallory.key))
        assert _error(reply) is None, reply
        got = await _request(mallory.client, f"mesh.registry.get.{agent.public_key}",
                             _signed("discover", agent, {}))
        assert got["payload"]["endpoints"] == {"inbox": f"mesh.agent.{agent.public_key}.inbox"}
    finally:
        await mallory.close()


# --- #22.7 per-node service budget ----------------------------------------------------


async def _discover_outcomes(p: Participant, signers: list[KeyPair], count: int) -> list[str]:
    outcomes = []
    for i in range(count):
        reply = await _request(p.client, "mesh.registry.discover", _signed("discover", signers[i % len(signers)], {}))
        error = _error(reply)
        outcomes.append("ok" if error is None else str(error["code"]))
    return outcomes


async def test_fresh_sender_keys_do_not_multiply_a_nodes_service_budget(host: DaemonProcess) -> None:
    flooder = await _join(host, "flooder", agent_count=3)
    alice = await _join(host, "alice")
    try:
        for agent in flooder.agents:
            assert _error(await _register(flooder, agent, _manifest(agent, flooder.key))) is None
        # Vouched senders of one node share that node's budget (each is far below
        # its own per-sender budget of 60): registrations count too.
        outcomes = await _discover_outcomes(flooder, flooder.agents, 40)
        assert outcomes.count("ok") == NODE_LIMIT - len(flooder.agents), outcomes
        assert set(outcomes[NODE_LIMIT:]) == {"RATE_LIMITED"}
        # 40 fresh keys nobody vouches for share one budget: no key is a new budget.
        fresh = [KeyPair.generate() for _ in range(40)]
        outcomes = await _discover_outcomes(flooder, fresh, 40)
        assert outcomes.count("ok") <= NODE_LIMIT and outcomes[-1] == "RATE_LIMITED", outcomes
        reply = await _request(flooder.client, "mesh.registry.discover", _signed("discover", fresh[0], {}))
        assert _error(reply) is not None and _error(reply)["details"]["scope"] == "node"  # type: ignore[index]
        # Another node, and the host's own agents, are untouched.
        agent = alice.agents[0]
        assert _error(await _register(alice, agent, _manifest(agent, alice.key))) is None
        assert await _discover_outcomes(alice, [agent], 3) == ["ok"] * 3
        assert (await asyncio.to_thread(host.call, "echo", "echo", "still here"))["output"] == {"ok": "still here"}
    finally:
        await flooder.close()
        await alice.close()


# --- #22.8 the starter credential -----------------------------------------------------


async def test_the_starter_credential_in_an_invite_grants_nothing(host: DaemonProcess) -> None:
    invite = await _admin(host, "Mesh.Invite", {"name": "starter-holder"})
    key = KeyPair.from_seed(invite["node_seed"])
    errors = ClientErrors()
    url = (await _admin(host, "Mesh.Info"))["nats_urls"][0]
    client = await connect_with_jwt(url, key, invite["jwt"], inbox_prefix=node_inbox_prefix(key.public_key),
                                    errors=errors)
    try:
        # It connects (the invite keeps the NATS creds format) and can do nothing:
        # no heartbeat, no registration, no reading of anything.
        await client.subscribe("mesh.event.>")
        await client.publish(f"mesh.heartbeat.{key.public_key}", b"{}")
        await flush_written(client)

        async def refused_twice() -> bool:
            return sum("permissions violation" in e.lower() for e in errors.messages()) >= 2

        await eventually_async(refused_twice, timeout=30.0)
    finally:
        await client.close()
    # The invite's key is what enrols: the node renews for its real credential over HTTP.
    grant = await ControlPlaneClient(await _control_url(host)).request_credential(key, [])
    assert grant.jwt != invite["jwt"]


# --- #22.6 control-plane denial -------------------------------------------------------


async def test_idle_held_connections_do_not_stop_a_renewal(host: DaemonProcess) -> None:
    url = urlsplit(await _control_url(host))
    assert url.hostname is not None and url.port is not None
    invite = await _admin(host, "Mesh.Invite", {"name": "renewer"})
    key = KeyPair.from_seed(invite["node_seed"])
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for _ in range(70):  # slowloris: connect, send half a head, never finish
            reader, writer = await asyncio.open_connection(url.hostname, url.port)
            writer.write(b"POST /v1/node-credential HTTP/1.1\r\n")
            held.append((reader, writer))
        await asyncio.gather(*(w.drain() for _, w in held))

        async def evicting() -> bool:
            # The control plane is at its connection limit (64) and drops the oldest
            # idle connections, not new ones (its head timeout is 60 s here).
            return sum(r.at_eof() or r.exception() is not None for r, _ in held) >= 70 - 64

        await eventually_async(evicting, timeout=15.0)
        grant = await ControlPlaneClient(await _control_url(host), timeout_s=5.0).request_credential(key, [])
        assert decode_jwt(grant.jwt)[1]["sub"] == key.public_key
    finally:
        for _, writer in held:
            writer.close()


async def _junk(url: str) -> int:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    body = json.dumps({"node_id": "junk"}).encode()
    writer.write(
        b"POST /v1/node-credential HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    status_line = await reader.readline()
    writer.close()
    return int(status_line.split()[1])


async def test_junk_from_the_same_address_does_not_lock_out_an_enrolled_node(host: DaemonProcess) -> None:
    invite = await _admin(host, "Mesh.Invite", {"name": "neighbour"})
    key = KeyPair.from_seed(invite["node_seed"])
    control = await _control_url(host)
    statuses = [await _junk(control) for _ in range(ADDRESS_LIMIT + 3)]
    assert statuses[-1] == 429 and 400 in statuses, statuses
    # A stranger's well-signed request is still junk to this address: refused.
    with pytest.raises(CredentialRefused) as refused:
        await ControlPlaneClient(control).request_credential(KeyPair.generate(), [])
    assert refused.value.status == 429
    # The enrolled node on the same host spends its own node key's budget.
    for _ in range(3):
        grant = await ControlPlaneClient(control).request_credential(key, [])
        assert decode_jwt(grant.jwt)[1]["sub"] == key.public_key
