"""Senders whose clocks are wrong, against real daemons, on both delivery paths (§22.3).

The sender is an agent of the independent wire client (it joins with an
invite and registers), but its envelopes are built and signed by meshnode's
protocol core with a *skewed clock*: the core reads no clock, so a sender
whose clock runs 20 minutes slow is just ``now_ms = wall - 20 min``.

Live (§22.3, max_age 10 min, future 5 min): a clock 20 min slow or 6 min fast
is refused silently (no answer, no handler, ``refused.inbound_stale``); 4 min
fast is served. Mailbox (node offline, the broker buffers): the same 20-min-slow
envelope is *accepted* by the drain (max_age 7 days: being old is what the
buffer is for) and answered at the sender's inbox without an accept, while
6 min fast is still refused (the future bound does not widen for the mailbox)
and 8 days old is refused. The daemon's own clock is not skewed here: the spec
asks receivers to bound senders' clocks, not to detect their own.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from meshnode.protocol.envelope import build_envelope, encode_envelope, sign_envelope
from meshnode.protocol.nkeys import KeyPair
from meshnode.testing import DaemonProcess, DaemonSet
from tests.integration.wire_client import WireAgent, WireClient
from tests.integration.wire_setup import enrolled_wire_agent

pytestmark = pytest.mark.integration

MINUTE_MS = 60_000
DAY_MS = 1440 * MINUTE_MS
QUIET_S = 2.0


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass
class SkewedSender:
    """Signs requests as ``key`` with a clock ``skew_ms`` off the true time."""

    key: KeyPair

    def request(self, target: str, input: Any, *, skew_ms: int) -> dict[str, Any]:
        clock: Callable[[], int] = lambda: wall_ms() + skew_ms  # noqa: E731 - the sender's clock
        env = build_envelope("request", self.key.public_key, now_ms=clock(), to=target,
                             payload={"offering": "echo", "input": input})
        return sign_envelope(env, self.key)


@dataclass
class Setup:
    hub: DaemonProcess
    node: DaemonProcess  # hosts the target; stopped for the mailbox half
    client: WireClient
    agent: WireAgent
    sender: SkewedSender
    target: str

    async def counters(self) -> dict[str, int]:
        status = await asyncio.to_thread(self.node.status)
        return dict(next(a for a in status["agents"] if a["name"] == "target")["counters"])

    async def send(self, env: dict[str, Any]) -> None:
        await self.client.conn.publish(f"mesh.agent.{self.target}.inbox", encode_envelope(env))
        await self.client.barrier()


@pytest.fixture
async def setup(meshnode_daemons: DaemonSet, tmp_path: Path) -> AsyncIterator[Setup]:
    hub = await asyncio.to_thread(meshnode_daemons.embedded, "hub", agents={})
    node = await asyncio.to_thread(meshnode_daemons.joined, "node", via=hub, agents={"target": {"plugin": "echo"}})
    async with enrolled_wire_agent(hub, tmp_path, "skewed", "skewed-sender") as (client, agent):
        sender = SkewedSender(KeyPair.from_seed(agent.key.seed))
        target = await asyncio.to_thread(node.agent_id, "target")
        yield Setup(hub, node, client, agent, sender, target)


def _statuses(responds: list[dict[str, Any]]) -> list[Any]:
    return [(r.get("payload") or {}).get("status") for r in responds]


async def test_skewed_senders_are_judged_by_the_window_of_the_path_they_arrive_on(setup: Setup) -> None:
    s = setup
    # -- live ---------------------------------------------------------------
    before = await s.counters()
    slow = s.sender.request(s.target, "live, 20 min slow", skew_ms=-20 * MINUTE_MS)
    fast = s.sender.request(s.target, "live, 6 min fast", skew_ms=6 * MINUTE_MS)
    for env in (slow, fast):
        await s.send(env)
    arrived = await s.client.quiet(s.agent, seconds=QUIET_S)
    assert [m.envelope for m in arrived if m.envelope] == [], "a stale envelope was answered"
    after = await s.counters()
    assert after.get("refused.inbound_stale", 0) - before.get("refused.inbound_stale", 0) == 2
    assert after.get("dispatched", 0) == before.get("dispatched", 0), "a handler ran for a stale envelope"
    ok = s.sender.request(s.target, "live, 4 min fast", skew_ms=4 * MINUTE_MS)
    await s.send(ok)
    assert _statuses(await s.client.wait_for(s.agent, ok["id"], timeout=10)) == ["accepted", "completed"]

    # -- mailbox: the node is offline and the broker buffers -----------------
    assert await asyncio.to_thread(s.node.stop) == 0
    old_but_buffered = s.sender.request(s.target, "mailbox, 20 min slow", skew_ms=-20 * MINUTE_MS)
    from_the_future = s.sender.request(s.target, "mailbox, 6 min fast", skew_ms=6 * MINUTE_MS)
    older_than_the_buffer = s.sender.request(s.target, "mailbox, 8 days slow", skew_ms=-8 * DAY_MS)
    for env in (old_but_buffered, from_the_future, older_than_the_buffer):
        await s.send(env)
    await asyncio.to_thread(s.node.start)
    responds = await s.client.wait_for(s.agent, old_but_buffered["id"], timeout=60)
    # Drained: answered at the sender's inbox, and never with an accept (§6.4a).
    assert _statuses(responds) == ["completed"]
    assert responds[0]["payload"]["output"] == {"ok": "mailbox, 20 min slow"}
    arrived = await s.client.quiet(s.agent, seconds=QUIET_S)
    answered = {(m.envelope or {}).get("in_reply_to") for m in arrived}
    assert from_the_future["id"] not in answered and older_than_the_buffer["id"] not in answered
    counters = await s.counters()  # a fresh process: its counters count the drain only
    assert counters.get("refused.inbound_stale", 0) == 2, json.dumps(counters)
    assert counters.get("dispatched", 0) == 1
