"""SKUs (§19.1, §19.4): what an agent sells, its digest, and which SKU covers an offering.

The digest (SHA-256 over ``agentmesh-sku-v1\\n`` + the SKU's canonical JSON)
is computed over the object exactly as declared, so it is the identity of the
terms: one moved micro-unit moves it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..canonical import CanonicalJSONError, canonicalize
from ..errors import ProtocolError
from ..json_copy import copy_json
from ..signing import b64url_encode
from .price import CommerceInvalid, Price, _invalid, parse_price

__all__ = [
    "SKU_DIGEST_TAG",
    "SKU_ID_PATTERN",
    "Provider",
    "Sku",
    "parse_sku",
    "parse_skus",
    "public_sku",
    "sku_digest",
    "sku_for",
]

#: §19.1: the domain tag of a SKU digest's hashed bytes (never inside the SKU).
SKU_DIGEST_TAG = "agentmesh-sku-v1"
#: §19.1: a SKU id.
SKU_ID_PATTERN = re.compile(r"[a-z0-9-]{1,64}")


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
        return dict(copy_json(self.document))


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
    return Sku(sku_id, covers_agent, offerings, price, provider, digest, copy_json(obj))


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

