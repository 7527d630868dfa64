"""MailboxReader's gathering, message by message (its wire behaviour is in
tests/integration/test_mailbox_reader.py): a pull request's end is told by a
status message on *that request's* reply subject, so the late status of an
earlier request that gave up cannot cut a later fetch short."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.aio.msg import Msg

from meshnode.transport.jetstream import MailboxReader


def _reader() -> MailboxReader:
    # An unconnected nats-py client: only its inbox names are used here.
    return MailboxReader(Client(), None, "MESH_INBOX_X", "inbox_X")  # type: ignore[arg-type]


def _delivery(reader: MailboxReader, request: int, n: int) -> Msg:
    return Msg(_client=Client(), subject=f"{reader._prefix}.{request}", reply=f"$JS.ACK.s.c.1.{n}.{n}.0.0", data=b"m")


def _status(reader: MailboxReader, request: int, code: str) -> Msg:
    return Msg(_client=Client(), subject=f"{reader._prefix}.{request}", headers={"Status": code}, data=b"")


async def test_only_the_current_requests_status_ends_a_fetch() -> None:
    reader = _reader()
    reader._current, reader._want = f"{reader._prefix}.2", 3
    woken = reader._woken = asyncio.get_running_loop().create_future()
    await reader._on_message(_status(reader, 1, "404"))  # request 1 gave up earlier
    assert not woken.done()
    await reader._on_message(_delivery(reader, 2, 1))
    assert not woken.done()
    await reader._on_message(_status(reader, 2, "404"))  # fewer stored than asked: the end
    assert woken.done()
    assert len(reader._ready) == 1


async def test_a_full_batch_wakes_the_fetch_and_later_deliveries_are_kept() -> None:
    reader = _reader()
    reader._current, reader._want = f"{reader._prefix}.1", 2
    woken = reader._woken = asyncio.get_running_loop().create_future()
    await reader._on_message(_delivery(reader, 1, 1))
    assert not woken.done()
    await reader._on_message(_delivery(reader, 1, 2))
    assert woken.done()
    reader._woken = None  # the fetch has returned
    await reader._on_message(_delivery(reader, 1, 3))  # late: kept for the next fetch
    assert len(reader._ready) == 3
