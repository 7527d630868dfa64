"""The benchmarks run (quick mode) and report their ratios; no timing is asserted."""

from __future__ import annotations

from benchmarks import bench_canonical


def test_canonical_benchmark_reports_ratios() -> None:
    result = bench_canonical.run(quick=True)
    for key in ("canonical_speedup_vs_rfc8785", "sign_vs_floor", "verify_vs_floor"):
        assert result[key] > 0
    assert 500 < result["envelope_bytes"] < 1200


def test_scale_benchmark_measures_a_real_daemon() -> None:
    """A few agents through the real daemon path: every figure is reported."""
    from benchmarks import bench_scale

    result = bench_scale.measure(3, settle_s=0.0, window_s=1.0)
    assert result["agents"] == 3
    assert result["rss_mb"] > 0 and result["nats_server_rss_mb"] > 0
    assert result["idle_cpu_pct"] >= 0 and result["idle_js_api_per_s"] >= 0
