"""What the node runtime needs from the configuration, already typed; and its clock."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from meshnode.protocol.protections import FreshnessWindow

__all__ = ["NodeSettings", "wall_clock_ms"]


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class NodeSettings:
    """What the runtime needs from the configuration, already typed."""

    name: str
    heartbeat_interval_s: float = 30.0
    availability_class: str | None = None
    vouch_ttl_ms: int | None = None
    freshness: FreshnessWindow = field(default_factory=FreshnessWindow)
    max_inbound_chars: int = 65536
    dedup_entries: int = 5000
    registry_timeout_s: float = 5.0
    #: Agents re-registered at once when every agent is (a new attestation, renew-now).
    registrations_at_once: int = 32
    resolve_ttl_s: float = 30.0
    #: Emits (events and feeds) per agent per subject per window (§6.6).
    emit_limit: int = 600
    emit_window_ms: int = 60_000
    #: Seconds between passes of each agent's mailbox drain (§16.4).
    drain_interval_s: float = 60.0
    #: An agent's on_start is warned about after this long, and failed (that agent
    #: only) after agent_start_timeout_s (issue #23 item 2).
    agent_start_warn_s: float = 10.0
    agent_start_timeout_s: float = 60.0
    #: Requests one agent may have in its handlers at once (issue #23 item 10).
    agent_max_concurrency: int = 64
    #: A loop stall at least this long is logged and counted (issue #23 item 2).
    loop_block_threshold_s: float = 1.0
