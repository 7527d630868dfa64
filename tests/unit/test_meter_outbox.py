"""Meter events off the request path (meshnode.node.commerce.MeterOutbox) and the
rating service's batched catch-up (meshnode.services.rating.RatingService)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import orjson
import pytest

from meshnode.agent import AgentSettings
from meshnode.node.commerce import AgreementGate, AgreementStore, MeterOutbox, UsageLog
from meshnode.node.runtime import Node, NodeSettings
from meshnode.protocol import envelope, subjects
from meshnode.protocol.envelope import decode_envelope
from meshnode.protocol.nkeys import KeyPair
from meshnode.services import rating
from meshnode.services.base import ServiceContext
from meshnode.services.rating import Ledger, RatingService
from meshnode.testing import eventually_async
from tests.fakes import FakeConnection, FakeJetStream
from tests.unit.test_rating import NOW, Caller, Shop, _agree, _host, _request

METERING = {"mesh.event.metering.": subjects.MESH_METERING}


@pytest.fixture
async def shop(tmp_path: Path) -> Any:
    connection = FakeConnection()
    connection.jetstream = FakeJetStream(METERING)
    node = Node(settings=NodeSettings(name="t"), node_key=KeyPair.generate(),
                connection=cast(Any, connection), clock=lambda: NOW)
    outbox = MeterOutbox(first_backoff_s=0.01, max_backoff_s=0.05)
    gate = AgreementGate(AgreementStore(tmp_path / "agreements.json"), approval_surface="https://a.example",
                         gate_free_terms=False, usage=UsageLog(tmp_path / "usage.jsonl"), publisher=outbox)
    node.commerce = gate
    seller = _host(node, "shop", Shop("shop", AgentSettings()))
    buyer = _host(node, "caller", Caller("caller", AgentSettings()))
    _agree(node, gate, seller, "generate")
    yield node, seller, buyer, gate, outbox, connection.jetstream
    await outbox.close(timeout=0.1)


async def _serve(gate: AgreementGate, seller: Any, buyer: Any, rid: str) -> None:
    env = _request(buyer, rid)
    await gate.check(seller, env, "generate", NOW)
    await gate.delivered(seller, env, "generate", NOW + 1, usage=[{"meter": "tokens_out", "quantity": 10}],
                         receipt_id=f"resp-{rid}")


def _stored(js: FakeJetStream) -> list[dict[str, Any]]:
    return [decode_envelope(m.data) for m in js.streams.get(subjects.MESH_METERING, [])]


async def test_jetstream_down_never_holds_the_request_and_loses_nothing(shop: Any) -> None:
    _, seller, buyer, gate, outbox, js = shop
    js.down = True
    for rid in ("r1", "r2", "r3"):
        await _serve(gate, seller, buyer, rid)  # returns at once: nothing awaits the wire
    assert len(gate.usage.read()) == 6  # the durable record is written first, as before
    assert outbox.pending == 6 and _stored(js) == []
    await eventually_async(lambda: outbox.stats["retried"] >= 3, what="publishes retried while down")
    js.down = False
    await eventually_async(lambda: outbox.pending == 0, what="the queue drained once JetStream is back")
    events = [env["payload"]["data"] for env in _stored(js)]
    assert [(e["meter"], e["envelope_id"]) for e in events] == [
        ("requests", "r1"), ("tokens_out", "resp-r1"), ("requests", "r2"), ("tokens_out", "resp-r2"),
        ("requests", "r3"), ("tokens_out", "resp-r3")]  # in order
    assert outbox.stats["published"] == 6 and outbox.stats["dropped"] == 0


async def test_events_go_out_a_window_at_a_time_and_only_the_failed_are_retried(shop: Any) -> None:
    """The outbox publishes up to ``window`` events before waiting for their
    acks (one round trip for them all; one at a time it kept up with ~500
    events a second). Events the stream refused in a window are retried ahead
    of the rest; the acked ones are not published again."""
    _, seller, buyer, gate, outbox, js = shop
    outbox.window = 4
    js.down = True  # hold them while they queue
    for rid in ("r1", "r2", "r3"):
        await _serve(gate, seller, buyer, rid)
    js.calls.clear()
    retried = outbox.stats["retried"]  # the attempts while down
    js.fail_publishes = 1  # the first of the first window
    js.down = False
    await eventually_async(lambda: outbox.pending == 0, what="the queue drained")
    ids = [e["payload"]["data"]["envelope_id"] for e in _stored(js)]
    assert ids == ["resp-r1", "r2", "resp-r2", "r1", "r3", "resp-r3"]  # r1 failed alone: stored after its window
    assert js.calls["publish_in_flight"] == 2 and js.calls["publish"] == 7  # a window of 4, then r1 again and 2
    assert (outbox.stats["published"], outbox.stats["retried"] - retried) == (6, 1)


async def test_a_republished_event_is_charged_once(shop: Any) -> None:
    _, seller, buyer, gate, outbox, js = shop
    await _serve(gate, seller, buyer, "r1")
    await eventually_async(lambda: outbox.pending == 0, what="published")
    envs = _stored(js)
    # A retry past the stream's duplicate window stores a second copy: the ledger rates it once.
    ledger = Ledger()
    lines = [ledger.fold(env) for env in envs + envs]
    assert [c.amount_micro for c in lines if c is not None] == [0, 30]
    assert ledger.stats["duplicate"] == 2
    # Within the window the stream itself drops the republished copy (same Nats-Msg-Id).
    first = js.streams[subjects.MESH_METERING][0]
    ack = await js.publish(first.subject, first.data, headers=first.headers)
    assert ack.duplicate and len(js.streams[subjects.MESH_METERING]) == 2


async def test_a_full_outbox_drops_new_events_counted(shop: Any) -> None:
    _, seller, buyer, gate, outbox, js = shop
    outbox.capacity = 3
    js.down = True
    await _serve(gate, seller, buyer, "r1")
    await _serve(gate, seller, buyer, "r2")  # its second event is one too many
    assert outbox.pending == 3 and outbox.stats["dropped"] == 1
    assert seller.counters["metering.dropped"] == 1
    assert len(gate.usage.read()) == 4  # the dropped one is still in usage.jsonl
    js.down = False
    await eventually_async(lambda: outbox.pending == 0, what="drained")
    assert [e["payload"]["data"]["envelope_id"] for e in _stored(js)] == ["r1", "resp-r1", "r2"]


async def test_close_flushes_then_counts_what_it_could_not_publish(shop: Any) -> None:
    _, seller, buyer, gate, outbox, js = shop
    js.fail_publishes = 2  # a short outage: close's flush rides it out
    await _serve(gate, seller, buyer, "r1")
    assert await outbox.close(timeout=5.0) == 0
    assert len(_stored(js)) == 2 and outbox.stats["retried"] == 2

    later = MeterOutbox(first_backoff_s=0.01, max_backoff_s=0.02)
    gate.publisher = later
    js.down = True
    await _serve(gate, seller, buyer, "r2")
    assert await later.close(timeout=0.2) == 2  # JetStream stays down: the rest is counted, not awaited forever
    assert seller.counters["metering.unpublished"] == 2 and later.pending == 0
    assert not later.put(seller, {"id": "late"})  # closed: dropped, counted
    assert later.stats["dropped"] == 1


async def test_rating_catches_up_in_batches(shop: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    node, seller, buyer, gate, outbox, js = shop
    for i in range(300):
        await _serve(gate, seller, buyer, f"r{i}")
    await eventually_async(lambda: outbox.pending == 0, what="published", timeout=30)
    tampered = _stored(js)[-1]
    tampered["payload"]["data"]["quantity"] = 10**6  # the seller's signature no longer covers it
    js.store(subjects.MESH_METERING, b"not an envelope")
    js.store(subjects.MESH_METERING, orjson.dumps(tampered))
    verified: list[str] = []
    real_verify = envelope.verify_envelope

    def counted(env: Any, **kwargs: Any) -> None:
        verified.append(env["id"])
        real_verify(env, **kwargs)

    monkeypatch.setattr(envelope, "verify_envelope", counted)  # what decode_envelope calls
    monkeypatch.setattr(rating, "verify_envelope", counted)  # what the fold calls
    ctx = ServiceContext(connection=cast(Any, node.connection), key=KeyPair.generate(), node_id=node.node_id)
    service = RatingService(ctx)
    followed = asyncio.Event()

    async def after_first_look(seconds: float) -> None:  # the test makes the later looks itself
        followed.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(service, "_pause", after_first_look)
    js.calls.clear()
    await service.start()
    try:
        assert len(service.ledger.lines) == 600 and service.ledger.stats["refused.garbage"] == 1
        # Every event's signature is checked once: by the fold (decoding checked it
        # as well before, twice in all). The tampered copy has its original's id:
        # 601 checks of 600 ids.
        assert len(verified) == 601 and len(set(verified)) == 600
        assert service.ledger.stats["refused.signature"] == 1
        assert js.calls["message"] == 0 and js.calls["fetch"] == 3  # 602 messages, 256 a round trip
        assert js.calls["reader"] == 1
        # The follow's first look found nothing new: one stream-info round trip,
        # and the reader is let go (the broker need not keep an idle consumer).
        await followed.wait()
        assert js.calls["stream_state"] == 2 and js.calls["reader.close"] == 1

        async def look_after(request_id: str) -> dict[str, int]:
            await _serve(gate, seller, buyer, request_id)
            await eventually_async(lambda: outbox.pending == 0, what="published")
            js.calls.clear()
            assert await service.catch_up() == 2
            return dict(js.calls)

        # New events: a new reader from the cursor on. More events at the next
        # look: the same reader, no consumer made or deleted for the look.
        assert await look_after("more") == {"stream_state": 1, "reader": 1, "fetch": 1}
        assert await look_after("still more") == {"stream_state": 1, "fetch": 1}
        assert len(service.ledger.lines) == 604
        js.calls.clear()
    finally:
        await service.stop()
    assert js.calls["reader.close"] == 1  # stopping lets the kept reader go


async def test_rating_looks_again_soon_while_events_keep_coming(shop: Any) -> None:
    """The service follows MESH_METERING by looking every 2 s; a busy mesh can
    pass more than the stream's bound between two such looks, and the events
    discarded meanwhile were never rated. After a look that found events it
    looks again after 0.1 s."""
    from meshnode.services import rating

    node, seller, buyer, gate, outbox, js = shop
    ctx = ServiceContext(connection=cast(Any, node.connection), key=KeyPair.generate(), node_id=node.node_id)
    service = RatingService(ctx)
    pauses: list[float] = []
    looked = asyncio.Event()

    async def pause(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 1:  # events arrive while the service waits after its first look
            await _serve(gate, seller, buyer, "r1")
            await eventually_async(lambda: outbox.pending == 0, what="published")
        elif len(pauses) == 3:
            looked.set()
            await asyncio.Event().wait()  # the test has seen enough: wait for the stop

    service._pause = pause  # type: ignore[method-assign]
    await service.start()  # its own catch-up at start, then the follow loop's
    try:
        await asyncio.wait_for(looked.wait(), timeout=30)
        # Nothing at first (idle), two events on the next look (soon again), then idle.
        assert pauses == [rating._CATCH_UP_S, rating._BUSY_CATCH_UP_S, rating._CATCH_UP_S]
        assert len(service.ledger.lines) == 2
    finally:
        await service.stop()


async def test_rating_catch_up_without_the_stream_reads_nothing() -> None:
    connection = FakeConnection()
    ctx = ServiceContext(connection=cast(Any, connection), key=KeyPair.generate(), node_id="N")
    service = RatingService(ctx)
    service._running = True  # catch_up alone, without serving
    assert await service.catch_up() == 0  # no MESH_METERING (yet): nothing, no error
    assert dict(connection.jetstream.calls) == {"stream_state": 1}
