"""The shared asyncio primitives (meshnode.aio)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from meshnode import aio
from meshnode.aio import BackgroundTasks, KeyedConcurrency, SharedRuns, backoff
from meshnode.testing import eventually_async


def test_backoff_doubles_up_to_its_cap_and_never_ends() -> None:
    assert list(itertools.islice(backoff(0.5, 5.0), 6)) == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert list(itertools.islice(backoff(0.25), 4)) == [0.25, 0.5, 1.0, 2.0]


async def test_background_tasks_hold_each_task_until_it_ends() -> None:
    tasks = BackgroundTasks()
    release = asyncio.Event()
    done: list[int] = []

    async def work(n: int) -> int:
        await release.wait()
        done.append(n)
        return n

    first = tasks.spawn(work(1), name="one")
    tasks.spawn(work(2))
    assert len(tasks) == 2 and bool(tasks) and first.get_name() == "one"
    release.set()
    assert await first == 1
    await asyncio.gather(*tasks)
    assert sorted(done) == [1, 2]
    await eventually_async(lambda: not tasks, what="the done callbacks (they run on a later loop iteration)")
    assert not tasks and list(tasks) == []


async def test_cancel_ends_every_task_and_swallows_their_errors() -> None:
    tasks = BackgroundTasks()

    async def forever() -> None:
        await asyncio.Event().wait()

    async def fails() -> None:
        raise RuntimeError("boom")

    running = [tasks.spawn(forever()), tasks.spawn(fails())]
    await tasks.cancel()
    assert all(t.done() for t in running)
    assert running[0].cancelled()


async def test_keyed_concurrency_runs_keys_side_by_side_and_one_key_in_order() -> None:
    tasks = BackgroundTasks()
    gate = KeyedConcurrency(3)
    release = {name: asyncio.Event() for name in ("a1", "a2", "b1", "d1")}
    started: list[str] = []
    ended: list[str] = []

    def job(name: str) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            started.append(name)
            await release[name].wait()
            ended.append(name)
            if name == "a1":
                raise RuntimeError("a failed job still lets the next of its key run")

        return run

    for name in ("a1", "a2", "b1"):
        await gate.submit(name[0], job(name), tasks)
    # a2 waits for a1 (same key) and holds the third slot: d1 must wait for a slot.
    waiting = asyncio.ensure_future(gate.submit("d", job("d1"), tasks))
    await eventually_async(lambda: started == ["a1", "b1"])
    assert not waiting.done() and gate.running == 2
    release["b1"].set()
    await waiting  # b1's slot went to d1
    await eventually_async(lambda: started == ["a1", "b1", "d1"])
    assert "a2" not in started
    release["a1"].set()
    await eventually_async(lambda: started == ["a1", "b1", "d1", "a2"])
    assert ended.index("a1") < started.index("a2")
    assert gate.peak == 2
    for event in release.values():
        event.set()
    await eventually_async(lambda: not tasks)
    assert sorted(ended) == ["a1", "a2", "b1", "d1"] and gate.running == 0
    # Every slot came back, and the per-key bookkeeping emptied.
    assert gate._gate._value == 3 and not gate._tails


def test_keyed_concurrency_needs_a_slot() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        KeyedConcurrency(0)


async def test_wait_for_keeps_a_cancellation_that_arrives_with_the_result() -> None:
    # The 3.11 flaw (gh-86296): the awaited queue.get() completes and the task
    # is cancelled in the same loop iteration; asyncio.wait_for returns the
    # item and the cancellation is lost. Ours raises CancelledError.
    queue: asyncio.Queue[int] = asyncio.Queue()
    reached = asyncio.Event()

    async def reader() -> int:
        reached.set()
        return await aio.wait_for(queue.get(), timeout=30.0)

    task = asyncio.get_running_loop().create_task(reader())
    await reached.wait()  # the reader is inside aio.wait_for(queue.get()) or about to be
    queue.put_nowait(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_wait_for_keeps_a_cancellation_the_awaited_code_swallows() -> None:
    # nats-py's _flush_pending catches CancelledError and returns: run in the
    # caller's task it would swallow the caller's own cancellation.
    entered = asyncio.Event()

    async def swallows() -> str:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass
        return "swallowed"

    task = asyncio.get_running_loop().create_task(aio.wait_for(swallows(), timeout=30.0))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(TimeoutError):  # and a timeout is still a timeout
        await aio.wait_for(swallows(), timeout=0.01)



async def test_wait_for_times_out_and_passes_results() -> None:
    async def value(v: int) -> int:
        return v

    assert await aio.wait_for(value(7), timeout=5.0) == 7
    assert await aio.wait_for(value(8), timeout=None) == 8
    with pytest.raises(TimeoutError):
        await aio.wait_for(asyncio.Event().wait(), timeout=0.01)


def test_the_code_uses_the_wait_for_without_the_flaw() -> None:
    src = Path(__file__).resolve().parents[2] / "src" / "meshnode"
    offenders = [
        str(p.relative_to(src)) for p in src.rglob("*.py")
        if p.name != "aio.py" and "asyncio.wait_for(" in p.read_text(encoding="utf-8")
    ]
    assert offenders == [], f"use meshnode.aio.wait_for (3.11's asyncio.wait_for loses cancellations): {offenders}"


async def test_cancel_and_wait_repeats_a_cancellation_the_task_lost() -> None:
    # A task that swallows its first cancellation (as 3.11's asyncio.wait_for
    # in a library does when the awaited reply lands at the same moment) ends
    # at the second one instead of hanging its canceller.
    swallowed = asyncio.Event()
    started = asyncio.Event()

    async def loses_one() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            swallowed.set()
        await asyncio.Event().wait()  # a reader that goes on reading

    task = asyncio.get_running_loop().create_task(loses_one())
    await started.wait()
    await aio.wait_for(aio.cancel_and_wait(task, again_after=0.05), timeout=30.0)
    assert swallowed.is_set() and task.cancelled()


class _RosterJob:
    """A job that reads what its callers changed before calling, and can be held open."""

    def __init__(self) -> None:
        self.roster: list[str] = []
        self.seen: list[tuple[list[str], bool]] = []
        self.gate = asyncio.Event()
        self.started = asyncio.Event()
        self.fail_with: Exception | None = None

    async def __call__(self, flag: bool) -> None:
        snapshot = list(self.roster)  # read at the start, as a credential request reads the roster
        self.started.set()
        await self.gate.wait()
        self.seen.append((snapshot, flag))
        if self.fail_with is not None:
            raise self.fail_with


async def test_shared_runs_serve_every_call_made_before_they_began_two_runs_for_many() -> None:
    job = _RosterJob()
    runs = SharedRuns(job)
    job.roster.append("a")
    first = asyncio.create_task(runs())
    await job.started.wait()
    # Made while the first run is under way: it read the roster before these, so they share the next.
    later = []
    for name in ("b", "c", "d"):
        job.roster.append(name)
        later.append(asyncio.create_task(runs(name == "c")))
    # The next run waits for its turn once the three have asked for it (they ask in order).
    await eventually_async(lambda: runs.queued == 2, what="the next run waiting for the first")
    assert not any(t.done() for t in [first, *later])
    job.gate.set()
    await asyncio.gather(first, *later)
    assert job.seen == [(["a"], False), (["a", "b", "c", "d"], True)]
    assert runs.runs == 2
    # Alone, a call gets a run of its own at once, with its own flag.
    job.roster.append("e")
    await runs()
    assert job.seen[-1] == (["a", "b", "c", "d", "e"], False) and runs.runs == 3


async def test_a_shared_runs_error_reaches_every_call_it_served_and_the_next_run_starts_afresh() -> None:
    job = _RosterJob()
    runs = SharedRuns(job)
    job.fail_with = ConnectionError("the broker is away")
    job.gate.set()
    callers = [asyncio.create_task(runs()) for _ in range(3)]
    results = await asyncio.gather(*callers, return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results) and runs.runs == 1
    job.fail_with = None
    await runs()
    assert runs.runs == 2


async def test_a_caller_cancelled_while_waiting_leaves_the_run_to_the_others() -> None:
    job = _RosterJob()
    runs = SharedRuns(job)
    impatient = asyncio.create_task(runs())
    patient = asyncio.create_task(runs())
    await job.started.wait()
    impatient.cancel()
    with pytest.raises(asyncio.CancelledError):
        await impatient
    job.gate.set()
    await patient
    assert runs.runs == 1 and len(job.seen) == 1


async def test_closing_shared_runs_cancels_the_run_and_its_callers_and_later_calls_start_anew() -> None:
    job = _RosterJob()
    runs = SharedRuns(job)
    caller = asyncio.create_task(runs())
    await job.started.wait()
    waiting = asyncio.create_task(runs())  # asks for the next run, which waits for the lock
    # Closed in the very turn the next run was asked for, before it began (tasks start in
    # the order they were made): that run is cancelled without ever having run.
    await asyncio.create_task(runs.close())
    for task in (caller, waiting):
        with pytest.raises(asyncio.CancelledError):
            await aio.wait_for(task, 30)  # a caller left waiting forever fails here, not hangs
    job.gate.set()
    await aio.wait_for(runs(), 30)  # not joined to a cancelled run
    assert runs.runs == 2 and len(job.seen) == 1


async def test_no_shared_run_interleaves_with_work_done_alone() -> None:
    job = _RosterJob()
    job.gate.set()
    runs = SharedRuns(job)
    order: list[str] = []
    inside = asyncio.Event()
    leave = asyncio.Event()

    async def renewal() -> None:
        async with runs.alone():
            order.append("alone begins")
            inside.set()
            await leave.wait()
            order.append("alone ends")

    alone = asyncio.create_task(renewal())
    await inside.wait()
    change = asyncio.create_task(runs())
    # Nothing held off, the run would have begun in the step it came to wait in.
    await eventually_async(lambda: runs.queued == 1, what="the run waiting for its turn")
    assert not job.started.is_set()
    leave.set()
    await job.started.wait()
    order.append("run begins")
    await asyncio.gather(alone, change)
    assert order == ["alone begins", "alone ends", "run begins"] and runs.runs == 1
