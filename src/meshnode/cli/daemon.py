"""``meshnode run``, ``check-config``, ``status`` and ``call``: running the daemon and
talking to it over its admin socket."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from meshnode.admin.client import (
    AdminClient,
    AdminClientError,
    DaemonNotRunning,
    call_listing,
    call_sync,
    exit_code_for,
    merge_pages,
)
from meshnode.admin.offloop import read_status_socket
from meshnode.admin.protocol import AdminError
from meshnode.config import (
    CONFIG_ENV,
    Config,
    ConfigError,
    describe_sources,
    load_config,
    resolve_config_path,
)

from .exitcodes import (
    EX_CHECK_FAILED,
    EX_CONFIG,
    EX_DATAERR,
    EX_ERROR,
    EX_INTERRUPTED,
    EX_LOOP_BLOCKED,
    EX_OK,
    EX_USAGE,
)
from .output import emit_json, emit_json_line, human_size, human_time


def register(commands: Any) -> None:
    run = commands.add_parser("run", help="run the daemon (embedded mesh when none is configured)")
    _config_arg(run)
    run.set_defaults(handler=cmd_run)

    check = commands.add_parser(
        "check-config",
        help="validate the configuration and each [agents.X] table against its plugin (exit 78 when bad)",
    )
    _config_arg(check)
    check.add_argument("--json", action="store_true")
    check.add_argument("--no-plugins", action="store_true",
                       help="check the file only: do not load the installed plugins")
    check.set_defaults(handler=cmd_check_config)

    status = commands.add_parser("status", help="node, mesh and agent status from a running daemon")
    _client_args(status)
    status.add_argument("--brief", action="store_true",
                        help="agent counts instead of the per-agent list, and no asyncio task count: the cheap form to poll "
                             "(a node with thousands of agents)")
    status.set_defaults(handler=cmd_status)

    call = commands.add_parser("call", help="call an agent's offering as this node's CLI identity")
    call.add_argument("agent", help="a local agent's name, a name the registry lists, or an agent id (U...)")
    call.add_argument("offering", help="the offering id, e.g. echo or chat")
    call.add_argument("input", nargs="?", help="the input as JSON (default: none); - reads it from stdin")
    call.add_argument("--text", help="shorthand for the input {\"text\": TEXT}; - reads the text from stdin")
    call.add_argument("--timeout", type=float, default=30.0,
                      help="seconds to wait for the answer, or for a task's next update: a task that keeps "
                      "reporting progress is followed until it ends (default 30)")
    call.add_argument("--stream", action="store_true", help="ask for a streamed answer (config.stream)")
    call.add_argument("--no-wait", action="store_true", help="return as soon as a task is opened (prints its id)")
    call.add_argument("--task-id", help="answer this task, paused in input_required/auth_required, with INPUT")
    call.add_argument("--context-id", help="the context of the task answered with --task-id (when it has one)")
    _client_args(call)
    call.set_defaults(handler=cmd_call)


def _config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="TOML configuration file (env MESHNODE_CONFIG)")


def _client_args(parser: argparse.ArgumentParser) -> None:
    _config_arg(parser)
    parser.add_argument("--socket", help="admin socket path (default: from the configuration)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _load(args: argparse.Namespace) -> Config | None:
    try:
        return load_config(args.config)
    except ConfigError as exc:
        print(f"meshnode: configuration error:\n{exc}", file=sys.stderr)
        return None


def cmd_run(args: argparse.Namespace) -> int:
    config = _load(args)
    if config is None:
        return EX_CONFIG
    from meshnode.daemon.logs import setup_logging
    from meshnode.daemon.main import run_daemon

    setup_logging(config.logging.level, config.logging.format)
    from meshnode.daemon.main import RELAUNCH, relaunch_process

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        run = asyncio.run
    else:
        run = uvloop.run
    try:
        result = run(run_daemon(config))
    except (SystemExit, KeyboardInterrupt) as exc:
        _exit_after_escape(exc)
    if result == RELAUNCH:
        relaunch_process()  # does not return
    return int(result)


def _exit_after_escape(exc: SystemExit | KeyboardInterrupt) -> NoReturn:
    """The daemon's own stops return an exit status, so a SystemExit (or
    KeyboardInterrupt) here was raised inside one of its tasks (a plugin's
    ``sys.exit()``, a library's) and left the event loop. The shutdown ran as
    far as asyncio's clean-up let it; a worker thread it could not end would
    keep the interpreter from exiting, a daemon alive and serving nothing. So
    the process ends now, as after kill -9, which the inbox and the broker's
    store recover from. Never status 0: a supervisor restarts it."""
    log = logging.getLogger("meshnode.daemon")
    if isinstance(exc, KeyboardInterrupt):
        log.error("interrupted before the daemon could handle the signal; exiting")
        code = EX_INTERRUPTED
    else:
        log.critical(
            "SystemExit(%r) was raised inside the daemon (traceback below) and ended its event loop; "
            "exiting with status %d (nothing acknowledged is lost: the next start recovers). "
            "A plugin must not call sys.exit(): raise an exception, or ask the daemon to stop",
            exc.code, EX_ERROR, exc_info=exc,
        )
        code = EX_ERROR
    logging.shutdown()
    os._exit(code)


def cmd_check_config(args: argparse.Namespace) -> int:
    # The daemon's plugin machinery (and through it the node runtime and NATS)
    # only for this command: `meshnode status` and the rest start without it.
    from meshnode.daemon.hosting import scan_plugins
    from meshnode.daemon.mesh import server_problems
    from meshnode.daemon.plugin_check import (
        agent_problems,
        installed_kinds,
        module_problems,
        raise_if_problems,
        unused_failures,
    )

    kinds: list[str] | None = None
    checked_plugins = False
    try:
        config = load_config(args.config)
        raise_if_problems(config, {}, server_problems(config))
        checked_plugins = not args.no_plugins
        if not args.no_plugins:
            # Like Caddy's validate: load the plugins the daemon would load, and
            # check every [agents.X] table against them (kind known, Settings valid).
            # The loader's own log lines would say each failure twice: it is reported below.
            logging.getLogger("meshnode.plugins").setLevel(logging.CRITICAL)
            _, catalog = scan_plugins(config, strict=False)
            raise_if_problems(config, agent_problems(config, catalog), module_problems(config, catalog))
            kinds = installed_kinds(catalog)
            for name, failure in unused_failures(config, catalog).items():
                print(f"warning: installed plugin {name!r} failed to load (no table uses it): {failure}",
                      file=sys.stderr)
    except ConfigError as exc:
        if args.json:
            problems = [{"file": p.file, "key": p.key, "message": p.message} for p in exc.problems]
            print(json.dumps({"ok": False, "problems": problems}))
        else:
            print(f"configuration error:\n{exc}", file=sys.stderr)
            if not checked_plugins and not args.no_plugins and "agents" in _toml_tables(exc.path):
                # The plugin checks need the rest valid first: a second round may find more.
                print("(the [agents.*] tables are checked against their plugins once the rest is valid)",
                      file=sys.stderr)
        return EX_CONFIG
    if args.json:
        print(json.dumps({"ok": True, "config": config.to_toml_dict(), "plugins": kinds}, default=str))
    else:
        for line in describe_sources(args.config):
            print(line)
        if kinds is not None:
            print(f"plugins: {', '.join(kinds) if kinds else 'none installed'}")
        mode = "embedded mesh" if not config.mesh.servers else f"joins {', '.join(config.mesh.servers)}"
        print(f"ok: node {config.node.name!r}, {mode}, {len(config.agents)} agent table(s)")
    return EX_OK


def _socket(args: argparse.Namespace) -> str | None:
    if args.socket:
        return str(args.socket)
    config = _load(args)
    return str(config.admin.socket) if config is not None else None


def admin_failure(args: argparse.Namespace, exc: Exception) -> str:
    """The line a failed admin call prints: the error, and for no daemon at a
    socket the CLI found by default, how to name the daemon that does run."""
    line = f"meshnode: {exc}"
    if isinstance(exc, DaemonNotRunning) and not getattr(args, "socket", None):
        path, _origin, explicit = resolve_config_path(getattr(args, "config", None))
        if not explicit:
            found = f"the socket {path} names" if path.exists() else f"the default socket (there is no {path})"
            line += (
                f"\n  ({found}, as neither --config nor ${CONFIG_ENV} names a file; reach a daemon"
                f" started with `meshnode run --config FILE` with --config FILE or {CONFIG_ENV}=FILE)"
            )
    return line


def _admin(
    args: argparse.Namespace,
    method: str,
    params: dict[str, Any] | None = None,
    *,
    timeout: float | None = 30.0,
    listing: bool = False,
    combine: Callable[[list[dict[str, Any]]], dict[str, Any]] = merge_pages,
) -> tuple[int, Any]:
    """``method`` on the daemon; ``listing``: it answers an agent list in pages,
    read them all and ``combine`` them (:func:`~meshnode.admin.client.call_listing`)."""
    socket = _socket(args)
    if socket is None:
        return EX_CONFIG, None
    try:
        result = call_sync(socket, method, params, timeout=timeout, listing=listing, combine=combine)
        _warn_if_roster_changed(result)
        return EX_OK, result
    except (AdminClientError, AdminError) as exc:
        print(admin_failure(args, exc), file=sys.stderr)
        return exit_code_for(exc), None


def _warn_if_roster_changed(result: Any) -> None:
    if isinstance(result, dict) and result.get("roster_changed"):
        print("meshnode: the roster kept changing while the agent list was read in pages: an agent "
              "may be missing or listed twice; run it again", file=sys.stderr)


#: How long ``status`` waits on the admin socket before it asks the status
#: socket whether the loop is blocked (a busy loop answers within this).
STATUS_SOCKET_AFTER_S = 2.0


def _status_or_blocked(args: argparse.Namespace, params: dict[str, Any] | None) -> tuple[int, Any]:
    """``Status`` from the admin socket; or, while the daemon's loop is blocked,
    the status socket's answer (its last snapshot and who blocks) with
    :data:`EX_LOOP_BLOCKED` — at once, not after the admin call's 30 s timeout."""
    socket = _socket(args)
    if socket is None:
        return EX_CONFIG, None

    async def ask() -> tuple[int, Any]:
        client = AdminClient(socket, timeout=30.0)
        call = asyncio.create_task(call_listing(client, "Status", params))
        try:
            done, _ = await asyncio.wait({call}, timeout=STATUS_SOCKET_AFTER_S)
            while not done:
                # The admin socket is slow: a blocked loop, or only a busy one?
                side = await asyncio.to_thread(read_status_socket, socket)
                if side is not None and side.get("blocked"):
                    return EX_LOOP_BLOCKED, side
                done, _ = await asyncio.wait({call}, timeout=1.0)
            return EX_OK, call.result()
        finally:
            if not call.done():
                call.cancel()
                await asyncio.wait({call})
            await client.close()

    try:
        return asyncio.run(ask())
    except (AdminClientError, AdminError) as exc:
        print(admin_failure(args, exc), file=sys.stderr)
        return exit_code_for(exc), None


def _blocked_lines(status: dict[str, Any]) -> list[str]:
    blocked = status["blocked"]
    agent = blocked.get("agent")
    who = f"a handler of agent {agent}" if agent and agent != "(none)" else "code outside any agent's handler"
    lines = [f"loop      BLOCKED now, for {blocked.get('for_s')} s, by {who}: nothing on this node "
             "answers until it returns (fix: await, or asyncio.to_thread for blocking calls)"]
    age = status.get("snapshot_age_s")
    if age is not None:
        lines.append(f"          the figures below are the last snapshot, {age} s old")
    else:
        lines.append("          no snapshot was published yet")
    return lines


def cmd_status(args: argparse.Namespace) -> int:
    code, status = _status_or_blocked(args, {"agents": False} if args.brief else None)
    if code not in (EX_OK, EX_LOOP_BLOCKED):
        return code
    _warn_if_roster_changed(status)
    if code == EX_LOOP_BLOCKED and args.brief:
        status["agents"] = []  # the snapshot may hold the list; --brief asked for counts
    if args.json:
        emit_json(status)
        return code
    if code == EX_LOOP_BLOCKED:
        print("\n".join(_blocked_lines(status)))
        if "node" not in status:
            return code
    _print_status(status)
    return code


def _print_status(status: dict[str, Any]) -> None:
    node, mesh = status["node"], status["mesh"]
    print(f"node      {node['name']}  {node['id']}")
    if status.get("state") not in (None, "serving"):
        # Still starting (the stage in flight says where), reloading or stopping.
        stage = f" (stage {status['stage']})" if status.get("stage") else ""
        print(f"state     {status['state']}{stage}")
    state = "connected" if mesh["connected"] else "DISCONNECTED"
    broker = mesh.get("broker") or {}
    if broker.get("state") == "unresponsive":
        state += f", broker UNRESPONSIVE since {broker.get('unresponsive_since')} ({broker.get('reason')})"
    print(f"mesh      {mesh['mode']}, {state} to {mesh.get('connected_url') or ', '.join(mesh['urls'])}")
    planned = mesh.get("planned_reconnects") or {}
    if planned.get("unbridged"):
        # Said only when it happened: a planned reconnect whose bridge the broker refused.
        total = planned["unbridged"] + planned.get("bridged", 0)
        print(f"          {planned['unbridged']} of {total} planned reconnects unbridged: live mail sent "
              "during them went to the agents' buffers (the log says why)")
    if mesh.get("control_plane"):
        print(f"control   {mesh['control_plane']}")
    if mesh.get("tenants"):
        print(f"tenants   mesh (own), {', '.join(mesh['tenants'])}")
    if status.get("credential"):
        cred = status["credential"]
        print(f"credential expires {_when(cred['expires_at'])} (renews at {_when(cred['renew_at'])})")
        if cred.get("trust_tier"):
            # Attested by the mesh operator in the credential (§9.7), never self-declared.
            print(
                f"attested  {cred['role']}, trust tier {cred['trust_tier']}, tenant {cred['tenant']}"
            )
    print(f"keys      {status['keystore']}")
    inbox = status.get("inbox")
    if inbox and not inbox.get("writable", True):
        print(f"inbox     NOT WRITABLE since {_when((inbox.get('fault_since_ms') or 0) // 1000)}: {inbox.get('fault')}"
              " (nothing is acked; mail waits in the broker's buffer)")
    metering = status.get("metering")
    if metering and (metering.get("queued") or metering.get("waiting_in_log_from")):
        waiting = " and more waiting in usage.jsonl" if metering.get("waiting_in_log_from") else ""
        print(f"metering  {metering['queued']} meter event(s) waiting for JetStream{waiting}")
    lost = {k: v for k, v in ((metering or {}).get("counters") or {}).items() if k in ("orphaned", "trimmed") and v}
    if lost:
        # Read back from the log but never published (the agent is gone; the segment was deleted first).
        print("metering  not published: " + ", ".join(f"{v} {k}" for k, v in sorted(lost.items()))
              + " (see the log's WARNINGs)")
    storage = status.get("storage")
    if storage:
        print(f"store     {_store_line(storage)}")
        for reason in storage.get("low") or []:
            print(f"  LOW     {reason}")
    for tenant, tenant_storage in sorted((status.get("tenant_storage") or {}).items()):
        print(f"store     tenant {tenant}: {_store_line(tenant_storage)}")
        for reason in tenant_storage.get("low") or []:
            print(f"  LOW     {reason}")
    summary = status.get("agent_summary") or {}
    print(f"agents    {summary.get('hosted', len(status['agents']))} hosted, {summary.get('registered', '?')} registered, "
          f"{summary.get('failed', '?')} failed")
    for agent in status["agents"]:
        if agent.get("state") == "failed":
            # Never hosted, or hosted and its start failed (on_start raised or timed out): why.
            hosted = f"{agent['id']}  {agent['plugin']:<12} " if "id" in agent else ""
            print(f"  {agent['name']:<16} {hosted}FAILED: {agent.get('failure')}")
            continue
        reg = "registered" if agent.get("registered") else f"NOT registered ({agent.get('registration_error')})"
        print(f"  {agent['name']:<16} {agent['id']}  {agent['plugin']:<12} {agent['state']:<8} {reg}  vouch until {_when(agent.get('vouch_expires_at'))}")
        if agent.get("in_flight") or agent.get("spawned_tasks"):
            # Work in progress per agent (#23): requests in its handlers, tasks they left running.
            print(f"    load      {agent.get('in_flight', 0)} of {agent.get('max_concurrency', '?')} requests in "
                  f"handlers, {agent.get('spawned_tasks', 0)} spawned tasks running")
        for sub in agent.get("subscriptions") or []:
            # Interest retention (§18.3): a durable subscription's history starts at its consumer.
            kept = f"durable, capturing since {sub.get('capturing_since')}" if sub.get("durable") else "live only"
            print(f"    {sub['kind']:<9} {sub['subject']}  ({kept})")
    process = status.get("process")
    if process:
        rss, peak = process.get("rss_bytes"), process.get("max_rss_bytes")
        memory = f"RSS {rss / 2**20:.1f} MiB" if isinstance(rss, int) else "RSS unknown"
        if isinstance(peak, int):
            memory += f" (peak {peak / 2**20:.1f} MiB)"
        tasks = process.get("asyncio_tasks")  # null in the brief form (counting walks every task)
        counted = "" if tasks is None else f"{tasks} asyncio tasks, "
        print(f"process   {memory}, {counted}{process.get('threads')} threads"
              " (memory is the whole process's: it cannot be split by agent)")
    loop = status.get("loop")
    if loop and loop.get("blocks"):
        # A handler blocked the event loop (#23): name who, so the plugin can be fixed.
        who = ", ".join(f"{agent} {n}x" for agent, n in sorted(loop["blocks"].items()))
        print(f"loop      BLOCKED by handlers: {who}; worst stall {loop.get('max_lag_s')} s")
    obs = status.get("observability")
    if obs:
        on = ", ".join(k for k in ("spans", "logs", "metrics") if obs.get(k)) or "nothing"
        published = ", ".join(f"{k} {v}" for k, v in obs.get("published", {}).items())
        print(f"observability  publishing {on}: {published}; dropped {obs.get('dropped', 0)}")
    a2a = status.get("a2a")
    if a2a:
        print(f"a2a       {a2a['url']}  exposing {', '.join(a2a['expose']) or 'nothing'} as {a2a['application']!r}")
        print(f"          run reports signed by {a2a['report_key']}")


def _toml_tables(path: Path | None) -> set[str]:
    """The top-level tables of the TOML file at ``path`` (empty when it does not parse)."""
    if path is None:
        return set()
    try:
        with open(path, "rb") as handle:
            return set(tomllib.load(handle))
    except (OSError, tomllib.TOMLDecodeError):
        return set()


def _next_step(agent: str, error: dict[str, Any]) -> str | None:
    """What a caller can do about a refusal that says how to get past it (§19.3, §19.5)."""
    raw = error.get("details")
    details: dict[str, Any] = raw if isinstance(raw, dict) else {}
    if error.get("code") == "AGREEMENT_REQUIRED" and details.get("sku"):
        agree = f"agree as this node's owner: meshnode agreements sign {agent} --sku {details['sku']}"
        if details.get("approval_url"):
            return f"  approve its terms at {details['approval_url']}, or {agree}"
        return f"  {agree}"
    estimate = details.get("estimate")
    if error.get("code") == "BUDGET_INSUFFICIENT" and isinstance(estimate, dict):
        return (f"  the responder estimates {estimate.get('amount_micro')} micro-{estimate.get('currency')}: "
                "send a budget whose cost_ceiling covers it")
    return None


def _store_line(storage: dict[str, Any]) -> str:
    """The mesh's JetStream store in one line: use, reservations, limit, headroom."""
    if storage.get("state") == "unknown":
        return f"unknown ({storage.get('error') or 'not read yet'})"
    limit = storage.get("limit_bytes", -1)
    # Measured figures, in human units (format_size spells a configured size: "293366B").
    text = (f"{storage['state']}: {human_size(storage['used_bytes'])} stored, "
            f"{human_size(storage['reserved_bytes'])} reserved")
    if limit is not None and limit >= 0:
        text += f" of {human_size(limit)}, {human_size(storage.get('headroom_bytes') or 0)} headroom"
    else:
        text += " (the account has no storage limit)"
    return text


def _when(epoch_s: Any) -> str:
    return human_time(epoch_s)


def cmd_call(args: argparse.Namespace) -> int:
    if args.text is not None and args.input is not None:
        print("meshnode: give either INPUT or --text, not both", file=sys.stderr)
        return EX_USAGE
    payload_input: Any = None
    # "-": from stdin, for what a command line cannot carry (the kernel caps one
    # argument at 128 KiB: "Argument list too long") or should not show (ps).
    if args.text is not None:
        payload_input = {"text": sys.stdin.read() if args.text == "-" else args.text}
    elif args.input is not None:
        source = "stdin" if args.input == "-" else "INPUT"
        try:
            payload_input = json.loads(sys.stdin.read() if args.input == "-" else args.input)
        except json.JSONDecodeError as exc:
            print(f"meshnode: {source} is not JSON ({exc}); use --text for plain text", file=sys.stderr)
            return EX_DATAERR
    params: dict[str, Any] = {"agent": args.agent, "offering": args.offering, "timeout": args.timeout}
    if args.stream:
        params["config"] = {"stream": True}
    if args.no_wait:
        params["wait_task"] = False
    if payload_input is not None:
        params["input"] = payload_input
    if args.task_id:
        params["task_id"] = args.task_id
    if args.context_id:
        params["context_id"] = args.context_id
    follow = args.stream or (not args.no_wait and sys.stderr.isatty() and not args.json)
    # An A2A peer's task is not on MESH_TASKS: the daemon waits for it (one Call).
    follow = follow and not args.agent.startswith("a2a:")
    if follow and not args.task_id:
        # Open the task, then follow it: chunks and progress as they arrive
        # (one Call waits for the end and answers everything at once).
        params["wait_task"] = False
    # The daemon answers a request within --timeout (plus its look-ups), but
    # follows a task it waits for as long as it keeps reporting: the admin call
    # must not give up first (at its own 30 s it cut every longer call short).
    waits_for_task = bool(params.get("wait_task", True))
    code, result = _admin(args, "Call", params, timeout=None if waits_for_task else args.timeout + 15)
    if code != EX_OK:
        return code
    streamed = False
    if (
        follow and not args.no_wait and result.get("task_id") and result.get("status") not in _ENDED
        and not args.task_id
    ):
        code, followed, streamed = _follow_task(args, result)
        if code != EX_OK:
            return code
        result = {**result, **followed}
    if args.no_wait and result.get("task_id") and result.get("status") not in _ENDED:
        # The id is what a caller that does not wait needs (tasks show/cancel ID).
        if args.json:
            emit_json(result)
        else:
            print(result["task_id"])
        return EX_OK
    if args.json:
        if args.stream:
            emit_json_line({"kind": "result", **result})
        else:
            print(json.dumps(result, indent=2, ensure_ascii=False))
    elif result.get("status") == "queued":
        print(f"queued: the agent's node holds it for a person (inbox {result.get('inbox_id')}); "
              "the answer will arrive in this node's inbox (meshnode inbox list)")
    elif result.get("status") == "failed":
        error = result.get("error") or {}
        print(f"failed: {error.get('code')}: {error.get('message')}", file=sys.stderr)
        hint = _next_step(args.agent, error)
        if hint:
            print(hint, file=sys.stderr)
    elif result.get("status") in ("input_required", "auth_required"):
        # Paused for the caller (§6.5): say what is asked and how to answer.
        print(f"{result['status']}: task {result.get('task_id')}"
              + (f": {result['message']}" if result.get("message") else ""))
        for problem in result.get("problems") or []:
            if isinstance(problem, dict):
                print(f"  {problem.get('input')}: {problem.get('problem')}: {problem.get('description')}")
        print(f"answer with: meshnode call {args.agent} {args.offering} INPUT --task-id {result.get('task_id')}"
              + (f" --context-id {result['context_id']}" if result.get("context_id") else ""))
    elif streamed:
        print()  # the chunks were the output; end their line
    else:
        output = result.get("output")
        text = output["text"] if (isinstance(output, dict) and set(output) <= {"text", "truncated"}) else output
        if isinstance(text, str):
            # Text as text (a streamed handler's joined words printed as "\"a b c \""); --json keeps JSON.
            print(text, end="" if text.endswith("\n") else "\n")
        else:
            print(json.dumps(output, indent=2, ensure_ascii=False))
    return EX_CHECK_FAILED if result.get("status") == "failed" else EX_OK


#: Call statuses after which there is nothing to follow.
_ENDED = frozenset({"completed", "failed", "canceled", "rejected", "exhausted", "queued",
                    "input_required", "auth_required"})


def _follow_task(args: argparse.Namespace, opened: dict[str, Any]) -> tuple[int, dict[str, Any], bool]:
    """Follow the task ``opened`` (``Tasks.Follow``): chunks to stdout as they
    arrive, progress to stderr on a terminal. Returns (exit code, the task's
    result, whether any chunk was printed)."""
    socket = _socket(args)
    if socket is None:
        return EX_CONFIG, {}, False
    progress = _LiveProgress(enabled=sys.stderr.isatty() and not args.json)
    state: dict[str, Any] = {"result": {}, "chunks": 0}

    async def follow() -> None:
        async with AdminClient(socket, timeout=args.timeout + 10) as client:
            params = {"task_id": opened["task_id"], "responder": opened.get("from"),
                      "stream": bool(args.stream), "timeout": args.timeout}
            async for item in client.stream("Tasks.Follow", params):
                kind = item.get("kind")
                if kind == "result":
                    state["result"] = {k: v for k, v in item.items() if k != "kind"}
                elif args.json:
                    emit_json_line(item)
                elif kind == "chunk":
                    progress.clear()
                    data = item.get("data")
                    sys.stdout.write(data if isinstance(data, str) else json.dumps(data, ensure_ascii=False) + "\n")
                    sys.stdout.flush()
                    state["chunks"] += 1
                elif kind == "update":
                    progress.show(f"task {opened['task_id']} {item.get('state')}"
                                  + (f": {item['message']}" if item.get("message") else ""))
        progress.clear()

    try:
        asyncio.run(follow())
    except KeyboardInterrupt:
        progress.clear()
        print(f"\nmeshnode: stopped following; task {opened['task_id']} goes on "
              f"(meshnode tasks show {opened['task_id']}, meshnode tasks cancel {opened['task_id']})",
              file=sys.stderr)
        return EX_INTERRUPTED, {}, False
    except (AdminClientError, AdminError) as exc:
        progress.clear()
        print(admin_failure(args, exc), file=sys.stderr)
        return exit_code_for(exc), {}, False
    return EX_OK, state["result"], state["chunks"] > 0


class _LiveProgress:
    """One status line on stderr, redrawn in place (only on a terminal)."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._shown = False

    def show(self, line: str) -> None:
        if self.enabled:
            print(f"\r\x1b[2K{line}", end="", file=sys.stderr, flush=True)
            self._shown = True

    def clear(self) -> None:
        if self.enabled and self._shown:
            print("\r\x1b[2K", end="", file=sys.stderr, flush=True)
            self._shown = False
