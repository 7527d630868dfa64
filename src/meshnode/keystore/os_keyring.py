"""The ``keyring`` key store backend: the OS keyring, and detecting a usable one without hanging or prompting.

Part of :mod:`meshnode.keystore` (split by backend, issue #16), which re-exports it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from meshnode.protocol.nkeys import KeyPair, NkeyError, Prefix

if TYPE_CHECKING:
    from keyring.backend import KeyringBackend

from .base import (
    _KEY_NAME,
    _KEYRING_PROBE_TIMEOUT,
    KEYRING_SERVICE,
    KeyStoreError,
    _check_role,
    validate_key_name,
)

# One logger for the whole key store, as before the split (issue #16).
log = logging.getLogger("meshnode.keystore")


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
