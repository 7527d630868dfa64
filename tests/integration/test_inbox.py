"""The node-held inbox with real daemons: offline both ways, interactive agents."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from meshnode.testing import DaemonProcess, DaemonSet, consistently, eventually

pytestmark = pytest.mark.integration

PLUGINS = {"plugin_modules": ["tests.agents:plugin", "tests.agents:attended_plugin"]}



def _counter(node: DaemonProcess, agent: str, name: str) -> int:
    counters = next(x for x in node.status()["agents"] if x["name"] == agent).get("counters") or {}
    return int(counters.get(name, 0))


def held(node: DaemonProcess, agent: str | None = None) -> list[dict[str, Any]]:
    params: dict[str, Any] = {"states": ["held"]}
    if agent:
        params["agent"] = agent
    messages: list[dict[str, Any]] = node.admin("Inbox.List", params)["messages"]
    return messages


def test_requests_to_a_stopped_node_are_answered_exactly_once_when_it_returns(meshnode_daemons: DaemonSet) -> None:
    a = meshnode_daemons.embedded("a", agents={"echo": {"plugin": "echo"}})
    b = meshnode_daemons.joined("b", via=a, agents={"echo_b": {"plugin": "echo"}}, node={"heartbeat_interval": "1s"})
    target = b.agent_id("echo_b")
    assert a.call(target, "echo", "warm-up")["status"] == "completed"
    assert b.stop() == 0

    sent = list(range(12))
    # At once: each call waits its 0.5 s for the stopped node together (6 s one by one).
    with ThreadPoolExecutor(max_workers=len(sent)) as pool:
        results = list(pool.map(lambda i: a.call(target, "echo", {"n": i}, timeout=0.5), sent))
    for result in results:
        assert result["status"] == "failed" and result["error"]["code"] == "TRANSPORT_TIMEOUT"
        assert "queued" in result["error"]["message"]  # silence from a registered agent: possibly queued

    b.start()
    # B drains its buffer on start; the late answers land in A's CLI inbox (the caller stopped waiting).
    answers = eventually(lambda: len(held(a, "cli")) >= 12 and held(a, "cli"),
                         detail=lambda: f"late answers did not arrive: {held(a, 'cli')}\n{b.log_tail()}")
    assert answers, f"late answers did not arrive: {held(a, 'cli')}\n{b.log_tail()}"
    outputs = sorted(m["output"]["ok"]["n"] for m in answers)
    assert outputs == sent  # every request answered, none twice
    assert len({m["msg_id"] for m in answers}) == 12
    drain = next(x for x in b.status()["agents"] if x["name"] == "echo_b")["drain"]
    assert drain["committed"] >= 12 and drain["passes"] >= 1
    consistently(lambda: len(held(a, "cli")) == 12, during=1.0, what="no further answer arriving")
    assert len(held(a, "cli")) == 12  # and nothing more arrives


def test_late_answer_to_a_stopped_requester_is_delivered_when_it_returns(meshnode_daemons: DaemonSet) -> None:
    a = meshnode_daemons.embedded("a", agents={"faulty": {"plugin": "test-faulty"}}, node=PLUGINS)
    b = meshnode_daemons.joined("b", via=a, agents={"echo_b": {"plugin": "echo"}})
    # B's CLI asks A's slow offering, then B goes away before the answer is sent.
    faulty = a.agent_id("faulty")
    result = b.call(faulty, "sleep", 2, timeout=0.5)
    assert result["status"] == "failed" and result["error"]["code"] == "TRANSPORT_TIMEOUT"
    assert b.stop() == 0
    # A answers into B's buffer meanwhile (its handler finishes while B is away).
    eventually(lambda: _counter(a, "faulty", "completed") >= 1, what="A's slow handler finishing")
    b.start()
    late = eventually(lambda: held(b, "cli"))
    assert late and late[0]["output"] == {"slept": 2} and late[0]["sender"] == faulty


def test_interactive_agent_queued_ack_and_cli_reply(meshnode_daemons: DaemonSet) -> None:
    a = meshnode_daemons.embedded("a", agents={"echo": {"plugin": "echo"}})
    b = meshnode_daemons.joined("b", via=a, agents={"desk": {"plugin": "test-attended"}}, node=PLUGINS)
    desk = b.agent_id("desk")
    status = next(x for x in b.status()["agents"] if x["name"] == "desk")
    assert status["interaction"] == "interactive"

    result = a.call(desk, "chat", {"text": "please call me back"}, timeout=5)
    assert result["status"] == "queued" and result["inbox_id"]  # never "accepted"

    waiting = held(b, "desk")
    assert len(waiting) == 1
    message = waiting[0]
    assert message["sender"] == a.agent_id("cli") and message["offering"] == "chat"
    assert "--- BEGIN SENDER MESSAGE ---" in message["text"] and "please call me back" in message["text"]
    assert str(message["id"]) == str(result["inbox_id"])

    from meshnode.testing import run_cli

    listed = run_cli("inbox", "list", "--agent", "desk", "--socket", b.socket_path).stdout
    assert f"#{message['id']}" in listed and "please call me back" in listed and "BEGIN SENDER MESSAGE" in listed
    shown = json.loads(run_cli("inbox", "show", str(message["id"]), "--socket", b.socket_path).stdout)
    assert shown["envelope"]["payload"]["input"] == {"text": "please call me back"}
    run_cli("inbox", "reply", str(message["id"]), "--text", "calling you now", "--socket", b.socket_path)
    assert held(b, "desk") == []
    answer = eventually(lambda: held(a, "cli"))
    assert answer and answer[0]["output"] == {"text": "calling you now"} and answer[0]["sender"] == desk

    # A second request, dismissed without an answer.
    a.call(desk, "chat", {"text": "never mind"}, timeout=5)
    second = eventually(lambda: held(b, "desk"))
    run_cli("inbox", "ack", str(second[0]["id"]), "--socket", b.socket_path)
    assert held(b, "desk") == []

    # From its own node (the local path has no transport reply subject): queued at
    # once too. The caller waited out its whole timeout, then the admin call's.
    local = b.call("desk", "chat", {"text": "from next door"}, timeout=30)
    assert local["status"] == "queued" and local["inbox_id"], local
    assert [m["id"] for m in held(b, "desk")] == [int(local["inbox_id"])]
