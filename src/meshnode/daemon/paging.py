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

from meshnode.admin.protocol import MAX_LINE_BYTES, InvalidParameter
from meshnode.pages import entries_within

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
    """One page of an admin reply's list (:func:`meshnode.pages.entries_within`),
    by default within :data:`AGENTS_PAGE_BYTES`."""
    return entries_within(total, entry_at, offset, limit=limit, budget=budget)
