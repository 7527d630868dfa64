"""Meter events on their way to the mesh (§13.5): the node's meter outbox and its journal.

Every meter event of a priced offering is written to the usage log first
(:mod:`meshnode.node.usage_log`), then queued here and published to
``mesh.event.metering.*``, where ``MESH_METERING`` keeps it for the rating
service (§19.6), off the request path. The usage log is also the outbox's
journal: the outbox keeps, in ``usage.published`` beside it, the place in the
log before which JetStream acked everything. After a crash, a stop that could
not publish everything, or a queue that overflowed during a long outage, the
events after that place are read back from the log and published: none is
lost, and one published twice is charged once (the ledger rates a
``(meter, envelope_id)`` once).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from meshnode.aio import wait_for
from meshnode.node.usage_log import LogPosition, LogSpan, UsageLog, rating_context_of
from meshnode.protocol import subjects
from meshnode.protocol.envelope import build_envelope, encode_envelope, sign_envelope
from meshnode.transport.files import write_private_file

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent

__all__ = [
    "OUTBOX_CAPACITY",
    "OUTBOX_WINDOW",
    "MeterJournal",
    "MeterOutbox",
    "MeterPublisher",
    "meter_envelope",
]

log = logging.getLogger("meshnode.commerce")


class MeterPublisher(Protocol):
    """Publish one meter event (``data``: the event with its ``rating`` context)
    for ``hosted``; ``span``: where the usage log holds it, when it does."""

    async def __call__(self, hosted: HostedAgent, data: Mapping[str, Any], event_type: str = "usage", *,
                       span: LogSpan | None = None) -> None: ...


#: Meter events held in memory, at most this many. Beyond it an event the usage
#: log holds waits there (read back once the queue has room); one it does not
#: hold (an A2A charge, a line the log could not write) is dropped, counted.
OUTBOX_CAPACITY = 10_000
#: The first retry after a failed publish, doubled per failure up to the cap.
OUTBOX_FIRST_BACKOFF_S = 0.25
OUTBOX_MAX_BACKOFF_S = 10.0
#: How long a publish waits for the stream's ack.
OUTBOX_PUBLISH_TIMEOUT_S = 5.0
#: Events published before waiting for their acks (one round trip for them all).
OUTBOX_WINDOW = 256
#: Events read back from the usage log and signed in one pass (at most the
#: window). A pass runs on the event loop and signs each event anew, ~60 µs an
#: event here: 64 hold live traffic up for ~4 ms a pass, where 256 held it for
#: 15-50 ms; a pass's one ack round trip is small beside its signing.
OUTBOX_READ_BACK = 64
#: A read-back pass examines at most this many lines of the log per event it may queue.
_LINES_PER_EVENT_READ = 16
#: The journal's place is written at most this often (and at stop): a crash
#: republishes at most this much already published, which the ledger charges once.
JOURNAL_SAVE_EVERY_S = 1.0


def meter_envelope(hosted: HostedAgent, data: Mapping[str, Any], event_type: str = "usage") -> dict[str, Any]:
    """``data`` (a §13.5 meter event with its ``rating`` context) as the ``emit``
    for ``mesh.event.metering.<event_type>``, signed by the responder (§13.5: a
    declared meter is the responder's claim, attributable because it arrives
    under the responder's signature). ``event_type`` ``a2a_charge``: ``data`` is
    an A2A charge (:func:`meshnode.a2a.charges.charge_event`), signed by the
    calling agent, whose debt it is.

    Not through the agent's ``emit``: receipts are the node's bookkeeping, not
    the plugin's events, and must not spend the agent's per-subject emit budget.
    """
    node = hosted.node
    env = build_envelope(
        "emit", hosted.agent_id, now_ms=node.now_ms(), ids=node.ids,
        payload={"domain": "metering", "event_type": event_type, "data": dict(data)},
    )
    return sign_envelope(env, hosted.key)


@dataclass(frozen=True, slots=True)
class _Pending:
    node: Any  # the NodePort whose connection publishes it
    counters: Counter[str]  # the signing agent's
    subject: str
    data: bytes
    msg_id: str
    span: LogSpan | None  # where the usage log holds it (None: it does not)
    acked: Callable[[], Awaitable[None]] | None = None  # told once JetStream acked it


class MeterJournal:
    """The meter outbox's place in the usage log, kept in ``usage.published``
    beside it: every event of a line before it was acked by JetStream.

    Written whole (a temporary file renamed over it), 0600. Not fsync'd: a
    place lost with the machine only means republishing events already
    published, which the ledger charges once.
    """

    def __init__(self, usage: UsageLog, path: Path | None = None) -> None:
        self.usage = usage
        self.path = path if path is not None else usage.path.with_name("usage.published")

    def load(self) -> LogPosition | None:
        """The place kept, None when there is none (the first start with a
        journal) or it cannot be read (logged: read as none)."""
        try:
            raw = orjson.loads(self.path.read_bytes())
            return LogPosition(int(raw["segment"]), int(raw["offset"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("%s cannot be read (%s): meter events are published from the end of %s on; "
                        "those after the last acked one and before now are not republished",
                        self.path, exc, self.usage.path)
            return None

    def forget(self) -> None:
        """Drop the place kept (``[commerce] publish_usage = false``): events
        logged while nothing publishes them are the node's alone, and a later
        start that publishes again begins at the log's end, not at them."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def save(self, position: LogPosition) -> None:
        write_private_file(self.path, orjson.dumps({"segment": position.segment, "offset": position.offset}).decode(),
                           replace=True, sync=False)


class MeterOutbox:
    """The meter events of this node on their way to ``MESH_METERING``, off the request path.

    Calling it (a :class:`MeterPublisher`) builds and signs the ``emit`` at once
    (its ``ts`` is the event's, the agent's key is at hand) and queues it; the
    request's answer never waits for JetStream. One worker publishes the queue
    in order, JetStream-acked, ``Nats-Msg-Id`` = the envelope id, up to
    ``window`` events at a time before it waits for their acks
    (:meth:`~meshnode.transport.jetstream.JetStream.publish_in_flight`). One
    at a time it published ~240 events a second from a node serving ~300
    priced calls a second, which make ~600: the rest overflowed the outbox.
    A failed publish (JetStream down, a disconnect, a leaderless stream) is
    retried, ahead of the events behind it, with exponential backoff
    (:data:`OUTBOX_FIRST_BACKOFF_S` doubling to :data:`OUTBOX_MAX_BACKOFF_S`),
    so events queued during an outage go out in order once it is back (only
    an event that failed alone, between acked ones, is stored after them; the
    ledger's fold is of the stream's order either way). A retry republishes the same bytes: the stream
    drops it within its duplicate window, and beyond it the ledger does (it
    rates a ``(meter, envelope_id)`` once, an A2A charge's ``(peer, task_key)``
    once).

    With a ``journal`` (the daemon's), the usage log backs the queue:

    * at most ``capacity`` events are held in memory; past that, the events
      the log holds wait there and are read back, ``window`` lines at a time,
      once the queue is empty (an event the log does not hold is dropped,
      counted as ``stats["dropped"]`` and the agent's ``metering.dropped``);
    * the journal's place moves past an event once JetStream acked it and
      every event before it;
    * events left at stop, or at a crash, are published after the next start
      (:meth:`resume`): read back from the log and signed anew by their agent
      (an agent no longer hosted cannot sign: its events are counted as
      ``stats["orphaned"]`` and logged).

    Without one, beyond ``capacity`` a new event is dropped, and :meth:`close`
    counts what it could not publish (``metering.unpublished``).
    """

    def __init__(
        self,
        *,
        capacity: int = OUTBOX_CAPACITY,
        first_backoff_s: float = OUTBOX_FIRST_BACKOFF_S,
        max_backoff_s: float = OUTBOX_MAX_BACKOFF_S,
        publish_timeout_s: float = OUTBOX_PUBLISH_TIMEOUT_S,
        window: int = OUTBOX_WINDOW,
        journal: MeterJournal | None = None,
    ) -> None:
        self.capacity = capacity
        self.window = max(1, window)
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.publish_timeout_s = publish_timeout_s
        self.stats: Counter[str] = Counter()
        self._queue: deque[_Pending] = deque()
        self._wake = asyncio.Event()
        self._closing = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._failing = False
        self.journal = journal
        # Where the events still to be read back from the log begin (None: none
        # are; every new event is queued), and the end of the last line of the
        # log that reached the queue or was passed over.
        self._backlog: LogPosition | None = None
        self._through: LogPosition | None = None
        self._agent_of: Callable[[str], HostedAgent | None] | None = None
        self._saved: LogPosition | None = None
        self._saved_at = 0.0
        self._save_timer: asyncio.TimerHandle | None = None
        if journal is not None:
            kept = journal.load()
            end = journal.usage.end()
            if kept is None or kept > end:
                # The first start with a journal (or a log begun anew): what the
                # log holds now was published, or given up, as before.
                with contextlib.suppress(OSError):  # unwritable: said at the first save that fails
                    journal.save(end)
                kept = end
            self._saved = self._through = kept
            if kept < end:
                self._backlog = kept  # read back once resume() says whose keys sign it

    @property
    def pending(self) -> int:
        """Events queued and not yet acked by the stream."""
        return len(self._queue)

    def status(self) -> dict[str, Any]:
        """For the daemon's Status: what waits for JetStream, and the counts."""
        return {
            "queued": len(self._queue),
            "waiting_in_log_from": list(self._backlog) if self._backlog is not None else None,
            "journal": str(self.journal.path) if self.journal is not None else None,
            "counters": dict(sorted(self.stats.items())),
        }

    def gauges(self) -> dict[str, int]:
        """For ``Metrics``: what waits (events queued; 1 while events wait in the
        log) and the running counts."""
        return {
            "meter_events_queued": len(self._queue),
            "meter_events_waiting_in_log": int(self._backlog is not None),
            **{f"meter_events_{name}": self.stats[name]
               for name in ("published", "read_back", "dropped", "orphaned", "trimmed", "unpublished")},
        }

    @property
    def backlog(self) -> LogPosition | None:
        """Where the events waiting in the usage log begin (None: none wait there)."""
        return self._backlog

    async def __call__(self, hosted: HostedAgent, data: Mapping[str, Any], event_type: str = "usage", *,
                       span: LogSpan | None = None) -> None:
        if not self._waits_in_log(span):  # else unsigned: read back and signed later
            self._enqueue(hosted, meter_envelope(hosted, data, event_type), event_type, span, None)

    def _waits_in_log(self, span: LogSpan | None) -> bool:
        """An event the log holds waits there (unsigned, read back later) while
        events before it wait there too or the queue is full."""
        if span is None or self.journal is None:
            return False
        if self._closing.is_set():
            # After stop's flush: past the place kept, so the next start publishes it.
            self.stats["waited_in_log"] += 1
            return True
        self._through = span.end
        if self._backlog is None:
            if len(self._queue) < self.capacity:
                return False
            self._backlog = span.start
            log.warning("the meter outbox holds %d events waiting for JetStream: the next ones wait in %s "
                        "and are read back from there", len(self._queue), self.journal.usage.path)
        # No wake: the worker reads the log back by itself once its queue is empty
        # (and, before resume(), cannot: a wake per event found nothing to do).
        self.stats["waited_in_log"] += 1
        return True

    def put(self, hosted: HostedAgent, env: Mapping[str, Any], event_type: str = "usage", *,
            span: LogSpan | None = None, acked: Callable[[], Awaitable[None]] | None = None) -> bool:
        """Queue one signed metering ``emit`` (``span``: where the usage log
        holds its event; ``acked``: awaited once JetStream acked it, for a
        record kept elsewhere); False when it was dropped (full, or closed)."""
        return self._waits_in_log(span) or self._enqueue(hosted, env, event_type, span, acked)

    def _enqueue(self, hosted: HostedAgent, env: Mapping[str, Any], event_type: str, span: LogSpan | None,
                 acked: Callable[[], Awaitable[None]] | None) -> bool:
        if self._closing.is_set() or len(self._queue) >= self.capacity:
            self.stats["dropped"] += 1
            hosted.counters["metering.dropped"] += 1
            if self.stats["dropped"] % 1000 == 1:  # the first, then every 1000th: an outage must not flood the log
                log.warning("meter event %s dropped (%s): %d waiting for JetStream, %d dropped so far",
                            env.get("id"), "closed" if self._closing.is_set() else "outbox full",
                            len(self._queue), self.stats["dropped"])
            return False
        self._queue.append(_Pending(
            hosted.node, hosted.counters, subjects.event_subject("metering", event_type),
            encode_envelope(dict(env)), str(env["id"]), span, acked,
        ))
        self.stats["queued"] += 1
        self._start()
        return True

    def resume(self, agent_of: Callable[[str], HostedAgent | None]) -> None:
        """Start reading back what waits in the usage log, its events signed by
        ``agent_of(provider)`` (the daemon calls this once its agents are
        hosted: a key not yet loaded would leave their events behind)."""
        self._agent_of = agent_of
        if self._backlog is not None:
            log.info("meter events of %s from %s on were not acked by JetStream: publishing them",
                     self.journal.usage.path if self.journal else "the usage log", tuple(self._backlog))
            self._start()

    def _kept_for_next_start(self, item: _Pending) -> bool:
        return (self.journal is not None and item.span is not None) or item.acked is not None

    def _start(self) -> None:
        self._wake.set()
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="meter-outbox")

    def _read_back(self) -> None:
        """Queue the next events waiting in the usage log (:data:`OUTBOX_READ_BACK`
        at most); once the log has no more, new events are queued again as they come."""
        journal, agent_of, position = self.journal, self._agent_of, self._backlog
        assert journal is not None and agent_of is not None and position is not None
        kept = journal.usage.kept_from()
        if position < kept:
            self.stats["trimmed"] += 1
            log.warning("meter events in %s before %s were deleted with their segment (usage_log_max_bytes) "
                        "before JetStream acked them: they are not published", journal.usage.path, tuple(kept))
            position = kept
        queued, examined, orphans = 0, 0, Counter[str]()
        limit = min(self.window, OUTBOX_READ_BACK)
        for span, record in journal.usage.lines_after(position):
            position = self._through = span.end
            examined += 1
            if examined > limit * _LINES_PER_EVENT_READ:
                # A long run of lines that publish nothing (an agent's events, it
                # gone): the loop gets its turn between such passes.
                self._backlog = span.start
                self._through = span.start
                break
            if record is None:
                continue
            provider = record["event"].get("provider")
            hosted = agent_of(provider) if isinstance(provider, str) else None
            if hosted is None:
                orphans[str(provider)] += 1
                continue
            try:
                env = meter_envelope(hosted, {**record["event"], "rating": rating_context_of(record)})
            except Exception as exc:  # a line that is no event after all
                self.stats["unreadable"] += 1
                log.warning("%s: a meter event at %s cannot be published: %s", journal.usage.path, tuple(span.start), exc)
                continue
            self._queue.append(_Pending(
                hosted.node, hosted.counters, subjects.METERING_USAGE, encode_envelope(env), str(env["id"]), span,
            ))
            queued += 1
            if queued >= limit:
                self._backlog = position
                break
        else:
            self._backlog = None  # read to its end: live again
        self.stats["read_back"] += queued
        if orphans:
            self.stats["orphaned"] += sum(orphans.values())
            log.warning("%d meter event(s) in %s are of agents this node no longer hosts (%s): nothing can sign "
                        "them, so they are not published", sum(orphans.values()), journal.usage.path,
                        ", ".join(sorted(orphans)))

    def _place(self) -> LogPosition | None:
        """Before which JetStream acked every event the log holds: the first
        queued one's line, else where the log's waiting events begin, else
        after the last line handed over."""
        for pending in self._queue:
            if pending.span is not None:
                return pending.span.start
        return self._backlog if self._backlog is not None else self._through

    def _save_place(self, *, now: bool = False) -> None:
        """Keep the journal's place, at most every :data:`JOURNAL_SAVE_EVERY_S`."""
        journal, place = self.journal, self._place()
        if journal is None or place is None or place == self._saved:
            return
        wait = self._saved_at + JOURNAL_SAVE_EVERY_S - time.monotonic()
        if wait > 0 and not now:
            if self._save_timer is None:
                self._save_timer = asyncio.get_running_loop().call_later(wait, self._save_later)
            return
        try:
            journal.save(place)
        except OSError as exc:
            log.warning("%s cannot be written (%s): a restart would publish some meter events again "
                        "(charged once)", journal.path, exc)
            return
        self._saved, self._saved_at = place, time.monotonic()

    def _save_later(self) -> None:
        self._save_timer = None
        self._save_place()

    async def _run(self) -> None:
        backoff = self.first_backoff_s
        while True:
            if not self._queue and self._backlog is not None and self._agent_of is not None \
                    and not self._closing.is_set():
                self._read_back()
                self._save_place()
                if not self._queue and self._backlog is not None:
                    await asyncio.sleep(0)  # only lines that publish nothing so far: read on after a turn
                    continue
            if not self._queue:
                if self._closing.is_set():
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            head = self._queue[0]
            # The head and the events behind it that go out on the same connection.
            batch: list[_Pending] = []
            for pending in itertools.islice(self._queue, self.window):
                if pending.node is not head.node:
                    break
                batch.append(pending)
            try:
                results: list[Any] = await head.node.connection.jetstream.publish_in_flight(
                    [(p.subject, p.data, {"Nats-Msg-Id": p.msg_id}) for p in batch],
                    timeout=self.publish_timeout_s,
                )
            except asyncio.CancelledError:
                raise
            except Exception as unsent:  # not even sent (the connection is gone): all retried
                results = [unsent] * len(batch)
            for _ in batch:
                self._queue.popleft()
            failed = [(p, r) for p, r in zip(batch, results, strict=True) if isinstance(r, BaseException)]
            self._queue.extendleft(reversed([p for p, _ in failed]))  # retried first, in their order
            self.stats["published"] += len(batch) - len(failed)
            self._save_place()
            for pending, result in zip(batch, results, strict=True):
                if pending.acked is not None and not isinstance(result, BaseException):
                    try:
                        await pending.acked()
                    except Exception as exc:  # its record then says unpublished: sent again after a restart
                        log.warning("meter event %s was published, but recording that failed: %s",
                                    pending.msg_id, exc)
            if failed:  # the transport, a full or leaderless stream: retried
                self.stats["retried"] += len(failed)
                first, why = failed[0]
                if not self._failing:
                    self._failing = True
                    log.warning("meter events not published on %s (%d waiting), retrying with backoff: %s",
                                first.subject, len(self._queue), why)
                else:
                    log.debug("meter event %s still not published: %s", first.msg_id, why)
                await self._pause(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
                continue
            backoff = self.first_backoff_s
            if self._failing:
                self._failing = False
                log.info("meter events publishing again on %s (%d waiting)", head.subject, len(self._queue))

    async def _pause(self, seconds: float) -> None:
        # Closing cuts a long backoff short (stop's flush gets its attempts in
        # within its budget), yet every retry still waits a little: never a busy loop.
        if self._closing.is_set():
            await asyncio.sleep(min(seconds, self.first_backoff_s))
            return
        with contextlib.suppress(TimeoutError):
            await wait_for(self._closing.wait(), seconds)

    async def close(self, timeout: float = 3.0) -> int:
        """Publish what is queued within ``timeout`` seconds, then stop; returns
        how many queued events were left unpublished. Those the journal's log
        holds (and what waits in it), and those with an ``acked`` hook (their
        record is kept elsewhere), are published after the next start; the
        rest are counted (``metering.unpublished``) and logged."""
        self._closing.set()
        self._wake.set()
        worker = self._worker
        if worker is not None and not worker.done():  # done: an earlier close ended it
            try:
                await wait_for(asyncio.shield(worker), timeout)
            except TimeoutError:
                worker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await worker
        if self._save_timer is not None:
            self._save_timer.cancel()
            self._save_timer = None
        self._save_place(now=True)
        left = len(self._queue)
        # Not lost: an event the journal's log holds, and one whose record elsewhere
        # learns of its ack (an A2A charge's row): the next start publishes both.
        kept = sum(1 for item in self._queue if self._kept_for_next_start(item))
        for item in self._queue:
            if not self._kept_for_next_start(item):
                item.counters["metering.unpublished"] += 1
        self.stats["unpublished"] += left - kept
        if left - kept:
            log.warning("%d meter event(s) not published before stop: the mesh's ledger will not have them",
                        left - kept)
        if kept or self._backlog is not None:
            log.warning("meter events not published before stop (%d queued%s): the next start publishes them",
                        kept, ", and more waiting in the log" if self._backlog is not None else "")
        self._queue.clear()
        return left
