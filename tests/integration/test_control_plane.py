"""The control plane beside a real embedded mesh: an invited node renews over HTTP
for its roster and the broker enforces exactly that roster (§4.8, §14.3, §18.10);
refusal is how retirement reaches a node."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from meshnode.control_plane import (
    ControlPlaneClient,
    ControlPlaneServer,
    CredentialRefused,
    node_credential_request,
    read_invite,
    write_invite,
)
from meshnode.daemon.credentials import request_credential_patiently
from meshnode.protocol.nkeys import KeyPair
from meshnode.transport.connection import flush_written
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.jwt import decode_jwt
from meshnode.transport.permissions import node_inbox_prefix

from .conftest import ClientErrors, connect_with_jwt

pytestmark = pytest.mark.integration


@pytest.fixture
async def control(
    mesh: EmbeddedNatsServer, tmp_path: Path
) -> AsyncIterator[ControlPlaneServer]:
    server = ControlPlaneServer(mesh, tmp_path / "control", port=0)
    async with server:
        yield server


async def _http(url: str, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    """One raw HTTP/1.1 exchange, to send what our own client never would."""
    host, port = url.removeprefix("http://").split(":")
    data = b"" if body is None else json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        writer.write(head.encode() + b"\r\n" + data)
        response = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    status_line, _, rest = response.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


async def test_invited_node_renews_for_its_roster_and_the_broker_enforces_it(
    mesh: EmbeddedNatsServer, control: ControlPlaneServer, tmp_path: Path
) -> None:
    # The operator invites a node; the invite travels as a file.
    path = tmp_path / "node-a.creds"
    write_invite(path, control.invite("node-a"), mesh.urls, control.url)
    invite = read_invite(path)
    assert invite.nats_urls == tuple(mesh.urls) and invite.control_plane_url == control.url
    node_key = invite.node_key

    # The starter credential lets the node connect and nothing more (it grants nothing).
    starter_errors = ClientErrors()
    starter = await connect_with_jwt(
        invite.nats_urls[0], node_key, invite.jwt,
        inbox_prefix=node_inbox_prefix(node_key.public_key), errors=starter_errors,
    )
    await starter.close()

    # Renewal over HTTP only — no NATS connection involved (§4.8).
    agents = [KeyPair.generate(), KeyPair.generate()]
    other_agent = KeyPair.generate()
    assert invite.control_plane_url is not None
    grant = await ControlPlaneClient(invite.control_plane_url).request_credential(
        node_key, agents
    )
    assert grant.nats_endpoints == tuple(mesh.urls) and grant.mesh_name == "meshnode-local"
    assert decode_jwt(grant.jwt)[1]["sub"] == node_key.public_key

    errors = ClientErrors()
    client = await connect_with_jwt(
        grant.nats_endpoints[0], node_key, grant.jwt,
        inbox_prefix=node_inbox_prefix(node_key.public_key), errors=errors,
    )
    try:
        inboxes = [
            await client.subscribe(f"mesh.agent.{agent.public_key}.inbox") for agent in agents
        ]
        await flush_written(client)
        for agent in agents:
            await client.publish(f"mesh.agent.{agent.public_key}.inbox", agent.public_key.encode())
        for agent, inbox in zip(agents, inboxes, strict=True):
            assert (await inbox.next_msg(timeout=2)).data == agent.public_key.encode()
        assert errors.seen == []

        foreign = f"mesh.agent.{other_agent.public_key}.inbox"
        await client.subscribe(foreign)
        await flush_written(client)
        await errors.wait_for(f'permissions violation for subscription to "{foreign}"')
    finally:
        await client.close()


async def test_unknown_node_is_refused(control: ControlPlaneServer) -> None:
    with pytest.raises(CredentialRefused) as caught:
        await ControlPlaneClient(control.url).request_credential(
            KeyPair.generate(), [KeyPair.generate()]
        )
    assert caught.value.status in (401, 403)
    assert caught.value.code == "node_unknown" and caught.value.revoked


async def test_retired_node_is_refused_its_next_renewal(
    mesh: EmbeddedNatsServer, control: ControlPlaneServer
) -> None:
    node_key = KeyPair.from_seed(control.invite("node-b").node_seed)
    agents = [KeyPair.generate()]
    client = ControlPlaneClient(control.url)
    grant = await client.request_credential(node_key, agents)

    message = control.retire_node(node_key.public_key)
    assert "credential stays usable until" in message and "renewal is now refused" in message
    with pytest.raises(CredentialRefused) as caught:
        await client.request_credential(node_key, agents)
    assert (caught.value.status, caught.value.code) == (403, "node_retired")

    # What the message warns about: the credential already issued still connects.
    connection = await connect_with_jwt(
        mesh.url, node_key, grant.jwt, inbox_prefix=node_inbox_prefix(node_key.public_key)
    )
    await connection.close()


async def test_retired_agent_is_refused_but_the_rest_of_the_roster_renews(
    control: ControlPlaneServer,
) -> None:
    node_key = KeyPair.from_seed(control.invite("node-c").node_seed)
    keep, drop = KeyPair.generate(), KeyPair.generate()
    client = ControlPlaneClient(control.url)
    await client.request_credential(node_key, [keep, drop])
    assert "renewal of any credential covering it is now refused" in control.retire_agent(
        drop.public_key
    )
    with pytest.raises(CredentialRefused) as caught:
        await client.request_credential(node_key, [keep, drop])
    assert (caught.value.status, caught.value.code) == (403, "agent_terminated")
    grant = await client.request_credential(node_key, [keep])
    assert grant.expires_at > 0


async def test_forged_agent_signature_is_401(control: ControlPlaneServer) -> None:
    node_key = KeyPair.from_seed(control.invite("node-d").node_seed)
    victim, mine = KeyPair.generate(), KeyPair.generate()
    # The node claims an agent whose key it does not hold: it signs for it
    # with a key it does have.
    body = node_credential_request(node_key, [victim, mine], int(time.time()))
    body["agents"][0]["sig"] = base64.b64encode(
        mine.sign(f"mesh-node-agent-v1:{body['ts']}:{node_key.public_key}:{victim.public_key}"
                  .encode())
    ).decode()
    status, answer = await _http(control.url, "POST", "/v1/node-credential", body)
    assert (status, answer["code"]) == (401, "bad_signature")
    assert "jwt" not in answer


async def test_mesh_info_is_public(mesh: EmbeddedNatsServer, control: ControlPlaneServer) -> None:
    status, answer = await _http(control.url, "GET", "/v1/mesh")
    assert status == 200
    assert answer == {
        "name": "meshnode-local",
        "protocol": "0.3",
        "nats_endpoints": mesh.urls,
        "control_plane": control.url,
        "inbox_prefixes": {"node": "_INBOX_{node_id}", "sdk": "_INBOX"},
    }
    info = await ControlPlaneClient(control.url).mesh_info()
    assert info.nats_endpoints == tuple(mesh.urls) and info.protocol == "0.3"


async def test_rate_limit_answers_429(control: ControlPlaneServer) -> None:
    # §16.2: 30 requests per sliding 60 s per address; the 31st is refused.
    for _ in range(30):
        status, _ = await _http(control.url, "GET", "/v1/mesh")
        assert status == 200
    status, answer = await _http(control.url, "GET", "/v1/mesh")
    assert status == 429
    assert answer["code"] == "rate_limited"
    assert 0 < answer["retry_after_ms"] <= 60_000
    with pytest.raises(CredentialRefused) as caught:
        await ControlPlaneClient(control.url).request_credential(KeyPair.generate(), [])
    assert caught.value.status == 429 and caught.value.retryable
    assert caught.value.retry_after_ms is not None


async def test_trust_tier_is_enrolled_persisted_and_renewed_with(
    control: ControlPlaneServer,
) -> None:
    with pytest.raises(ValueError, match="trust_tier must be one of"):
        control.invite("node-t0", trust_tier="gold")
    sandboxed = KeyPair.from_seed(control.invite("node-t1", trust_tier="sandbox").node_seed)
    standard = KeyPair.from_seed(control.invite("node-t2").node_seed)
    assert control.is_sandbox_node(sandboxed.public_key)
    assert not control.is_sandbox_node(standard.public_key)
    assert control.trust_tier_of(KeyPair.generate().public_key) is None
    # The tier lives in the enrolment state file, so it survives a restart.
    state = json.loads(control.state_path.read_text())
    assert state["nodes"][sandboxed.public_key]["trust_tier"] == "sandbox"
    # Every renewal carries it again; the node cannot ask for another.
    grant = await ControlPlaneClient(control.url).request_credential(sandboxed, [KeyPair.generate()])
    assert "agentmesh:trust_tier:sandbox" in decode_jwt(grant.jwt)[1]["nats"]["tags"]


async def test_a_rate_limited_credential_request_waits_its_turn_and_is_granted(
    mesh: EmbeddedNatsServer, tmp_path: Path
) -> None:
    """Roster changes in quick succession (a script adding and removing agents)
    each need a credential: past the per-node limit the daemon waits the 429's
    Retry-After and asks again instead of failing the change (the soak hit it)."""
    server = ControlPlaneServer(mesh, tmp_path / "control", port=0, node_rate_limit=1, rate_window_ms=4000)
    async with server:
        path = tmp_path / "node-a.creds"
        write_invite(path, server.invite("node-a"), mesh.urls, server.url)
        node_key = read_invite(path).node_key
        client = ControlPlaneClient(server.url)
        agents = [KeyPair.generate()]
        await request_credential_patiently(client, node_key, agents)
        # The limit is spent: a plain request is refused with the time to wait ...
        with pytest.raises(CredentialRefused) as caught:
            await client.request_credential(node_key, agents)
        assert caught.value.status == 429 and caught.value.retry_after_ms is not None
        # ... which the patient request waits out, and is granted.
        grant = await request_credential_patiently(client, node_key, agents)
        assert decode_jwt(grant.jwt)[1]["sub"] == node_key.public_key
        # Without the patience for it, the refusal is reported as it came.
        with pytest.raises(CredentialRefused) as refused:
            await request_credential_patiently(client, node_key, agents, patience_s=0.0)
        assert refused.value.status == 429
