"""Node scale: one real daemon on the embedded mesh hosting N agents.

For each N the benchmark starts ``meshnode run`` with N generated ``echo``
agents (one ``[agents.*]`` table each, as a person would write them) and the
embedded nats-server's monitoring port on, then measures:

* start-up: from spawning the process until the admin Status reports every
  agent registered;
* RSS of the daemon process (and, separately, of its nats-server);
* idle CPU of the daemon (percent of one core) over a quiet window after a
  settling period;
* JetStream API calls per second while idle, from nats-server's own counter
  (``/jsz`` ``api.total``) over the same window: what drains, heartbeats and
  renewals cost the broker when nothing is happening.

No traffic is sent: this is what hosting costs by itself.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from typing import Any

from meshnode.config.values import parse_size
from meshnode.testing import DaemonSet
from meshnode.transport.streams import DEFAULT_STREAM_LIMITS

from .harness import print_table, proc_cpu_s, proc_cpu_split, write_result

DEFAULT_AGENTS = (100, 1000, 10000)
BUFFER_BYTES = "1MiB"  # per-agent mailbox buffer ([inbox] buffer_max_bytes), see measure()


def _proc_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


def _jsz_api_total(monitor_url: str) -> int:
    with urllib.request.urlopen(f"{monitor_url}/jsz", timeout=10) as resp:
        data = json.load(resp)
    return int(data.get("api", {}).get("total", 0))


def _store_for(n: int) -> int:
    """The embedded store that fits the platform's reservations and ``n`` mailboxes of
    BUFFER_BYTES, with 1 GiB to spare (never below the 4 GiB default)."""
    gib = 1024**3
    return max(4 * gib, DEFAULT_STREAM_LIMITS.platform_total() + n * parse_size(BUFFER_BYTES) + gib)


def measure(
    n: int, *, settle_s: float, window_s: float, idle: bool = True, subscribing: bool = False
) -> dict[str, Any]:
    """One daemon hosting ``n`` agents: start-up until all are registered, then
    (``idle``) RSS, idle CPU and idle JetStream API rate. With ``subscribing``
    each agent also subscribes to an event pattern (``accepts``): one consumer
    on MESH_EVENTS each, made by the platform's consumer service."""
    daemons = DaemonSet()
    try:
        plugin = "test-listener" if subscribing else "echo"
        agents = {f"a{i:05d}": {"plugin": plugin} for i in range(n)}
        daemon = daemons.embedded(
            "scale",
            agents=agents,
            node={"plugin_modules": ["tests.agents:listener_plugin"]} if subscribing else None,
            # Every mailbox stream reserves its max_bytes in the JetStream store:
            # 10,000 x the 25 MiB default is more disk than this machine has.
            # And each reserves it out of the embedded server's store (default
            # 4 GiB): sized here for the platform's objects plus n mailboxes, as an
            # operator hosting this many agents would size it (docs/performance.md).
            extra={"mesh.embedded": {"monitor_port": 0, "jetstream_max_store": _store_for(n)},
                   "inbox": {"buffer_max_bytes": BUFFER_BYTES}},
            start=False,
        )
        t0 = time.monotonic()
        # With its bytecode cache, as an installed package starts (pip compiles
        # on install): an environment with PYTHONDONTWRITEBYTECODE set made each
        # start compile meshnode's ~200 modules from source (~0.3 s here).
        daemon.start(timeout=600.0, env_extra={"PYTHONDONTWRITEBYTECODE": ""})
        while True:
            summary = daemon.admin("Status", {"agents": False})["agent_summary"]
            registered = int(summary["registered"])  # n agents plus the node's own cli agent (hosted first)
            if registered >= n:
                break
            if int(summary.get("failed", 0)):
                raise RuntimeError(f"{summary['failed']} agent(s) failed to start:\n{daemon.log_tail(20)}")
            if time.monotonic() - t0 > 600:
                raise RuntimeError(f"only {registered} of {n} agents registered after 600 s")
            # A Status is O(agents + tasks) for the daemon: polled every 0.2 s it
            # was ~10 % of the daemon's main thread at 10,000 agents (py-spy), so
            # large rosters are polled once a second (±1 s on a minute-long figure).
            time.sleep(0.2 if n <= 1000 else 1.0)
        startup_s = time.monotonic() - t0
        pid = daemon.pid
        assert pid is not None
        if not idle:
            # CPU spent by the daemon (keys, vouches, manifests, the registry's
            # checks) and by its nats-server (mailbox streams, KV writes) until
            # every agent was registered, start-up included: where the time goes.
            servers = _children(pid)
            daemon_user, daemon_kernel = proc_cpu_split(pid)
            server_split = [proc_cpu_split(c) for c in servers]
            return {
                "agents": n,
                "startup_s": startup_s,
                "rss_mb": _proc_rss_mb(pid),
                "daemon_cpu_s": daemon_user + daemon_kernel,
                "daemon_kernel_cpu_s": daemon_kernel,
                "nats_server_cpu_s": sum(u + k for u, k in server_split),
                # Mostly ext4 creating each mailbox stream's directories and files.
                "nats_server_kernel_cpu_s": sum(k for _, k in server_split),
                "loadavg_1m": os.getloadavg()[0],
            }
        monitor = daemon.admin("Mesh.Info")["monitor_url"]
        time.sleep(settle_s)
        cpu0, api0, w0 = proc_cpu_s(pid), _jsz_api_total(monitor), time.monotonic()
        time.sleep(window_s)
        cpu1, api1, w1 = proc_cpu_s(pid), _jsz_api_total(monitor), time.monotonic()
        servers = _children(pid)
        return {
            "agents": n,
            "startup_s": startup_s,
            "rss_mb": _proc_rss_mb(pid),
            "nats_server_rss_mb": sum(_proc_rss_mb(c) for c in servers),
            "idle_cpu_pct": 100 * (cpu1 - cpu0) / (w1 - w0),
            "idle_js_api_per_s": (api1 - api0) / (w1 - w0),
            "window_s": w1 - w0,
        }
    finally:
        daemons.close()


def run(quick: bool = False, agents: tuple[int, ...] | None = None) -> dict[str, Any]:
    counts = agents or ((100, 1000) if quick else DEFAULT_AGENTS)
    settle, window = (5.0, 10.0) if quick else (15.0, 30.0)
    results = [measure(n, settle_s=settle, window_s=window) for n in counts]
    rows = [("agents", "start-up s", "daemon RSS MB", "nats-server RSS MB", "idle CPU % core", "idle JS API/s")]
    for r in results:
        rows.append((f"{r['agents']:,}", f"{r['startup_s']:.1f}", f"{r['rss_mb']:.0f}", f"{r['nats_server_rss_mb']:.0f}",
                     f"{r['idle_cpu_pct']:.1f}", f"{r['idle_js_api_per_s']:.1f}"))
    print_table(f"node scale: one daemon, N echo agents, idle window {window:.0f} s after {settle:.0f} s settling", rows)
    print("targets at 1,000 agents: start-up <= 30 s, RSS <= 250 MB, idle CPU <= 5 %, idle JS API <= 20/s; "
          f"mailbox buffer {BUFFER_BYTES} per agent")
    result = {"results": results, "settle_s": settle, "window_s": window, "buffer_max_bytes": BUFFER_BYTES}
    print(f"written {write_result('scale', result)}")
    return result


def run_subscribers(agents: tuple[int, ...] | None = None) -> dict[str, Any]:
    """``python -m benchmarks subscribers [--agents N,...]``: start-up of N agents that
    each subscribe to events, beside N that do not (not in the default set)."""
    counts = agents or (1000, 2000)
    results = []
    for n in counts:
        plain = measure(n, settle_s=0, window_s=0, idle=False)
        subscribing = measure(n, settle_s=0, window_s=0, idle=False, subscribing=True)
        results.append({"agents": n, "plain_startup_s": plain["startup_s"],
                        "subscribing_startup_s": subscribing["startup_s"],
                        "subscribing_daemon_cpu_s": subscribing["daemon_cpu_s"],
                        "subscribing_nats_server_cpu_s": subscribing["nats_server_cpu_s"],
                        "loadavg_1m": os.getloadavg()[0]})
    rows = [("agents", "start-up s (echo)", "start-up s (one event subscription each)", "daemon CPU s", "nats-server CPU s")]
    for r in results:
        rows.append((f"{r['agents']:,}", f"{r['plain_startup_s']:.1f}", f"{r['subscribing_startup_s']:.1f}",
                     f"{r['subscribing_daemon_cpu_s']:.1f}", f"{r['subscribing_nats_server_cpu_s']:.1f}"))
    print_table("subscribing agents: one daemon, N agents with one MESH_EVENTS consumer each", rows)
    result = {"results": results, "buffer_max_bytes": BUFFER_BYTES}
    print(f"written {write_result('subscribers', result)}")
    return result
