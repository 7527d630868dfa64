"""Agent lists in pages (meshnode.daemon.paging, meshnode.admin.client.call_listing):
Status and Agents.List answer at any roster size (at 10,000 agents the whole list
was larger than an admin reply may be)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from meshnode.admin.client import LISTING_ATTEMPTS, AdminClient, call_listing, merge_pages
from meshnode.admin.protocol import InvalidParameter
from meshnode.admin.server import AdminServer, CallContext, MethodRegistry
from meshnode.daemon.paging import agent_page_params, page_of
from meshnode.node.metrics import LatencyHistogram, loop_text, merge_exposition, prometheus_text


def _entry(index: int) -> dict[str, Any]:
    return {"name": f"a{index:03d}", "pad": "x" * 90}


ENTRY_BYTES = len(orjson.dumps(_entry(0))) + 1


def test_a_page_holds_what_fits_its_budget_and_says_where_the_next_begins() -> None:
    built: list[int] = []

    def entry_at(index: int) -> dict[str, Any]:
        built.append(index)
        return _entry(index)

    entries, following = page_of(10, entry_at, 0, budget=3 * ENTRY_BYTES)
    assert [e["name"] for e in entries] == ["a000", "a001", "a002"] and following == 3
    entries, following = page_of(10, entry_at, 9, budget=3 * ENTRY_BYTES)
    assert [e["name"] for e in entries] == ["a009"] and following is None
    assert set(built) == {0, 1, 2, 3, 9}  # the page's entries, and the one that did not fit: never the rest


def test_a_limit_cuts_a_page_and_one_entry_always_goes() -> None:
    entries, following = page_of(10, _entry, 2, limit=2)
    assert [e["name"] for e in entries] == ["a002", "a003"] and following == 4
    entries, following = page_of(10, _entry, 0, budget=1)  # an entry larger than the budget: alone
    assert len(entries) == 1 and following == 1
    everything, following = page_of(10, _entry, 0, budget=None)  # in the daemon's process: no bound
    assert len(everything) == 10 and following is None
    assert page_of(0, _entry, 0) == ([], None)
    assert page_of(3, _entry, 5) == ([], None)  # past the end (agents removed meanwhile)


@pytest.mark.parametrize(
    ("params", "field"),
    [({"agents_offset": -1}, "agents_offset"), ({"agents_offset": "2"}, "agents_offset"),
     ({"agents_offset": True}, "agents_offset"), ({"agents_limit": 0}, "agents_limit")],
)
def test_page_parameters_are_checked_by_name(params: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidParameter, match=field):
        agent_page_params(params)
    assert agent_page_params({}) == (0, None)


class _Roster:
    """A listing method over a roster of ``size`` agents, three to a page,
    whose version moves on the first ``changes`` pages after the first."""

    def __init__(self, size: int, changes: int = 0) -> None:
        self.size, self.changes, self.version = size, changes, 0

    async def list(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        offset = params.get("agents_offset", 0)
        if offset and self.changes:
            self.changes -= 1
            self.version += 1  # an agent added or removed between two pages
        entries, following = page_of(self.size, _entry, offset, limit=3)
        return {"node": "N", "agents": entries, "agents_next": following, "roster_version": self.version}


async def _listed(sock_path: Path, roster: _Roster) -> Any:
    registry = MethodRegistry()
    registry.add("Agents.List", roster.list)
    async with AdminServer(sock_path, methods=registry), AdminClient(sock_path) as client:
        return await call_listing(client, "Agents.List", {})


async def test_every_page_is_read_into_one_answer(short_tmp_path: Path) -> None:
    result = await _listed(short_tmp_path / "a.sock", _Roster(8))
    assert [e["name"] for e in result["agents"]] == [f"a{i:03d}" for i in range(8)]
    assert result["node"] == "N" and result["agents_next"] is None and "roster_changed" not in result


async def test_a_roster_change_between_pages_starts_the_listing_again(short_tmp_path: Path) -> None:
    result = await _listed(short_tmp_path / "a.sock", _Roster(8, changes=2))
    assert [e["name"] for e in result["agents"]] == [f"a{i:03d}" for i in range(8)]
    assert "roster_changed" not in result
    endless = await _listed(short_tmp_path / "b.sock", _Roster(8, changes=10 * LISTING_ATTEMPTS))
    assert endless["roster_changed"] is True  # said, never hidden


def test_prometheus_pages_merge_into_one_family_each() -> None:
    def agent(name: str) -> str:
        return prometheus_text([(name, f"U{name}", {"completed": 1}, LatencyHistogram())], {}) + loop_text(
            None, {name: (0, 64)}, {name: (0, 0)}
        )

    node_part = prometheus_text([], {"heartbeats": 3}, {}) + loop_text({"lag_s": 0.0, "max_lag_s": 0.1, "blocks": {}}, {})
    merged = merge_exposition([node_part, agent("a") + agent("b"), agent("c")])
    lines = merged.splitlines()
    types = [line for line in lines if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))  # one HELP and TYPE per family
    assert sum(line.startswith("# HELP ") for line in lines) == len(types)
    for family in ("meshnode_agent_events_total", "meshnode_agent_in_flight", "meshnode_handler_duration_ms"):
        at = [i for i, line in enumerate(lines) if line.startswith(family)]
        assert at == list(range(at[0], at[0] + len(at))), family  # its samples together
    events = [line for line in lines if line.startswith("meshnode_agent_events_total")]
    assert [e.split('agent="')[1][0] for e in events] == ["a", "b", "c"]  # in page order
    assert sum(line.startswith("meshnode_loop_lag_seconds ") for line in lines) == 1 and 'meshnode_node_events_total{event="heartbeats"} 3' in merged


def test_pages_merge_a_list_by_joining_and_a_mapping_by_name() -> None:
    listed = merge_pages([{"n": 1, "agents": [1, 2], "agents_next": 2}, {"n": 2, "agents": [3], "agents_next": None}])
    assert listed == {"n": 1, "agents": [1, 2, 3], "agents_next": None}
    named = merge_pages([{"agents": {"a": 1}, "agents_next": 1}, {"agents": {"b": 2}, "agents_next": None}])
    assert named["agents"] == {"a": 1, "b": 2}
