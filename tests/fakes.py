"""Fakes shared by the unit tests: the transport, the one fake of the node, and a clock.

:class:`FakeConnection` stands in for :class:`meshnode.transport.connection.MeshConnection`
(records publishes, answers requests from a script). :class:`FakeNode` is the
one fake of :class:`meshnode.node.runtime.Node`: it implements
:class:`meshnode.node.port.NodePort`, the narrow interface hosted agents,
tasks, contexts and pub/sub depend on, recording what they ask of it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import orjson

from meshnode.agent import Reply
from meshnode.node.pipeline import RefusalCounter
from meshnode.node.port import NodePort
from meshnode.protocol.envelope import IdGenerator
from meshnode.protocol.protections import DedupMemory, InboundGuard
from meshnode.transport.connection import MeshConnection, Message
from meshnode.transport.errors import NotFound, TransportError, TransportTimeout
from meshnode.transport.grants import Grants
from meshnode.transport.jetstream import PubAck, StoredMessage, StreamState

__all__ = [
    "FakeConnection", "FakeJetStream", "FakeMsg", "FakeNode", "FakePullSubscription", "FakeSettings", "ManualClock",
]


class ManualClock:
    """A clock a test sets: ``clock()`` is ``clock.now``, which only the test
    moves (``clock.now += 5``), or :meth:`sleep` (an injected sleep that
    advances the clock instead of waiting, and records each delay)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        self.now += delay


class FakePullSubscription:
    """Stands in for nats-py's ``JetStreamContext.PullSubscription`` (what
    :class:`~meshnode.transport.jetstream.PullConsumer` and ``StreamReader``
    wrap): each :meth:`fetch` raises ``raises`` when set, else returns ``msgs``."""

    def __init__(self, msgs: list[Any] | None = None, raises: BaseException | None = None) -> None:
        self.msgs = msgs or []
        self.raises = raises
        self.fetches: list[tuple[int, float]] = []

    async def fetch(self, batch: int, timeout: float) -> list[Any]:
        self.fetches.append((batch, timeout))
        if self.raises is not None:
            raise self.raises
        return self.msgs


@dataclass
class FakeMsg:
    """What a subscription callback is given: the parts of nats' ``Msg`` the node reads."""

    subject: str
    data: bytes
    reply: str = ""
    headers: dict[str, str] | None = None

    async def ack(self) -> None:
        pass

    def as_message(self) -> Message:
        """This fake as the :class:`~meshnode.transport.connection.Message` it stands in
        for, to hand to code typed against it. It has the parts the node reads
        (subject, data, reply, headers, ack), not a JetStream delivery's sequence,
        nak or in_progress, so it is not one; this is the one place that says so."""
        return cast(Message, self)


class FakeJetStream:
    """:class:`meshnode.transport.jetstream.JetStream`, faked: in-memory streams.

    ``routes`` maps a subject prefix to the stream an acked publish lands in
    (dedup by ``Nats-Msg-Id`` per stream, as the server's duplicate window);
    ``down`` makes every publish and read fail as an unreachable JetStream
    does, ``fail_publishes`` fails only that many next publishes. ``calls``
    counts round trips by name, so a test can tell a batch read from one per
    message.
    """

    def __init__(self, routes: Mapping[str, str] | None = None) -> None:
        self.routes = dict(routes or {})
        self.streams: dict[str, list[StoredMessage]] = {}
        self.down = False
        self.fail_publishes = 0
        self.calls: Counter[str] = Counter()
        self._msg_ids: dict[str, set[str]] = {}
        #: stream -> each consumer's filter subjects, as ``consumer_filters`` lists them.
        self.consumer_filter_lists: dict[str, list[list[str]]] = {}

    def _check(self, call: str) -> None:
        self.calls[call] += 1
        if self.down:
            raise TransportTimeout(f"{call}: JetStream did not answer (faked down)")

    async def publish(self, subject: str, data: bytes, *, headers: dict[str, str] | None = None,
                      timeout: float | None = None) -> PubAck:
        self._check("publish")
        if self.fail_publishes > 0:
            self.fail_publishes -= 1
            raise TransportTimeout("publish: no ack (faked)")
        stream = next((name for prefix, name in self.routes.items() if subject.startswith(prefix)), "_")
        stored = self.streams.setdefault(stream, [])
        msg_id = (headers or {}).get("Nats-Msg-Id")
        seen = self._msg_ids.setdefault(stream, set())
        if msg_id is not None and msg_id in seen:
            return PubAck(stream, stored[-1].seq if stored else 0, True)
        if msg_id is not None:
            seen.add(msg_id)
        seq = stored[-1].seq + 1 if stored else 1
        stored.append(StoredMessage(seq, subject, bytes(data), headers))
        return PubAck(stream, seq, False)

    async def publish_in_flight(self, messages: Sequence[tuple[str, bytes, dict[str, str] | None]], *,
                                timeout: float) -> list[PubAck | TransportError]:
        """Each message as :meth:`publish` would take it, one round trip counted for the lot."""
        self.calls["publish_in_flight"] += 1
        results: list[PubAck | TransportError] = []
        for subject, data, headers in messages:
            try:
                results.append(await self.publish(subject, data, headers=headers))
            except TransportError as exc:
                results.append(exc)
        return results

    async def publish_deduplicated(self, subject: str, data: bytes, *, msg_id: str, within_s: float = 20.0) -> PubAck:
        return await self.publish(subject, data, headers={"Nats-Msg-Id": msg_id})

    def store(self, stream: str, data: bytes, subject: str = "x") -> int:
        """Put one message in ``stream`` as the server would (a sourced copy); its seq."""
        stored = self.streams.setdefault(stream, [])
        seq = stored[-1].seq + 1 if stored else 1
        stored.append(StoredMessage(seq, subject, bytes(data), None))
        return seq

    def _stream(self, stream: str) -> list[StoredMessage]:
        if stream not in self.streams:
            raise NotFound(f"stream {stream} not found")
        return self.streams[stream]

    async def stream_state(self, stream: str, *, subjects_filter: str | None = None) -> StreamState:
        self._check("stream_state")
        stored = self._stream(stream)
        return StreamState(stream, len(stored), stored[-1].seq if stored else 0, 0, 0.0, False)

    async def message(self, stream: str, *, seq: int, subject: str | None = None, next: bool = False,
                      direct: bool = False) -> StoredMessage:
        self._check("message")
        for m in self._stream(stream):
            if m.seq == seq or (next and m.seq > seq and (subject is None or m.subject == subject)):
                return m
        raise NotFound(f"no message at {seq} in {stream}")

    async def consumer_filters(self, stream: str) -> list[list[str]]:
        self._check("consumer_filters")
        return [list(f) for f in self.consumer_filter_lists.get(stream, [])]

    async def reader(self, stream: str, *, start_seq: int, inactive_threshold_s: float = 60.0) -> _FakeReader:
        self._check("reader")
        self._stream(stream)
        return _FakeReader(self, stream, start_seq)


class _FakeReader:
    def __init__(self, js: FakeJetStream, stream: str, start_seq: int) -> None:
        self.js, self.stream, self.next_seq = js, stream, start_seq

    async def fetch(self, batch: int, *, timeout: float) -> list[StoredMessage]:
        self.js._check("fetch")
        out = [m for m in self.js._stream(self.stream) if m.seq >= self.next_seq][:batch]
        if out:
            self.next_seq = out[-1].seq + 1
        return out

    async def close(self) -> None:
        self.js.calls["reader.close"] += 1


class FakeConnection:
    """The transport, faked: records publishes; ``request`` answers from ``answers``;
    ``jetstream`` is a :class:`FakeJetStream`."""

    max_payload = 1024 * 1024

    def __init__(self) -> None:
        self.jetstream = FakeJetStream()
        self.published: list[tuple[str, bytes]] = []
        #: subject -> bytes (or a function of the request bytes) that a request gets back.
        self.answers: dict[str, bytes | Callable[[bytes], bytes]] = {}
        self.subscriptions: dict[str, Callable[[Any], Awaitable[None]]] = {}
        #: Connected until a reconnect starts; the test brings it back (``is_connected = True``).
        self._connected = True
        #: How often the code under test looked at ``is_connected`` (a test waits on it).
        self.connected_checks = 0
        #: Waits in :meth:`wait_connected` begun so far, and the event that ends them.
        self.connected_waits = 0
        self._back = asyncio.Event()
        self.connected_url: str | None = "nats://127.0.0.1:4222"
        #: Reconnects that started. As in nats-py, one asked for while a reconnect
        #: is under way is ignored (not counted).
        self.reconnects = 0
        #: As MeshConnection.disconnects: a test bumps it to play a dropped connection.
        self.disconnects = 0
        self.lost_listeners: list[Callable[[], None]] = []

    @property
    def is_connected(self) -> bool:
        self.connected_checks += 1
        return self._connected

    @is_connected.setter
    def is_connected(self, value: bool) -> None:
        self._connected = value
        if value:
            self._back.set()
        else:
            self._back.clear()

    async def wait_connected(self, timeout: float) -> bool:
        """As MeshConnection's: woken when a test sets ``is_connected``."""
        self.connected_waits += 1
        if not self._connected:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._back.wait(), timeout)
        return self._connected

    async def reconnect(self) -> None:
        if not self._connected:
            return
        self.is_connected = False
        self.reconnects += 1

    def on_reconnect(self, callback: Any) -> None:
        pass

    def on_error(self, callback: Any) -> None:
        pass

    async def connect(self) -> None:
        self.is_connected = True

    def on_lost(self, listener: Callable[[], None]) -> None:
        """A test calls :meth:`lose` to play the client giving up for good."""
        self.lost_listeners.append(listener)

    def lose(self) -> None:
        self.is_connected = False
        for listener in self.lost_listeners:
            listener()

    async def publish(self, subject: str, data: bytes, **_: Any) -> None:
        self.published.append((subject, bytes(data)))

    async def subscribe(self, subject: str, cb: Callable[[Any], Awaitable[None]], **_: Any) -> Any:
        self.subscriptions[subject] = cb
        return _FakeSubscription()

    async def request(self, subject: str, data: bytes, **_: Any) -> FakeMsg:
        answer = self.answers[subject]
        return FakeMsg(subject, answer(data) if callable(answer) else answer)

    def new_inbox(self) -> str:
        return "_INBOX.fake"

    async def flush(self, timeout: float | None = None) -> None:
        pass

    def as_connection(self) -> MeshConnection:
        """This fake as the :class:`~meshnode.transport.connection.MeshConnection` it
        stands in for, to hand to code typed against it. It has what the code under
        test uses, not the whole connection, so it is not one; this is the one
        place that says so."""
        return cast(MeshConnection, self)

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


class _FakeSubscription:
    async def unsubscribe(self) -> None:
        pass


@dataclass(frozen=True)
class FakeSettings:
    registry_timeout_s: float = 5.0
    resolve_ttl_s: float = 30.0
    max_inbound_chars: int = 65536


class FakeNode:
    """The one fake node (:class:`meshnode.node.port.NodePort`): a clock, ids,
    counters and a fake connection; every call it gets is recorded."""

    observability: Any = None
    inbox: Any = None
    open_tasks: Any = None
    trust: Any = None
    a2a: Any = None
    commerce: Any = None
    allowance: Any = None

    def __init__(
        self,
        *,
        now_ms: int = 1_800_000_000_000,
        manifests: Mapping[str, Mapping[str, Any]] | None = None,
        trusted_operators: frozenset[str] = frozenset(),
        node_id: str = "NFAKENODE",
    ) -> None:
        self.clock = now_ms
        #: The hosting node's key (the default owner of its agents, §8.6).
        self.node_id = node_id
        self.ids = IdGenerator()
        self.counters: Counter[str] = Counter()
        self.refusals = RefusalCounter()
        self.connection = FakeConnection()
        self.settings = FakeSettings()
        self.agents: dict[str, Any] = {}
        self.by_id: dict[str, Any] = {}
        self.trust_attestation: dict[str, Any] | None = None
        self.trusted_operators = trusted_operators
        #: What the node's credential grants (meshnode.transport.grants).
        self.grants = Grants.unrestricted()
        self.platform_keys: set[str] = set()
        self.manifests = dict(manifests or {})
        self.delivered: list[dict[str, Any]] = []
        self.published: list[dict[str, Any]] = []
        self.sent: list[dict[str, Any]] = []
        self.a2a_calls: list[dict[str, Any]] = []
        self.service_calls: list[tuple[str, str, Any]] = []
        self.service_answers: dict[str, Callable[[Any], Awaitable[dict[str, Any]]]] = {}
        self.pubsub: Any = None
        self.directory: Any = None
        self.responds: list[dict[str, Any]] = []
        self.queued: list[tuple[str, str, str]] = []
        self.chunks: list[dict[str, Any]] = []
        self.canceled: list[tuple[str, str, str]] = []
        self.emitted: list[tuple[str, str, Any]] = []
        self.subscribed: list[str] = []

    def as_port(self) -> NodePort:
        """This fake as the :class:`NodePort` it stands in for, to hand to the code under test.

        Every member of the port is here, but ``connection`` and ``settings`` are
        :class:`FakeConnection` and :class:`FakeSettings`: they fake only what the
        code under test reads of ``MeshConnection`` and ``NodeSettings``, so the
        fake is not structurally a ``NodePort``. This is the one place that says so;
        a test keeps its ``FakeNode`` for what it asserts on.
        """
        return cast(NodePort, self)

    # -- the clock and bookkeeping ---------------------------------------------------

    def now_ms(self) -> int:
        return self.clock

    def audit(self, hosted: Any, env: Mapping[str, Any], *, direction: str, path: str) -> None:
        self.counters[f"{direction}.{env.get('type')}.{path}"] += 1

    def new_guard(self, agent_id: str, memory: DedupMemory | None = None) -> InboundGuard:
        return InboundGuard(agent_id, memory=memory)

    # -- what agents ask of it -------------------------------------------------------

    async def reply_plain(self, reply_subject: str, obj: Any) -> None:
        await self.connection.publish(reply_subject, orjson.dumps(obj))

    def queued_locally(self, requester: str, request_id: str, inbox_id: str) -> None:
        self.queued.append((requester, request_id, inbox_id))

    def on_respond(self, hosted: Any, env: Mapping[str, Any]) -> bool:
        self.responds.append(dict(env))
        return False

    async def publish_chunk(self, hosted: Any, task: Any, index: int, data: Any, **kw: Any) -> None:
        self.chunks.append({"task_id": task.task_id, "index": index, "data": data, **kw})

    async def cancel_task(self, hosted: Any, responder: str, task_id: str, reason: str, note: str | None,
                          *, wait: bool = True) -> dict[str, Any]:
        self.canceled.append((responder, task_id, reason))
        return {"task_id": task_id, "status": "canceled"}

    async def emit(self, hosted: Any, domain: str, event_type: str, data: Any, *, trace: Mapping[str, Any]) -> None:
        self.emitted.append((domain, event_type, data))

    async def subscribe_events(self, hosted: Any, pattern: str, *, durable: bool = True, replay: bool = False) -> str:
        self.subscribed.append(pattern)
        return pattern

    async def durable_consume(self, hosted: Any, subject: str, **kw: Any) -> Any:
        self.subscribed.append(subject)
        return _FakeSubscription()

    async def deliver(self, sender: Any, env: dict[str, Any], to_agent: str) -> None:
        self.delivered.append(env)

    async def publish_task(self, subject: str, env: Mapping[str, Any]) -> None:
        self.published.append(dict(env))

    async def service_call(
        self, hosted: Any, subject: str, kind: str, payload: Any, *, timeout: float | None = None
    ) -> dict[str, Any]:
        self.service_calls.append((subject, kind, payload))
        answer = self.service_answers.get(subject)
        if answer is not None:
            return await answer(payload)
        if isinstance(payload, Mapping) and payload.get("agent_id") in self.manifests:
            return dict(self.manifests[payload["agent_id"]])
        raise AssertionError(f"no scripted answer on {subject}")

    async def send_request(self, hosted: Any, target: str, offering: str, input: Any, **kw: Any) -> Reply:
        self.sent.append({"target": target, "offering": offering, "input": input, **kw})
        return Reply({"type": "respond", "payload": {"status": "completed"}}, accepted=True)

    async def call_a2a(self, hosted: Any, peer: str, offering: str, input: Any, **kw: Any) -> Reply:
        self.a2a_calls.append({"peer": peer, "offering": offering, "input": input, **kw})
        return Reply({"type": "respond", "payload": {"status": "completed"}}, accepted=True)
