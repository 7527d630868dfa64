"""The benchmarks run (quick mode) and report their ratios; no timing is asserted."""

from __future__ import annotations

from benchmarks import bench_canonical


def test_canonical_benchmark_reports_ratios() -> None:
    result = bench_canonical.run(quick=True)
    for key in ("canonical_speedup_vs_rfc8785", "sign_vs_floor", "verify_vs_floor"):
        assert result[key] > 0
    assert 500 < result["envelope_bytes"] < 1200
