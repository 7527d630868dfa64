"""``python -m benchmarks [NAME ...] [--quick]``: run the benchmark suite."""

from __future__ import annotations

import argparse

from . import bench_canonical, bench_drain, bench_residual, bench_roundtrip, bench_stream

BENCHMARKS = {"canonical": bench_canonical.run, "drain": bench_drain.run, "residual": bench_residual.run, "stream": bench_stream.run, "roundtrip": bench_roundtrip.run}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("names", nargs="*", help=f"which to run: {', '.join(BENCHMARKS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}")
    for name in args.names or list(BENCHMARKS):
        BENCHMARKS[name](quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
