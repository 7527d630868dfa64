"""``kill -USR1 <pid>``: the daemon writes every pending asyncio task's stack to its log.

A daemon that is up but stuck on an await shows nothing useful to a thread
profiler (py-spy sees an idle event loop): what waits on what lives in the
tasks. The dump is one log record per task, at WARNING so that it passes
the default level, grouped by coroutine so a thousand identical waits read
as one line with a count.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
from collections import Counter
from typing import Any

log = logging.getLogger("meshnode.daemon.tasks")

#: At most this many distinct stacks are written (the rest are counted).
MAX_STACKS = 200


def _awaited(obj: Any) -> Any:
    """What a coroutine, generator or async generator waits on, if anything."""
    for attr in ("cr_await", "ag_await", "gi_yieldfrom"):
        inner = getattr(obj, attr, None)
        if inner is not None:
            return inner
    if type(obj).__name__ in ("async_generator_asend", "async_generator_athrow"):
        # ``async for`` awaits an asend wrapper that exposes nothing; its
        # referents hold the generator it drives.
        for ref in gc.get_referents(obj):
            if inspect.isasyncgen(ref):
                return ref
    return None


def _stack_of(task: asyncio.Task[Any]) -> str:
    """The task's await chain, outermost first: what asyncio's own stack omits
    (it shows the task's coroutine frame only)."""
    lines: list[str] = []
    obj: Any = task.get_coro()
    for _ in range(64):
        if obj is None:
            break
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "ag_frame", None) or getattr(obj, "gi_frame", None)
        if frame is not None:
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}')
        elif not hasattr(obj, "cr_frame") and not hasattr(obj, "ag_frame"):
            lines.append(f"  awaiting {type(obj).__name__}")
        obj = _awaited(obj)
    return "\n".join(lines)


def dump_tasks() -> int:
    """Log the stack of every pending task of the running loop; returns how many."""
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    stacks = Counter(_stack_of(t) for t in tasks)
    names: dict[str, str] = {}
    for t in tasks:
        names.setdefault(_stack_of(t), t.get_name())
    log.warning("task dump (SIGUSR1): %d pending task(s), %d distinct stack(s)", len(tasks), len(stacks))
    for i, (stack, count) in enumerate(stacks.most_common()):
        if i >= MAX_STACKS:
            log.warning("task dump: %d more distinct stack(s) not shown", len(stacks) - MAX_STACKS)
            break
        log.warning("task dump: %d× %s\n%s", count, names[stack], stack)
    return len(tasks)
