"""Tasks the node's agents left open when its process ended, and telling their requesters.

A Task lives in its handler's memory (§7.0). When the process ends while a
handler runs — a kill -9, an OOM kill, a power cut — nothing in it can send the
Task's terminal update, and the request is never run again (at most once,
docs/operations/exactly-once.md), so its requester would wait on a Task that
stays ``working`` for ever (or until a deadline it may not have set).

So the node keeps a journal of its open Tasks in the node inbox's SQLite file
(table ``open_tasks``): a row written (inline, committed) before a Task's first
reply goes out, its state updated at each transition, and the row deleted once
the Task's terminal update is published. A row still there when the next
process opens the file belongs to a Task the previous process left open; once
the agents run again each such Task is ended by its own agent, signed like any
update: ``failed`` with ``INTERNAL_ERROR`` (``details.reason: interrupted``)
when it was ``working``, else ``canceled`` with reason ``policy`` (a paused or
just-submitted Task cannot fail, §7.3).

A graceful stop tells requesters itself (``HostedAgent._tell_stopped``); the
journal covers what it could not.

What is not covered, and why: a plain request (no Task) interrupted by a crash
gets no answer — its caller's own timeout ends the wait (§6.4: silence means
possibly buffered, or lost), and a late ``failed`` could follow an answer that
reached the broker just before the crash. For a Task the same race is harmless:
the task manager refuses an update after a terminal one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from meshnode.node.inbox import InboxStore, InboxUnwritable
from meshnode.node.tasks import ResponderTask
from meshnode.protocol.errors import error_object
from meshnode.protocol.tasks import TERMINAL_STATES

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent

__all__ = ["OpenTask", "OpenTaskJournal", "end_left_open"]

log = logging.getLogger("meshnode.tasks")


@dataclass(frozen=True)
class OpenTask:
    """A Task an agent of this node had open, as the journal holds it."""

    agent: str
    task_id: str
    state: str
    request: dict[str, Any]


class OpenTaskJournal:
    """The ``open_tasks`` table of the node inbox's file.

    Every write is its own inline transaction (a few tens of µs: once per Task
    transition, never per request). A write that fails (a full disk) is logged
    and skipped: it must never fail the Task itself, and what it costs is only
    that a crash then leaves that Task's requester untold.
    """

    def __init__(self, store: InboxStore) -> None:
        self._store = store
        self._failing = False

    def left_open(self) -> list[OpenTask]:
        """Every Task in the journal. Read once at start-up, before this process
        opens any: then they are the ones the previous process left open."""
        rows = self._store.db.execute(
            "SELECT agent, task_id, state, request FROM open_tasks ORDER BY opened_ms"
        ).fetchall()
        tasks = []
        for agent, task_id, state, request in rows:
            try:
                decoded = orjson.loads(request)
            except orjson.JSONDecodeError:
                decoded = None
            if isinstance(decoded, dict):
                tasks.append(OpenTask(str(agent), str(task_id), str(state), decoded))
            else:  # unreadable: nothing to answer from; forget it
                self.ended(str(agent), str(task_id))
        return tasks

    def moved(self, agent: str, task_id: str, state: str, request: Mapping[str, Any], now_ms: int) -> None:
        """The Task is now in ``state``: recorded before its update goes out
        (the first one creates the row); a terminal state is :meth:`ended`."""
        if state in TERMINAL_STATES:
            return
        self._run(
            "INSERT INTO open_tasks (agent, task_id, state, request, opened_ms) VALUES (?,?,?,?,?)"
            " ON CONFLICT (agent, task_id) DO UPDATE SET state=excluded.state",
            (agent, task_id, state, orjson.dumps(request), now_ms),
        )

    def ended(self, agent: str, task_id: str) -> None:
        """The Task's terminal update went out: nothing is left to tell."""
        self._run("DELETE FROM open_tasks WHERE agent=? AND task_id=?", (agent, task_id))

    def _run(self, sql: str, params: tuple[Any, ...]) -> None:
        try:
            with self._store.transaction() as db:
                db.execute(sql, params)
        except (InboxUnwritable, RuntimeError) as exc:  # RuntimeError: the file already closed (a stop)
            if not self._failing:
                log.warning("the open-task journal cannot be written (%s): a crash now leaves the "
                            "requesters of the tasks open meanwhile untold", exc)
            self._failing = True
            return
        self._failing = False


async def end_left_open(tasks: list[OpenTask], agents: Mapping[str, HostedAgent],
                        journal: OpenTaskJournal) -> int:
    """End each Task the previous process left open, as its agent (``agents``:
    by agent id); the number ended. A Task whose agent is not hosted any more
    is forgotten (logged): nothing here can sign for it."""
    ended = 0
    for left in tasks:
        hosted = agents.get(left.agent)
        if hosted is None:
            log.warning("task %s was left open by agent %s, which this node no longer hosts: its requester "
                        "is not told", left.task_id, left.agent)
            journal.ended(left.agent, left.task_id)
            continue
        task = ResponderTask(hosted, left.request, left.task_id, state=left.state)
        try:
            if left.state == "working":
                error = error_object(
                    "INTERNAL_ERROR",
                    "the node running this task stopped while it ran (a crash or a kill); the work did not "
                    "complete and is not run again",
                    {"reason": "interrupted"},
                )
                await task._send("failed", error=error)
            else:
                await task._send("canceled", extra={
                    "reason": "policy",
                    "note": f"the node running this task stopped while it was {left.state}; it is not resumed",
                })
        except Exception as exc:  # the mesh not answering: the next start tries again
            log.warning("could not end task %s left open by %s: %s: %s", left.task_id, hosted.name,
                        type(exc).__name__, exc)
            continue
        ended += 1
        log.info("task %s of %s was left open when the node last stopped: ended %s", left.task_id, hosted.name,
                 task.state)
    return ended
