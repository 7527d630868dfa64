"""The embedded mesh's WebSocket listener, for nats.ws clients (issue #17).

``[mesh.embedded] websocket_port = 0`` makes the embedded nats-server listen
for WebSocket clients on a free loopback port, read back like the client port
and shown by ``meshnode mesh info``. The independent wire client
(:mod:`tests.integration.wire_client`, nothing from meshnode) joins over
``ws://`` with an invite, registers its agent, calls a hosted echo and is
called by the daemon: the same credential and the same traffic as over TCP.
The SDK-shaped client (:mod:`tests.integration.sdk_client`) does the same the
way a nats.ws SDK agent would: bootstrap token, ``_INBOX.``, untokenized
registration. A meshnode node joins over ``ws://`` too (``[mesh] servers``).
nats-py's WebSocket transport needs aiohttp (``meshnode[websocket]``, in the
``test`` extra); a node without it is refused at start, naming the key and the fix.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats.aio.transport
import pytest

from meshnode.config import load_config
from meshnode.testing import DaemonProcess, DaemonSet, render_toml, run_cli
from meshnode.transport.connection import WEBSOCKET_EXTRA
from tests.integration.cli_here import cli_here
from tests.integration.sdk_client import SdkClient
from tests.integration.wire_client import (
    UserKey,
    WireAgent,
    WireClient,
    read_invite,
    request_credential,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hub() -> Iterator[DaemonProcess]:
    daemons = DaemonSet()
    try:
        yield daemons.embedded(
            "hub", agents={"echo": {"plugin": "echo"}}, extra={"mesh.embedded": {"websocket_port": 0}}
        )
    finally:
        daemons.close()


def _ws_url(hub: DaemonProcess) -> str:
    info = json.loads(run_cli("mesh", "info", "--json", "--socket", hub.socket_path).stdout)
    url = info["websocket_url"]
    assert isinstance(url, str)
    return url


def test_mesh_info_shows_the_bound_websocket_port(hub: DaemonProcess) -> None:
    url = _ws_url(hub)
    assert url.startswith("ws://127.0.0.1:") and not url.endswith(":0")
    text = run_cli("mesh", "info", "--socket", hub.socket_path).stdout
    assert f"websocket      {url}" in text
    conf = (hub.data_dir / "mesh" / "nats-server.conf").read_text()
    assert "websocket {" in conf and "no_tls: true" in conf


def _pong(input: Any, request: Any) -> Any:
    return {"pong": input}


async def test_a_client_over_websocket_exchanges_requests_with_a_hosted_agent(
    hub: DaemonProcess, tmp_path: Path
) -> None:
    ws_url = await asyncio.to_thread(_ws_url, hub)
    invite_path = tmp_path / "ws-client.creds"
    await asyncio.to_thread(
        run_cli, "mesh", "invite", "ws-client", "--out", str(invite_path), "--socket", hub.socket_path
    )
    invite = read_invite(invite_path)
    client = WireClient(invite)
    agent = WireAgent(UserKey.generate(), "ws-agent", offerings={"ping": _pong})
    assert invite.control_plane is not None
    grant = await asyncio.to_thread(request_credential, invite.control_plane, client.node_key, [agent.key])
    client.jwt = grant["jwt"]
    client.nats_urls = [ws_url]  # the credential response names TCP; a nats.ws client dials ws://
    try:
        await client.connect()
        assert client.conn.connected_url is not None and client.conn.connected_url.scheme == "ws"
        await client.serve(agent)
        _, reply = await client.register(agent)
        assert reply["payload"]["status"] == "registered"

        echo = await asyncio.to_thread(hub.agent_id, "echo")
        inbox = await client.resolve_inbox(agent, echo)
        request = client.request_envelope(agent, echo, "echo", {"over": "websocket"})
        await client.publish_request(request, inbox)
        *_, completed = await client.wait_for(agent, request["id"], timeout=10.0)
        assert completed["payload"]["status"] == "completed"
        assert completed["payload"]["output"] == {"ok": {"over": "websocket"}}

        result = await asyncio.to_thread(hub.call, agent.id, "ping", {"n": 1}, 10.0)
        assert result["status"] == "completed" and result["output"] == {"pong": {"n": 1}}
        assert client.errors == []
    finally:
        await client.close()


async def test_an_sdk_shaped_agent_over_websocket_joins_with_a_token(hub: DaemonProcess) -> None:
    """The nats.ws case of the SDK-shaped client (tests/integration/sdk_client.py):
    bootstrap token, default _INBOX. prefix, untokenized registration, over ws://."""
    ws_url = await asyncio.to_thread(_ws_url, hub)
    token = (await asyncio.to_thread(hub.admin, "Mesh.Token", {"name": "ws-sdk"}))["token"]
    control_plane = (await asyncio.to_thread(hub.admin, "Mesh.Info"))["control_plane"]
    agent = WireAgent(UserKey.generate(), "ws-sdk", offerings={"ping": _pong})
    client = SdkClient(control_plane, agent, servers=[ws_url])
    try:
        _, reply = await client.start(token)
        assert reply["payload"]["status"] == "registered"
        assert client.conn.connected_url is not None and client.conn.connected_url.scheme == "ws"

        echo = await asyncio.to_thread(hub.agent_id, "echo")
        inbox = await client.resolve_inbox(agent, echo)
        request = client.request_envelope(agent, echo, "echo", {"sdk": "ws"})
        await client.publish_request(request, inbox)
        *_, completed = await client.wait_for(agent, request["id"], timeout=10.0)
        assert completed["payload"]["output"] == {"ok": {"sdk": "ws"}}

        result = await asyncio.to_thread(hub.call, agent.id, "ping", {"n": 2}, 10.0)
        assert result["status"] == "completed" and result["output"] == {"pong": {"n": 2}}
    finally:
        await client.close()


def _joined_over_websocket(hub: DaemonProcess, daemons: DaemonSet, name: str) -> DaemonProcess:
    node = daemons.joined(name, via=hub, agents={"ears": {"plugin": "echo"}}, start=False)
    node.config["mesh"]["servers"] = [_ws_url(hub)]
    node.config_path.write_text(render_toml(node.config), encoding="utf-8")
    return node


def test_a_node_joins_over_websocket_and_its_agents_work_both_ways(
    hub: DaemonProcess, meshnode_daemons: DaemonSet
) -> None:
    node = _joined_over_websocket(hub, meshnode_daemons, "ws-node").start()
    ws_url = node.config["mesh"]["servers"][0]
    assert node.status()["mesh"]["connected_url"] == ws_url
    ears = node.agent_id("ears")
    assert hub.call(ears, "echo", "in")["output"] == {"ok": "in"}
    assert node.call(hub.agent_id("echo"), "echo", "out")["output"] == {"ok": "out"}
    # A roster change presents a new credential by a bridged reconnect, over ws:// as well.
    node.admin("Agents.Add", {"name": "late", "config": {"plugin": "echo"}})
    assert hub.call(node.agent_id("late"), "echo", "late")["output"] == {"ok": "late"}
    assert hub.call(ears, "echo", "still")["output"] == {"ok": "still"}
    assert node.status()["mesh"]["connected_url"] == ws_url


def test_a_node_without_the_websocket_transport_is_refused_at_start_naming_key_and_fix(
    hub: DaemonProcess, meshnode_daemons: DaemonSet, tmp_path: Path
) -> None:
    """As installed without ``meshnode[websocket]``: aiohttp does not import."""
    shadow = tmp_path / "no-aiohttp"
    (shadow / "aiohttp").mkdir(parents=True)
    (shadow / "aiohttp" / "__init__.py").write_text('raise ImportError("aiohttp is not installed here")\n')
    node = _joined_over_websocket(hub, meshnode_daemons, "ws-bare")
    repository = Path(__file__).resolve().parents[2]
    node.start(env_extra={"PYTHONPATH": f"{shadow}:{repository}"}, wait=False)
    assert node.process is not None
    assert node.process.wait(timeout=120) == 78, node.log_tail()
    log = node.log_text()
    assert "mesh.servers[0]" in log and "pip install 'meshnode[websocket]'" in log, log
    assert "Traceback" not in log, log


def test_join_over_websocket_without_the_transport_warns_and_writes_the_configuration(
    hub: DaemonProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nats.aio.transport, "aiohttp", None)  # as nats-py sees a missing aiohttp
    ws_url = _ws_url(hub)
    invite = tmp_path / "w.creds"
    run_cli("mesh", "invite", "w-join", "--out", str(invite), "--socket", hub.socket_path)
    out = tmp_path / "joined.toml"
    joined = cli_here("join", str(invite), "--data-dir", str(tmp_path / "data"), "--config-out", str(out),
                      "--server", ws_url)
    assert joined.returncode == 0, joined.stderr
    assert WEBSOCKET_EXTRA in joined.stderr, joined.stderr
    assert load_config(out).mesh.servers == [ws_url]
