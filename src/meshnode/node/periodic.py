"""One primitive for every periodic job: heartbeats, renewals, drains.

A job is rescheduled only after its run finishes (runs never overlap), its
first run is jittered so N jobs started together do not fire together, and a
failing job logs once when it starts failing and once when it recovers rather
than once per tick. Jobs of one kind that run per agent (drains) share a
:class:`FailureDigest`, so a broker that times out for thousands of agents at
once makes a few lines, not two per agent; and a job with ``retry_s`` tries
again after a failure sooner than its interval (doubling up to it).
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import logging
import math
import random
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["FailureDigest", "PeriodicJob"]


class FailureDigest:
    """The failures and recoveries of many jobs of one kind, logged as a digest.

    The first failure (or recovery) is logged at once, as a lone job's would
    be; what follows within ``window_s`` is counted and logged as one line at
    the end of the window, and so on while it lasts. (10,000 agents starting
    against a broker busy creating their mailboxes logged 5,225 drain failures
    and 5,225 recoveries, one line each.) Each job's own state stays in its
    status (``failing``, ``last_error``).
    """

    def __init__(
        self,
        kind: str,
        logger: logging.Logger,
        *,
        window_s: float = 30.0,
        level: int = logging.WARNING,
        verb: str = "failing",
    ) -> None:
        self.kind = kind
        self._log = logger
        self.window_s = window_s
        self._level = level
        self._verb = verb
        self._window: asyncio.TimerHandle | None = None
        self._failed = 0
        self._recovered = 0
        self._last_error: str | None = None

    def failing(self, name: str, error: str) -> None:
        if self._window is None:
            self._log.log(self._level, "%s %s: %s", name, self._verb, error)
            self._open_window()
        else:
            self._failed += 1
            self._last_error = error

    def recovered(self, name: str) -> None:
        if self._window is None:
            self._log.info("%s recovered", name)
            self._open_window()
        else:
            self._recovered += 1

    def _open_window(self) -> None:
        self._window = asyncio.get_running_loop().call_later(self.window_s, self._close_window)

    def _close_window(self) -> None:
        self._window = None
        failed, recovered, self._failed, self._recovered = self._failed, self._recovered, 0, 0
        if failed:
            also = f"; {recovered} recovered" if recovered else ""
            self._log.log(
                self._level, "%d more %s %s in the last %.0f s (the latest: %s)%s; `meshnode status` shows each",
                failed, self.kind, self._verb, self.window_s, self._last_error, also)
        elif recovered:
            self._log.info("%d %s recovered in the last %.0f s", recovered, self.kind, self.window_s)
        if failed or recovered:
            self._open_window()  # while it lasts: one line per window


class _Schedule:
    """The waits of every job on one event loop: a heap, and one loop timer for its earliest.

    A waiting job holds no task, coroutine, future or timer of its own, only
    its entry here (issue #21). A node holds two jobs per agent, nearly all of
    them waiting at any moment, and what a wait holds is most of what the
    garbage collector walks at each full collection once the start-up world
    is frozen: at 10,000 agents a task suspended in a timed wait held seven
    objects (coroutine, future, its iterator, timer handle and libuv timer,
    bound method, arguments), ~70,000 in all, and the first full collection
    under load held the loop for 86 ms.

    An entry is ``[due, order, job]``. A wait ended early (a trigger) or
    dropped (stop) is cancelled in place, its job replaced by None, so the
    entry holds no job (a removed agent's, say) while it waits to come up and
    be discarded; the heap is rebuilt without them when they outnumber the
    live entries.
    """

    def __init__(self) -> None:
        # No strong reference to the loop, not even through the timer handle
        # (it refers to its loop): the registry holds schedules by a weak
        # reference to their loop, and a schedule that held its loop would keep
        # a closed loop (a test's) and its jobs alive for good. The loop keeps
        # a pending timer alive itself.
        self._heap: list[list[Any]] = []
        self._order = itertools.count()  # ties: first scheduled, first run; jobs never compared
        self._cancelled = 0
        self._timer: weakref.ref[asyncio.TimerHandle] | None = None
        self._timer_at = math.inf

    def add(self, job: PeriodicJob, delay: float) -> list[Any]:
        entry: list[Any] = [asyncio.get_running_loop().time() + delay, next(self._order), job]
        heapq.heappush(self._heap, entry)
        if entry[0] < self._timer_at:
            self._arm(entry[0])
        return entry

    def cancel(self, entry: list[Any]) -> None:
        entry[2] = None
        self._cancelled += 1
        if self._cancelled > 64 and self._cancelled * 2 > len(self._heap):
            self._heap = [e for e in self._heap if e[2] is not None]
            heapq.heapify(self._heap)
            self._cancelled = 0

    def _arm(self, when: float) -> None:
        pending = self._timer() if self._timer is not None else None
        if pending is not None:
            pending.cancel()
        self._timer_at = when
        # The shared empty context: the timer only hands due jobs their runs,
        # and each run goes on in its own job's context.
        self._timer = weakref.ref(asyncio.get_running_loop().call_at(when, self._fire, context=_TIMER_CONTEXT))

    def _fire(self) -> None:
        self._timer, self._timer_at = None, math.inf
        heap = self._heap
        loop = asyncio.get_running_loop()
        now = loop.time()
        while heap and heap[0][0] <= now:
            job = heapq.heappop(heap)[2]
            if job is None:
                self._cancelled -= 1
            else:
                job._entry = None
                job._begin()
        if heap:
            self._arm(heap[0][0])
        elif _SCHEDULES.get(loop) is self:
            del _SCHEDULES[loop]  # nothing waits on this loop any more


_SCHEDULES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Schedule] = weakref.WeakKeyDictionary()

#: The context the schedules' timers run in (see _Schedule._arm).
_TIMER_CONTEXT = contextvars.Context()


def _schedule() -> _Schedule:
    loop = asyncio.get_running_loop()
    schedule = _SCHEDULES.get(loop)
    if schedule is None:
        schedule = _SCHEDULES[loop] = _Schedule()
    return schedule


class PeriodicJob:
    """Run ``action`` every ``interval`` seconds until stopped.

    ``interval`` may be a callable, re-read after every run (renewals compute
    their next deadline from the credential they just obtained).
    """

    def __init__(
        self,
        name: str,
        action: Callable[[], Awaitable[None]],
        interval: float | Callable[[], float],
        *,
        jitter: float = 0.1,
        first_delay: float | None = None,
        logger: logging.Logger | None = None,
        retry_s: float | None = None,
        digest: FailureDigest | None = None,
    ) -> None:
        self.name = name
        self._action = action
        self._interval = interval
        self._jitter = jitter
        self._first_delay = first_delay
        self._log = logger or logging.getLogger("meshnode.periodic")
        self._retry_s = retry_s
        self._digest = digest
        self._failures_in_a_row = 0
        # Started and not stopped; the context every run continues in (the
        # starter's, copied once); the task of the run in flight, if any; the
        # wait in the loop's schedule, if waiting (see _Schedule).
        self._active = False
        self._context: contextvars.Context | None = None
        self._task: asyncio.Task[None] | None = None
        self._entry: list[Any] | None = None
        # A trigger since the last run began: the next wait ends at once.
        self._woken = False
        self.failing = False
        self.runs = 0
        self.failures = 0
        self.last_error: str | None = None

    def _next_interval(self) -> float:
        base = self._interval() if callable(self._interval) else self._interval
        return max(0.0, base)

    def start(self) -> None:
        if self._active:
            return
        self._active = True
        self._context = contextvars.copy_context()
        first = self._first_delay
        if first is None:
            first = self._next_interval() * random.uniform(0.0, self._jitter) if self._jitter else 0.0
        self._wait(first)

    def trigger(self) -> None:
        """Run as soon as possible (e.g. on reconnect); never overlaps.

        Called while a run is in flight, it causes one more run right after that
        run ends (triggers coalesce: several during one run give one extra run).
        """
        self._woken = True
        if self._entry is not None:
            self._drop_wait()
            self._begin()

    async def stop(self) -> None:
        self._active = False
        self._drop_wait()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    @property
    def running(self) -> bool:
        """Started and not stopped (running its action or waiting for the next run)."""
        return self._active

    @property
    def waiting(self) -> bool:
        """Waiting for its next run (in the loop's schedule)."""
        return self._entry is not None

    async def run_once(self) -> None:
        """Run the action now, with the job's failure accounting."""
        self.runs += 1
        try:
            await self._action()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failures += 1
            self._failures_in_a_row += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            if not self.failing:
                if self._digest is not None:
                    self._digest.failing(self.name, self.last_error)
                else:
                    self._log.warning("%s failing: %s", self.name, self.last_error)
            self.failing = True
        else:
            if self.failing:
                if self._digest is not None:
                    self._digest.recovered(self.name)
                else:
                    self._log.info("%s recovered", self.name)
            self.failing = False
            self._failures_in_a_row = 0
            self.last_error = None

    def _wait(self, seconds: float) -> None:
        if self._woken:
            # A trigger that arrived while the previous run was in flight (or
            # before the start) ends this wait at once (issue #23 item 5).
            self._begin()
        else:
            self._entry = _schedule().add(self, seconds)

    def _drop_wait(self) -> None:
        entry, self._entry = self._entry, None
        if entry is not None:
            schedule = _SCHEDULES.get(asyncio.get_running_loop())
            if schedule is not None:
                schedule.cancel(entry)
            entry[2] = None

    def _begin(self) -> None:
        """Start the runs' task: its wait is over."""
        assert self._context is not None and self._task is None
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._runs(), name=f"job:{self.name}", context=self._context)

    async def _runs(self) -> None:
        # Cleared before the run, not before the wait: a trigger during the run
        # stays set and makes the next wait end at once (a second run).
        self._woken = False
        try:
            await self.run_once()
        finally:
            self._task = None
        if not self._active:
            return  # stopped while the action ran to its end
        interval = self._next_interval()
        if self._failures_in_a_row and self._retry_s is not None:
            # Sooner after a failure (doubling), never later than the interval.
            interval = min(interval, self._retry_s * 2 ** min(self._failures_in_a_row - 1, 16))
        if self._jitter:
            interval *= random.uniform(1.0 - self._jitter / 2, 1.0 + self._jitter / 2)
        self._wait(interval)
