"""Spans, metrics and log events a node publishes about its agents (AgentMesh §13).

Everything here is off unless the operator turns it on (``[observability]``):
trace *propagation* is core and always on; *publishing* spans, metrics and
logs is a node setting (§13.1.1). With everything off the node holds no
:class:`Observability` at all and the hot path pays one ``is not None``.

**Spans.** Every envelope in or out already passes :meth:`Node.audit`; that
is the one hook. A *producer* span closes when an outbound request, respond
or emit is handed to the wire (its span id is the envelope's own, so the
receiver's consumer span is its child); a *consumer* span opens when an
inbound request or event is admitted and closes when the agent has answered
it (the first respond that is not the accept signal) or when ``on_event``
returns; an inbound respond is a consumer span closed at once. Work a handler
starts is parented by its consumer span (§13.1: "its own span_id"). Spans
are ``emit`` envelopes signed by the agent on ``mesh.trace.{agent_id}``,
built only from envelope members and the outcome (see
:mod:`meshnode.protocol.observability`). The accept signal and registry
probes are plumbing and make no span; task updates and stream chunks travel
outside the audit path and make none either.

**Metrics** (§13.2): every ``metrics_interval`` one event per agent on
``mesh.metrics.{agent_id}`` from the node's per-agent counters and handler
latency histogram.

**Logs** (§13.3): records of the agents' loggers (``meshnode.agent.<name>``)
at or above ``log_level`` become events on ``mesh.log.{agent_id}.{level}``,
with the trace and span of the work that logged them when there is one.

**Refusals.** Publishing is asynchronous (one bounded queue, one sender
task); a full queue drops and counts. A broker that refuses a publish says
so only through the connection's error callback; :class:`PublishRefusals`
turns each ``permissions violation`` into a counter (``node.counters``) and a
warning logged once per subject, so a span or metric the credential does not
cover is never silently lost.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshnode.node.periodic import PeriodicJob
from meshnode.protocol import subjects
from meshnode.protocol.envelope import (
    build_envelope,
    child_trace,
    encode_envelope,
    new_root_trace,
    sign_envelope,
)
from meshnode.protocol.observability import (
    Outcome,
    SpanKind,
    SpanRecord,
    error_code_of,
    log_level_name,
    log_payload,
    metrics_payload,
    outcome_of_respond,
    span_attributes,
    span_payload,
)
from meshnode.protocol.timeutil import try_parse_rfc3339

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent
    from meshnode.node.port import NodePort
    from meshnode.node.runtime import Node
    from meshnode.transport.connection import MeshConnection

__all__ = [
    "CURRENT_TRACE",
    "Observability",
    "ObservabilitySettings",
    "PublishRefusals",
    "install",
    "parse_permission_violation",
]

log = logging.getLogger("meshnode.observability")

#: (agent id, trace) of the work running in this task, for log events.
CURRENT_TRACE: contextvars.ContextVar[tuple[str, Mapping[str, Any]] | None] = contextvars.ContextVar(
    "meshnode_current_trace", default=None
)

_AGENT_LOGGER = "meshnode.agent"
_OPEN_CAP = 10_000
_QUEUE_CAP = 10_000
_PROBE = "__registry_probe__"
#: Offerings the node answers for every agent (§10.14 describe, §10.8 cancel).
_BUILTIN_OFFERINGS = frozenset({"describe", "task.cancel"})


@dataclass(frozen=True)
class ObservabilitySettings:
    """The ``[observability]`` table, typed."""

    spans: bool = False
    logs: bool = False
    log_level: int = logging.INFO
    metrics: bool = False
    metrics_interval_s: float = 60.0

    @property
    def any(self) -> bool:
        return self.spans or self.logs or self.metrics


@dataclass
class _Open:
    """A consumer span between admission and answer."""

    hosted: HostedAgent
    trace: dict[str, Any]
    started_ms: int
    envelope: Mapping[str, Any]
    offering: str | None


def parse_permission_violation(message: str) -> tuple[str, str] | None:
    """``(operation, subject)`` of a nats ``permissions violation`` error, else None.

    nats-py reports ``nats: permissions violation for publish to "mesh.x"``
    (the server's ``-ERR``, lower-cased), ``... for subscription to "..."``.
    """
    text = message.lower()
    marker = "permissions violation for "
    at = text.find(marker)
    if at < 0:
        return None
    rest = message[at + len(marker):]
    operation = "publish" if rest.lower().startswith("publish") else "subscribe"
    first, last = rest.find('"'), rest.rfind('"')
    if first < 0 or last <= first:
        return None
    return operation, rest[first + 1:last]


class PublishRefusals:
    """Counts and reports the broker's refusals of this node's publishes.

    Installed on every node (feeds need it as much as telemetry): each
    refusal increments ``refused.publish.<family>`` in ``node.counters``
    (``trace``, ``metrics``, ``log``, ``feed``, ``event``, ...) and is logged
    at warning level the first time its subject is refused, at debug after.
    """

    def __init__(self, node: NodePort) -> None:
        self.node = node
        self._warned: OrderedDict[str, None] = OrderedDict()

    def install(self, connection: MeshConnection) -> None:
        connection.on_error(self.on_error)

    def on_error(self, message: str) -> None:
        parsed = parse_permission_violation(message)
        if parsed is None:
            return
        operation, subject = parsed
        parts = subject.split(".")
        family = parts[1] if len(parts) > 1 and parts[0] == "mesh" else "other"
        self.node.counters[f"refused.{operation}.{family}"] += 1
        # nats-py lower-cases the server's message; keys are upper-case base32.
        owner = parts[2].upper() if family in ("trace", "metrics", "log", "feed") and len(parts) > 2 else None
        hosted = self.node.by_id.get(owner) if owner else None
        if hosted is not None:
            hosted.counters[f"refused.{operation}.{family}"] += 1
        if subject in self._warned:
            log.debug("the broker refused %s on %s again", operation, subject)
            return
        self._warned[subject] = None
        if len(self._warned) > 1000:
            self._warned.popitem(last=False)
        log.warning(
            "the broker refused to %s on %s (permissions violation): the node credential does not "
            "cover it; counted as refused.%s.%s, further refusals on this subject are counted only",
            operation,
            subject,
            operation,
            family,
        )


class Observability:
    """Span, metric and log publishing for one node (see the module docstring)."""

    def __init__(self, node: NodePort, settings: ObservabilitySettings) -> None:
        self.node = node
        self.settings = settings
        self.spans = settings.spans
        self._open: OrderedDict[tuple[str, str], _Open] = OrderedDict()
        self._queue: asyncio.Queue[tuple[HostedAgent, str, dict[str, Any]]] | None = None
        self._sender: asyncio.Task[None] | None = None
        self._job: PeriodicJob | None = None
        self._handler: _AgentLogHandler | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Start the sender, the metrics job and the log handler (what is enabled)."""
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue(_QUEUE_CAP)
        self._sender = self._loop.create_task(self._send_loop(), name="observability-sender")
        if self.settings.metrics:
            self._job = PeriodicJob(
                "observability-metrics", self.publish_metrics, self.settings.metrics_interval_s, jitter=0.1
            )
            self._job.start()
        if self.settings.logs:
            self._handler = _AgentLogHandler(self, self.settings.log_level)
            logging.getLogger(_AGENT_LOGGER).addHandler(self._handler)

    async def stop(self) -> None:
        if self._handler is not None:
            logging.getLogger(_AGENT_LOGGER).removeHandler(self._handler)
            self._handler = None
        if self._job is not None:
            await self._job.stop()
            self._job = None
        queue, sender = self._queue, self._sender
        self._sender = None
        if queue is not None and sender is not None:
            try:
                async with asyncio.timeout(2.0):
                    await queue.join()  # what is queued goes out while the connection lasts
            except TimeoutError:
                pass
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)

    def status(self) -> dict[str, Any]:
        c = self.node.counters
        return {
            "spans": self.settings.spans,
            "logs": self.settings.logs,
            "metrics": self.settings.metrics,
            "published": {k: c[f"observability.published.{k}"] for k in ("trace", "metrics", "log")},
            "dropped": c["observability.dropped"],
            "failed": c["observability.failed"],
            "open_spans": len(self._open),
        }

    # -- spans -----------------------------------------------------------------

    def on_audit(self, hosted: HostedAgent, env: Mapping[str, Any], direction: str, path: str) -> None:
        """Every envelope in or out (called from :meth:`Node.audit`)."""
        if self.settings.metrics:
            self.count_bytes(hosted, env, direction)
        if not self.spans:
            return
        kind = env.get("type")
        now = self.node.now_ms()
        if direction == "out":
            if kind == "respond":
                if _status(env) == "accepted":
                    return  # the accept signal is a delivery signal, not a hop of its own
                outcome = outcome_of_respond(env)
                opened = self._open.pop((hosted.agent_id, str(env.get("in_reply_to"))), None)
                offering = opened.offering if opened is not None else None
                if opened is not None:
                    self._close(opened, now, outcome, error_code_of(env.get("error")))
                self._producer(hosted, env, now, outcome, error_code_of(env.get("error")), offering)
            elif kind in ("request", "emit"):
                if kind == "request" and _offering(env) == _PROBE:
                    return
                self._producer(hosted, env, now, "ok", None, None)
            return
        if kind == "request":
            offering = _offering(env)
            if offering == _PROBE:
                return
            if offering is not None and offering not in hosted.offerings and offering not in _BUILTIN_OFFERINGS:
                offering = ""  # a name this agent does not offer is the sender's text: recorded as none
            self._opening(hosted, env, now, offering)
        elif kind == "emit":
            self._opening(hosted, env, now, None)
        elif kind == "respond" and _status(env) != "accepted":
            trace = _child(env)
            opened = _Open(hosted, trace, now, env, None)
            self._close(opened, now, outcome_of_respond(env), error_code_of(env.get("error")))

    def enter(
        self, hosted: HostedAgent, env: Mapping[str, Any] | None, trace: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        """The trace a handler context for ``env`` works in (called by :class:`AgentContext`).

        While ``env``'s consumer span is open that is the span itself, so the
        handler's downstream requests and emits are its children (§13.1:
        parent_span_id = the agent's own span). The trace is also remembered
        for this task's log events.
        """
        if env is not None and self.spans:
            opened = self._open.get((hosted.agent_id, str(env.get("id"))))
            if opened is not None:
                trace = opened.trace
        if self.settings.logs:
            CURRENT_TRACE.set((hosted.agent_id, trace))
        return trace

    def event_done(self, hosted: HostedAgent, env: Mapping[str, Any], ok: bool) -> None:
        """``on_event`` returned (``ok``) or raised: close the event's consumer span."""
        opened = self._open.pop((hosted.agent_id, str(env.get("id"))), None)
        if opened is not None:
            self._close(opened, self.node.now_ms(), "ok" if ok else "error", None)
        CURRENT_TRACE.set(None)

    def _opening(self, hosted: HostedAgent, env: Mapping[str, Any], now: int, offering: str | None) -> None:
        key = (hosted.agent_id, str(env.get("id")))
        self._open[key] = _Open(hosted, _child(env), now, env, offering)
        if len(self._open) > _OPEN_CAP:
            # A request never answered (held for a person, crashed handler)
            # must not pin memory: the oldest open span is given up.
            self._open.popitem(last=False)
            self.node.counters["observability.abandoned"] += 1

    def _close(
        self, opened: _Open, now: int, outcome: Outcome, error_code: str | None
    ) -> None:
        attrs = span_attributes(
            opened.envelope, kind="consumer", outcome=outcome, error_code=error_code, offering=opened.offering
        )
        self._span(opened.hosted, opened.trace, "consumer", opened.started_ms, now, attrs)

    def _producer(
        self,
        hosted: HostedAgent,
        env: Mapping[str, Any],
        now: int,
        outcome: Outcome,
        error_code: str | None,
        offering: str | None,
    ) -> None:
        trace = env.get("trace")
        if not isinstance(trace, Mapping):
            return
        ts = try_parse_rfc3339(env.get("ts"))
        started = ts // 1000 if ts is not None else now
        attrs = span_attributes(env, kind="producer", outcome=outcome, error_code=error_code, offering=offering)
        self._span(hosted, trace, "producer", min(started, now), now, attrs)

    def _span(
        self,
        hosted: HostedAgent,
        trace: Mapping[str, Any],
        kind: SpanKind,
        started: int,
        ended: int,
        attrs: Mapping[str, str],
    ) -> None:
        trace_id, span_id = trace.get("trace_id"), trace.get("span_id")
        if not isinstance(trace_id, str) or not isinstance(span_id, str):
            return
        parent = trace.get("parent_span_id")
        record = SpanRecord(
            trace_id=trace_id,
            span_id=span_id,
            parent_span_id=parent if isinstance(parent, str) else None,
            agent_id=hosted.agent_id,
            kind=kind,
            started_ms=started,
            ended_ms=ended,
            attributes=attrs,
        )
        self.enqueue(hosted, subjects.trace_subject(hosted.agent_id), span_payload(record))

    # -- metrics ---------------------------------------------------------------

    async def publish_metrics(self) -> None:
        """One §13.2 event per hosted agent, from its counters and latency histogram."""
        now = self.node.now_ms()
        for hosted in list(self.node.agents.values()):
            c = hosted.counters
            latency = getattr(hosted, "latency", None)
            payload = metrics_payload(
                hosted.agent_id,
                now,
                requests_total=c["dispatched"],
                requests_failed=c["failed"],
                tasks_active=hosted.active_tasks,
                tasks_completed=c["completed"],
                avg_latency_ms=latency.average_ms if latency is not None else 0.0,
                p99_latency_ms=latency.quantile_ms(0.99) if latency is not None else 0.0,
                bytes_in=c["bytes.in"],
                bytes_out=c["bytes.out"],
            )
            self.enqueue(hosted, subjects.metrics_subject(hosted.agent_id), payload)

    def count_bytes(self, hosted: HostedAgent, env: Mapping[str, Any], direction: str) -> None:
        """Envelope bytes in or out for the §13.2 counters (metrics enabled only)."""
        hosted.counters[f"bytes.{direction}"] += len(encode_envelope(env))

    # -- logs ----------------------------------------------------------------------

    def log_record(self, hosted: HostedAgent, record: logging.LogRecord) -> None:
        level = log_level_name(record.levelno)
        current = CURRENT_TRACE.get()
        trace: Mapping[str, Any] | None = None
        if current is not None and current[0] == hosted.agent_id:
            trace = current[1]
        try:
            message = record.getMessage()
        except Exception:
            message = str(record.msg)
        if record.exc_info and record.exc_info[0] is not None:
            message += f" ({record.exc_info[0].__name__})"
        payload = log_payload(
            hosted.agent_id,
            int(record.created * 1000),
            level=level,
            message=message,
            logger=record.name,
            trace_id=trace.get("trace_id") if trace else None,
            span_id=trace.get("span_id") if trace else None,
        )
        self.enqueue(hosted, subjects.log_subject(hosted.agent_id, level), payload)

    # -- the sender ----------------------------------------------------------------

    def enqueue(self, hosted: HostedAgent, subject: str, payload: dict[str, Any]) -> None:
        """Queue one event for the sender; a full queue (or a stopped sender) drops and counts."""
        queue = self._queue
        if queue is None or self._sender is None:
            self.node.counters["observability.dropped"] += 1
            return
        try:
            queue.put_nowait((hosted, subject, payload))
        except asyncio.QueueFull:
            self.node.counters["observability.dropped"] += 1

    async def _send_loop(self) -> None:
        queue = self._queue
        assert queue is not None
        node = self.node
        while True:
            hosted, subject, payload = await queue.get()
            try:
                env = build_envelope(
                    "emit",
                    hosted.agent_id,
                    now_ms=node.now_ms(),
                    payload=payload,
                    # Its own root: a span's envelope is not part of the trace it describes.
                    trace=new_root_trace(),
                    ids=node.ids,
                )
                sign_envelope(env, hosted.key)
                await node.connection.publish(subject, encode_envelope(env))
                node.counters[f"observability.published.{subject.split('.')[1]}"] += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                node.counters["observability.failed"] += 1
                if node.counters["observability.failed"] == 1:
                    log.warning("publishing on %s failed: %s (further failures are counted)", subject, exc)
            finally:
                queue.task_done()


class _AgentLogHandler(logging.Handler):
    """Turns agent log records into §13.3 events (on the loop that owns the node)."""

    def __init__(self, owner: Observability, level: int) -> None:
        super().__init__(level)
        self.owner = owner
        self._pid = os.getpid()

    def emit(self, record: logging.LogRecord) -> None:
        name = record.name
        if not name.startswith(_AGENT_LOGGER + "."):
            return
        agent_name = name[len(_AGENT_LOGGER) + 1:].split(".", 1)[0]
        hosted = self.owner.node.agents.get(agent_name)
        loop = self.owner._loop
        if hosted is None or loop is None or os.getpid() != self._pid:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self.owner.log_record(hosted, record)
            return
        try:
            loop.call_soon_threadsafe(self.owner.log_record, hosted, record)
        except RuntimeError:  # the loop has closed (shutdown): nothing is published any more
            pass


def _status(env: Mapping[str, Any]) -> str | None:
    payload = env.get("payload")
    status = payload.get("status") if isinstance(payload, Mapping) else None
    return status if isinstance(status, str) else None


def _offering(env: Mapping[str, Any]) -> str | None:
    payload = env.get("payload")
    if not isinstance(payload, Mapping):
        return None
    offering = payload.get("offering", payload.get("skill"))
    return offering if isinstance(offering, str) else None


def _child(env: Mapping[str, Any]) -> dict[str, Any]:
    trace = env.get("trace")
    return child_trace(trace if isinstance(trace, Mapping) else None)



def install(node: Node, settings: ObservabilitySettings) -> Observability | None:
    """Wire a node's observability: broker-refusal accounting always, publishing
    only when some of it is enabled. Call from the running loop."""
    PublishRefusals(node).install(node.connection)
    if not settings.any:
        node.observability = None
        return None
    obs = Observability(node, settings)
    obs.start()
    node.observability = obs
    return obs
