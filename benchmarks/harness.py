"""A small timing harness: medians of repeated batches, ratios against a baseline."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on the event loop the daemon runs on (uvloop where installed,
    as ``meshnode run`` does), so figures are the daemon's, baselines alike."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        import asyncio

        return asyncio.run(main)
    return uvloop.run(main)


@dataclass
class Measurement:
    name: str
    ops_per_s: float
    us_per_op: float
    runs: list[float] = field(default_factory=list)  # ops/s of each repetition


def measure(name: str, fn: Callable[[], object], *, batch: int, repeats: int = 7) -> Measurement:
    """Median throughput of ``fn`` over ``repeats`` batches of ``batch`` calls."""
    for _ in range(min(batch, 200)):  # warm caches and lazy imports
        fn()
    rates: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        elapsed = time.perf_counter() - start
        rates.append(batch / elapsed)
    median = statistics.median(rates)
    return Measurement(name, median, 1e6 / median, rates)


def proc_cpu_split(pid: int) -> tuple[float, float]:
    """(user, kernel) CPU seconds of process ``pid`` so far (``/proc``: utime, stime;
    clock ticks, 10 ms here, so measure over enough work)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def proc_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid`` so far, user and kernel."""
    return sum(proc_cpu_split(pid))


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def print_table(title: str, rows: Sequence[tuple[str, ...]]) -> None:
    print(f"\n== {title}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(widths[j]) if j == 0 else cell.rjust(widths[j]) for j, cell in enumerate(row)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {"benchmark": name, "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2, default=lambda o: asdict(o)))
    return path
