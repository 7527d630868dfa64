"""Drain passes never overlap, however many triggers and reconnects pile up."""

from __future__ import annotations

import asyncio
from typing import Any

from meshnode.node.drain import InboxDrain


class _Stub:
    agent_id = "U" + "A" * 55
    name = "stub"


async def test_overlapping_triggers_never_run_two_passes_at_once() -> None:
    drain = InboxDrain(object(), _Stub(), object(), interval_s=0.01)  # type: ignore[arg-type]
    active = 0
    peak = 0
    passes = 0

    async def slow_drain() -> None:
        nonlocal active, peak, passes
        active += 1
        peak = max(peak, active)
        passes += 1
        await asyncio.sleep(0.02)
        active -= 1

    async def nothing() -> None:
        return None

    drain._drain = slow_drain  # type: ignore[method-assign]
    drain.dispatch_pending = nothing  # type: ignore[method-assign]
    drain.start()
    calls: list[Any] = []
    for _ in range(20):
        drain.trigger()  # a reconnect storm
        calls.append(asyncio.ensure_future(drain.run_pass()))  # and direct calls too
        await asyncio.sleep(0.003)
    await asyncio.gather(*calls)
    await drain.stop()
    assert peak == 1 and passes >= 20
