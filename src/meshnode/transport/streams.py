"""The mesh's JetStream objects (§18.3, §18.4, §16.4), created or updated idempotently.

Every ``ensure_*`` here can run at every start of every service node: an
absent object is created, one that differs in a field we own is updated in
place (other server-side settings are kept), and one that already matches is
left alone. A difference the server refuses to update in place (retention,
storage) is reported as ``"mismatch: ..."`` and logged rather than raised,
because deleting a stream to recreate it would throw away what it holds.

Two stream settings are deliberate rather than defaults:

* ``no_ack`` on every stream bound to subjects that carry request-reply
  traffic (``MESH_REGISTRY``, each ``MESH_INBOX_*``, ``MESH_HEARTBEAT``):
  a capturing stream otherwise answers a request's reply subject with its
  PubAck, racing the real answer and defeating the no-responders liveness
  signal (§18.7).
* a duplicate window of at least two minutes on ``MESH_TASKS`` and
  ``MESH_EVENTS`` (§18.3, §18.8), so a republished ``Nats-Msg-Id`` dedups.

And every object is bounded (:class:`StreamLimits`, issue #22.3): each stream
and bucket has a ``max_bytes``, so nats-server *reserves* that much of the
account's store for it when it is created (and refuses the creation, error
10047, when the reservations would exceed the account's limit). What one
participant can write into a stream it may publish on (``MESH_TASKS``,
``MESH_EVENTS``, ``MESH_FEED``, ``MESH_HEARTBEAT``, the mailboxes) can then
never eat into the registry's, the task records' or the artifacts' share.
The participant-writable streams also carry ``max_msg_size``, refused at the
publisher's PubAck (10054 "message size exceeds maximum allowed"), and the
streams that hold a consumer per subscription or per task followed carry
``max_consumers`` (nats-server 2.15 caps a stream that sets none at 1,000).
Discard policy per stream:

* the shared streams discard the **oldest** message at their bound: a flood
  evicts history (which the task manager and feed writer already folded into
  their buckets) instead of refusing every legitimate update for the next
  seven days;
* a mailboxes discards **new** messages at its bound (``max_bytes`` and
  ``max_msgs``): "nothing lost while you are away" (§16.4) holds against a
  hostile sender, whose flood is refused while what was buffered before it
  stays; the drain purges what it has committed, so the bound only ever
  holds mail not yet taken in (issue #22.4).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamSource,
)
from nats.js.errors import APIError, NotFoundError

from meshnode.protocol import subjects
from meshnode.protocol.artifacts import INDEX_BUCKET, OBJECT_STORE_BUCKET, UPLOADS_BUCKET

from .errors import translated
from .jetstream import JetStream

__all__ = [
    "DAY_S",
    "METERING_MAX_AGE_S",
    "DEFAULT_MAILBOX_BYTES",
    "DEFAULT_MAILBOX_MSGS",
    "STREAM_LIST_PAGE",
    "SweepCursor",
    "DEFAULT_STREAM_LIMITS",
    "StreamLimits",
    "agreements_bucket_config",
    "artifact_buckets",
    "ensure_object_store",
    "DUPLICATE_WINDOW_S",
    "EnsureOutcome",
    "ensure_inbox_stream",
    "ensure_key_value",
    "ensure_mesh_streams",
    "ensure_stream",
    "purge_acked_mailboxes",
    "purge_acked_page",
    "feed_state_bucket_config",
    "feed_stream_config",
    "inbox_stream_config",
    "mesh_stream_configs",
    "metering_stream_config",
    "registry_bucket_config",
    "tasks_bucket_config",
    "wait_jetstream_ready",
]

log = logging.getLogger("meshnode.services.streams")  # the name operators filter on

DAY_S = 24 * 3600
DUPLICATE_WINDOW_S = 120.0
EnsureOutcome = Literal["created", "updated", "unchanged"] | str

_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """The byte bound of every stream and bucket the platform creates.

    Each is that object's ``max_bytes`` and so its reservation in the
    account's JetStream store (module docstring); :meth:`platform_total` is
    what one account's platform objects reserve before the first mailbox.
    ``max_msg_size`` bounds one message on the participant-writable streams.
    Configured under ``[storage]``; the defaults total 808 MiB.
    """

    tasks: int = 64 * _MIB
    """``MESH_TASKS``: task updates and stream chunks in flight (participant-writable)."""
    events: int = 32 * _MIB
    """``MESH_EVENTS`` (participant-writable)."""
    feed: int = 32 * _MIB
    """``MESH_FEED`` (participant-writable)."""
    heartbeat: int = 8 * _MIB
    """``MESH_HEARTBEAT`` (each node its own subject)."""
    registry_events: int = 8 * _MIB
    """``MESH_REGISTRY`` (written by the registry service)."""
    metering: int = 16 * _MIB
    """``MESH_METERING``: the meter events the rating service folds (sourced from MESH_EVENTS)."""
    registry: int = 32 * _MIB
    """KV ``mesh_registry``: manifests."""
    task_records: int = 64 * _MIB
    """KV ``mesh_tasks``: the authoritative task records."""
    feed_state: int = 16 * _MIB
    """KV ``mesh_feed_state``."""
    artifacts: int = 512 * _MIB
    """The artifact object store (all owners together; each owner also has its quota)."""
    artifact_index: int = 8 * _MIB
    artifact_uploads: int = 8 * _MIB
    agreements: int = 8 * _MIB
    """KV ``mesh_agreements``: the agreements registered with the platform (§19.5)."""
    max_msg_size: int = 1 * _MIB
    """One message on ``MESH_TASKS``, ``MESH_EVENTS``, ``MESH_FEED``, ``MESH_HEARTBEAT``."""
    max_consumers: int = 100_000
    """Consumers on ``MESH_TASKS``, ``MESH_EVENTS`` and ``MESH_FEED`` (one per agent's
    event or feed subscription, one per task followed). Always set: nats-server 2.15
    gives a stream that sets none a limit of 1,000 (and reads 0 or -1 as "its
    default"), so the 1,001st agent with an event subscription failed to start."""

    def platform_total(self) -> int:
        """Bytes the platform objects of one account reserve (mailboxes not included)."""
        return sum(
            getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_BYTES
        )


#: StreamLimits fields that are no reservation in the store.
_NOT_BYTES = ("max_msg_size", "max_consumers")


DEFAULT_STREAM_LIMITS = StreamLimits()


# The fields a mesh stream definition owns; anything else on an existing
# stream (placement, metadata, server defaults) is left as the server has it.
_OWNED_FIELDS = (
    "subjects",
    "retention",
    "max_age",
    "max_bytes",
    "max_msgs",
    "max_msg_size",
    "discard",
    "no_ack",
    "duplicate_window",
    "num_replicas",
    "storage",
    "max_consumers",
)


def mesh_stream_configs(
    replicas: int, limits: StreamLimits = DEFAULT_STREAM_LIMITS
) -> list[StreamConfig]:
    """The core streams of §18.3 (``replicas`` per the table: R3 where it says 3,
    capped by the cluster; ``MESH_HEARTBEAT`` is always R1), bounded by ``limits``."""
    return [
        StreamConfig(
            name=subjects.MESH_REGISTRY,
            description="Registration events (AgentMesh §18.3)",
            subjects=["mesh.registry.>"],
            retention=RetentionPolicy.LIMITS,
            max_age=DAY_S,
            max_bytes=limits.registry_events,
            discard=DiscardPolicy.OLD,
            storage=StorageType.FILE,
            num_replicas=replicas,
            no_ack=True,
        ),
        StreamConfig(
            name=subjects.MESH_TASKS,
            description="Task update delivery and redelivery buffer (AgentMesh §18.3)",
            # The update and stream grammar rather than the mesh.task.> prefix
            # (the §18.3 MESH_FEED reasoning): a prefix binding would capture the
            # request-reply lookup mesh.task.get.{id} and answer its reply subject
            # with a PubAck that races the task manager's real answer.
            subjects=["mesh.task.*.update", "mesh.task.*.stream"],
            retention=RetentionPolicy.LIMITS,
            max_age=7 * DAY_S,
            max_bytes=limits.tasks,
            max_msg_size=limits.max_msg_size,
            max_consumers=limits.max_consumers,
            discard=DiscardPolicy.OLD,
            storage=StorageType.FILE,
            num_replicas=replicas,
            duplicate_window=DUPLICATE_WINDOW_S,
        ),
        StreamConfig(
            name=subjects.MESH_EVENTS,
            description="Domain events (AgentMesh §18.3)",
            subjects=["mesh.event.>"],
            retention=RetentionPolicy.INTEREST,
            max_age=DAY_S,
            max_bytes=limits.events,
            max_msg_size=limits.max_msg_size,
            max_consumers=limits.max_consumers,
            discard=DiscardPolicy.OLD,
            storage=StorageType.FILE,
            num_replicas=replicas,
            duplicate_window=DUPLICATE_WINDOW_S,
        ),
        StreamConfig(
            name=subjects.MESH_HEARTBEAT,
            description="Node heartbeats for presence (AgentMesh §18.3)",
            subjects=["mesh.heartbeat.>"],
            retention=RetentionPolicy.LIMITS,
            max_age=300,
            max_bytes=limits.heartbeat,
            max_msg_size=limits.max_msg_size,
            discard=DiscardPolicy.OLD,
            storage=StorageType.FILE,
            num_replicas=1,
            no_ack=True,
        ),
        metering_stream_config(replicas, limits),
    ]


#: How long MESH_METERING keeps a meter event (its byte bound may evict sooner).
METERING_MAX_AGE_S = 90 * DAY_S


def metering_stream_config(replicas: int, limits: StreamLimits = DEFAULT_STREAM_LIMITS) -> StreamConfig:
    """``MESH_METERING`` (§13.5 "persist events durably"): the ``mesh.event.metering.>``
    messages of ``MESH_EVENTS``, copied by the server (a stream source) into a
    stream with *limits* retention, so the rating service can read it from the
    first sequence on every start and fold the same ledger each time.

    Why a sourced stream and not a second subject binding: JetStream refuses two
    streams on overlapping subjects, and MESH_EVENTS (interest retention) drops
    a message once its consumers have acked it, which makes it no replay source.
    The copy is bounded like every platform object (``[storage] metering_max_bytes``)
    and discards the oldest events first; the ledger spans what it holds.
    """
    return StreamConfig(
        name=subjects.MESH_METERING,
        description="Meter events, receipts and charges for rating (AgentMesh §13.5, §19.6)",
        sources=[StreamSource(name=subjects.MESH_EVENTS, filter_subject=subjects.METERING_EVENTS)],
        retention=RetentionPolicy.LIMITS,
        max_age=METERING_MAX_AGE_S,
        max_bytes=limits.metering,
        max_msg_size=limits.max_msg_size,
        discard=DiscardPolicy.OLD,
        storage=StorageType.FILE,
        num_replicas=replicas,
    )


def registry_bucket_config(
    replicas: int, limits: StreamLimits = DEFAULT_STREAM_LIMITS
) -> KeyValueConfig:
    """KV ``mesh_registry``: manifests keyed by agent id, no TTL, latest only (§18.4)."""
    return KeyValueConfig(
        bucket=subjects.KV_REGISTRY,
        description="Agent manifests (AgentMesh §9.1, §18.4)",
        history=1,
        ttl=None,
        max_bytes=limits.registry,
        storage=StorageType.FILE,
        replicas=replicas,
    )


def tasks_bucket_config(
    replicas: int, limits: StreamLimits = DEFAULT_STREAM_LIMITS
) -> KeyValueConfig:
    """KV ``mesh_tasks``: authoritative task state keyed by task id, 7-day TTL (§18.4)."""
    return KeyValueConfig(
        bucket=subjects.KV_TASKS,
        description="Task state (AgentMesh §7.4, §18.4)",
        history=1,
        ttl=7 * DAY_S,
        max_bytes=limits.task_records,
        storage=StorageType.FILE,
        replicas=replicas,
    )


def feed_stream_config(replicas: int, limits: StreamLimits = DEFAULT_STREAM_LIMITS) -> StreamConfig:
    """``MESH_FEED``: stream-feed history (§6.6a, §18.3).

    Bound to the four-token feed grammar ``mesh.feed.*.*`` and never the
    ``mesh.feed.>`` prefix, which would also capture the three-token lookup
    subject ``mesh.feed.get`` and send the stream's PubAck to the lookup's
    reply subject ahead of the real answer. Interest retention, like
    MESH_EVENTS, with the same two-minute duplicate window (§18.8).
    """
    return StreamConfig(
        name=subjects.FEED_STREAM,
        description="Owner-rooted feed history (AgentMesh §6.6a, §18.3)",
        subjects=[subjects.FEED_GRAMMAR],
        retention=RetentionPolicy.INTEREST,
        max_age=DAY_S,
        max_bytes=limits.feed,
        max_msg_size=limits.max_msg_size,
        max_consumers=limits.max_consumers,
        discard=DiscardPolicy.OLD,
        storage=StorageType.FILE,
        num_replicas=replicas,
        duplicate_window=DUPLICATE_WINDOW_S,
    )


def feed_state_bucket_config(
    replicas: int, limits: StreamLimits = DEFAULT_STREAM_LIMITS
) -> KeyValueConfig:
    """KV ``mesh_feed_state``: the latest emit envelope of each state feed, keyed
    ``{agent_id}.{topic}`` (§18.3); latest only, no TTL."""
    return KeyValueConfig(
        bucket=subjects.KV_FEED_STATE,
        description="Current value of each state feed (AgentMesh §6.6a, §18.3)",
        history=1,
        ttl=None,
        max_bytes=limits.feed_state,
        storage=StorageType.FILE,
        replicas=replicas,
    )


def agreements_bucket_config(
    replicas: int, limits: StreamLimits = DEFAULT_STREAM_LIMITS
) -> KeyValueConfig:
    """KV ``mesh_agreements``: one record per (consumer owner, seller agent, SKU),
    latest only, no TTL (an agreement lasts until it expires or is revoked; the
    agreement service bounds how many one owner holds)."""
    return KeyValueConfig(
        bucket=subjects.KV_AGREEMENTS,
        description="Agreements registered with the platform (AgentMesh §19.5)",
        history=1,
        ttl=None,
        max_bytes=limits.agreements,
        storage=StorageType.FILE,
        replicas=replicas,
    )


_MAILBOX_PREFIX = "MESH_INBOX_"
DEFAULT_MAILBOX_BYTES = 8 * _MIB
DEFAULT_MAILBOX_MSGS = 2000


def inbox_stream_config(
    agent_id: str,
    *,
    max_age_s: float = 7 * DAY_S,
    max_bytes: int = DEFAULT_MAILBOX_BYTES,
    max_msgs: int = DEFAULT_MAILBOX_MSGS,
    replicas: int = 1,
    discard: Literal["new", "old"] = "new",
) -> StreamConfig:
    """``MESH_INBOX_{agent_id}``: the agent's redelivery buffer (§16.4, §18.3).

    Limits retention, bounded by age, size and count, and ``no_ack`` so
    capturing a request never answers its reply subject. At its bound it
    discards **new** mail: a flood is refused rather than evicting the
    requests buffered before it (issue #22.4); the node's drain purges what it
    has committed, so the bound holds only mail not yet taken in.
    ``discard="old"`` is the earlier eviction, for meshes whose clients neither
    purge nor ack their mailbox (``[inbox] buffer_discard``).
    """
    return StreamConfig(
        name=subjects.inbox_stream_name(agent_id),
        description="Per-agent offline redelivery buffer (AgentMesh §16.4)",
        subjects=[subjects.agent_inbox(agent_id)],
        retention=RetentionPolicy.LIMITS,
        max_age=max_age_s,
        max_bytes=max_bytes,
        max_msgs=max_msgs,
        discard=DiscardPolicy.NEW if discard == "new" else DiscardPolicy.OLD,
        storage=StorageType.FILE,
        num_replicas=replicas,
        no_ack=True,
    )


def artifact_buckets(
    replicas: int, limits: StreamLimits = DEFAULT_STREAM_LIMITS
) -> tuple[ObjectStoreConfig, KeyValueConfig, KeyValueConfig]:
    """The object store and the two KV buckets the artifact service owns (§18.5)."""
    store = ObjectStoreConfig(
        bucket=OBJECT_STORE_BUCKET,
        description="Artifact bytes (AgentMesh §7.5, §18.5)",
        storage=StorageType.FILE,
        replicas=replicas,
        max_bytes=limits.artifacts,
    )
    index = KeyValueConfig(
        bucket=INDEX_BUCKET,
        description="Artifact metadata by object id (AgentMesh §18.5)",
        history=1,
        storage=StorageType.FILE,
        replicas=replicas,
        max_bytes=limits.artifact_index,
    )
    uploads = KeyValueConfig(
        bucket=UPLOADS_BUCKET,
        description="Artifact uploads in progress (meshnode)",
        history=1,
        storage=StorageType.FILE,
        replicas=replicas,
        max_bytes=limits.artifact_uploads,
    )
    return store, index, uploads


def _normalized(field: str, value: Any) -> Any:
    if field == "subjects":
        return sorted(value or [])
    if field in ("max_age", "duplicate_window"):
        return float(value or 0)
    if field in ("max_bytes", "max_msgs", "max_msg_size", "max_consumers"):
        return -1 if value in (None, 0) else int(value)
    if field in ("retention", "discard", "storage"):
        return getattr(value, "value", value)
    return value


def _differences(want: StreamConfig, have: StreamConfig) -> list[str]:
    diffs = []
    for name in _OWNED_FIELDS:
        wanted = getattr(want, name)
        if wanted is None:
            continue
        if name == "duplicate_window" and not wanted:
            continue  # 0 means "server default"; nothing to enforce
        if _normalized(name, wanted) != _normalized(name, getattr(have, name)):
            diffs.append(name)
    return diffs


async def ensure_stream(
    jetstream: JetStream, config: StreamConfig, *, create_first: bool = False
) -> EnsureOutcome:
    """Create ``config``'s stream, or bring the fields it owns up to date.

    Returns ``"created"``, ``"updated"``, ``"unchanged"``, or ``"mismatch:
    <fields>"`` when the server refused the update (logged).

    ``create_first`` is for a stream the caller expects not to exist yet (a
    new agent's mailbox): the create is sent without looking the stream up
    first, one JetStream call instead of two. A stream that does exist with
    exactly this configuration is then reported ``"created"`` too (the server
    accepts an identical create); one that differs is looked up and updated
    as usual.
    """
    with translated():
        return await _ensure_stream(jetstream, config, create_first=create_first)


async def _ensure_stream(
    jetstream: JetStream, config: StreamConfig, *, create_first: bool = False
) -> EnsureOutcome:
    js = jetstream.native
    assert config.name is not None
    if create_first:
        try:
            await js.add_stream(config)
            return "created"
        except APIError as exc:
            if exc.err_code != 10058:  # "already in use" with another configuration
                raise
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        try:
            await js.add_stream(config)
            return "created"
        except APIError as exc:
            if exc.err_code != 10058:  # "already in use": a concurrent creator won the race
                raise
            info = await js.stream_info(config.name)
    diffs = _differences(config, info.config)
    if not diffs:
        return "unchanged"
    merged = dataclasses.replace(
        info.config, **{name: getattr(config, name) for name in diffs}
    )
    try:
        await js.update_stream(merged)
    except APIError as exc:
        log.warning(
            "stream %s differs in %s and the server refused the update: %s",
            config.name,
            ", ".join(diffs),
            exc.description,
        )
        return f"mismatch: {', '.join(diffs)}"
    return "updated"


async def ensure_key_value(jetstream: JetStream, config: KeyValueConfig) -> EnsureOutcome:
    """Create the KV bucket, or bring its TTL, history and replicas up to date."""
    with translated():
        return await _ensure_key_value(jetstream, config)


async def _ensure_key_value(jetstream: JetStream, config: KeyValueConfig) -> EnsureOutcome:
    js = jetstream.native
    stream = f"KV_{config.bucket}"
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        try:
            await js.create_key_value(config)
            return "created"
        except APIError as exc:
            if exc.err_code != 10058:
                raise
            info = await js.stream_info(stream)
    want = StreamConfig(
        max_age=config.ttl or 0.0,
        max_msgs_per_subject=config.history,
        num_replicas=config.replicas,
        max_bytes=config.max_bytes,
    )
    have = info.config
    diffs = [
        name
        for name, wanted, current in (
            ("max_age", float(want.max_age or 0), float(have.max_age or 0)),
            ("max_msgs_per_subject", want.max_msgs_per_subject, have.max_msgs_per_subject),
            ("num_replicas", want.num_replicas, have.num_replicas),
            ("max_bytes", _normalized("max_bytes", want.max_bytes), _normalized("max_bytes", have.max_bytes)),
        )
        if wanted != current
    ]
    if not diffs:
        return "unchanged"
    merged = dataclasses.replace(have, **{name: getattr(want, name) for name in diffs})
    try:
        await js.update_stream(merged)
    except APIError as exc:
        log.warning("bucket %s differs in %s: %s", config.bucket, ", ".join(diffs), exc.description)
        return f"mismatch: {', '.join(diffs)}"
    return "updated"


async def ensure_object_store(jetstream: JetStream, config: ObjectStoreConfig) -> EnsureOutcome:
    """Create the object store, or bring its ``max_bytes`` up to date (the rest of
    an existing store's config is left as it is)."""
    js = jetstream.native
    with translated():
        try:
            info = await js.stream_info(f"OBJ_{config.bucket}")
        except NotFoundError:
            with contextlib.suppress(APIError):  # a concurrent instance created it first
                await js.create_object_store(str(config.bucket), config=config)
            return "created"
        if _normalized("max_bytes", config.max_bytes) == _normalized("max_bytes", info.config.max_bytes):
            return "unchanged"
        try:
            await js.update_stream(dataclasses.replace(info.config, max_bytes=config.max_bytes))
        except APIError as exc:
            log.warning("object store %s: max_bytes not updated: %s", config.bucket, exc.description)
            return "mismatch: max_bytes"
        return "updated"


async def ensure_inbox_stream(
    js: JetStream,
    agent_id: str,
    *,
    max_age_s: float = 7 * DAY_S,
    max_bytes: int = DEFAULT_MAILBOX_BYTES,
    max_msgs: int = DEFAULT_MAILBOX_MSGS,
    replicas: int = 1,
    discard: Literal["new", "old"] = "new",
    fresh: bool = False,
) -> EnsureOutcome:
    """Create or update ``MESH_INBOX_{agent_id}`` (see :func:`inbox_stream_config`).

    ``fresh``: the caller knows of no such mailbox (a first registration), so
    the create goes first (:func:`ensure_stream` ``create_first``)."""
    return await ensure_stream(
        js,
        inbox_stream_config(
            agent_id,
            max_age_s=max_age_s,
            max_bytes=max_bytes,
            max_msgs=max_msgs,
            replicas=replicas,
            discard=discard,
        ),
        create_first=fresh,
    )


#: Stream infos in one page of the JetStream API's STREAM.LIST (fixed by the server).
STREAM_LIST_PAGE = 256


class SweepCursor:
    """Where the mailbox sweep is in the stream listing (issue #21).

    The sweep reads one page of STREAM.LIST per tick instead of the whole
    listing: at 10,000 agents the full listing was 40 pages a minute, most of
    the registry's idle cost and a source of timeouts under load. ``offset`` is
    the next page's start; a short (or empty) page was the last, so the next
    tick starts over and ``passes`` counts one more complete pass.

    Streams created or deleted between two pages shift the listing (it is
    ordered by name): a mailbox may then be seen twice or skipped for one pass.
    Both are harmless: a purge up to the ack floor is idempotent, and the next
    pass sees a skipped one.
    """

    def __init__(self, page_size: int = STREAM_LIST_PAGE) -> None:
        self.page_size = page_size
        self.offset = 0
        self.passes = 0

    def advance(self, listed: int) -> None:
        """Move past a page that listed ``listed`` streams."""
        if listed < self.page_size:
            self.offset = 0
            self.passes += 1
        else:
            self.offset += listed


async def purge_acked_page(jetstream: JetStream, offset: int = 0) -> tuple[dict[str, int], int]:
    """Purge the mailboxes of one page of the stream listing (from ``offset``) up
    to what their drain consumer has acked; returns the purged mailboxes with
    the sequence each was purged through, and how many streams the page listed
    (fewer than :data:`STREAM_LIST_PAGE`: it was the last page).

    The platform's half of the discard-new mailbox (issue #22.4): a meshnode
    node purges its own mailbox after a drain, but any client that drains
    through the §18.6 durable (``inbox_{agent}``) and acks gets the same room
    back here, without a purge grant. A mailbox without that consumer, or
    with nothing acked past its first message, is left alone; so is an empty
    one (no consumer look-up at all: the listing carries each stream's state).
    """
    js = jetstream.native
    purged: dict[str, int] = {}
    with translated():
        page = await js.streams_info(offset=offset)
        for info in page:
            name = str(info.config.name)
            if not name.startswith(_MAILBOX_PREFIX) or not info.state.messages:
                continue
            try:
                durable = subjects.inbox_consumer_name(name[len(_MAILBOX_PREFIX):])
                consumer = await js.consumer_info(name, durable)
            except (NotFoundError, ValueError):
                continue  # nobody drains it through the §18.6 durable (or not an agent's)
            floor = int(consumer.ack_floor.stream_seq or 0) if consumer.ack_floor else 0
            if floor >= int(info.state.first_seq or 0):
                await js.purge_stream(name, seq=floor + 1)
                purged[name] = floor
    return purged, len(page)


async def purge_acked_mailboxes(jetstream: JetStream) -> dict[str, int]:
    """:func:`purge_acked_page` over the whole listing, page after page (one
    complete pass; the registry's sweep takes one page per tick instead)."""
    purged: dict[str, int] = {}
    cursor = SweepCursor()
    while cursor.passes == 0:
        page, listed = await purge_acked_page(jetstream, cursor.offset)
        purged.update(page)
        cursor.advance(listed)
    return purged


async def ensure_mesh_streams(
    js: JetStream, replicas: int, limits: StreamLimits = DEFAULT_STREAM_LIMITS
) -> dict[str, EnsureOutcome]:
    """Create or update every core stream and KV bucket of §18.3/§18.4.

    Returns each object's name with what happened to it. ``replicas`` is
    ``min(3, cluster size)``; 1 on the embedded mesh.
    """
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    outcomes: dict[str, EnsureOutcome] = {}
    for config in mesh_stream_configs(replicas, limits):
        assert config.name is not None
        outcomes[config.name] = await ensure_stream(js, config)
    for bucket in (registry_bucket_config(replicas, limits), tasks_bucket_config(replicas, limits)):
        outcomes[bucket.bucket] = await ensure_key_value(js, bucket)
    return outcomes


async def wait_jetstream_ready(jetstream: JetStream, *, timeout: float = 20.0) -> bool:
    """Wait until JetStream answers and every stream has a leader; False on timeout.

    A cluster that was just (re)started answers clients before its streams
    have elected leaders, and a service that creates or opens them in that
    window gets timeouts. Returns False (logged) when ``timeout`` passes first,
    e.g. because an R1 stream's only server is down for good; the caller then
    starts anyway and the objects it cannot reach fail on their own.
    """
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while True:
        try:
            infos = await jetstream.native.streams_info()
        except Exception as exc:  # timeouts and 503s while the cluster recovers
            last = f"{type(exc).__name__}: {exc}"
        else:
            leaderless = [
                str(info.config.name) for info in infos
                if info.cluster is not None and not info.cluster.leader
            ]
            if not leaderless:
                return True
            last = f"no leader yet for {', '.join(sorted(leaderless)[:5])}"
        if time.monotonic() >= deadline:
            log.warning("JetStream not ready after %.0fs (%s); starting anyway", timeout, last)
            return False
        await asyncio.sleep(0.5)
