"""Meter events survive a broker outage and a kill -9 (§13.5, §19.6): real daemons, real nats-server.

A mesh node (embedded mesh: the broker and the rating service) and a seller
node joined to it, hosting ``priced`` (``tests.agents.priced``); the seller's
CLI identity buys, its owner agreed to ``generate``. While the mesh node is
down the seller keeps serving its own callers (and its ``caller`` agent calls
an external A2A peer, a charge), and their meter events wait for JetStream.
Then the seller is killed (-9). Before, those events were in
the seller's ``usage.jsonl`` only, and the mesh's ledger never saw them; now
the seller's next start publishes them from there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from meshnode.testing import DaemonProcess, DaemonSet, eventually, run_cli
from tests.integration.a2a_peer import Behaviour, Peer

pytestmark = pytest.mark.integration

PRICE_PER_TOKEN = 3  # tests/agents/priced.py: generate


@pytest.fixture
def peer() -> Iterator[Peer]:
    with Peer(Behaviour()) as started:
        yield started


def _ledger(daemon: DaemonProcess, source: str = "ledger") -> dict[str, Any]:
    result: dict[str, Any] = json.loads(
        run_cli("usage", "--source", source, "--json", "--socket", daemon.socket_path).stdout
    )
    return result


def _lines(daemon: DaemonProcess, count: int) -> list[dict[str, Any]]:
    """The mesh's ledger lines, once there are ``count``."""
    seen: dict[str, Any] = {}

    def ready() -> bool:
        seen.update(_ledger(daemon))
        return len(seen["charges"]) >= count

    eventually(ready, what=f"{count} ledger lines", timeout=60, interval=0.5)
    lines: list[dict[str, Any]] = seen["charges"]
    return lines


def test_meter_events_of_an_outage_and_a_kill_9_reach_the_ledger_once(
    meshnode_daemons: DaemonSet, peer: Peer
) -> None:
    # The mesh node comes back on the same ports: the seller reconnects to the addresses it knows.
    ports = {"port": meshnode_daemons.port_for_restarts(), "control_port": meshnode_daemons.port_for_restarts()}
    mesh = meshnode_daemons.embedded("mesh", extra={"mesh.embedded": ports})
    seller = meshnode_daemons.joined(
        "seller", via=mesh, agents={"priced": {"plugin": "priced"}, "caller": {"plugin": "test-a2a-caller"}},
        node={"plugin_modules": ["tests.agents.priced:plugin", "tests.agents.a2a_caller:caller_plugin"]},
        extra={"a2a.peers.weather": {"url": peer.url, "contract_price": "0.10", "issuer_key": peer.issuer_key,
                                     "timeout": "5s"}},
    )
    run_cli("agreements", "sign", "priced", "--offering", "generate", "--socket", seller.socket_path)

    def sell() -> None:
        served = seller.call("priced", "generate", {"tokens": 10})
        assert served["status"] == "completed", served

    sell()
    assert len(_lines(seller, 2)) == 2  # requests and tokens_out, on the mesh

    mesh.stop()
    for _ in range(3):
        sell()  # local: served while the broker is away, the events wait for JetStream
    # An external A2A call meanwhile: its charge waits for JetStream too (its record: a2a-charges.sqlite3).
    called = seller.call("caller", "call", {"peer": "weather", "input": {"city": "Oslo"}}, timeout=60)
    assert called["status"] == "completed", called
    charged = Decimal(called["output"]["a2a"]["charge"]["charged"])
    local = _ledger(seller, "local")
    assert local["events"] == 8, local
    assert seller.status()["metering"]["queued"] == 7
    shown = run_cli("status", "--socket", seller.socket_path).stdout
    assert "metering  7 meter event(s) waiting for JetStream" in shown, shown
    seller.kill()  # the crash: what waited in memory is gone with the process

    mesh.start()
    seller.start()
    lines = _lines(seller, 9)
    assert len(lines) == 9, lines  # none missing, none rated twice
    usage = [c for c in lines if c["sku"] != "a2a:weather"]
    assert {(c["meter"], c["envelope_id"]) for c in usage} == {(c["meter"], c["envelope_id"]) for c in local["charges"]}
    assert sum(c["amount_micro"] for c in usage) == 4 * 10 * PRICE_PER_TOKEN
    assert [c["amount_micro"] for c in lines if c["sku"] == "a2a:weather"] == [int(charged * 1_000_000)]
    log = seller.log_text()
    assert "were not acked by JetStream: publishing them" in log
    assert "1 A2A charge(s) of an earlier run were not acked by JetStream: 1 queued" in log
    runtime = seller.admin("Metrics")["runtime"]
    assert (runtime["meter_events_read_back"], runtime["meter_events_waiting_in_log"]) == (6, 0), runtime
    prometheus = seller.admin("Metrics", {"format": "prometheus"})["text"]
    assert "meshnode_meter_events_read_back 6" in prometheus
    journal = seller.data_dir / "usage.published"
    assert journal.stat().st_mode & 0o777 == 0o600
