"""Which agent's code holds the memory allocated during a window (issue #23 item 10).

Every hosted agent shares the daemon's one heap, so no always-on figure can
say how much of the RSS is whose. What can be said, on demand, is where the
memory allocated *during a window* and still alive at its end was allocated
from: :func:`sample` turns on :mod:`tracemalloc` for the window (unless it is
already on, e.g. ``PYTHONTRACEMALLOC``), takes a snapshot, turns it off again,
and :func:`attribute` charges each surviving allocation to the agent whose
source code is the innermost frame of its traceback — the handler line that
allocated it, directly or through a library it called, or the task it
spawned. What no agent's code allocated (the daemon, nats-py, SQLite caches)
is reported as the daemon's own.

Agents are told apart by their code: two agents of the same plugin share a
row. Allocation tracing slows every allocation while it is on (an
allocation-heavy loop ran ~4.7× slower with 25 frames on the project's
two-core machine), which is why it is a sample and not a gauge.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tracemalloc
from collections import Counter
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "DEFAULT_FRAMES",
    "CodeRoot",
    "MemorySample",
    "attribute",
    "code_roots",
    "sample",
    "source_root_of",
]

#: Frames kept per allocation: enough to reach a handler's line from inside the
#: library calls it makes; each frame costs tracing time and memory.
DEFAULT_FRAMES = 25

#: The daemon's own package: an agent defined here (the CLI identity) is the
#: daemon, not a plugin, and must not collect the daemon's allocations.
_OWN_PACKAGE = Path(__file__).resolve().parents[1]

class _Frame(Protocol):
    @property
    def filename(self) -> str: ...
    @property
    def lineno(self) -> int: ...


class _Trace(Protocol):
    @property
    def size(self) -> int: ...
    @property
    def traceback(self) -> Sequence[_Frame]: ...


@dataclass(frozen=True)
class CodeRoot:
    """The source of one plugin: a package directory or a single module file."""

    path: str
    agents: tuple[str, ...]

    def holds(self, filename: str) -> bool:
        return filename == self.path or filename.startswith(self.path + os.sep)


@dataclass
class MemorySample:
    """What :func:`attribute` found: bytes and blocks per code root, the rest."""

    traced_bytes: int = 0
    traced_blocks: int = 0
    daemon_bytes: int = 0
    daemon_blocks: int = 0
    daemon_sites: Counter[str] = field(default_factory=Counter)
    by_root: dict[str, dict[str, Any]] = field(default_factory=dict)

    def as_dict(self, roots: Sequence[CodeRoot], top: int) -> dict[str, Any]:
        rows = []
        for root in roots:
            found = self.by_root.get(root.path, {"bytes": 0, "blocks": 0, "sites": Counter()})
            sites: Counter[str] = found["sites"]
            rows.append({
                "agents": list(root.agents),
                "source": root.path,
                "bytes": found["bytes"],
                "blocks": found["blocks"],
                "top_lines": [{"line": line, "bytes": size} for line, size in sites.most_common(top)],
            })
        rows.sort(key=lambda r: (-r["bytes"], r["source"]))
        return {
            "traced_bytes": self.traced_bytes,
            "traced_blocks": self.traced_blocks,
            "agents": rows,
            "daemon": {
                "bytes": self.daemon_bytes,
                "blocks": self.daemon_blocks,
                "top_lines": [{"line": line, "bytes": size} for line, size in self.daemon_sites.most_common(top)],
            },
        }


def source_root_of(obj: object) -> str | None:
    """Where the code of ``obj``'s class lives: its top-level package's
    directory, or the module file for a module outside any package. None for
    classes without a source file and for the daemon's own classes."""
    module_name = type(obj).__module__
    top = sys.modules.get(module_name.partition(".")[0])
    module = sys.modules.get(module_name)
    target = top if top is not None and hasattr(top, "__path__") else module
    file = getattr(target, "__file__", None)
    if not isinstance(file, str):
        return None
    path = Path(file).resolve()
    root = path.parent if hasattr(target, "__path__") else path
    if root == _OWN_PACKAGE or _OWN_PACKAGE in root.parents:
        return None
    return str(root)


def code_roots(agents: Mapping[str, object]) -> list[CodeRoot]:
    """The distinct code roots of ``agents`` (name -> agent object); agents
    of one plugin share a root. Roots nested in another (a plugin module inside
    a package already listed) fold into the outer one."""
    names: dict[str, list[str]] = {}
    for name, agent in agents.items():
        root = source_root_of(agent)
        if root is not None:
            names.setdefault(root, []).append(name)
    outer = sorted(names, key=len)
    merged: dict[str, list[str]] = {}
    for root in outer:
        home = next((o for o in merged if root == o or root.startswith(o + os.sep)), root)
        merged.setdefault(home, []).extend(names[root])
    return [CodeRoot(path, tuple(sorted(agent_names))) for path, agent_names in merged.items()]


def attribute(traces: Iterable[_Trace], roots: Sequence[CodeRoot]) -> MemorySample:
    """Charge each trace to the root holding its innermost frame that lies in
    any root; a trace with no such frame is the daemon's, charged to its
    innermost frame in meshnode's own code (the daemon's line that called the
    library which allocated it), else to its innermost frame. That is where
    the memory was made, not what holds it: a bounded cache shows as the
    line that made its entries."""
    result = MemorySample()
    # file name -> the root that holds it (or None): frames repeat a lot.
    owner_of: dict[str, CodeRoot | None] = {}
    own_code: dict[str, bool] = {}
    for trace in traces:
        result.traced_bytes += trace.size
        result.traced_blocks += 1
        owner: CodeRoot | None = None
        site = ""
        # tracemalloc lists frames oldest first; the innermost is last.
        for frame in reversed(trace.traceback):
            filename = frame.filename
            if filename not in owner_of:
                owner_of[filename] = next((r for r in roots if r.holds(filename)), None)
            owner = owner_of[filename]
            if owner is not None:
                site = f"{filename}:{frame.lineno}"
                break
        if owner is None:
            result.daemon_bytes += trace.size
            result.daemon_blocks += 1
            result.daemon_sites[_daemon_site(trace.traceback, own_code)] += trace.size
            continue
        entry = result.by_root.setdefault(owner.path, {"bytes": 0, "blocks": 0, "sites": Counter()})
        entry["bytes"] += trace.size
        entry["blocks"] += 1
        entry["sites"][site] += trace.size
    return result


def _daemon_site(traceback: Sequence[_Frame], own_code: dict[str, bool]) -> str:
    """``file:line`` of the innermost frame in meshnode's own package, else of the innermost frame."""
    for frame in reversed(traceback):
        filename = frame.filename
        own = own_code.get(filename)
        if own is None:
            own = own_code[filename] = filename.startswith(str(_OWN_PACKAGE) + os.sep)
        if own:
            return f"{filename}:{frame.lineno}"
    if not traceback:
        return "<unknown>"
    innermost = traceback[-1]
    return f"{innermost.filename}:{innermost.lineno}"


async def sample(
    agents: Mapping[str, object], window: Awaitable[None], *, frames: int = DEFAULT_FRAMES, top: int = 5
) -> dict[str, Any]:
    """Trace allocations while ``window`` runs (the admin method passes a
    sleep) and attribute what is still alive at its end to ``agents``' code
    (see the module docstring). Callers run one sample at a time: a second one
    would turn tracing off under the first."""
    already = tracemalloc.is_tracing()
    if not already:
        tracemalloc.start(frames)
    try:
        await window  # allocations happen meanwhile
        snapshot = tracemalloc.take_snapshot()
    finally:
        if not already:
            tracemalloc.stop()
    roots = code_roots(agents)
    # Grouping walks every trace: off the loop, so the daemon keeps serving.
    found = await asyncio.to_thread(attribute, snapshot.traces, roots)
    return {
        "frames": snapshot.traceback_limit,
        "since": "process start (tracing was already on)" if already else "the window's start",
        **found.as_dict(roots, top),
    }
