"""Signed statements about identities (AgentMesh §4.4, §8.3, §8.6, §9.7).

Four kinds of statement live here, each a small, self-verifying object:

* the node → agent **vouch** (§4.4): the hosting node's tagged signature that it
  hosts an agent, with an expiry that makes it a lease;
* the **owner attestation** (§8.6): the same shape and construction, signed by
  an owner key instead of the node key;
* the portable **trust attestation** (§9.7): an operator's claim about a node
  (trust tier, role), domain-separated by an in-object ``type`` member;
* the manifest **key claim** (§8.3): the agent's signature over the
  newline-joined binding between its id and its encryption key.

The generic checker for the "standard signed vector" shape the conformance
fixtures use lives in :mod:`.signed_vector` and is re-exported here.

Every verifier here raises :class:`~meshnode.protocol.errors.ProtocolError`
and never anything else for bad input. The error codes follow the spec's
division of blame:

* a vouch or owner attestation that fails (forged, for another agent or node,
  expired, malformed) means the agent is **not vouched for**, which §5.3 (2)
  and §6.2 answer with ``UNAUTHORIZED``. It is deliberately not
  ``IDENTITY_MISMATCH``: that code says the *sender's own* signature or
  ``from`` is wrong (§5.3 (1), §6.2), whereas a vouch is a third party's
  statement about the sender;
* a failing trust attestation is likewise ``UNAUTHORIZED``: the standing it
  claims is not granted;
* a key claim that does not verify makes the manifest unusable for sealing;
  at registration that is ``INVALID_MANIFEST`` (§8.2 makes the claim REQUIRED
  with an encryption key), and a claim served for a different agent than the
  one asked about is ``IDENTITY_MISMATCH``.

``details.reason`` names the precise failure and ``details.field`` the member
at fault, so a caller can log or map them further.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from .canonical import CanonicalJSONError, canonicalize
from .errors import ProtocolError
from .nkeys import KeyPair, NkeyError, Prefix, decode_public, is_valid_public, verify
from .signed_vector import (  # re-exported: the checker's first home was here
    SignatureEncoding,
    SignedVectorError,
    decode_signature,
    encode_signature,
    standard_signed_bytes,
    verify_signed_vector,
)
from .signing import (
    TRUST_ATTESTATION_TAG,
    VOUCH_TAG,
    b64url_decode,
    b64url_encode,
    sign_object,
    verify_object,
)
from .timeutil import format_ts, try_parse_rfc3339

__all__ = [
    "AVAILABILITY_CLASSES",
    "DAY_MS",
    "HOUR_MS",
    "MANIFEST_KEY_CLAIM_TAG",
    "NODE_ROLES",
    "TRUST_TIERS",
    "VOUCH_TTL_DECLARED_MS",
    "VOUCH_TTL_DEFAULT_MS",
    "SignatureEncoding",
    "SignedVectorError",
    "decode_signature",
    "default_vouch_ttl_ms",
    "encode_signature",
    "key_claim_bytes",
    "key_claim_verifies",
    "make_key_claim",
    "make_owner_attestation",
    "make_trust_attestation",
    "make_vouch",
    "renew_at_ms",
    "same_standing_until",
    "sign_key_claim",
    "standard_signed_bytes",
    "verify_key_claim",
    "verify_owner_attestation",
    "verify_signed_vector",
    "verify_trust_attestation",
    "verify_vouch",
    "vouch_needs_renewal",
]

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS

#: §9.2: the short vouch SDKs mint when the node profile declares no availability_class.
VOUCH_TTL_DEFAULT_MS = 72 * HOUR_MS
#: §9.2: the full vouch, earned by declaring an availability_class.
VOUCH_TTL_DECLARED_MS = 30 * DAY_MS

#: §9.7 declared node attribute: the node's expected uptime pattern.
AVAILABILITY_CLASSES = frozenset({"always_on", "intermittent", "on_demand"})
#: §9.7 attested claims and their closed vocabularies.
TRUST_TIERS = frozenset({"verified", "standard", "sandbox"})
NODE_ROLES = frozenset({"participant", "service"})

#: §8.3: the type component that opens the key claim's signed bytes.
MANIFEST_KEY_CLAIM_TAG = "agentmesh-manifest-key-v1"

_VOUCH_MEMBERS = ("node", "agent", "issued_at", "expires_at", "sig")
_TRUST_CLAIMS: Mapping[str, frozenset[str]] = {"trust_tier": TRUST_TIERS, "role": NODE_ROLES}
#: A trust attestation is issued by an operator (or the account acting for it, §4.1).
_ISSUER_PREFIXES = (Prefix.OPERATOR, Prefix.ACCOUNT)


# ── shared helpers ──────────────────────────────────────────────────────────


def _refuse(code: str, reason: str, message: str, field: str | None = None) -> ProtocolError:
    details: dict[str, Any] = {"reason": reason}
    if field is not None:
        details["field"] = field
    return ProtocolError(code, message, details)


def _check_lifetime(issued_at_ms: int, expires_at_ms: int) -> None:
    if not isinstance(issued_at_ms, int) or not isinstance(expires_at_ms, int):
        raise TypeError("issued_at_ms and expires_at_ms are integer epoch milliseconds")
    if expires_at_ms <= issued_at_ms:
        raise ValueError("an attestation must expire after it is issued")


def _lifetime_us(
    obj: Mapping[str, Any], code: str, reason_prefix: str, field_prefix: str
) -> tuple[int, int]:
    """Parse ``issued_at``/``expires_at`` to epoch microseconds, refusing bad values."""

    def instant(member: str) -> int:
        us = try_parse_rfc3339(obj.get(member))
        if us is None:
            raise _refuse(
                code,
                f"{reason_prefix}_malformed",
                f"{member} is not an RFC 3339 date-time",
                f"{field_prefix}{member}",
            )
        return us

    issued = instant("issued_at")
    expires = instant("expires_at")
    if expires < issued:
        raise _refuse(
            code,
            f"{reason_prefix}_malformed",
            "expires_at precedes issued_at",
            f"{field_prefix}expires_at",
        )
    return issued, expires


def _is_expired(expires_us: int, now_ms: int) -> bool:
    # "Has passed" (§4.4, §9.7): the instant of expiry itself is still valid,
    # which is also how the reference SDK compares.
    return expires_us < now_ms * 1000


# ── §9.2 vouch durations and §4.4/§4.8 renewal ──────────────────────────────


def default_vouch_ttl_ms(
    availability_class: str | None = None, *, configured_ttl_ms: int | None = None
) -> int:
    """The vouch lifetime to mint (§9.2).

    An explicitly configured TTL always wins. Otherwise a node that declares an
    ``availability_class`` (§9.7) earns the full 30-day vouch, and every other
    node gets the short 72-hour one, so an abandoned registration ages out of
    discovery in days. An unrecognized class counts as undeclared: durability
    must derive from what is declared, never from a value nobody can read.
    """
    if configured_ttl_ms is not None:
        if configured_ttl_ms <= 0:
            raise ValueError("a configured vouch TTL must be positive")
        return configured_ttl_ms
    if isinstance(availability_class, str) and availability_class in AVAILABILITY_CLASSES:
        return VOUCH_TTL_DECLARED_MS
    return VOUCH_TTL_DEFAULT_MS


def renew_at_ms(attestation: Mapping[str, Any]) -> int:
    """When to re-mint a vouch (or any issued_at/expires_at lease): issued + 2/3 of its life.

    The deadline is derived from the attestation's own lifetime (§4.4, §4.8),
    so one minted under a different policy still gets a proportionate
    deadline, and a whole missed cycle leaves a third of the lifetime to
    recover in. Raises ValueError when the timestamps are unreadable.
    """
    issued = try_parse_rfc3339(attestation.get("issued_at"))
    expires = try_parse_rfc3339(attestation.get("expires_at"))
    if issued is None or expires is None:
        raise ValueError("attestation timestamps are not RFC 3339 date-times")
    issued_ms, expires_ms = issued // 1000, expires // 1000
    life_ms = max(0, expires_ms - issued_ms)
    return issued_ms + (2 * life_ms) // 3


def same_standing_until(held: Mapping[str, Any] | None, fresh: Mapping[str, Any] | None, until_ms: int) -> bool:
    """Whether ``held`` can stand in for ``fresh`` until ``until_ms``: the same
    issuer attests the same claims about the same subject, and ``held`` is still
    valid then. Only the lifetime differs, so a verifier learns the same from
    either. False when either is missing or unreadable."""
    if held is None or fresh is None:
        return False
    if any(held.get(k) != fresh.get(k) for k in ("type", "issuer", "subject", "claims")):
        return False
    expires = try_parse_rfc3339(held.get("expires_at"))
    return expires is not None and expires // 1000 >= until_ms


def vouch_needs_renewal(attestation: Mapping[str, Any], now_ms: int) -> bool:
    """True once ``now_ms`` has reached :func:`renew_at_ms` (or the timestamps are unreadable)."""
    try:
        return now_ms >= renew_at_ms(attestation)
    except ValueError:
        return True


# ── §4.4 the node → agent vouch ─────────────────────────────────────────────


def make_vouch(
    node_key: KeyPair, agent_id: str, issued_at_ms: int, expires_at_ms: int
) -> dict[str, str]:
    """Mint the node's signed vouch for ``agent_id`` (§4.4), tagged ``agentmesh-vouch-v1``."""
    if not is_valid_public(agent_id, Prefix.USER):
        raise ValueError("agent_id is not a user nkey")
    _check_lifetime(issued_at_ms, expires_at_ms)
    vouch = {
        "node": node_key.public_key,
        "agent": agent_id,
        "issued_at": format_ts(issued_at_ms),
        "expires_at": format_ts(expires_at_ms),
    }
    vouch["sig"] = sign_object(vouch, VOUCH_TAG, node_key)
    return vouch


def _verify_lease(
    att: object,
    *,
    now_ms: int,
    signer_members: tuple[str, ...],
    expected_signer: str | None,
    signer_role: Prefix | None,
    expected_agent: str | None,
    accept_legacy_untagged: bool,
    kind: str,
    field_prefix: str,
) -> None:
    """The check shared by the vouch and the owner attestation (§4.4, §8.6)."""
    code = "UNAUTHORIZED"
    if not isinstance(att, Mapping):
        raise _refuse(
            code, f"{kind}_malformed", f"the {kind} is not an object", field_prefix.rstrip(".") or None
        )
    signer_member = next((m for m in signer_members if m in att), signer_members[0])
    for member in (signer_member, "agent", "issued_at", "expires_at", "sig"):
        if not isinstance(att.get(member), str) or not att.get(member):
            raise _refuse(
                code, f"{kind}_malformed", f"the {kind} lacks {member}", f"{field_prefix}{member}"
            )
    signer = att[signer_member]
    if not is_valid_public(signer, signer_role):
        raise _refuse(
            code, f"{kind}_malformed", f"{signer_member} is not a public key", f"{field_prefix}{signer_member}"
        )
    if not is_valid_public(att["agent"], Prefix.USER):
        raise _refuse(code, f"{kind}_malformed", "agent is not a user key", f"{field_prefix}agent")
    if expected_signer is not None and signer != expected_signer:
        raise _refuse(
            code,
            f"{kind}_signer_mismatch",
            f"the {kind} is signed for {signer}, not {expected_signer}",
            f"{field_prefix}{signer_member}",
        )
    if expected_agent is not None and att["agent"] != expected_agent:
        raise _refuse(
            code,
            f"{kind}_agent_mismatch",
            f"the {kind} binds agent {att['agent']}, not {expected_agent}",
            f"{field_prefix}agent",
        )
    try:
        good = verify_object(att, VOUCH_TAG, signer, accept_legacy_untagged=accept_legacy_untagged)
    except CanonicalJSONError:
        good = False
    if not good:
        raise _refuse(
            code,
            f"{kind}_signature_invalid",
            f"the {kind} signature does not verify for {signer}",
            f"{field_prefix}sig",
        )
    _, expires = _lifetime_us(att, code, kind, field_prefix)
    if _is_expired(expires, now_ms):
        raise _refuse(code, f"{kind}_expired", f"the {kind} has expired", f"{field_prefix}expires_at")


def verify_vouch(
    vouch: object,
    *,
    now_ms: int,
    expected_node: str | None = None,
    expected_agent: str | None = None,
    accept_legacy_untagged: bool = False,
) -> None:
    """Verify a node → agent vouch (§4.4); returns None or raises ProtocolError.

    Checks the shape, that the node and agent are the expected ones, the
    tagged signature by ``vouch.node``, and that ``expires_at`` has not passed
    at ``now_ms``. The legacy untagged signature is accepted only when
    ``accept_legacy_untagged`` is set (the 0.2 draft window; refused from 0.3).

    Every failure is ``UNAUTHORIZED`` (the agent is not vouched for, §5.3 (2))
    with ``details.reason`` one of ``vouch_malformed``,
    ``vouch_signer_mismatch``, ``vouch_agent_mismatch``,
    ``vouch_signature_invalid``, ``vouch_expired``.
    """
    _verify_lease(
        vouch,
        now_ms=now_ms,
        signer_members=("node",),
        expected_signer=expected_node,
        signer_role=Prefix.USER,
        expected_agent=expected_agent,
        accept_legacy_untagged=accept_legacy_untagged,
        kind="vouch",
        field_prefix="",
    )


# ── §8.6 the owner attestation ──────────────────────────────────────────────


def make_owner_attestation(
    owner_key: KeyPair, agent_id: str, issued_at_ms: int, expires_at_ms: int
) -> dict[str, str]:
    """Mint an owner → agent attestation (§8.6).

    §8.6 gives it "the same shape as node vouching", so it is emitted exactly
    as a vouch made with the owner key: the signer sits in ``node`` and the
    signature uses the vouch tag. That is also what the reference SDK's
    attestation type carries, so its registry reads ours.
    """
    return make_vouch(owner_key, agent_id, issued_at_ms, expires_at_ms)


def verify_owner_attestation(
    attestation: object,
    *,
    now_ms: int,
    owner: str,
    agent: str,
    accept_legacy_untagged: bool = False,
) -> None:
    """Verify that ``owner`` signed a current attestation binding ``agent`` (§8.6).

    The signer is read from ``owner`` when the attestation spells it that way,
    else from ``node`` (the vouch shape); either way it must equal ``owner``.
    Failures are ``UNAUTHORIZED`` with ``details.reason`` prefixed
    ``owner_attestation_`` and ``details.field`` under ``owner_attestation.``.
    """
    _verify_lease(
        attestation,
        now_ms=now_ms,
        signer_members=("owner", "node"),
        expected_signer=owner,
        signer_role=None,
        expected_agent=agent,
        accept_legacy_untagged=accept_legacy_untagged,
        kind="owner_attestation",
        field_prefix="owner_attestation.",
    )


# ── §9.7 the portable trust attestation ─────────────────────────────────────


def _check_trust_claims(claims: object) -> dict[str, str] | None:
    if not isinstance(claims, Mapping) or not claims:
        return None
    out: dict[str, str] = {}
    for name, value in claims.items():
        vocabulary = _TRUST_CLAIMS.get(name)
        if vocabulary is None or not isinstance(value, str) or value not in vocabulary:
            return None
        out[name] = value
    return out


def make_trust_attestation(
    operator_key: KeyPair,
    subject: str,
    claims: Mapping[str, str],
    issued_at_ms: int,
    expires_at_ms: int,
) -> dict[str, Any]:
    """Mint a portable trust attestation (§9.7): ``operator_key`` claims standing for ``subject``.

    The object names its own format (``type``), issuer, subject, claims
    (``trust_tier`` and/or ``role``), and a REQUIRED expiry; the signature
    covers the canonical JSON of everything but ``sig``. The type tag travels
    inside the object rather than as a byte prefix, as
    conformance/signature-tags.json's ``not_covered`` note pins.
    """
    if operator_key.role not in _ISSUER_PREFIXES:
        raise ValueError("a trust attestation is issued by an operator or account key")
    if not is_valid_public(subject, None):
        raise ValueError("subject is not a public nkey")
    checked = _check_trust_claims(claims)
    if checked is None:
        raise ValueError("claims must name trust_tier and/or role with values from §9.7")
    _check_lifetime(issued_at_ms, expires_at_ms)
    att: dict[str, Any] = {
        "type": TRUST_ATTESTATION_TAG,
        "issuer": operator_key.public_key,
        "subject": subject,
        "claims": checked,
        "issued_at": format_ts(issued_at_ms),
        "expires_at": format_ts(expires_at_ms),
    }
    att["sig"] = b64url_encode(operator_key.sign(canonicalize(att)))
    return att


#: Trust attestations whose signature verified: (issuer, sig, signed body) -> None.
#: One node's attestation rides in every manifest it registers and
#: is checked again at every look-up of a stored one, so a registry verified the
#: same bytes once per agent (~3 % of a 1,000-agent start). Only a verified
#: signature is remembered, for exactly the bytes it covers; expiry, subject and
#: issuer are checked on every call.
_VERIFIED_TRUST: dict[tuple[str, str, bytes], None] = {}
_VERIFIED_TRUST_MAX = 1024


def _trust_signature_valid(att: Mapping[str, Any], issuer: str) -> bool:
    try:
        sig = b64url_decode(att["sig"])
        body = canonicalize({k: v for k, v in att.items() if k != "sig"})
    except (ValueError, CanonicalJSONError):
        return False
    seen = (issuer, att["sig"], body)
    if seen in _VERIFIED_TRUST:
        return True
    # WIRE-NOTES describes a `tag\n` prefix for this object as well; the
    # fixture and the reference SDK sign the bare form. Accept either on
    # input, never emit the prefixed one. The in-object type is checked
    # before this point, so both forms are domain-separated.
    if not (verify(issuer, body, sig) or verify(issuer, TRUST_ATTESTATION_TAG.encode("ascii") + b"\n" + body, sig)):
        return False
    if len(_VERIFIED_TRUST) >= _VERIFIED_TRUST_MAX:
        _VERIFIED_TRUST.clear()  # rare (1,024 issuers' attestations); a clear is safe from any thread
    _VERIFIED_TRUST[seen] = None
    return True


def verify_trust_attestation(
    attestation: object,
    *,
    now_ms: int,
    expected_subject: str | None = None,
    trusted_issuers: Collection[str] | None = None,
) -> dict[str, str]:
    """Verify a portable trust attestation offline (§9.7) and return its claims.

    Refuses (``UNAUTHORIZED``, ``details.reason``): a ``type`` other than
    ``agentmesh-trust-attestation-v1`` (``trust_attestation_unknown_type``),
    a malformed object or claims (``trust_attestation_malformed``), a subject
    other than ``expected_subject`` (``trust_attestation_subject_mismatch``),
    an issuer outside ``trusted_issuers`` when given
    (``trust_attestation_untrusted_issuer``), a bad signature
    (``trust_attestation_signature_invalid``), or a passed ``expires_at``
    (``trust_attestation_expired``). Whether to trust the issuer at all is
    local policy: pass ``trusted_issuers`` to enforce one.
    """
    code = "UNAUTHORIZED"
    if not isinstance(attestation, Mapping):
        raise _refuse(code, "trust_attestation_malformed", "the trust attestation is not an object")
    if attestation.get("type") != TRUST_ATTESTATION_TAG:
        raise _refuse(
            code,
            "trust_attestation_unknown_type",
            f"unrecognized trust attestation type {attestation.get('type')!r}",
            "type",
        )
    for member in ("issuer", "subject", "issued_at", "expires_at", "sig"):
        if not isinstance(attestation.get(member), str) or not attestation.get(member):
            raise _refuse(
                code, "trust_attestation_malformed", f"the trust attestation lacks {member}", member
            )
    issuer, subject = attestation["issuer"], attestation["subject"]
    if not is_valid_public(issuer, None) or _public_role(issuer) not in _ISSUER_PREFIXES:
        raise _refuse(
            code, "trust_attestation_malformed", "issuer is not an operator or account key", "issuer"
        )
    if not is_valid_public(subject, None):
        raise _refuse(code, "trust_attestation_malformed", "subject is not a public key", "subject")
    claims = _check_trust_claims(attestation.get("claims"))
    if claims is None:
        raise _refuse(
            code, "trust_attestation_malformed", "claims are missing or outside §9.7", "claims"
        )
    if expected_subject is not None and subject != expected_subject:
        raise _refuse(
            code,
            "trust_attestation_subject_mismatch",
            f"the attestation is about {subject}, not {expected_subject}",
            "subject",
        )
    if trusted_issuers is not None and issuer not in trusted_issuers:
        raise _refuse(
            code, "trust_attestation_untrusted_issuer", f"issuer {issuer} is not trusted", "issuer"
        )
    if not _trust_signature_valid(attestation, issuer):
        raise _refuse(
            code,
            "trust_attestation_signature_invalid",
            "the trust attestation signature does not verify",
            "sig",
        )
    _, expires = _lifetime_us(attestation, code, "trust_attestation", "")
    if _is_expired(expires, now_ms):
        raise _refuse(
            code, "trust_attestation_expired", "the trust attestation has expired", "expires_at"
        )
    return claims


def _public_role(public_key: str) -> Prefix | None:
    """The role prefix of a public nkey, or None when it is malformed."""
    for role in (Prefix.OPERATOR, Prefix.ACCOUNT, Prefix.USER, Prefix.SERVER, Prefix.CLUSTER):
        try:
            decode_public(public_key, role)
        except NkeyError:
            continue
        return role
    return None


# ── §8.3 the manifest key claim ─────────────────────────────────────────────


def key_claim_bytes(issued_at: str, agent_id: str, encryption_key: str | None) -> bytes:
    """The §8.3 signed bytes: ``type\\nissued_at\\nid\\nencryption_key`` in UTF-8.

    Always four components and three separators, no trailing newline; an
    absent encryption key is the empty string, so the bytes then end at the
    third separator. Raises ValueError when any component contains a newline
    (such a claim is refused, never signed or verified) or is not a string.
    """
    components = (MANIFEST_KEY_CLAIM_TAG, issued_at, agent_id, encryption_key or "")
    for part in components:
        if not isinstance(part, str):
            raise ValueError("key claim components are strings")
        if "\n" in part:
            raise ValueError("a key claim component must not contain a newline (§8.3)")
    try:
        return "\n".join(components).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a key claim component is not valid Unicode") from None


def sign_key_claim(
    agent_key: KeyPair, *, issued_at: str, encryption_key: str | None = None
) -> str:
    """The base64url (unpadded) signature of ``agent_key`` over its own key claim."""
    return b64url_encode(agent_key.sign(key_claim_bytes(issued_at, agent_key.public_key, encryption_key)))


def make_key_claim(
    agent_key: KeyPair,
    *,
    issued_at_ms: int,
    encryption_key: str | None = None,
    trust: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A manifest ``trust`` block carrying a fresh key claim (§8.3).

    Members of an existing ``trust`` block other than ``issued_at`` and
    ``signature`` (e.g. ``tenant``) are preserved.
    """
    issued_at = format_ts(issued_at_ms)
    block = {k: v for k, v in (trust or {}).items() if k not in ("issued_at", "signature")}
    block["issued_at"] = issued_at
    block["signature"] = sign_key_claim(agent_key, issued_at=issued_at, encryption_key=encryption_key)
    return block


def verify_key_claim(manifest: object, *, expected_agent: str | None = None) -> None:
    """Verify a manifest's key claim against its own ``id`` (§8.3); raise ProtocolError.

    ``expected_agent`` is the agent the caller asked about: a claim that
    verifies for some other id is ``IDENTITY_MISMATCH`` (field ``id``), so a
    claim issued for agent B cannot answer for agent A. Everything else (no
    claim, a malformed ``trust.issued_at``, a component with a newline, a
    signature that does not verify) is ``INVALID_MANIFEST`` with
    ``details.field`` naming the member. Passing means exactly: the agent
    whose key is ``id`` declared this ``encryption_key`` (or none) at
    ``trust.issued_at``; nothing else in the manifest is attested.
    """
    code = "INVALID_MANIFEST"
    if not isinstance(manifest, Mapping):
        raise _refuse(code, "key_claim_malformed", "the manifest is not an object", "manifest")
    agent_id = manifest.get("id")
    if not isinstance(agent_id, str) or not is_valid_public(agent_id, Prefix.USER):
        raise _refuse(code, "key_claim_malformed", "id is not an agent key", "id")
    if expected_agent is not None and agent_id != expected_agent:
        raise _refuse(
            "IDENTITY_MISMATCH",
            "key_claim_agent_mismatch",
            f"the manifest is for {agent_id}, not the agent asked about",
            "id",
        )
    encryption_key = manifest.get("encryption_key")
    if encryption_key is not None and not isinstance(encryption_key, str):
        raise _refuse(code, "key_claim_malformed", "encryption_key is not a string", "encryption_key")
    trust = manifest.get("trust")
    if not isinstance(trust, Mapping):
        raise _refuse(code, "key_claim_missing", "the manifest carries no key claim", "trust")
    issued_at, signature = trust.get("issued_at"), trust.get("signature")
    if not isinstance(issued_at, str) or try_parse_rfc3339(issued_at) is None:
        raise _refuse(
            code, "key_claim_malformed", "trust.issued_at is not an RFC 3339 date-time", "trust.issued_at"
        )
    if not isinstance(signature, str) or not signature:
        raise _refuse(code, "key_claim_missing", "the manifest carries no key claim", "trust.signature")
    try:
        signed = key_claim_bytes(issued_at, agent_id, encryption_key)
        sig = decode_signature(signature, SignatureEncoding.BASE64URL)
    except ValueError as exc:
        raise _refuse(code, "key_claim_malformed", str(exc), "trust.signature") from None
    if not verify(agent_id, signed, sig, Prefix.USER):
        raise _refuse(
            code, "key_claim_signature_invalid", "the key claim does not verify against id", "trust.signature"
        )


def key_claim_verifies(manifest: object, *, expected_agent: str) -> bool:
    """True when it is safe to seal to this manifest's ``encryption_key`` as ``expected_agent``'s (§8.3)."""
    try:
        verify_key_claim(manifest, expected_agent=expected_agent)
    except ProtocolError:
        return False
    return True
