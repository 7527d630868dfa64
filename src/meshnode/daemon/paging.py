"""Agent lists in pages: how the admin API answers Status and Agents.List at any roster size.

The admin protocol carries a reply of at most MAX_LINE_BYTES (one JSON line);
at 10,000 agents an agent list is larger. So a listing answers one page: as
many entries as fit in AGENTS_PAGE_BYTES, from ``agents_offset``, with
``agents_next`` (the next page's offset; null on the last), ``agents_total``
and ``roster_version``. :func:`meshnode.admin.client.call_listing` reads
every page.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from meshnode.admin.protocol import MAX_LINE_BYTES, InvalidParameter

__all__ = ["AGENTS_PAGE_BYTES", "agent_page_params", "page_of"]

#: How much of a reply one page of an agent list may take (the rest of Status is a few KB).
AGENTS_PAGE_BYTES = MAX_LINE_BYTES // 2


def agent_page_params(params: Mapping[str, Any]) -> tuple[int, int | None]:
    """``agents_offset`` (default 0) and ``agents_limit`` (default: as many as fit) of a paged listing."""
    offset = params.get("agents_offset", 0)
    if type(offset) is not int or offset < 0:
        raise InvalidParameter("agents_offset must be an integer >= 0 (the agents_next of the previous page)")
    limit = params.get("agents_limit")
    if limit is not None and (type(limit) is not int or limit < 1):
        raise InvalidParameter("agents_limit must be an integer >= 1")
    return offset, limit


def page_of(
    total: int,
    entry_at: Callable[[int], dict[str, Any]],
    offset: int,
    limit: int | None = None,
    budget: int | None = AGENTS_PAGE_BYTES,
) -> tuple[list[dict[str, Any]], int | None]:
    """Entries ``entry_at(offset)``, ``entry_at(offset + 1)``, … of a list of
    ``total``: as many as encode within ``budget`` bytes (at least one; None:
    no bound, for a caller in the daemon's process) and at most ``limit``.
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
