"""The task manager on a real (embedded) nats-server, driven with raw signed envelopes.

A service-role connection hosts the task manager; a participant node hosting
the requester, the responder, a delegate and a stranger publishes task updates
and asks for records under its own §14.3 credential, so every message below
also passes the broker's permission checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from nats.js.api import ConsumerInfo

from meshnode.protocol import subjects
from meshnode.protocol.attestations import make_vouch
from meshnode.protocol.envelope import (
    build_envelope,
    decode_envelope,
    encode_envelope,
    sign_envelope,
)
from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.protocol.tasks import TRANSITIONS, TaskState
from meshnode.protocol.timeutil import format_ts
from meshnode.services import RegistryService, ServiceContext, ensure_mesh_streams
from meshnode.services.task_record import Outcome, Record, Verdict
from meshnode.services.tasks import CONSUMER_NAME, TaskManagerService
from meshnode.testing import consistently_async, eventually_async
from meshnode.transport.connection import MeshConnection, Message
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.jetstream import KeyValue, KvEntry
from meshnode.transport.streams import StreamLimits

from .conftest import connect

pytestmark = pytest.mark.integration

WAIT_S = 10.0


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# --- the world ------------------------------------------------------------------------


@dataclass
class World:
    """A mesh, its service connection, and one participant node hosting four agents."""

    server: EmbeddedNatsServer
    service_key: KeyPair
    service_conn: MeshConnection
    node_key: KeyPair
    conn: MeshConnection
    requester: KeyPair
    responder: KeyPair
    delegate: KeyPair
    stranger: KeyPair
    managers: list[TaskManagerService] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    counter: int = 0

    def task_id(self) -> str:
        self.counter += 1
        return f"task-{self.counter}-{now_ms()}"

    def context(self, **overrides: Any) -> ServiceContext:
        return ServiceContext(
            connection=self.service_conn,
            key=overrides.pop("key", KeyPair.generate(Prefix.USER)),
            node_id=self.service_key.public_key,
            **overrides,
        )

    async def manager(self, **options: Any) -> TaskManagerService:
        options.setdefault("sweep_interval_s", 0.05)
        options.setdefault("stranded_grace_s", 0.0)
        options.setdefault("deadline_tolerance_ms", 0)
        options.setdefault("fetch_timeout_s", 0.2)
        context_options = options.pop("context", {})
        tm = TaskManagerService(self.context(**context_options), **options)
        await tm.start()
        self.managers.append(tm)
        return tm

    # -- speaking on a task --------------------------------------------------

    async def update(
        self,
        sender: KeyPair,
        task_id: str,
        payload: dict[str, Any] | None,
        *,
        to: KeyPair | None = None,
        context_id: str | None = "ctx-1",
        budget: dict[str, Any] | None = None,
        artifacts: list[Any] | None = None,
        ts_ms: int | None = None,
        signer: KeyPair | None = None,
        envelope_task_id: str | None = None,
    ) -> dict[str, Any]:
        """Publish a signed respond on ``mesh.task.{task_id}.update``; returns it."""
        if to is None:
            to = self.requester if sender is not self.requester else self.responder
        env = build_envelope(
            "respond",
            sender.public_key,
            now_ms=ts_ms if ts_ms is not None else now_ms(),
            to=to.public_key,
            in_reply_to="req-1",
            task_id=envelope_task_id or task_id,
            context_id=context_id,
            payload=payload,
            budget=budget,
            artifacts=artifacts,
        )
        if signer is None:
            sign_envelope(env, sender)
        else:
            env["sig"] = sign_envelope(dict(env, **{"from": signer.public_key}), signer)["sig"]
        await self.conn.publish(
            subjects.task_update(task_id), encode_envelope(env), headers={"Nats-Msg-Id": env["id"]}
        )
        await self.conn.flush()
        return env

    async def get(self, asker: KeyPair, task_id: str, payload: Any = None) -> dict[str, Any]:
        """Ask for a record; returns the verified reply, checked to be bound to the request."""
        env = sign_envelope(
            build_envelope(
                "request", asker.public_key, now_ms=now_ms(),
                payload=payload if payload is not None else {"task_id": task_id},
            ),
            asker,
        )
        msg = await self.conn.request(subjects.task_get(task_id), encode_envelope(env), timeout=3.0)
        reply = decode_envelope(msg.data)
        assert reply["type"] == "respond" and reply["in_reply_to"] == env["id"]
        assert reply["to"] == asker.public_key
        return reply

    # -- observing -----------------------------------------------------------

    def events_of(self, event_type: str, task_id: str | None = None) -> list[dict[str, Any]]:
        """Data of every collected event of ``domain.event_type`` (for ``task_id``)."""
        domain, _, kind = event_type.partition(".")
        return [
            e["payload"]["data"]
            for e in self.events
            if e["payload"]["domain"] == domain
            and e["payload"]["event_type"] == kind
            and (task_id is None or e["payload"]["data"].get("task_id") == task_id)
        ]

    async def record(
        self, task_id: str, until: Callable[[Record], bool] = lambda r: True, tm: TaskManagerService | None = None
    ) -> Record:
        """The stored record once ``until`` holds for it (bounded wait)."""
        manager = tm or self.managers[0]

        async def matching() -> Record | None:
            record = await manager.read(task_id)
            return record if record is not None and until(record) else None

        return await eventually_async(matching, what=f"the record of {task_id} to match")

    async def rejected(self, task_id: str, env: dict[str, Any]) -> dict[str, Any]:
        """The meta.rejected_updates entry for ``env`` once recorded."""
        record = await self.record(
            task_id,
            lambda r: any(x["envelope_id"] == env["id"] for x in r["meta"].get("rejected_updates", [])),
        )
        return next(x for x in record["meta"]["rejected_updates"] if x["envelope_id"] == env["id"])


@pytest.fixture
async def world(mesh: EmbeddedNatsServer) -> AsyncIterator[World]:
    service_key = KeyPair.generate(Prefix.USER)
    service_conn = await connect(mesh, service_key, mesh.mint_node_credential(service_key.public_key, [], 300,
                                                                              role="service"))
    await ensure_mesh_streams(service_conn.jetstream, 1)
    node_key = KeyPair.generate(Prefix.USER)
    agents = [KeyPair.generate(Prefix.USER) for _ in range(4)]
    jwt = mesh.mint_node_credential(node_key.public_key, [a.public_key for a in agents], 300)
    conn = await connect(mesh, node_key, jwt)
    requester, responder, delegate, stranger = agents
    world = World(mesh, service_key, service_conn, node_key, conn, requester, responder, delegate, stranger)

    async def on_event(msg: Message) -> None:
        world.events.append(decode_envelope(msg.data))

    await conn.subscribe("mesh.event.>", on_event)
    await conn.flush()
    try:
        yield world
    finally:
        for tm in world.managers:
            with contextlib.suppress(Exception):
                await tm.stop()
        for c in (conn, service_conn):
            with contextlib.suppress(Exception):
                await c.close(drain_timeout=1)


# --- creation and transitions ----------------------------------------------------------------

#: How to reach each non-terminal state from creation.
PATHS: dict[TaskState, list[str]] = {
    TaskState.SUBMITTED: [],
    TaskState.WORKING: ["working"],
    TaskState.INPUT_REQUIRED: ["working", "input_required"],
    TaskState.AUTH_REQUIRED: ["working", "auth_required"],
}


def _status(state: TaskState) -> dict[str, Any]:
    if state is TaskState.CANCELED:
        return {"status": "canceled", "reason": "user_requested"}
    return {"status": state.value}


async def test_first_update_creates_the_record_and_every_legal_transition_applies(world: World) -> None:
    await world.manager()
    pairs = sorted((frm, to) for frm, to in TRANSITIONS if frm is not None)
    assert len(pairs) == 16
    expected: dict[str, tuple[str, int]] = {}
    for frm, to in pairs:
        task_id = world.task_id()
        await world.update(world.responder, task_id, {"status": "submitted", "offering": "summarize"})
        for step in PATHS[frm]:
            await world.update(world.responder, task_id, {"status": step})
        await world.update(world.responder, task_id, _status(to))
        expected[task_id] = (to.value, len(PATHS[frm]) + 2)
    for task_id, (state, updates) in expected.items():

        def all_applied(r: Record, n: int = updates) -> bool:
            return len(r["history"]) == n

        record = await world.record(task_id, all_applied)
        assert record["state"] == state, task_id
        assert not record["meta"].get("rejected_updates"), record["meta"]

    record = await world.record(next(iter(expected)))
    assert record["id"] == next(iter(expected))
    assert record["requester"] == world.requester.public_key
    assert record["responder"] == world.responder.public_key
    assert record["context_id"] == "ctx-1" and record["offering"] == "summarize"
    assert record["artifacts"] == [] and record["meta"]["request_id"] == "req-1"
    assert record["created_at"].endswith("Z") and record["updated_at"] >= record["created_at"]
    # The history holds the envelopes as received: still signed, still verifiable.
    for env in record["history"]:
        assert decode_envelope(orjson.dumps(env))["from"] == world.responder.public_key


async def test_progress_is_recorded_and_illegal_moves_are_refused_not_applied(world: World) -> None:
    tm = await world.manager()
    task_id = world.task_id()
    await world.update(world.responder, task_id, {"status": "working"})  # the §10.5 opening
    await world.update(world.responder, task_id, {"status": "working", "message": "half way"},
                       artifacts=[{"id": "a1", "name": "draft", "parts": [{"text": "v1"}]}])
    await world.update(world.responder, task_id, {"status": "working", "message": "nearly"},
                       artifacts=[{"id": "a1", "name": "draft", "parts": [{"text": "v2"}]}])
    record = await world.record(task_id, lambda r: len(r["history"]) == 3)
    assert record["state"] == "working" and record["meta"]["first_state"] == "working"
    assert record["meta"]["status_message"] == "nearly"
    assert record["artifacts"] == [{"id": "a1", "name": "draft", "parts": [{"text": "v2"}]}]

    backwards = await world.update(world.responder, task_id, {"status": "submitted"})
    entry = await world.rejected(task_id, backwards)
    assert entry["code"] == "TASK_INVALID_TRANSITION" and entry["status"] == "submitted"
    # Only the responder moves the Task; the requester may only cancel.
    pushed = await world.update(world.requester, task_id, {"status": "completed"})
    assert (await world.rejected(task_id, pushed))["code"] == "UNAUTHORIZED"
    # A malformed ending is refused at the door (§10.8).
    bad = await world.update(world.responder, task_id, {"status": "failed", "reason": "tired"})
    assert (await world.rejected(task_id, bad))["code"] == "INVALID_ENVELOPE"
    # A stranger is not recorded at all, only counted. (Counted from here: the
    # requester's push above is refused UNAUTHORIZED too, so "== 1" held before
    # the stranger's update was read, and under load, once it was, never again.)
    counted = tm.counters["refused.unauthorized"]
    await world.update(world.stranger, task_id, {"status": "completed"}, to=world.requester)
    await eventually_async(lambda: tm.counters["refused.unauthorized"] == counted + 1,
                           what="the stranger's update refused and counted")

    done = await world.update(world.responder, task_id, {"status": "completed", "output": {"text": "ok"}})
    record = await world.record(task_id, lambda r: r["state"] == "completed")
    assert record["output"] == {"text": "ok"}
    assert record["meta"]["terminal_envelope_id"] == done["id"]
    assert all(h["from"] != world.stranger.public_key for h in record["history"])
    again = await world.update(world.responder, task_id, {"status": "working"})
    assert (await world.rejected(task_id, again))["code"] == "TASK_INVALID_TRANSITION"
    late_cancel = await world.update(world.requester, task_id, {"status": "canceled", "reason": "superseded"})
    assert (await world.rejected(task_id, late_cancel))["code"] == "TASK_NOT_CANCELABLE"
    record = await world.record(task_id)
    assert record["state"] == "completed" and len(record["history"]) == 4


async def test_history_is_capped_oldest_first(world: World) -> None:
    await world.manager(history_cap=5)
    task_id = world.task_id()
    sent = [await world.update(world.responder, task_id, {"status": "submitted"})]
    sent.append(await world.update(world.responder, task_id, {"status": "working"}))
    for i in range(6):
        sent.append(await world.update(world.responder, task_id, {"status": "working", "message": f"step {i}"}))
    record = await world.record(task_id, lambda r: r["meta"].get("status_message") == "step 5")
    assert [h["id"] for h in record["history"]] == [e["id"] for e in sent[-5:]]


async def test_an_update_published_while_no_manager_runs_is_applied_when_one_starts(world: World) -> None:
    first = await world.manager()
    task_id = world.task_id()
    await world.update(world.responder, task_id, {"status": "submitted"})
    await world.record(task_id)
    await first.stop()

    async def no_pull_waiting() -> bool:  # its last pull request has expired
        info: ConsumerInfo = await world.service_conn.jetstream.native.consumer_info("MESH_TASKS", CONSUMER_NAME)
        return info.num_waiting == 0

    await eventually_async(no_pull_waiting, what="the stopped manager's last pull request expiring")
    await world.update(world.responder, task_id, {"status": "working"})
    second = await world.manager()
    record = await world.record(task_id, lambda r: r["state"] == "working", tm=second)
    assert len(record["history"]) == 2


async def test_forged_stale_duplicate_and_misaddressed_updates_are_dropped_and_counted(world: World) -> None:
    tm = await world.manager()
    task_id = world.task_id()
    await world.update(world.responder, task_id, {"status": "submitted"})
    await world.record(task_id)
    await world.update(world.responder, task_id, {"status": "working"}, signer=world.stranger)
    await eventually_async(lambda: tm.counters["refused.envelope"] == 1)
    await world.update(world.responder, task_id, {"status": "working"}, ts_ms=now_ms() - 20 * 60_000)
    await eventually_async(lambda: tm.counters["refused.stale"] == 1)
    other = world.task_id()
    await world.update(world.responder, task_id, {"status": "working"}, envelope_task_id=other)
    await eventually_async(lambda: tm.counters["refused.invalid_envelope"] == 1)
    env = await world.update(world.responder, task_id, {"status": "working"})
    # The same envelope again, under a new message id so the stream keeps it.
    await world.conn.publish(subjects.task_update(task_id), encode_envelope(env))
    await eventually_async(lambda: tm.counters["refused.duplicate"] == 1)
    record = await world.record(task_id)
    assert record["state"] == "working" and len(record["history"]) == 2
    assert await world.record(task_id) is not None and await tm.read(other) is None


async def test_a_cancel_that_overtakes_the_first_update_is_applied_once_the_record_exists(world: World) -> None:
    tm = await world.manager()
    task_id = world.task_id()
    await world.update(world.requester, task_id, {"status": "canceled", "reason": "user_requested"})
    # The cancel arrives first and waits for its record (stashed as an orphan).
    await eventually_async(lambda: tm.counters["orphans.stashed"] == 1, what="the overtaking cancel stashed")
    await world.update(world.responder, task_id, {"status": "submitted"})
    record = await world.record(task_id, lambda r: r["state"] == "canceled")
    assert record["requester"] == world.requester.public_key
    assert record["meta"]["cancel_reason"] == "user_requested"


# --- get -----------------------------------------------------------------------------------------


async def test_get_answers_the_parties_only(world: World) -> None:
    tm = await world.manager()
    task_id = world.task_id()
    await world.update(world.responder, task_id, {"status": "submitted"})
    stored = await world.record(task_id)
    for party in (world.requester, world.responder):
        reply = await world.get(party, task_id)
        assert reply["from"] == tm.ctx.service_id and "error" not in reply
        assert reply["payload"] == stored
    refused = await world.get(world.stranger, task_id)
    assert refused["payload"] == {"status": "failed"} and refused["error"]["code"] == "UNAUTHORIZED"
    missing = await world.get(world.requester, "no-such-task")
    assert missing["error"]["code"] == "TASK_NOT_FOUND"
    crossed = await world.get(world.requester, task_id, payload={"task_id": "another"})
    assert crossed["error"]["code"] == "INVALID_ENVELOPE"


# --- budgets and the central clock -----------------------------------------------------------------


def _deadline(offset_ms: int) -> str:
    return format_ts(now_ms() + offset_ms)


async def test_budget_revisions_only_from_the_parties_only_forward_never_retroactive(world: World) -> None:
    tm = await world.manager()
    task_id = world.task_id()
    far = _deadline(3_600_000)
    await world.update(world.responder, task_id, {"status": "working"},
                       budget={"revision": 0, "deadline": far})
    record = await world.record(task_id)
    assert record["budget"] == {"revision": 0, "deadline": far}

    ceiling = {"amount_micro": 6_000_000, "currency": "USD"}
    await world.update(world.requester, task_id, {"budget": {"revision": 1, "cost_ceiling": ceiling}})
    record = await world.record(task_id, lambda r: r["budget"]["revision"] == 1)
    # Absolute, never a delta: revision 1 has no deadline because it states none.
    assert record["budget"] == {"revision": 1, "cost_ceiling": ceiling}
    await world.update(world.responder, task_id, {"budget": {"revision": 2, "deadline": far}})
    await world.record(task_id, lambda r: r["budget"]["revision"] == 2)

    await world.update(world.stranger, task_id, {"budget": {"revision": 9, "deadline": far}},
                       to=world.responder)
    await eventually_async(lambda: tm.counters["refused.unauthorized"] == 1)
    equal = await world.update(world.requester, task_id, {"budget": {"revision": 2, "deadline": far}})
    assert (await world.rejected(task_id, equal))["code"] == "TASK_INVALID_TRANSITION"
    past = await world.update(world.requester, task_id,
                              {"budget": {"revision": 3, "deadline": _deadline(-3_600_000)}})
    assert (await world.rejected(task_id, past))["code"] == "TASK_INVALID_TRANSITION"
    broken = await world.update(world.requester, task_id, {"budget": {"revision": 3}})
    assert (await world.rejected(task_id, broken))["code"] == "INVALID_ENVELOPE"

    await world.update(world.responder, task_id, {"status": "completed"})
    await world.record(task_id, lambda r: r["state"] == "completed")
    ended = await world.update(world.requester, task_id, {"budget": {"revision": 4, "deadline": far}})
    assert (await world.rejected(task_id, ended))["code"] == "TASK_INVALID_TRANSITION"
    record = await world.record(task_id)
    assert record["budget"] == {"revision": 2, "deadline": far}


async def test_overdue_mark_notice_and_completed_late(world: World) -> None:
    tm = await world.manager()
    task_id = world.task_id()
    notices: list[dict[str, Any]] = []

    async def on_update(msg: Message) -> None:
        env = decode_envelope(msg.data)
        if env["from"] == tm.ctx.service_id:
            notices.append(env)

    await world.conn.subscribe(subjects.task_update(task_id), on_update)
    deadline = _deadline(300)
    await world.update(world.responder, task_id, {"status": "submitted"},
                       budget={"revision": 0, "deadline": deadline})
    await world.update(world.responder, task_id, {"status": "working"})
    record = await world.record(task_id, lambda r: r["meta"].get("overdue") is True)
    assert record["state"] == "working" and record["meta"]["overdue_at"] >= deadline

    await eventually_async(lambda: len(world.events_of("task.overdue", task_id)) == 1 and len(notices) == 1)
    event = world.events_of("task.overdue", task_id)[0]
    assert event == {
        "task_id": task_id, "requester": world.requester.public_key, "responder": world.responder.public_key,
        "context_id": "ctx-1", "state": "working", "deadline": deadline,
        "overdue_at": record["meta"]["overdue_at"],
    }
    notice = notices[0]
    assert notice["type"] == "respond" and notice["to"] == world.requester.public_key
    assert notice["task_id"] == task_id and notice["in_reply_to"] == "req-1"
    assert notice["payload"] == {"status": "working", "overdue": True, "deadline": deadline,
                                 "overdue_at": record["meta"]["overdue_at"]}
    # The manager's own notice on the update subject is neither applied nor a refusal.
    await eventually_async(lambda: tm.counters["ignored.notice"] == 1)

    await world.update(world.responder, task_id, {"status": "completed", "output": "late but here"})
    record = await world.record(task_id, lambda r: r["state"] == "completed")
    assert record["meta"]["completed_late"] is True
    assert record["meta"]["late"]["code"] == "DEADLINE_EXCEEDED"
    assert record["meta"]["late"]["deadline"] == deadline
    await eventually_async(lambda: len(world.events_of("metering.task_completed", task_id)) == 1)
    assert world.events_of("metering.task_completed", task_id)[0]["completed_late"] is True
    assert len(world.events_of("task.overdue", task_id)) == 1


async def test_a_revised_deadline_lifts_the_overdue_mark(world: World) -> None:
    await world.manager()
    task_id = world.task_id()
    await world.update(world.responder, task_id, {"status": "working"},
                       budget={"revision": 0, "deadline": _deadline(200)})
    await world.record(task_id, lambda r: r["meta"].get("overdue") is True)
    await world.update(world.requester, task_id, {"budget": {"revision": 1, "deadline": _deadline(3_600_000)}})
    record = await world.record(task_id, lambda r: r["budget"]["revision"] == 1)
    assert record["meta"]["overdue"] is False and "overdue_lifted_at" in record["meta"]
    await world.update(world.responder, task_id, {"status": "completed"})
    record = await world.record(task_id, lambda r: r["state"] == "completed")
    assert "completed_late" not in record["meta"]


# --- cancel, stranded delegates -------------------------------------------------------------------


async def test_a_canceled_task_flags_its_stranded_delegates(world: World) -> None:
    await world.manager()
    parent, child, finished_child, other_context, not_its_delegate = (world.task_id() for _ in range(5))
    # parent: requester -> responder. Its delegates: responder -> delegate, same context.
    await world.update(world.responder, parent, {"status": "working"}, context_id="ctx-s")
    await world.update(world.delegate, child, {"status": "working"}, to=world.responder, context_id="ctx-s")
    await world.update(world.delegate, finished_child, {"status": "working"}, to=world.responder,
                       context_id="ctx-s")
    await world.update(world.delegate, finished_child, {"status": "completed"}, to=world.responder,
                       context_id="ctx-s")
    await world.update(world.delegate, other_context, {"status": "working"}, to=world.responder,
                       context_id="ctx-other")
    await world.update(world.delegate, not_its_delegate, {"status": "working"}, to=world.stranger,
                       context_id="ctx-s")
    for task_id in (child, other_context, not_its_delegate):
        await world.record(task_id)
    await world.record(finished_child, lambda r: r["state"] == "completed")

    await world.update(world.requester, parent, {"status": "canceled", "reason": "user_requested"},
                       context_id="ctx-s")
    record = await world.record(parent, lambda r: r["meta"].get("stranded_check") == "done")
    assert record["state"] == "canceled" and record["meta"]["stranded_children"] == [child]
    stranded = await world.record(child, lambda r: r["meta"].get("stranded") is True)
    assert stranded["meta"]["stranded_parent"] == parent and stranded["state"] == "working"
    for task_id in (finished_child, other_context, not_its_delegate):
        assert not (await world.record(task_id))["meta"].get("stranded")

    await eventually_async(lambda: len(world.events_of("task.stranded")) == 1)
    event = world.events_of("task.stranded")[0]
    assert event == {
        "task_id": child, "requester": world.responder.public_key, "responder": world.delegate.public_key,
        "context_id": "ctx-s", "parent_task_id": parent, "parent_cancel_reason": "user_requested",
        "state": "working", "stranded_at": stranded["meta"]["stranded_at"],
    }
    # The performer confirming the cancel afterwards is recorded, not refused.
    await world.update(world.responder, parent, {"status": "canceled", "reason": "user_requested"},
                       context_id="ctx-s")
    record = await world.record(parent, lambda r: len(r["history"]) == 3)
    assert not record["meta"].get("rejected_updates")


async def test_the_stranded_check_waits_for_the_grace_period(world: World) -> None:
    await world.manager(stranded_grace_s=0.6)
    parent, child = world.task_id(), world.task_id()
    await world.update(world.responder, parent, {"status": "working"}, context_id="ctx-g")
    await world.update(world.delegate, child, {"status": "working"}, to=world.responder, context_id="ctx-g")
    await world.record(child)
    await world.update(world.requester, parent, {"status": "canceled", "reason": "deadline_exceeded"},
                       context_id="ctx-g")
    await world.record(parent, lambda r: r["state"] == "canceled")
    # The performer forwards its cancel within the grace period: nothing is stranded.
    await world.update(world.responder, child,
                       {"status": "canceled", "reason": "upstream_cancelled", "note": "deadline_exceeded"},
                       to=world.delegate, context_id="ctx-g")
    record = await world.record(parent, lambda r: r["meta"].get("stranded_check") == "done")
    assert "stranded_children" not in record["meta"]
    assert not world.events_of("task.stranded")


# --- failed: platform-computed attribution -------------------------------------------------------------


async def test_failed_event_attribution_is_checked_against_the_registered_manifest(world: World) -> None:
    registry = RegistryService(world.context())
    await registry.start()
    try:
        tm = await world.manager(manifest_of=registry.manifest)
        t = now_ms()
        manifest = {
            "id": world.responder.public_key, "name": "crm", "description": "syncs a CRM",
            "version": "1.0.0", "protocol_version": "0.3.0",
            "endpoint": f"mesh.agent.{world.responder.public_key}.inbox",
            "node": {"id": world.node_key.public_key,
                     "attestation": make_vouch(world.node_key, world.responder.public_key, t - 1000, t + 3_600_000)},
            "capabilities": ["crm"],
            "offerings": [{"id": "crm-sync", "name": "CRM sync",
                           "needs": [{"credential": "Salesforce"}, {"file": "text/csv"}]}],
        }
        register = sign_envelope(build_envelope("register", world.responder.public_key, now_ms=now_ms(),
                                                payload=manifest), world.responder)
        msg = await world.conn.request(subjects.registry_register(world.node_key.public_key),
                                       encode_envelope(register), timeout=3.0)
        assert decode_envelope(msg.data)["payload"]["status"] == "registered"
        await eventually_async(lambda: registry.manifest(world.responder.public_key) is not None)

        cases = {
            "declared": ({"reason": "needs_not_furnished", "unmet_need": "credential:Salesforce"}, "client"),
            "undeclared": ({"reason": "needs_not_furnished", "unmet_need": "credential:Stripe",
                            "attribution": "client"}, "provider"),
            "dependency": ({"reason": "dependency_failed", "dependency": "Salesforce API",
                            "attribution": "client"}, "provider"),
            "plain": ({}, "provider"),
        }
        ids = {}
        for name, (fields, _) in cases.items():
            ids[name] = world.task_id()
            await world.update(world.responder, ids[name], {"status": "working", "offering": "crm-sync"})
            await world.update(world.responder, ids[name], {"status": "failed", "note": "see log", **fields})
        # A responder nobody registered: its claim cannot be checked, so it fails closed.
        unknown = world.task_id()
        await world.update(world.delegate, unknown, {"status": "working", "offering": "crm-sync"})
        await world.update(world.delegate, unknown, {"status": "failed", "reason": "needs_not_furnished",
                                                     "unmet_need": "credential:Salesforce"})
        await eventually_async(lambda: len(world.events_of("task.failed")) == 5)
        for name, (fields, attribution) in cases.items():
            event = world.events_of("task.failed", ids[name])[0]
            assert event["attribution"] == attribution, name
            assert {k: v for k, v in fields.items() if k != "attribution"}.items() <= event.items()
            assert "note" not in event and event["offering"] == "crm-sync"
            record = await world.record(ids[name])
            assert record["meta"]["attribution"] == attribution
        assert world.events_of("task.failed", unknown)[0]["attribution"] == "provider"
        declared = await world.record(ids["declared"])
        assert declared["meta"]["failure_reason"] == "needs_not_furnished"
        assert declared["meta"]["unmet_need"] == "credential:Salesforce"
        event = world.events_of("task.failed", ids["declared"])[0]
        assert event["envelope_id"] == declared["meta"]["terminal_envelope_id"]
        # A failed update missing its unmet_need is refused at the door: no event.
        bad = world.task_id()
        await world.update(world.responder, bad, {"status": "working"})
        wrong = await world.update(world.responder, bad, {"status": "failed", "reason": "needs_not_furnished"})
        assert (await world.rejected(bad, wrong))["code"] == "INVALID_ENVELOPE"
        assert not world.events_of("task.failed", bad) and tm.counters["emitted.task.failed"] == 5
    finally:
        await registry.stop()


# --- receipts and meter events ----------------------------------------------------------------------


async def test_completed_receipt_and_usage_meter_events(world: World) -> None:
    await world.manager()
    task_id = world.task_id()
    budget = {"revision": 0, "deadline": _deadline(3_600_000),
              "cost_ceiling": {"amount_micro": 4_000_000, "currency": "USD"}}
    await world.update(world.responder, task_id, {"status": "submitted", "offering": "caselaw-summary"},
                       budget=budget)
    await world.update(world.responder, task_id,
                       {"status": "working", "usage": [{"meter": "tokens_out", "quantity": 2000}]})
    done = await world.update(world.responder, task_id, {
        "status": "completed", "output": {"summary": "..."},
        "usage": [{"meter": "tokens_out", "quantity": 4210}, {"meter": "tool_calls", "quantity": 3},
                  {"meter": "requests", "quantity": 5}, {"meter": "model_ms", "quantity": 1.5}],
        "cost": {"amount_micro": 6315, "currency": "USD"},
    })
    record = await world.record(task_id, lambda r: r["state"] == "completed")
    await eventually_async(lambda: len(world.events_of("metering.usage", task_id)) == 4)

    receipts = world.events_of("metering.task_completed", task_id)
    assert len(receipts) == 1
    receipt = receipts[0]
    assert receipt == {
        "task_id": task_id, "requester": world.requester.public_key, "responder": world.responder.public_key,
        "offering": "caselaw-summary", "started_at": record["created_at"],
        "completed_at": record["meta"]["ended_at"], "duration_ms": receipt["duration_ms"],
        "cost": {"amount_micro": 6315, "currency": "USD"}, "budget": budget,
        "completed_late": False, "status": "completed",
    }
    assert receipt["duration_ms"] >= 0

    usage = {e["meter"]: e for e in world.events_of("metering.usage", task_id)}
    # The terminal report supersedes the cumulative one (4210, not 6210); observed
    # meter names and fractional quantities are not declared usage.
    assert set(usage) == {"tokens_out", "tool_calls", "tasks_completed", "task_ms"}
    for meter, quantity in (("tokens_out", 4210), ("tool_calls", 3)):
        assert usage[meter] == {
            "meter": meter, "class": "declared", "quantity": quantity,
            "provider": world.responder.public_key, "consumer": world.requester.public_key,
            "offering": "caselaw-summary", "task_id": task_id, "envelope_id": done["id"],
            "ts": record["meta"]["ended_at"],
        }
    assert usage["tasks_completed"]["class"] == "observed" and usage["tasks_completed"]["quantity"] == 1
    assert usage["task_ms"]["class"] == "observed" and usage["task_ms"]["quantity"] == receipt["duration_ms"]
    assert usage["tasks_completed"]["envelope_id"] == usage["task_ms"]["envelope_id"] == done["id"]
    assert not world.events_of("metering.task_canceled", task_id)


async def test_canceled_receipt_carries_the_reason_and_never_the_note(world: World) -> None:
    await world.manager()
    task_id = world.task_id()
    await world.update(world.responder, task_id, {"status": "submitted"})
    progress = await world.update(world.responder, task_id,
                                  {"status": "working", "usage": [{"meter": "tokens_in", "quantity": 900}]})
    await world.update(world.requester, task_id,
                       {"status": "canceled", "reason": "superseded", "note": "a newer request replaces it"})
    record = await world.record(task_id, lambda r: r["state"] == "canceled")
    assert record["meta"]["cancel_reason"] == "superseded"
    assert record["meta"]["note"] == "a newer request replaces it"
    await eventually_async(lambda: len(world.events_of("metering.task_canceled", task_id)) == 1
                      and len(world.events_of("metering.usage", task_id)) == 2)
    receipt = world.events_of("metering.task_canceled", task_id)[0]
    assert receipt == {
        "task_id": task_id, "requester": world.requester.public_key, "responder": world.responder.public_key,
        "started_at": record["created_at"], "canceled_at": record["meta"]["ended_at"],
        "duration_ms": receipt["duration_ms"], "cancel_reason": "superseded", "status": "canceled",
    }
    usage = {e["meter"]: e for e in world.events_of("metering.usage", task_id)}
    # The responder's last cumulative report is the usage of a Task canceled under it.
    assert usage["tokens_in"]["quantity"] == 900 and usage["tokens_in"]["envelope_id"] == progress["id"]
    assert usage["task_ms"]["envelope_id"] == record["meta"]["terminal_envelope_id"]
    assert not world.events_of("metering.task_completed", task_id)


async def test_events_are_signed_by_the_task_manager_with_their_id_as_msg_id(world: World) -> None:
    tm = await world.manager()
    seen: list[Message] = []

    async def on(msg: Message) -> None:
        seen.append(msg)

    await world.conn.subscribe("mesh.event.metering.task_completed", on)
    task_id = world.task_id()
    await world.update(world.responder, task_id, {"status": "working"})
    await world.update(world.responder, task_id, {"status": "completed"})
    await eventually_async(lambda: len(seen) == 1)
    env = decode_envelope(seen[0].data)
    assert env["type"] == "emit" and env["from"] == tm.ctx.service_id
    assert seen[0].headers is not None and seen[0].headers["Nats-Msg-Id"] == env["id"]


# --- two task managers -------------------------------------------------------------------------------


async def test_two_task_managers_share_the_work_and_lose_no_update(world: World) -> None:
    a = await world.manager()
    b = await world.manager()
    steps = ["submitted", "working", "working", "working", "completed"]
    tasks = [world.task_id() for _ in range(12)]
    for step in steps:
        await asyncio.gather(*(world.update(world.responder, t, {"status": step}) for t in tasks))
    for task_id in tasks:
        record = await world.record(task_id, lambda r: r["state"] == "completed")
        assert len(record["history"]) == len(steps), record["meta"]
        assert not record["meta"].get("rejected_updates")
    await eventually_async(lambda: len(world.events_of("metering.task_completed")) == len(tasks))
    await consistently_async(lambda: len(world.events_of("metering.task_completed")) == len(tasks), during=0.2,
                             what="no second receipt for any task")
    assert sorted(e["task_id"] for e in world.events_of("metering.task_completed")) == sorted(tasks)
    applied = sum(tm.counters["verdict.created"] + tm.counters["verdict.applied"] + tm.counters["verdict.progress"]
                  for tm in (a, b))
    assert applied == len(tasks) * len(steps)


async def test_concurrent_writers_lose_nothing_one_write_wins_the_loser_reapplies(world: World) -> None:
    a = await world.manager()
    b = await world.manager()
    task_id = world.task_id()
    await world.update(world.responder, task_id, {"status": "working"})
    await world.record(task_id)

    def bump(record: Record | None) -> Outcome:
        assert record is not None
        updated = dict(record, meta=dict(record["meta"], bumps=record["meta"].get("bumps", 0) + 1))
        return Outcome(Verdict.APPLIED, updated)

    async def writer(tm: TaskManagerService) -> None:
        for _ in range(15):  # each manager writes one record at a time, as it does in service
            await tm.mutate(task_id, bump)

    await asyncio.gather(writer(a), writer(b))
    record = await world.record(task_id)
    assert record["meta"]["bumps"] == 30

    # Deterministically: b writes between a's read and a's write. a's write is
    # refused on the revision, a re-reads, re-applies, and both bumps count.
    kv = a._kv
    assert kv is not None
    conflicts_before = a.counters["write_conflicts"]

    class Interleaved:
        def __init__(self, kv: KeyValue) -> None:
            self.kv = kv
            self.raced = False

        async def get(self, key: str) -> KvEntry:
            return await self.kv.get(key)

        async def create(self, key: str, value: bytes) -> int:
            return await self.kv.create(key, value)

        async def update(self, key: str, value: bytes, *, last: int) -> int:
            if not self.raced:
                self.raced = True
                await b.mutate(task_id, bump)
            return await self.kv.update(key, value, last=last)

    a._kv = Interleaved(kv)  # type: ignore[assignment]
    try:
        await a.mutate(task_id, bump)
    finally:
        a._kv = kv
    record = await world.record(task_id)
    assert record["meta"]["bumps"] == 32
    assert a.counters["write_conflicts"] == conflicts_before + 1


async def test_two_sweeping_managers_mark_a_task_overdue_once(world: World) -> None:
    managers = [await world.manager(), await world.manager()]
    sweeps = [0, 0]
    for n, tm in enumerate(managers):
        def counted(tm: TaskManagerService = tm, n: int = n) -> Any:
            sweeps[n] += 1
            return type(tm).sweep(tm)

        tm.sweep = counted  # type: ignore[method-assign]
    task_id = world.task_id()
    await world.update(world.responder, task_id, {"status": "working"},
                       budget={"revision": 0, "deadline": _deadline(200)})
    await world.record(task_id, lambda r: r["meta"].get("overdue") is True)
    marked = list(sweeps)
    await eventually_async(lambda: all(now >= then + 3 for now, then in zip(sweeps, marked, strict=True)),
                           what="several sweeps of both managers after the mark")
    assert len(world.events_of("task.overdue", task_id)) == 1


async def test_participants_may_ask_and_the_lookup_is_not_captured(world: World) -> None:
    """A node credential grants the lookup subject; nothing else is needed to ask."""
    from meshnode.transport.permissions import node_permissions

    pub, _ = node_permissions(world.node_key.public_key, [world.requester.public_key])
    assert "mesh.task.get.*" in pub
    info = await world.service_conn.jetstream.native.stream_info("MESH_TASKS")
    # The lookup subject is not captured, so no PubAck races the manager's answer.
    assert info.config.subjects is not None
    assert "mesh.task.>" not in info.config.subjects



# --- a full record store ---------------------------------------------------------------------


async def test_a_full_record_store_makes_room_by_evicting_ended_tasks_oldest_first(world: World) -> None:
    """The bucket keeps ended Tasks' records while there is room; when a write
    does not fit, the records of the Tasks that ended longest ago give way, a
    live Task's never does, no update is lost, and a get of an evicted Task
    answers TASK_EXPIRED (found by a soak: a full store failed every update)."""
    tm = await world.manager(context={"stream_limits": StreamLimits(task_records=48 * 1024)})
    live = world.task_id()
    await world.update(world.responder, live, {"status": "submitted", "offering": "summarize"})
    await world.update(world.responder, live, {"status": "working"})
    await world.record(live, lambda r: r["state"] == "working")
    ended: list[str] = []
    for _ in range(400):  # far more than 48 KiB holds: the store fills well before
        task_id = world.task_id()
        await world.update(world.responder, task_id, {"status": "submitted", "offering": "summarize"})
        await world.update(world.responder, task_id, {"status": "working"})
        await world.update(world.responder, task_id, {"status": "completed", "result": {"n": len(ended)}})
        await world.record(task_id, lambda r: r["state"] == "completed")
        ended.append(task_id)
        if tm.counters["evicted.ended"] >= 2:
            break
    assert tm.counters["evicted.ended"] >= 2, f"{len(ended)} ended Tasks and the store never filled"
    assert tm.counters["apply_failed"] == 0
    # The oldest ended Task went first; the newest is still there, and so is the live one.
    assert (await world.get(world.requester, ended[0]))["error"]["code"] == "TASK_EXPIRED"
    assert "error" not in await world.get(world.requester, ended[-1])
    await world.update(world.responder, live, {"status": "completed", "result": {"n": -1}})
    record = await world.record(live, lambda r: r["state"] == "completed")
    assert [e["payload"]["status"] for e in record["history"]] == ["submitted", "working", "completed"]
    assert (await world.get(world.requester, "never-was"))["error"]["code"] == "TASK_NOT_FOUND"
