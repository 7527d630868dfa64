"""Roster changes at once on a joined node (opt-in, like the burst).

``python -m benchmarks roster [--agents N]`` runs two real daemons: a hub with
the embedded mesh and a node that joined it. Each roster change of a joined
node needs a credential naming its agents, from the hub's control plane, and a
reconnect to present it. It adds N agents three ways and reports, for each, the
time and the credential requests (the node's "node credential renewed" lines):

* one after another (``Agents.Add`` N times, each waiting for the last): the
  baseline, one request per agent;
* by a reload whose file gained N tables: one request for all of them;
* by N ``Agents.Add`` calls at once: they share the requests under way.

The hub's per-node limit (``node_rate_limit``, 30 a minute by default) is
raised for the run, so the baseline measures the requests and reconnects
themselves, not waits for the limit. The ratios are against the baseline of
the same run. See docs/operations/lifecycle.md.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from meshnode.testing import DaemonProcess, DaemonSet, render_toml

__all__ = ["roster", "run"]

#: The log line of each credential the control plane granted the node.
GRANTED = "node credential renewed; expires"


def _grants(node: DaemonProcess) -> int:
    return node.log_text().count(GRANTED)


def roster(agents: int) -> dict[str, Any]:
    """Add ``agents`` agents one after another, by a reload and all at once; their figures."""
    daemons = DaemonSet()
    figures: dict[str, dict[str, float]] = {}
    try:
        hub = daemons.embedded("roster-hub", agents={"echo": {"plugin": "echo"}},
                               extra={"mesh.embedded.control_plane": {"node_rate_limit": 100_000}})
        node = daemons.joined("roster-node", via=hub, agents={"echo": {"plugin": "echo"}})

        def timed(way: str, add: Any) -> None:
            before, started = _grants(node), time.perf_counter()
            add()
            figures[way] = {"seconds": time.perf_counter() - started, "requests": _grants(node) - before}

        def one_after_another() -> None:
            for i in range(agents):
                node.admin("Agents.Add", {"name": f"seq{i}", "config": {"plugin": "echo"}}, timeout=120)

        def by_reload() -> None:
            for i in range(agents):
                node.config[f"agents.file{i}"] = {"plugin": "echo"}
            node.config_path.write_text(render_toml(node.config), encoding="utf-8")
            report = node.admin("Reload", timeout=600)
            if len(report.get("added", [])) != agents:
                raise RuntimeError(f"the reload added {report.get('added')}, failed {report.get('failed')}")

        def at_once() -> None:
            errors: list[BaseException] = []

            def add(i: int) -> None:
                try:
                    node.admin("Agents.Add", {"name": f"con{i}", "config": {"plugin": "echo"}}, timeout=600)
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=add, args=(i,)) for i in range(agents)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if errors:
                raise RuntimeError(f"{len(errors)} of {agents} adds failed, e.g. {errors[0]}")

        timed("one after another", one_after_another)
        timed("by a reload", by_reload)
        timed("at once", at_once)
        # Every agent added is reached across the mesh: the credential in force covers them all.
        for name in (f"seq{agents - 1}", f"file{agents - 1}", f"con{agents - 1}"):
            answer = hub.call(node.agent_id(name), "echo", name)
            if answer.get("status") != "completed":
                raise RuntimeError(f"{name} did not answer: {answer}")
    finally:
        daemons.close()
    return {"agents": agents, "ways": figures}


def run(quick: bool = False, agents: int = 20) -> dict[str, Any]:
    """The benchmark entry: ``--quick`` adds 5 agents each way."""
    from .harness import print_table, write_result

    result = roster(5 if quick else agents)
    ways = result["ways"]
    baseline = ways["one after another"]
    print_table(
        f"roster: {result['agents']} agents added to a joined node, three ways",
        [("way", "seconds", "credential requests", "time vs one after another"),
         *((way, f"{f['seconds']:.2f}", f"{f['requests']:.0f}", f"{f['seconds'] / baseline['seconds']:.2f}x")
           for way, f in ways.items())],
    )
    print(f"written {write_result('roster', result)}")
    return result
