"""What every platform service shares: its context, intake and reply (§16.1, §18.7, §22).

Platform services (registry, presence, task manager) are service-role agents
hosted on a node's one connection. Each request they serve goes through the
same short pipeline, in order:

1. decode and verify the envelope (§5.3); garbage or a forged signature is
   dropped silently and logged, never answered (§22.7);
2. the §22 guard of :mod:`meshnode.node.pipeline`, judged live: remember
   ``(from, id)`` and drop a duplicate (§22.2), drop anything outside the live
   freshness window (§22.3) — together these make a captured request (a
   deregistration, say) useless to replay — drop an envelope addressed to
   someone else (§22.4) or over the relay hop bound (§21.2), and answer
   CONTEXT_TOO_LARGE over the size cap (§22.5; a service's requests carry data,
   so its cap defaults to what the transport carries);
3. refuse types that are never requests (``respond``, ``emit``, ``subscribe``);

Every refusal is counted in ``ServiceContext.refusals`` (intake ``service``,
labelled by rule: the daemon shares the node's counter), and logged.
4. count the request against the sender's sliding-window budget, shared by
   every service that holds the same :class:`ServiceContext` (§16.1: one
   counter across all service subjects), answering ``RATE_LIMITED`` with
   ``retry_after_ms`` when it is spent;
5. run the operation and answer with :meth:`ServiceBase.reply`.

Answers use ordinary NATS request-reply (§18.7: platform service operations
keep it): a signed ``respond`` from the service key, ``to`` the requester,
``in_reply_to`` the request id, published on the request's reply subject.
A failure carries payload ``{"status": "failed"}`` and a §12.1 ``error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from meshnode.aio import BackgroundTasks, KeyedConcurrency, backoff
from meshnode.node.pipeline import Intake, Path, RefusalCounter, Refused, decode_verified, guard
from meshnode.protocol.envelope import (
    IdGenerator,
    build_envelope,
    child_trace,
    encode_envelope,
    sign_envelope,
)
from meshnode.protocol.errors import ProtocolError, error_object
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.protections import (
    DEFAULT_FRESHNESS_WINDOW,
    DedupMemory,
    FreshnessWindow,
    InboundGuard,
)
from meshnode.protocol.ratelimit import RateDecision, SlidingWindowLimiter
from meshnode.protocol.subjects import event_subject
from meshnode.transport.connection import ConnectionListener, MeshConnection, Message, Subscription
from meshnode.transport.errors import NotFound, StoreFull
from meshnode.transport.jetstream import KV_DELETE_OPS, KeyValue, KvWatch, PullConsumer
from meshnode.transport.streams import DEFAULT_STREAM_LIMITS, StreamLimits

__all__ = [
    "NON_REQUEST_TYPES",
    "Operation",
    "ServiceBase",
    "ServiceContext",
    "wall_clock_ms",
]

#: Envelope types that are statements, never requests to a service.
NON_REQUEST_TYPES = frozenset({"respond", "emit", "subscribe"})

Envelope = dict[str, Any]
#: A service operation: the raw message and its verified envelope in, the
#: reply payload out. A ProtocolError it raises is answered as that error.
Operation = Callable[[Message, Envelope], Awaitable[Mapping[str, Any]]]


def wall_clock_ms() -> int:
    """Epoch milliseconds from the system clock."""
    return time.time_ns() // 1_000_000


def store_full_error(service: str, exc: StoreFull) -> dict[str, Any]:
    """The §12.2 answer for a write the JetStream store refused (issue #22.3).

    QUOTA_EXCEEDED rather than INTERNAL_ERROR: the service is healthy, the
    mesh's store (an object's ``max_bytes``, the account's or the server's
    limit) is not, and retrying does not help until an operator frees space
    or raises the limits (``[storage]``, ``[mesh.embedded] jetstream_max_store``).
    """
    code = f", JetStream error {exc.err_code}" if exc.err_code else ""
    return error_object(
        "QUOTA_EXCEEDED",
        f"{service}: the mesh's JetStream store refused the write ({exc}{code}); "
        "`meshnode status` on the mesh host shows store use; the operator frees space "
        "or raises [storage] / [mesh.embedded] jetstream_max_store / account_max_store",
        {"store": "jetstream", "service": service, **({"err_code": exc.err_code} if exc.err_code else {})},
    )


UNVOUCHED = "-"
"""The :class:`NodeBudget` key shared by every sender no registered node vouches for."""


@dataclass
class NodeBudget:
    """The per-node request budget beside the §16.1 per-sender one.

    A sender key costs nothing to make, so a per-sender limit alone is a limit
    per *key*: a node signing with fresh keys multiplies it at will. The node
    behind a sender is what the registry knows: the node whose current vouch
    it holds for that key (connection-bound registrations only, so a node can
    vouch for keys under its own id, never another's). A registration counts
    against the node its subject binds. Senders no node vouches for share one
    budget (``unvouched``), so fresh keys buy nothing there either. The node
    hosting the services is not budgeted (its own agents are local).
    ``node_of`` is set once the registry runs (it maps sender -> node or None).
    """

    limiter: SlidingWindowLimiter
    unvouched: SlidingWindowLimiter
    node_of: Callable[[str], str | None] | None = None

    def check(
        self, sender: str, bound_node: str | None, now_ms: int
    ) -> tuple[str, SlidingWindowLimiter, RateDecision]:
        """Count one request; the node key it counted against, its limiter and the decision."""
        node = bound_node
        if node is None and self.node_of is not None:
            node = self.node_of(sender)
        if node is None:
            return UNVOUCHED, self.unvouched, self.unvouched.check(UNVOUCHED, now_ms)
        return node, self.limiter, self.limiter.check(node, now_ms)


@dataclass
class ServiceContext:
    """What the hosting node hands each platform service.

    ``key`` is the service's own identity: every reply and event it emits is
    signed by it, and callers pin it on first use. ``replicas`` is the
    JetStream replica count for the objects services create: ``min(3,
    cluster size)``, 1 on the embedded mesh. ``limiter`` is the §16.1
    per-sender budget; services built from one context share it.
    ``refusals`` counts every request the intake refuses (the daemon passes
    the node's, so they show in its metrics). ``max_inbound_chars`` is the
    §22.5 cap; None is what the connection carries (``max_payload``).
    ``node_budget`` is the per-node budget beside ``limiter`` (None: none).
    """

    connection: MeshConnection
    key: KeyPair
    node_id: str
    now_ms: Callable[[], int] = wall_clock_ms
    ids: IdGenerator = field(default_factory=IdGenerator)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("meshnode.services"))
    replicas: int = 1
    limiter: SlidingWindowLimiter = field(default_factory=SlidingWindowLimiter)
    freshness: FreshnessWindow = DEFAULT_FRESHNESS_WINDOW
    refusals: RefusalCounter = field(default_factory=RefusalCounter)
    max_inbound_chars: int | None = None
    stream_limits: StreamLimits = DEFAULT_STREAM_LIMITS
    """The bound of every stream and bucket the services create (``[storage]``)."""
    node_budget: NodeBudget | None = None

    @property
    def service_id(self) -> str:
        """The service's public key: the ``from`` of everything it signs."""
        return self.key.public_key


class ServiceBase:
    """Subscriptions, intake and replies for one platform service.

    ``queue`` is the NATS queue group every request subscription joins, so
    several service nodes can serve the same subjects concurrently (each
    request reaches exactly one of them).
    """

    def __init__(self, ctx: ServiceContext, *, name: str, queue: str, dedup_entries: int = 5000) -> None:
        self.ctx = ctx
        self.name = name
        self.queue = queue
        self.log = ctx.log.getChild(name)
        self._dedup = DedupMemory(dedup_entries)
        self._guard: InboundGuard | None = None  # built at first use: max_payload needs the connection
        self._subs: list[Subscription] = []
        self._tasks = BackgroundTasks()
        self._running = False
        self._reconnect_hooked = False

    # -- lifecycle -----------------------------------------------------------

    def hook_reconnect(self, listener: ConnectionListener) -> None:
        """Run ``listener`` after every reconnect; registered once per instance,
        however often the service is stopped and started again."""
        if not self._reconnect_hooked:
            self.ctx.connection.on_reconnect(listener)
            self._reconnect_hooked = True

    async def consume_pull(
        self,
        pull_of: Callable[[], PullConsumer | None],
        handle: Callable[[Message], Awaitable[None]],
        *,
        batch: int,
        timeout_s: float,
        retry_s: float,
        what: str,
    ) -> None:
        """Fetch from a durable pull consumer and hand each message to ``handle``, while running.

        ``pull_of`` is read every round: stop() clears the consumer, which ends
        the loop. A failed fetch (a disconnect) is logged as ``fetching {what}
        failed`` and retried after ``retry_s``: the durable cursor resumes where it was.
        """
        while self.running:
            pull = pull_of()
            if pull is None:
                return
            try:
                msgs = await pull.fetch(batch, timeout=timeout_s)  # [] on timeout
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.log.warning("fetching %s failed: %s", what, exc)
                await asyncio.sleep(retry_s)
                continue
            for msg in msgs:
                await handle(msg)

    @property
    def running(self) -> bool:
        return self._running

    async def stop(self) -> None:
        """Unsubscribe everything and cancel background work. Idempotent."""
        self._running = False
        subs, self._subs = self._subs, []
        for sub in subs:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # a closed connection has nothing left to unsubscribe
                self.log.debug("unsubscribe failed: %s", exc)
        tasks, self._tasks = self._tasks, BackgroundTasks()
        await tasks.cancel()

    def spawn(self, job: Callable[[], Awaitable[None]], name: str) -> asyncio.Task[None]:
        """Run ``job()`` in the background until :meth:`stop`; an error is logged."""

        async def run() -> None:
            try:
                await job()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.log.exception("%s stopped on an error", name)

        return self._tasks.spawn(run(), name=f"{self.name}:{name}")

    async def open_watch(self, kv: KeyValue, what: str) -> KvWatch:
        """``kv.watch_all()``, retried with backoff while the service runs.

        Right after a reconnect to a cluster whose streams are still electing
        leaders, creating the watch's consumer times out; without a retry the
        watch task would end there and the service would answer from a copy
        that never updates again.
        """
        for delay in backoff(0.5, 5.0):
            try:
                return await kv.watch_all()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self._running:
                    raise
                self.log.warning("watching %s failed (%s); retrying in %.1fs", what, exc, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable: backoff() is endless")

    # -- subscriptions -------------------------------------------------------

    async def subscribe(
        self, subject: str, handler: Callable[[Message], Awaitable[None]], *, queue: bool = True
    ) -> Subscription:
        """Subscribe ``handler`` to ``subject`` (on the service's queue group unless
        ``queue=False``). A handler that raises is logged, never fatal."""

        async def guarded(msg: Message) -> None:
            try:
                await handler(msg)
            except Exception:
                self.log.exception("handler for %s failed", msg.subject)

        sub = await self.ctx.connection.subscribe(
            subject, guarded, queue=self.queue if queue else ""
        )
        self._subs.append(sub)
        return sub

    async def serve(
        self, subject: str, operation: Operation, *, concurrency: KeyedConcurrency | None = None
    ) -> Subscription:
        """Serve ``operation`` on ``subject``: intake (module docstring), then a
        reply with its payload, or with the error it raised.

        A subscription hands over one message at a time, so by default each
        operation ends before the next message is read. With ``concurrency``
        the intake and the rate limit still run in arrival order, then the
        operation and its reply run as a task: several at once (the gate's
        limit), one at a time per sender (``from``), in arrival order per sender.
        """

        async def handle(msg: Message) -> None:
            try:
                env = self.intake(msg)
            except Refused as refused:
                self._count_refusal(msg, refused)
                if refused.answer is not None and refused.envelope is not None:
                    # §22.7: the size cap answers the sender; every other refusal is silent.
                    await self.reply(msg, dict(refused.envelope), error=refused.answer)
                return
            if not await self.admit(msg, env):
                return
            if concurrency is None:
                await answer(msg, env)
                return

            async def job() -> None:
                try:
                    await answer(msg, env)
                except Exception:
                    self.log.exception("handler for %s failed", msg.subject)

            await concurrency.submit(str(env["from"]), job, self._tasks, name=f"{self.name}:{subject}")

        async def answer(msg: Message, env: Envelope) -> None:
            try:
                payload = await operation(msg, env)
            except ProtocolError as exc:
                await self.reply(msg, env, error=exc.to_object())
                return
            except StoreFull as exc:
                # Not INTERNAL_ERROR: the mesh's store (or this object's bound)
                # is full, which the operator fixes, not a retry (issue #22.3).
                self.log.warning("%s cannot write on %s: the JetStream store is full: %s", self.name, msg.subject, exc)
                await self.reply(msg, env, error=store_full_error(self.name, exc))
                return
            except Exception as exc:
                self.log.exception("%s failed on %s", self.name, msg.subject)
                await self.reply(
                    msg,
                    env,
                    error=error_object(
                        "INTERNAL_ERROR", f"{self.name} failed: {type(exc).__name__}"
                    ),
                )
                return
            await self.reply(msg, env, payload)

        return await self.subscribe(subject, handle)

    # -- intake --------------------------------------------------------------

    def decode(self, data: bytes, subject: str) -> Envelope | None:
        """The verified envelope in ``data``, or None (counted, logged) for garbage or a forgery."""
        try:
            return decode_verified(data)
        except Refused as refused:
            self.ctx.refusals.count(Intake.SERVICE, refused.rule)
            self.log.info("dropped %s on %s: %s", refused.rule.upper(), subject, refused.detail)
            return None

    def _inbound_guard(self) -> InboundGuard:
        if self._guard is None:
            cap = self.ctx.max_inbound_chars
            self._guard = InboundGuard(
                self.ctx.service_id,
                window=self.ctx.freshness,
                max_inbound_chars=cap if cap is not None else self.ctx.connection.max_payload,
                memory=self._dedup,
            )
        return self._guard

    def intake(self, msg: Message, *, request: bool = True) -> Envelope:
        """The service intake (module docstring, steps 1-3) of a live message:
        decode ─► verify ─► §22 guard ─► kind. Raises :class:`Refused`.

        ``request=False`` admits statement types (a heartbeat is an ``emit``).
        """
        env = decode_verified(msg.data)
        guard(self._inbound_guard(), env, Path.LIVE, self.ctx.now_ms())
        if request and env["type"] in NON_REQUEST_TYPES:
            raise Refused("not_a_request", f"a {env['type']} envelope sent as a request", envelope=env)
        return env

    def accept(self, msg: Message, *, request: bool = True) -> Envelope | None:
        """:meth:`intake`, with a refusal counted and logged: None for anything
        dropped (a statement intake has nobody to answer)."""
        try:
            return self.intake(msg, request=request)
        except Refused as refused:
            self._count_refusal(msg, refused)
            return None

    def _count_refusal(self, msg: Message, refused: Refused) -> None:
        self.ctx.refusals.count(Intake.SERVICE, refused.rule)
        env = refused.envelope
        if env is None:
            self.log.info("dropped %s on %s: %s", refused.rule.upper(), msg.subject, refused.detail)
        else:
            self.log.info("dropped %s (%s) from %s on %s: %s", env.get("id"), refused.rule,
                          env.get("from"), msg.subject, refused.detail)

    async def admit(self, msg: Message, env: Envelope) -> bool:
        """Count the request against the sender's budget; answer RATE_LIMITED when spent."""
        if env["from"] == self.ctx.service_id:
            # The platform asking itself (a tenant's registry resolving an exported
            # agent through another tenant's, §15.2): signed by this very key, and
            # carrying many callers' look-ups, so one sender's budget cannot fit it.
            return True
        now_ms = self.ctx.now_ms()
        decision = self.ctx.limiter.check(env["from"], now_ms)
        if decision.allowed and self.ctx.node_budget is not None:
            node, limiter, decision = self.ctx.node_budget.check(
                env["from"], self.bound_node(msg), now_ms
            )
            if node == self.ctx.node_id:
                # The node hosting the platform itself: its agents and its operator's
                # CLI are local, and throttling them would throttle the platform.
                decision = RateDecision(True)
            if not decision.allowed:
                self.log.warning("rate-limited node %s (sender %s) on %s", node, env["from"], msg.subject)
                await self.reply(
                    msg,
                    env,
                    error=error_object(
                        "RATE_LIMITED",
                        "too many requests to the platform services from this node"
                        if node != UNVOUCHED
                        else "too many requests to the platform services from senders no node vouches for",
                        {"limit": limiter.limit, "window_ms": limiter.window_ms, "scope": "node"},
                        retry_after_ms=decision.retry_after_ms,
                    ),
                )
                return False
        if decision.allowed:
            return True
        await self.reply(
            msg,
            env,
            error=error_object(
                "RATE_LIMITED",
                "too many requests to the platform services",
                {"limit": self.ctx.limiter.limit, "window_ms": self.ctx.limiter.window_ms},
                retry_after_ms=decision.retry_after_ms,
            ),
        )
        return False

    def bound_node(self, msg: Message) -> str | None:
        """The node the broker binds ``msg`` to by its subject, if any (the
        registration subject's node token); services with such subjects override."""
        return None

    # -- output --------------------------------------------------------------

    def sign(self, env: Envelope) -> Envelope:
        return sign_envelope(env, self.ctx.key)

    async def reply(
        self,
        msg: Message,
        request: Envelope,
        payload: Mapping[str, Any] | None = None,
        *,
        error: Mapping[str, Any] | None = None,
    ) -> None:
        """Answer ``request`` on the message's reply subject: a ``respond`` signed
        by the service key, ``to`` = the requester, ``in_reply_to`` = its id.

        With ``error`` the payload is ``{"status": "failed"}`` and ``error`` is
        the §12.1 object. A request without a reply subject gets no answer.
        """
        if not msg.reply:
            self.log.debug("no reply subject on %s; nothing to answer", msg.subject)
            return
        if error is not None:
            payload = {"status": "failed"}
        env = build_envelope(
            "respond",
            self.ctx.service_id,
            now_ms=self.ctx.now_ms(),
            to=request["from"],
            in_reply_to=request["id"],
            payload=dict(payload) if payload is not None else {},
            error=error,
            trace=child_trace(request.get("trace")),
            ids=self.ctx.ids,
        )
        try:
            await self.ctx.connection.publish(msg.reply, encode_envelope(self.sign(env)))
        except Exception as exc:  # the requester may be gone; nothing else to do
            self.log.warning("reply on %s failed: %s", msg.subject, exc)

    async def emit(self, domain: str, event_type: str, data: Mapping[str, Any]) -> None:
        """Publish a signed ``emit`` on ``mesh.event.{domain}.{event_type}`` with payload
        ``{domain, event_type, data}`` and ``Nats-Msg-Id`` = the envelope id (§18.8).

        Best effort: a failed publish is logged, never raised, because the
        event reports a change that has already happened.
        """
        env = build_envelope(
            "emit",
            self.ctx.service_id,
            now_ms=self.ctx.now_ms(),
            payload={"domain": domain, "event_type": event_type, "data": dict(data)},
            ids=self.ctx.ids,
        )
        self.sign(env)
        try:
            await self.ctx.connection.publish(
                event_subject(domain, event_type),
                encode_envelope(env),
                headers={"Nats-Msg-Id": env["id"]},
            )
        except Exception as exc:
            self.log.warning("emitting %s.%s failed: %s", domain, event_type, exc)


class KVMirror:
    """An in-memory copy of one KV bucket, fed by a watch (every instance sees every write)."""

    def __init__(self, service: ServiceBase, kv: KeyValue, name: str) -> None:
        self.service = service
        self.kv = kv
        self.name = name
        self.entries: dict[str, dict[str, Any]] = {}
        self.revisions: dict[str, int] = {}
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self, timeout: float) -> None:
        self.restart()
        async with asyncio.timeout(timeout):
            await self._synced.wait()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def restart(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._task = self.service.spawn(self._watch, f"{self.name}-watch")

    async def _watch(self) -> None:
        watcher = await self.service.open_watch(self.kv, self.name)
        snapshot: dict[str, dict[str, Any]] = {}
        revisions: dict[str, int] = {}
        syncing = True
        try:
            async for entry in watcher:
                if entry is None:
                    if syncing:
                        self.entries, self.revisions = snapshot, revisions
                        syncing = False
                        self._synced.set()
                    continue
                entries = snapshot if syncing else self.entries
                revs = revisions if syncing else self.revisions
                self._apply(entries, revs, entry.key, entry.revision, entry.operation, entry.value)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    def _apply(
        self,
        entries: dict[str, dict[str, Any]],
        revisions: dict[str, int],
        key: str,
        revision: int | None,
        operation: str | None,
        value: bytes | None,
    ) -> None:
        rev = revision or 0
        if rev and revisions.get(key, 0) > rev:
            return  # a newer write (our own, applied on the way out) is already here
        revisions[key] = rev
        if operation in KV_DELETE_OPS or not value:
            entries.pop(key, None)
            return
        try:
            record = orjson.loads(value)
        except orjson.JSONDecodeError:
            return
        if isinstance(record, dict):
            entries[key] = record

    def wrote(self, key: str, revision: int, record: dict[str, Any] | None) -> None:
        """Read-your-writes on this instance; the watch confirms it (and tells the others)."""
        self._apply(
            self.entries, self.revisions, key, revision, None if record else "DEL",
            orjson.dumps(record) if record else None,
        )

    async def get(self, key: str) -> tuple[dict[str, Any] | None, int]:
        """The authoritative record and its revision (a KV read, not the mirror)."""
        try:
            entry = await self.kv.get(key)
        except NotFound:
            return None, 0
        try:
            record = orjson.loads(entry.value or b"")
        except orjson.JSONDecodeError:
            return None, 0
        return (record if isinstance(record, dict) else None), int(entry.revision or 0)
