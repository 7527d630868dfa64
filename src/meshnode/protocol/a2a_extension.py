"""The AGBoss mesh extension of A2A v1.0 (``https://agboss.dev/a2a/mesh/v1``).

The pure core both halves of the A2A bridge share, kept beside the protocol
core so the node can carry A2A call chains without importing the gateway: no
I/O, no asyncio, no a2a-sdk, and the clock is always passed in. What lives here
(see A2A-MESH-EXTENSION.md):

- the envelope, a compact JWS of type ``agboss-mesh`` (EdDSA over Ed25519, or
  ``alg: none`` for a bare claim) carried at ``message.metadata[uri].envelope``;
  :func:`verify_envelope` applies the receiver's checks in the seed's order
  (audience before any signature is looked at; then a known issuer's signature,
  the replay window and the body hash), raising :class:`MeshAuthError` with the
  stable code of the 401;
- the chain checks every envelope gets (:func:`check_chain`);
- the signed run report of type ``agboss-mesh-report`` (:func:`sign_report`,
  :func:`verify_report`);
- ISO 8601 durations of seconds and USD decimal strings (encoded in
  :mod:`meshnode.protocol.a2a_jws`, with the compact JWS, and re-exported here
  as part of the extension's vocabulary);
- how mesh work addresses an A2A peer (``a2a:<peer>``, :func:`peer_name_of`)
  and carries an A2A call chain in ``meta[uri]`` (:func:`chain_meta_of`).

JWS header and payload are serialized as RFC 8785 canonical JSON, so the
same claims always give the same token; a verifier reads whatever JSON it is
given (only the bytes are signed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import nacl.signing

from meshnode.protocol.a2a_jws import (
    format_duration,
    format_instant,
    format_usd,
    instant_s,
    jws,
    parse_duration,
    parse_jws,
    parse_usd,
    parse_verify_key,
    verify_signature,
)
from meshnode.protocol.canonical import CanonicalJSONError, canonicalize
from meshnode.protocol.nkeys import NkeyError, decode_public, is_valid_public

__all__ = [
    "A2A_TARGET_PREFIX",
    "DEFAULT_EXPIRES_IN",
    "ENVELOPE_TYP",
    "EXTENSION_URI",
    "CLOCK_SKEW_S",
    "REPORT_TYP",
    "SCHEMA",
    "TASK_ENVELOPE_HEADER",
    "TASK_METHODS",
    "Budget",
    "ChainRefusal",
    "EnvelopeCheck",
    "IssuerTrust",
    "MeshAuthError",
    "ReplayCache",
    "ReportClaims",
    "ReportInvalid",
    "body_hash",
    "build_envelope_claims",
    "chain_meta_of",
    "check_chain",
    "extend_chain",
    "format_duration",
    "format_instant",
    "format_usd",
    "parse_duration",
    "parse_usd",
    "parse_verify_key",
    "peer_name_of",
    "sign_envelope",
    "sign_report",
    "task_operation",
    "unsecured_envelope",
    "verify_envelope",
    "verify_report",
]

EXTENSION_URI = "https://agboss.dev/a2a/mesh/v1"
ENVELOPE_TYP = "agboss-mesh"
REPORT_TYP = "agboss-mesh-report"
SCHEMA = 1
DEFAULT_EXPIRES_IN = 60.0
"""The replay window when an envelope names none (``PT60S``)."""

#: How far two applications' clocks may disagree by default: an envelope
#: issued this far in the future still counts, and a sender's ``expiresIn``
#: may exceed the seed's PT60S by as much, never more (``[a2a] clock_skew``).
CLOCK_SKEW_S = 30.0

#: The HTTP header (an A2A service parameter) carrying a task-operation
#: envelope: meshnode's profile of the extension, which defines envelopes on
#: messages only. GetTask, CancelTask and SubscribeToTask on a trusted
#: caller's task prove the caller with an envelope whose ``bodyHash`` is over
#: :func:`task_operation` (so it proves nothing for another task or method).
TASK_ENVELOPE_HEADER = "AGBoss-Mesh-Envelope"
#: The JSON-RPC methods that act on existing tasks, answered to their caller only
#: (ListTasks names no task: its proof is over ``{"method": "ListTasks"}``).
TASK_METHODS = ("GetTask", "CancelTask", "SubscribeToTask", "ListTasks")

# The 401 codes, in the order the checks run.
AUDIENCE_MISMATCH = "mesh.audience-mismatch"
AUDIENCE_MISSING = "mesh.audience-missing"
SIGNATURE_INVALID = "mesh.signature-invalid"
ENVELOPE_EXPIRED = "mesh.envelope-expired"
BODY_MISMATCH = "mesh.body-mismatch"
# The two REJECTED limits.
LIMIT_LOOP = "limit.mesh-loop"
LIMIT_HOPS = "limit.hops"


class MeshAuthError(Exception):
    """An envelope failed a check that answers 401; ``code`` is the stable code
    (``mesh.audience-mismatch`` …) and the only fact that may leave."""

    def __init__(self, code: str, reason: str = "") -> None:
        super().__init__(f"{code}: {reason}" if reason else code)
        self.code = code
        self.reason = reason


class ReportInvalid(ValueError):
    """A run report that must not be believed (bad signature, other task, other
    body, malformed). The caller then charges the contract price alone."""


# --- the body hash and the envelope JWS --------------------------------------------


def body_hash(message: Mapping[str, Any]) -> str:
    """``sha256:<hex>`` of the RFC 8785 canonical JSON of the A2A Message as sent,
    with ``metadata[EXTENSION_URI]`` removed (and ``metadata`` when it is then
    empty). Give it the parsed JSON of the message as it was on the wire, not a
    re-serialization through some model: the hash is over what was sent."""
    msg = dict(message)
    meta = msg.get("metadata")
    if isinstance(meta, Mapping) and EXTENSION_URI in meta:
        rest = {k: v for k, v in meta.items() if k != EXTENSION_URI}
        if rest:
            msg["metadata"] = rest
        else:
            del msg["metadata"]
    return "sha256:" + hashlib.sha256(canonicalize(msg)).hexdigest()


def sign_envelope(claims: Mapping[str, Any], signing_key: nacl.signing.SigningKey) -> str:
    """A compact JWS ``{"alg":"EdDSA","typ":"agboss-mesh"}`` over ``claims``."""
    return jws({"alg": "EdDSA", "typ": ENVELOPE_TYP}, claims, signing_key)


def unsecured_envelope(claims: Mapping[str, Any]) -> str:
    """An unsecured JWS (``alg: none``): a claim, never trusted. Its signature
    part is empty (``header.payload.``)."""
    return jws({"alg": "none", "typ": ENVELOPE_TYP}, claims, None)


# --- the envelope ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Budget:
    """What the caller may still spend (``budget.remaining``)."""

    remaining: Decimal
    currency: str = "USD"


@dataclass(frozen=True, slots=True)
class EnvelopeCheck:
    """An envelope that passed the 401 checks.

    ``trusted`` is true only when it was signed EdDSA by a known, allowed
    issuer and the signature verified: only then do ``budget``, ``deadline_s``
    and ``origin`` bind anything. ``call_chain`` is checked on every envelope,
    trusted or not (:func:`check_chain`).
    """

    claims: dict[str, Any]
    trusted: bool
    issuer: str | None
    signed: bool
    budget: Budget | None = None
    deadline_s: float | None = None
    origin: dict[str, Any] | None = None
    call_chain: tuple[dict[str, Any], ...] = ()
    body_hash: str | None = None
    issued_at_s: float | None = None
    #: The end of its replay window (epoch seconds), when it has one.
    expires_at_s: float | None = None
    #: What tells this token from any other (``sha256:`` of the compact JWS).
    token_id: str = ""


IssuerKeys = Callable[[str], nacl.signing.VerifyKey | None]


def _malformed(reason: str) -> MeshAuthError:
    # A token that is not a well-formed schema-1 agboss-mesh JWS has no
    # signature anyone could accept: it answers as an invalid signature.
    return MeshAuthError(SIGNATURE_INVALID, reason)


def verify_envelope(
    token: object,
    *,
    own_application: str,
    issuer_keys: IssuerKeys,
    now: float,
    message: Mapping[str, Any],
    clock_skew_s: float = CLOCK_SKEW_S,
) -> EnvelopeCheck:
    """Check an envelope in the seed's order and return what it says.

    1. audience: addressed to another application → ``mesh.audience-mismatch``;
       signed and addressed to none → ``mesh.audience-missing`` (before any
       signature is looked at);
    2. signature: signed by an issuer ``issuer_keys`` knows → it must verify
       (``mesh.signature-invalid``); a signature by an issuer it does not know
       (or ``alg: none``) makes the envelope a claim: accepted, never trusted;
       a malformed token or an unknown ``alg``/``typ`` is ``mesh.signature-invalid``;
    3. the replay window ``issuedAt`` + ``expiresIn`` (default and at most the
       seed's PT60S, plus ``clock_skew_s``, which is also how far in the future
       ``issuedAt`` may be) → ``mesh.envelope-expired``; required when signed
       (a replay inside the window is the caller's :class:`ReplayCache`'s to refuse);
    4. ``bodyHash`` against :func:`body_hash` of ``message`` (the raw JSON as
       received) → ``mesh.body-mismatch``; required when signed.

    ``token`` is whatever the message carried: anything but a compact JWS
    string is malformed. ``now`` is epoch seconds. Raises :class:`MeshAuthError`.
    """
    if not isinstance(token, str):
        raise _malformed("a JWS is a string")
    try:
        parsed = parse_jws(token)
    except ValueError as exc:
        raise _malformed(str(exc)) from None
    header, claims = parsed.header, parsed.claims
    alg = header.get("alg")
    signed = alg != "none"

    # 1. Audience, before the signature is so much as looked at.
    audience = claims.get("audience")
    if audience is not None and audience != own_application:
        raise MeshAuthError(AUDIENCE_MISMATCH, "envelope addressed to another application")
    if audience is None and signed:
        raise MeshAuthError(AUDIENCE_MISSING, "a signed envelope names no audience")

    # 2. Shape and signature.
    if header.get("typ") != ENVELOPE_TYP:
        raise _malformed("typ is not agboss-mesh")
    if alg not in ("EdDSA", "none"):
        raise _malformed(f"unsupported alg {alg!r}")
    if not signed and parsed.signature:
        raise _malformed("an unsecured JWS carries no signature")
    if claims.get("schema", SCHEMA) != SCHEMA:
        raise _malformed("unknown envelope schema")
    issuer = claims.get("issuer")
    if issuer is not None and not isinstance(issuer, str):
        raise _malformed("issuer is not a string")
    trusted = False
    if signed:
        if not isinstance(issuer, str) or not issuer:
            raise _malformed("a signed envelope names no issuer")
        key = issuer_keys(issuer)
        if key is not None:
            if not verify_signature(parsed, key):
                raise MeshAuthError(SIGNATURE_INVALID, "signature does not verify")
            trusted = True

    # 3. Replay window.
    issued_raw = claims.get("issuedAt")
    issued_at: float | None = None
    expires_at: float | None = None
    if issued_raw is not None or signed:
        issued_at = instant_s(issued_raw)
        if issued_at is None:
            raise MeshAuthError(ENVELOPE_EXPIRED, "issuedAt missing or malformed")
        expires_raw = claims.get("expiresIn")
        try:
            expires_in = DEFAULT_EXPIRES_IN if expires_raw is None else parse_duration(expires_raw)
        except ValueError:
            raise MeshAuthError(ENVELOPE_EXPIRED, "expiresIn malformed") from None
        # A sender cannot widen the window past the seed's: a long window is a
        # long replay opportunity.
        expires_in = min(expires_in, DEFAULT_EXPIRES_IN + clock_skew_s)
        expires_at = issued_at + expires_in
        if not issued_at - clock_skew_s <= now <= expires_at:
            raise MeshAuthError(ENVELOPE_EXPIRED, "outside the replay window")

    # 4. Body.
    claimed_hash = claims.get("bodyHash")
    if claimed_hash is not None or signed:
        try:
            actual = body_hash(message)
        except CanonicalJSONError:
            raise MeshAuthError(BODY_MISMATCH, "message has no canonical form") from None
        if claimed_hash != actual:
            raise MeshAuthError(BODY_MISMATCH, "bodyHash does not match the message")

    return EnvelopeCheck(
        claims=claims,
        trusted=trusted,
        issuer=issuer,
        signed=signed,
        budget=_parse_budget(claims.get("budget")),
        deadline_s=_parse_deadline(claims.get("deadline")),
        origin=_parse_origin(claims.get("origin")),
        call_chain=_parse_chain(claims.get("callChain")),
        body_hash=claimed_hash if isinstance(claimed_hash, str) else None,
        issued_at_s=issued_at,
        expires_at_s=expires_at,
        token_id="sha256:" + hashlib.sha256(token.encode("ascii")).hexdigest(),
    )


class ReplayCache:
    """The trusted envelopes seen inside their replay window, so each is
    accepted once: a replay (the very same token again) is refused
    ``mesh.envelope-expired`` with reason "replayed". In memory and bounded
    (``max_entries``; the oldest goes first): a restart forgets, and the
    window is short (PT60S plus the skew)."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._until: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._until)

    def check(self, check: EnvelopeCheck, *, now: float) -> None:
        """Remember a trusted envelope; raise :class:`MeshAuthError` if it was seen.
        Claims (untrusted) bind nothing and are not remembered."""
        if not check.trusted or check.expires_at_s is None:
            return
        seen = self._until.get(check.token_id)
        if seen is not None and seen >= now:
            raise MeshAuthError(ENVELOPE_EXPIRED, "replayed: this envelope was already used")
        if len(self._until) >= self.max_entries or len(self._until) % 1024 == 1023:
            self._prune(now)
        while len(self._until) >= self.max_entries:
            self._until.pop(next(iter(self._until)))
        self._until[check.token_id] = check.expires_at_s

    def _prune(self, now: float) -> None:
        for token_id in [t for t, until in self._until.items() if until < now]:
            del self._until[token_id]


def _parse_budget(value: object) -> Budget | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _malformed("budget is not an object")
    currency = value.get("currency", "USD")
    if currency != "USD":
        raise _malformed("budget currency is not USD")
    try:
        return Budget(parse_usd(value.get("remaining")), "USD")
    except ValueError:
        raise _malformed("budget.remaining is not a USD decimal string") from None


def _parse_deadline(value: object) -> float | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _malformed("deadline is not an object")
    try:
        return parse_duration(value.get("remaining"))  # type: ignore[arg-type]
    except ValueError:
        raise _malformed("deadline.remaining is not an ISO 8601 duration") from None


def _parse_origin(value: object) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _malformed("origin is not an object")
    return dict(value)


def _parse_chain(value: object) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(e, Mapping) for e in value):
        raise _malformed("callChain is not a list of objects")
    out: list[dict[str, Any]] = []
    for entry in value:
        if not isinstance(entry.get("application"), str):
            raise _malformed("a callChain entry names no application")
        out.append(dict(entry))
    return tuple(out)


def task_operation(method: str, task_id: str | None) -> dict[str, str]:
    """What a task-operation envelope's ``bodyHash`` is over: ``{"method", "id"}``
    (``{"method"}`` alone for ListTasks, which names no task)."""
    return {"method": method} if task_id is None else {"method": method, "id": task_id}


def build_envelope_claims(
    *,
    issuer: str,
    audience: str | None,
    now: float,
    message: Mapping[str, Any],
    call_chain: Sequence[Mapping[str, Any]] = (),
    origin: Mapping[str, Any] | None = None,
    budget_remaining: Decimal | str | None = None,
    deadline_remaining_s: float | None = None,
    expires_in_s: float = DEFAULT_EXPIRES_IN,
) -> dict[str, Any]:
    """Schema-1 envelope claims for ``message`` (its body hash computed here).
    ``call_chain`` is the chain as it should be sent: already extended by the
    sending hop (:func:`extend_chain`)."""
    claims: dict[str, Any] = {
        "schema": SCHEMA,
        "issuer": issuer,
        "callChain": [dict(e) for e in call_chain],
        "issuedAt": format_instant(now),
        "expiresIn": format_duration(expires_in_s),
        "bodyHash": body_hash(message),
    }
    if audience is not None:
        claims["audience"] = audience
    if origin is not None:
        claims["origin"] = dict(origin)
    if budget_remaining is not None:
        claims["budget"] = {"remaining": format_usd(Decimal(budget_remaining)), "currency": "USD"}
    if deadline_remaining_s is not None:
        claims["deadline"] = {"remaining": format_duration(max(0.0, deadline_remaining_s))}
    return claims


# --- issuer trust ---------------------------------------------------------------


@dataclass(frozen=True)
class IssuerTrust:
    """Which issuers are known, and their keys: an ``issuer_keys`` callable.

    ``keys`` are the configured issuers (name → key). An issuer id that is a
    mesh agent id (a user nkey) carries its own key and needs no configuration,
    but like every issuer it must pass ``allow``: ``None`` allows exactly the
    configured issuers; a collection allows the ids it lists (configured
    names or nkeys), and ``"*"`` in it allows every configured issuer and every
    nkey issuer.
    """

    keys: Mapping[str, nacl.signing.VerifyKey] = field(default_factory=dict)
    allow: Collection[str] | None = None

    def allowed(self, issuer: str) -> bool:
        if self.allow is None:
            return issuer in self.keys
        return "*" in self.allow or issuer in self.allow

    def __call__(self, issuer: str) -> nacl.signing.VerifyKey | None:
        if not self.allowed(issuer):
            return None
        key = self.keys.get(issuer)
        if key is not None:
            return key
        if is_valid_public(issuer):
            try:
                return nacl.signing.VerifyKey(decode_public(issuer))
            except NkeyError:  # pragma: no cover - is_valid_public said yes
                return None
        return None


# --- the chain ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChainRefusal:
    """A REJECTED task's reason: ``code`` (``limit.mesh-loop`` | ``limit.hops``)
    and the ``details`` that go out in ``status.message.metadata[uri]``."""

    code: str
    details: dict[str, Any]

    def metadata(self) -> dict[str, Any]:
        return {"code": self.code, "details": self.details}


def check_chain(
    call_chain: Sequence[Mapping[str, Any]],
    *,
    application: str,
    skill: str | None,
    max_hops: int,
) -> ChainRefusal | None:
    """The chain check every envelope gets. This receiver's own
    (``application``, ``skill``) already in the chain → ``limit.mesh-loop``; a
    chain already ``max_hops`` long → ``limit.hops``. An entry's skill is its
    ``start``; with ``skill`` None any entry of ``application`` is a loop."""
    chain = [dict(e) for e in call_chain]
    entry: dict[str, Any] = {"application": application}
    if skill is not None:
        entry["start"] = skill
    for e in chain:
        if e.get("application") == application and (skill is None or e.get("start") == skill):
            return ChainRefusal(LIMIT_LOOP, {"entry": entry, "chain": chain})
    if len(chain) >= max_hops:
        return ChainRefusal(LIMIT_HOPS, {"entry": entry, "chain": chain, "maxMeshHops": max_hops})
    return None


def extend_chain(
    call_chain: Sequence[Mapping[str, Any]],
    *,
    application: str,
    start: str | None,
    execution_id: str,
) -> list[dict[str, Any]]:
    """The chain with this hop appended (the caller last)."""
    entry: dict[str, Any] = {"application": application, "executionId": execution_id}
    if start is not None:
        entry["start"] = start
    return [*(dict(e) for e in call_chain), entry]


# --- the run report -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReportClaims:
    """A verified run report."""

    issuer: str
    execution_id: str
    spend_total: Decimal
    currency: str
    body_hash: str
    issued_at: str
    claims: dict[str, Any]


def sign_report(
    *,
    issuer: str,
    execution_id: str,
    spend_total: str,
    currency: str = "USD",
    body_hash: str,
    issued_at: float | str,
    signing_key: nacl.signing.SigningKey,
) -> str:
    """The receiver's signed run report (``typ: agboss-mesh-report``, schema 1).
    ``issued_at`` is epoch seconds or an RFC 3339 string; ``spend_total`` a USD
    decimal string."""
    parse_usd(spend_total)
    claims = {
        "schema": SCHEMA,
        "issuer": issuer,
        "executionId": execution_id,
        "spend": {"total": spend_total, "currency": currency},
        "bodyHash": body_hash,
        "issuedAt": issued_at if isinstance(issued_at, str) else format_instant(issued_at),
    }
    return jws({"alg": "EdDSA", "typ": REPORT_TYP}, claims, signing_key)


def verify_report(
    token: str,
    *,
    issuer_key: nacl.signing.VerifyKey,
    expected_body_hash: str,
    expected_execution_id: str,
) -> ReportClaims:
    """Verify a run report against the issuer's key, the caller's own bodyHash
    and its task's id. Raises :class:`ReportInvalid` naming what is wrong."""
    try:
        parsed = parse_jws(token)
    except ValueError as exc:
        raise ReportInvalid(str(exc)) from None
    if parsed.header.get("typ") != REPORT_TYP or parsed.header.get("alg") != "EdDSA":
        raise ReportInvalid("not an EdDSA agboss-mesh-report JWS")
    if not verify_signature(parsed, issuer_key):
        raise ReportInvalid("signature does not verify")
    c = parsed.claims
    if c.get("schema") != SCHEMA:
        raise ReportInvalid("unknown report schema")
    if c.get("executionId") != expected_execution_id:
        raise ReportInvalid("report is for another task")
    if c.get("bodyHash") != expected_body_hash:
        raise ReportInvalid("report is for another message")
    spend = c.get("spend")
    if not isinstance(spend, Mapping) or spend.get("currency") != "USD":
        raise ReportInvalid("spend is not a USD amount")
    try:
        total = parse_usd(spend.get("total"))
    except ValueError as exc:
        raise ReportInvalid(str(exc)) from None
    issuer, issued_at = c.get("issuer"), c.get("issuedAt")
    if not isinstance(issuer, str) or not isinstance(issued_at, str):
        raise ReportInvalid("issuer and issuedAt are strings")
    return ReportClaims(
        issuer=issuer,
        execution_id=expected_execution_id,
        spend_total=total,
        currency="USD",
        body_hash=expected_body_hash,
        issued_at=issued_at,
        claims=c,
    )


# --- A2A peers and call chains in mesh work --------------------------------------

#: How a hosted agent addresses a configured external A2A agent: ``a2a:<peer>``.
A2A_TARGET_PREFIX = "a2a:"


def peer_name_of(target: str) -> str | None:
    """The peer name of an ``a2a:<name>`` target, or None for a mesh target."""
    if isinstance(target, str) and target.startswith(A2A_TARGET_PREFIX):
        return target[len(A2A_TARGET_PREFIX):]
    return None


def chain_meta_of(envelope: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``meta[EXTENSION_URI]`` of a mesh envelope — ``{callChain, origin}``, set where
    work entered by A2A and carried into its mesh sub-requests — or None."""
    if not envelope:
        return None
    meta = envelope.get("meta")
    value = meta.get(EXTENSION_URI) if isinstance(meta, Mapping) else None
    return dict(value) if isinstance(value, Mapping) else None
