"""Reading the node's own credential (issue #17): reply prefix and registration subject;
and the embedded mesh's WebSocket listener.

meshnode's own credentials grant the private ``_INBOX_<node>.>`` and only the
connection-bound register subject, and must keep doing so; a credential minted
as in spec §14.3's example grants ``_INBOX.>`` and both register forms.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any, cast

import pytest

from meshnode.agent import Agent, AgentSettings
from meshnode.config.sections import EmbeddedMeshConfig, MeshConfig
from meshnode.node.hosted import HostedAgent
from meshnode.node.resolver import NOT_GRANTED, ManifestCache
from meshnode.node.runtime import Node
from meshnode.node.settings import NodeSettings
from meshnode.node.tasks import RequesterTask
from meshnode.node.trust import UNKNOWN, VOUCHED, VouchMemo
from meshnode.protocol import subjects
from meshnode.protocol.attestations import make_vouch
from meshnode.protocol.envelope import (
    build_envelope,
    decode_envelope,
    encode_envelope,
    sign_envelope,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.transport.errors import NoResponders, TransportTimeout
from meshnode.transport.grants import (
    Grants,
    PatternSet,
    check_inbox_prefix,
    choose_inbox_prefix,
    covers,
    register_subjects,
)
from meshnode.transport.jwt import decode_jwt, mint_user_jwt
from meshnode.transport.permissions import (
    JS_STREAM_INFO,
    REGISTER_UNBOUND,
    node_inbox_prefix,
    node_permissions,
)
from meshnode.transport.serverconf import TlsFiles, render_server_config
from tests.fakes import FakeConnection, FakeMsg, FakeNode

NOW = 1_800_000_000_000


def _claims(pub: list[str], sub: list[str], *, pub_deny: tuple[str, ...] = ()) -> dict[str, Any]:
    account = KeyPair.generate(Prefix.ACCOUNT)
    user = KeyPair.generate().public_key
    jwt = mint_user_jwt(
        account, user, name="n", issued_at=1, expires_at=10**10, pub_allow=pub, sub_allow=sub, pub_deny=pub_deny
    )
    return decode_jwt(jwt)[1]


def _example(node: str, agent: str) -> Grants:
    """Spec §14.3's example permissions, verbatim."""
    return Grants.from_claims(_claims(
        [
            "mesh.registry.register", f"mesh.registry.register.{node}", "mesh.registry.discover",
            "mesh.presence.get", "mesh.event.scraping.>", f"mesh.heartbeat.{node}",
            "mesh.task.*.update", "mesh.task.*.stream",
        ],
        [f"mesh.agent.{agent}.inbox", "mesh.event.registry.>", "mesh.task.*.update", "mesh.task.*.stream", "_INBOX.>"],
    ))


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("_INBOX.>", "_INBOX.>", True),
        ("_INBOX.>", "_INBOX.abc.1", True),
        (">", "_INBOX_U1.>", True),
        ("_INBOX.*", "_INBOX.>", False),
        ("_INBOX.>", "_INBOX", False),
        ("mesh.registry.register", "mesh.registry.register.UABC", False),
        ("mesh.registry.register.*", "mesh.registry.register.UABC", True),
        ("mesh.agent.*.inbox", "mesh.agent.*.inbox", True),
        ("mesh.agent.UA.inbox", "mesh.agent.*.inbox", False),
        ("$JS.API.CONSUMER.*.S.>", "$JS.API.CONSUMER.INFO.S.c", True),
    ],
)
def test_covers_is_subset_matching(pattern: str, subject: str, expected: bool) -> None:
    assert covers(pattern, subject) is expected


def test_a_pattern_set_answers_exactly_as_covers_does() -> None:
    # The indexed set (issue #21: one check per hosted agent, many grants per
    # agent) must say what trying every pattern with covers() says, for every
    # combination of literal, "*" and ">" tokens on either side.
    tokens = ("a", "b", "*", ">")
    shapes = [".".join(t) for n in (1, 2, 3) for t in itertools.product(tokens, repeat=n)]
    shapes = [s for s in shapes if ">" not in s[:-1]]  # ">" only last, as NATS allows
    for i, pattern in enumerate(shapes):
        group = (pattern, shapes[(i * 7) % len(shapes)], shapes[(i * 13) % len(shapes)])
        indexed = PatternSet(group)
        for subject in shapes:
            assert indexed.covers(subject) is any(covers(p, subject) for p in group), (group, subject)
    assert not PatternSet(()).covers("a")


def test_many_agents_grants_are_checked_without_scanning_them() -> None:
    node = KeyPair.generate().public_key
    agents = [KeyPair.generate().public_key for _ in range(300)]
    perms = node_permissions(node, agents, role="participant")
    grants = Grants.from_claims(_claims(perms.pub_allow, perms.sub_allow))
    for agent in agents[::37]:
        assert grants.can_publish(JS_STREAM_INFO.format(stream=subjects.inbox_stream_name(agent)))
    stranger = KeyPair.generate().public_key
    assert not grants.can_publish(JS_STREAM_INFO.format(stream=subjects.inbox_stream_name(stranger)))


def test_meshnodes_own_credentials_keep_the_private_prefix_and_the_bound_subject() -> None:
    node, agent = KeyPair.generate().public_key, KeyPair.generate().public_key
    for role in ("participant", "service"):
        perms = node_permissions(node, [agent], role=role)
        grants = Grants.from_claims(_claims(perms.pub_allow, perms.sub_allow))
        choice = choose_inbox_prefix(grants, node)
        assert (choice.prefix, choice.source) == (node_inbox_prefix(node), "private")
        bound = subjects.registry_register(node)
        # The bound form first (the untokenized one is granted too, so that the
        # registry can answer UNAUTHORIZED: see test_a_timeout_is_not_retried_untokenized).
        assert list(register_subjects(grants, bound))[0] == bound
        # Everything the node asks of the platform stays granted (no fast-fail on its own mesh).
        for subject in (subjects.registry_get(agent), subjects.REGISTRY_DISCOVER, "mesh.registry.deregister",
                        "mesh.presence.get", JS_STREAM_INFO.format(stream=subjects.inbox_stream_name(agent)),
                        JS_STREAM_INFO.format(stream=subjects.MESH_EVENTS)):
            assert grants.can_publish(subject), (role, subject)
        assert not grants.can_subscribe("_INBOX.>")


def test_the_spec_example_gives_the_shared_prefix_and_both_register_forms() -> None:
    node, agent = KeyPair.generate().public_key, KeyPair.generate().public_key
    grants = _example(node, agent)
    choice = choose_inbox_prefix(grants, node)
    assert (choice.prefix, choice.source) == ("_INBOX", "shared")
    bound = subjects.registry_register(node)
    assert list(register_subjects(grants, bound)) == [bound, REGISTER_UNBOUND]
    assert not grants.can_publish(subjects.registry_get(agent))
    assert not grants.can_publish(JS_STREAM_INFO.format(stream=subjects.inbox_stream_name(agent)))


def test_only_the_granted_register_form_is_used_and_neither_keeps_the_bound_one() -> None:
    node = KeyPair.generate().public_key
    bound = subjects.registry_register(node)
    unbound_only = Grants.from_claims(_claims([REGISTER_UNBOUND], ["_INBOX.>"]))
    assert list(register_subjects(unbound_only, bound)) == [REGISTER_UNBOUND]
    neither = Grants.from_claims(_claims(["mesh.registry.discover"], ["_INBOX.>"]))
    assert list(register_subjects(neither, bound)) == [bound]


def test_a_deny_wins_over_an_allow() -> None:
    node = KeyPair.generate().public_key
    grants = Grants.from_claims(_claims([">"], [">"], pub_deny=("mesh.registry.register",)))
    assert list(register_subjects(grants, subjects.registry_register(node))) == [subjects.registry_register(node)]


def test_another_granted_prefix_a_configured_one_and_none() -> None:
    node = KeyPair.generate().public_key
    other = Grants.from_claims(_claims(["mesh.>"], ["mesh.agent.*.inbox", "_R_acme.replies.>"]))
    assert (choose_inbox_prefix(other, node).prefix, choose_inbox_prefix(other, node).source) == (
        "_R_acme.replies", "granted",
    )
    assert choose_inbox_prefix(other, node, "_MINE").source == "configured"
    none = Grants.from_claims(_claims(["mesh.>"], ["mesh.agent.*.inbox"]))
    assert choose_inbox_prefix(none, node).source == "ungranted"
    assert choose_inbox_prefix(Grants.unrestricted(), node).source == "private"
    with pytest.raises(ValueError, match="inbox prefix"):
        check_inbox_prefix("_INBOX.>")


def test_no_permission_block_allows_everything() -> None:
    grants = Grants.from_claims({"nats": {"type": "user"}})
    assert grants.can_publish("anything.at.all") and grants.can_subscribe("_INBOX.>")


# --------------------------------------------------------------------------- registration fallback


def _node(grants: Grants, node_key: KeyPair | None = None) -> tuple[Node, HostedAgent, FakeConnection]:
    conn = FakeConnection()
    node = Node(settings=NodeSettings(name="t"), node_key=node_key or KeyPair.generate(),
                connection=cast(Any, conn), clock=lambda: NOW, grants=grants)
    key = KeyPair.generate()
    hosted = cast(HostedAgent, type("H", (), {"agent_id": key.public_key, "key": key, "name": "a",
                                              "manifest": {"id": key.public_key}, "registered": False,
                                              "registration_error": None})())
    return node, hosted, conn


def _registry_answer(registry: KeyPair) -> Callable[[bytes], bytes]:
    def answer(data: bytes) -> bytes:
        request = decode_envelope(data)
        env = build_envelope("respond", registry.public_key, now_ms=NOW, to=request["from"],
                             in_reply_to=request["id"], payload={"status": "registered"})
        sign_envelope(env, registry)
        return encode_envelope(env)
    return answer


def _no_responders(data: bytes) -> bytes:
    raise NoResponders("no responders")


async def test_a_bound_registration_nobody_answers_falls_back_once_and_sticks() -> None:
    registry = KeyPair.generate()
    grants = Grants.from_claims(_claims(["mesh.registry.register", "mesh.registry.register.*"], ["_INBOX.>"]))
    node, hosted, conn = _node(grants)
    bound = subjects.registry_register(node.node_id)
    tried: list[str] = []

    def bound_answer(data: bytes) -> bytes:
        tried.append(bound)
        return _no_responders(data)

    conn.answers[bound] = bound_answer
    conn.answers[REGISTER_UNBOUND] = _registry_answer(registry)
    await node.register(hosted)
    assert hosted.registered and tried == [bound]
    await node.register(hosted)  # the subject that worked is kept: no second bound attempt
    assert hosted.registered and tried == [bound]


async def test_a_timeout_or_a_refusal_is_not_retried_untokenized() -> None:
    node_key = KeyPair.generate()
    perms = node_permissions(node_key.public_key, [])
    node, hosted, conn = _node(Grants.from_claims(_claims(perms.pub_allow, perms.sub_allow)), node_key)
    tried: list[str] = []

    def timeout(data: bytes) -> bytes:
        tried.append("bound")
        raise TransportTimeout("nats: timeout")

    def untokenized(data: bytes) -> bytes:
        tried.append("untokenized")
        return _registry_answer(KeyPair.generate())(data)

    conn.answers[subjects.registry_register(node.node_id)] = timeout
    conn.answers[REGISTER_UNBOUND] = untokenized
    await node.register(hosted)
    assert not hosted.registered and tried == ["bound"]
    assert hosted.registration_error is not None and hosted.registration_error.startswith("TRANSPORT_TIMEOUT")


async def test_an_answer_lost_to_a_reconnect_is_asked_for_again_once_for_reads_and_registrations() -> None:
    # A planned reconnect (a roster change) can fall inside a service call; the
    # answer sent while the connection was down is gone (the soak saw a vouch
    # look-up time out). Registrations and reads are asked for again, as a new
    # envelope; a request that may not run twice is not.
    node, hosted, conn = _node(Grants.unrestricted())
    registry = KeyPair.generate()
    sent: list[str] = []

    def lost_once(data: bytes) -> bytes:
        sent.append(decode_envelope(data)["id"])
        if len(sent) == 1:
            conn.disconnects += 1  # the connection dropped while the answer was on its way
            raise TransportTimeout("nats: timeout")
        return _registry_answer(registry)(data)

    conn.answers[subjects.registry_register(node.node_id)] = lost_once
    await node.register(hosted)
    assert hosted.registered and len(sent) == 2 and sent[0] != sent[1]

    sent.clear()

    def timeout_without_a_reconnect(data: bytes) -> bytes:
        sent.append(decode_envelope(data)["id"])
        raise TransportTimeout("nats: timeout")

    conn.answers[subjects.registry_register(node.node_id)] = timeout_without_a_reconnect
    await node.register(hosted)
    assert not hosted.registered and len(sent) == 1, "a plain timeout is the registry's, not the connection's"

    sent.clear()
    conn.answers["mesh.task.create"] = lost_once
    with pytest.raises(ProtocolError, match="TRANSPORT_TIMEOUT"):
        await node.service_call(hosted, "mesh.task.create", "request", {"task": "once"})
    assert len(sent) == 1, "a request that may not run twice is not sent again"


async def test_registration_refusals_log_once_per_reason_then_a_digest(caplog: pytest.LogCaptureFixture) -> None:
    """A registry that times out for many agents at once (a fleet restarting)
    makes one line at once and a digest later, not a line per agent; a refusal
    for another reason is still logged at once."""
    caplog.set_level(logging.INFO, logger="meshnode.node")
    node, _hosted, conn = _node(Grants.unrestricted())

    def timeout(data: bytes) -> bytes:
        raise TransportTimeout("nats: timeout")

    conn.answers[subjects.registry_register(node.node_id)] = timeout
    agents = [_node(Grants.unrestricted())[1] for _ in range(50)]
    for hosted in agents:
        await node.register(hosted)
    assert all(not h.registered and str(h.registration_error).startswith("TRANSPORT_TIMEOUT") for h in agents)
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelno == logging.ERROR
    assert agents[0].agent_id in refusals[0].getMessage()

    def refused_invalid(data: bytes) -> bytes:
        raise ProtocolError("INVALID_MANIFEST", "the manifest names no offering")

    conn.answers[subjects.registry_register(node.node_id)] = refused_invalid
    other = _node(Grants.unrestricted())[1]
    await node.register(other)
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 2 and "INVALID_MANIFEST" in refusals[1].getMessage()

    # The 30 s window ends (run here rather than waited for): its digest line follows.
    timeouts = node._refusals["TRANSPORT_TIMEOUT"]
    assert timeouts._window is not None
    timeouts._window.cancel()
    timeouts._close_window()
    digest = [r.getMessage() for r in caplog.records if "more registrations (TRANSPORT_TIMEOUT)" in r.getMessage()]
    assert digest and digest[0].startswith("49 more registrations (TRANSPORT_TIMEOUT) refused")


async def test_a_failed_registration_is_retried_soon_then_backing_off() -> None:
    # Issue #21: a start of thousands of agents can time a registration out in
    # the registry's queue; the retry comes after seconds, not a flat minute.
    node, hosted, _ = _node(Grants.unrestricted())
    hosted.vouch = node._vouch(hosted.agent_id)
    node._schedule_vouch_renewal(hosted)
    job = node._jobs[f"vouch:{hosted.name}"]
    try:
        # The first wait is the job's first delay; then the job re-reads the interval after each run.
        delays = [job._first_delay or 0.0, *(job._next_interval() for _ in range(5))]
        for delay, (low, high) in zip(delays, [(5, 7.5), (10, 15), (20, 30), (40, 60), (60, 60), (60, 60)], strict=True):
            assert low <= delay <= high, delays
        hosted.registered = True
        assert job._next_interval() == 600.0  # registered: the renewal point, woken every 10 minutes
        hosted.registered = False
        assert 5 <= job._next_interval() <= 7.5  # a new failure starts again at 5 s
    finally:
        await job.stop()


async def test_a_service_subject_the_credential_does_not_grant_fails_at_once() -> None:
    node_key = KeyPair.generate()
    node, hosted, conn = _node(_example(node_key.public_key, node_key.public_key))
    with pytest.raises(ProtocolError) as raised:
        await node.service_call(hosted, subjects.registry_get(hosted.agent_id), "discover", {})
    assert raised.value.code == "AGENT_UNAVAILABLE" and raised.value.details["reason"] == NOT_GRANTED
    assert conn.published == []


# --------------------------------------------------------------------------- lookups through discovery


async def test_without_registry_get_targets_and_senders_are_looked_up_through_discovery() -> None:
    node = FakeNode(now_ms=NOW)
    host, agent = KeyPair.generate(), KeyPair.generate()
    vouch = make_vouch(host, agent.public_key, NOW - 1000, NOW + 3_600_000)
    manifest = {"id": agent.public_key, "node": {"id": host.public_key, "attestation": vouch}}
    hidden = KeyPair.generate().public_key

    async def refuse(payload: Any) -> dict[str, Any]:
        raise ProtocolError("AGENT_UNAVAILABLE", "not granted", {"reason": NOT_GRANTED})

    async def discover(payload: Any) -> dict[str, Any]:
        return {"agents": [manifest] if agent.public_key in payload["agent_ids"] else [], "total": 1}

    node.service_answers[subjects.registry_get(agent.public_key)] = refuse
    node.service_answers[subjects.registry_get(hidden)] = refuse
    node.service_answers[subjects.REGISTRY_DISCOVER] = discover
    assert (await ManifestCache(node.as_port()).resolve(cast(Any, None), agent.public_key))["id"] == agent.public_key
    with pytest.raises(ProtocolError) as raised:
        await ManifestCache(node.as_port()).resolve(cast(Any, None), hidden)
    assert raised.value.code == "NOT_FOUND"
    memo = VouchMemo(node.as_port())
    assert await memo.status(cast(Any, None), agent.public_key) == VOUCHED
    # Discovery does not show unlisted agents: not seen is unknown (let through), not unvouched.
    assert await memo.status(cast(Any, None), hidden) == UNKNOWN


# --------------------------------------------------------------------------- the WebSocket listener


def test_the_websocket_listener_is_off_by_default_and_plain_ws_on_the_mesh_host(tmp_path: Any) -> None:
    def render(websocket_port: int | None) -> str:
        return render_server_config(
            server_name="x", host="127.0.0.1", port=None, monitor_port=None, max_payload=1024,
            max_control_line=1024, operator_jwt="op", system_account="SYS", account_jwts={},
            store_dir=tmp_path, ports_file_dir=tmp_path, websocket_port=websocket_port,
        )

    assert "websocket {" not in render(None)
    any_port = render(0)
    assert 'websocket {\n  host: "127.0.0.1"\n  port: -1\n  no_tls: true\n}' in any_port
    assert "  port: 8443\n" in render(8443)
    secure = render_server_config(
        server_name="x", host="127.0.0.1", port=None, monitor_port=None, max_payload=1024,
        max_control_line=1024, operator_jwt="op", system_account="SYS", account_jwts={},
        store_dir=tmp_path, ports_file_dir=tmp_path, websocket_port=0,
        tls=TlsFiles(tmp_path / "c.pem", tmp_path / "k.pem"),
    )
    websocket = secure[secure.index("websocket {"):]
    assert "no_tls" not in websocket and f'cert_file: "{tmp_path / "c.pem"}"' in websocket
    assert EmbeddedMeshConfig().websocket_port is None
    assert EmbeddedMeshConfig(websocket_port=0).websocket_port == 0
    assert MeshConfig().inbox_prefix is None
    with pytest.raises(ValueError, match="inbox_prefix"):
        MeshConfig(inbox_prefix="_INBOX.>")


async def test_a_deferred_task_is_followed_live_without_the_jetstream_api() -> None:
    node_key = KeyPair.generate()
    node, _, conn = _node(_example(node_key.public_key, node_key.public_key))
    responder, key = KeyPair.generate(), KeyPair.generate()
    hosted = HostedAgent(node, name="asker", kind="t", agent=Agent("asker", AgentSettings()), key=key,
                         guard=node.new_guard(key.public_key), interaction="service")
    opening = sign_envelope(build_envelope("respond", responder.public_key, now_ms=NOW, to=key.public_key,
                                           in_reply_to="r1", task_id="t1", payload={"status": "working"}), responder)
    task = RequesterTask(hosted, opening)
    updates = task.updates(timeout=5.0)
    pending = asyncio.ensure_future(anext(updates))
    subject = subjects.task_update("t1")
    await _until(lambda: subject in conn.subscriptions)  # a core subscription, no consumer
    done = sign_envelope(build_envelope("respond", responder.public_key, now_ms=NOW, to=key.public_key,
                                        in_reply_to="r1", task_id="t1", payload={"status": "completed"}), responder)
    await conn.subscriptions[subject](FakeMsg(subject, encode_envelope(done)))
    assert (await pending)["payload"]["status"] == "completed"
    await updates.aclose()


async def _until(condition: Any) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    pytest.fail("condition never held")
