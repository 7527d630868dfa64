"""The owner allowance (EXT-8) over a real daemon: set, enforced, held, raised, persisted.

One embedded node hosts ``spender`` and ``watcher`` (``tests.agents.spender``);
its CLI identity asks ``spender`` for work. The owner (this node's key) sets
an allowance with ``meshnode allowance set``: work estimated over the per-task
ceiling is refused BUDGET_INSUFFICIENT with the estimate before the handler
runs; spend reported past it stops the work (BUDGET_EXHAUSTED). In
``ask_owner`` mode the work is held (at admission, and mid-task) in a Task
paused ``input_required`` until the owner raises the ceiling. Each crossing
is seen by ``watcher`` as ``mesh.event.agent.allowance_exceeded``. The
document and the day's spend survive a restart.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from meshnode.testing import DaemonProcess, DaemonSet, eventually, run_cli

pytestmark = pytest.mark.integration


def _ready(daemon: DaemonProcess) -> bool:
    names = {a["name"] for a in daemon.status()["agents"] if a.get("registered")}
    return {"spender", "watcher"} <= names


@pytest.fixture(scope="module")
def home() -> Iterator[DaemonProcess]:
    daemons = DaemonSet()
    try:
        daemon = daemons.embedded(
            "home", agents={"spender": {"plugin": "spender"}, "watcher": {"plugin": "watcher"}},
            node={"plugin_modules": ["tests.agents.spender:plugin"]},
        )
        eventually(lambda: _ready(daemon), what="spender and watcher registered", timeout=60)
        yield daemon
    finally:
        daemons.close()


def _cli(daemon: DaemonProcess, *args: str) -> Any:
    return json.loads(run_cli("allowance", *args, "--socket", daemon.socket_path, "--json").stdout)


def _stats(daemon: DaemonProcess) -> dict[str, int]:
    out: dict[str, int] = daemon.call("spender", "stats")["output"]
    return out


def _seen(daemon: DaemonProcess, outcome: str) -> list[dict[str, Any]]:
    events = daemon.call("watcher", "seen")["output"]
    return [e for e in events if e["data"]["outcome"] == outcome]


def test_refused_with_the_estimate_and_stopped_past_the_ceiling(home: DaemonProcess) -> None:
    shown = _cli(home, "set", "spender", "--per-task", "5000", "--per-day", "100000", "--cost-model", "1000:USD")
    assert shown["valid"] is True and shown["on_exhausted"] == "refuse"
    assert shown["document"]["owner_key"] == home.status()["node"]["id"]
    spender = shown["agent_id"]

    # Estimated at 8000 tokens = 8000 micro-USD, over the 5000 per task: refused, nothing ran.
    refused = home.call("spender", "work", {"estimate": 8000})
    assert refused["status"] == "failed", refused
    assert refused["error"]["code"] == "BUDGET_INSUFFICIENT"
    assert refused["error"]["details"] == {"estimate": {"amount_micro": 8000, "currency": "USD"}}
    assert _stats(home) == {"started": 0, "finished": 0}

    # Admitted (estimate fits), then the reported spend goes past the ceiling: stopped.
    stopped = home.call("spender", "work", {"estimate": 1000, "tokens": 3000, "steps": 2})
    assert stopped["status"] == "failed", stopped
    assert stopped["error"]["code"] == "BUDGET_EXHAUSTED"
    assert stopped["error"]["details"]["spent"] == {"amount_micro": 6000, "currency": "USD"}
    assert _stats(home) == {"started": 1, "finished": 0}

    refusal = eventually(lambda: _seen(home, "refused"), what="allowance_exceeded (refused) seen")
    assert refusal[0]["sender"] == spender
    assert refusal[0]["data"]["estimate"] == {"amount_micro": 8000, "currency": "USD"}
    assert refusal[0]["data"]["ceiling"]["scope"] == "task"
    eventually(lambda: _seen(home, "stopped"), what="allowance_exceeded (stopped) seen")

    day = _cli(home, "show", "spender")["allowances"][0]
    assert day["spend"]["today_micro"] == 6000
    assert [c["remaining_micro"] for c in day["ceilings"] if c["scope"] == "day"] == [94000]


def test_ask_owner_holds_until_the_owner_raises_the_allowance(home: DaemonProcess) -> None:
    _cli(home, "set", "spender", "--per-task", "5000", "--on-exhaustion", "ask_owner")
    before = _stats(home)

    # At admission: held unstarted, the Task paused for the owner.
    held = home.call("spender", "work", {"estimate": 8000, "tokens": 1000})
    assert held["status"] == "input_required", held
    assert held["error"]["code"] == "BUDGET_EXHAUSTED"
    shown = _cli(home, "show", "spender")["allowances"][0]
    assert [(h["task_id"], h["stage"]) for h in shown["held"]] == [(held["task_id"], "admission")]
    agents = {a["name"]: a for a in home.status()["agents"]}
    assert agents["spender"]["allowance_held"] == [held["task_id"]]
    assert _stats(home) == before
    _cli(home, "set", "spender", "--per-task", "20000")  # the mode stays ask_owner
    eventually(lambda: _stats(home)["finished"] == before["finished"] + 1, what="held work finished")
    assert _cli(home, "show", "spender")["allowances"][0]["held"] == []

    # Mid-task: 2 x 15000 tokens goes past 20000; paused, then raised again.
    paused = home.call("spender", "work", {"estimate": 100, "tokens": 15000, "steps": 2})
    assert paused["status"] == "input_required", paused
    assert paused["error"]["code"] == "BUDGET_EXHAUSTED"
    shown = _cli(home, "show", "spender")["allowances"][0]
    assert [h["stage"] for h in shown["held"]] == ["mid_task"]
    _cli(home, "set", "spender", "--per-task", "40000")
    eventually(lambda: _stats(home)["finished"] == before["finished"] + 2, what="paused work finished")
    eventually(lambda: len(_seen(home, "held")) == 1 and len(_seen(home, "paused")) == 1,
               what="allowance_exceeded (held, paused) seen")


def test_the_allowance_and_the_days_spend_survive_a_restart(home: DaemonProcess) -> None:
    before = _cli(home, "show", "spender")["allowances"][0]
    assert before["spend"]["today_micro"] > 0
    home.stop()
    home.start()
    eventually(lambda: _ready(home), what="agents registered again", timeout=60)
    after = _cli(home, "show", "spender")["allowances"][0]
    assert after["valid"] is True
    assert after["document"] == before["document"]
    assert after["spend"]["today_micro"] == before["spend"]["today_micro"]
