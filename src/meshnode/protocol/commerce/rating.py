"""Rating (§19.6): meter events × agreed prices → charges, in integer arithmetic.

A pure function of its inputs: replaying the same events gives the same
charges to the micro-unit.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..budget import Money
from ..timeutil import format_ts, try_parse_rfc3339
from .agreement import Agreement, AgreementRecord, find_agreement
from .price import Period, Price, PriceModel, Tier
from .sku import Sku, sku_for

__all__ = [
    "Charge",
    "ChargeOutcome",
    "Rater",
    "ledger_totals",
    "package_charge",
    "per_unit_charge",
    "period_key",
    "rate_events",
    "rate_stream",
    "tiered_charge",
]

# --- rating arithmetic -------------------------------------------------------------


def per_unit_charge(quantity: int, amount_micro: int, per: int = 1) -> int:
    """floor(quantity × amount_micro / per): no partial micro-unit is charged."""
    return quantity * amount_micro // per


def package_charge(quantity: int, size: int, amount_micro: int) -> int:
    """ceil(quantity / size) × amount_micro: partial packages round up."""
    return -(-quantity // size) * amount_micro


def tiered_charge(quantity: int, tiers: Iterable[Tier], per: int = 1) -> int:
    """Graduated: each tier rates its own span, floored per tier."""
    total = 0
    lower = 0
    for tier in tiers:
        upper = quantity if tier.up_to is None else min(quantity, tier.up_to)
        if upper > lower:
            total += (upper - lower) * tier.amount_micro // per
        if tier.up_to is None or quantity <= tier.up_to:
            break
        lower = tier.up_to
    return total


def _period_cost(price: Price, aggregate: int) -> int:
    """The cost of a period's billable aggregate for the aggregating shapes."""
    if price.model is PriceModel.PACKAGE:
        assert price.size is not None and price.amount_micro is not None
        return package_charge(aggregate, price.size, price.amount_micro)
    return tiered_charge(aggregate, price.tiers, price.unit_per)


def period_key(period: Period, at_ms: int) -> str:
    """The UTC calendar period holding ``at_ms``: ``YYYY-MM-DD`` or ``YYYY-MM``."""
    day = _dt.datetime.fromtimestamp(at_ms // 1000, tz=_dt.UTC)
    return f"{day:%Y-%m-%d}" if period is Period.DAY else f"{day:%Y-%m}"


class ChargeOutcome(StrEnum):
    """Why a rated event was charged what it was."""

    CHARGED = "charged"
    #: The ceiling bound: ``amount_micro`` < ``computed_micro`` (maybe 0).
    CLAMPED = "clamped"
    #: Covered by the price's included quantity.
    INCLUDED = "included"
    FREE = "free"
    #: A refusal event: a record, never a charge (§13.5).
    REFUSED = "refused"
    #: No agreement at the digest current at the event's ts (§19.6).
    NO_AGREEMENT = "no_agreement"
    #: The event's meter is not the one the price rates.
    UNRATED_METER = "unrated_meter"
    #: The interaction's ceiling is in another currency: not comparable, not charged.
    CEILING_CURRENCY = "ceiling_currency"


@dataclass(frozen=True, slots=True)
class Charge:
    """One ledger line: what one meter event was rated at under one SKU."""

    envelope_id: str
    meter: str
    quantity: int
    sku: str
    sku_digest: str
    consumer_owner: str | None
    seller_agent: str
    amount_micro: int
    currency: str | None
    outcome: ChargeOutcome
    computed_micro: int = 0
    interaction: str | None = None
    ts_ms: int = 0

    @property
    def money(self) -> Money | None:
        return None if self.currency is None else Money(self.amount_micro, self.currency)

    def to_object(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "envelope_id": self.envelope_id,
            "meter": self.meter,
            "quantity": self.quantity,
            "sku": self.sku,
            "sku_digest": self.sku_digest,
            "seller_agent": self.seller_agent,
            "amount_micro": self.amount_micro,
            "computed_micro": self.computed_micro,
            "outcome": self.outcome.value,
            "ts": format_ts(self.ts_ms),
        }
        if self.consumer_owner is not None:
            obj["consumer_owner"] = self.consumer_owner
        if self.currency is not None:
            obj["currency"] = self.currency
        if self.interaction is not None:
            obj["interaction"] = self.interaction
        return obj


@dataclass
class Rater:
    """The §19.6 fold: meter events × agreed prices → :class:`Charge` lines.

    Deterministic and replayable: the charges are a function of the events
    (in order), the SKUs, the agreements and the ceilings alone. A fresh
    ``Rater`` over the same inputs gives the same charges to the micro-unit;
    :func:`rate_events` is that replay. All arithmetic is integer.

    * per_unit floors each event's billable quantity;
    * package and tiered rate the period aggregate: an event is charged the
      difference its quantity makes to the aggregate's cost, so a period's
      charges sum to the cost of its aggregate however the usage was split
      (every agreed unit counts toward the aggregate, clamped ones included);
    * ``included`` is consumed in stream order before anything is billable,
      per consumer owner × seller × SKU digest × UTC period (the agreement's
      grain; new terms start fresh);
    * refusal events, events without an applying agreement and events of
      other meters rate to zero; duplicates on ``(meter, envelope_id)`` are
      dropped (:meth:`rate` returns None);
    * the budget ceiling of an interaction binds: its charges never sum
      past ``cost_ceiling`` (with no interaction named, the ceiling binds the
      one event's envelope);
    * an event whose ``ts`` cannot be read is matched against no agreement,
      so it rates to zero.
    """

    agreements: list[Agreement | AgreementRecord] = field(default_factory=list)
    _seen: set[tuple[str, str]] = field(default_factory=set, repr=False)
    _included_used: dict[tuple[str, ...], int] = field(default_factory=dict, repr=False)
    _billable: dict[tuple[str, ...], int] = field(default_factory=dict, repr=False)
    _interaction_charged: dict[str, int] = field(default_factory=dict, repr=False)

    def spent(self, interaction: str) -> int:
        """Micro-units charged so far against one interaction."""
        return self._interaction_charged.get(interaction, 0)

    def state_size(self) -> int:
        """How many entries the fold's memory holds (duplicate keys, period
        aggregates, interaction spend): what :meth:`forget` bounds."""
        return len(self._seen) + len(self._included_used) + len(self._billable) + len(self._interaction_charged)

    def forget(self, dropped: Iterable[Charge], held: Iterable[Charge]) -> None:
        """Let go of the state only ``dropped`` lines still needed; ``held``
        are the lines kept, all later in the stream than the dropped ones.

        Forgotten: the dropped lines' duplicate keys (their events would rate
        as new again), the spend of interactions no held line belongs to, and
        the included-quantity and period aggregates of UTC periods before the
        oldest held line's. Kept: what the held lines' interactions and
        periods still need, so events still to come rate as they would have
        unless they belong to a forgotten interaction or period. None of the
        forgotten state is known to a fresh ``Rater`` replaying the held
        lines' events either: the memory follows the window, not the time
        the fold has run."""
        held = list(held)
        live = {c.interaction or c.envelope_id for c in held}
        for c in dropped:
            self._seen.discard((c.meter, c.envelope_id))
            key = c.interaction or c.envelope_id
            if key not in live:
                self._interaction_charged.pop(key, None)
        dated = [c.ts_ms for c in held if c.ts_ms > 0]
        if not held:
            self._included_used.clear()
            self._billable.clear()
            return
        if not dated:
            return  # no readable time to date the periods by: keep them
        oldest = min(dated)
        current = {10: period_key(Period.DAY, oldest), 7: period_key(Period.MONTH, oldest)}
        for state in (self._included_used, self._billable):
            for stale in [k for k in state if k[-1] < current.get(len(k[-1]), "")]:
                del state[stale]

    def rate(
        self,
        event: Mapping[str, Any],
        *,
        sku: Sku,
        consumer_owner: str | None,
        seller_agent: str | None = None,
        ceiling: Money | None = None,
        interaction: str | None = None,
    ) -> Charge | None:
        """Rate one §13.5 meter event under ``sku`` (the SKU covering it, current at its ts).

        ``seller_agent`` defaults to the event's ``provider``; ``interaction``
        (what a budget ceiling binds: the Task, or the bare request) to its
        ``task_id``. ``ceiling`` is that interaction's ``cost_ceiling``.
        """
        meter = str(event["meter"])
        envelope_id = str(event["envelope_id"])
        key = (meter, envelope_id)
        if key in self._seen:
            return None
        self._seen.add(key)
        quantity = int(event["quantity"])
        seller = seller_agent if seller_agent is not None else str(event["provider"])
        at_us = try_parse_rfc3339(event.get("ts"))
        ts_ms = at_us // 1000 if at_us is not None else 0
        interaction = interaction if interaction is not None else event.get("task_id")
        price = sku.price

        def line(outcome: ChargeOutcome, amount: int = 0, computed: int = 0) -> Charge:
            return Charge(
                envelope_id, meter, quantity, sku.sku, sku.digest, consumer_owner, seller, amount,
                price.currency, outcome, computed, interaction, ts_ms,
            )

        if event.get("refused") is True:
            return line(ChargeOutcome.REFUSED)
        if price.is_free:
            return line(ChargeOutcome.FREE)
        if meter != price.rated_meter:
            return line(ChargeOutcome.UNRATED_METER)
        if find_agreement(
            self.agreements, consumer_owner=consumer_owner, seller_agent=seller, sku=sku, at_ms=ts_ms
        ) is None:
            return line(ChargeOutcome.NO_AGREEMENT)
        assert consumer_owner is not None
        grain = (consumer_owner, seller, sku.sku, sku.digest)

        billable = quantity
        if price.included is not None:
            inc_key = (*grain, "included", period_key(price.included.period, ts_ms))
            used = self._included_used.get(inc_key, 0)
            free_units = min(quantity, max(0, price.included.quantity - used))
            self._included_used[inc_key] = used + free_units
            billable -= free_units

        if price.model is PriceModel.FLAT:
            assert price.amount_micro is not None
            computed = billable * price.amount_micro
        elif price.model is PriceModel.PER_UNIT:
            assert price.amount_micro is not None
            computed = per_unit_charge(billable, price.amount_micro, price.unit_per)
        else:
            assert price.period is not None
            agg_key = (*grain, "aggregate", period_key(price.period, ts_ms))
            before = self._billable.get(agg_key, 0)
            self._billable[agg_key] = before + billable
            computed = _period_cost(price, before + billable) - _period_cost(price, before)

        if billable == 0 and quantity > 0:
            return line(ChargeOutcome.INCLUDED)
        amount = computed
        outcome = ChargeOutcome.CHARGED
        if ceiling is not None:
            if ceiling.currency != price.currency:
                return line(ChargeOutcome.CEILING_CURRENCY, 0, computed)
            already = self._interaction_charged.get(interaction or envelope_id, 0)
            amount = max(0, min(computed, ceiling.amount_micro - already))
            if amount < computed:
                outcome = ChargeOutcome.CLAMPED
        if interaction is not None or ceiling is not None:
            ikey = interaction or envelope_id
            self._interaction_charged[ikey] = self._interaction_charged.get(ikey, 0) + amount
        return line(outcome, amount, computed)


def rate_events(
    events: Iterable[Mapping[str, Any]],
    *,
    sku: Sku,
    consumer_owner: str | None,
    agreements: Iterable[Agreement | AgreementRecord] = (),
    ceiling: Money | None = None,
    interaction: str | None = None,
) -> list[Charge]:
    """Replay ``events`` through a fresh :class:`Rater` under one SKU and owner,
    all of them one interaction (``interaction``, default ``"interaction"``)
    bound by ``ceiling`` when given; duplicates produce no line."""
    rater = Rater(list(agreements))
    charges: list[Charge] = []
    label = interaction if interaction is not None else "interaction"
    for event in events:
        charge = rater.rate(event, sku=sku, consumer_owner=consumer_owner, ceiling=ceiling, interaction=label)
        if charge is not None:
            charges.append(charge)
    return charges


def rate_stream(
    events: Iterable[Mapping[str, Any]],
    *,
    skus_of: Mapping[str, Iterable[Sku]],
    owner_of: Mapping[str, str],
    agreements: Iterable[Agreement | AgreementRecord] = (),
    ceilings: Mapping[str, Money] | None = None,
    interaction_of: Callable[[Mapping[str, Any]], str | None] | None = None,
) -> list[Charge]:
    """Rate a whole §13.5 event stream (what a rating service folds), in order.

    Each event is routed to the SKU of its ``provider`` (``skus_of``: seller
    agent → the SKUs current for the events given) covering its ``offering``
    (an event without one is rated only by an agent-wide SKU); an event no SKU
    covers is free and yields no line. The consumer's owner is
    ``owner_of[event["consumer"]]`` (registry-resolved; missing = unresolvable,
    holds no agreements). ``interaction_of`` names what a budget binds
    (default: the event's ``task_id``), ``ceilings`` that interaction's
    ``cost_ceiling``. Deterministic: a replay gives the same lines.
    """
    rater = Rater(list(agreements))
    held = {seller: tuple(skus) for seller, skus in skus_of.items()}
    charges: list[Charge] = []
    for event in events:
        seller = str(event.get("provider"))
        offering = event.get("offering")
        candidates = held.get(seller, ())
        if isinstance(offering, str):
            sku = sku_for(candidates, offering)
        else:
            sku = next((s for s in candidates if s.covers_agent), None)
        if sku is None:
            continue
        interaction = interaction_of(event) if interaction_of is not None else event.get("task_id")
        ceiling = ceilings.get(interaction) if ceilings is not None and interaction is not None else None
        charge = rater.rate(
            event,
            sku=sku,
            consumer_owner=owner_of.get(str(event.get("consumer"))),
            seller_agent=seller,
            ceiling=ceiling,
            interaction=interaction,
        )
        if charge is not None:
            charges.append(charge)
    return charges


def ledger_totals(
    charges: Iterable[Charge], *, period: Period = Period.MONTH
) -> dict[tuple[str | None, str, str, str], int]:
    """Charged micro-units per (consumer owner, seller agent, currency, UTC
    period): the per-counterparty view ``usage`` reports. Zero-amount lines
    still open their key, so a refused or unagreed counterparty shows as 0."""
    totals: dict[tuple[str | None, str, str, str], int] = {}
    for c in charges:
        if c.currency is None:
            continue
        key = (c.consumer_owner, c.seller_agent, c.currency, period_key(period, c.ts_ms))
        totals[key] = totals.get(key, 0) + c.amount_micro
    return totals
