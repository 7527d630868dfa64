"""Targets' manifests from the registry (§14.4) without a herd (issue #21).

One look-up per target in flight however many callers want it; refreshed ahead
of expiry without making a caller wait; a RATE_LIMITED refresh keeps serving the
cached manifest and is tried again when the registry says. The node is the
shared fake; the clock is a test's own; nothing sleeps before asserting.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from meshnode.node.resolver import ManifestCache
from meshnode.node.singleflight import SingleFlightCache
from meshnode.node.trust import VouchMemo
from meshnode.protocol import subjects
from meshnode.protocol.attestations import make_vouch
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair, Prefix
from tests.fakes import FakeNode, ManualClock

NOW = 1_800_000_000_000


class Registry:
    """A scripted ``mesh.registry.get.<target>``: counts look-ups, holds each one
    until ``release`` is set, and fails the next ``fail`` ones as told."""

    def __init__(self, node: FakeNode, target: str, manifest: dict[str, Any]) -> None:
        self.calls = 0
        self.manifest = manifest
        self.release = asyncio.Event()
        self.release.set()
        self.fail: list[ProtocolError] = []
        node.service_answers[subjects.registry_get(target)] = self.answer

    async def answer(self, payload: Any) -> dict[str, Any]:
        self.calls += 1
        await self.release.wait()
        if self.fail:
            raise self.fail.pop(0)
        return dict(self.manifest)


def _target() -> tuple[str, dict[str, Any]]:
    agent = KeyPair.generate(Prefix.USER).public_key
    return agent, {"id": agent, "endpoints": {"inbox": f"mesh.agent.{agent}.inbox"}}


async def _until(condition: Any) -> None:
    """Let the loop run until ``condition()`` holds (bounded)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    pytest.fail("condition never held")


async def test_64_concurrent_first_calls_make_one_registry_lookup() -> None:
    node = FakeNode(now_ms=NOW)
    target, manifest = _target()
    registry = Registry(node, target, manifest)
    registry.release.clear()  # the look-up stays in flight while all 64 arrive
    cache = ManifestCache(node.as_port())

    calls = [asyncio.ensure_future(cache.resolve(None, target)) for _ in range(64)]  # type: ignore[arg-type]
    await _until(lambda: registry.calls == 1)
    registry.release.set()
    results = await asyncio.gather(*calls)

    assert registry.calls == 1 and cache.lookups == 1
    assert all(r == manifest for r in results)
    assert await cache.resolve(None, target) == manifest  # type: ignore[arg-type]
    assert registry.calls == 1  # and the next one is answered from the cache


async def test_refresh_ahead_of_expiry_never_makes_a_caller_wait() -> None:
    node = FakeNode(now_ms=NOW)
    target, manifest = _target()
    registry = Registry(node, target, manifest)
    clock = ManualClock(1000.0)
    cache = ManifestCache(node.as_port(), ttl_s=30.0, refresh_ahead=0.75, clock=clock)
    assert await cache.resolve(None, target) == manifest  # type: ignore[arg-type]

    clock.now += 25.0  # past 3/4 of the lifetime, still valid
    registry.release.clear()
    registry.manifest = {**manifest, "description": "v2"}
    # Answered at once from the cache while the refresh is held in flight...
    assert await asyncio.wait_for(cache.resolve(None, target), 1.0) == manifest  # type: ignore[arg-type]
    await _until(lambda: registry.calls == 2)
    for _ in range(10):  # ...however many ask meanwhile: still one refresh
        assert await cache.resolve(None, target) == manifest  # type: ignore[arg-type]
    assert registry.calls == 2
    registry.release.set()
    await _until(lambda: cache._cache.peek(target) == registry.manifest)
    assert await cache.resolve(None, target) == registry.manifest  # type: ignore[arg-type]
    assert registry.calls == 2


async def test_a_rate_limited_refresh_keeps_the_cached_manifest_and_retries_later() -> None:
    node = FakeNode(now_ms=NOW)
    target, manifest = _target()
    registry = Registry(node, target, manifest)
    clock = ManualClock(1000.0)
    cache = ManifestCache(node.as_port(), ttl_s=30.0, refresh_ahead=0.75, clock=clock)
    await cache.resolve(None, target)  # type: ignore[arg-type]

    clock.now += 25.0
    # A refresh the registry refuses for longer than the look-up may wait.
    registry.fail = [ProtocolError("RATE_LIMITED", "spent", retry_after_ms=60_000)]
    assert await cache.resolve(None, target) == manifest  # type: ignore[arg-type]
    await _until(lambda: registry.calls == 2 and not cache._cache._inflight)
    # The caller never saw it; nor does the next, and no new look-up starts before retry_after.
    assert await cache.resolve(None, target) == manifest  # type: ignore[arg-type]
    assert registry.calls == 2
    clock.now += 4.0  # retry_after is past the expiry: nothing is tried before it
    assert await cache.resolve(None, target) == manifest  # type: ignore[arg-type]
    assert registry.calls == 2
    clock.now += 2.0  # expired now: the caller waits for a look-up, which succeeds
    registry.manifest = {**manifest, "description": "v2"}
    assert await cache.resolve(None, target) == registry.manifest  # type: ignore[arg-type]
    assert registry.calls == 3


async def test_a_rate_limited_first_lookup_is_retried_when_the_registry_says() -> None:
    node = FakeNode(now_ms=NOW)
    target, manifest = _target()
    registry = Registry(node, target, manifest)
    registry.fail = [ProtocolError("RATE_LIMITED", "spent", retry_after_ms=1)]
    cache = ManifestCache(node.as_port())
    assert await cache.resolve(None, target) == manifest  # type: ignore[arg-type]
    assert registry.calls == 2


async def test_errors_reach_every_waiting_caller_and_are_not_remembered() -> None:
    node = FakeNode(now_ms=NOW)
    target, manifest = _target()
    registry = Registry(node, target, manifest)
    registry.release.clear()
    registry.fail = [ProtocolError("NOT_FOUND", "no such agent")]
    cache = ManifestCache(node.as_port())
    calls = [asyncio.ensure_future(cache.resolve(None, target)) for _ in range(8)]  # type: ignore[arg-type]
    await _until(lambda: registry.calls == 1)
    registry.release.set()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, ProtocolError) and r.code == "NOT_FOUND" for r in results)
    assert registry.calls == 1
    assert await cache.resolve(None, target) == manifest  # type: ignore[arg-type]
    assert registry.calls == 2


async def test_a_manifest_for_another_agent_is_refused() -> None:
    node = FakeNode(now_ms=NOW)
    target, _ = _target()
    other, manifest = _target()
    Registry(node, target, manifest)
    with pytest.raises(ProtocolError) as refused:
        await ManifestCache(node.as_port()).resolve(None, target)  # type: ignore[arg-type]
    assert refused.value.code == "IDENTITY_MISMATCH"


async def test_a_caller_giving_up_does_not_cancel_the_lookup_for_the_others() -> None:
    cache: SingleFlightCache[str, int] = SingleFlightCache()
    release = asyncio.Event()
    loads = 0

    async def load() -> tuple[int, float]:
        nonlocal loads
        loads += 1
        await release.wait()
        return 7, 10.0

    impatient = asyncio.ensure_future(cache.get("k", load))
    patient = asyncio.ensure_future(cache.get("k", load))
    await _until(lambda: loads == 1)
    impatient.cancel()
    release.set()
    assert await patient == 7 and loads == 1
    assert cache.peek("k") == 7


async def test_the_vouch_memo_shares_the_single_flight() -> None:
    node_key, agent = KeyPair.generate(Prefix.USER), KeyPair.generate(Prefix.USER)
    sender = agent.public_key
    manifest = {"id": sender, "node": {"id": node_key.public_key,
                                       "attestation": make_vouch(node_key, sender, NOW - 1000, NOW + 3_600_000)}}
    node = FakeNode(now_ms=NOW)
    registry = Registry(node, sender, manifest)
    registry.release.clear()
    memo = VouchMemo(node.as_port())
    calls = [asyncio.ensure_future(memo.status(None, sender)) for _ in range(64)]  # type: ignore[arg-type]
    await _until(lambda: registry.calls == 1)
    registry.release.set()
    assert await asyncio.gather(*calls) == ["vouched"] * 64
    assert registry.calls == 1 and memo.lookups == 1
