"""The A2A bridge store: tasks and the idempotency map survive a reopen."""

from __future__ import annotations

from pathlib import Path

from meshnode.a2a.store import BridgeStore, Stored


async def test_create_remember_update_reopen_and_sweep(tmp_path: Path) -> None:
    store = BridgeStore(tmp_path / "a2a.sqlite3")
    await store.open()
    task = {"id": "t1", "contextId": "c1", "status": {"state": "TASK_STATE_SUBMITTED"}}
    await store.create(task, agent="echo", caller="anonymous", message_id="m1", body_hash="sha256:aa", now_ms=1000)
    seen = await store.remembered(agent="echo", caller="anonymous", message_id="m1", not_before_ms=0)
    assert seen is not None and seen.task_id == "t1" and seen.body_hash == "sha256:aa"
    # Another caller, another agent, or past the retention: not the same message.
    assert await store.remembered(agent="echo", caller="issuer:x", message_id="m1", not_before_ms=0) is None
    assert await store.remembered(agent="other", caller="anonymous", message_id="m1", not_before_ms=0) is None
    assert await store.remembered(agent="echo", caller="anonymous", message_id="m1", not_before_ms=2000) is None
    assert [t["id"] for t in await store.unfinished()] == ["t1"]
    await store.close()

    store = BridgeStore(tmp_path / "a2a.sqlite3")
    await store.open()
    task["status"] = {"state": "TASK_STATE_COMPLETED"}
    await store.update(task, now_ms=1500, terminal=True)
    assert await store.unfinished() == []
    assert await store.get("t1") == Stored(agent="echo", caller="anonymous", task=task)
    await store.sweep(idempotency_before_ms=1001, tasks_before_ms=1000)
    assert await store.remembered(agent="echo", caller="anonymous", message_id="m1", not_before_ms=0) is None
    assert await store.get("t1") is not None  # terminal tasks are kept longer
    await store.sweep(idempotency_before_ms=0, tasks_before_ms=2000)
    assert await store.get("t1") is None
    await store.close()


async def test_the_owner_and_the_idempotency_key_are_apart(tmp_path: Path) -> None:
    # An anonymous task is owned by "anonymous" and deduplicated under its body hash.
    store = BridgeStore(tmp_path / "a2a.sqlite3")
    await store.open()
    task = {"id": "t2", "contextId": "c2", "status": {"state": "TASK_STATE_SUBMITTED"}}
    await store.create(task, agent="echo", caller="anonymous", message_id="m1", body_hash="sha256:bb",
                       now_ms=1000, dedup_caller="anonymous:sha256:bb")
    stored = await store.get("t2")
    assert stored is not None and stored.caller == "anonymous"
    assert await store.remembered(agent="echo", caller="anonymous", message_id="m1", not_before_ms=0) is None
    seen = await store.remembered(agent="echo", caller="anonymous:sha256:bb", message_id="m1", not_before_ms=0)
    assert seen is not None and seen.task_id == "t2"
    await store.close()
