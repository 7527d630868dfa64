"""Per-agent supervision of ``on_start`` (issue #23 item 2).

One plugin whose ``on_start`` never returns used to hold the whole ``agents``
start-up stage until its budget ran out, and the daemon then exited taking the
healthy agents with it. Each agent's start is now bounded on its own: a
warning once it is slow (``warn_s``), and after ``timeout_s`` the start is
cancelled and :class:`StartTimeout` raised, which fails only that agent
(state ``failed`` in Status) while the others start and serve.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

__all__ = ["StartTimeout", "supervise_start"]

log = logging.getLogger("meshnode.node")

#: How long a cancelled on_start may take to unwind before it is left behind.
_CANCEL_GRACE_S = 1.0


class StartTimeout(Exception):
    """An agent's ``on_start`` did not return within its timeout."""


async def supervise_start(start: Awaitable[None], *, name: str, warn_s: float, timeout_s: float) -> None:
    """Await ``start`` with a warning after ``warn_s`` and a limit of ``timeout_s``.

    Raises :class:`StartTimeout` at the limit (after cancelling ``start``), or
    whatever ``start`` raised. Cancelling the caller cancels ``start`` too.
    """
    task = asyncio.ensure_future(start)
    try:
        done, _ = await asyncio.wait({task}, timeout=min(warn_s, timeout_s))
        if not done:
            log.warning(
                "agent %s: on_start has not returned after %g s (it is failed at %g s)", name, warn_s, timeout_s
            )
            done, _ = await asyncio.wait({task}, timeout=max(0.0, timeout_s - warn_s))
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        # A start that swallows the cancellation is left behind, not waited for.
        await asyncio.wait({task}, timeout=_CANCEL_GRACE_S)
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: nobody else will look at it
        raise StartTimeout(f"on_start did not return within {timeout_s:g} s")
    task.result()
