"""Burst: a busy agent's broker buffer across roster changes (opt-in, like the soak).

``python -m benchmarks burst [--seconds N]`` runs two real daemons (a hub with the
embedded mesh, a joined node hosting ``echo``) and, for the given time, calls the
node's echo from the hub with 20 KB inputs from four threads, while the node adds
or removes an agent every two seconds (each one a planned reconnect: the node
presents a re-minted credential). At ~600 calls a second the default 8 MiB
buffer holds under a second of them, so the run shows whether the drain keeps
room in it: mail sent while the node is between connections has only the
buffer, and a full one refuses it.

It prints and records the calls completed and lost (timed out after 30 s) per
minute, and the buffer's backlog (last stored sequence minus the last purged one)
sampled from the node's drain status every half second. See
docs/operations/reliability.md, "A busy agent's buffer full at a reconnect".
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from meshnode.testing import DaemonSet

__all__ = ["burst", "run"]

PAYLOAD_BYTES = 20_000
CALLERS = 4
CHURN_EVERY_S = 2.0


def _echo_drain(status: dict[str, Any]) -> dict[str, Any] | None:
    for agent in status.get("agents", []):
        if isinstance(agent, dict) and agent.get("name") == "echo":
            drain = agent.get("drain")
            return drain if isinstance(drain, dict) else None
    return None


def burst(seconds: float, progress: Any = None) -> dict[str, Any]:
    """Run the burst for ``seconds`` and return its figures."""
    say = progress or (lambda _m: None)
    daemons = DaemonSet()
    counts = {"completed": 0, "lost": 0, "other": 0}
    backlog: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()
    try:
        hub = daemons.embedded("burst-hub", agents={"echo": {"plugin": "echo"}})
        node = daemons.joined("burst-node", via=hub, agents={"echo": {"plugin": "echo"}})
        target = node.agent_id("echo")

        def caller() -> None:
            while not stop.is_set():
                result = hub.call(target, "echo", "y" * PAYLOAD_BYTES, timeout=30)
                error = (result.get("error") or {}).get("code")
                outcome = "completed" if result.get("status") == "completed" else (
                    "lost" if error == "TRANSPORT_TIMEOUT" else "other")
                with lock:
                    counts[outcome] += 1

        def churn() -> None:
            n = 0
            while not stop.is_set():
                name = f"churn{n % 3}"
                n += 1
                node.admin("Agents.Add", {"name": name, "config": {"plugin": "echo"}}, timeout=60)
                if stop.wait(CHURN_EVERY_S):
                    break
                node.admin("Agents.Remove", {"name": name}, timeout=60)
                stop.wait(CHURN_EVERY_S)

        threads = [threading.Thread(target=caller, daemon=True) for _ in range(CALLERS)]
        threads.append(threading.Thread(target=churn, daemon=True))
        for thread in threads:
            thread.start()
        started = time.monotonic()
        next_report = started + 30
        while time.monotonic() - started < seconds:
            time.sleep(0.5)
            drain = _echo_drain(node.status())
            if drain is not None:
                backlog.append(int(drain["last_bound"]) - int(drain["purged_through"]))
            if time.monotonic() >= next_report:
                next_report += 30
                say(f"{time.monotonic() - started:.0f} s: {counts}")
        elapsed = time.monotonic() - started
        stop.set()
        final = _echo_drain(node.status()) or {}
    finally:
        stop.set()
        daemons.close()
    ordered = sorted(backlog) or [0]
    minutes = elapsed / 60
    return {
        "seconds": round(elapsed, 1),
        "completed_per_minute": counts["completed"] / minutes,
        "lost_per_minute": counts["lost"] / minutes,
        "counts": counts,
        "backlog_p50": statistics.median(ordered),
        "backlog_p90": ordered[int(len(ordered) * 0.9)],
        "backlog_max": ordered[-1],
        "drain": {k: final.get(k) for k in ("passes", "room_passes", "deferred", "repaired", "committed")},
    }


def run(quick: bool = False, seconds: float = 90.0) -> dict[str, Any]:
    """The benchmark entry: ``--quick`` runs 20 seconds."""
    from .harness import print_table, write_result

    result = burst(20.0 if quick else seconds, progress=lambda m: print(m, flush=True))
    print_table(
        f"burst: {CALLERS} callers of a joined node's echo with {PAYLOAD_BYTES // 1000} KB inputs, "
        f"a roster change every {CHURN_EVERY_S:.0f} s, {result['seconds']:.0f} s",
        [
            ("completed / min", "lost / min", "buffer backlog p50 / p90 / max (copies)", "drain"),
            (f"{result['completed_per_minute']:,.0f}", f"{result['lost_per_minute']:.1f}",
             f"{result['backlog_p50']:.0f} / {result['backlog_p90']} / {result['backlog_max']}",
             ", ".join(f"{k} {v}" for k, v in result["drain"].items())),
        ],
    )
    print(f"written {write_result('burst', result)}")
    return result
