"""Operating commands: agents, presence, discover, drain, renew, reload, logs, metrics."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from meshnode.admin.client import AdminClientError, exit_code_for, merge_pages
from meshnode.admin.protocol import AdminError
from meshnode.config import ConfigError, parse_duration

from .daemon import _admin, _client_args, _socket, admin_failure
from .exitcodes import EX_CANTCREAT, EX_CONFIG, EX_DATAERR, EX_OK, EX_USAGE
from .output import emit_json, human_size, human_time, render


def register(commands: Any) -> None:
    agents = commands.add_parser("agents", help="hosted agents: list, show, add, remove, restart")
    sub = agents.add_subparsers(dest="agents_command", metavar="ACTION", required=True)
    p = sub.add_parser("list", help="every hosted agent with its state")
    _client_args(p)
    p.set_defaults(handler=cmd_agents_list)
    p = sub.add_parser("show", help="one agent: manifest as registered, presence, counters, latency")
    p.add_argument("name")
    _client_args(p)
    p.set_defaults(handler=cmd_agents_show)
    p = sub.add_parser(
        "add", help="host new agents now (kept across restarts only with --save)",
        description="Host one or more new agents now. Without --save they live until the daemon "
        "stops: after a restart they are not hosted, and are deregistered. --save appends each "
        "one's [agents.NAME] table to the daemon's configuration file (the rest of the file is "
        "left exactly as written). Several names are added at once, with one node credential "
        "for them all (on a joined node each credential is a control-plane request, limited per "
        "node a minute); --plugin and --set apply to each. One that cannot be hosted fails "
        "alone, and the command exits with its error's code.",
    )
    p.add_argument("names", nargs="+", metavar="NAME", help="the agents' names (several: one credential for them all)")
    p.add_argument("--plugin", help="agent kind (default: NAME)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="a plugin setting (repeatable)")
    p.add_argument("--save", action="store_true",
                   help="also append [agents.NAME] to the daemon's configuration file")
    _client_args(p)
    p.set_defaults(handler=cmd_agents_add)
    p = sub.add_parser(
        "remove", help="stop agents and deregister them (out of the file too only with --save)",
        description="Stop one or more agents and deregister them (their broker buffers go too). "
        "Several names are removed with one node credential for them all. An agent the "
        "configuration file has comes back at the next start unless --save, which comments its "
        "[agents.NAME] table out of the file (uncommenting restores it); a reload leaves it "
        "removed either way.",
    )
    p.add_argument("names", nargs="+", metavar="NAME", help="the hosted agents to remove")
    p.add_argument("--keep-registration", action="store_true", help="keep their registrations and broker buffers")
    p.add_argument("--save", action="store_true",
                   help="also comment their [agents.NAME] tables out of the daemon's configuration file")
    _client_args(p)
    p.set_defaults(handler=cmd_agents_remove)
    p = sub.add_parser("restart", help="stop and start an agent (same key)")
    p.add_argument("name")
    _client_args(p)
    p.set_defaults(handler=cmd_agents_restart)

    p = commands.add_parser("presence", help="presence of a node or agent (default: all nodes)")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--node", help="a node id (U...)")
    target.add_argument("--agent", help="an agent: a local name, a name the registry lists, or an id (U...)")
    _client_args(p)
    p.set_defaults(handler=cmd_presence)

    p = commands.add_parser("discover", help="query the registry (§9.3 filters, AND)")
    p.add_argument(
        "--capability", action="append", dest="capabilities", default=[],
        help="agents with this capability (repeat: all of them)",
    )
    p.add_argument("--offering", dest="offering_id", help="agents with an offering of this id")
    p.add_argument("--tag", action="append", dest="tags", default=[], help="an offering tag (repeat: any of them)")
    p.add_argument("--availability", choices=["online", "busy", "degraded", "offline"], help="current presence")
    p.add_argument("--node", help="agents hosted by this node id (U...)")
    p.add_argument(
        "--trust-tier", dest="trust_tier", choices=["sandbox", "standard", "verified"],
        help="hosts whose operator-attested tier is at least this",
    )
    p.add_argument("--limit", type=int, help="at most this many agents")
    p.add_argument(
        "--exported-by", dest="exported_by", metavar="TENANT",
        help="ask TENANT's registry instead of this node's tenant's: TENANT exported its discovery "
        "here ([[mesh.embedded.exports]] discover = true, §15.2); of its agents, only exported ones answer calls",
    )
    _client_args(p)
    p.set_defaults(handler=cmd_discover)

    p = commands.add_parser("drain", help="run an inbox drain pass now")
    p.add_argument("--agent", help="only this agent")
    _client_args(p)
    p.set_defaults(handler=cmd_drain)

    p = commands.add_parser("renew", help="re-vouch and re-register agents, renew the node credential now")
    _client_args(p)
    p.set_defaults(handler=cmd_renew)

    p = commands.add_parser("reload", help="reload the configuration file (like SIGHUP)")
    _client_args(p)
    p.set_defaults(handler=cmd_reload)

    p = commands.add_parser("logs", help="recent daemon logs; --follow streams new ones")
    p.add_argument("--follow", "-f", action="store_true")
    p.add_argument("--level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("--lines", "-n", type=int, default=100)
    _client_args(p)
    p.set_defaults(handler=cmd_logs)

    tasks = commands.add_parser("tasks", help="tasks performed here; the task manager's records; cancel")
    tsub = tasks.add_subparsers(dest="tasks_command", metavar="ACTION", required=True)
    p = tsub.add_parser("list", help="tasks this node's agents are performing now")
    p.add_argument("--agent", help="only this hosted agent's tasks (all of them: one agent's always fit)")
    _client_args(p)
    p.set_defaults(handler=cmd_tasks_list)
    p = tsub.add_parser("show", help="a task's record from the task manager")
    p.add_argument("task_id")
    _client_args(p)
    p.set_defaults(handler=cmd_tasks_show)
    p = tsub.add_parser("cancel", help="cancel a task (sent as this node's CLI identity)")
    p.add_argument("task_id")
    p.add_argument("--agent", help="the agent performing it (name or id; default: the one the daemon knows)")
    p.add_argument("--reason", default="user_requested",
                   choices=["user_requested", "superseded", "deadline_exceeded", "budget_exhausted",
                            "upstream_cancelled", "policy", "needs_not_furnished", "dependency_failed"])
    p.add_argument("--note")
    _client_args(p)
    p.set_defaults(handler=cmd_tasks_cancel)

    p = commands.add_parser("metrics", help="counters and latencies per agent")
    p.add_argument("--prometheus", action="store_true", help="Prometheus text format")
    _client_args(p)
    p.set_defaults(handler=cmd_metrics)

    p = commands.add_parser(
        "memory",
        help="which agents' code holds the memory allocated during a window (tracemalloc sample)",
        description="Trace the daemon's allocations for a window and list, per agent plugin, the memory"
        " allocated during it that is still alive at its end, with the lines that allocated most."
        " Every agent shares one heap, so this is a sample, not a gauge: tracing slows allocations"
        " while it runs.",
    )
    p.add_argument("--for", dest="window", default="10s", metavar="DURATION",
                   help="how long to trace (e.g. 10s, 2m; 0.1 s to 10 min; default 10s)")
    p.add_argument("--frames", type=int, default=25, help="frames kept per allocation (default 25)")
    p.add_argument("--top", type=int, default=5, help="allocating lines listed per agent and for the daemon (default 5)")
    _client_args(p)
    p.set_defaults(handler=cmd_memory)


def _print(args: argparse.Namespace, result: Any) -> None:
    """``--json``: the result as JSON; otherwise a ``key  value`` listing for people."""
    if getattr(args, "json", False):
        emit_json(result)
    else:
        render(result)


def _simple(
    args: argparse.Namespace, method: str, params: dict[str, Any] | None = None, *, timeout: float = 30.0
) -> int:
    code, result = _admin(args, method, params, timeout=timeout)
    if code == EX_OK:
        _print(args, result)
    return code


def cmd_agents_list(args: argparse.Namespace) -> int:
    code, result = _admin(args, "Agents.List", listing=True)
    if code != EX_OK:
        return code
    if args.json:
        _print(args, result)
        return EX_OK
    for a in result["agents"]:
        if "id" not in a:
            print(f"{a['name']:<16} FAILED  {a.get('failure')}")
            continue
        reg = "registered" if a["registered"] else "unregistered"
        print(f"{a['name']:<16} {a['state']:<8} {reg:<12} {a['plugin']:<14} {a['id']}")
        if a["state"] == "failed" and a.get("failure"):
            print(f"{'':<16} FAILED  {a['failure']}")
    return EX_OK


def cmd_agents_show(args: argparse.Namespace) -> int:
    return _simple(args, "Agents.Show", {"name": args.name})


def cmd_agents_add(args: argparse.Namespace) -> int:
    config: dict[str, Any] = {}
    if args.plugin or len(args.names) == 1:
        config["plugin"] = args.plugin or args.names[0]
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep:
            print(f"meshnode: --set wants KEY=JSON, got {item!r}", file=sys.stderr)
            return EX_DATAERR
        try:
            config[key] = json.loads(raw)
        except json.JSONDecodeError:
            config[key] = raw  # a bare string is fine
    if len(args.names) > 1:
        return _agents_add_several(args, config)
    (name,) = args.names
    code, result = _admin(args, "Agents.Add", {"name": name, "config": config, "save": args.save},
                          timeout=_LONG_CALL_TIMEOUT_S)
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
        return EX_CANTCREAT if result.get("saved") is False else EX_OK
    print(f"hosting {result.get('name', name)} ({result.get('id', '?')}), {result.get('state', '?')}")
    _report_unregistered([result])
    if not args.save:
        print("not saved to the configuration: gone after a restart (use --save to keep it)", file=sys.stderr)
    return _report_saved(name, result)


def _report_unregistered(hosted: list[dict[str, Any]]) -> None:
    """Say which hosted agents the registry did not take (hosted, yet not
    discoverable and with no broker buffer): one line for them all, with the
    first reason; ``meshnode status`` shows each."""
    refused = [a for a in hosted if a.get("registered") is False and a.get("registration_error")]
    if not refused:
        return
    names = ", ".join(str(a.get("name")) for a in refused[:5]) + (", ..." if len(refused) > 5 else "")
    print(f"meshnode: warning: {len(refused)} hosted agent(s) not registered ({names}): "
          f"{refused[0]['registration_error']}", file=sys.stderr)


def _agents_add_several(args: argparse.Namespace, config: dict[str, Any]) -> int:
    """``agents add A B C``: one ``Agents.Add`` naming them all (one credential);
    the exit code is the first failure's, else 73 if a table was not saved."""
    code, result = _admin(args, "Agents.Add", {"names": args.names, "config": config, "save": args.save},
                          timeout=_LONG_CALL_TIMEOUT_S)
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
    codes: list[int] = []
    for agent in result["agents"]:
        name = agent["name"]
        if not agent["hosted"]:
            codes.append(_failed(name, "hosted", agent["error"]))
            continue
        if not args.json:
            print(f"hosting {name} ({agent.get('id', '?')}), {agent.get('state', '?')}")
        if _report_saved(name, agent, quiet=args.json) != EX_OK:
            codes.append(EX_CANTCREAT)
    _report_unregistered([a for a in result["agents"] if a["hosted"]])
    if not args.save and not args.json and result["hosted"]:
        print("not saved to the configuration: gone after a restart (use --save to keep them)", file=sys.stderr)
    return next(iter(codes), EX_OK)


#: ``agents add`` / ``remove`` / ``restart``, ``reload``, ``renew``, ``drain``:
#: longer than a call's usual 30 s. A joined node whose control plane
#: rate-limits it waits up to RATE_LIMIT_PATIENCE_S (75 s) for the credential,
#: thousands of agents take a while to host, an agent's stop and start have
#: their own grace periods, and a full buffer takes a while to drain; the CLI
#: gave up at 30 s while the daemon went on.
_LONG_CALL_TIMEOUT_S = 600.0


def _report_saved(name: str, result: dict[str, Any], *, quiet: bool = False) -> int:
    """Say whether --save wrote ``name``'s table; 73 when it could not."""
    if result.get("saved"):
        if not quiet:
            print(f"saved as [agents.{name}] in {result['config_file']}")
    elif result.get("saved") is False:
        print(f"meshnode: {name} not saved: {result['save_error']}; add this to the configuration "
              f"yourself to keep it:\n{result['table']}", file=sys.stderr)
        return EX_CANTCREAT
    return EX_OK


def cmd_agents_remove(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"deregister": not args.keep_registration, "save": args.save}
    if len(args.names) == 1:
        code, result = _admin(args, "Agents.Remove", {"name": args.names[0], **params}, timeout=_LONG_CALL_TIMEOUT_S)
        if code != EX_OK:
            return code
        if args.json:
            emit_json(result)
        else:
            print(f"removed {result['removed']}")
        return _report_unsaved(result["removed"], result, quiet=args.json)
    code, result = _admin(args, "Agents.Remove", {"names": args.names, **params}, timeout=_LONG_CALL_TIMEOUT_S)
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
    elif result["removed"]:
        print(f"removed {', '.join(result['removed'])}")
    codes = [_failed(name, "removed", wire) for name, wire in result["failed"].items()]
    codes += [_report_unsaved(name, outcome, quiet=args.json) for name, outcome in result["configuration"].items()]
    return next((c for c in codes if c != EX_OK), EX_OK)


def _report_unsaved(name: str, outcome: dict[str, Any], *, quiet: bool) -> int:
    """Say what became of a removed agent's table in the file; 73 when --save
    could not comment it out."""
    if outcome.get("saved") is False:
        print(f"meshnode: [agents.{name}] not commented out: {outcome['save_error']}; the next start "
              "hosts it again unless you remove it from the configuration yourself", file=sys.stderr)
        return EX_CANTCREAT
    if quiet or not outcome.get("configured"):
        return EX_OK
    where = outcome.get("config_file") or "the configuration"
    if outcome["saved"]:
        print(f"commented out [agents.{name}] in {where}")
    else:
        print(f"[agents.{name}] stays in {where}: the next start hosts it again (--save comments it out; "
              "a reload leaves it removed)", file=sys.stderr)
    return EX_OK


def _failed(name: str, what: str, wire: dict[str, Any]) -> int:
    """Say on stderr why agent ``name`` was not ``what`` (its admin error on the
    wire); the exit code that error stands for."""
    error = AdminError.from_wire(wire)
    print(f"meshnode: {name} not {what}: {error.message}", file=sys.stderr)
    return exit_code_for(error)


def cmd_agents_restart(args: argparse.Namespace) -> int:
    return _simple(args, "Agents.Restart", {"name": args.name}, timeout=_LONG_CALL_TIMEOUT_S)


def cmd_presence(args: argparse.Namespace) -> int:
    params = {k: v for k, v in (("node", args.node), ("agent", args.agent)) if v}
    return _simple(args, "Presence", params)


def cmd_discover(args: argparse.Namespace) -> int:
    query: dict[str, Any] = {}
    for key in ("capabilities", "tags"):
        if getattr(args, key):
            query[key] = getattr(args, key)
    for key in ("offering_id", "availability", "node", "trust_tier", "limit", "exported_by"):
        if getattr(args, key) is not None:
            query[key] = getattr(args, key)
    code, result = _admin(args, "Discover", query)
    if code != EX_OK:
        return code
    if args.json:
        _print(args, result)
        return EX_OK
    found = result.get("agents", [])
    if found:
        print(f"{'NAME':<20} {'STATE':<8} {'AGENT':<56}  {'NODE':<13} OFFERINGS")
    for m in found:
        offerings = ",".join(o.get("id", "?") for o in m.get("offerings", []))
        node = m.get("node") if isinstance(m.get("node"), dict) else {}
        # Names repeat across nodes (each node's "echo"): the node tells them apart.
        where = "this node" if m.get("hosted_here") else (str(node.get("id") or "-")[:12] + "…")
        print(f"{m.get('name', '?'):<20} {m.get('availability', '-'):<8} {m['id']:<56}  {where:<13} [{offerings}]")
    print(f"{result.get('total', 0)} agent(s)")
    return EX_OK


def cmd_drain(args: argparse.Namespace) -> int:
    code, result = _admin(args, "Drain.Now", {"agent": args.agent} if args.agent else {}, timeout=_LONG_CALL_TIMEOUT_S)
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
        return EX_OK
    quiet = 0
    for entry in result["drained"]:
        line = _drain_line(entry)
        if line is None:
            quiet += 1
        else:
            print(line)
    total = result["drained_total"]
    if quiet:
        print(f"{quiet} of {total} agents' buffers held nothing new" if total > 1 else
              f"{result['drained'][0]['agent']}: its buffer held nothing new")
    if result.get("not_shown"):
        print(f"{result['not_shown']} more drained; their results are in meshnode status --json")
    return EX_OK


def _drain_line(entry: dict[str, Any]) -> str | None:
    """One agent's drain pass in words; None when it found nothing and failed not."""
    done = entry.get("pass") or {}
    name = entry["agent"]
    if entry.get("failing"):
        return f"{name}: FAILING: {entry.get('last_error') or 'unknown error'}"
    if not done.get("fetched") and not done.get("dispatched"):
        return None
    parts = [f"fetched {done.get('fetched', 0)}", f"{done.get('committed', 0)} new",
             f"{done.get('duplicates', 0)} already handled"]
    if done.get("deferred"):
        parts.append(f"{done['deferred']} left while their live handlers run")
    return f"{name}: {', '.join(parts)}; {done.get('dispatched', 0)} handed to their handlers"


def cmd_renew(args: argparse.Namespace) -> int:
    return _simple(args, "Renew.Now", timeout=_LONG_CALL_TIMEOUT_S)


def cmd_reload(args: argparse.Namespace) -> int:
    code, result = _admin(args, "Reload", timeout=_LONG_CALL_TIMEOUT_S)
    if code != EX_OK:
        return code
    if args.json:
        _print(args, result)
        return EX_OK
    for line in reload_lines(result):
        print(line)
    return EX_OK


def reload_lines(report: dict[str, Any]) -> list[str]:
    """A reload's report as a person reads it: what changed, what did not and why."""
    lines = [
        f"{what}: {', '.join(report[key])}"
        for key, what in (("added", "hosted"), ("removed", "removed"), ("restarted", "restarted"))
        if report.get(key)
    ]
    if report.get("kept_removed"):
        lines.append(f"still removed (meshnode agents remove; `agents add` hosts them again): "
                     f"{', '.join(report['kept_removed'])}")
    for name, why in sorted((report.get("failed") or {}).items()):
        lines.append(f"FAILED {name}: {why}")
    for name, allowance in sorted((report.get("allowances") or {}).items()):
        if isinstance(allowance, dict) and allowance.get("valid") is False:
            lines.append(f"allowance of {name} does not hold ({allowance.get('source')}): "
                         f"{'; '.join(map(str, allowance.get('errors') or []))}")
    waiting = report.get("requires_restart") or []
    sections = [w for w in waiting if not w.startswith("plugin ")]
    if sections:
        lines.append(f"not applied until the daemon restarts: {', '.join(f'[{s}]' for s in sections)} changed")
    lines.extend(f"not applied until the daemon restarts: {w}" for w in waiting if w.startswith("plugin "))
    if not lines:
        reread = f"; {len(report['allowances'])} allowance(s) read again" if report.get("allowances") else ""
        lines.append(f"nothing to apply: the file is what runs{reread}")
    return lines


def cmd_logs(args: argparse.Namespace) -> int:
    if not args.follow:
        code, result = _admin(args, "Logs.Tail", {"lines": args.lines, "level": args.level})
        if code != EX_OK:
            return code
        for record in result["records"]:
            print(json.dumps(record) if args.json else _log_line(record))
        return EX_OK
    socket = _socket(args)
    if socket is None:
        return EX_CONFIG
    import asyncio

    from meshnode.admin.client import AdminClient

    async def follow() -> None:
        async with AdminClient(socket, timeout=None) as client:
            async for record in client.stream("Logs.Follow", {"level": args.level}):
                print(json.dumps(record) if args.json else _log_line(record), flush=True)

    try:
        asyncio.run(follow())
    except KeyboardInterrupt:
        return EX_OK
    except (AdminClientError, AdminError) as exc:
        print(admin_failure(args, exc), file=sys.stderr)
        return exit_code_for(exc)
    return EX_OK


def _log_line(record: dict[str, Any]) -> str:
    line = f"{human_time(record['ts'])} {record['level']:<7} {record['logger']}: {record['message']}"
    exception = record.get("exception")
    return f"{line}\n{exception}" if isinstance(exception, str) and exception else line


def cmd_tasks_list(args: argparse.Namespace) -> int:
    code, result = _admin(args, "Tasks.List", {"agent": args.agent} if args.agent else {})
    if code != EX_OK:
        return code
    if args.json:
        _print(args, result)
    elif not result["tasks"]:
        print("no tasks in progress")
    else:
        for t in result["tasks"]:
            print(f"{t['task_id']}  {t['agent']:<14} {t['state']:<14} {t.get('offering') or '':<12} for {t['requester']}")
        if result.get("not_shown"):
            print(f"... and {result['not_shown']:,} more (of {result['tasks_total']:,}): more than one answer "
                  "carries; --agent NAME lists all of one agent's")
    return EX_OK


def cmd_tasks_show(args: argparse.Namespace) -> int:
    code, record = _admin(args, "Tasks.Show", {"task_id": args.task_id})
    if code != EX_OK:
        return code
    if args.json:
        emit_json(record)
        return EX_OK
    print(render_task(record))
    return EX_OK


def render_task(record: dict[str, Any]) -> str:
    """A task manager record (``Tasks.Show``) for people: who, what, where it stands, how it went."""
    meta = record.get("meta") if isinstance(record.get("meta"), dict) else {}
    assert isinstance(meta, dict)
    lines = [
        f"task       {record.get('id')}" + (f"  (context {record['context_id']})" if record.get("context_id") else ""),
        f"offering   {record.get('offering') or '-'}",
        f"state      {record.get('state')}" + (f": {meta['status_message']}" if meta.get("status_message") else ""),
        f"requester  {record.get('requester')}",
        f"responder  {record.get('responder')}",
        f"created    {human_time(record.get('created_at'))}",
        f"updated    {human_time(record.get('updated_at'))}",
    ]
    if meta.get("ended_at"):
        lines.append(f"ended      {human_time(meta['ended_at'])}")
    for key, label in (("cancel_reason", "canceled"), ("failure_reason", "failure"), ("note", "note")):
        if meta.get(key):
            lines.append(f"{label:<10} {meta[key]}")
    if isinstance(meta.get("cost"), dict):
        lines.append(f"cost       {meta['cost'].get('amount_micro')} micro-{meta['cost'].get('currency')}")
    error = record.get("error")
    if isinstance(error, dict):
        lines.append(f"error      {error.get('code')}: {error.get('message')}")
    if "output" in record:
        output = record["output"]
        text = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
        lines.append(f"output     {text if len(text) <= 200 else text[:200] + '...'}")
    history = record.get("history") if isinstance(record.get("history"), list) else []
    assert isinstance(history, list)
    if history:
        lines.append(f"updates    {len(history)}" + (f" ({meta['history_dropped']} older dropped)" if meta.get("history_dropped") else ""))
        for env in history[-10:]:
            raw = env.get("payload") if isinstance(env, dict) else None
            payload: dict[str, Any] = raw if isinstance(raw, dict) else {}
            status = payload.get("status") or "-"
            message = f"  {payload['message']}" if payload.get("message") else ""
            lines.append(f"  {human_time(env.get('ts') if isinstance(env, dict) else None)}  {status:<14}{message}")
    return "\n".join(lines)


def cmd_tasks_cancel(args: argparse.Namespace) -> int:
    agent = args.agent
    if agent is None:
        # The daemon knows the task: one its agents perform, or one the task manager recorded.
        code, performing = _admin(args, "Tasks.List", {"task_id": args.task_id})
        if code != EX_OK:
            return code
        agent = next((t["agent"] for t in performing["tasks"] if t["task_id"] == args.task_id), None)
        if agent is None:
            code, record = _admin(args, "Tasks.Show", {"task_id": args.task_id})
            if code != EX_OK:
                print(f"meshnode: name the performer with --agent (the daemon does not know task {args.task_id})",
                      file=sys.stderr)
                return code
            agent = record.get("responder")
    params: dict[str, Any] = {"task_id": args.task_id, "agent": agent, "reason": args.reason}
    if args.note:
        params["note"] = args.note
    return _simple(args, "Tasks.Cancel", params)


def _merge_prometheus_pages(pages: list[dict[str, Any]]) -> dict[str, Any]:
    # Imported here: the CLI's parser loads none of the node runtime (test_architecture).
    from meshnode.node.metrics import merge_exposition

    merged = dict(pages[0])
    merged["text"] = merge_exposition(page["text"] for page in pages)
    merged["agents_next"] = None
    return merged


def cmd_metrics(args: argparse.Namespace) -> int:
    code, result = _admin(
        args, "Metrics", {"format": "prometheus" if args.prometheus else "json"}, listing=True,
        combine=_merge_prometheus_pages if args.prometheus else merge_pages,
    )
    if code != EX_OK:
        return code
    if args.prometheus and not args.json:
        sys.stdout.write(result["text"])  # --json: {"text": ...} like every other result
    else:
        _print(args, result)
    return EX_OK


def cmd_memory(args: argparse.Namespace) -> int:
    try:
        seconds = parse_duration(args.window).total_seconds()
    except ConfigError as exc:
        print(f"meshnode memory: --for: {exc}", file=sys.stderr)
        return EX_USAGE
    if not args.json:
        print(f"tracing allocations for {seconds:g} s ...", file=sys.stderr)
    params = {"seconds": seconds, "frames": args.frames, "top": args.top}
    # The call lasts the window, then the snapshot is grouped: allow for both.
    code, result = _admin(args, "Memory.Sample", params, timeout=seconds + 60.0)
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
        return EX_OK
    print(f"allocated during the {result['window_s']:g} s window and still alive: "
          f"{human_size(result['traced_bytes'])} in {result['traced_blocks']:,} blocks")
    for row in result["agents"]:
        print(f"{human_size(row['bytes']):>10}  {', '.join(row['agents'])}  ({row['source']})")
        for line in row["top_lines"]:
            print(f"{'':>12}{human_size(line['bytes']):>10}  {line['line']}")
    daemon = result["daemon"]
    print(f"{human_size(daemon['bytes']):>10}  the daemon and its libraries (no agent code on the stack)")
    for line in daemon.get("top_lines", ()):
        print(f"{'':>12}{human_size(line['bytes']):>10}  {line['line']}")
    rss = result["process"]
    if rss.get("rss_bytes_after") is not None:
        print(f"process RSS {human_size(rss['rss_bytes_before'] or 0)} -> {human_size(rss['rss_bytes_after'])}")
    return EX_OK
