"""The shared asyncio primitives (meshnode.aio)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable

import pytest

from meshnode.aio import BackgroundTasks, KeyedConcurrency, backoff
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
