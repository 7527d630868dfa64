"""Events and feeds on the node: the publish/subscribe half (AgentMesh §6.6, §6.6a, §6.7, §18.3).

One :class:`PubSub` per node holds what the publish and subscribe paths share:

* the **emit rate limit** per agent per subject (§6.6: "the platform SHOULD
  enforce rate limiting on event emission per agent per subject"), enforced
  at the sender so a runaway agent is stopped before it reaches the bus: an
  emit over the limit raises ``RATE_LIMITED`` with ``retry_after_ms``;
* the **interest-retention warning** (§18.3): MESH_EVENTS and MESH_FEED keep
  an event only while some durable consumer holds interest in its subject,
  so a domain's history begins with its first durable consumer. The node
  logs, once per subscription, when a durable consumer it creates is new
  (capture starts now), records each subscription for ``meshnode status``,
  and warns once per agent and domain when it emits while MESH_EVENTS has no
  durable consumer at all (nothing will be retained);
* **feeds**: publish on ``mesh.feed.{own id}.{topic}``, durable or ephemeral
  subscriptions on MESH_FEED, and the state snapshot through ``mesh.feed.get``;
* **telemetry subscriptions** (``mesh.trace.>``, ``mesh.metrics.>``,
  ``mesh.log.>``) for ordinary observers such as the OTLP exporter.

Every delivery runs the same checks as an event (signature, the §22 guard
with the event duplicate memory) plus the owner rule of owner-rooted
subjects: the signed ``from`` must be the subject's owner token.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshnode.agent import Event
from meshnode.aio import BackgroundTasks
from meshnode.node.pipeline import Intake, Path, Refused, decode_verified, guard
from meshnode.node.singleflight import SingleFlightCache
from meshnode.protocol import subjects
from meshnode.protocol.envelope import (
    build_envelope,
    encode_envelope,
    sign_envelope,
    validate_envelope,
    verify_envelope,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.feeds import (
    FeedPayload,
    FeedRefused,
    check_feed_envelope,
    check_feed_kind,
    feed_envelope,
    lookup_request,
    supersedes,
)
from meshnode.protocol.nkeys import is_valid_public
from meshnode.protocol.preflight import check_envelope_size
from meshnode.protocol.ratelimit import SlidingWindowLimiter
from meshnode.transport.connection import Message
from meshnode.transport.permissions import JS_CONSUMER_LIST, JS_STREAM_INFO

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent
    from meshnode.node.port import NodePort

__all__ = ["TELEMETRY_KINDS", "PubSub", "SubscriptionRecord"]

log = logging.getLogger("meshnode.pubsub")

#: What an observer may subscribe to, and the owner-rooted subject of each.
TELEMETRY_KINDS = ("trace", "metrics", "log")

# Headroom a state value needs to fit inside the mesh.feed.get answer that
# carries it (respond envelope, signature, {found, envelope} wrapper).
_STATE_HEADROOM = 2048
_LATEST_CAP = 10_000


@dataclass
class SubscriptionRecord:
    """One subscription an agent made, as ``meshnode status`` shows it."""

    kind: str  # "event" | "feed" | "telemetry"
    subject: str
    durable: bool
    consumer: str | None = None
    replay: bool = False
    capturing_since: str | None = None  # the durable consumer's creation time

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "subject": self.subject, "durable": self.durable}
        if self.consumer:
            out["consumer"] = self.consumer
            out["capturing_since"] = self.capturing_since
            out["replay"] = self.replay
        return out


#: How long one listing of MESH_EVENTS' consumer filters answers the interest hint.
INTEREST_LISTING_TTL_MS = 30_000


class PubSub:
    """The node's publish/subscribe state (see the module docstring)."""

    def __init__(self, node: NodePort, *, emit_limit: int = 600, emit_window_ms: int = 60_000) -> None:
        self._live_only_logged: set[str] = set()
        self.node = node
        self.emit_limiter = SlidingWindowLimiter(emit_limit, emit_window_ms, max_keys=10_000)
        self._records: dict[str, list[SubscriptionRecord]] = {}
        self._interest_checked: set[tuple[str, str]] = set()
        self._warned_undeclared: set[tuple[str, str]] = set()
        # The newest state value each agent has seen per feed, so a snapshot
        # read after the subscription delivered something newer returns that.
        self._latest: OrderedDict[tuple[str, str, str], Mapping[str, Any]] = OrderedDict()
        self._tasks = BackgroundTasks()
        # MESH_EVENTS' consumer filters for the interest hint (see _event_filters).
        self._filters: SingleFlightCache[str, list[list[str]]] = SingleFlightCache(
            capacity=1, clock=lambda: self.node.now_ms() / 1000
        )

    # -- the emit side ---------------------------------------------------------------

    def check_emit(self, hosted: HostedAgent, subject: str) -> None:
        """Count one emit by ``hosted`` on ``subject``; raise RATE_LIMITED over the limit."""
        decision = self.emit_limiter.check(f"{hosted.agent_id} {subject}", self.node.now_ms())
        if decision.allowed:
            return
        hosted.counters["emit.rate_limited"] += 1
        limiter = self.emit_limiter
        raise ProtocolError(
            "RATE_LIMITED",
            f"more than {limiter.limit} emits on {subject} in {limiter.window_ms} ms",
            {"subject": subject, "limit": limiter.limit, "window_ms": limiter.window_ms},
            retry_after_ms=decision.retry_after_ms,
        )

    async def emit(
        self, hosted: HostedAgent, domain: str, event_type: str, data: Any, *, trace: Mapping[str, Any]
    ) -> None:
        """Publish ``hosted``'s event on ``mesh.event.{domain}.{event_type}`` (§6.6):
        size-checked, rate-limited per agent per subject, ``Nats-Msg-Id`` = its id."""
        payload: dict[str, Any] = {"domain": domain, "event_type": event_type}
        if data is not None:
            payload["data"] = data
        env = build_envelope(
            "emit", hosted.agent_id, now_ms=self.node.now_ms(), payload=payload, trace=trace, ids=self.node.ids
        )
        sign_envelope(env, hosted.key)
        raw = encode_envelope(env)
        check_envelope_size(len(raw), self.node.connection.max_payload)
        subject = subjects.event_subject(domain, event_type)
        self.check_emit(hosted, subject)  # §6.6 per agent per subject; raises RATE_LIMITED
        self.note_emit(hosted, domain)
        self.node.audit(hosted, env, direction="out", path="live")
        await self.node.connection.publish(subject, raw, headers={"Nats-Msg-Id": env["id"]})

    def note_emit(self, hosted: HostedAgent, domain: str) -> None:
        """On an agent's first emit in ``domain``, check once that anything retains it."""
        key = (hosted.agent_id, domain)
        if key in self._interest_checked or len(self._interest_checked) > 10_000:
            return
        if not self.node.grants.can_publish(JS_STREAM_INFO.format(stream=subjects.MESH_EVENTS)):
            return  # nothing to ask with (a mesh built elsewhere); the broker would refuse it
        self._interest_checked.add(key)
        self._spawn(self._check_interest(hosted, domain))

    async def _check_interest(self, hosted: HostedAgent, domain: str) -> None:
        if not await self._domain_retained(domain):
            hosted.counters["emit.unretained"] += 1
            hosted.agent.log.warning(
                "emitting on mesh.event.%s.* while no durable consumer of MESH_EVENTS covers it: "
                "these events reach live subscribers only and are not retained (interest "
                "retention, §18.3); a domain's history begins when its first durable "
                "subscription exists",
                domain,
            )

    async def _event_filters(self) -> list[list[str]]:
        """MESH_EVENTS' consumer filters, from a listing at most INTEREST_LISTING_TTL_MS
        old (one listing at a time: :class:`SingleFlightCache`).

        A listing reads every consumer's whole info (CONSUMER.LIST, 256 a page):
        with one consumer per subscribing agent, asking it at every agent's first
        emit in a domain cost O(subscribers) each. The hint it serves is said
        once per agent and domain, so a listing some seconds old does.
        """
        async def listing() -> tuple[list[list[str]], float]:
            filters = await self.node.connection.jetstream.consumer_filters(subjects.MESH_EVENTS)
            return filters, INTEREST_LISTING_TTL_MS / 1000

        return await self._filters.get(subjects.MESH_EVENTS, listing)

    async def _domain_retained(self, domain: str) -> bool:
        """Whether any consumer of MESH_EVENTS holds interest in ``domain``'s events.

        Where the credential may list consumers (a service-role node), their
        filters are compared with the domain: the platform's own consumers
        (the rating ledger's copy of ``mesh.event.metering.>``) hold interest
        in their subjects only. Elsewhere only the stream's consumer count can
        be read, so any consumer counts as interest: the hint is then missed
        rather than given wrongly. A failed look-up says nothing (True).
        """
        js = self.node.connection.jetstream
        try:
            if self.node.grants.can_publish(JS_CONSUMER_LIST.format(stream=subjects.MESH_EVENTS)):
                domain_events = subjects.event_filter(f"{domain}.>")
                return any(
                    not filters or any(subjects.patterns_intersect(f, domain_events) for f in filters)
                    for filters in await self._event_filters()
                )
            return (await js.stream_state(subjects.MESH_EVENTS)).consumer_count > 0
        except Exception as exc:  # no stream, no permission, no connection: nothing to say
            log.debug("MESH_EVENTS interest check skipped: %s", exc)
            return True

    # -- subscriptions ---------------------------------------------------------------

    async def subscribe_events(
        self, hosted: HostedAgent, pattern: str, *, durable: bool = True, replay: bool = False
    ) -> str:
        """Subscribe ``hosted`` to ``mesh.event.{pattern}`` (§6.7, §18.6).

        A durable subscription is a JetStream consumer on MESH_EVENTS named
        ``mesh_event_{agent}_{hash}``: events published while the node is away
        are delivered when it returns (at-least-once, acked after the handler;
        judged with the mailbox window because they come out of a buffer). An
        ephemeral one is a core subscription judged with the live window.
        Returns the consumer name (durable) or the subject (ephemeral).
        """
        subject = subjects.event_filter(pattern)
        if durable and not self._may_consume(subjects.MESH_EVENTS):
            durable = False  # a mesh built elsewhere (§14.3's example grants no JetStream API)
        if not durable:
            async def on_live(msg: Message) -> None:
                try:
                    await hosted.receive_event(msg.data, subject=msg.subject, source=Path.LIVE)
                except Exception:
                    hosted.agent.log.exception("event pipeline failed")

            hosted.subscriptions.append(await self.node.connection.subscribe(subject, on_live))
            await self.record_subscription(hosted, kind="event", subject=subject)
            return subject

        name = subjects.event_consumer_name(hosted.agent_id, pattern)

        async def deliver(msg: Message) -> None:
            await hosted.receive_event(msg.data, subject=msg.subject, source=Path.MAILBOX)

        sub = await self.node.durable_consume(hosted, subject, stream="MESH_EVENTS", name=name, replay=replay, deliver=deliver)
        hosted.subscriptions.append(sub)
        await self.record_subscription(
            hosted, kind="event", subject=subject, consumer=name, replay=replay, sub=sub
        )
        return name


    def _may_consume(self, stream: str) -> bool:
        """Whether the credential grants the JetStream API on ``stream`` (every
        credential meshnode mints does). Without it a durable subscription is
        made a live one, said once: what is published while the node is away
        is then missed."""
        if self.node.grants.can_publish(JS_STREAM_INFO.format(stream=stream)):
            return True
        if stream not in self._live_only_logged:
            self._live_only_logged.add(stream)
            log.info(
                "the node credential grants no JetStream API on %s: durable subscriptions to it are "
                "live ones (what is published while this node is away is missed)",
                stream,
            )
        return False

    async def record_subscription(
        self,
        hosted: HostedAgent,
        *,
        kind: str,
        subject: str,
        consumer: str | None = None,
        replay: bool = False,
        sub: Any = None,
    ) -> SubscriptionRecord:
        """Remember a subscription for status; for a durable one, say when capture began."""
        record = SubscriptionRecord(kind, subject, consumer is not None, consumer, replay)
        if consumer is not None and sub is not None:
            try:
                info = await sub.consumer_info()
                record.capturing_since = info.created
                if not info.delivered_stream_seq and not info.num_pending:
                    hosted.agent.log.info(
                        "durable subscription %s (%s): capture of %s begins now; what was "
                        "published before any durable consumer held interest was not retained "
                        "(interest retention, §18.3)%s",
                        consumer,
                        kind,
                        subject,
                        " — replay starts from what is retained" if replay else "",
                    )
            except Exception as exc:
                log.debug("consumer info for %s unavailable: %s", consumer, exc)
        records = self._records.setdefault(hosted.agent_id, [])
        # Subscribing again (e.g. at every start) rebinds the same subscription.
        records[:] = [r for r in records if (r.kind, r.subject, r.consumer) != (kind, subject, consumer)]
        records.append(record)
        return record

    def subscriptions(self, hosted: HostedAgent) -> list[dict[str, Any]]:
        """The agent's subscriptions for ``meshnode status``."""
        return [r.as_dict() for r in self._records.get(hosted.agent_id, [])]

    def forget(self, hosted: HostedAgent) -> None:
        """Drop an agent's records (it was unhosted)."""
        self._records.pop(hosted.agent_id, None)
        for key in [k for k in self._latest if k[0] == hosted.agent_id]:
            del self._latest[key]

    # -- feeds: publish ------------------------------------------------------------------

    @staticmethod
    def feed_emits(agent_id: str, feeds: Mapping[str, str]) -> list[str]:
        """The manifest ``emits`` entries of an agent's declared ``feeds`` (§6.6a);
        raises ValueError for a topic or kind that is not a feed's, so an agent
        declaring one fails to start rather than publishing something unreadable."""
        out = []
        for topic, kind in feeds.items():
            check_feed_kind(kind)
            out.append(subjects.feed_subject(agent_id, topic))
        return out

    def declared_kind(self, hosted: HostedAgent, topic: str) -> str | None:
        feeds = getattr(type(hosted.agent), "feeds", None) or {}
        kind = feeds.get(topic) if isinstance(feeds, Mapping) else None
        return kind if isinstance(kind, str) else None

    async def publish_feed(
        self,
        hosted: HostedAgent,
        topic: str,
        data: Any,
        *,
        kind: str | None,
        trace: Mapping[str, Any],
    ) -> str:
        """Publish on ``mesh.feed.{own id}.{topic}``; returns the envelope id.

        ``kind`` defaults to the kind declared in the agent's ``feeds``, else
        ``stream``; a kind that contradicts the declaration is refused.
        """
        declared = self.declared_kind(hosted, topic)
        if kind is None:
            kind = declared or "stream"
        kind = check_feed_kind(kind)
        if declared is not None and declared != kind:
            raise ValueError(f"feed {topic!r} is declared {declared!r}, not {kind!r}")
        subject = subjects.feed_subject(hosted.agent_id, topic)  # refuses a bad topic first
        undeclared = (hosted.agent_id, topic)
        if declared is None and undeclared not in self._warned_undeclared and len(self._warned_undeclared) < 10_000:
            self._warned_undeclared.add(undeclared)
            hosted.agent.log.warning(
                "feed %r is not declared in the agent's feeds: it is not in the manifest's "
                "emits and cannot be discovered (§6.6a)",
                topic,
            )
        node = self.node
        env = feed_envelope(hosted.agent_id, topic, kind, data, now_ms=node.now_ms(), trace=trace, ids=node.ids)
        sign_envelope(env, hosted.key)
        raw = encode_envelope(env)
        max_payload = node.connection.max_payload
        check_envelope_size(len(raw) + (_STATE_HEADROOM if kind == "state" else 0), max_payload)
        self.check_emit(hosted, subject)
        node.audit(hosted, env, direction="out", path="live")
        await node.connection.publish(subject, raw, headers={"Nats-Msg-Id": env["id"]})
        hosted.counters[f"feeds.published.{kind}"] += 1
        return str(env["id"])

    # -- feeds: subscribe and read -----------------------------------------------------------

    async def subscribe_feed(
        self,
        hosted: HostedAgent,
        owner: str,
        topic: str = "*",
        *,
        durable: bool = True,
        replay: bool = False,
    ) -> str:
        """Subscribe ``hosted`` to ``owner``'s feed ``topic`` (``*``: all of its feeds).

        Durable: a consumer on MESH_FEED named ``mesh_feed_{agent}_{hash}``
        that keeps what is published while this node is away (acked after
        ``on_event``). Ephemeral: a core subscription. Returns the consumer
        name or the subject.
        """
        subject = subjects.feed_pattern(owner, topic)
        node = self.node
        if not durable:
            async def on_live(msg: Message) -> None:
                try:
                    await self.receive_feed(hosted, msg.data, subject=msg.subject, source=Path.LIVE)
                except Exception:
                    hosted.agent.log.exception("feed pipeline failed")

            hosted.subscriptions.append(await node.connection.subscribe(subject, on_live))
            await self.record_subscription(hosted, kind="feed", subject=subject)
            return subject

        name = subjects.feed_consumer_name(hosted.agent_id, subject)

        async def deliver(msg: Message) -> None:
            await self.receive_feed(hosted, msg.data, subject=msg.subject, source=Path.MAILBOX)

        sub = await node.durable_consume(
            hosted, subject, stream=subjects.FEED_STREAM, name=name, replay=replay, deliver=deliver
        )
        hosted.subscriptions.append(sub)
        await self.record_subscription(hosted, kind="feed", subject=subject, consumer=name, replay=replay, sub=sub)
        return name

    async def read_feed_state(self, hosted: HostedAgent, owner: str, topic: str) -> Event | None:
        """The current value of ``owner``'s state feed ``topic``, without replay (§18.3).

        Asks ``mesh.feed.get``; the answer's envelope is verified and owner-
        checked like any delivery. If this agent's subscription has already
        delivered a newer value, that one is returned instead, so a caller who
        subscribed first (subscribe before snapshot, §9.6) never goes back in
        time. None when the feed has never published.
        """
        node = self.node
        answer = await node.service_call(hosted, subjects.FEED_GET, "request", lookup_request(owner, topic))
        subject = subjects.feed_subject(owner, topic)
        stored = answer.get("envelope") if answer.get("found") is True else None
        env: dict[str, Any] | None = None
        if isinstance(stored, Mapping):
            try:
                env = validate_envelope(dict(stored))
                verify_envelope(env)
                check_feed_envelope(env, subject)
            except (ProtocolError, FeedRefused) as exc:
                hosted.refuse(Intake.FEED, "snapshot_refused", stored, str(exc))
                env = None
        latest = self._latest.get((hosted.agent_id, owner, topic))
        if latest is not None and supersedes(latest, env):
            env = dict(latest)
        if env is None:
            return None
        payload = check_feed_envelope(env, subject)
        hosted.counters["feeds.snapshots"] += 1
        return _feed_event(subject, env, payload)

    async def receive_feed(self, hosted: HostedAgent, data: bytes, *, subject: str, source: Path | str) -> bool:
        """The feed delivery path: verify, owner check, §22 guard, then ``on_event``.

        Returns True when the delivery reached the handler. Feed deliveries
        are ambient: they go to ``on_event``, never to the request path or
        the inbox.
        """
        path = source if isinstance(source, Path) else Path(source)
        node = self.node
        now_ms = node.now_ms()
        hosted.counters["feeds.received"] += 1
        try:
            env = decode_verified(data)
            try:
                payload = check_feed_envelope(env, subject)
            except FeedRefused as exc:  # the owner rule of owner-rooted subjects
                raise Refused(exc.reason, str(exc)) from None
            guard(hosted.event_guard, env, path, now_ms)
        except Refused as refused:
            hosted.refuse(Intake.FEED, refused.rule, refused.envelope, refused.detail)
            return False
        if payload.kind == "state" and not self._advance(hosted, env, payload):
            hosted.counters["feeds.superseded"] += 1
            return False
        node.audit(hosted, env, direction="in", path=f"feed-{path.value}")
        await hosted.dispatch_event(env, _feed_event(subject, env, payload), "feeds")
        return True

    def _advance(self, hosted: HostedAgent, env: Mapping[str, Any], payload: FeedPayload) -> bool:
        key = (hosted.agent_id, str(env["from"]), payload.topic)
        if not supersedes(env, self._latest.get(key)):
            return False  # an older state value after a newer one is not news
        self._latest[key] = env
        self._latest.move_to_end(key)
        if len(self._latest) > _LATEST_CAP:
            self._latest.popitem(last=False)
        return True

    # -- telemetry (an observer's subscription) -----------------------------------------------

    async def observe(self, hosted: HostedAgent, kind: str, agent: str | None = None) -> str:
        """Subscribe ``hosted`` to span, metric or log events (§13.1–§13.3), delivered to
        ``on_event`` as ordinary events (``domain`` ``trace``/``log``, or None for metrics).

        ``agent`` narrows to one agent; otherwise every agent the credential
        lets this node read. Live only: these subjects are a hand-off to a
        collector, not a store (§13.1.1). Envelopes are verified, must come
        from the agent their subject names, and pass the §22 guard. They are
        never traced themselves, so an exporter cannot feed on its own spans.
        """
        if kind not in TELEMETRY_KINDS:
            raise ValueError(f"observe one of {TELEMETRY_KINDS}, not {kind!r}")
        if agent is not None and not is_valid_public(agent):
            raise ValueError(f"not an agent id: {agent!r:.80}")
        subject = f"mesh.{kind}.{agent}" if agent is not None else f"mesh.{kind}.>"
        if kind == "log" and agent is not None:
            subject += ".*"

        async def on_msg(msg: Message) -> None:
            try:
                await self.receive_telemetry(hosted, msg.data, msg.subject)
            except Exception:
                hosted.agent.log.exception("telemetry pipeline failed")

        hosted.subscriptions.append(await self.node.connection.subscribe(subject, on_msg))
        await self.record_subscription(hosted, kind="telemetry", subject=subject)
        return subject

    async def receive_telemetry(self, hosted: HostedAgent, data: bytes, subject: str) -> bool:
        """The telemetry intake: decode ─► verify ─► kind and owner (an emit from the
        agent the subject names) ─► §22 guard (live) ─► ``on_event``. Never audited,
        so never traced: observing spans must not produce spans."""
        parts = subject.split(".")
        owner = parts[2] if len(parts) >= 3 else ""
        try:
            env = decode_verified(data)
            if env["type"] != "emit" or env["from"] != owner:
                raise Refused("not_owner", f"on {subject}", envelope=env)
            guard(hosted.event_guard, env, Path.LIVE, self.node.now_ms())
        except Refused as refused:
            hosted.refuse(Intake.TELEMETRY, refused.rule, refused.envelope, refused.detail)
            return False
        payload = env.get("payload")
        payload = payload if isinstance(payload, Mapping) else {}
        domain, event_type = payload.get("domain"), payload.get("event_type")
        event = Event(
            subject=subject,
            sender=env["from"],
            domain=domain if isinstance(domain, str) else None,
            event_type=event_type if isinstance(event_type, str) else None,
            data=payload.get("data") if "data" in payload else dict(payload),
            envelope=env,
        )
        await hosted.dispatch_event(env, event, "telemetry", observed=False)
        return True

    # -- housekeeping ----------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        self._tasks.spawn(coro)

    async def stop(self) -> None:
        await self._tasks.cancel()
        await self._filters.close()


def _feed_event(subject: str, env: Mapping[str, Any], payload: FeedPayload) -> Event:
    return Event(
        subject=subject,
        sender=str(env["from"]),
        domain=None,
        event_type=None,
        data=payload.data,
        envelope=env,
        topic=payload.topic,
        kind=payload.kind,
    )

