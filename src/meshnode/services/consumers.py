"""The consumer service: participants' consumers on the shared streams, made by the platform.

**Why a service.** §18.6 names every consumer a node keeps on a shared stream
after its owner *and* something only known at run time: the event consumer
``mesh_event_{agent}_{hash}`` hashes the subscribed pattern, a feed consumer
``mesh_feed_{agent}_{hash}`` the feed subject, a task consumer
``mesh_task_{task}_{requester}`` carries the task id. nats-server's permissions
match whole subject tokens, so no grant in a node's credential can say "the
consumers whose *name* starts with ``mesh_event_{my agent}_``"; a grant on
``$JS.API.CONSUMER.*.MESH_EVENTS.>`` lets a participant retarget, drain or
delete anyone's consumer, the task manager's included (#22). So participants
hold no consumer-management grant on ``MESH_TASKS``, ``MESH_EVENTS`` and
``MESH_FEED`` at all, and ask this service (service role, ``$JS.API.>``):

* ``mesh.consumers.ensure.{node_id}`` (connection-bound: the broker lets a node
  publish only its own token) with a signed request from the agent the
  consumer is for. The service derives the consumer's **name and whole
  configuration** from the request (§18.6), so a participant can neither pick
  another agent's name (the agent is the verified ``from``) nor a filter the
  name does not stand for (the name hashes the filter). The deliver subject
  must lie under the node's own private inbox prefix (``_INBOX_{node_id}.``),
  so deliveries reach that node only. An existing consumer whose configuration
  drifted is repaired (:meth:`JetStream.ensure_consumer`), never re-used as found.
* ``mesh.consumers.delete.{node_id}``: the same request, deleting the consumer.

The answer names the consumer and its deliver subject; the node then binds
the push consumer itself (:meth:`JetStream.bind_push`), which needs no API
permission, and acks what it receives.

**Bounds.** An agent holds at most ``max_per_agent`` consumers per stream
(QUOTA_EXCEEDED to the requester, naming the limit and the stream), counted
by :class:`_Holdings`; task consumers are additionally reaped by the server
after 120 s idle, and the shared streams carry a ``max_consumers`` ceiling
(:mod:`meshnode.transport.streams`; past it, QUOTA_EXCEEDED too).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from meshnode.node.singleflight import SingleFlightCache
from meshnode.protocol import subjects
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import Prefix, is_valid_public
from meshnode.protocol.subjects import SubjectError
from meshnode.transport.connection import Message
from meshnode.transport.errors import ConsumerLimit, NotFound
from meshnode.transport.jetstream import ConsumerSpec
from meshnode.transport.permissions import node_inbox_prefix

from .base import Envelope, ServiceBase, ServiceContext

__all__ = [
    "DEFAULT_MAX_PER_AGENT",
    "LISTING_TTL_S",
    "TASK_CONSUMER_IDLE_S",
    "ConsumerService",
    "consumer_owner",
    "consumer_spec",
]

DEFAULT_MAX_PER_AGENT = 256
"""Consumers one agent may hold on one shared stream (``services.max_consumers_per_agent``)."""

TASK_CONSUMER_IDLE_S = 120.0
"""A task consumer left behind (its node died mid-wait) is reaped after this long idle."""

_KINDS = ("event", "feed", "task_update", "task_stream")
_STREAM_OF = {
    "event": subjects.MESH_EVENTS,
    "feed": subjects.FEED_STREAM,
    "task_update": subjects.MESH_TASKS,
    "task_stream": subjects.MESH_TASKS,
}
_MAX_SUBJECT = 256


def _invalid(field: str, reason: str) -> ProtocolError:
    return ProtocolError("INVALID_ENVELOPE", f"consumer request: payload.{field} {reason}", {"member": f"payload.{field}"})


def consumer_spec(node_id: str, agent_id: str, payload: Mapping[str, Any]) -> tuple[str, ConsumerSpec]:
    """The stream and §18.6 consumer a request from ``agent_id`` on ``node_id`` stands for.

    Raises ProtocolError (INVALID_ENVELOPE) naming the payload member at fault.
    """
    kind = payload.get("kind")
    if kind not in _KINDS:
        raise _invalid("kind", f"must be one of {', '.join(_KINDS)}")
    deliver = payload.get("deliver_subject")
    prefix = f"{node_inbox_prefix(node_id)}."
    if deliver is not None and (
        not isinstance(deliver, str)
        or not deliver.startswith(prefix)
        or len(deliver) > _MAX_SUBJECT
        or any(c in deliver for c in " \t\r\n*>")
        or ".." in deliver
        or deliver.endswith(".")
    ):
        raise _invalid("deliver_subject", f"must be a literal subject under this node's inbox prefix {prefix}")
    replay = payload.get("replay", False)
    if not isinstance(replay, bool):
        raise _invalid("replay", "must be a boolean")
    stream = _STREAM_OF[str(kind)]
    try:
        if kind == "event":
            pattern = payload.get("pattern")
            if not isinstance(pattern, str):
                raise _invalid("pattern", "must be the subscribed pattern after mesh.event.")
            name = subjects.event_consumer_name(agent_id, pattern)
            spec = ConsumerSpec(
                name, f"mesh.event.{pattern}", deliver_all=replay, ack_wait_s=30, max_deliver=5,
                deliver_subject=deliver,
            )
        elif kind == "feed":
            subject = payload.get("subject")
            if not isinstance(subject, str):
                raise _invalid("subject", "must be the feed subject subscribed (mesh.feed.{owner}.{topic|*})")
            name = subjects.feed_consumer_name(agent_id, subject)
            spec = ConsumerSpec(
                name, subject, deliver_all=replay, ack_wait_s=30, max_deliver=5, deliver_subject=deliver,
            )
        else:
            task_id = payload.get("task_id")
            if not isinstance(task_id, str):
                raise _invalid("task_id", "must be the task's id")
            name = subjects.task_update_consumer_name(task_id, agent_id)
            filter_subject = subjects.task_update(task_id)
            if kind == "task_stream":
                name += "_stream"
                filter_subject = subjects.task_stream(task_id)
            spec = ConsumerSpec(
                name, filter_subject, deliver_all=True, ack_wait_s=30, max_deliver=3, durable=False,
                deliver_subject=deliver, inactive_threshold_s=TASK_CONSUMER_IDLE_S,
            )
    except SubjectError as exc:
        raise _invalid("kind", f"does not name a valid consumer: {exc}") from None
    if deliver is None and payload.get("op") != "delete":
        raise _invalid("deliver_subject", f"is required (a subject under {prefix})")
    return stream, spec


_KEY_LEN = 56  # an nkey public key's length: the agent id in a consumer's name


def consumer_owner(name: str) -> str | None:
    """The agent whose consumer ``name`` is (§18.6 forms), None for any other name:
    ``mesh_event_{agent}_{hash}``, ``mesh_feed_{agent}[_{hash}]``,
    ``mesh_task_{task}_{agent}[_stream]``."""
    for prefix in ("mesh_event_", "mesh_feed_"):
        if name.startswith(prefix):
            owner = name[len(prefix):len(prefix) + _KEY_LEN]
            rest = name[len(prefix) + _KEY_LEN:]
            return owner if len(owner) == _KEY_LEN and (not rest or rest.startswith("_")) else None
    if name.startswith("mesh_task_"):
        base = name.removesuffix("_stream")
        if len(base) > len("mesh_task_") + _KEY_LEN and base[-_KEY_LEN - 1] == "_":
            return base[-_KEY_LEN:]
    return None


#: How long one listing of a stream's consumers stands for it in the quota (see _Holdings).
LISTING_TTL_S = 5.0
_STREAM = "stream"  # a _Holdings is one stream's: its cache's only key


class _Holdings:
    """How many consumers each agent holds on one stream, for the quota.

    Listing the stream's consumers for every creation made creating n of them
    O(n²): starting 2,000 agents that subscribe to events took 86 s (13 s now),
    half the daemon's CPU decoding CONSUMER.LIST pages (py-spy) and the broker
    serving them. Now one listing of the names stands for up to LISTING_TTL_S
    (one at a time, shared: :class:`SingleFlightCache`), with this service's
    own creations and deletions counted on top of it. A count
    at the limit is listed afresh before anything is refused, so a consumer the
    server removed by itself (an idle task consumer) never causes a refusal;
    what other service instances created since the last listing (and what this
    one created while a listing was being read) is seen at the next one, at
    most LISTING_TTL_S later: the bound is exact at a refusal, and can be passed
    by what an agent gets created within that window elsewhere.
    """

    def __init__(self, list_names: Callable[[], Awaitable[list[str]]], clock: Callable[[], float]) -> None:
        self._list_names = list_names
        # One key (the stream): one listing at a time, shared by every caller.
        self._listing: SingleFlightCache[str, Counter[str]] = SingleFlightCache(capacity=1, clock=clock)

    async def _load(self) -> tuple[Counter[str], float]:
        names = await self._list_names()
        return Counter(owner for name in names if (owner := consumer_owner(name))), LISTING_TTL_S

    async def held(self, agent: str, *, fresh: bool = False) -> int:
        if fresh:
            self._listing.forget(_STREAM)
        counts = await self._listing.get(_STREAM, self._load)
        return counts[agent]

    def created(self, agent: str) -> None:
        counts = self._listing.peek(_STREAM)
        if counts is not None:
            counts[agent] += 1

    def deleted(self, agent: str) -> None:
        counts = self._listing.peek(_STREAM)
        if counts is not None and counts[agent] > 0:
            counts[agent] -= 1

    async def close(self) -> None:
        await self._listing.close()


class ConsumerService(ServiceBase):
    """``mesh.consumers.{ensure,delete}.{node}``; see the module docstring."""

    def __init__(self, ctx: ServiceContext, *, max_per_agent: int = DEFAULT_MAX_PER_AGENT) -> None:
        super().__init__(ctx, name="consumers", queue="mesh_consumers")
        self.max_per_agent = max_per_agent
        self._holdings: dict[str, _Holdings] = {}

    async def stop(self) -> None:
        await super().stop()
        for holdings in self._holdings.values():
            await holdings.close()

    def _holdings_on(self, stream: str) -> _Holdings:
        holdings = self._holdings.get(stream)
        if holdings is None:
            js = self.ctx.connection.jetstream
            holdings = self._holdings[stream] = _Holdings(lambda: js.consumer_names(stream), time.monotonic)
        return holdings

    async def admit(self, msg: Message, env: Envelope) -> bool:
        """Not charged to the sender's or node's service budget: these requests
        are the platform's own bookkeeping of the agent's task and event traffic
        (two per task), so a 60-per-minute budget would fail busy requesters
        with RATE_LIMITED for work they never asked the platform for. What
        bounds them instead is the per-agent consumer quota above, and every
        request is still verified (signature, addressing, agent of this node)."""
        return True

    async def start(self) -> None:
        if self.running:
            return
        self._running = True
        await self.serve(f"{subjects.CONSUMERS_ENSURE}.*", self._ensure)
        await self.serve(f"{subjects.CONSUMERS_DELETE}.*", self._delete)
        await self.ctx.connection.flush()

    @staticmethod
    def _node_of(msg: Message) -> str:
        node = msg.subject.rsplit(".", 1)[-1]
        if not is_valid_public(node, Prefix.USER):
            raise ProtocolError("INVALID_ENVELOPE", f"{msg.subject}: the last token must be the node id")
        return node

    async def _ensure(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        payload = env.get("payload")
        if not isinstance(payload, Mapping):
            raise _invalid("", "must be an object")
        node, agent = self._node_of(msg), str(env["from"])
        stream, spec = consumer_spec(node, agent, payload)
        js = self.ctx.connection.jetstream
        try:
            # The quota is checked only for a consumer that does not exist yet,
            # between ensure's look-up and its creation (one look-up, not two).
            action = await js.ensure_consumer(stream, spec, before_create=lambda: self._check_quota(stream, agent))
        except ConsumerLimit:
            raise ProtocolError(
                "QUOTA_EXCEEDED",
                f"{stream} holds as many consumers as it may ([storage] max_consumers_per_stream on the "
                "node running the platform services); the operator raises it, or agents unsubscribe",
                {"stream": stream, "limit": "max_consumers_per_stream"},
            ) from None
        if action == "created":
            self._holdings_on(stream).created(agent)
        if action in ("updated", "recreated"):
            self.log.warning("consumer %s of %s on %s was %s: its configuration had drifted", spec.name, agent, stream, action)
        return {"stream": stream, "name": spec.name, "deliver_subject": spec.deliver_subject, "action": action}

    async def _delete(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        payload = env.get("payload")
        if not isinstance(payload, Mapping):
            raise _invalid("", "must be an object")
        node, agent = self._node_of(msg), str(env["from"])
        stream, spec = consumer_spec(node, agent, {**payload, "op": "delete"})
        try:
            await self.ctx.connection.jetstream.delete_consumer(stream, spec.name)
        except NotFound:
            return {"stream": stream, "name": spec.name, "deleted": False}
        self._holdings_on(stream).deleted(agent)
        return {"stream": stream, "name": spec.name, "deleted": True}

    async def _check_quota(self, stream: str, agent: str) -> None:
        holdings = self._holdings_on(stream)
        held = await holdings.held(agent)
        if held >= self.max_per_agent:
            held = await holdings.held(agent, fresh=True)  # never refused on a stale count
        if held >= self.max_per_agent:
            raise ProtocolError(
                "QUOTA_EXCEEDED",
                f"agent {agent} already holds {held} consumers on {stream} (limit "
                f"services.max_consumers_per_agent = {self.max_per_agent}); unsubscribe some first",
                {"stream": stream, "limit": self.max_per_agent},
            )
