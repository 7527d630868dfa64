"""The task manager (§7.4, §7.7, §10.8, §10.8a, §13.5, §16.4, §18.4, §19.2): the authoritative Task record.

Responders (and, for a cancel, requesters) publish every Task update as a
signed ``respond`` on ``mesh.task.{task_id}.update``; the ``MESH_TASKS``
stream captures it. The task manager folds each update into the Task's record
in KV ``mesh_tasks`` (key = task id, 7-day TTL), keeps the central clock
(overdue marks, late completions, stranded delegates), and publishes what the
platform alone may state: attribution, receipts and meter events. The record
shape and who may say what are in :mod:`.task_record`.

Intake: the durable pull consumer ``mesh_task_manager`` on ``MESH_TASKS``
(filter ``mesh.task.*.update``, explicit ack, ack wait 10 s, max deliver 5),
shared by every task manager instance, so each update reaches one of them
(JetStream's queue group) and an update published while no instance runs is
applied when one starts (§18.4, §18.8). The consumer allows one unacknowledged
update at a time: updates are applied in the order the mesh received them,
across instances, which a Task's transitions need (``submitted`` must not be
judged after ``working``); an update whose write fails is retried while held,
and only after three failures handed back for redelivery. The price is
throughput: one KV round trip per update, mesh-wide. Every write is revision-checked (``kv.update(key,
value, last=revision)``), because the sweep and a second instance write the
same records: the loser re-reads and re-applies, and only the winning write
emits. Each update is verified (signature, ``(from, id)`` duplicate memory,
freshness judged against the time the stream stored it); anything that fails
is dropped silently, logged and counted in :attr:`TaskManagerService.counters`.

Subjects (the contract):

``mesh.task.get.{task_id}`` (request-reply, queue group ``mesh_task_manager``)
    Request: any request type, payload ``{task_id}`` (must match the token) or
    none. Reply: a signed ``respond`` whose payload is the record. Errors:
    ``TASK_NOT_FOUND``; ``UNAUTHORIZED`` for anybody but the Task's requester
    or responder; ``INVALID_ENVELOPE`` for a payload naming another task.

``mesh.task.{task_id}.update`` (the task manager's notice to the requester)
    When the deadline passes on a live Task, a ``respond`` signed by the task
    manager, ``to`` the requester, ``task_id`` set, ``in_reply_to`` the
    Task's request id when known, payload ``{status: <current state>,
    overdue: true, deadline, overdue_at}``. It restates the state (moves
    nothing) and rides the Task's own update channel, so a requester's task
    update consumer (§18.6) receives it even after being offline (§7.7:
    "marks the Task overdue at the deadline and notifies the requester").

Events (signed ``emit`` envelopes from the task manager's key, payload
``{domain, event_type, data}``, ``Nats-Msg-Id`` = envelope id); ``data``:

``mesh.event.task.overdue``
    ``{task_id, requester, responder, context_id?, offering?, state, deadline, overdue_at}``
``mesh.event.task.stranded`` (one per child, §10.8a)
    ``{task_id, requester, responder, context_id, offering?, parent_task_id,
    parent_cancel_reason?, state, stranded_at}``: a live Task sharing a
    canceled Task's context_id whose requester is the canceled Task's
    responder, still live ``stranded_grace_s`` after the cancel was recorded.
``mesh.event.task.failed``
    ``{task_id, requester, responder, context_id?, offering?, reason?,
    unmet_need?, dependency?, attribution, failed_at, envelope_id}``;
    ``attribution`` is computed here (§10.8a): ``client`` only for
    needs_not_furnished naming a need the responder's registered manifest
    declares (the Task's offering when known), else ``provider``, failing
    closed when the manifest cannot be read. A party's own ``attribution``
    member is ignored.
``mesh.event.metering.task_completed`` / ``mesh.event.metering.task_canceled``
    The §19.2 receipts (:func:`meshnode.protocol.metering.task_receipt`).
``mesh.event.metering.usage``
    §13.5 meter events when a Task ends: one ``declared`` event per entry of
    the responder's last ``payload.usage`` report (the terminal respond's, or
    the latest cumulative one before it; ``envelope_id`` = the reporting
    envelope), ``tasks_completed`` (1, on completion) and ``task_ms``
    (duration since the record was created, on every ending), both
    ``observed`` with ``envelope_id`` = the terminal envelope. ``provider``
    is the Task's responder, ``consumer`` its requester.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from meshnode.aio import backoff
from meshnode.protocol import subjects
from meshnode.protocol.budget import DEADLINE_SKEW_TOLERANCE_MS
from meshnode.protocol.envelope import build_envelope, child_trace, encode_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.protections import DedupMemory, DeliverySource, check_freshness
from meshnode.protocol.tasks import TERMINAL_STATES, is_valid_task_id, parse_state
from meshnode.transport.connection import Message
from meshnode.transport.errors import Conflict, NotFound, StoreFull
from meshnode.transport.jetstream import KV_DELETE_OPS, KeyValue, PullConsumer
from meshnode.transport.streams import (
    ensure_key_value,
    ensure_stream,
    mesh_stream_configs,
    tasks_bucket_config,
)

from .base import Envelope, ServiceBase, ServiceContext
from .task_record import (
    DEFAULT_HISTORY_CAP,
    Event,
    FoldSettings,
    IndexEntry,
    ManifestOf,
    Outcome,
    Record,
    Verdict,
    apply_update,
    finish_stranded_check,
    fit_record,
    flag_stranded,
    index_entry,
    mark_overdue,
    overdue_due,
    stranded_due,
)

__all__ = ["CONSUMER_NAME", "TASK_GET_PATTERN", "TASK_UPDATE_PATTERN", "TaskManagerService"]

CONSUMER_NAME = "mesh_task_manager"
TASK_UPDATE_PATTERN = "mesh.task.*.update"
TASK_GET_PATTERN = "mesh.task.get.*"

#: Room left under the broker's maximum message size for the get reply's envelope.
_REPLY_SLACK = 16 * 1024
#: A full record store makes room by deleting up to this many ended Tasks' records,
#: found among this many least recently written ones.
_ROOM_EVICT = 64
_ROOM_SCAN = 512
_ROOM_LOG_EVERY_S = 60.0
_MAX_WRITE_ATTEMPTS = 16
_APPLY_ATTEMPTS = 3
_ORPHANS_PER_TASK = 16
_ORPHAN_TASKS = 1000


@dataclass
class _Orphan:
    """An update that arrived before its Task's record (a cancel or revision racing
    the responder's first update); retried until ``expires_ms``."""

    env: dict[str, Any]
    received_ms: int
    expires_ms: int


class TaskManagerService(ServiceBase):
    """The authoritative Task record, the central clock and platform events (module docstring)."""

    def __init__(
        self,
        ctx: ServiceContext,
        *,
        history_cap: int = DEFAULT_HISTORY_CAP,
        sweep_interval_s: float = 1.0,
        manifest_of: ManifestOf | None = None,
        stranded_grace_s: float = 30.0,
        deadline_tolerance_ms: int = DEADLINE_SKEW_TOLERANCE_MS,
        orphan_ttl_s: float = 30.0,
        consumer: str = CONSUMER_NAME,
        fetch_timeout_s: float = 1.0,
        sync_timeout_s: float = 10.0,
        dedup_entries: int = 5000,
    ) -> None:
        super().__init__(ctx, name="tasks", queue=CONSUMER_NAME, dedup_entries=dedup_entries)
        if history_cap < 1:
            raise ValueError("history_cap must be at least 1")
        self.settings = FoldSettings(history_cap=history_cap, deadline_tolerance_ms=deadline_tolerance_ms)
        self.sweep_interval_s = sweep_interval_s
        self.manifest_of = manifest_of
        self.stranded_grace_ms = int(stranded_grace_s * 1000)
        self.orphan_ttl_ms = int(orphan_ttl_s * 1000)
        self.consumer = consumer
        self.fetch_timeout_s = fetch_timeout_s
        self._sync_timeout_s = sync_timeout_s
        #: Signals and outcomes by name (``refused.*``, ``verdict.*``, ``write_conflicts``, ...).
        self.counters: Counter[str] = Counter()
        # Updates keep their own duplicate memory: a get for a task named
        # "update" shares its subject with an update for a task named "get".
        self._update_dedup = DedupMemory(dedup_entries)
        self._kv: KeyValue | None = None
        self._index: dict[str, IndexEntry] = {}
        self._index_revs: dict[str, int] = {}
        self._orphans: dict[str, list[_Orphan]] = {}
        self._synced = asyncio.Event()
        self._watch_task: asyncio.Task[None] | None = None
        self._pull: PullConsumer | None = None
        self._max_record_bytes = 0
        self._room_logged_at = -_ROOM_LOG_EVERY_S

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        """Ensure ``MESH_TASKS`` and ``mesh_tasks``, load the sweep's index, bind the
        update consumer, then serve ``mesh.task.get.*`` and start the sweep."""
        if self.running:
            return
        js = self.ctx.connection.jetstream
        stream = next(c for c in mesh_stream_configs(self.ctx.replicas, self.ctx.stream_limits) if c.name == subjects.MESH_TASKS)
        await ensure_stream(js, stream)
        await ensure_key_value(js, tasks_bucket_config(self.ctx.replicas, self.ctx.stream_limits))
        self._kv = await js.key_value(subjects.KV_TASKS)
        self._max_record_bytes = max(64 * 1024, self.ctx.connection.max_payload - _REPLY_SLACK)
        self._running = True
        self._synced = asyncio.Event()
        self._restart_watch()
        try:
            async with asyncio.timeout(self._sync_timeout_s):
                await self._synced.wait()
            self._pull = await js.durable_pull(
                TASK_UPDATE_PATTERN,
                stream=subjects.MESH_TASKS,
                durable=self.consumer,
                # Applying an update takes milliseconds; with one update in
                # flight, a crashed holder stalls the queue for this long.
                ack_wait_s=10.0,
                max_deliver=5,
                # Created once; from then on the durable cursor says where to resume.
                deliver_all=False,
                # One update in flight mesh-wide keeps each Task's updates in order.
                max_ack_pending=1,
            )
        except BaseException:
            await self.stop()
            raise
        self.hook_reconnect(self._on_reconnect)
        self.spawn(self._consume, "updates")
        await self.serve(TASK_GET_PATTERN, self._get)
        self.spawn(self._sweep_loop, "sweep")
        await self.ctx.connection.flush()

    async def stop(self) -> None:
        await super().stop()
        task, self._watch_task = self._watch_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        pull, self._pull = self._pull, None
        if pull is not None:
            with contextlib.suppress(Exception):
                await pull.unsubscribe()

    async def _on_reconnect(self) -> None:
        if self.running:
            self._restart_watch()

    # -- the index (a KV watch) ------------------------------------------------

    def _restart_watch(self) -> None:
        old, self._watch_task = self._watch_task, None
        if old is not None:
            old.cancel()
        self._watch_task = self.spawn(self._watch, "kv-watch")

    async def _watch(self) -> None:
        assert self._kv is not None
        watcher = await self.open_watch(self._kv, "task records")
        try:
            async for entry in watcher:
                if entry is None:  # the end of the initial replay
                    self._synced.set()
                    continue
                deleted = entry.operation in KV_DELETE_OPS or not entry.value
                record = None if deleted else _loads(entry.value)
                self._index_apply(entry.key, entry.revision or 0, record, deleted=deleted)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    def _index_apply(self, task_id: str, revision: int, record: object, *, deleted: bool = False) -> None:
        if revision and self._index_revs.get(task_id, 0) > revision:
            return  # already holds a newer write (our own, applied on the way out)
        entry = None if deleted else index_entry(record)
        if entry is None:
            # Forgetting the revision too keeps memory to the live Tasks; an older
            # write replayed later is corrected by the newer one the watch delivers next.
            self._index_drop(task_id)
        else:
            self._index_revs[task_id] = revision
            self._index[task_id] = entry

    def _index_drop(self, task_id: str) -> None:
        self._index.pop(task_id, None)
        self._index_revs.pop(task_id, None)

    # -- records ---------------------------------------------------------------

    async def read(self, task_id: str) -> Record | None:
        """The stored record of ``task_id``, or None."""
        record, _ = await self._read(task_id)
        return record

    async def _read(self, task_id: str) -> tuple[Record | None, int | None]:
        assert self._kv is not None
        try:
            entry = await self._kv.get(task_id)
        except NotFound as exc:
            # A deleted key still has a revision to write against.
            gone = getattr(exc, "entry", None)
            return None, (gone.revision if gone is not None else None)
        record = _loads(entry.value)
        if not isinstance(record, dict):
            self.log.warning("task record %s is unreadable; it will be replaced", task_id)
            return None, entry.revision
        return record, entry.revision

    async def mutate(self, task_id: str, fold: Callable[[Record | None], Outcome]) -> Outcome:
        """Apply the pure ``fold`` to the stored record of ``task_id`` with a
        revision-checked write, re-reading and re-folding after every lost race.

        Returns the outcome of the fold whose record was written (or that
        decided to write nothing). Publishing its events is the caller's job.
        """
        assert self._kv is not None
        made_room = False
        for attempt in range(_MAX_WRITE_ATTEMPTS):
            record, revision = await self._read(task_id)
            outcome = fold(record)
            if outcome.record is None:
                if record is None:
                    self._index_drop(task_id)
                return outcome
            data = fit_record(outcome.record, self._max_record_bytes, orjson.dumps)
            try:
                if revision is None:
                    new_revision = await self._kv.create(task_id, data)
                else:
                    new_revision = await self._kv.update(task_id, data, last=revision)
            except StoreFull:
                # A new record, or one that grew, does not fit: ended Tasks give
                # way to live ones. Nothing to evict: the store is full of live work.
                if made_room or not await self._make_room():
                    raise
                made_room = True
                continue
            except Conflict:
                self.counters["write_conflicts"] += 1
                # Jittered backoff, so writers that collided do not collide again.
                await asyncio.sleep(random.uniform(0, 0.002 * (attempt + 1)))
                continue
            self._index_apply(task_id, new_revision, outcome.record)
            return outcome
        raise RuntimeError(f"task record {task_id}: {_MAX_WRITE_ATTEMPTS} writes lost the race in a row")

    async def _make_room(self) -> int:
        """The record store is full: delete the records of the Tasks that ended
        longest ago (up to ``_ROOM_EVICT``, among the ``_ROOM_SCAN`` least recently
        written records), and return how many went.

        Records are kept for the bucket's TTL (7 days, §18.4) while there is
        room; under pressure an ended Task's record, which nothing will write
        again, gives way to live work. A live Task's record, or one with a
        stranded check pending, is never deleted. A delete leaves a marker, so
        a get of an evicted Task answers TASK_EXPIRED, not TASK_NOT_FOUND.
        Each delete is revision-checked: a record written since it was read stays.
        """
        assert self._kv is not None
        evicted = 0
        async with contextlib.aclosing(self._kv.least_recent(_ROOM_SCAN)) as oldest:
            async for entry in oldest:
                if not _evictable(_loads(entry.value)):
                    continue
                try:
                    await self._kv.delete(entry.key, last=entry.revision)
                except (Conflict, NotFound):
                    continue
                evicted += 1
                if evicted >= _ROOM_EVICT:
                    break
        self.counters["evicted.ended"] += evicted
        if evicted:
            # A busy store makes room every few seconds: say so once a minute, with the total.
            now = time.monotonic()
            if now - self._room_logged_at >= _ROOM_LOG_EVERY_S:
                self._room_logged_at = now
                self.log.warning(
                    "the task record store is full ([storage] task_records_max_bytes): deleting the records of "
                    "ended Tasks, oldest first, to keep live ones written (%d so far); a get of one answers "
                    "TASK_EXPIRED. Raise the limit to keep ended Tasks for the full 7 days.",
                    self.counters["evicted.ended"],
                )
        else:
            self.log.error(
                "the task record store is full ([storage] task_records_max_bytes) and none of its %d least "
                "recently written records is an ended Task's: raise the limit", _ROOM_SCAN,
            )
        return evicted

    # -- updates -----------------------------------------------------------------

    async def _consume(self) -> None:
        await self.consume_pull(
            lambda: self._pull,
            self._on_update,
            batch=1,
            timeout_s=self.fetch_timeout_s,
            retry_s=min(1.0, self.fetch_timeout_s),
            what="task updates",
        )

    def _count(self, signal: str, msg: Message, detail: str) -> None:
        self.counters[signal] += 1
        self.log.info("task update on %s %s: %s", msg.subject, signal, detail)

    async def _on_update(self, msg: Message) -> None:
        try:
            stored_ms = msg.stored_ms
        except Exception:
            stored_ms = self.ctx.now_ms()
        parsed = subjects.parse_task_subject(msg.subject)
        env = self.decode(msg.data, msg.subject) if parsed is not None else None
        if parsed is None or env is None:
            self._count("refused.envelope", msg, "not a signed envelope on a task subject")
            await _ack(msg)
            return
        # Judged against when the stream stored it: a late manager must not
        # refuse what was fresh on arrival, and a replayed capture is stale there.
        if not check_freshness(env["ts"], stored_ms, DeliverySource.LIVE, self.ctx.freshness):
            self._count("refused.stale", msg, f"envelope {env['id']} from {env['from']}")
            await _ack(msg)
            return
        if (env["from"], env["id"]) in self._update_dedup:
            self._count("refused.duplicate", msg, f"envelope {env['id']} from {env['from']}")
            await _ack(msg)
            return
        outcome: Outcome | None = None
        for attempt, delay in zip(range(_APPLY_ATTEMPTS), backoff(0.25), strict=False):
            try:
                outcome = await self._apply(parsed.task_id, env, stored_ms)
                break
            except Exception:
                self.log.exception("applying task update %s failed (attempt %d)", env["id"], attempt + 1)
                # Retried while holding the message: a nak would let later updates
                # of the same Task overtake this one.
                with contextlib.suppress(Exception):
                    await msg.in_progress()
                await asyncio.sleep(delay)
        if outcome is None:
            self.counters["apply_failed"] += 1
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            return
        self._update_dedup.check_and_remember(env["from"], env["id"])
        await _ack(msg)

        if outcome.verdict is Verdict.ORPHAN:
            self._stash_orphan(parsed.task_id, env, stored_ms)
        elif outcome.verdict is Verdict.CREATED:
            await self._retry_orphans(parsed.task_id)

    async def _apply(self, task_id: str, env: dict[str, Any], received_ms: int) -> Outcome:
        """Fold one verified update into its record and publish what the write owes."""

        def fold(record: Record | None) -> Outcome:
            return apply_update(
                record, env, task_id=task_id, received_ms=received_ms, now_ms=self.ctx.now_ms(),
                settings=self.settings, manifest_of=self.manifest_of,
            )

        outcome = await self.mutate(task_id, fold)
        self.counters[f"verdict.{outcome.verdict.value}"] += 1
        if outcome.verdict in (Verdict.REFUSED, Verdict.REJECTED):
            is_notice = (
                outcome.code == "UNAUTHORIZED"
                and isinstance(env.get("payload"), Mapping)
                and env["payload"].get("overdue") is True
            )
            if is_notice:
                self.counters["ignored.notice"] += 1  # a task manager's own overdue notice
            else:
                self.counters[f"refused.{(outcome.code or 'unknown').lower()}"] += 1
                self.log.info(
                    "task %s: update %s from %s %s (%s: %s)", task_id, env["id"], env["from"],
                    outcome.verdict.value, outcome.code, outcome.message,
                )
        await self._publish(task_id, outcome)
        return outcome

    def _stash_orphan(self, task_id: str, env: dict[str, Any], received_ms: int) -> None:
        if task_id not in self._orphans and len(self._orphans) >= _ORPHAN_TASKS:
            self.counters["orphans.dropped"] += 1
            self.log.warning("too many updates waiting for their task; dropped %s", env["id"])
            return
        waiting = self._orphans.setdefault(task_id, [])
        if len(waiting) < _ORPHANS_PER_TASK:
            waiting.append(_Orphan(env, received_ms, self.ctx.now_ms() + self.orphan_ttl_ms))
            self.counters["orphans.stashed"] += 1

    async def _retry_orphans(self, task_id: str) -> None:
        waiting = self._orphans.pop(task_id, None)
        if not waiting:
            return
        if await self.read(task_id) is None:
            now = self.ctx.now_ms()
            kept = [o for o in waiting if o.expires_ms > now]
            for orphan in waiting:
                if orphan.expires_ms <= now:
                    self.counters["orphans.expired"] += 1
                    self.log.info("task %s: update %s never found its record", task_id, orphan.env["id"])
            if kept:
                self._orphans[task_id] = kept
            return
        for orphan in waiting:
            await self._apply(task_id, orphan.env, orphan.received_ms)

    # -- get ------------------------------------------------------------------------

    async def _get(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        task_id = msg.subject.rsplit(".", 1)[-1]
        if not is_valid_task_id(task_id):
            raise ProtocolError("INVALID_ENVELOPE", "the subject names no valid task_id", {"member": "task_id"})
        payload = env.get("payload")
        if isinstance(payload, Mapping) and payload.get("task_id", task_id) != task_id:
            raise ProtocolError("INVALID_ENVELOPE", "payload.task_id names another task", {"member": "task_id"})
        record, revision = await self._read(task_id)
        if record is None and revision is not None:
            # Only a full store deletes a record (see _make_room); the bucket's
            # TTL removes one without a marker.
            raise ProtocolError("TASK_EXPIRED", f"task {task_id} ended and its record was removed to make room")
        if record is None:
            raise ProtocolError("TASK_NOT_FOUND", f"no task {task_id}")
        if env["from"] not in (record.get("requester"), record.get("responder")):
            raise ProtocolError("UNAUTHORIZED", "only the Task's requester or responder may read it")
        return record

    # -- the central clock --------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        while self.running:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.log.exception("task sweep failed; retrying next interval")

    async def sweep(self) -> None:
        """One pass of the central clock: overdue marks, due stranded checks, waiting orphans."""
        now = self.ctx.now_ms()
        for task_id in overdue_due(
            list(self._index.values()), now_ms=now, tolerance_ms=self.settings.deadline_tolerance_ms
        ):
            outcome = await self.mutate(
                task_id, lambda record: mark_overdue(record, now_ms=self.ctx.now_ms(), settings=self.settings)
            )
            await self._publish(task_id, outcome)
        for parent, children in stranded_due(
            list(self._index.values()), now_ms=now, grace_ms=self.stranded_grace_ms
        ):
            parent_record = await self.read(parent.task_id)
            if parent_record is None:
                self._index_drop(parent.task_id)
                continue
            flagged: list[str] = []

            def strand(record: Record | None, parent: Record = parent_record) -> Outcome:
                return flag_stranded(record, parent, now_ms=self.ctx.now_ms())

            def close(record: Record | None, flagged: list[str] = flagged) -> Outcome:
                return finish_stranded_check(record, flagged, now_ms=self.ctx.now_ms())

            for child in children:
                outcome = await self.mutate(child.task_id, strand)
                if outcome.verdict is Verdict.APPLIED:
                    flagged.append(child.task_id)
                    await self._publish(child.task_id, outcome)
            await self.mutate(parent.task_id, close)
        for task_id in list(self._orphans):
            await self._retry_orphans(task_id)

    # -- output -------------------------------------------------------------------------

    async def _publish(self, task_id: str, outcome: Outcome) -> None:
        for event in outcome.events:
            await self._emit(event)
        if outcome.notice is not None and outcome.record is not None:
            await self._notify(task_id, outcome.record, outcome.notice)

    async def _emit(self, event: Event) -> None:
        self.counters[f"emitted.{event.domain}.{event.event_type}"] += 1
        await self.emit(event.domain, event.event_type, event.data)

    async def _notify(self, task_id: str, record: Record, payload: dict[str, Any]) -> None:
        """The requester's notice on the Task's update subject (module docstring)."""
        meta = record.get("meta") if isinstance(record.get("meta"), Mapping) else {}
        assert isinstance(meta, Mapping)
        history = record.get("history") or []
        trace = history[-1].get("trace") if history and isinstance(history[-1], Mapping) else None
        env = build_envelope(
            "respond",
            self.ctx.service_id,
            now_ms=self.ctx.now_ms(),
            to=str(record["requester"]),
            task_id=task_id,
            in_reply_to=meta.get("request_id") if isinstance(meta.get("request_id"), str) else None,
            context_id=record.get("context_id") if isinstance(record.get("context_id"), str) else None,
            payload=payload,
            trace=child_trace(trace if isinstance(trace, Mapping) else None),
            ids=self.ctx.ids,
        )
        self.sign(env)
        try:
            await self.ctx.connection.publish(
                subjects.task_update(task_id), encode_envelope(env), headers={"Nats-Msg-Id": env["id"]}
            )
            self.counters["notices"] += 1
        except Exception as exc:  # the mark is recorded; the notice is best effort
            self.log.warning("task %s: overdue notice failed: %s", task_id, exc)


def _loads(value: bytes | None) -> Any:
    if not value:
        return None
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError:
        return None


async def _ack(msg: Message) -> None:
    with contextlib.suppress(Exception):
        await msg.ack()


def _evictable(record: object) -> bool:
    """Whether a stored record may give way in a full store: its Task ended and
    the sweep has nothing left to do with it (no stranded check pending)."""
    return (
        isinstance(record, Mapping)
        and parse_state(record.get("state")) in TERMINAL_STATES
        and index_entry(record) is None
    )
