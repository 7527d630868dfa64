"""SIGUSR1's task dump (meshnode.daemon.taskdump) names what each task awaits."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from meshnode.daemon.taskdump import dump_tasks
from meshnode.testing import eventually_async


async def _chunks(gate: asyncio.Event) -> AsyncIterator[int]:
    await gate.wait()
    yield 1


async def _read_chunks(gate: asyncio.Event, started: list[int]) -> None:
    started.append(1)
    async for _ in _chunks(gate):
        pass


async def test_the_dump_follows_the_await_chain_into_async_generators(caplog: pytest.LogCaptureFixture) -> None:
    gate = asyncio.Event()
    started: list[int] = []
    readers = [asyncio.get_running_loop().create_task(_read_chunks(gate, started)) for _ in range(3)]
    await eventually_async(lambda: len(started) == 3, what="the readers waiting")
    with caplog.at_level(logging.WARNING, logger="meshnode.daemon.tasks"):
        assert dump_tasks() >= 3
    text = caplog.text
    # Three identical waits are one stack with a count; the generator's frame
    # (what asyncio's own task stack omits) is in it.
    assert "3× " in text, text
    assert "in _read_chunks" in text and "in _chunks" in text, text
    gate.set()
    await asyncio.gather(*readers)
