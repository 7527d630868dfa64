"""``meshnode a2a``: the A2A bridge. ``charges``: what calls to external A2A agents cost."""

from __future__ import annotations

import argparse
from typing import Any

from .daemon import _admin, _client_args
from .exitcodes import EX_OK
from .output import emit_json


def register(commands: Any) -> None:
    a2a = commands.add_parser("a2a", help="the A2A bridge (external A2A agents)")
    sub = a2a.add_subparsers(dest="a2a_command", metavar="ACTION", required=True)
    charges = sub.add_parser("charges", help="charges recorded for calls to external A2A agents")
    charges.add_argument("--peer", help="only this peer ([a2a.peers.<name>])")
    charges.add_argument("--limit", type=int, default=200)
    _client_args(charges)
    charges.set_defaults(handler=cmd_charges)


def cmd_charges(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"limit": args.limit}
    if args.peer:
        params["peer"] = args.peer
    code, result = _admin(args, "A2A.Charges", params)
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
        return EX_OK
    if not result["charges"]:
        print("no A2A charges recorded")
    for c in result["charges"]:
        spend = f" (reported {c['reported_spend']})" if c.get("reported_spend") else ""
        print(f"{c['peer']:<14} {c['task_key']:<44} {c['charged']:>10} {c['currency']}  "
              f"report {c['report']}{spend}  mesh {'yes' if c['mesh'] else 'no'}")
    for peer, total in sorted(result["totals"].items()):
        print(f"total {peer}: {total['total']} USD over {total['count']} call(s)")
    return EX_OK
