"""The embedded mesh's signing keys: operator, system account, mesh account, tenants."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from meshnode.protocol.nkeys import KeyPair, NkeyError, Prefix

from .errors import EmbeddedMeshError
from .files import ensure_private_dir, read_private_file, write_private_file
from .tenants import DEFAULT_TENANT, check_tenant_name

__all__ = ["MeshKeys", "load_or_create_key", "load_or_create_mesh_keys"]

log = logging.getLogger("meshnode.transport.embedded")  # the name operators filter on


_OPERATOR_SEED_FILE = "operator.nk"
_SYSTEM_ACCOUNT_SEED_FILE = "system-account.nk"
_MESH_ACCOUNT_SEED_FILE = "mesh-account.nk"
_TENANT_SEED_FILE = "tenant-{name}.nk"

@dataclass(frozen=True, slots=True)
class MeshKeys:
    """The signing keys of an embedded mesh. They never leave this host."""

    operator: KeyPair
    system_account: KeyPair
    mesh_account: KeyPair
    tenants: Mapping[str, KeyPair] = field(default_factory=dict)
    """Account keys of the tenants beyond the mesh's own account (§15)."""

    def account(self, tenant: str | None = None) -> KeyPair:
        """The account key of ``tenant`` (None or :data:`DEFAULT_TENANT`: the mesh account)."""
        if tenant is None or tenant == DEFAULT_TENANT:
            return self.mesh_account
        try:
            return self.tenants[tenant]
        except KeyError:
            raise ValueError(f"no tenant named {tenant!r} is configured") from None


def load_or_create_key(path: Path, role: Prefix) -> KeyPair:
    """The nkey seed of ``role`` kept in ``path`` (owner-only), created on first use."""
    try:
        text = read_private_file(path)
    except FileNotFoundError:
        created = KeyPair.generate(role)
        try:
            write_private_file(path, created.seed + "\n", replace=False)
            log.info("created %s key %s in %s", role.name.lower(), created.public_key, path)
            return created
        except FileExistsError:
            text = read_private_file(path)  # another process created it first
    try:
        loaded = KeyPair.from_seed(text.strip())
    except NkeyError as exc:
        raise EmbeddedMeshError(f"{path} does not hold an nkey seed: {exc}") from None
    if loaded.role != role:
        raise EmbeddedMeshError(
            f"{path} holds a {loaded.role.name.lower()} seed, expected {role.name.lower()}"
        )
    return loaded


def load_or_create_mesh_keys(mesh_dir: Path, tenants: Iterable[str] = ()) -> MeshKeys:
    """Load the operator and account seeds from ``mesh_dir``, creating missing ones.

    A removed tenant's seed stays on disk (its account is simply not served),
    so configuring it again restores the same account.
    """
    ensure_private_dir(mesh_dir)
    return MeshKeys(
        operator=load_or_create_key(mesh_dir / _OPERATOR_SEED_FILE, Prefix.OPERATOR),
        system_account=load_or_create_key(mesh_dir / _SYSTEM_ACCOUNT_SEED_FILE, Prefix.ACCOUNT),
        mesh_account=load_or_create_key(mesh_dir / _MESH_ACCOUNT_SEED_FILE, Prefix.ACCOUNT),
        tenants={
            name: load_or_create_key(
                mesh_dir / _TENANT_SEED_FILE.format(name=check_tenant_name(name)), Prefix.ACCOUNT
            )
            for name in tenants
        },
    )
