"""The owner allowance (EXT-8) over a real daemon: set, enforced, held, raised, persisted.

One embedded node hosts ``spender`` and ``watcher`` (``tests.agents.spender``);
its CLI identity asks ``spender`` for work. The owner (this node's key) sets
an allowance with ``meshnode allowance set``: work estimated over the per-task
ceiling is refused BUDGET_INSUFFICIENT with the estimate before the handler
runs; spend reported past it stops the work (BUDGET_EXHAUSTED). In
``ask_owner`` mode the work is held (at admission, and mid-task) in a Task
paused ``input_required`` until the owner raises the ceiling. Each crossing
is seen by ``watcher`` as ``mesh.event.agent.allowance_exceeded``. The
document and the day's spend survive a restart. A document signed by another
owner key is refused by ``allowance add`` until ``allowance_any_owner``; a
``meshnode reload`` takes ``allowance_file`` changes (valid, then tampered
with: failing closed) without restarting the agent.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meshnode.admin.exitcodes import EX_USAGE
from meshnode.protocol.allowance import Ceiling, CostModel, Scope, make_allowance
from meshnode.protocol.nkeys import KeyPair
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
    # The human view names the unit of its figures (they were bare numbers).
    human = run_cli("allowance", "show", "spender", "--socket", home.socket_path).stdout
    assert "spent today" in human and ": 6000 micro-USD" in human, human
    assert "of       100000 micro-USD spent, 94000 remaining" in human, human


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


def test_reload_and_add_take_documents_signed_by_another_owner_key(home: DaemonProcess, tmp_path: Path) -> None:
    # No stored document: the configured file alone governs (a valid stored one would win over an invalid file).
    spender = _cli(home, "clear", "spender")["allowance"]["agent_id"]
    node_id = home.status()["node"]["id"]
    person = KeyPair.generate()  # the owner signs with a personal key the manifest does not name
    later = time.time_ns() // 1_000_000 + 3_600_000  # newer than the stored document: it governs

    def document(per_task: int, at: int) -> dict[str, Any]:
        return make_allowance(person, agent=spender, cost_model=CostModel(1000, "USD"),
                              ceilings=[Ceiling(Scope.TASK, per_task)], updated_at_ms=at)

    # By default only the agent's owner (this node, §8.6) signs: refused naming both keys and the way out.
    configured = tmp_path / "configured.json"
    configured.write_text(json.dumps(document(500, later)), encoding="utf-8")
    refused = subprocess.run(
        [sys.executable, "-m", "meshnode.cli", "allowance", "add", str(configured), "--socket", home.socket_path],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )
    assert refused.returncode == EX_USAGE, refused
    assert "wrong_owner" in refused.stderr and person.public_key in refused.stderr and node_id in refused.stderr
    assert "[agents.spender] allowance_any_owner = true" in refused.stderr

    # `meshnode reload` takes the file and allowance_any_owner, restarting no agent.
    original = home.config_path.read_text(encoding="utf-8")
    home.config_path.write_text(original.replace(
        "[agents.spender]\n", f'[agents.spender]\nallowance_file = "{configured}"\nallowance_any_owner = true\n'
    ), encoding="utf-8")
    report = _reload(home)
    assert report["restarted"] == []
    assert report["allowances"]["spender"] == {"source": f"allowance_file {configured}", "valid": True, "errors": []}
    assert home.call("spender", "work", {"estimate": 800})["error"]["code"] == "BUDGET_INSUFFICIENT"  # over 500

    # The file tampered with: the next reload fails closed, naming it.
    configured.write_text(json.dumps(dict(document(500, later), ceilings=[{"scope": "task", "amount_micro": 10**9}])),
                          encoding="utf-8")
    [error] = _reload(home)["allowances"]["spender"]["errors"]
    assert str(configured) in error and "bad_signature" in error
    assert home.call("spender", "work", {"estimate": 1})["error"]["code"] == "BUDGET_INSUFFICIENT"

    # Accepted by `allowance add` now, and stored: the valid document governs, the work runs.
    added_file = tmp_path / "added.json"
    added_file.write_text(json.dumps(document(20000, later + 1)), encoding="utf-8")
    added = _cli(home, "add", str(added_file))
    assert added["valid"] is True and added["source"].startswith("stored ")
    assert added["document"]["owner_key"] == person.public_key
    assert home.call("spender", "work", {"estimate": 1000})["status"] == "completed"
    # (Turning allowance_any_owner off again fails this stored document closed: a unit test shows it.)
    home.config_path.write_text(original, encoding="utf-8")


def _reload(daemon: DaemonProcess) -> Any:
    return json.loads(run_cli("reload", "--socket", daemon.socket_path, "--json").stdout)
