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

The package holds one module per backend (:mod:`.file_store`,
:mod:`.systemd_credentials`, :mod:`.os_keyring`) beside what they share
(:mod:`.base`); this module chooses among them and re-exports every public name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from meshnode.config import is_system_service

if TYPE_CHECKING:
    from keyring.backend import KeyringBackend

from .base import (
    KEYRING_SERVICE,
    KeyStore,
    KeyStoreError,
    KeyStoreUnavailable,
    get_or_create_all,
    validate_key_name,
)
from .file_store import FileKeyStore
from .os_keyring import KeyringKeyStore, detect_keyring, keyring_usable
from .systemd_credentials import SystemdCredentialsKeyStore

__all__ = [
    "KEYRING_SERVICE",
    "FileKeyStore",
    "KeyStore",
    "KeyStoreError",
    "KeyStoreUnavailable",
    "KeyringKeyStore",
    "SystemdCredentialsKeyStore",
    "detect_keyring",
    "get_or_create_all",
    "keyring_usable",
    "open_keystore",
    "validate_key_name",
]


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
