"""Meter events off the request path (meshnode.node.meter_outbox.MeterOutbox) and the
rating service's batched catch-up (meshnode.services.rating.RatingService)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, cast

import orjson
import pytest

from meshnode.a2a import charges as charges_module
from meshnode.a2a.charges import Charge, ChargeStore
from meshnode.a2a.outbound import A2AOutbound
from meshnode.agent import AgentSettings
from meshnode.daemon.gateways import A2AGateways
from meshnode.node.commerce import AgreementGate, AgreementStore
from meshnode.node.meter_outbox import OUTBOX_READ_BACK, MeterJournal, MeterOutbox
from meshnode.node.runtime import Node, NodeSettings
from meshnode.node.usage_log import LogPosition, UsageLog, rating_context_of
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


def _journaled(gate: AgreementGate, **kwargs: Any) -> MeterOutbox:
    """An outbox over the gate's usage log as its journal, as the daemon makes
    one at each start, and the gate's publisher from now on."""
    assert gate.usage is not None
    outbox = MeterOutbox(first_backoff_s=0.01, max_backoff_s=0.05, journal=MeterJournal(gate.usage), **kwargs)
    gate.publisher = outbox
    return outbox


def _published(js: FakeJetStream) -> list[tuple[str, str]]:
    return [(e["meter"], e["envelope_id"]) for e in (env["payload"]["data"] for env in _stored(js))]


async def test_events_left_at_stop_are_published_after_the_next_start(shop: Any) -> None:
    """Events JetStream had not acked at stop were lost to the mesh's ledger
    (only usage.jsonl kept them). The usage log is now the outbox's journal:
    the next start reads them back from it, once its agents are hosted, and
    publishes them, signed anew by their agent, with the rating context they
    went out with."""
    node, seller, buyer, gate, _, js = shop
    first = _journaled(gate)
    first.resume(node.by_id.get)
    await _serve(gate, seller, buyer, "r1")
    await eventually_async(lambda: first.pending == 0, what="r1 published")
    js.down = True
    await _serve(gate, seller, buyer, "r2")
    await _serve(gate, seller, buyer, "r3")
    assert await first.close(timeout=0.1) == 4
    await _serve(gate, seller, buyer, "r4")  # completed after stop's flush: its events wait in the log too
    assert seller.counters["metering.unpublished"] == seller.counters["metering.dropped"] == 0  # none lost
    assert _published(js) == [("requests", "r1"), ("tokens_out", "resp-r1")]

    js.down = False
    second = _journaled(gate)  # the next start
    assert second.backlog is not None and second.pending == 0  # nothing signed before the agents are hosted
    second.resume(node.by_id.get)
    await eventually_async(lambda: len(_stored(js)) == 8, what="the events left at stop, published")
    assert _published(js)[2:] == [(m, f"{p}r{i}") for i in (2, 3, 4) for m, p in (("requests", ""), ("tokens_out", "resp-"))]
    assert second.backlog is None and second.stats["read_back"] == 6
    logged = {(r["event"]["meter"], r["event"]["envelope_id"]): r for r in gate.usage.read()}
    for env in _stored(js)[2:]:
        data = env["payload"]["data"]
        assert env["from"] == seller.agent_id
        assert data["rating"] == rating_context_of(logged[(data["meter"], data["envelope_id"])])
        assert data["rating"]["interaction"] in ("r2", "r3", "r4") and data["rating"]["agreement"]
    # The ledger rates them as it rated r1's.
    ledger = Ledger()
    charged = [ledger.fold(env) for env in _stored(js)]
    assert [c.amount_micro for c in charged if c is not None] == [0, 30] * 4
    await eventually_async(lambda: second.journal is not None and second.journal.load() == gate.usage.end(),
                           what="the journal's place at the log's end")
    await second.close(timeout=1.0)


async def test_after_a_crash_nothing_is_lost_and_what_goes_out_twice_is_charged_once(shop: Any) -> None:
    """A kill -9 leaves the queue unpublished and the journal's place up to a
    second behind: the next start publishes everything after that place. An
    event published before the crash but after the place goes out twice; the
    ledger charges it once."""
    node, seller, buyer, gate, _, js = shop
    crashed = _journaled(gate)
    crashed.resume(node.by_id.get)
    await _serve(gate, seller, buyer, "r1")
    await eventually_async(lambda: crashed.pending == 0, what="r1 published")
    assert crashed.journal is not None
    crashed.journal.save(LogPosition(1, 0))  # the place was not yet saved past r1 when the process died
    js.down = True
    await _serve(gate, seller, buyer, "r2")
    assert crashed._worker is not None
    crashed._worker.cancel()  # the crash: nothing more happens in that process
    js.down = False

    restarted = _journaled(gate)
    restarted.resume(node.by_id.get)
    await eventually_async(lambda: len(_stored(js)) == 6, what="r1 again and r2")
    assert _published(js) == [("requests", "r1"), ("tokens_out", "resp-r1")] * 2 + [
        ("requests", "r2"), ("tokens_out", "resp-r2")]
    ledger = Ledger()
    charged = [c for c in (ledger.fold(env) for env in _stored(js)) if c is not None]
    assert sorted((c.meter, c.envelope_id, c.amount_micro) for c in charged) == [
        ("requests", "r1", 0), ("requests", "r2", 0), ("tokens_out", "resp-r1", 30), ("tokens_out", "resp-r2", 30)]
    assert ledger.stats["duplicate"] == 2
    await restarted.close(timeout=1.0)


async def test_a_full_outbox_leaves_events_in_the_log_and_publishes_them_in_order(shop: Any) -> None:
    """Past ``capacity`` an event was dropped (usage.jsonl kept it, the mesh
    never saw it). With the journal it waits in the log, unsigned, and is read
    back once the queue has room: none is dropped, they go out in order, and
    new events queue again once the log is read to its end."""
    node, seller, buyer, gate, _, js = shop
    outbox = _journaled(gate, capacity=3)
    outbox.resume(node.by_id.get)
    js.down = True
    for rid in ("r1", "r2", "r3", "r4"):
        await _serve(gate, seller, buyer, rid)
    assert outbox.pending == 3 and outbox.stats["waited_in_log"] == 5 and outbox.stats["dropped"] == 0
    assert outbox.backlog is not None
    js.down = False
    await eventually_async(lambda: len(_stored(js)) == 8, what="all eight published")
    assert _published(js) == [(m, f"{p}r{i}") for i in range(1, 5) for m, p in (("requests", ""), ("tokens_out", "resp-"))]
    assert outbox.backlog is None and outbox.stats["read_back"] == 5 and seller.counters["metering.dropped"] == 0
    await _serve(gate, seller, buyer, "r5")  # live again: queued, not left in the log
    assert outbox.stats["waited_in_log"] == 5
    await eventually_async(lambda: len(_stored(js)) == 10, what="r5 published")
    await outbox.close(timeout=1.0)


async def test_events_of_an_agent_no_longer_hosted_are_counted_not_published(
    shop: Any, caplog: pytest.LogCaptureFixture
) -> None:
    node, seller, buyer, gate, _, js = shop
    first = _journaled(gate)
    first.resume(node.by_id.get)
    js.down = True
    await _serve(gate, seller, buyer, "r1")
    await first.close(timeout=0.05)
    js.down = False
    second = _journaled(gate)
    with caplog.at_level(logging.WARNING, logger="meshnode.commerce"):
        second.resume(lambda agent_id: None)  # its agent was taken off this node meanwhile
        await eventually_async(lambda: second.backlog is None, what="the log read")
    assert second.stats["orphaned"] == 2 and _stored(js) == []
    assert second.gauges() == {"meter_events_queued": 0, "meter_events_waiting_in_log": 0,
                               "meter_events_published": 0, "meter_events_read_back": 0, "meter_events_dropped": 0,
                               "meter_events_orphaned": 2, "meter_events_trimmed": 0, "meter_events_unpublished": 0}
    assert any(seller.agent_id in r.getMessage() and "no longer hosts" in r.getMessage() for r in caplog.records)
    await second.close(timeout=0.1)


async def _left_in_log(shop: Any, *, calls: int) -> None:
    """``calls`` priced calls served while JetStream is down, under a journaled
    outbox closed right after: their events wait in the usage log."""
    node, seller, buyer, gate, _, js = shop
    first = _journaled(gate)
    first.resume(node.by_id.get)
    js.down = True
    for i in range(calls):
        await _serve(gate, seller, buyer, f"r{i}")
    await first.close(timeout=0.05)
    js.down = False


def _queued_per_pass(outbox: MeterOutbox) -> list[int]:
    """How many events each of ``outbox``'s read-back passes queues, from now on."""
    queued: list[int] = []
    read_back = outbox._read_back

    def counted() -> None:
        before = outbox.pending
        read_back()
        queued.append(outbox.pending - before)

    outbox._read_back = counted  # type: ignore[method-assign]
    return queued


async def test_a_long_run_of_unpublishable_lines_is_read_in_passes(shop: Any) -> None:
    """A read-back pass examines a bounded number of lines (16 per event it
    may queue), so a long run of an absent agent's events does not hold the
    loop in one pass; the passes go on until the log is read."""
    _, _, _, gate, _, js = shop
    await _left_in_log(shop, calls=20)  # 40 lines
    second = _journaled(gate, window=1)  # 16 lines a pass
    passes = _queued_per_pass(second)
    second.resume(lambda agent_id: None)
    await eventually_async(lambda: second.backlog is None, what="the log read to its end")
    assert second.stats["orphaned"] == 40 and len(passes) == 3 and _stored(js) == []
    await second.close(timeout=0.1)


async def test_a_read_back_pass_signs_a_bounded_number_of_events(shop: Any) -> None:
    """A pass signs every event it queues on the event loop, so it takes at
    most OUTBOX_READ_BACK of them (less than the publishing window) and live
    traffic waits only that long; the passes go on until all are out, in order."""
    node, _, _, gate, _, js = shop
    await _left_in_log(shop, calls=50)  # 100 events
    second = _journaled(gate)
    assert second.window > OUTBOX_READ_BACK
    queued_per_pass = _queued_per_pass(second)
    second.resume(node.by_id.get)
    await eventually_async(lambda: second.backlog is None and second.pending == 0, what="the log published")
    assert queued_per_pass == [OUTBOX_READ_BACK, 100 - OUTBOX_READ_BACK]
    assert _published(js) == [(meter, rid) for i in range(50)
                              for meter, rid in (("requests", f"r{i}"), ("tokens_out", f"resp-r{i}"))]
    await second.close(timeout=0.1)


async def test_the_first_start_with_a_journal_publishes_nothing_old(shop: Any, tmp_path: Path) -> None:
    """A node upgraded with a usage log of months: its first journal starts at
    the log's end (those events went out, or were given up, before)."""
    node, seller, buyer, gate, outbox, js = shop
    js.down = True
    await _serve(gate, seller, buyer, "old")
    await outbox.close(timeout=0.05)  # the old outbox: unpublished, counted
    js.down = False
    fresh = _journaled(gate)
    assert fresh.journal is not None and fresh.journal.load() == gate.usage.end()
    assert fresh.journal.path.stat().st_mode & 0o777 == 0o600
    fresh.resume(node.by_id.get)
    await _serve(gate, seller, buyer, "new")
    await eventually_async(lambda: len(_stored(js)) == 2, what="new published")
    assert _published(js) == [("requests", "new"), ("tokens_out", "resp-new")]
    await fresh.close(timeout=1.0)

    # [commerce] publish_usage = false for a while: the place is forgotten, and
    # what is logged meanwhile is not published once publishing is back.
    fresh.journal.forget()
    gate.publisher = None
    await _serve(gate, seller, buyer, "kept-local")
    again = _journaled(gate)
    assert again.backlog is None
    again.resume(node.by_id.get)
    await _serve(gate, seller, buyer, "after")
    await eventually_async(lambda: len(_stored(js)) == 4, what="after published")
    assert _published(js)[2:] == [("requests", "after"), ("tokens_out", "resp-after")]
    await again.close(timeout=1.0)


async def test_a2a_charges_left_unpublished_go_out_after_the_next_start(shop: Any, tmp_path: Path) -> None:
    """An A2A charge is not in usage.jsonl: its record is the charge table.
    A charge's row is now marked published once JetStream acked its ledger
    event; what a stop or a crash left unmarked goes out after the next start,
    and the ledger charges a (peer, task) once."""
    node, _, buyer, _, outbox, js = shop
    store = ChargeStore(tmp_path / "a2a-charges.sqlite3")
    await store.open()
    gateways = A2AGateways()
    gateways.charges = store
    gateways.outbound = A2AOutbound("acme", "agent", {}, store, KeyPair.generate())
    gateways.publish_charges(node, outbox)
    charge = Charge(peer="weather", task_key="task:t1", message_id="m1", task_id="t1", agent=buyer.agent_id,
                    execution_id="e1", mesh=True, report="verified", reported_spend=None, contract_price="0.1",
                    charged="0.25", currency="USD", charged_at_ms=1)
    assert await store.record(charge)
    js.down = True
    assert gateways.outbound.on_charge is not None
    await gateways.outbound.on_charge(charge)  # what a charged call does
    assert await outbox.close(timeout=0.05) == 1  # the stop: not published
    assert [c.task_key for c in await store.unpublished()] == ["task:t1"]

    js.down = False
    later = MeterOutbox(first_backoff_s=0.01, max_backoff_s=0.05)  # the next start
    gateways.publish_charges(node, later)
    assert await gateways.republish_charges(node) == 1

    async def marked() -> bool:
        return not await store.unpublished()

    await eventually_async(marked, what="the charge marked published")
    assert [env["payload"]["event_type"] for env in _stored(js)] == ["a2a_charge"]
    assert _stored(js)[0]["from"] == buyer.agent_id
    assert await gateways.republish_charges(node) == 0  # nothing left for a later start
    ledger = Ledger()
    lines = [ledger.fold(env) for env in _stored(js) * 2]  # a copy sent again is charged once
    assert [c.amount_micro for c in lines if c is not None] == [250_000]
    await later.close(timeout=1.0)
    await store.close()


async def test_charges_recorded_before_the_published_column_count_as_published(tmp_path: Path) -> None:
    """An upgraded node's charge table gains the column; its old rows are not
    sent again (their events went out, or were given up, then)."""
    import sqlite3

    path = tmp_path / "a2a-charges.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(charges_module._SCHEMA)
    old.execute("INSERT INTO a2a_charges VALUES ('w','task:old','m','old','U','e',1,'verified',NULL,'0.1','0.1','USD',1,NULL)")
    old.commit()
    old.close()
    store = ChargeStore(path)
    await store.open()
    try:
        assert await store.unpublished() == []
        new = Charge(peer="w", task_key="task:new", message_id="m2", task_id="new", agent="U", execution_id="e",
                     mesh=True, report="verified", reported_spend=None, contract_price="0.1", charged="0.1",
                     currency="USD", charged_at_ms=2)
        assert await store.record(new)
        assert [c.task_key for c in await store.unpublished()] == ["task:new"]
        await store.mark_published("w", "task:new")
        assert await store.unpublished() == []
        assert {c.task_key for c in await store.recent()} == {"task:old", "task:new"}
    finally:
        await store.close()


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
