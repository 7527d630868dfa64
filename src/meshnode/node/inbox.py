"""The node-held inbox (AgentMesh §16.4): a durable SQLite mailbox per node.

Every message taken from the broker's redelivery buffer is written here and
only then acked to JetStream, so at any instant either the broker or this
file holds it.

A message row moves through these states::

    pending ──claim──► claimed ──start──► dispatched ──► answered | refused
       │   ▲              │                    │
       │   └─(process died before its handler started: run once after the restart)
       │                  └──────────► answered | refused (nothing ever started)
       │                                       └─(process died while its handler ran)─► interrupted
       └─(interactive agent)─► held ──► replied | dismissed
    any ──(older than the retention)──► deleted by the sweep

``claim`` (:meth:`InboxStore.start_row`) is committed before the row enters
the pipeline, so a row is handed to the pipeline at most once per process;
``start`` (:meth:`InboxStore.mark_started`) is committed inline right before
the irreversible step — its handler starting, or an answer without a handler
going out — so across a crash a row is run at most once: a row still merely
``claimed`` (caught in the pipeline's awaits, e.g. the sender's vouch check)
goes back to ``pending`` and runs once after the restart, and a row caught
mid-handler is kept as ``interrupted`` (visible, retryable by a person), never
silently re-run.

The duplicate memory of §22.2 is persisted here too (table ``seen``), and the
live path commits a request's pair right before the irreversible step — its
handler starting, or an answer without a handler going out
(:meth:`InboxStore.commit_live_now`) — so a drain of the buffered copy, in
this process or after a kill -9, never runs it again (issue #23). Until then
the request is only *taken* (:meth:`InboxStore.take`): the drain leaves its
copy in the broker, and a crash before the handler starts lets the restarted
node run the copy, once. A committed pair has ``done=0`` until the answer has
reached the broker (:meth:`InboxStore.settle`, after the node's flush round
trip, :attr:`InboxStore.settle_barrier`, which the write-behind flush passes
once for every answer since its last tick); a pair still at 0 when a new process
opens the file was caught mid-handler, and the drain keeps its buffered copy
as an ``interrupted`` row (never run again, never silently dropped).

How it is written (why inline ``sqlite3`` and not a thread per statement):
every statement runs on the event loop's thread — a WAL commit with
``synchronous=NORMAL`` is a ``write()`` into the OS cache, tens of µs, and
survives a process crash. Commits are adaptive group commits: a commit
happens at once (no timer, no gathering window), and whatever is queued at
that moment — settle marks, other pairs — rides in
it. What no irreversible step waits on — the settle marks of answered
requests (after their barrier) and the pairs of live responds — is not
committed on its own: it rides the next commit, or the write-behind flush at
most ``flush_interval`` later (issue #21: one commit per round trip less on
each side at concurrency 1).
What must survive a *power loss* is made so by a sync barrier (one ``fsync``
of the WAL, in a worker thread so the loop does not wait on the disk) before
the drain acks the broker and before it dispatches claimed rows. What a power
loss can still cost is written in docs/operations/exactly-once.md.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshnode.aio import wait_for
from meshnode.node.private_db import prepare_private_db, tighten_side_files

__all__ = ["HeldMessage", "InboxStore", "InboxRow", "InboxUnwritable", "STATES"]

log = logging.getLogger("meshnode.inbox")

STATES = (
    "pending",
    "claimed",
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
    done     INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (agent, sender, msg_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS seen_by_age ON seen (agent, seen_ms);
CREATE TABLE IF NOT EXISTS probe (k TEXT PRIMARY KEY, v INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS open_tasks (
    agent      TEXT NOT NULL,
    task_id    TEXT NOT NULL,
    state      TEXT NOT NULL,
    request    BLOB NOT NULL,
    opened_ms  INTEGER NOT NULL,
    PRIMARY KEY (agent, task_id)
) WITHOUT ROWID;
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
#: A write-behind backlog this long wakes the flusher before its interval ends.
_WAKE_BEHIND = 256
#: With nothing queued the flusher wakes this often only (for WAL maintenance),
#: not every ``flush_interval``: an idle daemon should not wake 20 times a second.
_IDLE_TICK_S = 1.0
#: After a failed settle barrier (disconnected), the next try waits this long.
_BARRIER_RETRY_S = 0.5

#: The remembered pairs are bounded as they are written, not once an hour: an
#: agent's pairs may run a tenth of ``seen_capacity`` past it before the trimmer
#: counts them (a count reads each of the agent's pairs, ~5 ms at 50,000). One
#: statement deletes at most ``_TRIM_CHUNK`` pairs (~3 ms), and a flush tick
#: spends at most ``_TRIM_BUDGET_S`` trimming, so catching up never holds the
#: loop for long. (The hourly sweep used to delete everything past the bound in
#: one transaction: 17 s on the loop for an agent at 1,000,000 pairs, which a
#: busy agent wrote in minutes, and a file that grew by that much in between.)
_TRIM_SLACK_DIVISOR = 10
_TRIM_CHUNK = 250
_TRIM_BUDGET_S = 0.005

#: Past this size the WAL is caught up inline after a worker checkpoint (see
#: ``InboxStore._maintain``), so a node under sustained load keeps it bounded.
WAL_CATCH_UP_BYTES = 16 * 1024 * 1024

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
    """The node's inbox database. One per node; shared by all hosted agents.

    Every method runs its SQLite statements inline on the caller's (the event
    loop's) thread; the only waits are the sync barrier's ``fsync`` and the
    checkpoint, both in a worker thread on their own file handles.
    """

    def __init__(
        self,
        path: Path,
        *,
        seen_capacity: int = 50_000,
        seen_max_age_ms: int = 7 * 86_400_000,
        retention_ms: int = 14 * 86_400_000,
        flush_interval: float = 0.05,
        synchronous: str = "NORMAL",
        checkpoint_every: int = 500,
    ) -> None:
        self.path = path
        self.seen_capacity = seen_capacity
        self.seen_max_age_ms = seen_max_age_ms
        self.retention_ms = retention_ms
        self.flush_interval = flush_interval
        self.synchronous = synchronous
        self.checkpoint_every = checkpoint_every
        self._db: sqlite3.Connection | None = None
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None
        self._reader_db: sqlite3.Connection | None = None
        # Set when close() retires the reader: a read racing the stop must not
        # start a new thread and connection that nothing would close.
        self._reader_retired = False
        # Live pairs waiting for the next group commit (agent, sender, msg_id,
        # seen_ms, done) with the future their dispatch waits on.
        self._live: list[tuple[tuple[str, str, str, int, int], asyncio.Future[str] | None]] = []
        self._settle: list[tuple[str, str, str, int]] = []
        self._commit_scheduled = False
        #: Awaited before settle marks are written (the node sets it: its answers
        #: have reached the broker). None: marks are written at once.
        self.settle_barrier: Callable[[], Awaitable[None]] | None = None
        # Settle marks waiting for the barrier (passed by the flush loop's next
        # tick, one round trip for all of them).
        self._unsent: list[tuple[str, str, str, int]] = []
        self._passing: list[tuple[str, str, str, int]] = []  # marks waiting on the barrier now
        # The same for drained rows' outcomes (state, note, ms, inbox id): a row
        # is not written answered before its answer reached the broker.
        self._unsent_states: list[tuple[str, str | None, int, int]] = []
        self._passing_states: list[tuple[str, str | None, int, int]] = []
        self._barrier_not_before = 0.0  # loop time: after a failed barrier, the next try waits
        # Live requests taken by the pipeline whose handler has not started yet
        # (nothing committed for them): the drain leaves their buffered copies
        # in the broker, neither acked nor dispatched, until the pair settles.
        self._taken: dict[tuple[str, str, str], None] = {}
        # Drained rows claimed by start_row whose handler has not started yet
        # (key: agent, sender, msg_id; value: the inbox id), see mark_started.
        self._claimed: dict[tuple[str, str, str], int] = {}
        # Pairs remembered behind (refusals; live pairs while the inbox cannot be written).
        self._seen_pending: list[tuple[str, str, str, int]] = []
        # Pairs taken back by forget(): a pair already committed must not make the
        # drain take its buffered copy for a duplicate (that copy is the only one left).
        self._forgotten: dict[tuple[str, str, str], None] = {}
        self._state_pending: list[tuple[str, str | None, int, int]] = []
        # The trimmer (see _TRIM_CHUNK): pairs written per agent since its last
        # count, the agents to count and trim (in order), how far past capacity
        # a counted agent still is, and the sweep's age bound per agent.
        self._seen_added: dict[str, int] = {}
        self._trim_slack = max(1, seen_capacity // _TRIM_SLACK_DIVISOR)
        self._trim_queue: dict[str, None] = {}
        self._seen_excess: dict[str, int] = {}
        self._trim_horizon: dict[str, int] = {}
        self._written_since_trim = 0
        self.trimmed_seen = 0
        self.expired_seen = 0
        self._flusher: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._idle = False  # the flusher sleeps until something is queued
        self._urgent = False  # something queued asks to be written without the window
        self._closing = False
        # The sync barrier: commits that changed the file, and how many of them
        # an fsync of the WAL has covered.
        self._commit_gen = 0
        self._synced_gen = 0
        self._syncing: asyncio.Future[None] | None = None
        self._syncer: asyncio.Task[None] | None = None
        self._checkpointed_at = 0
        self.catch_ups = 0
        self.commits = 0
        self.syncs = 0
        self.group_commits = 0
        self.live_committed = 0
        self.kept_interrupted = 0
        self.deferred = 0
        #: Why writes fail now (SQLite's message), None while the inbox is writable.
        self.fault: str | None = None
        self.fault_since_ms: int | None = None
        self.failed_writes = 0
        self.dropped_behind = 0
        self.degraded_live = 0

    # -- lifecycle -------------------------------------------------------------

    async def open(self) -> None:
        prepare_private_db(self.path)  # born 0600, so are its -wal/-shm (item 8)
        db = sqlite3.connect(self.path, isolation_level=None)
        self._db = db
        self._reader_retired = False
        db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a commit is in the OS's hands when it returns, so
        # it survives a kill -9; power-loss durability comes from the sync
        # barrier (_sync) where the §16.4 rule needs it, before any broker ack.
        db.execute(f"PRAGMA synchronous={self.synchronous}")
        db.execute("PRAGMA busy_timeout=5000")
        # Checkpoints (which fsync) run in a worker thread, not inside a commit
        # on the event loop (see _maintain).
        db.execute("PRAGMA wal_autocheckpoint=0")
        db.execute("PRAGMA journal_size_limit=67108864")
        db.executescript(_SCHEMA)
        columns = {str(r[1]) for r in db.execute("PRAGMA table_info(seen)")}
        if "done" not in columns:  # a file of an older version: its pairs were all handled
            db.execute("ALTER TABLE seen ADD COLUMN done INTEGER NOT NULL DEFAULT 1")
        # Pairs a previous process committed before dispatch and never settled:
        # it died (or was stopped) while their handlers ran. Their buffered
        # copies are kept as interrupted rows by the drain, never run again.
        db.execute("UPDATE seen SET done=2 WHERE done=0")
        tighten_side_files(self.path)
        self._flusher = asyncio.get_running_loop().create_task(self._flush_loop(), name="inbox-flush")

    async def close(self) -> None:
        if self._flusher is not None:
            self._closing = True
            self._wake.set()
            try:
                await wait_for(asyncio.shield(self._flusher), timeout=10.0)
            except TimeoutError:
                self._flusher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._flusher
            self._flusher = None
        if self._syncer is not None:
            with contextlib.suppress(Exception):
                await self._syncer
            self._syncer = None
        marks = self._passing + self._unsent
        states = self._passing_states + self._unsent_states
        self._unsent, self._passing = [], []
        self._unsent_states, self._passing_states = [], []
        if (marks or states) and self._db is not None:
            # The connection is still up at this stage of a stop: one last
            # barrier, so only answers that reached the broker are settled.
            barrier = self.settle_barrier
            try:
                if barrier is not None:
                    await wait_for(barrier(), timeout=2.0)
                self._settle.extend(marks)
                self._state_pending.extend(states)
            except Exception as exc:
                log.warning("stopping with %d answers not confirmed at the broker (%s): after a restart their "
                            "requests are kept as interrupted, not run again", len(marks) + len(states), exc)
        await self._close_reader()
        if self._db is not None:
            try:
                await self.flush()
            except InboxUnwritable as exc:
                # Only the persisted duplicate memory loses these pairs: after a
                # restart their buffered copies may be dispatched a second time.
                log.error("stopping with %d remembered pairs unwritten: %s", len(self._seen_pending), exc.cause)
            self._resolve_live(self._take_live(), "degraded")
            with contextlib.suppress(Exception):
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.close()
            self._db = None

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("inbox store is not open")
        return self._db

    def transaction(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """One inline write transaction on this file, for the other tables it
        holds (:mod:`meshnode.node.open_tasks`); failures as :meth:`_write`'s."""
        return self._write()

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (one commit), inline.

        A failure anywhere, the COMMIT included, leaves no transaction open
        (SQLite rolls some back by itself on SQLITE_FULL; the rest are rolled
        back here), so the store works again as soon as the disk does. A
        SQLite error is raised as :class:`InboxUnwritable` and recorded in
        :attr:`fault` (logged once when it starts and once when it ends).
        """
        db = self.db
        changes = db.total_changes
        try:
            db.execute("BEGIN IMMEDIATE")
            yield db
            db.execute("COMMIT")
        except BaseException as exc:
            if db.in_transaction:
                with contextlib.suppress(Exception):
                    db.execute("ROLLBACK")
            # Full, read-only, I/O error, locked, corrupt: the file cannot take
            # the write. (A constraint or programming error is a bug: raised as is.)
            if isinstance(exc, sqlite3.OperationalError) or type(exc) is sqlite3.DatabaseError:
                self._failed(exc)
                raise InboxUnwritable(self.path, str(exc)) from exc
            raise
        self.commits += 1
        # Only a commit that wrote something proves the disk takes writes
        # again (a drain pass with nothing to claim commits nothing).
        if db.total_changes != changes:
            self._commit_gen += 1
            if self.fault is not None:
                log.warning(
                    "the node inbox %s is writable again (%d writes failed since the fault began); "
                    "buffered mail is taken on the next drain pass", self.path, self.failed_writes,
                )
                self.fault = None
                self.fault_since_ms = None

    def _failed(self, exc: BaseException) -> None:
        self.failed_writes += 1
        if self.fault is None:
            self.fault_since_ms = time.time_ns() // 1_000_000
            log.error(
                "the node inbox %s cannot be written: %s. Nothing is acked to the broker while this "
                "lasts: messages stay in the redelivery buffer and are taken when space returns",
                self.path, exc,
            )
        self.fault = str(exc)

    async def _sync(self) -> None:
        """The sync barrier: every commit made so far is on disk when this
        returns (one ``fsync`` of the WAL in a worker thread; nothing when no
        commit changed the file since the last one). The drain calls it before
        it acks the broker and before it dispatches claimed rows."""
        gen = self._commit_gen
        while gen > self._synced_gen:
            if self._syncing is not None:
                # One fsync at a time, shared: callers arriving meanwhile wait
                # for it and need another only if they committed after it began.
                await asyncio.shield(self._syncing)
                continue
            self._syncing = asyncio.get_running_loop().create_future()
            target = self._commit_gen
            wal = self._wal_path
            try:
                await asyncio.to_thread(_fsync_file, wal)
            except OSError as exc:
                self._failed(exc)
                raise InboxUnwritable(self.path, f"fsync of {wal.name} failed: {exc}") from exc
            finally:
                syncing, self._syncing = self._syncing, None
                syncing.set_result(None)
            self.syncs += 1
            self._synced_gen = max(self._synced_gen, target)

    async def probe(self) -> None:
        """One tiny real write: clears :attr:`fault` when it commits, raises
        :class:`InboxUnwritable` while the inbox still cannot be written."""
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO probe (k, v) VALUES ('probe', ?)", (time.time_ns(),))

    def health(self) -> dict[str, Any]:
        """For status: whether the inbox can commit, and since when it cannot."""
        return {
            "path": str(self.path),
            "writable": self.fault is None,
            "fault": self.fault,
            "fault_since_ms": self.fault_since_ms,
            "failed_writes": self.failed_writes,
            "commits": self.commits,
            "group_commits": self.group_commits,
            "live_committed": self.live_committed,
            "live_degraded": self.degraded_live,
            "kept_interrupted": self.kept_interrupted,
            "drain_deferred": self.deferred,
            "syncs": self.syncs,
            "wal_bytes": self._wal_bytes(),
            "wal_catch_ups": self.catch_ups,
            "write_behind_pending": len(self._seen_pending) + len(self._state_pending)
            + len(self._live) + len(self._settle) + len(self._unsent) + len(self._passing)
            + len(self._unsent_states) + len(self._passing_states),
            "write_behind_dropped": self.dropped_behind,
            "seen_trimmed": self.trimmed_seen,
            "seen_expired": self.expired_seen,
            "seen_trim_queued": len(self._trim_queue),
        }

    def _transaction(self, statements: Iterable[tuple[str, Sequence[Any]]]) -> int:
        """One transaction, one commit; returns the rows changed."""
        with self._write() as db:
            before = db.total_changes
            for sql, params in statements:
                db.execute(sql, params)
            return db.total_changes - before

    # -- the live path: commit before dispatch ------------------------------------------

    def take(self, agent: str, sender: str, msg_id: str) -> None:
        """The live pipeline took a request: until its pair is committed (its
        handler starts, or an answer goes out) or released, a drain leaves the
        buffered copy where it is."""
        self._taken[(agent, sender, msg_id)] = None

    def taken(self, agent: str, sender: str, msg_id: str) -> bool:
        """Whether a live request is taken and nothing is committed for it yet."""
        return (agent, sender, msg_id) in self._taken

    def release(self, agent: str, sender: str, msg_id: str) -> None:
        """A taken request will not run here after all (its handler was
        cancelled before it started): nothing is written, so a drain after a
        restart runs its buffered copy."""
        self._taken.pop((agent, sender, msg_id), None)

    async def commit_live(self, agent: str, sender: str, msg_id: str, now_ms: int, *, settled: bool = False) -> str:
        """Commit the pair of a live message before the irreversible step: its
        handler starting, or its answer going out.

        Returns ``committed`` (the pair is in the file: a drain of the buffered
        copy, in this process or after a crash, never runs it again) or
        ``degraded`` (the inbox cannot be written now: the pair is written
        behind, and only a crash before the disk recovers could run the
        buffered copy again).

        ``settled`` commits the pair as finished at once (a respond, an answer
        without a handler); otherwise :meth:`settle` marks it finished, and a
        pair a new process finds unfinished was caught mid-handler.

        Group commit, adaptive: the first pair schedules a commit for the next
        turn of the event loop and every pair queued until then rides in it. An
        idle node commits at once; no timer adds latency.
        """
        if self._db is None:
            self._taken.pop((agent, sender, msg_id), None)
            return "degraded"
        if self.fault is not None:
            self._taken.pop((agent, sender, msg_id), None)
            self.remember(agent, sender, msg_id, now_ms)
            self.degraded_live += 1
            return "degraded"
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._live.append(((agent, sender, msg_id, now_ms, 1 if settled else 0), future))
        self._schedule_commit()
        return await future

    def commit_live_now(self, agent: str, sender: str, msg_id: str, now_ms: int, *, settled: bool = False) -> str:
        """:meth:`commit_live` at once, inline, with everything queued riding
        along (settle marks, other pairs): for the step right before a handler
        runs, so nothing — not even another task's turn — lies between the
        commit and the handler's first statement. (An awaited group commit
        marked a whole burst "started" while the handlers then ran one by one:
        a crash in between kept requests that never ran as interrupted.)"""
        key = (agent, sender, msg_id)
        if self._db is None:
            self._taken.pop(key, None)
            return "degraded"
        if self.fault is not None:
            self._taken.pop(key, None)
            self.remember(agent, sender, msg_id, now_ms)
            self.degraded_live += 1
            return "degraded"
        self._live.append(((agent, sender, msg_id, now_ms, 1 if settled else 0), None))
        return "committed" if self._group_commit() else "degraded"

    def commit_live_soon(self, agent: str, sender: str, msg_id: str, now_ms: int) -> None:
        """Queue a live *respond*'s pair, finished, for the next commit, without
        waiting for it: a request's inline commit, a drain's batch or the
        write-behind flush (at most ``flush_interval``, 50 ms, later), whichever
        comes first.

        Why not :meth:`commit_live_now`: a respond runs no handler, so nothing
        irreversible hangs on its pair; committing each one inline cost the
        requester one transaction per accept and one per answer (issue #21:
        ~17% of a requester's CPU at concurrency 64, and a WAL write each).
        Within this process nothing changes: the §22.2 memory already holds the
        pair, and :meth:`accept_batch` writes queued pairs before it judges a
        drained copy. Only a kill -9 before the next commit can leave the pair
        unwritten; the buffered copy is then drained as a late answer and held
        in the inbox (it reaches no handler; a person may see it once).
        """
        if self._db is None:
            return
        if self.fault is not None:
            self.remember(agent, sender, msg_id, now_ms)
            self.degraded_live += 1
            return
        self._live.append(((agent, sender, msg_id, now_ms, 1), None))
        self._queued(len(self._live))

    def settle(self, agent: str, sender: str, msg_id: str, now_ms: int) -> None:
        """A live request is finished (its handler answered or failed, or it
        was answered, refused or held without one): its pair is written done,
        in the next group commit."""
        self._taken.pop((agent, sender, msg_id), None)
        if (agent, sender, msg_id) in self._forgotten:
            # Taken back (the inbox could not hold it): the buffered copy is the
            # only one left and must stay new work for the drain.
            return
        mark = (agent, sender, msg_id, now_ms)
        if self.settle_barrier is None:
            self._settle.append(mark)
            self._schedule_commit()
            return
        # Not before the answer reached the broker: until then the pair stays
        # unfinished (a drain leaves its copy alone; a crash keeps it interrupted).
        # The flush loop's next tick (at most ``flush_interval`` away) passes
        # one barrier for all of them. (A barrier per answer, started at once,
        # was one flush round trip to the broker per request at concurrency 1:
        # ≈ 55 µs of a two-node round trip's CPU, issue #21.)
        self._unsent.append(mark)
        self._queued(len(self._unsent) + len(self._unsent_states))

    def _queued(self, backlog: int) -> None:
        """Something was queued for the write-behind: wake the flush loop if
        it sleeps idle (it then writes within ``flush_interval``), or at once
        when the backlog is long."""
        if self._idle or backlog >= _WAKE_BEHIND:
            self._wake.set()

    def _has_work(self) -> bool:
        return bool(self._live or self._settle or self._seen_pending or self._state_pending
                    or self._unsent or self._unsent_states or self._trim_queue)

    async def _wait_wake(self, timeout: float) -> None:
        """Until :meth:`_queued` (or close) wakes the loop, or ``timeout`` passes.
        (One timer: ``wait_for`` made a task, a shield and a cancel per tick.)"""
        timer = asyncio.get_running_loop().call_later(timeout, self._wake.set)
        try:
            await self._wake.wait()
        finally:
            timer.cancel()

    async def _pass_barrier(self) -> None:
        """Pass the settle barrier once for every mark and outcome waiting on
        it: afterwards they ride the next commit (a request's inline commit, a
        drain's batch, or the write-behind flush). A kill -9 before that
        commit keeps the row as interrupted *and* answered (never run twice),
        as a kill just before the barrier does. On failure (disconnected) they
        wait for the next pass; cancelled (a stop that could not wait), they are
        left for :meth:`close`'s own last barrier. Only the flush loop calls it."""
        barrier = self.settle_barrier
        if barrier is None or not (self._unsent or self._unsent_states):
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._barrier_not_before:
            return
        # The same list objects: forget() filters _passing in place while the barrier runs.
        marks = self._passing = self._unsent
        states = self._passing_states = self._unsent_states
        self._unsent, self._unsent_states = [], []
        try:
            await barrier()
        except BaseException as exc:
            self._unsent[:0] = marks
            self._unsent_states[:0] = states
            if not isinstance(exc, Exception):
                raise
            log.debug("settle barrier failed (%s); trying again in %.1f s", exc, _BARRIER_RETRY_S)
            self._barrier_not_before = loop.time() + _BARRIER_RETRY_S
            return
        finally:
            self._passing, self._passing_states = [], []
        self._state_pending.extend(states)
        self._settle.extend(marks)

    def _schedule_commit(self) -> None:
        if not self._commit_scheduled:
            self._commit_scheduled = True
            asyncio.get_running_loop().call_soon(self._group_commit)

    def _take_live(self) -> list[tuple[tuple[str, str, str, int, int], asyncio.Future[str] | None]]:
        live, self._live = self._live, []
        return live

    def _resolve_live(
        self, live: Iterable[tuple[tuple[str, str, str, int, int], asyncio.Future[str] | None]], outcome: str
    ) -> None:
        for pair, future in live:
            self._taken.pop(pair[:3], None)
            if future is not None and not future.done():
                future.set_result(outcome)

    def _write_live(
        self, db: sqlite3.Connection, live: Sequence[tuple[tuple[str, str, str, int, int], Any]],
        settle: Sequence[tuple[str, str, str, int]],
    ) -> None:
        """Inside a transaction: the queued live pairs, then the settle marks."""
        if live:
            pairs = [pair for pair, _ in live]
            db.executemany(
                "INSERT OR IGNORE INTO seen (agent, sender, msg_id, seen_ms, done) VALUES (?,?,?,?,?)",
                pairs,
            )
            self._count_written(pairs)
        if settle:
            db.executemany(
                "INSERT INTO seen (agent, sender, msg_id, seen_ms, done) VALUES (?,?,?,?,1)"
                " ON CONFLICT (agent, sender, msg_id) DO UPDATE SET done=1",
                settle,
            )

    def _group_commit(self) -> bool:
        """Commit everything queued (one transaction); False when it degraded."""
        self._commit_scheduled = False
        live = self._take_live()
        settle, self._settle = self._settle, []
        if not live and not settle:
            return True
        if self._db is None:
            self._resolve_live(live, "degraded")
            return False
        try:
            with self._write() as db:
                self._write_live(db, live, settle)
        except InboxUnwritable:
            # Availability over the strict rule while the disk is at fault: the
            # messages are dispatched, their pairs are written behind (the
            # in-memory §22.2 memory still refuses their buffered copies here).
            for pair, _ in live:
                if pair[:3] not in self._forgotten:
                    self.remember(*pair[:4])
            self.degraded_live += len(live)
            self._settle[:0] = settle
            self._resolve_live(live, "degraded")
            return False
        except BaseException as exc:  # a bug: never leave a dispatch waiting forever
            for _, future in live:
                if future is not None and not future.done():
                    future.set_exception(exc)
            raise
        self.group_commits += 1
        self.live_committed += len(live)
        self._resolve_live(live, "committed")
        return True

    # -- the drain: durable intake -----------------------------------------------

    async def accept_batch(
        self, agent: str, items: Sequence[tuple[str, str, str, bytes, int | None]], now_ms: int
    ) -> list[bool | None]:
        """Durably record drained messages (sender, msg_id, kind, raw, stream_seq).

        Returns, per item: True, new work (committed as a pending row); False,
        not new (already held here, handled live, or kept as ``interrupted``
        because a crash caught its live handler — the caller acks it without
        dispatching); None, the live path of this process is handling it right
        now (taken, or its handler is running): the caller leaves the copy in
        the broker, neither acked nor dispatched, so a crash before the live
        handler settles still finds it (redelivered after the ack wait).

        The commit is on disk when this returns (the sync barrier): only then
        may the caller ack. Copies already seen cost one primary-key look-up
        each and no write; a batch of nothing but those costs no fsync unless
        the live path committed since the last one.
        """
        if not items:
            return []
        # Live pairs waiting for their group commit ride in this transaction,
        # so the copies acked as their duplicates are never acked before them.
        live = self._take_live()
        settle, self._settle = self._settle, []
        behind = {(s, m) for a, s, m, _ in self._seen_pending if a == agent}
        fresh: list[bool | None] = []
        taken_back: list[tuple[str, str, str]] = []
        note = "the node stopped while its live handler ran; not run again"
        try:
            with self._write() as db:
                self._write_live(db, live, settle)
                for sender, msg_id, kind, raw, seq in items:
                    key = (agent, sender, msg_id)
                    if key in self._taken:
                        fresh.append(None)
                        self.deferred += 1
                        continue
                    if (sender, msg_id) in behind:
                        fresh.append(False)
                        continue
                    if key in self._forgotten:
                        # Taken back by the live path (it could not hold the message).
                        db.execute("DELETE FROM seen WHERE agent=? AND sender=? AND msg_id=?", key)
                        taken_back.append(key)
                    row = db.execute(
                        "SELECT done FROM seen WHERE agent=? AND sender=? AND msg_id=?", key
                    ).fetchone()
                    if row is not None:
                        if row[0] == 0:
                            # Its live handler runs in this process: acked only once
                            # it settled, or a crash now would leave nothing to keep.
                            fresh.append(None)
                            self.deferred += 1
                            continue
                        if row[0] == 2:
                            # Committed live by a process that died before the handler
                            # finished: kept for a person, never run a second time.
                            if kind == "request":
                                cur = db.execute(
                                    "INSERT OR IGNORE INTO messages (agent, sender, msg_id, kind, envelope,"
                                    " stream_seq, received_ms, state, state_ms, note)"
                                    " VALUES (?,?,?,?,?,?,?,'interrupted',?,?)",
                                    (agent, sender, msg_id, kind, raw, seq, now_ms, now_ms, note),
                                )
                                self.kept_interrupted += cur.rowcount
                            db.execute("UPDATE seen SET done=1 WHERE agent=? AND sender=? AND msg_id=?", key)
                        fresh.append(False)
                        continue
                    cur = db.execute(
                        "INSERT OR IGNORE INTO messages (agent, sender, msg_id, kind, envelope, stream_seq,"
                        " received_ms, state, state_ms) VALUES (?,?,?,?,?,?,?,'pending',?)",
                        (agent, sender, msg_id, kind, raw, seq, now_ms, now_ms),
                    )
                    fresh.append(cur.rowcount == 1)
        except InboxUnwritable:
            self._live[:0] = live  # the group commit retries them (and degrades them if it must)
            self._settle[:0] = settle
            if live:
                self._schedule_commit()
            raise
        self._resolve_live(live, "committed")
        for pair in taken_back:  # committed: the tombstones have done their work
            self._forgotten.pop(pair, None)
        await self._sync()
        return fresh

    async def claim_pending(self, agent: str, limit: int, now_ms: int) -> list[InboxRow]:
        """Mark up to ``limit`` pending rows dispatched (committed, on disk) and return them."""
        with self._write() as db:
            rows = [
                _row(r)
                for r in db.execute(
                    f"SELECT {_COLUMNS} FROM messages WHERE agent=? AND state='pending' ORDER BY inbox_id LIMIT ?",
                    (agent, limit),
                )
            ]
            if rows:
                db.executemany(
                    "UPDATE messages SET state='dispatched', state_ms=? WHERE inbox_id=?",
                    [(now_ms, r.inbox_id) for r in rows],
                )
                # The claimed pairs join the persisted duplicate memory now.
                db.executemany(
                    "INSERT OR IGNORE INTO seen (agent, sender, msg_id, seen_ms) VALUES (?,?,?,?)",
                    [(agent, r.sender, r.msg_id, now_ms) for r in rows],
                )
                self._count_written_for(agent, len(rows))
        if rows:
            # A claim lost to a power loss would put the rows back to pending
            # and run them again: on disk before any handler runs.
            await self._sync()
        return rows

    async def pending_rows(self, agent: str, limit: int) -> list[InboxRow]:
        """Up to ``limit`` pending rows, oldest first, without claiming them: each
        is claimed by :meth:`start_row` right before it is dispatched."""
        return [
            _row(r)
            for r in self.db.execute(
                f"SELECT {_COLUMNS} FROM messages WHERE agent=? AND state='pending' ORDER BY inbox_id LIMIT ?",
                (agent, limit),
            )
        ]

    async def start_row(self, row: InboxRow, now_ms: int) -> bool:
        """Claim one pending row right before it enters the pipeline, inline:
        a row is handed to the pipeline at most once. The claim is only
        ``claimed``: the pipeline awaits before the handler (the sender's vouch
        check), and a crash there must not keep a row that never ran as
        interrupted. :meth:`mark_started` commits ``dispatched`` right before
        the handler (or an answer) really starts; :meth:`recover_interrupted`
        puts rows still ``claimed`` back to ``pending``. The fsync follows in the
        background (one shared by the rows starting together). False: the row
        is no longer pending."""
        with self._write() as db:
            cur = db.execute(
                "UPDATE messages SET state='claimed', state_ms=? WHERE inbox_id=? AND state='pending'",
                (now_ms, row.inbox_id),
            )
            if cur.rowcount != 1:
                return False
        # The pair joins the persisted duplicate memory only when the row starts
        # (mark_started): a claimed row put back to pending after a crash must
        # not be refused as a duplicate of itself. In this process the §22.2
        # memory holds it from the pipeline's guard on.
        self._claimed[(row.agent, row.sender, row.msg_id)] = row.inbox_id
        self._sync_soon()
        return True

    def mark_started(self, agent: str, sender: str, msg_id: str, now_ms: int) -> None:
        """A claimed drained row reaches its irreversible step — its handler
        starting, an answer without a handler going out, a cancel or a
        follow-up acting: ``dispatched`` and its pair are committed inline, so
        nothing lies between the commit and that step, and a crash from here on
        keeps the row as ``interrupted`` (never run again). A no-op for a row
        already marked (the handler's own answers) or not claimed here.

        Raises :class:`InboxUnwritable` when the commit fails: the step must not
        happen then (the row stays ``claimed`` and runs once after a restart)."""
        key = (agent, sender, msg_id)
        inbox_id = self._claimed.pop(key, None)
        if inbox_id is None or self._db is None:
            return
        try:
            with self._write() as db:
                db.execute(
                    "UPDATE messages SET state='dispatched', state_ms=? WHERE inbox_id=? AND state='claimed'",
                    (now_ms, inbox_id),
                )
                db.execute(
                    "INSERT OR IGNORE INTO seen (agent, sender, msg_id, seen_ms) VALUES (?,?,?,?)",
                    (agent, sender, msg_id, now_ms),
                )
            self._count_written_for(agent, 1)
        except InboxUnwritable:
            log.error("drained message %d was not started: the inbox cannot record it; it runs after a restart",
                      inbox_id)
            raise
        self._sync_soon()

    def unclaim(self, agent: str, sender: str, msg_id: str) -> None:
        """The pipeline is done with a drained row (its outcome follows in
        :meth:`set_state`): forget the in-memory claim."""
        self._claimed.pop((agent, sender, msg_id), None)

    def _sync_soon(self) -> None:
        """The sync barrier in the background (failures are recorded in :attr:`fault`)."""
        if self._syncer is None or self._syncer.done():
            self._syncer = asyncio.get_running_loop().create_task(self._quiet_sync(), name="inbox-sync")

    async def _quiet_sync(self) -> None:
        # Until caught up: rows that started while this fsync ran need the next.
        while self._commit_gen > self._synced_gen:
            try:
                await self._sync()
            except InboxUnwritable:
                return

    async def recover_interrupted(self, now_ms: int) -> int:
        """At start-up: rows whose handler a process that died had started
        (``dispatched``) are ``interrupted``; rows it had only claimed
        (``claimed``: caught in the pipeline before the handler) are ``pending``
        again and run once. Returns the number kept as interrupted."""
        with self._write() as db:
            interrupted = db.execute(
                "UPDATE messages SET state='interrupted', state_ms=?, note='the node stopped while its handler ran'"
                " WHERE state='dispatched'", (now_ms,),
            ).rowcount
            again = db.execute(
                "UPDATE messages SET state='pending', state_ms=? WHERE state='claimed'", (now_ms,)
            ).rowcount
        if again:
            log.info("%d drained inbox message(s) were claimed but not started when the node last stopped; "
                     "they run now", again)
        return int(interrupted)

    # -- interactive: held messages --------------------------------------------------

    async def hold(self, agent: str, sender: str, msg_id: str, kind: str, raw: bytes, now_ms: int) -> int:
        """Keep a message for a person's live session; returns its inbox id."""
        with self._write() as db:
            db.execute(
                "INSERT OR IGNORE INTO messages (agent, sender, msg_id, kind, envelope, received_ms,"
                " state, state_ms) VALUES (?,?,?,?,?,?,'held',?)",
                (agent, sender, msg_id, kind, raw, now_ms, now_ms),
            )
            row = db.execute(
                "SELECT inbox_id FROM messages WHERE agent=? AND sender=? AND msg_id=?", (agent, sender, msg_id)
            ).fetchone()
        assert row is not None
        return int(row[0])

    async def get(self, inbox_id: int) -> InboxRow | None:
        row = self.db.execute(f"SELECT {_COLUMNS} FROM messages WHERE inbox_id=?", (inbox_id,)).fetchone()
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
        return [_row(r) for r in self.db.execute(sql, params)]

    async def counts(self) -> dict[str, int]:
        return {str(state): int(n) for state, n in self.db.execute("SELECT state, count(*) FROM messages GROUP BY state")}

    async def set_state(
        self, inbox_id: int, state: str, now_ms: int, note: str | None = None, *,
        durable: bool = True, after_answers: bool = False,
    ) -> None:
        """Record an outcome: committed at once by default; ``durable=False``
        writes it behind, for a caller on a hot path.

        ``after_answers``: the outcome of a drained row whose answer was just
        published (the drain's dispatch). It is written behind, and only once
        everything published so far reached the broker (the settle barrier):
        a terminal state committed while the answer still sat in the client's
        buffer, then a kill -9, left the row ``answered`` with its answer lost —
        neither run again nor kept (seen in the crash-burst test under load).
        Until then the row stays ``dispatched``: a crash keeps it ``interrupted``.
        """
        if state not in STATES:
            raise ValueError(f"unknown inbox state {state!r}")
        if after_answers and self.settle_barrier is not None:
            self._unsent_states.append((state, note, now_ms, inbox_id))
            self._queued(len(self._unsent) + len(self._unsent_states))
            return
        if durable:
            self._transaction(
                [("UPDATE messages SET state=?, state_ms=?, note=COALESCE(?, note) WHERE inbox_id=?",
                  (state, now_ms, note, inbox_id))]
            )
        else:
            self._state_pending.append((state, note, now_ms, inbox_id))
            self._urgent = True  # behind, but at once: the row's outcome shows without a window
            self._wake.set()

    # -- the persisted duplicate memory -------------------------------------------------

    def remember(self, agent: str, sender: str, msg_id: str, now_ms: int) -> None:
        """Write-behind: remember a pair the live path refused (nothing ran), or
        one :meth:`commit_live` could not commit."""
        self._forgotten.pop((agent, sender, msg_id), None)
        self._seen_pending.append((agent, sender, msg_id, now_ms))
        if len(self._seen_pending) > _MAX_BEHIND:
            # Only while writes fail for long: bound the backlog, oldest out. The
            # in-memory §22.2 memory still refuses their buffered copies in this
            # process; only a restart before recovery could dispatch one twice.
            excess = len(self._seen_pending) - _MAX_BEHIND
            del self._seen_pending[:excess]
            self.dropped_behind += excess
        self._queued(len(self._seen_pending))

    def forget(self, agent: str, sender: str, msg_id: str) -> None:
        """Take back a pair the live path gave (:meth:`remember` or
        :meth:`commit_live`): it could not handle the message after all (the
        inbox could not hold it), so the buffered copy must still be taken by
        a drain."""
        key = (agent, sender, msg_id)
        self._seen_pending = [p for p in self._seen_pending if p[:3] != key]
        self._settle = [p for p in self._settle if p[:3] != key]
        self._unsent = [p for p in self._unsent if p[:3] != key]
        self._passing[:] = [p for p in self._passing if p[:3] != key]
        self._taken.pop(key, None)
        self._forgotten[key] = None
        if len(self._forgotten) > _MAX_BEHIND:
            self._forgotten.pop(next(iter(self._forgotten)))
        if self._db is not None and self.fault is None:
            # The tombstone stays until the drain took the copy: a settle or a
            # write-behind arriving later must not bring the pair back.
            with contextlib.suppress(InboxUnwritable):
                self._transaction([("DELETE FROM seen WHERE agent=? AND sender=? AND msg_id=?", key)])

    async def read_seen(self, agent: str, limit: int) -> list[tuple[str, str]]:
        """:meth:`load_seen` off the event loop: in the store's reader thread, on
        that thread's own connection (what is committed, which is every pair of
        an earlier process).

        The node reads an agent's pairs at its first delivery after a restart
        (:meth:`HostedAgent.load_remembered`): 6-9 ms an agent of 5,000 pairs
        here, ~60 ms with the file out of the page cache, that held the loop
        and every other agent. One thread and one connection, not a thread per
        read: reads in several threads contend for the GIL with each other
        (measured: 1,000 busy agents' first deliveries 2x slower than inline).
        Raises RuntimeError once the store is closing or closed, as
        :meth:`load_seen` does.
        """
        if self._db is None or self._reader_retired:
            raise RuntimeError("inbox store is not open")
        if self._reader is None:
            self._reader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="inbox-reader")
        return await asyncio.get_running_loop().run_in_executor(self._reader, self._read_seen_here, agent, limit)

    def _read_seen_here(self, agent: str, limit: int) -> list[tuple[str, str]]:
        # In the reader thread: its connection is made and used only there.
        conn = self._reader_db
        if conn is None:
            conn = self._reader_db = sqlite3.connect(self.path, isolation_level=None)
            conn.execute("PRAGMA busy_timeout=5000")
        return self._newest_pairs(conn, agent, limit)

    def _close_reader_here(self) -> None:
        conn, self._reader_db = self._reader_db, None
        if conn is not None:
            conn.close()

    async def _close_reader(self) -> None:
        self._reader_retired = True
        reader, self._reader = self._reader, None
        if reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.get_running_loop().run_in_executor(reader, self._close_reader_here)
            reader.shutdown(wait=False)

    @staticmethod
    def _newest_pairs(conn: sqlite3.Connection, agent: str, limit: int) -> list[tuple[str, str]]:
        # Newest first straight off the (agent, seen_ms) index, which covers the
        # pair (the table has no rowid), then reversed here: sorting the rows
        # back in SQL took a temporary B-tree per agent.
        pairs: list[tuple[str, str]] = conn.execute(
            "SELECT sender, msg_id FROM seen WHERE agent=? ORDER BY seen_ms DESC LIMIT ?", (agent, limit)
        ).fetchall()
        pairs.reverse()
        return pairs

    def load_seen(self, agent: str, limit: int) -> list[tuple[str, str]]:
        """The newest ``limit`` remembered pairs of ``agent``, oldest first, on
        the store's own connection (synchronous; the node uses :meth:`read_seen`)."""
        return self._newest_pairs(self.db, agent, limit)

    async def final_write(self) -> None:
        """The write a forced exit still does: every pair and outcome written
        behind, in one transaction, whether or not :meth:`close` is under way.
        A store already closed has nothing left to write."""
        if self._db is None:
            return
        await self.flush()

    async def flush(self) -> None:
        """Write everything behind now (one transaction): queued live pairs,
        settle marks, remembered pairs and outcomes."""
        if self._db is None:
            return
        live = self._take_live()
        settle, self._settle = self._settle, []
        seen, self._seen_pending = self._seen_pending, []
        states, self._state_pending = self._state_pending, []
        if not live and not settle and not seen and not states:
            return
        try:
            with self._write() as db:
                self._write_live(db, live, settle)
                if seen:
                    db.executemany("INSERT OR IGNORE INTO seen (agent, sender, msg_id, seen_ms) VALUES (?,?,?,?)", seen)
                    self._count_written(seen)
                if states:
                    db.executemany(
                        "UPDATE messages SET state=?, state_ms=?, note=COALESCE(?, note) WHERE inbox_id=?",
                        [(state, ms, note, inbox_id) for state, note, ms, inbox_id in states],
                    )
        except BaseException:
            # Nothing taken is dropped: the next flush (or close) writes it —
            # except a pair forget() took back meanwhile.
            self._live[:0] = live
            self._settle[:0] = settle
            self._seen_pending[:0] = [p for p in seen if p[:3] not in self._forgotten]
            self._state_pending[:0] = states
            raise
        self.live_committed += len(live)
        self._resolve_live(live, "committed")

    async def _flush_loop(self) -> None:
        while not self._closing:
            if self.fault is not None:
                # The inbox cannot be written: retry once a second, not on every
                # wake-up (each live message would be one more failing write).
                await asyncio.sleep(1.0)
            elif self._has_work():
                await self._wait_wake(self.flush_interval)
            else:
                self._idle = True
                try:
                    await self._wait_wake(_IDLE_TICK_S)
                finally:
                    self._idle = False
                if self._has_work() and not self._closing and not self._urgent:
                    # Woken by what was just queued: it gets the usual window.
                    self._wake.clear()
                    await self._wait_wake(self.flush_interval)
            self._wake.clear()
            self._urgent = False
            try:
                await self.flush()  # first: a slow barrier must not hold up what is behind
                await self._pass_barrier()
                await self.flush()  # the marks and outcomes that just passed it
                await self._maintain()
                self._trim_step()
            except InboxUnwritable:
                pass  # recorded in self.fault; the next flush carries the backlog
            except Exception as exc:  # keep trying; the next flush carries the backlog
                log.warning("inbox write-behind failed: %s", exc)

    async def _maintain(self) -> None:
        """Checkpoint the WAL into the database now and then, in a worker
        thread on a connection of its own (a PASSIVE checkpoint never blocks
        the loop's writes): automatic checkpoints would fsync inside a commit
        on the event loop.

        SQLite starts the WAL over only when a write begins with *every* frame
        checkpointed. A node that commits while the worker's checkpoint runs
        (any sustained load) never reaches that moment, and its WAL grew
        without bound: 2 GB after 160,000 commits in ``benchmarks inbox``, each
        commit then costing two to three times the kernel time of a commit
        into a WAL that starts over. So once the WAL is past
        :data:`WAL_CATCH_UP_BYTES`, the frames written during the worker's
        checkpoint are checkpointed inline, on the writer's own connection: a
        short pause (those frames and two fsyncs), after which the next commit
        starts the WAL over (truncated to ``journal_size_limit``)."""
        if self.commits - self._checkpointed_at < self.checkpoint_every:
            return
        self._checkpointed_at = self.commits
        gen = self._commit_gen
        commits = self.commits
        done = await asyncio.to_thread(_checkpoint, self.path)
        if not done:
            return
        # A complete checkpoint synced everything committed before it.
        self._synced_gen = max(self._synced_gen, gen)
        if self.commits == commits or self._db is None or self._wal_bytes() < WAL_CATCH_UP_BYTES:
            return  # nothing written meanwhile: the next commit starts the WAL over by itself
        gen = self._commit_gen
        try:
            busy, log_frames, done_frames = self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as exc:
            log.debug("inbox catch-up checkpoint failed: %s", exc)
            return
        self.catch_ups += 1
        if busy == 0 and done_frames == log_frames:
            self._synced_gen = max(self._synced_gen, gen)

    @property
    def _wal_path(self) -> Path:
        return self.path.with_name(self.path.name + "-wal")

    def _wal_bytes(self) -> int:
        try:
            return os.stat(self._wal_path).st_size
        except OSError:
            return 0

    # -- retention -------------------------------------------------------------------

    async def sweep(self, now_ms: int) -> dict[str, int]:
        """Bound the file: finished rows past retention, and the remembered pairs
        by age and by count, agent by agent, a few milliseconds at a time (the
        loop serves everything else in between); returns how many pairs it
        deleted past their age and past the count."""
        horizon = now_ms - self.retention_ms
        seen_horizon = now_ms - self.seen_max_age_ms
        placeholders = ",".join("?" * len(TERMINAL_STATES))
        finished = [int(r[0]) for r in self.db.execute(
            f"SELECT inbox_id FROM messages WHERE state IN ({placeholders}) AND state_ms < ?",
            (*TERMINAL_STATES, horizon))]
        for start in range(0, len(finished), _TRIM_CHUNK):  # a chunk per transaction, the loop served between
            chunk = finished[start:start + _TRIM_CHUNK]
            self._transaction([(f"DELETE FROM messages WHERE inbox_id IN ({','.join('?' * len(chunk))})", chunk)])
            await asyncio.sleep(0)
        expired, trimmed = self.expired_seen, self.trimmed_seen
        # Every agent with remembered pairs, one index step each (not a scan of the table).
        agents: collections.deque[str] = collections.deque()
        agent = ""
        while (row := self.db.execute(
            "SELECT agent FROM seen WHERE agent > ? ORDER BY agent LIMIT 1", (agent,)
        ).fetchone()) is not None:
            agent = str(row[0])
            agents.append(agent)
            self._trim_horizon[agent] = seen_horizon
            self._trim_queue[agent] = None
            if len(agents) % 256 == 0:
                await asyncio.sleep(0)
        # Trimmed here, a budget at a time, so that the figures returned are this
        # sweep's (the flush loop takes its turns at the same queue meanwhile).
        while agents and self._db is not None and self.fault is None:
            while agents and agents[0] not in self._trim_queue:
                agents.popleft()
            if agents:
                self._trim_step()
                await asyncio.sleep(0)
        return {"finished_rows": len(finished), "expired_seen": self.expired_seen - expired,
                "trimmed_seen": self.trimmed_seen - trimmed}

    def _count_written(self, pairs: Sequence[Sequence[Any]]) -> None:
        """Pairs (agent first) were written to ``seen``: an agent whose pairs
        may have run past capacity by the slack is queued for the trimmer."""
        for pair in pairs:
            self._count_written_for(pair[0], 1)

    def _count_written_for(self, agent: str, n: int) -> None:
        self._written_since_trim += n
        count = self._seen_added[agent] = self._seen_added.get(agent, 0) + n
        if count >= self._trim_slack:
            self._trim_queue.setdefault(agent, None)

    def _trim_step(self) -> None:
        """Trim the queued agents' remembered pairs (those older than the
        sweep's bound, then the oldest past ``seen_capacity``: first-seen
        eviction, §22.2's bounded memory) for ``_TRIM_BUDGET_S``, or for as many
        pairs as were written since the last step if that is more: under any
        steady load the memory stays bounded (a trimmed pair costs ~10-15 µs,
        about half of what writing it did)."""
        if self._db is None or self.fault is not None:
            return
        owed, self._written_since_trim = self._written_since_trim, 0
        before = self.trimmed_seen + self.expired_seen
        deadline = time.perf_counter() + _TRIM_BUDGET_S
        while self._trim_queue and (
            time.perf_counter() < deadline or self.trimmed_seen + self.expired_seen - before < owed
        ):
            agent = next(iter(self._trim_queue))
            if self._trim_agent(agent):
                del self._trim_queue[agent]
                if self._seen_added.get(agent, 0) >= self._trim_slack:
                    self._trim_queue[agent] = None  # written past the slack again meanwhile: once more

    def _trim_agent(self, agent: str) -> bool:
        """One bounded statement (or a count) for ``agent``; True when it is done."""
        horizon = self._trim_horizon.get(agent)
        if horizon is not None:
            gone = self._transaction([(
                "DELETE FROM seen WHERE (agent, sender, msg_id) IN (SELECT agent, sender, msg_id FROM seen"
                " WHERE agent=? AND seen_ms < ? LIMIT ?)", (agent, horizon, _TRIM_CHUNK))])
            self.expired_seen += gone
            if gone >= _TRIM_CHUNK:
                return False
            del self._trim_horizon[agent]
            return False  # the count next
        excess = self._seen_excess.pop(agent, None)
        if excess is None:
            self._seen_added.pop(agent, None)  # what is written from here on counts toward the next time
            (count,) = self.db.execute("SELECT count(*) FROM seen WHERE agent=?", (agent,)).fetchone()
            excess = int(count) - self.seen_capacity
            if excess <= 0:
                return True
            return self._keep_excess(agent, excess)
        gone = self._transaction([(
            "DELETE FROM seen WHERE (agent, sender, msg_id) IN (SELECT agent, sender, msg_id FROM seen"
            " WHERE agent=? ORDER BY seen_ms LIMIT ?)", (agent, min(excess, _TRIM_CHUNK)))])
        self.trimmed_seen += gone
        return True if gone == 0 else self._keep_excess(agent, excess - gone)

    def _keep_excess(self, agent: str, excess: int) -> bool:
        if excess <= 0:
            return True
        self._seen_excess[agent] = excess
        return False


def _fsync_file(path: Path) -> None:
    """fsync ``path`` if it exists (a WAL truncated by a checkpoint is on disk already)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _checkpoint(path: Path) -> bool:
    """A PASSIVE checkpoint on a connection of its own; True when it was complete."""
    try:
        conn = sqlite3.connect(path, isolation_level=None)
    except sqlite3.Error:
        return False
    try:
        conn.execute("PRAGMA busy_timeout=1000")
        busy, log_frames, done = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        return bool(busy == 0 and log_frames >= 0 and done == log_frames)
    except sqlite3.Error as exc:
        log.debug("inbox checkpoint failed: %s", exc)
        return False
    finally:
        conn.close()
