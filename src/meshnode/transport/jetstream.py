"""The JetStream facade: everything node/ and services/ do with JetStream, without nats.

:class:`JetStream` (``MeshConnection.jetstream``) offers what the runtime and
the platform services need of the §18 binding and no more: acked publishes,
the per-agent mailbox buffer (:class:`MailboxBuffer`), durable push and pull
consumers, KV buckets (:class:`KeyValue`), direct stream reads for the object
store, and stream provisioning (:mod:`meshnode.transport.streams`). Every call
raises the transport error taxonomy (:mod:`meshnode.transport.errors`), never
nats-py's exceptions, and hands back transport types (:class:`Message`,
:class:`KvEntry`, :class:`StoredMessage`, ...), never nats-py's.

The consumer configurations live here, next to the calls that create them,
so the settings §18.6 fixes (ack policy, ack wait, redelivery bounds) are
read in one place.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo, DeliverPolicy, StreamInfo
from nats.js.errors import APIError
from nats.js.kv import KeyValue as NatsKeyValue

from meshnode.aio import backoff

from .errors import (
    NoResponders,
    NotFound,
    Reconnecting,
    TransportError,
    TransportTimeout,
    translate,
    translated,
)
from .messages import Message, MessageHandler, Subscription, wrap_handler

__all__ = [
    "ConsumerSpec",
    "ConsumerState",
    "KV_DELETE_OPS",
    "DurableSubscription",
    "JetStream",
    "KeyValue",
    "KvEntry",
    "KvWatch",
    "MailboxBuffer",
    "MailboxReader",
    "PubAck",
    "PullConsumer",
    "StoredMessage",
    "StreamReader",
    "StreamState",
]

log = logging.getLogger(__name__)

#: The KV operations that mean "this key is gone" (a delete marker or a purge).
KV_DELETE_OPS = ("DEL", "PURGE")

# The JetStream API prefix of the connection's context (nats-py's default), and
# the header that marks a server status message (a pull request's end).
_JS_API = "$JS.API"
_STATUS = "Status"


# --- values -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PubAck:
    """The stream's acknowledgement of a publish."""

    stream: str
    seq: int
    duplicate: bool


@dataclass(frozen=True, slots=True)
class StreamState:
    """What a caller needs of a stream's info."""

    name: str
    messages: int
    last_seq: int
    consumer_count: int
    max_age_s: float
    """The configured retention (0: unlimited)."""
    leaderless: bool
    """Clustered and without a leader right now."""
    max_msgs: int = 0
    """The configured bound on messages (0: unbounded)."""
    max_bytes: int = 0
    """The configured bound on bytes (0: unbounded)."""
    first_seq: int = 0
    """The sequence of the oldest message held (purged and expired ones are gone)."""


@dataclass(frozen=True, slots=True)
class ConsumerState:
    """What a caller needs of a consumer's info."""

    name: str
    created: str | None
    num_pending: int
    num_ack_pending: int
    delivered_stream_seq: int
    push_bound: bool
    """A push consumer (it has a deliver subject), as opposed to a pull consumer."""
    ack_floor_stream_seq: int = 0
    """Every message of the stream through this sequence is acknowledged."""
    max_ack_pending: int = 0
    """The most deliveries the consumer lets wait for an ack (0: no limit, or not known)."""


@dataclass(frozen=True, slots=True)
class ConsumerSpec:
    """The configuration a consumer must have, asserted every time it is bound.

    ``deliver_subject`` makes it a push consumer (None: a pull consumer);
    ``durable=False`` makes it a named consumer the server reaps once idle
    for ``inactive_threshold_s``. :meth:`JetStream.ensure_consumer` compares
    an existing consumer against the fields that decide what it delivers and
    to whom, so a consumer retargeted by someone else is repaired, not re-used.
    """

    name: str
    filter_subject: str
    deliver_all: bool = True
    ack_wait_s: float = 30
    max_deliver: int = -1
    durable: bool = True
    deliver_subject: str | None = None
    inactive_threshold_s: float | None = None
    max_ack_pending: int | None = None

    def config(self) -> ConsumerConfig:
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.ALL if self.deliver_all else DeliverPolicy.NEW,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver,
            filter_subject=self.filter_subject,
        )
        if self.durable:
            config.durable_name = self.name
        else:
            config.name = self.name
            config.inactive_threshold = self.inactive_threshold_s
        if self.deliver_subject is not None:
            config.deliver_subject = self.deliver_subject
        if self.max_ack_pending is not None:
            config.max_ack_pending = self.max_ack_pending
        return config

    def drift(self, found: ConsumerConfig) -> list[str]:
        """The fields in which ``found`` (a consumer's current config) differs."""
        out: list[str] = []
        filters = list(found.filter_subjects or [])
        if found.filter_subject:
            filters.append(found.filter_subject)
        if filters != [self.filter_subject]:
            out.append(f"filter_subject {filters!r} (want {self.filter_subject!r})")
        if (found.deliver_subject or None) != self.deliver_subject:
            out.append(f"deliver_subject {found.deliver_subject!r} (want {self.deliver_subject!r})")
        # The server's answer may carry the policy as a plain string.
        if getattr(found.ack_policy, "value", found.ack_policy) != AckPolicy.EXPLICIT.value:
            out.append(f"ack_policy {found.ack_policy!r} (want explicit)")
        if (found.max_deliver if found.max_deliver is not None else -1) != self.max_deliver:
            out.append(f"max_deliver {found.max_deliver!r} (want {self.max_deliver})")
        if found.ack_wait is None or abs(float(found.ack_wait) - self.ack_wait_s) > 0.5:
            out.append(f"ack_wait {found.ack_wait!r} (want {self.ack_wait_s})")
        if found.deliver_group:
            out.append(f"deliver_group {found.deliver_group!r} (want none)")
        return out


ConsumerAction = Literal["created", "bound", "updated", "recreated"]


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """A message read straight from a stream by sequence or subject."""

    seq: int
    subject: str
    data: bytes
    headers: dict[str, str] | None
    stored_ms: int | None = None
    """When the stream stored it (epoch ms), when the server said."""


def _stored(raw: Any, subject: str = "") -> StoredMessage:
    stored = getattr(raw, "time", None)
    return StoredMessage(
        seq=int(raw.seq or 0),
        subject=str(raw.subject or subject),
        data=bytes(raw.data or b""),
        headers=raw.headers,
        stored_ms=None if stored is None else int(stored.timestamp() * 1000),
    )


@dataclass(frozen=True, slots=True)
class KvEntry:
    """One KV entry. ``operation`` is ``"DEL"`` or ``"PURGE"`` for a delete or
    purge marker (seen in watches), else None."""

    key: str
    value: bytes
    revision: int
    operation: str | None = None
    created_ms: int | None = None
    """When the entry was written (epoch ms), when the server said."""

    @property
    def deleted(self) -> bool:
        return self.operation in KV_DELETE_OPS


def _stream_state(info: StreamInfo) -> StreamState:
    cluster = info.cluster
    return StreamState(
        name=str(info.config.name),
        messages=int(info.state.messages or 0),
        last_seq=int(info.state.last_seq or 0),
        consumer_count=int(getattr(info.state, "consumer_count", 0) or 0),
        max_age_s=float(getattr(info.config, "max_age", 0) or 0),
        leaderless=cluster is not None and not cluster.leader,
        max_msgs=max(0, int(getattr(info.config, "max_msgs", 0) or 0)),
        max_bytes=max(0, int(getattr(info.config, "max_bytes", 0) or 0)),
        first_seq=int(getattr(info.state, "first_seq", 0) or 0),
    )


async def _info_or_create(
    js: JetStreamContext,
    stream: str,
    name: str,
    config: ConsumerConfig,
    before_create: Callable[[], Awaitable[None]] | None = None,
) -> ConsumerInfo | None:
    """Consumer ``name``'s info, or None after creating it with ``config`` (it did not
    exist; ``before_create`` is awaited first, and what it raises stops the creation)."""
    try:
        with translated():
            found: ConsumerInfo = await js.consumer_info(stream, name)
            return found
    except NotFound:
        pass
    if before_create is not None:
        await before_create()
    with translated():
        await js.add_consumer(stream, config=config)
    return None


def _consumer_state(info: ConsumerInfo) -> ConsumerState:
    delivered = info.delivered
    ack_floor = info.ack_floor
    created = getattr(info, "created", None)
    return ConsumerState(
        name=str(info.name),
        created=None if created is None else str(created),
        num_pending=int(info.num_pending or 0),
        num_ack_pending=int(info.num_ack_pending or 0),
        delivered_stream_seq=int(delivered.stream_seq or 0) if delivered is not None else 0,
        push_bound=bool(info.config.deliver_subject),
        ack_floor_stream_seq=int(ack_floor.stream_seq or 0) if ack_floor is not None else 0,
        max_ack_pending=max(0, int(getattr(info.config, "max_ack_pending", 0) or 0)),
    )


def _entry(entry: Any) -> KvEntry:
    operation = getattr(entry, "operation", None)
    created = getattr(entry, "created", None)
    return KvEntry(
        key=str(entry.key),
        value=bytes(entry.value or b""),
        revision=int(entry.revision or 0),
        operation=None if operation is None else str(operation),
        created_ms=None if created is None else int(created.timestamp() * 1000),
    )


# --- consumers ----------------------------------------------------------------


class DurableSubscription(Subscription):
    """A push subscription bound to a durable (or named) JetStream consumer."""

    __slots__ = ("_push",)

    def __init__(self, sub: JetStreamContext.PushSubscription) -> None:
        super().__init__(sub)
        self._push = sub

    async def consumer_info(self) -> ConsumerState:
        with translated():
            return _consumer_state(await self._push.consumer_info())


class PullConsumer:
    """A pull subscription on a durable consumer."""

    def __init__(self, psub: JetStreamContext.PullSubscription) -> None:
        self._psub = psub

    async def fetch(self, batch: int, *, timeout: float) -> list[Message]:
        """Up to ``batch`` messages; an empty list when none came within ``timeout``."""
        try:
            with translated():
                msgs = await self._psub.fetch(batch, timeout=timeout)
        except TimeoutError:  # TransportTimeout, or asyncio's own, which nats-py raises untranslated
            return []
        return [Message(m) for m in msgs]

    async def consumer_info(self) -> ConsumerState:
        with translated():
            return _consumer_state(await self._psub.consumer_info())

    async def unsubscribe(self) -> None:
        with translated():
            await self._psub.unsubscribe()


class StreamReader:
    """A stream read in order from a sequence on, many messages per round trip.

    An ephemeral pull consumer (no acks, memory storage, reaped by the server
    once idle): where :meth:`JetStream.message` costs one round trip per
    message, :meth:`fetch` brings up to ``batch`` at once. Deliveries are in
    stream order; sequences the stream no longer holds are skipped.
    """

    def __init__(self, js: JetStreamContext, stream: str, name: str, psub: JetStreamContext.PullSubscription) -> None:
        self._js = js
        self._stream = stream
        self._name = name
        self._psub = psub

    async def fetch(self, batch: int, *, timeout: float) -> list[StoredMessage]:
        """Up to ``batch`` messages (fewer when fewer are stored: the server says
        so at once); an empty list when none came within ``timeout``."""
        try:
            with translated():
                msgs = await self._psub.fetch(batch, timeout=timeout)
        except TimeoutError:  # as in PullConsumer.fetch
            return []
        out: list[StoredMessage] = []
        for m in msgs:
            meta = m.metadata
            out.append(StoredMessage(
                seq=int(meta.sequence.stream), subject=str(m.subject), data=bytes(m.data or b""),
                headers=m.headers, stored_ms=int(meta.timestamp.timestamp() * 1000) if meta.timestamp else None,
            ))
        return out

    async def close(self) -> None:
        """Unsubscribe and delete the consumer (best effort: the server reaps it anyway)."""
        try:
            with translated():
                await self._psub.unsubscribe()
                await self._js.delete_consumer(self._stream, self._name)
        except TransportError as exc:
            log.debug("closing the reader %s on %s: %s", self._name, self._stream, exc)


class MailboxBuffer:
    """One agent's ``MESH_INBOX_{agent}`` and its durable drain consumer (§16.4, §18.6)."""

    def __init__(self, js: JetStreamContext, client: Client, subject: str, stream: str, consumer: str) -> None:
        self._js = js
        self._client = client
        self.subject = subject
        self.stream = stream
        self.consumer = consumer

    async def state(self) -> StreamState | None:
        """The buffer's state; None when it does not exist (sandbox, not registered yet)."""
        try:
            with translated():
                return _stream_state(await self._js.stream_info(self.stream))
        except NotFound:
            return None

    async def purge_through(self, seq: int) -> None:
        """Remove every message up to and including ``seq`` (the drain has
        committed them): the buffer discards new mail at its bound, so it
        must only ever hold mail not yet taken in (issue #22.4)."""
        with translated():
            await self._js.purge_stream(self.stream, seq=seq + 1)

    async def reader(self) -> MailboxReader:
        """The drain's reader of the buffer's durable consumer (created on first
        use, bound afterwards)."""
        # Unbounded max_deliver (the spec's default): every message fetched is
        # either committed and acked or (its batch failing, e.g. a full inbox
        # disk) handed back, and an unreadable one is acked too, so there is no
        # poison message to bound; a bound only turned a long inbox fault into
        # lost mail. Bound as found, not asserted: a durable created earlier
        # with max_deliver=5 keeps its config.
        config = ConsumerSpec(self.consumer, self.subject).config()
        config.name = self.consumer  # the create subject nats-py's pull_subscribe used
        await _info_or_create(self._js, self.stream, self.consumer, config)
        reader = MailboxReader(self._client, self._js, self.stream, self.consumer)
        await reader.open()
        return reader


class MailboxReader:
    """Reads a mailbox's durable consumer for the drain: one pull request per fetch.

    nats-py's pull ``fetch`` waits for each message of a batch with a task, a
    timer and a ``uuid4`` of its own: about half of the CPU a drain spent on a
    copy the live path had already handled (issue #21). Here one subscription
    under the node's private inbox prefix takes every delivery, and a fetch is
    one pull request (``no_wait``: what is stored now, up to the batch) whose
    deliveries the subscription gathers; the fetch wakes once, when the batch
    is full or the server ends the request with a status (404 no messages,
    408, 409). Each request has a reply subject of its own, so a late status
    of an earlier request cannot end a later one; a delivery that comes after
    its fetch gave up is kept for the next fetch, not dropped (unacked, it
    would only come back after the ack wait).
    """

    def __init__(self, client: Client, js: JetStreamContext, stream: str, consumer: str) -> None:
        self._client = client
        self._js = js
        self._stream = stream
        self._consumer = consumer
        self._next_subject = f"{_JS_API}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._prefix = client.new_inbox()
        self._sub: Any = None
        self._ready: list[Msg] = []
        self._want = 0
        self._requests = 0
        self._current = ""
        self._woken: asyncio.Future[None] | None = None

    async def open(self) -> None:
        with translated():
            self._sub = await self._client.subscribe(f"{self._prefix}.*", cb=self._on_message)

    async def _on_message(self, msg: Msg) -> None:
        headers = msg.headers
        if headers is not None and _STATUS in headers:
            if msg.subject == self._current:
                self._wake()
            return
        self._ready.append(msg)
        if len(self._ready) >= self._want:
            self._wake()

    def _wake(self) -> None:
        woken = self._woken
        if woken is not None and not woken.done():
            woken.set_result(None)

    async def fetch(self, batch: int, *, timeout: float) -> list[Message]:
        """Up to ``batch`` messages stored now (fewer when fewer are: the server
        says so at once); an empty list when none came within ``timeout``."""
        if len(self._ready) < batch:
            self._requests += 1
            self._current = f"{self._prefix}.{self._requests}"
            self._want = batch
            woken = self._woken = asyncio.get_running_loop().create_future()
            request = orjson.dumps({"batch": batch - len(self._ready), "no_wait": True})
            try:
                with translated():
                    await self._client.publish(self._next_subject, request, reply=self._current)
                async with asyncio.timeout(timeout):
                    await woken
            except TimeoutError:
                pass
            finally:
                self._woken = None
                self._current = ""
        taken, self._ready = self._ready[:batch], self._ready[batch:]
        return [Message(m) for m in taken]

    async def consumer_info(self) -> ConsumerState:
        with translated():
            return _consumer_state(await self._js.consumer_info(self._stream, self._consumer))

    async def unsubscribe(self) -> None:
        if self._sub is not None:
            with translated():
                await self._sub.unsubscribe()


# --- KV -----------------------------------------------------------------------


class KvWatch:
    """A watch on every key of a bucket: current values first, then changes.

    Iterating yields :class:`KvEntry` values and ``None`` once, when the
    current values have all been delivered.
    """

    def __init__(self, watcher: NatsKeyValue.KeyWatcher) -> None:
        self._watcher = watcher

    async def __aiter__(self) -> AsyncIterator[KvEntry | None]:
        with translated():
            async for entry in self._watcher:
                yield None if entry is None else _entry(entry)

    async def stop(self) -> None:
        with translated():
            await self._watcher.stop()  # type: ignore[no-untyped-call]


class KeyValue:
    """A KV bucket. A missing or deleted key raises :class:`NotFound`; a
    revision-checked write that lost raises :class:`Conflict`."""

    def __init__(self, kv: NatsKeyValue, bucket: str, jetstream: JetStream | None = None) -> None:
        self._kv = kv
        self.bucket = bucket
        self._jetstream = jetstream

    async def get(self, key: str) -> KvEntry:
        """The entry of ``key``. Raises NotFound; for a deleted key its ``entry``
        is the delete marker (its revision is what a write must name)."""
        try:
            with translated():
                return _entry(await self._kv.get(key))
        except NotFound as exc:
            marker = getattr(exc.__cause__, "entry", None)
            if marker is not None:
                exc.entry = _entry(marker)
            raise

    async def create(self, key: str, value: bytes) -> int:
        """Write ``key`` only if it does not exist (or was deleted); the new revision."""
        with translated():
            return int(await self._kv.create(key, value))

    async def update(self, key: str, value: bytes, *, last: int) -> int:
        """Write ``key`` only if its revision is still ``last``; the new revision."""
        with translated():
            return int(await self._kv.update(key, value, last=last))

    async def put(self, key: str, value: bytes) -> int:
        with translated():
            return int(await self._kv.put(key, value))

    async def delete(self, key: str, *, last: int | None = None) -> None:
        """Delete ``key`` (a marker stays); with ``last``, only while its revision is still ``last``."""
        with translated():
            await self._kv.delete(key, last=last)

    async def least_recent(self, limit: int) -> AsyncGenerator[KvEntry, None]:
        """Up to ``limit`` live entries, the least recently written first, read
        one request at a time as the caller iterates.

        Read from the front of the bucket's stream, whose oldest messages are
        the values written longest ago (a key's older values are gone: one
        value per key). Delete and purge markers are skipped. For making room
        in a full bucket.
        """
        if self._jetstream is None:
            raise RuntimeError(f"KV {self.bucket}: opened without its JetStream")
        stream = f"KV_{self.bucket}"
        prefix = f"$KV.{self.bucket}."
        seq = max(1, (await self._jetstream.stream_state(stream)).first_seq)
        given = 0
        while given < limit:
            try:
                # The next message at or after seq; the server finds one only with a subject.
                msg = await self._jetstream.message(stream, seq=seq, subject=prefix + ">", next=True)
            except NotFound:
                return  # past the last message
            seq = msg.seq + 1
            if (msg.headers or {}).get("KV-Operation") in KV_DELETE_OPS or not msg.subject.startswith(prefix):
                continue
            given += 1
            yield KvEntry(key=msg.subject[len(prefix):], value=msg.data, revision=msg.seq)

    async def watch_all(self) -> KvWatch:
        with translated():
            return KvWatch(await self._kv.watchall())


# --- the facade ---------------------------------------------------------------


class JetStream:
    """JetStream on the node's connection, in transport terms."""

    def __init__(self, js: JetStreamContext, client: Client) -> None:
        self._js = js
        self._client = client

    @property
    def native(self) -> JetStreamContext:
        """nats-py's context, for transport/ itself (stream provisioning) and tests."""
        return self._js

    # -- publishing --

    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> PubAck:
        """Publish and wait for the stream's ack (backpressure, and dedup by
        ``Nats-Msg-Id`` within the stream's window)."""
        with translated():
            if timeout is None:
                ack = await self._js.publish(subject, data, headers=headers)
            else:
                ack = await self._js.publish(subject, data, headers=headers, timeout=timeout)
        return PubAck(str(ack.stream), int(ack.seq), bool(ack.duplicate))

    async def publish_in_flight(
        self, messages: Sequence[tuple[str, bytes, dict[str, str] | None]], *, timeout: float
    ) -> list[PubAck | TransportError]:
        """Publish ``messages`` (subject, data, headers) in this order, all of
        them before waiting for any ack: the lot costs about one round trip, not
        one each (a busy node's meter outbox, one at a time, published ~240
        events a second). Returns each message's ack or the error that stands
        for it, in order: a refusal, or :class:`TransportTimeout` when no ack
        came within ``timeout`` seconds of the last publish (nats-py's own
        futures never time out). A message without an ack may still have been
        stored: publish it again with the same ``Nats-Msg-Id``."""
        futures: list[asyncio.Future[Any]] = []
        failed: TransportError | None = None
        for subject, data, headers in messages:
            try:
                with translated():
                    futures.append(await self._js.publish_async(subject, data, headers=headers))
            except TransportError as exc:
                failed = exc  # not written (disconnected, closed): it and the rest are not sent
                break
        if futures:
            try:
                await asyncio.wait(futures, timeout=timeout)
            except asyncio.CancelledError:
                for future in futures:
                    future.cancel()  # each holds one of nats-py's slots until it is done
                raise
        results: list[PubAck | TransportError] = []
        for future in futures:
            if not future.done():
                future.cancel()  # frees nats-py's slot for it; a late ack finds no future
                results.append(TransportTimeout(f"no ack within {timeout:g} s"))
                continue
            if future.cancelled():
                results.append(TransportTimeout("the publish was cancelled"))
                continue
            error = future.exception()
            if error is not None:
                results.append(translate(error))
                continue
            ack = future.result()
            results.append(PubAck(str(ack.stream), int(ack.seq), bool(ack.duplicate)))
        unsent = len(messages) - len(futures)
        if unsent:
            assert failed is not None
            results.extend([failed] * unsent)
        return results

    async def publish_deduplicated(
        self, subject: str, data: bytes, *, msg_id: str, within_s: float = 20.0
    ) -> PubAck:
        """:meth:`publish` with ``Nats-Msg-Id: msg_id``, retried through a lost ack.

        A reconnect (an agent added or removed makes the node re-present its
        credential) loses the ack of a publish in flight, though the message
        was most often stored; a caller that gave up there dropped a task's
        final answer or its last stream chunk (the soak found both). Retried
        with the same id until acked or ``within_s`` has passed: the stream's
        duplicate window (two minutes on MESH_TASKS, §18.8) answers a stored
        repeat with the first copy's ack, so the message is stored once.
        """
        headers = {"Nats-Msg-Id": msg_id}
        deadline = time.monotonic() + within_s
        for delay in backoff(0.2, 2.0):
            try:
                return await self.publish(subject, data, headers=headers)
            except (TransportTimeout, NoResponders, Reconnecting) as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.info("publish %s on %s not acked (%s); retrying", msg_id, subject, type(exc).__name__)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable: backoff() never ends")

    # -- streams --

    async def stream_state(self, stream: str, *, subjects_filter: str | None = None) -> StreamState:
        with translated():
            if subjects_filter is None:
                info = await self._js.stream_info(stream)
            else:
                info = await self._js.stream_info(stream, subjects_filter=subjects_filter)
        return _stream_state(info)

    async def stream_subjects(self, stream: str, subjects_filter: str) -> dict[str, int]:
        """Message counts per subject of ``stream`` matching ``subjects_filter``."""
        with translated():
            info = await self._js.stream_info(stream, subjects_filter=subjects_filter)
        return {str(k): int(v) for k, v in (info.state.subjects or {}).items()}

    async def all_stream_states(self) -> list[StreamState]:
        with translated():
            return [_stream_state(info) for info in await self._js.streams_info()]

    async def delete_stream(self, stream: str) -> None:
        with translated():
            await self._js.delete_stream(stream)

    async def purge_subject(self, stream: str, subject: str) -> None:
        """Remove every message of ``subject`` from ``stream``."""
        with translated():
            await self._js.purge_stream(stream, subject=subject)

    async def last_message(self, stream: str, subject: str, *, direct: bool = False) -> StoredMessage:
        with translated():
            raw = await self._js.get_last_msg(stream, subject, direct=direct)
        return _stored(raw, subject)

    async def message(
        self,
        stream: str,
        *,
        seq: int,
        subject: str | None = None,
        next: bool = False,
        direct: bool = False,
    ) -> StoredMessage:
        """The message at ``seq`` (with ``next``: the first at or after ``seq``, on
        ``subject`` if given)."""
        with translated():
            raw = await self._js.get_msg(stream, seq=seq, subject=subject, next=next, direct=direct)
        return _stored(raw)

    # -- consumers --

    async def reader(self, stream: str, *, start_seq: int, inactive_threshold_s: float = 60.0) -> StreamReader:
        """A :class:`StreamReader` of ``stream`` from ``start_seq`` on (the first
        message at or after it)."""
        name = f"reader_{uuid.uuid4().hex}"
        config = ConsumerConfig(
            name=name,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=max(1, start_seq),
            ack_policy=AckPolicy.NONE,
            inactive_threshold=inactive_threshold_s,
            mem_storage=True,
        )
        with translated():
            await self._js.add_consumer(stream, config=config)
            psub = await self._js.pull_subscribe_bind(consumer=name, stream=stream)
        return StreamReader(self._js, stream, name, psub)

    def mailbox(self, agent_subject: str, stream: str, consumer: str) -> MailboxBuffer:
        """An agent's offline buffer and its drain consumer."""
        return MailboxBuffer(self._js, self._client, agent_subject, stream, consumer)

    async def consumer_state(self, stream: str, consumer: str) -> ConsumerState:
        with translated():
            return _consumer_state(await self._js.consumer_info(stream, consumer))

    async def delete_consumer(self, stream: str, consumer: str) -> None:
        with translated():
            await self._js.delete_consumer(stream, consumer)

    async def consumer_names(self, stream: str, *, timeout: float = 5.0) -> list[str]:
        """Every consumer name on ``stream`` (``$JS.API.CONSUMER.NAMES``, paged by the server).

        Names only: nats-py's ``consumers_info`` reads every consumer's whole
        info (CONSUMER.LIST, 256 a page, each decoded into objects), which at
        2,000 consumers was half a busy daemon's CPU.
        """
        names: list[str] = []
        subject = f"{_JS_API}.CONSUMER.NAMES.{stream}"
        with translated():
            while True:
                reply = await self._client.request(subject, orjson.dumps({"offset": len(names)}), timeout=timeout)
                answer = orjson.loads(reply.data)
                if "error" in answer:
                    raise APIError.from_error(answer["error"])
                page = answer.get("consumers") or []
                names += page
                if not page or len(names) >= int(answer.get("total", 0)):
                    return names

    async def consumer_filters(self, stream: str) -> list[list[str]]:
        """The filter subjects of every consumer on ``stream``, one list per
        consumer (empty: the consumer reads the whole stream)."""
        filters: list[list[str]] = []
        with translated():
            while True:
                page = await self._js.consumers_info(stream, offset=len(filters))
                if not page:
                    return filters
                for info in page:
                    config = info.config
                    one = [config.filter_subject] if config.filter_subject else []
                    filters.append(one + list(config.filter_subjects or []))

    async def ensure_consumer(
        self, stream: str, spec: ConsumerSpec, *, before_create: Callable[[], Awaitable[None]] | None = None
    ) -> ConsumerAction:
        """Create the consumer ``spec`` describes, or assert an existing one's config.

        ``before_create`` is awaited when the consumer does not exist yet, right
        before it is created (a quota check: what it raises stops the creation).

        An existing consumer whose configuration drifted (another party
        retargeted its filter, moved its deliver subject, ...) is updated in
        place, or deleted and created again where the server refuses the
        update (its position is lost then: it pointed elsewhere anyway). Both
        are logged as warnings: they mean someone changed a consumer it did
        not own, or an older version left a different configuration.
        """
        found = await _info_or_create(self._js, stream, spec.name, spec.config(), before_create)
        if found is None:
            return "created"
        drift = spec.drift(found.config)
        if not drift:
            return "bound"
        log.warning("consumer %s on %s drifted (%s): repairing it", spec.name, stream, "; ".join(drift))
        try:
            with translated():
                await self._js.add_consumer(stream, config=spec.config())
            return "updated"
        except TransportError as exc:
            log.warning("consumer %s on %s cannot be updated (%s): recreating it", spec.name, stream, exc)
        try:
            with translated():
                await self._js.delete_consumer(stream, spec.name)
        except NotFound:
            pass
        with translated():
            await self._js.add_consumer(stream, config=spec.config())
        return "recreated"

    async def bind_push(
        self, stream: str, name: str, deliver_subject: str, handler: MessageHandler
    ) -> DurableSubscription:
        """Subscribe to an existing push consumer's deliver subject, acks manual.

        This needs no JetStream API permission at all: the consumer was made
        (and its configuration asserted) by whoever may administer it, and the
        node only listens where it delivers and acks what arrives.
        """
        config = ConsumerConfig(deliver_subject=deliver_subject, ack_policy=AckPolicy.EXPLICIT)
        with translated():
            sub = await self._js.subscribe_bind(stream, config, name, cb=wrap_handler(handler), manual_ack=True)
        return DurableSubscription(sub)

    async def durable_push(
        self,
        subject: str,
        handler: MessageHandler,
        *,
        stream: str,
        durable: str,
        replay: bool,
        max_deliver: int,
        ack_wait_s: float = 30,
    ) -> DurableSubscription:
        """A durable push consumer on ``subject`` with manual, explicit acks: the
        handler acks once it has done the work (§18.6)."""
        config = ConsumerConfig(
            durable_name=durable,
            deliver_policy=DeliverPolicy.ALL if replay else DeliverPolicy.NEW,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_deliver=max_deliver,
            filter_subject=subject,
        )
        with translated():
            sub = await self._js.subscribe(
                subject,
                durable=durable,
                stream=stream,
                config=config,
                cb=wrap_handler(handler),
                manual_ack=True,
            )
        return DurableSubscription(sub)

    async def replay_push(
        self,
        subject: str,
        handler: MessageHandler,
        *,
        stream: str,
        name: str,
        max_deliver: int,
        inactive_threshold_s: float,
        ack_wait_s: float = 30,
    ) -> DurableSubscription:
        """A named (not durable) push consumer delivering ``subject`` from the start,
        reaped by the server once idle for ``inactive_threshold_s``."""
        config = ConsumerConfig(
            name=name,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_deliver=max_deliver,
            filter_subject=subject,
            inactive_threshold=inactive_threshold_s,
        )
        with translated():
            sub = await self._js.subscribe(
                subject, cb=wrap_handler(handler), stream=stream, manual_ack=True, config=config
            )
        return DurableSubscription(sub)

    async def durable_pull(
        self,
        subject: str,
        *,
        stream: str,
        durable: str,
        deliver_all: bool = True,
        ack_wait_s: float = 30,
        max_deliver: int = -1,
        max_ack_pending: int | None = None,
    ) -> PullConsumer:
        """A durable pull consumer (shared by every instance binding the same name)."""
        config = ConsumerConfig(
            durable_name=durable,
            deliver_policy=DeliverPolicy.ALL if deliver_all else DeliverPolicy.NEW,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_deliver=max_deliver,
            filter_subject=subject,
        )
        if max_ack_pending is not None:
            config.max_ack_pending = max_ack_pending
        # Asserted on every bind: nats-py re-uses an existing durable as found,
        # so a consumer retargeted while this node was away would stay wrong.
        await self.ensure_consumer(
            stream,
            ConsumerSpec(
                durable, subject, deliver_all=deliver_all, ack_wait_s=ack_wait_s,
                max_deliver=max_deliver, max_ack_pending=max_ack_pending,
            ),
        )
        with translated():
            psub = await self._js.pull_subscribe(subject, durable=durable, stream=stream, config=config)
        return PullConsumer(psub)

    # -- KV --

    async def key_value(self, bucket: str) -> KeyValue:
        with translated():
            return KeyValue(await self._js.key_value(bucket), bucket, self)
