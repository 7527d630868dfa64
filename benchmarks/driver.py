"""The round-trip driver: a hosted agent that times requests from inside its node.

Loaded into a daemon with ``[node] plugin_modules = ["benchmarks.driver:plugin"]``
and hosted as ``[agents.driver] plugin = "bench-driver"``. One admin ``Call`` of
its ``run`` offering fires ``n`` requests at ``input.target`` (an agent id on
another node) through the ordinary ``ctx.request`` path — signed, checked on the
far side with every §22 protection, accepted, answered and checked again here —
and returns what it measured inside this daemon's process, so the admin socket
and the CLI identity's own request are not part of any figure.

Input: ``{"target": agent id, "offering": "echo", "payload": any, "mode":
"latency" | "throughput", "n": int, "concurrency": int}``. ``latency`` runs the
calls one after another (``concurrency`` is ignored) and returns p50/p99 in µs;
``throughput`` keeps ``concurrency`` calls in flight and returns calls/s. Both
return this process's CPU time per call in µs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from meshnode.agent import Agent, Context, offering
from meshnode.plugins import hookimpl


def percentiles(samples: list[float]) -> tuple[float, float]:
    """(p50, p99) of ``samples`` (nearest rank)."""
    ordered = sorted(samples)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def time_sequential(call: Callable[[], Awaitable[object]], n: int) -> tuple[float, float]:
    """p50/p99 latency in µs of ``n`` calls made one after another."""
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - t) * 1e6)
    return percentiles(samples)


async def time_concurrent(call: Callable[[], Awaitable[object]], n: int, concurrency: int) -> float:
    """Calls per second for ``n`` calls with ``concurrency`` in flight."""
    queue = iter(range(n))

    async def worker() -> None:
        for _ in queue:  # the workers share one iterator: n calls in all
            await call()

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - t)


class BenchDriver(Agent):
    """Times round trips to another agent from inside this node."""

    description = "benchmark driver: times round trips from inside its node"

    @offering("run", framing=False)
    async def run(self, ctx: Context, input: Any) -> Any:
        target = str(input["target"])
        offering_id = str(input.get("offering", "echo"))
        payload = input.get("payload")
        n = int(input["n"])
        mode = input.get("mode", "latency")

        async def call() -> None:
            await ctx.request(target, offering_id, payload, timeout=60)

        cpu0 = time.process_time()
        if mode == "latency":
            p50, p99 = await time_sequential(call, n)
            result: dict[str, Any] = {"p50_us": p50, "p99_us": p99}
        elif mode == "throughput":
            result = {"per_s": await time_concurrent(call, n, int(input.get("concurrency", 64)))}
        else:
            raise ValueError(f"mode must be latency or throughput, not {mode!r}")
        result["cpu_us"] = (time.process_time() - cpu0) / n * 1e6
        result["n"] = n
        return result


class BenchDriverPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("bench-driver", BenchDriver)


plugin = BenchDriverPlugin()
