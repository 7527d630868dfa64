"""Hostile input against the one inbound pipeline, :meth:`HostedAgent.receive`.

The node runtime is real (``Node``, ``HostedAgent``, the §22 guard, admission,
fencing, a real SQLite inbox in a temporary directory); only the transport is
a fake that records what the node publishes. Every property checks the same
invariants (issue #10, §22.7):

* nothing raises out of the pipeline, on any delivery path;
* no handler runs for a refused message;
* unauthenticated input (not JSON, not an envelope, a forged or broken
  signature) gets no reply at all, and neither do duplicates, stale or
  misaddressed envelopes (silent refusals);
* the size cap answers CONTEXT_TOO_LARGE, not retryable, to the sender;
* a well-formed, fresh, addressed request does run its handler exactly once,
  so a pipeline that refused everything would fail here too.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from meshnode.agent import Agent, AgentSettings, Context, offering
from meshnode.node.hosted import HostedAgent
from meshnode.node.inbox import InboxStore
from meshnode.node.runtime import Node, NodeSettings
from meshnode.protocol.canonical import CanonicalJSONError
from meshnode.protocol.envelope import MAX_NESTING, build_envelope, sign_envelope
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.signing import ENVELOPE_TAG, sign_object
from meshnode.protocol.timeutil import format_ts
from tests.fuzz.profile import fuzz_settings
from tests.fuzz.strategies import (
    envelope_like,
    envelope_types,
    json_values,
    keys,
    nested,
    raw_bytes,
    timestamps,
)

NOW_MS = 1_782_900_000_000  # 2026-07-01, a fixed node clock
SOURCES = ("live", "local", "mailbox")


class Probe(Agent):
    """Records every handler run; one plain, one schema-checked, one framed offering."""

    description = "fuzz probe"

    def __init__(self, name: str, settings: AgentSettings) -> None:
        super().__init__(name, settings)
        self.ran: list[str] = []

    @offering("work")
    async def work(self, ctx: Context, input: Any) -> Any:
        self.ran.append(ctx.envelope["id"])
        return {"ok": True}

    @offering("schema", input_schema={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    async def schema(self, ctx: Context, input: Any) -> Any:
        self.ran.append(ctx.envelope["id"])
        return {"n": input["n"]}

    @offering("text", framing=True)
    async def text(self, ctx: Context, input: Any) -> Any:
        self.ran.append(ctx.envelope["id"])
        return {"framed": ctx.text}


class Desk(Probe):
    """The same, hosted as an interactive agent: requests are held, never run (§8.3a)."""

    interaction = "interactive"


class RecordingConnection:
    """The transport, faked: records publishes; nothing else is reachable."""

    max_payload = 1024 * 1024

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    def on_reconnect(self, callback: Any) -> None:
        pass

    def on_error(self, callback: Any) -> None:
        pass

    async def publish(self, subject: str, data: bytes, **_: Any) -> None:
        self.published.append((subject, bytes(data)))

    async def flush(self, timeout: float = 5) -> None:
        """Everything published is "at the broker" at once (the inbox's settle barrier)."""

    def responds_to(self, msg_id: object) -> list[dict[str, Any]]:
        out = []
        for _, data in self.published:
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue
            if isinstance(obj, dict) and obj.get("in_reply_to") == msg_id:
                out.append(obj)
        return out


@dataclass
class Harness:
    runner: asyncio.Runner
    node: Node
    conn: RecordingConnection
    probe: HostedAgent
    desk: HostedAgent
    sender: KeyPair = field(default_factory=KeyPair.generate)

    def receive(self, target: HostedAgent, data: bytes, source: str, reply: str | None = None) -> str:
        inbox_id = 1 if source == "mailbox" else None
        outcome: str = self.runner.run(
            target.receive(data, source=source, reply=reply, inbox_id=inbox_id, wait=True)
        )
        return outcome

    def ran(self) -> list[str]:
        return [*self._agent(self.probe).ran, *self._agent(self.desk).ran]

    @staticmethod
    def _agent(hosted: HostedAgent) -> Probe:
        assert isinstance(hosted.agent, Probe)
        return hosted.agent

    def reset(self) -> None:
        self.conn.published.clear()


def _host(node: Node, name: str, cls: type[Probe]) -> HostedAgent:
    key = KeyPair.generate()
    hosted = HostedAgent(
        node, name=name, kind="fuzz-probe", agent=cls(name, AgentSettings()), key=key,
        guard=node.new_guard(key.public_key), interaction=cls.interaction,
    )
    hosted.vouch = node._vouch(hosted.agent_id)
    hosted.manifest = node.build_manifest(hosted)
    node.agents[name] = hosted
    node.by_id[hosted.agent_id] = hosted
    return hosted


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    with asyncio.Runner() as runner:
        conn = RecordingConnection()
        inbox = InboxStore(tmp_path / "inbox.db", synchronous="OFF")
        runner.run(inbox.open())
        node = Node(
            settings=NodeSettings(name="fuzz"), node_key=KeyPair.generate(),
            connection=conn,  # type: ignore[arg-type]  # the transport is the one fake
            clock=lambda: NOW_MS,
            inbox=inbox,
        )
        h = Harness(runner, node, conn, _host(node, "probe", Probe), _host(node, "desk", Desk))
        try:
            yield h
        finally:
            runner.run(inbox.close())


def _wire(env: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(env)
    except TypeError:  # integers beyond 64 bits: the stdlib writes them
        return json.dumps(env).encode()


def _signed(env: dict[str, Any], key: KeyPair) -> dict[str, Any] | None:
    """Sign whatever ``env`` holds (even nonsense); None when it has no canonical form."""
    env.pop("sig", None)
    try:
        env["sig"] = sign_object(env, ENVELOPE_TAG, key)
    except (CanonicalJSONError, RecursionError):
        return None
    return env


def _assert_silent(h: Harness, outcome: str, ran_before: int) -> None:
    assert outcome == "refused"
    assert h.conn.published == [], f"an unauthenticated or silent refusal was answered: {h.conn.published[:1]}"
    assert len(h.ran()) == ran_before, "a handler ran for a refused message"


# --------------------------------------------------------------------------- unauthenticated


@fuzz_settings(300)
@given(data=raw_bytes, source=st.sampled_from(SOURCES), reply=st.sampled_from([None, "_INBOX.x.y"]))
def test_garbage_bytes_are_refused_silently_on_every_path(harness: Harness, data: bytes, source: str, reply: str | None) -> None:
    harness.reset()
    before = len(harness.ran())
    for target in (harness.probe, harness.desk):
        outcome = harness.receive(target, data, source, reply)
        _assert_silent(harness, outcome, before)


@fuzz_settings(300)
@given(obj=envelope_like, source=st.sampled_from(SOURCES))
def test_envelope_shaped_objects_with_wrong_types_are_refused_silently(harness: Harness, obj: dict[str, Any], source: str) -> None:
    harness.reset()
    before = len(harness.ran())
    _assert_silent(harness, harness.receive(harness.probe, _wire(obj), source, "_INBOX.r"), before)


def _valid_request(h: Harness, *, payload: Any = None, to: str | None = None, now_ms: int = NOW_MS) -> dict[str, Any]:
    env = build_envelope(
        "request", h.sender.public_key, now_ms=now_ms, to=to or h.probe.agent_id,
        payload=payload if payload is not None else {"offering": "work", "input": {"x": 1}},
    )
    return sign_envelope(env, h.sender)


@fuzz_settings(300)
@given(member=keys, value=json_values, source=st.sampled_from(SOURCES))
def test_a_valid_envelope_mutated_after_signing_is_refused_silently(
    harness: Harness, member: str, value: Any, source: str
) -> None:
    env = _valid_request(harness)
    assume(env.get(member) != value)
    env[member] = value
    harness.reset()
    before = len(harness.ran())
    _assert_silent(harness, harness.receive(harness.probe, _wire(env), source, "_INBOX.r"), before)


@fuzz_settings(100)
@given(forger=st.just(None), payload=json_values)
def test_a_forged_signature_is_refused_silently(harness: Harness, forger: None, payload: Any) -> None:
    """Signed by one key, claiming another's ``from`` (a forgery), or with another envelope's sig."""
    victim = KeyPair.generate()
    env = build_envelope("request", victim.public_key, now_ms=NOW_MS, to=harness.probe.agent_id,
                         payload={"offering": "work", "input": payload})
    assume(_signed(env, harness.sender) is not None)  # signed by the wrong key
    harness.reset()
    before = len(harness.ran())
    _assert_silent(harness, harness.receive(harness.probe, _wire(env), "live", "_INBOX.r"), before)
    other = _valid_request(harness)
    env["from"], env["sig"] = other["from"], other["sig"]  # a real signature over other bytes
    _assert_silent(harness, harness.receive(harness.probe, _wire(env), "live", "_INBOX.r"), before)


@fuzz_settings(30)
@given(depth=st.integers(min_value=100, max_value=50_000), source=st.sampled_from(SOURCES))
def test_deep_nesting_is_refused_not_crashing(harness: Harness, depth: int, source: str) -> None:
    """A structurally valid envelope whose payload nests ``depth`` deep (its sig cannot verify)."""
    env = _valid_request(harness)
    text = _wire(env).replace(b'"payload":{', b'"payload":{"deep":' + nested(depth) + b",", 1)
    harness.reset()
    before = len(harness.ran())
    _assert_silent(harness, harness.receive(harness.probe, text, source, "_INBOX.r"), before)


# --------------------------------------------------------------------------- authenticated


@dataclass(frozen=True)
class Shape:
    kind: str
    offset_ms: int | None  # ts = now + offset; None: ts from the timestamps strategy
    ts_text: str
    to: str  # "self" | "other" | "absent" | "null"
    hops: Any
    payload: Any
    extra: dict[str, Any]


shapes = st.builds(
    Shape,
    kind=st.one_of(st.just("request"), envelope_types),
    offset_ms=st.one_of(
        st.none(),
        st.integers(-8 * 86_400_000, 8 * 86_400_000),
        st.sampled_from([-600_000, -600_001, 300_000, 300_001, -604_800_000, -604_800_001, 0]),
    ),
    ts_text=timestamps,
    to=st.sampled_from(["self", "self", "other", "absent", "null"]),
    hops=st.one_of(st.none(), st.integers(-2, 6), json_values),
    payload=st.one_of(
        json_values,
        st.fixed_dictionaries(
            {"offering": st.sampled_from(["work", "schema", "text", "describe", "task.cancel", "nope", "__registry_probe__"])},
            optional={"input": json_values, "config": json_values, "files": json_values, "resources": json_values,
                      "text": json_values, "message": json_values},
        ),
    ),
    extra=st.dictionaries(st.sampled_from(["budget", "task_id", "in_reply_to", "context_id", "artifacts", "error"]),
                          json_values, max_size=2),
)


def _fresh(offset_ms: int, source: str) -> bool:
    drift = -offset_ms
    max_age = 604_800_000 if source == "mailbox" else 600_000
    return -300_000 <= drift <= max_age


@fuzz_settings(400)
@given(shape=shapes, source=st.sampled_from(SOURCES), target=st.sampled_from(["probe", "desk"]),
       reply=st.sampled_from([None, "_INBOX.r"]))
def test_signed_hostile_envelopes_follow_the_refusal_rules(
    harness: Harness, shape: Shape, source: str, target: str, reply: str | None
) -> None:
    h = harness
    hosted = h.probe if target == "probe" else h.desk
    ts = format_ts(NOW_MS + shape.offset_ms) if shape.offset_ms is not None else shape.ts_text
    env = build_envelope(shape.kind, h.sender.public_key, now_ms=NOW_MS, payload=shape.payload, include_payload=True)
    env["ts"] = ts
    if shape.to == "self":
        env["to"] = hosted.agent_id
    elif shape.to == "other":
        env["to"] = KeyPair.generate().public_key
    elif shape.to == "null":
        env["to"] = None
    if shape.hops is not None:
        env["meta"] = {"hops": shape.hops}
    env.update(shape.extra)
    assume(_signed(env, h.sender) is not None)
    data = _wire(env)
    h.reset()
    before = len(h.ran())
    outcome = h.receive(hosted, data, source, reply)  # must not raise
    assert outcome in ("refused", "answered", "held")
    ran = len(h.ran()) - before
    answers = h.conn.responds_to(env["id"])
    stale = shape.offset_ms is not None and not _fresh(shape.offset_ms, source)
    if stale or shape.to in ("other", "null"):
        # §22.3 / §22.4: silent, and nothing ran.
        _assert_silent(h, outcome, before)
    if outcome == "refused":
        assert ran == 0, "a handler ran for a refused message"
        codes = [(a.get("error") or {}).get("code") for a in answers]
        assert codes in ([], ["CONTEXT_TOO_LARGE"]), f"a refusal answered {codes}"
        for a in answers:
            assert a["error"]["retryable"] is False and a["to"] == env["from"]
    if ran:
        assert hosted is h.probe and shape.kind == "request"
        assert ran == 1
        if source != "mailbox":  # a live handler runs only after its accept (§6.4a)
            assert any((a.get("payload") or {}).get("status") == "accepted" for a in answers)
    if hosted is h.desk:
        assert ran == 0, "an interactive agent's request ran a handler"
    if (shape.kind == "request" and shape.offset_ms is not None and not stale and shape.to in ("self", "absent")
            and shape.hops in (None, 0, 1, 2, 3) and not shape.extra and hosted is h.probe
            and shape.payload == {"offering": "work"}):
        assert ran == 1, "a fresh, addressed, admissible request did not run"
    # A replay of the same bytes, on any path, never runs anything and is never answered.
    h.reset()
    total = len(h.ran())
    for again in SOURCES:
        _assert_silent(h, h.receive(hosted, data, again, reply), total)


@fuzz_settings(100)
@given(input=json_values, source=st.sampled_from(SOURCES))
def test_a_valid_request_runs_once_and_its_replays_never(harness: Harness, input: Any, source: str) -> None:
    h = harness
    env = build_envelope("request", h.sender.public_key, now_ms=NOW_MS, to=h.probe.agent_id,
                         payload={"offering": "work", "input": input})
    assume(_signed(env, h.sender) is not None)  # no canonical form (an unsafe integer): not sendable
    data = _wire(env)
    assume(len(data) < 60_000)  # well under the §22.5 cap (the cap has its own property)
    h.reset()
    before = len(h.ran())
    assert h.receive(h.probe, data, source, "_INBOX.r") == "answered"
    assert h.ran()[before:] == [env["id"]]
    statuses = [(a.get("payload") or {}).get("status") for a in h.conn.responds_to(env["id"])]
    assert statuses[-1] == "completed"
    h.reset()
    for again in SOURCES:
        _assert_silent(h, h.receive(h.probe, data, again, "_INBOX.r"), before + 1)


@fuzz_settings(50)
@given(extra=st.integers(min_value=1, max_value=5000), field=st.sampled_from(["text", "message", "prompt", None]))
def test_oversized_sender_text_is_answered_context_too_large_and_never_runs(
    harness: Harness, extra: int, field: str | None
) -> None:
    h = harness
    big = "\U0001f600" * ((65_536 + extra) // 2 + 1)  # UTF-16 units: 2 each
    # The ladder (§22.5) walks what the handler would receive: the request's input.
    payload: Any = {"offering": "text", "input": big if field is None else {field: big, "n": 1}}
    env = _valid_request(h, payload=payload)
    h.reset()
    before = len(h.ran())
    outcome = h.receive(h.probe, _wire(env), "live", "_INBOX.r")
    answers = h.conn.responds_to(env["id"])
    assert len(h.ran()) == before
    assert outcome == "refused"
    assert [a["error"]["code"] for a in answers] == ["CONTEXT_TOO_LARGE"]
    assert answers[0]["error"]["retryable"] is False
    assert h.probe.counters["refused.inbound_oversize"] >= 1  # the local signal (§22.7)


@fuzz_settings(30)
@given(depth=st.integers(min_value=1, max_value=400), source=st.sampled_from(SOURCES))
@example(depth=MAX_NESTING - 2, source="live")
@example(depth=MAX_NESTING - 1, source="live")
def test_a_genuinely_signed_deep_payload_never_crashes(harness: Harness, depth: int, source: str) -> None:
    """Signed correctly, nested ``depth`` deep: within the nesting bound it runs, beyond it is refused silently."""
    h = harness
    inner: Any = 1
    for _ in range(depth):
        inner = [inner]
    env = build_envelope("request", h.sender.public_key, now_ms=NOW_MS, to=h.probe.agent_id,
                         payload={"offering": "work", "input": inner})
    assume(_signed(env, h.sender) is not None)
    h.reset()
    before = len(h.ran())
    outcome = h.receive(h.probe, _wire(env), source, "_INBOX.r")
    if depth + 2 > MAX_NESTING:  # the envelope, the payload, then ``depth`` lists
        _assert_silent(h, outcome, before)
    else:
        assert outcome == "answered" and h.ran()[before:] == [env["id"]]
