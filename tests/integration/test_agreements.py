"""Economics §19.5 over real daemons: a paid offering and the agreement that admits it.

The consumer node runs the embedded mesh (registry, presence); the provider
joins it and hosts ``priced`` (``tests.agents.priced``), whose ``summarize``
offering declares a flat price. The consumer's CLI identity (owned by the
consumer node, §8.3) asks it for work: refused with AGREEMENT_REQUIRED before
the handler runs; served once the consumer signs an agreement
(``meshnode agreements sign``) and the provider's operator adds it
(``meshnode agreements add``); refused again after the provider restarts with
another price (the SKU's digest moved, so the standing agreement is stale).
``meshnode usage --source local`` then rates the node's recorded meter events:
refusals at zero, the served request at the price agreed, the same on every
replay (the mesh's ledger is tests/integration/test_rating.py's).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meshnode.admin.exitcodes import EX_NOPERM
from meshnode.admin.protocol import PermissionDenied
from meshnode.protocol.commerce.revocation import sign_revocation
from meshnode.protocol.nkeys import KeyPair
from meshnode.testing import DaemonProcess, DaemonSet, eventually, run_cli

pytestmark = pytest.mark.integration

APPROVAL = "https://billing.example/approve"


def _registered(daemon: DaemonProcess, name: str) -> bool:
    return any(a["name"] == name and a.get("registered") for a in daemon.status()["agents"])


@pytest.fixture(scope="module")
def nodes() -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    daemons = DaemonSet()
    try:
        consumer = daemons.embedded("consumer")
        provider = daemons.joined(
            "provider", consumer,
            agents={"priced": {"plugin": "priced"}, "desk": {"plugin": "priced", "interaction": "interactive"}},
            node={"plugin_modules": ["tests.agents.priced:plugin"]}, start=False,
        )
        provider.config_path.write_text(provider.config_path.read_text() + f'\n[commerce]\napproval_url = "{APPROVAL}"\n')
        provider.start()
        eventually(lambda: _registered(provider, "priced") and _registered(provider, "desk"),
                   what="priced and desk registered", timeout=60)
        yield consumer, provider
    finally:
        daemons.close()


def _summarize(consumer: DaemonProcess, seller: str) -> dict[str, Any]:
    result: dict[str, Any] = consumer.call(seller, "summarize", "a long text to summarize")
    return result


def test_paid_offering_needs_an_agreement_at_the_current_digest(
    nodes: tuple[DaemonProcess, DaemonProcess], tmp_path: Path
) -> None:
    consumer, provider = nodes
    seller = provider.agent_id("priced")

    # No agreement: refused at admission, with where to approve, and nothing ran.
    refused = _summarize(consumer, seller)
    assert refused["status"] == "failed", refused
    error = refused["error"]
    assert error["code"] == "AGREEMENT_REQUIRED", error
    assert error["details"]["sku"] == "summarize"
    assert error["details"]["approval_url"] == f"{APPROVAL}?sku=summarize"
    first_digest = error["details"]["sku_digest"]
    assert provider.call("priced", "ping")["output"] == {"runs": 0}
    # A free offering of the same agent is not gated.
    assert consumer.call(seller, "ping")["status"] == "completed"

    # The consumer's owner signs at the digest the registry shows (the storefront's).
    doc = tmp_path / "agreement.json"
    signed = json.loads(run_cli(
        "agreements", "sign", seller, "--offering", "summarize", "--out", str(doc),
        "--socket", consumer.socket_path, "--json",
    ).stdout)
    assert signed["stored"] is False  # the seller is hosted elsewhere
    assert signed["agreement"]["sku_digest"] == first_digest
    assert signed["agreement"]["consumer_owner"] == consumer.status()["node"]["id"]
    run_cli("agreements", "add", str(doc), "--socket", provider.socket_path)
    held = json.loads(run_cli("agreements", "list", "--socket", provider.socket_path, "--json").stdout)
    assert [a["sku"] for a in held["agreements"]] == ["summarize"]

    served = _summarize(consumer, seller)
    assert served["status"] == "completed", served
    assert served["output"]["runs"] == 1  # the refused request never ran

    # The price moves: the provider restarts with new terms, the digest moves,
    # the standing agreement (still in the store) no longer admits.
    provider.stop()
    provider.start(env_extra={"MESHNODE_TEST_PRICE_MICRO": "3000"})
    eventually(lambda: _registered(provider, "priced"), what="priced registered again", timeout=60)
    again = _summarize(consumer, seller)
    assert again["status"] == "failed", again
    assert again["error"]["code"] == "AGREEMENT_REQUIRED"
    assert again["error"]["details"]["sku_digest"] != first_digest
    assert provider.call("priced", "ping")["output"] == {"runs": 0}  # a fresh process; nothing ran
    held = json.loads(run_cli("agreements", "list", "--socket", provider.socket_path, "--json").stdout)
    assert [a["sku_digest"] for a in held["agreements"]] == [first_digest]

    # The recorded meter events, rated (§19.6): both refusals rate to zero,
    # the served request is charged at the terms agreed then; a replay is identical.
    rated = json.loads(run_cli("usage", "--source", "local", "--socket", provider.socket_path, "--json").stdout)
    outcomes = [(c["outcome"], c["amount_micro"], c["sku_digest"]) for c in rated["charges"]]
    assert outcomes == [("refused", 0, first_digest), ("charged", 2000, first_digest),
                        ("refused", 0, again["error"]["details"]["sku_digest"])]
    owner = consumer.status()["node"]["id"]
    assert [(t["consumer_owner"], t["seller_agent"], t["currency"], t["amount_micro"]) for t in rated["totals"]] == [
        (owner, seller, "USD", 2000)
    ]
    assert json.loads(run_cli("usage", "--source", "local", "--socket", provider.socket_path, "--json").stdout) == rated


def _cli_json(daemon: DaemonProcess, *args: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(run_cli(*args, "--socket", daemon.socket_path, "--json").stdout)
    return result


def test_the_platform_carries_agreements_and_revocations_to_the_seller(
    nodes: tuple[DaemonProcess, DaemonProcess], tmp_path: Path
) -> None:
    """§19.5 "registered with the platform": the consumer signs on its node and
    the seller's node admits without any `agreements add`; the signer revokes
    from its own node and the seller refuses; a stranger (the seller's node,
    holding a copy of the document) can neither register nor revoke it.

    Runs after the test above on the same mesh (its usage assertions count
    every meter event); it starts from "no live agreement at the current
    digest", which holds both after that test and on a fresh mesh."""
    consumer, provider = nodes
    seller = provider.agent_id("priced")
    owner = consumer.status()["node"]["id"]
    refused = _summarize(consumer, seller)
    assert refused["error"]["code"] == "AGREEMENT_REQUIRED", refused

    doc = tmp_path / "agreement.json"
    signed = _cli_json(consumer, "agreements", "sign", seller, "--offering", "summarize", "--out", str(doc))
    assert signed["registered"] is True and signed["stored"] is False, signed
    digest = signed["agreement"]["sku_digest"]
    assert digest == refused["error"]["details"]["sku_digest"]
    # No `agreements add` on the seller's node: the platform's copy admits
    # (its registration event dropped the seller's cached "none").
    served = eventually(
        lambda: (r := _summarize(consumer, seller))["status"] == "completed" and r, what="served after sign"
    )
    assert served["output"]["runs"] >= 1
    mine = consumer.admin("Agreements.List")["registered"]
    assert [(a["consumer_owner"], a["seller_agent"], a["sku_digest"], a["revoked_at"]) for a in mine] == [
        (owner, seller, digest, None)
    ]
    theirs = provider.admin("Agreements.List")["registered"]
    assert [(a["consumer_owner"], a["sku_digest"]) for a in theirs] == [(owner, digest)]

    # A stranger holding the document cannot register it (it does not own the
    # signer's key), nor revoke it; the platform's record is unchanged.
    stranger = subprocess.run(
        [sys.executable, "-m", "meshnode.cli", "agreements", "register", str(doc), "--socket", provider.socket_path],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )
    assert stranger.returncode == EX_NOPERM, stranger
    assert "not_the_owner" in stranger.stderr or "only the owner" in stranger.stderr, stranger.stderr
    assert provider.admin("Agreements.Revoke", {"sku": "summarize"})["platform_revoked"] == []
    forged = sign_revocation(KeyPair.generate(), seller_agent=seller, sku="summarize", revoked_at_ms=time.time_ns() // 10**6)
    forged["consumer_owner"] = owner  # claims the owner; signed by another key
    with pytest.raises(PermissionDenied) as denied:
        provider.admin("Agreements.Revoke", {"revocation": forged})
    assert denied.value.params["code"] == "UNAUTHORIZED", denied.value.params
    assert denied.value.params["details"]["reason"] == "bad_signature"
    assert consumer.admin("Agreements.List")["registered"] == mine
    assert _summarize(consumer, seller)["status"] == "completed"

    # The signer revokes from its own node: the seller's node refuses again.
    revoked = _cli_json(consumer, "agreements", "revoke", "summarize")
    assert [a["sku_digest"] for a in revoked["platform_revoked"]] == [digest], revoked
    again = eventually(
        lambda: (r := _summarize(consumer, seller))["status"] == "failed" and r, what="refused after revoke"
    )
    assert again["error"]["code"] == "AGREEMENT_REQUIRED", again
    listed = consumer.admin("Agreements.List")["registered"]
    assert [a["revoked_at"] is not None for a in listed] == [True]
    # Re-registering the revoked document is refused: a replay cannot undo a revocation.
    with pytest.raises(PermissionDenied) as replay:
        consumer.admin("Agreements.Register", {"agreement": json.loads(doc.read_text())})
    assert replay.value.params["details"]["reason"] == "revoked", replay.value.params


def test_an_interactive_agent_checks_the_agreement_before_it_holds(
    nodes: tuple[DaemonProcess, DaemonProcess], tmp_path: Path
) -> None:
    # A person answers desk's requests (interaction = "interactive"): a paid
    # offering's request is refused at admission, not held for the person.
    consumer, provider = nodes
    desk = provider.agent_id("desk")
    refused = consumer.call(desk, "summarize", "please summarize", timeout=10)
    assert refused["status"] == "failed", refused
    assert refused["error"]["code"] == "AGREEMENT_REQUIRED" and refused["error"]["details"]["sku"] == "summarize"
    assert _cli_json(provider, "inbox", "list", "--agent", "desk")["messages"] == []

    doc = tmp_path / "desk-agreement.json"
    run_cli("agreements", "sign", desk, "--offering", "summarize", "--out", str(doc),
            "--socket", consumer.socket_path)
    run_cli("agreements", "add", str(doc), "--socket", provider.socket_path)
    queued = consumer.call(desk, "summarize", "please summarize", timeout=10)
    assert queued["status"] == "queued" and queued["inbox_id"], queued
    held = _cli_json(provider, "inbox", "list", "--agent", "desk")["messages"]
    assert [str(m["id"]) for m in held] == [str(queued["inbox_id"])]

    # §19.3: agreed, but the request's cost_ceiling is below the flat price:
    # refused with the price as the estimate, before anything is held.
    low = consumer.admin("Call", {
        "agent": desk, "offering": "summarize", "input": "please summarize", "timeout": 10,
        "budget": {"revision": 1, "cost_ceiling": {"amount_micro": 1999, "currency": "USD"}},
    }, timeout=20)
    assert low["status"] == "failed" and low["error"]["code"] == "BUDGET_INSUFFICIENT", low
    manifest = provider.admin("Agents.Show", {"name": "desk"})["manifest"]
    price = next(s["price"] for s in manifest["skus"] if s["sku"] == "summarize")  # the price in force
    assert price["amount_micro"] > 1999
    assert low["error"]["details"]["estimate"] == {"amount_micro": price["amount_micro"], "currency": "USD"}
    assert [str(m["id"]) for m in _cli_json(provider, "inbox", "list", "--agent", "desk")["messages"]] == [
        str(queued["inbox_id"])
    ]
