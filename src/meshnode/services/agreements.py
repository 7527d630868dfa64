"""The agreement service (§19.5 "registered with the platform"): register, revoke, look up.

An agreement (§19.5) is signed by the consumer's owner key and enforced by the
seller's node at admission. Without a platform store the document has to be
carried to the seller's node by hand and a signer cannot revoke it from where
it signed. This service is the platform's copy, on the embedded mesh (queue
group ``mesh_agreements``, so several service nodes serve it), with its state
in the KV bucket ``mesh_agreements`` (one record per (owner, seller, SKU),
bounded by ``[storage] agreements_max_bytes``; participants hold no ``$KV``
grant, so only the services write it).

Subjects (meshnode's; §14.1 reserves none for this):

* ``mesh.agreements.register`` — payload ``{agreement}``. The document must
  verify against its own ``consumer_owner`` (shape and signature, §19.5),
  **and** the request must come from that owner: signed by the owner key
  itself, or by an agent whose registry manifest names it as ``owner`` (the
  registry sets that to the hosting node unless an owner attestation says
  otherwise, §8.3). *Why both:* a signed document proves the owner agreed, not
  that the owner wants it registered now; a copy handed to a seller as a file
  (``agreements sign --out``) or a document revoked and replayed must not be
  (re-)registered by whoever holds it. A document agreed at or before the
  record's revocation is refused (a replay cannot undo a revocation); an older
  document never replaces a newer one.
* ``mesh.agreements.revoke`` — payload ``{revocation}``, a signed revocation
  (:mod:`meshnode.protocol.commerce.revocation`) from the same owner, under
  the same sender rule. Prospective (§19.5): the record keeps the agreement and
  gains ``revoked_at_ms``, the later of the revocation's ``revoked_at`` and
  the instant the service received it, so a back-dated revocation cannot
  un-rate usage already metered.
* ``mesh.agreements.lookup`` — payload ``{consumer_owner?, seller_agent?,
  sku?}`` (an owner or a seller at least). Answered to the parties only: the
  owner's side (the owner key or its agents) for its own agreements, the
  seller's side (the seller agent, or an agent of the seller's owner) for the
  agreements to that seller. Not charged to the sender's service budget: a
  seller's node asks at admission, and the platform's own bookkeeping must
  not fail paid work with RATE_LIMITED (the node single-flights and caches
  the answers, :mod:`meshnode.node.agreement_lookup`). Answers are served from
  the in-memory mirror of the bucket.

Every change emits ``mesh.event.agreements.registered`` or ``.revoked`` (data:
owner, seller, SKU), which sellers' nodes use to drop their cached answers.

Errors: UNAUTHORIZED (``details.reason``: ``not_the_owner``, ``bad_signature``,
``revoked``) naming the owner; INVALID_ENVELOPE naming the member at fault;
NOT_FOUND for a revocation with no agreement to revoke; QUOTA_EXCEEDED past
``max_per_owner`` records (``[services] max_agreements_per_owner``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from meshnode.protocol import subjects
from meshnode.protocol.commerce import Agreement, AgreementRecord, parse_agreement, verify_agreement
from meshnode.protocol.commerce.revocation import Revocation, verify_revocation
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import is_valid_public
from meshnode.protocol.timeutil import format_ts
from meshnode.transport.connection import Message
from meshnode.transport.errors import Conflict
from meshnode.transport.streams import agreements_bucket_config, ensure_key_value

from .base import Envelope, KVMirror, ServiceBase, ServiceContext

__all__ = [
    "DEFAULT_MAX_PER_OWNER",
    "MAX_LOOKUP_ANSWER",
    "AgreementService",
    "authorize_owner",
    "record_out",
    "registered",
    "revoked",
]

DEFAULT_MAX_PER_OWNER = 1000
"""Records one owner may hold (all sellers and SKUs; revoked and expired included)."""
MAX_LOOKUP_ANSWER = 200
"""Records one look-up answers (``truncated: true`` beyond), to stay under max_payload."""
_CAS_ATTEMPTS = 5
_SYNC_TIMEOUT_S = 20.0


def _unauthorized(reason: str, message: str, owner: str) -> ProtocolError:
    return ProtocolError("UNAUTHORIZED", message, {"reason": reason, "consumer_owner": owner})


def authorize_owner(sender: str, owner: str, sender_owner: str | None, what: str) -> None:
    """Raise UNAUTHORIZED (``not_the_owner``) unless ``sender`` is ``owner`` or an
    agent the registry says ``owner`` owns (``sender_owner``)."""
    if sender == owner or (sender_owner is not None and sender_owner == owner):
        return
    raise _unauthorized(
        "not_the_owner",
        f"{what}: only the owner {owner} (its key, or an agent it owns) may do this; "
        f"{sender} is owned by {sender_owner or 'nobody the registry knows'}",
        owner,
    )


def registered(current: Mapping[str, Any] | None, agreement: Agreement, *, sender: str, now_ms: int) -> dict[str, Any]:
    """The record after registering ``agreement`` over ``current`` (the stored
    record of the same owner, seller and SKU, or None). Raises UNAUTHORIZED
    (``revoked``) for a document agreed at or before the current revocation, and
    INVALID_ENVELOPE (``stale``) for one older than the live agreement held."""
    if current is not None:
        held = current.get("agreement")
        held_ms = _agreed_ms(held)
        revocation = current.get("revocation")
        revoked_ms = current.get("revocation_at_ms")
        if isinstance(revocation, Mapping) and isinstance(revoked_ms, int) and agreement.agreed_at_ms <= revoked_ms:
            raise _unauthorized(
                "revoked",
                f"agreement to {agreement.sku!r} agreed at {agreement.agreed_at} was revoked at "
                f"{revocation.get('revoked_at')}; sign a new one to agree again",
                agreement.consumer_owner,
            )
        if held_ms is not None and current.get("revoked_at_ms") is None and agreement.agreed_at_ms < held_ms:
            raise ProtocolError(
                "INVALID_ENVELOPE",
                f"agreement.agreed_at {agreement.agreed_at} is older than the live agreement held for this "
                f"owner, seller and SKU ({held.get('agreed_at') if isinstance(held, Mapping) else '?'})",
                {"member": "agreement.agreed_at", "reason": "stale"},
            )
    return {"agreement": agreement.to_object(), "registered_by": sender, "registered_at_ms": now_ms}


def revoked(current: Mapping[str, Any] | None, revocation: Revocation, *, now_ms: int) -> dict[str, Any] | None:
    """The record after ``revocation`` (None: nothing changes — it was revoked
    already, or the agreement held was signed after the revocation). Raises
    NOT_FOUND when no agreement is held."""
    if current is None or not isinstance(current.get("agreement"), Mapping):
        raise ProtocolError(
            "NOT_FOUND",
            f"no agreement of {revocation.consumer_owner} to {revocation.sku!r} of {revocation.seller_agent} "
            "is registered",
            {"consumer_owner": revocation.consumer_owner, "seller_agent": revocation.seller_agent, "sku": revocation.sku},
        )
    agreed_ms = _agreed_ms(current["agreement"])
    if current.get("revoked_at_ms") is not None or (agreed_ms is not None and agreed_ms > revocation.revoked_at_ms):
        return None
    return {
        **current,
        "revoked_at_ms": max(revocation.revoked_at_ms, now_ms),  # prospective only (§19.5)
        "revocation_at_ms": revocation.revoked_at_ms,
        "revocation": dict(revocation.document),
    }


def record_out(record: Mapping[str, Any]) -> dict[str, Any]:
    """A stored record as a look-up answers it."""
    out: dict[str, Any] = {"agreement": record.get("agreement")}
    revoked_ms = record.get("revoked_at_ms")
    if isinstance(revoked_ms, int):
        out["revoked_at_ms"] = revoked_ms
        out["revoked_at"] = format_ts(revoked_ms)
    return out


def _agreed_ms(document: object) -> int | None:
    try:
        return parse_agreement(document).agreed_at_ms
    except ProtocolError:
        return None


def _payload(env: Envelope, member: str) -> Any:
    payload = env.get("payload")
    if not isinstance(payload, Mapping):
        raise ProtocolError("INVALID_ENVELOPE", "agreement service: payload must be an object", {"member": "payload"})
    if member not in payload:
        raise ProtocolError(
            "INVALID_ENVELOPE", f"agreement service: payload.{member} is required", {"member": f"payload.{member}"}
        )
    return payload[member]


class AgreementService(ServiceBase):
    """``mesh.agreements.{register,revoke,lookup}``; see the module docstring.

    ``owner_of`` maps an agent id to the owner its registry manifest names
    (None: unknown), from the registry's cache.
    """

    def __init__(
        self,
        ctx: ServiceContext,
        *,
        owner_of: Callable[[str], str | None],
        max_per_owner: int = DEFAULT_MAX_PER_OWNER,
    ) -> None:
        super().__init__(ctx, name="agreements", queue="mesh_agreements")
        self.owner_of = owner_of
        self.max_per_owner = max_per_owner
        self._mirror: KVMirror | None = None

    async def start(self) -> None:
        if self.running:
            return
        js = self.ctx.connection.jetstream
        await ensure_key_value(js, agreements_bucket_config(self.ctx.replicas, self.ctx.stream_limits))
        self._mirror = KVMirror(self, await js.key_value(subjects.KV_AGREEMENTS), "agreements")
        self._running = True
        try:
            await self._mirror.start(_SYNC_TIMEOUT_S)
        except BaseException:
            await self.stop()
            raise
        self.hook_reconnect(self._on_reconnect)
        await self.serve(subjects.AGREEMENTS_REGISTER, self._register)
        await self.serve(subjects.AGREEMENTS_REVOKE, self._revoke)
        await self.serve(subjects.AGREEMENTS_LOOKUP, self._lookup)
        await self.ctx.connection.flush()

    async def _on_reconnect(self) -> None:
        if self.running and self._mirror is not None:
            self._mirror.restart()  # a fresh watch replays every key

    async def admit(self, msg: Message, env: Envelope) -> bool:
        """Look-ups are not charged to the sender's budget (module docstring);
        registrations and revocations are, like every other service request."""
        if msg.subject == subjects.AGREEMENTS_LOOKUP:
            return True
        return await super().admit(msg, env)

    def _mirror_or_fail(self) -> KVMirror:
        if self._mirror is None:
            raise ProtocolError("AGENT_UNAVAILABLE", "the agreement service is starting")
        return self._mirror

    def _sender_owner(self, sender: str) -> str | None:
        return self.owner_of(sender)

    async def _write(self, key: str, change: Callable[[dict[str, Any] | None], dict[str, Any] | None]) -> dict[str, Any] | None:
        """Read the authoritative record, apply ``change`` and write it back with
        a revision check (several service nodes may serve at once). Returns the
        record written, or None when ``change`` changed nothing."""
        mirror = self._mirror_or_fail()
        for _ in range(_CAS_ATTEMPTS):
            current, revision = await mirror.get(key)
            record = change(current)
            if record is None:
                return None
            data = orjson.dumps(record)
            try:
                if revision:
                    new_revision = await mirror.kv.update(key, data, last=revision)
                else:
                    new_revision = await mirror.kv.create(key, data)
            except Conflict:
                continue  # another service node wrote it first: judge against its record
            mirror.wrote(key, new_revision, record)
            return record
        raise ProtocolError("AGENT_OVERLOADED", f"agreement record {key} kept changing; try again", retry_after_ms=500)

    def _held_by(self, owner: str) -> int:
        prefix = f"{owner}."
        return sum(1 for key in self._mirror_or_fail().entries if key.startswith(prefix))

    async def _register(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        document = _payload(env, "agreement")
        try:
            agreement = verify_agreement(document)
        except ProtocolError as exc:
            if exc.code == "IDENTITY_MISMATCH":
                owner = document.get("consumer_owner") if isinstance(document, Mapping) else None
                raise _unauthorized(
                    "bad_signature", f"agreement refused: {exc.message}", owner if isinstance(owner, str) else ""
                ) from None
            raise
        sender = str(env["from"])
        authorize_owner(sender, agreement.consumer_owner, self._sender_owner(sender), "registering an agreement")
        key = subjects.agreement_key(agreement.consumer_owner, agreement.seller_agent, agreement.sku)
        if key not in self._mirror_or_fail().entries and self._held_by(agreement.consumer_owner) >= self.max_per_owner:
            raise ProtocolError(
                "QUOTA_EXCEEDED",
                f"owner {agreement.consumer_owner} already holds {self.max_per_owner} registered agreements "
                "(limit [services] max_agreements_per_owner)",
                {"limit": self.max_per_owner, "consumer_owner": agreement.consumer_owner},
            )
        now = self.ctx.now_ms()
        record = await self._write(key, lambda current: registered(current, agreement, sender=sender, now_ms=now))
        assert record is not None
        self.log.info("registered agreement of %s to %s of %s", agreement.consumer_owner, agreement.sku, agreement.seller_agent)
        await self.emit(subjects.AGREEMENTS_EVENT_DOMAIN, "registered", {
            "consumer_owner": agreement.consumer_owner, "seller_agent": agreement.seller_agent,
            "sku": agreement.sku, "sku_digest": agreement.sku_digest,
        })
        return record_out(record)

    async def _revoke(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        document = _payload(env, "revocation")
        try:
            revocation = verify_revocation(document)
        except ProtocolError as exc:
            if exc.code == "IDENTITY_MISMATCH":
                owner = document.get("consumer_owner") if isinstance(document, Mapping) else None
                raise _unauthorized(
                    "bad_signature", f"revocation refused: {exc.message}", owner if isinstance(owner, str) else ""
                ) from None
            raise
        sender = str(env["from"])
        authorize_owner(sender, revocation.consumer_owner, self._sender_owner(sender), "revoking an agreement")
        key = subjects.agreement_key(revocation.consumer_owner, revocation.seller_agent, revocation.sku)
        now = self.ctx.now_ms()
        record = await self._write(key, lambda current: revoked(current, revocation, now_ms=now))
        if record is None:
            current, _ = await self._mirror_or_fail().get(key)
            return {"revoked": False, **record_out(current or {})}
        self.log.info("revoked agreement of %s to %s of %s", revocation.consumer_owner, revocation.sku, revocation.seller_agent)
        await self.emit(subjects.AGREEMENTS_EVENT_DOMAIN, "revoked", {
            "consumer_owner": revocation.consumer_owner, "seller_agent": revocation.seller_agent,
            "sku": revocation.sku, "revoked_at_ms": record["revoked_at_ms"],
        })
        return {"revoked": True, **record_out(record)}

    async def _lookup(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        payload = env.get("payload")
        if not isinstance(payload, Mapping):
            raise ProtocolError("INVALID_ENVELOPE", "agreement look-up: payload must be an object", {"member": "payload"})
        owner, seller, sku = payload.get("consumer_owner"), payload.get("seller_agent"), payload.get("sku")
        for name, value in (("consumer_owner", owner), ("seller_agent", seller)):
            if value is not None and not (isinstance(value, str) and is_valid_public(value)):
                raise ProtocolError("INVALID_ENVELOPE", f"agreement look-up: payload.{name} must be a key",
                                    {"member": f"payload.{name}"})
        if sku is not None and not isinstance(sku, str):
            raise ProtocolError("INVALID_ENVELOPE", "agreement look-up: payload.sku must be a SKU id", {"member": "payload.sku"})
        if owner is None and seller is None:
            raise ProtocolError("INVALID_ENVELOPE", "agreement look-up: name payload.consumer_owner or payload.seller_agent",
                                {"member": "payload.consumer_owner"})
        sender = str(env["from"])
        sender_owner = self._sender_owner(sender)
        owner_side = owner is not None and (sender == owner or sender_owner == owner)
        seller_side = seller is not None and (
            sender == seller or (sender_owner is not None and sender_owner == self.owner_of(seller)))
        if not (owner_side or seller_side):
            raise ProtocolError(
                "UNAUTHORIZED",
                "agreement look-up: answered to the parties only (the owner or its agents for payload.consumer_owner, "
                "the seller or its owner's agents for payload.seller_agent)",
                {"reason": "not_a_party"},
            )
        found: list[dict[str, Any]] = []
        truncated = False
        for record in self._mirror_or_fail().entries.values():
            document = record.get("agreement")
            if not isinstance(document, Mapping):
                continue
            if (owner is not None and document.get("consumer_owner") != owner) or (
                seller is not None and document.get("seller_agent") != seller
            ) or (sku is not None and document.get("sku") != sku):
                continue
            if len(found) >= MAX_LOOKUP_ANSWER:
                truncated = True
                break
            found.append(record_out(record))
        return {"agreements": found, "truncated": truncated}

    def records(self) -> list[AgreementRecord]:
        """Every registered agreement with its revocation, from the mirror (an
        agreement source for the rating service); a record that no longer
        verifies is left out."""
        out: list[AgreementRecord] = []
        for record in (self._mirror.entries.values() if self._mirror is not None else ()):
            try:
                agreement = verify_agreement(record.get("agreement"))
            except ProtocolError:
                continue
            revoked_ms = record.get("revoked_at_ms")
            out.append(AgreementRecord(agreement, revoked_ms if isinstance(revoked_ms, int) else None))
        return out

    async def stop(self) -> None:
        await super().stop()
        mirror, self._mirror = self._mirror, None
        if mirror is not None:
            await mirror.stop()
