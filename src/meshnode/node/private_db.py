"""SQLite files the daemon keeps, private (0600) from the moment they exist.

SQLite (unix VFS) gives a database's ``-wal``, ``-shm`` and ``-journal`` side
files the permission bits of the database file itself. A database created by
``connect()`` is born with the process umask (typically 0644) and its side
files are created at the first write, before any ``chmod`` after opening: they
kept 0644 while the database was tightened to 0600 (issue #23 item 8). The
side files hold the same rows as the database (the WAL holds the newest ones),
so they must be exactly as private.

``prepare_private_db`` is called before ``connect()``: it creates the directory
0700 and the database file 0600 (an ``os.open`` with mode 0600 whatever the
umask, then ``fchmod`` in case the umask narrowed it further), and tightens a
database or side files left looser by an older version. ``tighten_side_files``
is called after opening, for side files SQLite created meanwhile.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["PRIVATE_FILE_MODE", "SIDE_SUFFIXES", "prepare_private_db", "tighten_side_files"]

PRIVATE_FILE_MODE = 0o600
SIDE_SUFFIXES = ("-wal", "-shm", "-journal")


def _side_files(path: Path) -> list[Path]:
    return [path.with_name(path.name + suffix) for suffix in SIDE_SUFFIXES]


def tighten_side_files(path: Path) -> None:
    """chmod 0600 the database and whichever of its side files exist."""
    for candidate in (path, *_side_files(path)):
        with contextlib.suppress(FileNotFoundError, PermissionError):
            if candidate.stat().st_mode & 0o777 != PRIVATE_FILE_MODE:
                candidate.chmod(PRIVATE_FILE_MODE)


def prepare_private_db(path: Path) -> None:
    """Make ``path`` a 0600 file in a 0700 directory before SQLite opens it."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # O_EXCL-less O_CREAT: an existing database is left as is (then tightened).
    fd = os.open(path, os.O_CREAT | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), PRIVATE_FILE_MODE)
    try:
        with contextlib.suppress(PermissionError):  # not ours: SQLite will say so
            os.fchmod(fd, PRIVATE_FILE_MODE)
    finally:
        os.close(fd)
    tighten_side_files(path)
