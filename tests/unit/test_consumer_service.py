"""The consumer service's derivation (#22): a request names a kind and its
parameter; the consumer's name and whole configuration follow from it, and from
the agent that signed it, never from what the requester would like them to be."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.api import ConsumerConfig

from meshnode.protocol import subjects
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.services.consumers import (
    LISTING_TTL_S,
    TASK_CONSUMER_IDLE_S,
    _Holdings,
    consumer_owner,
    consumer_spec,
)
from meshnode.testing import eventually_async
from meshnode.transport.jetstream import ConsumerSpec
from meshnode.transport.permissions import node_inbox_prefix
from tests.fakes import ManualClock

NODE = KeyPair.generate(Prefix.USER).public_key
OTHER_NODE = KeyPair.generate(Prefix.USER).public_key
AGENT = KeyPair.generate(Prefix.USER).public_key
DELIVER = f"{node_inbox_prefix(NODE)}.c.x"


def test_an_event_consumer_is_named_by_its_agent_and_the_hash_of_its_filter() -> None:
    stream, spec = consumer_spec(NODE, AGENT, {"kind": "event", "pattern": "billing.*", "deliver_subject": DELIVER})
    assert stream == "MESH_EVENTS"
    assert spec.name == subjects.event_consumer_name(AGENT, "billing.*")
    assert (spec.filter_subject, spec.deliver_subject, spec.max_deliver, spec.durable) == (
        "mesh.event.billing.*", DELIVER, 5, True)
    assert not spec.deliver_all  # §18.6: deliver new unless replay was asked
    _, replay = consumer_spec(NODE, AGENT, {"kind": "event", "pattern": "billing.*", "deliver_subject": DELIVER,
                                            "replay": True})
    assert replay.deliver_all


def test_task_consumers_are_the_requesters_and_reaped_when_idle() -> None:
    stream, spec = consumer_spec(NODE, AGENT, {"kind": "task_stream", "task_id": "t-1", "deliver_subject": DELIVER})
    assert stream == "MESH_TASKS"
    assert spec.name == f"mesh_task_t-1_{AGENT}_stream" and spec.filter_subject == "mesh.task.t-1.stream"
    assert not spec.durable and spec.inactive_threshold_s == TASK_CONSUMER_IDLE_S and spec.max_deliver == 3
    _, deleting = consumer_spec(NODE, AGENT, {"kind": "task_update", "task_id": "t-1", "op": "delete"})
    assert deleting.name == f"mesh_task_t-1_{AGENT}"


@pytest.mark.parametrize(
    ("payload", "member"),
    [
        ({"kind": "mirror"}, "payload.kind"),
        ({"kind": "event", "pattern": "a.b", "deliver_subject": f"{node_inbox_prefix(OTHER_NODE)}.c.x"},
         "payload.deliver_subject"),
        ({"kind": "event", "pattern": "a.b", "deliver_subject": f"{node_inbox_prefix(NODE)}.>"},
         "payload.deliver_subject"),
        ({"kind": "event", "pattern": "a.b"}, "payload.deliver_subject"),
        ({"kind": "event", "pattern": "mesh.event.a", "deliver_subject": DELIVER}, "payload.kind"),
        ({"kind": "feed", "subject": "mesh.task.x.update", "deliver_subject": DELIVER}, "payload.kind"),
        ({"kind": "task_update", "task_id": "a.b", "deliver_subject": DELIVER}, "payload.kind"),
        ({"kind": "task_update", "deliver_subject": DELIVER}, "payload.task_id"),
        ({"kind": "event", "pattern": "a", "deliver_subject": DELIVER, "replay": "yes"}, "payload.replay"),
    ],
)
def test_a_request_outside_the_forms_is_refused_naming_the_member(payload: dict[str, object], member: str) -> None:
    with pytest.raises(ProtocolError) as info:
        consumer_spec(NODE, AGENT, payload)
    assert info.value.code == "INVALID_ENVELOPE" and info.value.details["member"] == member


def test_drift_names_each_field_that_moved() -> None:
    spec = ConsumerSpec("mesh_task_manager", "mesh.task.*.update", max_deliver=-1)
    assert spec.drift(ConsumerConfig.from_response(spec.config().as_dict())) == []
    retargeted = ConsumerConfig.from_response(
        ConsumerSpec("mesh_task_manager", "mesh.task.x.update", max_deliver=1, deliver_subject="_INBOX_X.y")
        .config().as_dict())
    assert [d.split()[0] for d in spec.drift(retargeted)] == ["filter_subject", "deliver_subject", "max_deliver"]


def test_every_consumer_form_names_its_owner() -> None:
    names = [
        subjects.event_consumer_name(AGENT, "billing.*"),
        subjects.feed_consumer_name(AGENT),
        subjects.feed_consumer_name(AGENT, f"mesh.feed.{OTHER_NODE}.*"),
        subjects.task_update_consumer_name("t-1", AGENT),
        subjects.task_update_consumer_name("t-1", AGENT) + "_stream",
        # A task id that itself contains an agent-shaped token still names its requester.
        subjects.task_update_consumer_name(f"x_{OTHER_NODE}", AGENT),
    ]
    assert [consumer_owner(name) for name in names] == [AGENT] * len(names)
    for foreign in ("JS_SRC_g07BLAX3", "drain", "mesh_event_short_1234", "mesh_task_t-1", f"mesh_feed_{AGENT}x"):
        assert consumer_owner(foreign) is None, foreign


class Listing:
    """The stream's consumer names, counting how often they are listed."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.calls = 0
        self.gate: asyncio.Event | None = None

    async def __call__(self) -> list[str]:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        return list(self.names)


async def test_holdings_list_once_per_window_and_count_their_own_changes_on_top() -> None:
    mine = [subjects.event_consumer_name(AGENT, f"p{i}") for i in range(3)]
    listing, clock = Listing([*mine, subjects.event_consumer_name(OTHER_NODE, "p")]), ManualClock()
    holdings = _Holdings(listing, clock)
    assert await holdings.held(AGENT) == 3 and await holdings.held(OTHER_NODE) == 1
    holdings.created(AGENT)
    holdings.deleted(OTHER_NODE)
    holdings.deleted(OTHER_NODE)  # never below zero
    clock.now = LISTING_TTL_S - 0.1
    assert (await holdings.held(AGENT), await holdings.held(OTHER_NODE), listing.calls) == (4, 0, 1)
    # Past the window the stream is listed again: what it says now counts.
    clock.now = LISTING_TTL_S
    assert (await holdings.held(AGENT), listing.calls) == (3, 2)
    # Fresh (before a refusal): listed at once, whatever the window says.
    listing.names = mine[:1]
    assert (await holdings.held(AGENT, fresh=True), listing.calls) == (1, 3)


async def test_concurrent_askers_share_one_listing() -> None:
    listing, clock = Listing([subjects.event_consumer_name(AGENT, "p")]), ManualClock()
    listing.gate = asyncio.Event()
    holdings = _Holdings(listing, clock)
    askers = [asyncio.ensure_future(holdings.held(AGENT)) for _ in range(5)]
    await eventually_async(lambda: listing.calls == 1, what="the first listing under way")
    listing.gate.set()
    assert await asyncio.gather(*askers) == [1] * 5
    assert listing.calls == 1
