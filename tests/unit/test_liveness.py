"""The broker watch's bookkeeping and rounds, with probe callables (no broker; issue #23 item 11)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from meshnode.transport.liveness import BrokerWatch, LivenessState
from tests.fakes import ManualClock


def test_an_episode_starts_once_and_ends_on_the_first_answer() -> None:
    state = LivenessState(restart_after_s=20)
    assert state.answered(0.0, 1000.0, 0.002) is None and state.responsive
    assert state.failed(10.0, 1010.0, "ping: timeout") is True
    assert state.failed(15.0, 1015.0, "ping: timeout") is False  # the same episode
    status = state.status()
    assert status["state"] == "unresponsive" and status["unresponsive_since"] == "1970-01-01T00:16:50+00:00"
    assert status["failed_probes"] == 2 and status["unresponsive_episodes"] == 1
    assert state.answered(18.0, 1018.0, 0.003) == 8.0
    assert state.status()["state"] == "responsive" and state.reason is None
    assert state.failed(30.0, 1030.0, "again") is True and state.episodes == 2


def test_the_remedy_is_due_after_the_bound_and_then_at_that_interval() -> None:
    state = LivenessState(restart_after_s=20)
    assert not state.remedy_due(5.0)  # responsive: nothing to remedy
    state.failed(10.0, 0.0, "x")
    assert not state.remedy_due(29.9)
    assert state.remedy_due(30.0) and state.remedies == 1
    assert not state.remedy_due(45.0)  # not again right away
    assert state.remedy_due(50.0) and state.remedies == 2
    state.answered(51.0, 0.0, 0.001)
    state.failed(60.0, 0.0, "y")
    assert not state.remedy_due(70.0)  # a new episode counts from its own start
    assert state.remedy_due(80.0)


async def test_a_round_reports_the_first_failing_probe_and_applies_the_remedy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock()
    answers = {"process": True, "ping": True}
    calls: list[str] = []
    remedies: list[float] = []

    def probe(name: str):  # type: ignore[no-untyped-def]
        async def run(timeout: float) -> None:
            calls.append(name)
            if not answers[name]:
                raise TimeoutError

        return run

    async def remedy() -> None:
        remedies.append(clock.now)

    watch = BrokerWatch(
        [("process", probe("process")), ("ping", probe("ping"))],
        interval_s=1, timeout_s=0.5, restart_after_s=20, remedy=remedy, clock=clock,
    )
    assert await watch.check() and calls == ["process", "ping"]
    answers["process"] = False
    caplog.set_level(logging.WARNING, "meshnode.transport")
    for second in range(1, 26):
        clock.now = float(second)
        assert not await watch.check()
        await watch._remedy_if_due()
    assert watch.status()["reason"] == "process: TimeoutError"
    assert remedies == [21.0]  # 20 s after the first failed round
    assert sum("not answering" in r.message for r in caplog.records) == 1  # logged once
    assert watch.gauges() == {"broker_unresponsive": 1, "broker_unresponsive_episodes": 1,
                              "broker_failed_probes": 25, "broker_remedies": 1}
    answers["process"] = True
    assert await watch.check()
    assert watch.gauges()["broker_unresponsive"] == 0
    assert any("answers again" in r.message for r in caplog.records)


async def test_a_hanging_probe_is_cut_at_the_deadline_and_the_task_stops() -> None:
    async def hangs(timeout: float) -> None:
        await asyncio.Event().wait()

    watch = BrokerWatch([("ping", hangs)], interval_s=0.01, timeout_s=0.05, restart_after_s=60)
    assert not await watch.check()
    assert watch.status()["state"] == "unresponsive" and "TimeoutError" in watch.status()["reason"]
    watch.start()
    await asyncio.sleep(0)
    await watch.stop()
    assert watch._task is None
