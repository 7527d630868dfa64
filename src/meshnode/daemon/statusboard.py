"""What the status socket answers while the loop is blocked (issue #23 item 10).

The loop *publishes*: every few seconds (and at each ``Status`` call) it
encodes the Status result and stores the bytes with the time they were made.
The status socket's thread (:mod:`meshnode.admin.offloop`) *reads*: it takes
the last bytes, decodes its own copy, and adds ``blocked`` from the loop
watchdog (:meth:`LoopWatchdog.blocked_now`, itself built for other threads).
Nothing the loop owns is touched from the thread: a bytes object and a float,
swapped in one assignment, are all it reads of the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson

from meshnode.node.looplag import LoopWatchdog

__all__ = ["PUBLISH_INTERVAL_S", "StatusBoard"]

log = logging.getLogger("meshnode.daemon")

#: How often the loop refreshes the snapshot (seconds): the age a blocked answer's figures have at most, before the block.
PUBLISH_INTERVAL_S = 5.0
#: Above this many agents the periodic snapshot leaves out the per-agent list
#: (``status --brief``'s shape): a few ms of the loop every 5 s at most. A
#: ``Status`` call still publishes the list it answered.
LISTED_AGENTS_MAX = 100


class StatusBoard:
    """The last published Status, and the answer built from it in another thread."""

    def __init__(self, watchdog: Callable[[], LoopWatchdog | None]) -> None:
        self._watchdog = watchdog
        #: (encoded Status, time.monotonic() when it was made): one tuple, replaced whole.
        self._published: tuple[bytes, float] | None = None
        self._task: asyncio.Task[None] | None = None

    # -- on the loop ---------------------------------------------------------------

    def publish(self, status: dict[str, Any]) -> None:
        """Store ``status`` for the thread (encoded here, so the thread shares no object)."""
        self._published = (orjson.dumps(status, default=str), time.monotonic())

    def start(self, snapshot: Callable[[], dict[str, Any]], interval_s: float = PUBLISH_INTERVAL_S) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(snapshot, interval_s), name="status-board")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, snapshot: Callable[[], dict[str, Any]], interval_s: float) -> None:
        while True:
            try:
                self.publish(snapshot())
            except Exception:  # a status that fails to build must not end the board
                log.exception("publishing the status snapshot failed")
            await asyncio.sleep(interval_s)

    # -- in the status socket's thread ------------------------------------------------

    def answer(self) -> bytes:
        """The status socket's ``result``: the last snapshot with ``blocked`` and its age."""
        published = self._published
        watchdog = self._watchdog()
        blocked = watchdog.blocked_now() if watchdog is not None else None
        if published is None:
            status: dict[str, Any] = {"state": "starting"}
            age: float | None = None
        else:
            status = orjson.loads(published[0])
            age = round(time.monotonic() - published[1], 1)
        status["blocked"] = blocked
        status["snapshot_age_s"] = age
        return orjson.dumps(status)
