"""Finding counterparts: ``ctx.discover(...)`` and ``ctx.resolve(name)``.

A plugin names the agent it wants to work with the way a person does (``echo``,
"whoever offers ``summarize``", "an agent with the ``translation``
capability"), and the node turns that into an agent the registry knows, by
**resolution** (§14.4): every result is a manifest the registry (or this node,
for its own agents) answered, with the endpoint subjects it carries; no id or
subject is ever built from a name.

* :meth:`AgentDirectory.discover` sends a §6.3 discover query (§9.3 filters,
  AND) and returns :class:`~meshnode.agent.AgentInfo` records. Answers are
  remembered for ``settings.resolve_ttl_s`` per query, one look-up in flight at
  a time (:class:`~meshnode.node.singleflight.SingleFlightCache`: a herd of
  handlers asking the same spends one of the agent's registry budget, §16.1),
  and each manifest found is handed to the manifest cache, so the request that
  follows needs no second look-up.
* :meth:`AgentDirectory.resolve` takes what a handler was given: an agent id
  (``U...``: its manifest, local or from the registry), the name of an agent
  hosted on this node (its ``[agents.<name>]`` table), or a display name known
  to the registry (exactly one match; none is :class:`~meshnode.agent.AgentNotFound`,
  several is :class:`~meshnode.agent.AmbiguousAgent`, listing them).

The registry's ``name`` filter is meshnode's extension of §9.3; a registry
that ignores it answers every agent, so names are matched here again and the
listing is paged through (at most ``MAX_NAME_PAGES`` pages).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from meshnode.agent import AgentInfo, AgentNotFound, AmbiguousAgent
from meshnode.node.resolver import NO_RESPONDERS
from meshnode.node.singleflight import SingleFlightCache
from meshnode.protocol import subjects
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import is_valid_public

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent
    from meshnode.node.port import NodePort
    from meshnode.node.resolver import ManifestCache

__all__ = ["MAX_NAME_PAGES", "AgentDirectory", "agent_info"]

#: How many pages of a name look-up are read from a registry that ignores the filter.
MAX_NAME_PAGES = 10
_PAGE = 500


def agent_info(manifest: Mapping[str, Any], *, local: bool) -> AgentInfo:
    """The record a handler gets for one resolved manifest."""
    node = manifest.get("node")
    offerings = manifest.get("offerings")
    caps = manifest.get("capabilities")
    availability = manifest.get("availability")
    return AgentInfo(
        id=str(manifest.get("id")),
        name=str(manifest.get("name") or ""),
        node=str(node.get("id")) if isinstance(node, Mapping) and node.get("id") else None,
        capabilities=tuple(c for c in caps if isinstance(c, str)) if isinstance(caps, list) else (),
        offerings=tuple(
            str(o["id"]) for o in offerings if isinstance(o, Mapping) and isinstance(o.get("id"), str)
        ) if isinstance(offerings, list) else (),
        availability=availability if isinstance(availability, str) else ("online" if local else None),
        local=local,
        manifest=manifest,
    )


class AgentDirectory:
    """Discovery and name resolution for the agents a node hosts."""

    def __init__(self, node: NodePort, manifests: ManifestCache) -> None:
        self.node = node
        self.manifests = manifests
        self._queries: SingleFlightCache[str, list[dict[str, Any]]] = SingleFlightCache(capacity=1024)
        #: Registry discover queries sent (each page), for tests and metrics.
        self.queries = 0

    async def close(self) -> None:
        await self._queries.close()

    # -- discover ----------------------------------------------------------------------

    async def discover(
        self,
        requester: HostedAgent,
        *,
        capability: str | Sequence[str] | None = None,
        offering: str | None = None,
        name: str | None = None,
        tags: Sequence[str] | None = None,
        availability: str | None = None,
        limit: int = 50,
        exported_by: str | None = None,
        **filters: Any,
    ) -> list[AgentInfo]:
        """Agents matching every filter given (§9.3, AND), as the registry answers.

        ``capability`` is one tag or several (all required); ``offering`` an
        offering id; ``name`` a display name; ``availability`` a presence
        value (``online``...); further §9.3 filters (``node``, ``owner``,
        ``version``, ``trust_tier``...) pass as keywords. This node's own
        agents are listed like any other (the registry knows them too).
        ``exported_by`` names another tenant whose discovery was exported to
        this node's (§15.2): its registry answers instead of this tenant's.
        """
        query: dict[str, Any] = {k: v for k, v in filters.items() if v is not None}
        if capability is not None:
            query["capabilities"] = [capability] if isinstance(capability, str) else list(capability)
        if offering is not None:
            query["offering_id"] = offering
        if name is not None:
            query["name"] = name
        if tags is not None:
            query["tags"] = list(tags)
        if availability is not None:
            query["availability"] = availability
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ProtocolError("INVALID_QUERY", "limit: must be a positive integer", {"field": "limit"})
        manifests = await self._search(requester, query, limit, exported_by)
        return [agent_info(m, local=m.get("id") in self.node.by_id) for m in manifests]

    async def query(
        self, requester: HostedAgent, query: dict[str, Any], *, exported_by: str | None = None
    ) -> dict[str, Any]:
        """One §6.3 discover query as sent (a page: ``agents`` and ``cursor``), by
        this tenant's registry or, with ``exported_by``, by that tenant's exported
        discovery (§15.2). Not cached: for a person asking (``meshnode discover``).

        Raises ProtocolError ``INVALID_QUERY`` for a malformed tenant name, and
        ``AGENT_UNAVAILABLE`` naming the export to configure when no registry
        answers on the tenant's subject (its discovery is not exported here).
        """
        if exported_by is None:
            return await self.node.service_call(requester, subjects.REGISTRY_DISCOVER, "discover", query)
        try:
            subject = subjects.external_discover(exported_by)
        except subjects.SubjectError:
            raise ProtocolError(
                "INVALID_QUERY", f"exported_by: {exported_by!r} cannot name a tenant", {"field": "exported_by"}
            ) from None
        try:
            return await self.node.service_call(requester, subject, "discover", query)
        except ProtocolError as exc:
            if exc.code != "AGENT_UNAVAILABLE" or (exc.details or {}).get("reason") != NO_RESPONDERS:
                raise
            # No responders: the subject leads nowhere in this account. Say what
            # opens it rather than "no service answers on mesh.external...".
            raise ProtocolError(
                "AGENT_UNAVAILABLE",
                f"tenant {exported_by!r} has not exported its discovery to this node's tenant"
                f" (nothing answers on {subject}): the mesh's operator adds [[mesh.embedded.exports]]"
                f' from = "{exported_by}", to = this tenant, discover = true, and restarts the mesh node',
                {"reason": NO_RESPONDERS, "exported_by": exported_by, "subject": subject},
            ) from None

    async def _search(
        self, requester: HostedAgent, query: dict[str, Any], limit: int, exported_by: str | None = None
    ) -> list[dict[str, Any]]:
        # Per asking agent: what the registry lists depends on who asks (private
        # agents are listed to their own owner only, §8.6).
        key = json.dumps([requester.agent_id, query, limit, exported_by], sort_keys=True, default=str)

        async def load() -> tuple[list[dict[str, Any]], float]:
            return await self._pages(requester, query, limit, exported_by), self.node.settings.resolve_ttl_s

        return list(await self._queries.get(key, load))

    async def _pages(
        self, requester: HostedAgent, query: dict[str, Any], limit: int, exported_by: str | None
    ) -> list[dict[str, Any]]:
        """Up to ``limit`` matches, paged; a ``name`` filter is applied here too."""
        name = query.get("name")
        found: list[dict[str, Any]] = []
        cursor: str | None = None
        for _ in range(MAX_NAME_PAGES if name is not None else 1):
            page_query = {**query, "limit": _PAGE if name is not None else limit}
            if cursor is not None:
                page_query["cursor"] = cursor
            self.queries += 1
            answer = await self.query(requester, page_query, exported_by=exported_by)
            agents = answer.get("agents")
            for manifest in agents if isinstance(agents, list) else ():
                if not isinstance(manifest, dict) or not is_valid_public(manifest.get("id")):
                    continue
                if name is not None and manifest.get("name") != name:
                    continue
                # Known now: the request that follows needs no second look-up.
                # Not another tenant's: of those only the exported answer, and
                # this tenant's registry says which (a request to the rest
                # would wait out its whole timeout: no route, no answer).
                if exported_by is None:
                    self.manifests.remember(manifest)
                found.append(manifest)
            next_cursor = answer.get("cursor")
            if len(found) >= limit or not isinstance(next_cursor, str) or not next_cursor:
                break
            cursor = next_cursor
        return found[:limit]

    # -- resolve ------------------------------------------------------------------------

    async def resolve(self, requester: HostedAgent, target: str) -> AgentInfo:
        """One agent, from an id, a local agent name or a registry display name."""
        if not isinstance(target, str) or not target:
            raise AgentNotFound(target, "an agent is named by a non-empty string")
        local = self.node.by_id.get(target) or self.node.agents.get(target)
        if local is not None:
            return agent_info(local.manifest, local=True)
        if is_valid_public(target):
            return agent_info(await self.manifests.resolve(requester, target), local=False)
        # Two is enough to tell "one" from "several"; a few more name them.
        matches = await self._search(requester, {"name": target}, 5)
        if not matches:
            here = ", ".join(sorted(n for n in self.node.agents if n != "cli")) or "none"
            raise AgentNotFound(
                target,
                f"no agent named {target!r}: not an agent of this node (local agents: {here}) and"
                " the registry lists none by that name (an unlisted agent is reached by its id)",
            )
        if len(matches) > 1:
            raise AmbiguousAgent(target, [agent_info(m, local=False) for m in matches])
        return agent_info(matches[0], local=False)
