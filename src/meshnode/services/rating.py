"""The rating service (§19.6): meter events × agreed prices, folded into a ledger.

Rating's contract is normative (§19.6): a pure function of the event stream,
the SKUs and the agreements, integer arithmetic, refusals and unagreed usage
rate to zero, a budget's ``cost_ceiling`` binds. This service is that fold
over the mesh's durable meter stream, and nothing else: it settles nothing
(§1.3) and never blocks work.

Intake: ``MESH_METERING`` (:func:`meshnode.transport.streams.metering_stream_config`),
the server's copy of every ``mesh.event.metering.>`` message, read by stream
sequence from the first one on every start. The ledger is therefore *derived*,
never stored: every instance folds the same messages in the same order and
holds the same ledger to the micro-unit (redundant service nodes agree
without coordinating), and a restart rebuilds it by replaying. Its horizon is
the stream's bounds (``[storage] metering_max_bytes``, 90 days).

What is rated (:class:`Ledger`):

``mesh.event.metering.usage`` from a seller's node (:mod:`meshnode.node.commerce`)
    An ``emit`` signed by the responder, ``data`` a §13.5 meter event whose
    ``provider`` is the signer, plus ``data.rating``: the SKU as declared at the
    event (its digest recomputed here), the consumer's owner resolved at
    admission, the owner-signed agreement that admitted it (its signature is
    verified here, so a seller cannot invent one), the request's
    ``cost_ceiling`` and the ``interaction`` it binds (the request id). Meter
    events without ``rating`` (the task manager's, for receipts and analytics)
    are not charged: a price is the seller's to state.
``mesh.event.metering.a2a_charge`` from a calling node (:mod:`meshnode.a2a`)
    What an external A2A agent charged a mesh agent for one call
    (``max(verified spend, contract price)``, already decided by the bridge):
    signed by the calling agent, which thereby records its own debt; kept as a
    ledger line as stated (sku ``a2a:<peer>``, meter ``a2a_calls``).

Horizon: the ledger holds the lines of the events the stream still holds.
When ``MESH_METERING`` discards its oldest events (its bounds above), their
lines go too, with the rating state only they needed (duplicate keys,
interaction spend, earlier periods' aggregates), once they are an eighth of
the ledger. The running service thus holds what a restarted one's replay
would, plus at most that eighth, and its memory follows the stream's
bounds, not its uptime (a line and its keys take ~0.5 KB, its event ~1.7 KB
of the stream: the default 16 MiB is some 10,000 events and ~5 MB of
ledger). Keep a longer record by raising ``metering_max_bytes``.

Idempotent on the deriving envelope: a redelivered or republished meter event
(same ``(meter, envelope_id)``) and a repeated A2A charge (same ``(peer,
task_key)``) are charged once within the horizon.

Subject (the contract):

``mesh.rating.ledger`` (request-reply, queue group ``mesh_rating``)
    Request payload ``{owner?, seller?, period?, charges?, charges_offset?,
    totals_offset?, charges_bytes?, as_of?}``; reply ``{events, charges: [...],
    charges_next, totals: [{consumer_owner, seller_agent, currency, period,
    amount_micro}], totals_next, ledger: {seq, lines, complete, ...}}``.
    ``charges`` and ``totals`` are one page each (no lines with ``charges:
    false``), together within half the connection's ``max_payload``;
    ``charges_next`` / ``totals_next`` are the next page's offsets (null: the
    last), and ``as_of`` (the first page's ``events``) keeps later pages to
    the lines the first one counted (:meth:`LedgerView.answer`).
    ``ledger.complete`` is false when the stream had discarded events before
    this instance read them (``ledger.missed`` of them; ``ledger.since``: the
    ledger is whole from then on): their charges are not in the ledger.
    ``ledger.dropped`` counts the lines let go since because the stream
    discarded their events (see *Horizon*); it changes between two pages
    only when lines were let go in between: a reader then starts over.

    A requester sees the lines whose consumer owner is its owner (the
    registry's ``owner`` of its manifest, or the requester itself when it is
    an owner key, e.g. a node) and the lines of sellers it owns: "who did I
    serve" and "whom did I consume" from one ledger, nothing of third parties.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any, Protocol

from meshnode.pages import entries_within
from meshnode.protocol import subjects
from meshnode.protocol.budget import Money, parse_money
from meshnode.protocol.commerce import (
    Agreement,
    AgreementRecord,
    Charge,
    ChargeOutcome,
    ParsedOnce,
    Rater,
    Sku,
    ledger_totals,
    parse_sku,
    verify_agreement,
)
from meshnode.protocol.envelope import decode_envelope, verify_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.metering import meter_event_problems
from meshnode.protocol.timeutil import format_ts, try_parse_rfc3339
from meshnode.transport.connection import Message
from meshnode.transport.errors import NotFound

from .base import Envelope, ServiceBase, ServiceContext

if TYPE_CHECKING:
    from meshnode.transport.jetstream import StreamReader

__all__ = [
    "A2A_METER",
    "AgreementSource",
    "Ledger",
    "LedgerView",
    "PageRequest",
    "PageRequestError",
    "RatingService",
    "ledger_view",
    "line_filter",
    "page_request",
]

#: The meter name of an A2A charge line (one call = one unit).
A2A_METER = "a2a_calls"
#: How often the service reads what MESH_METERING gained while nobody asked.
_CATCH_UP_S = 2.0
#: ... and how soon it looks again after a look found new events.
_BUSY_CATCH_UP_S = 0.1
#: Meter events read per round trip when catching up (§19.6 replay of a full stream).
_FETCH_BATCH = 256
#: How long one batch may take to arrive (the range is known to be stored).
_FETCH_TIMEOUT_S = 2.0
#: Query answers kept up to date between queries (see RatingService._views).
_VIEWS_KEPT = 16
#: Lines of discarded events are let go once they are this share (1/n) of the ledger.
_FORGET_SHARE = 8


class AgreementSource(Protocol):
    """Agreements the ledger may rate against beyond those the events carry
    (e.g. a platform agreement store): read once per fold."""

    def records(self) -> Iterable[Agreement | AgreementRecord]: ...


def _micro_usd(text: object) -> int | None:
    """A USD decimal string (the A2A charge table's unit) as integer micro-units, floored."""
    try:
        value = Decimal(str(text))
    except (InvalidOperation, ValueError):
        return None
    if not value.is_finite() or value < 0:
        return None
    return int((value * 1_000_000).to_integral_value(rounding="ROUND_FLOOR"))


@dataclass
class Ledger:
    """The pure fold of metering envelopes, in stream order, into charge lines.

    :meth:`fold` takes one envelope (decoded, not yet verified) and returns the
    line it added, or None (a duplicate, or nothing to rate). A fresh Ledger
    fed the same envelopes holds the same lines: that is the replay.
    """

    agreements: Iterable[Agreement | AgreementRecord] = ()
    lines: list[Charge] = field(default_factory=list)
    #: The stream sequence of each line's event, ascending (parallel to ``lines``).
    seqs: list[int] = field(default_factory=list)
    #: Lines let go by :meth:`forget_before` (their events left the stream).
    dropped: int = 0
    stats: Counter[str] = field(default_factory=Counter)
    _rater: Rater = field(init=False)
    _a2a_seen: set[tuple[str, str]] = field(default_factory=set)
    _carried: set[str] = field(default_factory=set)
    #: How an event's SKU is parsed and its agreement verified: once per distinct document.
    _sku: Callable[[object], Sku] = field(default_factory=lambda: ParsedOnce(parse_sku))
    _agreement: Callable[[object], Agreement] = field(default_factory=lambda: ParsedOnce(verify_agreement))

    def __post_init__(self) -> None:
        self._rater = Rater(list(self.agreements))

    def fold(self, env: Mapping[str, Any], seq: int | None = None) -> Charge | None:
        """Rate one envelope, the stream's message ``seq`` (default: the one
        after the last line's)."""
        charge = self._rate(env)
        if charge is not None:
            self.lines.append(charge)
            self.seqs.append(seq if seq is not None else (self.seqs[-1] + 1 if self.seqs else 1))
        return charge

    def held_before(self, first_seq: int) -> int:
        """How many lines rate events stored before stream sequence ``first_seq``."""
        return bisect.bisect_left(self.seqs, first_seq)

    def forget_before(self, first_seq: int) -> int:
        """Let go of the lines of events stored before ``first_seq`` (the
        stream's first message: the rest were discarded), and of the rating
        state only they needed (:meth:`Rater.forget`); returns how many.

        This is the ledger's horizon: it holds what the stream holds, as a
        fresh replay would, so its memory is bounded by the stream's bounds
        and not by how long the service has run. An event of a forgotten
        line, published again, is rated as new (a replay could not know it)."""
        count = self.held_before(first_seq)
        if not count:
            return 0
        gone = self.lines[:count]
        del self.lines[:count]
        del self.seqs[:count]
        self.dropped += count
        self._rater.forget((c for c in gone if c.meter != A2A_METER), self.lines)
        for c in gone:
            if c.meter == A2A_METER and c.interaction is not None:
                self._a2a_seen.discard((c.seller_agent.removeprefix("a2a:"), c.interaction))  # (peer, task_key)
        return count

    def state_size(self) -> int:
        """The entries the fold remembers beside its lines (duplicate keys,
        period aggregates, interaction spend): bounded by :meth:`forget_before`."""
        return self._rater.state_size() + len(self._a2a_seen)

    def _rate(self, env: Mapping[str, Any]) -> Charge | None:
        try:
            verify_envelope(env)
        except ProtocolError:
            self.stats["refused.signature"] += 1
            return None
        payload = env.get("payload")
        if env.get("type") != "emit" or not isinstance(payload, Mapping) or payload.get("domain") != "metering":
            self.stats["ignored"] += 1
            return None
        data = payload.get("data")
        if not isinstance(data, Mapping):
            self.stats["refused.shape"] += 1
            return None
        if payload.get("event_type") == "usage":
            return self._usage(env, data)
        if payload.get("event_type") == "a2a_charge":
            return self._a2a(env, data)
        self.stats["ignored"] += 1  # receipts (task_completed, ...) are not charges
        return None

    def _usage(self, env: Mapping[str, Any], event: Mapping[str, Any]) -> Charge | None:
        context = event.get("rating")
        if not isinstance(context, Mapping):
            self.stats["unpriced"] += 1  # the task manager's events: no price stated
            return None
        if meter_event_problems(event) or event.get("provider") != env.get("from"):
            # A declared meter is the responder's claim: only its own signature states it (§13.5).
            self.stats["refused.event"] += 1
            return None
        try:
            sku = self._sku(context.get("sku"))
            ceiling: Money | None = (
                parse_money(context["cost_ceiling"]) if context.get("cost_ceiling") is not None else None
            )
        except ProtocolError:
            self.stats["refused.rating"] += 1
            return None
        carried = context.get("agreement")
        if carried is not None:
            self._carry(carried, str(event["provider"]))
        owner = context.get("consumer_owner")
        interaction = context.get("interaction")
        charge = self._rater.rate(
            event, sku=sku, consumer_owner=owner if isinstance(owner, str) else None,
            seller_agent=str(event["provider"]), ceiling=ceiling,
            interaction=interaction if isinstance(interaction, str) else None,
        )
        if charge is None:
            self.stats["duplicate"] += 1
            return None
        self.stats[f"rated.{charge.outcome.value}"] += 1
        return charge

    def _carry(self, document: object, seller: str) -> None:
        """Hold an agreement an event carried, once its owner's signature verifies."""
        try:
            agreement = self._agreement(document)
        except ProtocolError:
            self.stats["refused.agreement"] += 1
            return
        if agreement.seller_agent != seller or agreement.sig in self._carried:
            return
        self._carried.add(agreement.sig)
        self._rater.agreements.append(agreement)

    def _a2a(self, env: Mapping[str, Any], data: Mapping[str, Any]) -> Charge | None:
        peer, task_key, agent = data.get("peer"), data.get("task_key"), data.get("agent")
        if not (isinstance(peer, str) and isinstance(task_key, str) and agent == env.get("from")):
            # The calling agent states its own debt; nobody else's word counts.
            self.stats["refused.a2a"] += 1
            return None
        amount = _micro_usd(data.get("charged"))
        currency = data.get("currency")
        at_us = try_parse_rfc3339(data.get("ts"))
        if amount is None or not isinstance(currency, str) or at_us is None:
            self.stats["refused.a2a"] += 1
            return None
        key = (peer, task_key)
        if key in self._a2a_seen:
            self.stats["duplicate"] += 1
            return None
        self._a2a_seen.add(key)
        owner = data.get("consumer_owner")
        message_id = data.get("message_id")
        charge = Charge(
            envelope_id=str(message_id) if isinstance(message_id, str) else task_key,
            meter=A2A_METER, quantity=1, sku=f"a2a:{peer}", sku_digest="",
            consumer_owner=owner if isinstance(owner, str) else None, seller_agent=f"a2a:{peer}",
            amount_micro=amount, currency=currency, outcome=ChargeOutcome.CHARGED, computed_micro=amount,
            interaction=task_key, ts_ms=at_us // 1000,
        )
        self.stats["rated.a2a"] += 1
        return charge


class LedgerView:
    """The ``usage`` answer of one filter over a ledger that grows at its end.

    It scans only the lines added since the last :meth:`update`, so a reader
    paging through a large ledger costs one pass over it, not one per page
    (at 100,000 lines a full pass took ~0.5 s of the service's loop).
    """

    def __init__(self, keep: Callable[[Charge], bool]) -> None:
        self._keep = keep
        self._scanned = 0
        self.matching: list[Charge] = []
        self._totals: dict[tuple[str | None, str, str, str], int] = {}
        self._earlier: tuple[int, dict[tuple[str | None, str, str, str], int]] | None = None

    def update(self, lines: Sequence[Charge]) -> None:
        """Take in the lines added to ``lines`` since the last update."""
        fresh = [c for c in lines[self._scanned:] if self._keep(c)]
        self._scanned = len(lines)
        self.matching.extend(fresh)
        for key, amount in ledger_totals(fresh).items():
            self._totals[key] = self._totals.get(key, 0) + amount

    def answer(self, page: PageRequest | None = None, *, budget: int | None = None) -> dict[str, Any]:
        """One page of the answer (``page``, default: the first, every line).

        ``events`` counts the matching lines and ``totals`` adds them up per
        consumer owner, seller, currency and UTC month; with ``page.as_of``
        both stop at that many lines (the first page's ``events``: later
        pages then answer for the same lines while the ledger grows).
        ``charges`` lists the lines from ``page.charges_offset`` (none when
        ``page.charges`` is false) and ``totals`` the rows from
        ``page.totals_offset``, each as many as encode within half of
        ``budget`` bytes (the smaller of it and ``page.charges_bytes``), with
        ``charges_next`` / ``totals_next`` the next page's offsets (None: the
        last). Lines are appended at the ledger's end and the rows sorted, so
        pages read one after another line up."""
        page = page or PageRequest()
        if page.charges_bytes is not None:
            budget = page.charges_bytes if budget is None else min(budget, page.charges_bytes)
        share = None if budget is None else max(1, budget // 2)
        lines = self.matching
        sums = self._totals
        if page.as_of is not None and page.as_of < len(lines):
            # An earlier state (lines rated since the first page): its totals are
            # summed once and kept for the reader's further pages.
            lines = lines[: page.as_of]
            if self._earlier is None or self._earlier[0] != page.as_of:
                self._earlier = (page.as_of, ledger_totals(lines))
            sums = self._earlier[1]
        rows = [
            {"consumer_owner": k[0], "seller_agent": k[1], "currency": k[2], "period": k[3], "amount_micro": v}
            for k, v in sorted(sums.items(), key=lambda kv: tuple(str(x) for x in kv[0]))
        ]
        totals, totals_next = entries_within(len(rows), rows.__getitem__, page.totals_offset, budget=share)
        charges: list[dict[str, Any]] = []
        charges_next: int | None = None
        if page.charges:
            charges, charges_next = entries_within(
                len(lines), lambda i: lines[i].to_object(), page.charges_offset, budget=share)
        return {"events": len(lines), "charges": charges, "charges_next": charges_next,
                "totals": totals, "totals_next": totals_next}


def line_filter(
    visible: Callable[[Charge], bool] = lambda _c: True,
    owner: str | None = None,
    seller: str | None = None,
    period: str | None = None,
) -> Callable[[Charge], bool]:
    """The lines a ``usage`` query asks for: visible to the requester, of
    consumer owner ``owner``, seller ``seller``, in UTC period prefix ``period``
    (``YYYY``/``YYYY-MM``/``YYYY-MM-DD``)."""

    def keep(c: Charge) -> bool:
        return (
            visible(c)
            and (owner is None or c.consumer_owner == owner)
            and (seller is None or c.seller_agent == seller)
            and (period is None or format_ts(c.ts_ms).startswith(period))
        )

    return keep


def ledger_view(
    lines: Iterable[Charge],
    *,
    visible: Callable[[Charge], bool] = lambda _c: True,
    owner: str | None = None,
    seller: str | None = None,
    period: str | None = None,
    page: PageRequest | None = None,
    budget: int | None = None,
) -> dict[str, Any]:
    """The ``usage`` answer over ``lines`` at once (:class:`LedgerView`'s,
    filtered by :func:`line_filter`): the charges and their totals per
    consumer owner, seller, currency and UTC month."""
    view = LedgerView(line_filter(visible, owner, seller, period))
    view.update(list(lines))
    return view.answer(page, budget=budget)


class PageRequestError(ValueError):
    """A ledger query's paging member is malformed: ``member`` names it."""

    def __init__(self, member: str, message: str) -> None:
        super().__init__(f"{member} {message}")
        self.member = member


@dataclass(frozen=True)
class PageRequest:
    """Which page of a ledger query (see :meth:`LedgerView.answer`)."""

    charges: bool = True
    charges_offset: int = 0
    charges_bytes: int | None = None
    totals_offset: int = 0
    as_of: int | None = None


def page_request(params: Mapping[str, Any]) -> PageRequest:
    """The page a ledger query asks for: ``charges`` (default true),
    ``charges_offset`` and ``totals_offset`` (default 0), ``charges_bytes``
    and ``as_of`` (default none); raises :class:`PageRequestError` for a
    malformed one."""
    charges = params.get("charges", True)
    if not isinstance(charges, bool):
        raise PageRequestError("charges", "must be a boolean")
    offsets: dict[str, int] = {}
    for member, previous in (("charges_offset", "charges_next"), ("totals_offset", "totals_next")):
        value = params.get(member, 0)
        if type(value) is not int or value < 0:
            raise PageRequestError(member, f"must be an integer >= 0 (the {previous} of the previous page)")
        offsets[member] = value
    bounds: dict[str, int | None] = {}
    for member, least in (("charges_bytes", 1), ("as_of", 0)):
        value = params.get(member)
        if value is not None and (type(value) is not int or value < least):
            raise PageRequestError(member, f"must be an integer >= {least}")
        bounds[member] = value
    return PageRequest(charges, offsets["charges_offset"], bounds["charges_bytes"], offsets["totals_offset"],
                       bounds["as_of"])


class RatingService(ServiceBase):
    """The ledger over ``MESH_METERING``; see the module docstring.

    ``owner_of`` maps an agent id to its owner as the registry records it
    (None: unknown); ``agreements`` is an optional further agreement source.
    """

    def __init__(
        self,
        ctx: ServiceContext,
        *,
        owner_of: Callable[[str], str | None] | None = None,
        agreements: AgreementSource | None = None,
    ) -> None:
        super().__init__(ctx, name="rating", queue="mesh_rating")
        self.owner_of = owner_of or (lambda _agent: None)
        self.agreement_source = agreements
        self.ledger = Ledger()
        self._next_seq = 1
        #: Events the stream discarded before this instance read them, and when
        #: the first event after the latest such gap was stored (epoch ms).
        self._missed = 0
        self._whole_since_ms: int | None = None
        #: The answers of the latest queries, kept up to date as the ledger grows
        #: (a reader paging through it asks the same query once per page).
        self._views: dict[tuple[str | None, ...], LedgerView] = {}
        self._lock = asyncio.Lock()
        #: The reader kept between looks while events keep coming, and the
        #: sequence it delivers next (see :meth:`catch_up`).
        self._reader: StreamReader | None = None
        self._reader_at = 0

    async def start(self) -> None:
        if self.running:
            return
        # The stream itself is ensured with the mesh's streams (ensure_mesh_streams).
        self.ledger = Ledger(list(self.agreement_source.records()) if self.agreement_source else ())
        self._next_seq = 1
        self._missed, self._whole_since_ms = 0, None
        self._views.clear()
        self._running = True
        try:
            await self.catch_up()
        except Exception as exc:
            # A stream without a leader yet (a cluster restarted moments ago) must
            # not fail the daemon's start-up: _follow retries, and a query folds
            # what it can before it answers.
            self.log.warning("reading %s at start failed (retried): %s", subjects.MESH_METERING, exc)
        self.spawn(self._follow, "follow")
        await self.serve(subjects.RATING_LEDGER, self._query)
        await self.ctx.connection.flush()

    async def stop(self) -> None:
        await super().stop()
        await self._close_reader()

    async def catch_up(self) -> int:
        """Fold every MESH_METERING message not folded yet, in sequence order;
        returns how many were read. Safe to call concurrently (one reader).

        One stream-info round trip says whether anything is new; what is, is
        read in batches of :data:`_FETCH_BATCH` through an ordered reader
        (:meth:`~meshnode.transport.jetstream.JetStream.reader`), so the first
        fold of a full stream costs one round trip per batch, not per event.
        The reader is kept from one look to the next while events keep coming
        and closed at the first look that finds none: a busy mesh's looks, ten
        a second, made and deleted a consumer each (two more round trips each,
        through a loop busy with the calls that make the events).
        """
        js = self.ctx.connection.jetstream
        read = 0
        async with self._lock:
            if not self.running:
                return 0
            try:
                state = await js.stream_state(subjects.MESH_METERING)
            except NotFound:
                return 0  # the stream is not provisioned (yet): nothing to fold
            last = state.last_seq
            self._follow_horizon(state.first_seq)
            if last < self._next_seq:
                await self._close_reader()  # idle: the broker need not keep a consumer for it
                return 0
            if self._reader is None or self._reader_at != self._next_seq:
                await self._close_reader()
                self._reader = await js.reader(subjects.MESH_METERING, start_seq=self._next_seq)
            reader = self._reader
            try:
                while self.running and self._next_seq <= last:
                    batch = await reader.fetch(min(_FETCH_BATCH, last - self._next_seq + 1), timeout=_FETCH_TIMEOUT_S)
                    if not batch:
                        break  # the rest of the range is gone (deleted messages): next time
                    for stored in batch:
                        if stored.seq < self._next_seq:
                            continue  # already folded (never expected of an ordered read)
                        if stored.seq > self._next_seq:
                            self._discarded(stored.seq - self._next_seq, stored.seq, stored.stored_ms)
                        self._next_seq = stored.seq + 1
                        read += 1
                        try:
                            # Parsed and validated here; the fold verifies the signature
                            # first thing (verifying here too checked every event twice).
                            env = decode_envelope(stored.data, verify=False)
                        except ProtocolError:
                            self.ledger.stats["refused.garbage"] += 1
                            continue
                        self.ledger.fold(env, stored.seq)
            except BaseException:
                await self._close_reader()  # where it stands is unknown: a new one next time
                raise
            self._reader_at = self._next_seq
        return read

    async def _close_reader(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            await reader.close()

    def _follow_horizon(self, first_seq: int) -> None:
        """Forget the lines whose events the stream no longer holds
        (:meth:`Ledger.forget_before`), once they are an eighth of the ledger:
        its memory stays within the stream's bounds plus that eighth, and the
        query views (rebuilt on the next query) are not thrown away on every
        discarded event."""
        prunable = self.ledger.held_before(first_seq)
        if not prunable or prunable < len(self.ledger.lines) // _FORGET_SHARE:
            return
        first_time = not self.ledger.dropped
        self.ledger.forget_before(first_seq)
        self._views.clear()  # their lines and totals include the forgotten lines
        # Once at INFO: on a busy mesh this happens every few seconds from then on.
        self.log.log(
            logging.INFO if first_time else logging.DEBUG,
            "%d ledger line(s) left with their events (%s keeps from seq %d, [storage] metering_max_bytes); "
            "%d held, %d let go since start", prunable, subjects.MESH_METERING, first_seq,
            len(self.ledger.lines), self.ledger.dropped,
        )

    def _discarded(self, count: int, next_seq: int, stored_ms: int | None) -> None:
        """``count`` events before ``next_seq`` were gone when this instance came
        to read them: the stream is bounded ([storage] metering_max_bytes, 90
        days) and discards its oldest. After a restart that is whatever it no
        longer holds; while running, a burst that outran the catch-up."""
        self._missed += count
        self._whole_since_ms = stored_ms
        self.ledger.stats["missed"] += count
        self.log.warning(
            "%s discarded %d event(s) (through seq %d) before the rating service folded them: the ledger "
            "leaves out their charges, and is whole from %s on; [storage] metering_max_bytes bounds what "
            "the mesh keeps", subjects.MESH_METERING, count, next_seq - 1,
            format_ts(stored_ms) if stored_ms is not None else "the next event",
        )

    def coverage(self) -> dict[str, Any]:
        """What the ledger covers: ``complete`` when this instance folded every
        event the stream ever held; else ``missed`` (how many it never saw)
        and ``since`` (from when on it is whole). ``dropped``: lines let go
        because the stream discarded their events since (the ledger's
        horizon, :meth:`Ledger.forget_before`); ``held_from``: the time of
        the oldest line held once any was."""
        held: dict[str, Any] = {"dropped": self.ledger.dropped}
        if self.ledger.dropped and self.ledger.lines:
            held["held_from"] = format_ts(self.ledger.lines[0].ts_ms)
        if not self._missed:
            return {"complete": True, "missed": 0, **held}
        since = format_ts(self._whole_since_ms) if self._whole_since_ms is not None else None
        return {"complete": False, "missed": self._missed, "since": since, **held}

    async def _follow(self) -> None:
        while self.running:
            read = 0
            try:
                read = await self.catch_up()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a disconnect, a leaderless stream: retried
                self.log.warning("reading %s failed: %s", subjects.MESH_METERING, exc)
            # While events keep coming, look again soon: the stream discards its
            # oldest at its bound, and a busy mesh can pass more than the bound
            # (~10,000 events in the default 16 MiB) between two looks 2 s apart.
            await self._pause(_BUSY_CATCH_UP_S if read else _CATCH_UP_S)

    async def _pause(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def _visible_to(self, requester: str) -> Callable[[Charge], bool]:
        owner = self.owner_of(requester) or requester

        def visible(c: Charge) -> bool:
            if c.consumer_owner == owner or c.seller_agent == requester:
                return True
            return not c.seller_agent.startswith("a2a:") and self.owner_of(c.seller_agent) == owner

        return visible

    async def _query(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        payload = env.get("payload")
        params = payload if isinstance(payload, Mapping) else {}
        filters: dict[str, str | None] = {}
        for name in ("owner", "seller", "period"):
            value = params.get(name)
            if value is not None and not isinstance(value, str):
                raise ProtocolError("INVALID_ENVELOPE", f"payload.{name} must be a string", {"member": name})
            filters[name] = value
        try:
            page = page_request(params)
        except PageRequestError as exc:
            raise ProtocolError("INVALID_ENVELOPE", f"payload.{exc}", {"member": exc.member}) from None
        # A page fits the answer's message whatever the requester asks: a busy
        # mesh's ledger outgrows max_payload (about 2,300 lines in 1 MiB), and an
        # answer too large to publish reached nobody (the caller timed out).
        cap = max(1, self.ctx.connection.max_payload // 2)
        with contextlib.suppress(Exception):  # answer from what is folded if the stream is unreadable now
            await self.catch_up()
        requester = str(env["from"])
        key = (requester, self.owner_of(requester), filters["owner"], filters["seller"], filters["period"])
        kept = self._views.pop(key, None) or LedgerView(line_filter(self._visible_to(requester), **filters))
        self._views[key] = kept  # the most recent last
        while len(self._views) > _VIEWS_KEPT:
            del self._views[next(iter(self._views))]
        kept.update(self.ledger.lines)
        view = kept.answer(page, budget=cap)
        view["ledger"] = {"seq": self._next_seq - 1, "lines": len(self.ledger.lines), **self.coverage()}
        return view
