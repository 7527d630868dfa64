"""Agents written with the public AgentMesh SDKs on a meshnode mesh (issue #17).

An SDK-shaped client (:mod:`tests.integration.sdk_client`: default ``_INBOX.``
reply prefix, untokenized registration, a bootstrap token, one agent per
connection) joins one shared embedded mesh and goes through everything an SDK
agent does there; the security tests then check what its credential cannot do.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import nats
import pytest
from nats.errors import TimeoutError as NatsTimeout

from meshnode.testing import DaemonProcess, DaemonSet, eventually_async, run_cli
from tests.integration.sdk_client import SdkClient, bootstrap
from tests.integration.wire_client import (
    CredentialRefused,
    ServiceError,
    UserKey,
    WireAgent,
    build_envelope,
)

pytestmark = pytest.mark.integration

PLUGINS = {"plugin_modules": ["tests.agents:plugin", "tests.agents:listener_plugin"]}


@pytest.fixture(scope="module")
def hub() -> Iterator[DaemonProcess]:
    daemons = DaemonSet()
    try:
        yield daemons.embedded(
            "hub",
            agents={"echo": {"plugin": "echo"}, "faulty": {"plugin": "test-faulty"},
                    "listener": {"plugin": "test-listener"}},
            node=PLUGINS,
        )
    finally:
        daemons.close()


def _token(hub: DaemonProcess, name: str, **params: Any) -> str:
    token = hub.admin("Mesh.Token", {"name": name, **params})["token"]
    assert isinstance(token, str)
    return token


def _control_plane(hub: DaemonProcess) -> str:
    url = hub.admin("Mesh.Info")["control_plane"]
    assert isinstance(url, str)
    return url


def _twice(input: Any, request: Any) -> Any:
    return {"twice": input}


async def _sdk(hub: DaemonProcess, name: str) -> SdkClient:
    token = await asyncio.to_thread(_token, hub, name)
    client = SdkClient(await asyncio.to_thread(_control_plane, hub),
                       WireAgent(UserKey.generate(), name, offerings={"twice": _twice, "later": _twice}))
    client.deferred.add("later")
    await client.start(token)
    return client


async def test_an_sdk_agent_joins_and_works_both_ways(hub: DaemonProcess) -> None:
    # The operator's side: a single-use token on the command line.
    out = await asyncio.to_thread(run_cli, "mesh", "token", "sdk-bot", "--ttl", "1h", "--json",
                                  "--socket", hub.socket_path)
    token = json.loads(out.stdout)["token"]
    assert token.startswith("am_")
    # Where a client learns the reply prefix its credential allows.
    info = await asyncio.to_thread(hub.admin, "Mesh.Info")
    assert info["inbox_prefixes"] == {"node": "_INBOX_{node_id}", "sdk": "_INBOX"}
    with urllib.request.urlopen(info["control_plane"] + "/v1/mesh", timeout=10) as response:
        assert json.loads(response.read())["inbox_prefixes"] == info["inbox_prefixes"]
    agent = WireAgent(UserKey.generate(), "sdk-bot", offerings={"twice": _twice, "later": _twice})
    client = SdkClient(await asyncio.to_thread(_control_plane, hub), agent)
    client.deferred.add("later")
    try:
        # bootstrap -> connect -> register (untokenized, vouched by the credential key)
        answer = await client.bootstrap(token)
        assert answer["mesh"]["inbox_prefix"] == "_INBOX" and answer["label"] == "sdk-bot"
        assert set(answer) >= {"jwt", "seed", "mesh", "expires_at", "renew_url"}
        await client.connect()
        await client.serve(agent)
        _, registered = await client.register(agent)
        assert registered["payload"]["node_binding"] == "sdk_enrolled"

        # heartbeat -> online, and the enrolment shows in discovery's node profile
        await client.heartbeat()

        async def online() -> bool:
            found = await client.discover({"agent_ids": [agent.id]})
            return bool(found) and found[0].get("availability") == "online"

        await eventually_async(online, timeout=20)
        [mine] = await client.discover({"agent_ids": [agent.id]})
        assert mine["node"]["id"] == client.node_id and mine["node"]["profile"]["enrolment"] == "sdk"

        # discover meshnode's echo and call it: accept, then the answer at our inbox
        status = await asyncio.to_thread(hub.status)
        ids = {a["name"]: a["id"] for a in status["agents"]}
        [echo] = await client.discover({"agent_ids": [ids["echo"]]})
        sent = await client.publish_request(client.request_envelope(agent, echo["id"], "echo", {"hi": 1}),
                                            echo["endpoints"]["inbox"])
        responds = await client.wait_for(agent, sent.envelope["id"], timeout=15)
        assert [(r.get("payload") or {}).get("status") for r in responds][-1] == "completed"
        assert responds[-1]["from"] == echo["id"]

        # meshnode calls it, bare and deferred
        bare = await asyncio.to_thread(hub.call, agent.id, "twice", {"n": 1})
        assert (bare["status"], bare["output"], bare["from"]) == ("completed", {"twice": {"n": 1}}, agent.id)
        deferred = await asyncio.to_thread(hub.call, agent.id, "later", {"n": 2})
        assert (deferred["status"], deferred["output"]) == ("completed", {"twice": {"n": 2}})
        assert deferred["task_id"]

        # a hosted agent calls it
        relayed = await asyncio.to_thread(hub.call, "faulty", "relay",
                                          {"target": agent.id, "offering": "twice", "input": 3})
        assert relayed["output"]["relayed"] == {"twice": 3} and relayed["output"]["from"] == agent.id

        # events both ways
        await client.subscribe_events("demo.>")
        await asyncio.to_thread(hub.call, "listener", "emit", {"data": {"from": "hub"}})
        await eventually_async(
            lambda: any((e.get("payload") or {}).get("data") == {"from": "hub"} for e in client.events),
            timeout=15,
        )
        await client.emit("demo.tick", {"from": "sdk"})

        async def heard() -> bool:
            seen = (await asyncio.to_thread(hub.call, "listener", "seen"))["output"]
            return any(e["sender"] == agent.id and e["data"] == {"from": "sdk"} for e in seen)

        await eventually_async(heard, timeout=15)

        # offline delivery: a request sent while it is away waits in its mailbox
        await client.disconnect()
        away = await asyncio.to_thread(hub.call, agent.id, "twice", {"while": "away"}, 2.0)
        assert away["status"] != "completed"
        await client.connect()
        drained = await client.drain_mailbox()
        assert any((e.get("payload") or {}).get("input") == {"while": "away"} for e in drained)

        # renewal, then retirement refuses it
        renewed = await client.renew()
        assert renewed["node_id"] == client.node_id and renewed["mesh"]["inbox_prefix"] == "_INBOX"
        nodes = await asyncio.to_thread(hub.admin, "Mesh.Nodes", {})
        [enrolled] = [n for n in nodes["nodes"] if n["node_id"] == client.node_id]
        assert (enrolled["profile"], enrolled["agent_id"]) == ("sdk", agent.id)
        listing = await asyncio.to_thread(run_cli, "mesh", "nodes", "--socket", hub.socket_path)
        [line] = [ln for ln in listing.stdout.splitlines() if client.node_id in ln]
        assert line.split()[:2] == ["sdk-bot", "sdk"] and agent.id in line
        await asyncio.to_thread(hub.admin, "Mesh.Retire", {"node_id": client.node_id})
        with pytest.raises(CredentialRefused) as refused:
            await client.renew()
        assert refused.value.status == 403 and refused.value.body["code"] == "node_retired"
    finally:
        await client.close()


async def test_a_token_is_single_use_and_expired_or_revoked_ones_are_refused(hub: DaemonProcess) -> None:
    url = await asyncio.to_thread(_control_plane, hub)
    token = await asyncio.to_thread(_token, hub, "once")
    await asyncio.to_thread(bootstrap, url, token, UserKey.generate().public_key)
    with pytest.raises(CredentialRefused) as used:
        await asyncio.to_thread(bootstrap, url, token, UserKey.generate().public_key)
    assert used.value.body["code"] == "token_used"

    revoked = await asyncio.to_thread(_token, hub, "revoked")
    out = await asyncio.to_thread(run_cli, "mesh", "retire", "--token", "revoked", "--socket", hub.socket_path)
    assert "revoked" in out.stdout
    with pytest.raises(CredentialRefused) as gone:
        await asyncio.to_thread(bootstrap, url, revoked, UserKey.generate().public_key)
    assert gone.value.body["code"] == "token_revoked"

    minted = await asyncio.to_thread(hub.admin, "Mesh.Token", {"name": "expiring", "ttl_s": 1})
    # Wait on the clock itself (the token's expiry is whole seconds), then try once.
    await eventually_async(lambda: time.time() >= minted["expires_at"] + 1, timeout=10)
    with pytest.raises(CredentialRefused) as late:
        await asyncio.to_thread(bootstrap, url, minted["token"], UserKey.generate().public_key)
    assert late.value.body["code"] == "token_expired"


async def test_an_sdk_credential_reads_nobody_elses_mail(hub: DaemonProcess) -> None:
    """Not a meshnode node's private replies, not another agent's inbox or mailbox stream."""
    mallory = await _sdk(hub, "mallory")
    victim = await _sdk(hub, "victim")
    try:
        status = await asyncio.to_thread(hub.status)
        echo = next(a["id"] for a in status["agents"] if a["name"] == "echo")
        hub_node = (await asyncio.to_thread(hub.admin, "Mesh.Info"))["node_id"]
        for subject in (f"_INBOX_{hub_node}.>", f"mesh.agent.{victim.agent.id}.inbox",
                        f"mesh.agent.{echo}.inbox"):
            await mallory.conn.subscribe(subject)
            await mallory.barrier()

            def refused(s: str = subject) -> bool:
                # nats-py lower-cases the server's message, subject included.
                return any(f'subscription to "{s.lower()}"' in str(e) for e in mallory.errors)

            await eventually_async(
                refused,
                what=f"the server refusing the subscription to {subject}",
                timeout=10,
                detail=lambda: [str(e) for e in mallory.errors],
            )
        js = mallory.conn.jetstream(timeout=3)
        for stream in (f"MESH_INBOX_{victim.agent.id}", f"MESH_INBOX_{echo}"):
            with pytest.raises((NatsTimeout, nats.js.errors.Error)):
                await js.stream_info(stream)
        # Its own mailbox it may read (an SDK drains it when it reconnects).
        assert await mallory.drain_mailbox() == []
    finally:
        await mallory.close()
        await victim.close()


async def test_untokenized_registration_from_a_meshnode_node_is_refused(
    hub: DaemonProcess, tmp_path: Any
) -> None:
    # A meshnode-profile node (invited the ordinary way) may publish the
    # untokenized subject: the registry, not the broker, refuses it, with §4.4's answer.
    from tests.integration.wire_client import WireClient, read_invite

    invite_path = tmp_path / "plain.creds"
    await asyncio.to_thread(run_cli, "mesh", "invite", "plain-node", "--out", str(invite_path),
                            "--socket", hub.socket_path)
    assert "# meshnode-inbox-prefix: _INBOX_" in invite_path.read_text()
    plain = WireClient(read_invite(invite_path))
    agent = WireAgent(UserKey.generate(), "plain-agent")
    try:
        await plain.join([agent])
        with pytest.raises(ServiceError) as refused:
            await plain.service_request("mesh.registry.register", "register", agent, agent.manifest(plain.node_key))
        assert refused.value.code == "UNAUTHORIZED"
        assert refused.value.reply["error"]["details"]["reason"] == "untokenized_registration"
        # An SDK agent cannot register another agent under its enrolment either.
        sdk = await _sdk(hub, "honest")
        try:
            other = UserKey.generate()
            env = build_envelope("register", other, payload=WireAgent(other, "x").manifest(sdk.node_key))
            msg = await sdk.conn.request("mesh.registry.register", json.dumps(env).encode(), timeout=5)
            assert json.loads(msg.data)["error"]["details"]["reason"] == "sdk_enrolment_mismatch"
        finally:
            await sdk.close()
    finally:
        await plain.close()


async def test_a_self_vouching_sdk_agent_registers_and_goes_online(hub: DaemonProcess) -> None:
    # The Python SDK vouches with the agent's own key unless given a node seed.
    token = await asyncio.to_thread(_token, hub, "self-vouch")
    agent = WireAgent(UserKey.generate(), "self-vouch", offerings={"twice": _twice})
    client = SdkClient(await asyncio.to_thread(_control_plane, hub), agent, self_vouch=True)
    try:
        _, registered = await client.start(token)
        assert registered["payload"]["node_binding"] == "sdk_enrolled"
        await client.heartbeat()

        async def online() -> bool:
            found = await client.discover({"agent_ids": [agent.id]})
            return bool(found) and found[0].get("availability") == "online"

        await eventually_async(online, timeout=20)
        bare = await asyncio.to_thread(hub.call, agent.id, "twice", 7)
        assert bare["output"] == {"twice": 7}
    finally:
        await client.close()
