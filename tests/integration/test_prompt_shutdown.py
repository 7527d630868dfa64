"""A daemon stopped while it is still starting its agents exits promptly (issue #23):
SIGTERM during the ``agents`` stage cancels the starts in flight, skips the stages
after it, runs the shutdown of what did start (the inbox's final write
included) and exits 0; the next start is clean."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from meshnode.admin.client import call_sync
from meshnode.testing import DaemonSet, eventually, render_toml, run_cli

pytestmark = pytest.mark.integration

#: The bound on a SIGTERM during start-up (generous: a loaded CI machine). Before
#: the fix the daemon went on registering until its agents stage's budget ran out.
STOP_BOUND_S = 15.0

#: Cheap agents registering beside the one that never finishes starting.
N_ECHO = 60


def _status(socket: str) -> dict[str, Any] | None:
    if not os.path.exists(socket):
        return None
    try:
        status: dict[str, Any] = call_sync(socket, "Status", {}, timeout=5.0)
    except Exception:
        return None
    return status


def test_sigterm_while_agents_start_exits_promptly_and_restarts_clean() -> None:
    daemons = DaemonSet()
    try:
        agents: dict[str, dict[str, Any]] = {f"echo{i:03d}": {"plugin": "echo"} for i in range(N_ECHO)}
        # Holds the agents stage open for as long as its timeout allows (10 min).
        agents["hang"] = {"plugin": "test-hang-on-start"}
        node = daemons.embedded(
            "stop-early",
            agents=agents,
            node={"plugin_modules": ["tests.agents:plugin"], "agent_start_timeout": "10m"},
            start=False,
        )
        node.start(wait=False)
        assert node.process is not None

        def starting() -> bool:
            status = _status(node.socket_path)
            if status is None or status["state"] != "starting" or status["stage"] != "agents":
                return False
            return any(a["name"] == "hang" and a["state"] == "starting" for a in status["agents"])

        eventually(starting, timeout=120, what="the daemon in its agents stage, 'hang' starting",
                   detail=node.log_tail)
        # The operator sees where it is (the CLI's human form; --json has state and stage).
        assert "state     starting (stage agents)" in run_cli("status", "--brief", "--socket", node.socket_path).stdout
        sent = time.monotonic()
        node.process.send_signal(signal.SIGTERM)
        code = node.process.wait(timeout=STOP_BOUND_S + 30)
        took = time.monotonic() - sent
        assert code == 0, node.log_tail()
        assert took < STOP_BOUND_S, f"exited {took:.1f} s after SIGTERM (bound {STOP_BOUND_S} s)\n{node.log_tail()}"
        log = node.log_text()
        assert "stop requested during start-up (stage agents): cancelling it" in log, node.log_tail()
        assert "start-up stage '" not in log, "a stop is not a failed stage\n" + node.log_tail()
        assert not os.path.exists(node.socket_path), "the admin socket was closed by the shutdown"
        # The inbox's final write ran: its last connection closed with the WAL checkpointed.
        wal = node.data_dir / "inbox.sqlite3-wal"
        assert not wal.exists() or wal.stat().st_size == 0, "the inbox was not closed"

        # The restart is clean: without the hanging agent it serves, the echo agents answer.
        del node.config["agents.hang"]
        node.config_path.write_text(render_toml(node.config), encoding="utf-8")
        node.start(timeout=180)
        assert node.call("echo000", "echo", "again")["output"] == {"ok": "again"}
        assert node.status()["agent_summary"]["failed"] == 0
        assert node.stop() == 0
    finally:
        daemons.close()

