"""A memo of asynchronous look-ups: one in flight per key, refreshed ahead of expiry.

The node asks the registry about other agents on behalf of its own: is a
sender vouched for (:mod:`meshnode.node.trust`), what does a target's manifest
say (:mod:`meshnode.node.resolver`). Both answers are remembered for a while,
and both must be asked **once** however many callers want them at the same
moment: the registry counts every look-up against the asking agent's budget
(§16.1), so a herd of 64 identical look-ups spends it and fails the callers
with RATE_LIMITED for the platform's own bookkeeping.

:class:`SingleFlightCache` gives that guarantee:

* a fresh entry is answered at once;
* otherwise the callers of one key share one look-up, run as its own task
  (a caller that gives up does not cancel it for the others);
* with ``refresh_ahead`` < 1, an entry older than that fraction of its
  lifetime is refreshed in the background while callers keep getting it; a
  refresh that fails (or learns nothing) leaves the entry as it was, to be
  tried again after ``retry_in(error)`` seconds, never later than its expiry.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from meshnode.aio import BackgroundTasks

__all__ = ["SingleFlightCache"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: What a look-up returns: the value and how many seconds it may be remembered
#: (``math.inf``: for good; 0 or less: answer the callers, remember nothing).
Loader = Callable[[], Awaitable[tuple[V, float]]]


@dataclass
class _Entry(Generic[V]):
    value: V
    expires: float  # clock time after which the value is not answered any more
    refresh_at: float  # clock time from which a background refresh may start


def _one_second(_: BaseException | None) -> float:
    return 1.0


class SingleFlightCache(Generic[K, V]):
    """Values by key, each looked up by at most one task at a time."""

    def __init__(
        self,
        *,
        capacity: int = 50_000,
        refresh_ahead: float = 1.0,
        retry_in: Callable[[BaseException | None], float] = _one_second,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity = capacity
        self.refresh_ahead = refresh_ahead
        self.retry_in = retry_in
        self.clock = clock
        self._entries: dict[K, _Entry[V]] = {}
        self._inflight: dict[K, asyncio.Task[V]] = {}
        self._tasks = BackgroundTasks()

    def peek(self, key: K) -> V | None:
        """The remembered value while it lasts, without looking anything up."""
        entry = self._entries.get(key)
        return entry.value if entry is not None and entry.expires > self.clock() else None

    def remember(self, key: K, value: V, ttl: float) -> None:
        """Learn ``value`` for ``ttl`` seconds as if it had been looked up."""
        self._store(key, value, ttl)

    def forget(self, key: K) -> None:
        self._entries.pop(key, None)

    async def get(self, key: K, load: Loader[V]) -> V:
        """The value of ``key``: remembered, or from the one look-up in flight
        (``load`` is called only when none is). A caller with a value still
        valid never waits, not even for its refresh."""
        now = self.clock()
        entry = self._entries.get(key)
        if entry is not None and entry.expires > now:
            if entry.refresh_at <= now and key not in self._inflight:
                self._start(key, load)  # in the background; errors keep the entry
            return entry.value
        task = self._inflight.get(key)
        if task is None:
            task = self._start(key, load)
        # shield: one caller cancelled (its own timeout) must not cancel the others' look-up.
        return await asyncio.shield(task)

    async def close(self) -> None:
        """Cancel the look-ups in flight."""
        await self._tasks.cancel()

    def _start(self, key: K, load: Loader[V]) -> asyncio.Task[V]:
        task = self._tasks.spawn(self._run(key, load), name=f"single-flight {key!r}")
        self._inflight[key] = task
        task.add_done_callback(lambda done: self._settled(key, done))
        return task

    async def _run(self, key: K, load: Loader[V]) -> V:
        value, ttl = await load()
        if ttl > 0:
            self._store(key, value, ttl)
        else:
            self._retry_later(key, None)
        return value

    def _store(self, key: K, value: V, ttl: float) -> None:
        now = self.clock()
        self._entries.pop(key, None)  # re-inserted last: eviction is oldest-learnt first
        if len(self._entries) >= self.capacity:
            self._entries.pop(next(iter(self._entries)))
        refresh_at = now + ttl * self.refresh_ahead if math.isfinite(ttl) and self.refresh_ahead < 1 else math.inf
        self._entries[key] = _Entry(value, now + ttl, refresh_at)

    def _retry_later(self, key: K, error: BaseException | None) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.refresh_at = min(entry.expires, self.clock() + self.retry_in(error))

    def _settled(self, key: K, task: asyncio.Task[V]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if task.cancelled():
            return
        error = task.exception()  # retrieved: no "never retrieved" warning when nobody waited
        if error is not None:
            self._retry_later(key, error)
