"""§5.3 step 2 on the event intake as on requests (issue #17): an event from a
sender no node vouches for (or whose key was revoked) is refused silently and
counted (``event`` / ``sender_not_vouched``); an event from a vouched sender, from
the node's own agent or from a platform service's key reaches ``on_event``. The
platform's keys are learnt from the registry's (pinned, signed) registration reply."""

from __future__ import annotations

from typing import Any, cast

from meshnode.agent import Agent, AgentSettings, Context, Event
from meshnode.node.hosted import HostedAgent
from meshnode.node.pipeline import Intake, Path
from meshnode.node.runtime import Node, NodeSettings
from meshnode.protocol import subjects
from meshnode.protocol.attestations import make_vouch
from meshnode.protocol.envelope import (
    build_envelope,
    decode_envelope,
    encode_envelope,
    sign_envelope,
)
from meshnode.protocol.nkeys import KeyPair
from tests.fakes import FakeConnection

NOW = 1_800_000_000_000


class Listener(Agent):
    def __init__(self, name: str, settings: AgentSettings) -> None:
        super().__init__(name, settings)
        self.events: list[Event] = []

    async def on_event(self, ctx: Context, event: Event) -> None:
        self.events.append(event)


def _emit(sender: KeyPair) -> bytes:
    env = build_envelope("emit", sender.public_key, now_ms=NOW, payload={"domain": "d", "event_type": "e"})
    return encode_envelope(sign_envelope(env, sender))


def _registry(registry: KeyPair, payload_of: Any) -> Any:
    """A signed registry answer (or error) to the request in the bytes."""
    def answer(data: bytes) -> bytes:
        request = decode_envelope(data)
        payload, error = payload_of(request)
        env = build_envelope("respond", registry.public_key, now_ms=NOW, to=request["from"],
                             in_reply_to=request["id"], payload=payload)
        if error is not None:
            env["error"] = error
        return encode_envelope(sign_envelope(env, registry))
    return answer


def _node() -> tuple[Node, HostedAgent, FakeConnection, Listener]:
    conn = FakeConnection()
    node = Node(settings=NodeSettings(name="t"), node_key=KeyPair.generate(), connection=cast(Any, conn),
                clock=lambda: NOW, check_sender_vouch=True)
    key = KeyPair.generate()
    agent = Listener("listener", AgentSettings())
    hosted = HostedAgent(node, name="listener", kind="test", agent=agent, key=key,
                         guard=node.new_guard(key.public_key), interaction="service")
    node.agents["listener"] = hosted
    node.by_id[hosted.agent_id] = hosted
    return node, hosted, conn, agent


async def test_events_follow_the_same_vouch_rule_as_requests() -> None:
    node, hosted, conn, agent = _node()
    registry, host = KeyPair.generate(), KeyPair.generate()
    vouched, stranger, revoked, service = (KeyPair.generate() for _ in range(4))
    manifest = {"id": vouched.public_key, "node": {
        "id": host.public_key, "attestation": make_vouch(host, vouched.public_key, NOW - 1000, NOW + 3_600_000)}}

    looked_up: list[str] = []

    def get(key: KeyPair, request: dict[str, Any]) -> tuple[Any, Any]:
        looked_up.append(key.public_key)
        if key is vouched:
            return manifest, None
        if key is revoked:
            return {"status": "failed"}, {"code": "UNAUTHORIZED", "message": "revoked",
                                          "details": {"reason": "agent_key_revoked"}, "retryable": False}
        return {"status": "failed"}, {"code": "NOT_FOUND", "message": "no such agent", "retryable": False}

    for key in (vouched, stranger, revoked, service):
        conn.answers[subjects.registry_get(key.public_key)] = _registry(registry, lambda r, k=key: get(k, r))
    # A registration reply names the platform's keys; the node learns them from it.
    conn.answers[subjects.registry_register(node.node_id)] = _registry(
        registry, lambda r: ({"status": "registered", "platform_keys": [registry.public_key, service.public_key]}, None)
    )
    await node.register(hosted)
    assert hosted.registered and service.public_key in node.platform_keys

    assert await hosted.receive_event(_emit(vouched), subject="mesh.event.d.e", source=Path.LIVE)
    assert await hosted.receive_event(_emit(service), subject="mesh.event.d.e", source=Path.LIVE)
    assert not await hosted.receive_event(_emit(stranger), subject="mesh.event.d.e", source=Path.LIVE)
    assert not await hosted.receive_event(_emit(revoked), subject="mesh.event.d.e", source=Path.MAILBOX)
    assert [e.sender for e in agent.events] == [vouched.public_key, service.public_key]
    assert node.refusals.get(Intake.EVENT, "sender_not_vouched") == 1
    assert node.refusals.get(Intake.EVENT, "sender_key_revoked") == 1
    # The service key was never looked up: exempt, not merely vouched.
    assert service.public_key not in looked_up
    assert sorted(looked_up) == sorted(k.public_key for k in (vouched, stranger, revoked))


async def test_without_the_check_events_pass_as_before() -> None:
    node, hosted, _, agent = _node()
    node.trust = None  # [protections] check_sender_vouch = false
    assert await hosted.receive_event(_emit(KeyPair.generate()), subject="mesh.event.d.e", source=Path.LIVE)
    assert len(agent.events) == 1
