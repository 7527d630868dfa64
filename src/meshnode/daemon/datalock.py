"""One daemon per data directory.

Everything a node keeps lives under its data directory: the keys, the SQLite
node inbox, the credential, and for an embedded mesh the broker's JetStream
store. A second ``meshnode run`` on the same directory (a manual start beside
the systemd service, a configuration copied with only its ports changed) used
to get as far as starting its own nats-server on the running mesh's store
before a taken port stopped it: two brokers writing one store. The daemon now
takes an exclusive lock on ``DATA_DIR/daemon.lock`` before it touches anything
else there, and a second one stops at once, naming the first. ``meshnode join``
takes it too while it writes the node key and credential into a directory.

The lock is ``flock`` on an open file: the kernel drops it when the process
ends, however it ends (``kill -9`` included), so a stale lock cannot keep a
node down. The descriptor is close-on-exec: the broker the daemon starts does
not inherit it (a broker outliving a killed daemon would hold the node down),
and a daemon that re-executes itself takes it again in its new image. The file
holds the holder's pid, for the refusal's message; it is never deleted
(deleting a lock file races with the next taker).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

__all__ = ["DAEMON_HINT", "LOCK_FILE", "DataDirBusy", "DataDirLock"]

LOCK_FILE = "daemon.lock"
#: What a refused daemon is told to do instead of stopping the other one.
DAEMON_HINT = "give this one a data directory of its own ([node] data_dir)"


class DataDirBusy(RuntimeError):
    """Another process holds the data directory's lock."""

    def __init__(self, data_dir: Path, holder: int | None, hint: str = DAEMON_HINT) -> None:
        self.data_dir = data_dir
        self.holder = holder
        who = f"another meshnode daemon (pid {holder})" if holder else "another meshnode daemon"
        super().__init__(f"{who} is running with data directory {data_dir}: stop it first, or {hint}")


class DataDirLock:
    """The held lock of one data directory (:meth:`acquire`); :meth:`release` at the end."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd = fd
        self.path = path

    @classmethod
    def acquire(cls, data_dir: Path, *, hint: str = DAEMON_HINT) -> DataDirLock:
        """Lock ``data_dir`` (which must exist) for this process, or raise
        :class:`DataDirBusy` naming the holder's pid (and ``hint``, the other way out)."""
        path = data_dir / LOCK_FILE
        # os.open's descriptors are not inheritable (PEP 446): close-on-exec.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DataDirBusy(data_dir, _holder(fd), hint) from None
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path)

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Let the directory go (closing the descriptor drops the lock); idempotent."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def _holder(fd: int) -> int | None:
    """The pid the holder wrote, when it reads as one."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
