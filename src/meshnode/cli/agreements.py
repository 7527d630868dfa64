"""``meshnode agreements``: sign, register, add, list and revoke §19.5 agreements (Economics extension).

``sign`` registers the agreement with the platform agreement service (so the
seller's node admits this owner's agents without anyone carrying a file) and
``revoke`` revokes there too; ``add`` is the local-store path for a seller on
a mesh without the service.

The signing key is the node's own (the default owner of every agent it hosts,
§8.3), held by the daemon from the keystore: the CLI never reads a key.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from .daemon import _admin, _client_args
from .exitcodes import EX_CANTCREAT, EX_OK, EX_TEMPFAIL, EX_USAGE
from .output import emit_json, read_json_document


def register(commands: Any) -> None:
    agreements = commands.add_parser("agreements", help="agreements to paid SKUs (§19.5)")
    sub = agreements.add_subparsers(dest="agreements_command", metavar="ACTION", required=True)
    sign = sub.add_parser("sign", help="sign (as this node's owner key) an agreement to a seller's SKU at its current digest")
    sign.add_argument("seller", help="the seller agent: a local name, an id (U...) or a registry name")
    sign.add_argument("--sku", help="the SKU id (default: the one covering --offering, or the seller's only SKU)")
    sign.add_argument("--offering", help="pick the SKU covering this offering")
    sign.add_argument("--expires-in", type=int, metavar="SECONDS", help="the agreement expires this long after now")
    sign.add_argument("--out", type=Path, help="also write the signed document here (to `agreements add` on the seller's node)")
    _client_args(sign)
    sign.set_defaults(handler=cmd_sign)
    reg = sub.add_parser(
        "register", help="register an agreement signed elsewhere (a JSON file) with the platform; its signer must own this node"
    )
    reg.add_argument("file", type=Path, help="the signed agreement document (JSON)")
    _client_args(reg)
    reg.set_defaults(handler=cmd_register)
    add = sub.add_parser("add", help="keep an agreement signed elsewhere (a JSON file) in this node's store")
    add.add_argument("file", type=Path, help="the signed agreement document (JSON)")
    _client_args(add)
    add.set_defaults(handler=cmd_add)
    lst = sub.add_parser("list", help="the agreements this node holds, and those registered with the platform")
    _client_args(lst)
    lst.set_defaults(handler=cmd_list)
    revoke = sub.add_parser(
        "revoke", help="revoke agreements to a SKU from now on (prospective), here and, for this node's own, at the platform"
    )
    revoke.add_argument("sku", nargs="?", help="the SKU id (required unless --document)")
    revoke.add_argument(
        "--document", type=Path, metavar="FILE",
        help="send this revocation, signed elsewhere by the owner key, to the platform instead",
    )
    revoke.add_argument("--owner", help="only this consumer owner's (U...)")
    revoke.add_argument("--seller", help="only to this seller (a local name or an id)")
    _client_args(revoke)
    revoke.set_defaults(handler=cmd_revoke)


def register_usage(commands: Any) -> None:
    usage = commands.add_parser(
        "usage", help="receipts and rated charges per counterparty and period, from the mesh's ledger (§19.6)"
    )
    usage.add_argument("--owner", help="only this consumer owner (U...)")
    usage.add_argument("--seller", help="only this seller (a local name or an id)")
    usage.add_argument("--period", help="only this UTC period: YYYY, YYYY-MM or YYYY-MM-DD")
    usage.add_argument("--source", choices=("auto", "ledger", "local"), default="auto",
                       help="the mesh's rating service (ledger), this node's usage log (local), "
                       "or the ledger falling back to the log (auto, the default)")
    usage.add_argument("--charges", action="store_true", help="list every rated event, not only the totals")
    _client_args(usage)
    usage.set_defaults(handler=cmd_usage)


def cmd_usage(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {}
    if args.owner:
        params["owner"] = args.owner
    if args.seller:
        params["seller"] = args.seller
    if args.period:
        params["period"] = args.period
    if args.source != "auto":
        params["source"] = args.source
    # The lines only when they are shown: a busy mesh's ledger runs to many pages.
    params["charges"] = bool(args.charges or args.json)
    code, result = _usage_pages(args, params)
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
        return EX_OK
    where = "the mesh's ledger" if result.get("source") == "ledger" else "this node's usage log"
    ledger = result.get("ledger")
    if isinstance(ledger, dict) and ledger.get("complete") is False:
        print(f"meshnode: the ledger misses {ledger.get('missed')} meter event(s) the mesh discarded before "
              f"the rating service read them (it is whole from {ledger.get('since') or '?'} on): their charges "
              "are not in these figures; [storage] metering_max_bytes sets how much the mesh keeps",
              file=sys.stderr)
    if isinstance(ledger, dict) and ledger.get("dropped"):
        # The ledger's horizon: what the mesh still keeps of the meter events.
        where += (f", from {ledger.get('held_from') or 'its latest events'} on ({ledger['dropped']} older line(s) "
                  "went with the events the mesh discarded; [storage] metering_max_bytes)")
    if not result["events"]:
        print(f"no usage recorded ({where})")
        return EX_OK
    print(f"from {where}:")
    if args.charges:
        for c in result["charges"]:
            # Micro-units, like the totals below ("2000 USD" read as two thousand dollars).
            amount = f"{c['amount_micro']} micro-{c.get('currency', '?')}"
            print(f"{c['ts']}  {c['sku']:<16} {c['meter']:<10} {c['quantity']:>6}  {amount:>16}  "
                  f"{c['outcome']:<13} owner {c.get('consumer_owner', '?')}")
    for t in result["totals"]:
        print(f"{t['period']}  owner {t['consumer_owner']}  seller {t['seller_agent']}  "
              f"{t['amount_micro']} micro-{t['currency']}")
    return EX_OK


#: Reads of the ledger started over because it let lines go meanwhile, before giving up.
_USAGE_READS = 5
#: How long a page of ``Usage.Rated`` may take. The first page from the local
#: usage log rates it whole: up to some 700,000 lines at the default bound,
#: ~30 s on the benchmarks' machine, past the admin calls' usual 30 s.
_USAGE_TIMEOUT_S = 600.0


def _usage_pages(args: argparse.Namespace, params: dict[str, Any]) -> tuple[int, Any]:
    """``Usage.Rated`` with every page of its charges and totals. Later pages
    ask ``as_of`` the first page's ``events``: they answer for the lines the
    first one counted, so the lines and the totals agree while the ledger
    grows. When the ledger lets its oldest lines go between two pages (its
    ``ledger.dropped`` moves: the mesh discarded their events), the pages no
    longer line up and the read starts over."""
    for _ in range(_USAGE_READS):
        code, result = _usage_read(args, params)
        if code != EX_OK or result is not None:
            return code, result
    print(f"meshnode: usage: the ledger let lines go while it was read, {_USAGE_READS} times in a row (the mesh "
          "discards meter events as fast as they come: [storage] metering_max_bytes); try again, or narrow the "
          "query with --owner, --seller or --period", file=sys.stderr)
    return EX_TEMPFAIL, None


def _dropped(answer: dict[str, Any]) -> object:
    ledger = answer.get("ledger")
    return ledger.get("dropped") if isinstance(ledger, dict) else None


def _usage_read(args: argparse.Namespace, params: dict[str, Any]) -> tuple[int, Any]:
    """One read of every page (:func:`_usage_pages`): (code, None) to start over."""
    code, first = _admin(args, "Usage.Rated", params, timeout=_USAGE_TIMEOUT_S)
    if code != EX_OK:
        return code, None
    merged = {**first, "charges": list(first["charges"]), "totals": list(first["totals"])}
    following = {"charges": first.get("charges_next"), "totals": first.get("totals_next")}
    while following["charges"] is not None or following["totals"] is not None:
        # A part read whole asks for nothing more: no lines, the totals from their end.
        ask = {**params, "as_of": first["events"],
               "totals_offset": len(merged["totals"]) if following["totals"] is None else following["totals"]}
        if following["charges"] is None:
            ask["charges"] = False
        else:
            ask["charges_offset"] = following["charges"]
        code, page = _admin(args, "Usage.Rated", ask, timeout=_USAGE_TIMEOUT_S)
        if code != EX_OK:
            return code, None
        if _dropped(page) != _dropped(first):
            return EX_OK, None  # lines let go in between: the offsets moved
        if not page["charges"] and not page["totals"]:
            break  # the ledger was folded anew meanwhile (a restarted rating service): what was read stands
        for part in ("charges", "totals"):
            if following[part] is not None:
                merged[part].extend(page[part])
                following[part] = page.get(f"{part}_next")
    merged["charges"] = merged["charges"][: first["events"]]
    return EX_OK, {**merged, "charges_next": None, "totals_next": None}


def cmd_sign(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"seller": args.seller}
    for name, value in (("sku", args.sku), ("offering", args.offering), ("expires_in_s", args.expires_in)):
        if value is not None:
            params[name] = value
    if args.out is not None:
        # Checked before signing: `sign` registers with the platform, and an
        # unwritable --out found only afterwards would leave a registered
        # agreement and a traceback.
        parent = args.out.parent if str(args.out.parent) else Path(".")
        if not parent.is_dir() or not os.access(parent, os.W_OK) or args.out.is_dir():
            print(f"meshnode: agreements sign: --out {args.out}: cannot create the file "
                  f"(its directory {parent} is missing or not writable); nothing signed", file=sys.stderr)
            return EX_CANTCREAT
    code, result = _admin(args, "Agreements.Sign", params)
    if code != EX_OK:
        return code
    if args.out is not None:
        try:
            args.out.write_text(json.dumps(result["agreement"], indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            # Not lost: the signed document goes to stdout instead.
            print(f"meshnode: agreements sign: signed, but --out {args.out} could not be written ({exc}); "
                  "the document follows on stdout", file=sys.stderr)
            emit_json(result["agreement"])
            return EX_CANTCREAT
    if args.json:
        emit_json(result)
        return EX_OK
    a = result["agreement"]
    print(f"signed {a['sku']} ({a['sku_digest']}) for {a['seller_agent']} as {a['consumer_owner']}")
    if result["stored"]:
        print("stored: the seller is hosted here and admits this owner's agents now")
    if result.get("registered"):
        print("registered with the platform: the seller's node admits this owner's agents now")
    else:
        print(f"not registered with the platform ({result.get('registration_error')})", file=sys.stderr)
        if not result["stored"]:
            where = f" {args.out}" if args.out else " (use --out FILE)"
            print(f"hand{where} to the seller's operator for `meshnode agreements add`")
    return EX_OK


def cmd_register(args: argparse.Namespace) -> int:
    code, document = read_json_document(args.file, "agreement document")
    if code != EX_OK:
        return code
    code, result = _admin(args, "Agreements.Register", {"agreement": document})
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
        return EX_OK
    a = result["agreement"]
    print(f"registered {a['sku']} ({a['sku_digest']}) of {a['consumer_owner']} for {a['seller_agent']}")
    return EX_OK


def cmd_add(args: argparse.Namespace) -> int:
    code, document = read_json_document(args.file, "agreement document")
    if code != EX_OK:
        return code
    code, result = _admin(args, "Agreements.Add", {"agreement": document})
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
        return EX_OK
    a = result["agreement"]
    print(f"added {a['sku']} ({a['sku_digest']}) of {a['consumer_owner']}")
    return EX_OK


def cmd_list(args: argparse.Namespace) -> int:
    code, result = _admin(args, "Agreements.List")
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
        return EX_OK
    if not result["agreements"] and not result.get("registered"):
        print("no agreements held")
    for where, items in (("local", result["agreements"]), ("platform", result.get("registered") or [])):
        for a in items:
            state = f"revoked {a['revoked_at']}" if a["revoked_at"] else f"expires {a['expires_at']}" if a["expires_at"] else "live"
            print(f"{where:<8} {a['sku']:<20} {a['sku_digest']}  owner {a['consumer_owner']}  "
                  f"seller {a['seller_agent']}  {state}")
    if result.get("registered_error"):
        print(f"platform agreements not shown: {result['registered_error']}", file=sys.stderr)
    return EX_OK


def cmd_revoke(args: argparse.Namespace) -> int:
    if args.document is not None:
        code, document = read_json_document(args.document, "revocation document")
        if code != EX_OK:
            return code
        code, result = _admin(args, "Agreements.Revoke", {"revocation": document})
        if code != EX_OK:
            return code
        if args.json:
            emit_json(result)
        else:
            print(f"revoked {len(result['platform_revoked'])} agreement(s) at the platform")
        return EX_OK
    if not args.sku:
        print("meshnode: agreements revoke: name the SKU (or --document FILE)", file=sys.stderr)
        return EX_USAGE
    params: dict[str, Any] = {"sku": args.sku}
    if args.owner:
        params["owner"] = args.owner
    if args.seller:
        params["seller"] = args.seller
    code, result = _admin(args, "Agreements.Revoke", params)
    if code != EX_OK:
        return code
    if args.json:
        emit_json(result)
        return EX_OK
    print(f"revoked {len(result['revoked'])} agreement(s) to {args.sku} here, "
          f"{len(result.get('platform_revoked') or [])} at the platform")
    if result.get("platform_error"):
        print(f"not revoked at the platform: {result['platform_error']}", file=sys.stderr)
    return EX_OK
