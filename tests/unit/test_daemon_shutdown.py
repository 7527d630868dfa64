"""Shutdown derived from start-up (meshnode.daemon.lifecycle.Shutdown), and the
lifecycle and agent states the admin Status shows."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson

from meshnode.config import Config
from meshnode.daemon.lifecycle import SHUTDOWN_BUDGETS, DaemonState, Shutdown
from meshnode.daemon.main import Daemon
from meshnode.node.states import AgentState


async def test_stages_run_in_their_named_order_each_unwinding_last_in_first_out() -> None:
    done: list[str] = []
    shutdown = Shutdown()

    def undo(name: str) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            done.append(name)

        return run

    # Pushed in start-up order: the mesh server first, the admin socket last.
    shutdown.push("stop-mesh-server", undo("embedded"))
    shutdown.push("close-connection", undo("connection"))
    shutdown.push("close-connection", undo("renewal"))
    shutdown.push("final-write", undo("inbox"))
    shutdown.push("stop-agents", undo("agents"))
    shutdown.push("stop-intake", undo("subscriptions"))
    shutdown.push("stop-intake", undo("admin"))
    await shutdown.run()
    assert done == ["admin", "subscriptions", "agents", "inbox", "renewal", "connection", "embedded"]
    # Each undo runs once: a second stop has nothing left to do.
    await shutdown.run()
    assert len(done) == 7


async def test_a_failing_or_stuck_undo_does_not_keep_the_later_stages_from_running() -> None:
    done: list[str] = []
    shutdown = Shutdown({**SHUTDOWN_BUDGETS, "stop-agents": 0.05})

    async def fail() -> None:
        raise RuntimeError("boom")

    async def hang() -> None:
        await asyncio.Event().wait()

    async def mark() -> None:
        done.append("connection")

    async def mark_inbox() -> None:
        done.append("inbox")

    shutdown.push("final-write", mark_inbox)
    shutdown.push("final-write", fail)  # runs first in its stage; the inbox still closes
    shutdown.push("stop-agents", hang)  # over its budget: abandoned
    shutdown.push("close-connection", mark)
    await shutdown.run()
    assert done == ["inbox", "connection"]


async def test_only_what_started_is_stopped(tmp_path: Path) -> None:
    config = Config.model_validate({"node": {"data_dir": str(tmp_path)}})
    daemon = Daemon(config)
    before = daemon.state  # read apart: mypy would keep daemon.state narrowed across stop()
    assert before is DaemonState.CREATED
    await daemon.stop()  # nothing started: nothing to undo, and no error
    assert daemon.state is DaemonState.STOPPED


def test_status_shows_the_lifecycle_state(tmp_path: Path) -> None:
    config = Config.model_validate({"node": {"data_dir": str(tmp_path)}})
    daemon = Daemon(config)
    status = daemon.status()
    assert status["state"] == "created"
    assert status["agents"] == [] and status["agent_summary"]["hosted"] == 0
    # The admin socket encodes replies with orjson: the enum goes out as its value.
    assert orjson.loads(orjson.dumps(status))["state"] == "created"


def test_agent_states_are_the_strings_the_admin_api_always_showed() -> None:
    assert [s.value for s in AgentState] == ["starting", "running", "retrying", "failed", "stopped"]
    failed: str = AgentState.FAILED  # a str (StrEnum), which is the point
    assert failed == "failed"
    assert orjson.dumps({"state": AgentState.RUNNING}) == b'{"state":"running"}'
