"""Two asyncio primitives every layer above the protocol core shares.

* :class:`BackgroundTasks`: the owner of fire-and-forget tasks. The event loop
  keeps only weak references to tasks, so a task nobody holds may be collected
  mid-flight (ruff ``RUF006``); each owner (a connection, a hosted agent, a
  service) holds its tasks here until they finish, and cancels them on stop.
* :func:`backoff`: the delays of a retry loop, doubling from ``first`` up to
  ``cap``; the loop decides when to give up (a deadline, a number of attempts,
  its owner stopping) and when to start over (a fresh iterator).

This module imports nothing of meshnode: it sits beside the protocol core at
the bottom of the layers, but unlike it, it is about asyncio.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

__all__ = ["BackgroundTasks", "backoff"]

_T = TypeVar("_T")


def backoff(first: float, cap: float = math.inf) -> Iterator[float]:
    """``first``, ``2 * first``, ``4 * first`` ... never more than ``cap``; endless."""
    delay = first
    while True:
        yield delay
        delay = min(delay * 2, cap)


class BackgroundTasks:
    """Strong references to running tasks, dropped as each one finishes.

    Iterating, ``len()`` and truthiness see the tasks still running.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, _T], *, name: str | None = None) -> asyncio.Task[_T]:
        """Run ``coro`` as a task on the running loop and hold it until it is done."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    def __bool__(self) -> bool:
        return bool(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        # A copy: tasks leave the set as they finish, also while the caller iterates.
        return iter(list(self._tasks))

    async def cancel(self) -> None:
        """Cancel every task and wait until they have all ended (errors swallowed)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
