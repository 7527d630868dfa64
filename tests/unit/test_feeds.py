"""Feeds, pure parts (§6.6a, §18.3): payloads, the owner check, state ordering, lookups,
the MESH_FEED binding and consumer names."""

from __future__ import annotations

import pytest
from nats.js.api import RetentionPolicy

from meshnode.protocol import subjects
from meshnode.protocol.envelope import sign_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.feeds import (
    FeedRefused,
    check_feed_envelope,
    check_feed_kind,
    feed_envelope,
    feed_payload,
    lookup_request,
    lookup_response,
    parse_feed_payload,
    parse_lookup_request,
    supersedes,
)
from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.transport.streams import feed_state_bucket_config, feed_stream_config

OWNER = KeyPair.generate(Prefix.USER)
OTHER = KeyPair.generate(Prefix.USER)


def test_payload_is_topic_kind_data_never_a_domain_event() -> None:
    assert feed_payload("status", "state", {"a": 1}) == {"topic": "status", "kind": "state", "data": {"a": 1}}
    assert parse_feed_payload({"topic": "status", "kind": "stream", "data": None}) is not None
    assert parse_feed_payload({"domain": "x", "event_type": "y", "data": {}}) is None
    assert parse_feed_payload({"topic": "a.b", "kind": "state"}) is None
    assert parse_feed_payload({"topic": "status", "kind": "latest"}) is None
    for bad_topic in ("a.b", "", "*", "x" * 129, "bad topic"):
        with pytest.raises(ValueError):
            feed_payload(bad_topic, "state", 1)
    with pytest.raises(ValueError):
        check_feed_kind("latest")


def test_the_feed_envelope_is_an_emit_without_a_recipient() -> None:
    env = feed_envelope(OWNER.public_key, "status", "state", {"x": 1}, now_ms=1_700_000_000_000)
    assert env["type"] == "emit" and env["from"] == OWNER.public_key and "to" not in env
    with pytest.raises(ValueError):
        feed_envelope("not-a-key", "status", "state", 1, now_ms=0)


def test_every_reader_checks_the_owner_and_the_topic() -> None:
    subject = subjects.feed_subject(OWNER.public_key, "status")
    good = sign_envelope(feed_envelope(OWNER.public_key, "status", "state", 1, now_ms=0), OWNER)
    assert check_feed_envelope(good, subject).kind == "state"
    cases = {
        "not_owner": sign_envelope(feed_envelope(OTHER.public_key, "status", "state", 1, now_ms=0), OTHER),
        "topic_mismatch": sign_envelope(feed_envelope(OWNER.public_key, "other", "state", 1, now_ms=0), OWNER),
        "not_an_emit": {**good, "type": "request"},
        "bad_payload": {**good, "payload": {"domain": "d", "event_type": "t"}},
    }
    for reason, env in cases.items():
        with pytest.raises(FeedRefused) as err:
            check_feed_envelope(env, subject)
        assert err.value.reason == reason
    with pytest.raises(FeedRefused) as err:
        check_feed_envelope(good, subjects.FEED_GET)
    assert err.value.reason == "not_a_feed"


def test_a_state_value_is_replaced_only_by_a_newer_one() -> None:
    older = feed_envelope(OWNER.public_key, "status", "state", 1, now_ms=1_000)
    newer = feed_envelope(OWNER.public_key, "status", "state", 2, now_ms=2_000)
    assert supersedes(older, None)
    assert supersedes(newer, older) and not supersedes(older, newer)
    assert not supersedes(newer, newer)  # the same envelope twice is not an update
    same_ms = [feed_envelope(OWNER.public_key, "status", "state", n, now_ms=3_000) for n in range(3)]
    ordered = sorted(same_ms, key=lambda e: e["id"])
    assert supersedes(ordered[2], ordered[1]) and not supersedes(ordered[0], ordered[1])


def test_lookup_shapes() -> None:
    assert lookup_request(OWNER.public_key, "status") == {"agent": OWNER.public_key, "topic": "status"}
    assert parse_lookup_request({"agent": OWNER.public_key, "topic": "status"}) == (OWNER.public_key, "status")
    for bad in (None, {"agent": "x", "topic": "status"}, {"agent": OWNER.public_key, "topic": "a.b"}):
        with pytest.raises(ProtocolError) as err:
            parse_lookup_request(bad)
        assert err.value.code == "INVALID_QUERY"
    assert lookup_response(None) == {"found": False, "envelope": None}
    assert lookup_response({"id": "x"}) == {"found": True, "envelope": {"id": "x"}}


def test_mesh_feed_binds_the_four_token_grammar_only() -> None:
    config = feed_stream_config(1)
    assert config.name == "MESH_FEED"
    assert config.subjects == ["mesh.feed.*.*"]  # never mesh.feed.>: that captures mesh.feed.get
    assert config.retention == RetentionPolicy.INTEREST
    assert (config.duplicate_window or 0) >= 120
    bucket = feed_state_bucket_config(1)
    assert bucket.bucket == "mesh_feed_state" and bucket.history == 1


def test_feed_consumer_names_are_one_per_subscription() -> None:
    agent = OTHER.public_key
    assert subjects.feed_consumer_name(agent) == f"mesh_feed_{agent}"
    all_feeds = subjects.feed_consumer_name(agent, subjects.feed_pattern(OWNER.public_key))
    one = subjects.feed_consumer_name(agent, subjects.feed_pattern(OWNER.public_key, "status"))
    assert all_feeds != one and all_feeds.startswith(f"mesh_feed_{agent}_") and len(all_feeds.split("_")[-1]) == 16
    for bad in ("mesh.feed.get", "mesh.event.a.b", f"mesh.feed.{OWNER.public_key}.a.b", "mesh.feed.*.*"):
        with pytest.raises(subjects.SubjectError):
            subjects.feed_consumer_name(agent, bad)
