"""The replay-on-restart residual (§16.4, §22.2), measured.

Live traffic is handled at once, but its buffered copy stays in the broker
until the next drain pass acks it. The node remembers what it handled (the
persisted duplicate memory, written behind in ~50 ms batches), so after a
restart the drain acks those copies instead of running them again. What is
left is the write-behind window: a message handled live in the last moments
before a SIGKILL may be dispatched a second time after the restart. This
measures how often, with real daemons, by killing the target right after a
burst of live requests and counting dispatches in the journal agent.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

from meshnode.testing import DaemonSet

from .harness import print_table, write_result


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
            time.sleep(2.0)  # the start-up drain runs
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
