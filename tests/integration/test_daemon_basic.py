"""The daemon end to end with real processes: start, serve, call, stop, no orphans."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from meshnode.config import Config
from meshnode.daemon.lifecycle import StageFailed
from meshnode.daemon.main import Daemon
from meshnode.testing import DaemonProcess, DaemonSet, eventually, run_cli

pytestmark = pytest.mark.integration

TEST_PLUGINS = {"plugin_modules": ["tests.agents:plugin"]}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_embedded_node_serves_and_stops_cleanly(meshnode_daemons: DaemonSet) -> None:
    node = meshnode_daemons.embedded(
        "one",
        agents={"echo": {"plugin": "echo"}, "bad": {"plugin": "test-crash-on-start"}, "faulty": {"plugin": "test-faulty"}},
        node=TEST_PLUGINS,
    )
    status = node.status()
    by_name = {a["name"]: a for a in status["agents"]}
    assert by_name["echo"]["registered"] and by_name["echo"]["state"] == "running"
    assert by_name["bad"]["state"] == "failed" and "cannot start" in by_name["bad"]["failure"]
    assert status["mesh"]["connected"] and status["mesh"]["mode"] == "embedded"
    # The brief form (what a 10,000-agent node can answer): counts, no per-agent list.
    brief = node.admin("Status", {"agents": False})
    assert brief["agents"] == [] and brief["agent_summary"] == status["agent_summary"]
    # ...and no asyncio task count (it walks every task); the full form counts them.
    assert brief["process"]["asyncio_tasks"] is None and status["process"]["asyncio_tasks"] > 0
    assert brief["process"]["rss_bytes"] > 0
    for process in (brief["process"], status["process"]):  # the kernel's high-water mark lags its RSS
        assert process["max_rss_bytes"] >= process["rss_bytes"], process
    assert status["agent_summary"]["registered"] == sum(1 for a in status["agents"] if a.get("registered"))
    assert status["agent_summary"]["failed"] >= 1  # "bad" failed to start
    text = run_cli("status", "--brief", "--socket", node.socket_path).stdout
    assert f"{status['agent_summary']['hosted']} hosted" in text and by_name["echo"]["id"] not in text
    # A hub nobody joined yet says so (it printed a bare table header).
    assert "no node has joined this mesh" in run_cli("mesh", "nodes", "--socket", node.socket_path).stdout

    result = node.call("echo", "echo", {"x": [1, 2]})
    assert result == {"status": "completed", "output": {"ok": {"x": [1, 2]}}, "from": by_name["echo"]["id"],
                      "accepted": True, "task_id": None}

    crashed = node.call("faulty", "crash")
    assert crashed["status"] == "failed" and crashed["error"]["code"] == "INTERNAL_ERROR"
    assert "secret detail" not in str(crashed)
    assert node.call("echo", "echo", "still alive")["output"] == {"ok": "still alive"}

    mesh_pid = int((node.data_dir / "mesh").joinpath("nats-server.pid").read_text()) if (node.data_dir / "mesh" / "nats-server.pid").exists() else None
    children = [int(p) for p in os.popen(f"pgrep -P {node.pid}").read().split()]
    assert children, "the embedded nats-server runs as a child"
    assert node.stop() == 0
    for pid in children + ([mesh_pid] if mesh_pid else []):
        assert not _alive(pid), f"process {pid} outlived the daemon"


def _past_the_credentials_second(node: DaemonProcess) -> None:
    """Wait until the second ``node``'s credential was issued in has passed: its
    times are whole seconds, so a credential re-minted within that second is the
    same credential, with the same attestation, and a test of what a re-mint
    changes would prove nothing."""
    issued = node.status()["credential"]["expires_at"] - 24 * 3600  # the default lifetime
    eventually(lambda: time.time() >= issued + 1.2, what="a second past the credential's issue")


def test_agent_added_at_runtime_gets_a_reminted_credential(meshnode_daemons: DaemonSet) -> None:
    a = meshnode_daemons.embedded("a", agents={"echo": {"plugin": "echo"}})
    b = meshnode_daemons.joined("b", via=a, agents={"echo_b": {"plugin": "echo"}})
    _past_the_credentials_second(b)
    added = b.admin("Agents.Add", {"name": "late", "config": {"plugin": "echo"}})
    assert added["registered"] and added["state"] == "running"
    # The broker lets node B receive on the new agent's inbox only with the new credential.
    result = a.call(added["id"], "echo", "hello late agent")
    assert result["status"] == "completed" and result["output"] == {"ok": "hello late agent"}
    assert b.status()["mesh"]["connected"]
    # Its mailbox is drained too: the participant credential names each agent's
    # mailbox, and the node judged the new agent against the credential read at
    # start, which does not name it (no drain: offline mail stayed in the broker).
    drained = b.admin("Drain.Now", {"agent": "late"})["drained"]
    assert [d["agent"] for d in drained] == ["late"]
    b.admin("Agents.Remove", {"name": "late"})
    gone = a.admin("Discover", {"agent_ids": [added["id"]]})
    assert gone["agents"] == []
    # Each change re-minted B's credential, and its attestation with it: the
    # other agent kept the one it carries (no re-registration per change).
    log = b.log_text()
    assert log.count("registered echo_b as") == 1
    # Presented by a reconnect on purpose: routine, not a warning.
    assert "to present a new credential" in log
    assert not re.search(r"WARNING .*disconnected from the mesh", log), b.log_tail()
    # The embedded node's service-role credential names no agent: A's own roster
    # changes would not reconnect it (test_lifecycle); B's did not either.
    hub_log = a.log_text()
    assert "to present a new credential" not in hub_log
    # One INFO line per registration: the hub's registry logs B's (another node's);
    # its own agents' registrations are logged once, by A's node.
    assert re.search(rf"INFO .*registered {added['id']} on node {b.status()['node']['id']}", hub_log), a.log_tail()
    assert hub_log.count("registered echo as") == 1
    assert not re.search(rf"INFO .*registered {a.agent_id('echo')} on node", hub_log), a.log_tail()


def test_a_roster_change_keeps_the_other_agents_registrations(meshnode_daemons: DaemonSet) -> None:
    # Issue #21: each added or removed agent re-registered every other one (22-26 s
    # per change at 10,000 agents); the re-minted attestation differed only in its lifetime.
    node = meshnode_daemons.embedded("one", agents={"echo": {"plugin": "echo"}, "other": {"plugin": "echo"}})
    echo = node.agent_id("echo")
    _past_the_credentials_second(node)
    carried = node.admin("Discover", {"agent_ids": [echo]})["agents"][0]["node"]["trust_attestation"]
    for name in ("late", "later"):
        assert node.admin("Agents.Add", {"name": name, "config": {"plugin": "echo"}})["registered"]
    node.admin("Agents.Remove", {"name": "late"})
    log = node.log_text()
    assert log.count("registered echo as") == 1 and log.count("registered other as") == 1
    # What the manifests carry is still the standing the mesh attests, and valid:
    # the new agent's manifest carries the same one, and it answers.
    later = node.admin("Discover", {"agent_ids": [node.agent_id("later")]})["agents"][0]
    assert later["node"]["trust_attestation"] == carried
    # Added without a reconnect (the service-role credential names no agent), and
    # served: live, and its mailbox drained.
    assert node.call("later", "echo", "on time")["output"] == {"ok": "on time"}
    assert [d["agent"] for d in node.admin("Drain.Now", {"agent": "later"})["drained"]] == ["later"]
    assert "to present a new credential" not in log
    assert node.admin("Discover", {"agent_ids": [echo]})["agents"][0]["node"]["trust_attestation"] == carried
    assert node.call("later", "echo", "hi")["output"] == {"ok": "hi"}


def test_status_shows_the_lifecycle_state(
    meshnode_daemons: DaemonSet,
) -> None:
    node = meshnode_daemons.embedded("one", agents={"echo": {"plugin": "echo"}})
    status = node.status()
    assert status["state"] == "serving"
    assert {a["state"] for a in status["agents"]} == {"running"}
    children = [int(p) for p in os.popen(f"pgrep -P {node.pid}").read().split()]
    assert node.stop() == 0
    for pid in children:
        assert not _alive(pid), f"process {pid} outlived the daemon"


async def test_a_start_that_fails_late_stops_what_it_had_started(tmp_path: Path) -> None:
    # The admin stage (the last) cannot bind under a regular file: by then the
    # embedded nats-server, the control plane, the connection and the services run.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    config = Config.model_validate({
        "node": {"data_dir": str(tmp_path / "data")},
        "mesh": {"embedded": {"port": 0, "control_port": 0}},
        "admin": {"socket": str(blocker / "admin.sock")},
    })
    daemon = Daemon(config)
    with pytest.raises(StageFailed) as failed:
        await daemon.start()
    assert failed.value.stage == "admin"
    assert daemon.status()["state"] == "failed"
    assert daemon.embedded is not None
    pid = daemon.embedded.pid
    assert pid is not None and _alive(pid)
    await daemon.stop()
    assert daemon.embedded.pid is None or not _alive(pid)
    assert daemon.connection is not None and not daemon.connection.is_connected
    assert daemon.inbox is not None and daemon.status()["state"] == "failed"
