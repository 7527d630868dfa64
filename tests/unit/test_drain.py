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


class _Buffer:
    stream = "MESH_INBOX_X"

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.purged: list[int] = []

    async def purge_through(self, seq: int) -> None:
        if self.fail:
            raise PermissionError("permissions violation for publish to $JS.API.STREAM.PURGE.MESH_INBOX_X")
        self.purged.append(seq)


async def test_the_drain_purges_what_it_committed_and_a_refused_purge_is_logged_once(
    caplog: Any,
) -> None:
    # Issue #22.4: the mailbox discards new mail at its bound, so the drain
    # removes what it committed; a credential without the grant costs room, never mail.
    # A purge failing now and then (its reply lost in a reconnect) is not logged:
    # only FAILURES_TO_WARN in a row are, once.
    from meshnode.node.drain import FAILURES_TO_WARN

    drain = InboxDrain(object(), _Stub(), object(), interval_s=60)  # type: ignore[arg-type]
    ok = _Buffer(fail=False)
    await drain._purge(ok, 41)  # type: ignore[arg-type]
    assert ok.purged == [41] and drain.stats.purged_through == 41
    refused = _Buffer(fail=True)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "cannot purge" in r.getMessage()]

    with caplog.at_level("WARNING", logger="meshnode.drain"):
        for bound in range(50, 50 + FAILURES_TO_WARN - 1):
            await drain._purge(refused, bound)  # type: ignore[arg-type]
        await drain._purge(ok, 60)  # type: ignore[arg-type]  # a success ends the run of failures
        for bound in range(61, 61 + FAILURES_TO_WARN - 1):
            await drain._purge(refused, bound)  # type: ignore[arg-type]
        assert warnings() == []
        for bound in range(70, 75):
            await drain._purge(refused, bound)  # type: ignore[arg-type]
    assert drain.stats.purge_failures == 2 * (FAILURES_TO_WARN - 1) + 5 and drain.stats.purged_through == 60
    assert len(warnings()) == 1 and "MESH_INBOX_X" in warnings()[0]


def test_a_copy_whose_live_handler_runs_comes_back_soon_then_less_often() -> None:
    """The purge stops at a copy that is out: a flat second let a busy agent's
    buffer fill. Most live handlers settle within the write-behind window."""
    from meshnode.node.drain import DEFER_FIRST_S, DEFER_S, defer_delay

    delays = [defer_delay(n) for n in range(1, 8)]
    assert delays[0] == DEFER_FIRST_S < DEFER_S
    assert delays == sorted(delays) and delays[-1] == DEFER_S
    assert defer_delay(0) == DEFER_FIRST_S  # a count the server did not give


async def test_a_pass_purges_by_bytes_before_it_reaches_its_count() -> None:
    """A buffer of 20 KB requests holds fewer copies than the purge count (512):
    settled copies worth a quarter of the bound's bytes are purged at once."""
    drain = InboxDrain(object(), _Stub(), object(), interval_s=60)  # type: ignore[arg-type]
    buffer = _Buffer(fail=False)
    drain._settled = {1, 2, 3}
    drain._purge_bytes = 50_000
    drain._unpurged_bytes = 40_000  # three 20 KB copies would be 60,000; say two so far
    await drain._release(buffer)  # type: ignore[arg-type]
    assert buffer.purged == []  # under both the count and the bytes: kept for later
    drain._unpurged_bytes = 60_000
    await drain._release(buffer)  # type: ignore[arg-type]
    assert buffer.purged == [3] and drain.stats.purged_through == 3 and drain._unpurged_bytes == 0
