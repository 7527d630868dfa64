"""Broker liveness: is the NATS server still answering, not only still there?

A broker that is frozen (SIGSTOP, a hung host, a stuck disk) keeps its TCP
connections open: the client stays "connected", nats-py's own PING every two
minutes notices only after two are missed, and the embedded mesh's supervisor,
which waits for the process to *exit*, never sees anything. Meanwhile every
mesh call times out (issue #23 item 11).

:class:`BrokerWatch` asks instead, every ``interval_s``: a PING/PONG round trip
on the node's connection (``flush``) with a deadline of ``timeout_s``, and on
the embedded mesh a probe of the server process itself (its monitoring
``/healthz`` when a monitor port is configured, else a fresh client
connection that must be greeted with INFO) under the same deadline. A failed
probe starts an *unresponsive* episode: logged once, counted, shown in
Status. Once an episode has lasted ``restart_after_s`` the watch applies its
remedy — the embedded mesh kills the frozen server (its supervisor starts it
again on the same ports and store); a joined node drops the connection so the
client fails over to another server of ``[mesh] servers`` — and applies it again
at most every ``restart_after_s`` while the episode lasts. The first answer
ends the episode (logged).

:class:`LivenessState` is the bookkeeping without I/O, unit-tested on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from meshnode.aio import wait_for

__all__ = ["BrokerWatch", "LivenessState", "Probe"]

log = logging.getLogger("meshnode.transport")

#: One check: returns normally when the broker answered within ``timeout``,
#: raises (anything) when it did not.
Probe = Callable[[float], Awaitable[None]]


@dataclass
class LivenessState:
    """The episodes of an unresponsive broker, fed one probe result at a time.

    Times are the caller's monotonic clock; ``wall`` values (epoch seconds) are
    only for display.
    """

    restart_after_s: float
    unresponsive_since: float | None = None
    unresponsive_since_wall: float | None = None
    reason: str | None = None
    last_ok_wall: float | None = None
    last_rtt_s: float | None = None
    failed_probes: int = 0
    episodes: int = 0
    remedies: int = 0
    _last_remedy: float | None = None

    @property
    def responsive(self) -> bool:
        return self.unresponsive_since is None

    def answered(self, now: float, wall: float, rtt_s: float) -> float | None:
        """Record an answer; returns how long the episode it ends lasted (None: there was none)."""
        self.last_ok_wall, self.last_rtt_s = wall, rtt_s
        if self.unresponsive_since is None:
            return None
        lasted = now - self.unresponsive_since
        self.unresponsive_since = self.unresponsive_since_wall = None
        self.reason = None
        self._last_remedy = None
        return lasted

    def failed(self, now: float, wall: float, reason: str) -> bool:
        """Record a failed probe; True when it starts an episode (the one to log)."""
        self.failed_probes += 1
        self.reason = reason
        if self.unresponsive_since is not None:
            return False
        self.unresponsive_since, self.unresponsive_since_wall = now, wall
        self.episodes += 1
        return True

    def remedy_due(self, now: float) -> bool:
        """True when the episode has lasted ``restart_after_s`` since it began
        or since the last remedy; records the remedy when it says so."""
        if self.unresponsive_since is None:
            return False
        since = self._last_remedy if self._last_remedy is not None else self.unresponsive_since
        if now - since < self.restart_after_s:
            return False
        self._last_remedy = now
        self.remedies += 1
        return True

    def status(self) -> dict[str, Any]:
        def iso(wall: float | None) -> str | None:
            return None if wall is None else datetime.fromtimestamp(wall, UTC).isoformat(timespec="seconds")

        return {
            "state": "responsive" if self.responsive else "unresponsive",
            "unresponsive_since": iso(self.unresponsive_since_wall),
            "reason": self.reason,
            "last_answer_at": iso(self.last_ok_wall),
            "last_rtt_ms": None if self.last_rtt_s is None else round(self.last_rtt_s * 1000, 2),
            "failed_probes": self.failed_probes,
            "unresponsive_episodes": self.episodes,
            "remedies": self.remedies,
            "restart_after_s": self.restart_after_s,
        }


class BrokerWatch:
    """Probes the broker every ``interval_s``; see the module docstring.

    ``probes`` are tried in order (the first failure is the reason); ``remedy``
    is awaited when an episode is due one (None: report only). ``describe``
    names the remedy in the log.
    """

    def __init__(
        self,
        probes: list[tuple[str, Probe]],
        *,
        interval_s: float,
        timeout_s: float,
        restart_after_s: float,
        remedy: Callable[[], Awaitable[None]] | None = None,
        describe: str = "restart",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._probes = probes
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._remedy = remedy
        self._describe = describe
        self._clock = clock
        self.state = LivenessState(restart_after_s=restart_after_s)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="broker-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def status(self) -> dict[str, Any]:
        return {**self.state.status(), "interval_s": self.interval_s, "timeout_s": self.timeout_s}

    def gauges(self) -> dict[str, int | None]:
        """For the metrics: 1 while unresponsive, and the running totals."""
        return {
            "broker_unresponsive": 0 if self.state.responsive else 1,
            "broker_unresponsive_episodes": self.state.episodes,
            "broker_failed_probes": self.state.failed_probes,
            "broker_remedies": self.state.remedies,
        }

    async def check(self) -> bool:
        """One round of probes and what follows from it; True when the broker answered."""
        started = self._clock()
        for name, probe in self._probes:
            try:
                await wait_for(probe(self.timeout_s), timeout=self.timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure to answer is the finding, not an error here
                why = f"{name}: {type(exc).__name__}{f': {exc}' if str(exc) else ''}"
                self._failed(why)
                return False
        lasted = self.state.answered(self._clock(), time.time(), self._clock() - started)
        if lasted is not None:
            log.warning("the mesh broker answers again (it was unresponsive for %.1f s)", lasted)
        return True

    def _failed(self, why: str) -> None:
        now = self._clock()
        if self.state.failed(now, time.time(), why):
            log.error(
                "the mesh broker is not answering (%s, deadline %g s); %s",
                why, self.timeout_s,
                f"{self._describe} after {self.state.restart_after_s:g} s" if self._remedy else "waiting",
            )

    async def _remedy_if_due(self) -> None:
        if self._remedy is None or not self.state.remedy_due(self._clock()):
            return
        log.error(
            "the mesh broker has not answered for %.1f s (%s): %s",
            self._clock() - (self.state.unresponsive_since or self._clock()), self.state.reason, self._describe,
        )
        try:
            await self._remedy()
        except Exception:
            log.exception("broker remedy (%s) failed", self._describe)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
                await self._remedy_if_due()
            except asyncio.CancelledError:
                raise
            except Exception:  # the watch must outlive any one bad round
                log.exception("broker liveness check failed")
