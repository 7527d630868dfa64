"""Rating (§19.6) over a real daemon: meter events on the mesh, folded into the ledger.

One embedded-mesh daemon (it runs the rating service) hosts ``priced``
(``tests.agents.priced``: ``generate`` is priced per ``tokens_out`` token, a
meter its handler reports with ``ctx.report_usage``; ``summarize`` is flat) and
``caller`` (``tests.agents.a2a_caller``), which calls an in-process A2A peer.
The daemon's CLI identity (owned by the node, §8.3) buys; its owner signs an
agreement to ``generate`` only. ``meshnode usage`` then reads the mesh's
ledger: the reported tokens charged at the agreed unit price, a refusal at
zero, a budget's ceiling clamping the charge, the A2A call's charge beside
them, and, after a restart (the rating service folds ``MESH_METERING`` again
from its first message), the very same charges.
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


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    with Peer(Behaviour()) as started:
        yield started


@pytest.fixture(scope="module")
def daemon(peer: Peer) -> Iterator[DaemonProcess]:
    daemons = DaemonSet()
    try:
        yield daemons.embedded(
            "rating",
            agents={"priced": {"plugin": "priced"}, "caller": {"plugin": "test-a2a-caller"}},
            node={"plugin_modules": ["tests.agents.priced:plugin", "tests.agents.a2a_caller:caller_plugin"]},
            extra={
                "commerce": {"approval_url": "https://billing.example/approve"},
                "a2a.peers.weather": {"url": peer.url, "contract_price": "0.10", "issuer_key": peer.issuer_key,
                                      "timeout": "5s"},
            },
        )
    finally:
        daemons.close()


def _ledger(daemon: DaemonProcess) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(
        run_cli("usage", "--source", "ledger", "--json", "--socket", daemon.socket_path).stdout
    )
    return result


def _lines(daemon: DaemonProcess, count: int) -> dict[str, Any]:
    """The ledger once it holds ``count`` lines (the server copies events into
    MESH_METERING asynchronously)."""
    seen: dict[str, Any] = {}

    def ready() -> bool:
        seen.update(_ledger(daemon))
        return len(seen["charges"]) >= count

    eventually(ready, what=f"{count} ledger lines", timeout=30)
    return seen


def test_usage_is_rated_into_the_ledger_and_replays_identically(daemon: DaemonProcess) -> None:
    owner = daemon.status()["node"]["id"]
    seller = daemon.agent_id("priced")
    run_cli("agreements", "sign", "priced", "--offering", "generate", "--socket", daemon.socket_path)

    # The handler reports 1000 tokens_out: charged 1000 × the agreed unit price.
    served = daemon.call("priced", "generate", {"tokens": 1000})
    assert served["status"] == "completed", served
    # No agreement to summarize: refused, and the refusal rates to zero.
    refused = daemon.call("priced", "summarize", "text")
    assert refused["error"]["code"] == "AGREEMENT_REQUIRED", refused
    # A budget ceiling of 1000 micro-USD: 500 tokens cost 1500, only 1000 are charged.
    capped = daemon.admin("Call", {
        "agent": "priced", "offering": "generate", "input": {"tokens": 500}, "timeout": 30,
        "budget": {"revision": 1, "cost_ceiling": {"amount_micro": 1000, "currency": "USD"}},
    }, timeout=40)
    assert capped["status"] == "completed", capped

    # requests + tokens_out for each generate, one refusal.
    ledger = _lines(daemon, 5)
    assert ledger["source"] == "ledger"
    rated = [(c["meter"], c["quantity"], c["outcome"], c["amount_micro"]) for c in ledger["charges"]]
    assert rated == [
        ("requests", 1, "unrated_meter", 0),
        ("tokens_out", 1000, "charged", 1000 * PRICE_PER_TOKEN),
        ("requests", 0, "refused", 0),
        ("requests", 1, "unrated_meter", 0),
        ("tokens_out", 500, "clamped", 1000),
    ]
    assert ledger["charges"][4]["computed_micro"] == 500 * PRICE_PER_TOKEN  # past the ceiling: not charged
    assert all(c["consumer_owner"] == owner and c["seller_agent"] == seller for c in ledger["charges"])
    assert ledger["totals"][0]["amount_micro"] == 4000
    # The declared event derives from the respond that carried the report (§13.5).
    assert ledger["charges"][1]["envelope_id"] != ledger["charges"][0]["envelope_id"]

    # The node's own log, replayed locally, agrees to the micro-unit.
    local = json.loads(run_cli("usage", "--source", "local", "--json", "--socket", daemon.socket_path).stdout)
    assert [c["amount_micro"] for c in local["charges"]] == [c["amount_micro"] for c in ledger["charges"]]

    # A2A: the bridge's charge for a call lands in the same ledger.
    out = daemon.call("caller", "call", {"peer": "weather", "input": {"city": "Oslo"}}, timeout=60)
    assert out["status"] == "completed", out
    charged = out["output"]["a2a"]["charge"]["charged"]
    ledger = _lines(daemon, 6)
    a2a = ledger["charges"][5]
    assert (a2a["sku"], a2a["seller_agent"], a2a["consumer_owner"]) == ("a2a:weather", "a2a:weather", owner)
    assert a2a["amount_micro"] == int(Decimal(charged) * 1_000_000)

    # Replay: a restarted rating service folds the recorded stream again.
    daemon.stop()
    daemon.start()
    again = _lines(daemon, 6)
    assert again["charges"] == ledger["charges"]
    assert again["totals"] == ledger["totals"]



def _sold(daemons: DaemonSet, name: str, extra: dict[str, Any], calls: int) -> DaemonProcess:
    """An embedded daemon hosting ``priced``, its CLI identity's owner agreed to
    ``generate``, which it then calls ``calls`` times (a requests line and a
    tokens_out line each, 10 tokens a call)."""
    daemon = daemons.embedded(
        name, agents={"priced": {"plugin": "priced"}},
        node={"plugin_modules": ["tests.agents.priced:plugin"]}, extra=extra,
    )
    run_cli("agreements", "sign", "priced", "--offering", "generate", "--socket", daemon.socket_path)
    for _ in range(calls):
        served = daemon.call("priced", "generate", {"tokens": 10})
        assert served["status"] == "completed", served
    return daemon


def test_a_ledger_larger_than_one_message_is_read_in_pages(meshnode_daemons: DaemonSet) -> None:
    """A busy mesh's ledger outgrows one message: the rating service answered
    every line at once, an answer over ``max_payload`` could not be published,
    and ``meshnode usage`` timed out (in 1 MiB, about 2,300 lines). Here the
    mesh's ``max_payload`` is 32 KiB and the ledger holds 120 lines (~50 KiB):
    the totals come at once, and the lines page by page, all of them, once."""
    calls = 60
    daemon = _sold(meshnode_daemons, "paged", {"mesh.embedded": {"max_payload": "32KiB"}}, calls)
    socket = ("--socket", daemon.socket_path)
    seen: dict[str, Any] = {}

    def all_rated() -> bool:
        seen.update(json.loads(run_cli("usage", "--source", "ledger", "--json", *socket).stdout))
        return int(seen["events"]) >= 2 * calls

    eventually(all_rated, what=f"{2 * calls} ledger lines", timeout=60)
    lines = seen["charges"]
    assert seen["events"] == len(lines) == 2 * calls and seen["charges_next"] is None
    assert len({(c["meter"], c["envelope_id"]) for c in lines}) == len(lines), "a line read twice"
    assert sum(c["amount_micro"] for c in lines) == calls * 10 * PRICE_PER_TOKEN
    assert [t["amount_micro"] for t in seen["totals"]] == [calls * 10 * PRICE_PER_TOKEN]

    # The pages as the admin API gives them: each within the asked size, in ledger order.
    first = daemon.admin("Usage.Rated", {"source": "ledger", "charges_bytes": 4096})
    assert first["charges_next"] is not None and first["events"] == len(lines)
    paged = list(first["charges"])
    following = first["charges_next"]
    while following is not None:
        page = daemon.admin("Usage.Rated", {"source": "ledger", "charges_bytes": 4096, "charges_offset": following})
        assert 0 < len(json.dumps(page["charges"])) <= 4096 + 1024, "a page past the size asked"
        paged.extend(page["charges"])
        following = page["charges_next"]
    assert paged == lines

    # The totals alone do not list the lines.
    brief = daemon.admin("Usage.Rated", {"source": "ledger", "charges": False})
    assert (brief["events"], brief["charges"], brief["charges_next"]) == (len(lines), [], None)
    human = run_cli("usage", "--source", "ledger", *socket)
    assert f"{calls * 10 * PRICE_PER_TOKEN} micro-USD" in human.stdout, human.stdout
    # Each charge in micro-units too: it printed "30 USD" for 30 micro-USD.
    charged = [line for line in run_cli("usage", "--source", "ledger", "--charges", *socket).stdout.splitlines()
               if " charged " in line]
    assert charged and all(f" {10 * PRICE_PER_TOKEN} micro-USD  charged " in line for line in charged), charged


def test_the_ledger_holds_what_the_mesh_keeps_and_says_what_it_misses(meshnode_daemons: DaemonSet) -> None:
    """``MESH_METERING`` is bounded (``[storage] metering_max_bytes``) and
    discards its oldest events. Here the bound is 32 KiB and 40 calls make 80
    events.

    The running rating service lets the lines of discarded events go with
    them: its memory follows the stream's bounds, not its uptime (it had kept
    every line it ever folded), and ``usage`` says from when the lines are.
    A rating service that starts after the discards folds only what is left,
    and ``usage`` used to show those totals as if whole: after a restart the
    ledger says how many events it misses and from when it is whole, and the
    CLI says so beside the totals; it holds every line the running one did."""
    # The CLI identity asks the rating service once per poll of each round: room
    # beyond the 60 a minute a sender gets, for a slow machine's longer waits.
    daemon = _sold(meshnode_daemons, "bounded", {"storage": {"metering_max_bytes": "32KiB"},
                                                 "registry": {"rate_limit": 1000}}, 0)
    rounds, calls = 8, 5  # the stream keeps ~19 events: the service reads each round before it is discarded
    for done in range(1, rounds + 1):
        for _ in range(calls):
            assert daemon.call("priced", "generate", {"tokens": 10})["status"] == "completed"

        def round_folded(events: int = 2 * calls * done) -> dict[str, Any] | None:
            answer: dict[str, Any] = daemon.admin("Usage.Rated", {"source": "ledger"})  # folds what is new
            return answer if answer["ledger"]["seq"] >= events else None

        running = eventually(round_folded, what=f"the rating service folding round {done}", timeout=60)
    held = running["ledger"]
    assert held["complete"] is True and running["events"] + held["dropped"] == 80, running
    assert held["lines"] == running["events"] < 80 and held["held_from"].startswith("20"), held
    kept = {(c["meter"], c["envelope_id"]) for c in running["charges"]}
    human = run_cli("usage", "--source", "ledger", "--socket", daemon.socket_path)
    assert "older line(s) went with the events the mesh discarded" in human.stdout, human.stdout
    assert "ledger line(s) left with their events" in daemon.log_text()

    daemon.stop()
    daemon.start()

    def folded() -> dict[str, Any] | None:
        answer: dict[str, Any] = daemon.admin("Usage.Rated", {"source": "ledger", "charges": False})
        return answer if answer["ledger"]["seq"] >= 80 else None

    answer = eventually(folded, what="the restarted rating service's fold", timeout=60)
    ledger = answer["ledger"]
    assert ledger["complete"] is False and 0 < ledger["missed"] < 80, ledger
    assert answer["events"] + ledger["missed"] == 80, answer  # the rest are in the ledger
    replayed = daemon.admin("Usage.Rated", {"source": "ledger"})["charges"]
    assert kept <= {(c["meter"], c["envelope_id"]) for c in replayed}, "the replay lacks a line the service held"
    assert ledger["since"].startswith("20"), ledger
    human = run_cli("usage", "--source", "ledger", "--socket", daemon.socket_path)
    assert f"the ledger misses {ledger['missed']} meter event(s)" in human.stderr, human.stderr
    assert "before the rating service folded them" in daemon.log_text()


def test_the_nodes_usage_log_keeps_within_its_bound(meshnode_daemons: DaemonSet) -> None:
    """usage.jsonl, the node's own record of its priced events, grew for ever
    (~1.5 KB an event). With ``[commerce] usage_log_max_bytes`` 64 KiB, 40
    calls (80 events, ~120 KB) rotate it into segments and delete the oldest,
    saying so in the log; ``usage --source local`` rates what is kept."""
    daemon = _sold(meshnode_daemons, "logbound", {"commerce": {"usage_log_max_bytes": "64KiB"}}, 40)
    segments = sorted(p.name for p in daemon.data_dir.glob("usage.jsonl*"))
    assert "usage.jsonl" in segments and len(segments) > 1, segments
    assert sum((daemon.data_dir / name).stat().st_size for name in segments) <= 64 * 1024
    assert "deleted its oldest segment" in daemon.log_text()
    local = json.loads(run_cli("usage", "--source", "local", "--json", "--socket", daemon.socket_path).stdout)
    assert local["source"] == "local" and 0 < local["events"] < 80, local["events"]
    assert all(c["amount_micro"] == 10 * PRICE_PER_TOKEN for c in local["charges"] if c["meter"] == "tokens_out")
