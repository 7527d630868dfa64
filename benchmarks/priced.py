"""Priced traffic for a while: the meter outbox and the rating ledger under load.

``python -m benchmarks priced --minutes N [--metering-bytes 4MiB]`` runs one
embedded-mesh daemon hosting ``priced`` (``tests.agents.priced``: ``generate``
is priced per token) with ``[storage] metering_max_bytes`` as given (small, so
that ``MESH_METERING`` discards its oldest events within seconds), signs the
CLI identity's agreement, and keeps four callers busy with priced calls
through the admin API. Every 15 s it samples the ledger as ``usage`` sees it
(the stream sequence folded, the lines held and let go, whether it missed
events) and the daemon's RSS. At the end: the meter events the outbox had
to drop (``dropped (outbox full)`` WARNINGs), every WARNING by kind, the
ERROR lines.

What it showed (reliability.md, "Priced traffic"): the ledger kept every
line it ever folded (its memory grew with uptime), and the outbox, one
publish at a time, published ~240 of the ~600 events a second the calls made
and dropped the rest.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from meshnode.testing import DaemonSet, run_cli

from .harness import write_result
from .soak import warnings_logged

CALLERS = 4
SAMPLE_S = 15.0


def run(quick: bool = False, minutes: float = 5.0, metering_bytes: str = "4MiB") -> dict[str, Any]:
    minutes = 0.5 if quick else minutes
    daemons = DaemonSet()
    stop = threading.Event()
    calls: Counter[str] = Counter()
    samples: list[dict[str, Any]] = []
    try:
        daemon = daemons.embedded(
            "priced", agents={"priced": {"plugin": "priced"}},
            node={"plugin_modules": ["tests.agents.priced:plugin"]},
            extra={"storage": {"metering_max_bytes": metering_bytes}},
        )
        run_cli("agreements", "sign", "priced", "--offering", "generate", "--socket", daemon.socket_path)

        def caller() -> None:
            while not stop.is_set():
                try:
                    answer = daemon.call("priced", "generate", {"tokens": 10})
                    calls["completed" if answer.get("status") == "completed" else "other"] += 1
                except Exception:  # counted: a call the daemon did not answer
                    calls["failed"] += 1

        threads = [threading.Thread(target=caller, daemon=True) for _ in range(CALLERS)]
        for thread in threads:
            thread.start()
        started = time.monotonic()
        end = started + minutes * 60
        while time.monotonic() < end:
            stop.wait(min(SAMPLE_S, max(0.0, end - time.monotonic())))
            answer = daemon.admin("Usage.Rated", {"source": "ledger", "charges": False})
            ledger = answer["ledger"]
            sample = {"s": round(time.monotonic() - started), "calls": calls["completed"], "seq": ledger["seq"],
                      "lines": ledger["lines"], "dropped": ledger.get("dropped", 0),
                      "missed": ledger.get("missed", 0),
                      "rss_mib": round(daemon.admin("Metrics", {})["runtime"]["rss_bytes"] / 2**20, 1)}
            samples.append(sample)
            print("  ".join(f"{k} {v}" for k, v in sample.items()), flush=True)
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        log = daemon.log_text()
        warnings = warnings_logged(log)
        errors = sum(1 for line in log.splitlines() if " ERROR " in line)
    finally:
        stop.set()
        daemons.close()
    seconds = minutes * 60
    result = {"minutes": minutes, "metering_max_bytes": metering_bytes, "calls": dict(calls),
              "calls_per_s": calls["completed"] / seconds, "samples": samples, "warnings": warnings,
              "errors": errors,
              "outbox_full_warnings": sum(n for kind, n in warnings.items() if "outbox full" in kind)}
    print(f"{calls['completed']:,} priced calls ({result['calls_per_s']:.0f}/s), {calls['failed']} failed; "
          f"ledger lines held {min(s['lines'] for s in samples)}-{max(s['lines'] for s in samples)}, "
          f"RSS {samples[0]['rss_mib']}-{samples[-1]['rss_mib']} MiB; WARNINGs {warnings}; ERROR lines {errors}")
    print(f"written {write_result('priced', result)}")
    return result
