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
import logging
import random
from collections.abc import Awaitable, Callable

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


#: The context every job's wait timer runs in (see PeriodicJob._sleep).
_TIMER_CONTEXT = contextvars.Context()


def _end_wait(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


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
        self._task: asyncio.Task[None] | None = None
        # A trigger since the last run began, and the wait a trigger ends (see _sleep).
        self._woken = False
        self._waiter: asyncio.Future[None] | None = None
        self.failing = False
        self.runs = 0
        self.failures = 0
        self.last_error: str | None = None

    def _next_interval(self) -> float:
        base = self._interval() if callable(self._interval) else self._interval
        return max(0.0, base)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"job:{self.name}")

    def trigger(self) -> None:
        """Run as soon as possible (e.g. on reconnect); never overlaps.

        Called while a run is in flight, it causes one more run right after that
        run ends (triggers coalesce: several during one run give one extra run).
        """
        self._woken = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

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

    async def _sleep(self, seconds: float) -> None:
        # A trigger that arrived while the previous run was in flight ends this
        # wait at once (issue #23 item 5); _run clears the flag just before each
        # run instead.
        #
        # One future, ended by a timer or by trigger(): the fewest objects a
        # wait can hold. A node holds two jobs per agent, nearly all of them
        # waiting at any moment, and what a wait holds is most of what the
        # garbage collector walks at each full collection once the start-up
        # world is frozen (issue #21): an Event wait under asyncio.timeout held
        # ten objects per wait (two coroutines, the timeout and its bound
        # method, a future, a context, a timer); 100 ms per collection at
        # 10,000 agents. The timer runs in one shared empty context instead of
        # a copy of the current one per wait (it only ends the future; the job
        # resumes in its own task's context). Like the timeout before it, the
        # wait needs no task of its own (a wait_for per wait was ~2 of each
        # agent's ~5 tasks while 1,000 agents started).
        if self._woken:
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiter = waiter
        timer = loop.call_later(seconds, _end_wait, waiter, context=_TIMER_CONTEXT)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    async def _run(self) -> None:
        first = self._first_delay
        if first is None:
            first = self._next_interval() * random.uniform(0.0, self._jitter) if self._jitter else 0.0
        await self._sleep(first)
        while True:
            # Cleared before the run, not before the wait: a trigger during the run
            # stays set and makes the next wait return at once (a second run).
            self._woken = False
            await self.run_once()
            interval = self._next_interval()
            if self._failures_in_a_row and self._retry_s is not None:
                # Sooner after a failure (doubling), never later than the interval.
                interval = min(interval, self._retry_s * 2 ** min(self._failures_in_a_row - 1, 16))
            if self._jitter:
                interval *= random.uniform(1.0 - self._jitter / 2, 1.0 + self._jitter / 2)
            await self._sleep(interval)
