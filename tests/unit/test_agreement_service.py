"""The platform agreement service's rules (meshnode.services.agreements) and the
seller node's cached look-up of it (meshnode.node.agreement_lookup), §19.5."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from meshnode.agent import Agent, AgentSettings, Context, offering
from meshnode.node.agreement_lookup import PlatformAgreements
from meshnode.node.commerce import AgreementGate, AgreementStore
from meshnode.node.hosted import HostedAgent
from meshnode.node.manifests import build_manifest
from meshnode.node.runtime import Node, NodeSettings
from meshnode.protocol import subjects
from meshnode.protocol.commerce import make_agreement, parse_agreement, parse_sku, verify_agreement
from meshnode.protocol.commerce.revocation import sign_revocation, verify_revocation
from meshnode.protocol.envelope import build_envelope, encode_envelope, sign_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair
from meshnode.services.agreements import authorize_owner, record_out, registered, revoked
from meshnode.transport.connection import Message
from tests.fakes import FakeConnection, FakeMsg, FakeNode

NOW = 1_800_000_000_000
OWNER = KeyPair.generate()
STRANGER = KeyPair.generate()
SELLER = KeyPair.generate().public_key
AGENT = KeyPair.generate().public_key
SKU = parse_sku({"sku": "summarize", "covers": {"offerings": ["summarize"]},
                 "price": {"model": "flat", "currency": "USD", "amount_micro": 2000}, "provider": {"id": "internal"}})


def _agreement(at_ms: int = NOW - 1000, owner: KeyPair = OWNER, seller: str = SELLER) -> dict[str, Any]:
    return make_agreement(owner, seller_agent=seller, sku=SKU, agreed_at_ms=at_ms)


def test_only_the_owner_or_an_agent_it_owns_may_register_or_revoke() -> None:
    authorize_owner(OWNER.public_key, OWNER.public_key, None, "x")  # the owner key itself
    authorize_owner(AGENT, OWNER.public_key, OWNER.public_key, "x")  # an agent the registry says it owns
    for sender_owner in (STRANGER.public_key, None):
        with pytest.raises(ProtocolError) as info:
            authorize_owner(AGENT, OWNER.public_key, sender_owner, "registering an agreement")
        assert info.value.code == "UNAUTHORIZED"
        assert info.value.details == {"reason": "not_the_owner", "consumer_owner": OWNER.public_key}


def test_a_revocation_is_prospective_and_a_replay_cannot_undo_it() -> None:
    doc = _agreement()
    record = registered(None, verify_agreement(doc), sender=AGENT, now_ms=NOW)
    assert record["agreement"] == doc and record_out(record) == {"agreement": doc}
    # Back-dated to before the agreement's use: the record revokes from when the service got it.
    revocation = verify_revocation(sign_revocation(OWNER, seller_agent=SELLER, sku="summarize", revoked_at_ms=NOW - 500))
    after = revoked(record, revocation, now_ms=NOW)
    assert after is not None and after["revoked_at_ms"] == NOW and after["revocation_at_ms"] == NOW - 500
    assert record_out(after)["revoked_at_ms"] == NOW
    assert revoked(after, revocation, now_ms=NOW + 1) is None  # already revoked: nothing changes
    # The same document registered again (by its owner even) stays revoked.
    with pytest.raises(ProtocolError) as info:
        registered(after, verify_agreement(doc), sender=AGENT, now_ms=NOW + 1)
    assert info.value.code == "UNAUTHORIZED" and info.value.details["reason"] == "revoked"
    # Signing again later is a new agreement; the old revocation does not reach it.
    newer = _agreement(at_ms=NOW + 10)
    again = registered(after, verify_agreement(newer), sender=AGENT, now_ms=NOW + 20)
    assert again["agreement"] == newer and "revoked_at_ms" not in again
    assert revoked(again, revocation, now_ms=NOW + 30) is None
    # An older document never replaces a newer live one.
    with pytest.raises(ProtocolError) as stale:
        registered(again, verify_agreement(_agreement(at_ms=NOW)), sender=AGENT, now_ms=NOW + 40)
    assert stale.value.details == {"member": "agreement.agreed_at", "reason": "stale"}


def test_revoking_nothing_is_not_found_and_only_the_signer_revokes() -> None:
    revocation = verify_revocation(sign_revocation(OWNER, seller_agent=SELLER, sku="summarize", revoked_at_ms=NOW))
    with pytest.raises(ProtocolError) as info:
        revoked(None, revocation, now_ms=NOW)
    assert info.value.code == "NOT_FOUND"
    # A stranger's key cannot sign for the owner: the revocation does not verify.
    forged = sign_revocation(STRANGER, seller_agent=SELLER, sku="summarize", revoked_at_ms=NOW)
    forged["consumer_owner"] = OWNER.public_key
    with pytest.raises(ProtocolError) as bad:
        verify_revocation(forged)
    assert bad.value.code == "IDENTITY_MISMATCH" and bad.value.details["reason"] == "bad_signature"
    # An agreement's signature is under another tag: it is no revocation.
    doc = _agreement()
    as_revocation = {"v": 1, "consumer_owner": OWNER.public_key, "seller_agent": SELLER, "sku": "summarize",
                     "revoked_at": doc["agreed_at"], "sig": doc["sig"]}
    with pytest.raises(ProtocolError):
        verify_revocation(as_revocation)
    with pytest.raises(ProtocolError) as shape:
        verify_revocation({**revocation.document, "sku": "No Such"})
    assert shape.value.details["member"] == "revocation.sku"


# -- the seller node's look-up -------------------------------------------------


class Shop(Agent):
    @offering("summarize", price={"model": "flat", "currency": "USD", "amount_micro": 2000})
    async def summarize(self, ctx: Context, input: Any) -> Any:
        return "s"


def _seller(node: Any) -> HostedAgent:
    key = KeyPair.generate()
    hosted = HostedAgent(node, name="shop", kind="test", agent=Shop("shop", AgentSettings()), key=key,
                         guard=node.new_guard(key.public_key), interaction="service")
    node.agents["shop"] = hosted
    node.by_id[hosted.agent_id] = hosted
    return hosted


def _event(key: KeyPair, event_type: str, data: dict[str, Any]) -> Message:
    env = build_envelope("emit", key.public_key, now_ms=NOW,
                         payload={"domain": "agreements", "event_type": event_type, "data": data})
    sign_envelope(env, key)
    return FakeMsg(f"mesh.event.agreements.{event_type}", encode_envelope(env)).as_message()


async def test_lookups_are_single_flight_cached_and_dropped_on_a_platform_event() -> None:
    node = FakeNode(now_ms=NOW)
    seller = _seller(node)
    platform_key = KeyPair.generate()
    node.platform_keys.add(platform_key.public_key)
    gate_open = asyncio.Event()
    doc = _agreement(seller=seller.agent_id)
    forged = {**_agreement(owner=STRANGER, seller=seller.agent_id), "consumer_owner": OWNER.public_key}
    answer: dict[str, Any] = {"agreements": [{"agreement": doc}, {"agreement": forged}]}

    async def lookup(payload: Any) -> dict[str, Any]:
        assert payload == {"consumer_owner": OWNER.public_key, "seller_agent": seller.agent_id, "sku": "summarize"}
        await gate_open.wait()
        return answer

    node.service_answers[subjects.AGREEMENTS_LOOKUP] = lookup
    platform = PlatformAgreements(node.as_port(), ttl_s=60)
    herd = [asyncio.create_task(platform.records(seller, OWNER.public_key, "summarize")) for _ in range(20)]
    await asyncio.sleep(0)
    gate_open.set()
    results = await asyncio.gather(*herd)
    assert platform.lookups == 1  # one look-up for the herd, never RATE_LIMITED for bookkeeping
    # The forged one (not signed by its consumer_owner) is dropped; the service is not trusted to make one up.
    assert all([r.agreement.document for r in res] == [doc] for res in results)
    await platform.records(seller, OWNER.public_key, "summarize")
    assert platform.lookups == 1  # cached

    # An event from anyone but the platform changes nothing; the platform's drops the entry.
    data = {"consumer_owner": OWNER.public_key, "seller_agent": seller.agent_id, "sku": "summarize"}
    await platform.on_event(_event(STRANGER, "revoked", data))
    await platform.records(seller, OWNER.public_key, "summarize")
    assert platform.lookups == 1
    answer = {"agreements": [{"agreement": doc, "revoked_at_ms": NOW}]}
    await platform.on_event(_event(platform_key, "revoked", data))
    [record] = await platform.records(seller, OWNER.public_key, "summarize")
    assert platform.lookups == 2 and record.revoked_at_ms == NOW
    await platform.close()


async def test_an_unreachable_service_is_no_agreement_for_a_short_while() -> None:
    node = FakeNode(now_ms=NOW)
    seller = _seller(node)

    async def down(payload: Any) -> dict[str, Any]:
        raise ProtocolError("AGENT_UNAVAILABLE", "no service answers on mesh.agreements.lookup")

    node.service_answers[subjects.AGREEMENTS_LOOKUP] = down
    platform = PlatformAgreements(node.as_port(), ttl_s=60, unavailable_ttl_s=60)
    assert await platform.records(seller, OWNER.public_key, "summarize") == []
    assert await platform.records(seller, OWNER.public_key, "summarize") == []
    assert platform.lookups == 1  # remembered, not asked per request
    await platform.close()


async def test_the_gate_admits_on_a_registered_agreement_and_refuses_once_revoked(tmp_path: Path) -> None:
    node = Node(settings=NodeSettings(name="t"), node_key=KeyPair.generate(),
                connection=FakeConnection().as_connection(), clock=lambda: NOW)
    shop = _seller(node)
    shop.manifest = build_manifest(shop, {"id": node.node_id}, 65536)
    caller_key = KeyPair.generate()
    caller = HostedAgent(node, name="caller", kind="test", agent=Shop("caller", AgentSettings()), key=caller_key,
                         guard=node.new_guard(caller_key.public_key), interaction="service")
    node.agents["caller"] = caller
    node.by_id[caller.agent_id] = caller
    caller.manifest = build_manifest(caller, {"id": node.node_id}, 65536)
    gate = AgreementGate(AgreementStore(tmp_path / "agreements.json"), approval_surface="https://a.example",
                         gate_free_terms=False)
    [sku] = shop.skus
    doc = make_agreement(node.key, seller_agent=shop.agent_id, sku=sku, agreed_at_ms=NOW - 1000)
    records: list[dict[str, Any]] = [{"agreement": doc}]
    lookups = FakeNode(now_ms=NOW)
    lookups.by_id[shop.agent_id] = shop

    async def lookup(payload: Any) -> dict[str, Any]:
        return {"agreements": records}

    lookups.service_answers[subjects.AGREEMENTS_LOOKUP] = lookup
    gate.platform = PlatformAgreements(lookups.as_port(), ttl_s=60)
    env = {"from": caller.agent_id, "id": "r1"}
    assert await gate.check(shop, env, "summarize", NOW) == sku  # nothing in the local store
    records[0] = {"agreement": doc, "revoked_at_ms": NOW + 5}
    gate.platform.invalidate(node.node_id, shop.agent_id, sku.sku)
    with pytest.raises(ProtocolError) as info:
        await gate.check(shop, {**env, "id": "r2"}, "summarize", NOW + 10)
    assert info.value.code == "AGREEMENT_REQUIRED" and info.value.details["sku_digest"] == sku.digest
    assert parse_agreement(doc).consumer_owner == node.node_id
    assert orjson.loads(orjson.dumps(records))  # the answers stay JSON
    await gate.platform.close()
