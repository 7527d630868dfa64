"""Which agent's handlers spawned the asyncio tasks that still run (issue #23 item 10).

A handler that starts work per request (``asyncio.create_task`` and forgets
it) grew a daemon to thousands of tasks with nothing saying whose they were.
The tally attributes every task to the agent whose handler created it:

* the handler wrapper (:func:`meshnode.node.looplag.running_for`) sets
  :data:`CURRENT` to the agent's :class:`TaskCount` while the handler runs;
  a task copies its creator's context, so a task spawned by a handler (and a
  task *that* task spawns) carries the same count;
* a loop task factory (:func:`install`) reads the variable as each task is
  made, counts it, and uncounts it in a done callback. It also runs a counted
  task's coroutine through :func:`meshnode.node.pluginexit.contained`, so a
  ``sys.exit()`` in it ends that task, not the daemon.

Cost: one context-variable read per task made anywhere on the loop, and for a
handler's task an increment plus one done callback — well under a microsecond
over plain ``create_task`` (``benchmarks/task_tally.py`` measures it). Memory
cannot be attributed this way: every agent shares one heap, so Status shows
the process's RSS, and :mod:`.memsample` samples whose code keeps memory.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Generator
from typing import Any, Protocol

from meshnode.node.pluginexit import contained

__all__ = ["CURRENT", "TaskCount", "install", "installed", "uninstall"]


class TaskCount:
    """Agent ``agent``'s tasks: ``live`` still running, ``total`` made since its start."""

    __slots__ = ("agent", "live", "total")

    def __init__(self, agent: str = "") -> None:
        self.agent = agent
        self.live = 0
        self.total = 0

    def done(self, _task: object) -> None:
        """The done callback of a counted task (runs on the loop)."""
        self.live -= 1


#: The count of the agent whose handler runs in this context (None: the node's own code).
CURRENT: contextvars.ContextVar[TaskCount | None] = contextvars.ContextVar("meshnode_task_count", default=None)


class _Factory(Protocol):
    def __call__(
        self,
        loop: asyncio.AbstractEventLoop,
        coro: Coroutine[Any, Any, Any] | Generator[Any, None, Any],
        **kwargs: Any,
    ) -> asyncio.Future[Any]: ...


class _Tally:
    """The task factory; wraps whichever factory the loop had before (or none)."""

    __slots__ = ("previous",)

    def __init__(self, previous: _Factory | None) -> None:
        self.previous = previous

    def __call__(
        self,
        loop: asyncio.AbstractEventLoop,
        coro: Coroutine[Any, Any, Any] | Generator[Any, None, Any],
        **kwargs: Any,
    ) -> asyncio.Future[Any]:
        # The loop passes ``context`` only when create_task was given one; the
        # task then runs in it, so that is the context to read.
        context: contextvars.Context | None = kwargs.get("context")
        count = CURRENT.get() if context is None else context.get(CURRENT)
        if count is not None and asyncio.iscoroutine(coro):
            coro = contained(coro, count.agent)
        if self.previous is not None:
            task = self.previous(loop, coro, **kwargs)
        else:
            task = asyncio.Task(coro, loop=loop, **kwargs)
        if count is not None:
            count.live += 1
            count.total += 1
            task.add_done_callback(count.done)
        return task


def install(loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Count tasks on ``loop`` (default: the running one); idempotent."""
    loop = loop or asyncio.get_running_loop()
    current = loop.get_task_factory()
    if isinstance(current, _Tally):
        return
    loop.set_task_factory(_Tally(current))  # type: ignore[arg-type]


def uninstall(loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Stop counting on ``loop``: the factory it had before comes back.

    Tasks already counted still uncount themselves when they end.
    """
    loop = loop or asyncio.get_running_loop()
    current = loop.get_task_factory()
    if isinstance(current, _Tally):
        loop.set_task_factory(current.previous)


def installed(loop: asyncio.AbstractEventLoop | None = None) -> bool:
    loop = loop or asyncio.get_running_loop()
    return isinstance(loop.get_task_factory(), _Tally)
