"""Prices (§19.1, §19.3): the five closed price shapes and how one is validated.

A price is rated against a named meter (§13.5); money is integer micro-units
in a three-letter currency. A malformed price (or SKU, :mod:`.sku`) is an
INVALID_MANIFEST refusal whose ``details.reason`` is a :class:`CommerceInvalid`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ..budget import Money, budget_insufficient
from ..errors import ProtocolError, shape_error
from ..metering import is_meter_name

__all__ = [
    "CommerceInvalid",
    "Included",
    "Period",
    "Price",
    "PriceModel",
    "Tier",
    "parse_price",
]

_CURRENCY = re.compile(r"[A-Z]{3}")
#: The observed meter a flat price rates (§19.1, §13.5).
_FLAT_METER = "requests"


class PriceModel(StrEnum):
    """The closed five price shapes of §19.1."""

    FREE = "free"
    FLAT = "flat"
    PER_UNIT = "per_unit"
    PACKAGE = "package"
    TIERED = "tiered"


class Period(StrEnum):
    """An aggregation period: a UTC calendar day or month (§19.1)."""

    DAY = "day"
    MONTH = "month"


class CommerceInvalid(StrEnum):
    """Why a SKU or price is malformed: ``details.reason`` of the INVALID_MANIFEST
    refusal (SKUs are manifest content, §8.1). ``details.member`` names the member."""

    NOT_AN_OBJECT = "not_an_object"
    BAD_SKU_ID = "bad_sku_id"
    DUPLICATE_SKU = "duplicate_sku"
    AMBIGUOUS_COVER = "ambiguous_cover"
    BAD_COVERS = "bad_covers"
    COVERS_BOTH = "covers_both"
    COVERS_EMPTY_OFFERINGS = "covers_empty_offerings"
    BAD_OFFERING = "bad_offering"
    MISSING_PROVIDER = "missing_provider"
    BAD_PROVIDER = "bad_provider"
    UNKNOWN_MODEL = "unknown_model"
    #: A member the price's model does not name (``free`` names no money fields;
    #: ``flat`` rates ``requests`` and names no meter).
    FOREIGN_FIELD = "foreign_field"
    MISSING_CURRENCY = "missing_currency"
    BAD_CURRENCY = "bad_currency"
    MISSING_AMOUNT = "missing_amount"
    FLOAT_MONEY = "float_money"
    NEGATIVE_MONEY = "negative_money"
    MISSING_METER = "missing_meter"
    BAD_METER = "bad_meter"
    BAD_PER = "bad_per"
    BAD_SIZE = "bad_size"
    MISSING_PERIOD = "missing_period"
    BAD_PERIOD = "bad_period"
    MISSING_TIERS = "missing_tiers"
    BAD_TIER = "bad_tier"
    TIERS_BOUNDED_TAIL = "tiers_bounded_tail"
    TIERS_NON_MONOTONIC = "tiers_non_monotonic"
    BAD_INCLUDED = "bad_included"
    INCLUDED_WITHOUT_PERIOD = "included_without_period"


def _invalid(reason: CommerceInvalid, member: str, message: str) -> ProtocolError:
    return shape_error("INVALID_MANIFEST", f"invalid SKU: {message} (§19.1)", reason, member)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_int(value: object) -> bool:
    return type(value) is int and value > 0


def _non_negative_int(value: object) -> bool:
    return type(value) is int and value >= 0


def _money_amount(value: object, member: str) -> int:
    """A §19.3 amount: a non-negative integer, never a float however integral."""
    if type(value) is not int:
        if _is_number(value):
            raise _invalid(CommerceInvalid.FLOAT_MONEY, member, "amount_micro must be an integer (§19.3)")
        raise _invalid(CommerceInvalid.MISSING_AMOUNT, member, "amount_micro is required")
    if value < 0:
        raise _invalid(CommerceInvalid.NEGATIVE_MONEY, member, "amount_micro must be non-negative")
    return value


def _period(value: object, member: str, missing: CommerceInvalid) -> Period:
    if value is None:
        raise _invalid(missing, member, f"{member} is required")
    if value not in (Period.DAY.value, Period.MONTH.value):
        raise _invalid(CommerceInvalid.BAD_PERIOD, member, 'period is "day" or "month" (UTC calendar)')
    return Period(value)


# --- prices -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Included:
    """A free allowance deducted before rating, resetting every ``period``."""

    quantity: int
    period: Period

    def to_object(self) -> dict[str, Any]:
        return {"quantity": self.quantity, "period": self.period.value}


@dataclass(frozen=True, slots=True)
class Tier:
    """One graduated tier: units up to ``up_to`` (cumulative; None on the
    unbounded last tier) rate at ``amount_micro`` per ``per`` units."""

    amount_micro: int
    up_to: int | None = None

    def to_object(self) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        if self.up_to is not None:
            obj["up_to"] = self.up_to
        obj["amount_micro"] = self.amount_micro
        return obj


#: The members each model names; anything else on the price is malformed.
_MODEL_FIELDS: Mapping[PriceModel, frozenset[str]] = {
    PriceModel.FREE: frozenset({"model"}),
    PriceModel.FLAT: frozenset({"model", "currency", "amount_micro"}),
    PriceModel.PER_UNIT: frozenset({"model", "currency", "meter", "per", "amount_micro", "included"}),
    PriceModel.PACKAGE: frozenset({"model", "currency", "meter", "size", "amount_micro", "period", "included"}),
    PriceModel.TIERED: frozenset({"model", "currency", "meter", "per", "period", "tiers", "included"}),
}


@dataclass(frozen=True, slots=True)
class Price:
    """A validated §19.1 price. Members a model does not name are None / empty;
    ``per`` keeps what was declared (None = the default 1, see :attr:`unit_per`)."""

    model: PriceModel
    currency: str | None = None
    amount_micro: int | None = None
    meter: str | None = None
    per: int | None = None
    size: int | None = None
    period: Period | None = None
    tiers: tuple[Tier, ...] = ()
    included: Included | None = None

    @property
    def is_free(self) -> bool:
        return self.model is PriceModel.FREE

    @property
    def unit_per(self) -> int:
        return self.per if self.per is not None else 1

    @property
    def rated_meter(self) -> str | None:
        """The meter this price rates: ``requests`` for flat, None for free."""
        if self.model is PriceModel.FLAT:
            return _FLAT_METER
        return self.meter

    def to_object(self) -> dict[str, Any]:
        """The price as declared: members not set are omitted, never null."""
        obj: dict[str, Any] = {"model": self.model.value}
        if self.currency is not None:
            obj["currency"] = self.currency
        if self.meter is not None:
            obj["meter"] = self.meter
        if self.per is not None:
            obj["per"] = self.per
        if self.size is not None:
            obj["size"] = self.size
        if self.amount_micro is not None:
            obj["amount_micro"] = self.amount_micro
        if self.period is not None:
            obj["period"] = self.period.value
        if self.tiers:
            obj["tiers"] = [t.to_object() for t in self.tiers]
        if self.included is not None:
            obj["included"] = self.included.to_object()
        return obj


def _parse_tiers(raw: object) -> tuple[Tier, ...]:
    if not isinstance(raw, list) or not raw:
        raise _invalid(CommerceInvalid.MISSING_TIERS, "price.tiers", "tiered requires a non-empty tiers array")
    tiers: list[Tier] = []
    previous = 0
    for i, item in enumerate(raw):
        member = f"price.tiers[{i}]"
        if not isinstance(item, Mapping) or set(item) - {"up_to", "amount_micro"}:
            raise _invalid(CommerceInvalid.BAD_TIER, member, "a tier is {up_to?, amount_micro}")
        amount = _money_amount(item.get("amount_micro"), f"{member}.amount_micro")
        last = i == len(raw) - 1
        if "up_to" not in item:
            if not last:
                raise _invalid(CommerceInvalid.BAD_TIER, f"{member}.up_to", "only the last tier omits up_to")
            tiers.append(Tier(amount))
            continue
        if last:
            raise _invalid(
                CommerceInvalid.TIERS_BOUNDED_TAIL, f"{member}.up_to", "the last tier must be unbounded (no up_to)"
            )
        up_to = item["up_to"]
        if not _positive_int(up_to):
            raise _invalid(CommerceInvalid.BAD_TIER, f"{member}.up_to", "up_to must be a positive integer")
        assert isinstance(up_to, int)
        if up_to <= previous:
            raise _invalid(CommerceInvalid.TIERS_NON_MONOTONIC, f"{member}.up_to", "up_to must strictly increase")
        previous = up_to
        tiers.append(Tier(amount, up_to))
    return tuple(tiers)


def _parse_included(raw: object) -> Included:
    if not isinstance(raw, Mapping) or set(raw) - {"quantity", "period"}:
        raise _invalid(CommerceInvalid.BAD_INCLUDED, "price.included", "included is {quantity, period}")
    quantity = raw.get("quantity")
    if not _non_negative_int(quantity):
        raise _invalid(
            CommerceInvalid.BAD_INCLUDED, "price.included.quantity", "included.quantity must be a non-negative integer"
        )
    assert isinstance(quantity, int)
    # An allowance without a period never resets.
    period = _period(raw.get("period"), "price.included.period", CommerceInvalid.INCLUDED_WITHOUT_PERIOD)
    return Included(quantity, period)


def parse_price(obj: object) -> Price:
    """Validate a §19.1 price and return it as a :class:`Price`.

    Rules: ``model`` one of the closed five; only the members the model names
    (``free`` names none; ``flat`` rates the ``requests`` meter and names no
    other); money per §19.3 (non-negative integer ``amount_micro``, a
    three-letter ISO 4217 currency, private-use X-codes included); ``meter`` a
    §13.5 meter name; ``per`` and ``size`` positive integers; ``package`` and
    ``tiered`` require ``period``; tiers graduated, ``up_to`` strictly
    increasing, the last tier unbounded; ``included`` requires ``quantity``
    and ``period``.

    Raises ProtocolError INVALID_MANIFEST with ``details.reason`` (a
    :class:`CommerceInvalid` value) and ``details.member``.
    """
    if not isinstance(obj, Mapping):
        raise _invalid(CommerceInvalid.NOT_AN_OBJECT, "price", "price must be an object")
    raw_model = obj.get("model")
    if raw_model not in {m.value for m in PriceModel}:
        raise _invalid(
            CommerceInvalid.UNKNOWN_MODEL, "price.model", "model is one of free, flat, per_unit, package, tiered"
        )
    model = PriceModel(raw_model)
    foreign = sorted(set(obj) - _MODEL_FIELDS[model])
    if foreign:
        raise _invalid(CommerceInvalid.FOREIGN_FIELD, f"price.{foreign[0]}", f"{foreign[0]!r} is not a field of {model}")
    if model is PriceModel.FREE:
        return Price(model)

    currency = obj.get("currency")
    if currency is None:
        raise _invalid(CommerceInvalid.MISSING_CURRENCY, "price.currency", "currency is required")
    if not (isinstance(currency, str) and _CURRENCY.fullmatch(currency)):
        raise _invalid(CommerceInvalid.BAD_CURRENCY, "price.currency", "currency must be an ISO 4217 code")
    amount = None if model is PriceModel.TIERED else _money_amount(obj.get("amount_micro"), "price.amount_micro")
    if model is PriceModel.FLAT:
        return Price(model, currency, amount)

    meter = obj.get("meter")
    if meter is None:
        raise _invalid(CommerceInvalid.MISSING_METER, "price.meter", f"{model} requires the meter it rates")
    if not is_meter_name(meter):
        raise _invalid(CommerceInvalid.BAD_METER, "price.meter", "meter must match [a-z0-9_]{1,64}")
    assert isinstance(meter, str)
    per = obj.get("per")
    if per is not None and not _positive_int(per):
        raise _invalid(CommerceInvalid.BAD_PER, "price.per", "per must be a positive integer")
    size = obj.get("size")
    period: Period | None = None
    tiers: tuple[Tier, ...] = ()
    if model is PriceModel.PACKAGE:
        if not _positive_int(size):
            raise _invalid(CommerceInvalid.BAD_SIZE, "price.size", "package requires a positive integer size")
        period = _period(obj.get("period"), "price.period", CommerceInvalid.MISSING_PERIOD)
    elif model is PriceModel.TIERED:
        period = _period(obj.get("period"), "price.period", CommerceInvalid.MISSING_PERIOD)
        tiers = _parse_tiers(obj.get("tiers"))
    included = _parse_included(obj["included"]) if "included" in obj else None
    return Price(
        model,
        currency,
        amount,
        meter,
        per if isinstance(per, int) else None,
        size if isinstance(size, int) else None,
        period,
        tiers,
        included,
    )


def admission_estimate(price: Price) -> Money | None:
    """What the work costs as far as admission can know (§19.3): a flat price is
    the price of the one request; a metered price (per_unit, package, tiered)
    depends on quantities the work itself produces, and free costs nothing to
    compare (None for both)."""
    if price.model is PriceModel.FLAT and price.amount_micro is not None and price.currency is not None:
        return Money(price.amount_micro, price.currency)
    return None


def check_price_within_ceiling(price: Price, ceiling: Money | None) -> None:
    """Refuse at admission with BUDGET_INSUFFICIENT, carrying the price as the
    estimate, when a request's ``cost_ceiling`` cannot cover a known price
    (§19.3, §7.7): below it, or in another currency (no rate is held between
    currencies, so none is compared: §21's settlement rule). Equality admits;
    no ceiling, or no price known before the work, admits."""
    estimate = admission_estimate(price)
    if ceiling is None or estimate is None:
        return
    if ceiling.currency != estimate.currency:
        raise budget_insufficient(
            estimate, f"the price is in {estimate.currency}; a cost_ceiling in {ceiling.currency} is not compared"
        )
    if ceiling.amount_micro < estimate.amount_micro:
        raise budget_insufficient(
            estimate,
            f"the price ({estimate.amount_micro} micro-{estimate.currency}) exceeds the cost_ceiling "
            f"({ceiling.amount_micro})",
        )
