"""Private keys at rest (AgentMesh §4.8: a node MUST protect the agent private keys
it holds at rest).

A :class:`KeyStore` maps a key name (``"node"``, ``"agent.<name>"``,
``"mesh.operator"``, ...) to an nkey :class:`~meshnode.protocol.nkeys.KeyPair`.
Backends, chosen by :func:`open_keystore`:

``file``
    ``<data_dir>/keys/<name>.seed``: directory 0700, files 0600, created
    without any window of wider permissions and written atomically. A key file
    readable by group or others is refused, never silently used.
``keyring``
    The OS keyring (desktop sessions): service ``"meshnode"``, user
    ``"<scope>/<name>"`` where the scope is derived from the data directory, so
    two nodes of one user do not share keys.
``systemd-credentials``
    Read-only keys from ``$CREDENTIALS_DIRECTORY`` (``LoadCredential=`` /
    ``LoadCredentialEncrypted=``); any other key (an agent added at runtime)
    lives in the file store in the data directory.
``auto``
    systemd credentials when ``$CREDENTIALS_DIRECTORY`` is set; else the
    keyring when a usable backend exists and this is not a system service;
    else the file store.

All operations block (file system, D-Bus); call them from a worker thread
(``asyncio.to_thread``) on the event loop. Seeds never appear in logs, reprs or
exception messages.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from meshnode.config import is_system_service
from meshnode.protocol.nkeys import KeyPair, NkeyError, Prefix

if TYPE_CHECKING:
    from keyring.backend import KeyringBackend

__all__ = [
    "KEYRING_SERVICE",
    "FileKeyStore",
    "KeyStore",
    "KeyStoreError",
    "KeyStoreUnavailable",
    "KeyringKeyStore",
    "SystemdCredentialsKeyStore",
    "detect_keyring",
    "keyring_usable",
    "open_keystore",
    "validate_key_name",
]

log = logging.getLogger(__name__)

KEYRING_SERVICE = "meshnode"

_KEY_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
_SEED_SUFFIX = ".seed"
_KEYRING_PROBE_TIMEOUT = 3.0


class KeyStoreError(Exception):
    """A key could not be read or written. Not retryable without operator action:
    the message says which key/file and how to fix it. Never contains a seed."""

    def __init__(self, message: str, *, name: str | None = None, path: Path | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.path = path


class KeyStoreUnavailable(KeyStoreError):
    """The requested backend cannot be used here (no keyring, no credentials directory)."""


def validate_key_name(name: str) -> str:
    """Return ``name`` if it is a valid key name (``[a-z0-9][a-z0-9._-]{0,127}``).

    Raises ValueError otherwise; the pattern keeps names safe as file names,
    systemd credential IDs and keyring user names.
    """
    if not isinstance(name, str) or not _KEY_NAME.fullmatch(name):
        raise ValueError(f"invalid key name {name!r}: expected [a-z0-9][a-z0-9._-]{{0,127}}")
    return name


@runtime_checkable
class KeyStore(Protocol):
    """Where a node keeps private keys at rest."""

    @property
    def kind(self) -> str:
        """The backend: ``"file"``, ``"keyring"`` or ``"systemd-credentials"``."""
        ...

    def get(self, name: str) -> KeyPair | None:
        """The stored key pair, or None when there is none under ``name``."""
        ...

    def get_or_create(self, name: str, role: Prefix | None = None) -> KeyPair:
        """The stored key pair, creating and storing a new one if absent.

        ``role`` (default: user) is the nkey role of a new key; when given, a
        stored key of another role is an error. Idempotent; concurrent callers
        get the same key.
        """
        ...

    def delete(self, name: str) -> bool:
        """Remove the key; False when there was none. Read-only keys raise KeyStoreError."""
        ...

    def names(self) -> list[str]:
        """Sorted names of the stored keys."""
        ...

    def describe(self) -> str:
        """One line for status output: which backend and where."""
        ...


def _check_role(name: str, pair: KeyPair, role: Prefix | None, where: str) -> KeyPair:
    if role is not None and pair.role != role:
        raise KeyStoreError(
            f"key {name!r} in {where} is a {pair.role.name.lower()} key, "
            f"expected a {role.name.lower()} key",
            name=name,
        )
    return pair


# --------------------------------------------------------------------------- file store

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

    def _write_new(self, name: str, pair: KeyPair) -> KeyPair:
        """Store ``pair`` unless a key appeared meanwhile; returns the key now stored."""
        final = self.path_for(name)
        tmp = self.directory / f".{name}.{secrets.token_hex(8)}.tmp"
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
        with _private_umask():
            fd = os.open(tmp, flags, 0o600)
        try:
            try:
                payload = (pair.seed + "\n").encode("ascii")
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
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
        _fsync_dir(self.directory)
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


# --------------------------------------------------------------------------- systemd credentials


class SystemdCredentialsKeyStore:
    """Read-only keys from ``$CREDENTIALS_DIRECTORY/<name>``, the rest in a file store.

    systemd decrypts ``LoadCredentialEncrypted=`` keys into a private,
    non-swappable directory readable only by the service; keys created at
    runtime (a newly added agent) cannot go there and use ``fallback``.
    """

    kind = "systemd-credentials"

    def __init__(self, credentials_dir: Path, fallback: FileKeyStore) -> None:
        self.credentials_dir = Path(credentials_dir)
        self.fallback = fallback

    def __repr__(self) -> str:
        return (
            f"SystemdCredentialsKeyStore({str(self.credentials_dir)!r}, fallback={self.fallback!r})"
        )

    def describe(self) -> str:
        held = self._credential_names()
        listed = ", ".join(held) if held else "no keys"
        return (
            f"systemd credentials {self.credentials_dir} (read-only: {listed}); "
            f"other keys in {self.fallback.describe()}"
        )

    def _credential_names(self) -> list[str]:
        # The unit may load other credentials too (a NATS .creds file, TLS keys):
        # only those holding an nkey seed are keys.
        try:
            entries = os.listdir(self.credentials_dir)
        except OSError:
            return []
        found = []
        for entry in entries:
            if not _KEY_NAME.fullmatch(entry):
                continue
            try:
                self._read_credential(entry)
            except KeyStoreError:
                continue
            found.append(entry)
        return sorted(found)

    def _read_credential(self, name: str) -> KeyPair | None:
        # No mode check here: systemd creates the directory and files private to the
        # service (ramfs, 0400/0500) and their on-disk modes are its business.
        path = self.credentials_dir / validate_key_name(name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise KeyStoreError(
                f"cannot read credential {path}: {exc.strerror}", name=name, path=path
            ) from None
        try:
            return KeyPair.from_seed(data.decode("ascii"))
        except (UnicodeDecodeError, NkeyError):
            raise KeyStoreError(
                f"credential {path} does not hold a valid nkey seed", name=name, path=path
            ) from None

    def get(self, name: str) -> KeyPair | None:
        pair = self._read_credential(name)
        return pair if pair is not None else self.fallback.get(name)

    def get_or_create(self, name: str, role: Prefix | None = None) -> KeyPair:
        pair = self._read_credential(name)
        if pair is not None:
            return _check_role(name, pair, role, f"systemd credentials {self.credentials_dir}")
        return self.fallback.get_or_create(name, role)

    def delete(self, name: str) -> bool:
        path = self.credentials_dir / validate_key_name(name)
        if path.exists():
            raise KeyStoreError(
                f"key {name!r} comes from systemd credential {path}, which is read-only; "
                "remove its LoadCredential=/LoadCredentialEncrypted= line from the unit",
                name=name,
                path=path,
            )
        return self.fallback.delete(name)

    def names(self) -> list[str]:
        return sorted(set(self._credential_names()) | set(self.fallback.names()))


# --------------------------------------------------------------------------- OS keyring


def keyring_usable(backend: KeyringBackend | None) -> bool:
    """True when ``backend`` really stores secrets.

    Not keyring's fail or null backends, not a chainer with nothing to chain,
    and a priority above zero (keyring's own "not recommended" threshold).
    """
    if backend is None:
        return False
    try:
        from keyring.backends import chainer, fail, null
    except ImportError:  # pragma: no cover - keyring is a dependency
        return False
    if isinstance(backend, fail.Keyring | null.Keyring):
        return False
    try:
        if isinstance(backend, chainer.ChainerBackend) and not backend.backends:
            return False
        priority = float(backend.priority)
    except Exception:  # a backend's priority probe raises when it is not viable
        return False
    return priority > 0


def _desktop_keyring_reachable(env: Mapping[str, str]) -> bool:
    # On Linux the keyrings worth using live on the session D-Bus; without a
    # session bus there is nothing to find, and probing could start helpers.
    if sys.platform in ("darwin", "win32"):
        return True
    return bool(env.get("DBUS_SESSION_BUS_ADDRESS")) or bool(env.get("PYTHON_KEYRING_BACKEND"))


def detect_keyring(
    env: Mapping[str, str] | None = None, *, timeout: float = _KEYRING_PROBE_TIMEOUT
) -> KeyringBackend | None:
    """The OS keyring backend if a usable one exists, else None.

    Never hangs and never prompts: it skips the probe where no desktop session
    can exist, and gives up after ``timeout`` seconds (a D-Bus service that does
    not answer). Only backend selection runs here; unlocking a locked
    collection, which may prompt, happens on first use, in a desktop session.
    """
    env = os.environ if env is None else env
    if not _desktop_keyring_reachable(env):
        return None
    result: list[KeyringBackend | None] = []

    def probe() -> None:
        try:
            import keyring

            result.append(keyring.get_keyring())
        except Exception as exc:  # any backend import/probe failure means "no keyring"
            log.debug("keyring detection failed: %s", exc)
            result.append(None)

    thread = threading.Thread(target=probe, name="meshnode-keyring-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive() or not result:
        log.warning("keyring detection did not finish within %.1fs; not using it", timeout)
        return None
    backend = result[0]
    return backend if keyring_usable(backend) else None


class KeyringKeyStore:
    """Seeds in the OS keyring: service ``"meshnode"``, user ``"<scope>/<name>"``.

    The keyring cannot list entries, so the names are kept in one more entry,
    ``"<scope>/.names"`` (a JSON list; ``.`` cannot start a key name).
    """

    kind = "keyring"

    def __init__(self, backend: KeyringBackend, scope: str) -> None:
        self.backend = backend
        self.scope = scope
        self._lock = threading.Lock()

    @staticmethod
    def scope_for(data_dir: Path) -> str:
        """A stable per-node scope: a short hash of the absolute data directory."""
        absolute = os.path.abspath(os.fspath(data_dir))
        return hashlib.sha256(absolute.encode("utf-8", "surrogateescape")).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"KeyringKeyStore({type(self.backend).__name__}, scope={self.scope!r})"

    def describe(self) -> str:
        cls = type(self.backend)
        return (
            f"OS keyring {cls.__module__}.{cls.__qualname__}, "
            f"service {KEYRING_SERVICE!r}, entries {self.scope}/<name>"
        )

    def _user(self, name: str) -> str:
        return f"{self.scope}/{validate_key_name(name)}"

    def _call(self, what: str, name: str, fn: Callable[[], object]) -> object:
        try:
            return fn()
        except Exception as exc:
            # Exception text from a backend never includes the secret we pass it.
            raise KeyStoreError(
                f"keyring {what} of key {name!r} failed: {type(exc).__name__}: {exc}", name=name
            ) from None

    def _index(self) -> list[str]:
        raw = self._call(
            "read",
            ".names",
            lambda: self.backend.get_password(KEYRING_SERVICE, f"{self.scope}/.names"),
        )
        if not isinstance(raw, str):
            return []
        try:
            names = json.loads(raw)
        except ValueError:
            return []
        if not isinstance(names, list):
            return []
        return sorted({n for n in names if isinstance(n, str) and _KEY_NAME.fullmatch(n)})

    def _save_index(self, names: list[str]) -> None:
        value = json.dumps(sorted(set(names)))
        self._call(
            "write",
            ".names",
            lambda: self.backend.set_password(KEYRING_SERVICE, f"{self.scope}/.names", value),
        )

    def get(self, name: str) -> KeyPair | None:
        user = self._user(name)
        raw = self._call("read", name, lambda: self.backend.get_password(KEYRING_SERVICE, user))
        if raw is None:
            return None
        if not isinstance(raw, str):
            raise KeyStoreError(f"keyring entry {user!r} is not a string", name=name)
        try:
            return KeyPair.from_seed(raw)
        except NkeyError:
            raise KeyStoreError(
                f"keyring entry {KEYRING_SERVICE!r}/{user!r} does not hold a valid nkey seed",
                name=name,
            ) from None

    def get_or_create(self, name: str, role: Prefix | None = None) -> KeyPair:
        user = self._user(name)
        where = f"keyring entry {user!r}"
        with self._lock:
            existing = self.get(name)
            if existing is not None:
                return _check_role(name, existing, role, where)
            pair = KeyPair.generate(role or Prefix.USER)
            seed = pair.seed
            self._call(
                "write", name, lambda: self.backend.set_password(KEYRING_SERVICE, user, seed)
            )
            # Key first, index second: a crash between them leaves a key that a
            # later get_or_create finds and indexes, never an index without a key.
            index = self._index()
            if name not in index:
                self._save_index([*index, name])
        log.info("created key %s (%s) in the OS keyring", name, pair.public_key)
        return pair

    def delete(self, name: str) -> bool:
        user = self._user(name)
        with self._lock:
            if self.get(name) is None:
                removed = False
            else:
                self._call(
                    "delete", name, lambda: self.backend.delete_password(KEYRING_SERVICE, user)
                )
                removed = True
            index = self._index()
            if name in index:
                self._save_index([n for n in index if n != name])
        return removed

    def names(self) -> list[str]:
        return self._index()


# --------------------------------------------------------------------------- selection

KeyringProbe = Callable[[], "KeyringBackend | None"]


def open_keystore(
    backend: str,
    data_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    keyring_probe: KeyringProbe | None = None,
    system_service: bool | None = None,
) -> KeyStore:
    """Open the key store named by ``[keystore] backend``.

    ``keyring_probe`` returns the keyring backend to use (default:
    :func:`detect_keyring` over ``env``); ``system_service`` overrides the
    detection of :func:`meshnode.config.is_system_service`. Both exist so the
    choice made by ``auto`` can be tested without a desktop session.

    Raises :class:`KeyStoreUnavailable` when an explicitly named backend cannot
    be used here, ValueError for an unknown backend name.
    """
    env = os.environ if env is None else env
    data_dir = Path(data_dir)

    def probe() -> KeyringBackend | None:
        found = keyring_probe() if keyring_probe is not None else detect_keyring(env)
        return found if keyring_usable(found) else None

    creds = env.get("CREDENTIALS_DIRECTORY", "")
    if backend == "file":
        return FileKeyStore(data_dir)
    if backend == "systemd-credentials":
        if not creds:
            raise KeyStoreUnavailable(
                "keystore backend 'systemd-credentials' needs $CREDENTIALS_DIRECTORY; "
                "run under systemd with LoadCredential=/LoadCredentialEncrypted=, "
                "or choose another [keystore] backend"
            )
        return SystemdCredentialsKeyStore(Path(creds), FileKeyStore(data_dir))
    if backend == "keyring":
        found = probe()
        if found is None:
            raise KeyStoreUnavailable(
                "keystore backend 'keyring' needs a usable OS keyring (a desktop "
                "session's Secret Service, macOS Keychain, Windows Credential Locker); "
                "none was found. Use backend 'file' or 'systemd-credentials' on a server"
            )
        return KeyringKeyStore(found, KeyringKeyStore.scope_for(data_dir))
    if backend == "auto":
        if creds:
            return SystemdCredentialsKeyStore(Path(creds), FileKeyStore(data_dir))
        service = is_system_service(env) if system_service is None else system_service
        if not service:
            found = probe()
            if found is not None:
                return KeyringKeyStore(found, KeyringKeyStore.scope_for(data_dir))
        return FileKeyStore(data_dir)
    raise ValueError(
        f"unknown keystore backend {backend!r}: expected auto, keyring, systemd-credentials or file"
    )
