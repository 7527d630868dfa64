"""The ``file`` key store backend: ``<data_dir>/keys/<name>.seed``, 0700/0600, written atomically.

Part of :mod:`meshnode.keystore` (split by backend, issue #16), which re-exports it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import secrets
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from meshnode.protocol.nkeys import KeyPair, NkeyError, Prefix

from .base import (
    _KEY_NAME,
    _SEED_SUFFIX,
    KeyStoreError,
    _check_role,
    validate_key_name,
)

# One logger for the whole key store, as before the split (issue #16).
log = logging.getLogger("meshnode.keystore")


# os.umask is process-wide; the lock keeps our own threads from interleaving
# set/restore. The mode passed to os.open/os.mkdir already excludes group and
# other bits; the umask pins that no matter what umask the process started with.
_UMASK_LOCK = threading.Lock()


@contextlib.contextmanager
def _private_umask() -> Iterator[None]:
    with _UMASK_LOCK:
        old = os.umask(0o077)
        try:
            yield
        finally:
            os.umask(old)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_syncfs() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        syncfs: Callable[[int], int] = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    return syncfs


#: Linux syncfs(2), which Python does not wrap: one flush of the file system
#: holding the key directory. None elsewhere (each file is fsync'd instead).
_SYNCFS = _load_syncfs()


def _syncfs(path: Path) -> None:
    assert _SYNCFS is not None
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        if _SYNCFS(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    finally:
        os.close(fd)


#: Key files fsync'd at once by :meth:`FileKeyStore.get_or_create_many` where there
#: is no syncfs (8 measured ~8x faster than one at a time here; more did not help).
_WRITERS = 8


class FileKeyStore:
    """Seeds in ``<data_dir>/keys/<name>.seed`` (directory 0700, files 0600)."""

    kind = "file"

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.directory = self.data_dir / "keys"
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FileKeyStore({str(self.directory)!r})"

    def describe(self) -> str:
        return f"file store {self.directory} (directory 0700, key files 0600)"

    def path_for(self, name: str) -> Path:
        """The file that holds key ``name``."""
        return self.directory / (validate_key_name(name) + _SEED_SUFFIX)

    def _check_directory(self) -> bool:
        """False when the directory does not exist; raises when it is not private."""
        try:
            st = os.lstat(self.directory)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            raise KeyStoreError(
                f"{self.directory} is not a directory (a symlink or file is refused)",
                path=self.directory,
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise KeyStoreError(
                f"key directory {self.directory} is accessible by group or others "
                f"(mode {mode:04o}); fix it with: chmod 700 {self.directory}",
                path=self.directory,
            )
        return True

    def _ensure_directory(self) -> None:
        if self._check_directory():
            return
        with _private_umask():
            self.data_dir.mkdir(parents=True, exist_ok=True)
            # Another process may have made it meanwhile; it is checked just below.
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.directory, 0o700)
        self._check_directory()

    def _read(self, name: str) -> KeyPair | None:
        path = self.path_for(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise KeyStoreError(
                    f"key file {path} is a symlink; refusing to follow it", name=name, path=path
                ) from None
            raise KeyStoreError(
                f"cannot open key file {path}: {exc.strerror}", name=name, path=path
            ) from None
        try:
            # fstat on the open descriptor: the file checked is the file read.
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise KeyStoreError(f"key file {path} is not a regular file", name=name, path=path)
            mode = stat.S_IMODE(st.st_mode)
            if mode & 0o077:
                raise KeyStoreError(
                    f"key file {path} is accessible by group or others (mode {mode:04o}); "
                    f"refusing to use it. Fix it with: chmod 600 {path}",
                    name=name,
                    path=path,
                )
            data = b""
            while chunk := os.read(fd, 4096):
                data += chunk
                if len(data) > 4096:
                    raise KeyStoreError(
                        f"key file {path} is too large to be an nkey seed", name=name, path=path
                    )
        finally:
            os.close(fd)
        try:
            return KeyPair.from_seed(data.decode("ascii"))
        except (UnicodeDecodeError, NkeyError):
            raise KeyStoreError(
                f"key file {path} does not hold a valid nkey seed", name=name, path=path
            ) from None

    def get(self, name: str) -> KeyPair | None:
        validate_key_name(name)
        if not self._check_directory():
            return None
        return self._read(name)

    def get_or_create(self, name: str, role: Prefix | None = None) -> KeyPair:
        validate_key_name(name)
        where = f"file store {self.directory}"
        with self._lock:
            try:
                self._ensure_directory()
                existing = self._read(name)
                if existing is not None:
                    return _check_role(name, existing, role, where)
                stored = self._write_new(name, KeyPair.generate(role or Prefix.USER))
            except KeyStoreError:
                raise
            except OSError as exc:
                raise KeyStoreError(
                    f"cannot store key {name!r} in {self.directory}: {exc.strerror or exc}",
                    name=name,
                    path=self.directory,
                ) from None
            return _check_role(name, stored, role, where)

    def import_key(self, name: str, pair: KeyPair) -> KeyPair:
        """Store a key made elsewhere (e.g. the node key of an invite).

        Idempotent for the same key; refuses to replace a different one.
        """
        validate_key_name(name)
        with self._lock:
            self._ensure_directory()
            existing = self._read(name)
            if existing is None:
                existing = self._write_new(name, pair)
            if existing.public_key != pair.public_key:
                raise KeyStoreError(
                    f"a different key named {name!r} already exists in {self.directory}",
                    name=name,
                    path=self.path_for(name),
                )
            return existing

    def get_or_create_many(self, names: Sequence[str]) -> list[KeyPair]:
        """:meth:`get_or_create` (user role) of every name, in order.

        The new keys are written to temporary files, made durable together,
        then each linked into place, and the directory fsync'd once before this
        returns (nothing uses a key before then). On Linux one syncfs(2) makes
        them all durable: a first start with 1,000 agents spent ~1.5 s (and as
        much CPU) on a thousand fsyncs, ~8 at a time. Elsewhere each file is
        fsync'd, 8 side by side.
        """
        for name in names:
            validate_key_name(name)
        with self._lock:
            try:
                self._ensure_directory()
                found = {name: self._read(name) for name in dict.fromkeys(names)}
                missing = [name for name, pair in found.items() if pair is None]
                if missing:
                    found.update(self._create_many(missing))
                    _fsync_dir(self.directory)
            except KeyStoreError:
                raise
            except OSError as exc:
                raise KeyStoreError(
                    f"cannot store keys in {self.directory}: {exc.strerror or exc}", path=self.directory
                ) from None
        out: list[KeyPair] = []
        for name in names:
            pair = found[name]
            assert pair is not None
            out.append(pair)
        return out

    def _create_many(self, names: list[str]) -> dict[str, KeyPair]:
        pairs = {name: KeyPair.generate(Prefix.USER) for name in names}
        staged: dict[str, Path] = {}
        try:
            if _SYNCFS is not None:
                for name in names:
                    staged[name] = self._write_temporary(name, pairs[name], sync=False)
                _syncfs(self.directory)
            else:
                def write(name: str) -> None:
                    # Recorded as each one lands: if another fails, this one is removed too.
                    staged[name] = self._write_temporary(name, pairs[name], sync=True)

                with ThreadPoolExecutor(min(_WRITERS, len(names)), thread_name_prefix="keystore") as pool:
                    for _ in pool.map(write, names):
                        pass
            # Durable before any is linked: a key in place is never one a crash can empty.
            return {name: self._link_into_place(name, pairs[name], staged.pop(name)) for name in names}
        finally:
            for tmp in staged.values():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    def _write_new(self, name: str, pair: KeyPair) -> KeyPair:
        """Store ``pair`` unless a key appeared meanwhile; returns the key now stored."""
        stored = self._link_into_place(name, pair, self._write_temporary(name, pair, sync=True))
        _fsync_dir(self.directory)
        return stored

    def _write_temporary(self, name: str, pair: KeyPair, *, sync: bool) -> Path:
        """The seed in a new private temporary file beside its final place (fsync'd if ``sync``)."""
        tmp = self.directory / f".{name}.{secrets.token_hex(8)}.tmp"
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
        with _private_umask():
            fd = os.open(tmp, flags, 0o600)
        try:
            payload = (pair.seed + "\n").encode("ascii")
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        os.close(fd)
        return tmp

    def _link_into_place(self, name: str, pair: KeyPair, tmp: Path) -> KeyPair:
        """Give the durable temporary file ``tmp`` its final name (removing ``tmp``);
        returns the key now stored there (another creator's, if it won)."""
        final = self.path_for(name)
        try:
            try:
                # link() never replaces an existing file, unlike rename(): if another
                # process created the key first, theirs wins and we return it.
                os.link(tmp, final)
            except FileExistsError:
                winner = self._read(name)
                if winner is None:
                    raise KeyStoreError(
                        f"key file {final} vanished while being created", name=name, path=final
                    ) from None
                return winner
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                # File systems without hard links: rename is still atomic, only not
                # exclusive; the in-process lock covers the common case.
                if final.exists():
                    winner = self._read(name)
                    if winner is not None:
                        return winner
                os.rename(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        log.info("created key %s (%s) in %s", name, pair.public_key, self.directory)
        return pair

    def delete(self, name: str) -> bool:
        path = self.path_for(name)
        with self._lock:
            if not self._check_directory():
                return False
            # Leftovers of an interrupted create hold the same seed: remove them too.
            for stale in self.directory.glob(f".{name}.*.tmp"):
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
            try:
                os.unlink(path)
            except FileNotFoundError:
                return False
            _fsync_dir(self.directory)
        log.info("deleted key %s from %s", name, self.directory)
        return True

    def names(self) -> list[str]:
        if not self._check_directory():
            return []
        found = []
        for entry in os.listdir(self.directory):
            if entry.endswith(_SEED_SUFFIX):
                name = entry[: -len(_SEED_SUFFIX)]
                if _KEY_NAME.fullmatch(name):
                    found.append(name)
        return sorted(found)
