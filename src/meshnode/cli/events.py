"""``meshnode pub`` and ``meshnode sub``: events and feeds from a terminal, like
``nats pub``/``nats sub``, as this node's CLI identity (signed by its key, §6.6).

  meshnode pub DOMAIN EVENT [JSON]       emit mesh.event.DOMAIN.EVENT
  meshnode sub PATTERN [--count N]       print each event on mesh.event.PATTERN as it arrives
  meshnode sub --feed OWNER [TOPIC]      print each entry of an agent's feed (all its topics by default)

``sub`` runs until interrupted (exit 0) or ``--count`` events arrived; with
``--json`` each event is one JSON object on one line. It is live: events
published while it is not running are not replayed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from meshnode.admin.client import AdminClient, AdminClientError, exit_code_for
from meshnode.admin.protocol import AdminError

from .daemon import _admin, _client_args, _socket, admin_failure
from .exitcodes import EX_CONFIG, EX_DATAERR, EX_OK, EX_USAGE
from .output import emit_json, emit_json_line, human_time


def register(commands: Any) -> None:
    pub = commands.add_parser("pub", help="publish an event as this node's CLI identity")
    pub.add_argument("domain", help="the event domain, e.g. billing")
    pub.add_argument("event_type", metavar="EVENT", help="the event type, e.g. invoice_ready")
    pub.add_argument("data", nargs="?", metavar="JSON", help="the event data as JSON (default: none)")
    _client_args(pub)
    pub.set_defaults(handler=cmd_pub)

    sub = commands.add_parser("sub", help="print events (or a feed's entries) as they arrive")
    sub.add_argument("pattern", nargs="?", help="event pattern after mesh.event., e.g. 'billing.*' or '>'")
    sub.add_argument("--feed", nargs="+", metavar=("OWNER", "TOPIC"),
                     help="an agent's feed instead: OWNER (name on this node or id) and optionally TOPIC")
    sub.add_argument("--count", type=int, metavar="N", help="stop after N events")
    _client_args(sub)
    sub.set_defaults(handler=cmd_sub)


def cmd_pub(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"domain": args.domain, "event_type": args.event_type}
    if args.data is not None:
        try:
            params["data"] = json.loads(args.data)
        except json.JSONDecodeError as exc:
            print(f"meshnode: JSON is not JSON ({exc}); quote a string as '\"text\"'", file=sys.stderr)
            return EX_DATAERR
    code, result = _admin(args, "Events.Publish", params)
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
    else:
        print(f"published on {result['subject']} as {result['from']}")
    return EX_OK


def _feed_owner(args: argparse.Namespace, owner: str) -> str | None:
    """A local agent name becomes its id; an id passes as given."""
    if owner.startswith("U") and len(owner) == 56:
        return owner
    code, result = _admin(args, "Agents.List", listing=True)
    if code != EX_OK:
        return None
    for agent in result["agents"]:
        if agent.get("name") == owner and agent.get("id"):
            return str(agent["id"])
    print(f"meshnode: {owner!r} is neither an agent of this node nor an agent id (U...)", file=sys.stderr)
    return None


def cmd_sub(args: argparse.Namespace) -> int:
    if (args.pattern is None) == (args.feed is None):
        print("meshnode: give a PATTERN or --feed OWNER [TOPIC]", file=sys.stderr)
        return EX_USAGE
    if args.feed is not None and len(args.feed) > 2:
        print("meshnode: --feed takes OWNER and at most one TOPIC", file=sys.stderr)
        return EX_USAGE
    if args.count is not None and args.count < 1:
        print("meshnode: --count wants a positive number", file=sys.stderr)
        return EX_USAGE
    socket = _socket(args)
    if socket is None:
        return EX_CONFIG
    params: dict[str, Any]
    if args.feed is not None:
        owner = _feed_owner(args, args.feed[0])
        if owner is None:
            return EX_DATAERR
        params = {"owner": owner, "topic": args.feed[1] if len(args.feed) > 1 else "*"}
    else:
        params = {"pattern": args.pattern}

    async def follow() -> None:
        seen = 0
        async with AdminClient(socket, timeout=30.0) as client:
            async for item in client.stream("Events.Subscribe", params):
                if item.get("kind") == "subscribed":
                    # On stderr, so stdout stays the events alone.
                    print(f"listening on {item['subject']} (Ctrl-C to stop)", file=sys.stderr, flush=True)
                    continue
                if args.json:
                    emit_json_line(item)
                else:
                    what = item.get("topic") or f"{item.get('domain')}.{item.get('event_type')}"
                    data = json.dumps(item.get("data"), ensure_ascii=False)
                    print(f"{human_time(item.get('ts'))}  {what}  from {item.get('from')}  {data}", flush=True)
                seen += 1
                if args.count is not None and seen >= args.count:
                    return  # leaving the stream closes the subscription

    try:
        asyncio.run(follow())
    except KeyboardInterrupt:
        return EX_OK
    except (AdminClientError, AdminError) as exc:
        print(admin_failure(args, exc), file=sys.stderr)
        return exit_code_for(exc)
    return EX_OK
