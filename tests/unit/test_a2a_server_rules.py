"""The A2A bridge's pure rules: JSON depth, task ownership, the idempotency key."""

from __future__ import annotations

from typing import Any

import pytest
from a2a.types.a2a_pb2 import ListTasksRequest, TaskState
from a2a.utils.errors import InvalidParamsError

from meshnode.a2a.handler import _listed
from meshnode.a2a.inbound import ANONYMOUS, Inbound, dedup_caller, may_see
from meshnode.a2a.intake import MAX_JSON_DEPTH, deeper_than


def nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def test_depth_counts_arrays_and_objects_without_recursing() -> None:
    assert not deeper_than(nested(MAX_JSON_DEPTH), MAX_JSON_DEPTH)
    assert deeper_than(nested(MAX_JSON_DEPTH + 1), MAX_JSON_DEPTH)
    assert deeper_than(nested(50_000), MAX_JSON_DEPTH)  # no RecursionError
    assert not deeper_than("scalar", 0) and not deeper_than([], 1) and deeper_than([[]], 1)


def test_a_trusted_task_is_its_issuers_an_anonymous_task_its_holders() -> None:
    assert may_see("issuer:a", "issuer:a")
    assert not may_see("issuer:a", "issuer:b")
    assert not may_see("issuer:a", ANONYMOUS)
    assert may_see(ANONYMOUS, ANONYMOUS) and may_see(ANONYMOUS, "issuer:a")


def test_anonymous_messages_are_deduplicated_on_their_body() -> None:
    def inbound(digest: str) -> Inbound:
        return Inbound(activated=False, message={}, body_hash=digest)

    assert dedup_caller("issuer:a", inbound("sha256:1")) == "issuer:a"
    assert dedup_caller(ANONYMOUS, inbound("sha256:1")) == "anonymous:sha256:1"
    # No canonical form, no hash: never the same key twice.
    assert dedup_caller(ANONYMOUS, inbound("")) != dedup_caller(ANONYMOUS, inbound(""))


def test_list_tasks_filters_and_pages() -> None:
    tasks = [
        {"id": f"t{i}", "contextId": "c1" if i % 2 else "c2",
         "status": {"state": "TASK_STATE_COMPLETED" if i < 3 else "TASK_STATE_WORKING",
                    "timestamp": f"2026-01-01T00:00:0{i}.000Z"},
         "artifacts": [{"artifactId": "output", "parts": [{"text": "x"}]}],
         "history": [{"messageId": f"m{i}", "role": "ROLE_USER", "parts": [{"text": "hi"}]}]}
        for i in range(5)
    ]
    page = _listed(tasks, ListTasksRequest(page_size=2))
    assert [t.id for t in page.tasks] == ["t0", "t1"] and page.next_page_token == "2" and page.total_size == 5
    assert not any(t.artifacts for t in page.tasks)  # includeArtifacts defaults to false
    last = _listed(tasks, ListTasksRequest(page_size=2, page_token="4", include_artifacts=True, history_length=0))
    assert [t.id for t in last.tasks] == ["t4"] and last.next_page_token == ""
    assert last.tasks[0].artifacts and not last.tasks[0].history
    assert [t.id for t in _listed(tasks, ListTasksRequest(context_id="c1")).tasks] == ["t1", "t3"]
    working = _listed(tasks, ListTasksRequest(status=TaskState.TASK_STATE_WORKING))
    assert [t.id for t in working.tasks] == ["t3", "t4"]
    after = ListTasksRequest()
    after.status_timestamp_after.FromJsonString("2026-01-01T00:00:02Z")
    assert [t.id for t in _listed(tasks, after).tasks] == ["t3", "t4"]
    for bad in (ListTasksRequest(page_token="x"), ListTasksRequest(page_token="-1"), ListTasksRequest(page_size=0),
                ListTasksRequest(page_size=101)):
        with pytest.raises(InvalidParamsError):
            _listed(tasks, bad)
