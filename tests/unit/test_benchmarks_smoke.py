"""The benchmarks run (quick mode) and report their ratios; no timing is asserted."""

from __future__ import annotations

import pytest

from benchmarks import bench_canonical


def test_canonical_benchmark_reports_ratios() -> None:
    result = bench_canonical.run(quick=True)
    for key in ("canonical_speedup_vs_rfc8785", "sign_vs_floor", "verify_vs_floor"):
        assert result[key] > 0
    assert 500 < result["envelope_bytes"] < 1200


@pytest.mark.integration  # real daemons and a broker: not in `make test-fast`
def test_scale_benchmark_measures_a_real_daemon() -> None:
    """A few agents through the real daemon path: every figure is reported."""
    from benchmarks import bench_scale

    result = bench_scale.measure(3, settle_s=0.0, window_s=1.0)
    assert result["agents"] == 3
    assert result["rss_mb"] > 0 and result["nats_server_rss_mb"] > 0
    assert result["idle_cpu_pct"] >= 0 and result["idle_js_api_per_s"] >= 0


@pytest.mark.integration  # real daemons and a broker: not in `make test-fast`
def test_two_process_roundtrip_benchmark_runs_real_daemons() -> None:
    """A handful of round trips between two daemon processes, and the raw
    baseline between two processes: every figure is reported (none asserted)."""
    from benchmarks import bench_roundtrip2

    result = bench_roundtrip2.measure(n_lat=5, n_tp=10, repeats=1, warm=2)
    for side in ("raw", "two_processes"):
        figures = result[side]
        assert figures["p50_us"] > 0 and figures["p99_us"] >= figures["p50_us"]
        assert figures["throughput"] > 0 and len(figures["runs"]) == 1
    assert result["two_processes"]["node_a_cpu_us"] > 0
    assert result["latency_ratio"] > 0 and result["throughput_ratio"] > 0 and result["crypto_floor_us"] > 0
