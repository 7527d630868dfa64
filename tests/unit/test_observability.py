"""Observability, pure parts and the span bookkeeping (§13.1–§13.3), without a broker."""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any

import pytest

from meshnode.node.observe import (
    Observability,
    ObservabilitySettings,
    PublishRefusals,
    parse_permission_violation,
)
from meshnode.observability.otlp import otel_available, span_fields
from meshnode.protocol.envelope import (
    build_envelope,
    decode_envelope,
    new_root_trace,
    sign_envelope,
)
from meshnode.protocol.errors import error_object
from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.protocol.observability import (
    SpanRecord,
    error_code_of,
    log_level_name,
    log_payload,
    metrics_payload,
    outcome_of_respond,
    span_attributes,
    span_payload,
)
from tests.fakes import FakeNode

AGENT = KeyPair.generate(Prefix.USER)
PEER = KeyPair.generate(Prefix.USER)
SECRET = "the sender's secret text"


def request(offering: str = "echo", **extra: Any) -> dict[str, Any]:
    payload = {"offering": offering, "input": {"text": SECRET, "amount": {"value": 4242}}}
    env = build_envelope("request", PEER.public_key, now_ms=1_700_000_000_000, to=AGENT.public_key,
                         payload=payload, **extra)
    return sign_envelope(env, PEER)


def respond(req: dict[str, Any], status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
    env = build_envelope("respond", AGENT.public_key, now_ms=1_700_000_000_050, to=PEER.public_key,
                         in_reply_to=req["id"], payload={"status": status, "output": {"text": SECRET}},
                         error=error, trace={**req["trace"], "span_id": "ab" * 8, "parent_span_id": req["trace"]["span_id"]})
    return sign_envelope(env, AGENT)


def test_attributes_come_from_the_envelope_and_outcome_only() -> None:
    req = request(task_id="task-1", context_id="ctx-9")
    attrs = span_attributes(req, kind="consumer", outcome="ok")
    assert attrs == {
        "agentmesh.primitive": "request",
        "agentmesh.peer": PEER.public_key,
        "agentmesh.offering": "echo",
        "agentmesh.task_id": "task-1",
        "agentmesh.context_id": "ctx-9",
        "agentmesh.outcome": "ok",
    }
    failed = respond(req, "failed", error_object("INPUT_INVALID", f"bad: {SECRET}", {"why": SECRET}))
    attrs = span_attributes(failed, kind="producer", outcome=outcome_of_respond(failed),
                            error_code=error_code_of(failed["error"]), offering="echo")
    assert attrs["agentmesh.outcome"] == "refused" and attrs["agentmesh.error_code"] == "INPUT_INVALID"
    assert attrs["agentmesh.peer"] == PEER.public_key
    text = json.dumps(attrs)
    assert SECRET not in text and "4242" not in text
    # Values from the wire are admitted only in their shape.
    odd = {**req, "task_id": "a.b", "payload": {"offering": "tell me " + SECRET}}
    assert set(span_attributes(odd, kind="consumer", outcome="ok")) == {
        "agentmesh.primitive", "agentmesh.peer", "agentmesh.context_id", "agentmesh.outcome"}
    assert "agentmesh.offering" not in span_attributes(req, kind="consumer", outcome="ok", offering="")


def test_outcomes_and_codes() -> None:
    req = request()
    assert outcome_of_respond(respond(req, "completed")) == "ok"
    assert outcome_of_respond(respond(req, "canceled")) == "canceled"
    assert outcome_of_respond(respond(req, "failed", error_object("INTERNAL_ERROR", "x"))) == "error"
    assert outcome_of_respond(respond(req, "failed", error_object("DEADLINE_EXCEEDED", "x"))) == "timeout"
    assert outcome_of_respond(respond(req, "failed", error_object("OFFERING_NOT_FOUND", "x"))) == "refused"
    assert error_code_of({"code": "MADE_UP_BY_THE_PEER", "message": "x"}) is None
    assert error_code_of({"code": "SKILL_NOT_FOUND"}) == "OFFERING_NOT_FOUND"


def test_span_payload_has_the_span_completed_shape() -> None:
    span = SpanRecord("a" * 32, "b" * 16, None, AGENT.public_key, "producer", 1_000, 1_250,
                      {"agentmesh.primitive": "request", "agentmesh.offering": "echo", "agentmesh.outcome": "ok"})
    payload = span_payload(span)
    assert payload["domain"] == "trace" and payload["event_type"] == "span_completed"
    data = payload["data"]
    assert data["duration_ms"] == 250 and data["operation"] == "request" and data["offering"] == "echo"
    assert data["status"] == "ok" and data["error"] is None and data["parent_span_id"] is None
    assert data["started_at"].endswith("Z") and data["tags"]["agentmesh.outcome"] == "ok"


def test_metrics_and_log_payloads() -> None:
    m = metrics_payload(AGENT.public_key, 0, requests_total=3, requests_failed=1, tasks_active=0,
                        tasks_completed=2, avg_latency_ms=1.23456, p99_latency_ms=float("inf"),
                        bytes_in=10, bytes_out=20)
    assert m["avg_latency_ms"] == 1.235 and m["p99_latency_ms"] == 0 and m["timestamp"] == "1970-01-01T00:00:00.000Z"
    assert [log_level_name(n) for n in (10, 20, 30, 40, 50)] == ["debug", "info", "warn", "error", "error"]
    line = log_payload(AGENT.public_key, 0, level="warn", message="x" * 5000, logger="l", trace_id="t")
    assert line["event_type"] == "warn" and len(line["data"]["message"]) == 4096
    assert line["data"]["trace_id"] == "t" and "span_id" not in line["data"]


def test_permission_violations_are_parsed_and_counted() -> None:
    subject = f"mesh.metrics.{AGENT.public_key}"
    message = f'nats: permissions violation for publish to "{subject.lower()}"'
    assert parse_permission_violation(message) == ("publish", subject.lower())
    assert parse_permission_violation('nats: permissions violation for subscription to "a.b"') == ("subscribe", "a.b")
    assert parse_permission_violation("nats: stale connection") is None
    node = FakeNode()
    refusals = PublishRefusals(node.as_port())
    refusals.on_error(message)
    refusals.on_error(message)
    assert node.counters["refused.publish.metrics"] == 2


# -- the span bookkeeping, with a fake node ------------------------------------------


class FakeHosted:
    def __init__(self) -> None:
        self.agent_id = AGENT.public_key
        self.key = AGENT
        self.name = "echo"
        self.counters: Counter[str] = Counter()
        self.offerings = {"echo": object()}
        self.active_tasks = 0


T0 = 1_700_000_000_100


async def test_one_hop_makes_a_consumer_and_a_producer_span() -> None:
    node, hosted = FakeNode(now_ms=T0), FakeHosted()
    obs = Observability(node.as_port(), ObservabilitySettings(spans=True))
    obs.start()
    req = request()
    obs.on_audit(hosted, req, "in", "live")  # type: ignore[arg-type]
    handling = obs.enter(hosted, req, req["trace"])  # type: ignore[arg-type]
    assert handling["trace_id"] == req["trace"]["trace_id"] and handling["parent_span_id"] == req["trace"]["span_id"]
    obs.on_audit(hosted, respond(req, "accepted"), "out", "live")  # type: ignore[arg-type]
    node.clock += 40
    answer = respond(req, "completed")
    obs.on_audit(hosted, answer, "out", "live")  # type: ignore[arg-type]
    probe = request("__registry_probe__")
    obs.on_audit(hosted, probe, "in", "live")  # type: ignore[arg-type]
    event = sign_envelope(build_envelope("emit", PEER.public_key, now_ms=node.clock, payload={"domain": "d"},
                                         trace=new_root_trace()), PEER)
    obs.on_audit(hosted, event, "in", "event-live")  # type: ignore[arg-type]
    obs.event_done(hosted, event, False)  # type: ignore[arg-type]
    await obs.stop()

    spans = []
    for subject, data in node.connection.published:
        env = decode_envelope(data)  # verified: signed by the agent itself
        assert subject == f"mesh.trace.{AGENT.public_key}" and env["from"] == AGENT.public_key
        spans.append(env["payload"]["data"])
    kinds = [(s["kind"], s["operation"], s["status"]) for s in spans]
    assert kinds == [("consumer", "request", "ok"), ("producer", "respond", "ok"), ("consumer", "emit", "error")]
    consumer, producer, _ = spans
    assert consumer["span_id"] == handling["span_id"] and consumer["duration_ms"] == 40
    assert producer["span_id"] == answer["trace"]["span_id"] and producer["offering"] == "echo"
    assert SECRET not in json.dumps(spans) and "4242" not in json.dumps(spans)
    assert obs.status()["open_spans"] == 0 and node.counters["observability.published.trace"] == 3


async def test_disabled_spans_publish_nothing_and_logs_carry_the_trace() -> None:
    node, hosted = FakeNode(now_ms=T0), FakeHosted()
    node.agents["echo"] = hosted
    obs = Observability(node.as_port(), ObservabilitySettings(logs=True, log_level=logging.WARNING))
    obs.start()
    req = request()
    obs.on_audit(hosted, req, "in", "live")  # type: ignore[arg-type]
    trace = obs.enter(hosted, req, req["trace"])  # type: ignore[arg-type]
    assert trace == req["trace"]  # spans off: the handler works in the envelope's own trace
    logging.getLogger("meshnode.agent.echo").info("below the level")
    logging.getLogger("meshnode.agent.echo").warning("above the level")
    logging.getLogger("meshnode.agent.nobody").warning("not a hosted agent")
    await obs.stop()
    (subject, data), = node.connection.published
    line = decode_envelope(data)["payload"]["data"]
    assert subject == f"mesh.log.{AGENT.public_key}.warn"
    assert line["message"] == "above the level" and line["trace_id"] == req["trace"]["trace_id"]


def test_otlp_mapping_without_the_sdk() -> None:
    span = SpanRecord("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", "00f067aa0ba902b7",
                      AGENT.public_key, "consumer", 1_000, 1_005,
                      {"agentmesh.primitive": "request", "agentmesh.offering": "echo",
                       "agentmesh.outcome": "refused", "agentmesh.error_code": "INPUT_INVALID"})
    fields = span_fields(span_payload(span)["data"])
    assert fields is not None
    assert fields.trace_id == 0x0AF7651916CD43DD8448EB211C80319C and fields.parent_span_id == 0x00F067AA0BA902B7
    assert fields.name == "request echo" and fields.kind == "consumer" and not fields.ok
    assert fields.status_description == "INPUT_INVALID" and fields.end_ns - fields.start_ns == 5_000_000
    assert fields.attributes["messaging.operation.type"] == "process"
    assert span_fields({"trace_id": "0" * 32}) is None and span_fields("nope") is None


@pytest.mark.skipif(not otel_available(), reason="opentelemetry-sdk is not installed (optional)")
def test_otlp_bridge_exports_spans_with_the_mesh_ids() -> None:  # pragma: no cover - optional dependency
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, StatusCode

    from meshnode.observability.otlp import SpanBridge

    exporter = InMemorySpanExporter()
    bridge = SpanBridge(exporter, service_name="test-mesh")
    producer = SpanRecord("0af7651916cd43dd8448eb211c80319c", "00f067aa0ba902b7", None, PEER.public_key,
                          "producer", 1_000, 1_001, {"agentmesh.primitive": "request", "agentmesh.outcome": "ok"})
    consumer = SpanRecord("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", "00f067aa0ba902b7",
                          AGENT.public_key, "consumer", 1_001, 1_010,
                          {"agentmesh.primitive": "request", "agentmesh.outcome": "error",
                           "agentmesh.error_code": "INTERNAL_ERROR"})
    assert bridge.add(span_payload(producer)["data"]) and bridge.add(span_payload(consumer)["data"])
    assert not bridge.add({"not": "a span"})
    assert bridge.flush() == 2
    first, second = exporter.get_finished_spans()
    assert first.kind == SpanKind.PRODUCER and second.kind == SpanKind.CONSUMER
    assert second.parent is not None and second.parent.span_id == first.context.span_id
    assert second.context.trace_id == first.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert second.status.status_code == StatusCode.ERROR and second.status.description == "INTERNAL_ERROR"
    assert second.resource.attributes["agentmesh.agent.id"] == AGENT.public_key
    assert second.attributes["agentmesh.error_code"] == "INTERNAL_ERROR"


def test_the_peak_rss_never_reads_below_the_current_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel folds its per-thread RSS counters into ``ru_maxrss`` lazily:
    ``meshnode status`` showed "RSS 67.1 MiB (peak 66.9 MiB)"."""
    import resource

    from meshnode.daemon import operations

    class Usage:
        ru_maxrss = 1  # KiB: far below any real RSS

    monkeypatch.setattr(resource, "getrusage", lambda _who: Usage())
    figures = operations.process_figures(count_tasks=False)
    rss = figures["rss_bytes"]
    assert isinstance(rss, int) and rss > 1024 and figures["max_rss_bytes"] == rss
