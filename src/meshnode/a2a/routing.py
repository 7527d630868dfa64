"""How mesh work addresses A2A peers and carries an A2A call chain (no SDK imports:
the node imports this whether or not the ``a2a`` extra is installed)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshnode.a2a.extension import EXTENSION_URI

__all__ = ["A2A_TARGET_PREFIX", "chain_meta_of", "peer_name_of"]

#: How a hosted agent addresses a configured external A2A agent: ``a2a:<peer>``.
A2A_TARGET_PREFIX = "a2a:"


def peer_name_of(target: str) -> str | None:
    """The peer name of an ``a2a:<name>`` target, or None for a mesh target."""
    if isinstance(target, str) and target.startswith(A2A_TARGET_PREFIX):
        return target[len(A2A_TARGET_PREFIX):]
    return None


def chain_meta_of(envelope: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``meta[EXTENSION_URI]`` of a mesh envelope — ``{callChain, origin}``, set where
    work entered by A2A and carried into its mesh sub-requests — or None."""
    if not envelope:
        return None
    meta = envelope.get("meta")
    value = meta.get(EXTENSION_URI) if isinstance(meta, Mapping) else None
    return dict(value) if isinstance(value, Mapping) else None
