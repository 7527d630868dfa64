"""The platform services' signing keys, shared by every service node of a mesh.

Callers pin each service's key on first use (``Node.service_call``), so two
service nodes answering the same queue group must sign as the same service:
they load the same seeds from a directory the operator distributes to each
(``[services] key_dir``), one owner-only file per service, ``<name>.nk``.
"""

from __future__ import annotations

from pathlib import Path

from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.transport.errors import EmbeddedMeshError
from meshnode.transport.meshkeys import load_or_create_key

__all__ = ["SERVICE_NAMES", "ServiceKeyError", "load_service_keys"]

SERVICE_NAMES = ("registry", "presence", "tasks", "artifacts", "feeds")
"""The services a service node runs, each with its own signing key."""


class ServiceKeyError(RuntimeError):
    """A shared service key is missing or unreadable."""


def load_service_keys(key_dir: Path, *, create: bool = False) -> dict[str, KeyPair]:
    """The services' keys from ``key_dir`` (``<name>.nk`` each), by service name.

    ``create`` makes missing seeds (the tool that sets a mesh up); a service node
    loads with ``create=False`` and is told which file is missing, because a key
    it invented alone would not match its peers'.
    """
    if create:
        key_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    keys: dict[str, KeyPair] = {}
    for name in SERVICE_NAMES:
        path = key_dir / f"{name}.nk"
        if not create and not path.exists():
            raise ServiceKeyError(
                f"[services] key_dir: {path} is missing; copy the mesh's shared service keys "
                f"there (every service node needs the same {', '.join(SERVICE_NAMES)} keys)"
            )
        try:
            keys[name] = load_or_create_key(path, Prefix.USER)
        except (EmbeddedMeshError, OSError) as exc:
            raise ServiceKeyError(f"[services] key_dir: {path}: {exc}") from exc
    return keys
