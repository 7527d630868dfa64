"""The one inbound pipeline (meshnode.node.pipeline): every intake refuses a forged
envelope, and counts it the same way — the node's one refusal counter, labelled
by intake and rule. Also the checks the service intake gained (addressing, hops,
size) and the first-reply plan the request path follows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from meshnode.agent import Agent, AgentSettings, Context, Event, offering
from meshnode.node.hosted import HostedAgent
from meshnode.node.metrics import prometheus_text
from meshnode.node.pipeline import Intake, Path, RefusalCounter, Refused, first_reply, guard
from meshnode.node.runtime import Node, NodeSettings
from meshnode.node.tasks import RequesterTask
from meshnode.protocol import subjects
from meshnode.protocol.accept import FirstReply, InboundOutcome
from meshnode.protocol.envelope import (
    build_envelope,
    decode_envelope,
    encode_envelope,
    sign_envelope,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.protections import InboundGuard
from meshnode.services.base import ServiceBase, ServiceContext
from meshnode.transport.connection import Message
from tests.fakes import FakeConnection, FakeMsg

NOW = 1_800_000_000_000
OWNER = KeyPair.generate()
FORGER = KeyPair.generate()


class Listener(Agent):
    def __init__(self, name: str, settings: AgentSettings) -> None:
        super().__init__(name, settings)
        self.events: list[Event] = []

    @offering("work")
    async def work(self, ctx: Context, input: Any) -> Any:
        return {"ok": True}

    async def on_event(self, ctx: Context, event: Event) -> None:
        self.events.append(event)


def forged(kind: str, **kw: Any) -> bytes:
    """Signed by the forger, claiming to be from OWNER: the signature does not verify."""
    env = sign_envelope(build_envelope(kind, FORGER.public_key, now_ms=NOW, **kw), FORGER)
    env["from"] = OWNER.public_key
    return encode_envelope(env)


def node_with_agent() -> tuple[Node, HostedAgent, FakeConnection]:
    conn = FakeConnection()
    node = Node(settings=NodeSettings(name="t"), node_key=KeyPair.generate(),
                connection=cast(Any, conn), clock=lambda: NOW)
    key = KeyPair.generate()
    hosted = HostedAgent(node, name="listener", kind="test", agent=Listener("listener", AgentSettings()), key=key,
                         guard=node.new_guard(key.public_key), interaction="service")
    node.agents["listener"] = hosted
    node.by_id[hosted.agent_id] = hosted
    return node, hosted, conn


class Service(ServiceBase):
    pass


def service(refusals: RefusalCounter, **kw: Any) -> tuple[Service, FakeConnection]:
    conn = FakeConnection()
    ctx = ServiceContext(connection=cast(Any, conn), key=KeyPair.generate(), node_id="N",
                         now_ms=lambda: NOW, refusals=refusals, **kw)
    return Service(ctx, name="svc", queue="q"), conn


def msg(subject: str, data: bytes, reply: str = "") -> Message:
    return cast(Message, FakeMsg(subject, data, reply))


def test_a_forged_signature_is_refused_as_identity_mismatch() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_envelope(forged("emit", payload={}))
    assert info.value.code == "IDENTITY_MISMATCH"


async def test_every_intake_refuses_a_forged_envelope_through_the_same_counter() -> None:
    node, hosted, conn = node_with_agent()
    rule = "identity_mismatch"
    feed_subject = subjects.feed_subject(OWNER.public_key, "status")

    # Requests and responds: the inbox intake.
    assert await hosted.receive(forged("request", to=hosted.agent_id, payload={"offering": "work"}),
                                source=Path.LIVE) == "refused"
    assert await hosted.receive(forged("respond", to=hosted.agent_id, in_reply_to="r1",
                                       payload={"status": "completed"}), source="local") == "refused"
    # Events, feeds, telemetry.
    assert not await hosted.receive_event(forged("emit", payload={"domain": "d", "event_type": "e"}),
                                          subject="mesh.event.d.e", source=Path.MAILBOX)
    assert not await node.pubsub.receive_feed(
        hosted, forged("emit", payload={"topic": "status", "kind": "stream", "data": 1}),
        subject=feed_subject, source=Path.LIVE)
    assert not await node.pubsub.receive_telemetry(hosted, forged("emit", payload={"domain": "trace"}),
                                                   f"mesh.trace.{OWNER.public_key}")
    # A platform service's request intake, sharing the node's counter (as the daemon wires it).
    svc, svc_conn = service(node.refusals)
    assert svc.accept(msg("mesh.registry.get.x", forged("discover", payload={}), "_INBOX.r")) is None
    # A service's reply to this node.
    conn.answers["mesh.registry.get.x"] = lambda request: forged(
        "respond", to=hosted.agent_id, in_reply_to=decode_envelope(request)["id"], payload={})
    with pytest.raises(ProtocolError) as info:
        await node.service_call(hosted, "mesh.registry.get.x", "discover", {})
    assert info.value.code == "IDENTITY_MISMATCH"
    # The updates of a Task this agent asked for.
    opening = sign_envelope(build_envelope("respond", OWNER.public_key, now_ms=NOW, to=hosted.agent_id,
                                           in_reply_to="r1", task_id="t1", payload={"status": "working"}), OWNER)
    task = RequesterTask(hosted, opening)
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    await queue.put(forged("respond", to=hosted.agent_id, task_id="t1", payload={"status": "completed"}))

    async def replay(subject: str, kind: str) -> tuple[asyncio.Queue[bytes], Any]:
        return queue, None

    async def release(sub: Any, subject: str, kind: str) -> None:
        pass

    task._replay = replay  # type: ignore[method-assign]
    task._release = release  # type: ignore[method-assign]
    updates: AsyncIterator[Any] = task.updates(timeout=0.05)
    with pytest.raises(TimeoutError):  # the forged "completed" is not an update: nothing ends the wait
        await anext(updates)
    # A stream chunk claiming to be the opener's, with a signature that does not verify.
    await queue.put(forged("emit", task_id="t1", payload={"chunk_index": 0, "data": "x", "final": True}))
    chunks: AsyncIterator[Any] = task.stream(timeout=0.05)
    with pytest.raises(TimeoutError):  # dropped, not fatal: the stream waits on for the opener's chunks
        await anext(chunks)

    assert node.refusals.by_label() == {
        ("inbox", rule): 2,
        ("event", rule): 1,
        ("feed", rule): 1,
        ("telemetry", rule): 1,
        ("service", rule): 1,
        ("service_reply", rule): 1,
        ("task_update", rule): 1,
        ("task_stream", rule): 1,
    }
    assert {intake.value for intake in Intake} == {label[0] for label in node.refusals.by_label()}
    # Nothing was answered, nothing reached a handler (§22.7: an unauthenticated sender learns nothing).
    assert conn.published == [] and svc_conn.published == []
    assert isinstance(hosted.agent, Listener) and hosted.agent.events == []
    # The agent's own signals are still raised, named as before.
    assert hosted.counters["refused.identity_mismatch"] == 2
    assert hosted.counters["refused.event.identity_mismatch"] == 1
    assert hosted.counters["refused.feed.identity_mismatch"] == 1
    assert hosted.counters["refused.telemetry.identity_mismatch"] == 1
    # And the node's metrics show the one counter.
    text = prometheus_text([], node.counters, node.refusals.by_label())
    assert 'meshnode_inbound_refused_total{intake="service_reply",rule="identity_mismatch"} 1' in text
    assert node.refusals.as_dict()["inbox"] == {rule: 2}


def request(sender: KeyPair, **kw: Any) -> dict[str, Any]:
    return sign_envelope(build_envelope("discover", sender.public_key, now_ms=NOW, payload=kw.pop("payload", {}),
                                        **kw), sender)


async def test_the_service_intake_checks_addressing_hops_and_size() -> None:
    refusals = RefusalCounter()
    svc, conn = service(refusals, max_inbound_chars=100)
    answered: list[dict[str, Any]] = []

    async def operation(m: Message, env: dict[str, Any]) -> dict[str, Any]:
        answered.append(env)
        return {"ok": True}

    await svc.serve("mesh.svc.op", operation)
    handle = conn.subscriptions["mesh.svc.op"]
    sender = KeyPair.generate()
    ok = request(sender)
    misaddressed = request(sender, to=KeyPair.generate().public_key)
    too_many_hops = request(sender, meta={"hops": 4})
    oversize = request(sender, payload={"text": "x" * 101})
    for env in (ok, ok, misaddressed, too_many_hops, oversize):
        await handle(msg("mesh.svc.op", encode_envelope(env), "_INBOX.r"))

    assert [env["id"] for env in answered] == [ok["id"]]
    assert refusals.as_dict() == {"service": {
        "inbound_duplicate": 1, "inbound_misaddressed": 1, "inbound_hops_exceeded": 1, "inbound_oversize": 1}}
    # Silent refusals answer nothing; the size cap answers CONTEXT_TOO_LARGE (§22.7).
    assert conn.responds_to(misaddressed["id"]) == [] and conn.responds_to(too_many_hops["id"]) == []
    (refusal,) = conn.responds_to(oversize["id"])
    assert refusal["error"]["code"] == "CONTEXT_TOO_LARGE" and refusal["payload"] == {"status": "failed"}
    assert len(conn.responds_to(ok["id"])) == 1


def test_the_service_size_cap_defaults_to_what_the_transport_carries() -> None:
    svc, _ = service(RefusalCounter())
    big = request(KeyPair.generate(), payload={"data": "x" * 200_000})
    assert svc.accept(msg("mesh.svc.op", encode_envelope(big))) is not None
    svc2, conn2 = service(RefusalCounter())
    conn2.max_payload = 100_000
    with pytest.raises(Refused) as info:
        svc2.intake(msg("mesh.svc.op", encode_envelope(big)))
    assert info.value.rule == "inbound_oversize" and info.value.answer is not None


def test_the_first_reply_follows_the_pure_rule_on_every_path() -> None:
    admitted = InboundOutcome.ADMITTED
    assert first_reply(Path.LIVE, admitted).accept and first_reply(Path.LOCAL, admitted).accept
    assert first_reply(Path.MAILBOX, admitted).first_reply is FirstReply.SUBSTANTIVE
    for path in Path:
        assert first_reply(path, admitted, attended=True).first_reply is FirstReply.QUEUED_ACK
        assert not first_reply(path, InboundOutcome.SILENT_REFUSAL).accept


def test_the_guard_stage_refuses_with_the_rule_and_the_answer() -> None:
    me = KeyPair.generate().public_key
    sender = KeyPair.generate()
    g = InboundGuard(me, max_inbound_chars=10)
    env = sign_envelope(build_envelope("request", sender.public_key, now_ms=NOW, to=me,
                                       payload={"offering": "o", "input": "x" * 11}), sender)
    with pytest.raises(Refused) as info:
        guard(g, env, Path.LOCAL, NOW)
    assert info.value.rule == "inbound_oversize" and info.value.answer is not None
    assert info.value.answer["code"] == "CONTEXT_TOO_LARGE"
    with pytest.raises(Refused) as again:
        guard(g, env, Path.LIVE, NOW)
    assert again.value.rule == "inbound_duplicate" and again.value.answer is None


async def test_the_remembered_pairs_are_read_once_for_every_delivery_waiting() -> None:
    """A busy agent's first delivery after a restart reads the pairs its inbox
    remembers (§22.2), off the event loop (InboxStore.read_seen). Deliveries
    that come meanwhile wait for the same read, and the memory is filled
    before any of them is checked. A failed read fails the deliveries waiting
    for it and is tried again at the next."""
    _, hosted, _ = node_with_agent()
    started, release = asyncio.Event(), asyncio.Event()
    reads: list[int] = []
    fail = [True]

    async def read() -> list[tuple[str, str]]:
        reads.append(1)
        started.set()
        await release.wait()
        if fail[0]:
            fail[0] = False
            raise OSError("disk went away")
        return [("USENDER", "m1"), ("USENDER", "m2")]

    hosted.remembered = read
    first = asyncio.ensure_future(hosted.load_remembered())
    second = asyncio.ensure_future(hosted.load_remembered())
    await asyncio.wait_for(started.wait(), 30)
    assert not first.done() and not second.done()
    release.set()
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert [type(r) for r in results] == [OSError, OSError] and reads == [1]
    assert hosted.remembered is read  # not read: the next delivery tries again
    await asyncio.gather(hosted.load_remembered(), hosted.load_remembered())
    assert reads == [1, 1] and hosted.remembered is None
    assert ("USENDER", "m1") in hosted.guard.memory and ("USENDER", "m2") in hosted.guard.memory
    await hosted.load_remembered()  # read once: nothing more
    assert reads == [1, 1]
