"""The sender's node tier on the receiving side (§9.7): VouchMemo verifies the
attestation in the sender's manifest again, expiry enforced, against the
operators this node trusts. The node and registry are fakes; the crypto is real."""

from __future__ import annotations

import asyncio
from typing import Any

from meshnode.node.trust import VouchMemo
from meshnode.protocol.attestations import make_trust_attestation, make_vouch
from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.testing import eventually_async
from tests.fakes import FakeNode

HOUR_MS = 3_600_000
NOW = 1_800_000_000_000


def sender_on_node(issuer: KeyPair, tier: str, *, lifetime_ms: int = HOUR_MS,
                   tamper: bool = False) -> tuple[str, dict[str, Any]]:
    node, agent = KeyPair.generate(Prefix.USER), KeyPair.generate(Prefix.USER)
    attestation = make_trust_attestation(
        issuer, node.public_key, {"trust_tier": tier}, NOW - HOUR_MS, NOW + lifetime_ms
    )
    if tamper:
        attestation["claims"] = {"trust_tier": "verified"}
    manifest = {
        "id": agent.public_key,
        "node": {
            "id": node.public_key,
            "attestation": make_vouch(node, agent.public_key, NOW - HOUR_MS, NOW + 24 * HOUR_MS),
            "trust_attestation": attestation,
        },
    }
    return agent.public_key, manifest


def test_a_trusted_attestation_gives_the_tier_until_it_expires() -> None:
    operator, stranger = KeyPair.generate(Prefix.OPERATOR), KeyPair.generate(Prefix.OPERATOR)
    sandboxed, m1 = sender_on_node(operator, "sandbox")
    forged, m2 = sender_on_node(operator, "sandbox", tamper=True)
    foreign, m3 = sender_on_node(stranger, "verified")
    stale, m4 = sender_on_node(operator, "verified", lifetime_ms=-1)
    node = FakeNode(now_ms=NOW, manifests={sandboxed: m1, forged: m2, foreign: m3, stale: m4},
                    trusted_operators=frozenset({operator.public_key}))
    memo = VouchMemo(node.as_port())

    async def look_up_all() -> list[str]:
        return [await memo.status(None, s) for s in (sandboxed, forged, foreign, stale)]  # type: ignore[arg-type]

    # Every sender is vouched for; only a trusted, intact, current attestation proves a tier.
    assert asyncio.run(look_up_all()) == ["vouched"] * 4
    assert memo.tier_of(sandboxed) == "sandbox"
    assert memo.tier_of(forged) is None
    assert memo.tier_of(foreign) is None
    assert memo.tier_of(stale) is None
    node.clock = NOW + HOUR_MS + 1  # the attestation has expired: it proves nothing now
    assert memo.tier_of(sandboxed) is None


def test_a_sender_that_keeps_writing_is_re_checked_in_the_background_and_never_waits() -> None:
    """The vouch memo answers from memory until the entry expires; from three
    quarters of its lifetime on, a status asked for starts the registry look-up
    in the background (one), so a sender that keeps writing never waits for it."""
    operator = KeyPair.generate(Prefix.OPERATOR)
    sender, manifest = sender_on_node(operator, "standard")
    node = FakeNode(now_ms=NOW, manifests={sender: manifest}, trusted_operators=frozenset({operator.public_key}))
    clock = [1000.0]
    memo = VouchMemo(node.as_port(), vouched_ttl_s=60.0, clock=lambda: clock[0])

    async def scenario() -> list[tuple[str, bool, int]]:
        seen = []
        assert not memo.known(sender)
        seen.append((await memo.status(None, sender), memo.known(sender), len(node.service_calls)))  # type: ignore[arg-type]
        clock[0] += 40.0  # two thirds: answered from memory, nothing asked
        seen.append((await memo.status(None, sender), memo.known(sender), len(node.service_calls)))  # type: ignore[arg-type]
        clock[0] += 10.0  # past three quarters: answered from memory, the look-up starts aside
        seen.append((await memo.status(None, sender), memo.known(sender), len(node.service_calls)))  # type: ignore[arg-type]
        await eventually_async(lambda: len(node.service_calls) == 2, what="the background look-up")
        clock[0] += 30.0  # past the first entry's expiry: the refreshed one answers, no wait
        known_before = memo.known(sender)
        seen.append((await memo.status(None, sender), known_before, len(node.service_calls)))  # type: ignore[arg-type]
        return seen

    assert asyncio.run(scenario()) == [
        ("vouched", True, 1),
        ("vouched", True, 1),
        ("vouched", True, 1),
        ("vouched", True, 2),
    ]
