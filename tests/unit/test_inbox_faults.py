"""The node inbox when SQLite cannot write: disk full (SQLITE_FULL) and read-only.

These faults are produced by SQLite itself, on the store's own connection:
``PRAGMA max_page_count`` caps the file at its current size (the real
SQLITE_FULL path, as on a full disk) and ``PRAGMA query_only`` makes every
write fail as on a read-only file. A real full filesystem (tmpfs) with a
real daemon is tests/integration/test_disk_full.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from meshnode.node.inbox import InboxStore, InboxUnwritable
from meshnode.node.runtime import Node, NodeSettings
from meshnode.protocol.envelope import build_envelope, encode_envelope, sign_envelope
from meshnode.protocol.nkeys import KeyPair
from meshnode.testing import eventually_async
from tests.fuzz.test_fuzz_pipeline import Desk, Probe, RecordingConnection, _host

NOW = 1_782_900_000_000


async def _full(store: InboxStore) -> None:
    row = store.db.execute("PRAGMA page_count").fetchone()
    assert row is not None
    store.db.execute(f"PRAGMA max_page_count = {int(row[0])}")


async def _space_returns(store: InboxStore) -> None:
    store.db.execute("PRAGMA max_page_count = 1073741823")


def _item(i: int, size: int = 20_000) -> tuple[str, str, str, bytes, int]:
    return ("sender", f"m{i}", "request", os.urandom(size), i)


async def test_a_full_inbox_refuses_to_commit_says_so_and_recovers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    try:
        assert await store.accept_batch("A", [_item(0, 10)], NOW) == [True]
        await _full(store)
        with pytest.raises(InboxUnwritable) as info:
            for i in range(1, 50):  # until the pages in hand are used up
                await store.accept_batch("A", [_item(i)], NOW)
        assert "full" in info.value.cause
        health = store.health()
        assert health["writable"] is False and "full" in health["fault"]
        assert not store.db.in_transaction, "a failed commit left a transaction open"
        # Every other write path fails the same way, and no transaction is left open.
        with pytest.raises(InboxUnwritable):
            await store.hold("A", "sender", "held-1", "request", os.urandom(50_000), NOW)
        assert [r.msg_id for r in await store.rows(states=["held"])] == []
        errors = [r for r in caplog.records if r.levelname == "ERROR" and "cannot be written" in r.getMessage()]
        assert len(errors) == 1, "the fault is logged once when it starts, not per failed write"
        before = await store.counts()
        await _space_returns(store)
        assert await store.accept_batch("A", [_item(100)], NOW) == [True]
        assert store.health()["writable"] is True and store.fault is None
        after = await store.counts()
        assert after["pending"] == before["pending"] + 1  # nothing committed was lost, nothing half-written
        assert any("writable again" in r.getMessage() for r in caplog.records)
    finally:
        await _space_returns(store)
        await store.close()


async def test_a_read_only_inbox_refuses_and_recovers(tmp_path: Path) -> None:
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    try:
        store.db.execute("PRAGMA query_only = 1")
        with pytest.raises(InboxUnwritable) as info:
            await store.accept_batch("A", [_item(1, 10)], NOW)
        assert "readonly" in info.value.cause.replace("-", "").replace(" ", "")
        with pytest.raises(InboxUnwritable):
            await store.claim_pending("A", 10, NOW)
        assert store.health()["writable"] is False
        store.db.execute("PRAGMA query_only = 0")
        assert await store.accept_batch("A", [_item(1, 10)], NOW) == [True]
        assert [r.msg_id for r in await store.claim_pending("A", 10, NOW)] == ["m1"]
        assert store.health()["writable"] is True
    finally:
        store.db.execute("PRAGMA query_only = 0")
        await store.close()


async def test_write_behind_keeps_its_backlog_while_unwritable(tmp_path: Path) -> None:
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    try:
        store.db.execute("PRAGMA query_only = 1")
        store.remember("A", "s", "live-1", NOW)
        with pytest.raises(InboxUnwritable):
            await store.flush()
        assert store.health()["write_behind_pending"] == 1
        # The drain still knows the pair was handled live (no second dispatch).
        store.db.execute("PRAGMA query_only = 0")
        assert await store.accept_batch("A", [("s", "live-1", "request", b"{}", 1)], NOW) == [False]
        await store.flush()
        assert store.health()["write_behind_pending"] == 0
    finally:
        store.db.execute("PRAGMA query_only = 0")
        await store.close()


async def test_an_interactive_request_the_inbox_cannot_hold_is_left_to_the_buffer(tmp_path: Path) -> None:
    """Live: not held, so no queued ack and not remembered; the drained copy is then held."""
    conn = RecordingConnection()
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    node = Node(settings=NodeSettings(name="t"), node_key=KeyPair.generate(),
                connection=conn, clock=lambda: NOW, inbox=store)  # type: ignore[arg-type]
    desk = _host(node, "desk", Desk)
    sender = KeyPair.generate()
    env = sign_envelope(build_envelope("request", sender.public_key, now_ms=NOW, to=desk.agent_id,
                                       payload={"offering": "work", "input": "hello"}), sender)
    data = encode_envelope(env)
    try:
        store.db.execute("PRAGMA query_only = 1")
        assert await desk.receive(data, source="live", reply="_INBOX.r") == "refused"
        assert conn.published == [], "a queued ack was sent for a message nobody holds"
        assert desk.counters["refused.inbox_unwritable"] == 1
        store.db.execute("PRAGMA query_only = 0")
        # The broker still buffers it (nothing acked): the drain takes it now.
        assert await store.accept_batch(desk.agent_id, [(sender.public_key, env["id"], "request", data, 1)], NOW) == [True]
        rows = await store.claim_pending(desk.agent_id, 10, NOW)
        assert [r.msg_id for r in rows] == [env["id"]]
        assert await desk.receive(data, source="mailbox", inbox_id=rows[0].inbox_id, wait=True) == "held"
    finally:
        store.db.execute("PRAGMA query_only = 0")
        await store.close()


async def test_the_write_behind_backlog_is_bounded_during_a_long_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import meshnode.node.inbox as inbox_module

    monkeypatch.setattr(inbox_module, "_MAX_BEHIND", 10)
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    try:
        store.db.execute("PRAGMA query_only = 1")
        for i in range(25):
            store.remember("A", "s", f"live-{i}", NOW)
        health = store.health()
        assert health["write_behind_pending"] == 10 and health["write_behind_dropped"] == 15
    finally:
        store.db.execute("PRAGMA query_only = 0")
        await store.close()


@pytest.mark.parametrize("write_fails", [True, False])
async def test_a_pair_taken_back_after_its_commit_stays_taken_back(tmp_path: Path, write_fails: bool) -> None:
    """The live path commits a pair before dispatch, then finds it cannot hold
    the message (the hold fails) and forgets the pair. Whether the delete can be
    written at once or only once the disk recovers, the drain must take the
    buffered copy as new work: it is the only copy left. (Found by the full-disk
    integration test: one message in six was acked as a duplicate and lost.)"""
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    try:
        assert await store.commit_live("A", "s", "live-1", NOW) == "committed"
        if write_fails:
            store.db.execute("PRAGMA query_only = 1")
            with pytest.raises(InboxUnwritable):
                await store.probe()
        store.forget("A", "s", "live-1")  # the hold failed
        store.db.execute("PRAGMA query_only = 0")
        assert await store.accept_batch("A", [("s", "live-1", "request", b"{}", 1)], NOW) == [True]
        # And a pair that was handled live stays a duplicate.
        assert await store.commit_live("A", "s", "live-2", NOW, settled=True) == "committed"
        assert await store.accept_batch("A", [("s", "live-2", "request", b"{}", 2)], NOW) == [False]
    finally:
        store.db.execute("PRAGMA query_only = 0")
        await store.close()


async def test_a_live_request_is_committed_before_its_handler_runs_and_settled_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipeline's order (issue #23): the (from, id) pair is in the file when
    the handler's first statement runs; a drained copy meanwhile is left in the
    broker; once answered (and flushed), the copy is a plain duplicate."""
    conn = RecordingConnection()
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    node = Node(settings=NodeSettings(name="t"), node_key=KeyPair.generate(),
                connection=conn, clock=lambda: NOW, inbox=store)  # type: ignore[arg-type]
    probe = _host(node, "probe", Probe)
    sender = KeyPair.generate()
    env = sign_envelope(build_envelope("request", sender.public_key, now_ms=NOW, to=probe.agent_id,
                                       payload={"offering": "work", "input": "x"}), sender)
    data = encode_envelope(env)
    seen_at_start: list[object] = []
    copies: list[object] = []
    real_work = Probe.work

    async def work(self: Probe, ctx: Any, input: Any) -> Any:
        key = (probe.agent_id, sender.public_key, env["id"])
        seen_at_start.append(store.db.execute("SELECT done FROM seen WHERE agent=? AND sender=? AND msg_id=?",
                                              key).fetchone())
        item = (sender.public_key, env["id"], "request", data, 1)
        copies.append((await store.accept_batch(probe.agent_id, [item], NOW))[0])
        return await real_work(self, ctx, input)

    agent = probe.agent
    assert isinstance(agent, Probe)
    monkeypatch.setattr(agent, "work", work.__get__(agent))
    try:
        assert await probe.receive(data, source="live", reply="_INBOX.r") == "answered"
        await eventually_async(lambda: agent.ran == [env["id"]], what="the handler ran")
        assert seen_at_start == [(0,)], "the pair was not committed before the handler ran"
        assert copies == [None], "the drain took the copy of a request whose handler was running"
        assert conn.responds_to(env["id"]), "no answer"
        await eventually_async(lambda: store.health()["write_behind_pending"] == 0, what="the settle written")
        item = (sender.public_key, env["id"], "request", data, 1)
        assert await store.accept_batch(probe.agent_id, [item], NOW) == [False]
    finally:
        await store.close()


async def test_a_request_taken_back_is_never_settled_afterwards(tmp_path: Path) -> None:
    """The hold failed, the pair was taken back (forget), then the pipeline
    finishes the request as refused: settling it now would make the drain ack
    the only copy left as a duplicate."""
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    try:
        store.take("A", "s", "f1")
        store.forget("A", "s", "f1")
        store.settle("A", "s", "f1", NOW)
        await store.flush()
        assert await store.accept_batch("A", [("s", "f1", "request", b"{}", 1)], NOW) == [True]
    finally:
        await store.close()
