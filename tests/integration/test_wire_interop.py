"""The daemon against an independent client that only speaks the wire protocol.

:mod:`tests.integration.wire_client` imports nothing from meshnode: it joins
the mesh with an invite written by ``meshnode mesh invite``, renews the
credential over HTTP, connects with its node key, registers a hand-built
manifest, and exchanges signed envelopes with real daemon processes. Every
§22 refusal is then driven through the live inbox path and judged twice: what
the sender sees at its own inbox, and that no handler ran (the agent's
``Status`` counters: ``refused.<name>`` moves, ``dispatched`` does not).
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from meshnode.testing import DaemonProcess, DaemonSet, eventually_async, run_cli
from tests.integration.wire_client import (
    Inbound,
    UserKey,
    WireAgent,
    WireClient,
    build_envelope,
    now_ms,
    read_invite,
)
from tests.integration.wire_setup import enrolled_wire_agent

pytestmark = pytest.mark.integration

TEST_PLUGINS = {"plugin_modules": ["tests.agents:plugin"]}
#: How long "silent" is given to prove itself: long enough for a local
#: daemon to answer many times over, short enough to keep the file fast.
QUIET_S = 1.5
REPLY_TIMEOUT_S = 5.0
MINUTE_MS = 60_000


@dataclass
class Wire:
    """A daemon hosting echo and test-faulty, and the independent client joined to it."""

    node: DaemonProcess
    client: WireClient
    agent: WireAgent
    grant: dict[str, Any]
    registration: tuple[dict[str, Any], dict[str, Any]]
    echo_id: str
    faulty_id: str

    async def counters(self, name: str) -> dict[str, int]:
        status = await asyncio.to_thread(self.node.status)
        for agent in status["agents"]:
            if agent["name"] == name:
                return dict(agent["counters"])
        raise KeyError(name)

    async def inbox_of(self, agent_id: str) -> str:
        manifest = await self.client.get_manifest(self.agent, agent_id)
        inbox = manifest["endpoints"]["inbox"]
        assert isinstance(inbox, str)
        return inbox


def _pong(input: Any, request: Mapping[str, Any]) -> Any:
    return {"pong": input}


@pytest.fixture
async def wire(meshnode_daemons: DaemonSet, tmp_path: Path) -> AsyncIterator[Wire]:
    # The harness talks to the admin socket synchronously (its own event
    # loop), so every call into it runs in a thread.
    node = await asyncio.to_thread(
        meshnode_daemons.embedded,
        "hub",
        agents={"echo": {"plugin": "echo"}, "faulty": {"plugin": "test-faulty"}},
        node=TEST_PLUGINS,
    )
    invite_path = tmp_path / "wire-client.creds"
    await asyncio.to_thread(
        run_cli, "mesh", "invite", "wire-client", "--out", str(invite_path), "--socket", node.socket_path
    )
    client = WireClient(read_invite(invite_path))
    agent = WireAgent(UserKey.generate(), "wire-agent", offerings={"ping": _pong})
    try:
        grant = await client.join([agent])
        await client.serve(agent)
        registration = await client.register(agent)
        status = await asyncio.to_thread(node.status)
        ids = {a["name"]: a["id"] for a in status["agents"]}
        yield Wire(node, client, agent, grant, registration, ids["echo"], ids["faulty"])
    finally:
        await client.close()


def _status(env: Mapping[str, Any]) -> Any:
    return (env.get("payload") or {}).get("status")


def _delta(before: Mapping[str, int], after: Mapping[str, int], prefix: str = "refused.") -> dict[str, int]:
    keys = {k for k in (*before, *after) if k.startswith(prefix)}
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys if after.get(k, 0) != before.get(k, 0)}


def _assert_bound(env: Mapping[str, Any], request: Mapping[str, Any], *, sender: str) -> None:
    """A respond correlated to ``request``, signed by ``sender``, for its requester (§6.5)."""
    assert env["type"] == "respond"
    assert env["from"] == sender
    assert env["to"] == request["from"]
    assert env["in_reply_to"] == request["id"]
    assert env["trace"]["trace_id"] == request["trace"]["trace_id"]
    assert env["trace"]["parent_span_id"] == request["trace"]["span_id"]


def test_the_client_imports_nothing_from_meshnode() -> None:
    """The point of the client: it is loaded alone, and no meshnode module comes with it."""
    path = Path(__file__).with_name("wire_client.py")
    probe = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('wire_client', {str(path)!r})\n"
        "module = sys.modules['wire_client'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'meshnode'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout


# ----------------------------------------------------------------- join and talk


async def test_independent_client_joins_with_an_invite_and_registers(wire: Wire) -> None:
    client, agent = wire.client, wire.agent
    assert client.invite.node_name == "wire-client"
    assert wire.grant["node_id"] == client.node_id and wire.grant["agents"] == [agent.id]

    request, reply = wire.registration
    assert request["type"] == "register" and request["from"] == agent.id
    assert reply["payload"]["status"] == "registered"
    assert reply["payload"]["agent_id"] == agent.id
    assert reply["payload"]["node_binding"] == "connection_bound"
    # Signed by the registry's own key (verified by the client), bound to the request.
    assert reply["from"] not in (agent.id, client.node_id)
    assert reply["to"] == agent.id and reply["in_reply_to"] == request["id"]

    stored = await client.get_manifest(agent, agent.id)
    assert stored["endpoints"]["inbox"] == agent.inbox_subject
    assert stored["node"]["id"] == client.node_id
    assert [o["id"] for o in stored["offerings"]] == ["ping"]
    assert client.errors == []


async def test_independent_client_calls_echo(wire: Wire) -> None:
    client, agent = wire.client, wire.agent
    inbox = await wire.inbox_of(wire.echo_id)
    before = await wire.counters("echo")
    # Divergence-prone canonical JSON (§5.3), signed by one implementation and
    # verified by the other in both directions: number forms, escapes, raw
    # U+2028, and keys whose UTF-16 order differs from their UTF-8 order.
    value = {
        "numbers": [1, 1.0, 2.5, -0.0, 1e21, 1e-7, 9007199254740991, 0.1],
        "text": "tab\tquote\" slash/ line\u2028sep \u0001 é 😀",
        "keys": {"\U0001F600": 1, "\uE000": 2, "a": 3, "Z": 4, "ü": True},
        "empty": [{}, [], "", None],
    }

    request = client.request_envelope(agent, wire.echo_id, "echo", value)
    sent = await client.publish_request(request, inbox)
    accepted, completed = await client.wait_for(agent, request["id"], timeout=REPLY_TIMEOUT_S)

    assert _status(accepted) == "accepted" and "task_id" not in accepted
    assert _status(completed) == "completed" and "task_id" not in completed
    assert completed["payload"]["output"] == {"ok": value}
    for env in (accepted, completed):
        _assert_bound(env, request, sender=wire.echo_id)
    # Both arrived at the client's own inbox and verified with its own code;
    # nothing of the answer travelled on the reply subject (§18.7).
    assert all(m.verified and m.subject == agent.inbox_subject for m in agent.inbox)
    assert sent.reply_traffic == []

    after = await wire.counters("echo")
    assert after["dispatched"] == before.get("dispatched", 0) + 1
    assert after["completed"] == before.get("completed", 0) + 1
    assert _delta(before, after) == {}


async def test_daemon_calls_the_independent_clients_agent(wire: Wire) -> None:
    agent = wire.agent
    result = await asyncio.to_thread(wire.node.call, agent.id, "ping", {"n": 7}, 10.0)
    assert result == {
        "status": "completed",
        "output": {"pong": {"n": 7}},
        "from": agent.id,
        "accepted": True,
        "task_id": None,
    }
    # A refusal from the foreign agent comes back as the daemon's failed result.
    refused = await asyncio.to_thread(wire.node.call, agent.id, "no-such-offering", None, 10.0)
    assert refused["status"] == "failed" and refused["from"] == agent.id
    assert refused["error"]["code"] == "OFFERING_NOT_FOUND"

    requests = [m for m in agent.inbox if m.envelope and m.envelope.get("type") == "request"]
    assert len(requests) == 2 and all(m.verified for m in requests)
    request = requests[0].envelope
    assert request is not None
    # From the daemon's CLI identity, addressed to our agent, verified by our code.
    assert request["from"] == await asyncio.to_thread(wire.node.agent_id, "cli")
    assert request["to"] == agent.id
    assert request["payload"]["offering"] == "ping" and request["payload"]["input"] == {"n": 7}
    assert wire.client.errors == []


async def test_describe_is_served_without_running_a_handler(wire: Wire) -> None:
    client, agent = wire.client, wire.agent
    manifest = await client.get_manifest(agent, wire.echo_id)
    before = await wire.counters("echo")

    request = client.request_envelope(agent, wire.echo_id, "describe")
    sent = await client.publish_request(request, manifest["endpoints"]["inbox"])
    responds = await client.wait_for(agent, request["id"], timeout=REPLY_TIMEOUT_S)

    assert [_status(r) for r in responds] == ["completed"], "describe never sends an accept (§6.4a)"
    (answer,) = responds
    _assert_bound(answer, request, sender=wire.echo_id)
    output = answer["payload"]["output"]
    assert output["agent_id"] == wire.echo_id
    assert output["public"] == manifest["public"]
    assert sent.reply_traffic == []

    after = await wire.counters("echo")
    assert after.get("dispatched", 0) == before.get("dispatched", 0), "describe ran the agent"
    assert after.get("describe", 0) == before.get("describe", 0) + 1
    assert _delta(before, after) == {}
    assert len(agent.responds_to(request["id"])) == 1, "nothing followed the document"


async def test_an_invalid_inbound_trace_is_replaced_not_copied(wire: Wire) -> None:
    client, agent = wire.client, wire.agent
    bad_trace = {"trace_id": "NOT-HEX", "span_id": "0000000000000000", "parent_span_id": None}
    request = client.request_envelope(agent, wire.echo_id, "echo", "hi", trace=bad_trace)
    await client.publish_request(request, await wire.inbox_of(wire.echo_id))
    responds = await client.wait_for(agent, request["id"], timeout=REPLY_TIMEOUT_S)
    assert _status(responds[-1]) == "completed"
    for env in responds:
        trace = env["trace"]
        assert trace["trace_id"] != "NOT-HEX" and len(trace["trace_id"]) == 32
        assert int(trace["trace_id"], 16) != 0 and int(trace["span_id"], 16) != 0
        assert trace["parent_span_id"] is None, "a fresh root, not a child of the invalid span"


# ------------------------------------------------------- §22 refusals, live path


async def _handled_request(wire: Wire) -> bytes:
    """An envelope the echo agent has already handled, as raw bytes to replay."""
    request = wire.client.request_envelope(wire.agent, wire.echo_id, "echo", {"once": True})
    await wire.client.publish_request(request, await wire.inbox_of(wire.echo_id))
    responds = await wire.client.wait_for(wire.agent, request["id"], timeout=REPLY_TIMEOUT_S)
    assert _status(responds[-1]) == "completed"
    return json_bytes(request)


def json_bytes(env: Mapping[str, Any]) -> bytes:
    return json.dumps(env).encode("utf-8")


async def _forged(wire: Wire) -> bytes:
    # Claims to be the client's agent, signed by some other key.
    return json_bytes(
        wire.client.request_envelope(wire.agent, wire.echo_id, "echo", "hi", sign_with=UserKey.generate())
    )


async def _tampered(wire: Wire) -> bytes:
    env = wire.client.request_envelope(wire.agent, wire.echo_id, "echo", "hi")
    env["payload"]["input"] = "changed after signing"
    return json_bytes(env)


async def _fresh_resend_of_a_refused_id(wire: Wire) -> bytes:
    """§22.2 "remember first, then judge": an id refused as stale is remembered,
    so the same (from, id) re-signed with a fresh ts is a duplicate."""
    stale = wire.client.request_envelope(
        wire.agent, wire.echo_id, "echo", "hi", ts_ms=now_ms() - 11 * MINUTE_MS
    )
    before = (await wire.counters("echo")).get("refused.inbound_stale", 0)
    await wire.client.publish_request(stale, await wire.inbox_of(wire.echo_id))
    async def refused_stale() -> bool:
        return bool((await wire.counters("echo")).get("refused.inbound_stale", 0) != before)

    await eventually_async(refused_stale, what="the stale request refused")
    return json_bytes(
        wire.client.request_envelope(wire.agent, wire.echo_id, "echo", "hi", id=stale["id"])
    )


async def _stale(wire: Wire) -> bytes:
    return json_bytes(
        wire.client.request_envelope(wire.agent, wire.echo_id, "echo", "hi", ts_ms=now_ms() - 11 * MINUTE_MS)
    )


async def _future(wire: Wire) -> bytes:
    return json_bytes(
        wire.client.request_envelope(wire.agent, wire.echo_id, "echo", "hi", ts_ms=now_ms() + 6 * MINUTE_MS)
    )


async def _unparseable_ts(wire: Wire) -> bytes:
    return json_bytes(
        wire.client.request_envelope(wire.agent, wire.echo_id, "echo", "hi", ts="yesterday at noon")
    )


async def _misaddressed(wire: Wire) -> bytes:
    # Validly signed, for another (real) agent, delivered onto echo's inbox.
    return json_bytes(
        wire.client.request_envelope(wire.agent, wire.echo_id, "echo", "hi", to=wire.faulty_id)
    )


async def _too_many_hops(wire: Wire) -> bytes:
    return json_bytes(
        wire.client.request_envelope(wire.agent, wire.echo_id, "echo", "hi", meta={"hops": 4})
    )


SILENT_REFUSALS: dict[str, tuple[Callable[[Wire], Awaitable[bytes]], str]] = {
    "forged-signature": (_forged, "refused.identity_mismatch"),
    "tampered-after-signing": (_tampered, "refused.identity_mismatch"),
    "replay-of-handled-envelope": (_handled_request, "refused.inbound_duplicate"),
    "fresh-resend-of-an-id-refused-as-stale": (_fresh_resend_of_a_refused_id, "refused.inbound_duplicate"),
    "stale-over-10-min": (_stale, "refused.inbound_stale"),
    "future-over-5-min": (_future, "refused.inbound_stale"),
    "ts-not-rfc3339": (_unparseable_ts, "refused.inbound_stale"),
    "misaddressed": (_misaddressed, "refused.inbound_misaddressed"),
    "hops-over-3": (_too_many_hops, "refused.inbound_hops_exceeded"),
}


async def test_a_replay_after_the_node_restarted_is_still_a_duplicate(
    meshnode_daemons: DaemonSet, tmp_path: Path
) -> None:
    """§22.2 across a restart: the node reads an agent's remembered pairs at
    its first delivery (not at start-up, issue #21), and that first delivery
    can be the replay itself."""
    hub = await asyncio.to_thread(meshnode_daemons.embedded, "hub")
    node = await asyncio.to_thread(meshnode_daemons.joined, "far", via=hub, agents={"echo": {"plugin": "echo"}})
    async with enrolled_wire_agent(hub, tmp_path, "wire-client", "wire-agent") as (client, agent):
        echo_id = await asyncio.to_thread(node.agent_id, "echo")
        inbox = (await client.get_manifest(agent, echo_id))["endpoints"]["inbox"]
        request = client.request_envelope(agent, echo_id, "echo", "once")
        await client.publish_request(request, inbox)
        (*_, answer) = await client.wait_for(agent, request["id"], timeout=REPLY_TIMEOUT_S)
        assert _status(answer) == "completed", answer

        await asyncio.to_thread(node.stop)
        await asyncio.to_thread(node.start)

        async def echo_counters() -> dict[str, int]:
            status = await asyncio.to_thread(node.status)
            return dict(next(a for a in status["agents"] if a["name"] == "echo")["counters"])

        await client.publish_request(request, inbox)

        async def refused() -> bool:
            return (await echo_counters()).get("refused.inbound_duplicate", 0) == 1

        await eventually_async(refused, what="the replay refused as a duplicate after the restart")
        counters = await echo_counters()
        assert counters.get("completed", 0) == 0 and counters.get("failed", 0) == 0, counters
        assert len(agent.responds_to(request["id"])) == 2  # the first run's accept and answer: none for the replay


@pytest.mark.parametrize("case", list(SILENT_REFUSALS))
async def test_silent_refusal_on_the_live_path(wire: Wire, case: str) -> None:
    make, counter = SILENT_REFUSALS[case]
    data = await make(wire)
    inbox = await wire.inbox_of(wire.echo_id)
    before = await wire.counters("echo")

    sent = await wire.client.publish_request(data, inbox)
    arrived: list[Inbound] = await wire.client.quiet(wire.agent, seconds=QUIET_S)

    assert arrived == [], f"the sender was answered: {[m.envelope for m in arrived]}"
    assert sent.reply_traffic == []
    after = await wire.counters("echo")
    assert _delta(before, after) == {counter: 1}
    assert after.get("dispatched", 0) == before.get("dispatched", 0), "a handler ran"
    assert after.get("completed", 0) == before.get("completed", 0)


def _offset_ts(ms: int, hours: int) -> str:
    """``ms`` written in a numeric-offset RFC 3339 form (not ``Z``)."""
    zone = timezone(timedelta(hours=hours))
    moment = datetime.fromtimestamp(ms / 1000, zone)
    return moment.isoformat(timespec="milliseconds")


async def test_envelopes_just_inside_every_bound_are_handled(wire: Wire) -> None:
    """The other half of each silent refusal: the same request just inside each
    bound, or in another form a receiver must accept (any RFC 3339 ts, absent
    ``to``, another 0.x version), is handled, so the refusals above are the
    bounds and not a receiver that refuses everything."""
    client, agent = wire.client, wire.agent
    inbox = await wire.inbox_of(wire.echo_id)
    now = now_ms()
    controls: dict[str, dict[str, Any]] = {
        "9.5 min old": {"ts_ms": now - 9 * MINUTE_MS - 30_000},
        "4.5 min ahead": {"ts_ms": now + 4 * MINUTE_MS + 30_000},
        "ts with a numeric offset": {"ts": _offset_ts(now, 2)},
        "ts in whole seconds, Z": {
            "ts": datetime.fromtimestamp(now // 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        },
        "meta.hops at 3": {"meta": {"hops": 3}},
        "to absent": {"to": None},
        "another 0.x protocol version": {"v": "0.2.0"},
    }
    before = await wire.counters("echo")
    for label, overrides in controls.items():
        request = client.request_envelope(agent, wire.echo_id, "echo", label, **overrides)
        await client.publish_request(request, inbox)
        try:
            responds = await client.wait_for(agent, request["id"], timeout=REPLY_TIMEOUT_S)
        except TimeoutError:
            raise AssertionError(f"{label}: no answer (refused?)") from None
        assert [_status(r) for r in responds] == ["accepted", "completed"], label
        assert responds[-1]["payload"]["output"] == {"ok": label}
    after = await wire.counters("echo")
    assert _delta(before, after) == {}
    assert after["dispatched"] == before.get("dispatched", 0) + len(controls)


async def test_oversize_sender_text_is_answered_context_too_large(wire: Wire) -> None:
    client, agent = wire.client, wire.agent
    inbox = await wire.inbox_of(wire.echo_id)

    # At the cap is a legal message (strictly greater-than refuses), counted in
    # UTF-16 code units: 65,536 units here, but 65,538 UTF-8 bytes.
    at_cap_text = "x" * 65534 + "\U0001F600"
    at_cap = client.request_envelope(agent, wire.echo_id, "echo", at_cap_text)
    await client.publish_request(at_cap, inbox)
    (_, done) = await client.wait_for(agent, at_cap["id"], timeout=REPLY_TIMEOUT_S)
    assert _status(done) == "completed" and done["payload"]["output"]["ok"] == at_cap_text

    before = await wire.counters("echo")
    # 65,537 UTF-16 code units but 65,536 code points: "😀" counts 2 (§22.5).
    text = "x" * 65535 + "\U0001F600"
    over = client.request_envelope(agent, wire.echo_id, "echo", text)
    sent = await client.publish_request(over, inbox)
    responds = await client.wait_for(agent, over["id"], timeout=REPLY_TIMEOUT_S)

    assert [_status(r) for r in responds] == ["failed"], "no accept before a refusal"
    (refusal,) = responds
    _assert_bound(refusal, over, sender=wire.echo_id)
    assert refusal["error"]["code"] == "CONTEXT_TOO_LARGE"
    assert refusal["error"]["retryable"] is False
    assert sent.reply_traffic == []
    after = await wire.counters("echo")
    assert _delta(before, after) == {"refused.inbound_oversize": 1}
    assert after.get("dispatched", 0) == before.get("dispatched", 0), "a handler ran"


ADMISSION_REFUSALS: dict[str, tuple[str, str, Any, dict[str, Any] | None]] = {
    "OFFERING_NOT_FOUND": ("echo", "no-such-offering", {"a": 1}, None),
    "INPUT_INVALID": ("faulty", "schema", {"n": "seven"}, None),
    "CONTENT_TYPE_NOT_SUPPORTED": ("echo", "echo", {"a": 1}, {"accepted_output": ["image/png"]}),
}


@pytest.mark.parametrize("code", list(ADMISSION_REFUSALS))
async def test_admission_refusal_answers_without_an_accept(wire: Wire, code: str) -> None:
    target, offering, value, config = ADMISSION_REFUSALS[code]
    target_id = wire.echo_id if target == "echo" else wire.faulty_id
    client, agent = wire.client, wire.agent
    inbox = await wire.inbox_of(target_id)
    before = await wire.counters(target)

    request = client.request_envelope(agent, target_id, offering, value, config=config)
    sent = await client.publish_request(request, inbox)
    responds = await client.wait_for(agent, request["id"], timeout=REPLY_TIMEOUT_S)

    assert [_status(r) for r in responds] == ["failed"], "a refusal of admission is the first reply"
    (refusal,) = responds
    _assert_bound(refusal, request, sender=target_id)
    assert refusal["error"]["code"] == code
    assert refusal["error"]["retryable"] is False
    assert sent.reply_traffic == []
    after = await wire.counters(target)
    assert _delta(before, after) == {f"refused.{code}": 1}
    assert after.get("dispatched", 0) == before.get("dispatched", 0), "a handler ran"


async def test_replayed_envelope_with_fresh_id_is_not_a_duplicate(wire: Wire) -> None:
    """Control for the replay case: the same content under a new id is new work,
    so the duplicate refusal above is keyed on (from, id), not on content."""
    inbox = await wire.inbox_of(wire.echo_id)
    first = wire.client.request_envelope(wire.agent, wire.echo_id, "echo", {"same": 1})
    second = build_envelope("request", wire.agent.key, to=wire.echo_id, payload=first["payload"])
    for env in (first, second):
        await wire.client.publish_request(env, inbox)
        responds = await wire.client.wait_for(wire.agent, env["id"], timeout=REPLY_TIMEOUT_S)
        assert _status(responds[-1]) == "completed"


async def test_a_sender_no_node_vouches_for_is_refused(wire: Wire) -> None:
    """§5.3 step 2: a genuine signature from a key no node vouches for is refused
    UNAUTHORIZED (the registry is asked once; the answer is memoised)."""
    stranger = WireAgent(UserKey.generate(), "stranger", offerings={})
    before = await wire.counters("echo")
    request = wire.client.request_envelope(stranger, wire.echo_id, "echo", "hi")
    await wire.client.publish_request(request, await wire.inbox_of(wire.echo_id))
    async def refused_unvouched() -> dict[str, int] | None:
        counters = await wire.counters("echo")
        return counters if counters.get("refused.sender_not_vouched", 0) > before.get("refused.sender_not_vouched", 0) else None

    after = await eventually_async(refused_unvouched, what="the unvouched sender refused")
    assert after.get("refused.sender_not_vouched", 0) == before.get("refused.sender_not_vouched", 0) + 1
    assert after.get("dispatched", 0) == before.get("dispatched", 0)
    # The registered agent of the same node is still served.
    request = wire.client.request_envelope(wire.agent, wire.echo_id, "echo", "still fine")
    await wire.client.publish_request(request, await wire.inbox_of(wire.echo_id))
    replies = await wire.client.wait_for(wire.agent, request["id"], timeout=REPLY_TIMEOUT_S)
    assert _status(replies[-1]) == "completed"


async def test_a_sandbox_tier_node_is_attested_in_its_credential_and_clamped(
    meshnode_daemons: DaemonSet, tmp_path: Path
) -> None:
    """§9.7/§8.6: the tier is the operator's word, carried in the credential and
    applied by the registry; nothing the node itself says makes it otherwise."""
    node = await asyncio.to_thread(
        meshnode_daemons.embedded, "hub", agents={"echo": {"plugin": "echo"}}
    )
    invite_path = tmp_path / "sandboxed.creds"
    invited = await asyncio.to_thread(
        run_cli, "mesh", "invite", "sandboxed", "--trust-tier", "sandbox",
        "--out", str(invite_path), "--socket", node.socket_path, "--json",
    )
    assert json.loads(invited.stdout)["trust_tier"] == "sandbox"
    client = WireClient(read_invite(invite_path))
    # The agent asks to be public; a sandbox host cannot have that (§8.6).
    agent = WireAgent(UserKey.generate(), "sandboxed-agent", offerings={"ping": _pong})
    try:
        grant = await client.join([agent])
        claims = json.loads(_b64url_decode(grant["jwt"].split(".")[1]))
        assert "agentmesh:trust_tier:sandbox" in claims["nats"]["tags"]
        assert "agentmesh:role:participant" in claims["nats"]["tags"]

        await client.serve(agent)
        await client.register(agent)
        echo_id = next(a["id"] for a in (await asyncio.to_thread(node.status))["agents"])
        manifest = await client.get_manifest(agent, agent.key.public_key)
        assert manifest["sandbox"] is True
        assert manifest["visibility"] == "unlisted"
        listed = await asyncio.to_thread(node.admin, "Discover", {})
        ids = {m["id"] for m in listed["agents"]}
        assert echo_id in ids and agent.key.public_key not in ids

        # A verified host is found by the discovery tier filter; the hub's own
        # node, never enrolled with a tier, counts as standard.
        verified_path = tmp_path / "verified.creds"
        await asyncio.to_thread(
            run_cli, "mesh", "invite", "verified", "--trust-tier", "verified",
            "--out", str(verified_path), "--socket", node.socket_path,
        )
        verified_client = WireClient(read_invite(verified_path))
        verified_agent = WireAgent(UserKey.generate(), "verified-agent", offerings={"ping": _pong})
        try:
            await verified_client.join([verified_agent])
            await verified_client.serve(verified_agent)
            await verified_client.register(verified_agent)

            async def tiered(tier: str) -> set[str]:
                found = await asyncio.to_thread(node.admin, "Discover", {"trust_tier": tier})
                return {m["id"] for m in found["agents"]}

            assert await tiered("verified") == {verified_agent.key.public_key}
            by_cli = await asyncio.to_thread(
                run_cli, "discover", "--trust-tier", "verified", "--json", "--socket", node.socket_path
            )
            assert [m["id"] for m in json.loads(by_cli.stdout)["agents"]] == [verified_agent.key.public_key]
            at_least_standard = await tiered("standard")
            assert {echo_id, verified_agent.key.public_key} <= at_least_standard
            assert agent.key.public_key not in at_least_standard

            # The operator sees both enrolments and their tiers.
            listing = await asyncio.to_thread(
                run_cli, "mesh", "nodes", "--json", "--socket", node.socket_path
            )
            enrolled = {n["name"]: n for n in json.loads(listing.stdout)["nodes"]}
            assert enrolled["sandboxed"]["trust_tier"] == "sandbox"
            assert enrolled["verified"]["trust_tier"] == "verified"
            assert all(n["retired_at"] is None and n["credential_expires_at"] for n in enrolled.values())
            table = await asyncio.to_thread(run_cli, "mesh", "nodes", "--socket", node.socket_path)
            assert "sandboxed" in table.stdout and "verified" in table.stdout and "active" in table.stdout
        finally:
            await verified_client.close()
    finally:
        await client.close()


def _b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
