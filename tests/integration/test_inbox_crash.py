"""kill -9 during drains: nothing lost, nothing dispatched twice across restarts.

Each trial buffers requests for a stopped node, starts it, kills it with
SIGKILL at a random moment of its drain, and repeats; finally it lets the node
finish. Every request must then be either answered (the late answer is held in
the caller's inbox) or kept by the node as ``interrupted`` — never lost — and
the journal agent (which fsyncs each request id before answering) must show no
id twice. ``MESHNODE_CRASH_TRIALS`` raises the number of trials for a long run.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from meshnode.testing import DaemonSet, consistently, eventually

pytestmark = pytest.mark.integration

TRIALS = int(os.environ.get("MESHNODE_CRASH_TRIALS", "3"))
PER_TRIAL = int(os.environ.get("MESHNODE_CRASH_MESSAGES", "20"))


def test_kill_9_during_drain_loses_nothing_and_never_dispatches_twice(meshnode_daemons: DaemonSet) -> None:
    rng = random.Random(int(os.environ.get("MESHNODE_CRASH_SEED", "7")))
    a = meshnode_daemons.embedded("a", agents={})
    journal = f"{meshnode_daemons.root}/journal.log"
    b = meshnode_daemons.joined(
        "b", via=a, agents={"work": {"plugin": "test-journal", "path": journal}},
        node={"plugin_modules": ["tests.agents:journal_plugin"]},
    )
    target = b.agent_id("work")
    request_ids: list[str] = []
    for _ in range(TRIALS):
        if b.process is not None and b.process.poll() is None:
            assert b.stop() == 0
        # Sent at once (each waits its 0.2 s for the stopped node together, not one
        # after another: 4 s a trial): the buffer holds them all the same.
        with ThreadPoolExecutor(max_workers=PER_TRIAL) as pool:
            sent = list(pool.map(lambda i: a.call(target, "work", {"i": i}, timeout=0.2), range(PER_TRIAL)))
        for result in sent:
            assert result["status"] == "failed" and result["error"]["code"] == "TRANSPORT_TIMEOUT"
            request_ids.append(result["error"]["details"]["request_id"])
        b.start()
        time.sleep(rng.uniform(0.0, 0.6))  # somewhere inside the drain (or just after)
        b.kill()
    b.start()  # the last run finishes the work

    def settled() -> tuple[set[str], set[str]] | None:
        answered = {m["envelope"]["in_reply_to"] for m in _held_full(a)}
        kept = {m["msg_id"] for m in b.admin("Inbox.List", {"states": ["interrupted"], "limit": 1000})["messages"]}
        if answered | kept >= set(request_ids):
            return answered, kept
        return None

    outcome = eventually(settled, timeout=60, what="every request answered or kept as interrupted")
    assert outcome is not None, "some requests were neither answered nor kept by the node"
    answered, kept = outcome
    with open(journal) as fh:
        dispatched = Counter(line.strip() for line in fh if line.strip())
    twice = {rid: n for rid, n in dispatched.items() if n > 1}
    assert not twice, f"dispatched more than once: {twice}"
    assert not (answered & kept) or all(dispatched[r] <= 1 for r in answered & kept)
    answers_per_request = Counter(m["envelope"]["in_reply_to"] for m in _held_full(a))
    assert max(answers_per_request.values()) == 1, "a request was answered twice"
    print(f"{len(request_ids)} requests over {TRIALS} crash trials: {len(answered)} answered, "
          f"{len(kept)} kept as interrupted, 0 lost, 0 dispatched twice")


def _held_full(node: Any) -> list[dict[str, Any]]:
    rows = node.admin("Inbox.List", {"agent": "cli", "states": ["held"], "limit": 1000})["messages"]
    return [node.admin("Inbox.Show", {"id": r["id"]}) for r in rows]


def test_kill_9_during_a_stream_tells_the_requester_and_never_reruns_it(meshnode_daemons: DaemonSet) -> None:
    """A responder killed in the middle of a stream: the requester is told the
    stream failed (it does not wait forever, and never sees it completed), and
    the restarted responder — whose drain finds the request's buffered copy —
    does not run the handler a second time (at-most-once dispatch, §16.4)."""
    plugins = {"plugin_modules": ["tests.agents:tasks_plugin"]}
    a = meshnode_daemons.embedded("a", agents={}, node=plugins)
    b = meshnode_daemons.joined("b", via=a, agents={"streamer": {"plugin": "test-tasks"}}, node=plugins)
    runs = meshnode_daemons.root / "drip-runs.log"
    target = b.agent_id("streamer")
    outcome: dict[str, Any] = {}

    def call() -> None:
        params = {"agent": target, "offering": "drip", "input": {"runs": str(runs), "n": 400, "pause": 0.05},
                  "config": {"stream": True}, "timeout": 8}
        try:
            outcome["result"] = a.admin("Call", params, timeout=40)
        except Exception as exc:  # a refusal is an answer too
            outcome["error"] = exc

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    eventually(lambda: runs.exists() and runs.read_text().strip(), what="the stream's handler starting")
    assert runs.exists() and len(runs.read_text().split()) == 1, "the stream never started"
    # The stream is open on B, and the write-behind has recorded the request as handled.
    eventually(lambda: any(t["agent"] == "streamer" for t in b.admin("Tasks.List")["tasks"])
               and b.status()["inbox"]["write_behind_pending"] == 0,
               what="B's stream task open and its write-behind flushed")
    b.kill()

    caller.join(timeout=60)

    assert not caller.is_alive(), "the requester is still waiting on a dead stream"
    # Told, in so many words: the task went quiet, with its id to follow up.
    result = outcome.get("result")
    assert result is not None, outcome
    assert result["status"] == "failed" and result["error"]["code"] == "TRANSPORT_TIMEOUT", result
    assert result["error"]["details"]["task_id"] == result["task_id"]
    b.start()
    # Let the restarted node drain its buffer (the request's copy is there) and settle.
    def drains_settled() -> list[dict[str, Any]] | None:
        drains = [ag.get("drain") or {} for ag in b.status()["agents"] if ag["name"] == "streamer"]
        return drains if drains and int(drains[0].get("passes", 0)) >= 1 and not drains[0].get("running") else None

    drains = eventually(drains_settled, what="the restarted node's drain pass finishing")
    # The buffered copy was judged already handled, by this pass or by one
    # before the kill (live mail wakes the drain): either way, not new work.
    assert drains and drains[0]["dispatched"] == 0, drains
    consistently(lambda: len(runs.read_text().split()) == 1, during=1.0, what="no second run of the handler")
    assert len(runs.read_text().split()) == 1, "the handler ran again after the restart"


def _call_in_background(node: Any, target: str, offering: str, input: Any) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def call() -> None:
        outcome["result"] = node.call(target, offering, input, timeout=90)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    return caller, outcome


def test_requesters_are_told_when_the_responder_stops_or_crashes_mid_work(
    meshnode_daemons: DaemonSet, tmp_path: Any
) -> None:
    """A handler still running when its node stopped left the requester waiting on a
    Task that stayed ``working`` for ever (and a plain request until its timeout). A
    graceful stop now tells it (AGENT_UNAVAILABLE, reason agent_stopped); after a
    kill -9 the next start ends every Task the journal holds as open (INTERNAL_ERROR,
    reason interrupted). Neither is run again."""
    plugins = {"plugin_modules": ["tests.agents:tasks_plugin", "tests.agents:plugin"]}
    a = meshnode_daemons.embedded("a", agents={}, node=plugins)
    b = meshnode_daemons.joined("b", via=a, agents={"worker": {"plugin": "test-tasks"},
                                                     "sleeper": {"plugin": "test-faulty"}}, node=plugins)
    worker, sleeper = b.agent_id("worker"), b.agent_id("sleeper")
    never = {"gate": str(tmp_path / "never-opened")}

    def running_here(count: int) -> bool:
        return len(b.admin("Tasks.List")["tasks"]) >= count

    # A graceful stop: a Task and a plain request, both running.
    task_call, task_outcome = _call_in_background(a, worker, "gated_task", never)
    plain_call, plain_outcome = _call_in_background(a, sleeper, "sleep", 600)
    eventually(lambda: running_here(1) and b.status()["agents"] and any(
        ag["name"] == "sleeper" and ag["in_flight"] == 1 for ag in b.status()["agents"]),
        what="both handlers running on b")
    assert b.stop() == 0
    for caller in (task_call, plain_call):
        caller.join(timeout=60)
        assert not caller.is_alive(), "a requester still waits on a stopped node"
    for outcome in (task_outcome, plain_outcome):
        result = outcome["result"]
        assert result["status"] == "failed" and result["error"]["code"] == "AGENT_UNAVAILABLE", result
        assert result["error"]["details"] == {"reason": "agent_stopped"}, result
    stopped_task = task_outcome["result"]["task_id"]
    assert stopped_task

    # A crash: the Task is ended by the next start, as its agent.
    b.start()
    crash_call, crash_outcome = _call_in_background(a, worker, "gated_task", never)
    eventually(lambda: running_here(1), what="the task running on b")
    b.kill()
    b.start()
    crash_call.join(timeout=60)
    assert not crash_call.is_alive(), "the requester still waits on a task its crashed node left open"
    result = crash_outcome["result"]
    assert result["status"] == "failed" and result["error"]["code"] == "INTERNAL_ERROR", result
    assert result["error"]["details"] == {"reason": "interrupted"}, result
    assert "1 task(s) were left open when the node last stopped; 1 ended" in b.log_text()
    record = a.admin("Tasks.Show", {"task_id": result["task_id"]})
    assert record["state"] == "failed", record

    # What the stop told is settled: only the crashed request is kept as interrupted.
    kept = eventually(lambda: b.admin("Inbox.List", {"states": ["interrupted"]})["messages"] or None,
                      what="the crashed request kept as interrupted")
    assert [m["agent"] for m in kept] == ["worker"], kept
    assert "left open" not in b.log_text().split("1 task(s) were left open")[1], "a task ended twice"
