"""Mailbox drain throughput: 10,000 buffered requests through the real pipeline.

A real nats-server holds the buffer (MESH_INBOX_{agent}); the node drains it
into the SQLite inbox (WAL; the sync barrier fsyncs before every ack), acks
after each commit, and dispatches every message through the full inbound
pipeline (signature, §22 checks, admission, the echo handler, a signed
answer). Measured twice in the same run, both fetching 128 messages per
JetStream call, so the ratio is the commit grouping's alone: grouped commits
(one commit and one fsync per fetched batch) against the baseline of one
commit — and one fsync — per message. (An earlier baseline also fetched one
message per call, which mixed fetch batching into the ratio.)
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshnode.node.drain import InboxDrain
from meshnode.node.inbox import InboxStore
from meshnode.node.runtime import Node, NodeSettings
from meshnode.protocol import subjects
from meshnode.protocol.envelope import build_envelope, encode_envelope, sign_envelope
from meshnode.protocol.nkeys import KeyPair
from meshnode.transport.connection import MeshConnection
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.permissions import node_inbox_prefix
from meshnode.transport.streams import ensure_inbox_stream

from .harness import print_table, proc_cpu_s, run_loop, write_result


class _CommitPerMessage(InboxDrain):
    """The baseline: the same fetches of 128, but one commit (one fsync) and
    one ack per message."""

    async def _commit(self, msgs: Sequence[Any]) -> None:
        for m in msgs:
            await super()._commit([m])
            for settled in self._unreleased:  # acked at once, not left for the batch's purge
                await settled.ack()
            self._unreleased = []


async def _buffered(
    mesh: EmbeddedNatsServer, count: int
) -> tuple[MeshConnection, KeyPair, KeyPair, list[tuple[str, str]]]:
    """A node connection and ``count`` signed requests stored in its agent's
    mailbox; returns the connection, the agent's and the node's keys and the
    (sender, id) pairs published."""
    node_key, agent_key, sender = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    jwt = mesh.mint_node_credential(node_key.public_key, [agent_key.public_key], 3600, role="service")
    conn = MeshConnection([mesh.url], node_key=node_key, jwt_source=lambda: jwt,
                          inbox_prefix=node_inbox_prefix(node_key.public_key))
    await conn.connect()
    # Room for every message: the default mailbox bounds (count and bytes) would
    # refuse the rest, and the pass would drain only what fitted.
    await ensure_inbox_stream(conn.jetstream, agent_key.public_key, max_bytes=256 * 1024 * 1024, max_msgs=count)
    subject = subjects.agent_inbox(agent_key.public_key)
    now = time.time_ns() // 1_000_000
    pairs: list[tuple[str, str]] = []
    for i in range(count):
        env = sign_envelope(build_envelope("request", sender.public_key, now_ms=now, to=agent_key.public_key,
                                           payload={"offering": "echo", "input": {"i": i}}), sender)
        await conn.publish(subject, encode_envelope(env))
        pairs.append((sender.public_key, env["id"]))
    await conn.flush(timeout=30)
    # The stream stores asynchronously after the server has the messages: wait for all.
    stream = subjects.inbox_stream_name(agent_key.public_key)
    for _ in range(600):
        stored = (await conn.jetstream.stream_state(stream)).messages
        if stored >= count:
            break
        await asyncio.sleep(0.05)
    else:
        raise RuntimeError(f"the mailbox holds {stored} of the {count} messages published to it")
    return conn, agent_key, node_key, pairs


async def _drain_once(mesh: EmbeddedNatsServer, workdir: Path, count: int, batch: int, *, per_message: bool) -> float:
    from meshnode_echo import EchoAgent

    conn, agent_key, node_key, _ = await _buffered(mesh, count)
    node = Node(settings=NodeSettings(name="bench", registry_timeout_s=0.2), node_key=node_key, connection=conn)
    store = InboxStore(workdir / f"inbox-{batch}-{per_message}.sqlite3")
    await store.open()
    node.inbox = store
    hosted = await node.host(name="echo", kind="echo", agent_class=EchoAgent, settings={}, key=agent_key)
    await node.drains.pop("echo").stop()  # measure one explicit pass, not the periodic job
    drain = (_CommitPerMessage if per_message else InboxDrain)(node, hosted, store, batch=batch)
    started = time.perf_counter()
    await drain.run_pass()
    elapsed = time.perf_counter() - started
    assert drain.stats.committed == count, drain.stats
    assert hosted.counters["completed"] == count, hosted.counters
    await node.unhost("echo")
    await store.close()
    await conn.close()
    return elapsed


async def _redrain_seen(mesh: EmbeddedNatsServer, workdir: Path, count: int) -> tuple[float, float]:
    """CPU (µs) per copy of a pass over copies the live path already handled:
    fetched, judged (a primary-key look-up), released (purged, or acked where
    a purge cannot reach); nothing dispatched. This process's CPU, and
    nats-server's over the same pass (how the pass lets the broker forget a
    copy moves cost between the two: a purge per batch of 128 cost the broker
    more than the acks it replaced)."""
    from meshnode_echo import EchoAgent

    conn, agent_key, node_key, pairs = await _buffered(mesh, count)
    node = Node(settings=NodeSettings(name="bench", registry_timeout_s=0.2), node_key=node_key, connection=conn)
    store = InboxStore(workdir / "inbox-seen.sqlite3")
    await store.open()
    node.inbox = store
    hosted = await node.host(name="echo", kind="echo", agent_class=EchoAgent, settings={}, key=agent_key)
    await node.drains.pop("echo").stop()
    now = time.time_ns() // 1_000_000
    for sender, msg_id in pairs:  # as the live path leaves them: remembered, written
        store.remember(agent_key.public_key, sender, msg_id, now)
    await store.flush()
    drain = InboxDrain(node, hosted, store, batch=128)
    broker_pid = mesh.pid
    assert broker_pid is not None
    cpu, broker = time.process_time(), proc_cpu_s(broker_pid)
    await drain.run_pass()
    cpu, broker = time.process_time() - cpu, proc_cpu_s(broker_pid) - broker
    assert drain.stats.duplicates == count and drain.stats.committed == 0, drain.stats
    assert not hosted.counters["dispatched"], hosted.counters
    await node.unhost("echo")
    await store.close()
    await conn.close()
    return cpu / count * 1e6, broker / count * 1e6


async def measure(count: int, per_message_count: int) -> dict[str, float]:
    """The three passes on one embedded nats-server: ``count`` new messages
    with grouped commits, ``per_message_count`` with a commit per message, and
    ``count`` copies the live path already handled."""
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        mesh = EmbeddedNatsServer(Path(tmp) / "mesh")
        await mesh.start()
        try:
            grouped = await _drain_once(mesh, Path(tmp), count, batch=128, per_message=False)
            single = await _drain_once(mesh, Path(tmp), per_message_count, batch=128, per_message=True)
            seen_us, broker_us = await _redrain_seen(mesh, Path(tmp), count)
        finally:
            await mesh.stop()
    return {"messages": count, "grouped_msgs_per_s": count / grouped,
            "per_message_fsync_msgs_per_s": per_message_count / single,
            "speedup": (count / grouped) / (per_message_count / single), "redrain_seen_cpu_us_per_copy": seen_us,
            "redrain_seen_broker_cpu_us_per_copy": broker_us}


def run(quick: bool = False) -> dict[str, Any]:
    count = 1000 if quick else 10_000
    per_message_count = 200 if quick else 1000

    async def main() -> dict[str, Any]:
        result: dict[str, Any] = await measure(count, per_message_count)
        grouped_rate, single_rate = result["grouped_msgs_per_s"], result["per_message_fsync_msgs_per_s"]
        rows = [
            ("drain into handlers (real pipeline)", "messages", "msgs/s", "ratio"),
            ("grouped commits (batch 128)", f"{count:,}", f"{grouped_rate:,.0f}", f"{grouped_rate / single_rate:.1f}x"),
            ("one commit + fsync per message, same fetches (baseline)", f"{per_message_count:,}",
             f"{single_rate:,.0f}", "1.0x"),
        ]
        print_table("mailbox drain, durable commit before ack", rows)
        print(f"a pass over {count:,} copies the live path already handled (fetch, judge, release by purge; none "
              f"dispatched): {result['redrain_seen_cpu_us_per_copy']:.1f} µs of this process's CPU per copy, "
              f"nats-server {result['redrain_seen_broker_cpu_us_per_copy']:.1f} µs (/proc, 10 ms ticks)")
        print(f"written {write_result('drain', result)}")
        return result

    return run_loop(main())
