"""Day-to-day operations over the admin API: agents, drains, renewals, reload,
logs and metrics (registered by the daemon next to its core methods).

Every method here is part of the admin contract; params and results are
documented on each. Method names are CamelCase, dotted by area.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from meshnode.admin.protocol import AdminError, InvalidParameter, NotFound, Refused
from meshnode.admin.server import CallContext, MethodRegistry
from meshnode.config import AgentConfig, ConfigError, load_config
from meshnode.daemon.allowance import reload_allowances
from meshnode.daemon.hosting import rescan_catalog
from meshnode.daemon.logs import BUFFER, level_number
from meshnode.daemon.paging import agent_page_params, page_of
from meshnode.daemon.plugin_check import agent_problems, raise_if_problems
from meshnode.daemon.storewatch import tenant_gauges_text
from meshnode.node import memsample
from meshnode.node.builtin import CLI_AGENT_NAME
from meshnode.node.hosted import HostedAgent
from meshnode.node.metrics import loop_text, merge_exposition, prometheus_text
from meshnode.node.runtime import Node
from meshnode.protocol.errors import ProtocolError

if TYPE_CHECKING:
    from meshnode.daemon.main import Daemon

__all__ = ["register_operations"]

log = logging.getLogger("meshnode.operations")


def register_operations(daemon: Daemon, methods: MethodRegistry) -> None:
    ops = _Operations(daemon)
    methods.add("Agents.List", ops.agents_list, level="operator",
                doc="params {agents_offset?, agents_limit?} -> {agents: [status...], agents_total, agents_next, "
                "roster_version}: the same records as Status, one page (agents_next: the next page's "
                "agents_offset, null on the last)")
    methods.add("Agents.Show", ops.agents_show, level="operator",
                doc="params {name} -> {status, manifest (as registered), presence, latency}")
    methods.add("Agents.Restart", ops.agents_restart, level="admin",
                doc="params {name} -> status after the agent was stopped and started again (same key)")
    methods.add("Drain.Now", ops.drain_now, level="operator",
                doc="params {agent?} -> {drained: [{agent, ...its drain's status, pass: {fetched, committed, "
                "duplicates, dispatched, deferred} of this pass}], drained_total, not_shown} after one drain pass "
                "per agent that reads the broker (as many entries as fit a reply; not_shown: the rest)")
    methods.add("Renew.Now", ops.renew_now, level="admin",
                doc="params {} -> {credential, vouches} after re-vouching, re-registering and renewing the credential")
    methods.add("Reload", ops.reload, level="admin",
                doc="params {} -> {added, removed, restarted, requires_restart, allowances, kept_removed?, failed?};"
                " plugins re-scanned first; a bad file or [agents.X] table is refused (Refused) and nothing changes;"
                " requires_restart: the sections (and upgraded plugins) that differ from what runs, until a restart")
    methods.add("Logs.Tail", ops.logs_tail, level="operator",
                doc="params {lines?=100, level?} -> {records: [{ts, level, logger, message}]}")
    methods.add("Logs.Follow", ops.logs_follow, level="operator", streaming=True,
                doc="params {level?} -> a stream of {ts, level, logger, message} (send more: true)")
    methods.add("Tasks.List", ops.tasks_list, level="operator",
                doc="params {agent? (a hosted agent's name), task_id?} -> {tasks: [{task_id, agent, requester, "
                "state, offering, delegates}], tasks_total, not_shown} performed here now, by that agent / that "
                "task only when named (as many as fit a reply; not_shown: the rest; one agent's always fit)")
    methods.add("Tasks.Show", ops.tasks_show, level="operator",
                doc="params {task_id} -> the task manager's record (requester or responder must be hosted here); "
                    "NotFound for a task it does not hold (TASK_NOT_FOUND, TASK_EXPIRED), Refused otherwise")
    methods.add("Tasks.Cancel", ops.tasks_cancel, level="operator",
                doc="params {task_id, agent (the performer), reason, note?} -> the performer's answer; sent as the CLI identity; "
                    "NotFound for a task the performer does not hold")
    methods.add("Mesh.Retire", ops.mesh_retire, level="admin",
                doc="params {node_id} | {agent_id} | {token (a pending SDK enrolment token's name)} -> {retired, message}; the message says how long the old credential stays usable")
    methods.add("Metrics", ops.metrics, level="operator",
                doc="params {format?: json|prometheus, agents_offset?, agents_limit?} -> counters and handler "
                "latencies per agent; the agents in pages as Status's (agents_next, agents_total, "
                "roster_version), the node's own figures in full on every json page and on the first "
                "prometheus page only (a series twice is invalid); merge prometheus pages family by family")
    methods.add("Memory.Sample", ops.memory_sample, level="operator",
                doc="params {seconds?=10, frames?=25, top?=5} -> {window_s, traced_bytes, agents: [{agents,"
                " source, bytes, blocks, top_lines}], daemon: {bytes, blocks}, process}: memory allocated"
                " during the window and still alive, by the agent code that allocated it (tracemalloc)")


#: Bounds of a memory sample's window (seconds) and of the frames traced per allocation.
MEMORY_WINDOW_S = (0.1, 600.0)
MEMORY_FRAMES = (1, 100)


#: The drain counters ``Drain.Now`` reports for its own pass (``pass``).
_PASS_COUNTS = ("fetched", "committed", "duplicates", "dispatched", "deferred")

class _Operations:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        # One memory sample at a time: a second would turn tracing off under the first.
        self._memory_sampling = asyncio.Lock()

    def _node(self) -> Node:
        if self.daemon.node is None:
            raise NotFound("the node is not running")
        return self.daemon.node

    def _hosted(self, params: dict[str, Any]) -> HostedAgent:
        name = params.get("name")
        if not isinstance(name, str):
            raise InvalidParameter("name is required")
        node = self._node()
        hosted = node.agents.get(name) or node.by_id.get(name)
        if hosted is None:
            raise NotFound(f"no hosted agent named {name!r}")
        return hosted

    async def agents_list(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        offset, limit = agent_page_params(params)
        agents, place = self.daemon.methods.agent_page(offset, limit)
        return {"agents": agents, **place}

    async def agents_show(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        hosted = self._hosted(params)
        node = self._node()
        result: dict[str, Any] = {
            "status": self.daemon.agent_status(hosted),
            "latency": hosted.latency.as_dict(),
            "manifest": hosted.manifest,
        }
        cli = node.agents.get(CLI_AGENT_NAME)
        if cli is not None:
            try:
                result["manifest"] = await node.service_call(
                    cli, f"mesh.registry.get.{hosted.agent_id}", "discover", {"agent_id": hosted.agent_id}
                )
                result["registered_manifest"] = True
            except ProtocolError as exc:
                result["registered_manifest"] = False
                result["registry_error"] = exc.code
            try:
                result["presence"] = await node.service_call(cli, "mesh.presence.get", "request", {"agent": hosted.agent_id})
            except ProtocolError as exc:
                result["presence"] = {"error": exc.code}
        return result

    async def agents_restart(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        hosted = self._hosted(params)
        if hosted.name == CLI_AGENT_NAME:
            raise InvalidParameter("the CLI identity is not restartable")
        return await self.daemon.restart_agent(hosted.name)

    async def drain_now(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        node = self._node()
        names = [params["agent"]] if isinstance(params.get("agent"), str) else list(node.drains)
        drained = []
        for name in names:
            drain = node.drains.get(name)
            if drain is None:
                raise NotFound(f"agent {name!r} has no drain (not hosted, or no inbox)")
            before = drain.status()
            await drain.run_now()
            after = drain.status()
            # What this pass did, beside the agent's running totals.
            this_pass = {key: after[key] - before[key] for key in _PASS_COUNTS}
            drained.append({"agent": name, **after, "pass": this_pass})
        # Every agent's passes (10,000 of them) do not fit a reply: as many as
        # fit, and how many were left out (each is in Status's agent list).
        shown, _ = page_of(len(drained), drained.__getitem__, 0)
        return {"drained": shown, "drained_total": len(drained), "not_shown": len(drained) - len(shown)}

    async def renew_now(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        return await self.daemon.renew_now()

    async def reload(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        return await self.daemon.reload()

    async def logs_tail(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        lines = params.get("lines", 100)
        if not isinstance(lines, int) or not 0 < lines <= 2000:
            raise InvalidParameter("lines must be an integer in 1..2000")
        floor = level_number(str(params.get("level", "debug")))
        records = [r for r in BUFFER.records if level_number(r["level"]) >= floor]
        return {"records": records[-lines:]}

    async def logs_follow(self, params: dict[str, Any], call: CallContext) -> AsyncIterator[dict[str, Any]]:
        floor = level_number(str(params.get("level", "debug")))
        queue = BUFFER.follow()
        try:
            while True:
                record = await queue.get()
                if level_number(record["level"]) >= floor:
                    yield record
        finally:
            BUFFER.unfollow(queue)

    async def tasks_list(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        node = self._node()
        agent, task_id = params.get("agent"), params.get("task_id")
        if agent is not None and not isinstance(agent, str):
            raise InvalidParameter("agent is a hosted agent's name")
        if task_id is not None and not isinstance(task_id, str):
            raise InvalidParameter("task_id is a string")
        if agent is not None and agent not in node.agents:
            raise NotFound(f"no hosted agent named {agent!r}")
        performers = [node.agents[agent]] if agent is not None else list(node.agents.values())
        tasks = []
        for hosted in performers:
            if task_id is None:
                found = list(hosted.tasks.values())
            else:
                found = [hosted.tasks[task_id]] if task_id in hosted.tasks else []
            for task in found:
                raw = task.request.get("payload")
                payload: dict[str, Any] = raw if isinstance(raw, dict) else {}
                tasks.append({"task_id": task.task_id, "agent": hosted.name, "requester": task.requester,
                              "state": task.state, "offering": payload.get("offering"),
                              "delegates": [t for _, t in task.delegates]})
        # Up to 64 per agent: at thousands of busy agents more than a reply
        # carries. As many as fit, and how many were left out (one agent's
        # always fit: name it).
        shown, _ = page_of(len(tasks), tasks.__getitem__, 0)
        return {"tasks": shown, "tasks_total": len(tasks), "not_shown": len(tasks) - len(shown)}

    async def tasks_show(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        node = self._node()
        task_id = params.get("task_id")
        if not isinstance(task_id, str):
            raise InvalidParameter("task_id is required")
        for hosted in node.agents.values():
            task = hosted.tasks.get(task_id)
            if task is not None:
                caller = hosted
                break
        else:
            caller = node.agents[CLI_AGENT_NAME]
        try:
            record: dict[str, Any] = await node.service_call(caller, f"mesh.task.get.{task_id}", "request", {"task_id": task_id})
        except ProtocolError as exc:
            raise _task_refusal(exc) from None
        return record

    async def tasks_cancel(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        node = self._node()
        task_id, agent, reason = params.get("task_id"), params.get("agent"), params.get("reason", "user_requested")
        if not (isinstance(task_id, str) and isinstance(agent, str) and isinstance(reason, str)):
            raise InvalidParameter("task_id, agent and reason are strings")
        local = node.agents.get(agent)
        performer = local.agent_id if local is not None else agent
        note = params.get("note") if isinstance(params.get("note"), str) else None
        try:
            result: dict[str, Any] = await node.cancel_task(node.agents[CLI_AGENT_NAME], performer, task_id, reason, note)
        except ProtocolError as exc:
            raise _task_refusal(exc) from None
        return result

    async def mesh_retire(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        plane = self.daemon.control_plane
        if plane is None:
            raise NotFound("this node runs no control plane (only the embedded-mesh node retires)")
        node_id, agent_id = params.get("node_id"), params.get("agent_id")
        token = params.get("token")
        try:
            if isinstance(token, str):
                # A pending SDK enrolment token, by name: it can no longer be exchanged.
                message = await asyncio.to_thread(plane.revoke_token, token)
                retired = token
            elif isinstance(node_id, str):
                message = await asyncio.to_thread(plane.retire_node, node_id)
                retired = node_id
            elif isinstance(agent_id, str):
                message = await asyncio.to_thread(plane.retire_agent, agent_id)
                retired = agent_id
            else:
                raise InvalidParameter("node_id or agent_id is required")
        except LookupError as exc:
            raise NotFound(str(exc)) from None
        except ValueError as exc:
            raise InvalidParameter(str(exc)) from None
        log.warning("retired %s: %s", retired, message)
        return {"retired": retired, "message": message}

    async def memory_sample(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        node = self._node()
        seconds = _number_param(params, "seconds", 10.0, MEMORY_WINDOW_S)
        frames = int(_number_param(params, "frames", float(memsample.DEFAULT_FRAMES), MEMORY_FRAMES))
        top = int(_number_param(params, "top", 5.0, (0, 100)))
        if self._memory_sampling.locked():
            raise Refused("a memory sample is already running; wait for it to end")
        async with self._memory_sampling:
            before = runtime_gauges().get("rss_bytes")
            agents = {name: hosted.agent for name, hosted in node.agents.items()}
            log.info("memory sample: tracing allocations for %g s (%d frames)", seconds, frames)
            result = await memsample.sample(agents, asyncio.sleep(seconds), frames=frames, top=top)
        return {"window_s": seconds, **result, "process": {"rss_bytes_before": before, "rss_bytes_after": runtime_gauges().get("rss_bytes")}}

    async def metrics(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        """Counters and latencies, the agents' in pages (:mod:`meshnode.daemon.paging`):
        Prometheus text for 1,000 agents is ~2.5 MB, past what a reply may carry."""
        node = self._node()
        fmt = params.get("format", "json")
        if fmt not in ("json", "prometheus"):
            raise InvalidParameter("format is json or prometheus")
        offset, limit = agent_page_params(params)
        runtime = runtime_gauges()
        store = self.daemon.store_watch
        if store is not None:
            runtime = {**runtime, **store.gauges()}
        broker = self.daemon.broker_watch
        if broker is not None:  # issue #23 item 11: a frozen broker shows here too
            runtime = {**runtime, **broker.gauges()}
        outbox = self.daemon.meter_outbox
        if outbox is not None:  # meter events on their way to the mesh's ledger
            runtime = {**runtime, **outbox.gauges()}
        hosted = list(node.agents.values())
        place: dict[str, Any] = {"agents_total": len(hosted), "roster_version": node.roster_version}
        if fmt == "prometheus":

            def agent_text(index: int) -> dict[str, Any]:
                h = hosted[index]
                return {"text": prometheus_text([(h.name, h.agent_id, h.counters, h.latency)], {}) + loop_text(
                    None, {h.name: (h.in_flight, h.max_concurrency)}, {h.name: (h.spawned.live, h.spawned.total)}
                )}

            entries, place["agents_next"] = page_of(len(hosted), agent_text, offset, limit)
            # The node's own figures once, on the first page: a series twice is invalid.
            parts = [e["text"] for e in entries]
            if offset == 0:
                parts.insert(0, prometheus_text([], node.counters, node.refusals.by_label()) + loop_text(
                    node.watchdog.status(), {}
                ) + "".join(
                    f"# TYPE meshnode_{k} gauge\nmeshnode_{k} {v}\n" for k, v in runtime.items() if v is not None
                ) + tenant_gauges_text(self.daemon.tenant_store_watches))
            return {"content_type": "text/plain; version=0.0.4", "text": merge_exposition(parts), **place}

        def agent_figures(index: int) -> dict[str, Any]:
            h = hosted[index]
            return {
                "name": h.name, "id": h.agent_id, "counters": dict(h.counters), "latency": h.latency.as_dict(),
                "in_flight": h.in_flight, "max_concurrency": h.max_concurrency, "active_tasks": h.active_tasks,
                "spawned_tasks": h.spawned.live, "spawned_tasks_total": h.spawned.total,
            }

        entries, place["agents_next"] = page_of(len(hosted), agent_figures, offset, limit)
        return {
            "runtime": runtime,
            # Each tenant's store (tenant name -> the jetstream_store_* gauges).
            "tenants": {name: w.gauges() for name, w in self.daemon.tenant_store_watches.items()},
            "node": dict(node.counters),
            "refusals": node.refusals.as_dict(),
            "agents": {e.pop("name"): e for e in entries},
            **place,
            "loop": node.watchdog.status(),
            "log_records_dropped": BUFFER.dropped,
            "ts": int(time.time()),
        }


async def reload_config(daemon: Daemon) -> dict[str, Any]:
    """Parse and validate the new file off the event loop, then apply the difference.

    Agents added, removed or reconfigured are applied without dropping the
    connection (an added agent needs a re-minted credential, presented by a
    reconnect); everything else that changed is reported as needing a restart.
    A bad file raises Refused and the running configuration stays in force.

    The installed plugins are scanned again first (a plugin pip-installed since
    the start is found) and every ``[agents.X]`` table is checked against them
    as ``check-config`` does: a problem refuses the reload like a bad file. A
    table not hosted until now (its plugin was missing) is hosted (``added``);
    one that cannot be hosted or restarted (on_start raised, its key file is
    unusable, the new credential was not presented) is listed under ``failed``
    (name -> why), shown failed by Status and tried again by the next reload,
    and the rest applies; an upgraded plugin that agents run is listed under
    ``requires_restart`` (its old module stays imported). An agent ``agents
    remove`` stopped whose table has not changed stays removed (``kept_removed``).
    Every agent's
    allowance is read again (``allowances``: name -> {source, valid,
    errors}); a change of only ``allowance_file`` / ``allowance_any_owner``
    restarts no agent.
    """
    old = daemon.config
    hosting = daemon._hosting()
    try:
        new = await asyncio.to_thread(load_config, old.source_file)
        # Entry points are read again: a plugin pip-installed since the start is
        # found (importlib's caches dropped first), and every [agents.X] table is
        # checked against the plugins as check-config checks it.
        catalog, upgraded = await asyncio.to_thread(rescan_catalog, new, hosting.catalog)
        raise_if_problems(new, agent_problems(new, catalog))
    except ConfigError as exc:
        log.error("reload refused: the configuration does not validate:\n%s", exc)
        raise Refused(f"the new configuration does not validate; nothing changed:\n{exc}",
                      {"problems": str(exc)}) from None
    daemon.notifier.reloading()
    report: dict[str, Any] = {"added": [], "removed": [], "restarted": [], "requires_restart": []}
    try:
        hosting.catalog = catalog
        running = daemon.node.agents if daemon.node is not None else {}
        old_agents = {n: a for n, a in old.agents.items() if a.enabled}
        new_agents = {n: a for n, a in new.agents.items() if a.enabled}
        for name in sorted(set(old_agents) - set(new_agents)):
            if name in running:
                await daemon.remove_agent(name, deregister=True, reconnect=False)
            hosting.failed_agents.pop(name, None)
            hosting.removed_by_hand.discard(name)
            report["removed"].append(name)
        # A reload applies what changed in the file: an agent `agents remove`
        # stopped stays stopped while its table is what it was.
        held_out = sorted(n for n in hosting.removed_by_hand
                          if n in old_agents and n in new_agents and old_agents[n] == new_agents[n])
        if held_out:
            report["kept_removed"] = held_out
        # New tables, and tables not hosted until now (their plugin was missing).
        to_add = sorted(n for n in new_agents if n not in held_out and (n not in old_agents or n not in running))
        # All at once: one credential (and one reconnect) for every addition.
        added = await daemon.add_agents({name: _table_to_add(new_agents[name]) for name in to_add}) if to_add else {}
        for name in to_add:
            outcome = added[name]
            if isinstance(outcome, Exception):
                # One agent failing to start fails alone and the rest of the new
                # configuration still applies: its on_start raised, its key file
                # is unusable, the credential naming it was not presented in time.
                # Raising here would end the reload half-applied (removals done,
                # later additions never tried) with only a log line to show.
                _record_failed(daemon, report, name, "could not be hosted", outcome)
                continue
            report["added"].append(name)
        for kind, change in sorted(upgraded.items()):
            users = sorted(n for n, a in new_agents.items() if a.plugin == kind and n in running and n not in to_add)
            if users:
                # The old module stays imported: Python cannot swap a loaded
                # plugin's code in place, so this one truly needs a restart.
                report["requires_restart"].append(
                    f"plugin {kind}: {change}; agents {', '.join(users)} run the old code until the daemon restarts"
                )
        for name in sorted(set(old_agents) & set(new_agents)):
            if name in to_add:
                continue
            if _without_allowance(old_agents[name]) != _without_allowance(new_agents[name]):
                daemon.config.agents[name] = new_agents[name]
                try:
                    await daemon.restart_agent(name, new_agents[name])
                except Exception as exc:
                    _record_failed(daemon, report, name, "could not be restarted", exc)
                    continue
                report["restarted"].append(name)
        # EXT-8: every allowance_file read again (changed, removed, now invalid:
        # in force at once, failing closed as at start); no agent restarts for it.
        report["allowances"] = reload_allowances(daemon, new)
        # [node] plugin_modules is applied: the rescan above loaded the new list.
        running_now = old.model_copy(
            update={"node": old.node.model_copy(update={"plugin_modules": new.node.plugin_modules})}
        )
        pending = [s for s in _RESTART_SECTIONS if getattr(running_now, s) != getattr(new, s)]
        report["requires_restart"].extend(pending)
        if old.logging != new.logging:
            logging.getLogger().setLevel(new.logging.level.upper())
        # The running configuration keeps the sections only a restart applies:
        # the next reload compares the file with what runs, so it still says
        # they wait for a restart (it said nothing once they were swapped in).
        daemon.config = new.model_copy(update={s: getattr(running_now, s) for s in pending})
    finally:
        daemon.notifier.ready("reloaded")
    log.info("configuration reloaded: %s", report)
    return report


#: Configuration sections a reload cannot apply to a running daemon.
_RESTART_SECTIONS = ("node", "mesh", "registry", "services", "admin", "protections", "inbox", "keystore", "a2a")


def _task_refusal(exc: ProtocolError) -> AdminError:
    """A task manager's refusal as the admin error scripts can tell apart: a
    task it does not hold (TASK_NOT_FOUND, or TASK_EXPIRED: evicted) is
    NotFound (exit 65, as ``inbox show`` of an unknown message), anything else
    Refused (exit 1). Either carries the §12 error object."""
    if exc.code in ("TASK_NOT_FOUND", "TASK_EXPIRED"):
        return NotFound(exc.message, exc.to_object())
    return Refused(exc.message, exc.to_object())


def _record_failed(daemon: Daemon, report: dict[str, Any], name: str, what: str, exc: Exception) -> None:
    """Report one agent the reload could not apply (``failed``: name -> why).

    An agent left unhosted is also listed by ``Status`` as failed with the
    reason, and the next reload (or ``agents add``) tries it again.
    """
    why = exc.message if isinstance(exc, AdminError) else f"{type(exc).__name__}: {exc}"
    log.error("reload: agent %s %s: %s", name, what, why)
    report.setdefault("failed", {})[name] = why
    running = daemon.node.agents if daemon.node is not None else {}
    if name not in running:
        daemon._hosting().failed_agents[name] = why


def _table_to_add(agent: AgentConfig) -> dict[str, Any]:
    """``[agents.<name>]`` as ``Agents.Add`` takes it: the plugin's settings and the
    node's own keys that hosting reads (a reload-added agent had lost its
    ``max_concurrency``). The allowance keys are applied after, by
    :func:`reload_allowances`, to every agent alike."""
    table: dict[str, Any] = {**agent.settings, "plugin": agent.plugin}
    if agent.interaction:
        table["interaction"] = agent.interaction
    if agent.max_concurrency is not None:
        table["max_concurrency"] = agent.max_concurrency
    return table


def _without_allowance(agent: AgentConfig) -> AgentConfig:
    """``agent`` with its allowance keys at their defaults: a change there is
    applied by re-reading the allowance, never by restarting the agent (which
    would end its work in progress)."""
    return agent.model_copy(update={"allowance_file": None, "allowance_any_owner": None})


def _number_param(params: dict[str, Any], name: str, default: float, bounds: tuple[float, float]) -> float:
    """``params[name]`` as a number within ``bounds`` (inclusive), or ``default``."""
    value = params.get(name, default)
    low, high = bounds
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise InvalidParameter(f"{name} must be a number from {low:g} to {high:g} (got {value!r})")
    return float(value)


def process_figures(*, count_tasks: bool = True) -> dict[str, int | None]:
    """The process in Status: :func:`runtime_gauges` and the peak RSS.

    Per-agent memory is not among them: every agent shares the process's one
    heap, so no gauge can split it; the per-agent figures are tasks
    (``spawned_tasks``) and requests (``in_flight``), and ``Memory.Sample``
    (:mod:`meshnode.node.memsample`) says whose code kept what a window allocated.
    """
    peak: int | None
    try:
        # ru_maxrss is in KiB on Linux.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (OSError, ValueError):
        peak = None
    gauges = runtime_gauges(count_tasks=count_tasks)
    rss = gauges.get("rss_bytes")
    if peak is not None and isinstance(rss, int):
        # The kernel folds its per-thread RSS counters into the high-water mark
        # lazily: read a moment apart, the peak could show below the current RSS.
        peak = max(peak, rss)
    return {**gauges, "max_rss_bytes": peak}


def runtime_gauges(*, count_tasks: bool = True) -> dict[str, int | None]:
    """The process's own resource gauges, for leak watching (soak runs):
    asyncio tasks alive, open file descriptors, resident memory and threads.
    None where the platform does not say (no /proc), and tasks None unless
    ``count_tasks``: the count walks every task (about five per agent, ~20 ms at
    10,000 agents), which a status polled by a script should not pay."""
    fds: int | None
    try:
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        fds = None
    rss: int | None = None
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            rss = int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    tasks: int | None = None
    if count_tasks:
        with contextlib.suppress(RuntimeError):  # no running loop (a status read before the daemon runs)
            tasks = len(asyncio.all_tasks())
    return {
        "asyncio_tasks": tasks,
        "open_fds": fds,
        "rss_bytes": rss,
        "threads": threading.active_count(),
    }
