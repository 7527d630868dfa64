"""Owner-only files: written atomically with mode 0600 at every instant, read with a check.

The mesh's signing keys, its nats-server config (which embeds account JWTs)
and the control plane's enrolment state are all kept this way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from pathlib import Path

__all__ = ["ensure_private_dir", "read_private_file", "write_private_file"]

log = logging.getLogger("meshnode.transport.embedded")  # the name these messages always had


def write_private_file(path: Path, content: str, *, replace: bool, sync: bool = True) -> None:
    """Write ``content`` to ``path`` readable by the owner only, at every instant.

    The bytes go to a fresh temporary file created with O_EXCL and mode 0600
    (umask can only narrow that, and fchmod restores it exactly), which is then
    moved into place. Without ``replace`` an existing file wins: FileExistsError.
    ``sync`` fsyncs the file and its directory; without it the file is whole
    (the old one or the new one) after a crash of the process, not
    necessarily after one of the machine, for a file written often from the
    event loop whose loss costs only repeated work.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            data = content.encode("utf-8")
            while data:
                data = data[os.write(fd, data) :]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    if not sync:
        return
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_private_file(path: Path) -> str:
    """The text of an owner-only file, restricting (and warning about) a looser mode."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "r", encoding="ascii") as handle:
        mode = os.fstat(handle.fileno()).st_mode
        if stat.S_IMODE(mode) & 0o077:
            log.warning(
                "%s was readable by other users (mode %o); restricting it to the owner. "
                "Treat the key as exposed if others could log in here.",
                path, stat.S_IMODE(mode),
            )
            os.fchmod(handle.fileno(), 0o600)
        return handle.read()


def ensure_private_dir(path: Path) -> None:
    """``path`` as an owner-only directory (created with its parents if missing)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
