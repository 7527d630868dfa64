"""``python -m benchmarks [NAME ...] [--quick] [--agents 100,1000,10000]``: run the suite.

Each benchmark prints its own table and writes ``benchmarks/results/NAME.json``;
a run of more than one ends with a summary of the performance targets (issue
#9) against what this run measured, also written as ``summary.json``.

``python -m benchmarks soak --minutes N`` is the long leak run (not part of the
default set); see :mod:`benchmarks.soak`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from . import (
    bench_canonical,
    bench_drain,
    bench_inbox,
    bench_residual,
    bench_roundtrip,
    bench_roundtrip2,
    bench_scale,
    bench_stream,
)
from .harness import print_table, write_result

BENCHMARKS: dict[str, Callable[..., dict[str, Any]]] = {
    "canonical": bench_canonical.run,
    "roundtrip": bench_roundtrip.run,
    "roundtrip2": bench_roundtrip2.run,
    "drain": bench_drain.run,
    "stream": bench_stream.run,
    "scale": bench_scale.run,
    "residual": bench_residual.run,
    "inbox": bench_inbox.run,
}


def _agents(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--agents takes counts like 100,1000,10000, not {text!r}") from None
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError("--agents takes positive counts")
    return counts


def summary(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each issue-#9 target with this run's figure and whether it is met."""
    rows: list[dict[str, Any]] = []

    def add(target: str, value: float, limit: float, *, at_most: bool, shown: str) -> None:
        met = value <= limit if at_most else value >= limit
        rows.append({"target": target, "value": value, "limit": limit, "shown": shown, "met": met})

    if "canonical" in results:
        r = results["canonical"]
        add("canonical JSON ≥ 10x rfc8785", r["canonical_speedup_vs_rfc8785"], 10, at_most=False,
            shown=f"{r['canonical_speedup_vs_rfc8785']:.1f}x")
    if "roundtrip" in results:
        r = results["roundtrip"]
        add("two-node latency ≤ 2.5x raw nats-py", r["latency_ratio"], 2.5, at_most=True, shown=f"{r['latency_ratio']:.2f}x")
        add("two-node throughput @64 ≥ 40% raw", r["throughput_ratio"], 0.40, at_most=False, shown=f"{r['throughput_ratio']:.0%}")
        add("CPU per round trip ≤ 2x crypto floor", r["cpu_vs_floor"], 2.0, at_most=True, shown=f"{r['cpu_vs_floor']:.2f}x")
    if "roundtrip2" in results:
        r = results["roundtrip2"]
        add("2 daemon processes: latency ≤ 2.5x raw", r["latency_ratio"], 2.5, at_most=True,
            shown=f"{r['latency_ratio']:.2f}x")
        add("2 daemon processes: throughput @64 ≥ 40% raw", r["throughput_ratio"], 0.40, at_most=False,
            shown=f"{r['throughput_ratio']:.0%}")
        add("2 daemon processes: CPU per rt ≤ 2x floor", r["cpu_vs_floor"], 2.0, at_most=True,
            shown=f"{r['cpu_vs_floor']:.2f}x")
    if "scale" in results:
        for r in results["scale"]["results"]:
            if r["agents"] != 1000:
                continue
            add("1,000 agents registered ≤ 30 s", r["startup_s"], 30, at_most=True, shown=f"{r['startup_s']:.1f} s")
            add("1,000 agents RSS ≤ 250 MB", r["rss_mb"], 250, at_most=True, shown=f"{r['rss_mb']:.0f} MB")
            add("1,000 agents idle CPU ≤ 5% core", r["idle_cpu_pct"], 5, at_most=True, shown=f"{r['idle_cpu_pct']:.1f}%")
            add("1,000 agents idle JS API ≤ 20/s", r["idle_js_api_per_s"], 20, at_most=True,
                shown=f"{r['idle_js_api_per_s']:.1f}/s")
    if "residual" in results:
        r = results["residual"]
        add("run twice after kill -9 = 0 (#23)", r["dispatched_twice"], 0, at_most=True,
            shown=f"{r['dispatched_twice']} of {r['live_handled']}")
    if "inbox" in results:
        r = results["inbox"]
        add("commit before dispatch ≤ +50 µs CPU (#21)", r["added_cpu_us_per_request"], 50, at_most=True,
            shown=f"+{r['added_cpu_us_per_request']:.1f} µs ({r['cpu_ratio_new_over_old']:.1f}x write-behind)")
        add("commit before dispatch ≤ +0.2 ms latency (#21)", r["commit_latency_us_before_handler"], 200,
            at_most=True, shown=f"+{r['commit_latency_us_before_handler']:.0f} µs")
        add("drain of an already-seen copy ≤ 30 µs (#21)", r["already_seen_us_per_item"], 30, at_most=True,
            shown=f"{r['already_seen_us_per_item']:.1f} µs")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("names", nargs="*", help=f"which to run: {', '.join(BENCHMARKS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    parser.add_argument("--agents", type=_agents, default=None,
                        help="agent counts for the scale benchmark (default 100,1000,10000; quick: 100,1000)")
    parser.add_argument("--minutes", type=float, default=60.0, help="soak only: how long to run (default 60)")
    args = parser.parse_args()
    if "soak" in args.names:
        from . import soak

        soak.run(quick=args.quick, minutes=args.minutes)
        args.names = [n for n in args.names if n != "soak"]
        if not args.names:
            return 0
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}")
    results: dict[str, dict[str, Any]] = {}
    for name in args.names or list(BENCHMARKS):
        if name == "scale":
            results[name] = bench_scale.run(quick=args.quick, agents=args.agents)
        else:
            results[name] = BENCHMARKS[name](quick=args.quick)
    targets = summary(results)
    if targets:
        print_table("targets (issue #9), this run, 2 cores shared", [("target", "measured", "met"), *(
            (t["target"], t["shown"], "yes" if t["met"] else "NO") for t in targets)])
        print(f"written {write_result('summary', {'targets': targets, 'quick': args.quick})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
