"""The shared streams' consumer ceiling, against a real nats-server.

nats-server 2.15 limits every stream that sets no ``max_consumers`` to 1,000
consumers (and reads 0 or -1 as "its default"): the 1,001st agent with an event
subscription on one mesh failed to start ("maximum consumers limit reached",
10026). The platform's streams now set the ceiling themselves, a stream made
by an earlier version is updated in place, and the consumer service lists a
stream's consumer names once per window rather than every consumer's whole
info for every creation.
"""

from __future__ import annotations

import dataclasses

import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from meshnode.protocol import subjects
from meshnode.transport.errors import ConsumerLimit, translated
from meshnode.transport.jetstream import JetStream
from meshnode.transport.streams import (
    DEFAULT_STREAM_LIMITS,
    StreamLimits,
    ensure_mesh_streams,
    mesh_stream_configs,
)

from .conftest import NodeFactory

pytestmark = pytest.mark.integration

#: nats-server 2.15's default ceiling for a stream that sets none.
SERVER_DEFAULT = 1000


async def test_more_than_the_servers_default_of_consumers_fit_on_mesh_events(node_factory: NodeFactory) -> None:
    service = await node_factory(0, role="service")
    js = JetStream(service.client.jetstream(), service.client)
    # A MESH_EVENTS as an earlier version made it: no max_consumers of its own.
    old = next(c for c in mesh_stream_configs(1) if c.name == subjects.MESH_EVENTS)
    await service.client.jetstream().add_stream(dataclasses.replace(old, max_consumers=None))

    outcomes = await ensure_mesh_streams(js, 1)
    assert outcomes[subjects.MESH_EVENTS] == "updated", outcomes
    info = await service.client.jetstream().stream_info(subjects.MESH_EVENTS)
    assert info.config.max_consumers == DEFAULT_STREAM_LIMITS.max_consumers

    native = service.client.jetstream()
    for i in range(SERVER_DEFAULT + 5):
        await native.add_consumer(subjects.MESH_EVENTS, ConsumerConfig(
            durable_name=f"c{i}", filter_subject=f"mesh.event.ceiling.{i}", ack_policy=AckPolicy.EXPLICIT,
            mem_storage=True,  # nothing for the broker to write at its stop
        ))
    # Every name, across the names API's pages (besides ours, MESH_METERING's source).
    names = await js.consumer_names(subjects.MESH_EVENTS)
    assert sorted(n for n in names if not n.startswith("JS_SRC_")) == sorted(f"c{i}" for i in range(SERVER_DEFAULT + 5))
    assert len(set(names)) == len(names)

    # A ceiling of its own is kept, and refused past, named by its error.
    # (The server does not count its own JS_SRC_ consumer of a stream source.)
    lowered = await ensure_mesh_streams(js, 1, StreamLimits(max_consumers=SERVER_DEFAULT + 6))
    assert lowered[subjects.MESH_EVENTS] == "updated", lowered
    await native.add_consumer(subjects.MESH_EVENTS, ConsumerConfig(
        durable_name="last", filter_subject="mesh.event.ceiling.last", ack_policy=AckPolicy.EXPLICIT,
    ))
    with pytest.raises(ConsumerLimit), translated():
        await native.add_consumer(subjects.MESH_EVENTS, ConsumerConfig(
            durable_name="one-too-many", filter_subject="mesh.event.ceiling.more", ack_policy=AckPolicy.EXPLICIT,
        ))
