"""The asyncio primitives every layer above the protocol core shares.

* :class:`BackgroundTasks`: the owner of fire-and-forget tasks. The event loop
  keeps only weak references to tasks, so a task nobody holds may be collected
  mid-flight (ruff ``RUF006``); each owner (a connection, a hosted agent, a
  service) holds its tasks here until they finish, and cancels them on stop.
* :func:`backoff`: the delays of a retry loop, doubling from ``first`` up to
  ``cap``; the loop decides when to give up (a deadline, a number of attempts,
  its owner stopping) and when to start over (a fresh iterator).
* :func:`wait_for`: ``asyncio.wait_for`` without its Python 3.11 flaw, which
  the project's code uses everywhere instead (a unit test keeps it so).
* :func:`cancel_and_wait`: cancel tasks and wait for their end, cancelling
  again those a lost cancellation left running.
* :class:`KeyedConcurrency`: run jobs side by side, a bounded number at once,
  but one at a time and in arrival order for the same key (a request handler
  that may serve different agents concurrently but never one agent twice at once).
* :class:`SharedRuns`: one run of a job serves every call made before it
  started (many roster changes at once, one credential for them all).

This module imports nothing of meshnode: it sits beside the protocol core at
the bottom of the layers, but unlike it, it is about asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

__all__ = ["BackgroundTasks", "KeyedConcurrency", "SharedRuns", "backoff", "cancel_and_wait", "wait_for"]

_T = TypeVar("_T")


def backoff(first: float, cap: float = math.inf) -> Iterator[float]:
    """``first``, ``2 * first``, ``4 * first`` ... never more than ``cap``; endless."""
    delay = first
    while True:
        yield delay
        delay = min(delay * 2, cap)


async def wait_for(aw: Awaitable[_T], timeout: float | None) -> _T:
    """Await ``aw`` for at most ``timeout`` seconds (None: no limit); TimeoutError after.

    Why not ``asyncio.wait_for``: on Python 3.11 it swallows a cancellation
    that arrives in the same loop iteration as ``aw``'s result (CPython
    gh-86296) and returns the result instead, so a task cancelled while a
    message lands keeps running (an A2A stream reader did, and its request
    hung). Why not plain :func:`asyncio.timeout` around ``aw`` either: ``aw``
    would run in the caller's task, and code that swallows a cancellation
    (nats-py's ``_flush_pending`` does) would then swallow the caller's own.
    So ``aw`` runs as a task of its own, awaited through a shield: the
    caller's cancellation (or the timeout) always reaches the caller, and
    ``aw`` is then cancelled and waited for (:func:`cancel_and_wait`), so it
    is not running when this returns, as with ``asyncio.wait_for``. A result
    that lands as the time runs out is returned, not dropped; one that lands
    as the caller is cancelled is dropped with the caller.
    """
    inner = asyncio.ensure_future(aw)
    try:
        if timeout is None:
            return await asyncio.shield(inner)
        async with asyncio.timeout(timeout):
            return await asyncio.shield(inner)
    except TimeoutError:
        if inner.done() and not inner.cancelled() and inner.exception() is None:
            return inner.result()  # it finished as the time ran out: the result is not lost
        await cancel_and_wait(inner)
        if not inner.cancelled():
            inner.exception()  # retrieved: the timeout is what the caller gets
        raise
    except BaseException:
        if not inner.done():
            await cancel_and_wait(inner)
        if not inner.cancelled():
            inner.exception()  # retrieved: the caller's exception is the one that counts
        raise


async def cancel_and_wait(*tasks: asyncio.Future[Any], again_after: float = 1.0) -> None:
    """Cancel ``tasks`` and wait until every one has ended (their errors are theirs).

    A task still running ``again_after`` seconds after its cancellation is
    cancelled again, and so on: on Python 3.11 a cancellation can be lost
    inside code we do not own (``asyncio.wait_for`` in nats-py swallows one
    that arrives with the reply, see :func:`wait_for`), and one ``cancel()``
    then leaves the task waiting on a stream nobody reads any more.
    """
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=again_after)


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
        await cancel_and_wait(*tasks)
        for task in tasks:
            if not task.cancelled():
                task.exception()  # retrieved: an error at cancel time is swallowed, not "never retrieved"


class KeyedConcurrency:
    """At most ``limit`` jobs at once; jobs of one key strictly one after another.

    :meth:`submit` waits for a free slot (so a caller feeding it from a
    subscription is slowed down instead of piling up tasks), then starts the
    job as a task of ``tasks`` and returns. A job whose key already has a job
    queued or running waits for that one to end (however it ends) before it
    starts: per key, jobs run in the order they were submitted and never
    overlap. The waiting job holds its slot; the job it waits for holds one
    too and is running or itself waiting on a running one, so the chain always
    moves.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        self.limit = limit
        self._gate = asyncio.Semaphore(limit)
        # The last job submitted per key, while it has not ended.
        self._tails: dict[str, asyncio.Task[None]] = {}
        self.running = 0
        #: The most jobs that ran at once (observability and tests).
        self.peak = 0

    async def submit(
        self, key: str, job: Callable[[], Awaitable[None]], tasks: BackgroundTasks, *, name: str | None = None
    ) -> asyncio.Task[None]:
        """Start ``job()`` once a slot is free and every earlier job of ``key`` has ended."""
        await self._gate.acquire()
        previous = self._tails.get(key)

        async def run() -> None:
            try:
                if previous is not None and not previous.done():
                    # asyncio.wait never raises the predecessor's error or cancellation.
                    await asyncio.wait([previous])
                self.running += 1
                self.peak = max(self.peak, self.running)
                try:
                    await job()
                finally:
                    self.running -= 1
            finally:
                self._gate.release()
                if self._tails.get(key) is asyncio.current_task():
                    del self._tails[key]

        try:
            task = tasks.spawn(run(), name=name)
        except BaseException:
            self._gate.release()
            raise
        self._tails[key] = task
        return task


class SharedRuns:
    """Calls of a job that share its runs: one run serves every call made before it started.

    ``await runs(flag)`` returns once a run of ``job`` that *began after the
    call* has ended, and raises that run's error. So whatever the caller
    changed before calling is seen by the run that serves it. Calls made while
    a run is under way wait for the next one, which starts when that one ends,
    and all of them share it: N calls at once cost two runs, not N. The run is
    asked with ``flag`` set when any call it serves set it.

    A run is a task of its own: a caller cancelled while it waits leaves the
    run to the others.
    """

    def __init__(self, job: Callable[[bool], Awaitable[None]]) -> None:
        self._job = job
        self._lock = asyncio.Lock()
        self._tasks = BackgroundTasks()
        # The run that calls made now join (not begun yet), and its flag.
        self._next: asyncio.Future[None] | None = None
        self._next_flag = False
        #: Runs begun so far, and runs that have come to wait for their turn
        #: (observability and tests).
        self.runs = 0
        self.queued = 0

    async def __call__(self, flag: bool = False) -> None:
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            # Nobody may be left to read a failure (every caller cancelled).
            self._next.add_done_callback(lambda f: None if f.cancelled() else f.exception())
            self._next_flag = False
            run = self._tasks.spawn(self._run(self._next), name="shared-run")
            run.add_done_callback(functools.partial(self._settle, self._next))
        self._next_flag = self._next_flag or flag
        await asyncio.shield(self._next)

    async def _run(self, done: asyncio.Future[None]) -> None:
        self.queued += 1
        async with self._lock:  # the run under way ends first
            # From here on calls join the run after this one: what this one reads may predate them.
            self._next = None
            flag, self.runs = self._next_flag, self.runs + 1
            try:
                await self._job(flag)
            except Exception as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)

    def _settle(self, done: asyncio.Future[None], _run: asyncio.Task[None]) -> None:
        # A run cancelled (even before it began): its callers must not wait
        # forever, nor later calls join it.
        if not done.done():
            done.cancel()
        if self._next is done:
            self._next = None

    @contextlib.asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        """Hold every run off while the block runs: work that must not
        interleave with one (it reads and writes what the runs do)."""
        async with self._lock:
            yield

    async def close(self) -> None:
        """Cancel the runs under way or waiting (their callers see a cancellation)."""
        await self._tasks.cancel()
