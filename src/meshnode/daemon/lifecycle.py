"""Named lifecycle stages with time budgets, and the daemon's lifecycle state.

Start-up and shutdown are sequences of named stages. A stage that overruns its
budget is logged with what it was doing and abandoned; shutdown goes on to the
next stage regardless, so one stuck component cannot keep the process alive
past systemd's ``TimeoutStopSec``. The shutdown budgets are declared here so a
test can check that they add up to less than the unit's stop timeout.

Shutdown is derived from start-up: each start stage, as it brings something
up, pushes the undo onto :class:`Shutdown` under the named shutdown stage it
belongs to (an inbox is closed in ``final-write``, a connection in
``close-connection``). Stopping runs the named stages in order, each one
unwinding its own :class:`contextlib.AsyncExitStack` last-in first-out within
its budget, so only what started is stopped, and in reverse.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from meshnode.aio import wait_for

__all__ = [
    "SHUTDOWN_BUDGETS",
    "DaemonState",
    "Shutdown",
    "Stage",
    "StageFailed",
    "run_stage",
    "shutdown_budget_total",
]

log = logging.getLogger("meshnode.lifecycle")

#: Shutdown stages in order, with their budgets in seconds (see systemd/meshnode.service).
SHUTDOWN_BUDGETS: dict[str, float] = {
    "stop-intake": 3.0,  # close the admin socket, unsubscribe inboxes
    "stop-agents": 10.0,  # let handlers finish, call on_stop, while the connection is up
    "final-write": 5.0,  # inbox commit and WAL checkpoint
    "close-connection": 5.0,  # drain and close NATS
    "stop-services": 3.0,  # control plane, platform services
    "stop-mesh-server": 6.0,  # embedded nats-server: SIGTERM, then SIGKILL
}


def shutdown_budget_total() -> float:
    return sum(SHUTDOWN_BUDGETS.values())


class DaemonState(enum.StrEnum):
    """Where the daemon is in its life (admin ``Status``: ``state``)."""

    CREATED = "created"
    STARTING = "starting"
    #: Every start stage done; READY=1 sent to systemd.
    SERVING = "serving"
    #: Applying a new configuration (systemd RELOADING=1); still serving.
    RELOADING = "reloading"
    STOPPING = "stopping"
    STOPPED = "stopped"
    #: A start stage failed; the daemon is stopping what it started.
    FAILED = "failed"


class Shutdown:
    """The undo of everything started, grouped by named shutdown stage.

    ``push(stage, undo)`` records an undo under one of
    :data:`SHUTDOWN_BUDGETS`; :meth:`run` runs the stages in order, each within
    its budget, each unwinding its undos in reverse. Running twice does nothing
    the second time (every stack is emptied as it runs).
    """

    def __init__(self, budgets: dict[str, float] | None = None) -> None:
        self.budgets = dict(budgets or SHUTDOWN_BUDGETS)
        self._stacks = {name: contextlib.AsyncExitStack() for name in self.budgets}

    def push(self, stage: str, undo: Callable[[], Awaitable[object]]) -> None:
        """Run ``undo`` in shutdown stage ``stage`` (after undos pushed later)."""

        async def call() -> None:
            await undo()

        self._stacks[stage].push_async_callback(call)

    async def run(self) -> None:
        for name, budget in self.budgets.items():
            stack, self._stacks[name] = self._stacks[name], contextlib.AsyncExitStack()
            await run_stage(Stage(name, budget, stack.aclose), critical=False)


class StageFailed(Exception):
    """A start-up stage failed; the daemon cannot serve."""

    def __init__(self, stage: str, cause: BaseException) -> None:
        # A bare TimeoutError has no text: name the type rather than print nothing.
        reason = str(cause) or type(cause).__name__
        super().__init__(f"start-up stage {stage!r} failed: {reason}")
        self.stage = stage
        self.cause = cause


@dataclass
class Stage:
    name: str
    budget: float
    action: Callable[[], Awaitable[None]]


async def run_stage(stage: Stage, *, critical: bool) -> bool:
    """Run one stage within its budget.

    ``critical`` stages (start-up) raise StageFailed on error or timeout;
    non-critical ones (shutdown) log and return False so the next stage runs.
    """
    started = time.monotonic()
    try:
        await wait_for(stage.action(), timeout=stage.budget)
    except TimeoutError as exc:
        log.error("stage %s exceeded its %.1fs budget; moving on", stage.name, stage.budget)
        if critical:
            raise StageFailed(stage.name, exc) from exc
        return False
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if critical:
            raise StageFailed(stage.name, exc) from exc
        log.exception("stage %s failed", stage.name)
        return False
    log.debug("stage %s done in %.2fs", stage.name, time.monotonic() - started)
    return True
