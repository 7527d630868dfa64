"""The shared asyncio primitives (meshnode.aio)."""

from __future__ import annotations

import asyncio
import itertools

from meshnode.aio import BackgroundTasks, backoff
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
