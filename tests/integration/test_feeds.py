"""Feeds across real nodes (§6.6a, §18.3): owner-only publishing enforced by the broker
and by every reader, state values for late subscribers, durable stream feeds."""

from __future__ import annotations

from typing import Any

import pytest

from meshnode.testing import DaemonProcess, DaemonSet, eventually

pytestmark = pytest.mark.integration

PLUGINS = {"plugin_modules": ["tests.agents:feeder_plugin"]}
FEEDER = {"plugin": "test-feeder"}



def ok(result: dict[str, Any]) -> Any:
    assert result["status"] == "completed", result
    return result["output"]


def seen(node: DaemonProcess, agent: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = ok(node.call(agent, "seen"))
    return events


def counters(node: DaemonProcess, agent: str) -> dict[str, int]:
    record = next(a for a in node.status()["agents"] if a["name"] == agent)
    result: dict[str, int] = record["counters"]
    return result


def test_feeds_end_to_end(meshnode_daemons: DaemonSet) -> None:
    a = meshnode_daemons.embedded("a", agents={"owner": FEEDER, "twin": FEEDER}, node=PLUGINS)
    b = meshnode_daemons.joined(
        "b", via=a, agents={"reader": FEEDER, "late": FEEDER, "mallory": FEEDER}, node=PLUGINS
    )
    owner = a.agent_id("owner")

    # Declared feeds are in the manifest's emits (discoverable, §6.6a).
    manifest = a.admin("Agents.Show", {"name": "owner"})["manifest"]
    assert {f"mesh.feed.{owner}.status", f"mesh.feed.{owner}.changes"} <= set(manifest["emits"])

    # A durable subscription to all of the owner's feeds, on another node.
    consumer = ok(b.call("reader", "subscribe_feed", {"owner": owner}))
    assert consumer.startswith(f"mesh_feed_{b.agent_id('reader')}_")
    ok(a.call("owner", "publish", {"topic": "status", "data": {"level": "ok"}}))
    ok(a.call("owner", "publish", {"topic": "changes", "data": {"seq": 1}}))
    assert eventually(lambda: len(seen(b, "reader")) == 2, detail=lambda: seen(b, "reader"))
    by_topic = {e["topic"]: e for e in seen(b, "reader")}
    assert by_topic["status"]["kind"] == "state" and by_topic["status"]["data"] == {"level": "ok"}
    assert by_topic["changes"]["kind"] == "stream" and by_topic["changes"]["sender"] == owner
    assert by_topic["status"]["subject"] == f"mesh.feed.{owner}.status"
    assert by_topic["status"]["domain"] is None  # a feed is never a domain event

    # A feed published by a non-owner is refused by the broker: B's credential
    # grants mesh.feed.{its own agents}.> only.
    ok(b.call("mallory", "publish_on", {"owner": owner, "topic": "status", "data": {"level": "forged"}}))
    assert eventually(lambda: b.admin("Metrics")["node"].get("refused.publish.feed", 0) >= 1)
    assert "permissions violation" in b.log_text() or "refused to publish" in b.log_text()

    # The owner's own node could publish for a co-hosted agent; every reader
    # refuses an envelope not signed by the subject's owner (the writer too).
    ok(a.call("twin", "publish_on", {"owner": owner, "topic": "status", "data": {"level": "spoofed"}}))
    assert eventually(lambda: counters(b, "reader").get("refused.feed.not_owner", 0) == 1, detail=lambda: counters(b, "reader"))
    assert eventually(lambda: "refused (not_owner)" in a.log_text())  # the platform's state writer
    assert ok(b.call("late", "read_state", {"owner": owner, "topic": "status"}))["data"] == {"level": "ok"}

    # A later value replaces the state; a late subscriber reads it without replay.
    v2 = ok(a.call("owner", "publish", {"topic": "status", "data": {"level": "busy"}}))["id"]
    assert eventually(lambda: len(seen(b, "reader")) == 3)
    ok(b.call("late", "subscribe_feed", {"owner": owner, "topic": "status", "durable": False}))
    # The platform's state writer is a pull consumer of its own, not the reader's live
    # delivery: the new value is stored on its next fetch, which a loaded machine delays.
    state = eventually(
        lambda: (s := ok(b.call("late", "read_state", {"owner": owner, "topic": "status"})))["id"] == v2 and s,
        what="the state writer storing the new value",
    )
    assert state == {"found": True, "data": {"level": "busy"}, "id": v2, "kind": "state"}
    assert seen(b, "late") == []  # a snapshot is read, not replayed into on_event
    assert ok(b.call("late", "read_state", {"owner": owner, "topic": "never"})) == {"found": False}

    # Durable feed subscriptions survive the subscriber being offline.
    assert b.stop() == 0
    ok(a.call("owner", "publish", {"topic": "changes", "data": {"seq": 2}}))
    ok(a.call("owner", "publish", {"topic": "changes", "data": {"seq": 3}}))
    b.start()
    # The agent subscribes again as it starts (here: asked to); the same call binds
    # the same durable consumer, which kept what was published meanwhile.
    assert ok(b.call("reader", "subscribe_feed", {"owner": owner})) == consumer
    assert eventually(lambda: [e["data"]["seq"] for e in seen(b, "reader") if e["topic"] == "changes"] == [2, 3],
                      detail=lambda: seen(b, "reader"))
    status = next(x for x in b.status()["agents"] if x["name"] == "reader")
    assert [s for s in status["subscriptions"] if s["kind"] == "feed"][0]["durable"] is True

    # The forged and spoofed values never became the state.
    assert ok(b.call("late", "read_state", {"owner": owner, "topic": "status"}))["data"] == {"level": "busy"}


def test_feed_kind_must_match_its_declaration(meshnode_daemons: DaemonSet) -> None:
    a = meshnode_daemons.embedded("a", agents={"owner": FEEDER}, node=PLUGINS)
    result = a.call("owner", "publish", {"topic": "status", "data": 1, "kind": "stream"})
    assert result["status"] == "failed" and result["error"]["code"] == "INTERNAL_ERROR", result
    assert "declared 'state'" in a.log_text()
    bad = a.call("owner", "publish", {"topic": "a.b", "data": 1})
    assert bad["status"] == "failed", bad
