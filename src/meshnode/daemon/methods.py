"""The daemon's core admin methods: status, calls as the CLI identity, presence
and discovery, agents added and removed, the node inbox (§8.3a, §16.4), A2A
charges and the mesh's enrolment (registered next to :mod:`.operations` and
:mod:`.artifacts`).

Every method here is part of the admin contract; its ``doc`` says its params
and result. Method names are CamelCase, dotted by area.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import meshnode
from meshnode.admin.protocol import INTERNAL, AdminError, InvalidParameter, NotFound
from meshnode.admin.server import CallContext, MethodRegistry
from meshnode.agent import RemoteError, RequestQueued
from meshnode.config import AgentConfig
from meshnode.config.editing import (
    SaveRefused,
    agent_table_text,
    append_agent_table,
    comment_out_agent_table,
)
from meshnode.control_plane.enrolment import DEFAULT_TOKEN_TTL_S, INBOX_PREFIXES
from meshnode.daemon.operations import process_figures
from meshnode.daemon.paging import AGENTS_PAGE_BYTES, agent_page_params, page_of
from meshnode.node.builtin import CLI_AGENT_NAME
from meshnode.node.context import AgentContext
from meshnode.node.hosted import HostedAgent
from meshnode.node.inbox import STATES as INBOX_STATES
from meshnode.node.inbox import InboxRow, InboxStore
from meshnode.node.states import AgentState
from meshnode.protocol.a2a_extension import EXTENSION_URI as A2A_URI
from meshnode.protocol.canonical import parse_json
from meshnode.protocol.envelope import new_root_trace
from meshnode.protocol.errors import ProtocolError, error_object
from meshnode.protocol.fencing import FrameProvenance, frame_payload
from meshnode.protocol.nkeys import Prefix, is_valid_public
from meshnode.protocol.protections import sender_body
from meshnode.transport.permissions import node_inbox_prefix
from meshnode.transport.tenants import DEFAULT_TENANT

if TYPE_CHECKING:
    from meshnode.daemon.main import Daemon

__all__ = ["CoreMethods", "register_core_methods"]

log = logging.getLogger("meshnode.daemon")



def register_core_methods(daemon: Daemon, methods: MethodRegistry) -> CoreMethods:
    """Add the core methods (module docstring) to ``methods``."""
    ops = CoreMethods(daemon)
    methods.add(
        "Status", ops.status, level="operator",
        doc="params {agents?: true, agents_offset?, agents_limit?} -> node and agent status; the agent list is "
        "one page (as many as fit a reply; agents_next: the next page's agents_offset, null on the last; "
        "agents_total; roster_version moves when an agent is hosted or unhosted); agents=false is the brief "
        "form for polling: counts instead of the agent list, process.asyncio_tasks null",
    )
    methods.add("Call", ops.call, level="operator", doc="params {agent, offering, input?, timeout?, config?, budget?, wait_task?, task_id?, context_id?} -> the answer; a task paused for input comes back with status input_required/auth_required, task_id and problems: answer it with task_id")
    methods.add("Presence", ops.presence, level="operator", doc="presence of a node or agent (or all nodes)")
    methods.add("Discover", ops.discover, level="operator", doc="params {§9.3 filters..., exported_by?}: query the registry; exported_by: another tenant whose discovery was exported to this node's (§15.2) answers instead")
    methods.add("Agents.Add", ops.agents_add, level="admin", doc="params {name | names, config, save?}: host a new agent now (re-mints the credential); save=true also appends its table to the configuration file. name: one agent, its status, its failure the call's. names: several with the same config, one credential for them all -> {agents: [{name, hosted, status... | error}], hosted, failed}, each failing alone")
    methods.add("Agents.Remove", ops.agents_remove, level="admin", doc="params {name | names, deregister?, save?}: stop and deregister agents; save=true also comments their tables out of the configuration file. name -> {removed: name, configured, saved?, config_file?, save_error?}; names (one credential for them all) -> {removed: [names], failed: {name: error}, configuration: {name: {saved, configured, ...}}}. saved null: the file still has the table (the next start hosts the agent; reloads leave it removed)")
    methods.add("Inbox.List", ops.inbox_list, level="operator", doc="held, interrupted and recent inbox messages")
    methods.add("Inbox.Show", ops.inbox_show, level="operator", doc="one inbox message in full")
    methods.add("Inbox.Reply", ops.inbox_reply, level="operator", doc="answer a held request as its agent")
    methods.add("Inbox.Ack", ops.inbox_ack, level="operator", doc="dismiss a held message")
    methods.add(
        "A2A.Charges", ops.a2a_charges, level="operator",
        doc="params {peer?, limit?} -> charges recorded for calls to external A2A agents, newest first, and totals per peer",
    )
    methods.add("Mesh.Info", ops.mesh_info, level="operator", doc="NATS URLs and control-plane URL")
    methods.add(
        "Mesh.Nodes", ops.mesh_nodes, level="operator",
        doc="-> {nodes: [{node_id, name, trust_tier, tenant, enrolled_at, retired_at, last_issued_at, "
        "credential_expires_at, profile (node|sdk), agent_id (sdk)}], tokens: [{name, state, trust_tier, "
        "tenant, created_at, expires_at, used_at, node_id}]} every node the control plane enrolled and every "
        "SDK enrolment token (unix seconds; nulls when never)",
    )
    methods.add(
        "Mesh.Token", ops.mesh_token, level="admin",
        doc="params {name, ttl_s?, trust_tier?, tenant?} -> {token (secret, shown once), name, expires_at, "
        "trust_tier, tenant, control_plane, notes}: a single-use token an AgentMesh SDK agent exchanges at "
        "POST /v1/bootstrap; notes say what limits its use (a port picked at start, a loopback-only mesh)",
    )
    methods.add("Mesh.Invite", ops.mesh_invite, level="admin", doc="params {name, trust_tier?, tenant?} -> enrol a new node (tier standard|verified|sandbox, attested in its credentials; tenant: an account from [mesh.embedded] tenants, default mesh); returns its invite (secret) and notes on what limits its use (a port picked at start, a loopback-only mesh)")
    return ops


class CoreMethods:
    """The handlers behind :func:`register_core_methods`."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def snapshot(
        self,
        *,
        agents_listed: bool = True,
        agents_offset: int = 0,
        agents_limit: int | None = None,
        page_bytes: int | None = AGENTS_PAGE_BYTES,
    ) -> dict[str, Any]:
        """Node and agent status. ``agents_listed=False`` is the brief form for
        scripts that poll: it leaves out the per-agent list (the counts in
        ``agent_summary`` remain) and the asyncio task count
        (``process.asyncio_tasks`` is null: counting walks every task, ~20 ms of
        the loop at 10,000 agents; ``Metrics`` and the full form count them).
        The list is one page (:meth:`agent_page`) from ``agents_offset``
        (``page_bytes`` None: the whole list, for a caller in this process)."""
        node = self.d.node
        hosted = list(node.agents.values()) if node is not None else []
        agents: list[dict[str, Any]] = []
        page: dict[str, Any] = {}
        if agents_listed:
            agents, page = self.agent_page(agents_offset, agents_limit, page_bytes)
        # One pass, the enum member read once: a script polls this at any
        # roster size, and on Python 3.11 each AgentState.FAILED is a
        # descriptor call (the per-agent cost tripled with it in the loop).
        failed_state = AgentState.FAILED
        registered = 0
        failed_hosted: list[str] = []
        for h in hosted:
            registered += h.registered
            if h.state is failed_state:
                failed_hosted.append(h.name)
        summary = {
            "hosted": len(hosted),
            "registered": registered,
            "failed": len(self.d.failed_agents.keys() | failed_hosted),
        }
        return {
            "product": "meshnode",
            "version": meshnode.__version__,
            # The daemon's lifecycle state (meshnode.daemon.lifecycle.DaemonState).
            "state": self.d.state.value,
            # The start-up stage in flight while "starting" (None otherwise).
            "stage": self.d.stage,
            "node": {
                "id": self.d.node_key.public_key if self.d.node_key else None,
                "name": self.d.config.node.name,
                "data_dir": str(self.d.data_dir),
            },
            "mesh": {
                "mode": "embedded" if self.d.embedded_mode else "joined",
                "urls": self.d.mesh_urls(),
                "control_plane": self.d.control_plane_url(),
                # Tenants this embedded mesh serves beside its own account (§15).
                "tenants": list(self.d.embedded.tenants) if self.d.embedded is not None else [],
                "connected": bool(self.d.connection and self.d.connection.is_connected),
                "connected_url": self.d.connection.connected_url if self.d.connection else None,
                "known_servers": self.d.connection.known_servers if self.d.connection else [],
                "last_error": self.d.connection.last_error if self.d.connection else None,
                # Reconnects the node made to present a new credential: bridged
                # ones missed no live mail (MeshConnection.reconnect).
                "planned_reconnects": {
                    "bridged": self.d.connection.bridged_reconnects if self.d.connection else 0,
                    "unbridged": self.d.connection.unbridged_reconnects if self.d.connection else 0,
                    # Messages that came by both the bridge and the connection,
                    # the second copy dropped unread.
                    "copies_dropped": self.d.connection.overlap_copies_dropped if self.d.connection else 0,
                },
                # Does the broker still answer (a frozen one keeps "connected" true)?
                "broker": self.broker_status(),
            },
            "credential": self.d.credential_status(),
            # writable false: disk full or read-only; nothing is acked until it clears.
            "inbox": self.d.inbox.health() if self.d.inbox is not None else None,
            # Meter events on their way to MESH_METERING (None: [commerce] publish_usage = false).
            "metering": self.d.meter_outbox.status() if self.d.meter_outbox is not None else None,
            # The mesh's JetStream store (service nodes): use, limit, headroom, low.
            "storage": self.d.store_watch.snapshot() if self.d.store_watch is not None else None,
            # Each tenant's account store (its own limit: the mesh's is split among them).
            "tenant_storage": {name: w.snapshot() for name, w in self.d.tenant_store_watches.items()},
            "keystore": self.d.keystore.describe() if self.d.keystore else None,
            "agents": agents,
            **page,
            "agent_summary": summary,
            # The loop-lag watchdog: lag now, worst, blocks by agent (#23).
            "loop": self.d.node.watchdog.status() if self.d.node is not None else None,
            # Set only in the status socket's answer: the loop is stuck now,
            # {for_s, agent, threshold_s}, and the rest is snapshot_age_s old.
            "blocked": None,
            # The process as a whole: memory cannot be told apart by agent (one heap).
            "process": process_figures(count_tasks=agents_listed),
            "services": [type(s).__name__ for s in self.d.services],
            # What the platform services count (ended task records evicted from a
            # full store, updates that failed, mailbox sweeps), by service name.
            "service_counters": {
                s.name: dict(sorted(counters.items()))
                for s in self.d.services
                if isinstance(counters := getattr(s, "counters", None), Mapping)
            },
            "replicas": self.d.services[0].ctx.replicas if self.d.services else None,
            "observability": self.d.node.observability.status() if self.d.node and self.d.node.observability else None,
            "a2a": self.d.gateways.status(),
        }

    def agent_page(
        self, offset: int = 0, limit: int | None = None, page_bytes: int | None = AGENTS_PAGE_BYTES
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """One page of the agent list (Status, Agents.List), from ``offset``, and its place in it.

        The list is every hosted agent in hosting order, then the agents that
        failed before they were hosted. A page holds as many entries as fit in
        ``paging.AGENTS_PAGE_BYTES`` (at least one) and at most ``limit``: at 10,000 agents
        the whole list is larger than an admin reply may be, and `meshnode
        status` failed with "reply too large". The second value says where the
        page lies: ``agents_total``, ``agents_next`` (the offset of the next
        page; null on the last) and ``roster_version`` (it moves whenever an
        agent is hosted or unhosted: a client reading pages compares it).
        """
        node = self.d.node
        hosted = list(node.agents.values()) if node is not None else []
        # An agent whose on_start failed stays hosted (state failed) *and* is
        # recorded in failed_agents: list it once, as the hosted entry (issue
        # #23 item 12); failed_agents adds only those never hosted (unknown
        # kind, a plugin that did not load, a failed instantiation).
        names = {h.name for h in hosted}
        never_hosted = [(name, why) for name, why in self.d.failed_agents.items() if name not in names]
        failed_state = AgentState.FAILED

        def entry_at(index: int) -> dict[str, Any]:
            if index >= len(hosted):
                name, why = never_hosted[index - len(hosted)]
                return {"name": name, "state": failed_state.value, "failure": why}
            return self.d.agent_status(hosted[index])

        total = len(hosted) + len(never_hosted)
        entries, following = page_of(total, entry_at, offset, limit, page_bytes)
        place = {
            "agents_total": total,
            "agents_next": following,
            "roster_version": node.roster_version if node is not None else 0,
        }
        return entries, place

    def broker_status(self) -> dict[str, Any] | None:
        watch = self.d.broker_watch
        if watch is None:
            return None
        status = watch.status()
        embedded = self.d.embedded
        if embedded is not None:
            status["pid"] = embedded.pid
            status["process_restarts"] = embedded.restarts
        return status

    async def status(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        listed = params.get("agents", True)
        if not isinstance(listed, bool):
            raise InvalidParameter("agents must be true or false")
        offset, limit = agent_page_params(params)
        status = self.snapshot(agents_listed=listed, agents_offset=offset, agents_limit=limit)
        if listed and offset == 0 and status["agents_next"] is None:
            self.d.status_board.publish(status)  # the freshest figures for a later block
        return status

    async def call(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        if self.d.node is None:
            raise NotFound("the node is not running")
        target = params.get("agent")
        offering = params.get("offering")
        if not isinstance(target, str) or not isinstance(offering, str):
            raise InvalidParameter("agent and offering are required strings")
        timeout = params.get("timeout", 30)
        if not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise InvalidParameter("timeout must be a number of seconds in (0, 3600]")
        local = self.d.node.agents.get(target)
        target_id = local.agent_id if local is not None else target
        if not target:
            raise InvalidParameter("agent must name an agent: a local name, an id (U...), a registry name or a2a:<peer>")
        # Anything else is a name the registry may know: ctx.request resolves it
        # (§14.4) and answers NOT_FOUND / INVALID_QUERY (ambiguous) when it cannot.
        cli: HostedAgent = self.d.node.agents[CLI_AGENT_NAME]

        ctx = AgentContext(cli, trace=new_root_trace())
        config = params.get("config") if isinstance(params.get("config"), dict) else None
        task_id = params.get("task_id")
        if task_id is not None and not isinstance(task_id, str):
            raise InvalidParameter("task_id must be a string (the task to answer)")
        context_id = params.get("context_id") if isinstance(params.get("context_id"), str) else None
        try:
            budget = params.get("budget") if isinstance(params.get("budget"), dict) else None
            reply = await ctx.request(
                target_id, offering, params.get("input"), timeout=float(timeout), config=config, budget=budget,
                task_id=task_id, context_id=context_id,
            )
            if reply.task is not None and params.get("wait_task", True):
                # A task paused for input or auth comes back as such, with its
                # problems: answer it with another Call naming its task_id (§6.5).
                try:
                    final = await reply.task.result(timeout=float(timeout), until_paused=True)
                except TimeoutError:
                    # No update for the whole wait (the responder may have died
                    # mid-task, or is just slow): a plain answer, not an internal
                    # error, naming the task so the caller can follow it up.
                    return {
                        "status": "failed",
                        "error": {
                            "code": "TRANSPORT_TIMEOUT",
                            "message": f"no update of task {reply.task.task_id} within {float(timeout):g} s;"
                            f" last known state {reply.task.state}",
                            "retryable": True,
                            "details": {"task_id": reply.task.task_id, "last_state": reply.task.state},
                        },
                        "accepted": reply.accepted,
                        "task_id": reply.task.task_id,
                    }
                payload = final.get("payload") if isinstance(final.get("payload"), dict) else {}
                answer: dict[str, Any] = {
                    "status": payload.get("status"),
                    "output": payload.get("output"),
                    "error": final.get("error"),
                    "from": final.get("from"),
                    "accepted": reply.accepted,
                    "task_id": reply.task.task_id,
                }
                for key in ("message", "problems"):
                    if payload.get(key) is not None:
                        answer[key] = payload[key]
                if final.get("context_id") is not None:
                    answer["context_id"] = final["context_id"]
                return answer
        except RemoteError as exc:
            return {"status": "failed", "error": exc.to_object(), "from": exc.envelope.get("from")}
        except RequestQueued as exc:
            return {"status": "queued", "inbox_id": exc.inbox_id, "to": target_id}
        except ProtocolError as exc:
            return {"status": "failed", "error": exc.to_object(), "local": True}
        return {
            "status": reply.status,
            "output": reply.output,
            "from": reply.envelope.get("from"),
            "accepted": reply.accepted,
            "task_id": reply.task_id,
            # Deliverables (§7.5), e.g. an output too large for one message (§18.9).
            **({"artifacts": reply.envelope["artifacts"]} if reply.envelope.get("artifacts") else {}),
            # An A2A peer's answer (a2a:<name>): mesh, report, charge, message/task ids.
            **({"a2a": reply.envelope["meta"][A2A_URI]}
               if isinstance(reply.envelope.get("meta"), dict) and A2A_URI in reply.envelope["meta"] else {}),
        }

    async def agents_add(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        names, table = _agent_names(params), params.get("config", {})
        if not isinstance(table, dict):
            raise InvalidParameter("config (object) is required", {"parameter": "config"})
        save = params.get("save", False)
        if not isinstance(save, bool):
            raise InvalidParameter("save must be a boolean", {"parameter": "save"})
        if save:
            try:  # refused before any agent starts: a value TOML cannot hold
                for name in names:
                    agent_table_text(name, table)
            except SaveRefused as exc:
                raise InvalidParameter(f"--save: {exc}") from None
        if "name" in params:
            result = dict(await self.d.add_agent(names[0], table))
            result["saved"] = None
            if save:
                result.update(await self._save_agent(names[0], table))
            return result
        # Several: one credential for them all; each fails alone (see add_agents).
        outcomes = await self.d.add_agents(dict.fromkeys(names, table))
        agents: list[dict[str, Any]] = []
        for name in names:
            outcome = outcomes[name]
            if isinstance(outcome, Exception):
                error = outcome if isinstance(outcome, AdminError) else AdminError(
                    INTERNAL, f"agent {name} not hosted: {type(outcome).__name__}: {outcome}")
                agents.append({"name": name, "hosted": False, "error": error.to_wire()})
                continue
            entry = {**outcome, "name": name, "hosted": True, "saved": None}
            if save:
                entry.update(await self._save_agent(name, table))
            agents.append(entry)
        return {"agents": agents, "hosted": sum(a["hosted"] for a in agents),
                "failed": sum(not a["hosted"] for a in agents)}

    async def _save_agent(self, name: str, table: dict[str, Any]) -> dict[str, Any]:
        """Append the agent's table to the running configuration's file, so a
        restart (and a reload) keeps it. The agent runs either way; a file that
        cannot be written is reported with the text to add by hand."""
        source = self.d.config.source_file
        if source is None:
            return {"saved": False, "save_error": "the daemon runs without a configuration file",
                    "table": agent_table_text(name, table)}
        try:
            await asyncio.to_thread(append_agent_table, source, name, table)
        except SaveRefused as exc:
            return {"saved": False, "save_error": str(exc), "table": agent_table_text(name, table)}
        # The running configuration now matches the file: a reload sees nothing new.
        self.d.config.agents[name] = AgentConfig.model_validate({"plugin": name, **table})
        log.info("agent %s saved to %s", name, source)
        return {"saved": True, "config_file": str(source)}

    async def agents_remove(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        names = _agent_names(params)
        deregister = bool(params.get("deregister", True))
        save = params.get("save", False)
        if not isinstance(save, bool):
            raise InvalidParameter("save must be a boolean", {"parameter": "save"})
        if "name" in params:
            await self.d.remove_agent(names[0], deregister=deregister)
            return {"removed": names[0], **await self._unsave_agent(names[0], save)}
        removed, failed = await self.d.remove_agents(names, deregister=deregister)
        return {"removed": removed, "failed": {name: exc.to_wire() for name, exc in failed.items()},
                "configuration": {name: await self._unsave_agent(name, save) for name in removed}}

    async def _unsave_agent(self, name: str, save: bool) -> dict[str, Any]:
        """After ``agents remove``: what becomes of the agent's ``[agents.<name>]``
        table. ``saved`` True: commented out of the file; None: the file still has
        it (``config_file``), so the next start hosts the agent again; False: it
        could not be edited (``save_error``). An agent the file has and that stays
        there is held out of reloads until it is added again or its table changes:
        a reload for something else brought it back."""
        source = self.d.config.source_file
        if name not in self.d.config.agents:
            return {"configured": False}  # added at runtime: the file never had it
        if save and source is not None:
            try:
                await asyncio.to_thread(comment_out_agent_table, source, name)
            except SaveRefused as exc:
                self.d.hold_out_of_reloads(name)
                return {"saved": False, "save_error": str(exc), "configured": True, "config_file": str(source)}
            # The running configuration matches the file again: a reload sees nothing new.
            del self.d.config.agents[name]
            log.info("agent %s commented out of %s", name, source)
            return {"saved": True, "configured": True, "config_file": str(source)}
        self.d.hold_out_of_reloads(name)
        if save:
            return {"saved": False, "save_error": "the daemon runs without a configuration file", "configured": True}
        return {"saved": None, "configured": True, "config_file": str(source) if source else None}

    async def a2a_charges(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        if self.d.gateways.charges is None:
            return {"charges": [], "totals": {}}
        peer = params.get("peer")
        if peer is not None and not isinstance(peer, str):
            raise InvalidParameter("peer must be a string")
        limit = params.get("limit", 200)
        if not isinstance(limit, int) or not 0 < limit <= 10_000:
            raise InvalidParameter("limit must be an integer in (0, 10000]")
        rows = await self.d.gateways.charges.recent(peer=peer, limit=limit)
        return {"charges": [r.to_object() for r in rows], "totals": await self.d.gateways.charges.totals()}

    def _agent_name(self, agent_id: str) -> str:
        if self.d.node is not None:
            hosted = self.d.node.by_id.get(agent_id)
            if hosted is not None:
                return hosted.name
        return agent_id

    def _inbox_summary(self, row: InboxRow, *, full: bool = False) -> dict[str, Any]:
        now = time.time_ns() // 1_000_000
        summary: dict[str, Any] = {
            "id": row.inbox_id,
            "agent": self._agent_name(row.agent),
            "agent_id": row.agent,
            "sender": row.sender,
            "kind": row.kind,
            "state": row.state,
            "age_s": max(0, (now - row.received_ms) // 1000),
            "msg_id": row.msg_id,
        }
        if row.note:
            summary["note"] = row.note
        try:
            env = parse_json(row.envelope)
        except ValueError:
            return summary
        if not isinstance(env, dict):
            return summary
        raw_payload = env.get("payload")
        payload: dict[str, Any] = raw_payload if isinstance(raw_payload, dict) else {}
        if row.kind == "request":
            summary["offering"] = payload.get("offering")
            # Sender text is shown only inside its provenance frame (§22.6).
            framed = frame_payload(sender_body(env), FrameProvenance.from_envelope(env, row.received_ms))
            if framed.field is not None:
                body = framed.payload
                summary["text"] = body.get(framed.field) if isinstance(body, dict) else body
        else:
            summary["in_reply_to"] = env.get("in_reply_to")
            summary["status"] = payload.get("status")
            summary["output"] = payload.get("output")
            if env.get("error"):
                summary["error"] = env.get("error")
        if full:
            summary["envelope"] = env
        return summary

    def _require_inbox(self) -> InboxStore:
        if self.d.inbox is None or self.d.node is None:
            raise NotFound("the node inbox is not open")
        return self.d.inbox

    async def inbox_list(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        inbox = self._require_inbox()
        agent = params.get("agent")
        agent_id = None
        if isinstance(agent, str):
            hosted = self.d.node.agents.get(agent) if self.d.node else None
            agent_id = hosted.agent_id if hosted else agent
        states = params.get("states") or ["held", "interrupted"]
        if not isinstance(states, list) or not all(isinstance(st, str) and st in INBOX_STATES for st in states):
            # A hostile or mistyped value was an internal error (found by the admin fuzz test).
            raise InvalidParameter(f"states must be a list of inbox states: {', '.join(INBOX_STATES)}")
        if params.get("all"):
            states = None
        limit = params.get("limit", 100)
        if not isinstance(limit, int) or not 0 < limit <= 1000:
            raise InvalidParameter("limit must be an integer in 1..1000")
        rows = await inbox.rows(agent=agent_id, states=states, limit=limit)
        return {"messages": [self._inbox_summary(r) for r in rows], "counts": await inbox.counts()}

    async def _inbox_row(self, params: dict[str, Any]) -> InboxRow:
        inbox = self._require_inbox()
        inbox_id = params.get("id")
        if not isinstance(inbox_id, int):
            raise InvalidParameter("id (an integer) is required")
        row = await inbox.get(inbox_id)
        if row is None:
            raise NotFound(f"no inbox message {inbox_id}")
        return row

    async def inbox_show(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        return self._inbox_summary(await self._inbox_row(params), full=True)

    async def inbox_reply(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:

        row = await self._inbox_row(params)
        if row.kind != "request" or row.state not in ("held", "interrupted"):
            raise InvalidParameter(f"message {row.inbox_id} is a {row.state} {row.kind}; only held requests take a reply")
        assert self.d.node is not None
        hosted = self.d.node.by_id.get(row.agent)
        if hosted is None:
            raise NotFound("the agent this message was for is not hosted any more")
        output = params.get("output")
        if output is None and isinstance(params.get("text"), str):
            output = {"text": params["text"]}
        status = params.get("status", "completed")
        if status not in ("completed", "failed"):
            raise InvalidParameter("status is completed or failed")
        request = parse_json(row.envelope)
        error = None
        if status == "failed":
            error = error_object(str(params.get("code", "UNAUTHORIZED")), str(params.get("message", "declined")))
        await hosted.answer(request, status=status, output=output, error=error)
        await self._require_inbox().set_state(row.inbox_id, "replied", time.time_ns() // 1_000_000)
        return {"replied": row.inbox_id, "to": row.sender}

    async def inbox_ack(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        row = await self._inbox_row(params)
        await self._require_inbox().set_state(row.inbox_id, "dismissed", time.time_ns() // 1_000_000)
        return {"dismissed": row.inbox_id}

    async def presence(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        if self.d.node is None:
            raise NotFound("the node is not running")
        query = {k: v for k, v in params.items() if k in ("node", "agent") and isinstance(v, str)}
        agent = query.get("agent")
        if agent is not None and not is_valid_public(agent, Prefix.USER):
            # A name, as `meshnode call` takes one: this node's agent, else the registry's.
            cli = self.d.node.agents[CLI_AGENT_NAME]
            try:
                query["agent"] = (await self.d.node.directory.resolve(cli, agent)).id
            except ProtocolError as exc:
                raise NotFound(exc.message) from None
        return await self._service(call, "mesh.presence.get", "request", query)

    async def discover(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        node = self.d.node
        if node is None:
            raise NotFound("the node is not running")
        query = dict(params)
        exported_by = query.pop("exported_by", None)
        found = await node.directory.query(node.agents[CLI_AGENT_NAME], query, exported_by=exported_by)
        agents = found.get("agents")
        if isinstance(agents, list):
            # Which of them this node hosts: names repeat across nodes (every node's "echo").
            for manifest in agents:
                if isinstance(manifest, dict):
                    manifest["hosted_here"] = manifest.get("id") in node.by_id
        return found

    async def _service(self, call: CallContext, subject: str, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        if self.d.node is None:
            raise NotFound("the node is not running")
        cli = self.d.node.agents[CLI_AGENT_NAME]
        return await self.d.node.service_call(cli, subject, kind, payload)

    async def mesh_nodes(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        if self.d.control_plane is None:
            raise NotFound("this node runs no control plane (only the embedded-mesh node enrols nodes)")
        nodes = await asyncio.to_thread(self.d.control_plane.list_nodes)
        tokens = await asyncio.to_thread(self.d.control_plane.list_tokens)
        now = int(time.time())
        return {
            "nodes": [
                {
                    "node_id": n.node_id,
                    "name": n.name,
                    "trust_tier": n.trust_tier,
                    "tenant": n.tenant,
                    "enrolled_at": n.enrolled_at,
                    "retired_at": n.retired_at,
                    "last_issued_at": n.last_issued_at,
                    "credential_expires_at": n.credential_expires_at,
                    "profile": n.profile,
                    "agent_id": n.agent_id,
                    # Invited, not started yet: the first start must come before this.
                    "invite_expires_at": n.invite_expires_at,
                    "state": n.state(now),
                }
                for n in nodes
            ],
            # SDK enrolment tokens, by name (the tokens themselves are never kept).
            "tokens": [
                {
                    "name": t.name,
                    "state": t.state(now),
                    "trust_tier": t.trust_tier,
                    "tenant": t.tenant,
                    "created_at": t.created_at,
                    "expires_at": t.expires_at,
                    "used_at": t.used_at,
                    "node_id": t.node_id,
                }
                for t in tokens
            ],
        }

    async def mesh_info(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        return {
            "mode": "embedded" if self.d.embedded_mode else "joined",
            "name": self.d.config.node.name,
            "nats_urls": self.d.mesh_urls(),
            "control_plane": self.d.control_plane_url(),
            "node_id": self.d.node_key.public_key if self.d.node_key else None,
            # Set only when [mesh.embedded] monitor_port asks for it.
            "monitor_url": self.d.embedded.monitor_url if self.d.embedded is not None else None,
            # Set only when [mesh.embedded] websocket_port asks for it (nats.ws clients).
            "websocket_url": self.d.embedded.websocket_url if self.d.embedded is not None else None,
            # The reply prefix each enrolment profile's credential allows
            # (nats.connect(inbox_prefix=...)), and this node's own.
            "inbox_prefixes": dict(INBOX_PREFIXES),
            "inbox_prefix": self._own_inbox_prefix(),
            **self._tenancy(),
        }

    def _tenancy(self) -> dict[str, Any]:
        """The tenants and exports the running embedded mesh was started with
        (account JWTs are minted at start: a file changed since waits for a restart)."""
        embedded = self.d.config.mesh.embedded if self.d.embedded_mode else None
        if embedded is None:
            return {"tenants": None, "exports": []}
        return {
            "tenants": [DEFAULT_TENANT, *embedded.tenants],
            "exports": [
                {"from": e.from_, "to": e.to, "agents": list(e.agents), "discover": e.discover}
                for e in embedded.exports
            ],
        }

    def _own_inbox_prefix(self) -> str | None:
        """The reply prefix this node connected with: chosen from its credential's
        grants (or [mesh] inbox_prefix), which on a mesh built elsewhere may be the
        shared _INBOX; before the connect stage, the private one it would choose."""
        mesh = self.d.mesh
        if mesh is not None and mesh.inbox is not None:
            return mesh.inbox.prefix
        return node_inbox_prefix(self.d.node_key.public_key) if self.d.node_key else None

    async def mesh_token(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        if self.d.control_plane is None:
            raise NotFound("this node runs no control plane (only the embedded-mesh node enrols)")
        name = params.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidParameter("name is required")
        ttl_s = params.get("ttl_s", DEFAULT_TOKEN_TTL_S)
        if not isinstance(ttl_s, int) or isinstance(ttl_s, bool) or ttl_s <= 0:
            raise InvalidParameter("ttl_s must be a positive number of seconds")
        trust_tier = params.get("trust_tier", "standard")
        tenant = params.get("tenant") or "mesh"
        if not isinstance(trust_tier, str) or not isinstance(tenant, str):
            raise InvalidParameter("trust_tier and tenant must be strings")
        try:
            token, record = await asyncio.to_thread(
                self.d.control_plane.create_token, name, ttl_s, trust_tier, tenant
            )
        except ValueError as exc:
            raise InvalidParameter(str(exc)) from None
        return {
            "token": token,
            "name": record.name,
            "expires_at": record.expires_at,
            "trust_tier": record.trust_tier,
            "tenant": record.tenant,
            "control_plane": self.d.control_plane_url(),
            "notes": self.d.mesh.reach_notes() if self.d.mesh is not None else [],
        }

    async def mesh_invite(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        if self.d.control_plane is None:
            raise NotFound("this node runs no control plane (only the embedded-mesh node invites)")
        name = params.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidParameter("name is required")
        trust_tier = params.get("trust_tier", "standard")
        if not isinstance(trust_tier, str):
            raise InvalidParameter("trust_tier must be a string")
        tenant = params.get("tenant") or "mesh"
        if not isinstance(tenant, str):
            raise InvalidParameter("tenant must be a string")
        try:
            bundle = await asyncio.to_thread(self.d.control_plane.invite, name, trust_tier, tenant)
        except ValueError as exc:
            raise InvalidParameter(str(exc)) from None
        log.info("invited node %s as %s (trust tier %s, tenant %s)", name, bundle.node_id, trust_tier, tenant)
        return {
            "trust_tier": trust_tier,
            "tenant": tenant,
            "name": bundle.node_name,
            "node_id": bundle.node_id,
            "node_seed": bundle.node_seed,
            "jwt": bundle.jwt,
            "nats_urls": self.d.mesh_urls(),
            "control_plane": self.d.control_plane_url(),
            "notes": self.d.mesh.reach_notes() if self.d.mesh is not None else [],
        }


#: The most agents one ``Agents.Add`` / ``Agents.Remove`` names (``names``).
MAX_AGENTS_PER_CALL = 10_000


def _agent_names(params: Mapping[str, Any]) -> list[str]:
    """The agents an ``Agents.Add`` / ``Agents.Remove`` names: ``name`` (one;
    its failure is the call's) or ``names`` (several, each failing alone)."""
    if ("name" in params) == ("names" in params):
        raise InvalidParameter("give name (one agent) or names (a list of agents), not both")
    if "name" in params:
        name = params["name"]
        if not isinstance(name, str):
            raise InvalidParameter("name must be a string", {"parameter": "name"})
        return [name]
    names = params["names"]
    if (not isinstance(names, list) or not names or len(names) > MAX_AGENTS_PER_CALL
            or not all(isinstance(n, str) for n in names)):
        raise InvalidParameter(f"names must be a list of 1 to {MAX_AGENTS_PER_CALL:,} strings",
                               {"parameter": "names"})
    repeated = sorted(n for n, count in Counter(names).items() if count > 1)
    if repeated:
        raise InvalidParameter(f"names lists {', '.join(repeated)} more than once", {"parameter": "names"})
    return list(names)
