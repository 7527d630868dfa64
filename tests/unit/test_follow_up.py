"""Answering a paused task: the follow-up rule (§6.5, §7.3) and the responder's round."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import pytest

from meshnode.node.tasks import InputTimeout, ResponderTask
from meshnode.protocol.envelope import build_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.tasks import PausedTask, check_follow_up
from meshnode.testing import eventually_async
from tests.fakes import FakeNode

REQUESTER = KeyPair.generate().public_key
STRANGER = KeyPair.generate().public_key


def paused(state: str = "input_required", context_id: str | None = "ctx-1") -> PausedTask:
    return PausedTask(task_id="t1", requester=REQUESTER, state=state, context_id=context_id, offering="ask")


def code_of(task: PausedTask | None, **kw: Any) -> str | None:
    args: dict[str, Any] = {"task_id": "t1", "sender": REQUESTER, **kw}
    try:
        check_follow_up(task, **args)
    except ProtocolError as exc:
        return exc.code
    return None


@pytest.mark.parametrize("state", ["input_required", "auth_required"])
def test_the_requester_may_resume_a_paused_task(state: str) -> None:
    assert code_of(paused(state)) is None
    assert code_of(paused(state), context_id="ctx-1", offering="ask") is None


def test_a_stranger_and_an_unknown_task_are_answered_alike() -> None:
    with pytest.raises(ProtocolError) as unknown:
        check_follow_up(None, task_id="t1", sender=STRANGER)
    with pytest.raises(ProtocolError) as foreign:
        check_follow_up(paused(), task_id="t1", sender=STRANGER)
    # The same error object: a stranger learns nothing about which tasks exist.
    assert unknown.value.to_object() == foreign.value.to_object()
    assert foreign.value.code == "TASK_NOT_FOUND"
    assert "restarted" in foreign.value.message


@pytest.mark.parametrize("state", ["submitted", "working", "completed", "failed", "canceled", "rejected", "exhausted"])
def test_a_task_not_paused_is_an_invalid_transition(state: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        check_follow_up(paused(state), task_id="t1", sender=REQUESTER)
    assert exc.value.code == "TASK_INVALID_TRANSITION"
    assert exc.value.details == {"task_id": "t1", "from": state, "to": "working"}


def test_a_stranger_never_learns_the_state() -> None:
    assert code_of(paused("working"), sender=STRANGER) == "TASK_NOT_FOUND"


def test_context_and_offering_must_be_the_tasks() -> None:
    assert code_of(paused(), context_id="ctx-2") == "TASK_NOT_FOUND"
    assert code_of(paused(context_id=None), context_id="ctx-2") == "TASK_NOT_FOUND"
    assert code_of(paused(context_id=None)) is None  # absent: a SHOULD, not a MUST
    assert code_of(paused(), offering="other") == "INVALID_ENVELOPE"


# --- the responder's round, against a recording fake node ------------------------


class FakeHosted:
    def __init__(self) -> None:
        self.node = FakeNode()
        self.key = KeyPair.generate()
        self.agent_id = self.key.public_key


def request(sender: str = REQUESTER, **kw: Any) -> dict[str, Any]:
    return build_envelope("request", sender, now_ms=1_800_000_000_000, payload={"offering": "ask"}, **kw)


def working_task() -> ResponderTask:
    task = ResponderTask(FakeHosted(), request(context_id="ctx-1"), "t1")  # type: ignore[arg-type]
    task.state = "working"
    return task


def node_of(task: ResponderTask) -> FakeNode:
    node = task.hosted.node
    assert isinstance(node, FakeNode)
    return node


PROBLEMS = [{"input": "name", "problem": "missing", "description": "whom?"}]


async def test_ask_input_returns_the_follow_ups_input_after_working_is_sent() -> None:
    task = working_task()
    asking = asyncio.create_task(task.ask_input(PROBLEMS, schema={"type": "object", "required": ["name"]}))
    await eventually_async(lambda: task.state == "input_required")
    follow = request(task_id="t1")
    assert code_of(task.paused(), context_id="ctx-1", offering="ask") is None
    with pytest.raises(ProtocolError) as wrong:
        await task.take_follow_up(follow, {"nom": "x"})
    assert wrong.value.code == "INPUT_INVALID" and task.state == "input_required"
    await task.take_follow_up(follow, {"name": "Ada"})
    assert await asking == {"name": "Ada"}
    answer = node_of(task).delivered[-1]
    assert answer["in_reply_to"] == follow["id"] and answer["task_id"] == "t1"
    assert answer["payload"] == {"status": "working"}
    assert task.follow_up is not None and task.follow_up.envelope is follow
    # A second follow-up finds the task working.
    assert code_of(task.paused()) == "TASK_INVALID_TRANSITION"


async def test_require_input_still_returns_at_once_and_the_input_waits() -> None:
    task = working_task()
    pausing: Awaitable[object] = task.require_auth("sign in")  # typed to return nothing; checked here too
    assert await pausing is None
    await task.take_follow_up(request(task_id="t1"), {"user": "ada"})
    assert await task.wait_for_input(timeout=1) == {"user": "ada"}


async def test_an_unanswered_round_ends_canceled_and_refuses_late_answers() -> None:
    task = working_task()
    with pytest.raises(InputTimeout):
        await task.ask_input(PROBLEMS, timeout=0.01)
    last = node_of(task).published[-1]
    assert last["payload"]["status"] == "canceled" and last["payload"]["reason"] == "policy"
    assert code_of(task.paused()) == "TASK_INVALID_TRANSITION"


async def test_a_cancel_while_waiting_closes_the_round() -> None:
    task = working_task()
    asking = asyncio.create_task(task.ask_input(PROBLEMS))
    await eventually_async(lambda: task.state == "input_required")
    asking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asking
    with pytest.raises(ProtocolError) as exc:
        await task.take_follow_up(request(task_id="t1"), {"name": "Ada"})
    assert exc.value.code == "TASK_INVALID_TRANSITION"  # no round open: nothing to resume


async def test_a_budget_pause_takes_a_revision_not_a_follow_up() -> None:
    task = working_task()
    await task._send("input_required")  # as pause_for_budget does
    with pytest.raises(ProtocolError) as exc:
        await task.take_follow_up(request(task_id="t1"), {"name": "Ada"})
    assert exc.value.code == "TASK_INVALID_TRANSITION" and "budget" in exc.value.message
