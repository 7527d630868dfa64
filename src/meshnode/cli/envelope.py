"""``meshnode envelope``: canonical bytes, verification and signing for people
integrating other AgentMesh implementations.

  meshnode envelope canonical < value.json      canonical JSON bytes of any value
  meshnode envelope verify [--json] < env.json  which check failed, or ok
  meshnode envelope sign --seed-file F < e.json sign (filling v/id/ts/trace if absent)
  meshnode envelope keygen [--out F]            a fresh agent key (seed + public key)

Exit codes: 0 ok, 1 verification failed, 65 invalid input, 66 unreadable file,
73 --out exists.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any

from meshnode.protocol.canonical import CanonicalJSONError, canonicalize, parse_json
from meshnode.protocol.envelope import (
    PROTOCOL_VERSION,
    IdGenerator,
    new_root_trace,
    sign_envelope,
    validate_envelope,
    verify_envelope,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair, NkeyError
from meshnode.protocol.timeutil import format_ts

from .exitcodes import EX_CANTCREAT, EX_CHECK_FAILED, EX_DATAERR, EX_NOINPUT, EX_OK


def register(commands: Any) -> None:
    parser = commands.add_parser("envelope", help="canonicalize, verify and sign envelopes")
    sub = parser.add_subparsers(dest="envelope_command", metavar="ACTION", required=True)

    canonical = sub.add_parser("canonical", help="stdin JSON -> canonical JSON bytes (RFC 8785 + §5.3)")
    canonical.add_argument("--json", action="store_true", help="(the output is JSON already: canonical bytes)")
    canonical.set_defaults(handler=cmd_canonical)

    verify = sub.add_parser("verify", help="stdin envelope -> ok, or which check failed")
    verify.add_argument("--json", action="store_true", help="machine-readable result")
    verify.add_argument(
        "--accept-legacy-untagged",
        action="store_true",
        help="also accept the 0.2-era untagged signature form",
    )
    verify.set_defaults(handler=cmd_verify)

    sign = sub.add_parser("sign", help="stdin envelope -> signed envelope")
    sign.add_argument("--seed-file", required=True,
                      help="file holding the signer's nkey seed (SU...), or keygen's JSON ({\"seed\": ...})")
    sign.add_argument("--no-fill", action="store_true", help="sign exactly what is given")
    sign.add_argument("--pretty", action="store_true", help="indent the output")
    sign.add_argument("--json", action="store_true", help="(the output is JSON already: the signed envelope)")
    sign.set_defaults(handler=cmd_sign)

    keygen = sub.add_parser("keygen", help="a fresh agent key pair as JSON ({public_key, seed})")
    keygen.add_argument("--out", metavar="FILE",
                        help="write it to FILE, readable by you only (0600; never replaced), and print "
                        "the public key")
    keygen.add_argument("--json", action="store_true", help="(the output is JSON already)")
    keygen.set_defaults(handler=cmd_keygen)


def _read_stdin_json() -> Any:
    data = sys.stdin.buffer.read()
    return parse_json(data)


def _fail(message: str, code: int) -> int:
    print(f"meshnode envelope: {message}", file=sys.stderr)
    return code


def cmd_canonical(args: argparse.Namespace) -> int:
    try:
        out = canonicalize(_read_stdin_json())
    except (ValueError, CanonicalJSONError) as exc:
        return _fail(f"invalid input: {exc}", EX_DATAERR)
    sys.stdout.buffer.write(out)
    sys.stdout.buffer.flush()
    return EX_OK


def cmd_verify(args: argparse.Namespace) -> int:
    result: dict[str, Any]
    code = EX_OK
    try:
        env = validate_envelope(_read_stdin_json())
        verify_envelope(env, accept_legacy_untagged=args.accept_legacy_untagged)
        result = {"ok": True, "from": env["from"], "id": env["id"], "type": env["type"]}
    except ValueError as exc:  # not JSON (json.JSONDecodeError, CanonicalJSONError)
        result = {"ok": False, "check": "json", "code": "INVALID_ENVELOPE", "message": str(exc)}
        code = EX_DATAERR
    except ProtocolError as exc:
        check = {"INVALID_ENVELOPE": "structure", "INVALID_VERSION": "version"}.get(exc.code, "signature")
        result = {"ok": False, "check": check, "code": exc.code, "message": exc.message}
        if exc.details:
            result["details"] = exc.details
        code = EX_CHECK_FAILED if check == "signature" else EX_DATAERR
    if args.json:
        print(json.dumps(result))
    elif result["ok"]:
        print(f"ok: {result['type']} {result['id']} from {result['from']}")
    else:
        member = result.get("details", {}).get("member")
        where = f" (member {member})" if member else ""
        print(f"{result['check']} check failed: {result['code']}: {result['message']}{where}")
    return code


def cmd_sign(args: argparse.Namespace) -> int:
    try:
        with open(args.seed_file, encoding="ascii") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            key = KeyPair.from_seed(_seed_in(fh.read()))
    except OSError as exc:
        return _fail(f"cannot read seed file {args.seed_file}: {exc.strerror}", EX_NOINPUT)
    except (NkeyError, UnicodeDecodeError) as exc:
        return _fail(f"seed file {args.seed_file} does not hold an nkey seed: {exc}", EX_DATAERR)
    if mode & 0o077:
        _warn_readable(f"seed file {args.seed_file}", mode, f"chmod 600 {args.seed_file}")
    try:
        env = _read_stdin_json()
    except ValueError as exc:
        return _fail(f"invalid input: {exc}", EX_DATAERR)
    if not isinstance(env, dict):
        return _fail("invalid input: an envelope is a JSON object", EX_DATAERR)
    if env.get("from", key.public_key) != key.public_key:
        return _fail(f"'from' is {env['from']} but the seed is for {key.public_key}", EX_DATAERR)
    if not args.no_fill:
        now_ms = int(time.time() * 1000)
        env.setdefault("v", PROTOCOL_VERSION)
        env.setdefault("id", IdGenerator().new_id(now_ms))
        env.setdefault("ts", format_ts(now_ms))
        env.setdefault("from", key.public_key)
        env.setdefault("trace", new_root_trace())
    env["from"] = key.public_key
    try:
        sign_envelope(env, key)
        validate_envelope(env)
    except (CanonicalJSONError, ProtocolError, ValueError) as exc:
        return _fail(f"cannot sign: {exc}", EX_DATAERR)
    print(json.dumps(env, ensure_ascii=False, indent=2 if args.pretty else None))
    return EX_OK


def cmd_keygen(args: argparse.Namespace) -> int:
    key = KeyPair.generate()
    text = json.dumps({"public_key": key.public_key, "seed": key.seed})
    if args.out:
        # Imported per command: meshnode.transport pulls in NATS (CLI start-up time).
        from meshnode.transport.files import write_private_file

        try:
            write_private_file(Path(args.out), text + "\n", replace=False)
        except FileExistsError:
            return _fail(f"{args.out} exists; not replacing a key", EX_CANTCREAT)
        except OSError as exc:
            return _fail(f"cannot write {args.out}: {exc.strerror}", EX_CANTCREAT)
        print(key.public_key)
        return EX_OK
    print(text)
    try:
        mode = os.fstat(sys.stdout.fileno()).st_mode
    except (OSError, ValueError):  # no real file behind stdout (a test's capture)
        return EX_OK
    if stat.S_ISREG(mode) and mode & 0o077:
        _warn_readable("the seed went to a file that", mode, "chmod 600 it, or use --out FILE next time")
    return EX_OK


def _seed_in(text: str) -> str:
    """The seed in a seed file: the seed itself, or keygen's JSON holding it."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            value = json.loads(stripped)
        except ValueError:
            raise NkeyError("the file looks like JSON but does not parse") from None
        if not isinstance(value, dict) or not isinstance(value.get("seed"), str):
            raise NkeyError('JSON without a "seed" string')
        return str(value["seed"])
    return stripped


def _warn_readable(what: str, mode: int, remedy: str) -> None:
    print(f"meshnode envelope: warning: {what} is readable by others (mode {stat.S_IMODE(mode):04o}): "
          f"it holds a secret key; {remedy}", file=sys.stderr)
