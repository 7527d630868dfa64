"""Two-node round trips with each node its own daemon process, as deployed.

``roundtrip`` runs both nodes in one Python process, so at concurrency 64 they
share one thread. Here node B is a real ``meshnode run`` on the embedded mesh
hosting the ``echo`` agent, node A a real ``meshnode run`` that joined it with
an invite, hosting the benchmark driver (:mod:`benchmarks.driver`). One admin
``Call`` per batch asks the driver to fire the batch at B's echo through the
ordinary ``ctx.request`` path (request, accept, answer — all signed, every §22
check, the target's manifest fetched from the registry once and cached); the
timings are taken inside A's process.

The baseline, in the same run against the same nats-server: raw nats-py
request-reply of the same payload size, the requester in this process and the
responder in its own (:mod:`benchmarks.raw_responder`). Batches of both
alternate, so a busy neighbour on the shared machine hits both alike; figures
are medians over the batches. CPU per round trip is the CPU time both ends'
processes used over the latency batches (``/proc``; nats-server excluded on
both sides), against the same crypto floor as ``roundtrip``; the same at
concurrency 64 (``cpu_us_at_64``) says how many cores each side kept busy.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nats

from meshnode.protocol.nkeys import KeyPair
from meshnode.testing import DaemonProcess, DaemonSet
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.jwt import nats_auth_callbacks

from .bench_roundtrip import PAYLOAD, _crypto_floor_us, issue21_figures, print_issue21_figures
from .driver import time_concurrent, time_sequential
from .harness import print_table, proc_cpu_s, run_loop, write_result
from .raw_responder import SUBJECT

RAW_BODY = 700  # bytes: about a request envelope carrying PAYLOAD, as in ``roundtrip``
CONCURRENCY = 64
ENVELOPE_SIZES = [900, 750, 800]  # request, accept, answer (for the crypto floor)


IDLE_WINDOW_S = 3.0


def _idle_cpu_ms_per_s(pids: tuple[int, int], window_s: float) -> float:
    """Both daemons' CPU (ms per second) over ``window_s`` with no traffic."""
    cpu0, t0 = sum(proc_cpu_s(p) for p in pids), time.monotonic()
    time.sleep(window_s)  # a measuring window: nothing is waited for
    return (sum(proc_cpu_s(p) for p in pids) - cpu0) / (time.monotonic() - t0) * 1000


def _start_daemons(daemons: DaemonSet) -> tuple[DaemonProcess, DaemonProcess, str]:
    """Node B (embedded mesh, echo) and node A (joined, driver); B's echo id."""
    node_b = daemons.embedded("b", agents={"echo": {"plugin": "echo"}})
    node_a = daemons.joined(
        "a", node_b, agents={"driver": {"plugin": "bench-driver"}},
        node={"plugin_modules": ["benchmarks.driver:plugin"]},
    )
    return node_a, node_b, node_b.agent_id("echo")


def _raw_user(node_b: DaemonProcess, name: str) -> tuple[str, KeyPair]:
    """A NATS user allowed everything in B's mesh account, minted with the
    account key B keeps in its data directory (same broker, no meshnode role)."""
    key = KeyPair.generate()
    jwt = EmbeddedNatsServer(node_b.data_dir).mint_user(name, key.public_key, [">"], [">"], 3600)
    return jwt, key


def _drive(node_a: DaemonProcess, pids: tuple[int, int], target: str, mode: str, n: int) -> dict[str, Any]:
    """One driver batch on node A; adds both daemons' CPU per call (µs)."""
    cpu0 = sum(proc_cpu_s(p) for p in pids)
    reply = node_a.call("driver", "run", {
        "target": target, "offering": "echo", "payload": PAYLOAD, "mode": mode, "n": n, "concurrency": CONCURRENCY,
    }, timeout=600)
    cpu1 = sum(proc_cpu_s(p) for p in pids)
    if reply.get("status") != "completed":
        raise RuntimeError(f"driver batch failed: {reply}\nnode A log:\n{node_a.log_tail()}")
    out: dict[str, Any] = reply["output"]
    out["both_cpu_us"] = (cpu1 - cpu0) / n * 1e6
    return out


def measure(*, n_lat: int, n_tp: int, repeats: int, warm: int = 100, idle_window_s: float = IDLE_WINDOW_S) -> dict[str, Any]:
    """Start both daemons and the raw responder, run ``repeats`` alternating
    batches of each, and return the medians (plus every batch's figures)."""

    async def main(node_a: DaemonProcess, node_b: DaemonProcess, echo_id: str, url: str) -> dict[str, Any]:
        resp_jwt, resp_key = _raw_user(node_b, "bench-raw-responder")
        responder = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.raw_responder"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=str(Path(__file__).resolve().parents[1]),
            env={**os.environ, "MESHNODE_BENCH_NATS_URL": url, "MESHNODE_BENCH_NATS_JWT": resp_jwt,
                 "MESHNODE_BENCH_NATS_SEED": resp_key.seed, "MESHNODE_BENCH_BODY": str(RAW_BODY)},
        )
        try:
            assert responder.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(responder.stdout.readline), 60)
            if line.strip() != "ready":
                raise RuntimeError(f"raw responder did not start (exit {responder.poll()}): {line!r}")
            req_jwt, req_key = _raw_user(node_b, "bench-raw-requester")
            jwt_cb, sig_cb = nats_auth_callbacks(lambda: req_jwt, req_key)
            nc = await nats.connect(url, user_jwt_cb=jwt_cb, signature_cb=sig_cb)
            body = b"x" * RAW_BODY

            async def raw_call() -> None:
                await nc.request(SUBJECT, body, timeout=10)

            pids = (node_a.pid, node_b.pid)
            assert pids[0] is not None and pids[1] is not None
            mesh_pids = (pids[0], pids[1])
            # Warm both paths (B's manifest lookup, caches, lazy imports).
            await time_sequential(raw_call, warm)
            await asyncio.to_thread(_drive, node_a, mesh_pids, echo_id, "latency", warm)
            # What both daemons spend with no traffic (flush ticks, the loop
            # watchdog, the services' polls), to tell it apart from the round
            # trips in the CPU figure at concurrency 1.
            idle = await asyncio.to_thread(_idle_cpu_ms_per_s, mesh_pids, idle_window_s)
            raw_runs: list[dict[str, float]] = []
            mesh_runs: list[dict[str, Any]] = []
            floors: list[float] = []
            for _ in range(repeats):
                floors.append(_crypto_floor_us(ENVELOPE_SIZES))
                cpu0, rcpu0 = time.process_time(), proc_cpu_s(responder.pid)
                p50, p99 = await time_sequential(raw_call, n_lat)
                cpu_us = ((time.process_time() - cpu0) + (proc_cpu_s(responder.pid) - rcpu0)) / n_lat * 1e6
                lat = await asyncio.to_thread(_drive, node_a, mesh_pids, echo_id, "latency", n_lat)
                cpu0, rcpu0 = time.process_time(), proc_cpu_s(responder.pid)
                tp_raw = await time_concurrent(raw_call, n_tp, CONCURRENCY)
                cpu_tp_us = ((time.process_time() - cpu0) + (proc_cpu_s(responder.pid) - rcpu0)) / n_tp * 1e6
                tp = await asyncio.to_thread(_drive, node_a, mesh_pids, echo_id, "throughput", n_tp)
                raw_runs.append({"p50_us": p50, "p99_us": p99, "throughput": tp_raw, "cpu_us": cpu_us,
                                 "cpu_us_at_64": cpu_tp_us})
                mesh_runs.append({"p50_us": lat["p50_us"], "p99_us": lat["p99_us"], "throughput": tp["per_s"],
                                  "cpu_us": lat["both_cpu_us"], "node_a_cpu_us": lat["cpu_us"],
                                  "cpu_us_at_64": tp["both_cpu_us"]})
            await nc.close()
        finally:
            if responder.stdin is not None:
                responder.stdin.close()
            try:
                responder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                responder.kill()
                responder.wait(timeout=10)

        def medians(runs: list[dict[str, float]]) -> dict[str, Any]:
            return {**{k: statistics.median(r[k] for r in runs) for k in runs[0]}, "runs": runs}

        raw, mesh = medians(raw_runs), medians(mesh_runs)
        floor = statistics.median(floors)
        return {
            "layout": "node A (driver) and node B (echo, embedded nats-server) each their own daemon process; "
                      "raw requester and responder in two processes",
            "raw": raw,
            "two_processes": mesh,
            "latency_ratio": mesh["p50_us"] / raw["p50_us"],
            "p99_ratio": mesh["p99_us"] / raw["p99_us"],
            "throughput_ratio": mesh["throughput"] / raw["throughput"],
            "cpu_per_round_trip_us": mesh["cpu_us"],
            "crypto_floor_us": floor,
            "cpu_vs_floor": mesh["cpu_us"] / floor,
            "idle_cpu_ms_per_s": idle,
            # The idle work that falls inside one round trip at concurrency 1.
            "idle_cpu_us_per_rt": idle * mesh["p50_us"] / 1000,
            **issue21_figures(floor=floor, raw=raw, mesh=mesh),
            "samples": {"latency": n_lat, "throughput": n_tp, "repeats": repeats, "concurrency": CONCURRENCY},
        }

    daemons = DaemonSet()
    try:
        node_a, node_b, echo_id = _start_daemons(daemons)
        url = node_b.admin("Mesh.Info")["nats_urls"][0]  # the admin client runs its own loop: call it outside ours
        result: dict[str, Any] = run_loop(main(node_a, node_b, echo_id, url))
        return result
    finally:
        daemons.close()


def run(quick: bool = False) -> dict[str, Any]:
    repeats = 1 if quick else 5
    result = measure(n_lat=200 if quick else 1000, n_tp=500 if quick else 3000, repeats=repeats)
    raw, mesh = result["raw"], result["two_processes"]
    rows: list[tuple[str, ...]] = [
        ("measurement", "p50 µs", "p99 µs", f"req/s @{CONCURRENCY}", "CPU µs/rt", "vs raw nats-py"),
        ("raw nats-py, 2 processes", f"{raw['p50_us']:.0f}", f"{raw['p99_us']:.0f}", f"{raw['throughput']:,.0f}",
         f"{raw['cpu_us']:.0f}", "baseline"),
        ("meshnode, 2 daemon processes", f"{mesh['p50_us']:.0f}", f"{mesh['p99_us']:.0f}",
         f"{mesh['throughput']:,.0f}", f"{mesh['cpu_us']:.0f}",
         f"latency {result['latency_ratio']:.2f}x, throughput {result['throughput_ratio']:.0%}"),
    ]
    print_table(f"round trip, one daemon per node (uvloop; medians of {repeats}; CPU = both ends' processes)", rows)
    print(f"CPU per round trip (node A + node B, nats-server excluded): {mesh['cpu_us']:.0f} µs "
          f"= {result['cpu_vs_floor']:.2f}x the {result['crypto_floor_us']:.0f} µs crypto floor; "
          f"node A alone {mesh['node_a_cpu_us']:.0f} µs; of it ≈ {result['idle_cpu_us_per_rt']:.0f} µs is the "
          f"daemons' idle work ({result['idle_cpu_ms_per_s']:.1f} ms/s with no traffic)")
    # CPU per call at concurrency 64 (batched writes make it cheaper than at 1)
    # times the rate: how many cores each side kept busy, i.e. whether it was CPU-bound.
    print(f"at concurrency {CONCURRENCY}: meshnode {mesh['cpu_us_at_64']:.0f} µs CPU per round trip, "
          f"{mesh['cpu_us_at_64'] * mesh['throughput'] / 1e6:.2f} cores busy (both daemons); raw nats-py "
          f"{raw['cpu_us_at_64']:.0f} µs, {raw['cpu_us_at_64'] * raw['throughput'] / 1e6:.2f} cores busy")
    print_issue21_figures(result, floor=result["crypto_floor_us"])
    print(f"written {write_result('roundtrip2', result)}")
    return result
