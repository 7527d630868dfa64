"""Artifact store limits and owner resolution (§7.5.2): how much an owner may keep, and who owns a writer.

Split out of :mod:`.artifacts` (issue #16); re-exported from there.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import orjson

from meshnode.protocol import subjects
from meshnode.protocol.artifacts import DEFAULT_RETENTION_S
from meshnode.protocol.errors import ProtocolError
from meshnode.transport.errors import NotFound
from meshnode.transport.jetstream import KeyValue

from .base import ServiceContext

__all__ = ["ArtifactLimits", "OwnerResolver", "check_limits", "registry_owner_resolver"]

#: The agent id in, its owner out (None: not a registered agent).
OwnerResolver = Callable[[str], Awaitable[str | None]]


@dataclass(frozen=True)
class ArtifactLimits:
    """Per-owner quota, per-object limit and lifetimes (§7.5.2; deployment-specific)."""

    quota_bytes: int = 1024**3
    quota_objects: int = 10_000
    max_object_bytes: int = 256 * 1024**2
    default_retention_s: int = DEFAULT_RETENTION_S
    max_retention_s: int = 365 * 86_400
    upload_idle_s: float = 3600.0
    sweep_interval_s: float = 300.0
    #: Continuation messages (chunks, ranged fetches) per sender per minute.
    transfer_limit: int = 12_000


def registry_owner_resolver(ctx: ServiceContext) -> OwnerResolver:
    """Resolve owners by reading the registry's KV bucket (for a store without a registry)."""
    kv: KeyValue | None = None

    async def owner_of(agent_id: str) -> str | None:
        nonlocal kv
        if kv is None:
            kv = await ctx.connection.jetstream.key_value(subjects.KV_REGISTRY)
        try:
            entry = await kv.get(agent_id)
        except NotFound:
            return None
        try:
            manifest = orjson.loads(entry.value or b"")
        except orjson.JSONDecodeError:
            return None
        owner = manifest.get("owner") if isinstance(manifest, dict) else None
        return owner if isinstance(owner, str) and owner else None

    return owner_of


def check_limits(limits: ArtifactLimits, usage: Mapping[str, int], size: int, retention_s: int) -> None:
    """Refuse a write of ``size`` bytes kept ``retention_s`` against ``limits``, given ``usage``
    (:meth:`~.artifacts.ArtifactService.usage_of`: stored plus reserved bytes and objects)."""
    if size > limits.max_object_bytes:
        raise ProtocolError(
            "PAYLOAD_TOO_LARGE",
            f"one object may hold at most {limits.max_object_bytes} bytes",
            {"limit": "max_object_bytes", "max": limits.max_object_bytes, "size": size},
        )
    if retention_s > limits.max_retention_s:
        raise ProtocolError(
            "QUOTA_EXCEEDED",
            f"retention beyond {limits.max_retention_s} s is not offered by this store",
            {"limit": "retention_s", "quota": limits.max_retention_s, "requested": retention_s},
        )
    used_bytes = usage["bytes"] + usage["reserved_bytes"]
    used_objects = usage["objects"] + usage["reserved_objects"]
    if used_objects + 1 > limits.quota_objects:
        raise ProtocolError(
            "QUOTA_EXCEEDED",
            f"the owner is at its limit of {limits.quota_objects} objects",
            {"limit": "objects", "quota": limits.quota_objects, "used": used_objects, "requested": 1},
        )
    if used_bytes + size > limits.quota_bytes:
        raise ProtocolError(
            "QUOTA_EXCEEDED",
            f"the owner's storage quota of {limits.quota_bytes} bytes would be exceeded",
            {"limit": "bytes", "quota": limits.quota_bytes, "used": used_bytes, "requested": size},
        )
