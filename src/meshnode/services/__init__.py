"""Platform services hosted on a service-role node: registry and presence (§9).

:func:`start_platform_services` is the one call a hosting node needs: it
creates or updates the mesh's JetStream objects (§18.3, §18.4), then starts
the registry (which loads its cache before serving) and presence, wired to
each other: presence asks the registry who vouched for an agent, and
discovery joins presence for availability.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from .base import ServiceBase, ServiceContext
from .presence import PresenceService
from .registry import RegistryService
from .streams import ensure_mesh_streams

__all__ = [
    "PlatformServices",
    "PresenceService",
    "RegistryService",
    "ServiceBase",
    "ServiceContext",
    "ensure_mesh_streams",
    "start_platform_services",
]


@dataclass
class PlatformServices:
    """The running registry and presence of one service node."""

    registry: RegistryService
    presence: PresenceService

    async def stop(self) -> None:
        await self.registry.stop()
        await self.presence.stop()


async def start_platform_services(
    ctx: ServiceContext,
    *,
    require_connection_bound: bool = True,
    heartbeat_interval_s: float = 30.0,
    trust_tier_of: Callable[[str], str | None] | None = None,
    trusted_issuers: Collection[str] = (),
    imported: Mapping[str, str] | None = None,
) -> PlatformServices:
    """Ensure the mesh streams, then start registry and presence on ``ctx``."""
    await ensure_mesh_streams(ctx.connection.js, ctx.replicas)
    presence = PresenceService(ctx, heartbeat_interval_s)
    registry = RegistryService(
        ctx,
        require_connection_bound=require_connection_bound,
        presence=presence,
        trust_tier_of=trust_tier_of,
        trusted_issuers=trusted_issuers,
        imported=imported,
    )
    await registry.start()
    try:
        await presence.start()
    except BaseException:
        await registry.stop()
        raise
    return PlatformServices(registry, presence)
