"""The Economics extension on the node (§19.1, §19.5): declared SKUs and the agreement check.

Three jobs, each small:

* :func:`declared_skus` turns what an agent class declares (``@offering(price=...)``
  and :attr:`meshnode.agent.Agent.skus`) into validated §19.1 SKUs with their
  digests: the plugin author writes prices, never digests.
* :class:`AgreementStore` holds the agreements this node enforces: owner-signed
  documents (§19.5), verified on the way in, kept in ``agreements.json`` in the
  data directory, revocable (prospectively).
* :class:`AgreementGate` is the admission check in the §7.7/§22 slot: a request
  whose offering a paid SKU covers, from a requester whose owner holds no
  unexpired agreement at the SKU's current digest, is refused with
  AGREEMENT_REQUIRED before any work.

Two sources of agreements, asked in order: this node's own store (what the
seller's operator added, ``meshnode agreements add``: it works without any
platform), then the platform agreement service (what owners registered,
§19.5 "registered with the platform"), through the cached, single-flight
:class:`~meshnode.node.agreement_lookup.PlatformAgreements`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshnode.agent import OfferingSpec
from meshnode.node.usage_log import UsageLog
from meshnode.protocol import subjects
from meshnode.protocol.budget import parse_budget
from meshnode.protocol.commerce import (
    Agreement,
    AgreementRecord,
    Sku,
    agreement_required,
    approval_url,
    check_price_within_ceiling,
    find_agreement,
    parse_sku,
    parse_skus,
    sku_for,
    verify_agreement,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.metering import MeterClass, meter_event
from meshnode.transport.files import write_private_file

if TYPE_CHECKING:
    from meshnode.node.agreement_lookup import PlatformAgreements
    from meshnode.node.hosted import HostedAgent
    from meshnode.node.meter_outbox import MeterPublisher

__all__ = [
    "AgreementGate",
    "AgreementStore",
    "declared_skus",
    "default_sku_id",
    "rating_context",
]

log = logging.getLogger("meshnode.commerce")

_NOT_SKU_CHAR = re.compile(r"[^a-z0-9-]+")


def default_sku_id(offering_id: str) -> str:
    """The SKU id of a priced offering that names none: the offering id lower-cased,
    every run of other characters as one ``-``, at most 64 characters."""
    return _NOT_SKU_CHAR.sub("-", offering_id.lower()).strip("-")[:64] or "sku"


#: §13.5 observed meters this node does not count yet: a price on one rates nothing.
UNPRODUCED_OBSERVED_METERS = frozenset({"responses", "events", "bytes_in", "bytes_out", "tasks_completed", "task_ms"})


def declared_skus(declared: Sequence[Mapping[str, Any]], offerings: Iterable[OfferingSpec]) -> tuple[Sku, ...]:
    """Validated SKUs of an agent class: ``declared`` (whole SKU objects) then one
    per priced offering. Raises ProtocolError INVALID_MANIFEST naming the member
    (``skus[i]....``) when a SKU is malformed or two SKUs cover one offering."""
    objects: list[dict[str, Any]] = [dict(s) for s in declared]
    for spec in offerings:
        if spec.price is None:
            continue
        sku = {
            "sku": spec.sku or default_sku_id(spec.id),
            "covers": {"offerings": [spec.id]},
            "price": dict(spec.price),
            "provider": dict(spec.billing_provider or {"id": "internal"}),
        }
        try:
            parse_sku(sku)
        except ProtocolError as exc:
            # The author wrote @offering(price=...), not skus[N]: name what they wrote
            # (an index into the list the node builds would point at nothing in their code).
            member = str(exc.details.get("member", ""))
            where = {"price": "price", "provider": "billing_provider", "sku": "sku"}.get(member.split(".")[0], member)
            rest = member.partition(".")[2]
            at = f'@offering("{spec.id}") {where}' + (f".{rest}" if rest else "")
            raise ProtocolError(exc.code, f"{at}: {exc.message}", {**exc.details, "member": at}) from None
        objects.append(sku)
    return parse_skus(objects) if objects else ()


def _record_object(record: AgreementRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"agreement": record.agreement.to_object()}
    if record.revoked_at_ms is not None:
        out["revoked_at_ms"] = record.revoked_at_ms
    return out


class AgreementStore:
    """The agreements this node enforces, in ``path`` (JSON, written atomically, 0600).

    One record per (consumer owner, seller agent, SKU id): a newer agreement to
    the same SKU replaces the older one (re-approval after a price change).
    Only documents whose signature verifies against their own
    ``consumer_owner`` are accepted; a record that no longer verifies when the
    file is read is dropped with a warning, never enforced as valid.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._records: dict[tuple[str, str, str], AgreementRecord] = {}
        self._load()

    def _load(self) -> None:
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            # Fail closed: an unreadable store holds no agreements (paid work is refused).
            log.error("%s: unreadable agreement store (%s); no agreements are enforced as held", self.path, exc)
            return
        for i, item in enumerate(raw.get("agreements", []) if isinstance(raw, dict) else []):
            try:
                agreement = verify_agreement(item.get("agreement") if isinstance(item, dict) else None)
            except ProtocolError as exc:
                log.warning("%s: agreements[%d] dropped: %s", self.path, i, exc.message)
                continue
            revoked = item.get("revoked_at_ms")
            self._records[self._key(agreement)] = AgreementRecord(
                agreement, revoked if isinstance(revoked, int) else None
            )

    @staticmethod
    def _key(agreement: Agreement) -> tuple[str, str, str]:
        return (agreement.consumer_owner, agreement.seller_agent, agreement.sku)

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        data = json.dumps({"agreements": [_record_object(r) for r in self._records.values()]}, indent=2)
        write_private_file(self.path, data, replace=True)

    def add(self, document: object) -> Agreement:
        """Verify (shape and the owner's signature, §19.5) and keep ``document``.
        Raises ProtocolError (INVALID_ENVELOPE / IDENTITY_MISMATCH) otherwise."""
        agreement = verify_agreement(document)
        self._records[self._key(agreement)] = AgreementRecord(agreement)
        self._save()
        return agreement

    def revoke(self, *, sku: str, consumer_owner: str | None, seller_agent: str | None, now_ms: int) -> list[Agreement]:
        """Revoke (from ``now_ms`` on, prospectively) the live agreements to ``sku``
        matching the given owner and seller (None: any). Returns those revoked."""
        revoked: list[Agreement] = []
        for key, record in self._records.items():
            a = record.agreement
            if a.sku != sku or record.revoked_at_ms is not None:
                continue
            if consumer_owner is not None and a.consumer_owner != consumer_owner:
                continue
            if seller_agent is not None and a.seller_agent != seller_agent:
                continue
            self._records[key] = AgreementRecord(a, now_ms)
            revoked.append(a)
        if revoked:
            self._save()
        return revoked

    def records(self) -> list[AgreementRecord]:
        return list(self._records.values())


def rating_context(sku: Sku, owner: str | None, agreement: Agreement | None,
                   env: Mapping[str, Any]) -> dict[str, Any]:
    """What the rating service needs beside a meter event to rate it alone (§19.6):
    the SKU as declared at the event (its digest is recomputed by the rater), the
    consumer's owner resolved at admission, the owner-signed agreement that
    admitted it (the rater verifies its signature, so a seller cannot invent
    one), and the request's ``cost_ceiling`` with the interaction it binds."""
    context: dict[str, Any] = {"sku": sku.to_object(), "consumer_owner": owner}
    if agreement is not None:
        context["agreement"] = agreement.to_object()
    budget = env.get("budget")
    if isinstance(budget, Mapping) and isinstance(budget.get("cost_ceiling"), Mapping):
        context["cost_ceiling"] = dict(budget["cost_ceiling"])
    context["interaction"] = str(env.get("id"))
    return context


#: Admitted requests awaiting their completion's meter event, at most this many.
_ADMITTED_CAP = 10_000


class AgreementGate:
    """The §19.5 admission check, with the node's store and ``[commerce]`` settings.

    It also keeps the seller's meter of priced offerings (§13.5): each event is
    appended to ``usage`` (the durable record, first) and, with ``publisher``
    set (the daemon sets a :class:`MeterOutbox`), handed on for the rating
    service: queued, not awaited on the wire, so the answer goes out first.
    """

    def __init__(
        self,
        store: AgreementStore,
        *,
        approval_surface: str | None,
        gate_free_terms: bool,
        usage: UsageLog | None = None,
        publisher: MeterPublisher | None = None,
    ) -> None:
        self.store = store
        self.approval_surface = approval_surface
        self.gate_free_terms = gate_free_terms
        self.usage = usage
        self.publisher = publisher
        #: The platform agreement service, asked when the local store holds no
        #: agreement (None: the local store alone, ``[commerce] platform_agreements = false``).
        self.platform: PlatformAgreements | None = None
        # Request id -> (SKU, owner, the agreement that admitted it) from
        # admission to completion (FIFO-bounded: a request whose handler never
        # completes must not grow it forever).
        self._admitted: dict[str, tuple[Sku, str | None, Agreement | None]] = {}

    @property
    def metering(self) -> bool:
        return self.usage is not None or self.publisher is not None

    async def _record(self, hosted: HostedAgent, env: Mapping[str, Any], sku: Sku, owner: str | None,
                      agreement: Agreement | None, events: Sequence[Mapping[str, Any]]) -> None:
        context = rating_context(sku, owner, agreement, env)
        for event in events:
            span = None
            if self.usage is not None:
                try:
                    span = self.usage.append(event, sku, owner, context)
                except OSError as exc:
                    # Usage is a record, not a gate: losing a line never refuses work.
                    log.warning("%s: meter event not recorded: %s", self.usage.path, exc)
            if self.publisher is not None:
                try:
                    await self.publisher(hosted, {**event, "rating": context}, span=span)
                except Exception as exc:  # signing, encoding (the outbox never waits on the wire): logged, the work stands
                    hosted.counters["metering.unpublished"] += 1
                    log.warning("meter event %s/%s not published on %s: %s", event.get("meter"),
                                event.get("envelope_id"), subjects.METERING_USAGE, exc)

    async def delivered(
        self,
        hosted: HostedAgent,
        env: Mapping[str, Any],
        offering: str,
        now_ms: int,
        *,
        usage: Sequence[Mapping[str, Any]] | None = None,
        receipt_id: str | None = None,
        task_id: str | None = None,
    ) -> None:
        """A request admitted by :meth:`check` completed: record its ``requests``
        event (under the request's id) and one declared event per ``usage`` entry
        (under ``receipt_id``, the respond that carried the report, §13.5)."""
        admitted = self._admitted.pop(str(env.get("id")), None)
        if admitted is None:
            return
        sku, owner, agreement = admitted
        common: dict[str, Any] = {
            "provider": hosted.agent_id, "consumer": str(env["from"]), "ts_ms": now_ms, "offering": offering,
            "task_id": task_id,
        }
        try:
            events = [meter_event("requests", MeterClass.OBSERVED, 1, envelope_id=str(env["id"]), **common)]
            for line in usage or ():
                events.append(meter_event(
                    str(line["meter"]), MeterClass.DECLARED, int(line["quantity"]),
                    envelope_id=receipt_id or str(env["id"]), **common,
                ))
        except ValueError as exc:
            log.warning("%s: meter events of %s not recorded: %s", hosted.name, env.get("id"), exc)
            return
        await self._record(hosted, env, sku, owner, agreement, events)

    async def owner_of(self, hosted: HostedAgent, requester: str) -> str | None:
        """The requester's owner the way EXT-2 §7.1 resolves it: the owner of its
        registry manifest (which the registry materializes, defaulting to the
        hosting node). None when the registry does not know it: an unresolvable
        owner holds no agreements."""
        try:
            info = await hosted.node.directory.resolve(hosted, requester)
        except ProtocolError:
            return None
        manifest = info.manifest
        owner = manifest.get("owner")
        if isinstance(owner, str):
            return owner
        # A manifest this node serves itself (a local requester) is the
        # registrant's copy, before the registry's rewrite: owner defaults to
        # the hosting node (§8.3), which is exactly what the registry records.
        node = manifest.get("node")
        node_id = node.get("id") if isinstance(node, Mapping) else None
        return node_id if isinstance(node_id, str) else None

    def _admit(self, env: Mapping[str, Any], sku: Sku, owner: str | None, agreement: Agreement | None = None) -> Sku:
        if self.metering:
            self._admitted[str(env.get("id"))] = (sku, owner, agreement)
            if len(self._admitted) > _ADMITTED_CAP:
                self._admitted.pop(next(iter(self._admitted)))
        return sku

    async def _record_refusal(
        self, hosted: HostedAgent, env: Mapping[str, Any], sku: Sku, owner: str | None,
        agreement: Agreement | None, offering: str, now_ms: int, code: str,
    ) -> None:
        # §13.5 refusal events: declined demand is recorded at quantity 0 (rated to zero).
        try:
            refusal = meter_event(
                "requests", MeterClass.OBSERVED, 0, provider=hosted.agent_id, consumer=str(env["from"]),
                envelope_id=str(env["id"]), ts_ms=now_ms, offering=offering, refusal_code=code,
            )
        except ValueError as exc:
            log.warning("%s: refusal event of %s not recorded: %s", hosted.name, env.get("id"), exc)
        else:
            await self._record(hosted, env, sku, owner, agreement, [refusal])

    async def check(self, hosted: HostedAgent, env: Mapping[str, Any], offering: str, now_ms: int) -> Sku | None:
        """Raise AGREEMENT_REQUIRED (details sku, sku_digest, approval_url) when a
        paid SKU covers ``offering`` and the requester's (``env["from"]``) owner
        holds no live agreement at its current digest; BUDGET_INSUFFICIENT
        (details.estimate: the price) when it does but the request's
        ``cost_ceiling`` cannot cover the SKU's flat price (§19.3). Returns the covering SKU
        (None: free). The refusal, and later the completion, are recorded as
        meter events in the usage log."""
        sku = sku_for(hosted.skus, offering)
        if sku is None:
            return None
        requester = str(env["from"])
        gated = sku.is_paid or (self.gate_free_terms and sku.provider.terms_url is not None)
        if not gated:
            return self._admit(env, sku, None)  # free: nothing to agree to, nothing to attribute
        owner = await self.owner_of(hosted, requester)
        agreement = find_agreement(
            self.store.records(), consumer_owner=owner, seller_agent=hosted.agent_id, sku=sku, at_ms=now_ms
        )
        if agreement is None and owner is not None and self.platform is not None:
            # Not in this node's store: the agreements the owner registered with the
            # platform (cached and single-flight, :mod:`meshnode.node.agreement_lookup`).
            agreement = find_agreement(
                await self.platform.records(hosted, owner, sku.sku),
                consumer_owner=owner, seller_agent=hosted.agent_id, sku=sku, at_ms=now_ms,
            )
        if agreement is not None:
            block = env.get("budget")
            if block is not None:
                try:
                    # §19.3: a flat price the request's cost_ceiling cannot cover is
                    # refused now, with the price as the estimate (a price quote).
                    check_price_within_ceiling(sku.price, parse_budget(block).cost_ceiling)
                except ProtocolError as exc:
                    await self._record_refusal(hosted, env, sku, owner, agreement, offering, now_ms, exc.code)
                    raise
            return self._admit(env, sku, owner, agreement)
        await self._record_refusal(hosted, env, sku, owner, None, offering, now_ms, "AGREEMENT_REQUIRED")
        try:
            url = approval_url(sku, self.approval_surface)
        except ValueError:
            # No approval surface anywhere: still refused (paid work without an
            # agreement never runs), and the message says which key fixes it.
            raise ProtocolError(
                "AGREEMENT_REQUIRED",
                f"{sku.sku!r} is paid and this account holds no agreement to its current terms; the operator "
                "has configured no approval surface ([commerce] approval_url, or the SKU's provider.checkout_url)",
                {"sku": sku.sku, "sku_digest": sku.digest, "approval_url": None},
            ) from None
        raise agreement_required(sku, url)
