"""What a node publishes about itself (AgentMesh §13.1–§13.3): spans, metrics, logs.

Pure functions: the clock and ids are parameters, nothing here does I/O.

**Spans (§13.1.1).** A mesh hop is one span on each side: the sender's
*producer* span (closed when the message is handed to the wire) and the
receiver's *consumer* span (closed when it has finished handling it). Span
attributes are drawn from the envelope and from the outcome only —
:func:`span_attributes` reads exactly the envelope members the span model
lists and nothing else, so payloads, sender text, artifacts, offering inputs
and outputs, amounts and a remote party's free-text error message cannot
reach a span by construction. Values from the wire are admitted only when
they have the shape the attribute has (a key, an id token, a closed-enum
error code); anything else is left out rather than copied.

**Metrics (§13.2)** and **logs (§13.3)** are ordinary emit payloads on
``mesh.metrics.{agent}`` and ``mesh.log.{agent}.{level}``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ERROR_CODES, normalize_code
from .nkeys import is_valid_public
from .subjects import is_valid_id_token
from .timeutil import format_ts

__all__ = [
    "LOG_LEVELS",
    "OUTCOMES",
    "Outcome",
    "SpanKind",
    "SpanRecord",
    "error_code_of",
    "log_level_name",
    "log_payload",
    "metrics_payload",
    "outcome_of_respond",
    "span_attributes",
    "span_payload",
]

SpanKind = Literal["producer", "consumer"]
Outcome = Literal["ok", "error", "refused", "timeout", "canceled"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "error", "refused", "timeout", "canceled")

#: The §13.3 levels, in order.
LOG_LEVELS = ("debug", "info", "warn", "error")

# Codes an agent answers *instead of* doing the work: admission and policy
# refusals (§6.4, §12.2). Everything else that fails is an error.
_REFUSAL_CODES = frozenset({
    "INVALID_ENVELOPE", "INVALID_VERSION", "IDENTITY_MISMATCH", "OFFERING_NOT_FOUND",
    "INPUT_INVALID", "CONTENT_TYPE_NOT_SUPPORTED", "UNAUTHORIZED", "SEALING_REQUIRED",
    "BUDGET_INSUFFICIENT", "DEADLINE_UNMEETABLE", "AGREEMENT_REQUIRED", "CONTEXT_TOO_LARGE",
    "RATE_LIMITED", "AGENT_OVERLOADED", "QUOTA_EXCEEDED", "PAYLOAD_TOO_LARGE",
    "TASK_NOT_CANCELABLE", "TASK_INVALID_TRANSITION",
})
_TIMEOUT_CODES = frozenset({"TRANSPORT_TIMEOUT", "DEADLINE_EXCEEDED"})
# An offering id is the agent's own naming; only a plain token may ride a span.
_OFFERING = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")


def error_code_of(error: object) -> str | None:
    """The closed-enum §12.2 code of an error object, or None.

    Only the code: never the message or details (a remote party's free text
    MUST NOT reach a span), and never a code outside the table.
    """
    if not isinstance(error, Mapping):
        return None
    code = error.get("code")
    if not isinstance(code, str):
        return None
    code = normalize_code(code)
    return code if code in ERROR_CODES else None


def outcome_of_respond(envelope: Mapping[str, Any]) -> Outcome:
    """The §13.1.1 outcome a respond reports: its status, else its error's code."""
    payload = envelope.get("payload")
    status = payload.get("status") if isinstance(payload, Mapping) else None
    if status == "canceled":
        return "canceled"
    if status == "rejected":
        return "refused"
    code = error_code_of(envelope.get("error"))
    if status == "failed" or envelope.get("error") is not None:
        if code in _TIMEOUT_CODES:
            return "timeout"
        if code in _REFUSAL_CODES:
            return "refused"
        return "error"
    if status == "exhausted":
        return "error"
    return "ok"


def _offering_of(envelope: Mapping[str, Any]) -> str | None:
    if envelope.get("type") != "request":
        return None
    payload = envelope.get("payload")
    offering = payload.get("offering") if isinstance(payload, Mapping) else None
    if offering is None and isinstance(payload, Mapping):
        offering = payload.get("skill")  # the legacy alias (§8.5)
    return offering if isinstance(offering, str) and _OFFERING.fullmatch(offering) else None


def span_attributes(
    envelope: Mapping[str, Any],
    *,
    kind: SpanKind,
    outcome: Outcome,
    error_code: str | None = None,
    offering: str | None = None,
) -> dict[str, str]:
    """The §13.1.1 attributes of the span for ``envelope``, and only those.

    ``kind`` picks the peer: a producer's counterparty is ``to``, a consumer's
    is ``from``. ``offering`` overrides the envelope's (a respond names none;
    its request did); ``""`` records none. Absent or ill-shaped values are omitted.
    """
    attrs: dict[str, str] = {}
    primitive = envelope.get("type")
    if isinstance(primitive, str) and primitive in ("request", "respond", "emit", "subscribe"):
        attrs["agentmesh.primitive"] = primitive
    peer = envelope.get("to") if kind == "producer" else envelope.get("from")
    if isinstance(peer, str) and is_valid_public(peer):
        attrs["agentmesh.peer"] = peer
    named = offering if offering is not None else _offering_of(envelope)
    if named is not None and _OFFERING.fullmatch(named):
        attrs["agentmesh.offering"] = named
    for member, name in (("task_id", "agentmesh.task_id"), ("context_id", "agentmesh.context_id")):
        value = envelope.get(member)
        if is_valid_id_token(value):
            assert isinstance(value, str)
            attrs[name] = value
    attrs["agentmesh.outcome"] = outcome
    code = error_code if error_code in ERROR_CODES else None
    if code is not None and outcome != "ok":
        attrs["agentmesh.error_code"] = code
    return attrs


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """One closed span, before it becomes a ``span_completed`` payload."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    agent_id: str
    kind: SpanKind
    started_ms: int
    ended_ms: int
    attributes: Mapping[str, str]


def span_payload(span: SpanRecord) -> dict[str, Any]:
    """The §13.1 emit payload ``{domain: trace, event_type: span_completed, data}``.

    ``data`` carries the §13.1 members; ``tags`` holds the §13.1.1 attributes
    under their ``agentmesh.*`` names, and ``kind`` says which side of the hop
    this is (``producer``/``consumer``), which an OpenTelemetry exporter needs.
    """
    attrs = dict(span.attributes)
    outcome = attrs.get("agentmesh.outcome", "ok")
    data: dict[str, Any] = {
        "trace_id": span.trace_id,
        "span_id": span.span_id,
        "parent_span_id": span.parent_span_id,
        "agent_id": span.agent_id,
        "kind": span.kind,
        "operation": attrs.get("agentmesh.primitive", "unknown"),
        "started_at": format_ts(span.started_ms),
        "ended_at": format_ts(span.ended_ms),
        "duration_ms": max(0, span.ended_ms - span.started_ms),
        "status": outcome,
        "error": attrs.get("agentmesh.error_code"),
        "tags": attrs,
    }
    if "agentmesh.offering" in attrs:
        data["offering"] = attrs["agentmesh.offering"]
    return {"domain": "trace", "event_type": "span_completed", "data": data}


def metrics_payload(
    agent_id: str,
    now_ms: int,
    *,
    requests_total: int,
    requests_failed: int,
    tasks_active: int,
    tasks_completed: int,
    avg_latency_ms: float,
    p99_latency_ms: float,
    bytes_in: int,
    bytes_out: int,
) -> dict[str, Any]:
    """The §13.2 metrics payload (counts cumulative since the agent started)."""

    def ms(value: float) -> int | float:
        # JSON has no infinity: an open-ended top bucket reports as its bound.
        if value != value or value in (float("inf"), float("-inf")):
            return 0
        return round(value, 3)

    return {
        "agent_id": agent_id,
        "timestamp": format_ts(now_ms),
        "requests_total": requests_total,
        "requests_failed": requests_failed,
        "tasks_active": tasks_active,
        "tasks_completed": tasks_completed,
        "avg_latency_ms": ms(avg_latency_ms),
        "p99_latency_ms": ms(p99_latency_ms),
        "bytes_in": bytes_in,
        "bytes_out": bytes_out,
    }


def log_level_name(levelno: int) -> str:
    """A Python logging level as one of the §13.3 levels."""
    if levelno >= 40:
        return "error"
    if levelno >= 30:
        return "warn"
    if levelno >= 20:
        return "info"
    return "debug"


def log_payload(
    agent_id: str,
    now_ms: int,
    *,
    level: str,
    message: str,
    logger: str,
    trace_id: str | None = None,
    span_id: str | None = None,
    max_chars: int = 4096,
) -> dict[str, Any]:
    """The §13.3 log emit payload ``{domain: log, event_type: level, data}``.

    ``trace_id`` and ``span_id`` are included when available (§13.3 MUST);
    the message is cut at ``max_chars`` so one log line cannot fill the bus.
    """
    text = message if len(message) <= max_chars else message[: max_chars - 1] + "…"
    data: dict[str, Any] = {
        "agent_id": agent_id,
        "timestamp": format_ts(now_ms),
        "level": level,
        "logger": logger,
        "message": text,
    }
    if trace_id:
        data["trace_id"] = trace_id
    if span_id:
        data["span_id"] = span_id
    return {"domain": "log", "event_type": level, "data": data}
