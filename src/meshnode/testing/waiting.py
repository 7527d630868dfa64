"""Waiting in tests for a condition, never for a fixed time.

A test that sleeps and then asserts is a guess about how fast the machine is:
too short and it fails on a loaded CI runner, too long and every run pays for
it. :func:`eventually` polls a probe until it holds, so a healthy run returns
as soon as the condition does and a slow one gets a generous ``timeout``; when
the time is up it fails naming what was awaited and the last thing it saw::

    from meshnode.testing import eventually

    answers = eventually(lambda: held(node, "cli"), what="the late answers in the CLI inbox")
    await eventually_async(lambda: manager.counters["refused.stale"] == 1)

A probe means "not yet" by returning something falsy or by raising
``AssertionError`` (so a small function full of asserts is a probe too); the
first truthy value is returned. :func:`consistently` is the other half: a
condition that must *keep* holding for a window (nothing more arrives), checked
throughout the window and failing the moment it breaks.

``MESHNODE_TEST_TIMEOUT_SCALE`` (a factor, default 1) stretches every timeout
here for a machine known to be slow; it never shortens a passing run.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar, overload

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "WaitTimeout",
    "consistently",
    "consistently_async",
    "eventually",
    "eventually_async",
]

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0
"""Generous on purpose: a passing wait returns as soon as its condition holds."""

_FIRST_DELAY_S = 0.02
_MAX_DELAY_S = 0.25  # probes often cost an admin call; do not hammer a busy daemon


class WaitTimeout(AssertionError):
    """A condition did not hold in time. An ``AssertionError``, so pytest shows it
    as a failed expectation with the message naming what was awaited."""


def _scale() -> float:
    try:
        return max(1.0, float(os.environ.get("MESHNODE_TEST_TIMEOUT_SCALE", "1")))
    except ValueError:
        return 1.0


def _describe(probe: Callable[..., object]) -> str:
    """The probe's source line when it is a lambda (what a reader wrote), else its name."""
    name = getattr(probe, "__qualname__", None) or repr(probe)
    if name.endswith("<lambda>"):
        try:
            source = " ".join(inspect.getsource(probe).split())
        except (OSError, TypeError):
            return name
        return source if len(source) <= 200 else source[:197] + "..."
    return str(name)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 500 else text[:497] + "..."


def _failure(
    what: str, timeout: float, last: object, error: BaseException | None, detail: Callable[[], object] | None
) -> WaitTimeout:
    seen = f"last error: {type(error).__name__}: {error}" if error is not None else f"last value: {_short(last)}"
    message = f"timed out after {timeout:g} s waiting for {what} ({seen})"
    if detail is not None:
        try:
            message += f"\n{detail()}"
        except Exception as exc:  # the failure must still be reported
            message += f"\n(detail unavailable: {type(exc).__name__}: {exc})"
    return WaitTimeout(message)


class _Poll:
    """The deadline and the growing delay shared by the sync and async waits."""

    def __init__(self, timeout: float, interval: float) -> None:
        self.timeout = timeout * _scale()
        self.deadline = time.monotonic() + self.timeout
        self.delay = min(_FIRST_DELAY_S, interval)
        self.interval = interval

    def next_delay(self) -> float | None:
        """How long to wait before the next try; None once the deadline has passed
        (the try just made, after the deadline, was the last)."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            return None
        delay = min(self.delay, left)
        self.delay = min(self.delay * 1.5, self.interval)
        return delay


def eventually(
    probe: Callable[[], T | Literal[False] | None],
    *,
    what: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    interval: float = _MAX_DELAY_S,
    retry_on: tuple[type[BaseException], ...] = (),
    detail: Callable[[], object] | None = None,
) -> T:
    """Call ``probe`` until it returns something truthy, and return that.

    The value returned is never ``None`` or ``False``, and its type says so: a
    probe typed ``X | None`` (a look-up), or ``cond and value`` (``Literal[False]
    | X``), gives an ``X``.

    ``what`` names the condition in the failure message (default: the probe's
    source). ``retry_on`` lists exceptions that mean "not yet" besides
    ``AssertionError`` (e.g. a call that fails while a mesh heals); any other
    exception propagates at once. Raises :class:`WaitTimeout` after ``timeout``
    seconds; the probe always gets one last try at the deadline. ``detail``, if
    given, is called once on failure and its value added to the message (the
    state a reader needs to see: a log tail, the counters).
    """
    poll = _Poll(timeout, interval)
    not_yet: tuple[type[BaseException], ...] = (AssertionError, *retry_on)
    last: object = None
    while True:
        error: BaseException | None = None
        try:
            last = probe()
        except not_yet as exc:
            error = exc
        else:
            if last:
                return last
        delay = poll.next_delay()
        if delay is None:
            raise _failure(what or _describe(probe), poll.timeout, last, error, detail)
        time.sleep(delay)


@overload
async def eventually_async(
    probe: Callable[[], Awaitable[T | Literal[False] | None]],
    *,
    what: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    interval: float = _MAX_DELAY_S,
    retry_on: tuple[type[BaseException], ...] = (),
    detail: Callable[[], object] | None = None,
) -> T: ...


@overload
async def eventually_async(
    probe: Callable[[], T | Literal[False] | None],
    *,
    what: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    interval: float = _MAX_DELAY_S,
    retry_on: tuple[type[BaseException], ...] = (),
    detail: Callable[[], object] | None = None,
) -> T: ...


async def eventually_async(
    probe: Callable[[], Any],
    *,
    what: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    interval: float = _MAX_DELAY_S,
    retry_on: tuple[type[BaseException], ...] = (),
    detail: Callable[[], object] | None = None,
) -> Any:
    """:func:`eventually` for asyncio tests: the probe may be a plain function or
    return an awaitable (``lambda: manager.read(task_id)``); the loop keeps
    running between tries."""
    poll = _Poll(timeout, interval)
    not_yet: tuple[type[BaseException], ...] = (AssertionError, *retry_on)
    last: object = None
    while True:
        error: BaseException | None = None
        try:
            result = probe()
            if inspect.isawaitable(result):
                result = await result
            last = result
        except not_yet as exc:
            error = exc
        else:
            if last:
                return last
        delay = poll.next_delay()
        if delay is None:
            raise _failure(what or _describe(probe), poll.timeout, last, error, detail)
        await asyncio.sleep(delay)


def consistently(
    probe: Callable[[], object],
    *,
    during: float,
    what: str | None = None,
    interval: float = 0.1,
) -> None:
    """Check ``probe`` throughout the next ``during`` seconds; fail the moment it
    does not hold. For what must *not* happen (nothing more arrives, no second
    run), where no event marks the end: the window is the claim, stated here
    once instead of as a bare sleep before an assert."""
    deadline = time.monotonic() + during
    while True:
        try:
            value = probe()
        except AssertionError as exc:
            raise AssertionError(f"{what or _describe(probe)} stopped holding: {exc}") from exc
        if not value:
            raise AssertionError(f"{what or _describe(probe)} stopped holding (value: {_short(value)})")
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(interval, left))


async def consistently_async(
    probe: Callable[[], object],
    *,
    during: float,
    what: str | None = None,
    interval: float = 0.05,
) -> None:
    """:func:`consistently` for asyncio tests (the probe may return an awaitable)."""
    deadline = time.monotonic() + during
    while True:
        try:
            value = probe()
            if inspect.isawaitable(value):
                value = await value
        except AssertionError as exc:
            raise AssertionError(f"{what or _describe(probe)} stopped holding: {exc}") from exc
        if not value:
            raise AssertionError(f"{what or _describe(probe)} stopped holding (value: {_short(value)})")
        left = deadline - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(interval, left))
