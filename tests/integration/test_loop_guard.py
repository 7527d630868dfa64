"""A handler that blocks the loop, and one past its concurrency limit (issue #23 items 2, 10), with a real daemon.

One embedded daemon for the module: an agent whose handler calls ``time.sleep``
(the loop-lag watchdog must name it, count it, and the node must stay up and
online; ``meshnode status`` must answer *while* it blocks), agents that hold
requests until released (the limit must refuse busy, not queue), and one that
leaves tasks running per request (counted for it in status).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from meshnode.admin.exitcodes import EX_LOOP_BLOCKED, EX_OK
from meshnode.admin.offloop import read_status_socket
from meshnode.testing import DaemonProcess, DaemonSet, eventually

pytestmark = pytest.mark.integration

#: A short heartbeat interval: presence's offline verdict comes after 2 x 2 s of
#: silence, so the 5 s block below is longer than it.
HEARTBEAT = "2s"
BLOCK_S = 5


@pytest.fixture(scope="module")
def node() -> Iterator[DaemonProcess]:
    daemons = DaemonSet()
    try:
        yield daemons.embedded(
            "loopguard",
            agents={
                "blocker": {"plugin": "test-blocking"},
                "held": {"plugin": "test-blocking", "max_concurrency": 2},
                "opener": {"plugin": "test-blocking"},
                "spawner": {"plugin": "test-blocking"},
                "echo": {"plugin": "echo"},
                "watch": {"plugin": "test-presence-watch"},
            },
            node={"plugin_modules": ["tests.agents:plugin"], "heartbeat_interval": HEARTBEAT},
        )
    finally:
        daemons.close()


def _agent(node: DaemonProcess, name: str) -> dict[str, Any]:
    return next(a for a in node.status()["agents"] if a["name"] == name)


def test_a_loop_blocking_handler_is_named_counted_and_the_node_stays_online(node: DaemonProcess) -> None:
    node_id = node.status()["node"]["id"]

    def presence_events() -> list[str]:
        seen = node.call("watch", "seen")["output"]
        return [e["subject"].rsplit(".", 1)[-1] for e in seen if (e["data"] or {}).get("node") == node_id]

    # The watcher hears presence: the node came online at start.
    eventually(lambda: "node_online" in presence_events(), what="presence's node_online", detail=node.log_tail)
    heartbeats_before = node.admin("Metrics")["node"].get("heartbeats", 0)
    assert node.call("blocker", "block", BLOCK_S, timeout=60)["output"] == {"blocked": BLOCK_S}
    # The daemon is up: the admin socket answers, the other agents serve.
    status = node.status()
    assert status["state"] == "serving"
    assert node.call("echo", "echo", "after the block")["output"] == {"ok": "after the block"}
    # Logged with the agent's name, counted for it (status, metrics).
    logged = re.compile(r"event loop was blocked for (\d+\.\d) s by a handler of agent blocker")
    eventually(lambda: logged.search(node.log_text()), what="the block logged with the agent's name", detail=node.log_tail)
    match = logged.search(node.log_text())
    # The lag is measured from the watchdog's last wakeup, up to 0.25 s before the block began.
    assert match is not None and float(match.group(1)) >= BLOCK_S - 1
    loop = node.status()["loop"]
    assert loop["blocks"].get("blocker", 0) >= 1 and loop["max_lag_s"] >= BLOCK_S - 1, loop
    assert _agent(node, "blocker")["counters"]["loop_blocked"] >= 1
    shown = subprocess.run(
        [sys.executable, "-m", "meshnode.cli", "status", "--config", str(node.config_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert shown.returncode == 0 and "BLOCKED by handlers: blocker 1x" in shown.stdout, shown.stdout + shown.stderr
    prom = node.admin("Metrics", {"format": "prometheus"})["text"]
    assert re.search(r'meshnode_loop_blocks_total\{agent="blocker"\} [1-9]', prom), prom
    # A beat went out right after the stall (not a full interval later), and
    # presence, whose own sweep stalled too, still has the node online.
    eventually(
        lambda: node.admin("Metrics")["node"].get("heartbeats", 0) > heartbeats_before,
        what="a heartbeat after the block", detail=node.log_tail,
    )
    assert node.admin("Presence", {"node": node_id})["availability"] == "online"
    # Past the sweep after the stall (a sweep every interval / 4 = 0.5 s), with
    # a beat sent since: presence never called the node offline.
    beats = node.admin("Metrics")["node"]["heartbeats"]
    eventually(lambda: node.admin("Metrics")["node"]["heartbeats"] > beats, what="the next beat", timeout=30)
    assert presence_events() == ["node_online"], presence_events()


def test_a_handler_past_its_concurrency_limit_is_refused_busy(node: DaemonProcess) -> None:
    assert _agent(node, "held")["max_concurrency"] == 2
    assert _agent(node, "echo")["max_concurrency"] == 64  # [node] agent_max_concurrency's default
    answers: list[dict[str, Any]] = []

    def hold(i: int) -> None:
        answers.append(node.call("held", "hold", i, timeout=60))

    holders = [threading.Thread(target=hold, args=(i,)) for i in range(2)]
    for t in holders:
        t.start()
    try:
        eventually(lambda: _agent(node, "held")["in_flight"] == 2, what="two requests held", detail=node.log_tail)
        refused = node.call("held", "hold", "third")
        assert refused["status"] == "failed", refused
        error = refused["error"]
        assert error["code"] == "AGENT_OVERLOADED" and error["retryable"] is True, error
        assert error["details"]["max_concurrency"] == 2 and "retry_after_ms" in error, error
        assert "max_concurrency" in error["message"]  # names the key that lifts it
        assert node.admin("Metrics")["refusals"]["inbox"]["AGENT_OVERLOADED"] >= 1
        # Another agent is not affected by this one's limit.
        assert node.call("echo", "echo", "free")["output"] == {"ok": "free"}
    finally:
        node.call("opener", "release")
        for t in holders:
            t.join(timeout=60)
    assert sorted(a["output"]["held"] for a in answers) == [0, 1]
    eventually(lambda: _agent(node, "held")["in_flight"] == 0, what="the slots freed", detail=node.log_tail)
    assert node.call("held", "release")["output"] == {"released": True}  # served again below the limit


def _cli_status(node: DaemonProcess, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshnode.cli", "status", "--config", str(node.config_path), *extra],
        capture_output=True, text=True, timeout=90, check=False,
    )


def test_status_answers_while_a_handler_blocks_the_loop(node: DaemonProcess, tmp_path: Any) -> None:
    release = tmp_path / "release"
    answers: list[dict[str, Any]] = []
    blocking = threading.Thread(target=lambda: answers.append(
        node.call("blocker", "block_until", {"file": str(release), "max_s": 120}, timeout=150)
    ))
    blocking.start()
    try:
        # Blocked once the status socket says so (its thread answers; the loop cannot).
        eventually(
            lambda: (read_status_socket(node.socket_path) or {}).get("blocked") is not None,
            what="the loop blocked by the handler", timeout=60, detail=node.log_tail,
        )
        started = time.monotonic()
        shown = _cli_status(node)
        took = time.monotonic() - started
        assert shown.returncode == EX_LOOP_BLOCKED, shown.stdout + shown.stderr
        assert re.search(r"BLOCKED now, for [\d.]+ s, by a handler of agent blocker", shown.stdout), shown.stdout
        assert "last snapshot" in shown.stdout and "node      loopguard" in shown.stdout, shown.stdout
        # Seconds (a Python start and the 2 s grace), not the admin call's 30 s timeout.
        assert took < 20, took
        as_json = _cli_status(node, "--json")
        assert as_json.returncode == EX_LOOP_BLOCKED, as_json.stderr
        status = json.loads(as_json.stdout)
        assert status["blocked"]["agent"] == "blocker" and status["blocked"]["for_s"] >= 1, status["blocked"]
        assert status["node"]["name"] == "loopguard" and status["snapshot_age_s"] is not None
    finally:
        release.touch()
        blocking.join(timeout=150)
    assert answers and answers[0]["output"] == {"released": True}, answers
    # The loop is back: status answers from it, with nothing blocked.
    shown = _cli_status(node, "--json")
    assert shown.returncode == EX_OK and json.loads(shown.stdout)["blocked"] is None, shown.stdout + shown.stderr


def test_tasks_an_agents_handlers_leave_running_are_counted_for_it(node: DaemonProcess) -> None:
    assert node.call("spawner", "spawn", 5)["output"] == {"spawned": 5}
    # Five workers, each with a child task: ten, all the spawner's.
    eventually(lambda: _agent(node, "spawner")["spawned_tasks"] == 10, what="ten tasks counted", detail=node.log_tail)
    assert _agent(node, "echo")["spawned_tasks"] == 0
    status = node.status()
    assert status["process"]["rss_bytes"] > 0 and status["process"]["asyncio_tasks"] >= 10, status["process"]
    shown = _cli_status(node)
    assert shown.returncode == EX_OK, shown.stderr
    assert re.search(r"load\s+0 of 64 requests in handlers, 10 spawned tasks running", shown.stdout), shown.stdout
    assert "process   RSS" in shown.stdout
    metrics = node.admin("Metrics")
    assert metrics["agents"]["spawner"]["spawned_tasks"] == 10
    prom = node.admin("Metrics", {"format": "prometheus"})["text"]
    assert 'meshnode_agent_spawned_tasks{agent="spawner"} 10' in prom, prom
    assert node.call("spawner", "spawned_release")["output"] == {"released": True}
    eventually(lambda: _agent(node, "spawner")["spawned_tasks"] == 0, what="the tasks ended and uncounted")
    assert _agent(node, "spawner")["spawned_tasks_total"] == 10


def _cli(node: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshnode.cli", *args, "--config", str(node.config_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )


def test_a_memory_sample_names_the_agent_whose_handler_kept_memory(node: DaemonProcess) -> None:
    started_line = "memory sample: tracing allocations for 10 s"
    seen_before = node.log_text().count(started_line)
    sampled: list[subprocess.CompletedProcess[str]] = []
    sampler = threading.Thread(target=lambda: sampled.append(_cli(node, "memory", "--for", "10s", "--json")))
    sampler.start()
    try:
        # Calls go in once the daemon says tracing is on (it turns it on before
        # it serves anything else), and keep going until the window has ended.
        eventually(lambda: node.log_text().count(started_line) > seen_before,
                   what="the daemon tracing allocations", timeout=60, detail=node.log_tail)
        calls = 0
        while sampler.is_alive() and calls < 50:
            assert node.call("spawner", "keep")["output"]["kept"] >= 1
            calls += 1
    finally:
        sampler.join(timeout=150)
    assert sampled and sampled[0].returncode == EX_OK, sampled and sampled[0].stderr
    found = json.loads(sampled[0].stdout)
    assert found["window_s"] == 10 and found["since"] == "the window's start"
    (mine,) = [row for row in found["agents"] if "spawner" in row["agents"]]
    # Every test agent here comes from one package (tests/agents): they share a row.
    assert {"blocker", "held", "spawner"} <= set(mine["agents"])
    assert mine["bytes"] >= 64 * 1024, found
    assert "tests/agents/__init__.py:" in mine["top_lines"][0]["line"], mine
    (echo,) = [row for row in found["agents"] if row["agents"] == ["echo"]]
    assert "meshnode_echo" in echo["source"]
    assert found["daemon"]["bytes"] > 0 and found["process"]["rss_bytes_after"] > 0
    # And for people: the same figures as a listing.
    shown = _cli(node, "memory", "--for", "0.2s")
    assert shown.returncode == EX_OK, shown.stderr
    assert "the daemon and its libraries" in shown.stdout and "spawner" in shown.stdout, shown.stdout
    assert "tracing allocations for 0.2 s" in shown.stderr
