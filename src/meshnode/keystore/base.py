"""What every key store backend shares: the :class:`KeyStore` protocol, its errors and key names.

Part of :mod:`meshnode.keystore` (split by backend, issue #16), which re-exports it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from meshnode.protocol.nkeys import KeyPair, Prefix

# One logger for the whole key store, as before the split (issue #16).
log = logging.getLogger("meshnode.keystore")


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


def get_or_create_all(store: KeyStore, names: Sequence[str]) -> list[KeyPair]:
    """``store.get_or_create(name)`` of every name, in order: in one batch where
    the backend has one (the file store writes new keys side by side)."""
    batch = getattr(store, "get_or_create_many", None)
    if callable(batch):
        return list(batch(names))
    return [store.get_or_create(name) for name in names]


def _check_role(name: str, pair: KeyPair, role: Prefix | None, where: str) -> KeyPair:
    if role is not None and pair.role != role:
        raise KeyStoreError(
            f"key {name!r} in {where} is a {pair.role.name.lower()} key, "
            f"expected a {role.name.lower()} key",
            name=name,
        )
    return pair
