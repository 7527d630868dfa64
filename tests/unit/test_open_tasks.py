"""The journal of open Tasks (meshnode.node.open_tasks) on a real inbox file:
what a process leaves in it is what the next one reads, and a write that fails
never fails the Task."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshnode.node.inbox import InboxStore
from meshnode.node.open_tasks import OpenTask, OpenTaskJournal

NOW = 1_782_900_000_000
REQUEST = {"id": "r1", "from": "UREQUESTER", "type": "request", "payload": {"offering": "slow"}}


async def test_what_one_process_leaves_open_the_next_one_reads(tmp_path: Path) -> None:
    path = tmp_path / "inbox.sqlite3"
    store = InboxStore(path)
    await store.open()
    journal = OpenTaskJournal(store)
    journal.moved("A", "t1", "working", REQUEST, NOW)
    journal.moved("A", "t2", "submitted", {**REQUEST, "id": "r2"}, NOW + 1)
    journal.moved("A", "t2", "input_required", {**REQUEST, "id": "r2"}, NOW + 2)  # a transition: state only
    journal.moved("A", "t3", "working", {**REQUEST, "id": "r3"}, NOW + 3)
    journal.moved("A", "t3", "completed", {**REQUEST, "id": "r3"}, NOW + 4)  # terminal: not recorded ...
    journal.ended("A", "t3")  # ... and ended once published
    await store.close()

    again = InboxStore(path)
    await again.open()
    try:
        assert OpenTaskJournal(again).left_open() == [
            OpenTask("A", "t1", "working", REQUEST),
            OpenTask("A", "t2", "input_required", {**REQUEST, "id": "r2"}),
        ]
    finally:
        await again.close()


async def test_an_unreadable_row_is_forgotten_and_a_failing_write_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    try:
        journal = OpenTaskJournal(store)
        with store.transaction() as db:
            db.execute("INSERT INTO open_tasks VALUES ('A', 'bad', 'working', x'7b7b', 1)")
        assert journal.left_open() == []
        assert store.db.execute("SELECT count(*) FROM open_tasks").fetchone() == (0,)
        store.db.execute("PRAGMA query_only = 1")  # every write fails, as on a read-only file
        journal.moved("A", "t1", "working", REQUEST, NOW)
        journal.moved("A", "t2", "working", REQUEST, NOW)
        warnings = [r for r in caplog.records if "open-task journal cannot be written" in r.getMessage()]
        assert len(warnings) == 1, "said once while it lasts, not per write"
        store.db.execute("PRAGMA query_only = 0")
        journal.moved("A", "t3", "working", REQUEST, NOW)
        assert [t.task_id for t in journal.left_open()] == ["t3"]
    finally:
        await store.close()


async def test_a_journal_write_after_the_file_closed_does_not_raise(tmp_path: Path) -> None:
    """A Task's update after the inbox closed (late in a stop) must still go out: the
    journal only skips its write."""
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    journal = OpenTaskJournal(store)
    await store.close()
    journal.moved("A", "t1", "working", REQUEST, NOW)
    journal.ended("A", "t1")
