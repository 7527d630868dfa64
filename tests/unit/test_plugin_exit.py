"""A plugin's sys.exit() fails the call it was made in, never the daemon's loop
(meshnode.node.pluginexit); the daemon-level behaviour is in test_fault_isolation."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys

import pytest

from meshnode.node import looplag, tasktally
from meshnode.node.looplag import running_for
from meshnode.node.pluginexit import PluginExited


async def test_running_for_turns_a_sys_exit_into_the_calls_failure() -> None:
    refused = r"on_start called sys.exit\(4\); a plugin cannot end the daemon"
    with pytest.raises(PluginExited, match=refused) as caught, running_for("quitter", None, "on_start"):
        sys.exit(4)
    assert caught.value.code == 4 and isinstance(caught.value.__cause__, SystemExit)
    assert asyncio.current_task() not in looplag._owners  # attribution undone as on any exit
    with pytest.raises(ValueError, match="plain"), running_for("quitter", None, "a handler"):
        raise ValueError("plain")  # anything else passes as it was


async def test_a_task_the_plugin_made_ends_with_its_sys_exit_and_the_loop_runs_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def quit_soon() -> None:
        sys.exit(5)

    count = tasktally.TaskCount("background")
    tasktally.install()
    try:
        with running_for("background", count, "on_start"):
            task = asyncio.get_running_loop().create_task(quit_soon())
        with (
            caplog.at_level(logging.ERROR, logger="meshnode.node"),
            pytest.raises(PluginExited, match=r"a task of agent background called sys.exit\(5\)"),
        ):
            await task
        assert "the task ended" in caplog.text
        assert count.live == 0 and count.total == 1
        # The node's own tasks (no agent's count in their context) run as made.
        async def node_work() -> str:
            return "done"

        own = asyncio.get_running_loop().create_task(node_work(), context=contextvars.Context())
        assert getattr(own.get_coro(), "__name__", None) == "node_work"
        assert await own == "done"
    finally:
        tasktally.uninstall()
