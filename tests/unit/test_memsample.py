"""The memory sample (issue #23 item 10): allocations made during a window are
charged to the agent code that made them, with real tracemalloc."""

from __future__ import annotations

import asyncio
import importlib
import sys
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from meshnode.agent import AgentSettings
from meshnode.node import memsample
from meshnode.node.builtin import CliAgent
from meshnode.node.memsample import CodeRoot, attribute, code_roots, source_root_of

PLUGIN = '''
class Hoarder:
    """Keeps what each call allocates, as a leaking handler would."""

    def __init__(self):
        self.kept = []

    def handle(self, count):
        self.kept.append([bytearray(4096) for _ in range(count)])


class Quiet:
    def handle(self, count):
        return None
'''


@pytest.fixture
def plugin(short_tmp_path: Path) -> Iterator[ModuleType]:
    """A plugin package on sys.path, as ``pip install`` would leave one."""
    package = short_tmp_path / "hoardplug"
    package.mkdir()
    (package / "__init__.py").write_text(PLUGIN, encoding="utf-8")
    sys.path.insert(0, str(short_tmp_path))
    try:
        yield importlib.import_module("hoardplug")
    finally:
        sys.path.remove(str(short_tmp_path))
        sys.modules.pop("hoardplug", None)


def test_agents_of_one_plugin_share_its_package_and_the_daemons_own_have_none(plugin: ModuleType) -> None:
    root = source_root_of(plugin.Hoarder())
    assert plugin.__file__ is not None  # imported from its files
    assert root is not None and Path(root) == Path(plugin.__file__).resolve().parent
    roots = code_roots({"a": plugin.Hoarder(), "b": plugin.Quiet(), "cli": CliAgent("cli", AgentSettings())})
    assert roots == [CodeRoot(root, ("a", "b"))]


async def test_a_sample_charges_what_a_plugin_kept_to_it_and_the_rest_to_the_daemon(plugin: ModuleType) -> None:
    hoarder = plugin.Hoarder()
    started = asyncio.Event()
    daemon_side: list[bytes] = []

    async def window() -> None:
        started.set()
        hoarder.handle(256)  # ~1 MiB kept by plugin code
        daemon_side.append(b"x" * 300_000)  # kept by code outside any agent
        await asyncio.sleep(0)

    assert not tracemalloc.is_tracing()
    found = await memsample.sample({"hoarder": hoarder}, window(), top=2)
    assert started.is_set()
    assert not tracemalloc.is_tracing()  # turned off again: it slows every allocation
    (row,) = found["agents"]
    assert row["agents"] == ["hoarder"]
    assert 256 * 4096 <= row["bytes"] < 2 * 256 * 4096
    assert row["blocks"] >= 256
    keeping_line = PLUGIN.splitlines().index("        self.kept.append([bytearray(4096) for _ in range(count)])") + 1
    assert row["top_lines"][0]["line"].endswith(f"hoardplug/__init__.py:{keeping_line}")
    assert found["daemon"]["bytes"] >= 300_000
    assert found["traced_bytes"] == row["bytes"] + found["daemon"]["bytes"]
    assert found["since"] == "the window's start"


async def test_a_sample_leaves_tracing_on_when_it_found_it_on(plugin: ModuleType) -> None:
    tracemalloc.start(5)
    try:
        hoarder = plugin.Hoarder()
        hoarder.handle(8)  # before the window: still counted, tracing started earlier

        async def window() -> None:
            await asyncio.sleep(0)

        found = await memsample.sample({"hoarder": hoarder}, window())
        assert tracemalloc.is_tracing()
        assert found["since"].startswith("process start")
        assert found["agents"][0]["bytes"] >= 8 * 4096
    finally:
        tracemalloc.stop()


@dataclass
class _Frame:
    filename: str
    lineno: int


@dataclass
class _Trace:
    size: int
    traceback: list[_Frame]


def test_the_innermost_agent_frame_takes_the_allocation() -> None:
    outer = CodeRoot("/site/outerplug", ("outer",))
    inner = CodeRoot("/site/innerplug", ("inner",))
    traces = [
        # outer's handler called into inner's library code, which allocated through json
        _Trace(100, [_Frame("/site/outerplug/a.py", 3), _Frame("/site/innerplug/b.py", 7),
                     _Frame("/usr/lib/json.py", 1)]),
        _Trace(10, [_Frame("/site/outerplug/a.py", 4)]),
        _Trace(1, [_Frame("/site/outerplugX/c.py", 1)]),  # a sibling directory, not outer's
    ]
    found = attribute(traces, [outer, inner])
    assert found.by_root["/site/innerplug"]["bytes"] == 100
    assert found.by_root["/site/outerplug"]["bytes"] == 10
    assert (found.daemon_bytes, found.daemon_blocks) == (1, 1)
    rows = found.as_dict([outer, inner], top=1)["agents"]
    assert [r["agents"] for r in rows] == [["inner"], ["outer"]]
    assert rows[0]["top_lines"] == [{"line": "/site/innerplug/b.py:7", "bytes": 100}]


def test_the_daemons_own_allocations_are_charged_to_its_innermost_own_line() -> None:
    """What no agent's code allocated is still located: at the innermost line of
    meshnode's own package on its stack (where the daemon chose to keep what a
    library allocated), else at the allocation's innermost frame."""
    own = str(memsample._OWN_PACKAGE)
    agent = CodeRoot("/site/plug", ("plug",))
    traces = [
        # the inbox kept what orjson decoded, called from the pipeline
        _Trace(300, [_Frame(f"{own}/node/pipeline.py", 10), _Frame(f"{own}/node/inbox.py", 20),
                     _Frame("/site/orjson/__init__.py", 1)]),
        _Trace(200, [_Frame(f"{own}/node/pipeline.py", 10), _Frame(f"{own}/node/inbox.py", 20)]),
        # nats-py's own buffer, with no meshnode frame on the stack
        _Trace(50, [_Frame("/site/nats/aio/client.py", 5)]),
        _Trace(7, [_Frame("/site/plug/a.py", 1)]),
    ]
    found = attribute(traces, [agent]).as_dict([agent], top=5)
    assert found["daemon"] == {
        "bytes": 550,
        "blocks": 3,
        "top_lines": [
            {"line": f"{own}/node/inbox.py:20", "bytes": 500},
            {"line": "/site/nats/aio/client.py:5", "bytes": 50},
        ],
    }
    assert found["agents"][0]["bytes"] == 7
