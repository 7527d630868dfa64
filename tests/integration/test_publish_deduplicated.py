"""A JetStream publish whose ack is lost is retried with the same Nats-Msg-Id
and stored once (the soak found a stream's final chunk lost this way: an agent
added or removed re-presents the node's credential, and the reconnect drops the
ack of a publish in flight). Real nats-server; the lost ack is played by
reconnecting after the first attempt was stored and dropping its answer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.js.api import StreamConfig

from meshnode.protocol.nkeys import KeyPair
from meshnode.testing import eventually_async
from meshnode.transport.connection import MeshConnection
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.errors import NoResponders, TransportTimeout
from meshnode.transport.jetstream import JetStream

from .conftest import connect

pytestmark = pytest.mark.integration


@pytest.fixture
async def client(mesh: EmbeddedNatsServer) -> AsyncIterator[MeshConnection]:
    key = KeyPair.generate()
    conn = await connect(mesh, key, mesh.mint_user("t", key.public_key, [">"], [">"], 300))
    try:
        yield conn
    finally:
        await conn.close()


async def test_an_ack_lost_in_a_reconnect_is_retried_and_the_message_stored_once(
    client: MeshConnection, monkeypatch: pytest.MonkeyPatch
) -> None:
    await client.jetstream.native.add_stream(StreamConfig(name="T", subjects=["t.>"], duplicate_window=120))
    real_publish = JetStream.publish
    attempts: list[bool] = []

    async def first_ack_lost(self: JetStream, subject: str, data: bytes, **kw: Any) -> Any:
        ack = await real_publish(self, subject, data, **kw)
        attempts.append(ack.duplicate)
        if len(attempts) == 1:
            await client.reconnect()  # stored, but its answer never reached the caller
            raise TransportTimeout("nats: timeout")
        return ack

    monkeypatch.setattr(JetStream, "publish", first_ack_lost)
    ack = await client.jetstream.publish_deduplicated("t.final", b"last chunk", msg_id="m-1")
    assert attempts == [False, True] and ack.duplicate and ack.seq == 1
    assert (await client.jetstream.stream_state("T")).messages == 1


async def test_a_publish_nobody_stores_yet_is_retried_until_the_stream_is_there(
    mesh: EmbeddedNatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    key = KeyPair.generate()
    conn = await connect(mesh, key, mesh.mint_user("t", key.public_key, [">"], [">"], 300))
    try:
        with caplog.at_level(logging.INFO, logger="meshnode.transport.jetstream"):
            publish = asyncio.ensure_future(conn.jetstream.publish_deduplicated("u.x", b"m", msg_id="m-2"))

            await eventually_async(
                lambda: any("not acked (NoResponders)" in r.getMessage() for r in caplog.records),
                what="the first attempt refused (no stream yet) and retried",
            )
            await conn.jetstream.native.add_stream(StreamConfig(name="U", subjects=["u.>"]))
            ack = await asyncio.wait_for(publish, timeout=30)
        assert ack.stream == "U" and not ack.duplicate
    finally:
        await conn.close()


async def test_a_publish_still_not_acked_after_its_time_raises(client: MeshConnection) -> None:
    with pytest.raises(NoResponders):
        await client.jetstream.publish_deduplicated("v.x", b"m", msg_id="m-3", within_s=0.5)


async def test_messages_published_in_flight_are_stored_in_order_each_with_its_own_answer(
    client: MeshConnection,
) -> None:
    """``publish_in_flight`` writes every message before waiting for any ack
    (the meter outbox's window): the stream stores them in the order given,
    each gets its own ack; one published again (same ``Nats-Msg-Id``) is
    answered as a duplicate, and one no stream stores as NoResponders, without
    failing the others."""
    await client.jetstream.native.add_stream(StreamConfig(name="W", subjects=["w.>"], duplicate_window=120))
    messages: list[tuple[str, bytes, dict[str, str] | None]] = [
        (f"w.{i % 3}", f"m{i}".encode(), {"Nats-Msg-Id": f"id-{i}"}) for i in range(1000)
    ]
    acks = await client.jetstream.publish_in_flight(messages, timeout=30)
    assert [getattr(a, "seq", None) for a in acks] == list(range(1, 1001)), [a for a in acks if not hasattr(a, "seq")][:3]
    reader = await client.jetstream.reader("W", start_seq=1)
    try:
        stored: list[bytes] = []
        while len(stored) < 1000:
            stored.extend(m.data for m in await reader.fetch(256, timeout=5))
    finally:
        await reader.close()
    assert stored == [data for _, data, _ in messages]

    again = await client.jetstream.publish_in_flight(
        [messages[5], ("nowhere.x", b"lost", None), ("w.new", b"new", {"Nats-Msg-Id": "id-new"})], timeout=30)
    assert getattr(again[0], "duplicate", None) is True and getattr(again[0], "seq", None) == 6
    assert isinstance(again[1], NoResponders)
    assert getattr(again[2], "seq", None) == 1001
