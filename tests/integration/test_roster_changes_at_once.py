"""Many roster changes at once on a joined node share one credential.

A joined node asks the control plane for a credential naming its agents at
every roster change, and presents it by a reconnect. The control plane allows
each node ``node_rate_limit`` requests a minute (30 by default). A reload adding
20 agents asked 20 times; 20 ``agents add`` side by side asked 20 times too, and
past the limit each waited out the rest of the minute (59.8 s for the 20, 24
"limits this node" lines in the log). Now a reload asks once, and concurrent
changes share the refreshes (``meshnode.aio.SharedRuns``): 0.4 s for the same 20.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from meshnode.testing import DaemonProcess, DaemonSet, render_toml

pytestmark = pytest.mark.integration

AT_ONCE = 8
#: The log line of each credential the control plane granted the node.
GRANTED = "node credential renewed; expires"


def grants(node: DaemonProcess) -> int:
    return node.log_text().count(GRANTED)


def test_a_reload_adding_many_agents_asks_for_one_credential_and_concurrent_adds_share_theirs(
    meshnode_daemons: DaemonSet,
) -> None:
    # A limit the old behaviour (one request per agent: 2 * AT_ONCE) would have run into.
    hub = meshnode_daemons.embedded(
        "hub", agents={"echo": {"plugin": "echo"}},
        extra={"mesh.embedded.control_plane": {"node_rate_limit": AT_ONCE}},
    )
    node = meshnode_daemons.joined("j", via=hub, agents={"ears": {"plugin": "echo"}})
    before = grants(node)
    assert before >= 1, node.log_tail()

    for i in range(AT_ONCE):
        node.config[f"agents.r{i}"] = {"plugin": "echo"}
    node.config_path.write_text(render_toml(node.config), encoding="utf-8")
    report = node.admin("Reload")
    assert report["added"] == sorted(f"r{i}" for i in range(AT_ONCE)) and "failed" not in report, report
    assert grants(node) == before + 1, node.log_tail()

    outcomes: dict[str, Any] = {}

    def add(name: str) -> None:
        try:
            outcomes[name] = node.admin("Agents.Add", {"name": name, "config": {"plugin": "echo"}})
        except Exception as exc:
            outcomes[name] = exc

    adders = [threading.Thread(target=add, args=(f"c{i}",)) for i in range(AT_ONCE)]
    for thread in adders:
        thread.start()
    for thread in adders:
        thread.join(timeout=120)
    failed = {name: o for name, o in outcomes.items() if isinstance(o, Exception)}
    assert len(outcomes) == AT_ONCE and not failed, failed
    # Each add waits for a refresh that began after it; those made meanwhile share one.
    assert before + 1 < grants(node) < before + 1 + AT_ONCE, node.log_tail()
    assert "limits this node" not in node.log_text(), node.log_tail()

    # Every one of them is covered by the credential in force: the hub reaches each.
    for name in ("r0", f"r{AT_ONCE - 1}", "c0", f"c{AT_ONCE - 1}"):
        answer = hub.call(node.agent_id(name), "echo", name)
        assert answer["status"] == "completed" and answer["output"] == {"ok": name}, answer
