"""What calls to external A2A agents cost: one durable charge per task.

The mesh extension's rule (A2A-MESH-EXTENSION.md, the run report): the caller
charges ``max(verified spend, contract price)`` — *once*, whichever of its
passes over the task (the SendMessage answer, a GetTask poll, a resend after an
ambiguous failure) reads it. The table's primary key ``(peer, task_key)`` is
that "once": the first pass to record a charge wins, every later one is a no-op,
and because the table lives in SQLite beside the node inbox a restarted node
does not count a task again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiosqlite

from meshnode.node.private_db import prepare_private_db, tighten_side_files
from meshnode.protocol.timeutil import format_ts

__all__ = ["Charge", "ChargeStore", "REPORT_STATES", "charge_event"]

#: What became of the run report of a charged call.
#: ``verified``: signature, bodyHash and task id all checked (spend counted);
#: ``invalid``: a report that must not be believed (contract price charged);
#: ``missing``: the peer activated the extension but sent no report;
#: ``unverifiable``: a report, but no key to check it against is known;
#: ``not_expected``: the answer did not echo the extension (mesh: false);
#: ``canceled``: the calling mesh work was canceled and CancelTask went out —
#: recorded at zero, since only a completed task carries a run report.
REPORT_STATES = ("verified", "invalid", "missing", "unverifiable", "not_expected", "canceled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS a2a_charges (
    peer TEXT NOT NULL,
    task_key TEXT NOT NULL,
    message_id TEXT NOT NULL,
    task_id TEXT,
    agent TEXT NOT NULL,
    execution_id TEXT,
    mesh INTEGER NOT NULL,
    report TEXT NOT NULL,
    reported_spend TEXT,
    contract_price TEXT NOT NULL,
    charged TEXT NOT NULL,
    currency TEXT NOT NULL,
    charged_at_ms INTEGER NOT NULL,
    note TEXT,
    PRIMARY KEY (peer, task_key)
);
CREATE INDEX IF NOT EXISTS a2a_charges_execution ON a2a_charges (execution_id);
"""


@dataclass(frozen=True, slots=True)
class Charge:
    """One recorded charge. Amounts are USD decimal strings."""

    peer: str
    task_key: str
    message_id: str
    task_id: str | None
    agent: str
    execution_id: str | None
    mesh: bool
    report: str
    reported_spend: str | None
    contract_price: str
    charged: str
    currency: str
    charged_at_ms: int
    note: str | None = None

    def to_object(self) -> dict[str, Any]:
        return asdict(self)


def charge_event(charge: Charge, consumer_owner: str | None) -> dict[str, Any]:
    """``data`` of the ``mesh.event.metering.a2a_charge`` event that puts ``charge``
    in the mesh's ledger (:mod:`meshnode.services.rating`): the calling agent's
    own record of what the peer charged it, keyed ``(peer, task_key)`` there too."""
    data: dict[str, Any] = {
        "peer": charge.peer,
        "task_key": charge.task_key,
        "message_id": charge.message_id,
        "agent": charge.agent,
        "report": charge.report,
        "contract_price": charge.contract_price,
        "charged": charge.charged,
        "currency": charge.currency,
        "ts": format_ts(charge.charged_at_ms),
    }
    if charge.task_id is not None:
        data["task_id"] = charge.task_id
    if consumer_owner is not None:
        data["consumer_owner"] = consumer_owner
    return data


def charge_amount(contract_price: Decimal, verified_spend: Decimal | None) -> Decimal:
    """``max(verified spend, contract price)``; an unverified spend counts as none."""
    if verified_spend is None:
        return contract_price
    return max(verified_spend, contract_price)


class ChargeStore:
    """The durable charge table (``a2a-charges.sqlite3`` in the node's data directory)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db: aiosqlite.Connection | None = None

    async def open(self) -> None:
        prepare_private_db(self.path)  # born 0600, so are its -wal/-shm
        self._db = await aiosqlite.connect(self.path)
        await self._db.execute("PRAGMA journal_mode=WAL")
        await self._db.executescript(_SCHEMA)
        async with self._db.execute("PRAGMA table_info(a2a_charges)") as cur:
            columns = {row[1] for row in await cur.fetchall()}
        if "published" not in columns:
            # Whether JetStream acked the charge's ledger event (the meter outbox's
            # journal for charges). Rows from before it count as published: their
            # events went out, or were given up, then.
            await self._db.execute("ALTER TABLE a2a_charges ADD COLUMN published INTEGER NOT NULL DEFAULT 1")
        await self._db.commit()
        tighten_side_files(self.path)

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None

    def _conn(self) -> aiosqlite.Connection:
        if self._db is None:
            raise RuntimeError("the A2A charge store is not open")
        return self._db

    async def record(self, charge: Charge) -> bool:
        """Record ``charge`` unless its (peer, task) was already charged.

        True when this call recorded it (committed before returning), False
        when an earlier pass had: the earlier record stands unchanged.
        """
        db = self._conn()
        cursor = await db.execute(
            "INSERT OR IGNORE INTO a2a_charges (peer, task_key, message_id, task_id, agent, execution_id,"
            " mesh, report, reported_spend, contract_price, charged, currency, charged_at_ms, note, published)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
            (
                charge.peer, charge.task_key, charge.message_id, charge.task_id, charge.agent,
                charge.execution_id, int(charge.mesh), charge.report, charge.reported_spend,
                charge.contract_price, charge.charged, charge.currency, charge.charged_at_ms, charge.note,
            ),
        )
        await db.commit()
        return cursor.rowcount == 1

    async def unpublished(self, limit: int = 10_000) -> list[Charge]:
        """Charges whose ledger event JetStream has not acked (oldest first): a
        stop or a crash left them queued, or the outbox was full."""
        return await self._select("WHERE published = 0", (), limit=limit, newest_first=False)

    async def mark_published(self, peer: str, task_key: str) -> None:
        """JetStream acked the charge's ledger event."""
        db = self._conn()
        await db.execute("UPDATE a2a_charges SET published = 1 WHERE peer = ? AND task_key = ?", (peer, task_key))
        await db.commit()

    async def get(self, peer: str, task_key: str) -> Charge | None:
        rows = await self._select("WHERE peer = ? AND task_key = ?", (peer, task_key), limit=1)
        return rows[0] if rows else None

    async def recent(self, *, peer: str | None = None, limit: int = 200) -> list[Charge]:
        """The most recent charges first (of one peer, or all)."""
        if peer is None:
            return await self._select("", (), limit=limit)
        return await self._select("WHERE peer = ?", (peer,), limit=limit)

    async def spent_by_execution(self, execution_id: str) -> Decimal:
        """What the calls made for one piece of mesh work have been charged so far."""
        db = self._conn()
        async with db.execute("SELECT charged FROM a2a_charges WHERE execution_id = ?", (execution_id,)) as cur:
            rows = await cur.fetchall()
        return sum((Decimal(r[0]) for r in rows), Decimal(0))

    async def totals(self) -> dict[str, dict[str, Any]]:
        """Per peer: number of charges and their sum (a USD decimal string)."""
        db = self._conn()
        async with db.execute("SELECT peer, charged FROM a2a_charges") as cur:
            rows = await cur.fetchall()
        out: dict[str, dict[str, Any]] = {}
        for peer, charged in rows:
            entry = out.setdefault(peer, {"count": 0, "total": Decimal(0)})
            entry["count"] += 1
            entry["total"] += Decimal(charged)
        return {p: {"count": e["count"], "total": str(e["total"])} for p, e in out.items()}

    async def _select(self, where: str, args: Sequence[Any], *, limit: int, newest_first: bool = True) -> list[Charge]:
        db = self._conn()
        sql = (
            "SELECT peer, task_key, message_id, task_id, agent, execution_id, mesh, report, reported_spend,"
            f" contract_price, charged, currency, charged_at_ms, note FROM a2a_charges {where}"
            f" ORDER BY charged_at_ms {'DESC' if newest_first else 'ASC'} LIMIT ?"
        )
        async with db.execute(sql, (*args, limit)) as cur:
            rows = await cur.fetchall()
        return [
            Charge(r[0], r[1], r[2], r[3], r[4], r[5], bool(r[6]), r[7], r[8], r[9], r[10], r[11], r[12], r[13])
            for r in rows
        ]


def now_ms() -> int:
    return time.time_ns() // 1_000_000
