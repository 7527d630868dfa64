"""Other agents' manifests, as the registry gives them (AgentMesh §14.4).

Every request the node sends needs its target's manifest (its inbox, its
offerings' schemas and limits for the pre-flight). :class:`ManifestCache`
remembers each for ``ttl_s`` and keeps the registry's budget for the agents'
own use: the look-ups are the platform's bookkeeping, so

* one look-up per target is in flight, however many requests want it
  (:class:`~meshnode.node.singleflight.SingleFlightCache`; 64 concurrent first
  requests from one agent used to make 64 look-ups and spend its 60-a-minute
  budget, failing most of them RATE_LIMITED);
* a manifest is refreshed in the background from ``refresh_ahead`` of its
  lifetime on, while callers keep using it; a refresh that fails (RATE_LIMITED
  included) keeps the cached manifest until it expires and is tried again after
  the registry's ``retry_after_ms`` (a second otherwise);
* a look-up the registry answers RATE_LIMITED is retried after its
  ``retry_after_ms`` while that fits in ``settings.registry_timeout_s``, so a
  caller sees RATE_LIMITED only when its agent's budget stays spent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshnode.node.singleflight import SingleFlightCache
from meshnode.protocol import subjects
from meshnode.protocol.errors import ProtocolError

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent
    from meshnode.node.port import NodePort

__all__ = ["NOT_GRANTED", "NO_RESPONDERS", "ManifestCache", "discover_one"]

#: ``details.reason`` of the AGENT_UNAVAILABLE a node raises for a service subject
#: its own credential does not grant (nothing was sent).
NOT_GRANTED = "not_granted"
#: ``details.reason`` of the AGENT_UNAVAILABLE a node raises when nothing listens
#: on a service subject (the broker said so at once: no responders).
NO_RESPONDERS = "no_responders"


def not_granted(exc: ProtocolError) -> bool:
    return exc.code == "AGENT_UNAVAILABLE" and (exc.details or {}).get("reason") == NOT_GRANTED


async def discover_one(node: NodePort, requester: HostedAgent, target: str) -> dict[str, Any] | None:
    """``target``'s manifest through ``mesh.registry.discover`` (``agent_ids`` filter),
    or None when the registry lists it to nobody (unlisted, private, unknown).

    For a mesh whose credentials grant discovery but no ``mesh.registry.get.*``,
    as spec §14.3's example does; a lookup by id sees unlisted agents too.
    """
    found = await node.service_call(
        requester, subjects.REGISTRY_DISCOVER, "discover", {"agent_ids": [target], "limit": 1}
    )
    agents = found.get("agents")
    for manifest in agents if isinstance(agents, list) else ():
        if isinstance(manifest, dict) and manifest.get("id") == target:
            return manifest
    return None


def _retry_in(error: BaseException | None) -> float:
    """When to try a failed refresh again: when the registry says, else in a second."""
    if isinstance(error, ProtocolError) and error.retry_after_ms:
        return max(error.retry_after_ms / 1000, 0.05)
    return 1.0


class ManifestCache:
    """The manifests of agents hosted elsewhere, by agent id, looked up once at a time."""

    def __init__(
        self,
        node: NodePort,
        *,
        ttl_s: float = 30.0,
        refresh_ahead: float = 0.75,
        capacity: int = 50_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self.ttl_s = ttl_s
        self._cache: SingleFlightCache[str, dict[str, Any]] = SingleFlightCache(
            capacity=capacity, refresh_ahead=refresh_ahead, retry_in=_retry_in, clock=clock
        )
        #: Registry look-ups made (each attempt), for tests and metrics.
        self.lookups = 0

    async def resolve(self, requester: HostedAgent, target: str) -> dict[str, Any]:
        """``target``'s manifest: cached, or from the one registry look-up in flight
        (made on ``requester``'s behalf, signed by its key)."""

        async def load() -> tuple[dict[str, Any], float]:
            return await self._lookup(requester, target), self.ttl_s

        return await self._cache.get(target, load)

    def remember(self, manifest: dict[str, Any], ttl_s: float | None = None) -> None:
        """Cache a manifest known otherwise (a benchmark's pinned target), for
        ``ttl_s`` seconds (default: the cache's own)."""
        self._cache.remember(manifest["id"], manifest, self.ttl_s if ttl_s is None else ttl_s)

    async def close(self) -> None:
        await self._cache.close()

    async def _lookup(self, requester: HostedAgent, target: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.node.settings.registry_timeout_s
        while True:
            self.lookups += 1
            try:
                manifest = await self.node.service_call(
                    requester, subjects.registry_get(target), "discover", {"agent_id": target}
                )
            except ProtocolError as exc:
                if not_granted(exc):
                    # A mesh built elsewhere may grant discovery only (§14.3's example).
                    manifest_or_none = await discover_one(self.node, requester, target)
                    if manifest_or_none is None:
                        raise ProtocolError("NOT_FOUND", f"the registry lists no agent {target}") from None
                    return manifest_or_none
                wait = _retry_in(exc)
                if exc.code != "RATE_LIMITED" or time.monotonic() + wait > deadline:
                    raise
                await asyncio.sleep(wait)  # the registry said when; the budget refills
                continue
            if manifest.get("id") != target:
                raise ProtocolError("IDENTITY_MISMATCH", "registry answered for another agent")
            return manifest
