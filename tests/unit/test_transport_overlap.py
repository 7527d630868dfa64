"""The second copies a bridged reconnect's overlap brings are dropped in the transport.

While a bridge stands in for the node's client, a message can arrive by
both; the client keeps what it processed then and drops the second copy
before anything reads it (:class:`meshnode.transport.connection._OverlapCopies`).
"""

from __future__ import annotations

from typing import Any

from nats.aio.subscription import Subscription

from meshnode.transport.connection import _Client, _overlap_begins, _overlap_ends, _OverlapCopies
from tests.fakes import ManualClock


def _held(*sids: int, clock: ManualClock | None = None) -> _OverlapCopies:
    copies = _OverlapCopies(clock) if clock is not None else _OverlapCopies()
    copies.sids.update(sids)
    return copies


def test_a_message_passes_once_and_its_copy_is_dropped() -> None:
    copies = _held(7)
    assert copies.first_copy(7, b"mesh.agent.A", b"_INBOX.x.1", b"body", b"")
    assert not copies.first_copy(7, b"mesh.agent.A", b"_INBOX.x.1", b"body", b"")
    assert copies.dropped == 1


def test_messages_that_differ_in_any_part_are_all_kept() -> None:
    """A JetStream redelivery differs in its reply (the delivery count), a
    publish to two subscriptions in its subscription: neither is a copy."""
    copies = _held(7, 8)
    base = (7, b"mesh.agent.A", b"$JS.ACK.S.C.1.5.5.0.0", b"body", b"NATS/1.0\r\n\r\n")
    variants = [
        base,
        (8, *base[1:]),
        (7, b"mesh.agent.B", *base[2:]),
        (7, base[1], b"$JS.ACK.S.C.2.5.5.0.0", *base[3:]),
        (7, base[1], base[2], b"other", base[4]),
        (7, base[1], base[2], base[3], b""),
        # a part's bytes moved across a boundary is another message
        (7, b"mesh.agent.", b"A$JS.ACK.S.C.1.5.5.0.0", base[3], base[4]),
    ]
    assert all(copies.first_copy(*v) for v in variants)
    assert copies.dropped == 0


def test_what_was_seen_is_forgotten_after_the_horizon() -> None:
    clock = ManualClock()
    copies = _held(1, clock=clock)
    for n in range(100):
        assert copies.first_copy(1, b"s", b"", str(n).encode(), b"")
    clock.now += _OverlapCopies.HORIZON_S
    # The next look forgets everything older than the horizon: memory stays
    # bounded by the traffic of one horizon, however long a bridge stays open.
    assert copies.first_copy(1, b"s", b"", b"fresh", b"")
    assert len(copies._seen) == 1
    assert copies.first_copy(1, b"s", b"", b"0", b"")


def test_a_subscription_no_bridge_holds_gets_every_message() -> None:
    """A pulled subscription is not bridged, so it has no copies; and its
    fetches get the same status bytes (404 no messages) again and again,
    which must all reach it."""
    copies = _held(7)
    status = (9, b"_INBOX.pull", b"", b"", b"NATS/1.0 404 No Messages\r\n\r\n")
    assert copies.first_copy(*status) and copies.first_copy(*status)
    assert copies.dropped == 0


def test_the_filter_lives_while_any_bridge_is_open() -> None:
    """Back-to-back roster changes can open a second bridge before the first
    closed: the client keeps looking for copies until both are gone."""
    client = _Client()
    assert client.overlap is None and "_process_msg" not in vars(client)
    _overlap_begins(client, [1, 2])
    assert "_process_msg" in vars(client)  # the filter is in the message path only now
    first = client.overlap
    _overlap_begins(client, [2, 3])
    assert client.overlap is first and first is not None
    assert (first.bridges, first.sids) == (2, {1, 2, 3})
    assert first.first_copy(3, b"s", b"", b"x", b"")
    assert not first.first_copy(3, b"s", b"", b"x", b"")  # counted when the last bridge ends
    assert _overlap_ends(client) == 0 and client.overlap is first
    assert _overlap_ends(client) == 1 and client.overlap is None
    assert "_process_msg" not in vars(client)


async def test_the_filter_drops_a_copy_on_its_way_into_the_client() -> None:
    """What the parser (or a bridge) hands the client goes through the filter
    while it is on: a second copy never reaches the subscription."""
    client = _Client()
    sub = Subscription(client, 1, "s")  # as nats-py registers one; no broker needed
    client._subs[sub._id] = sub
    _overlap_begins(client, [sub._id])
    for _ in range(2):
        await client._process_msg(sub._id, b"s", b"", b"once", b"")
    await client._process_msg(sub._id, b"s", b"", b"twice", b"")
    assert [m.data for m in _queued(sub)] == [b"once", b"twice"]
    assert _overlap_ends(client) == 1


def _queued(sub: Any) -> list[Any]:
    queue = sub._pending_queue
    return [queue.get_nowait() for _ in range(queue.qsize())]
