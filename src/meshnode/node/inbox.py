"""The node-held inbox (AgentMesh §16.4): a durable SQLite mailbox per node.

Every message taken from the broker's redelivery buffer is written here and
only then acked to JetStream, so at any instant either the broker or this
file holds it. Commits are grouped: a drained batch is one transaction (one
fsync in WAL mode with ``synchronous=FULL``), not one per message.

A message row moves through these states::

    pending ──claim──► dispatched ──► answered | refused
       │                   │
       │                   └─(process died while its handler ran)─► interrupted
       └─(interactive agent)─► held ──► replied | dismissed
    any ──(older than the retention)──► deleted by the sweep

``claim`` is committed before a handler runs, so a row is handed to a handler
at most once even across a crash; a row caught mid-handler by a crash is kept
as ``interrupted`` (visible, retryable by a person), never silently re-run.

The duplicate memory of §22.2 is persisted here too (table ``seen``): what the
live path handled is remembered across a restart, so a drain after a restart
acks the buffered copy instead of dispatching it again. Entries are written
behind (batched) and bounded by age (the mailbox window: nothing older is
accepted anyway) and by count per agent (first-seen eviction).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiosqlite

from meshnode.node.private_db import prepare_private_db, tighten_side_files

__all__ = ["HeldMessage", "InboxStore", "InboxRow", "InboxUnwritable", "STATES"]

log = logging.getLogger("meshnode.inbox")

STATES = (
    "pending",
    "dispatched",
    "answered",
    "refused",
    "interrupted",
    "held",
    "replied",
    "dismissed",
)
TERMINAL_STATES = ("answered", "refused", "replied", "dismissed")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    inbox_id     INTEGER PRIMARY KEY AUTOINCREMENT,
    agent        TEXT NOT NULL,
    sender       TEXT NOT NULL,
    msg_id       TEXT NOT NULL,
    kind         TEXT NOT NULL,
    envelope     BLOB NOT NULL,
    stream_seq   INTEGER,
    received_ms  INTEGER NOT NULL,
    state        TEXT NOT NULL,
    state_ms     INTEGER NOT NULL,
    note         TEXT,
    UNIQUE (agent, sender, msg_id)
);
CREATE INDEX IF NOT EXISTS messages_by_state ON messages (agent, state, inbox_id);
CREATE TABLE IF NOT EXISTS seen (
    agent    TEXT NOT NULL,
    sender   TEXT NOT NULL,
    msg_id   TEXT NOT NULL,
    seen_ms  INTEGER NOT NULL,
    PRIMARY KEY (agent, sender, msg_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS seen_by_age ON seen (agent, seen_ms);
CREATE TABLE IF NOT EXISTS probe (k TEXT PRIMARY KEY, v INTEGER NOT NULL);
"""


@dataclass(frozen=True)
class InboxRow:
    inbox_id: int
    agent: str
    sender: str
    msg_id: str
    kind: str
    envelope: bytes
    stream_seq: int | None
    received_ms: int
    state: str
    state_ms: int
    note: str | None


HeldMessage = InboxRow

#: Remembered pairs held for the write-behind at most (they pile up only while the
#: inbox cannot be written).
_MAX_BEHIND = 100_000

_COLUMNS = "inbox_id, agent, sender, msg_id, kind, envelope, stream_seq, received_ms, state, state_ms, note"


def _row(values: Sequence[Any]) -> InboxRow:
    return InboxRow(*values)


class InboxUnwritable(RuntimeError):
    """The inbox cannot commit (disk full, read-only, I/O error).

    Nothing that needed the commit happened: the caller must not ack the
    broker, so the message stays in the redelivery buffer (§16.4) until the
    inbox can take it. ``cause`` is SQLite's own message.
    """

    def __init__(self, path: Path, cause: str) -> None:
        super().__init__(f"the node inbox {path} cannot be written: {cause}")
        self.cause = cause


class InboxStore:
    """The node's inbox database. One per node; shared by all hosted agents."""

    def __init__(
        self,
        path: Path,
        *,
        seen_capacity: int = 50_000,
        seen_max_age_ms: int = 7 * 86_400_000,
        retention_ms: int = 14 * 86_400_000,
        flush_interval: float = 0.05,
        synchronous: str = "FULL",
    ) -> None:
        self.path = path
        self.seen_capacity = seen_capacity
        self.seen_max_age_ms = seen_max_age_ms
        self.retention_ms = retention_ms
        self.flush_interval = flush_interval
        self.synchronous = synchronous
        self._db: aiosqlite.Connection | None = None
        self._lock = asyncio.Lock()
        self._seen_pending: list[tuple[str, str, str, int]] = []
        # Pairs taken back by forget(). A flush may hold such a pair in flight
        # when forget() runs: re-queued after a failed write it must not come
        # back, and written by a write that succeeded it must not make the drain
        # take its buffered copy for a duplicate (that copy is the only one left).
        self._forgotten: dict[tuple[str, str, str], None] = {}
        self._state_pending: list[tuple[str, str | None, int, int]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._closing = False
        self.commits = 0
        #: Why writes fail now (SQLite's message), None while the inbox is writable.
        self.fault: str | None = None
        self.fault_since_ms: int | None = None
        self.failed_writes = 0
        self.dropped_behind = 0

    # -- lifecycle -------------------------------------------------------------

    async def open(self) -> None:
        prepare_private_db(self.path)  # born 0600, so are its -wal/-shm (item 8)
        self._db = await aiosqlite.connect(self.path, isolation_level=None)
        await self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is on disk before we ack the broker (the durability rule).
        await self._db.execute(f"PRAGMA synchronous={self.synchronous}")
        await self._db.execute("PRAGMA busy_timeout=5000")
        await self._db.executescript(_SCHEMA)
        tighten_side_files(self.path)
        self._flusher = asyncio.get_running_loop().create_task(self._flush_loop(), name="inbox-flush")

    async def close(self) -> None:
        if self._flusher is not None:
            # Let the write-behind finish the batch it may be writing: cancelling
            # it mid-transaction would roll back pairs it already took (a
            # restart would then answer a handled request again).
            self._closing = True
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._flusher), timeout=10.0)
            except TimeoutError:
                self._flusher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._flusher
            self._flusher = None
        if self._db is not None:
            try:
                await self.flush()
            except InboxUnwritable as exc:
                # Only the persisted duplicate memory loses these pairs: after a
                # restart their buffered copies may be dispatched a second time.
                log.error("stopping with %d remembered pairs unwritten: %s", len(self._seen_pending), exc.cause)
            # Under the lock: a write already waiting for it (a forced exit's
            # final_write, which took its pairs off the queue) commits before
            # the file is closed, instead of failing on a closed connection.
            async with self._lock:
                with contextlib.suppress(Exception):
                    await self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                await self._db.close()
                self._db = None

    @property
    def db(self) -> aiosqlite.Connection:
        if self._db is None:
            raise RuntimeError("inbox store is not open")
        return self._db

    @contextlib.asynccontextmanager
    async def _write(self) -> AsyncIterator[aiosqlite.Connection]:
        """One write transaction (one commit, one fsync), under the store's lock.

        A failure anywhere, the COMMIT included, leaves no transaction open
        (SQLite rolls some back by itself on SQLITE_FULL; the rest are rolled
        back here), so the store works again as soon as the disk does. A
        SQLite error is raised as :class:`InboxUnwritable` and recorded in
        :attr:`fault` (logged once when it starts and once when it ends).
        """
        async with self._lock:
            db = self.db
            changes = db.total_changes
            try:
                await db.execute("BEGIN IMMEDIATE")
                yield db
                await db.execute("COMMIT")
            except BaseException as exc:
                if db.in_transaction:
                    with contextlib.suppress(Exception):
                        await db.execute("ROLLBACK")
                # Full, read-only, I/O error, locked, corrupt: the file cannot take
                # the write. (A constraint or programming error is a bug: raised as is.)
                if isinstance(exc, sqlite3.OperationalError) or type(exc) is sqlite3.DatabaseError:
                    self._failed(exc)
                    raise InboxUnwritable(self.path, str(exc)) from exc
                raise
            self.commits += 1
            # Only a commit that wrote something proves the disk takes writes
            # again (a drain pass with nothing to claim commits nothing).
            if self.fault is not None and db.total_changes != changes:
                log.warning(
                    "the node inbox %s is writable again (%d writes failed since the fault began); "
                    "buffered mail is taken on the next drain pass", self.path, self.failed_writes,
                )
                self.fault = None
                self.fault_since_ms = None

    def _failed(self, exc: sqlite3.Error) -> None:
        self.failed_writes += 1
        if self.fault is None:
            self.fault_since_ms = time.time_ns() // 1_000_000
            log.error(
                "the node inbox %s cannot be written: %s. Nothing is acked to the broker while this "
                "lasts: messages stay in the redelivery buffer and are taken when space returns",
                self.path, exc,
            )
        self.fault = str(exc)

    async def probe(self) -> None:
        """One tiny real write: clears :attr:`fault` when it commits, raises
        :class:`InboxUnwritable` while the inbox still cannot be written."""
        async with self._write() as db:
            await db.execute("INSERT OR REPLACE INTO probe (k, v) VALUES ('probe', ?)", (time.time_ns(),))

    def health(self) -> dict[str, Any]:
        """For status: whether the inbox can commit, and since when it cannot."""
        return {
            "path": str(self.path),
            "writable": self.fault is None,
            "fault": self.fault,
            "fault_since_ms": self.fault_since_ms,
            "failed_writes": self.failed_writes,
            "commits": self.commits,
            "write_behind_pending": len(self._seen_pending) + len(self._state_pending),
            "write_behind_dropped": self.dropped_behind,
        }

    async def _transaction(self, statements: Iterable[tuple[str, Sequence[Any]]]) -> None:
        """One transaction, one commit (one fsync)."""
        async with self._write() as db:
            for sql, params in statements:
                await db.execute(sql, params)

    # -- the drain: durable intake -----------------------------------------------

    async def accept_batch(
        self, agent: str, items: Sequence[tuple[str, str, str, bytes, int | None]], now_ms: int
    ) -> list[bool]:
        """Durably record drained messages (sender, msg_id, kind, raw, stream_seq).

        Returns, per item, whether it is new work (False: already held here or
        already handled live — the caller acks it without dispatching). The
        commit has happened when this returns: only then may the caller ack.
        """
        if not items:
            return []
        # Pairs the live path handled moments ago may still wait in the write-behind.
        pending = {(s, m) for a, s, m, _ in self._seen_pending if a == agent}
        fresh: list[bool] = []
        taken_back: list[tuple[str, str, str]] = []
        async with self._write() as db:
            for sender, msg_id, kind, raw, seq in items:
                if (sender, msg_id) in pending:
                    fresh.append(False)
                    continue
                if (agent, sender, msg_id) in self._forgotten:
                    # Taken back by the live path (it could not hold the message);
                    # a write-behind already in flight may have written it anyway.
                    await db.execute(
                        "DELETE FROM seen WHERE agent=? AND sender=? AND msg_id=?", (agent, sender, msg_id)
                    )
                    taken_back.append((agent, sender, msg_id))
                async with db.execute(
                    "SELECT 1 FROM seen WHERE agent=? AND sender=? AND msg_id=?", (agent, sender, msg_id)
                ) as cur:
                    seen_live = await cur.fetchone() is not None
                if seen_live:
                    fresh.append(False)
                    continue
                cur2 = await db.execute(
                    "INSERT OR IGNORE INTO messages (agent, sender, msg_id, kind, envelope, stream_seq,"
                    " received_ms, state, state_ms) VALUES (?,?,?,?,?,?,?,'pending',?)",
                    (agent, sender, msg_id, kind, raw, seq, now_ms, now_ms),
                )
                fresh.append(cur2.rowcount == 1)
        for pair in taken_back:  # committed: the tombstones have done their work
            self._forgotten.pop(pair, None)
        return fresh

    async def claim_pending(self, agent: str, limit: int, now_ms: int) -> list[InboxRow]:
        """Mark up to ``limit`` pending rows dispatched (committed) and return them."""
        async with self._write() as db:
            async with db.execute(
                f"SELECT {_COLUMNS} FROM messages WHERE agent=? AND state='pending' ORDER BY inbox_id LIMIT ?",
                (agent, limit),
            ) as cur:
                rows = [_row(r) for r in await cur.fetchall()]
            if rows:
                await db.executemany(
                    "UPDATE messages SET state='dispatched', state_ms=? WHERE inbox_id=?",
                    [(now_ms, r.inbox_id) for r in rows],
                )
                # The claimed pairs join the persisted duplicate memory now.
                await db.executemany(
                    "INSERT OR IGNORE INTO seen (agent, sender, msg_id, seen_ms) VALUES (?,?,?,?)",
                    [(agent, r.sender, r.msg_id, now_ms) for r in rows],
                )
        return rows

    async def recover_interrupted(self, now_ms: int) -> int:
        """At start-up: rows claimed by a process that died are ``interrupted``."""
        await self._transaction(
            [("UPDATE messages SET state='interrupted', state_ms=?, note='the node stopped while its handler ran'"
              " WHERE state='dispatched'", (now_ms,))]
        )
        async with self.db.execute("SELECT changes()") as cur:
            row = await cur.fetchone()
        return int(row[0]) if row else 0

    # -- interactive: held messages --------------------------------------------------

    async def hold(self, agent: str, sender: str, msg_id: str, kind: str, raw: bytes, now_ms: int) -> int:
        """Keep a message for a person's live session; returns its inbox id."""
        async with self._write() as db:
            await db.execute(
                "INSERT OR IGNORE INTO messages (agent, sender, msg_id, kind, envelope, received_ms,"
                " state, state_ms) VALUES (?,?,?,?,?,?,'held',?)",
                (agent, sender, msg_id, kind, raw, now_ms, now_ms),
            )
            async with db.execute(
                "SELECT inbox_id FROM messages WHERE agent=? AND sender=? AND msg_id=?", (agent, sender, msg_id)
            ) as cur:
                row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    async def get(self, inbox_id: int) -> InboxRow | None:
        async with self.db.execute(f"SELECT {_COLUMNS} FROM messages WHERE inbox_id=?", (inbox_id,)) as cur:
            row = await cur.fetchone()
        return _row(row) if row else None

    async def rows(
        self, *, agent: str | None = None, states: Sequence[str] | None = None, limit: int = 100
    ) -> list[InboxRow]:
        sql = f"SELECT {_COLUMNS} FROM messages"
        where: list[str] = []
        params: list[Any] = []
        if agent is not None:
            where.append("agent=?")
            params.append(agent)
        if states:
            where.append(f"state IN ({','.join('?' * len(states))})")
            params.extend(states)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY inbox_id DESC LIMIT ?"
        params.append(limit)
        async with self.db.execute(sql, params) as cur:
            return [_row(r) for r in await cur.fetchall()]

    async def counts(self) -> dict[str, int]:
        async with self.db.execute("SELECT state, count(*) FROM messages GROUP BY state") as cur:
            return {str(state): int(n) for state, n in await cur.fetchall()}

    async def set_state(self, inbox_id: int, state: str, now_ms: int, note: str | None = None, *, durable: bool = True) -> None:
        """Record an outcome. Outcomes after dispatch are informational, so by
        default they are durable but a caller on a hot path may write behind."""
        if state not in STATES:
            raise ValueError(f"unknown inbox state {state!r}")
        if durable:
            await self._transaction(
                [("UPDATE messages SET state=?, state_ms=?, note=COALESCE(?, note) WHERE inbox_id=?",
                  (state, now_ms, note, inbox_id))]
            )
        else:
            self._state_pending.append((state, note, now_ms, inbox_id))
            self._wake.set()

    # -- the persisted duplicate memory -------------------------------------------------

    def remember(self, agent: str, sender: str, msg_id: str, now_ms: int) -> None:
        """Write-behind: remember a pair handled on the live path."""
        self._forgotten.pop((agent, sender, msg_id), None)
        self._seen_pending.append((agent, sender, msg_id, now_ms))
        if len(self._seen_pending) > _MAX_BEHIND:
            # Only while writes fail for long: bound the backlog, oldest out. The
            # in-memory §22.2 memory still refuses their buffered copies in this
            # process; only a restart before recovery could dispatch one twice.
            excess = len(self._seen_pending) - _MAX_BEHIND
            del self._seen_pending[:excess]
            self.dropped_behind += excess
        if len(self._seen_pending) >= 256:
            self._wake.set()

    def forget(self, agent: str, sender: str, msg_id: str) -> None:
        """Take back a pair :meth:`remember` was given and that is not yet written:
        the live path could not handle the message after all (the inbox could
        not hold it), so the buffered copy must still be taken by a drain."""
        self._seen_pending = [p for p in self._seen_pending if p[:3] != (agent, sender, msg_id)]
        self._forgotten[(agent, sender, msg_id)] = None
        if len(self._forgotten) > _MAX_BEHIND:
            self._forgotten.pop(next(iter(self._forgotten)))

    async def load_seen(self, agent: str, limit: int) -> list[tuple[str, str]]:
        """The newest ``limit`` remembered pairs of ``agent``, oldest first."""
        async with self.db.execute(
            "SELECT sender, msg_id FROM (SELECT sender, msg_id, seen_ms FROM seen WHERE agent=?"
            " ORDER BY seen_ms DESC LIMIT ?) ORDER BY seen_ms ASC",
            (agent, limit),
        ) as cur:
            return [(str(s), str(m)) for s, m in await cur.fetchall()]

    async def final_write(self) -> None:
        """The write a forced exit still does: every pair and outcome written
        behind, in one transaction, whether or not :meth:`close` is under way.

        The write waits for the store's lock, so a write-behind batch already in
        flight commits first; then everything still behind is written. A store
        already closed has nothing left to write.
        """
        if self._db is None:
            return
        # The write-behind may be mid-transaction with pairs it already took off
        # the queue: the lock is free only once it committed (or failed and put
        # them back, for the flush below to write).
        async with self._lock:
            pass
        await self.flush()

    async def flush(self) -> None:
        """Write the behind-writes now (one transaction)."""
        seen, self._seen_pending = self._seen_pending, []
        states, self._state_pending = self._state_pending, []
        if not seen and not states:
            return
        try:
            await self._write_behind(seen, states)
        except BaseException:
            # Nothing taken is dropped: the next flush (or close) writes it —
            # except a pair forget() took back while this write was in flight.
            self._seen_pending[:0] = [p for p in seen if p[:3] not in self._forgotten]
            self._state_pending[:0] = states
            raise

    async def _write_behind(
        self, seen: list[tuple[str, str, str, int]], states: list[tuple[str, str | None, int, int]]
    ) -> None:
        statements: list[tuple[str, Sequence[Any]]] = []
        for item in seen:
            statements.append(("INSERT OR IGNORE INTO seen (agent, sender, msg_id, seen_ms) VALUES (?,?,?,?)", item))
        for state, note, ms, inbox_id in states:
            statements.append(
                ("UPDATE messages SET state=?, state_ms=?, note=COALESCE(?, note) WHERE inbox_id=?",
                 (state, ms, note, inbox_id))
            )
        await self._transaction(statements)

    async def _flush_loop(self) -> None:
        while not self._closing:
            if self.fault is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=self.flush_interval)
            else:
                # The inbox cannot be written: retry once a second, not on every
                # wake-up (each live message would be one more failing write).
                await asyncio.sleep(1.0)
            self._wake.clear()
            try:
                await self.flush()
            except InboxUnwritable:
                pass  # recorded in self.fault; the next flush carries the backlog
            except Exception as exc:  # keep trying; the next flush carries the backlog
                log.warning("inbox write-behind failed: %s", exc)

    # -- retention -------------------------------------------------------------------

    async def sweep(self, now_ms: int) -> dict[str, int]:
        """Bound the file: finished rows past retention, and the memory by age and count."""
        horizon = now_ms - self.retention_ms
        seen_horizon = now_ms - self.seen_max_age_ms
        placeholders = ",".join("?" * len(TERMINAL_STATES))
        await self._transaction(
            [
                (f"DELETE FROM messages WHERE state IN ({placeholders}) AND state_ms < ?", (*TERMINAL_STATES, horizon)),
                ("DELETE FROM seen WHERE seen_ms < ?", (seen_horizon,)),
            ]
        )
        trimmed = 0
        async with self.db.execute(
            "SELECT agent, count(*) FROM seen GROUP BY agent HAVING count(*) > ?", (self.seen_capacity,)
        ) as cur:
            over = await cur.fetchall()
        for agent, count in over:
            excess = int(count) - self.seen_capacity
            # First-seen eviction: the oldest remembered pairs go first.
            await self._transaction(
                [("DELETE FROM seen WHERE (agent, sender, msg_id) IN (SELECT agent, sender, msg_id FROM seen"
                  " WHERE agent=? ORDER BY seen_ms LIMIT ?)", (agent, excess))]
            )
            trimmed += excess
        return {"trimmed_seen": trimmed}

