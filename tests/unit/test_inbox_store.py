"""The SQLite inbox store: commit-then-ack intake, at-most-once claims, retention."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from meshnode.node.inbox import InboxStore

A = "U" + "A" * 55


async def test_intake_claim_interrupt_and_memory(tmp_path: Path) -> None:
    store = InboxStore(tmp_path / "i.sqlite3", seen_capacity=3, retention_ms=1000, seen_max_age_ms=10_000)
    await store.open()
    try:
        items = [("s1", f"id{i}", "request", b"{}", i) for i in range(5)]
        assert await store.accept_batch(A, items, 100) == [True] * 5
        assert await store.accept_batch(A, items[:2], 101) == [False, False]  # already held: ack, don't redo
        store.remember(A, "s2", "live1", 102)  # handled on the live path
        await store.flush()
        assert await store.accept_batch(A, [("s2", "live1", "request", b"{}", 9)], 103) == [False]

        claimed = await store.claim_pending(A, 3, 200)
        assert [r.msg_id for r in claimed] == ["id0", "id1", "id2"]
        assert await store.claim_pending(A, 10, 201) and not await store.claim_pending(A, 10, 202)
        # A process dies while handlers run: those rows are kept, never re-run.
        assert await store.recover_interrupted(300) == 5
        assert await store.counts() == {"interrupted": 5}
        assert not await store.claim_pending(A, 10, 301)

        held = await store.hold(A, "s3", "x", "request", b"{}", 400)
        assert (await store.get(held)).state == "held"  # type: ignore[union-attr]
        await store.set_state(held, "replied", 500)

        remembered = await store.load_seen(A, 100)
        assert ("s2", "live1") in remembered and len(remembered) == 6
        await store.sweep(5000)  # replied row past retention goes; memory trimmed to capacity
        assert await store.get(held) is None
        assert len(await store.load_seen(A, 100)) == 3
        assert store.commits > 5
    finally:
        await store.close()
    assert oct((tmp_path / "i.sqlite3").stat().st_mode & 0o777) == "0o600"


async def test_close_during_a_write_behind_flush_loses_nothing(tmp_path: Path) -> None:
    """A stop landing while the write-behind writes must not roll back the pairs
    it took: a restart would answer an already-handled request again."""
    path = tmp_path / "i.sqlite3"
    for attempt in range(20):
        store = InboxStore(path)
        await store.open()
        for i in range(50):
            store.remember("A", "S", f"m{attempt}-{i}", 1000 + i)
        store._wake.set()  # the flusher starts its batch ...
        for _ in range(attempt % 4):
            await asyncio.sleep(0)
        await store.close()  # ... and the stop arrives at a different point each round
        reopened = InboxStore(path)
        await reopened.open()
        remembered = set(await reopened.load_seen("A", 100_000))
        await reopened.close()
        assert {("S", f"m{attempt}-{i}") for i in range(50)} <= remembered


async def test_a_failed_write_behind_keeps_its_batch_for_the_next(tmp_path: Path) -> None:
    store = InboxStore(tmp_path / "i.sqlite3")
    await store.open()
    store.remember("A", "S", "m1", 1000)
    real = store._write_behind

    async def failing(*args: object) -> None:
        raise OSError("disk full")

    store._write_behind = failing  # type: ignore[method-assign]
    with pytest.raises(OSError):
        await store.flush()
    store._write_behind = real  # type: ignore[method-assign]
    await store.flush()
    assert await store.load_seen("A", 10) == [("S", "m1")]
    await store.close()
