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

import json
import threading
import tomllib
from typing import Any

import pytest

from meshnode.cli.exitcodes import EX_DATAERR, EX_OK, EX_USAGE
from meshnode.testing import DaemonProcess, DaemonSet, render_toml

from .cli_here import cli_here

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


def test_agents_add_and_remove_of_several_names_ask_for_one_credential_each(meshnode_daemons: DaemonSet) -> None:
    """``meshnode agents add A B C`` is one Agents.Add naming them all: one
    credential request for them all, each agent failing alone (here a name the
    node refuses), and --save writing each table. ``agents remove A B C`` the
    same way. A script adding agents one call at a time ran into the control
    plane's per-node limit past 30 a minute, and waited out the minute."""
    hub = meshnode_daemons.embedded(
        "hub", agents={"echo": {"plugin": "echo"}},
        extra={"mesh.embedded.control_plane": {"node_rate_limit": AT_ONCE}},
    )
    node = meshnode_daemons.joined("j", via=hub, agents={"ears": {"plugin": "echo"}})
    socket = ("--socket", node.socket_path)
    names = [f"m{i}" for i in range(AT_ONCE)]
    before = grants(node)

    added = cli_here("agents", "add", *names, "Not-A-Name", "--plugin", "echo", "--save", *socket)
    assert added.returncode == EX_USAGE, added  # the refused name's code; the others are hosted
    assert "meshnode: Not-A-Name not hosted: agent names match" in added.stderr, added.stderr
    for name in names:
        assert f"hosting {name} (U" in added.stdout and f"saved as [agents.{name}]" in added.stdout, added.stdout
    assert grants(node) == before + 1, node.log_tail()
    saved = tomllib.loads(node.config_path.read_text(encoding="utf-8"))["agents"]
    assert {name: saved[name] for name in names} == dict.fromkeys(names, {"plugin": "echo"})
    assert "Not-A-Name" not in saved
    for name in (names[0], names[-1]):
        answer = hub.call(node.agent_id(name), "echo", name)
        assert answer["status"] == "completed" and answer["output"] == {"ok": name}, answer

    as_json = cli_here("agents", "add", "j0", "j1", "--plugin", "echo", "--json", *socket)
    assert as_json.returncode == EX_OK, as_json
    report = json.loads(as_json.stdout)
    assert (report["hosted"], report["failed"]) == (2, 0), report
    assert [(a["name"], a["hosted"], a["saved"]) for a in report["agents"]] == [("j0", True, None), ("j1", True, None)]
    assert grants(node) == before + 2, node.log_tail()

    removed = cli_here("agents", "remove", *names, "j0", "j1", "nobody", *socket)
    assert removed.returncode == EX_DATAERR, removed  # "nobody" is not hosted: NotFound
    assert "meshnode: nobody not removed: no hosted agent named 'nobody'" in removed.stderr, removed.stderr
    assert f"removed {', '.join([*names, 'j0', 'j1'])}" in removed.stdout, removed.stdout
    assert grants(node) == before + 3, node.log_tail()
    hosted = {a["name"] for a in node.admin("Agents.List")["agents"]}
    assert not hosted & {*names, "j0", "j1"} and "ears" in hosted, hosted
    assert "limits this node" not in node.log_text(), node.log_tail()
