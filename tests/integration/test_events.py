"""Events across real nodes: fan-out, durable replay after a restart, the §22 path."""

from __future__ import annotations

from typing import Any

import pytest

from meshnode.testing import DaemonProcess, DaemonSet, eventually, run_cli

pytestmark = pytest.mark.integration

PLUGINS = {"plugin_modules": ["tests.agents:plugin", "tests.agents:listener_plugin"]}



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
    assert eventually(lambda: len(seen(a, "la")) == 1 and len(seen(b, "lb")) == 1)
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
    assert eventually(lambda: [e["data"]["n"] for e in seen(b, "lb")] == [2, 3], detail=lambda: seen(b, "lb"))
    counters = next(x for x in b.status()["agents"] if x["name"] == "lb")["counters"]
    assert counters.get("events.handled") == 2


FEEDS_AND_LISTENER = {"plugin_modules": ["tests.agents:listener_plugin", "tests.agents:feeder_plugin"]}


def counters(node: DaemonProcess, agent: str) -> dict[str, int]:
    record = next(a for a in node.status()["agents"] if a["name"] == agent)
    result: dict[str, int] = record["counters"]
    return result


def test_duplicate_publish_is_deduplicated(meshnode_daemons: DaemonSet) -> None:
    a = meshnode_daemons.embedded(
        "a", agents={"la": {"plugin": "test-listener"}, "f": {"plugin": "test-feeder"}}, node=FEEDS_AND_LISTENER
    )

    def copies(marker: int) -> int:
        return sum(1 for e in seen(a, "la") if e["data"] == {"dup": marker})

    # The same envelope published twice with its id as Nats-Msg-Id: JetStream
    # stores it once (the ≥ 2 min duplicate window of MESH_EVENTS, §18.8).
    once = a.call("f", "publish_twice", {"data": {"dup": 1}, "same_id": True})
    assert once["status"] == "completed", once
    assert once["output"]["duplicate"] == [False, True]
    assert once["output"]["seq"][0] == once["output"]["seq"][1]
    assert eventually(lambda: copies(1) == 1)

    # Republished under another message id, the broker stores it twice; the
    # subscriber's event duplicate memory (§22.2) drops the second copy.
    twice = a.call("f", "publish_twice", {"data": {"dup": 2}, "same_id": False})
    assert twice["status"] == "completed", twice
    assert eventually(lambda: counters(a, "la").get("refused.event.inbound_duplicate", 0) == 1, detail=lambda: counters(a, "la"))
    # The second copy was refused (counted above); the first one is seen once handled.
    eventually(lambda: copies(2) >= 1, what="the first copy of the republished event handled")
    assert copies(2) == 1 and copies(1) == 1


def test_replay_from_start_and_interest_retention(meshnode_daemons: DaemonSet) -> None:
    a = meshnode_daemons.embedded(
        "a", agents={"f": {"plugin": "test-feeder"}, "late": {"plugin": "test-feeder"},
                     "fresh": {"plugin": "test-feeder"}},
        node=FEEDS_AND_LISTENER,
    )
    b = meshnode_daemons.joined("b", via=a, agents={"lb": {"plugin": "test-listener"}}, node=FEEDS_AND_LISTENER)
    assert b.stop() == 0
    # Retained only because lb's durable consumer holds interest in demo.* (§18.3).
    for n in (1, 2):
        assert a.call("f", "emit", {"data": {"n": n}})["status"] == "completed"

    def data(agent: str) -> list[Any]:
        return [e["data"] for e in seen(a, agent) if e["subject"] == "mesh.event.demo.tick"]

    assert a.call("late", "subscribe", {"pattern": "demo.*", "replay": True})["status"] == "completed"
    assert eventually(lambda: data("late") == [{"n": 1}, {"n": 2}], detail=lambda: data("late"))
    assert a.call("fresh", "subscribe", {"pattern": "demo.*"})["status"] == "completed"
    a.call("f", "emit", {"data": {"n": 3}})
    assert eventually(lambda: data("fresh") == [{"n": 3}], detail=lambda: data("fresh"))  # new only: no backlog
    subs = next(x for x in a.status()["agents"] if x["name"] == "late")["subscriptions"]
    assert subs == [{"kind": "event", "subject": "mesh.event.demo.*", "durable": True,
                     "consumer": subs[0]["consumer"], "capturing_since": subs[0]["capturing_since"],
                     "replay": True}]
    assert subs[0]["capturing_since"]
    text = run_cli("status", "--socket", a.socket_path).stdout
    assert "mesh.event.demo.*  (durable, capturing since" in text, text


def test_emit_rate_limit_per_agent_per_subject(meshnode_daemons: DaemonSet) -> None:
    a = meshnode_daemons.embedded(
        "a", agents={"f": {"plugin": "test-feeder"}}, node=FEEDS_AND_LISTENER,
        extra={"events": {"emit_limit": 5, "emit_window": "60s"}},
    )
    burst = a.call("f", "emit_many", {"n": 8})
    assert burst["status"] == "completed", burst
    assert burst["output"]["sent"] == 5 and burst["output"]["code"] == "RATE_LIMITED"
    assert burst["output"]["retry_after_ms"] > 0
    # Another subject has its own budget.
    assert a.call("f", "emit", {"domain": "other"})["status"] == "completed"
    assert counters(a, "f")["emit.rate_limited"] == 1
    # Nothing holds interest in these domains: the node says so once (§18.3).
    assert eventually(lambda: "not retained (interest retention" in a.log_text(), detail=lambda: a.log_tail())
