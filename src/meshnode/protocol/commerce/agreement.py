"""Agreements (§19.5, §12.2): the consumer owner's signature binding an account to a SKU's terms.

Shape, signature, whether a held agreement applies at an instant, and the
admission check that refuses paid work without one (AGREEMENT_REQUIRED).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import quote

from ..budget import DEADLINE_SKEW_TOLERANCE_MS
from ..canonical import CanonicalJSONError
from ..errors import ProtocolError, shape_error
from ..json_copy import copy_json
from ..nkeys import KeyPair, is_valid_public
from ..signing import b64url_decode, b64url_encode, sign_object, verify_object
from ..timeutil import format_ts, try_parse_rfc3339
from .sku import SKU_ID_PATTERN, Sku, sku_for

__all__ = [
    "AGREEMENT_TAG",
    "Agreement",
    "AgreementInvalid",
    "AgreementRecord",
    "Evidence",
    "agreement_applies",
    "agreement_required",
    "approval_url",
    "check_agreement",
    "find_agreement",
    "make_agreement",
    "parse_agreement",
    "sign_agreement",
    "verify_agreement",
]

#: §19.5: the domain tag of an agreement's signed bytes.
AGREEMENT_TAG = "agentmesh-agreement-v1"
#: A SHA-256 digest as unpadded base64url: 43 characters.
_DIGEST_LEN = 43


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
    return shape_error("INVALID_ENVELOPE", f"invalid agreement: {message} (§19.5)", reason, member)


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
        return dict(copy_json(self.document))


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
        expires_at, expires_ms, evidence, copy_json(doc),
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
    unsigned = {k: copy_json(v) for k, v in document.items() if k != "sig"}
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

