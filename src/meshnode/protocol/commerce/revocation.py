"""The signed revocation of an agreement (§19.5 "revocable by their signer").

The spec says an agreement is revocable by its signer and that revocation is
prospective, but gives the revocation no shape. meshnode's is the agreement's
own posture: a small document signed by the same owner key, under its own
domain tag (so an agreement's signature can never be replayed as a
revocation, nor the other way round)::

    {"v": 1, "consumer_owner": "U…", "seller_agent": "U…", "sku": "summarize",
     "revoked_at": "<RFC 3339 UTC>", "sig": "<owner key over
     `meshnode-agreement-revocation-v1` + LF + the canonical JSON without sig>"}

It revokes every agreement of ``consumer_owner`` to ``sku`` of ``seller_agent``
agreed at or before ``revoked_at``: usage before that instant stays rated, and
signing again later (a newer ``agreed_at``) is a new agreement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..canonical import CanonicalJSONError
from ..errors import ProtocolError
from ..nkeys import KeyPair, is_valid_public
from ..signing import sign_object, verify_object
from ..timeutil import format_ts, try_parse_rfc3339
from .sku import SKU_ID_PATTERN

__all__ = ["REVOCATION_TAG", "Revocation", "sign_revocation", "verify_revocation"]

#: The domain tag of a revocation's signed bytes (meshnode's; the spec names none).
REVOCATION_TAG = "meshnode-agreement-revocation-v1"


@dataclass(frozen=True, slots=True)
class Revocation:
    """A verified revocation; ``revoked_at_ms`` is ``revoked_at`` in epoch milliseconds."""

    consumer_owner: str
    seller_agent: str
    sku: str
    revoked_at: str
    revoked_at_ms: int
    document: Mapping[str, Any]


def _invalid(member: str, message: str) -> ProtocolError:
    return ProtocolError(
        "INVALID_ENVELOPE", f"invalid revocation: {message}", {"member": f"revocation.{member}"}
    )


def sign_revocation(
    owner: KeyPair, *, seller_agent: str, sku: str, revoked_at_ms: int
) -> dict[str, Any]:
    """The owner's signed revocation of its agreements to ``sku`` of ``seller_agent``."""
    doc: dict[str, Any] = {
        "v": 1,
        "consumer_owner": owner.public_key,
        "seller_agent": seller_agent,
        "sku": sku,
        "revoked_at": format_ts(revoked_at_ms),
    }
    doc["sig"] = sign_object(doc, REVOCATION_TAG, owner)
    verify_revocation(doc)
    return doc


def verify_revocation(doc: object) -> Revocation:
    """Shape, then the signature against the document's own ``consumer_owner``.

    Raises ProtocolError: INVALID_ENVELOPE naming ``revocation.<member>`` for a
    malformed document, IDENTITY_MISMATCH (``details.reason: bad_signature``)
    when the signature is not the owner's.
    """
    if not isinstance(doc, Mapping):
        raise _invalid("", "a revocation is an object")
    if not (type(doc.get("v")) is int and doc["v"] == 1):
        raise _invalid("v", "v is the integer 1")
    owner, seller, sku = doc.get("consumer_owner"), doc.get("seller_agent"), doc.get("sku")
    if not isinstance(owner, str) or not is_valid_public(owner):
        raise _invalid("consumer_owner", "consumer_owner is an owner key")
    if not isinstance(seller, str) or not is_valid_public(seller):
        raise _invalid("seller_agent", "seller_agent is an agent key")
    if not (isinstance(sku, str) and SKU_ID_PATTERN.fullmatch(sku)):
        raise _invalid("sku", "sku must match [a-z0-9-]{1,64}")
    revoked_at = doc.get("revoked_at")
    us = try_parse_rfc3339(revoked_at)
    if us is None or not isinstance(revoked_at, str):
        raise _invalid("revoked_at", "revoked_at must be an RFC 3339 date-time")
    if not (isinstance(doc.get("sig"), str) and doc["sig"]):
        raise _invalid("sig", "a revocation is signed")
    try:
        verified = verify_object(doc, REVOCATION_TAG, owner)
    except CanonicalJSONError:
        verified = False
    if not verified:
        raise ProtocolError(
            "IDENTITY_MISMATCH",
            "the revocation's signature does not verify against consumer_owner (§19.5: only the signer revokes)",
            {"reason": "bad_signature", "member": "revocation.sig"},
        )
    return Revocation(owner, seller, sku, revoked_at, us // 1000, dict(doc))
