"""NotReady from on_start: retried with a capped backoff until the start timeout (issue #23 item 2)."""

from __future__ import annotations

import pytest

from meshnode.agent import NotReady
from meshnode.node import supervise
from meshnode.node.supervise import NotReadyTooLong, StartTimeout, supervise_retrying
from tests.fakes import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


async def test_not_ready_twice_then_started(clock: ManualClock) -> None:
    attempts = 0
    retries: list[tuple[int, str, float]] = []

    async def start() -> None:
        nonlocal attempts
        attempts += 1
        if attempts <= 2:
            raise NotReady(f"database down ({attempts})")

    taken = await supervise_retrying(start, name="a", warn_s=10, timeout_s=60, clock=clock, sleep=clock.sleep,
                                     on_retry=lambda *args: retries.append(args))
    assert taken == 3 and clock.sleeps == [1.0, 2.0]
    assert retries == [(1, "database down (1)", 1.0), (2, "database down (2)", 2.0)]


async def test_the_delays_are_capped_and_the_timeout_gives_up(clock: ManualClock) -> None:
    async def never() -> None:
        raise NotReady("never")

    with pytest.raises(NotReadyTooLong, match=r"still not ready after 60 s \(\d+ attempt\(s\)\): never"):
        await supervise_retrying(never, name="a", warn_s=10, timeout_s=60, clock=clock, sleep=clock.sleep, cap_s=8)
    assert max(clock.sleeps) == 8 and clock.sleeps[:4] == [1, 2, 4, 8]
    assert clock.now < 60  # no attempt starts past the bound
    assert issubclass(NotReadyTooLong, StartTimeout)  # failed like a hung start (no traceback logged)


async def test_retry_after_is_honoured_within_the_cap_and_other_errors_are_not_retried(clock: ManualClock) -> None:
    attempts = 0

    async def start() -> None:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise NotReady("soon", retry_after=0.25)
        if attempts == 2:
            raise NotReady("later", retry_after=999)
        raise RuntimeError("broken")

    with pytest.raises(RuntimeError, match="broken"):
        await supervise_retrying(start, name="a", warn_s=10, timeout_s=60, clock=clock, sleep=clock.sleep)
    assert clock.sleeps == [0.25, supervise.RETRY_CAP_S]
