"""Long lists answered in pages that fit one reply.

A reply has a size bound: the admin protocol's line (MAX_LINE_BYTES), a mesh
message's ``max_payload``. A list that can outgrow it (an agent list at
10,000 agents, the rating ledger's charge lines) is answered a page at a
time: as many entries as encode within a byte budget, and the offset of the
next page. Used by the daemon's admin methods and by the platform services.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

__all__ = ["entries_within"]


def entries_within(
    total: int,
    entry_at: Callable[[int], dict[str, Any]],
    offset: int,
    *,
    limit: int | None = None,
    budget: int | None,
) -> tuple[list[dict[str, Any]], int | None]:
    """Entries ``entry_at(offset)``, ``entry_at(offset + 1)``, … of a list of
    ``total``: as many as encode within ``budget`` bytes (at least one; None:
    no bound, for a caller in the same process) and at most ``limit``.
    Returns them and the next page's offset (None: this page reaches the end).
    Only the entries of this page are built."""
    entries: list[dict[str, Any]] = []
    size = 0
    index = offset
    while index < total and (limit is None or len(entries) < limit):
        entry = entry_at(index)
        if budget is not None:
            cost = len(orjson.dumps(entry, default=str)) + 1  # its comma
            if entries and size + cost > budget:
                break
            size += cost
        entries.append(entry)
        index += 1
    return entries, (index if index < total else None)
