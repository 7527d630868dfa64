"""Counters and latency histograms a node keeps per agent, and their Prometheus text form."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LatencyHistogram", "loop_text", "merge_exposition", "prometheus_text"]

#: Histogram bucket upper bounds, in milliseconds.
BUCKETS_MS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)


@dataclass
class LatencyHistogram:
    """Cumulative histogram of handler durations (cheap to update on the hot path)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_MS) + 1))
    total: int = 0
    sum_ms: float = 0.0

    def observe(self, ms: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_MS, ms)] += 1
        self.total += 1
        self.sum_ms += ms

    @property
    def average_ms(self) -> float:
        return self.sum_ms / self.total if self.total else 0.0

    def quantile_ms(self, q: float) -> float:
        """An upper-bound estimate of the q-quantile (the bucket it falls in)."""
        if not self.total:
            return 0.0
        rank = q * self.total
        seen = 0
        for i, n in enumerate(self.counts):
            seen += n
            if seen >= rank:
                return float(BUCKETS_MS[i]) if i < len(BUCKETS_MS) else float("inf")
        return float("inf")

    def as_dict(self) -> dict[str, float | int]:
        return {
            "count": self.total,
            "avg_ms": round(self.average_ms, 3),
            "p50_ms": self.quantile_ms(0.5),
            "p99_ms": self.quantile_ms(0.99),
        }


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(
    agents: Iterable[tuple[str, str, Mapping[str, int], LatencyHistogram]],
    node: Mapping[str, int],
    refusals: Mapping[tuple[str, str], int] | None = None,
) -> str:
    """The Prometheus text exposition format (version 0.0.4) of the node's metrics.

    ``refusals`` is :meth:`RefusalCounter.by_label`: inbound refusals by intake and rule.
    """
    lines = [
        "# HELP meshnode_node_events_total Node-level counters (heartbeats, envelopes by type and path).",
        "# TYPE meshnode_node_events_total counter",
    ]
    for key, value in sorted(node.items()):
        lines.append(f'meshnode_node_events_total{{event="{_escape(key)}"}} {value}')
    if refusals is not None:
        lines += [
            "# HELP meshnode_inbound_refused_total Inbound envelopes refused, by intake and rule (§22.7).",
            "# TYPE meshnode_inbound_refused_total counter",
        ]
        for (intake, rule), value in sorted(refusals.items()):
            lines.append(
                f'meshnode_inbound_refused_total{{intake="{_escape(intake)}",rule="{_escape(rule)}"}} {value}'
            )
    lines += [
        "# HELP meshnode_agent_events_total Per-agent counters (received, dispatched, completed, refused.*).",
        "# TYPE meshnode_agent_events_total counter",
    ]
    histograms: list[str] = [
        "# HELP meshnode_handler_duration_ms Offering handler durations.",
        "# TYPE meshnode_handler_duration_ms histogram",
    ]
    for name, agent_id, counters, hist in agents:
        labels = f'agent="{_escape(name)}",agent_id="{agent_id}"'
        for key, value in sorted(counters.items()):
            lines.append(f'meshnode_agent_events_total{{{labels},event="{_escape(key)}"}} {value}')
        cumulative = 0
        for bound, n in zip((*BUCKETS_MS, "+Inf"), hist.counts, strict=True):
            cumulative += n
            histograms.append(f'meshnode_handler_duration_ms_bucket{{{labels},le="{bound}"}} {cumulative}')
        histograms.append(f"meshnode_handler_duration_ms_sum{{{labels}}} {hist.sum_ms:.3f}")
        histograms.append(f"meshnode_handler_duration_ms_count{{{labels}}} {hist.total}")
    return "\n".join(lines + histograms) + "\n"


def loop_text(
    loop: Mapping[str, Any] | None,
    concurrency: Mapping[str, tuple[int, int]],
    spawned: Mapping[str, tuple[int, int]] | None = None,
) -> str:
    """The loop-lag watchdog's figures and each agent's handlers in flight, as Prometheus text.

    ``loop`` is :meth:`LoopWatchdog.status` (None: leave the loop's own
    figures out, as a page after the first does); ``concurrency`` maps an
    agent's name to (requests in its handlers, its limit); ``spawned`` to
    (tasks its handlers spawned that still run, tasks they spawned in all).
    """
    lines: list[str] = []
    if loop is not None:
        lines += [
            "# HELP meshnode_loop_lag_seconds How late the event loop's last periodic wakeup fired.",
            "# TYPE meshnode_loop_lag_seconds gauge",
            f"meshnode_loop_lag_seconds {loop['lag_s']}",
            "# HELP meshnode_loop_lag_max_seconds The largest loop lag seen since the start.",
            "# TYPE meshnode_loop_lag_max_seconds gauge",
            f"meshnode_loop_lag_max_seconds {loop['max_lag_s']}",
            "# HELP meshnode_loop_blocks_total Loop stalls past the threshold, by the agent whose handler ran.",
            "# TYPE meshnode_loop_blocks_total counter",
        ]
        for agent, n in sorted(loop["blocks"].items()):
            lines.append(f'meshnode_loop_blocks_total{{agent="{_escape(agent)}"}} {n}')
    lines += [
        "# HELP meshnode_agent_in_flight Requests in an agent's handlers now.",
        "# TYPE meshnode_agent_in_flight gauge",
    ]
    for name, (n, _) in sorted(concurrency.items()):
        lines.append(f'meshnode_agent_in_flight{{agent="{_escape(name)}"}} {n}')
    lines += [
        "# HELP meshnode_agent_max_concurrency An agent's limit of requests in its handlers.",
        "# TYPE meshnode_agent_max_concurrency gauge",
    ]
    for name, (_, limit) in sorted(concurrency.items()):
        lines.append(f'meshnode_agent_max_concurrency{{agent="{_escape(name)}"}} {limit}')
    if spawned:
        lines += [
            "# HELP meshnode_agent_spawned_tasks asyncio tasks an agent's handlers spawned that still run.",
            "# TYPE meshnode_agent_spawned_tasks gauge",
        ]
        for name, (live, _) in sorted(spawned.items()):
            lines.append(f'meshnode_agent_spawned_tasks{{agent="{_escape(name)}"}} {live}')
        lines += [
            "# HELP meshnode_agent_spawned_tasks_total asyncio tasks an agent's handlers spawned since its start.",
            "# TYPE meshnode_agent_spawned_tasks_total counter",
        ]
        for name, (_, total) in sorted(spawned.items()):
            lines.append(f'meshnode_agent_spawned_tasks_total{{agent="{_escape(name)}"}} {total}')
    return "\n".join(lines) + "\n"


def merge_exposition(texts: Iterable[str]) -> str:
    """Prometheus texts (this module's, e.g. the pages of ``Metrics``) as one.

    The exposition format keeps each metric family's samples together under
    one HELP and TYPE; pages each carry their agents' samples of the same
    families. Families come in the order they first appear, samples in page
    order.
    """
    families: dict[str, list[str]] = {}
    headers: dict[str, list[str]] = {}
    for text in texts:
        current = ""
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                current = line.split(" ", 3)[2]
                known = headers.setdefault(current, [])
                families.setdefault(current, [])
                if not any(h.startswith(line[:7]) for h in known):
                    known.append(line)
                continue
            families.setdefault(current, []).append(line)
    out: list[str] = []
    for name, samples in families.items():
        out += headers.get(name, [])
        out += samples
    return "\n".join(out) + "\n"
