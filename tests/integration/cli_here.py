"""The CLI's ``main`` run in the test process, its result shaped like ``subprocess.run``'s.

A fresh interpreter per command spends most of its time on imports (~0.8 s
each, more on a loaded machine); tests that issue dozens of commands against a
running daemon, where what is under test is the daemon's answer and the
command's output, use this. The subprocess path itself (argv, exit status,
streams, terminals) stays covered by the tests that need a real process.

Stdout and stderr are captured at the Python level (``sys.stdout``/``sys.stderr``,
with a ``buffer`` for the commands that write bytes); they are not terminals,
as with a pipe; stdin is the given bytes (none by default). Only for synchronous tests: ``main`` runs its
own event loop.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

from meshnode.cli import main

__all__ = ["cli_here", "cli_here_bytes"]


def cli_here(*args: str) -> subprocess.CompletedProcess[str]:
    """``meshnode ARGS`` in this process: its exit code, stdout and stderr as text."""
    code, out, err = _run(args, b"")
    return subprocess.CompletedProcess(list(args), code, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def cli_here_bytes(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    """``meshnode ARGS`` in this process with ``stdin``: stdout and stderr as bytes."""
    code, out, err = _run(args, stdin)
    return subprocess.CompletedProcess(list(args), code, out, err)


def _run(args: tuple[str, ...], stdin: bytes) -> tuple[int, bytes, bytes]:
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", newline="")
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", newline="")
    saved_stdin = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse (usage errors, --help) leaves this way
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.stdin = saved_stdin
    captured = []
    for stream in (out, err):
        stream.flush()
        buffer = stream.buffer
        assert isinstance(buffer, io.BytesIO)
        captured.append(buffer.getvalue())
    return code, captured[0], captured[1]
