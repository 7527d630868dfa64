"""``meshnode mesh info|invite`` on the embedded-mesh node, and ``meshnode join``
to set up a second node from an invite file."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from meshnode.config import ConfigError, load_config
from meshnode.config.values import parse_duration

from .daemon import _admin, _client_args
from .exitcodes import EX_CANTCREAT, EX_CONFIG, EX_DATAERR, EX_NOINPUT, EX_OK, EX_TEMPFAIL, EX_USAGE
from .output import emit_json, human_time


def register(commands: Any) -> None:
    mesh = commands.add_parser("mesh", help="the mesh this node runs or joined")
    sub = mesh.add_subparsers(dest="mesh_command", metavar="ACTION", required=True)

    info = sub.add_parser("info", help="NATS URL(s) and control-plane URL")
    _client_args(info)
    info.set_defaults(handler=cmd_info)

    nodes = sub.add_parser("nodes", help="the nodes this mesh's control plane enrolled: tier, retired, credential expiry")
    _client_args(nodes)
    nodes.set_defaults(handler=cmd_nodes)

    invite = sub.add_parser("invite", help="enrol a new node and write its invite (a NATS creds file)")
    invite.add_argument("name", help="a name for the new node")
    invite.add_argument("--out", required=True, help="where to write the invite file (created 0600)")
    invite.add_argument(
        "--trust-tier", choices=("standard", "verified", "sandbox"), default="standard",
        help="the operator's attestation of the new host (§9.7); sandbox clamps its agents "
        "(never listed in discovery, no offline buffer)",
    )
    invite.add_argument(
        "--tenant", default="mesh",
        help="the tenant (NATS account, §15) the node joins: one of [mesh.embedded] tenants, "
        "or mesh (the default, the mesh's own account); its agents are found and reached "
        "only within it unless an export says otherwise",
    )
    _client_args(invite)
    invite.set_defaults(handler=cmd_invite)

    token = sub.add_parser(
        "token", help="mint a single-use am_... token that enrols one AgentMesh SDK agent (POST /v1/bootstrap)"
    )
    token.add_argument("name", help="a name for the SDK agent's enrolment (shown by `mesh nodes`)")
    token.add_argument(
        "--ttl", default="7d", help="how long the token can be exchanged, e.g. 1h, 7d (default 7d)"
    )
    token.add_argument(
        "--trust-tier", choices=("standard", "verified", "sandbox"), default="standard",
        help="the operator's attestation of the agent's host (§9.7), as for `mesh invite`",
    )
    token.add_argument(
        "--tenant", default="mesh", help="the tenant (NATS account, §15) the agent joins, as for `mesh invite`"
    )
    _client_args(token)
    token.set_defaults(handler=cmd_token)

    retire = sub.add_parser("retire", help="refuse a node's (or an agent's) next credential: revocation by refusal")
    who = retire.add_mutually_exclusive_group(required=True)
    who.add_argument("--token", help="the name of a pending SDK enrolment token to revoke")
    who.add_argument("--node", help="the node to retire: its id (U...), or the name it was invited under")
    who.add_argument("--agent", help="the agent id (U...) to retire")
    _client_args(retire)
    retire.set_defaults(handler=cmd_retire)

    join = commands.add_parser("join", help="set up this machine as a node of the mesh in an invite file")
    join.add_argument("invite", help="the invite file from `meshnode mesh invite`")
    join.add_argument("--data-dir", required=True, help="data directory for the new node (created 0700)")
    join.add_argument("--config-out", help="where to write its configuration (default DATA_DIR/meshnode.toml)")
    join.add_argument(
        "--agent",
        action="append",
        default=[],
        metavar="NAME[=PLUGIN]",
        help="host an agent (repeatable); PLUGIN defaults to NAME",
    )
    join.add_argument(
        "--ca-file",
        help="PEM CA bundle that verifies the mesh's TLS certificate (tls:// and https:// URLs); "
        "written as [mesh] ca_file",
    )
    join.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="URL",
        help="a NATS URL of the mesh (repeatable): for a plain .creds file from a mesh meshnode "
        "did not build, which names none; overrides the invite's URLs",
    )
    join.add_argument(
        "--force", action="store_true",
        help="replace an existing configuration that differs (the old one is kept as FILE.bak)",
    )
    join.add_argument("--json", action="store_true")
    join.set_defaults(handler=cmd_join)


def cmd_info(args: argparse.Namespace) -> int:
    code, info = _admin(args, "Mesh.Info")
    if code != EX_OK:
        return code
    if args.json:
        emit_json(info)
    else:
        print(f"mesh           {info['name']} ({info['mode']})")
        print(f"nats           {', '.join(info['nats_urls'])}")
        print(f"control plane  {info.get('control_plane') or '-'}")
        if info.get("websocket_url"):
            print(f"websocket      {info['websocket_url']}")
        prefixes = info.get("inbox_prefixes") or {}
        if prefixes:
            print("reply prefix   " + ", ".join(f"{k}: {v}" for k, v in prefixes.items()))
        tenants = info.get("tenants") or []
        if len(tenants) > 1:
            print(f"tenants        {tenants[0]} (own), {', '.join(tenants[1:])}")
        for export in info.get("exports") or []:
            opened = [f"{len(export['agents'])} agent inbox(es)"] if export["agents"] else []
            opened += ["discovery"] if export["discover"] else []
            print(f"export         {export['from']} -> {export['to']}: {' and '.join(opened)}")
            for agent in export["agents"]:
                print(f"                 {agent}")
    return EX_OK


def cmd_token(args: argparse.Namespace) -> int:
    try:
        ttl_s = int(parse_duration(args.ttl).total_seconds())
    except ValueError as exc:
        print(f"meshnode: --ttl {args.ttl!r}: {exc}", file=sys.stderr)
        return EX_USAGE
    code, result = _admin(
        args, "Mesh.Token",
        {"name": args.name, "ttl_s": ttl_s, "trust_tier": args.trust_tier, "tenant": args.tenant},
    )
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
    else:
        print(result["token"])
        print(
            f"single-use enrolment token for SDK agent {result['name']} (tier {result['trust_tier']}, "
            f"tenant {result['tenant']}), expires {_when(result['expires_at'])}; shown once, hand it over "
            f"privately. The agent exchanges it at {result.get('control_plane') or '-'}/v1/bootstrap",
            file=sys.stderr,
        )
        _print_notes(result)
    return EX_OK


def cmd_invite(args: argparse.Namespace) -> int:
    # Imported per command: the control plane pulls in NATS, which no other
    # command needs before it runs (CLI start-up time).
    from meshnode.control_plane import InviteBundle, write_invite

    # Checked before inviting: an invite whose file cannot be written enrols a
    # node key nobody holds, and its name is taken until it is retired.
    unwritable = _unwritable_invite_path(Path(args.out))
    if unwritable is not None:
        print(f"meshnode: {unwritable}; nothing was invited", file=sys.stderr)
        return EX_CANTCREAT
    code, result = _admin(
        args, "Mesh.Invite", {"name": args.name, "trust_tier": args.trust_tier, "tenant": args.tenant}
    )
    if code != EX_OK:
        return code
    bundle = InviteBundle(result["name"], result["node_seed"], result["jwt"])
    try:
        write_invite(args.out, bundle, result["nats_urls"], result.get("control_plane"))
    except OSError as exc:
        # Lost a race with another writer, or the disk: undo the invite.
        why = "it exists (not overwriting an invite)" if isinstance(exc, FileExistsError) else exc.strerror
        undo, _ = _admin(args, "Mesh.Retire", {"node_id": result["node_id"]})
        undone = (
            f"the invite of {result['name']} was withdrawn (retired)" if undo == EX_OK else
            f"retire the invite with meshnode mesh retire --node {result['node_id']} before inviting {result['name']} again"
        )
        print(f"meshnode: cannot write {args.out}: {why}; {undone}", file=sys.stderr)
        return EX_CANTCREAT
    if args.json:
        print(json.dumps({
            "name": result["name"], "node_id": result["node_id"],
            "trust_tier": result.get("trust_tier", args.trust_tier),
            "tenant": result.get("tenant", args.tenant), "file": args.out,
            "notes": result.get("notes", []),
        }))
    else:
        print(
            f"invited node {result['name']} ({result['node_id']}), trust tier {args.trust_tier}, "
            f"tenant {result.get('tenant', args.tenant)}"
        )
        print(f"wrote {args.out} (0600) - it holds the node's secret key; hand it over privately")
        print(f"on the new node: meshnode join {args.out} --data-dir DIR")
        _print_notes(result)
    return EX_OK


def _unwritable_invite_path(path: Path) -> str | None:
    """Why an invite cannot be written at ``path`` (None when it can, as far as
    can be told before writing)."""
    if path.exists() or path.is_symlink():
        return f"{path} exists; not overwriting an invite (remove it, or pick another --out)"
    parent = path.parent
    if not parent.is_dir():
        return f"cannot write {path}: the directory {parent} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot write {path}: the directory {parent} is not writable"
    return None


def _print_notes(result: dict[str, Any]) -> None:
    """The hub's caveats on who can use what it handed out (Mesh.Invite/Token)."""
    for note in result.get("notes", []):
        print(f"note: {note}", file=sys.stderr)


def _when(epoch_s: int | None) -> str:
    return human_time(epoch_s)


def cmd_nodes(args: argparse.Namespace) -> int:
    code, result = _admin(args, "Mesh.Nodes", {})
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result, indent=None)
        return EX_OK
    if not result["nodes"] and not any(t["state"] == "pending" for t in result.get("tokens", [])):
        print("no node has joined this mesh, and no invitation is pending (this node is its hub: "
              "`meshnode mesh invite NAME` makes an invitation)")
        return EX_OK
    print(f"{'NAME':<20} {'PROFILE':<7} {'TIER':<9} {'TENANT':<12} {'STATE':<8} {'CREDENTIAL EXPIRES':<21} NODE")
    for n in result["nodes"]:
        state = n.get("state") or ("retired" if n["retired_at"] is not None else "active")
        agent = f" (agent {n['agent_id']})" if n.get("agent_id") else ""
        if state in ("invited", "expired"):
            agent += f" (invite {'expired' if state == 'expired' else 'valid until'} {_when(n['invite_expires_at'])})"
        print(
            f"{n['name']:<20} {n.get('profile', 'node'):<7} {n['trust_tier']:<9} {n.get('tenant', 'mesh'):<12} "
            f"{state:<8} {_when(n['credential_expires_at']):<21} {n['node_id']}{agent}"
        )
    pending = [t for t in result.get("tokens", []) if t["state"] == "pending"]
    for t in pending:
        print(
            f"{t['name']:<20} {'sdk':<7} {t['trust_tier']:<9} {t['tenant']:<12} {'token':<8} "
            f"{'-':<21} (token unused, expires {_when(t['expires_at'])})"
        )
    return EX_OK


def cmd_retire(args: argparse.Namespace) -> int:
    params = (
        {"token": args.token} if args.token
        else {"node_id": args.node} if args.node else {"agent_id": args.agent}
    )
    code, result = _admin(args, "Mesh.Retire", params)
    if code != EX_OK:
        return code
    print(json.dumps(result) if args.json else f"retired {result['retired']}: {result['message']}")
    return EX_OK


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def cmd_join(args: argparse.Namespace) -> int:
    from meshnode.control_plane import InviteError, read_invite
    from meshnode.keystore import FileKeyStore, KeyStoreError

    try:
        invite = read_invite(args.invite)
    except FileNotFoundError:
        print(f"meshnode: no invite file at {args.invite}", file=sys.stderr)
        return EX_NOINPUT
    except (InviteError, OSError) as exc:
        print(f"meshnode: {args.invite} is not a usable invite: {exc}", file=sys.stderr)
        return EX_DATAERR
    servers = list(args.server) or list(invite.nats_urls or ())
    if not servers:
        print(
            f"meshnode: {args.invite} names no NATS URL (a plain creds file); give the mesh's with --server URL",
            file=sys.stderr,
        )
        return EX_DATAERR
    # Looked at first so that a plain join does not import nats-py (~0.4 s).
    if any(u.lower().startswith(("ws://", "wss://")) for u in servers):
        from meshnode.transport.connection import WEBSOCKET_EXTRA, websocket_unsupported

        if websocket_unsupported(servers):
            # Written all the same: the node can be set up before the extra is installed.
            print(f"meshnode: warning: ws:// and wss:// servers need nats-py's WebSocket transport, "
                  f"which needs aiohttp: {WEBSOCKET_EXTRA} before starting this node", file=sys.stderr)
    ca_file = Path(args.ca_file).expanduser().absolute() if args.ca_file else None
    if ca_file is not None and not ca_file.is_file():
        print(f"meshnode: --ca-file {ca_file}: no such file", file=sys.stderr)
        return EX_NOINPUT
    data_dir = Path(args.data_dir).expanduser().absolute()
    agents: list[tuple[str, str]] = []
    for spec in args.agent:
        name, _, plugin = spec.partition("=")
        agents.append((name, plugin or name))
    name = invite.name or data_dir.name
    lines = [
        "# Written by `meshnode join`: this node joins the mesh named in its invite.",
        "[node]",
        f"name = {_toml_str(name)}",
        f"data_dir = {_toml_str(str(data_dir))}",
        "",
        "[mesh]",
        f"servers = [{', '.join(_toml_str(u) for u in servers)}]",
    ]
    if invite.control_plane_url:
        lines.append(f"control_plane = {_toml_str(invite.control_plane_url)}")
    if ca_file is not None:
        lines.append(f"ca_file = {_toml_str(str(ca_file))}")
    lines += [
        "",
        "[admin]",
        f"socket = {_toml_str(str(data_dir / 'admin.sock'))}",
        "",
        "[keystore]",
        'backend = "file"  # the invite\'s node key was imported into DATA_DIR/keys',
    ]
    for agent_name, plugin in agents:
        lines += ["", f"[agents.{agent_name}]", f"plugin = {_toml_str(plugin)}"]
    config_path = Path(args.config_out) if args.config_out else data_dir / "meshnode.toml"
    text = "\n".join(lines) + "\n"
    from meshnode.daemon.credentials import store_credential
    from meshnode.daemon.datalock import DataDirBusy, DataDirLock

    # Decided before anything is written: a refused join leaves key, credential
    # and configuration as they were. First whether a daemon runs there (its
    # node key and credential would be replaced under it), then whose key the
    # directory holds, then the configuration file.
    lock: DataDirLock | None = None
    try:
        if data_dir.is_dir():
            lock = DataDirLock.acquire(data_dir, hint="join into another --data-dir")
        other = _other_node_key(data_dir, invite.node_key.public_key)
        if other is not None:
            # A data dir is one node: its key is its identity, never replaced (not even --force).
            print(
                f"meshnode: {data_dir} already holds another node's key ({other}); a data directory is "
                "one node. Join into a fresh --data-dir (or remove this one if that node is gone for "
                "good; its key cannot be recovered)", file=sys.stderr,
            )
            return EX_CANTCREAT
        backup = _existing_config(config_path, text, force=args.force)
        if isinstance(backup, int):
            return backup
        if lock is None:
            data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            lock = DataDirLock.acquire(data_dir, hint="join into another --data-dir")
        os.chmod(data_dir, 0o700)
        FileKeyStore(data_dir).import_key("node", invite.node_key)
        store_credential(data_dir, invite.jwt, [])
    except DataDirBusy as exc:
        print(f"meshnode: {exc}", file=sys.stderr)
        return EX_TEMPFAIL
    except KeyStoreError as exc:
        print(f"meshnode: {exc}", file=sys.stderr)
        return EX_CANTCREAT
    finally:
        if lock is not None:
            lock.release()
    if backup is not None:
        os.replace(config_path, backup)
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(text, encoding="utf-8")
    try:
        load_config(config_path)
    except ConfigError as exc:
        print(f"meshnode: the written configuration does not validate:\n{exc}", file=sys.stderr)
        return EX_CONFIG
    if args.json:
        print(json.dumps({
            "node_id": invite.node_id, "config": str(config_path), "data_dir": str(data_dir),
            "backup": str(backup) if backup is not None else None,
        }))
    else:
        print(f"joined as node {name} ({invite.node_id})")
        print(f"configuration: {config_path}")
        if backup is not None:
            print(f"the previous configuration is kept as {backup}")
        print(f"start it with: meshnode run --config {config_path}")
    return EX_OK


def _other_node_key(data_dir: Path, joining: str) -> str | None:
    """The public key of a node key ``data_dir`` holds other than ``joining``'s."""
    from meshnode.keystore import FileKeyStore, KeyStoreError

    if not (data_dir / "keys").is_dir():
        return None
    try:
        held = FileKeyStore(data_dir).get("node")
    except KeyStoreError:
        return None  # unreadable: import_key says why
    return held.public_key if held is not None and held.public_key != joining else None


def _existing_config(path: Path, text: str, *, force: bool) -> Path | int | None:
    """What to do about a configuration already at ``path``.

    None: nothing there (or the very text join would write), so just write.
    A path: ``--force`` was given, move the old file there first. An exit code:
    refused, because the file differs from what join writes, i.e. someone
    edited it (or it belongs to another node), and silently replacing it would
    lose that work.
    """
    try:
        current = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        print(f"meshnode: cannot read the existing configuration {path}: {exc.strerror}", file=sys.stderr)
        return EX_CANTCREAT
    if current == text:
        return None
    if not force:
        print(
            f"meshnode: {path} exists and differs from the configuration join writes (edited?); "
            "not overwriting it. Re-run with --force to replace it (the old file is kept as "
            f"{path.name}.bak), or --config-out to write elsewhere",
            file=sys.stderr,
        )
        return EX_CANTCREAT
    backup = path.with_name(path.name + ".bak")
    n = 1
    while backup.exists():
        backup = path.with_name(f"{path.name}.bak.{n}")
        n += 1
    return backup
