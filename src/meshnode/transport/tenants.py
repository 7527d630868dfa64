"""Tenants (§15): each a NATS account; what one exports to another, as account JWT links."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from meshnode.protocol import subjects
from meshnode.protocol.nkeys import Prefix, is_valid_public

from .jwt import (
    ServiceExport,
    ServiceImport,
)
from .permissions import (
    AGENT_INBOX,
    DISCOVER,
    EXTERNAL_GET,
    REGISTRY_GET,
)

__all__ = [
    "DEFAULT_TENANT",
    "TenantExport",
    "account_links",
    "check_tenant_name",
    "external_discover_subject",
    "external_get_subject",
    "imported_agents",
]



DEFAULT_TENANT = "mesh"
"""The name of the mesh's own account, the tenant of every node enrolled without one."""

_TENANT_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")


def check_tenant_name(name: object) -> str:
    """``name`` if it can name a tenant (it becomes a subject token and a file name)."""
    if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name):
        raise ValueError(
            f"tenant name {name!r} must be 1-32 of a-z 0-9 _ -, starting with a letter"
        )
    return name


def external_discover_subject(tenant: str) -> str:
    """Where an importing tenant reaches ``tenant``'s exported discovery (§15.2 step 2)."""
    return subjects.external_discover(check_tenant_name(tenant))


def external_get_subject(tenant: str, agent_id: str) -> str:
    """Where an importing tenant's registry looks up an agent ``tenant`` exported to it."""
    if not is_valid_public(agent_id, Prefix.USER):
        raise ValueError(f"{agent_id!r} is not an agent id")
    return EXTERNAL_GET.replace("*", check_tenant_name(tenant), 1).replace("*", agent_id)


def imported_agents(tenant: str, exports: Iterable[TenantExport]) -> dict[str, str]:
    """Agent id -> the subject ``tenant``'s registry resolves it on, for every agent
    another tenant exported to ``tenant``."""
    return {
        agent: external_get_subject(export.tenant, agent)
        for export in exports
        if export.to == tenant
        for agent in export.agents
    }


@dataclass(frozen=True, slots=True)
class TenantExport:
    """What one tenant makes reachable from another (§15.2); nothing else crosses.

    ``agents``: the inboxes (``mesh.agent.<id>.inbox``) the importing tenant's
    nodes may send to, under the same subject; the importing tenant's registry
    resolves them through the exporting one's (``mesh.registry.get.<id>``,
    imported as :func:`external_get_subject`). ``discover``: the exporting
    tenant's registry answers discovery queries the importer sends on
    :func:`external_discover_subject` (its own registry stays its own).
    An export is one-way: an answer travels back to the requester's inbox,
    so a conversation needs the requester's agent exported the other way too.
    """

    tenant: str
    to: str
    agents: tuple[str, ...] = ()
    discover: bool = False

    def __post_init__(self) -> None:
        check_tenant_name(self.tenant)
        check_tenant_name(self.to)
        if self.tenant == self.to:
            raise ValueError(f"tenant {self.tenant} cannot export to itself")
        for agent in self.agents:
            if not is_valid_public(agent, Prefix.USER):
                raise ValueError(f"exported agent {agent!r} is not an agent id (U...)")


def account_links(
    accounts: Mapping[str, str], exports: Iterable[TenantExport]
) -> dict[str, tuple[list[ServiceExport], list[ServiceImport]]]:
    """The exports and imports each tenant's account JWT carries.

    ``accounts`` maps tenant name to account public key. Raises ValueError
    for an export naming a tenant that does not exist.
    """
    links: dict[str, tuple[list[ServiceExport], list[ServiceImport]]] = {
        name: ([], []) for name in accounts
    }
    for export in exports:
        for name in (export.tenant, export.to):
            if name not in accounts:
                raise ValueError(f"export names tenant {name!r}, which is not configured")
        offered, _ = links[export.tenant]
        _, taken = links[export.to]
        wanted: list[tuple[str, str]] = []
        for agent in export.agents:
            wanted.append((AGENT_INBOX.format(agent=agent), AGENT_INBOX.format(agent=agent)))
            wanted.append(
                (REGISTRY_GET.replace("*", agent), external_get_subject(export.tenant, agent))
            )
        if export.discover:
            wanted.append((DISCOVER, external_discover_subject(export.tenant)))
        for subject, local in wanted:
            if all(e.subject != subject for e in offered):
                offered.append(ServiceExport(subject))
            entry = ServiceImport(accounts[export.tenant], subject, local)
            if entry not in taken:
                taken.append(entry)
    return links
