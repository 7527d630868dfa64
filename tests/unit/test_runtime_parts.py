"""Small runtime parts: rate limiter, periodic jobs, lifecycle stages, sd_notify, plugin loading."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import importlib.metadata
import logging
import socket
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import pytest

from meshnode.agent import Agent, Context, offering
from meshnode.daemon.lifecycle import (
    SHUTDOWN_BUDGETS,
    Stage,
    StageFailed,
    run_stage,
    shutdown_budget_total,
)
from meshnode.daemon.sdnotify import Notifier
from meshnode.node import periodic
from meshnode.node.periodic import FailureDigest, PeriodicJob
from meshnode.node.runtime import Node
from meshnode.node.settings import NodeSettings
from meshnode.plugins import PluginLoadError, load_plugins
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.ratelimit import SlidingWindowLimiter
from meshnode.testing import eventually_async
from tests.fakes import FakeConnection

# -- rate limiter (§16.1) ---------------------------------------------------------


def test_sliding_window_allows_limit_then_refuses_with_retry_after() -> None:
    limiter = SlidingWindowLimiter(limit=3, window_ms=1000)
    assert all(limiter.check("a", t).allowed for t in (0, 100, 200))
    refused = limiter.check("a", 300)
    assert not refused.allowed and refused.retry_after_ms == 700
    assert limiter.check("b", 300).allowed  # per sender
    assert limiter.check("a", 1001).allowed  # the oldest event slid out


def test_limiter_key_table_is_bounded() -> None:
    limiter = SlidingWindowLimiter(limit=1, window_ms=1000, max_keys=10)
    for i in range(100):
        limiter.check(f"k{i}", i)
    assert len(limiter) == 10
    limiter.sweep(10_000)
    assert len(limiter) == 0


def test_limiter_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        SlidingWindowLimiter(limit=0)


# -- periodic jobs ------------------------------------------------------------------


async def test_periodic_job_never_overlaps_and_logs_failure_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="meshnode.periodic")
    running = 0
    max_running = 0
    calls = 0

    async def action() -> None:
        nonlocal running, max_running, calls
        running += 1
        max_running = max(max_running, running)
        calls += 1
        await asyncio.sleep(0.02)
        running -= 1
        if calls <= 3:
            raise RuntimeError("boom")

    job = PeriodicJob("t", action, 0.001, jitter=0.0, first_delay=0.0)
    job.start()
    def triggered_until_five_runs() -> bool:
        job.trigger()  # a trigger storm: the runs must still never overlap
        return calls >= 5

    await eventually_async(triggered_until_five_runs, interval=0.005, what="five runs of the job")
    await job.stop()
    assert max_running == 1
    assert calls >= 5 and job.failures == 3 and not job.failing
    assert sum("t failing" in r.message for r in caplog.records) == 1
    assert sum("t recovered" in r.message for r in caplog.records) == 1


async def test_a_failed_run_is_tried_again_after_retry_s_not_a_whole_interval() -> None:
    """A drain that timed out tries again within seconds (doubling), not a
    whole interval later: the mail it could not reach waited for it."""
    calls = 0

    async def action() -> None:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise TimeoutError("the broker is busy")

    job = PeriodicJob("t", action, 3600.0, jitter=0.0, first_delay=0.0, retry_s=0.01)
    job.start()
    try:
        await eventually_async(lambda: calls >= 3 and not job.failing, what="two retries, then a success")
    finally:
        await job.stop()
    assert job.failures == 2


async def test_many_jobs_failing_at_once_log_a_digest_not_a_line_each(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("meshnode.test.digest")
    caplog.set_level(logging.INFO, logger=logger.name)
    digest = FailureDigest("drains", logger, window_s=0.05)
    for i in range(100):
        digest.failing(f"drain:a{i}", "TransportTimeout: nats: timeout")
    for i in range(100):
        digest.recovered(f"drain:a{i}")
    assert [r.message for r in caplog.records] == ["drain:a0 failing: TransportTimeout: nats: timeout"]

    def summarised() -> bool:
        return any("99 more drains failing" in r.message for r in caplog.records)

    await eventually_async(summarised, what="the window's digest line")
    digest_line = next(r.message for r in caplog.records if "99 more" in r.message)
    assert "TransportTimeout: nats: timeout" in digest_line and "100 recovered" in digest_line
    # Quiet again: the next failure is logged at once once the window after the digest closed.
    await eventually_async(lambda: digest._window is None, what="the digest's windows closed")
    digest.failing("drain:b", "boom")
    assert caplog.records[-1].message == "drain:b failing: boom"
    assert len(caplog.records) == 3


async def test_periodic_job_trigger_during_a_run_causes_a_second_run() -> None:
    # Issue #23 item 5: a trigger while the action is in flight must not be lost
    # (a reconnect during a drain pass would otherwise wait a full interval).
    in_run = asyncio.Event()
    release = asyncio.Event()
    second = asyncio.Event()
    calls = 0

    async def action() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            in_run.set()
            await release.wait()
        else:
            second.set()

    job = PeriodicJob("t", action, 3600.0, jitter=0.0, first_delay=0.0)
    job.start()
    try:
        await asyncio.wait_for(in_run.wait(), timeout=5)
        job.trigger()  # during the first run
        job.trigger()  # coalesces with the one above
        release.set()
        await asyncio.wait_for(second.wait(), timeout=5)  # not after the 1 h interval
        assert calls == 2
    finally:
        await job.stop()


async def test_a_trigger_ends_a_waiting_job_at_once_and_the_job_keeps_its_own_context() -> None:
    # A waiting job is an entry in its loop's schedule, whose one timer runs in
    # a shared empty context: the job must still see the context it started in.
    marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker", default="none")
    marker.set("the starter's")
    seen: asyncio.Queue[str] = asyncio.Queue()

    async def action() -> None:
        seen.put_nowait(marker.get())

    job = PeriodicJob("t", action, 0.01, jitter=0.0, first_delay=0.0)
    job.start()
    try:
        assert await asyncio.wait_for(seen.get(), 5) == "the starter's"
        assert await asyncio.wait_for(seen.get(), 5) == "the starter's", "after a wait the timer ended"
    finally:
        await job.stop()

    slow = PeriodicJob("slow", action, 3600.0, jitter=0.0, first_delay=0.0)
    slow.start()
    try:
        await asyncio.wait_for(seen.get(), 5)
        await eventually_async(lambda: slow.waiting, what="the job waiting for its next run")
        slow.trigger()
        await asyncio.wait_for(seen.get(), 5)  # not after the hour
        assert slow.runs == 2
        await eventually_async(lambda: slow.waiting, what="the job waiting again")
    finally:
        await slow.stop()
    assert not slow.waiting and not slow.running, "a stopped job holds no wait"


async def test_waiting_jobs_hold_no_task_and_run_in_the_order_they_are_due() -> None:
    # Issue #21: a node holds two jobs per agent, nearly all waiting; a wait is
    # an entry in the loop's one schedule, not a task suspended in a timed wait.
    order: list[str] = []
    all_ran = asyncio.Event()

    def recorder(name: str) -> Callable[[], Awaitable[None]]:
        async def action() -> None:
            order.append(name)
            if len(order) == 3:
                all_ran.set()
        return action

    tasks_before = len(asyncio.all_tasks())
    idle = [PeriodicJob(f"idle{i}", recorder("idle"), 3600.0, first_delay=3600.0) for i in range(500)]
    for job in idle:
        job.start()
    assert all(job.waiting for job in idle)
    assert len(asyncio.all_tasks()) == tasks_before, "a waiting job has no task"
    # Scheduled out of order; each runs once (the next run is an hour away).
    jobs = [PeriodicJob(name, recorder(name), 3600.0, jitter=0.0, first_delay=delay)
            for name, delay in (("third", 0.15), ("first", 0.05), ("second", 0.1))]
    for job in jobs:
        job.start()
    try:
        await asyncio.wait_for(all_ran.wait(), 10)
        assert order == ["first", "second", "third"]
    finally:
        for job in [*jobs, *idle]:
            await job.stop()
    assert len(asyncio.all_tasks()) == tasks_before


async def test_a_stopped_or_triggered_job_is_not_held_by_its_old_wait() -> None:
    # A removed agent's jobs stop: the schedule must not keep them (and through
    # them the agent) until their old due time, hours away for a vouch renewal.
    ran = asyncio.Event()

    async def action() -> None:
        ran.set()

    stopped = PeriodicJob("stopped", action, 3600.0, first_delay=3600.0)
    stopped.start()
    await stopped.stop()
    gone = weakref.ref(stopped)
    del stopped
    gc.collect()
    assert gone() is None, "the stopped job's cancelled wait still refers to it"

    triggered = PeriodicJob("triggered", action, 3600.0, jitter=0.0, first_delay=3600.0)
    triggered.start()
    triggered.trigger()
    await asyncio.wait_for(ran.wait(), 5)
    assert triggered.runs == 1
    await eventually_async(lambda: triggered.waiting, what="the job waiting for its next run")
    await triggered.stop()
    # Cancelled waits are dropped from the schedule once they outnumber the rest.
    many = [PeriodicJob(f"m{i}", action, 3600.0, first_delay=3600.0) for i in range(200)]
    for job in many:
        job.start()
    schedule = periodic._SCHEDULES[asyncio.get_running_loop()]
    for job in many:
        await job.stop()
    assert len(schedule._heap) <= 64 + 2


def test_a_loop_closed_with_jobs_still_waiting_is_not_kept_by_the_schedule() -> None:
    # The schedules are held by a weak reference to their loop: one that
    # referred to its loop would keep every closed loop that still had a job
    # waiting (a test's, say) alive for good, with its jobs.
    async def action() -> None:
        pass

    loop = asyncio.new_event_loop()

    async def start_one() -> PeriodicJob:
        job = PeriodicJob("left waiting", action, 3600.0, first_delay=3600.0)
        job.start()
        return job

    job = loop.run_until_complete(start_one())
    assert job.waiting and loop in periodic._SCHEDULES
    loop.close()
    gone = weakref.ref(loop)
    del loop
    gc.collect()
    assert gone() is None, "the schedule kept its closed loop alive"


# -- lifecycle stages -----------------------------------------------------------------


async def test_stage_budget_and_criticality() -> None:
    async def slow() -> None:
        await asyncio.sleep(5)

    async def broken() -> None:
        raise OSError("disk gone")

    assert await run_stage(Stage("slow", 0.05, slow), critical=False) is False
    assert await run_stage(Stage("broken", 1, broken), critical=False) is False
    with pytest.raises(StageFailed, match="broken"):
        await run_stage(Stage("broken", 1, broken), critical=True)


def test_shutdown_budgets_are_positive_and_ordered() -> None:
    assert list(SHUTDOWN_BUDGETS)[0] == "stop-intake"
    assert list(SHUTDOWN_BUDGETS)[-1] == "stop-mesh-server"
    assert all(b > 0 for b in SHUTDOWN_BUDGETS.values())
    assert shutdown_budget_total() == sum(SHUTDOWN_BUDGETS.values())


# -- sd_notify ----------------------------------------------------------------------


def test_notifier_sends_datagrams_and_is_silent_without_systemd(short_tmp_path: Path) -> None:
    assert Notifier(env={}).notify("READY=1") is False
    path = str(short_tmp_path / "n.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        notifier = Notifier(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
        assert notifier.watchdog_interval == 2.0
        assert notifier.ready("serving")
        assert sock.recv(100) == b"READY=1\nSTATUS=serving"
        assert notifier.stopping()
        assert sock.recv(100) == b"STOPPING=1"


# -- plugin loading -----------------------------------------------------------------


class Good(Agent):
    @offering("ping")
    async def ping(self, ctx: Context, input: object) -> object:
        return "pong"


def _ep(name: str, value: str) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name=name, value=value, group="meshnode.agents")


def test_broken_plugin_is_skipped_and_reported() -> None:
    eps = [_ep("good", f"{__name__}:Good"), _ep("broken", "no_such_module_xyz:Thing")]
    _, catalog = load_plugins(entry_points=eps)
    assert catalog.kinds == {"good": Good}
    assert "broken" in catalog.failures and "ModuleNotFoundError" in catalog.failures["broken"]


def test_strict_mode_fails_fast() -> None:
    with pytest.raises(PluginLoadError, match="broken"):
        load_plugins(entry_points=[_ep("broken", "no_such_module_xyz:Thing")], strict=True)


def test_offerings_are_collected_with_their_specs() -> None:
    specs = Good.offerings()
    assert list(specs) == ["ping"] and specs["ping"].manifest_entry() == {"id": "ping"}


async def test_each_agent_runs_a_bounded_number_at_once_and_every_agent_gets_its_turn() -> None:
    # A new attestation or renew-now re-registers every agent: side by side, a
    # bounded number at a time, and one failure neither stops the others nor is lost.
    node = Node(settings=NodeSettings(name="t", registrations_at_once=3), node_key=KeyPair.generate(),
                connection=FakeConnection().as_connection())
    hosted = {f"a{i}": cast(Any, object()) for i in range(10)}
    node.agents.update(hosted)
    running, peak, done = 0, 0, []
    release = asyncio.Event()  # the registry answers once the test has seen the bound reached

    async def step(agent: Any) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await release.wait()
        running -= 1
        if agent is hosted["a4"]:
            raise RuntimeError("a4's registry call failed")
        done.append(agent)

    each = asyncio.ensure_future(node.each_agent(step))
    await eventually_async(lambda: running == 3, what="the first steps waiting on the registry")
    release.set()
    with pytest.raises(RuntimeError, match="a4's registry call failed"):
        await each
    assert peak == 3
    assert len(done) == 9 and hosted["a4"] not in done
