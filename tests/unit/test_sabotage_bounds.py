"""Unit checks of the #22 bounds whose live behaviour tests/integration/test_sabotage_endpoints.py
exercises: the per-node service budget's attribution, and that a node never connects with
an invite's starter credential."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshnode.config import Config
from meshnode.daemon.credentials import CredentialUnavailable, obtain_credential, store_credential
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.ratelimit import SlidingWindowLimiter
from meshnode.services.base import UNVOUCHED, NodeBudget
from meshnode.transport.embedded import EmbeddedNatsServer


def test_the_node_budget_is_spent_by_the_vouching_node_not_the_sender_key() -> None:
    vouched = {"A1": "N1", "A2": "N1"}
    budget = NodeBudget(SlidingWindowLimiter(3, 60_000), SlidingWindowLimiter(2, 60_000), vouched.get)
    decisions = [budget.check(sender, None, 1000)[2].allowed for sender in ("A1", "A2", "A1", "A2")]
    assert decisions == [True, True, True, False]  # two keys, one node: three in all
    # A registration counts against the node its subject binds, whatever the sender.
    node, _, decision = budget.check("fresh", "N2", 1000)
    assert (node, decision.allowed) == ("N2", True)
    # Keys nobody vouches for share one budget: fresh keys buy nothing.
    outcomes = [budget.check(f"fresh{i}", None, 1000) for i in range(3)]
    assert [o[0] for o in outcomes] == [UNVOUCHED] * 3
    assert [o[2].allowed for o in outcomes] == [True, True, False]


async def test_a_node_never_connects_with_a_starter_credential(tmp_path: Path) -> None:
    mesh = EmbeddedNatsServer(tmp_path / "mesh")  # keys only: minting needs no running broker
    node = KeyPair.generate()
    store_credential(tmp_path, mesh.mint_starter_credential(node.public_key, 3600), [])
    # No control plane configured: the starter, though unexpired, is not used.
    with pytest.raises(CredentialUnavailable, match="starter credential"):
        await obtain_credential(Config(), tmp_path, node, [])
