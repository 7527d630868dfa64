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
        #: Messages that arrived more than once (the bridge's overlap must not show).
        self.repeated: list[int] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Future[None] | None = None

    async def collect(self, msg: Message) -> None:
        n = int(msg.data)
        if n in self.received:
            self.repeated.append(n)
        self.received.add(n)

    async def collect_and_ack(self, msg: Message) -> None:
        """:meth:`collect` for a JetStream delivery, acked once collected."""
        await self.collect(msg)
        await msg.ack()

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

    async def through_planned_reconnects(self, conn: MeshConnection, times: int = 3, *, bridged: bool = True) -> None:
        """With mail flowing, reconnect ``conn`` on purpose ``times`` times, each
        back (with its bridge closed); then stop and wait for every message, and
        check that a bridge covered every reconnect (``bridged``) or none."""
        for n in range(1, times + 1):
            await eventually_async(lambda: bool(self.received), what="mail flowing")
            await conn.reconnect()

            def back(expected: int = n) -> bool:
                done = conn.bridged_reconnects if bridged else conn.unbridged_reconnects
                return done >= expected and conn._bridge is None and conn.is_connected

            await eventually_async(back, what=f"planned reconnect {n} back, its bridge closed")
        await self.stop()
        await self.all_arrived()
        assert (conn.bridged_reconnects, conn.unbridged_reconnects) == ((times, 0) if bridged else (0, times))
        assert self.repeated == [], f"{len(self.repeated)} message(s) arrived twice: {self.repeated[:20]}"

    async def all_arrived(self, first: int = 0) -> None:
        """Wait until every message from ``first`` on has arrived (the failure names the missing)."""
        expected = set(range(first, self.sent))
        await eventually_async(lambda: self.received >= expected, what="every message published",
                               detail=lambda: f"{self.sent} sent, missing {sorted(expected - self.received)[:20]}")
