"""Tasks across and within nodes: deferral with progress, streaming, cancel with propagation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from meshnode.testing import DaemonProcess, DaemonSet, eventually, run_cli

pytestmark = pytest.mark.integration

PLUGINS = {"plugin_modules": ["tests.agents:tasks_plugin"]}


@pytest.fixture(scope="module")
def both() -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    """One pair for the four tests of the tasks plugin (each started the same two
    daemons): every task they open ends before the test does, and the one
    counter read absolutely (tasks.canceled) only the cancel test moves."""
    daemons = DaemonSet()
    try:
        a = daemons.embedded("a", agents={"tasks": {"plugin": "test-tasks"}}, node=PLUGINS)
        b = daemons.joined("b", via=a, agents={"tasks_b": {"plugin": "test-tasks"}}, node=PLUGINS)
        yield a, b
    finally:
        daemons.close()


def test_deferred_task_completes_with_output_locally_and_remotely(both: tuple[DaemonProcess, DaemonProcess]) -> None:
    a, b = both
    for caller, target in ((a, "tasks"), (a, b.agent_id("tasks_b")), (b, a.agent_id("tasks"))):
        result: dict[str, Any] = caller.call(target, "slow", {"steps": 3})
        assert result["status"] == "completed", result
        assert result["output"] == {"done": 3} and result["task_id"].startswith("t")
        assert result["accepted"] is True


def test_rejected_and_illegal(both: tuple[DaemonProcess, DaemonProcess]) -> None:
    a, _ = both
    result = a.call("tasks", "reject")
    assert result["status"] == "rejected"


def test_streamed_words_arrive_in_order_and_final_output_recovers(both: tuple[DaemonProcess, DaemonProcess]) -> None:
    a, b = both
    text = "the quick brown fox jumps over the lazy dog"
    for caller, target in ((a, "tasks"), (a, b.agent_id("tasks_b"))):
        params = {"agent": target, "offering": "words", "input": {"text": text}, "config": {"stream": True}, "timeout": 30}
        result = caller.admin("Call", params)
        assert result["status"] == "completed" and result["output"] == "".join(w + " " for w in text.split())
        # Without stream: the same words, one bare answer, no task.
        bare = caller.call(target, "words", {"text": text})
        assert bare["status"] == "completed" and bare["task_id"] is None and bare["output"] == result["output"]


def test_cancel_stops_the_handler_and_propagates_to_delegates(both: tuple[DaemonProcess, DaemonProcess]) -> None:
    a, b = both
    opened = a.admin("Call", {"agent": b.agent_id("tasks_b"), "offering": "delegate",
                              "input": {"target": a.agent_id("tasks")}, "wait_task": False, "timeout": 30})
    task_id = opened["task_id"]
    assert opened["status"] == "working"
    def sub_task() -> str | None:
        performing = a.admin("Tasks.List")["tasks"]  # A performs the delegate's sub-task
        return next((t["task_id"] for t in performing if t["agent"] == "tasks"), None)

    child: str | None = eventually(sub_task, what="the delegate's sub-task on A")
    assert child, "the delegate never started its sub-task"
    # Narrowed by agent (all of one agent's always fit a reply) or by task; the
    # CLI's cancel finds the performer so, however many tasks the node runs.
    assert [t["task_id"] for t in a.admin("Tasks.List", {"agent": "tasks"})["tasks"]] == [child]
    (by_id,) = a.admin("Tasks.List", {"task_id": child})["tasks"]
    assert by_id["agent"] == "tasks" and by_id["requester"] == b.agent_id("tasks_b")
    assert a.admin("Tasks.List", {"task_id": task_id})["tasks"] == []  # B's, not A's
    listed = run_cli("tasks", "list", "--agent", "tasks", "--socket", a.socket_path).stdout
    assert child in listed
    from meshnode.admin.protocol import NotFound

    with pytest.raises(NotFound, match="no hosted agent named 'nobody'"):
        a.admin("Tasks.List", {"agent": "nobody"})
    answer = a.admin("Tasks.Cancel", {"task_id": task_id, "agent": b.agent_id("tasks_b"), "reason": "superseded"})
    assert answer["status"] == "canceled"
    # B stopped its handler; the cancel was forwarded to A's sub-task as upstream_cancelled.
    eventually(lambda: not any(t["task_id"] == child for t in a.admin("Tasks.List")["tasks"]),
               what="A's sub-task to stop")
    assert not any(t["task_id"] == child for t in a.admin("Tasks.List")["tasks"])
    assert b.admin("Tasks.List") == {"tasks": [], "tasks_total": 0, "not_shown": 0}
    counters = next(x for x in a.status()["agents"] if x["name"] == "tasks")["counters"]
    assert counters.get("tasks.canceled") == 1
    # A second cancel finds nothing left to cancel there: NotFound (the CLI's
    # exit 65), the performer's section 12 error in its params.
    with pytest.raises(NotFound) as missing:
        a.admin("Tasks.Cancel", {"task_id": task_id, "agent": b.agent_id("tasks_b"), "reason": "superseded"})
    assert missing.value.params["code"] == "TASK_NOT_FOUND"


def test_budget_admission_and_pause_at_the_ceiling(meshnode_daemons: DaemonSet) -> None:
    plugins = {"plugin_modules": ["tests.agents:seller_plugin"]}
    a = meshnode_daemons.embedded("a", agents={"seller": {"plugin": "test-seller"}}, node=plugins)
    b = meshnode_daemons.joined("b", via=a, agents={"buyer": {"plugin": "test-seller"}}, node=plugins)
    seller = a.agent_id("seller")
    refused = b.admin("Call", {"agent": seller, "offering": "metered", "input": {}, "timeout": 10,
                               "budget": {"revision": 0, "cost_ceiling": {"amount_micro": 10, "currency": "USD"}}})
    assert refused["status"] == "failed" and refused["error"]["code"] == "BUDGET_INSUFFICIENT"
    assert refused["error"]["details"]["estimate"] == {"amount_micro": 1000, "currency": "USD"}
    past = b.admin("Call", {"agent": seller, "offering": "metered", "input": {}, "timeout": 10,
                            "budget": {"revision": 0, "deadline": "2020-01-01T00:00:00Z"}})
    assert past["status"] == "failed" and past["error"]["code"] == "DEADLINE_UNMEETABLE"
    # Across nodes: the seller pauses at the ceiling, the buyer raises the budget, work resumes.
    bought = b.call("buyer", "buy", {"target": seller}, timeout=30)
    assert bought["output"] == {"status": "completed", "output": {"finished": True, "revision": 1}}, bought


def test_requester_detects_gaps_and_truncation_and_drops_foreign_chunks(meshnode_daemons: DaemonSet) -> None:
    plugins = {"plugin_modules": ["tests.agents:streams_plugin"]}
    a = meshnode_daemons.embedded("a", agents={"producer": {"plugin": "test-streams"}}, node=plugins)
    b = meshnode_daemons.joined("b", via=a, agents={"consumer": {"plugin": "test-streams"}}, node=plugins)
    producer = a.agent_id("producer")

    def consume(offering: str) -> dict[str, Any]:
        result = b.call("consumer", "consume", {"target": producer, "offering": offering}, timeout=30)
        assert result["status"] == "completed", result
        output: dict[str, Any] = result["output"]
        return output

    assert consume("honest") == {"chunks": ["c0", "c1", "c2", "c3", "c4"]}
    assert "missing or injected" in consume("gap")["broken"]
    assert "chunk_count" in consume("truncated")["broken"]
    # A stranger's chunks are dropped, never fatal (#23): the producer's stream completes.
    assert consume("forged") == {"chunks": ["c0"]}
    # Counted: the gap's unsigned chunk 2 (not yet due), the stranger's chunk, the forged final.
    assert b.admin("Metrics")["refusals"]["task_stream"] == {"out_of_order": 1, "not_a_party": 1, "identity_mismatch": 1}


def test_failure_with_a_reason_from_the_closed_vocabulary(meshnode_daemons: DaemonSet) -> None:
    plugins = {"plugin_modules": ["tests.agents:unfurnished_plugin"]}
    a = meshnode_daemons.embedded("a", agents={"fixer": {"plugin": "test-unfurnished"}}, node=plugins)
    result = a.call("fixer", "fix", {})
    assert result["status"] == "failed" and result["task_id"]
    record: dict[str, Any] = eventually(
        lambda: (r := a.admin("Tasks.Show", {"task_id": result["task_id"]})).get("state") == "failed" and r,
        what="the task record reaching failed")
    assert record["state"] == "failed"
    last = record["history"][-1]["payload"]
    assert last["reason"] == "needs_not_furnished" and last["unmet_need"] == "resource:git"
