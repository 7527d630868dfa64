"""The per-agent task tally's cost (issue #23 item 10): ``create_task`` with and without it.

Each figure is one task made and run to its end (a coroutine that returns at
once), on the daemon's loop (uvloop). Three cases: no task factory (the
baseline), the tally's factory for a task of the node's own code (one
context-variable read), and for a task a handler spawned (read, count, one
done callback). The budget is a few microseconds per task.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from meshnode.node import tasktally
from meshnode.node.tasktally import TaskCount

from .harness import print_table, run_loop, write_result

#: The brief's bound on the tally's cost per task (µs).
BUDGET_US = 3.0


async def _noop() -> None:
    return None


async def _per_task_us(n: int, count: TaskCount | None) -> float:
    token = tasktally.CURRENT.set(count)
    try:
        started = time.perf_counter()
        for _ in range(n):
            # One at a time, as a handler spawns them: made, run, ended (the
            # done callback included), without a backlog of thousands pending.
            await asyncio.create_task(_noop())
        return (time.perf_counter() - started) / n * 1e6
    finally:
        tasktally.CURRENT.reset(token)


async def _measure(n: int, repeats: int) -> dict[str, float]:
    await _per_task_us(n, None)  # warm up
    figures: dict[str, list[float]] = {"plain": [], "node": [], "agent": []}
    for _ in range(repeats):
        # Interleaved, so load on the shared machine hits every case alike.
        figures["plain"].append(await _per_task_us(n, None))
        tasktally.install()
        try:
            figures["node"].append(await _per_task_us(n, None))
            figures["agent"].append(await _per_task_us(n, TaskCount()))
        finally:
            tasktally.uninstall()
    # The fastest batch of each: load on a shared machine only ever adds time.
    return {name: min(values) for name, values in figures.items()}


def run(quick: bool = False) -> dict[str, Any]:
    n, repeats = (1_000, 3) if quick else (2_000, 25)
    us = run_loop(_measure(n, repeats))
    overhead_node = us["node"] - us["plain"]
    overhead_agent = us["agent"] - us["plain"]
    rows = [("measurement", "µs/task", "over baseline")]
    rows.append(("create_task + run, no factory", f"{us['plain']:.2f}", "baseline"))
    rows.append(("with the tally, node's own task", f"{us['node']:.2f}", f"{overhead_node:+.2f} µs"))
    rows.append(("with the tally, a handler's task", f"{us['agent']:.2f}", f"{overhead_agent:+.2f} µs"))
    print_table(f"per-agent task tally ({n:,} tasks per batch, fastest of {repeats})", rows)
    result = {
        "tasks_per_batch": n,
        "plain_us_per_task": round(us["plain"], 3),
        "node_task_us": round(us["node"], 3),
        "agent_task_us": round(us["agent"], 3),
        "tally_overhead_us": round(overhead_agent, 3),
        "budget_us": BUDGET_US,
    }
    write_result("tasktally", result)
    return result
