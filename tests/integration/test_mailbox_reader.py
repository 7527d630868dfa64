"""The drain's reader of a mailbox consumer against a real nats-server.

One pull request per fetch, its deliveries gathered by one subscription
(issue #21: nats-py's fetch spent a task and a timer on every message). What
the drain relies on: a fetch returns what is stored now, in stream order, up to
its batch, and returns at once when less is stored (the server's status ends
the request); a delivery that arrives after its fetch gave up is handed out by
the next fetch, not lost; acks reach the consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from meshnode.protocol import subjects
from meshnode.protocol.nkeys import KeyPair
from meshnode.testing import DEFAULT_TIMEOUT_S, eventually_async
from meshnode.transport.connection import MeshConnection
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.jetstream import MailboxBuffer, MailboxReader
from meshnode.transport.streams import ensure_inbox_stream

from .conftest import connect

pytestmark = pytest.mark.integration

#: Longer than any test here may take: a fetch that waits it out is a failure.
NEVER_S = 3600.0


@pytest.fixture
async def node(mesh: EmbeddedNatsServer) -> AsyncIterator[tuple[MeshConnection, KeyPair]]:
    node_key, agent = KeyPair.generate(), KeyPair.generate()
    jwt = mesh.mint_node_credential(node_key.public_key, [agent.public_key], 300, role="service")
    conn = await connect(mesh, node_key, jwt)
    try:
        await ensure_inbox_stream(conn.jetstream, agent.public_key)
        yield conn, agent
    finally:
        await conn.close()


async def _buffer_with(conn: MeshConnection, agent: KeyPair, count: int) -> MailboxBuffer:
    subject = subjects.agent_inbox(agent.public_key)
    for n in range(count):
        await conn.publish(subject, f"mail {n}".encode())
    buffer = conn.jetstream.mailbox(
        subject, subjects.inbox_stream_name(agent.public_key), subjects.inbox_consumer_name(agent.public_key)
    )

    async def stored() -> bool:
        state = await buffer.state()
        return state is not None and state.last_seq >= count

    await eventually_async(stored, what=f"{count} messages stored")
    return buffer


@contextlib.asynccontextmanager
async def _reading(buffer: MailboxBuffer) -> AsyncIterator[MailboxReader]:
    reader = await buffer.reader()
    try:
        yield reader
    finally:
        await reader.unsubscribe()


async def _fetch(reader: MailboxReader, batch: int) -> list[bytes]:
    """Fetch and ack; a fetch that would wait out its (hour-long) timeout fails the test."""
    msgs = await asyncio.wait_for(reader.fetch(batch, timeout=NEVER_S), DEFAULT_TIMEOUT_S)
    for m in msgs:
        await m.ack()
    return [m.data for m in msgs]


async def test_fetches_return_the_stored_mail_in_order_and_stop_short_at_once(
    node: tuple[MeshConnection, KeyPair],
) -> None:
    conn, agent = node
    async with _reading(await _buffer_with(conn, agent, 7)) as reader:
        assert await _fetch(reader, 3) == [b"mail 0", b"mail 1", b"mail 2"]
        # Fewer stored than asked for: the server ends the request, no waiting out the timeout.
        assert await _fetch(reader, 10) == [b"mail 3", b"mail 4", b"mail 5", b"mail 6"]
        assert await _fetch(reader, 10) == []
        # An ack is a plain publish the consumer applies on its own time: a read
        # right after may still count the last fetch's copies as pending.
        async def settled() -> bool:
            state = await reader.consumer_info()
            return bool(state.num_pending == 0 and state.num_ack_pending == 0)

        await eventually_async(settled, what="the consumer with nothing pending")


async def test_mail_delivered_after_its_fetch_gave_up_goes_to_the_next_fetch(
    node: tuple[MeshConnection, KeyPair],
) -> None:
    conn, agent = node
    async with _reading(await _buffer_with(conn, agent, 5)) as reader:
        # Gives up before anything can arrive; the server delivers the five anyway.
        assert await reader.fetch(5, timeout=0) == []
        # (White-box: the reader has received them, with no fetch waiting.)
        await eventually_async(lambda: len(reader._ready) == 5, what="the late deliveries received")
        # They are pending an ack now, so the server has nothing left to send: the
        # next fetch, asking for one more than that, hands out the five it kept.
        assert await _fetch(reader, 6) == [f"mail {n}".encode() for n in range(5)]


async def test_a_new_reader_binds_the_existing_durable_and_resumes_after_the_acked(
    node: tuple[MeshConnection, KeyPair],
) -> None:
    conn, agent = node
    buffer = await _buffer_with(conn, agent, 4)
    async with _reading(buffer) as first:
        assert await _fetch(first, 2) == [b"mail 0", b"mail 1"]
        await conn.flush()
    async with _reading(buffer) as second:
        assert await _fetch(second, 10) == [b"mail 2", b"mail 3"]
