"""Spans, logs and metrics on the mesh (§13): emitted only when enabled, read by an
ordinary observer on another node, and never carrying content."""

from __future__ import annotations

import json
from typing import Any

import pytest

from meshnode.observability.otlp import otel_available
from meshnode.testing import DaemonProcess, DaemonSet, eventually, eventually_async

pytestmark = pytest.mark.integration

PLUGINS = {"plugin_modules": ["tests.agents:feeder_plugin", "tests.agents:collector_plugin"]}
ON = {"observability": {"spans": True, "logs": True, "log_level": "warning", "metrics": True,
                        "metrics_interval": "1s"}}
SPAN_DATA_MEMBERS = {"trace_id", "span_id", "parent_span_id", "agent_id", "kind", "operation", "offering",
                     "started_at", "ended_at", "duration_ms", "status", "error", "tags"}
SPAN_ATTRIBUTES = {"agentmesh.primitive", "agentmesh.peer", "agentmesh.offering", "agentmesh.task_id",
                   "agentmesh.context_id", "agentmesh.outcome", "agentmesh.error_code"}



def observed(node: DaemonProcess, prefix: str) -> list[dict[str, Any]]:
    result = node.call("collector", "seen", {"subject_prefix": prefix})
    assert result["status"] == "completed", result
    events: list[dict[str, Any]] = result["output"]
    return events


def test_spans_logs_and_metrics_only_when_enabled(meshnode_daemons: DaemonSet) -> None:
    a = meshnode_daemons.embedded(
        "a", agents={"echo": {"plugin": "echo"}, "feeder": {"plugin": "test-feeder"}}, node=PLUGINS, extra=ON
    )
    b = meshnode_daemons.joined(
        "b", via=a, agents={"collector": {"plugin": "test-collector"}, "echo_b": {"plugin": "echo"}}, node=PLUGINS
    )
    echo, cli = a.agent_id("echo"), a.agent_id("cli")
    quiet = {b.agent_id(n) for n in ("collector", "echo_b", "cli")}
    secret, amount = "s3cret-payload-text", 987654321

    answer = a.call("echo", "echo", {"text": secret, "price": {"amount": amount}})
    assert answer["status"] == "completed", answer
    refused = a.call("echo", "no-such-offering", {"text": secret})
    assert refused["status"] == "failed"
    # Spans are off on B: its agents' exchanges leave no record on the mesh.
    assert b.call("echo_b", "echo", {"text": secret})["status"] == "completed"

    def spans() -> list[dict[str, Any]]:
        return [e for e in observed(b, "mesh.trace.") if e["event_type"] == "span_completed"]

    def find(agent: str, kind: str, primitive: str, outcome: str = "ok") -> list[dict[str, Any]]:
        return [
            s["data"] for s in spans()
            if s["sender"] == agent and s["data"]["kind"] == kind and s["data"]["operation"] == primitive
            and s["data"]["status"] == outcome
        ]

    assert eventually(lambda: find(cli, "consumer", "respond", "refused"), detail=lambda: spans())
    (request,) = [s for s in find(cli, "producer", "request") if s["tags"].get("agentmesh.offering") == "echo"]
    (handled,) = [s for s in find(echo, "consumer", "request") if s["tags"].get("agentmesh.offering") == "echo"]
    (answered,) = [s for s in find(echo, "producer", "respond") if s["tags"].get("agentmesh.offering") == "echo"]
    # One hop, two sides: the consumer span is the child of the producer span.
    assert handled["trace_id"] == request["trace_id"] == answered["trace_id"]
    assert handled["parent_span_id"] == request["span_id"]
    assert request["tags"]["agentmesh.peer"] == echo and handled["tags"]["agentmesh.peer"] == cli
    assert handled["tags"]["agentmesh.outcome"] == "ok" and handled["error"] is None
    (refusal,) = find(echo, "consumer", "request", "refused")
    assert refusal["tags"]["agentmesh.error_code"] == "OFFERING_NOT_FOUND"
    assert "agentmesh.offering" not in refusal["tags"]  # a name the agent does not offer is not ours to record

    everything = spans()
    assert everything and {s["sender"] for s in everything} <= {echo, cli}
    assert not {s["sender"] for s in everything} & quiet
    for span in everything:
        assert set(span["data"]) <= SPAN_DATA_MEMBERS, span["data"]
        assert set(span["data"]["tags"]) <= SPAN_ATTRIBUTES, span["data"]["tags"]
        assert span["subject"] == f"mesh.trace.{span['sender']}"
        assert span["envelope"]["type"] == "emit" and span["envelope"]["from"] == span["sender"]
        assert "payload" not in json.dumps(span["data"])
    text = json.dumps(everything)
    assert secret not in text and str(amount) not in text
    assert "is not offered by this agent" not in text  # never a remote error's message

    # Log events carry the trace and span of the work that logged them (§13.3).
    logged = a.call("feeder", "log", {"note": "n1"})
    assert logged["status"] == "completed", logged
    feeder = a.agent_id("feeder")

    def logs() -> list[dict[str, Any]]:
        return [e["data"] for e in observed(b, f"mesh.log.{feeder}.warn") if "n1" in e["data"]["message"]]

    assert eventually(logs, detail=lambda: observed(b, "mesh.log."))
    (line,) = logs()
    assert line["level"] == "warn" and line["agent_id"] == feeder
    assert (line["trace_id"], line["span_id"]) == (logged["output"]["trace_id"], logged["output"]["span_id"])

    # Metrics (§13.2) from the node's per-agent counters.
    def metrics() -> list[dict[str, Any]]:
        return [e["data"] for e in observed(b, f"mesh.metrics.{echo}") if e["data"]["requests_total"] >= 1]

    assert eventually(metrics, detail=lambda: observed(b, "mesh.metrics."))
    sample = metrics()[-1]
    assert set(sample) == {"agent_id", "timestamp", "requests_total", "requests_failed", "tasks_active",
                           "tasks_completed", "avg_latency_ms", "p99_latency_ms", "bytes_in", "bytes_out"}
    assert sample["bytes_in"] > 0 and sample["bytes_out"] > 0
    assert not [e for e in observed(b, "mesh.") if e["sender"] in quiet]

    status_a, status_b = a.status(), b.status()
    assert status_a["observability"]["published"]["trace"] >= 4
    assert status_b["observability"] is None


@pytest.mark.skipif(not otel_available(), reason="opentelemetry-sdk is not installed (optional)")
def test_otlp_exporter_agent_turns_span_events_into_opentelemetry_spans(
    meshnode_daemons: DaemonSet,
) -> None:  # pragma: no cover - optional dependency
    a = meshnode_daemons.embedded(
        "a",
        agents={"echo": {"plugin": "echo"}, "otlp": {"plugin": "otlp-exporter", "exporter": "console",
                                                      "flush_interval_s": 0.2}},
        node={"plugin_modules": ["meshnode.observability.otlp:plugin"]},
        extra={"observability": {"spans": True}},
    )
    assert a.call("echo", "echo", {"n": 1})["status"] == "completed"
    assert eventually(lambda: '"name": "request echo"' in a.log_text(), detail=lambda: a.log_tail())
    assert '"kind": "SpanKind.CONSUMER"' in a.log_text() and '"kind": "SpanKind.PRODUCER"' in a.log_text()
    assert '"agentmesh.offering": "echo"' in a.log_text()


def test_otlp_exporter_refuses_to_start_without_the_sdk(meshnode_daemons: DaemonSet) -> None:
    if otel_available():
        pytest.skip("opentelemetry-sdk is installed")
    a = meshnode_daemons.embedded(
        "a", agents={"otlp": {"plugin": "otlp-exporter"}},
        node={"plugin_modules": ["meshnode.observability.otlp:plugin"]},
    )
    records = [x for x in a.status()["agents"] if x["name"] == "otlp"]
    assert records and all(r["state"] == "failed" for r in records), records
    assert any("opentelemetry-sdk" in r.get("failure", "") for r in records), records


async def test_a_refused_metric_or_span_publish_is_counted_and_warned_once(
    mesh: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A real broker refusing a publish the credential does not cover (an agent
    missing from the roster): counted per family, warned once per subject."""
    from collections import Counter

    from meshnode.node.observe import ObservabilitySettings, install
    from meshnode.node.runtime import Node, NodeSettings
    from meshnode.protocol.nkeys import KeyPair, Prefix
    from meshnode.transport.connection import MeshConnection
    from meshnode.transport.permissions import node_inbox_prefix

    node_key, listed, unlisted = (KeyPair.generate(Prefix.USER) for _ in range(3))
    jwt = mesh.mint_node_credential(node_key.public_key, [listed.public_key], 60)
    connection = MeshConnection([mesh.url], node_key=node_key, jwt_source=lambda: jwt,
                                inbox_prefix=node_inbox_prefix(node_key.public_key))
    await connection.connect()
    try:
        node = Node(settings=NodeSettings(name="t"), node_key=node_key, connection=connection)
        obs = install(node, ObservabilitySettings(metrics=True, metrics_interval_s=3600))
        assert obs is not None

        class Hosted:  # what publish_metrics reads of a hosted agent
            def __init__(self, key: KeyPair) -> None:
                self.agent_id, self.key, self.active_tasks = key.public_key, key, 0
                self.counters: Counter[str] = Counter()

        node.agents = {"listed": Hosted(listed), "unlisted": Hosted(unlisted)}  # type: ignore[dict-item]
        node.by_id = {h.agent_id: h for h in node.agents.values()}
        for _ in range(2):
            await obs.publish_metrics()
            await connection.flush()
        await eventually_async(lambda: node.counters["refused.publish.metrics"] >= 2)
        assert node.counters["observability.published.metrics"] == 4  # handed over; the broker said no to two
        assert node.agents["unlisted"].counters["refused.publish.metrics"] == 2
        assert node.agents["listed"].counters["refused.publish.metrics"] == 0
        warnings = [r for r in caplog.records if "refused to publish" in r.getMessage()]
        assert len(warnings) == 1 and unlisted.public_key.lower() in warnings[0].getMessage()
        await obs.stop()
    finally:
        await connection.close()
