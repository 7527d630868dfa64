"""A2A -> mesh -> A2A: the call chain crosses the mesh, so a loop back to the
first caller is caught by that caller's own chain check (#8).

The test is application ``weather-co``'s client: it calls agent ``entry`` of
application ``acme`` over A2A (the inbound bridge) with a chain naming
(weather-co, forecast). ``entry`` asks agent ``caller`` — a *mesh* request —
to call ``a2a:weather``, which is weather-co's forecast skill again (a real
a2a-sdk server doing the chain check with the shared core). The chain it
receives still holds weather-co's entry, so it refuses with limit.mesh-loop
and nothing runs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from a2a.types.a2a_pb2 import Message
from google.protobuf.json_format import MessageToDict, ParseDict

from meshnode.protocol.a2a_extension import EXTENSION_URI, build_envelope_claims, unsecured_envelope
from meshnode.testing import DaemonProcess, DaemonSet
from tests.integration.a2a_peer import Behaviour, Peer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def weather() -> Iterator[Peer]:
    with Peer(Behaviour()) as peer:
        yield peer


@pytest.fixture(scope="module")
def acme(weather: Peer) -> Iterator[tuple[DaemonProcess, int]]:
    daemons = DaemonSet()
    try:
        # acme as its own peer too (meshnode -> meshnode): its bridge serves on a
        # socket this test holds (listen = "fd://N"), so its URL is known before
        # it starts. No audience or issuer key configured: a meshnode card
        # publishes both in the extension's params.
        listener = daemons.listening_socket()
        port = listener.getsockname()[1]
        daemon = daemons.embedded(
            "acme",
            agents={"entry": {"plugin": "test-a2a-caller"}, "caller": {"plugin": "test-a2a-caller"}},
            node={"plugin_modules": ["tests.agents.a2a_caller:plugin"]},
            extra={
                "a2a": {
                    "listen": f"fd://{listener.fileno()}", "expose": ["entry"], "application": "acme",
                    "allow_issuers": ["*"],  # trust agent-id issuers: reports for them
                },
                "a2a.peers.weather": {"url": weather.url, "contract_price": "0.10",
                                      "issuer_key": weather.issuer_key},
                "a2a.peers.self": {"url": f"http://127.0.0.1:{port}/agents/entry", "contract_price": "0.05"},
            },
            pass_fds=(listener.fileno(),),
        )
        yield daemon, port
    finally:
        daemons.close()


def test_a2a_mesh_a2a_loop_is_refused_by_the_first_callers_chain_check(
    acme: tuple[DaemonProcess, int], weather: Peer
) -> None:
    daemon, port = acme
    caller_id = daemon.agent_id("caller")
    msg: dict[str, Any] = MessageToDict(ParseDict({
        "messageId": str(uuid.uuid4()),
        "role": "ROLE_USER",
        "parts": [{"data": {"target": caller_id, "peer": "weather"}}],
        "metadata": {"skill": "relay"},
    }, Message()))
    # weather-co's own hop: it is serving "forecast" and calls acme from there.
    claims = build_envelope_claims(
        issuer="weather-co", audience="acme", now=time.time(), message=msg,
        call_chain=[{"application": "weather-co", "start": "forecast", "executionId": "w-1"}],
    )
    msg["metadata"][EXTENSION_URI] = {"envelope": unsecured_envelope(claims)}
    before = len(weather.received)
    body = {"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {"message": msg}}
    headers = {"A2A-Version": "1.0", "A2A-Extensions": EXTENSION_URI}
    response = httpx.post(f"http://127.0.0.1:{port}/agents/entry", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    task = response.json()["result"]["task"]
    assert task["status"]["state"] == "TASK_STATE_COMPLETED", task
    # weather-co saw its own (application, skill) in the chain that crossed acme's mesh.
    got = weather.received[before:]
    assert len(got) == 1 and got[0].claims is not None
    chain = got[0].claims["callChain"]
    assert [(e["application"], e.get("start")) for e in chain] == [
        ("weather-co", "forecast"), ("acme", "relay"), ("acme", "call"),
    ]
    refused = weather._refused[got[0].message_id]
    assert refused["code"] == "limit.mesh-loop"
    assert refused["details"]["entry"] == {"application": "weather-co", "start": "forecast"}
    # acme's agent learnt it as a rejection with the peer's code, and nothing was charged.
    assert "limit.mesh-loop" in response.text
    assert not [r for r in daemon.admin("A2A.Charges")["charges"] if r["message_id"] == got[0].message_id]


def test_meshnode_calls_meshnode_over_a2a_with_a_verified_report(
    acme: tuple[DaemonProcess, int], weather: Peer
) -> None:
    """Our outbound bridge against our own inbound one: envelope accepted and
    trusted, the run report verified against the bridge key, charged once."""
    daemon, _ = acme
    result = daemon.call("caller", "call", {
        "peer": "self", "offering": "relay", "input": {"target": daemon.agent_id("caller"), "peer": "weather"},
    }, timeout=60)
    out = result["output"]
    assert out.get("status") == "completed", out
    info = out["a2a"]
    assert info["mesh"] is True and info["report"] == "verified", info
    assert info["charge"]["charged"] == "0.05"  # the agents report no cost: the contract price
    # The inner call made it to weather-co and back through both bridges.
    assert out["output"]["status"] == "completed" and out["output"]["output"]["forecast"] == "sunny"
