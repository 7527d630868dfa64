"""Meter events into MESH_METERING: the seller's outbox, one event in flight against a window.

A node serving priced calls hands two meter events a call (the observed
``requests``, the declared meter) to its :class:`~meshnode.node.commerce.MeterOutbox`,
which publishes them JetStream-acked, off the request path. One at a time,
each waiting for its ack, it published ~240 events a second from a node
serving ~300 priced calls a second (~600 events), and past the outbox's
bound (10,000 waiting) the rest were dropped from the mesh's ledger (kept
only in the node's ``usage.jsonl``). Alone, without the calls, one at a time
reads faster: the busy node's loop is what each ack waited on. Measured here in one run, on one real nats-server:
the same signed events through the outbox with a window of 1 (the old way)
and of :data:`~meshnode.node.commerce.OUTBOX_WINDOW`, events a second, the
stream holding every one of them once at the end of each.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from nats.js.api import StreamConfig

from meshnode.node.commerce import OUTBOX_WINDOW, MeterOutbox, meter_envelope
from meshnode.node.runtime import Node, NodeSettings
from meshnode.protocol.nkeys import KeyPair
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
        print("a priced call makes two meter events; the outbox drops what is past 10,000 waiting")
        print(f"written {write_result('metering', result)}")
        return result

    return run_loop(main())
