"""The loop-lag watchdog: a handler that blocks the event loop is seen and named (issue #23 items 2, 10).

Everything a node does runs on one asyncio loop: the handlers of every agent,
the heartbeats, the admin socket. A handler that blocks it (``time.sleep(5)``,
a CPU-bound loop, a synchronous HTTP call) stalls all of them, and nothing
used to say so. The watchdog has two halves:

* on the loop, a periodic wakeup (:meth:`LoopWatchdog._tick`) measures how
  late it fires: that lateness is the loop's lag, kept as a gauge. A wakeup at
  least ``threshold_s`` late is a *block*, reported to ``on_block`` once the
  loop runs again (the node logs it, counts it per agent and sends a
  heartbeat at once, so presence hears from the node right after the stall);
* a small thread notices a wakeup that is overdue *while* the loop is stuck
  and looks at which asyncio task the loop is running: the one that blocks.
  Handlers run inside :func:`running_for`, which maps their task to their
  agent's name, so the block is attributed to that agent.

The thread never touches the loop: it reads two values the loop publishes
(the time of the last wakeup, the running task) and writes one sample the
loop reads back. A block shorter than the threshold is only seen in the gauge.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from meshnode.node import tasktally
from meshnode.node.pluginexit import exited

__all__ = ["UNATTRIBUTED", "LoopWatchdog", "running_for"]

log = logging.getLogger("meshnode.node")

#: The label of a block that ran outside any agent's handler (the node's own code).
UNATTRIBUTED = "(none)"

#: The asyncio task each running handler is in, and its agent's name.
_owners: dict[asyncio.Task[Any], str] = {}


class running_for:  # noqa: N801 - used as a function (``with running_for(...)``)
    """Attribute the current task to agent ``name`` while the block, which runs
    the agent's code ``call`` (e.g. "on_start"), runs.

    ``tasks``: the agent's count of the asyncio tasks its handlers spawn
    (:mod:`.tasktally`); a task made inside the block is counted there.
    A ``SystemExit`` leaving the block leaves it as
    :class:`~meshnode.node.pluginexit.PluginExited`: it fails the call, not
    the daemon.
    Nested uses (a drain running a handler in its own task) restore the outer
    owner; costs one dict write and one pop per handler. (A class, not a
    generator context manager: it runs around every handler, and
    ``contextlib``'s machinery cost three times as much.)
    """

    __slots__ = ("_call", "_name", "_outer", "_task", "_tasks", "_token")

    def __init__(self, name: str, tasks: tasktally.TaskCount | None = None, call: str = "a handler") -> None:
        self._name = name
        self._call = call
        self._tasks = tasks
        self._task: asyncio.Task[Any] | None = None
        self._outer: str | None = None
        self._token: contextvars.Token[tasktally.TaskCount | None] | None = None

    def __enter__(self) -> None:
        task = self._task = asyncio.current_task()
        if task is None:
            return
        self._outer = _owners.get(task)
        _owners[task] = self._name
        if self._tasks is not None:
            self._token = tasktally.CURRENT.set(self._tasks)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        task = self._task
        if task is not None:
            if self._token is not None:
                tasktally.CURRENT.reset(self._token)
            if self._outer is None:
                _owners.pop(task, None)
            else:
                _owners[task] = self._outer
        if isinstance(exc, SystemExit):
            raise exited(self._call, exc) from exc


class LoopWatchdog:
    """Measures the loop's lag and reports blocks with the agent that caused them.

    ``on_block(lag_s, agent)`` is called on the loop after a block; ``agent``
    is the blocking handler's agent name, or :data:`UNATTRIBUTED`.
    """

    def __init__(
        self,
        *,
        threshold_s: float,
        on_block: Callable[[float, str], None],
        interval_s: float | None = None,
    ) -> None:
        if threshold_s <= 0:
            raise ValueError("threshold_s must be positive")
        self.threshold_s = threshold_s
        #: Wakeups are frequent enough to see a block of the threshold; more is waste.
        self.interval_s = interval_s if interval_s is not None else min(0.25, threshold_s / 4)
        self._on_block = on_block
        #: The last wakeup's lateness, and the largest seen.
        self.lag_s = 0.0
        self.max_lag_s = 0.0
        #: Blocks by agent name (UNATTRIBUTED for the node's own code).
        self.blocks: Counter[str] = Counter()
        self._beat = time.monotonic()
        # (beat, agent): the thread's sample of the task that stalled the wakeup at ``beat``.
        self._sample: tuple[float, str] | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self.running:
            return
        loop = asyncio.get_running_loop()
        self._stopped.clear()
        self._beat = time.monotonic()
        self._loop = loop
        self._task = loop.create_task(self._tick(), name="loop-watchdog")
        self._thread = threading.Thread(target=self._watch, args=(loop,), name="meshnode-loop-watchdog", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopped.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        thread, self._thread = self._thread, None
        if thread is not None:
            await asyncio.to_thread(thread.join, 2.0)

    def status(self) -> dict[str, Any]:
        """For Status and metrics: the lag now, the worst, the blocks by agent."""
        return {
            "lag_s": round(self.lag_s, 3),
            "max_lag_s": round(self.max_lag_s, 3),
            "block_threshold_s": self.threshold_s,
            "blocks": dict(self.blocks),
        }

    def blocked_now(self) -> dict[str, Any] | None:
        """Is the loop stuck right now? Safe to call from any thread.

        None while the loop keeps its wakeups (or the watchdog is stopped);
        otherwise ``{"for_s", "agent", "threshold_s"}``: how long the due
        wakeup is overdue (at least the threshold) and the agent whose
        handler the loop is running (:data:`UNATTRIBUTED` for the node's own
        code). Reads only what the loop publishes (the last wakeup's time, the
        running task and its owner), like the watchdog's thread.
        """
        loop = self._loop
        if loop is None or self._stopped.is_set() or self._thread is None:
            return None
        overdue = time.monotonic() - self._beat - self.interval_s
        if overdue < self.threshold_s:
            return None
        task = asyncio.current_task(loop)
        agent = _owners.get(task, UNATTRIBUTED) if task is not None else UNATTRIBUTED
        return {"for_s": round(overdue, 1), "agent": agent, "threshold_s": self.threshold_s}

    # -- on the loop -------------------------------------------------------------

    async def _tick(self) -> None:
        interval = self.interval_s
        while True:
            beat = time.monotonic()
            self._beat = beat
            await asyncio.sleep(interval)
            lag = max(0.0, time.monotonic() - beat - interval)
            self.lag_s = lag
            self.max_lag_s = max(self.max_lag_s, lag)
            if lag < self.threshold_s:
                continue
            sample = self._sample
            agent = sample[1] if sample is not None and sample[0] == beat else UNATTRIBUTED
            self.blocks[agent] += 1
            try:
                self._on_block(lag, agent)
            except Exception:  # a reporting failure must not stop the watchdog
                log.exception("reporting a loop block failed")

    # -- in the thread -------------------------------------------------------------

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        # Sampled once per stalled wakeup, half a threshold in: by then the
        # loop is stuck in the blocking step, and current_task names it.
        overdue = self.interval_s + self.threshold_s / 2
        while not self._stopped.wait(self.interval_s):
            beat = self._beat
            if time.monotonic() - beat < overdue:
                continue
            sample = self._sample
            if sample is not None and sample[0] == beat:
                continue
            task = asyncio.current_task(loop)
            self._sample = (beat, _owners.get(task, UNATTRIBUTED) if task is not None else UNATTRIBUTED)
