"""A sender whose vouch the registry is slow to confirm holds up only its own
request, not the agent's other live mail.

The live subscription hands over one message at a time. A §5.3 registry look-up
made inline for a sender not judged lately held every later message to the
agent until the look-up ended; the soak saw a 5 s stall when a reconnect lost
the registry's answer. Here a real nats-server, a real node hosting echo with
the vouch check on, and a stand-in registry that never answers for one sender:
another sender's request is answered while that look-up still waits.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from meshnode.node.runtime import Node, NodeSettings
from meshnode.protocol import subjects
from meshnode.protocol.envelope import build_envelope, encode_envelope, sign_envelope
from meshnode.protocol.nkeys import KeyPair
from meshnode.testing import eventually_async
from meshnode.transport.connection import MeshConnection, Message
from meshnode.transport.embedded import EmbeddedNatsServer

from .conftest import connect

pytestmark = pytest.mark.integration

#: Far longer than the test waits for the other sender's answer.
REGISTRY_TIMEOUT_S = 120.0


@pytest.fixture
async def echo_node(mesh: EmbeddedNatsServer, tmp_path: Path) -> AsyncIterator[tuple[Node, str]]:
    from meshnode_echo import EchoAgent

    node_key, agent = KeyPair.generate(), KeyPair.generate()
    conn = await connect(mesh, node_key, mesh.mint_node_credential(node_key.public_key, [agent.public_key], 300,
                                                                   role="service"))
    node = Node(settings=NodeSettings(name="b", registry_timeout_s=REGISTRY_TIMEOUT_S), node_key=node_key,
                connection=conn, check_sender_vouch=True)
    await node.host(name="echo", kind="echo", agent_class=EchoAgent, settings={}, key=agent)
    try:
        yield node, agent.public_key
    finally:
        await node.unhost("echo", grace=0.5)  # the slow look-up's task is cancelled, not waited for
        await conn.close(drain_timeout=1.0)  # a look-up held inline never finishes here


async def test_a_slow_vouch_look_up_holds_up_only_its_own_request(
    mesh: EmbeddedNatsServer, echo_node: tuple[Node, str]
) -> None:
    _node, echo = echo_node
    slow, quick = KeyPair.generate(), KeyPair.generate()
    client_key = KeyPair.generate()
    client: MeshConnection = await connect(mesh, client_key, mesh.mint_user("c", client_key.public_key, [">"], [">"], 300))
    asked: list[str] = []
    answers: dict[str, list[dict[str, Any]]] = {slow.public_key: [], quick.public_key: []}

    async def never_answer(msg: Message) -> None:
        asked.append(msg.subject)  # the registry of a mesh whose answer is lost

    async def answer_to(msg: Message) -> None:
        env = orjson.loads(msg.data)
        answers[env["to"]].append(env)

    try:
        # The quick sender's look-up finds no registry at all and is over at once
        # (the registry's absence lets the envelope pass, §5.3); the slow one's waits.
        await client.subscribe(subjects.registry_get(slow.public_key), never_answer)
        for sender in (slow, quick):
            await client.subscribe(subjects.agent_inbox(sender.public_key), answer_to)
        await client.flush()

        def send(sender: KeyPair, text: str) -> bytes:
            env = build_envelope("request", sender.public_key, now_ms=time.time_ns() // 1_000_000, to=echo,
                                 payload={"offering": "echo", "input": text})
            return encode_envelope(sign_envelope(env, sender))

        await client.publish(subjects.agent_inbox(echo), send(slow, "first"))
        await client.flush()
        await eventually_async(lambda: bool(asked), what="the slow sender's vouch look-up under way")
        await client.publish(subjects.agent_inbox(echo), send(quick, "second"))
        await client.flush()

        def quick_answered() -> bool:
            return any(a["payload"].get("status") == "completed" for a in answers[quick.public_key])

        await eventually_async(quick_answered, what="the other sender's answer while the look-up waits")
        assert not answers[slow.public_key], "the slow sender's request is still waiting for the registry"
        assert asked == [subjects.registry_get(slow.public_key)]
    finally:
        await client.close()


async def test_only_so_many_requests_wait_apart_and_then_the_subscription_waits_again(
    mesh: EmbeddedNatsServer, echo_node: tuple[Node, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flood of new keys must not turn into unbounded tasks and registry
    look-ups: past MAX_VOUCH_WAITS the look-up runs inline again, so the
    subscription itself waits (the backpressure it always was)."""
    from meshnode.node import pipeline

    monkeypatch.setattr(pipeline, "MAX_VOUCH_WAITS", 2)
    node, echo = echo_node
    hosted = node.agents["echo"]
    senders = [KeyPair.generate() for _ in range(4)]
    client_key = KeyPair.generate()
    client: MeshConnection = await connect(mesh, client_key, mesh.mint_user("c", client_key.public_key, [">"], [">"], 300))
    asked: list[str] = []

    async def never_answer(msg: Message) -> None:
        asked.append(msg.subject)

    try:
        for sender in senders:
            await client.subscribe(subjects.registry_get(sender.public_key), never_answer)
        await client.flush()
        for sender in senders:
            env = build_envelope("request", sender.public_key, now_ms=time.time_ns() // 1_000_000, to=echo,
                                 payload={"offering": "echo", "input": "x"})
            await client.publish(subjects.agent_inbox(echo), encode_envelope(sign_envelope(env, sender)))
        await client.flush()
        # Two wait apart; the third's look-up runs inline and holds the subscription,
        # so the fourth is not even judged yet.
        await eventually_async(lambda: len(asked) >= 3, what="three vouch look-ups under way")
        assert hosted.vouch_waits == 2
        # (In any order: the inline look-up goes out before the parked ones' tasks run.)
        assert sorted(asked) == sorted(subjects.registry_get(s.public_key) for s in senders[:3])
    finally:
        await client.close()
