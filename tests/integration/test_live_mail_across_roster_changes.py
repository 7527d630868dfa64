"""Live mail sent while a joined node changes its roster reaches its agents.

Each `agents add` and `agents remove` on a joined node presents a new credential
by a reconnect. Mail sent during the cut found no subscriber: a buffered agent
got it late from its drain, a sandbox agent (no buffer, §16.4) never, and its
caller was told the agent was unavailable. The reconnect is now bridged
(``MeshConnection.reconnect``); here callers keep calling a sandbox node's agent
while that node's roster changes four times, and every call must be answered.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from meshnode.testing import DaemonSet, eventually

pytestmark = pytest.mark.integration

CALLERS = 4


def test_a_sandbox_agent_answers_every_call_made_while_its_nodes_roster_changes(
    meshnode_daemons: DaemonSet,
) -> None:
    a = meshnode_daemons.embedded("a", agents={"echo": {"plugin": "echo"}})
    s = meshnode_daemons.joined("s", via=a, agents={"ears": {"plugin": "echo"}},
                                invite_args=("--trust-tier", "sandbox"))
    ears = s.agent_id("ears")
    assert a.call(ears, "echo", "warm")["status"] == "completed"  # A has resolved it once
    results: list[dict[str, Any]] = []
    stop = threading.Event()

    def call_until_stopped(caller: int) -> None:
        n = 0
        while not stop.is_set():
            results.append(a.call(ears, "echo", f"{caller}:{n}"))
            n += 1

    callers = [threading.Thread(target=call_until_stopped, args=(i,), daemon=True) for i in range(CALLERS)]
    for thread in callers:
        thread.start()
    try:
        for change in ({"method": "Agents.Add", "name": "late"}, {"method": "Agents.Add", "name": "later"},
                       {"method": "Agents.Remove", "name": "late"}, {"method": "Agents.Remove", "name": "later"}):
            answered = len(results)
            # Calls on the way while the roster changes, and more after it.
            params: dict[str, Any] = {"name": change["name"]}
            if change["method"] == "Agents.Add":
                params["config"] = {"plugin": "echo"}
            s.admin(change["method"], params)

            def more_answered(n: int = answered) -> bool:
                return len(results) >= n + 2 * CALLERS

            eventually(more_answered, what="calls answered after the change")
    finally:
        stop.set()
        for thread in callers:
            thread.join(timeout=120)
    failed = [r for r in results if r.get("status") != "completed"]
    assert not failed, f"{len(failed)} of {len(results)} calls failed, e.g. {failed[:3]}"
    reconnects = s.status()["mesh"]["planned_reconnects"]
    assert reconnects == {"bridged": 4, "unbridged": 0}, reconnects
