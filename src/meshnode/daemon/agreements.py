"""The ``Agreements.*`` admin methods (§19.5): sign, add, list and revoke agreements;
``Usage.Rated`` (§19.6): the recorded meter events rated against them.

The owner key is this node's key (read from the keystore at start): the node
is the default owner of every agent it hosts (§8.3), so it is the account
whose agreements cover requests from those agents. ``Agreements.Sign`` signs
an agreement to a seller's SKU at the digest the seller currently declares
(its own manifest when the seller is hosted here, else the registry's copy),
registers it with the platform agreement service (§19.5, as this node's CLI
agent, which the node owns) and keeps it in this node's store when the seller
is hosted here; ``Agreements.Register`` registers a document signed
elsewhere (the service takes it only when this node is owned by its signer);
``Agreements.Add`` takes an agreement signed elsewhere (a file the consumer's
operator hands over) into the local store, verifying the owner's signature:
the path for a seller on a mesh without the agreement service.
``Agreements.Revoke`` revokes in the local store and, for this node's own
agreements, at the platform with a revocation signed by the owner key, which
reaches every seller's node through the service's event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from meshnode.admin.methods import param
from meshnode.admin.protocol import (
    AdminError,
    InvalidParameter,
    NotFound,
    PermissionDenied,
    Refused,
)
from meshnode.admin.server import CallContext, MethodRegistry
from meshnode.agent.replies import RemoteError
from meshnode.daemon.paging import AGENTS_PAGE_BYTES
from meshnode.node.agreement_lookup import parse_records
from meshnode.node.builtin import CLI_AGENT_NAME
from meshnode.node.commerce import AgreementGate
from meshnode.node.hosted import HostedAgent
from meshnode.protocol import subjects
from meshnode.protocol.commerce import AgreementRecord, parse_skus, sign_agreement
from meshnode.protocol.commerce.revocation import sign_revocation
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import is_valid_public
from meshnode.protocol.timeutil import format_ts
from meshnode.services.rating import (
    LedgerView,
    PageRequest,
    PageRequestError,
    line_filter,
    page_request,
)

if TYPE_CHECKING:
    from meshnode.daemon.main import Daemon

__all__ = ["record_summary", "register_agreement_methods"]


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def record_summary(record: AgreementRecord) -> dict[str, Any]:
    """One stored agreement as the CLI shows it (the signed document included)."""
    a = record.agreement
    return {
        "consumer_owner": a.consumer_owner,
        "seller_agent": a.seller_agent,
        "sku": a.sku,
        "sku_digest": a.sku_digest,
        "agreed_at": a.agreed_at,
        "expires_at": a.expires_at,
        "revoked_at": format_ts(record.revoked_at_ms) if record.revoked_at_ms is not None else None,
        "document": a.to_object(),
    }


def _admin_error(exc: ProtocolError, what: str) -> AdminError:
    """The admin error for a refusal of the agreement service (the §12 object in params)."""
    if exc.code == "UNAUTHORIZED":
        return PermissionDenied(f"{what}: {exc.message}", exc.to_object())
    return Refused(f"{what}: {exc.code}: {exc.message}", exc.to_object())


def register_agreement_methods(daemon: Daemon, methods: MethodRegistry) -> None:
    """Add the ``Agreements.*`` admin methods (module docstring)."""
    ops = _AgreementMethods(daemon)
    methods.add(
        "Agreements.Sign", ops.sign, level="admin",
        doc="params {seller, sku?, offering?, expires_in_s?} -> {agreement, stored, registered, registration_error}: "
        "this node's key (the owner of its agents) signs an agreement to the seller's SKU at its current digest, "
        "registers it with the platform agreement service and stores it when the seller is hosted here",
    )
    methods.add(
        "Agreements.Register", ops.register, level="admin",
        doc="params {agreement} -> {agreement}: register an owner-signed agreement with the platform (§19.5); "
        "refused UNAUTHORIZED unless this node is owned by its signer",
    )
    methods.add(
        "Agreements.Add", ops.add, level="admin",
        doc="params {agreement} -> {agreement}: keep an owner-signed agreement (§19.5) in this node's store (verified)",
    )
    methods.add(
        "Agreements.List", ops.list, level="operator",
        doc="-> {owner, agreements: [...], registered: [...], registered_error}: the agreements of this node's store, "
        "and those registered with the platform by this node's owner or to its agents",
    )
    methods.add(
        "Usage.Rated", ops.usage, level="operator",
        doc="params {owner?, seller?, period?, source?: auto|ledger|local, charges?: bool, charges_offset?, "
        "totals_offset?, charges_bytes?, as_of?} -> "
        "{events, charges: [...], charges_next, totals: [{consumer_owner, seller_agent, currency, period, "
        "amount_micro}], totals_next, ledger?, source}: rated charges (§19.6) from the mesh's rating service "
        "(source ledger), else this node's usage log replayed against the held agreements (source local). events "
        "counts the matching charges and totals adds them up; charges and totals are one page each (no charges "
        "with charges=false; together at most charges_bytes and half a reply), charges_next / totals_next the "
        "next page's offsets (null: the last); as_of (the first page's events) keeps later pages to those lines. "
        "ledger: {seq, lines, complete, missed, since?, dropped, held_from?}; when its dropped differs between "
        "two pages the ledger let lines go in between (the mesh discarded their events): read again from the first",
    )
    methods.add(
        "Agreements.Revoke", ops.revoke, level="admin",
        doc="params {sku, owner?, seller?} | {revocation} -> {revoked: [...], platform_revoked: [...], platform_error}: "
        "revoke from now on (prospective, §19.5) in this node's store and, for this node's own agreements, at the "
        "platform; or send a revocation document signed elsewhere to the platform",
    )


#: How long the local usage view of a first page serves the pages that follow it,
#: after the last page asked. It holds every rated line (~0.5 KB each: ~350 MB for a
#: full 1 GiB log), so only as long as a reader paging back to back needs.
LOCAL_VIEW_TTL_S = 30.0


@dataclasses.dataclass
class _LocalView:
    """The usage log rated for one query, kept for the query's later pages.

    Rating the log is a fold from its first line, so the lines it gives for a
    log that has only grown at its end since are the first ones of the fold
    over the grown log: a later page (it asks ``as_of`` the first page's
    count) may be answered from this view while the same agreements are held
    and the same oldest segment is kept. A deleted segment or another
    agreement starts the fold anew."""

    key: tuple[object, ...]
    view: LedgerView
    expires: float


class _AgreementMethods:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self._local: _LocalView | None = None
        self._local_expiry: asyncio.TimerHandle | None = None

    def _gate(self) -> AgreementGate:
        node = self.d.node
        if node is None or node.commerce is None:
            raise NotFound("the node is not running")
        return node.commerce

    def _cli(self) -> HostedAgent:
        """The node's CLI agent: owned by this node, so the service takes this owner's requests from it."""
        node = self.d.node
        if node is None or CLI_AGENT_NAME not in node.agents:
            raise NotFound("the node is not running")
        return node.agents[CLI_AGENT_NAME]

    async def _service(self, hosted: HostedAgent, subject: str, payload: dict[str, Any]) -> dict[str, Any]:
        node = self.d.node
        assert node is not None
        return await node.service_call(hosted, subject, "request", payload)

    def _asker_for(self, owner: object) -> HostedAgent:
        """Who sends an owner's request: an agent here that ``owner`` owns by
        attestation (its manifest names it), else the CLI agent (owned by this node)."""
        node = self.d.node
        assert node is not None
        for hosted in node.agents.values():
            if owner is not None and hosted.manifest.get("owner") == owner:
                return hosted
        return self._cli()

    async def _register(self, document: dict[str, Any]) -> dict[str, Any]:
        """Register ``document`` with the platform; ProtocolError as the service refused."""
        asker = self._asker_for(document.get("consumer_owner"))
        return await self._service(asker, subjects.AGREEMENTS_REGISTER, {"agreement": document})

    async def _seller_skus(self, seller: str) -> tuple[str, list[Mapping[str, Any]]]:
        """The seller's id and its SKUs ({sku, covers?, digest}) as currently declared."""
        node = self.d.node
        assert node is not None
        local = node.agents.get(seller) or node.by_id.get(seller)
        if local is not None:
            return local.agent_id, [
                {"sku": s.sku, "digest": s.digest, "offerings": list(s.offerings), "agent": s.covers_agent}
                for s in local.skus
            ]
        try:
            info = await node.directory.resolve(node.agents[CLI_AGENT_NAME], seller)
        except ProtocolError as exc:
            raise NotFound(f"seller {seller!r}: {exc.message}") from None
        manifest = info.manifest
        try:
            # Fresh from the registry, not the node's manifest cache: signing
            # agrees to the digest declared *now*, and a cached copy may predate
            # a price change (the agreement would be stale at once).
            manifest = await node.service_call(
                node.agents[CLI_AGENT_NAME], subjects.registry_get(info.id), "discover", {"agent_id": info.id}
            )
        except ProtocolError as exc:
            if exc.code == "NOT_FOUND":
                raise NotFound(f"seller {seller!r}: {exc.message}") from None
            # Another answer (a credential granting discovery only): the copy resolved above.
        if isinstance(manifest.get("skus"), list):
            try:
                skus = parse_skus(manifest["skus"])
            except ProtocolError as exc:
                raise InvalidParameter(f"seller {seller!r} declares malformed skus: {exc.message}") from None
            return info.id, [
                {"sku": s.sku, "digest": s.digest, "offerings": list(s.offerings), "agent": s.covers_agent}
                for s in skus
            ]
        public = manifest.get("public")
        advertised = public.get("skus") if isinstance(public, Mapping) else None
        return info.id, [
            {"sku": s.get("sku"), "digest": s.get("digest"), "offerings": [], "agent": False}
            for s in (advertised if isinstance(advertised, list) else [])
            if isinstance(s, Mapping)
        ]

    async def sign(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        gate = self._gate()
        seller = param(params, "seller", str)
        sku_id = param(params, "sku", str, None)
        offering = param(params, "offering", str, None)
        expires_in = param(params, "expires_in_s", int, None)
        if expires_in is not None and expires_in <= 0:
            raise InvalidParameter("expires_in_s must be a positive number of seconds", {"parameter": "expires_in_s"})
        seller_id, skus = await self._seller_skus(seller)
        if sku_id is None and offering is not None:
            named = [s for s in skus if offering in s["offerings"]] or [s for s in skus if s["agent"]]
            sku_id = named[0]["sku"] if named else None
        if sku_id is None and len(skus) == 1:
            sku_id = skus[0]["sku"]
        chosen = next((s for s in skus if s["sku"] == sku_id), None)
        if chosen is None:
            names = ", ".join(str(s["sku"]) for s in skus) or "none"
            raise NotFound(f"seller {seller!r} declares no SKU {sku_id!r} (its SKUs: {names}); pass --sku")
        key = self.d.node_key
        assert key is not None
        now = _now_ms()
        doc: dict[str, Any] = {
            "v": 1,
            "consumer_owner": key.public_key,
            "seller_agent": seller_id,
            "sku": chosen["sku"],
            "sku_digest": chosen["digest"],
            "agreed_at": format_ts(now),
        }
        if expires_in is not None:
            doc["expires_at"] = format_ts(now + expires_in * 1000)
        try:
            signed = sign_agreement(doc, key)
        except ProtocolError as exc:
            raise InvalidParameter(f"cannot sign: {exc.message}", exc.details) from None
        stored = seller_id in self.d.node.by_id if self.d.node is not None else False
        if stored:
            gate.store.add(signed)
        registered, error = True, None
        try:
            await self._register(signed)
        except ProtocolError as exc:
            # Signed all the same: the document (--out) and the local store still work.
            registered, error = False, f"{exc.code}: {exc.message}"
        return {"agreement": signed, "stored": stored, "registered": registered, "registration_error": error}

    async def _revoke_document(self, document: dict[str, Any]) -> dict[str, Any]:
        """Send a revocation signed elsewhere (an owner key this node does not
        hold) to the platform; the service takes it only from (an agent of) its signer."""
        try:
            asker = self._asker_for(document.get("consumer_owner"))
            answer = await self._service(asker, subjects.AGREEMENTS_REVOKE, {"revocation": document})
        except ProtocolError as exc:
            raise _admin_error(exc, "the agreement service refused the revocation") from None
        agreement = answer.get("agreement")
        return {
            "revoked": [],
            "platform_revoked": [agreement] if answer.get("revoked") and isinstance(agreement, dict) else [],
            "platform_error": None,
        }

    async def register(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        document = param(params, "agreement", dict)
        try:
            answer = await self._register(document)
        except ProtocolError as exc:
            raise _admin_error(exc, "the agreement service refused the registration") from None
        return {"agreement": answer.get("agreement", document)}

    async def add(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        gate = self._gate()
        document = param(params, "agreement", dict)
        try:
            agreement = gate.store.add(document)
        except ProtocolError as exc:
            raise InvalidParameter(f"agreement refused: {exc.message}", exc.details) from None
        return {"agreement": agreement.to_object()}

    async def list(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        gate = self._gate()
        key = self.d.node_key
        node = self.d.node
        assert node is not None
        registered: dict[tuple[str, str, str], AgreementRecord] = {}
        error: str | None = None
        # This owner's agreements (as its CLI agent), then those to each seller hosted here (as that seller).
        askers: list[tuple[HostedAgent, dict[str, Any]]] = []
        if key is not None:
            askers.append((self._cli(), {"consumer_owner": key.public_key}))
        askers += [(h, {"seller_agent": h.agent_id}) for h in node.agents.values() if h.skus]
        for hosted, query in askers:
            try:
                answer = await self._service(hosted, subjects.AGREEMENTS_LOOKUP, query)
            except ProtocolError as exc:
                error = f"{exc.code}: {exc.message}"
                break
            for record in parse_records(answer):
                a = record.agreement
                registered[(a.consumer_owner, a.seller_agent, a.sku)] = record
        return {
            "owner": key.public_key if key is not None else None,
            "agreements": [record_summary(r) for r in gate.store.records()],
            "registered": [record_summary(r) for r in registered.values()],
            "registered_error": error,
        }

    async def usage(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        gate = self._gate()
        owner = param(params, "owner", str, None)
        seller = param(params, "seller", str, None)
        period = param(params, "period", str, None)
        source = param(params, "source", str, "auto")
        if source not in ("auto", "ledger", "local"):
            raise InvalidParameter("source must be auto, ledger or local", {"parameter": "source"})
        node = self.d.node
        if seller is not None and node is not None:
            local = node.agents.get(seller)
            seller = local.agent_id if local is not None else seller
        try:
            page = page_request(params)
        except PageRequestError as exc:
            raise InvalidParameter(str(exc), {"parameter": exc.member}) from None
        filters = {k: v for k, v in (("owner", owner), ("seller", seller), ("period", period)) if v is not None}
        # One page, sized for this reply (the service bounds its own by max_payload too).
        budget = AGENTS_PAGE_BYTES if page.charges_bytes is None else min(page.charges_bytes, AGENTS_PAGE_BYTES)
        if source != "local" and node is not None and CLI_AGENT_NAME in node.agents:
            # The mesh's ledger first (§19.6): every seller's events, A2A charges too.
            query = {**filters, **dataclasses.asdict(page), "charges_bytes": budget}
            query = {k: v for k, v in query.items() if v is not None}
            try:
                answer = await node.service_call(node.agents[CLI_AGENT_NAME], subjects.RATING_LEDGER, "request", query)
                return {"charges_next": None, "totals_next": None, **answer, "source": "ledger"}
            except (ProtocolError, RemoteError) as exc:
                if source == "ledger":
                    raise NotFound(f"no rating service answered on {subjects.RATING_LEDGER}: {exc}") from None
        # Fallback: this node's own usage.jsonl replayed against the agreements it holds.
        if gate.usage is None:
            return {"events": 0, "charges": [], "charges_next": None, "totals": [], "totals_next": None,
                    "source": "local"}
        return {**(await self._local_view(gate, filters, page)).answer(page, budget=budget), "source": "local"}

    async def _local_view(self, gate: AgreementGate, filters: Mapping[str, str], page: PageRequest) -> LedgerView:
        """The usage log rated for ``filters``: anew for a first page, from the
        first page's view for the pages after it (:class:`_LocalView`). Rating
        the whole log is ~45 µs a line here, and the default bound holds some
        700,000: one pass per page made a full log's read take hours."""
        usage = gate.usage
        assert usage is not None
        agreements = list(gate.store.records())
        segments = usage.segments()
        key = (tuple(sorted(filters.items())), segments[0].name if segments else None,
               tuple(sorted((r.agreement.sig, r.revoked_at_ms) for r in agreements)))
        loop = asyncio.get_running_loop()
        kept = self._local
        if (page.as_of is not None and kept is not None and kept.key == key and loop.time() < kept.expires
                and page.as_of <= len(kept.view.matching)):
            kept.expires = loop.time() + LOCAL_VIEW_TTL_S
            return kept.view
        # Off the loop: the log is read and rated whole, and a busy node's runs to hundreds of MB.
        lines = await asyncio.to_thread(usage.rate, agreements)
        view = LedgerView(line_filter(lambda _c: True, **filters))
        view.update(lines)
        self._local = _LocalView(key, view, loop.time() + LOCAL_VIEW_TTL_S)
        if self._local_expiry is None:
            self._local_expiry = loop.call_later(LOCAL_VIEW_TTL_S, self._expire_local)
        return view

    def _expire_local(self) -> None:
        """Let a kept view go once no page asked for it for a while (it holds every line)."""
        self._local_expiry = None
        kept = self._local
        if kept is None:
            return
        loop = asyncio.get_running_loop()
        if loop.time() >= kept.expires:
            self._local = None
        else:
            self._local_expiry = loop.call_later(kept.expires - loop.time(), self._expire_local)

    async def revoke(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        gate = self._gate()
        document = param(params, "revocation", dict, None)
        if document is not None:
            return await self._revoke_document(document)
        sku = param(params, "sku", str)
        owner = param(params, "owner", str, None)
        seller = param(params, "seller", str, None)
        node = self.d.node
        if seller is not None and node is not None:
            local = node.agents.get(seller)
            seller = local.agent_id if local is not None else seller
        if seller is not None and not is_valid_public(seller):
            seller, _ = await self._seller_skus(seller)  # a registry name
        now = _now_ms()
        revoked = gate.store.revoke(sku=sku, consumer_owner=owner, seller_agent=seller, now_ms=now)
        key = self.d.node_key
        platform_revoked: list[dict[str, Any]] = []
        error: str | None = None
        if key is not None and owner in (None, key.public_key):
            # This owner's registered agreements to the SKU, revoked by a
            # revocation its key signs; the service tells the sellers' nodes.
            try:
                answer = await self._service(
                    self._cli(), subjects.AGREEMENTS_LOOKUP, {"consumer_owner": key.public_key, "sku": sku}
                )
                for record in parse_records(answer):
                    a = record.agreement
                    if record.revoked_at_ms is not None or (seller is not None and a.seller_agent != seller):
                        continue
                    revocation = sign_revocation(key, seller_agent=a.seller_agent, sku=a.sku, revoked_at_ms=now)
                    result = await self._service(self._cli(), subjects.AGREEMENTS_REVOKE, {"revocation": revocation})
                    if result.get("revoked"):
                        platform_revoked.append(a.to_object())
            except ProtocolError as exc:
                error = f"{exc.code}: {exc.message}"
        return {
            "revoked": [a.to_object() for a in revoked],
            "platform_revoked": platform_revoked,
            "platform_error": error,
        }
