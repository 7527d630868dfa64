"""Events across real nodes: fan-out, durable replay after a restart, the §22 path."""

from __future__ import annotations

import time
from typing import Any

import pytest

from meshnode.testing import DaemonProcess, DaemonSet

pytestmark = pytest.mark.integration

PLUGINS = {"plugin_modules": ["tests.agents:plugin", "tests.agents:listener_plugin"]}


def wait_for(predicate: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def seen(node: DaemonProcess, agent: str) -> list[dict[str, Any]]:
    result = node.call(agent, "seen")
    assert result["status"] == "completed", result
    events: list[dict[str, Any]] = result["output"]
    return events


def test_fan_out_and_durable_replay(meshnode_daemons: DaemonSet) -> None:
    a = meshnode_daemons.embedded("a", agents={"la": {"plugin": "test-listener"}}, node=PLUGINS)
    b = meshnode_daemons.joined("b", via=a, agents={"lb": {"plugin": "test-listener"}}, node=PLUGINS)
    la, lb = a.agent_id("la"), b.agent_id("lb")

    emitted = a.call("la", "emit", {"data": {"n": 1}})
    assert emitted["status"] == "completed"
    assert wait_for(lambda: len(seen(a, "la")) == 1 and len(seen(b, "lb")) == 1)
    for events in (seen(a, "la"), seen(b, "lb")):
        assert events[0]["subject"] == "mesh.event.demo.tick"
        assert events[0]["sender"] == la and events[0]["data"] == {"n": 1}
        assert events[0]["trace_id"] == emitted["output"]["trace_id"]  # §13.1: the emit keeps the trace

    # B goes away; events published meanwhile wait in its durable consumer.
    assert b.stop() == 0
    a.call("la", "emit", {"data": {"n": 2}})
    a.call("la", "emit", {"data": {"n": 3}})
    b.start()
    assert b.agent_id("lb") == lb  # same identity after the restart
    assert wait_for(lambda: [e["data"]["n"] for e in seen(b, "lb")] == [2, 3]), seen(b, "lb")
    counters = next(x for x in b.status()["agents"] if x["name"] == "lb")["counters"]
    assert counters.get("events.handled") == 2
