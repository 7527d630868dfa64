"""Numbered mail published without pause, and what of it arrived: for tests of
what a connection misses while it reconnects."""

from __future__ import annotations

import asyncio

from meshnode.testing import eventually_async
from meshnode.transport.connection import MeshConnection, Message


class SteadyMail:
    """``sender`` publishes 0, 1, 2, ... on ``subject`` from :meth:`start` until
    :meth:`stop`; :meth:`collect` is the receiving side's handler."""

    def __init__(self, sender: MeshConnection, subject: str) -> None:
        self.sender = sender
        self.subject = subject
        self.sent = 0
        self.received: set[int] = set()
        self._stop = asyncio.Event()
        self._task: asyncio.Future[None] | None = None

    async def collect(self, msg: Message) -> None:
        self.received.add(int(msg.data))

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._publish())

    async def _publish(self) -> None:
        while not self._stop.is_set():
            await self.sender.publish(self.subject, str(self.sent).encode())
            self.sent += 1
            if self.sent % 8 == 0:
                await self.sender.flush()  # lets the other side's reconnect run between batches

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        await self.sender.flush()

    async def all_arrived(self, first: int = 0) -> None:
        """Wait until every message from ``first`` on has arrived (the failure names the missing)."""
        expected = set(range(first, self.sent))
        await eventually_async(lambda: self.received >= expected, what="every message published",
                               detail=lambda: f"{self.sent} sent, missing {sorted(expected - self.received)[:20]}")
