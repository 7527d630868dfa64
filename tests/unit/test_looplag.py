"""The loop-lag watchdog and the concurrency admission stage (issue #23 items 2, 10)."""

from __future__ import annotations

import asyncio
import time

import pytest

from meshnode.node.looplag import UNATTRIBUTED, LoopWatchdog, running_for
from meshnode.node.pipeline import check_concurrency
from meshnode.protocol.errors import ProtocolError
from meshnode.testing import eventually_async


async def test_a_block_is_reported_with_the_agent_whose_handler_ran() -> None:
    reports: list[tuple[float, str]] = []
    watchdog = LoopWatchdog(threshold_s=0.2, on_block=lambda lag, agent: reports.append((lag, agent)))
    watchdog.start()
    try:
        async def handler() -> None:
            with running_for("blocker"):
                time.sleep(0.8)  # what the watchdog exists for: a handler blocking the loop

        await asyncio.create_task(handler())
        await eventually_async(lambda: reports, what="the block reported")
        lag, agent = reports[0]
        assert agent == "blocker" and lag >= 0.4
        assert watchdog.blocks["blocker"] == 1 and watchdog.status()["max_lag_s"] >= 0.4
        # Outside any handler: reported, unattributed.
        time.sleep(0.8)
        await eventually_async(lambda: len(reports) == 2, what="the second block reported")
        assert reports[1][1] == UNATTRIBUTED
    finally:
        await watchdog.stop()
    assert not watchdog.running


async def test_running_for_restores_the_outer_owner() -> None:
    from meshnode.node import looplag

    task = asyncio.current_task()
    assert task is not None
    with running_for("drain"):
        with running_for("agent"):
            assert looplag._owners[task] == "agent"
        assert looplag._owners[task] == "drain"
    assert task not in looplag._owners


def test_the_concurrency_stage_refuses_busy_past_the_limit() -> None:
    check_concurrency(1, 2)
    with pytest.raises(ProtocolError) as caught:
        check_concurrency(2, 2, typical_ms=5.0)
    error = caught.value.to_object()
    assert error["code"] == "AGENT_OVERLOADED" and error["retryable"] is True
    assert error["retry_after_ms"] == 100 and error["details"]["max_concurrency"] == 2
    assert "max_concurrency" in error["message"]
