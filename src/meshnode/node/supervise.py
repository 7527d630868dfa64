"""Per-agent supervision of ``on_start`` (issue #23 item 2).

One plugin whose ``on_start`` never returns used to hold the whole ``agents``
start-up stage until its budget ran out, and the daemon then exited taking the
healthy agents with it. Each agent's start is now bounded on its own: a
warning once it is slow (``warn_s``), and after ``timeout_s`` the start is
cancelled and :class:`StartTimeout` raised, which fails only that agent
(state ``failed`` in Status) while the others start and serve.

An ``on_start`` that raises :class:`~meshnode.agent.NotReady` is retried
(:func:`supervise_retrying`): a doubling delay from one second, capped, until
the same ``timeout_s`` has passed since the first attempt; then the agent is
failed like one that hung.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from meshnode.agent import NotReady
from meshnode.aio import backoff

__all__ = ["NotReadyTooLong", "StartTimeout", "supervise_retrying", "supervise_start"]

log = logging.getLogger("meshnode.node")

#: How long a cancelled on_start may take to unwind before it is left behind.
_CANCEL_GRACE_S = 1.0


#: The first delay after a NotReady, and the most any delay grows to.
RETRY_FIRST_S = 1.0
RETRY_CAP_S = 15.0


class StartTimeout(Exception):
    """An agent's ``on_start`` did not return within its timeout."""


class NotReadyTooLong(StartTimeout):
    """An agent's ``on_start`` kept raising NotReady until its timeout had passed."""


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


async def supervise_retrying(
    make_start: Callable[[], Awaitable[None]],
    *,
    name: str,
    warn_s: float,
    timeout_s: float,
    on_retry: Callable[[int, str, float], None] = lambda attempt, reason, delay: None,
    first_delay_s: float = RETRY_FIRST_S,
    cap_s: float = RETRY_CAP_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> int:
    """:func:`supervise_start` on ``make_start()``, again after each NotReady.

    The delays double from ``first_delay_s`` up to ``cap_s`` (a NotReady with
    ``retry_after`` asks for its own, still capped); ``on_retry(attempt, reason,
    delay)`` is told before each wait. ``timeout_s`` bounds everything from the
    first attempt: an attempt gets only what is left of it, and a NotReady whose
    next attempt would start past it raises :class:`NotReadyTooLong`. Returns
    the number of attempts it took.
    """
    give_up_at = clock() + timeout_s
    delays = backoff(first_delay_s, cap_s)
    attempt = 0
    while True:
        attempt += 1
        # The first attempt gets the whole timeout, as before retries existed.
        limit = timeout_s if attempt == 1 else max(0.0, give_up_at - clock())
        try:
            await supervise_start(make_start(), name=name, warn_s=warn_s, timeout_s=limit)
            return attempt
        except NotReady as exc:
            planned = next(delays)
            delay = planned if exc.retry_after is None else max(0.0, min(exc.retry_after, cap_s))
            if clock() + delay >= give_up_at:
                raise NotReadyTooLong(
                    f"on_start was still not ready after {timeout_s:g} s ({attempt} attempt(s)): {exc.reason}"
                ) from None
            log.warning("agent %s: not ready (%s); retrying in %g s (attempt %d)", name, exc.reason, delay, attempt)
            on_retry(attempt, exc.reason, delay)
            await sleep(delay)
