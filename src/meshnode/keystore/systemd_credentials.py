"""The ``systemd-credentials`` key store backend: read-only keys from ``$CREDENTIALS_DIRECTORY``.

Part of :mod:`meshnode.keystore` (split by backend, issue #16), which re-exports it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from meshnode.protocol.nkeys import KeyPair, NkeyError, Prefix

from .base import (
    _KEY_NAME,
    KeyStoreError,
    _check_role,
    validate_key_name,
)
from .file_store import FileKeyStore

# One logger for the whole key store, as before the split (issue #16).
log = logging.getLogger("meshnode.keystore")


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
