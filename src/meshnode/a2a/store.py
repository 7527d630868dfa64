"""The A2A bridge's durable state: tasks and the idempotency map (SQLite).

Both outlive a daemon restart: GetTask answers for a task created before it,
and the same messageId from the same caller within the retention gets the same
task. Each task remembers its caller (``issuer:<id>`` or ``anonymous``): the
bridge answers task operations only to it. The idempotency key's caller is
``issuer:<id>`` for a trusted caller and ``anonymous:<bodyHash>`` otherwise, so
anonymous callers share a task only when they send the very same message. A task is stored as its A2A ProtoJSON object, rewritten on every change;
the idempotency row is written in the same transaction as the task's first
version, before any agent runs, so a resend after a crash finds it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiosqlite
import orjson

from meshnode.node.private_db import prepare_private_db, tighten_side_files

__all__ = ["BridgeStore", "Remembered", "Stored"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS a2a_tasks (
    task_id     TEXT PRIMARY KEY,
    agent       TEXT NOT NULL,
    caller      TEXT NOT NULL,
    created_ms  INTEGER NOT NULL,
    updated_ms  INTEGER NOT NULL,
    terminal    INTEGER NOT NULL DEFAULT 0,
    task_json   BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS a2a_idempotency (
    agent       TEXT NOT NULL,
    caller      TEXT NOT NULL,
    message_id  TEXT NOT NULL,
    task_id     TEXT NOT NULL,
    body_hash   TEXT NOT NULL,
    created_ms  INTEGER NOT NULL,
    PRIMARY KEY (agent, caller, message_id)
);
CREATE INDEX IF NOT EXISTS a2a_idempotency_created ON a2a_idempotency (created_ms);
"""


@dataclass(frozen=True, slots=True)
class Remembered:
    """A messageId already seen from this caller: its task and message hash."""

    task_id: str
    body_hash: str


@dataclass(frozen=True, slots=True)
class Stored:
    """A stored task: the agent it ran on, its caller and its A2A object."""

    agent: str
    caller: str
    task: dict[str, Any]


class BridgeStore:
    """Tasks and idempotency rows under the node's data directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db: aiosqlite.Connection | None = None

    async def open(self) -> None:
        prepare_private_db(self.path)  # born 0600, so are its -wal/-shm
        self._db = await aiosqlite.connect(self.path, isolation_level=None)
        await self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a task row is on disk before the caller is told about the task.
        await self._db.execute("PRAGMA synchronous=FULL")
        await self._db.execute("PRAGMA busy_timeout=5000")
        await self._db.executescript(_SCHEMA)
        tighten_side_files(self.path)

    async def close(self) -> None:
        if self._db is not None:
            with contextlib.suppress(Exception):
                await self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            await self._db.close()
            self._db = None

    @property
    def db(self) -> aiosqlite.Connection:
        if self._db is None:
            raise RuntimeError("the A2A bridge store is not open")
        return self._db

    async def create(
        self,
        task: dict[str, Any],
        *,
        agent: str,
        caller: str,
        message_id: str,
        body_hash: str,
        now_ms: int,
        dedup_caller: str | None = None,
        terminal: bool = False,
    ) -> None:
        """Store a new task and its idempotency row in one transaction.

        ``caller`` owns the task; ``dedup_caller`` (default ``caller``) keys
        the idempotency row with ``message_id``."""
        db = self.db
        await db.execute("BEGIN IMMEDIATE")
        try:
            await db.execute(
                "INSERT INTO a2a_tasks (task_id, agent, caller, created_ms, updated_ms, terminal, task_json)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (task["id"], agent, caller, now_ms, now_ms, int(terminal), orjson.dumps(task)),
            )
            await db.execute(
                "INSERT OR REPLACE INTO a2a_idempotency"
                " (agent, caller, message_id, task_id, body_hash, created_ms) VALUES (?, ?, ?, ?, ?, ?)",
                (agent, dedup_caller or caller, message_id, task["id"], body_hash, now_ms),
            )
            await db.execute("COMMIT")
        except BaseException:
            await db.execute("ROLLBACK")
            raise

    async def update(self, task: dict[str, Any], *, now_ms: int, terminal: bool) -> None:
        await self.db.execute(
            "UPDATE a2a_tasks SET task_json = ?, updated_ms = ?, terminal = ? WHERE task_id = ?",
            (orjson.dumps(task), now_ms, int(terminal), task["id"]),
        )

    async def get(self, task_id: str) -> Stored | None:
        """The task ``task_id`` with its agent and caller, or None."""
        async with self.db.execute(
            "SELECT agent, caller, task_json FROM a2a_tasks WHERE task_id = ?", (task_id,)
        ) as cur:
            row = await cur.fetchone()
        if row is None:
            return None
        task: dict[str, Any] = orjson.loads(row[2])
        return Stored(agent=str(row[0]), caller=str(row[1]), task=task)

    async def owned(self, *, agent: str, caller: str) -> list[dict[str, Any]]:
        """The tasks ``caller`` created on ``agent``, the newest first (ListTasks)."""
        async with self.db.execute(
            "SELECT task_json FROM a2a_tasks WHERE agent = ? AND caller = ? ORDER BY created_ms DESC, task_id",
            (agent, caller),
        ) as cur:
            rows = await cur.fetchall()
        return [orjson.loads(r[0]) for r in rows]

    async def remembered(
        self, *, agent: str, caller: str, message_id: str, not_before_ms: int
    ) -> Remembered | None:
        async with self.db.execute(
            "SELECT task_id, body_hash FROM a2a_idempotency"
            " WHERE agent = ? AND caller = ? AND message_id = ? AND created_ms >= ?",
            (agent, caller, message_id, not_before_ms),
        ) as cur:
            row = await cur.fetchone()
        return None if row is None else Remembered(str(row[0]), str(row[1]))

    async def unfinished(self) -> list[dict[str, Any]]:
        """Tasks that were not terminal when the daemon last stopped."""
        async with self.db.execute("SELECT task_json FROM a2a_tasks WHERE terminal = 0") as cur:
            rows = await cur.fetchall()
        return [orjson.loads(r[0]) for r in rows]

    async def sweep(self, *, idempotency_before_ms: int, tasks_before_ms: int) -> None:
        """Forget idempotency rows past the retention and terminal tasks past theirs."""
        await self.db.execute(
            "DELETE FROM a2a_idempotency WHERE created_ms < ?", (idempotency_before_ms,)
        )
        await self.db.execute(
            "DELETE FROM a2a_tasks WHERE terminal = 1 AND updated_ms < ?", (tasks_before_ms,)
        )
