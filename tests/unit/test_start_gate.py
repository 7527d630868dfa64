"""No handler runs before its agent's on_start returned: a request arriving while
the node starts an agent waits for the start to settle (at most
``max_concurrency`` of them), and one to an agent that did not start is
refused AGENT_UNAVAILABLE, retryable."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from meshnode.agent import Agent, AgentSettings, Context, offering
from meshnode.node.hosted import HostedAgent
from meshnode.node.pipeline import Path
from meshnode.node.runtime import Node, NodeSettings
from meshnode.node.states import AgentState
from meshnode.protocol import subjects
from meshnode.protocol.envelope import (
    build_envelope,
    decode_envelope,
    encode_envelope,
    new_root_trace,
    sign_envelope,
)
from meshnode.protocol.nkeys import KeyPair
from meshnode.testing import eventually_async
from tests.fakes import FakeConnection

NOW = 1_800_000_000_000
CALLER = KeyPair.generate()


class Loader(Agent):
    """Its handler needs what on_start loads."""

    def __init__(self, name: str, settings: AgentSettings) -> None:
        super().__init__(name, settings)
        self.model: str | None = None

    @offering("ask", framing=False)
    async def ask(self, ctx: Context, input: Any) -> Any:
        assert self.model is not None, "the handler ran before on_start returned"
        return {"model": self.model}


def _starting_agent(max_concurrency: int) -> tuple[HostedAgent, FakeConnection]:
    conn = FakeConnection()
    node = Node(settings=NodeSettings(name="t"), node_key=KeyPair.generate(), connection=cast(Any, conn),
                clock=lambda: NOW, check_sender_vouch=False)
    key = KeyPair.generate()
    hosted = HostedAgent(node, name="loader", kind="test", agent=Loader("loader", AgentSettings()), key=key,
                         guard=node.new_guard(key.public_key), interaction="service", max_concurrency=max_concurrency)
    hosted.start_settled = asyncio.Event()  # as Node.host does while on_start runs
    node.agents["loader"], node.by_id[hosted.agent_id] = hosted, hosted
    return hosted, conn


def _request(hosted: HostedAgent) -> tuple[str, bytes]:
    """A signed request to ``hosted``: its id and its bytes."""
    env = build_envelope("request", CALLER.public_key, to=hosted.agent_id, payload={"offering": "ask", "input": {}},
                         trace=new_root_trace(), now_ms=NOW)
    return str(env["id"]), encode_envelope(sign_envelope(env, CALLER))


def _answers(conn: FakeConnection) -> dict[str, dict[str, Any]]:
    """The substantive responds sent to the caller, by the request they answer."""
    inbox = subjects.agent_inbox(CALLER.public_key)
    found = [decode_envelope(data) for subject, data in conn.published if subject == inbox]
    return {env["in_reply_to"]: env for env in found if env["payload"].get("status") != "accepted"}


async def test_a_request_during_the_start_waits_and_runs_after_on_start() -> None:
    hosted, conn = _starting_agent(max_concurrency=1)
    (r1, first_bytes), (r2, second_bytes) = _request(hosted), _request(hosted)
    first = asyncio.create_task(hosted.receive(first_bytes, source=Path.LIVE))
    await eventually_async(lambda: hosted.status(None, [])["waiting_for_start"] == 1, what="r1 held")
    # One more than max_concurrency is not held: refused at once, retryable.
    assert await hosted.receive(second_bytes, source=Path.LIVE) == "answered"
    refused = _answers(conn)[r2]
    assert refused["payload"]["status"] == "failed" and refused["error"]["code"] == "AGENT_UNAVAILABLE"
    assert refused["error"]["details"] == {"reason": "starting"}
    assert r1 not in _answers(conn)
    # on_start returns: the held request runs.
    cast(Loader, hosted.agent).model = "loaded"
    hosted.state = AgentState.RUNNING
    assert hosted.start_settled is not None
    hosted.start_settled.set()
    await first
    await eventually_async(lambda: r1 in _answers(conn), what="r1 answered")
    assert _answers(conn)[r1]["payload"] == {"status": "completed", "output": {"model": "loaded"}}
    assert hosted.status(None, [])["waiting_for_start"] == 0


async def test_a_request_to_an_agent_that_did_not_start_is_refused() -> None:
    hosted, conn = _starting_agent(max_concurrency=4)
    (r1, first_bytes), (r2, second_bytes) = _request(hosted), _request(hosted)
    held = asyncio.create_task(hosted.receive(first_bytes, source=Path.LIVE))
    await eventually_async(lambda: hosted.status(None, [])["waiting_for_start"] == 1, what="r1 held")
    hosted.state = AgentState.FAILED  # on_start raised
    assert hosted.start_settled is not None
    hosted.start_settled.set()
    await held
    await hosted.receive(second_bytes, source=Path.LIVE)  # one arriving after
    for rid in (r1, r2):
        answer = _answers(conn)[rid]
        assert answer["payload"]["status"] == "failed" and answer["error"]["code"] == "AGENT_UNAVAILABLE", answer
        assert answer["error"]["details"] == {"reason": "not_started", "state": "failed"}
