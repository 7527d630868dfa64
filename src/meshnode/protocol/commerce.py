"""Commerce (AgentMesh §19.1, §19.4–§19.6, §12.2): SKUs, prices, agreements, rating.

What an agent sells is a **SKU**: what it covers, what it costs (one of five
closed price shapes rated against a named meter, §13.5) and who bills for it.
The SKU's **digest** (SHA-256 over ``agentmesh-sku-v1\\n`` + its canonical
JSON) is the identity of the terms: one moved micro-unit moves it. An
**agreement** is the consumer owner's signature binding their account to a
SKU at one digest; admission refuses paid work without one
(AGREEMENT_REQUIRED). **Rating** folds meter events × the agreed price into
charges: a pure function of its inputs, integer arithmetic only, so replaying
the same events gives the same charges to the micro-unit.

Everything here is pure: no clock (instants are parameters), no I/O, no
registry. Callers resolve the requester's owner, hold the agreement store and
route events; this module judges and computes. Refusal and shape-error
``details.reason`` values follow ``conformance/commerce.json`` where the
fixture names a rule.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import quote

from .budget import DEADLINE_SKEW_TOLERANCE_MS, Money
from .canonical import CanonicalJSONError, canonicalize
from .errors import ProtocolError
from .metering import is_meter_name
from .nkeys import KeyPair, is_valid_public
from .signing import b64url_decode, b64url_encode, sign_object, verify_object
from .timeutil import format_ts, try_parse_rfc3339

__all__ = [
    "AGREEMENT_TAG",
    "SKU_DIGEST_TAG",
    "SKU_ID_PATTERN",
    "Agreement",
    "AgreementInvalid",
    "AgreementRecord",
    "Charge",
    "ChargeOutcome",
    "CommerceInvalid",
    "Evidence",
    "Included",
    "Period",
    "Price",
    "PriceModel",
    "Provider",
    "Rater",
    "Sku",
    "Tier",
    "agreement_applies",
    "agreement_required",
    "approval_url",
    "check_agreement",
    "find_agreement",
    "make_agreement",
    "package_charge",
    "parse_agreement",
    "parse_price",
    "parse_sku",
    "parse_skus",
    "per_unit_charge",
    "period_key",
    "public_sku",
    "ledger_totals",
    "rate_events",
    "rate_stream",
    "sign_agreement",
    "sku_digest",
    "sku_for",
    "tiered_charge",
    "verify_agreement",
]

#: §19.1: the domain tag of a SKU digest's hashed bytes (never inside the SKU).
SKU_DIGEST_TAG = "agentmesh-sku-v1"
#: §19.5: the domain tag of an agreement's signed bytes.
AGREEMENT_TAG = "agentmesh-agreement-v1"
#: §19.1: a SKU id.
SKU_ID_PATTERN = re.compile(r"[a-z0-9-]{1,64}")

_CURRENCY = re.compile(r"[A-Z]{3}")
#: A SHA-256 digest as unpadded base64url: 43 characters.
_DIGEST_LEN = 43
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
    return ProtocolError(
        "INVALID_MANIFEST", f"invalid SKU: {message} (§19.1)", {"reason": reason.value, "member": member}
    )


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


# --- SKUs ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Provider:
    """Who bills for a SKU (§19.4): ``internal`` or an external provider's name."""

    id: str
    terms_url: str | None = None
    checkout_url: str | None = None
    account_ref: str | None = None

    @property
    def is_internal(self) -> bool:
        return self.id == "internal"


def sku_digest(sku: Mapping[str, Any]) -> str:
    """The §19.1 digest of a SKU object as declared: unpadded base64url of
    SHA-256 over ``agentmesh-sku-v1\\n`` + its canonical JSON."""
    return b64url_encode(hashlib.sha256(SKU_DIGEST_TAG.encode("ascii") + b"\n" + canonicalize(sku)).digest())


@dataclass(frozen=True, slots=True)
class Sku:
    """A validated SKU. ``digest`` is computed over the object exactly as
    declared (``document``), so members this version does not read still bind."""

    sku: str
    covers_agent: bool
    offerings: tuple[str, ...]
    price: Price
    provider: Provider
    digest: str
    document: Mapping[str, Any] = field(repr=False, compare=False, hash=False)

    @property
    def is_paid(self) -> bool:
        return not self.price.is_free

    def covers(self, offering: str) -> bool:
        return self.covers_agent or offering in self.offerings

    def to_object(self) -> dict[str, Any]:
        """A copy of the SKU as declared (the digested bytes' object)."""
        return dict(_deep_copy(self.document))


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def _parse_covers(raw: object) -> tuple[bool, tuple[str, ...]]:
    if not isinstance(raw, Mapping):
        raise _invalid(CommerceInvalid.BAD_COVERS, "covers", "covers is {agent: true} or {offerings: [...]}")
    # §8.5: SKUs written before the rename say covers.skills. Read, never
    # rewritten (the digest is over the declared bytes).
    member = "offerings" if "offerings" in raw else "skills" if "skills" in raw else None
    agent = raw.get("agent")
    if "agent" in raw and agent is not True:
        raise _invalid(CommerceInvalid.BAD_COVERS, "covers.agent", "covers.agent is the literal true")
    if agent is True and member is not None:
        raise _invalid(CommerceInvalid.COVERS_BOTH, "covers", "covers is agent XOR offerings")
    if agent is True:
        return True, ()
    if member is None:
        raise _invalid(CommerceInvalid.BAD_COVERS, "covers", "covers names the agent or a list of offerings")
    offerings = raw[member]
    if not isinstance(offerings, list):
        raise _invalid(CommerceInvalid.BAD_COVERS, f"covers.{member}", f"covers.{member} must be an array")
    if not offerings:
        raise _invalid(CommerceInvalid.COVERS_EMPTY_OFFERINGS, f"covers.{member}", "an empty list covers nothing")
    for i, offering in enumerate(offerings):
        if not (isinstance(offering, str) and offering):
            raise _invalid(CommerceInvalid.BAD_OFFERING, f"covers.{member}[{i}]", "offerings are offering ids")
    return False, tuple(offerings)


def _parse_provider(raw: object) -> Provider:
    if raw is None:
        raise _invalid(CommerceInvalid.MISSING_PROVIDER, "provider", "every SKU names who bills for it (§19.4)")
    if not (isinstance(raw, Mapping) and isinstance(raw.get("id"), str) and raw["id"]):
        raise _invalid(CommerceInvalid.BAD_PROVIDER, "provider.id", "provider.id names who bills for it")
    optional: dict[str, str | None] = {}
    for name in ("terms_url", "checkout_url", "account_ref"):
        value = raw.get(name)
        if value is not None and not (isinstance(value, str) and value):
            raise _invalid(CommerceInvalid.BAD_PROVIDER, f"provider.{name}", f"provider.{name} must be a string")
        optional[name] = value
    return Provider(raw["id"], optional["terms_url"], optional["checkout_url"], optional["account_ref"])


def parse_sku(obj: object) -> Sku:
    """Validate one §19.1 SKU and compute its digest.

    ``sku`` matches ``[a-z0-9-]{1,64}``; ``covers`` is ``{agent: true}`` XOR a
    non-empty ``{offerings: [...]}``; ``price`` per :func:`parse_price`;
    ``provider`` present with a non-empty ``id``. Raises ProtocolError
    INVALID_MANIFEST (``details.reason`` a :class:`CommerceInvalid`).
    """
    if not isinstance(obj, Mapping):
        raise _invalid(CommerceInvalid.NOT_AN_OBJECT, "sku", "a SKU must be an object")
    sku_id = obj.get("sku")
    if not (isinstance(sku_id, str) and SKU_ID_PATTERN.fullmatch(sku_id)):
        raise _invalid(CommerceInvalid.BAD_SKU_ID, "sku", "sku must match [a-z0-9-]{1,64}")
    covers_agent, offerings = _parse_covers(obj.get("covers"))
    price = parse_price(obj.get("price"))
    provider = _parse_provider(obj.get("provider"))
    try:
        digest = sku_digest(obj)
    except CanonicalJSONError as exc:
        raise _invalid(CommerceInvalid.NOT_AN_OBJECT, "sku", f"no canonical form: {exc}") from None
    return Sku(sku_id, covers_agent, offerings, price, provider, digest, _deep_copy(obj))


def parse_skus(raw: object) -> tuple[Sku, ...]:
    """Validate a manifest's ``skus`` array: each SKU, ids unique, and no two
    equally specific SKUs covering the same offering (two agent-wide SKUs, or
    one offering listed twice), so :func:`sku_for` is never a guess."""
    if not isinstance(raw, list):
        raise _invalid(CommerceInvalid.NOT_AN_OBJECT, "skus", "skus must be an array")
    skus: list[Sku] = []
    ids: set[str] = set()
    listed: set[str] = set()
    agent_wide = False
    for i, item in enumerate(raw):
        try:
            sku = parse_sku(item)
        except ProtocolError as exc:
            exc.details["member"] = f"skus[{i}].{exc.details.get('member', '')}".rstrip(".")
            raise
        if sku.sku in ids:
            raise _invalid(CommerceInvalid.DUPLICATE_SKU, f"skus[{i}].sku", f"sku id {sku.sku!r} is not unique")
        ids.add(sku.sku)
        if sku.covers_agent:
            if agent_wide:
                raise _invalid(CommerceInvalid.AMBIGUOUS_COVER, f"skus[{i}].covers", "two agent-wide SKUs")
            agent_wide = True
        for offering in sku.offerings:
            if offering in listed:
                raise _invalid(
                    CommerceInvalid.AMBIGUOUS_COVER, f"skus[{i}].covers", f"{offering!r} is named by two SKUs"
                )
            listed.add(offering)
        skus.append(sku)
    return tuple(skus)


def sku_for(skus: Iterable[Sku], offering: str) -> Sku | None:
    """The SKU covering ``offering`` (§19.1): one naming it explicitly beats an
    agent-wide one. None means the offering is free."""
    agent_wide: Sku | None = None
    for sku in skus:
        if offering in sku.offerings:
            return sku
        if sku.covers_agent and agent_wide is None:
            agent_wide = sku
    return agent_wide


def public_sku(sku: Sku) -> dict[str, Any]:
    """The storefront advertisement of a SKU (§8.7, §19.1): id, price, digest."""
    return {"sku": sku.sku, "price": sku.price.to_object(), "digest": sku.digest}


# --- agreements -----------------------------------------------------------------


class AgreementInvalid(StrEnum):
    """Why an agreement document is refused (``details.reason``)."""

    NOT_AN_OBJECT = "not_an_object"
    WRONG_VERSION = "wrong_version"
    BAD_CONSUMER_OWNER = "bad_consumer_owner"
    BAD_SELLER_AGENT = "bad_seller_agent"
    BAD_SKU = "bad_sku"
    MISSING_DIGEST = "missing_digest"
    BAD_DIGEST = "bad_digest"
    BAD_AGREED_AT = "bad_agreed_at"
    BAD_EXPIRES_AT = "bad_expires_at"
    BAD_EVIDENCE = "bad_evidence"
    MISSING_SIG = "missing_sig"
    #: The signature does not verify against ``consumer_owner`` (the signer IS the account).
    BAD_SIGNATURE = "bad_signature"
    #: The document is signed by another owner than the one expected.
    WRONG_OWNER = "wrong_owner"


def _agreement_invalid(reason: AgreementInvalid, member: str, message: str) -> ProtocolError:
    return ProtocolError(
        "INVALID_ENVELOPE", f"invalid agreement: {message} (§19.5)", {"reason": reason.value, "member": member}
    )


@dataclass(frozen=True, slots=True)
class Evidence:
    """The provider-side confirmation backing an agreement (informative, §19.5)."""

    provider: str
    ref: str | None = None


@dataclass(frozen=True, slots=True)
class Agreement:
    """A shape-valid §19.5 agreement. Instants keep the signer's exact strings;
    ``*_ms`` are the same instants in epoch milliseconds."""

    consumer_owner: str
    seller_agent: str
    sku: str
    sku_digest: str
    agreed_at: str
    agreed_at_ms: int
    sig: str
    expires_at: str | None = None
    expires_at_ms: int | None = None
    evidence: Evidence | None = None
    document: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False, hash=False)

    def is_expired(self, now_ms: int) -> bool:
        """Expired from ``expires_at`` on, with no skew tolerance: nothing races
        an expiry, the consumer re-approves."""
        return self.expires_at_ms is not None and now_ms >= self.expires_at_ms

    def to_object(self) -> dict[str, Any]:
        return dict(_deep_copy(self.document))


def _is_digest(value: object) -> bool:
    if not (isinstance(value, str) and len(value) == _DIGEST_LEN):
        return False
    try:
        return len(b64url_decode(value)) == 32 and b64url_encode(b64url_decode(value)) == value
    except ValueError:
        return False


def _instant(doc: Mapping[str, Any], member: str, reason: AgreementInvalid) -> tuple[str, int]:
    raw = doc.get(member)
    us = try_parse_rfc3339(raw)
    if us is None or not isinstance(raw, str):
        raise _agreement_invalid(reason, member, f"{member} must be an RFC 3339 date-time")
    return raw, us // 1000


def parse_agreement(doc: object) -> Agreement:
    """Validate an agreement document's shape (§19.5); the signature is not checked.

    ``v`` the integer 1; ``consumer_owner`` and ``seller_agent`` public user
    nkeys; ``sku`` a SKU id; ``sku_digest`` a SHA-256 digest (unpadded
    base64url); ``agreed_at`` (and ``expires_at``, optional and after it) RFC
    3339; ``evidence`` optional ``{provider, ref?}``; ``sig`` a string. Raises
    ProtocolError INVALID_ENVELOPE with ``details.reason`` an
    :class:`AgreementInvalid`.
    """
    if not isinstance(doc, Mapping):
        raise _agreement_invalid(AgreementInvalid.NOT_AN_OBJECT, "agreement", "an agreement is an object")
    if not (type(doc.get("v")) is int and doc["v"] == 1):
        raise _agreement_invalid(AgreementInvalid.WRONG_VERSION, "v", "v is the integer 1")
    if not is_valid_public(doc.get("consumer_owner")):
        raise _agreement_invalid(AgreementInvalid.BAD_CONSUMER_OWNER, "consumer_owner", "consumer_owner is an owner key")
    if not is_valid_public(doc.get("seller_agent")):
        raise _agreement_invalid(AgreementInvalid.BAD_SELLER_AGENT, "seller_agent", "seller_agent is an agent key")
    sku = doc.get("sku")
    if not (isinstance(sku, str) and SKU_ID_PATTERN.fullmatch(sku)):
        raise _agreement_invalid(AgreementInvalid.BAD_SKU, "sku", "sku must match [a-z0-9-]{1,64}")
    digest = doc.get("sku_digest")
    if digest is None or digest == "":
        raise _agreement_invalid(AgreementInvalid.MISSING_DIGEST, "sku_digest", "an agreement without a digest agrees to nothing")
    if not _is_digest(digest):
        raise _agreement_invalid(AgreementInvalid.BAD_DIGEST, "sku_digest", "sku_digest is a base64url SHA-256")
    assert isinstance(digest, str)
    agreed_at, agreed_ms = _instant(doc, "agreed_at", AgreementInvalid.BAD_AGREED_AT)
    expires_at: str | None = None
    expires_ms: int | None = None
    if "expires_at" in doc:
        expires_at, expires_ms = _instant(doc, "expires_at", AgreementInvalid.BAD_EXPIRES_AT)
        if expires_ms <= agreed_ms:
            raise _agreement_invalid(AgreementInvalid.BAD_EXPIRES_AT, "expires_at", "expires_at must follow agreed_at")
    evidence: Evidence | None = None
    if "evidence" in doc:
        raw = doc["evidence"]
        if not (isinstance(raw, Mapping) and isinstance(raw.get("provider"), str) and raw["provider"]):
            raise _agreement_invalid(AgreementInvalid.BAD_EVIDENCE, "evidence", "evidence names its provider")
        ref = raw.get("ref")
        if ref is not None and not isinstance(ref, str):
            raise _agreement_invalid(AgreementInvalid.BAD_EVIDENCE, "evidence.ref", "evidence.ref is a string")
        evidence = Evidence(raw["provider"], ref)
    sig = doc.get("sig")
    if not (isinstance(sig, str) and sig):
        raise _agreement_invalid(AgreementInvalid.MISSING_SIG, "sig", "an agreement is signed")
    return Agreement(
        doc["consumer_owner"], doc["seller_agent"], sku, digest, agreed_at, agreed_ms, sig,
        expires_at, expires_ms, evidence, _deep_copy(doc),
    )


def verify_agreement(doc: object, *, consumer_owner: str | None = None) -> Agreement:
    """Shape (:func:`parse_agreement`), then the signature against the
    document's own ``consumer_owner`` under ``agentmesh-agreement-v1``.

    A signature by any other key fails: the signer IS the account.
    ``consumer_owner``, when given, must also equal the document's. Signature
    failures raise IDENTITY_MISMATCH (``details.reason`` ``bad_signature`` or
    ``wrong_owner``). An agreement that fails is no agreement: enforcing callers
    treat it as absent, which refuses work rather than authorising it.
    """
    agreement = parse_agreement(doc)
    assert isinstance(doc, Mapping)
    if consumer_owner is not None and agreement.consumer_owner != consumer_owner:
        raise ProtocolError(
            "IDENTITY_MISMATCH", "the agreement belongs to another owner", {"reason": AgreementInvalid.WRONG_OWNER.value}
        )
    try:
        verified = verify_object(doc, AGREEMENT_TAG, agreement.consumer_owner)
    except CanonicalJSONError:  # a member with no canonical form signs nothing
        verified = False
    if not verified:
        raise ProtocolError(
            "IDENTITY_MISMATCH",
            "the agreement's signature does not verify against consumer_owner (§19.5)",
            {"reason": AgreementInvalid.BAD_SIGNATURE.value},
        )
    return agreement


def sign_agreement(document: Mapping[str, Any], owner: KeyPair) -> dict[str, Any]:
    """Sign an agreement document with the consumer's owner key.

    ``consumer_owner`` is set to the key's public key (the signer is the
    account by definition) and any previous ``sig`` replaced. The result is
    validated; raises ProtocolError when the document is malformed.
    """
    unsigned = {k: _deep_copy(v) for k, v in document.items() if k != "sig"}
    unsigned["consumer_owner"] = owner.public_key
    signed = dict(unsigned, sig=sign_object(unsigned, AGREEMENT_TAG, owner))
    parse_agreement(signed)
    return signed


def make_agreement(
    owner: KeyPair,
    *,
    seller_agent: str,
    sku: Sku,
    agreed_at_ms: int,
    expires_at_ms: int | None = None,
    evidence: Evidence | None = None,
) -> dict[str, Any]:
    """Build and sign the owner's agreement to ``sku`` at its current digest."""
    doc: dict[str, Any] = {
        "v": 1,
        "consumer_owner": owner.public_key,
        "seller_agent": seller_agent,
        "sku": sku.sku,
        "sku_digest": sku.digest,
        "agreed_at": format_ts(agreed_at_ms),
    }
    if expires_at_ms is not None:
        doc["expires_at"] = format_ts(expires_at_ms)
    if evidence is not None:
        doc["evidence"] = {"provider": evidence.provider} | ({"ref": evidence.ref} if evidence.ref is not None else {})
    return sign_agreement(doc, owner)


@dataclass(frozen=True, slots=True)
class AgreementRecord:
    """An agreement as a store holds it: with the instant it was revoked, if it
    was. Revocation is prospective: usage before ``revoked_at_ms`` stays rated."""

    agreement: Agreement
    revoked_at_ms: int | None = None


def agreement_applies(
    held: Agreement | AgreementRecord,
    *,
    consumer_owner: str,
    seller_agent: str,
    sku: str,
    sku_digest: str,
    at_ms: int,
    skew_ms: int = DEADLINE_SKEW_TOLERANCE_MS,
) -> bool:
    """Does this agreement authorise this work at ``at_ms``?

    Owner, seller, SKU id and digest all match (a digest mismatch is a missing
    agreement); it is not expired nor revoked at ``at_ms``; and it was agreed
    by then, within ``skew_ms`` (an owner's clock may run ahead of the node's,
    §22.3).
    """
    record = held if isinstance(held, AgreementRecord) else AgreementRecord(held)
    a = record.agreement
    return (
        a.consumer_owner == consumer_owner
        and a.seller_agent == seller_agent
        and a.sku == sku
        and a.sku_digest == sku_digest
        and a.agreed_at_ms - skew_ms <= at_ms
        and not a.is_expired(at_ms)
        and (record.revoked_at_ms is None or at_ms < record.revoked_at_ms)
    )


def find_agreement(
    agreements: Iterable[Agreement | AgreementRecord],
    *,
    consumer_owner: str | None,
    seller_agent: str,
    sku: Sku,
    at_ms: int,
) -> Agreement | None:
    """The first held agreement covering ``sku`` at its current digest at
    ``at_ms``; None for an unresolvable owner (it holds no agreements).

    Hold only agreements that passed :func:`verify_agreement`; this matches
    members and never checks signatures."""
    if consumer_owner is None:
        return None
    for held in agreements:
        if agreement_applies(
            held, consumer_owner=consumer_owner, seller_agent=seller_agent, sku=sku.sku,
            sku_digest=sku.digest, at_ms=at_ms,
        ):
            return held.agreement if isinstance(held, AgreementRecord) else held
    return None


def approval_url(sku: Sku, surface: str | None = None) -> str:
    """Where a human approves ``sku`` (§19.5): the provider's ``checkout_url``,
    else the deployment's approval ``surface`` with ``sku=<id>`` added, else
    the provider's ``terms_url``. Raises ValueError when there is none: a
    refusal without an approval url is a dead end."""
    if sku.provider.checkout_url:
        return sku.provider.checkout_url
    if surface:
        return f"{surface}{'&' if '?' in surface else '?'}sku={quote(sku.sku, safe='')}"
    if sku.provider.terms_url:
        return sku.provider.terms_url
    raise ValueError(f"SKU {sku.sku!r} has no checkout_url and no approval surface is configured")


def agreement_required(sku: Sku, url: str, message: str = "") -> ProtocolError:
    """AGREEMENT_REQUIRED with ``details`` {sku, sku_digest, approval_url} (§19.5, §12.2)."""
    return ProtocolError(
        "AGREEMENT_REQUIRED",
        message or f"{sku.sku!r} is paid and this account holds no agreement to its current terms",
        {"sku": sku.sku, "sku_digest": sku.digest, "approval_url": url},
    )


def check_agreement(
    skus: Iterable[Sku],
    offering: str,
    *,
    consumer_owner: str | None,
    seller_agent: str,
    agreements: Iterable[Agreement | AgreementRecord],
    now_ms: int,
    approval_surface: str | None = None,
    gate_free_terms: bool = False,
) -> Sku | None:
    """The §19.5 admission check, before any work.

    Returns the SKU covering ``offering`` (None: free, nothing to check).
    A paid SKU — or, with ``gate_free_terms``, a free one carrying a
    ``terms_url`` (agreement without money is a terms gate) — needs an
    unexpired, unrevoked agreement of ``consumer_owner`` at the SKU's
    current digest; otherwise raises :func:`agreement_required`. An
    unresolvable owner (None) holds no agreements.
    """
    sku = sku_for(skus, offering)
    if sku is None:
        return None
    gated = sku.is_paid or (gate_free_terms and sku.provider.terms_url is not None)
    if gated and find_agreement(
        agreements, consumer_owner=consumer_owner, seller_agent=seller_agent, sku=sku, at_ms=now_ms
    ) is None:
        raise agreement_required(sku, approval_url(sku, approval_surface))
    return sku


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
