"""A busy agent's broker buffer keeps room for mail sent during a gap.

Every live message is also stored in the agent's buffer, which refuses new mail
at its bound (discard-new), and only a drain pass purges the copies the live
path handled. With a pass only every ``drain_interval`` the buffer of an agent
busier than its bound per interval filled with handled copies, and mail sent
while the node was between connections found it full and was not kept (the
soak saw the echo agent's buffer at 100 %). Live mail reaching half the bound
since the last pass now runs a pass at once. Real nats-server, real node.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from meshnode.node.inbox import InboxStore
from meshnode.node.runtime import Node, NodeSettings
from meshnode.protocol import subjects
from meshnode.protocol.envelope import build_envelope, encode_envelope, sign_envelope
from meshnode.protocol.nkeys import KeyPair
from meshnode.testing import eventually_async
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.streams import ensure_inbox_stream

from .conftest import connect

pytestmark = pytest.mark.integration

BOUND = 20


async def test_live_mail_filling_half_the_buffer_runs_a_pass_that_makes_room(
    mesh: EmbeddedNatsServer, tmp_path: Path
) -> None:
    from meshnode_echo import EchoAgent

    node_key, agent, sender = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    jwt = mesh.mint_node_credential(node_key.public_key, [agent.public_key], 300, role="service")
    conn = await connect(mesh, node_key, jwt)
    store = InboxStore(tmp_path / "inbox.sqlite3")
    await store.open()
    try:
        await ensure_inbox_stream(conn.jetstream, agent.public_key, max_msgs=BOUND)
        # The periodic pass is an hour away: only the start-up pass and passes
        # the live mail asks for run here.
        node = Node(settings=NodeSettings(name="room", registry_timeout_s=0.2, drain_interval_s=3600),
                    node_key=node_key, connection=conn)
        node.inbox = store
        await node.host(name="echo", kind="echo", agent_class=EchoAgent, settings={}, key=agent)
        drain = node.drains["echo"]
        await eventually_async(lambda: drain.stats.passes >= 1 and not drain.stats.running,
                               what="the start-up pass (it learns the buffer's bound)")
        assert drain.stats.room_passes == 0

        subject = subjects.agent_inbox(agent.public_key)
        stream = subjects.inbox_stream_name(agent.public_key)

        async def send(count: int) -> None:
            for n in range(count):
                env = sign_envelope(build_envelope("request", sender.public_key, now_ms=time.time_ns() // 1_000_000,
                                                   to=agent.public_key, payload={"offering": "echo", "input": n}),
                                    sender)
                await conn.publish(subject, encode_envelope(env))
            await conn.flush()

        # Sustained traffic: three bounds' worth of live mail, each half bound
        # handled live. It asks for a pass, which purges the copies acked so far
        # (the last few may still be out: their handlers' marks are written each
        # write-behind tick), before the next half bound comes. With a pass only
        # every drain_interval the buffer is full after BOUND copies and refuses
        # the rest.
        hosted = node.agents["echo"]
        total, half = 3 * BOUND, BOUND // 2
        for sent in range(half, total + 1, half):
            await send(half)
            await eventually_async(lambda n=sent: hosted.counters["received"] >= n, what=f"{sent} handled live")
            await eventually_async(lambda n=sent: drain.stats.purged_through >= n - BOUND // 4,
                                   what=f"room made after {sent}", detail=drain.status)

        async def all_kept() -> bool:
            return (await conn.jetstream.stream_state(stream)).last_seq == total

        await eventually_async(all_kept, what="every copy stored", detail=lambda: (drain.status(), hosted.counters))
        assert drain.stats.room_passes >= 2, drain.status()
        assert drain.stats.purged_through >= BOUND, drain.status()
        state = await conn.jetstream.stream_state(stream)
        assert state.max_msgs == BOUND, state
        assert drain.status()["room_passes"] == drain.stats.room_passes
        await node.unhost("echo")
    finally:
        await store.close()
        await conn.close()
