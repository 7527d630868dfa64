"""The SQLite inbox store: commit-then-ack intake, at-most-once claims, retention."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypedDict, Unpack

import pytest

from meshnode.node import inbox as inbox_module
from meshnode.node.inbox import InboxStore, InboxUnwritable
from meshnode.testing import eventually_async

A = "U" + "A" * 55


class _GatedBarrier:
    """A settle barrier that passes only once ``gate`` is set, counting passes."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.passes = 0

    async def __call__(self) -> None:
        await self.gate.wait()
        self.passes += 1


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

        remembered = store.load_seen(A, 100)
        assert ("s2", "live1") in remembered and len(remembered) == 6
        # The node's read (at an agent's first delivery): the same pairs, in the
        # store's reader thread on its own connection, off the event loop.
        assert await store.read_seen(A, 100) == remembered
        assert any(t.name.startswith("inbox-reader") for t in threading.enumerate())
        await store.sweep(5000)  # replied row past retention goes; memory trimmed to capacity
        assert await store.get(held) is None
        assert len(store.load_seen(A, 100)) == 3
        assert store.commits > 5
    finally:
        await store.close()
    assert store._reader is None and store._reader_db is None  # closed with the store
    # A read racing the stop (a delivery as the node closes) is refused, as the
    # synchronous read is, rather than starting a reader nothing would close.
    with pytest.raises(RuntimeError, match="not open"):
        await store.read_seen(A, 100)
    assert store._reader is None
    assert oct((tmp_path / "i.sqlite3").stat().st_mode & 0o777) == "0o600"


class _Bounds(TypedDict, total=False):
    """The bounds of :class:`InboxStore` a trimming test sets."""

    seen_capacity: int
    seen_max_age_ms: int
    retention_ms: int


@contextlib.asynccontextmanager
async def _trimmed_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int, **bounds: Unpack[_Bounds]
) -> AsyncIterator[InboxStore]:
    """An open store with small bounds, trimming ``chunk`` pairs per statement
    (so an agent takes several statements)."""
    monkeypatch.setattr(inbox_module, "_TRIM_CHUNK", chunk)
    store = InboxStore(tmp_path / "i.sqlite3", **bounds)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


def _pairs_of(store: InboxStore, agent: str) -> list[tuple[str, int]]:
    return [(str(m), int(ms)) for m, ms in store.db.execute(
        "SELECT msg_id, seen_ms FROM seen WHERE agent=? ORDER BY seen_ms", (agent,))]


async def test_the_remembered_pairs_are_bounded_as_they_are_written_not_by_the_hourly_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy agent's pairs are trimmed to seen_capacity by the write-behind's
    own ticks, a chunk at a time, oldest first; nothing waits for the sweep
    (hourly, which once deleted a whole hour's excess in one transaction on
    the loop). A quiet agent beside it keeps everything it has."""
    async with _trimmed_store(tmp_path, monkeypatch, 7, seen_capacity=40) as store:
        for i in range(10):
            store.remember("quiet", "S", f"q{i}", i)
        for batch in range(5):
            for i in range(30):
                store.remember(A, "S", f"m{batch * 30 + i}", 1000 + batch * 30 + i)
            await store.flush()
        await eventually_async(lambda: not store._trim_queue and len(_pairs_of(store, A)) == 40,
                               what="the busy agent trimmed to its capacity", detail=store.health)
        kept = _pairs_of(store, A)
        assert [m for m, _ in kept] == [f"m{i}" for i in range(110, 150)]  # the newest 40
        assert len(_pairs_of(store, "quiet")) == 10
        assert store.health()["seen_trimmed"] == 110


async def test_pairs_written_while_an_agent_is_trimmed_bring_it_back_to_the_trimmer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _trimmed_store(tmp_path, monkeypatch, 3, seen_capacity=20) as store:
        with store.db:
            store.db.executemany("INSERT INTO seen VALUES (?,?,?,?,?)", [(A, "S", f"m{i}", i, 1) for i in range(30)])
        store._trim_queue[A] = None
        assert not store._trim_agent(A)  # counted: 10 past the bound, not trimmed yet
        for i in range(5):  # meanwhile the agent writes on (A is queued already)
            store.remember(A, "S", f"late{i}", 1000 + i)
        await store.flush()
        while store._trim_queue:
            store._trim_step()
        kept = _pairs_of(store, A)
        assert len(kept) == 20 and kept[-1][0] == "late4" and kept[0][0] == "m15"


async def test_the_sweep_deletes_aged_pairs_agent_by_agent_and_trims_the_rest_to_capacity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _trimmed_store(tmp_path, monkeypatch, 5, seen_capacity=20, seen_max_age_ms=1000) as store:
        # Written straight to the file (as an older version left it): no counts yet.
        rows = [(agent, "S", f"{agent}-{i}", ms, 1) for agent, count, ms in
                (("old", 12, 10), ("busy", 50, 5000), ("mixed", 30, 10)) for i in range(count)]
        rows += [("mixed", "S", f"mixed-new-{i}", 5000, 1) for i in range(25)]
        with store.db:
            store.db.executemany("INSERT INTO seen VALUES (?,?,?,?,?)", rows)
            # Finished rows past the retention (14 days), and ones still within it or not finished.
            store.db.executemany(
                "INSERT INTO messages (agent, sender, msg_id, kind, envelope, received_ms, state, state_ms)"
                " VALUES (?,?,?,'request',x'7b7d',0,?,?)",
                [(A, "S", f"r{i}", state, ms) for i, (state, ms) in enumerate(
                    [("answered", 0)] * 12 + [("answered", 5000), ("pending", 0)])])
        result = await store.sweep(now_ms=14 * 86_400_000 + 10)
        assert result == {"finished_rows": 12, "expired_seen": 12 + 30 + 25 + 50, "trimmed_seen": 0}
        assert await store.counts() == {"answered": 1, "pending": 1}
        # A later sweep's bound by count: the newest pairs stay.
        with store.db:
            store.db.executemany("INSERT INTO seen VALUES (?,?,?,?,?)", rows)
        result = await store.sweep(now_ms=5500)
        assert result == {"finished_rows": 0, "expired_seen": 12 + 30, "trimmed_seen": 30 + 5}
        assert _pairs_of(store, "old") == []
        assert len(_pairs_of(store, "busy")) == 20 and len(_pairs_of(store, "mixed")) == 20
        assert all(m.startswith("mixed-new-") for m, _ in _pairs_of(store, "mixed"))
        assert not store._trim_queue and not store._trim_horizon


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
        remembered = set(reopened.load_seen("A", 100_000))
        await reopened.close()
        assert {("S", f"m{attempt}-{i}") for i in range(50)} <= remembered


async def test_a_failed_write_behind_keeps_its_batch_for_the_next(tmp_path: Path) -> None:
    store = InboxStore(tmp_path / "i.sqlite3")
    await store.open()
    store.remember("A", "S", "m1", 1000)
    store.db.execute("PRAGMA query_only = 1")  # every write fails, as on a read-only file
    with pytest.raises(InboxUnwritable):
        await store.flush()
    store.db.execute("PRAGMA query_only = 0")
    await store.flush()
    assert store.load_seen("A", 10) == [("S", "m1")]
    await store.close()


# -- the live path's commit before dispatch (issue #23) ------------------------------


async def test_live_pairs_are_group_committed_before_dispatch_and_never_drained_again(tmp_path: Path) -> None:
    store = InboxStore(tmp_path / "i.sqlite3")
    await store.open()
    try:
        # Pairs queued in the same turn of the loop ride in one commit; an idle
        # store commits a lone pair at once (no gathering window).
        before = store.group_commits
        outcomes = await asyncio.gather(*(store.commit_live(A, "s", f"m{i}", 100) for i in range(20)))
        assert outcomes == ["committed"] * 20
        assert store.group_commits == before + 1
        assert await store.commit_live(A, "s", "lone", 100) == "committed"
        assert store.group_commits == before + 2
        items = [("s", f"m{i}", "request", b"{}", i) for i in range(20)]
        # Their handlers run: the buffered copies stay in the broker meanwhile.
        assert await store.accept_batch(A, items, 102) == [None] * 20
        for i in range(20):
            store.settle(A, "s", f"m{i}", 103)
        # Settled: the copies are acked without dispatch.
        assert await store.accept_batch(A, items, 104) == [False] * 20
        assert await store.counts() == {}
    finally:
        await store.close()


async def test_a_drained_copy_never_overtakes_the_commit_of_its_live_pair(tmp_path: Path) -> None:
    """A live pair still queued for its group commit when a drain batch arrives
    is committed by that batch's transaction, before the copy is acked."""
    path = tmp_path / "i.sqlite3"
    store = InboxStore(path)
    await store.open()
    try:
        waiting = asyncio.ensure_future(store.commit_live(A, "s", "q1", 100))
        await asyncio.sleep(0)  # queued, its commit scheduled but not run
        # Committed by the batch's transaction, its handler about to run: the copy waits.
        assert await store.accept_batch(A, [("s", "q1", "request", b"{}", 1)], 101) == [None]
        assert await waiting == "committed"
        assert ("s", "q1") in store.load_seen(A, 10)
    finally:
        await store.close()


async def test_a_crash_mid_handler_keeps_the_buffered_copy_as_interrupted(tmp_path: Path) -> None:
    """Committed live, never settled (the process died while the handler ran):
    after a restart the drained copy is kept as ``interrupted`` — neither run
    a second time nor silently dropped. Settled pairs are plain duplicates."""
    path = tmp_path / "i.sqlite3"
    store = InboxStore(path)
    await store.open()
    assert await store.commit_live(A, "s", "running", 100) == "committed"
    assert await store.commit_live(A, "s", "finished", 100) == "committed"
    store.settle(A, "s", "finished", 100)
    await asyncio.sleep(0)  # the settle rides in the next group commit
    assert await store.commit_live(A, "s", "answer", 100, settled=True) == "committed"
    # A kill -9 here: the file is not closed (the connection is simply dropped).
    store._db.close()  # type: ignore[union-attr]
    store._db = None
    store._closing = True
    reopened = InboxStore(path)
    await reopened.open()
    try:
        items = [("s", "running", "request", b"{}", 1), ("s", "finished", "request", b"{}", 2),
                 ("s", "answer", "respond", b"{}", 3)]
        assert await reopened.accept_batch(A, items, 200) == [False, False, False]
        kept = await reopened.rows(states=["interrupted"])
        assert [r.msg_id for r in kept] == ["running"] and kept[0].envelope == b"{}"
        assert await reopened.claim_pending(A, 10, 201) == []
        # The copy drained again (its ack was lost) adds nothing.
        assert await reopened.accept_batch(A, items[:1], 202) == [False]
        assert len(await reopened.rows(states=["interrupted"])) == 1
    finally:
        await reopened.close()


async def test_the_sync_barrier_runs_only_when_something_was_committed(tmp_path: Path) -> None:
    store = InboxStore(tmp_path / "i.sqlite3")
    await store.open()
    try:
        assert await store.accept_batch(A, [("s", "n1", "request", b"{}", 1)], 100) == [True]
        syncs = store.syncs
        assert syncs >= 1
        # Already-seen copies only, nothing committed since: no fsync at all.
        assert await store.accept_batch(A, [("s", "n1", "request", b"{}", 1)], 101) == [False]
        assert store.syncs == syncs
        # A live commit since the last sync: the ack of its copy waits for one fsync.
        await store.commit_live(A, "s", "l1", 102, settled=True)
        assert await store.accept_batch(A, [("s", "l1", "request", b"{}", 2)], 103) == [False]
        assert store.syncs == syncs + 1
    finally:
        await store.close()


async def test_an_unwritable_inbox_degrades_the_live_commit_to_write_behind(tmp_path: Path) -> None:
    store = InboxStore(tmp_path / "i.sqlite3")
    await store.open()
    try:
        store.db.execute("PRAGMA query_only = 1")
        assert await store.commit_live(A, "s", "d1", 100) == "degraded"  # dispatched anyway
        assert store.fault is not None and store.health()["live_degraded"] == 1
        store.db.execute("PRAGMA query_only = 0")
        await store.probe()
        await store.flush()  # the write-behind carries it once the disk is back
        assert ("s", "d1") in store.load_seen(A, 10)
    finally:
        await store.close()


async def test_a_file_of_an_older_version_gains_the_done_column(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "i.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE seen (agent TEXT NOT NULL, sender TEXT NOT NULL, msg_id TEXT NOT NULL,"
        " seen_ms INTEGER NOT NULL, PRIMARY KEY (agent, sender, msg_id)) WITHOUT ROWID;"
        f" INSERT INTO seen VALUES ('{A}', 's', 'old', 1);"
    )
    old.commit()
    old.close()
    store = InboxStore(path)
    await store.open()
    try:
        # An old pair was written after its dispatch: handled, a plain duplicate.
        assert await store.accept_batch(A, [("s", "old", "request", b"{}", 1)], 100) == [False]
        assert await store.rows(states=["interrupted"]) == []
    finally:
        await store.close()


async def test_a_taken_request_is_left_in_the_broker_until_it_settles(tmp_path: Path) -> None:
    """Taken by the live path, its handler not started: the drain neither acks
    nor dispatches the copy (a crash now must find it and run it once); once
    the request settled the copy is a plain duplicate. Released (cancelled
    before it ran), nothing is written and the copy is new work."""
    store = InboxStore(tmp_path / "i.sqlite3")
    await store.open()
    try:
        store.take(A, "s", "t1")
        store.take(A, "s", "t2")
        items = [("s", "t1", "request", b"{}", 1), ("s", "t2", "request", b"{}", 2)]
        assert await store.accept_batch(A, items, 100) == [None, None]
        store.settle(A, "s", "t1", 101)  # answered without a handler
        store.release(A, "s", "t2")  # cancelled before its handler started
        await asyncio.sleep(0)
        assert await store.accept_batch(A, items, 102) == [False, True]
        assert store.health()["drain_deferred"] == 2
    finally:
        await store.close()


async def test_outcomes_written_behind_land_on_their_rows(tmp_path: Path) -> None:
    store = InboxStore(tmp_path / "i.sqlite3")
    await store.open()
    try:
        assert await store.accept_batch(A, [("s", "o1", "request", b"{}", 1)], 100) == [True]
        (row,) = await store.claim_pending(A, 10, 101)
        await store.set_state(row.inbox_id, "answered", 102, "done", durable=False)
        await store.flush()
        written = await store.get(row.inbox_id)
        assert written is not None and (written.state, written.state_ms, written.note) == ("answered", 102, "done")
    finally:
        await store.close()


async def test_a_request_settles_only_after_its_answer_reached_the_broker(tmp_path: Path) -> None:
    """The finished mark waits for the settle barrier (the node's flush round
    trip): written while the answer still sat in the client's buffer, a kill -9
    would let the drain ack the copy of a request whose answer never left."""
    store = InboxStore(tmp_path / "i.sqlite3")
    await store.open()
    barrier = _GatedBarrier()
    sent = barrier.gate
    store.settle_barrier = barrier
    try:
        store.take(A, "s", "b1")
        assert store.commit_live_now(A, "s", "b1", 100) == "committed"
        store.settle(A, "s", "b1", 101)  # answered; the answer is not out yet
        store.take(A, "s", "b2")
        assert store.commit_live_now(A, "s", "b2", 100) == "committed"
        store.settle(A, "s", "b2", 101)
        await asyncio.sleep(0)
        items = [("s", "b1", "request", b"{}", 1), ("s", "b2", "request", b"{}", 2)]
        assert await store.accept_batch(A, items, 102) == [None, None]  # still unfinished: left in the broker
        sent.set()
        await eventually_async(lambda: store.health()["write_behind_pending"] == 0, what="the settle marks written")
        assert barrier.passes == 1, "one barrier for the batch of answers"
        assert await store.accept_batch(A, items, 103) == [False, False]
    finally:
        await store.close()


async def test_a_claimed_row_runs_once_after_a_crash_and_a_started_one_is_interrupted(tmp_path: Path) -> None:
    """Issue #23: a drained row is claimed before the pipeline (whose awaits,
    e.g. the sender's vouch, come before the handler) and marked started only
    right before its handler. A kill -9 in between must not keep a row that
    never ran as interrupted: it is pending again, and its pair is not in the
    duplicate memory (or the re-dispatch would be refused as a duplicate of
    itself). A row whose handler started is interrupted, never run again."""
    path = tmp_path / "i.sqlite3"
    store = InboxStore(path)
    await store.open()
    items = [("s", "claimed", "request", b"{}", 1), ("s", "started", "request", b"{}", 2)]
    assert await store.accept_batch(A, items, 100) == [True, True]
    claimed, started = await store.pending_rows(A, 10)
    assert await store.start_row(claimed, 101) and await store.start_row(started, 101)
    assert not await store.start_row(claimed, 102)  # handed to the pipeline at most once
    store.mark_started(A, "s", "started", 103)
    store.mark_started(A, "s", "started", 104)  # a second mark (the handler's answer) changes nothing
    assert {r.msg_id: r.state for r in await store.rows()} == {"claimed": "claimed", "started": "dispatched"}
    # A kill -9 here: nothing is closed, nothing more is written.
    assert store._flusher is not None
    store._flusher.cancel()
    await asyncio.gather(store._flusher, return_exceptions=True)
    if store._syncer is not None:
        await asyncio.gather(store._syncer, return_exceptions=True)
    store._db.close()  # type: ignore[union-attr]
    store._db = None
    reopened = InboxStore(path)
    await reopened.open()
    try:
        assert await reopened.recover_interrupted(200) == 1
        assert {r.msg_id: r.state for r in await reopened.rows()} == {"claimed": "pending", "started": "interrupted"}
        assert reopened.load_seen(A, 10) == [("s", "started")]
        # The buffered copies drained again add nothing; the claimed row runs once.
        assert await reopened.accept_batch(A, items, 201) == [False, False]
        (again,) = await reopened.pending_rows(A, 10)
        assert again.msg_id == "claimed" and await reopened.start_row(again, 202)
        reopened.mark_started(A, "s", "claimed", 203)
        assert (await reopened.get(again.inbox_id)).state == "dispatched"  # type: ignore[union-attr]
    finally:
        await reopened.close()


async def test_live_responds_and_settle_marks_ride_the_next_commit(tmp_path: Path) -> None:
    """Issue #21: a live respond's pair is not committed on its own: it rides the
    next commit (here a request's inline commit) or the write-behind flush; a
    drained copy judged before either is still known (accept_batch writes queued
    pairs first), and nothing queued is lost at close."""
    path = tmp_path / "i.sqlite3"
    store = InboxStore(path, flush_interval=3600)  # no flush during the test: only the rides
    await store.open()
    try:
        before = store.commits
        for i in range(10):
            store.commit_live_soon(A, "s", f"r{i}", 100)
        await asyncio.sleep(0)
        assert store.commits == before, "nothing committed for the responds alone"
        assert store.commit_live_now(A, "s", "request", 100) == "committed"
        assert store.commits == before + 1 and store.live_committed == 11, "the responds rode the request's commit"
        store.commit_live_soon(A, "s", "late", 101)
        assert await store.accept_batch(A, [("s", "late", "respond", b"{}", 1)], 102) == [False]
        assert await store.accept_batch(A, [("s", "r3", "respond", b"{}", 2)], 102) == [False]
        store.commit_live_soon(A, "s", "at-close", 103)
    finally:
        await store.close()
    reopened = InboxStore(path)
    await reopened.open()
    try:
        assert {("s", "at-close"), ("s", "r9"), ("s", "late")} <= set(reopened.load_seen(A, 100))
    finally:
        await reopened.close()


async def test_answers_share_one_barrier_and_one_commit_per_flush_tick(tmp_path: Path) -> None:
    """Issue #21: an answered request's finished mark waits for the write-behind
    flush's next tick, which passes the settle barrier (a flush round trip to
    the broker) once for every answer since the last tick, then writes their
    marks in one commit. A barrier started per answer was one round trip per
    request at concurrency 1; a commit per answer, one WAL write each."""
    store = InboxStore(tmp_path / "i.sqlite3", flush_interval=3600)
    await store.open()
    passed = 0

    async def barrier() -> None:
        nonlocal passed
        passed += 1

    store.settle_barrier = barrier
    try:
        for q in ("q1", "q2", "q3"):
            store.take(A, "s", q)
            assert store.commit_live_now(A, "s", q, 100) == "committed"
        commits = store.commits
        await eventually_async(lambda: store._idle, what="the flusher asleep with nothing queued")
        for q in ("q1", "q2", "q3"):
            store.settle(A, "s", q, 101)
        # Woken by the first mark, the flusher now waits out its window (an hour here).
        await eventually_async(lambda: not store._idle, what="the flusher woken into its window")
        assert (passed, store.commits) == (0, commits), "no barrier and no commit per answer"
        # Unfinished until then: a drain leaves the copy in the broker.
        assert await store.accept_batch(A, [("s", "q1", "request", b"{}", 1)], 102) == [None]
        store._wake.set()  # the flush loop's tick (every flush_interval)
        await eventually_async(lambda: store.health()["write_behind_pending"] == 0, what="the marks written")
        assert passed == 1, "one barrier for the three answers"
        items = [("s", q, "request", b"{}", i) for i, q in enumerate(("q1", "q2", "q3"))]
        assert await store.accept_batch(A, items, 103) == [False, False, False]
    finally:
        await store.close()


async def test_an_idle_flusher_sleeps_until_something_is_queued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing queued the write-behind does not tick every flush_interval
    (an idle daemon woke 20 times a second for it); what is queued meanwhile
    wakes it and is written within the usual window, not at the next idle
    tick (here an hour away)."""
    monkeypatch.setattr(inbox_module, "_IDLE_TICK_S", 3600.0)
    store = InboxStore(tmp_path / "i.sqlite3", flush_interval=0.01)
    await store.open()
    try:
        await eventually_async(lambda: store._idle, what="the flusher asleep with nothing queued")
        store.remember(A, "s", "late", 100)
        await eventually_async(lambda: store.health()["write_behind_pending"] == 0, what="the pair written")
        assert await store.accept_batch(A, [("s", "late", "request", b"{}", 1)], 101) == [False]
        await eventually_async(lambda: store._idle, what="asleep again")
    finally:
        await store.close()


async def test_a_barrier_cancelled_by_a_stop_leaves_its_marks_for_the_last_one(tmp_path: Path) -> None:
    """A stop that cannot wait for the flush loop's barrier cancels it: the marks
    it carried go back to wait, and close()'s own last barrier settles them,
    so a clean stop does not leave an answered request looking interrupted."""
    path = tmp_path / "i.sqlite3"
    store = InboxStore(path, flush_interval=3600)
    await store.open()
    barrier = _GatedBarrier()
    store.settle_barrier = barrier
    store.take(A, "s", "q")
    assert store.commit_live_now(A, "s", "q", 100) == "committed"
    store.settle(A, "s", "q", 101)
    passing = asyncio.ensure_future(store._pass_barrier())
    await eventually_async(lambda: store._passing, what="the barrier under way")
    passing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await passing
    assert store.health()["write_behind_pending"] == 1
    barrier.gate.set()
    await store.close()
    reopened = InboxStore(path)
    await reopened.open()
    try:
        assert await reopened.accept_batch(A, [("s", "q", "request", b"{}", 1)], 102) == [False]
        assert reopened.kept_interrupted == 0 and await reopened.counts() == {}
    finally:
        await reopened.close()


async def test_a_failed_barrier_is_tried_again_after_a_pause(tmp_path: Path) -> None:
    """Disconnected, the barrier fails: the marks wait, and the flush loop tries
    again no sooner than half a second later (not on every 50 ms tick)."""
    store = InboxStore(tmp_path / "i.sqlite3", flush_interval=0.01)
    await store.open()
    tries: list[float] = []

    async def barrier() -> None:
        tries.append(asyncio.get_running_loop().time())
        if len(tries) == 1:
            raise ConnectionError("not connected (the client is reconnecting)")

    store.settle_barrier = barrier
    try:
        store.take(A, "s", "q")
        assert store.commit_live_now(A, "s", "q", 100) == "committed"
        store.settle(A, "s", "q", 101)
        await eventually_async(lambda: store.health()["write_behind_pending"] == 0, what="the mark written")
        assert len(tries) == 2 and tries[1] - tries[0] >= inbox_module._BARRIER_RETRY_S
        assert await store.accept_batch(A, [("s", "q", "request", b"{}", 1)], 102) == [False]
    finally:
        await store.close()


async def test_the_wal_starts_over_although_commits_ran_during_every_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #21: SQLite restarts the WAL only when a write begins with every
    frame checkpointed, which a node committing while the worker's checkpoint
    runs never reached (2 GB of WAL after 160,000 commits). Past the catch-up
    size, the frames written meanwhile are checkpointed inline and the next
    commit starts the WAL over."""
    real_checkpoint = inbox_module._checkpoint
    entered, proceed = threading.Event(), threading.Event()

    def checkpoint_while_the_loop_commits(path: Path) -> bool:
        done = real_checkpoint(path)
        entered.set()
        # The loop commits now: frames this checkpoint did not cover.
        assert proceed.wait(30), "the test never let the checkpoint finish"
        return done

    monkeypatch.setattr(inbox_module, "_checkpoint", checkpoint_while_the_loop_commits)
    monkeypatch.setattr(inbox_module, "WAL_CATCH_UP_BYTES", 0)
    store = InboxStore(tmp_path / "i.sqlite3", checkpoint_every=10, flush_interval=3600)
    await store.open()
    try:
        for i in range(10):
            assert store.commit_live_now(A, "s", f"before{i}", 100 + i, settled=True) == "committed"
        maintaining = asyncio.ensure_future(store._maintain())
        await eventually_async(entered.is_set, what="the worker's checkpoint ran")
        for i in range(30):  # a node under load keeps committing meanwhile
            assert store.commit_live_now(A, "s", f"during{i}", 200 + i, settled=True) == "committed"
        proceed.set()
        await maintaining
        assert store.health()["wal_catch_ups"] == 1
        assert store.commit_live_now(A, "s", "after", 300, settled=True) == "committed"
        # Frames in the WAL now: those of the one commit since it started over.
        reader = sqlite3.connect(tmp_path / "i.sqlite3")
        try:
            _, frames, _ = reader.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        finally:
            reader.close()
        assert 0 < frames <= 4, f"the WAL did not start over: {frames} frames"
        # Nothing was lost on the way.
        assert await store.accept_batch(A, [("s", "during29", "request", b"{}", 1)], 400) == [False]
    finally:
        proceed.set()
        await store.close()


async def test_a_drained_rows_outcome_waits_until_its_answer_reached_the_broker(tmp_path: Path) -> None:
    """A drained request's answer is published, then its row is marked answered:
    not before the settle barrier says the answer reached the broker. A kill -9
    in between used to leave the row answered with the answer lost in the
    client's buffer (neither run again nor kept); now the row is still
    dispatched then, which a restart keeps as interrupted."""
    store = InboxStore(tmp_path / "i.sqlite3", flush_interval=0.01)
    await store.open()
    barrier = _GatedBarrier()
    gate = barrier.gate
    store.settle_barrier = barrier
    try:
        assert await store.accept_batch(A, [("s", "r1", "request", b"{}", 1)], 100) == [True]
        (row,) = await store.pending_rows(A, 10)
        assert await store.start_row(row, 101)
        store.mark_started(A, "s", "r1", 102)  # the handler runs and its answer is published
        await store.set_state(row.inbox_id, "answered", 103, durable=False, after_answers=True)
        await store.flush()
        stored = await store.get(row.inbox_id)
        assert stored is not None and stored.state == "dispatched", "answered before the answer reached the broker"
        gate.set()  # the flush loop's tick was waiting on it

        async def answered() -> bool:
            stored = await store.get(row.inbox_id)
            return stored is not None and stored.state == "answered"

        await eventually_async(answered, what="the outcome written once the barrier passed")
        assert barrier.passes == 1
    finally:
        gate.set()
        await store.close()
