"""The daemon's SQLite stores and their side files are private from birth (issue #23 item 8).

SQLite creates ``-wal``/``-shm`` with the database file's mode, so a database
born with the umask's 0644 and tightened afterwards left 0644 side files beside
it. Each store the daemon keeps is opened here under a loose umask and every
file of it must be 0600 (and its directory 0700).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from meshnode.a2a.charges import ChargeStore
from meshnode.a2a.store import BridgeStore
from meshnode.node.inbox import InboxStore
from meshnode.node.private_db import SIDE_SUFFIXES, prepare_private_db

A = "U" + "A" * 55


@pytest.fixture
def loose_umask() -> Iterator[None]:
    old = os.umask(0o022)  # the common default: files 0644, directories 0755
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _files(db: Path) -> list[Path]:
    return [p for p in (db, *(db.with_name(db.name + s) for s in SIDE_SUFFIXES)) if p.exists()]


async def _inbox(path: Path) -> Callable[[], Awaitable[None]]:
    store = InboxStore(path)
    await store.open()
    assert await store.accept_batch(A, [("s", "id", "request", b"{}", 1)], 1) == [True]
    store.remember(A, "s", "live", 2)
    await store.flush()
    return store.close


async def _bridge(path: Path) -> Callable[[], Awaitable[None]]:
    store = BridgeStore(path)
    await store.open()
    return store.close


async def _charges(path: Path) -> Callable[[], Awaitable[None]]:
    store = ChargeStore(path)
    await store.open()
    await store.recent()  # a read in WAL mode opens the -wal/-shm pair
    return store.close


@pytest.mark.usefixtures("loose_umask")
@pytest.mark.parametrize("opener", [_inbox, _bridge, _charges], ids=["inbox", "a2a", "a2a-charges"])
async def test_store_and_its_side_files_are_0600(
    tmp_path: Path, opener: Callable[[Path], Awaitable[Callable[[], Awaitable[None]]]]
) -> None:
    db = tmp_path / "data" / "store.sqlite3"
    close = await opener(db)
    try:
        files = _files(db)
        names = {p.name for p in files}
        assert db.name + "-wal" in names and db.name + "-shm" in names  # WAL mode, open
        assert {p.name: _mode(p) for p in files} == {p.name: 0o600 for p in files}
        assert _mode(db.parent) == 0o700
    finally:
        await close()
    assert {p.name: _mode(p) for p in _files(db)} == {p.name: 0o600 for p in _files(db)}


@pytest.mark.usefixtures("loose_umask")
async def test_loose_files_left_by_an_older_version_are_tightened(tmp_path: Path) -> None:
    db = tmp_path / "inbox.sqlite3"
    close = await _inbox(db)
    await close()
    for path in [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]:
        path.touch()
        path.chmod(0o644)
    prepare_private_db(db)
    assert {p.name: _mode(p) for p in _files(db)} == {p.name: 0o600 for p in _files(db)}
    store = InboxStore(db)  # and the tightened database still opens, its rows intact
    await store.open()
    try:
        held = await store.accept_batch(A, [("s", "id", "request", b"{}", 1)], 1)
        assert held == [False]  # the row written before is still there
    finally:
        await store.close()
