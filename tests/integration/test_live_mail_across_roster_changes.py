"""Live mail sent while a joined node changes its roster reaches its agents.

Each `agents add` and `agents remove` on a joined node presents a new credential
by a reconnect. Mail sent during the cut found no subscriber: a buffered agent
got it late from its drain, a sandbox agent (no buffer, §16.4) never, and its
caller was told the agent was unavailable. The reconnect is now bridged
(``MeshConnection.reconnect``); here callers keep calling a sandbox node's agent
while that node's roster changes four times, and every call must be answered.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from meshnode.protocol.subjects import event_consumer_name
from meshnode.testing import DaemonProcess, DaemonSet, eventually

pytestmark = pytest.mark.integration

CALLERS = 4
LISTENERS = {"plugin_modules": ["tests.agents:listener_plugin"]}
ROSTER_CHANGES = ({"method": "Agents.Add", "name": "late"}, {"method": "Agents.Add", "name": "later"},
                  {"method": "Agents.Remove", "name": "late"}, {"method": "Agents.Remove", "name": "later"})


def change_roster_four_times(node: DaemonProcess, progress: Callable[[], int], more: int, what: str) -> None:
    """Add two agents to ``node`` and remove them, one change at a time, each
    time waiting for ``progress()`` (work the test's threads count) to move
    on by ``more``: work on its way during each change, and after it."""
    for change in ROSTER_CHANGES:
        before = progress()
        params: dict[str, Any] = {"name": change["name"]}
        if change["method"] == "Agents.Add":
            params["config"] = {"plugin": "echo"}
        node.admin(change["method"], params)

        def moved_on(n: int = before) -> bool:
            return progress() >= n + more

        eventually(moved_on, what=what)


def test_a_sandbox_agent_answers_every_call_made_while_its_nodes_roster_changes(
    meshnode_daemons: DaemonSet,
) -> None:
    a = meshnode_daemons.embedded("a", agents={"echo": {"plugin": "echo"}})
    s = meshnode_daemons.joined("s", via=a, agents={"ears": {"plugin": "echo"}},
                                invite_args=("--trust-tier", "sandbox"))
    ears = s.agent_id("ears")
    assert a.call(ears, "echo", "warm")["status"] == "completed"  # A has resolved it once
    results: list[dict[str, Any]] = []
    stop = threading.Event()

    def call_until_stopped(caller: int) -> None:
        n = 0
        while not stop.is_set():
            results.append(a.call(ears, "echo", f"{caller}:{n}"))
            n += 1

    callers = [threading.Thread(target=call_until_stopped, args=(i,), daemon=True) for i in range(CALLERS)]
    for thread in callers:
        thread.start()
    try:
        change_roster_four_times(s, lambda: len(results), 2 * CALLERS, "calls answered after the change")
    finally:
        stop.set()
        for thread in callers:
            thread.join(timeout=120)
    failed = [r for r in results if r.get("status") != "completed"]
    assert not failed, f"{len(failed)} of {len(results)} calls failed, e.g. {failed[:3]}"
    _bridged_without_copies(s)


def test_events_published_while_a_joined_nodes_roster_changes_come_without_redelivery(
    meshnode_daemons: DaemonSet,
) -> None:
    """An agent's events reach it through a JetStream push consumer. A delivery
    made while its node reconnected for a roster change was lost with the
    connection and came again only after the consumer's ack wait (30 s). The
    bridge holds the consumer's deliver subject too: every event arrives, and
    the broker delivered each once (its own count, read from its monitoring
    endpoint, so the test does not depend on how long anything took)."""
    a = meshnode_daemons.embedded("a", agents={"la": {"plugin": "test-listener"}}, node=LISTENERS,
                                  extra={"mesh.embedded": {"monitor_port": 0}})
    s = meshnode_daemons.joined("s", via=a, agents={"lb": {"plugin": "test-listener"}}, node=LISTENERS)
    emitted: list[int] = []
    stop = threading.Event()

    def emit_until_stopped() -> None:
        while not stop.is_set():
            n = len(emitted)
            assert a.call("la", "emit", {"data": {"n": n}})["status"] == "completed"
            emitted.append(n)

    emitter = threading.Thread(target=emit_until_stopped, daemon=True)
    emitter.start()
    try:
        change_roster_four_times(s, lambda: len(emitted), 4, "events emitted after the change")
    finally:
        stop.set()
        emitter.join(timeout=120)

    def numbers_seen() -> list[int]:
        result = s.call("lb", "seen")
        assert result["status"] == "completed", result
        return sorted(event["data"]["n"] for event in result["output"])

    eventually(lambda: numbers_seen() == emitted, what="every event at lb, once each",
               detail=lambda: f"{len(emitted)} emitted, seen {numbers_seen()[-10:]}")
    # Each delivery, a redelivery too, takes the consumer's next delivery
    # sequence; the bridge's second copy of a delivery takes none.
    consumer = _consumer(a, "MESH_EVENTS", event_consumer_name(s.agent_id("lb"), "demo.*"))
    assert consumer["delivered"]["consumer_seq"] == len(emitted), consumer
    _bridged_without_copies(s)


def _bridged_without_copies(node: DaemonProcess) -> None:
    """Each of ``node``'s four roster changes was bridged, and no agent saw a
    message twice. In the overlap a message can come by both the bridge and
    the connection; the agents' intakes refused the second copy as a
    duplicate (§22.2), logged as a WARNING after every roster change (the
    soak's log), until the transport dropped it unread."""
    reconnects = node.status()["mesh"]["planned_reconnects"]
    assert (reconnects["bridged"], reconnects["unbridged"]) == (4, 0), reconnects
    refusals = node.admin("Metrics")["refusals"]
    duplicates = {intake: rules["inbound_duplicate"] for intake, rules in refusals.items() if "inbound_duplicate" in rules}
    assert not duplicates, f"copies refused as duplicates: {duplicates} ({reconnects['copies_dropped']} dropped unread)"
    assert "inbound_duplicate" not in node.log_text()


def _consumer(node: DaemonProcess, stream: str, name: str) -> dict[str, Any]:
    """The broker's own record of a consumer (nats-server's /jsz monitoring)."""
    monitor = node.admin("Mesh.Info")["monitor_url"]
    with urllib.request.urlopen(f"{monitor}/jsz?accounts=true&streams=true&consumers=true", timeout=30) as resp:
        jsz = json.load(resp)
    found = [c for account in jsz.get("account_details", []) for s in account.get("stream_detail", [])
             if s.get("name") == stream for c in s.get("consumer_detail", []) if c.get("name") == name]
    assert found, f"no consumer {name} on {stream} in the broker's /jsz"
    return dict(found[0])
