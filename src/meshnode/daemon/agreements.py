"""The ``Agreements.*`` admin methods (§19.5): sign, add, list and revoke agreements;
``Usage.Rated`` (§19.6): the recorded meter events rated against them.

The owner key is this node's key (read from the keystore at start): the node
is the default owner of every agent it hosts (§8.3), so it is the account
whose agreements cover requests from those agents. ``Agreements.Sign`` signs
an agreement to a seller's SKU at the digest the seller currently declares
(its own manifest when the seller is hosted here, else the registry's copy)
and keeps it in this node's store when the seller is hosted here;
``Agreements.Add`` takes an agreement signed elsewhere (a file the consumer's
operator hands over) into the store, verifying the owner's signature.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from meshnode.admin.methods import param
from meshnode.admin.protocol import InvalidParameter, NotFound
from meshnode.admin.server import CallContext, MethodRegistry
from meshnode.agent.replies import RemoteError
from meshnode.node.builtin import CLI_AGENT_NAME
from meshnode.node.commerce import AgreementGate
from meshnode.protocol import subjects
from meshnode.protocol.commerce import AgreementRecord, parse_skus, sign_agreement
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.timeutil import format_ts
from meshnode.services.rating import ledger_view

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


def register_agreement_methods(daemon: Daemon, methods: MethodRegistry) -> None:
    """Add the ``Agreements.*`` admin methods (module docstring)."""
    ops = _AgreementMethods(daemon)
    methods.add(
        "Agreements.Sign", ops.sign, level="admin",
        doc="params {seller, sku?, offering?, expires_in_s?} -> {agreement, stored}: this node's key (the owner of "
        "its agents) signs an agreement to the seller's SKU at its current digest; stored when the seller is hosted here",
    )
    methods.add(
        "Agreements.Add", ops.add, level="admin",
        doc="params {agreement} -> {agreement}: keep an owner-signed agreement (§19.5) in this node's store (verified)",
    )
    methods.add("Agreements.List", ops.list, level="operator", doc="-> {owner, agreements: [...]} the agreements this node enforces")
    methods.add(
        "Usage.Rated", ops.usage, level="operator",
        doc="params {owner?, seller?, period?, source?: auto|ledger|local} -> {events, charges: [...], totals: "
        "[{consumer_owner, seller_agent, currency, period, amount_micro}], source}: rated charges (§19.6) from the "
        "mesh's rating service (source ledger), else this node's usage log replayed against the held agreements "
        "(source local)",
    )
    methods.add(
        "Agreements.Revoke", ops.revoke, level="admin",
        doc="params {sku, owner?, seller?} -> {revoked: [...]}: revoke from now on (prospective, §19.5)",
    )


class _AgreementMethods:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def _gate(self) -> AgreementGate:
        node = self.d.node
        if node is None or node.commerce is None:
            raise NotFound("the node is not running")
        return node.commerce

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
        return {"agreement": signed, "stored": stored}

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
        return {
            "owner": key.public_key if key is not None else None,
            "agreements": [record_summary(r) for r in gate.store.records()],
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
        filters = {k: v for k, v in (("owner", owner), ("seller", seller), ("period", period)) if v is not None}
        if source != "local" and node is not None and CLI_AGENT_NAME in node.agents:
            # The mesh's ledger first (§19.6): every seller's events, A2A charges too.
            try:
                answer = await node.service_call(node.agents[CLI_AGENT_NAME], subjects.RATING_LEDGER, "request", filters)
                return {**answer, "source": "ledger"}
            except (ProtocolError, RemoteError) as exc:
                if source == "ledger":
                    raise NotFound(f"no rating service answered on {subjects.RATING_LEDGER}: {exc}") from None
        # Fallback: this node's own usage.jsonl replayed against the agreements it holds.
        if gate.usage is None:
            return {"events": 0, "charges": [], "totals": [], "source": "local"}
        return {**ledger_view(gate.usage.rate(gate.store.records()), **filters), "source": "local"}

    async def revoke(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        gate = self._gate()
        sku = param(params, "sku", str)
        owner = param(params, "owner", str, None)
        seller = param(params, "seller", str, None)
        node = self.d.node
        if seller is not None and node is not None:
            local = node.agents.get(seller)
            seller = local.agent_id if local is not None else seller
        revoked = gate.store.revoke(sku=sku, consumer_owner=owner, seller_agent=seller, now_ms=_now_ms())
        return {"revoked": [a.to_object() for a in revoked]}
