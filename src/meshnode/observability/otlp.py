"""An example exporter: mesh span events → OpenTelemetry spans over OTLP (§13.4).

An ordinary agent. It subscribes to ``mesh.trace.>`` (or one agent's
``mesh.trace.{agent_id}``) through :meth:`Context.observe`, so every span
event it sees has been signature-verified, owner-checked (the signer is the
agent its subject names) and passed the §22 guard, and turns each
``span_completed`` into an OpenTelemetry span with the same trace and span
ids: a mesh hop lands in the same trace as the OpenTelemetry spans inside the
agents, because both use W3C Trace Context.

It needs ``opentelemetry-sdk`` (and ``opentelemetry-exporter-otlp-proto-http``
for the default exporter), which meshnode does not depend on: without them
the agent refuses to start and says what to install. Use it from a node's
configuration::

    [node]
    plugin_modules = ["meshnode.observability.otlp:plugin"]

    [agents.otlp]
    plugin = "otlp-exporter"
    endpoint = "http://127.0.0.1:4318/v1/traces"   # an OpenTelemetry Collector's OTLP/HTTP receiver

Mapping: ``kind`` producer/consumer → ``SpanKind.PRODUCER``/``CONSUMER``; the
§13.1.1 ``agentmesh.*`` attributes are kept as they are, plus
``messaging.system = agentmesh`` and ``messaging.operation.type`` (``send`` /
``process``); the outcome becomes the span status (``ok`` → OK, anything
else → ERROR described by the closed-enum error code, never a message); the
publishing agent is the resource (``service.name``, ``agentmesh.agent.id``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

import meshnode
from meshnode.agent import Agent, AgentSettings, Context, Event
from meshnode.plugins import hookimpl
from meshnode.protocol.nkeys import is_valid_public
from meshnode.protocol.timeutil import try_parse_rfc3339

__all__ = [
    "OtelSpanFields",
    "OtlpExporter",
    "OtlpSettings",
    "SpanBridge",
    "otel_available",
    "plugin",
    "span_fields",
]

_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_INSTALL_HINT = "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"


def otel_available() -> bool:
    """True when ``opentelemetry-sdk`` can be imported."""
    try:
        return importlib.util.find_spec("opentelemetry.sdk") is not None
    except ModuleNotFoundError:
        return False


@dataclass(frozen=True)
class OtelSpanFields:
    """What an OpenTelemetry span is built from; no SDK types, so testable without it."""

    trace_id: int
    span_id: int
    parent_span_id: int | None
    name: str
    kind: Literal["producer", "consumer"]
    start_ns: int
    end_ns: int
    attributes: dict[str, str]
    ok: bool
    status_description: str | None
    agent_id: str


def span_fields(data: object) -> OtelSpanFields | None:
    """The OpenTelemetry view of a ``span_completed`` data object, or None when
    it is not a well-formed span event (unknown ids, times, or kind)."""
    if not isinstance(data, Mapping):
        return None
    trace_id, span_id, parent = data.get("trace_id"), data.get("span_id"), data.get("parent_span_id")
    if not (isinstance(trace_id, str) and _HEX32.fullmatch(trace_id) and int(trace_id, 16)):
        return None
    if not (isinstance(span_id, str) and _HEX16.fullmatch(span_id) and int(span_id, 16)):
        return None
    if parent is not None and not (isinstance(parent, str) and _HEX16.fullmatch(parent)):
        return None
    kind = data.get("kind")
    if kind not in ("producer", "consumer"):
        return None
    started, ended = try_parse_rfc3339(data.get("started_at")), try_parse_rfc3339(data.get("ended_at"))
    if started is None or ended is None:
        return None
    agent_id = data.get("agent_id")
    if not is_valid_public(agent_id):
        return None
    tags = data.get("tags")
    attributes = {
        str(k): str(v)
        for k, v in (tags.items() if isinstance(tags, Mapping) else ())
        if isinstance(k, str) and k.startswith("agentmesh.") and isinstance(v, str)
    }
    attributes["messaging.system"] = "agentmesh"
    attributes["messaging.operation.type"] = "send" if kind == "producer" else "process"
    assert isinstance(agent_id, str)
    attributes["agentmesh.agent.id"] = agent_id
    operation = attributes.get("agentmesh.primitive", "hop")
    offering = attributes.get("agentmesh.offering")
    outcome = attributes.get("agentmesh.outcome", "ok")
    return OtelSpanFields(
        trace_id=int(trace_id, 16),
        span_id=int(span_id, 16),
        parent_span_id=int(parent, 16) if isinstance(parent, str) and int(parent, 16) else None,
        name=f"{operation} {offering}" if offering else operation,
        kind="producer" if kind == "producer" else "consumer",
        start_ns=started * 1000,
        end_ns=max(ended, started) * 1000,
        attributes=attributes,
        ok=outcome == "ok",
        status_description=None if outcome == "ok" else attributes.get("agentmesh.error_code", outcome),
        agent_id=agent_id,
    )


class SpanBridge:
    """Collects span events and exports them in batches through an OpenTelemetry
    ``SpanExporter`` (any: OTLP, console, in-memory). Requires the SDK."""

    def __init__(self, exporter: Any, *, service_name: str = "agentmesh", batch_size: int = 256) -> None:
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.exporter = exporter
        self.service_name = service_name
        self.batch_size = batch_size
        self._pending: list[OtelSpanFields] = []
        self._resources: dict[str, Any] = {}
        self._scope = InstrumentationScope("meshnode.observability.otlp", meshnode.__version__)
        self.exported = 0
        self.rejected = 0

    def add(self, data: object) -> bool:
        """Queue one span event's data; False (counted) when it is not a span."""
        fields = span_fields(data)
        if fields is None:
            self.rejected += 1
            return False
        self._pending.append(fields)
        return True

    @property
    def full(self) -> bool:
        return len(self._pending) >= self.batch_size

    def flush(self) -> int:
        """Export what is queued (blocking: call it off the event loop); returns the count."""
        batch, self._pending = self._pending, []
        if not batch:
            return 0
        self.exporter.export([self._readable(f) for f in batch])
        self.exported += len(batch)
        return len(batch)

    def _resource(self, agent_id: str) -> Any:
        resource = self._resources.get(agent_id)
        if resource is None:
            from opentelemetry.sdk.resources import Resource

            resource = Resource.create({"service.name": self.service_name, "agentmesh.agent.id": agent_id})
            self._resources[agent_id] = resource
        return resource

    def _readable(self, f: OtelSpanFields) -> Any:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        flags = TraceFlags(TraceFlags.SAMPLED)
        context = SpanContext(f.trace_id, f.span_id, is_remote=False, trace_flags=flags)
        parent = (
            SpanContext(f.trace_id, f.parent_span_id, is_remote=True, trace_flags=flags)
            if f.parent_span_id is not None
            else None
        )
        return ReadableSpan(
            name=f.name,
            context=context,
            parent=parent,
            resource=self._resource(f.agent_id),
            attributes=dict(f.attributes),
            kind=SpanKind.PRODUCER if f.kind == "producer" else SpanKind.CONSUMER,
            status=Status(StatusCode.OK) if f.ok else Status(StatusCode.ERROR, f.status_description),
            start_time=f.start_ns,
            end_time=f.end_ns,
            instrumentation_scope=self._scope,
        )

    def shutdown(self) -> None:
        self.flush()
        self.exporter.shutdown()


class OtlpSettings(AgentSettings):
    """``[agents.<name>]`` of an exporter."""

    exporter: Literal["otlp-http", "otlp-grpc", "console"] = "otlp-http"
    endpoint: str | None = None
    """The collector's OTLP endpoint (``http://host:4318/v1/traces`` for OTLP/HTTP,
    ``host:4317`` for gRPC); None uses the exporter's own default or environment."""
    headers: dict[str, str] = Field(default_factory=dict)
    agent: str | None = None
    """Export only this agent's spans (its id); every agent's by default."""
    service_name: str = "agentmesh"
    batch_size: int = Field(default=256, ge=1)
    flush_interval_s: float = Field(default=1.0, gt=0)


def _make_exporter(settings: OtlpSettings) -> Any:
    if settings.exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    kwargs: dict[str, Any] = {}
    if settings.endpoint:
        kwargs["endpoint"] = settings.endpoint
    if settings.headers:
        kwargs["headers"] = dict(settings.headers)
    if settings.exporter == "otlp-grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc(**kwargs)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http(**kwargs)


class OtlpExporter(Agent):
    """Subscribes to span events and exports them as OpenTelemetry spans."""

    description = "Exports the mesh's span events to an OpenTelemetry collector (OTLP)."
    capabilities = ("observability",)
    Settings = OtlpSettings
    #: Overridable for tests: builds the SpanExporter from the settings.
    exporter_factory: Callable[[OtlpSettings], Any] = staticmethod(_make_exporter)

    def __init__(self, name: str, settings: AgentSettings) -> None:
        super().__init__(name, settings)
        self.bridge: SpanBridge | None = None
        self._flusher: asyncio.Task[None] | None = None

    async def on_start(self, ctx: Context) -> None:
        if not otel_available():
            raise RuntimeError(f"the OTLP exporter needs the OpenTelemetry SDK: {_INSTALL_HINT}")
        settings = self.settings
        assert isinstance(settings, OtlpSettings)
        try:
            exporter = type(self).exporter_factory(settings)
        except ImportError as exc:
            raise RuntimeError(f"cannot build the {settings.exporter} exporter ({exc}): {_INSTALL_HINT}") from None
        self.bridge = SpanBridge(exporter, service_name=settings.service_name, batch_size=settings.batch_size)
        self._flusher = asyncio.get_running_loop().create_task(self._flush_loop(settings.flush_interval_s))
        await ctx.observe("trace", settings.agent)

    async def on_event(self, ctx: Context, event: Event) -> None:
        if self.bridge is None or event.domain != "trace" or event.event_type != "span_completed":
            return
        if self.bridge.add(event.data) and self.bridge.full:
            await self._flush()

    async def _flush(self) -> None:
        if self.bridge is not None:
            try:
                await asyncio.to_thread(self.bridge.flush)
            except Exception as exc:  # a collector that is down must not stop the agent
                self.log.warning("exporting spans failed: %s", exc)

    async def _flush_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self._flush()

    async def on_stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
        if self.bridge is not None:
            await asyncio.to_thread(self.bridge.shutdown)


class _Plugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("otlp-exporter", OtlpExporter)


#: ``[node] plugin_modules = ["meshnode.observability.otlp:plugin"]`` provides
#: the agent kind ``otlp-exporter``.
plugin = _Plugin()
