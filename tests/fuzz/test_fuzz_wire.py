"""Hostile input over real NATS to a real daemon: an agent's inbox and the registry.

The unit-level properties (test_fuzz_pipeline.py, test_fuzz_registry_intake.py)
judge every case precisely; this one checks that the same kinds of input,
delivered the way a stranger would deliver them, change nothing end to end:

* inbox: garbage bytes, envelope-shaped objects, forged and tampered
  signatures, stale and misaddressed envelopes sent to a journaling agent (it
  fsyncs every dispatch). Afterwards the journal is empty, the sender's inbox
  got no answer, the daemon lives, and a genuine request is still served;
* registry: signed registrations whose manifest is a valid one with a member
  replaced by any JSON value, or any JSON value at all, on the connection-bound
  subject. Every one is answered with a signed respond: registered, or a
  structured error, never INTERNAL_ERROR; afterwards the registry still serves.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnode.protocol.canonical import parse_json
from meshnode.protocol.envelope import verify_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.testing import DaemonProcess, DaemonSet, consistently, run_cli
from tests.fuzz.profile import fuzz_settings
from tests.fuzz.strategies import envelope_like, raw_bytes, wire_values
from tests.integration.wire_client import (
    ServiceError,
    UserKey,
    WireAgent,
    WireClient,
    build_envelope,
    now_ms,
    read_invite,
)

pytestmark = pytest.mark.integration

PLUGINS = {"plugin_modules": ["tests.agents:journal_plugin"]}
MEMBERS = ["id", "name", "description", "version", "protocol_version", "endpoint", "endpoints", "node",
           "capabilities", "offerings", "owner", "visibility", "public", "trust", "sealing", "data_use", "meta"]


class Wire:
    def __init__(self, runner: asyncio.Runner, node: DaemonProcess, client: WireClient, agent: WireAgent,
                 journal: Path, target: str) -> None:
        self.runner, self.node, self.client, self.agent, self.journal, self.target = (
            runner, node, client, agent, journal, target)


@pytest.fixture
def wire(meshnode_daemons: DaemonSet, tmp_path: Path) -> Iterator[Wire]:
    journal = tmp_path / "journal.log"
    node = meshnode_daemons.embedded("fw", agents={"work": {"plugin": "test-journal", "path": str(journal)}},
                                     node=PLUGINS)
    invite = tmp_path / "stranger.creds"
    run_cli("mesh", "invite", "stranger", "--out", str(invite), "--socket", node.socket_path)
    with asyncio.Runner() as runner:
        client = WireClient(read_invite(invite))
        agent = WireAgent(UserKey.generate(), "stranger")
        runner.run(client.join([agent]))
        runner.run(client.serve(agent))
        runner.run(client.register(agent))
        try:
            yield Wire(runner, node, client, agent, journal, node.agent_id("work"))
        finally:
            runner.run(client.close())


def tampered_envelope(sender: UserKey, target: str, payload: Any) -> dict[str, Any]:
    """A request signed over one input and sent with ``payload`` instead.

    The signed input is ``[payload]``, whose canonical form never equals
    ``payload``'s: a fixed signed input (it was ``1``) made every generated
    ``1`` or ``1.0`` an untampered, genuine request, which ran the handler and
    was answered (about one run in a hundred).
    """
    env = build_envelope("request", sender, to=target, payload={"offering": "work", "input": [payload]})
    env["payload"]["input"] = payload
    return env


def _inbox_cases(w: Wire) -> st.SearchStrategy[bytes]:
    target, me = w.target, w.agent.key

    def forged(payload: Any) -> bytes:
        return json.dumps(build_envelope("request", me, to=target, payload={"offering": "work", "input": payload},
                                         sign_with=UserKey.generate())).encode()

    def tampered(payload: Any) -> bytes:
        return json.dumps(tampered_envelope(me, target, payload)).encode()

    def stale(minutes: int) -> bytes:
        return json.dumps(build_envelope("request", me, to=target, payload={"offering": "work"},
                                         ts_ms=now_ms() + minutes * 60_000)).encode()

    def misaddressed(payload: Any) -> bytes:
        return json.dumps(build_envelope("request", me, to=UserKey.generate().public_key,
                                         payload={"offering": "work", "input": payload})).encode()

    def dumps(obj: Any) -> bytes:
        try:
            return json.dumps(obj).encode()
        except (TypeError, ValueError):
            return b"{}"

    return st.one_of(
        raw_bytes.filter(lambda b: len(b) < 900_000),
        envelope_like.map(dumps),
        wire_values.map(forged),
        st.integers(-1, 2).flatmap(lambda _: wire_values.map(tampered)),
        st.one_of(st.integers(-10_000, -11), st.integers(6, 10_000)).map(stale),
        wire_values.map(misaddressed),
    )


def test_hostile_inbox_traffic_runs_nothing_and_answers_nothing(wire: Wire) -> None:
    w = wire
    subject = f"mesh.agent.{w.target}.inbox"
    sent = 0

    @fuzz_settings(120)
    @given(data=_inbox_cases(w))
    def case(data: bytes) -> None:
        nonlocal sent
        w.runner.run(w.client.conn.publish(subject, data))
        sent += 1

    case()
    w.runner.run(w.client.barrier())
    # Nothing marks "decided not to answer": watch for a handler run or an answer a while.
    consistently(lambda: (not w.journal.exists() or w.journal.read_text() == "")
                 and not any(m.envelope and m.envelope.get("type") == "respond" for m in w.agent.inbox),
                 during=1.5, what="no handler run and no answer for hostile input")
    assert not w.journal.exists() or w.journal.read_text() == "", "a handler ran for hostile input"
    answers = [m for m in w.agent.inbox if m.envelope and m.envelope.get("type") == "respond"]
    assert answers == [], f"hostile input was answered: {answers[:1]}"
    status = w.node.status()
    counters = next(a for a in status["agents"] if a["name"] == "work")["counters"]
    assert counters.get("dispatched", 0) == 0 and sum(v for k, v in counters.items() if k.startswith("refused.")) >= 1
    # Still serving: a genuine request runs once and is answered.
    request = w.client.request_envelope(w.agent, w.target, "work", {"ok": 1})
    w.runner.run(w.client.publish_request(request, subject))
    responds = w.runner.run(w.client.wait_for(w.agent, request["id"], timeout=15))
    assert responds[-1]["payload"]["status"] == "completed"
    assert w.journal.read_text().split() == [request["id"]]
    print(f"{sent} hostile inbox messages: 0 dispatched, 0 answered")


@fuzz_settings(200)
@given(payload=st.one_of(st.sampled_from([1, 1.0, [1], {"a": 1}, None, [], ""]), wire_values))
def test_a_tampered_inbox_case_never_verifies(payload: Any) -> None:
    """The hostile cases above must be hostile: a tampered request whose
    signature still verifies is genuine mail, and running it is right."""
    env = parse_json(json.dumps(tampered_envelope(UserKey.generate(), UserKey.generate().public_key, payload)))
    with pytest.raises(ProtocolError):
        verify_envelope(env)


def test_hostile_registrations_get_structured_answers(wire: Wire) -> None:
    w = wire
    valid = w.agent.manifest(w.client.node_key)
    codes: dict[str, int] = {}

    async def register(payload: Any) -> None:
        subject = f"mesh.registry.register.{w.client.node_id}"
        for _ in range(20):
            try:
                _, reply = await w.client.service_request(subject, "register", w.agent, payload, timeout=10)
                outcome = str((reply.get("payload") or {}).get("status"))
            except ServiceError as exc:
                outcome = str(exc.code)
                if outcome == "RATE_LIMITED":  # structured too; wait as told and send it again
                    codes[outcome] = codes.get(outcome, 0) + 1
                    wait_ms = (exc.reply.get("error") or {}).get("retry_after_ms") or 1000
                    await asyncio.sleep(min(float(wait_ms), 5000.0) / 1000)
                    continue
            break
        codes[outcome] = codes.get(outcome, 0) + 1
        assert outcome != "INTERNAL_ERROR", f"the registry failed on {payload!r:.300}"

    def replaced(member: str, value: Any) -> Any:
        manifest = copy.deepcopy(valid)
        manifest[member] = value
        return manifest

    payloads = st.one_of(wire_values, st.builds(replaced, st.sampled_from(MEMBERS), wire_values))

    @fuzz_settings(40)
    @given(payload=payloads)
    def case(payload: Any) -> None:
        w.runner.run(register(payload))

    case()
    # The registry still serves, and the real manifest still registers.
    w.runner.run(register(copy.deepcopy(valid)))
    manifest = w.runner.run(w.client.get_manifest(w.agent, w.agent.id))
    assert manifest["id"] == w.agent.id
    print(f"hostile registrations: {codes}")
