"""A planned reconnect (a new credential to present) is not held back by the
client's back-off for failing servers (the soak's churn found it).

nats-py stamps a server at every connect and waits ``reconnect_wait`` before
connecting again to a server stamped within that time. Here the wait is an
hour: a second planned reconnect right after the first must still come back
within the test's ordinary timeout, against a real nats-server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.testing import eventually_async
from meshnode.transport.connection import MeshConnection
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.errors import TransportError
from meshnode.transport.messages import Message
from meshnode.transport.permissions import node_inbox_prefix

from .steady_mail import SteadyMail

HOUR_S = 3600.0


async def test_planned_reconnects_back_to_back_skip_the_failure_back_off(mesh: EmbeddedNatsServer) -> None:
    key = KeyPair.generate(Prefix.USER)
    jwt = mesh.mint_node_credential(key.public_key, [], 300, role="service")
    conn = MeshConnection(
        [mesh.url],
        node_key=key,
        jwt_source=lambda: jwt,
        name="planned reconnect",
        inbox_prefix=node_inbox_prefix(key.public_key),
        connect_timeout=2.0,
        reconnect_wait=HOUR_S,
    )
    reconnects: list[int] = []

    async def counted() -> None:
        reconnects.append(len(reconnects) + 1)

    conn.on_reconnect(counted)
    await conn.connect()
    try:
        for expected in (1, 2, 3):
            await conn.reconnect()

            def back(n: int = expected) -> bool:
                return len(reconnects) >= n and conn.is_connected

            await eventually_async(back, what=f"planned reconnect {expected} back")
        # A working connection: a PING answered by the broker.
        await conn.ping(timeout=10.0)
    finally:
        await conn.close()


async def test_a_ping_while_a_planned_reconnect_runs_waits_for_it(mesh: EmbeddedNatsServer) -> None:
    """The broker watch pings every few seconds; one that finds the client between
    servers because of a planned reconnect must not report the broker unresponsive
    (the soak's churn logged an error and counted an episode for it)."""
    key = KeyPair.generate(Prefix.USER)
    jwt = mesh.mint_node_credential(key.public_key, [], 300, role="service")
    conn = MeshConnection([mesh.url], node_key=key, jwt_source=lambda: jwt, name="ping while reconnecting",
                          inbox_prefix=node_inbox_prefix(key.public_key), connect_timeout=2.0)
    await conn.connect()
    try:
        for _ in range(3):
            await conn.reconnect()
            assert not conn.is_connected  # the ping below finds the client between servers
            await conn.ping(timeout=10.0)
            assert conn.is_connected
    finally:
        await conn.close()


async def test_a_message_tail_left_in_the_parser_does_not_outlive_the_reconnect(mesh: EmbeddedNatsServer) -> None:
    """Roster changes a few milliseconds apart at 1,000 agents wedged the
    connection for good: nats-py empties its parser when a reconnect is asked
    for, but the old connection's read loop can still feed it one more chunk
    before it is cancelled, and nats-py's own reset at the new connection never
    runs. The tail of a message cut at that chunk's end then stood in front of
    every byte of the new connection. Here the tail is put there by hand, right
    where the old read loop left it: the reconnected connection must still
    answer PINGs and carry messages."""
    key = KeyPair.generate(Prefix.USER)
    jwt = mesh.mint_user("parser-tail", key.public_key, ["test.>"], ["test.>", "_INBOX.>"], 300)
    conn = MeshConnection([mesh.url], node_key=key, jwt_source=lambda: jwt, name="parser tail", connect_timeout=2.0)
    await conn.connect()
    received: list[bytes] = []

    async def collect(msg: Message) -> None:
        received.append(msg.data)

    try:
        await conn.subscribe("test.tail", collect)
        await conn.reconnect()  # nats-py empties the parser here, synchronously
        # What the old read loop parsed next: a message cut in its payload, longer
        # than a control line may be, so the parser waits for "the rest" forever.
        conn.nc._ps.buf.extend(b'"agent":"UCDJIAFQFRHZ6Q","issued_at":"2026-12-06' + b"x" * 5000)
        await conn.ping(timeout=10.0)  # waits for the reconnect, then a PING answered
        await conn.publish("test.tail", b"after the reconnect")
        await conn.flush()
        await eventually_async(lambda: received == [b"after the reconnect"], what="the message after the reconnect")
    finally:
        await conn.close()


async def test_a_flush_whose_pong_went_with_the_connection_is_done_on_the_next(mesh: EmbeddedNatsServer) -> None:
    """The answers' barrier (the node's flush) outlives a planned reconnect.

    nats-py forgets the PONGs it waits for when it reconnects, so a flush whose
    PING went out just before a roster change waited its whole timeout (5 s):
    with a change every two seconds no barrier got through, no live request's
    pair was marked finished, the drain could purge nothing and the agent's
    buffer filled until it refused mail. Here no PONG comes until the cut (each
    dropped as the cut connection drops them; the reconnect's own hand-over
    flush waits for one too) and the connection is cut: the flush must end on
    the new connection, well inside its own timeout."""
    key = KeyPair.generate(Prefix.USER)
    jwt = mesh.mint_node_credential(key.public_key, [], 300, role="service")
    conn = MeshConnection([mesh.url], node_key=key, jwt_source=lambda: jwt, name="flush across a reconnect",
                          inbox_prefix=node_inbox_prefix(key.public_key), connect_timeout=2.0)
    await conn.connect()
    nc = conn.nc
    original = nc._process_pong
    dropped: list[bool] = []

    async def lose_the_pongs_until_the_cut() -> None:
        if not conn.disconnects:  # counted by the client's own disconnect callback
            dropped.append(True)  # its future stays waiting, as one on a cut connection does
            return
        await original()

    nc._process_pong = lose_the_pongs_until_the_cut  # type: ignore[method-assign]
    try:
        flushing = asyncio.ensure_future(conn.flush(timeout=120))
        await eventually_async(lambda: bool(dropped), what="the first PONG lost")
        assert not flushing.done()
        await conn.reconnect()
        # Without the fix the flush waits for that PONG until its 120 s are up.
        await asyncio.wait_for(flushing, timeout=60)
        assert conn.is_connected
    finally:
        await conn.close()


def _pair(
    mesh: EmbeddedNatsServer, name: str, allowed: tuple[str, ...] = ("test.>", "_INBOX.>")
) -> tuple[MeshConnection, MeshConnection]:
    """A connection under test and a peer, both allowed ``allowed`` (by default
    test.> and their replies)."""
    key = KeyPair.generate(Prefix.USER)
    jwt = mesh.mint_user(name, key.public_key, list(allowed), list(allowed), 300)
    conn = MeshConnection([mesh.url], node_key=key, jwt_source=lambda: jwt, name=name, connect_timeout=2.0)
    peer_key = KeyPair.generate(Prefix.USER)
    peer_jwt = mesh.mint_user(f"{name} peer", peer_key.public_key, list(allowed), list(allowed), 300)
    peer = MeshConnection([mesh.url], node_key=peer_key, jwt_source=lambda: peer_jwt, name=f"{name} peer",
                          connect_timeout=2.0)
    return conn, peer


async def _request_held(conn: MeshConnection, responder: MeshConnection) -> tuple[asyncio.Future[Message], Message]:
    """Connect both; ``conn`` asks test.slow and ``responder`` holds the request
    unanswered: the answer is the test's to send."""
    await conn.connect()
    await responder.connect()
    held: list[Message] = []

    async def hold(msg: Message) -> None:
        held.append(msg)

    await responder.subscribe("test.slow", hold)
    await responder.flush()
    asking = asyncio.ensure_future(conn.request("test.slow", b"?", timeout=60))
    await eventually_async(lambda: bool(held), what="the request at the responder")
    return asking, held[0]


async def test_live_mail_sent_during_planned_reconnects_all_arrives(mesh: EmbeddedNatsServer) -> None:
    """A roster change or a renewal reconnects the node; live mail sent meanwhile
    found no subscriber and was gone (a sandbox agent's for good, §16.4). A peer
    publishes without pause across three planned reconnects: every message must
    arrive, and the bridge must have covered each."""
    conn, peer = _pair(mesh, "bridged")
    mail = SteadyMail(peer, "test.live")
    reconnects: list[int] = []

    async def counted() -> None:
        reconnects.append(1)  # the drain re-runs on every reconnect (§16.4), bridged or not

    conn.on_reconnect(counted)
    await conn.connect()
    await peer.connect()
    try:
        await conn.subscribe("test.live", mail.collect)
        await conn.flush()
        mail.start()
        await mail.through_planned_reconnects(conn)
        await eventually_async(lambda: len(reconnects) == 3, what="the reconnect listeners run for each")
    finally:
        await peer.close()
        await conn.close()


async def test_a_queue_members_mail_during_planned_reconnects_all_arrives(mesh: EmbeddedNatsServer) -> None:
    """A platform service listens as a member of a queue group; the broker gives
    each message to one member only, the bridge being one. A message given to
    the connection being cut, still on its way, had no copy on the bridge and
    was lost. The connection hands its subscriptions to the bridge before the
    cut (unsubscribes, then reads what the broker sent it until then), so
    nothing is on its way to it when it goes."""
    conn, peer = _pair(mesh, "queued")
    mail = SteadyMail(peer, "test.work")
    await conn.connect()
    await peer.connect()
    try:
        await conn.subscribe("test.work", mail.collect, queue="workers")
        await conn.flush()
        mail.start()
        await mail.through_planned_reconnects(conn)
    finally:
        await peer.close()
        await conn.close()


async def test_a_reply_due_while_the_connection_is_away_comes_through_the_bridge(mesh: EmbeddedNatsServer) -> None:
    """A reply sent to the connection being cut was lost, and its request waited
    out its whole timeout (a drain pass's JetStream call: 5 s, while a busy
    agent's buffer filled). Here the answer is sent only once the connection is
    cut: the bridge holds the reply inbox and the request gets its answer."""
    conn, responder = _pair(mesh, "requester")
    cut: list[bool] = []

    async def on_cut() -> None:
        cut.append(True)

    try:
        asking, request = await _request_held(conn, responder)
        conn.on_disconnect(on_cut)
        await conn.reconnect()
        await eventually_async(lambda: bool(cut), what="the connection cut")
        await request.respond(b"!")
        reply = await asyncio.wait_for(asking, timeout=30)
        assert reply.data == b"!"
        await eventually_async(lambda: conn.is_connected, what="reconnected")
        assert conn.bridged_reconnects == 1
    finally:
        await responder.close()
        await conn.close()


async def test_without_a_bridge_a_planned_reconnect_lets_the_replies_already_due_come_first(
    mesh: EmbeddedNatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When no bridge can be opened (the broker refuses a second connection), a
    planned reconnect waits a moment for the requests already out: here the
    answer is held back until the reconnect has begun, and the connection must
    not be cut before it came in."""
    import meshnode.transport.connection as connection

    monkeypatch.setattr(connection, "PLANNED_CUT_WAIT_S", 60.0)  # however slow this machine is
    conn, responder = _pair(mesh, "unbridged")

    async def no_bridge(nc: object) -> None:
        return None

    monkeypatch.setattr(conn, "_open_bridge", no_bridge)
    replied_before_the_cut: list[bool] = []
    try:
        asking, request = await _request_held(conn, responder)
        (reply_due,) = conn.nc._resp_map.values()  # nats-py's future for that reply

        async def cut() -> None:
            replied_before_the_cut.append(reply_due.done())

        conn.on_disconnect(cut)
        reconnecting = asyncio.ensure_future(conn.reconnect())
        await eventually_async(lambda: conn._planned_reconnect, what="the planned reconnect begun")
        await request.respond(b"!")
        reply = await asyncio.wait_for(asking, timeout=30)
        await asyncio.wait_for(reconnecting, timeout=30)
        await eventually_async(lambda: bool(replied_before_the_cut) and conn.is_connected, what="reconnected")
        assert reply.data == b"!" and replied_before_the_cut == [True]
        assert conn.unbridged_reconnects == 1 and conn.bridged_reconnects == 0
    finally:
        await responder.close()
        await conn.close()


async def test_the_bridge_hands_mail_over_only_to_subscriptions_still_held(mesh: EmbeddedNatsServer) -> None:
    """What the bridge receives goes through the connection's own processing,
    as the connection's own mail would (the subscription's callback, in order;
    its answers and acks go out on the connection, not on the bridge, which
    closes soon), and only while the connection still holds that
    subscription: an agent removed during the cut gets nothing more."""
    from meshnode.transport.connection import _Bridge

    conn, _ = _pair(mesh, "relay")
    await conn.connect()
    got: list[Message] = []

    async def collect(msg: Message) -> None:
        got.append(msg)

    try:
        held = await conn.subscribe("test.held", collect)
        gone = await conn.subscribe("test.gone", collect)
        nc = conn.nc
        held_sub, gone_sub = (next(s for s in nc._subs.values() if s.subject == x) for x in ("test.held", "test.gone"))
        bridge = _Bridge(nc)  # never connected: its parser would hand it these frames
        bridge._home_sids = {101: held_sub._id, 102: gone_sub._id}
        await gone.unsubscribe()
        await bridge._process_msg(102, b"test.gone", b"", b"late", b"")
        await bridge._process_msg(103, b"test.held", b"", b"not held by the bridge", b"")
        await bridge._process_msg(101, b"test.held", b"", b"on time", b"")
        await bridge._process_msg(101, b"test.held", b"", b"next", b"")
        await eventually_async(lambda: len(got) >= 2, what="the held subscription's mail")
        assert [m.data for m in got] == [b"on time", b"next"]
        assert all(m._msg._client is nc and m._msg.sid == held_sub._id for m in got)
        await held.unsubscribe()
    finally:
        await conn.close()


async def test_a_push_consumers_deliveries_during_planned_reconnects_come_without_the_ack_wait(
    mesh: EmbeddedNatsServer,
) -> None:
    """A JetStream push consumer (an agent's events, a task's replayed updates)
    delivers to a subject of the node's: a delivery made during the cut was
    lost with the connection and came back only after the consumer's ack wait
    (30 s). The bridge holds the deliver subject too. Here the ack wait is an
    hour, so a delivery the bridge missed would fail the test's wait."""
    from nats.js.api import StreamConfig

    conn, peer = _pair(mesh, "push", allowed=(">",))
    mail = SteadyMail(peer, "push.live")
    await conn.connect()
    await peer.connect()
    try:
        await conn.jetstream.native.add_stream(StreamConfig(name="PUSH", subjects=["push.>"]))
        await conn.jetstream.durable_push(
            "push.live", mail.collect_and_ack, stream="PUSH", durable="held", replay=True, max_deliver=5, ack_wait_s=HOUR_S
        )
        mail.start()
        await mail.through_planned_reconnects(conn)
    finally:
        await peer.close()
        await conn.close()


@pytest.mark.parametrize("bridged", [True, False], ids=["bridged", "unbridged"])
@pytest.mark.parametrize("batch", [1, 16])
async def test_a_pull_consumers_fetches_during_planned_reconnects_miss_nothing(
    mesh: EmbeddedNatsServer, monkeypatch: pytest.MonkeyPatch, batch: int, bridged: bool
) -> None:
    """A durable pull consumer fetched in a loop, as the tasks service (one at
    a time) and the feeds service (in batches) do. A delivery to the fetch
    under way at the cut was lost with the connection and came again only
    after the consumer's ack wait: one run in two of three lost one. Here the
    ack wait is an hour, so a lost delivery fails the wait for every message.
    Pulled subscriptions are not bridged; the hand-over before the cut covers
    them with a bridge or without."""
    from nats.js.api import StreamConfig

    conn, peer = _pair(mesh, "pull", allowed=(">",))
    if not bridged:
        async def no_bridge(nc: object) -> None:
            return None

        monkeypatch.setattr(conn, "_open_bridge", no_bridge)
    mail = SteadyMail(peer, "pull.live")
    stop = asyncio.Event()

    async def consume() -> None:
        pull = await conn.jetstream.durable_pull("pull.live", stream="PULL", durable="pulled", ack_wait_s=HOUR_S)
        failed_in_a_row = 0
        while not stop.is_set():
            try:
                msgs = await pull.fetch(batch, timeout=1.0)
            except TransportError:  # the cut interrupted the fetch: fetch again once back, as the services do
                failed_in_a_row += 1
                assert failed_in_a_row < 100, "the fetch keeps failing with the connection up"
                await conn.wait_connected(30)
                continue
            failed_in_a_row = 0
            for msg in msgs:
                await mail.collect_and_ack(msg)

    await conn.connect()
    await peer.connect()
    try:
        await conn.jetstream.native.add_stream(StreamConfig(name="PULL", subjects=["pull.>"]))
        consuming = asyncio.ensure_future(consume())
        mail.start()
        await mail.through_planned_reconnects(conn, bridged=bridged)
        stop.set()
        await asyncio.wait_for(consuming, timeout=30)
    finally:
        await peer.close()
        await conn.close()


async def test_subscriptions_made_while_the_bridge_stands_in_get_their_mail(
    mesh: EmbeddedNatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent hosted while another roster change reconnects the node
    subscribes in the middle of that reconnect. The bridge took its list of
    subscriptions when it opened, so one made later stayed on the connection
    being cut (or, made after the cut, on none): its live mail until the
    connection was back found no subscriber, and a sandbox agent's was lost
    (§16.4). Here one subscription is made while the bridge opens and one
    while the connection is away; the mail published to each while the
    connection is away must arrive, once, and the mail after it too.

    A JetStream push consumer (a task's update consumer) bound while the
    connection is away needs no bridge: the server delivers to its subject
    only while someone listens there, so what is stored meanwhile is
    delivered once the connection is back, not after the ack wait (an hour
    here, so the test's wait would fail on it)."""
    from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

    from meshnode.transport.connection import _Bridge, flush_written

    conn, peer = _pair(mesh, "late subscriptions", allowed=(">",))
    got: dict[str, list[bytes]] = {"test.opening": [], "test.away": [], "test.js.away": []}

    def collector(subject: str) -> Callable[[Message], Awaitable[None]]:
        async def collect(msg: Message) -> None:
            got[subject].append(msg.data)
            if subject.startswith("test.js."):
                await msg.ack()

        return collect

    async def ignore(msg: Message) -> None:
        pass

    real_hold = _Bridge.hold

    async def hold_and_meanwhile_subscribe(bridge: _Bridge, sub: object) -> None:
        if not made_while_opening:  # the bridge has its list; hosting goes on meanwhile
            made_while_opening.append(await conn.subscribe("test.opening", collector("test.opening")))
        await real_hold(bridge, sub)

    made_while_opening: list[object] = []
    monkeypatch.setattr(_Bridge, "hold", hold_and_meanwhile_subscribe)
    away: list[bool] = []
    await conn.connect()
    await peer.connect()
    nc = conn.nc
    cut = nc._disconnected_cb
    assert cut is not None

    async def while_away() -> None:
        # nats-py reconnects only once this returns: the connection is away throughout.
        await cut()
        if away:
            return  # the close at the end
        away.append(True)
        await conn.subscribe("test.away", collector("test.away"))
        await conn.jetstream.bind_push("LATE", "late", "test.deliver.late", collector("test.js.away"))
        bridge = conn._bridge
        assert bridge is not None, "no bridge stands in"
        await flush_written(bridge)  # its subscriptions are in force at the broker
        await publish_each(b"while away")

    async def publish_each(data: bytes) -> None:
        for subject in got:
            if subject.startswith("test.js."):
                await peer.jetstream.publish(subject, data)  # stored, then delivered to the consumer
            else:
                await peer.publish(subject, data)
        await peer.flush()

    nc._disconnected_cb = while_away
    await peer.jetstream.native.add_stream(StreamConfig(name="LATE", subjects=["test.js.>"]))
    await peer.jetstream.native.add_consumer("LATE", ConsumerConfig(
        durable_name="late", deliver_subject="test.deliver.late", ack_policy=AckPolicy.EXPLICIT, ack_wait=HOUR_S))
    try:
        await conn.subscribe("test.before", ignore)
        await conn.flush()
        await conn.reconnect()
        await eventually_async(lambda: conn.is_connected and conn._bridge is None and bool(away),
                               what="the reconnect back, its bridge closed")
        await eventually_async(lambda: all(got.values()), what="the mail sent while away", detail=lambda: got)
        await publish_each(b"after")
        expected = {subject: [b"while away", b"after"] for subject in got}
        await eventually_async(lambda: all(len(v) >= 2 for v in got.values()), what="the mail sent after",
                               detail=lambda: got)
        assert got == expected
        assert conn.bridged_reconnects == 1 and made_while_opening
    finally:
        await peer.close()
        await conn.close()
