"""The replay-on-restart residual (§16.4, §22.2), measured: it must be 0.

Live traffic is handled at once, but its buffered copy stays in the broker
until the next drain pass acks it. The live path commits each request's
(from, id) pair right before its handler starts (issue #23; it used to be
written behind in ~50 ms batches, and 0.7–4.7% of a burst ran twice after a
kill -9), so after a restart the drain acks those copies — or keeps one whose
handler the kill caught as ``interrupted`` — and never runs them again. This
measures it with real daemons: a burst of live requests, SIGKILL right after,
a restart, and the journal agent's count of handler runs per request.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from meshnode.testing import DaemonProcess, DaemonSet, eventually

from .harness import print_table, write_result


def _drained(node: DaemonProcess) -> bool:
    drain = next(a for a in node.status()["agents"] if a["name"] == "work").get("drain") or {}
    return int(drain.get("passes", 0)) >= 1 and not drain.get("running")


def run(quick: bool = False) -> dict[str, Any]:
    trials = 2 if quick else 5
    burst = 50 if quick else 200
    daemons = DaemonSet()
    totals = Counter[str]()
    try:
        a = daemons.embedded("a", agents={})
        journal = f"{daemons.root}/journal.log"
        b = daemons.joined("b", via=a, agents={"work": {"plugin": "test-journal", "path": journal}},
                           node={"plugin_modules": ["tests.agents:journal_plugin"]})
        target = b.agent_id("work")
        for _ in range(trials):
            for i in range(burst):
                result = a.call(target, "work", {"i": i}, timeout=10)
                assert result["status"] == "completed", result
                totals["live_handled"] += 1
            b.kill()  # SIGKILL right after the burst: the worst moment for the residual
            b.start()
            eventually(lambda: _drained(b), timeout=60, what="the start-up drain pass")
        with open(journal) as fh:
            counts = Counter(line.strip() for line in fh if line.strip())
        totals["dispatched_twice"] = sum(1 for n in counts.values() if n > 1)
    finally:
        daemons.close()
    rate = totals["dispatched_twice"] / max(1, totals["live_handled"])
    print_table("replay-on-restart residual after SIGKILL", [
        ("measurement", "messages", "dispatched twice", "rate"),
        ("live burst then kill -9", str(totals["live_handled"]), str(totals["dispatched_twice"]), f"{rate:.2%}"),
    ])
    result = {"trials": trials, "burst": burst, **totals, "rate": rate}
    print(f"written {write_result('residual', result)}")
    return result


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONPATH", ".")
    run()
