"""ctx.resolve / ctx.discover (node/directory.py) against the one fake node: names
resolved through the registry's answers (§14.4), one look-up per query at a time
and cached, the local name first, clear errors for unknown and ambiguous names."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from meshnode.agent import AgentNotFound, AmbiguousAgent
from meshnode.node.directory import AgentDirectory
from meshnode.node.resolver import NO_RESPONDERS, ManifestCache
from meshnode.protocol import subjects
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair
from meshnode.services.query import parse_discover_query
from tests.fakes import FakeNode


class _Hosted:
    def __init__(self, name: str, manifest: dict[str, Any]) -> None:
        self.name = name
        self.agent_id = manifest["id"]
        self.manifest = manifest


def _manifest(name: str, *, caps: tuple[str, ...] = (), offerings: tuple[str, ...] = ("echo",)) -> dict[str, Any]:
    agent_id = KeyPair.generate().public_key
    return {"id": agent_id, "name": name, "node": {"id": "NODE"}, "capabilities": list(caps),
            "offerings": [{"id": o} for o in offerings], "endpoints": {"inbox": f"x.{agent_id}"}}


def _setup(registry: list[dict[str, Any]], *, honours_name: bool = True, page: int = 500) -> tuple[
        FakeNode, AgentDirectory, _Hosted, list[dict[str, Any]]]:
    node = FakeNode()
    me = _Hosted("finder", _manifest("finder"))
    node.agents["finder"] = me
    node.by_id[me.agent_id] = me
    queries: list[dict[str, Any]] = []

    async def discover(payload: Any) -> dict[str, Any]:
        queries.append(dict(payload))
        await asyncio.sleep(0)  # let a herd gather on the one look-up
        query = parse_discover_query({k: v for k, v in payload.items()
                                      if k != "cursor" and (honours_name or k != "name")})
        matches = [m for m in registry if query.matches(m)]
        start = next((i for i, m in enumerate(matches) if m["id"] == payload.get("cursor")), -1) + 1
        chunk = matches[start:start + min(page, query.limit)]
        more = start + len(chunk) < len(matches)
        return {"agents": chunk, "total": len(matches), **({"cursor": chunk[-1]["id"]} if more else {})}

    node.service_answers[subjects.REGISTRY_DISCOVER] = discover
    cache = ManifestCache(node)  # type: ignore[arg-type]
    return node, AgentDirectory(node, cache), me, queries  # type: ignore[arg-type]


async def test_a_name_resolves_to_the_registrys_manifest_once_for_a_herd() -> None:
    echo = _manifest("echo")
    node, directory, me, queries = _setup([echo, _manifest("other")])
    found = await asyncio.gather(*(directory.resolve(me, "echo") for _ in range(20)))  # type: ignore[arg-type]
    assert {f.id for f in found} == {echo["id"]} and not found[0].local
    assert found[0].manifest is echo  # the registry's answer, not a constructed id or inbox
    assert len(queries) == 1 and queries[0]["name"] == "echo"
    await directory.resolve(me, "echo")  # type: ignore[arg-type]
    assert len(queries) == 1  # cached
    # The manifest went to the manifest cache: a request to it needs no look-up.
    assert await directory.manifests.resolve(me, echo["id"]) is echo  # type: ignore[arg-type]
    assert all(kind == "discover" and subject == subjects.REGISTRY_DISCOVER for subject, kind, _ in node.service_calls)
    await directory.close()


async def test_local_names_and_ids_need_no_registry() -> None:
    node, directory, me, queries = _setup([])
    info = await directory.resolve(me, "finder")  # type: ignore[arg-type]
    assert info.local and info.id == me.agent_id
    assert (await directory.resolve(me, me.agent_id)).local  # type: ignore[arg-type]
    assert queries == []


async def test_unknown_and_ambiguous_names_say_so() -> None:
    twins = [_manifest("twin"), _manifest("twin")]
    _, directory, me, _ = _setup(twins)
    with pytest.raises(AgentNotFound) as unknown:
        await directory.resolve(me, "nobody")  # type: ignore[arg-type]
    assert unknown.value.code == "NOT_FOUND" and "local agents: finder" in unknown.value.message
    with pytest.raises(AmbiguousAgent) as ambiguous:
        await directory.resolve(me, "twin")  # type: ignore[arg-type]
    assert ambiguous.value.code == "INVALID_QUERY"
    assert sorted(ambiguous.value.details["candidates"]) == sorted(t["id"] for t in twins)


async def test_a_registry_that_ignores_the_name_filter_is_paged_and_filtered() -> None:
    crowd = [_manifest(f"agent-{i}") for i in range(7)]
    target = crowd[5]
    _, directory, me, queries = _setup(crowd, honours_name=False, page=2)
    assert (await directory.resolve(me, "agent-5")).id == target["id"]  # type: ignore[arg-type]
    assert len(queries) == 4  # pages of two until the listing ended


async def test_discover_passes_section_9_3_filters() -> None:
    scribe = _manifest("scribe", caps=("writing", "latin"), offerings=("copy",))
    _, directory, me, queries = _setup([scribe, _manifest("echo", caps=("writing",))])
    found = await directory.discover(me, capability=["writing", "latin"])  # type: ignore[arg-type]
    assert [f.id for f in found] == [scribe["id"]] and found[0].offerings == ("copy",)
    assert [f.name for f in await directory.discover(me, offering="echo")] == ["echo"]  # type: ignore[arg-type]
    await directory.discover(me, node="NODE", limit=3)  # type: ignore[arg-type]
    assert queries[-1] == {"node": "NODE", "limit": 3}


def test_registry_name_filter() -> None:
    query = parse_discover_query({"name": "echo"})
    assert query.matches({"id": "U1", "name": "echo"}) and not query.matches({"id": "U2", "name": "other"})


async def test_exported_by_asks_the_other_tenants_discovery_and_says_what_opens_it() -> None:
    theirs = _manifest("echo")
    node, directory, me, queries = _setup([_manifest("echo")])
    asked: list[dict[str, Any]] = []

    async def family(payload: Any) -> dict[str, Any]:
        asked.append(dict(payload))
        return {"agents": [theirs], "total": 1}

    node.service_answers[subjects.external_discover("family")] = family
    found = await directory.discover(me, offering="echo", exported_by="family")  # type: ignore[arg-type]
    assert [f.id for f in found] == [theirs["id"]] and queries == []  # not this tenant's registry
    assert asked == [{"offering_id": "echo", "limit": 50}]
    # Not remembered as a manifest: this tenant's registry resolves a request to
    # it (only an exported agent has a route; the rest are NOT_FOUND at once).
    async def not_exported(payload: Any) -> dict[str, Any]:
        raise ProtocolError("NOT_FOUND", "no such agent")

    node.service_answers[subjects.registry_get(theirs["id"])] = not_exported
    with pytest.raises(ProtocolError, match="no such agent"):
        await directory.manifests.resolve(me, theirs["id"])  # type: ignore[arg-type]
    # Cached apart from the same query to this tenant's own registry.
    assert [f.id for f in await directory.discover(me, offering="echo")] != [theirs["id"]]  # type: ignore[arg-type]
    assert len(asked) == 1 and len(queries) == 1

    async def nobody(payload: Any) -> dict[str, Any]:  # what the node raises on no responders
        raise ProtocolError("AGENT_UNAVAILABLE", "no service answers", {"reason": NO_RESPONDERS})

    node.service_answers[subjects.external_discover("work")] = nobody
    with pytest.raises(ProtocolError) as refused:
        await directory.discover(me, exported_by="work")  # type: ignore[arg-type]
    assert refused.value.code == "AGENT_UNAVAILABLE"
    assert 'from = "work", to = this tenant, discover = true' in refused.value.message
    assert refused.value.details["subject"] == "mesh.external.work.discover"
    with pytest.raises(ProtocolError) as bad:
        await directory.discover(me, exported_by="a.b")  # type: ignore[arg-type]
    assert bad.value.code == "INVALID_QUERY" and bad.value.details == {"field": "exported_by"}
    await directory.close()
