"""``meshnode inbox``: held messages (interactive agents, late answers), by a person."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .daemon import _admin, _client_args
from .exitcodes import EX_DATAERR, EX_OK
from .output import emit_json


def register(commands: Any) -> None:
    inbox = commands.add_parser("inbox", help="messages the node holds for a person")
    sub = inbox.add_subparsers(dest="inbox_command", metavar="ACTION", required=True)

    lst = sub.add_parser("list", help="held and interrupted messages (--all for every state)")
    lst.add_argument("--agent", help="only this agent (local name or id)")
    lst.add_argument("--all", action="store_true", help="every state, newest first")
    lst.add_argument("--limit", type=int, default=100)
    _client_args(lst)
    lst.set_defaults(handler=cmd_list)

    show = sub.add_parser("show", help="one message in full (the sender text stays framed)")
    show.add_argument("id", type=int)
    _client_args(show)
    show.set_defaults(handler=cmd_show)

    reply = sub.add_parser("reply", help="answer a held request as its agent")
    reply.add_argument("id", type=int)
    group = reply.add_mutually_exclusive_group(required=True)
    group.add_argument("--text", help="answer with {\"text\": TEXT}")
    group.add_argument("--output", help="answer with this JSON output")
    group.add_argument("--decline", metavar="MESSAGE", help="answer failed (UNAUTHORIZED) with MESSAGE")
    _client_args(reply)
    reply.set_defaults(handler=cmd_reply)

    ack = sub.add_parser("ack", help="dismiss a held message without answering")
    ack.add_argument("id", type=int)
    _client_args(ack)
    ack.set_defaults(handler=cmd_ack)


def cmd_list(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"limit": args.limit, "all": args.all}
    if args.agent:
        params["agent"] = args.agent
    code, result = _admin(args, "Inbox.List", params)
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
        return EX_OK
    if not result["messages"]:
        print("no held messages")
    for m in result["messages"]:
        what = m.get("offering") or m.get("status") or ""
        print(f"#{m['id']:<6} {m['state']:<11} {m['agent']:<14} {m['kind']:<8} {what:<12} from {m['sender']}  {m['age_s']}s ago")
        if m.get("text"):
            for line in str(m["text"]).splitlines():
                print(f"        {line}")
        elif m.get("output") is not None:
            print(f"        output: {json.dumps(m['output'], ensure_ascii=False)}")
    return EX_OK


def cmd_show(args: argparse.Namespace) -> int:
    code, result = _admin(args, "Inbox.Show", {"id": args.id})
    if code == EX_OK:
        # JSON with or without --json: the message in full, the sender's text
        # inside its frame exactly as the daemon gave it (scripts parse this).
        emit_json(result)
    return code


def cmd_reply(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"id": args.id}
    if args.text is not None:
        params["text"] = args.text
    elif args.output is not None:
        try:
            params["output"] = json.loads(args.output)
        except json.JSONDecodeError as exc:
            print(f"meshnode: --output is not JSON ({exc})", file=sys.stderr)
            return EX_DATAERR
    else:
        params.update(status="failed", code="UNAUTHORIZED", message=args.decline)
    code, result = _admin(args, "Inbox.Reply", params)
    if code == EX_OK:
        print(json.dumps(result) if args.json else f"replied to #{args.id} ({result['to']})")
    return code


def cmd_ack(args: argparse.Namespace) -> int:
    code, result = _admin(args, "Inbox.Ack", {"id": args.id})
    if code == EX_OK:
        print(json.dumps(result) if args.json else f"dismissed #{args.id}")
    return code
