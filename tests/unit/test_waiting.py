"""The shared test waits: return as soon as the condition holds, fail naming it."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from meshnode.testing import (
    WaitTimeout,
    consistently,
    consistently_async,
    eventually,
    eventually_async,
)


def test_eventually_returns_the_first_truthy_value() -> None:
    counter = itertools.count()
    assert eventually(lambda: next(counter) >= 3 and "ready") == "ready"


def test_an_assertion_error_in_the_probe_means_not_yet() -> None:
    calls = itertools.count()

    def probe() -> int:
        n = next(calls)
        assert n >= 2, "not yet"
        return n

    assert eventually(probe) == 2


def test_the_failure_names_what_was_awaited_and_the_last_value() -> None:
    started = time.monotonic()
    with pytest.raises(WaitTimeout) as failed:
        eventually(lambda: [], what="the late answers", timeout=0.2)
    assert time.monotonic() - started < 5
    assert "the late answers" in str(failed.value) and "last value: []" in str(failed.value)
    assert isinstance(failed.value, AssertionError)


def test_without_a_name_the_failure_quotes_the_lambda() -> None:
    with pytest.raises(WaitTimeout) as failed:
        eventually(lambda: 1 + 1 == 3, timeout=0.05)
    assert "1 + 1 == 3" in str(failed.value)


def test_other_exceptions_propagate_unless_listed() -> None:
    def broken() -> bool:
        raise KeyError("gone")

    with pytest.raises(KeyError):
        eventually(broken, timeout=1)
    with pytest.raises(WaitTimeout) as failed:
        eventually(broken, timeout=0.05, retry_on=(KeyError,))
    assert "KeyError" in str(failed.value)


def test_the_timeout_scale_stretches_a_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHNODE_TEST_TIMEOUT_SCALE", "3")
    with pytest.raises(WaitTimeout) as failed:
        eventually(lambda: False, timeout=0.05)
    assert "0.15 s" in str(failed.value)


async def test_eventually_async_awaits_the_probe() -> None:
    counter = itertools.count()

    async def probe() -> int | None:
        n = next(counter)
        return n if n >= 2 else None

    assert await eventually_async(probe) == 2
    assert await eventually_async(lambda: "plain") == "plain"
    with pytest.raises(WaitTimeout, match="never"):
        await eventually_async(lambda: asyncio.sleep(0, result=False), what="never", timeout=0.05)


def test_consistently_fails_the_moment_the_condition_breaks() -> None:
    consistently(lambda: True, during=0.05)
    started = time.monotonic()
    calls = itertools.count()
    with pytest.raises(AssertionError, match="still one"):
        consistently(lambda: next(calls) < 2, during=10, what="still one", interval=0.01)
    assert time.monotonic() - started < 5


async def test_consistently_async() -> None:
    await consistently_async(lambda: asyncio.sleep(0, result=True), during=0.05)
    with pytest.raises(AssertionError):
        await consistently_async(lambda: False, during=1)


def test_a_detail_is_added_to_the_failure() -> None:
    with pytest.raises(WaitTimeout, match="the counters: 3"):
        eventually(lambda: False, timeout=0.05, detail=lambda: "the counters: 3")
