"""The bounded drain against a real nats-server and a real SQLite inbox.

The receiving agent here is a recorder standing in for the pipeline, so the
test can see exactly what a pass hands over; everything else is real.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from meshnode.node.drain import InboxDrain
from meshnode.node.inbox import InboxStore
from meshnode.protocol import subjects
from meshnode.protocol.envelope import build_envelope, encode_envelope, sign_envelope
from meshnode.protocol.nkeys import KeyPair
from meshnode.testing import eventually_async
from meshnode.transport.connection import MeshConnection
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.permissions import node_inbox_prefix
from meshnode.transport.streams import ensure_inbox_stream

pytestmark = pytest.mark.integration


class Recorder:
    def __init__(self, agent_id: str) -> None:
        self.agent_id = agent_id
        self.name = "recorder"
        self.received: list[tuple[str, int | None]] = []

    def signal(self, *args: Any) -> None:
        pass

    def clamp_mailbox_window(self, retention_ms: int) -> None:
        self.retention_ms = retention_ms

    async def receive(self, data: bytes, *, source: str, inbox_id: int | None = None, wait: bool = False, reply: str | None = None) -> str:
        import orjson

        self.received.append((orjson.loads(data)["id"], inbox_id))
        return "answered"


async def stored(stream_info: Any, agent_id: str, count: int) -> None:
    """Wait until the agent's buffer holds ``count`` messages. A core publish and a
    flush only say the server has the message; JetStream stores it a moment
    later, and a pass reading its bound before then would rightly not see it."""
    stream = subjects.inbox_stream_name(agent_id)

    async def holds() -> bool:
        return bool((await stream_info(stream)).state.last_seq >= count)

    await eventually_async(holds, what=f"{count} message(s) stored in {stream}")


async def _consumer(conn: MeshConnection, agent: KeyPair) -> Any:
    """The agent's drain durable as the broker sees it (nats-py's ConsumerInfo)."""
    return await conn.jetstream.native.consumer_info(
        subjects.inbox_stream_name(agent.public_key), subjects.inbox_consumer_name(agent.public_key)
    )


async def _consumer_once(conn: MeshConnection, agent: KeyPair, settled: Callable[[Any], bool], what: str) -> Any:
    """The agent's drain durable once ``settled`` holds for it. An ack is a plain
    publish that the consumer applies on its own time, so the broker can answer
    a read sent right after a pass before it has applied the pass's acks (seen
    in CI: 30 copies still pending after a pass that had acked all 30)."""

    async def probe() -> Any:
        info = await _consumer(conn, agent)
        return info if settled(info) else None

    return await eventually_async(probe, what=what, detail=lambda: "the broker still counts copies the pass acked")


class NodeStandIn:
    def __init__(self, connection: MeshConnection) -> None:
        self.connection = connection

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


async def test_a_pass_stops_at_the_bound_and_later_mail_waits(mesh: EmbeddedNatsServer, tmp_path: Path) -> None:
    node_key, agent, sender = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    jwt = mesh.mint_node_credential(node_key.public_key, [agent.public_key], 300, role="service")
    conn = MeshConnection([mesh.url], node_key=node_key, jwt_source=lambda: jwt,
                          inbox_prefix=node_inbox_prefix(node_key.public_key))
    await conn.connect()
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    try:
        await ensure_inbox_stream(conn.jetstream, agent.public_key)
        inbox_subject = subjects.agent_inbox(agent.public_key)

        sent = 0

        async def send(n: int) -> list[str]:
            nonlocal sent
            ids = []
            for _ in range(n):
                env = sign_envelope(build_envelope("request", sender.public_key, now_ms=NodeStandIn(conn).now_ms(),
                                                   to=agent.public_key, payload={"offering": "echo"}), sender)
                await conn.publish(inbox_subject, encode_envelope(env))
                ids.append(env["id"])
            await conn.flush()
            sent += n
            await stored(original, agent.public_key, sent)
            return ids

        js = conn.jetstream.native
        original = js.stream_info
        first = await send(5)
        recorder = Recorder(agent.public_key)
        drain = InboxDrain(NodeStandIn(conn), recorder, store)  # type: ignore[arg-type]

        js = conn.jetstream.native
        original = js.stream_info
        later: list[str] = []

        async def bound_then_more(name: str, *args: Any, **kw: Any) -> Any:
            info = await original(name, *args, **kw)
            later.extend(await send(3))  # arrives after the bound was read: the live path's
            return info

        js.stream_info = bound_then_more  # type: ignore[method-assign]
        await drain.run_pass()
        js.stream_info = original  # type: ignore[method-assign]
        assert [r[0] for r in recorder.received] == first
        assert drain.stats.last_bound == 5

        # The next pass takes a fresh bound and gets the rest; nothing twice.
        await drain.run_pass()
        assert [r[0] for r in recorder.received] == first + later
        skips = drain.stats.idle_skips
        await drain.run_pass()
        assert len(recorder.received) == 8
        assert drain.stats.idle_skips == skips + 1  # nothing new: one stream-info call, no consumer work
        counts = await store.counts()
        assert counts == {"answered": 8}
        # Every inbox row was committed before its ack: the consumer has nothing pending.
        await _consumer_once(conn, agent, lambda i: i.num_pending == 0 and i.num_ack_pending == 0,
                             "the consumer with nothing pending")
    finally:
        await store.close()
        await conn.close()


async def test_periodic_passes_skip_the_broker_until_mail_is_seen(mesh: EmbeddedNatsServer, tmp_path: Path) -> None:
    """Idle periodic passes cost no JetStream call while the live subscription saw
    no mail; mail seen live (or the full-check cadence) makes the next pass look."""
    node_key, agent, sender = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    jwt = mesh.mint_node_credential(node_key.public_key, [agent.public_key], 300, role="service")
    conn = MeshConnection([mesh.url], node_key=node_key, jwt_source=lambda: jwt,
                          inbox_prefix=node_inbox_prefix(node_key.public_key))
    await conn.connect()
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    try:
        await ensure_inbox_stream(conn.jetstream, agent.public_key)
        recorder = Recorder(agent.public_key)
        drain = InboxDrain(NodeStandIn(conn), recorder, store, full_every=3)  # type: ignore[arg-type]
        js = conn.jetstream.native
        original = js.stream_info
        calls: list[str] = []

        async def counting(name: str, *args: Any, **kw: Any) -> Any:
            calls.append(name)
            return await original(name, *args, **kw)

        js.stream_info = counting  # type: ignore[method-assign]
        await drain._periodic_pass()  # the start-up pass always looks
        assert len(calls) == 1
        await drain._periodic_pass()
        await drain._periodic_pass()
        assert len(calls) == 1 and drain.stats.quiet_skips == 2
        await drain._periodic_pass()  # every third pass reads the bound regardless
        assert len(calls) == 2

        env = sign_envelope(build_envelope("request", sender.public_key, now_ms=NodeStandIn(conn).now_ms(),
                                           to=agent.public_key, payload={"offering": "echo"}), sender)
        await conn.publish(subjects.agent_inbox(agent.public_key), encode_envelope(env))
        await conn.flush()
        await stored(original, agent.public_key, 1)  # uncounted: the original stream_info
        drain.note_live_mail()  # what the node's live subscription does on every message
        await drain._periodic_pass()
        assert len(calls) == 3
        assert [r[0] for r in recorder.received] == [env["id"]]
        js.stream_info = original  # type: ignore[method-assign]
    finally:
        await store.close()
        await conn.close()


async def test_a_mailbox_created_without_a_look_up_is_still_brought_up_to_date(mesh: EmbeddedNatsServer) -> None:
    # The registry creates a new agent's mailbox straight away (issue #21: one
    # JetStream call, not two); when the agent did have one, the same call
    # must leave it as it would have been left by the look-up-first path.
    node_key, agent = KeyPair.generate(), KeyPair.generate()
    jwt = mesh.mint_node_credential(node_key.public_key, [agent.public_key], 300, role="service")
    conn = MeshConnection([mesh.url], node_key=node_key, jwt_source=lambda: jwt,
                          inbox_prefix=node_inbox_prefix(node_key.public_key))
    await conn.connect()
    stream = subjects.inbox_stream_name(agent.public_key)
    try:
        assert await ensure_inbox_stream(conn.jetstream, agent.public_key, max_msgs=10, fresh=True) == "created"
        # Existing and identical: accepted as it is.
        assert await ensure_inbox_stream(conn.jetstream, agent.public_key, max_msgs=10, fresh=True) == "created"
        # Existing and different: looked up and updated in place.
        assert await ensure_inbox_stream(conn.jetstream, agent.public_key, max_msgs=20, fresh=True) == "updated"
        assert (await conn.jetstream.native.stream_info(stream)).config.max_msgs == 20
        assert await ensure_inbox_stream(conn.jetstream, agent.public_key, max_msgs=20) == "unchanged"
    finally:
        await conn.jetstream.native.delete_stream(stream)
        await conn.close()


@pytest.fixture
def acks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The stream sequences acked one by one from here on (the drain's acks, counted)."""
    from meshnode.transport.messages import Message

    acks: list[int] = []
    real_ack = Message.ack

    async def counted_ack(self: Message) -> None:
        acks.append(self.sequence)
        await real_ack(self)

    monkeypatch.setattr(Message, "ack", counted_ack)
    return acks


async def _buffer_of(mesh: EmbeddedNatsServer, count: int) -> tuple[MeshConnection, KeyPair, KeyPair, list[str]]:
    """A connection, an agent whose buffer holds ``count`` requests, their sender and their ids."""
    node_key, agent, sender = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    jwt = mesh.mint_node_credential(node_key.public_key, [agent.public_key], 300, role="service")
    conn = MeshConnection([mesh.url], node_key=node_key, jwt_source=lambda: jwt,
                          inbox_prefix=node_inbox_prefix(node_key.public_key))
    await conn.connect()
    await ensure_inbox_stream(conn.jetstream, agent.public_key)
    ids = []
    for _ in range(count):
        env = sign_envelope(build_envelope("request", sender.public_key, now_ms=NodeStandIn(conn).now_ms(),
                                           to=agent.public_key, payload={"offering": "echo"}), sender)
        await conn.publish(subjects.agent_inbox(agent.public_key), encode_envelope(env))
        ids.append(env["id"])
    await conn.flush()
    await stored(conn.jetstream.native.stream_info, agent.public_key, count)
    return conn, agent, sender, ids


async def test_settled_copies_are_purged_not_acked_and_only_those_past_a_gap_are_acked(
    mesh: EmbeddedNatsServer, tmp_path: Path, acks: list[int]
) -> None:
    """A pass lets the broker forget what it committed by purging the contiguous
    run (one call per PURGE_EVERY copies, and at its end), not by an ack per
    copy; nats-server drops purged messages from the consumer's pending acks. A
    copy still out (its live handler runs) is a gap the purge cannot cross: the
    committed copies after it are acked one by one, so nothing settled is ever
    redelivered."""
    conn, agent, sender, ids = await _buffer_of(mesh, 10)
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    try:
        store.take(agent.public_key, sender.public_key, ids[6])  # seq 7: its live handler is running
        recorder = Recorder(agent.public_key)
        drain = InboxDrain(NodeStandIn(conn), recorder, store)  # type: ignore[arg-type]
        await drain.run_pass()

        assert [r[0] for r in recorder.received] == ids[:6] + ids[7:]
        assert drain.stats.purged_through == 6
        assert sorted(acks) == [8, 9, 10]  # past the gap; 1-6 went with the purge
        stream = subjects.inbox_stream_name(agent.public_key)
        assert (await conn.jetstream.stream_state(stream)).first_seq == 7
        await _consumer_once(conn, agent, lambda i: i.num_ack_pending == 1 and i.ack_floor.stream_seq == 6,
                             "only the copy still out pending")

        # The live handler settles; a later pass takes the handed-back copy and
        # purges through the end, acking nothing more.
        await store.commit_live(agent.public_key, sender.public_key, ids[6], NodeStandIn(conn).now_ms(), settled=True)

        async def emptied() -> bool:
            await drain.run_pass()
            return drain.stats.purged_through == 10

        await eventually_async(emptied, what="the handed-back copy settled and purged", detail=drain.status)
        assert sorted(acks) == [8, 9, 10]
        assert len(recorder.received) == 9  # seq 7 was committed by its live handler: a duplicate here
        await _consumer_once(conn, agent, lambda i: i.num_ack_pending == 0 and i.num_pending == 0,
                             "the consumer with nothing pending")
    finally:
        await store.close()
        await conn.close()


@pytest.mark.parametrize("deferred", [(), (7, 30)])
async def test_over_many_fetches_copies_wait_for_the_purge_unless_past_a_gap(
    mesh: EmbeddedNatsServer, tmp_path: Path, acks: list[int], monkeypatch: pytest.MonkeyPatch,
    deferred: tuple[int, ...],
) -> None:
    """The release after each fetch sorts out only what that fetch settled while
    no purge happened since the last one; what the earlier releases kept for the
    purge stays kept. Fetches of 8 against a purge every 20: copies before the
    first gap wait for a purge across fetches and are never acked; every
    settled copy past a gap is acked (the gap stops the purge); nothing settled
    is left out for redelivery."""
    import meshnode.node.drain as drain_module

    monkeypatch.setattr(drain_module, "PURGE_EVERY", 20)
    conn, agent, sender, ids = await _buffer_of(mesh, 40)
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    try:
        for seq in deferred:  # their live handlers are running
            store.take(agent.public_key, sender.public_key, ids[seq - 1])
        recorder = Recorder(agent.public_key)
        drain = InboxDrain(NodeStandIn(conn), recorder, store, batch=8)  # type: ignore[arg-type]
        await drain.run_pass()

        first_gap = min(deferred, default=41)
        assert len(recorder.received) == 40 - len(deferred)
        assert drain.stats.purged_through == first_gap - 1
        assert sorted(acks) == [s for s in range(first_gap + 1, 41) if s not in deferred]
        await _consumer_once(conn, agent, lambda i: i.num_ack_pending == len(deferred),
                             "only the copies still out pending")
    finally:
        await store.close()
        await conn.close()


async def test_the_nodes_passes_share_a_bound_on_reading_the_broker_at_once(
    mesh: EmbeddedNatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Passes of several agents started together (as after a node's start) read
    the broker a bounded number at a time, and each still drains all of its mail."""
    import asyncio

    running = peak = 0
    real_drain = InboxDrain._drain

    async def counted(self: InboxDrain) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            await real_drain(self)
        finally:
            running -= 1

    monkeypatch.setattr(InboxDrain, "_drain", counted)
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    buffers = [await _buffer_of(mesh, 5) for _ in range(3)]
    try:
        slots = asyncio.Semaphore(1)
        recorders = [Recorder(agent.public_key) for _conn, agent, _s, _ids in buffers]
        drains = [InboxDrain(NodeStandIn(conn), recorder, store, slots=slots)  # type: ignore[arg-type]
                  for (conn, *_rest), recorder in zip(buffers, recorders, strict=True)]
        await asyncio.gather(*(d.run_pass() for d in drains))
        assert peak == 1
        for recorder, (_conn, _agent, _sender, ids) in zip(recorders, buffers, strict=True):
            assert [r[0] for r in recorder.received] == ids
    finally:
        await store.close()
        for conn, *_rest in buffers:
            await conn.close()


async def test_a_pass_purges_often_enough_for_a_small_max_ack_pending(
    mesh: EmbeddedNatsServer, tmp_path: Path, acks: list[int]
) -> None:
    """Copies wait unacked for the next purge, and they count against the
    consumer's max_ack_pending: with a durable that allows 8 (created by
    another client, bound as found) one pass still takes all 50, purging every
    4, and acks none. Were the purges spaced by PURGE_EVERY alone, the broker
    would stop delivering at 8 and the pass would end there."""
    from nats.js.api import AckPolicy, ConsumerConfig

    conn, agent, _sender, ids = await _buffer_of(mesh, 50)
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    try:
        stream, consumer = subjects.inbox_stream_name(agent.public_key), subjects.inbox_consumer_name(agent.public_key)
        await conn.jetstream.native.add_consumer(stream, ConsumerConfig(
            durable_name=consumer, ack_policy=AckPolicy.EXPLICIT, max_ack_pending=8,
            filter_subject=subjects.agent_inbox(agent.public_key)))
        recorder = Recorder(agent.public_key)
        drain = InboxDrain(NodeStandIn(conn), recorder, store, batch=16)  # type: ignore[arg-type]
        await drain.run_pass()
        assert [r[0] for r in recorder.received] == ids
        assert drain.stats.purged_through == 50 and acks == []
        assert (await conn.jetstream.stream_state(stream)).messages == 0
    finally:
        await store.close()
        await conn.close()


async def test_a_refused_purge_falls_back_to_acking_every_settled_copy(
    mesh: EmbeddedNatsServer, tmp_path: Path, acks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A credential without the purge grant (minted before it existed) costs
    room, never redeliveries: once the purge is refused the pass acks every
    copy it settled, those it was holding for the purge included."""
    from meshnode.transport.errors import TransportError
    from meshnode.transport.jetstream import MailboxBuffer

    async def refused(self: MailboxBuffer, seq: int) -> None:
        raise TransportError(f"permissions violation for publish to $JS.API.STREAM.PURGE.{self.stream}")

    monkeypatch.setattr(MailboxBuffer, "purge_through", refused)
    conn, agent, _sender, ids = await _buffer_of(mesh, 30)
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    try:
        recorder = Recorder(agent.public_key)
        drain = InboxDrain(NodeStandIn(conn), recorder, store, batch=8)  # type: ignore[arg-type]
        await drain.run_pass()
        assert len(recorder.received) == 30
        assert sorted(acks) == list(range(1, 31)) and drain.stats.purge_failures >= 1
        await _consumer_once(conn, agent, lambda i: i.num_ack_pending == 0 and i.num_pending == 0,
                             "the consumer with nothing pending")
    finally:
        await store.close()
        await conn.close()
