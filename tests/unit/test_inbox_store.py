"""The SQLite inbox store: commit-then-ack intake, at-most-once claims, retention."""

from __future__ import annotations

from pathlib import Path

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
