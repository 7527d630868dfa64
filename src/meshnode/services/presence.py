"""The presence service (§9.6, §10.10): ephemeral node liveness, never the manifest.

Subjects:

``mesh.heartbeat.{node_id}`` and ``mesh.heartbeat.{node_id}.{agent_id}`` (consumed)
    A signed ``emit`` (WIRE-NOTES: payload ``{node, availability}`` from the
    SDKs; the spec's ``{availability, active_tasks, capacity, uptime_seconds,
    load}``). The identity rules of §10.10 are applied in full:

    * the node is the subject token, which must be a valid node key; a
      payload ``node`` is never read;
    * a message that does not decode and verify as an envelope is dropped;
    * the sender must be the node itself, or an agent that node vouched for
      (asked of the registry through ``vouched_by``); a per-agent override
      additionally requires the subject's agent to be vouched by that node,
      and its sender to be the node or that agent;
    * an ``availability`` outside online/busy/degraded/offline is absent,
      which reads as ``online``;
    * duplicates and envelopes outside the live freshness window are
      dropped, so a captured beat cannot be replayed to hold a dead node up.

    Every service node consumes every heartbeat (no queue group): each
    presence instance keeps its own full view.

``mesh.presence.get`` (request-reply, queue group ``mesh_presence``)
    ``{}`` (or no payload) → ``{nodes: [{node, availability, last_seen, ...}]}``;
    ``{node}`` → ``{node, availability, last_seen?, ...}`` (a node never seen
    is ``offline`` without ``last_seen``); ``{agent}`` → the same for the
    node currently vouching for the agent, plus ``agent`` and its per-agent
    override when one is fresh (``NOT_FOUND`` when no node vouches for it).
    ``last_seen`` is RFC 3339; the load members (``active_tasks``,
    ``capacity``, ``uptime_seconds``, ``load``) appear when the last beat
    carried them. ``INVALID_QUERY`` for a malformed key.

A node is offline when its last beat is older than ``2 × heartbeat_interval``
(computed at read time) or when it said so. A periodic sweep emits
``mesh.event.presence.node_offline`` when a node stops beating and
``node_online`` when it (re)appears (payload data ``{node, availability,
last_seen}``), and evicts nodes silent for ``evict_after_s``.

On start, presence subscribes first and then seeds itself from the last beat
per node still in ``MESH_HEARTBEAT`` (subscribe before snapshot, §9.6), so a
restarted presence does not report every node offline for an interval.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from meshnode.protocol import subjects
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import is_valid_public
from meshnode.protocol.timeutil import format_ts
from meshnode.transport.connection import Message

from .base import Envelope, ServiceBase, ServiceContext
from .query import AVAILABILITY_VALUES

__all__ = ["LOAD_MEMBERS", "PresenceRecord", "PresenceService", "VouchLookup"]

#: Who vouches for an agent now: its node id, or None (not registered, vouch expired).
VouchLookup = Callable[[str], str | None]

LOAD_MEMBERS = ("active_tasks", "capacity", "uptime_seconds", "load")
_HEARTBEAT_ALL = "mesh.heartbeat.>"


@dataclass
class PresenceRecord:
    """The last accepted beat for a node (``agent`` None) or a per-agent override."""

    node: str
    last_seen_ms: int
    reported: str = "online"
    load: dict[str, int | float] = field(default_factory=dict)
    agent: str | None = None


def _number(value: object) -> int | float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class PresenceService(ServiceBase):
    """Tracks node liveness from heartbeats and answers ``mesh.presence.get``."""

    def __init__(
        self,
        ctx: ServiceContext,
        heartbeat_interval_s: float = 30.0,
        *,
        vouched_by: VouchLookup | None = None,
        evict_after_s: float = 3600.0,
        seed_from_stream: bool = True,
    ) -> None:
        if heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be positive")
        super().__init__(ctx, name="presence", queue="mesh_presence")
        self.heartbeat_interval_s = heartbeat_interval_s
        self.vouched_by = vouched_by
        """The registry's answer to "which node vouches for this agent now?"."""
        self.evict_after_s = max(evict_after_s, 2 * heartbeat_interval_s)
        self._seed = seed_from_stream
        self._nodes: dict[str, PresenceRecord] = {}
        self._agents: dict[str, PresenceRecord] = {}
        self._live: dict[str, bool] = {}

    @property
    def offline_after_ms(self) -> int:
        """Silence longer than this makes a node offline (2 × interval, §9.6)."""
        return int(2 * self.heartbeat_interval_s * 1000)

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        if self.running:
            return
        self._running = True
        await self.subscribe(_HEARTBEAT_ALL, self._on_heartbeat, queue=False)
        await self.serve(subjects.PRESENCE_GET, self._get)
        await self.ctx.connection.flush()
        if self._seed:
            await self._seed_from_stream()
        self.spawn(self._sweep_loop, "sweep")

    # -- reads ---------------------------------------------------------------

    def _fresh(self, record: PresenceRecord | None, now_ms: int) -> bool:
        return record is not None and now_ms - record.last_seen_ms <= self.offline_after_ms

    def availability_of_node(self, node_id: str) -> str:
        """``online``/``busy``/``degraded``/``offline`` for ``node_id`` now."""
        record = self._nodes.get(node_id)
        if not self._fresh(record, self.ctx.now_ms()):
            return "offline"
        assert record is not None
        return record.reported

    def availability_of(self, agent_id: str, node_id: str | None = None) -> str:
        """An agent's availability: its fresh per-agent override, else its node's.

        ``node_id`` is the agent's hosting node when the caller knows it;
        otherwise it is asked of ``vouched_by``.
        """
        if node_id is None:
            node_id = self.vouched_by(agent_id) if self.vouched_by else None
            if node_id is None:
                return "offline"
        node_state = self.availability_of_node(node_id)
        override = self._agents.get(agent_id)
        if (
            node_state != "offline"
            and override is not None
            and override.node == node_id
            and self._fresh(override, self.ctx.now_ms())
        ):
            return override.reported
        return node_state

    def node_view(self, node_id: str) -> dict[str, Any]:
        """The ``{node, availability, last_seen?, load...}`` answer for one node."""
        view: dict[str, Any] = {"node": node_id, "availability": self.availability_of_node(node_id)}
        record = self._nodes.get(node_id)
        if record is not None:
            view["last_seen"] = format_ts(record.last_seen_ms)
            view.update(record.load)
        return view

    def nodes(self) -> list[dict[str, Any]]:
        """Every node presence currently knows, by node id."""
        return [self.node_view(node) for node in sorted(self._nodes)]

    # -- heartbeats ----------------------------------------------------------

    async def _on_heartbeat(self, msg: Message) -> None:
        target = subjects.parse_heartbeat_subject(msg.subject)
        if target is None:
            self.log.debug("dropped a heartbeat on a malformed subject %r", msg.subject[:120])
            return
        env = self.accept(msg, request=False)
        if env is None:
            return
        await self._ingest(target, env, self.ctx.now_ms())

    def _authorized(self, target: subjects.HeartbeatSubject, sender: str) -> bool:
        node, agent = target.node_id, target.agent_id
        lookup = self.vouched_by
        if agent is not None and (lookup is None or lookup(agent) != node):
            return False  # an override for an agent this node does not host
        if sender == node:
            return True
        if lookup is None or lookup(sender) != node:
            return False
        return agent is None or sender == agent

    async def _ingest(
        self, target: subjects.HeartbeatSubject, env: Envelope, seen_ms: int, *, announce: bool = True
    ) -> None:
        if env["type"] != "emit":
            self.log.info("dropped a %s envelope on %s", env["type"], subjects.heartbeat(target.node_id))
            return
        if not self._authorized(target, env["from"]):
            self.log.warning(
                "dropped a heartbeat for node %s from %s: not the node or an agent it vouched for",
                target.node_id,
                env["from"],
            )
            return
        payload = env.get("payload")
        body: Mapping[str, Any] = payload if isinstance(payload, Mapping) else {}
        reported = body.get("availability")
        if not (isinstance(reported, str) and reported in AVAILABILITY_VALUES):
            reported = "online"  # §10.10: an unknown value is treated as absent
        load = {k: n for k in LOAD_MEMBERS if (n := _number(body.get(k))) is not None}
        record = PresenceRecord(target.node_id, seen_ms, reported, load, target.agent_id)
        table, key = (
            (self._nodes, target.node_id)
            if target.agent_id is None
            else (self._agents, target.agent_id)
        )
        current = table.get(key)
        if current is not None and current.last_seen_ms > seen_ms:
            return  # an older beat (from the stream seed) never rolls presence back
        table[key] = record
        if announce:
            await self._announce(target.node_id)

    async def _announce(self, node_id: str) -> None:
        live = self.availability_of_node(node_id) != "offline"
        if self._live.get(node_id, False) == live:
            return
        self._live[node_id] = live
        view = self.node_view(node_id)
        data: dict[str, Any] = {
            k: view[k] for k in ("node", "availability", "last_seen") if k in view
        }
        await self.emit("presence", "node_online" if live else "node_offline", data)

    async def _seed_from_stream(self) -> None:
        js = self.ctx.connection.jetstream
        try:
            beats = await js.stream_subjects(subjects.MESH_HEARTBEAT, _HEARTBEAT_ALL)
        except Exception as exc:
            self.log.info("no heartbeat history to seed from: %s", exc)
            return
        for subject in sorted(beats):
            target = subjects.parse_heartbeat_subject(subject)
            if target is None:
                continue
            try:
                raw = await js.last_message(subjects.MESH_HEARTBEAT, subject)
            except Exception as exc:
                self.log.debug("could not read the last beat on %s: %s", subject, exc)
                continue
            if not raw.data or raw.stored_ms is None:
                continue
            env = self.decode(raw.data, subject)
            if env is None:
                continue
            # The server's capture time, not the sender's ts, is when we heard it.
            seen_ms = raw.stored_ms
            await self._ingest(target, env, min(seen_ms, self.ctx.now_ms()), announce=False)
        for node in self._nodes:
            self._live[node] = self.availability_of_node(node) != "offline"

    async def sweep(self) -> None:
        """Announce nodes that went silent and evict long-silent ones (run periodically)."""
        now = self.ctx.now_ms()
        evict_ms = int(self.evict_after_s * 1000)
        for node in list(self._nodes):
            await self._announce(node)
            record = self._nodes.get(node)
            if record is not None and now - record.last_seen_ms > evict_ms:
                del self._nodes[node]
                self._live.pop(node, None)
        for agent, record in list(self._agents.items()):
            if now - record.last_seen_ms > evict_ms:
                del self._agents[agent]

    async def _sweep_loop(self) -> None:
        period = max(0.05, self.heartbeat_interval_s / 4)
        loop = asyncio.get_running_loop()
        while self.running:
            due = loop.time() + period
            await asyncio.sleep(period)
            if loop.time() - due > period:
                # This process's loop stalled (a handler blocking it, #23): the
                # beats that arrived meanwhile are still unread, so the silence
                # measured now is our own. Read them first; judge next period.
                continue
            try:
                await self.sweep()
            except Exception:
                self.log.exception("presence sweep failed")

    # -- mesh.presence.get ---------------------------------------------------

    async def _get(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        payload = env.get("payload")
        if payload is None:
            payload = {}
        if not isinstance(payload, Mapping):
            raise ProtocolError("INVALID_QUERY", "query: must be an object", {"field": "query"})
        if payload.get("node") is not None:
            node = payload["node"]
            if not is_valid_public(node):
                raise ProtocolError("INVALID_QUERY", "node: must be a node key", {"field": "node"})
            return self.node_view(node)
        agent = payload.get("agent", payload.get("agent_id"))
        if agent is not None:
            if not is_valid_public(agent):
                raise ProtocolError("INVALID_QUERY", "agent: must be an agent key", {"field": "agent"})
            node = self.vouched_by(agent) if self.vouched_by else None
            if node is None:
                raise ProtocolError(
                    "NOT_FOUND", "no node currently vouches for this agent", {"agent": agent}
                )
            view = self.node_view(node)
            view["agent"] = agent
            view["availability"] = self.availability_of(agent, node)
            return view
        return {"nodes": self.nodes()}
