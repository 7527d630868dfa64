"""Meter events: the seller's outbox into MESH_METERING, and the rating service's fold.

A node serving priced calls hands two meter events a call (the observed
``requests``, the declared meter) to its :class:`~meshnode.node.meter_outbox.MeterOutbox`,
which publishes them JetStream-acked, off the request path. One at a time,
each waiting for its ack, it published ~240 events a second from a node
serving ~300 priced calls a second (~600 events), and past the outbox's
bound (10,000 waiting) the rest were dropped from the mesh's ledger (kept
only in the node's ``usage.jsonl``). Alone, without the calls, one at a time
reads faster: the busy node's loop is what each ack waited on. Measured here in one run, on one real nats-server:
the same signed events through the outbox with a window of 1 (the old way)
and of :data:`~meshnode.node.meter_outbox.OUTBOX_WINDOW`, events a second, the
stream holding every one of them once at the end of each.

The rating service then folds every event into its ledger (§19.6): it
verifies the event's signature, parses the SKU the event carries and verifies
the signature of the agreement it carries. Those two documents are the same
event after event; the fold now parses each distinct one once. Measured in
the same run: µs of CPU an event, that fold against the same ledger parsing
both every time (the baseline), on priced events as a seller's node makes
them (one agreement, a per-token SKU, a cost ceiling).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from nats.js.api import StreamConfig

from meshnode.node.commerce import rating_context
from meshnode.node.meter_outbox import OUTBOX_WINDOW, MeterOutbox, meter_envelope
from meshnode.node.runtime import Node, NodeSettings
from meshnode.protocol.commerce import make_agreement, parse_sku, verify_agreement
from meshnode.protocol.envelope import IdGenerator, build_envelope, sign_envelope
from meshnode.protocol.nkeys import KeyPair
from meshnode.services.rating import Ledger
from meshnode.transport.connection import MeshConnection
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.permissions import node_inbox_prefix

from .harness import print_table, run_loop, write_result


async def _through_outbox(node: Node, hosted: Any, stream: str, count: int, window: int) -> float:
    """Seconds from queueing ``count`` events until the stream acked them all
    (signed beforehand: the node signs an event when the call ends, not here)."""
    event_type = stream.lower()  # mesh.event.metering.<event_type>: one stream per pass
    events = [
        meter_envelope(hosted, {"meter": "requests", "class": "observed", "quantity": 1, "provider": hosted.agent_id,
                                "consumer": hosted.agent_id, "envelope_id": f"{stream}-{i}",
                                "ts": "2026-12-07T00:00:00Z"}, event_type)
        for i in range(count)
    ]
    outbox = MeterOutbox(capacity=count + 1, window=window)
    started = time.perf_counter()
    for env in events:
        outbox.put(hosted, env, event_type)
    while outbox.pending:
        await asyncio.sleep(0.002)
    elapsed = time.perf_counter() - started
    await outbox.close()
    stored = (await node.connection.jetstream.stream_state(stream)).messages
    assert stored == count and outbox.stats["published"] == count, (stored, dict(outbox.stats))
    return elapsed


async def measure(count: int) -> dict[str, Any]:
    from meshnode_echo import EchoAgent

    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        mesh = EmbeddedNatsServer(Path(tmp) / "mesh")
        await mesh.start()
        try:
            node_key, agent_key = KeyPair.generate(), KeyPair.generate()
            jwt = mesh.mint_node_credential(node_key.public_key, [agent_key.public_key], 3600, role="service")
            conn = MeshConnection([mesh.url], node_key=node_key, jwt_source=lambda: jwt,
                                  inbox_prefix=node_inbox_prefix(node_key.public_key))
            await conn.connect()
            node = Node(settings=NodeSettings(name="bench", registry_timeout_s=0.2), node_key=node_key,
                        connection=conn)
            hosted = await node.host(name="seller", kind="echo", agent_class=EchoAgent, settings={}, key=agent_key)
            seconds: dict[int, float] = {}
            # Interleaved, twice each: the later pass of each reads the warmer machine.
            for round_ in range(2):
                for window in (1, OUTBOX_WINDOW):
                    stream = f"METERING_{window}_{round_}"
                    await conn.jetstream.native.add_stream(
                        StreamConfig(name=stream, subjects=[f"mesh.event.metering.{stream.lower()}"]))
                    elapsed = await _through_outbox(node, hosted, stream, count, window)
                    seconds[window] = min(seconds.get(window, elapsed), elapsed)
                    await conn.jetstream.native.delete_stream(stream)
            await node.unhost("seller")
            await conn.close()
        finally:
            await mesh.stop()
    one, windowed = count / seconds[1], count / seconds[OUTBOX_WINDOW]
    return {"events": count, "window": OUTBOX_WINDOW, "one_in_flight_events_per_s": one,
            "windowed_events_per_s": windowed, "speedup": windowed / one}


def _priced_events(count: int) -> list[dict[str, Any]]:
    """``count`` signed meter events of one seller, as its node publishes them:
    the declared ``tokens_out`` of a per-token SKU, each carrying the SKU, the
    buyer's owner-signed agreement and the request's cost ceiling."""
    seller, owner = KeyPair.generate(), KeyPair.generate()
    sku = parse_sku({
        "sku": "generate", "covers": {"offerings": ["generate"]},
        "price": {"model": "per_unit", "currency": "USD", "meter": "tokens_out", "amount_micro": 3},
        "provider": {"id": owner.public_key, "name": "bench seller"},
    })
    agreement = verify_agreement(make_agreement(owner, seller_agent=seller.public_key, sku=sku,
                                                agreed_at_ms=1_700_000_000_000))
    ids = IdGenerator()
    events = []
    for i in range(count):
        request = {"from": owner.public_key, "id": f"req-{i}",
                   "budget": {"revision": 1, "cost_ceiling": {"amount_micro": 90_000, "currency": "USD"}}}
        data = {"meter": "tokens_out", "class": "declared", "quantity": 400, "provider": seller.public_key,
                "consumer": owner.public_key, "envelope_id": f"resp-{i}", "ts": "2026-12-07T00:00:00Z",
                "rating": rating_context(sku, owner.public_key, agreement, request)}
        env = build_envelope("emit", seller.public_key, now_ms=1_800_000_000_000 + i, ids=ids,
                             payload={"domain": "metering", "event_type": "usage", "data": data})
        events.append(sign_envelope(env, seller))
    return events


def fold_cpu_us(events: list[dict[str, Any]], *, parse_once: bool) -> float:
    """CPU µs an event of folding ``events`` into a fresh ledger (every one
    must rate to a line); ``parse_once=False`` is the baseline that parses the
    SKU and verifies the agreement of every event."""
    ledger = Ledger()
    if not parse_once:
        ledger._sku, ledger._agreement = parse_sku, verify_agreement
    started = time.process_time()
    for env in events:
        ledger.fold(env)
    cpu = time.process_time() - started
    assert len(ledger.lines) == len(events) and all(c.amount_micro == 1200 for c in ledger.lines), ledger.stats
    return cpu / len(events) * 1e6


def measure_fold(count: int, rounds: int = 5) -> dict[str, Any]:
    """The fold with and without parsing each document once, interleaved, medians."""
    events = _priced_events(count)
    once: list[float] = []
    every: list[float] = []
    for _ in range(rounds):
        once.append(fold_cpu_us(events, parse_once=True))
        every.append(fold_cpu_us(events, parse_once=False))
    med_once, med_every = statistics.median(once), statistics.median(every)
    return {"fold_events": count, "fold_cpu_us_per_event": med_once, "fold_baseline_cpu_us_per_event": med_every,
            "fold_speedup": med_every / med_once}


def run(quick: bool = False) -> dict[str, Any]:
    count = 2000 if quick else 10_000

    async def main() -> dict[str, Any]:
        result = await measure(count)
        rows = [
            ("meter outbox → MESH_METERING (acked)", "events", "events/s", "ratio"),
            (f"window of {OUTBOX_WINDOW} (now)", f"{count:,}", f"{result['windowed_events_per_s']:,.0f}",
             f"{result['speedup']:.1f}x"),
            ("one at a time (before; baseline)", f"{count:,}", f"{result['one_in_flight_events_per_s']:,.0f}", "1.0x"),
        ]
        print_table("meter events published by a seller's node (best of 2 interleaved passes each)", rows)
        print("a priced call makes two meter events; past 10,000 waiting the daemon's outbox leaves the rest in "
              "usage.jsonl and reads them back (this in-process outbox has no journal)")
        result.update(measure_fold(500 if quick else 2000))
        print_table("the rating service's fold of priced meter events (CPU, medians of 5 interleaved passes)", [
            ("fold", "µs an event", "ratio"),
            ("SKU parsed and agreement verified once per distinct document (now)",
             f"{result['fold_cpu_us_per_event']:.0f}", f"{result['fold_speedup']:.2f}x"),
            ("both for every event (before; baseline)", f"{result['fold_baseline_cpu_us_per_event']:.0f}", "1.00x"),
        ])
        print("either way every event's own signature is verified; a document that fails is checked every time")
        print(f"written {write_result('metering', result)}")
        return result

    return run_loop(main())
