"""``meshnode artifacts``: the mesh artifact store from a terminal (§7.5).

Everything goes through the admin socket (``Artifacts.*``), as the node's CLI
identity. Files are read and written here, by the caller, and stream over
the socket in pieces: the daemon never opens a path a client names (it may
run as a user that can read what the caller cannot). ``get`` writes nothing
where you asked until the whole object has been verified against its digest.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import mimetypes
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from meshnode.admin.client import AdminClient, AdminClientError, exit_code_for
from meshnode.admin.protocol import AdminError, Refused
from meshnode.config import ConfigError, parse_duration

from .daemon import _client_args, _socket, admin_failure
from .exitcodes import EX_CANTCREAT, EX_CONFIG, EX_NOINPUT, EX_OK, EX_USAGE
from .output import emit_json, human_duration, human_rate, human_size, human_time, rfc3339_fields

#: Raw bytes per admin call (the daemon's ADMIN_PIECE).
PIECE = 512 * 1024
#: Up to this size a file goes in one message; above, as an upload session.
ONE_SHOT = 64 * 1024
#: Objects at least this large get a progress display on stderr.
PROGRESS_FROM = 4 * 1024 * 1024


def register(commands: Any) -> None:
    artifacts = commands.add_parser("artifacts", help="store and fetch files in the mesh artifact store")
    sub = artifacts.add_subparsers(dest="artifacts_command", metavar="ACTION", required=True)

    put = sub.add_parser("put", help="store a file; prints its ref")
    put.add_argument("file", help="the file to store (- for stdin)")
    put.add_argument("--name", help="the file name recorded with it (default: the file's name)")
    put.add_argument("--media-type", help="MIME type (default: guessed from the name)")
    put.add_argument("--retention", help="how long to keep it, e.g. 30d (default: the store's, 14d)")
    put.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    _client_args(put)
    put.set_defaults(handler=cmd_put)

    get = sub.add_parser("get", help="fetch a ref, verified against its digest")
    get.add_argument("ref")
    get.add_argument("--out", "-o", help="write here (default, or -: stdout)")
    get.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    _client_args(get)
    get.set_defaults(handler=cmd_get)

    stat = sub.add_parser("stat", help="a ref's size, digest, media type and lifetime")
    stat.add_argument("ref")
    _client_args(stat)
    stat.set_defaults(handler=cmd_stat)

    rm = sub.add_parser("rm", help="delete an artifact now (its owner only); the ref then answers gone")
    rm.add_argument("ref")
    _client_args(rm)
    rm.set_defaults(handler=cmd_rm)

    usage = sub.add_parser("usage", help="this node's owner's storage against its quota")
    _client_args(usage)
    usage.set_defaults(handler=cmd_usage)


# --------------------------------------------------------------------------- output


class _Progress:
    """``done of total (pct), rate, ETA`` on stderr: redrawn in place on a
    terminal, every quarter otherwise. Sizes and rates share one set of units
    (:func:`~meshnode.cli.output.human_size`: binary, one decimal)."""

    def __init__(self, verb: str, total: int, quiet: bool, *, clock: Any = time.monotonic) -> None:
        self.verb = verb
        self.total = total
        self.enabled = not quiet and total >= PROGRESS_FROM
        self.tty = sys.stderr.isatty()
        self._quarter = 0
        self._clock = clock
        self._started = clock()

    def line(self, done: int) -> str:
        """The progress line after ``done`` bytes."""
        pct = 100 * done // max(1, self.total)
        elapsed = self._clock() - self._started
        line = f"{self.verb} {human_size(done)} of {human_size(self.total)} ({pct}%)"
        if elapsed > 0 and done > 0:
            rate = done / elapsed
            line += f", {human_rate(rate)}"
            if done < self.total:
                line += f", ETA {human_duration((self.total - done) / rate)}"
            else:
                line += f", in {human_duration(elapsed)}"
        return line

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        pct = 100 * done // max(1, self.total)
        line = self.line(done)
        if self.tty:
            print(f"\r\x1b[2K{line}", end="", file=sys.stderr, flush=True)
        elif pct // 25 > self._quarter or done >= self.total:
            self._quarter = pct // 25
            print(line, file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


def _refused(exc: Refused) -> int:
    error = exc.params
    details = error.get("details")
    line = f"failed: {error.get('code')}: {error.get('message')}"
    if details:
        line += f" {json.dumps(details, ensure_ascii=False)}"
    print(line, file=sys.stderr)
    return exit_code_for(exc)  # the mesh said no: EX_CHECK_FAILED


def _run(args: argparse.Namespace, work: Any) -> tuple[int, Any]:
    """Run ``work(client)`` against the daemon; map failures to exit codes."""
    socket = _socket(args)
    if socket is None:
        return EX_CONFIG, None

    async def main() -> Any:
        async with AdminClient(socket, timeout=180.0) as client:
            return await work(client)

    try:
        return EX_OK, asyncio.run(main())
    except Refused as exc:
        return _refused(exc), None
    except (AdminClientError, AdminError) as exc:
        print(admin_failure(args, exc), file=sys.stderr)
        return exit_code_for(exc), None


def _print(args: argparse.Namespace, result: Any, text: str) -> None:
    if args.json:
        emit_json(result)
    else:
        print(text)


def looks_binary(head: bytes) -> bool:
    """Whether bytes would garble a terminal: a NUL, or not UTF-8 (a multi-byte
    character cut at the end of ``head`` is fine)."""
    if b"\0" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start < len(head) - 3
    return False


# --------------------------------------------------------------------------- put


def _open_source(path: str) -> tuple[IO[bytes], int, str, str | None]:
    """The input as a seekable binary file, its size, digest and name."""
    if path == "-":
        spool = tempfile.TemporaryFile()  # noqa: SIM115 - closed by the caller
        sha = hashlib.sha256()
        while block := sys.stdin.buffer.read(1024 * 1024):
            spool.write(block)
            sha.update(block)
        size = spool.tell()
        spool.seek(0)
        return spool, size, "sha256:" + sha.hexdigest(), None
    handle = open(path, "rb")  # noqa: SIM115 - closed by the caller
    sha = hashlib.sha256()
    while block := handle.read(1024 * 1024):
        sha.update(block)
    size = handle.tell()
    handle.seek(0)
    return handle, size, "sha256:" + sha.hexdigest(), Path(path).name


def cmd_put(args: argparse.Namespace) -> int:
    retention_s: int | None = None
    if args.retention is not None:
        try:
            retention_s = max(1, int(parse_duration(args.retention).total_seconds()))
        except (ValueError, ConfigError) as exc:
            print(f"meshnode: --retention: {exc}", file=sys.stderr)
            return EX_USAGE
    try:
        source, size, digest, file_name = _open_source(args.file)
    except OSError as exc:
        print(f"meshnode: cannot read {args.file}: {exc}", file=sys.stderr)
        return EX_NOINPUT
    name = args.name or file_name
    media_type = args.media_type or (mimetypes.guess_type(name)[0] if name else None) or "application/octet-stream"
    progress = _Progress("uploaded", size, args.quiet)

    async def work(client: AdminClient) -> dict[str, Any]:
        base: dict[str, Any] = {"media_type": media_type}
        if name:
            base["name"] = name
        if retention_s is not None:
            base["retention_s"] = retention_s
        if size <= ONE_SHOT:
            data = source.read()
            result: dict[str, Any] = await client.call(
                "Artifacts.Put", {**base, "data": base64.b64encode(data).decode(), "digest": digest}
            )
            return result
        opened = await client.call("Artifacts.Put", {**base, "size": size, "digest": digest})
        upload, done, seq = opened["upload"], 0, 0
        step = min(PIECE, int(opened.get("chunk_max") or PIECE))  # the mesh's max payload may be smaller
        try:
            while done < size:
                data = source.read(min(step, size - done))
                if not data:
                    raise OSError("the file shrank while it was being stored")
                reply = await client.call("Artifacts.Put", {"upload": upload, "seq": seq, "data": base64.b64encode(data).decode()})
                done += len(data)
                seq += 1
                progress.update(done)
        except BaseException:
            try:
                await client.call("Artifacts.Put", {"upload": upload, "abort": True})
            except Exception:
                pass
            raise
        finally:
            progress.done()
        return dict(reply)

    try:
        code, result = _run(args, work)
    except OSError as exc:
        print(f"meshnode: {exc}", file=sys.stderr)
        return EX_NOINPUT
    finally:
        source.close()
    if code == EX_OK:
        _print(args, result, str(result["ref"]))
    return code


# --------------------------------------------------------------------------- get


def cmd_get(args: argparse.Namespace) -> int:
    # "-" is stdout, as `put -` reads stdin (it created a file named "-").
    out_path = Path(args.out) if args.out and args.out != "-" else None
    target_dir = out_path.resolve().parent if out_path else None
    try:
        # Received bytes wait here until the whole object is verified.
        spool = tempfile.NamedTemporaryFile(  # noqa: SIM115 - renamed or removed below
            dir=target_dir, prefix=".meshnode-get-", delete=False
        )
    except OSError as exc:
        print(f"meshnode: cannot create {args.out}: {exc}", file=sys.stderr)
        return EX_CANTCREAT
    spool_path = Path(spool.name)
    sha = hashlib.sha256()

    async def work(client: AdminClient) -> dict[str, Any]:
        final: dict[str, Any] = {}
        progress: _Progress | None = None
        received = 0
        async for item in client.stream("Artifacts.Get", {"ref": args.ref}):
            if "data" in item:
                data = base64.b64decode(item["data"])
                if item.get("offset") != received:
                    raise AdminClientError("the daemon sent pieces out of order")
                spool.write(data)
                sha.update(data)
                received += len(data)
                if progress is None:
                    progress = _Progress("fetched", int(item.get("size") or 0), args.quiet)
                progress.update(received)
            else:
                final = dict(item)
        if progress is not None:
            progress.done()
        actual = "sha256:" + sha.hexdigest()
        if final.get("digest") != actual or final.get("size") != received:
            raise AdminClientError(f"received bytes do not match the verified digest ({actual})")
        return final

    try:
        code, result = _run(args, work)
        spool.close()
        if code != EX_OK:
            return code
        if out_path is None:
            with open(spool_path, "rb") as handle:
                if sys.stdout.isatty() and looks_binary(handle.read(8192)):
                    print(f"meshnode: {args.ref} is binary ({result.get('media_type', 'unknown type')}, "
                          f"{human_size(int(result.get('size') or 0))}); not writing it to a terminal: "
                          "use --out FILE or a pipe", file=sys.stderr)
                    return EX_USAGE
                handle.seek(0)
                while block := handle.read(1024 * 1024):
                    sys.stdout.buffer.write(block)
            sys.stdout.buffer.flush()
            if args.json:
                # stdout holds the bytes: the record goes to stderr, one line.
                print(json.dumps(rfc3339_fields(result)), file=sys.stderr)
        else:
            os.replace(spool_path, out_path)
            _print(args, result, f"{out_path}: {human_size(result['size'])}, {result['digest']}")
        return EX_OK
    except OSError as exc:
        print(f"meshnode: cannot write {args.out or 'stdout'}: {exc}", file=sys.stderr)
        return EX_CANTCREAT
    finally:
        spool.close()
        spool_path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- stat, rm, usage


def cmd_stat(args: argparse.Namespace) -> int:
    async def work(client: AdminClient) -> Any:
        return await client.call("Artifacts.Stat", {"ref": args.ref})

    code, result = _run(args, work)
    if code == EX_OK:
        lines = [
            f"ref        {result['ref']}",
            f"name       {result.get('name', '-')}",
            f"media type {result['media_type']}",
            f"size       {human_size(result['size'])} ({result['size']} bytes)",
            f"digest     {result.get('digest', '-')}",
            f"created    {human_time(result.get('created_at'))}",
            f"expires    {human_time(result.get('expires_at'))}",
        ]
        if result.get("owner"):
            lines += [f"owner      {result['owner']}", f"writer     {result['writer']}"]
        _print(args, result, "\n".join(lines))
    return code


def cmd_rm(args: argparse.Namespace) -> int:
    async def work(client: AdminClient) -> Any:
        return await client.call("Artifacts.Remove", {"ref": args.ref})

    code, result = _run(args, work)
    if code == EX_OK:
        _print(args, result, f"removed {args.ref}" if result.get("removed") else f"{args.ref} was already gone")
    return code


def cmd_usage(args: argparse.Namespace) -> int:
    async def work(client: AdminClient) -> Any:
        return await client.call("Artifacts.Usage", {})

    code, result = _run(args, work)
    if code == EX_OK:
        text = (
            f"owner    {result['owner']}\n"
            f"bytes    {human_size(result['bytes'])} of {human_size(result['quota_bytes'])}"
            f" ({human_size(result['reserved_bytes'])} in uploads)\n"
            f"objects  {result['objects']} of {result['quota_objects']}\n"
            f"largest  {human_size(result['max_object_bytes'])} per object"
        )
        _print(args, result, text)
    return code
