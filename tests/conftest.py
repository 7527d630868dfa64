"""Shared test helpers: where the published fixtures live, a short temporary
directory, and a per-test watchdog."""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conformance import fixtures_dir

#: A test still running after this many seconds is taken for a hang (the
#: slowest test takes well under a minute on an idle machine). Override with
#: MESHNODE_TEST_TIMEOUT (seconds; 0 turns the watchdog off), e.g. for
#: MESHNODE_SOAK_SECONDS runs.
TEST_TIMEOUT_S = float(os.environ.get("MESHNODE_TEST_TIMEOUT", "300"))

#: After the interrupt, how long the session may take to wind down before the
#: process is ended outright (a hang the interrupt cannot reach).
_WIND_DOWN_S = 60.0


def load_fixture(name: str) -> dict[str, Any]:
    """Load a published fixture by file name, skipping the test when absent."""
    path: Path = fixtures_dir() / name
    if not path.is_file():
        pytest.skip(f"fixture {name} not found under {fixtures_dir()} (set MESHNODE_FIXTURES)")
    data: dict[str, Any] = json.loads(path.read_bytes())
    return data


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A fresh directory with a short path, removed afterwards.

    For tests whose paths end in a Unix socket (at most ~100 bytes): pytest's
    ``tmp_path`` is long already and longer still under pytest-xdist
    (``.../pytest-N/popen-gwK/<test name>``), which would fail the
    configuration's socket-length check rather than what the test checks."""
    # /tmp itself, not TMPDIR: a long TMPDIR (macOS) would defeat the point.
    path = Path(tempfile.mkdtemp(prefix="mn-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _dump_asyncio_tasks(limit: int = 40) -> None:
    # An async test hangs in an await, which no thread stack shows: print the
    # pending tasks of every running loop (read from another thread, which is
    # not safe in general and good enough for a process about to stop).
    loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]
    for loop in loops:
        try:
            tasks = list(asyncio.all_tasks(loop))
        except RuntimeError:  # the set changed while read
            continue
        sys.stderr.write(f"\n=== {len(tasks)} pending asyncio task(s) of {loop!r} ===\n")
        for task in tasks[:limit]:
            task.print_stack(limit=8, file=sys.stderr)
    sys.stderr.flush()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """End a hung test instead of the CI job's time: after TEST_TIMEOUT_S the
    stacks of every thread go to the real stderr (capture suspended) and the
    session is interrupted as by Ctrl-C (pytest reports what ran); if it still
    does not end, the process exits with status 3."""
    if TEST_TIMEOUT_S <= 0:
        yield
        return
    capman = item.config.pluginmanager.getplugin("capturemanager")
    timers: list[threading.Timer] = []

    def fire() -> None:
        if capman is not None:
            capman.suspend_global_capture(in_=False)
        sys.stderr.write(
            f"\n\n=== {item.nodeid} still running after {TEST_TIMEOUT_S:.0f}s "
            "(MESHNODE_TEST_TIMEOUT): stacks of every thread ===\n"
        )
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _dump_asyncio_tasks()
        last = threading.Timer(_WIND_DOWN_S, os._exit, args=(3,))
        last.daemon = True
        timers.append(last)
        last.start()
        os.kill(os.getpid(), signal.SIGINT)

    watchdog = threading.Timer(TEST_TIMEOUT_S, fire)
    watchdog.daemon = True
    timers.append(watchdog)
    watchdog.start()
    try:
        yield
    finally:
        for timer in timers:
            timer.cancel()
