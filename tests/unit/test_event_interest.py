"""The emit side's interest hint (§18.3): whether any durable consumer of MESH_EVENTS
retains a domain, from a listing of the consumers' filters shared for a while."""

from __future__ import annotations

import asyncio

from meshnode.node.pubsub import INTEREST_LISTING_TTL_MS, PubSub
from meshnode.protocol import subjects
from tests.fakes import FakeNode


async def test_the_filters_are_listed_once_per_window_and_read_for_every_domain() -> None:
    node = FakeNode()
    js = node.connection.jetstream
    js.consumer_filter_lists[subjects.MESH_EVENTS] = [["mesh.event.billing.*"], ["mesh.event.metering.>"]]
    pubsub = PubSub(node.as_port())
    # Many first emits at once (agents starting together): one listing between them.
    answers = await asyncio.gather(*(pubsub._domain_retained(d) for d in ("billing", "demo", "metering") * 20))
    assert answers == [True, False, True] * 20
    assert js.calls["consumer_filters"] == 1
    # A subscription made meanwhile counts once the window has passed.
    js.consumer_filter_lists[subjects.MESH_EVENTS].append(["mesh.event.demo.>"])
    node.clock += INTEREST_LISTING_TTL_MS - 1
    assert not await pubsub._domain_retained("demo")
    node.clock += 1
    assert await pubsub._domain_retained("demo")
    assert js.calls["consumer_filters"] == 2
    # A consumer without a filter reads the whole stream: every domain is retained.
    js.consumer_filter_lists[subjects.MESH_EVENTS] = [[]]
    node.clock += INTEREST_LISTING_TTL_MS
    assert await pubsub._domain_retained("anything")
