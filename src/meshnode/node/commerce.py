"""The Economics extension on the node (§19.1, §19.5): declared SKUs and the agreement check.

Three jobs, each small:

* :func:`declared_skus` turns what an agent class declares (``@offering(price=...)``
  and :attr:`meshnode.agent.Agent.skus`) into validated §19.1 SKUs with their
  digests: the plugin author writes prices, never digests.
* :class:`AgreementStore` holds the agreements this node enforces: owner-signed
  documents (§19.5), verified on the way in, kept in ``agreements.json`` in the
  data directory, revocable (prospectively).
* :class:`AgreementGate` is the admission check in the §7.7/§22 slot: a request
  whose offering a paid SKU covers, from a requester whose owner holds no
  unexpired agreement at the SKU's current digest, is refused with
  AGREEMENT_REQUIRED before any work.

Two sources of agreements, asked in order: this node's own store (what the
seller's operator added, ``meshnode agreements add``: it works without any
platform), then the platform agreement service (what owners registered,
§19.5 "registered with the platform"), through the cached, single-flight
:class:`~meshnode.node.agreement_lookup.PlatformAgreements`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import re
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import orjson

from meshnode.agent import OfferingSpec
from meshnode.aio import wait_for
from meshnode.protocol import subjects
from meshnode.protocol.budget import parse_budget, parse_money
from meshnode.protocol.commerce import (
    Agreement,
    AgreementRecord,
    Charge,
    ParsedOnce,
    Rater,
    Sku,
    agreement_required,
    approval_url,
    check_price_within_ceiling,
    find_agreement,
    parse_sku,
    parse_skus,
    sku_for,
    verify_agreement,
)
from meshnode.protocol.envelope import build_envelope, encode_envelope, sign_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.metering import MeterClass, meter_event

if TYPE_CHECKING:
    from meshnode.node.agreement_lookup import PlatformAgreements
    from meshnode.node.hosted import HostedAgent

__all__ = [
    "AgreementGate",
    "AgreementStore",
    "MeterOutbox",
    "MeterPublisher",
    "UsageLog",
    "declared_skus",
    "default_sku_id",
    "meter_envelope",
    "rating_context",
]

log = logging.getLogger("meshnode.commerce")

_NOT_SKU_CHAR = re.compile(r"[^a-z0-9-]+")


def default_sku_id(offering_id: str) -> str:
    """The SKU id of a priced offering that names none: the offering id lower-cased,
    every run of other characters as one ``-``, at most 64 characters."""
    return _NOT_SKU_CHAR.sub("-", offering_id.lower()).strip("-")[:64] or "sku"


#: §13.5 observed meters this node does not count yet: a price on one rates nothing.
UNPRODUCED_OBSERVED_METERS = frozenset({"responses", "events", "bytes_in", "bytes_out", "tasks_completed", "task_ms"})


def declared_skus(declared: Sequence[Mapping[str, Any]], offerings: Iterable[OfferingSpec]) -> tuple[Sku, ...]:
    """Validated SKUs of an agent class: ``declared`` (whole SKU objects) then one
    per priced offering. Raises ProtocolError INVALID_MANIFEST naming the member
    (``skus[i]....``) when a SKU is malformed or two SKUs cover one offering."""
    objects: list[dict[str, Any]] = [dict(s) for s in declared]
    for spec in offerings:
        if spec.price is None:
            continue
        sku = {
            "sku": spec.sku or default_sku_id(spec.id),
            "covers": {"offerings": [spec.id]},
            "price": dict(spec.price),
            "provider": dict(spec.billing_provider or {"id": "internal"}),
        }
        try:
            parse_sku(sku)
        except ProtocolError as exc:
            # The author wrote @offering(price=...), not skus[N]: name what they wrote
            # (an index into the list the node builds would point at nothing in their code).
            member = str(exc.details.get("member", ""))
            where = {"price": "price", "provider": "billing_provider", "sku": "sku"}.get(member.split(".")[0], member)
            rest = member.partition(".")[2]
            at = f'@offering("{spec.id}") {where}' + (f".{rest}" if rest else "")
            raise ProtocolError(exc.code, f"{at}: {exc.message}", {**exc.details, "member": at}) from None
        objects.append(sku)
    return parse_skus(objects) if objects else ()


def _record_object(record: AgreementRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"agreement": record.agreement.to_object()}
    if record.revoked_at_ms is not None:
        out["revoked_at_ms"] = record.revoked_at_ms
    return out


class AgreementStore:
    """The agreements this node enforces, in ``path`` (JSON, written atomically, 0600).

    One record per (consumer owner, seller agent, SKU id): a newer agreement to
    the same SKU replaces the older one (re-approval after a price change).
    Only documents whose signature verifies against their own
    ``consumer_owner`` are accepted; a record that no longer verifies when the
    file is read is dropped with a warning, never enforced as valid.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._records: dict[tuple[str, str, str], AgreementRecord] = {}
        self._load()

    def _load(self) -> None:
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            # Fail closed: an unreadable store holds no agreements (paid work is refused).
            log.error("%s: unreadable agreement store (%s); no agreements are enforced as held", self.path, exc)
            return
        for i, item in enumerate(raw.get("agreements", []) if isinstance(raw, dict) else []):
            try:
                agreement = verify_agreement(item.get("agreement") if isinstance(item, dict) else None)
            except ProtocolError as exc:
                log.warning("%s: agreements[%d] dropped: %s", self.path, i, exc.message)
                continue
            revoked = item.get("revoked_at_ms")
            self._records[self._key(agreement)] = AgreementRecord(
                agreement, revoked if isinstance(revoked, int) else None
            )

    @staticmethod
    def _key(agreement: Agreement) -> tuple[str, str, str]:
        return (agreement.consumer_owner, agreement.seller_agent, agreement.sku)

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_name(self.path.name + ".tmp")
        data = json.dumps({"agreements": [_record_object(r) for r in self._records.values()]}, indent=2)
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def add(self, document: object) -> Agreement:
        """Verify (shape and the owner's signature, §19.5) and keep ``document``.
        Raises ProtocolError (INVALID_ENVELOPE / IDENTITY_MISMATCH) otherwise."""
        agreement = verify_agreement(document)
        self._records[self._key(agreement)] = AgreementRecord(agreement)
        self._save()
        return agreement

    def revoke(self, *, sku: str, consumer_owner: str | None, seller_agent: str | None, now_ms: int) -> list[Agreement]:
        """Revoke (from ``now_ms`` on, prospectively) the live agreements to ``sku``
        matching the given owner and seller (None: any). Returns those revoked."""
        revoked: list[Agreement] = []
        for key, record in self._records.items():
            a = record.agreement
            if a.sku != sku or record.revoked_at_ms is not None:
                continue
            if consumer_owner is not None and a.consumer_owner != consumer_owner:
                continue
            if seller_agent is not None and a.seller_agent != seller_agent:
                continue
            self._records[key] = AgreementRecord(a, now_ms)
            revoked.append(a)
        if revoked:
            self._save()
        return revoked

    def records(self) -> list[AgreementRecord]:
        return list(self._records.values())


#: ``[commerce] usage_log_max_bytes``'s default: what the usage log keeps, all segments together.
USAGE_LOG_MAX_BYTES = 1024**3
#: The log is cut into this many segments of the bound: the oldest goes whole.
USAGE_LOG_SEGMENTS = 16
#: A deleted usage-log segment up to this size is counted inline (under a millisecond).
_COUNT_INLINE_BYTES = 1 << 20


class UsageLog:
    """The meter events of priced offerings this node recorded, in ``path`` (JSON lines).

    Each line is ``{"event": <§13.5 meter event>, "sku": <the SKU as declared
    when the event happened>, "consumer_owner": <resolved at admission>}``, plus
    the request's ``cost_ceiling`` (§19.3) and ``interaction`` (the request
    envelope id the ceiling binds) when it carried a budget, and the
    ``agreement`` that admitted it, so a replay rates
    each event under the terms current at its ts, whatever the agent declares
    now. Recorded: one observed ``requests`` event per completed request of an
    offering a SKU covers, one declared event per meter the handler reported
    (``ctx.report_usage``), and one refusal event (quantity 0, ``refused:
    true``) per AGREEMENT_REQUIRED.

    Bounded by ``max_bytes`` (``[commerce] usage_log_max_bytes``; 0: never
    trimmed): a line is ~1.5 KB, and a node serving 300 priced calls a second
    wrote ~1 MB a second, for ever. ``path`` is the segment being written; at a
    sixteenth of the bound it becomes ``path.N`` (N counting up) and a new one
    starts; past the bound the oldest segments are deleted, each logged with
    what it held. :meth:`records` reads the segments kept, oldest first.
    """

    def __init__(self, path: Path, *, max_bytes: int = USAGE_LOG_MAX_BYTES,
                 segments: int = USAGE_LOG_SEGMENTS) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.segment_bytes = max(1, max_bytes // max(1, segments)) if max_bytes > 0 else 0
        self._written: int | None = None  # the current segment's size, once known

    def append(self, event: Mapping[str, Any], sku: Sku, consumer_owner: str | None,
               context: Mapping[str, Any] | None = None) -> None:
        # Serialized at once and not kept: the SKU's document goes as it is, uncopied.
        record: dict[str, Any] = {"event": event if isinstance(event, dict) else dict(event),
                                  "sku": sku.document if isinstance(sku.document, dict) else dict(sku.document),
                                  "consumer_owner": consumer_owner}
        for name in ("cost_ceiling", "interaction", "agreement"):
            if context is not None and context.get(name) is not None:
                record[name] = context[name]
        try:
            data = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)  # ~10x json.dumps; a line each event
        except TypeError:  # what orjson refuses (a non-string key, a 65-bit integer): as before
            data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        if self.segment_bytes:
            if self._written is None:
                self._written = self.path.stat().st_size if self.path.exists() else 0
            if self._written and self._written + len(data) > self.segment_bytes:
                self._rotate()
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
        except FileNotFoundError:  # its directory is not there (yet): made once, not per event
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        if self._written is not None:
            self._written += len(data)

    def segments(self) -> list[Path]:
        """The segments kept, oldest first: ``path.1``, ``path.2``, ..., then ``path``."""
        return [p for _, p in self._rotated()] + ([self.path] if self.path.exists() else [])

    def _rotated(self) -> list[tuple[int, Path]]:
        """The closed segments ``path.N`` with their N, oldest first."""
        rotated = []
        for candidate in self.path.parent.glob(f"{self.path.name}.*"):
            suffix = candidate.name[len(self.path.name) + 1:]
            if suffix.isdigit():
                rotated.append((int(suffix), candidate))
        return sorted(rotated)

    def _rotate(self) -> None:
        """Close the current segment (``path`` becomes ``path.N``) and delete
        the oldest until the rest and a full new segment fit ``max_bytes``."""
        rotated = self._rotated()
        closed = self.path.with_name(f"{self.path.name}.{rotated[-1][0] + 1 if rotated else 1}")
        os.replace(self.path, closed)
        self._written = 0
        kept = [p for _, p in rotated] + [closed]
        total = sum(p.stat().st_size for p in kept)
        for oldest in kept[:-1]:
            if total + self.segment_bytes <= self.max_bytes:  # room for the segment now begun
                break
            size = oldest.stat().st_size
            f = oldest.open("rb")  # still readable once unlinked: counted after, maybe off the loop
            oldest.unlink()
            total -= size
            self._report_deleted(f, oldest.name, size)

    def _report_deleted(self, f: BinaryIO, name: str, size: int) -> None:
        """Log a deleted segment with its record count. Counting reads the
        whole segment (64 MiB by default, 20-50 ms): inside a running event
        loop a segment over :data:`_COUNT_INLINE_BYTES` is counted in its
        default executor, so the loop (every request of the node) never waits
        for it."""

        def count_and_warn() -> None:
            try:
                with f:
                    lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
                held = f"{lines} record(s)"
            except OSError as exc:
                held = f"records not counted: {exc}"
            log.warning("usage log: deleted its oldest segment %s (%s, %d bytes) to stay within "
                        "[commerce] usage_log_max_bytes (%d); the mesh's ledger rates what MESH_METERING keeps",
                        name, held, size, self.max_bytes)

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or size <= _COUNT_INLINE_BYTES:
            count_and_warn()
        else:
            loop.run_in_executor(None, count_and_warn)

    @staticmethod
    def _lines(path: Path) -> Iterator[str]:
        try:
            with path.open(encoding="utf-8") as f:
                yield from f
        except FileNotFoundError:  # deleted meanwhile (trimmed)
            return

    def records(self) -> Iterator[dict[str, Any]]:
        """Every readable record of the segments kept, in order, one at a time
        (a torn last line is skipped).

        Safe beside a writer in another thread: what it yields is always the
        log's first lines, whole segments then the current one up to where it
        was read, even when a segment is closed meanwhile (``path`` becoming
        ``path.N`` between a listing and the open of ``path`` would otherwise
        leave out all of ``path.N``). A segment trimmed before it is read is
        left out, as trimmed."""
        read_upto = 0  # the N of the last closed segment read
        while True:
            unread = [(n, p) for n, p in self._rotated() if n > read_upto]
            for n, segment in unread:
                yield from self._parsed(self._lines(segment))
                read_upto = n
            if unread:
                continue  # one more may have been closed while these were read
            try:
                current = self.path.open(encoding="utf-8")
            except FileNotFoundError:
                return
            with current:
                # Closed between the listing and the open: the file held is a
                # newer one, and the closed segment's lines come first. (Closed
                # after the open, it is the file held; read from its name.)
                if any(n > read_upto for n, _ in self._rotated()):
                    continue
                # Read to its end: a rotation meanwhile only stops its growth.
                yield from self._parsed(current)
                return

    @staticmethod
    def _parsed(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("event"), dict):
                yield record

    def read(self) -> list[dict[str, Any]]:
        """Every readable record, in order (:meth:`records` as a list)."""
        return list(self.records())

    def rate(self, agreements: Iterable[Agreement | AgreementRecord]) -> list[Charge]:
        """The §19.6 fold of the recorded events × the agreements: a fresh
        :class:`~meshnode.protocol.commerce.Rater`, so the same log and
        agreements always give the same charges to the micro-unit. A request's
        ``cost_ceiling`` clamps what its events are charged together. The
        agreement that admitted a request (from this store or the platform's)
        is kept on its line and counts too, once its signature verifies."""
        rater = Rater(list(agreements))
        carried: set[str] = set()
        charges: list[Charge] = []
        # The same few SKUs and agreements, line after line: each parsed (and
        # its signature checked) once, as the rating service's fold does.
        agreement_of, sku_of = ParsedOnce(verify_agreement), ParsedOnce(parse_sku)
        for record in self.records():
            document = record.get("agreement")
            if document is not None:
                try:
                    held = agreement_of(document)
                except ProtocolError:
                    held = None
                if held is not None and held.sig not in carried:
                    carried.add(held.sig)
                    rater.agreements.append(held)
            try:
                sku = sku_of(record.get("sku"))
                ceiling = parse_money(record["cost_ceiling"]) if "cost_ceiling" in record else None
            except ProtocolError:
                continue
            owner = record.get("consumer_owner")
            interaction = record.get("interaction")
            charge = rater.rate(
                record["event"], sku=sku, consumer_owner=owner if isinstance(owner, str) else None,
                ceiling=ceiling, interaction=interaction if isinstance(interaction, str) else None,
            )
            if charge is not None:
                charges.append(charge)
        return charges


#: ``(hosted, data)`` -> publish one meter event; see :class:`MeterOutbox`.
MeterPublisher = Callable[["HostedAgent", Mapping[str, Any]], Awaitable[None]]

#: Meter events waiting for JetStream, at most this many; beyond it a new event
#: is dropped (counted, logged): it stays in ``usage.jsonl``, the durable record.
OUTBOX_CAPACITY = 10_000
#: The first retry after a failed publish, doubled per failure up to the cap.
OUTBOX_FIRST_BACKOFF_S = 0.25
OUTBOX_MAX_BACKOFF_S = 10.0
#: How long a publish waits for the stream's ack.
OUTBOX_PUBLISH_TIMEOUT_S = 5.0
#: Events published before waiting for their acks (one round trip for them all).
OUTBOX_WINDOW = 256


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


class MeterOutbox:
    """The meter events of this node on their way to ``MESH_METERING``, off the request path.

    Calling it (a :data:`MeterPublisher`) builds and signs the ``emit`` at once
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

    Bounded (``capacity``): beyond it a new event is dropped, counted
    (``stats["dropped"]``, the agent's ``metering.dropped``) and logged; it is
    still in ``usage.jsonl``, which the node writes before queueing.
    :meth:`close` flushes what it can within its timeout and counts the rest
    (``metering.unpublished``).
    """

    def __init__(
        self,
        *,
        capacity: int = OUTBOX_CAPACITY,
        first_backoff_s: float = OUTBOX_FIRST_BACKOFF_S,
        max_backoff_s: float = OUTBOX_MAX_BACKOFF_S,
        publish_timeout_s: float = OUTBOX_PUBLISH_TIMEOUT_S,
        window: int = OUTBOX_WINDOW,
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

    @property
    def pending(self) -> int:
        """Events queued and not yet acked by the stream."""
        return len(self._queue)

    async def __call__(self, hosted: HostedAgent, data: Mapping[str, Any], event_type: str = "usage") -> None:
        self.put(hosted, meter_envelope(hosted, data, event_type), event_type)

    def put(self, hosted: HostedAgent, env: Mapping[str, Any], event_type: str = "usage") -> bool:
        """Queue one signed metering ``emit``; False when it was dropped (full, or closed)."""
        if self._closing.is_set() or len(self._queue) >= self.capacity:
            self.stats["dropped"] += 1
            hosted.counters["metering.dropped"] += 1
            if self.stats["dropped"] % 1000 == 1:  # the first, then every 1000th: an outage must not flood the log
                log.warning("meter event %s dropped (%s): %d waiting for JetStream, %d dropped so far; it stays "
                            "in usage.jsonl", env.get("id"), "closed" if self._closing.is_set() else "outbox full",
                            len(self._queue), self.stats["dropped"])
            return False
        self._queue.append(_Pending(
            hosted.node, hosted.counters, subjects.event_subject("metering", event_type),
            encode_envelope(dict(env)), str(env["id"]),
        ))
        self.stats["queued"] += 1
        self._wake.set()
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="meter-outbox")
        return True

    async def _run(self) -> None:
        backoff = self.first_backoff_s
        while True:
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
        how many events were left unpublished (counted, logged, in ``usage.jsonl``)."""
        self._closing.set()
        self._wake.set()
        worker = self._worker
        if worker is not None:
            try:
                await wait_for(asyncio.shield(worker), timeout)
            except TimeoutError:
                worker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await worker
        left = len(self._queue)
        if left:
            for item in self._queue:
                item.counters["metering.unpublished"] += 1
            self.stats["unpublished"] += left
            log.warning("%d meter event(s) not published before stop; they stay in usage.jsonl", left)
            self._queue.clear()
        return left


def rating_context(sku: Sku, owner: str | None, agreement: Agreement | None,
                   env: Mapping[str, Any]) -> dict[str, Any]:
    """What the rating service needs beside a meter event to rate it alone (§19.6):
    the SKU as declared at the event (its digest is recomputed by the rater), the
    consumer's owner resolved at admission, the owner-signed agreement that
    admitted it (the rater verifies its signature, so a seller cannot invent
    one), and the request's ``cost_ceiling`` with the interaction it binds."""
    context: dict[str, Any] = {"sku": sku.to_object(), "consumer_owner": owner}
    if agreement is not None:
        context["agreement"] = agreement.to_object()
    budget = env.get("budget")
    if isinstance(budget, Mapping) and isinstance(budget.get("cost_ceiling"), Mapping):
        context["cost_ceiling"] = dict(budget["cost_ceiling"])
    context["interaction"] = str(env.get("id"))
    return context


#: Admitted requests awaiting their completion's meter event, at most this many.
_ADMITTED_CAP = 10_000


class AgreementGate:
    """The §19.5 admission check, with the node's store and ``[commerce]`` settings.

    It also keeps the seller's meter of priced offerings (§13.5): each event is
    appended to ``usage`` (the durable record, first) and, with ``publisher``
    set (the daemon sets a :class:`MeterOutbox`), handed on for the rating
    service: queued, not awaited on the wire, so the answer goes out first.
    """

    def __init__(
        self,
        store: AgreementStore,
        *,
        approval_surface: str | None,
        gate_free_terms: bool,
        usage: UsageLog | None = None,
        publisher: MeterPublisher | None = None,
    ) -> None:
        self.store = store
        self.approval_surface = approval_surface
        self.gate_free_terms = gate_free_terms
        self.usage = usage
        self.publisher = publisher
        #: The platform agreement service, asked when the local store holds no
        #: agreement (None: the local store alone, ``[commerce] platform_agreements = false``).
        self.platform: PlatformAgreements | None = None
        # Request id -> (SKU, owner, the agreement that admitted it) from
        # admission to completion (FIFO-bounded: a request whose handler never
        # completes must not grow it forever).
        self._admitted: dict[str, tuple[Sku, str | None, Agreement | None]] = {}

    @property
    def metering(self) -> bool:
        return self.usage is not None or self.publisher is not None

    async def _record(self, hosted: HostedAgent, env: Mapping[str, Any], sku: Sku, owner: str | None,
                      agreement: Agreement | None, events: Sequence[Mapping[str, Any]]) -> None:
        context = rating_context(sku, owner, agreement, env)
        for event in events:
            if self.usage is not None:
                try:
                    self.usage.append(event, sku, owner, context)
                except OSError as exc:
                    # Usage is a record, not a gate: losing a line never refuses work.
                    log.warning("%s: meter event not recorded: %s", self.usage.path, exc)
            if self.publisher is not None:
                try:
                    await self.publisher(hosted, {**event, "rating": context})
                except Exception as exc:  # signing, encoding (the outbox never waits on the wire): logged, the work stands
                    hosted.counters["metering.unpublished"] += 1
                    log.warning("meter event %s/%s not published on %s: %s", event.get("meter"),
                                event.get("envelope_id"), subjects.METERING_USAGE, exc)

    async def delivered(
        self,
        hosted: HostedAgent,
        env: Mapping[str, Any],
        offering: str,
        now_ms: int,
        *,
        usage: Sequence[Mapping[str, Any]] | None = None,
        receipt_id: str | None = None,
        task_id: str | None = None,
    ) -> None:
        """A request admitted by :meth:`check` completed: record its ``requests``
        event (under the request's id) and one declared event per ``usage`` entry
        (under ``receipt_id``, the respond that carried the report, §13.5)."""
        admitted = self._admitted.pop(str(env.get("id")), None)
        if admitted is None:
            return
        sku, owner, agreement = admitted
        common: dict[str, Any] = {
            "provider": hosted.agent_id, "consumer": str(env["from"]), "ts_ms": now_ms, "offering": offering,
            "task_id": task_id,
        }
        try:
            events = [meter_event("requests", MeterClass.OBSERVED, 1, envelope_id=str(env["id"]), **common)]
            for line in usage or ():
                events.append(meter_event(
                    str(line["meter"]), MeterClass.DECLARED, int(line["quantity"]),
                    envelope_id=receipt_id or str(env["id"]), **common,
                ))
        except ValueError as exc:
            log.warning("%s: meter events of %s not recorded: %s", hosted.name, env.get("id"), exc)
            return
        await self._record(hosted, env, sku, owner, agreement, events)

    async def owner_of(self, hosted: HostedAgent, requester: str) -> str | None:
        """The requester's owner the way EXT-2 §7.1 resolves it: the owner of its
        registry manifest (which the registry materializes, defaulting to the
        hosting node). None when the registry does not know it: an unresolvable
        owner holds no agreements."""
        try:
            info = await hosted.node.directory.resolve(hosted, requester)
        except ProtocolError:
            return None
        manifest = info.manifest
        owner = manifest.get("owner")
        if isinstance(owner, str):
            return owner
        # A manifest this node serves itself (a local requester) is the
        # registrant's copy, before the registry's rewrite: owner defaults to
        # the hosting node (§8.3), which is exactly what the registry records.
        node = manifest.get("node")
        node_id = node.get("id") if isinstance(node, Mapping) else None
        return node_id if isinstance(node_id, str) else None

    def _admit(self, env: Mapping[str, Any], sku: Sku, owner: str | None, agreement: Agreement | None = None) -> Sku:
        if self.metering:
            self._admitted[str(env.get("id"))] = (sku, owner, agreement)
            if len(self._admitted) > _ADMITTED_CAP:
                self._admitted.pop(next(iter(self._admitted)))
        return sku

    async def _record_refusal(
        self, hosted: HostedAgent, env: Mapping[str, Any], sku: Sku, owner: str | None,
        agreement: Agreement | None, offering: str, now_ms: int, code: str,
    ) -> None:
        # §13.5 refusal events: declined demand is recorded at quantity 0 (rated to zero).
        try:
            refusal = meter_event(
                "requests", MeterClass.OBSERVED, 0, provider=hosted.agent_id, consumer=str(env["from"]),
                envelope_id=str(env["id"]), ts_ms=now_ms, offering=offering, refusal_code=code,
            )
        except ValueError as exc:
            log.warning("%s: refusal event of %s not recorded: %s", hosted.name, env.get("id"), exc)
        else:
            await self._record(hosted, env, sku, owner, agreement, [refusal])

    async def check(self, hosted: HostedAgent, env: Mapping[str, Any], offering: str, now_ms: int) -> Sku | None:
        """Raise AGREEMENT_REQUIRED (details sku, sku_digest, approval_url) when a
        paid SKU covers ``offering`` and the requester's (``env["from"]``) owner
        holds no live agreement at its current digest; BUDGET_INSUFFICIENT
        (details.estimate: the price) when it does but the request's
        ``cost_ceiling`` cannot cover the SKU's flat price (§19.3). Returns the covering SKU
        (None: free). The refusal, and later the completion, are recorded as
        meter events in the usage log."""
        sku = sku_for(hosted.skus, offering)
        if sku is None:
            return None
        requester = str(env["from"])
        gated = sku.is_paid or (self.gate_free_terms and sku.provider.terms_url is not None)
        if not gated:
            return self._admit(env, sku, None)  # free: nothing to agree to, nothing to attribute
        owner = await self.owner_of(hosted, requester)
        agreement = find_agreement(
            self.store.records(), consumer_owner=owner, seller_agent=hosted.agent_id, sku=sku, at_ms=now_ms
        )
        if agreement is None and owner is not None and self.platform is not None:
            # Not in this node's store: the agreements the owner registered with the
            # platform (cached and single-flight, :mod:`meshnode.node.agreement_lookup`).
            agreement = find_agreement(
                await self.platform.records(hosted, owner, sku.sku),
                consumer_owner=owner, seller_agent=hosted.agent_id, sku=sku, at_ms=now_ms,
            )
        if agreement is not None:
            block = env.get("budget")
            if block is not None:
                try:
                    # §19.3: a flat price the request's cost_ceiling cannot cover is
                    # refused now, with the price as the estimate (a price quote).
                    check_price_within_ceiling(sku.price, parse_budget(block).cost_ceiling)
                except ProtocolError as exc:
                    await self._record_refusal(hosted, env, sku, owner, agreement, offering, now_ms, exc.code)
                    raise
            return self._admit(env, sku, owner, agreement)
        await self._record_refusal(hosted, env, sku, owner, None, offering, now_ms, "AGREEMENT_REQUIRED")
        try:
            url = approval_url(sku, self.approval_surface)
        except ValueError:
            # No approval surface anywhere: still refused (paid work without an
            # agreement never runs), and the message says which key fixes it.
            raise ProtocolError(
                "AGREEMENT_REQUIRED",
                f"{sku.sku!r} is paid and this account holds no agreement to its current terms; the operator "
                "has configured no approval surface ([commerce] approval_url, or the SKU's provider.checkout_url)",
                {"sku": sku.sku, "sku_digest": sku.digest, "approval_url": None},
            ) from None
        raise agreement_required(sku, url)
