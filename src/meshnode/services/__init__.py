"""Platform services hosted on a service-role node: registry, presence, artifact
store, task manager and feeds (§9, §7.5, §10, §6.6a).

Each is a :class:`ServiceBase` built from a :class:`ServiceContext`. They are
wired together (and to the control plane) in one place, the daemon's
:func:`meshnode.daemon.platform.start_platform_services`.
"""

from __future__ import annotations

from meshnode.transport.streams import ensure_mesh_streams

from .base import ServiceBase, ServiceContext
from .presence import PresenceService
from .registry import RegistryService

__all__ = [
    "PresenceService",
    "RegistryService",
    "ServiceBase",
    "ServiceContext",
    "ensure_mesh_streams",
]
