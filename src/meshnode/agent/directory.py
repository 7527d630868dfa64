"""What ``ctx.discover(...)`` and ``ctx.resolve(name)`` answer, and how they fail."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshnode.protocol.errors import ProtocolError

__all__ = ["AgentInfo", "AgentNotFound", "AmbiguousAgent"]


@dataclass(frozen=True)
class AgentInfo:
    """One agent as resolution found it (§14.4): from the registry's answer, or
    this node's own manifest for an agent hosted here. ``id`` is what
    :meth:`Context.request` takes; ``manifest`` is the record verbatim (its
    ``endpoints`` are the subjects the node sends to)."""

    id: str
    name: str
    node: str | None
    capabilities: tuple[str, ...]
    offerings: tuple[str, ...]
    #: Presence as the registry joined it (``online``...), None when it did not say.
    availability: str | None
    #: Hosted by this node (requests to it are delivered locally, §4.7).
    local: bool
    manifest: Mapping[str, Any] = field(repr=False, compare=False)


class AgentNotFound(ProtocolError):
    """No agent answers to the name (``NOT_FOUND``, ``details.name``)."""

    def __init__(self, name: object, message: str) -> None:
        super().__init__("NOT_FOUND", message, {"name": name, "reason": "unknown_agent"})
        self.name = name


class AmbiguousAgent(ProtocolError):
    """Several agents answer to the name (``INVALID_QUERY``, ``details.candidates``):
    pick one by id, or narrow with :meth:`Context.discover`'s filters."""

    def __init__(self, name: str, candidates: Sequence[AgentInfo]) -> None:
        listed = "; ".join(f"{c.id} on node {c.node or '?'}" for c in candidates)
        super().__init__(
            "INVALID_QUERY",
            f"more than one agent is named {name!r} ({listed}): name one by its id, or"
            " narrow with ctx.discover(name=..., node=..., capability=...)",
            {"name": name, "reason": "ambiguous_name", "candidates": [c.id for c in candidates]},
        )
        self.name = name
        self.candidates = tuple(candidates)
