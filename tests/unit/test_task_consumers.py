"""A requester's consumer on MESH_TASKS is released however its wait ends (#23 item 4).

Against the one fake node: the consumer service's ensure is held open (the
service has made the consumer; its answer is on the way) while the waiter is
cancelled, and the delete must still be asked for at once, not left to the
server's idle reap.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from meshnode.agent import Agent, AgentSettings
from meshnode.node.hosted import HostedAgent
from meshnode.node.tasks import RequesterTask
from meshnode.protocol import subjects
from meshnode.protocol.envelope import build_envelope, sign_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.testing import eventually_async
from tests.fakes import FakeNode

NOW = 1_800_000_000_000


def requester() -> tuple[FakeNode, HostedAgent, RequesterTask]:
    node = FakeNode(now_ms=NOW, node_id=KeyPair.generate(Prefix.USER).public_key)
    node.connection.inbox_prefix = "_INBOX_NODE"  # type: ignore[attr-defined]  # a node's private prefix
    key, responder = KeyPair.generate(), KeyPair.generate()
    hosted = HostedAgent(node.as_port(), name="asker", kind="t", agent=Agent("asker", AgentSettings()), key=key,
                         guard=node.new_guard(key.public_key), interaction="service")
    opening = sign_envelope(build_envelope("respond", responder.public_key, now_ms=NOW, to=key.public_key,
                                           in_reply_to="r1", task_id="t1", payload={"status": "working"}),
                            responder)
    return node, hosted, RequesterTask(hosted, opening)


@pytest.mark.parametrize("wait", ["updates", "stream"])
async def test_a_wait_cancelled_while_its_consumer_is_made_still_deletes_it(wait: str) -> None:
    node, hosted, task = requester()
    ensured = asyncio.Event()
    never = asyncio.Event()
    deleted: list[Any] = []

    async def ensure(payload: Any) -> dict[str, Any]:
        ensured.set()  # the service made the consumer; its answer never comes in time
        await never.wait()
        raise AssertionError("unreachable")

    async def delete(payload: Any) -> dict[str, Any]:
        deleted.append(payload)
        return {"deleted": True}

    node.service_answers[subjects.consumers_ensure(node.node_id)] = ensure
    node.service_answers[subjects.consumers_delete(node.node_id)] = delete
    reader = task.updates(timeout=30.0) if wait == "updates" else task.stream(timeout=30.0)
    waiter = asyncio.ensure_future(anext(reader))
    await asyncio.wait_for(ensured.wait(), timeout=10.0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await eventually_async(lambda: deleted, what="the consumer's delete asked of the service")
    kind = "task_update" if wait == "updates" else "task_stream"
    assert deleted == [{"kind": kind, "task_id": "t1"}]
    assert hosted.counters["consumers.release_failed"] == 0


async def test_a_refused_ensure_asks_no_delete() -> None:
    node, hosted, task = requester()

    async def refuse(payload: Any) -> dict[str, Any]:
        raise ProtocolError("QUOTA_EXCEEDED", "too many consumers")

    node.service_answers[subjects.consumers_ensure(node.node_id)] = refuse
    with pytest.raises(ProtocolError):
        await anext(task.updates(timeout=30.0))
    assert [s for s, _, _ in node.service_calls] == [subjects.consumers_ensure(node.node_id)]
    assert hosted.active_tasks == 0
