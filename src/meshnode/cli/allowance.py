"""``meshnode allowance``: the owner's spending allowance of a hosted agent (EXT-8).

  meshnode allowance set AGENT --per-task N --per-day N --cost-model 1500:USD [--on-exhaustion ask_owner]
  meshnode allowance add FILE
  meshnode allowance show [AGENT]
  meshnode allowance clear AGENT
  meshnode allowance decline AGENT [--task TASK]

Amounts are integer micro-units (1 000 000 = one currency unit). The document
is signed by the daemon with this node's key (the owner of its agents); the
CLI never reads a key. ``add`` installs a document signed elsewhere (by
another owner key): the file is read here and sent to the daemon, which
verifies it and refuses it naming the member or the reason.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from .daemon import _admin, _client_args
from .exitcodes import EX_OK
from .output import emit_json, read_json_document

_COST_MODEL = re.compile(r"(\d+)(?::([A-Z]{3}))?")


def _cost_model(text: str) -> dict[str, Any]:
    match = _COST_MODEL.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r}: --cost-model is MICRO_PER_1K_TOKENS[:CURRENCY], e.g. 1500:USD (currency default USD)"
        )
    return {"per_1k_tokens_micro": int(match.group(1)), "currency": match.group(2) or "USD"}


def _micro(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: an amount is a non-negative integer of micro-units")
    return value


def register(commands: Any) -> None:
    allowance = commands.add_parser("allowance", help="the owner's spending allowance of a hosted agent (EXT-8)")
    sub = allowance.add_subparsers(dest="allowance_command", metavar="ACTION", required=True)
    set_ = sub.add_parser("set", help="sign (as this node's owner key) and enforce a new allowance for an agent")
    set_.add_argument("agent", help="the hosted agent (its name here, or its id)")
    set_.add_argument("--per-task", type=_micro, metavar="MICRO", help="ceiling on each Task's spend")
    set_.add_argument("--per-context", type=_micro, metavar="MICRO", help="ceiling on each context's spend")
    set_.add_argument("--per-day", type=_micro, metavar="MICRO", help="ceiling on each UTC day's spend")
    set_.add_argument("--cost-model", type=_cost_model, metavar="MICRO[:CUR]",
                      help="what 1000 tokens cost, in micro-units of CUR (default: the current document's)")
    set_.add_argument("--on-exhaustion", choices=["refuse", "ask_owner"],
                      help="refuse work over the allowance, or hold it for the owner (default: the current mode, "
                           "else refuse)")
    _client_args(set_)
    set_.set_defaults(handler=cmd_set)
    add = sub.add_parser("add", help="install an allowance document signed elsewhere (by another owner key)")
    add.add_argument("file", type=Path, help="the signed allowance document (JSON); it names its agent")
    _client_args(add)
    add.set_defaults(handler=cmd_add)
    show = sub.add_parser("show", help="the allowance, the spend so far and what remains, and held work")
    show.add_argument("agent", nargs="?", help="one hosted agent (default: all)")
    _client_args(show)
    show.set_defaults(handler=cmd_show)
    clear = sub.add_parser("clear", help="remove the allowance set with `allowance set`")
    clear.add_argument("agent", help="the hosted agent")
    _client_args(clear)
    clear.set_defaults(handler=cmd_clear)
    decline = sub.add_parser("decline", help="refuse work held for the owner (BUDGET_INSUFFICIENT)")
    decline.add_argument("agent", help="the hosted agent")
    decline.add_argument("--task", metavar="TASK_ID", help="only this held Task (default: all of the agent's)")
    _client_args(decline)
    decline.set_defaults(handler=cmd_decline)


def _print(a: dict[str, Any]) -> None:
    if not a.get("set"):
        print(f"{a['agent']}: no allowance")
        return
    state = "valid" if a.get("valid") else f"FAILS CLOSED: {a.get('error')}"
    print(f"{a['agent']} ({a['agent_id']}): {state}, on exhaustion {a.get('on_exhausted')}; from {a.get('source')}")
    for error in a.get("errors", []):
        print(f"  warning: {error}")
    doc = a.get("document")
    unit = "micro"  # every figure below is in micro-units of the cost model's currency
    if doc is not None:
        cm = doc["cost_model"]
        unit = f"micro-{cm['currency']}"
        print(f"  cost model: {cm['per_1k_tokens_micro']} {unit} per 1000 tokens")
    for c in a.get("ceilings", []):
        which = c.get("day") or c.get("task_id") or c.get("context_id") or "each (largest so far)"
        print(f"  {c['scope']:<8} {which:<28} {c['spent_micro']:>12} of {c['amount_micro']:>12} {unit} spent,"
              f" {c['remaining_micro']} remaining")
    spend = a["spend"]
    print(f"  spent today ({spend['day']}): {spend['today_micro']} {unit}")
    for h in a.get("held", []):
        print(f"  held: task {h['task_id']} ({h['stage']}, since {h['since']}): raise the allowance or "
              f"`meshnode allowance decline {a['agent']} --task {h['task_id']}`")


def cmd_set(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"agent": args.agent}
    for name in ("per_task", "per_context", "per_day", "cost_model"):
        value = getattr(args, name)
        if value is not None:
            params[name] = value
    if args.on_exhaustion is not None:
        params["on_exhausted"] = args.on_exhaustion
    code, result = _admin(args, "Allowance.Set", params)
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
        return EX_OK
    _print(result)
    return EX_OK


def cmd_add(args: argparse.Namespace) -> int:
    code, document = read_json_document(args.file, "allowance document", object_only=True)
    if code != EX_OK:
        return code
    code, result = _admin(args, "Allowance.Add", {"document": document})
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
        return EX_OK
    _print(result)
    return EX_OK


def cmd_show(args: argparse.Namespace) -> int:
    code, result = _admin(args, "Allowance.Show", {"agent": args.agent} if args.agent else {})
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
        return EX_OK
    if not result["allowances"]:
        print("no agents hosted")
    for a in result["allowances"]:
        _print(a)
    return EX_OK


def cmd_clear(args: argparse.Namespace) -> int:
    code, result = _admin(args, "Allowance.Clear", {"agent": args.agent})
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
        return EX_OK
    print(f"{args.agent}: " + ("allowance cleared" if result["cleared"] else "no stored allowance to clear"))
    if result["allowance"].get("set"):
        _print(result["allowance"])
    return EX_OK


def cmd_decline(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"agent": args.agent}
    if args.task:
        params["task_id"] = args.task
    code, result = _admin(args, "Allowance.Decline", params)
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
        return EX_OK
    print(f"declined {len(result['declined'])} held task(s)")
    return EX_OK
