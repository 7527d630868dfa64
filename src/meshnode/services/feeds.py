"""The feed service (§6.6a, §18.3): MESH_FEED, the state-feed KV and ``mesh.feed.get``.

Three duties, all on the service node:

**Objects.** ``MESH_FEED`` bound to the four-token grammar ``mesh.feed.*.*``
(interest retention, two-minute duplicate window) and the KV bucket
``mesh_feed_state``; both created or updated idempotently at start.

**The state writer.** The platform keeps the latest emit envelope of each
*state* feed under ``{agent_id}.{topic}``, written on delivery. It is a
durable pull consumer (``mesh_feed_state_writer``, which several service
nodes share: each message reaches one of them) on MESH_FEED rather than a core subscription, so a
service node that was briefly disconnected catches up instead of leaving a
stale value; and it is the platform rather than the publisher's node because
(a) one writer applies one ordering rule for every SDK's publishers, (b)
participants need no KV write grant, and (c) a publish and its state record
cannot diverge when the publisher's node dies between the two. The writer
verifies the signature, refuses an envelope whose ``from`` is not the
subject's owner (the broker grant says only which *node* published), and
replaces the stored value only with a newer one (ts, then id), with a
revision-checked compare-and-set so concurrent writers cannot regress it.

**The lookup.** ``mesh.feed.get`` (queue group ``mesh_feed``): request
payload ``{agent, topic}``, answer ``{found, envelope}`` — how a late
subscriber reads the current value without replaying history. The caller
subscribes to the feed first (subscribe before snapshot, §9.6).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Mapping
from typing import Any

from meshnode.protocol import subjects
from meshnode.protocol.canonical import parse_json
from meshnode.protocol.envelope import decode_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.feeds import (
    FeedRefused,
    check_feed_envelope,
    lookup_response,
    parse_lookup_request,
    supersedes,
)
from meshnode.transport.connection import Message
from meshnode.transport.errors import Conflict, NotFound
from meshnode.transport.jetstream import KeyValue, PullConsumer
from meshnode.transport.streams import (
    ensure_key_value,
    ensure_stream,
    feed_state_bucket_config,
    feed_stream_config,
)

from .base import Envelope, ServiceBase, ServiceContext

__all__ = ["WRITER_CONSUMER", "FeedService"]

WRITER_CONSUMER = "mesh_feed_state_writer"
# One message per pull: nats-py's fetch of a larger batch waits for the whole
# batch (or the timeout) once the first message is in, which would delay a
# state value by up to the timeout; one at a time it is written on arrival.
_FETCH_BATCH = 1
_FETCH_TIMEOUT_S = 1.0
_CAS_ATTEMPTS = 5


class FeedService(ServiceBase):
    """MESH_FEED and the state-feed binding; see the module docstring."""

    def __init__(self, ctx: ServiceContext) -> None:
        super().__init__(ctx, name="feeds", queue="mesh_feed")
        self._kv: KeyValue | None = None
        self._pull: PullConsumer | None = None
        self.stats: Counter[str] = Counter()

    async def start(self) -> None:
        if self.running:
            return
        js = self.ctx.connection.jetstream
        await ensure_stream(js, feed_stream_config(self.ctx.replicas, self.ctx.stream_limits))
        await ensure_key_value(js, feed_state_bucket_config(self.ctx.replicas, self.ctx.stream_limits))
        self._kv = await js.key_value(subjects.KV_FEED_STATE)
        self._running = True

        # A pull consumer, not a push consumer with a deliver group: a push
        # consumer's deliver subject is fixed when the first service node creates
        # it, under that node's private reply prefix, which no other service node
        # may subscribe to. Pulled, every service node shares the one durable.
        await self._retire_push_writer()
        self._pull = await js.durable_pull(
            subjects.FEED_GRAMMAR,
            stream=subjects.FEED_STREAM,
            durable=WRITER_CONSUMER,
            deliver_all=True,
            ack_wait_s=30,
            max_deliver=5,
        )
        self.spawn(self._consume, "state-writer")
        await self.serve(subjects.FEED_GET, self._get)
        await self.ctx.connection.flush()

    # -- the writer --------------------------------------------------------------

    async def _retire_push_writer(self) -> None:
        """Delete the writer consumer if an earlier version created it as a push
        consumer (it cannot be turned into a pull consumer in place)."""
        js = self.ctx.connection.jetstream
        try:
            info = await js.consumer_state(subjects.FEED_STREAM, WRITER_CONSUMER)
        except NotFound:
            return
        if info.push_bound:
            self.log.info("replacing the push consumer %s with a pull consumer", WRITER_CONSUMER)
            with contextlib.suppress(NotFound):
                await js.delete_consumer(subjects.FEED_STREAM, WRITER_CONSUMER)

    async def _consume(self) -> None:
        await self.consume_pull(
            lambda: self._pull,
            self._on_feed,
            batch=_FETCH_BATCH,
            timeout_s=_FETCH_TIMEOUT_S,
            retry_s=_FETCH_TIMEOUT_S,
            what="feed messages",
        )

    async def _on_feed(self, msg: Message) -> None:
        try:
            await self.record(msg.subject, msg.data)
        except Exception:
            self.log.exception("recording a feed value from %s failed", msg.subject)
            # Let JetStream redeliver (max_deliver bounds it): the value may be newer.
            return
        with contextlib.suppress(Exception):  # unacked: redelivered, and judged again
            await msg.ack()

    async def record(self, subject: str, data: bytes) -> str:
        """Judge one delivered feed message and keep it when it is a newer state value.

        Returns what happened: ``stored``, ``stale`` (not newer than the kept
        value), ``stream`` (nothing to keep), or ``refused:<reason>``.
        """
        kv = self._kv
        if kv is None:
            raise RuntimeError("the feed service is not started")
        try:
            env = decode_envelope(data)
            payload = check_feed_envelope(env, subject)
        except ProtocolError as exc:
            return self._refused(exc.code.lower(), subject, exc.message)
        except FeedRefused as exc:
            return self._refused(exc.reason, subject, str(exc))
        if payload.kind != "state":
            self.stats["stream"] += 1
            return "stream"
        key = subjects.feed_state_key(env["from"], payload.topic)
        for _ in range(_CAS_ATTEMPTS):
            try:
                entry = await kv.get(key)
            except NotFound:  # also a deleted key
                try:
                    await kv.create(key, data)
                except Conflict:
                    continue  # another writer got there first; judge against its value
                self.stats["stored"] += 1
                return "stored"
            current = _stored_envelope(entry.value)
            if not supersedes(env, current):
                self.stats["stale"] += 1
                return "stale"
            assert entry.revision is not None
            try:
                await kv.update(key, data, last=entry.revision)
            except Conflict:
                continue
            self.stats["stored"] += 1
            return "stored"
        self.stats["contended"] += 1
        raise RuntimeError(f"feed state {key} kept changing under the writer")

    def _refused(self, reason: str, subject: str, detail: str) -> str:
        self.stats[f"refused.{reason}"] += 1
        self.log.warning("feed message on %s refused (%s): %s", subject, reason, detail)
        return f"refused:{reason}"

    # -- the lookup --------------------------------------------------------------

    async def _get(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        agent, topic = parse_lookup_request(env.get("payload"))
        kv = self._kv
        if kv is None:
            raise ProtocolError("AGENT_UNAVAILABLE", "the feed service is starting")
        try:
            entry = await kv.get(subjects.feed_state_key(agent, topic))
        except NotFound:
            self.stats["lookup.missing"] += 1
            return lookup_response(None)
        stored = _stored_envelope(entry.value)
        self.stats["lookup.found" if stored is not None else "lookup.missing"] += 1
        return lookup_response(stored)

    async def stop(self) -> None:
        await super().stop()
        pull, self._pull = self._pull, None
        if pull is not None:
            with contextlib.suppress(Exception):
                await pull.unsubscribe()
        self._kv = None


def _stored_envelope(value: bytes | None) -> dict[str, Any] | None:
    if not value:
        return None
    try:
        parsed = parse_json(value)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None
