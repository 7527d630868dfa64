"""The subject map (§14, §18.3, §18.6): builders, token rules, parsers, the reserved prefix."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnode.protocol import subjects as S
from meshnode.protocol.nkeys import encode_public
from meshnode.protocol.subjects import SubjectError
from tests.conftest import load_fixture

AGENT = "UBMBH4BK6EIHQFVMHLSABFSQXB3JXUFZOXVZQTIERO33AD4HHAI3D7QP"
NODE = "UAKQRYZBYFOC65OQZVJ3QPCIERDTRNNZPMOJUYXC3DGPRCDWSKD4HV5A"
TASK = "0198c001-0000-7000-8000-00000000cafe"
DIGEST = "ab" * 32

BAD_TOKENS = ["", "a.b", "*", ">", "a b", "a\tb", "a\nb", "x*", "y>"]


def test_fixed_service_subjects() -> None:
    assert S.REGISTRY_REGISTER == "mesh.registry.register"
    assert S.REGISTRY_DEREGISTER == "mesh.registry.deregister"
    assert S.REGISTRY_DISCOVER == "mesh.registry.discover"
    assert S.PRESENCE_GET == "mesh.presence.get"
    assert S.FEED_GET == "mesh.feed.get"
    assert S.REGISTRY_DESCRIPTOR_PUT == "mesh.registry.descriptor.put"
    assert S.REGISTRY_EVAL_PUT == "mesh.registry.eval.put"
    assert [S.ARTIFACTS_PUT, S.ARTIFACTS_FETCH, S.ARTIFACTS_STAT, S.ARTIFACTS_REMOVE, S.ARTIFACTS_USAGE] == [
        "mesh.artifacts.put",
        "mesh.artifacts.fetch",
        "mesh.artifacts.stat",
        "mesh.artifacts.remove",
        "mesh.artifacts.usage",
    ]


def test_registry_subjects() -> None:
    assert S.registry_register() == "mesh.registry.register"
    assert S.registry_register(NODE) == f"mesh.registry.register.{NODE}"
    assert S.registry_get(AGENT) == f"mesh.registry.get.{AGENT}"
    assert S.registry_descriptor_get(AGENT) == f"mesh.registry.descriptor.get.{AGENT}"
    assert S.registry_descriptor_digest(DIGEST) == f"mesh.registry.descriptor.digest.{DIGEST}"
    assert S.registry_eval_get(AGENT) == f"mesh.registry.eval.get.{AGENT}"
    assert S.registry_eval_digest(DIGEST) == f"mesh.registry.eval.digest.{DIGEST}"
    with pytest.raises(SubjectError):
        S.registry_descriptor_digest("AB" * 32)
    with pytest.raises(SubjectError):
        S.registry_register("not-a-key")


def test_agent_and_task_subjects() -> None:
    assert S.agent_inbox(AGENT) == f"mesh.agent.{AGENT}.inbox"
    assert S.agent_inbox_guarded(AGENT) == f"mesh.agent.{AGENT}.inbox.guarded"
    assert S.task_update(TASK) == f"mesh.task.{TASK}.update"
    assert S.task_stream(TASK) == f"mesh.task.{TASK}.stream"


@pytest.mark.parametrize("bad", ["x.y", "*", ">", "", "a b", "x" * 129])
def test_task_subjects_refuse_non_token_ids(bad: str) -> None:
    # A wire-supplied task_id must never widen or move a publish.
    with pytest.raises(SubjectError):
        S.task_update(bad)
    with pytest.raises(SubjectError):
        S.task_stream(bad)


@pytest.mark.parametrize("bad", ["", "UNOTAKEY", AGENT.lower(), AGENT + ".x", "*", ">"])
def test_agent_positions_require_a_user_key(bad: str) -> None:
    for build in (S.agent_inbox, S.registry_get, S.metrics_subject, S.inbox_stream_name, S.inbox_consumer_name):
        with pytest.raises(SubjectError):
            build(bad)


def test_events() -> None:
    assert S.event_subject("scraping", "profile_found") == "mesh.event.scraping.profile_found"
    assert S.event_filter("scraping.*") == "mesh.event.scraping.*"
    assert S.event_filter(">") == "mesh.event.>"
    assert S.event_filter("billing.invoice_ready") == "mesh.event.billing.invoice_ready"
    for bad in BAD_TOKENS:
        with pytest.raises(SubjectError):
            S.event_subject(bad, "x")
        with pytest.raises(SubjectError):
            S.event_subject("x", bad)
    for bad_pattern in ("", "a..b", "a.>.b", "a b.c", "a.", ".a"):
        with pytest.raises(SubjectError):
            S.event_filter(bad_pattern)


def test_feeds_and_state_keys() -> None:
    assert S.feed_subject(AGENT, "status") == f"mesh.feed.{AGENT}.status"
    assert S.feed_pattern(AGENT) == f"mesh.feed.{AGENT}.*"
    assert S.feed_pattern(AGENT, "status") == f"mesh.feed.{AGENT}.status"
    assert S.feed_state_key(AGENT, "status") == f"{AGENT}.status"
    with pytest.raises(SubjectError):
        S.feed_subject(AGENT, "*")  # a wildcard is never a publish topic


def test_feeds_fixture_build_and_parse_cases() -> None:
    fixture = load_fixture("feeds.json")
    section = fixture["subjects"]
    assert section["lookup_subject"] == S.FEED_GET
    for case in section["build_cases"]:
        if case["verdict"] == "accept":
            assert S.feed_subject(case["agent"], case["topic"]) == case["subject"], case["id"]
        else:
            with pytest.raises(SubjectError):
                S.feed_subject(case["agent"], case["topic"])
    for case in section["parse_cases"]:
        parsed = S.parse_feed_subject(case["subject"])
        if case["verdict"] == "accept":
            assert parsed == (case["agent"], case["topic"]), case["id"]
        else:
            assert parsed is None, case["id"]
    for case in fixture["state_binding"]["kv_key_cases"]:
        assert S.feed_state_key(case["agent"], case["topic"]) == case["key"]


def test_presence_sessions_observability() -> None:
    assert S.heartbeat(NODE) == f"mesh.heartbeat.{NODE}"
    assert S.heartbeat(NODE, AGENT) == f"mesh.heartbeat.{NODE}.{AGENT}"
    assert S.session_subject(TASK, "message") == f"mesh.session.{TASK}.message"
    assert S.session_all(TASK) == f"mesh.session.{TASK}.>"
    assert S.TRACE_ALL == "mesh.trace.>"
    assert S.trace_subject("span") == "mesh.trace.span"
    assert S.trace_subject("a", "b") == "mesh.trace.a.b"
    assert S.metrics_subject(AGENT) == f"mesh.metrics.{AGENT}"
    assert S.log_subject(AGENT, "warn") == f"mesh.log.{AGENT}.warn"
    with pytest.raises(SubjectError):
        S.trace_subject()
    with pytest.raises(SubjectError):
        S.log_subject(AGENT, "warn.x")


def test_jetstream_names() -> None:
    assert S.inbox_stream_name(AGENT) == f"MESH_INBOX_{AGENT}"
    assert S.inbox_consumer_name(AGENT) == f"inbox_{AGENT}"
    assert S.task_update_consumer_name(TASK, AGENT) == f"mesh_task_{TASK}_{AGENT}"
    assert S.feed_consumer_name(AGENT) == f"mesh_feed_{AGENT}"
    assert (S.MESH_EVENTS, S.MESH_TASKS, S.MESH_REGISTRY, S.MESH_HEARTBEAT, S.FEED_STREAM) == (
        "MESH_EVENTS",
        "MESH_TASKS",
        "MESH_REGISTRY",
        "MESH_HEARTBEAT",
        "MESH_FEED",
    )


def test_event_consumer_name_is_the_cross_sdk_derivation() -> None:
    # Pinned by the other SDKs: sha256("billing.invoice_ready")[:16].
    assert S.event_consumer_name(AGENT, "billing.invoice_ready") == f"mesh_event_{AGENT}_99397ba4a29eec30"
    expected = hashlib.sha256(b"scraping.*").hexdigest()[:16]
    assert S.event_consumer_name(AGENT, "scraping.*") == f"mesh_event_{AGENT}_{expected}"
    with pytest.raises(SubjectError):
        S.event_consumer_name(AGENT, "mesh.event.billing.invoice_ready")


def test_reserved_peer_prefix() -> None:
    assert S.is_reserved("mesh.peer.instance1.x")
    assert S.is_reserved("mesh.peer")
    assert not S.is_reserved("mesh.peering.x")
    assert not S.is_reserved(S.agent_inbox(AGENT))
    for pattern in ("mesh.>", ">", "mesh.*.x", "mesh.peer.>", "*.peer.a", "mesh.peer.*"):
        assert S.subscription_overlaps_reserved(pattern), pattern
    for pattern in ("mesh.event.>", "mesh.*", "mesh.peer", "mesh.agent.*.inbox", "other.>"):
        assert not S.subscription_overlaps_reserved(pattern), pattern


def test_parsers() -> None:
    assert S.parse_inbox_subject(S.agent_inbox(AGENT)) == AGENT
    assert S.parse_inbox_subject(f"mesh.agent.{AGENT}.inbox.guarded") is None
    assert S.parse_inbox_subject("mesh.agent.notakey.inbox") is None
    assert S.parse_heartbeat_subject(S.heartbeat(NODE)) == (NODE, None)
    assert S.parse_heartbeat_subject(S.heartbeat(NODE, AGENT)) == (NODE, AGENT)
    assert S.parse_heartbeat_subject("mesh.heartbeat.phantom") is None
    assert S.parse_heartbeat_subject(f"mesh.heartbeat.{NODE}.x") is None
    assert S.parse_heartbeat_subject(f"mesh.heartbeat.{NODE}.{AGENT}.x") is None
    assert S.parse_task_subject(S.task_update(TASK)) == (TASK, "update")
    assert S.parse_task_subject(S.task_stream(TASK)) == (TASK, "stream")
    assert S.parse_task_subject(f"mesh.task.{TASK}.other") is None
    assert S.parse_register_subject(S.REGISTRY_REGISTER) == (False, None)
    assert S.parse_register_subject(S.registry_register(NODE)) == (True, NODE)
    assert S.parse_register_subject("mesh.registry.register.bogus") is None
    assert S.parse_register_subject("mesh.registry.discover") is None


@pytest.mark.parametrize("bad", BAD_TOKENS)
def test_check_token_refuses(bad: str) -> None:
    assert not S.is_valid_token(bad)
    with pytest.raises(SubjectError):
        S.check_token(bad, "x")


# --- properties -------------------------------------------------------------

keys = st.binary(min_size=32, max_size=32).map(encode_public)
ids = st.from_regex(r"[A-Za-z0-9_-]{1,128}", fullmatch=True)
tokens = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=".*>"), min_size=1, max_size=40)


def _tokens_ok(subject: str) -> bool:
    return all(part != "" and " " not in part for part in subject.split("."))


@given(keys, keys, ids, tokens, tokens)
def test_built_subjects_never_have_empty_tokens(agent: str, node: str, task_id: str, a: str, b: str) -> None:
    built = [
        S.agent_inbox(agent),
        S.registry_get(agent),
        S.registry_register(node),
        S.task_update(task_id),
        S.task_stream(task_id),
        S.event_subject(a, b),
        S.feed_subject(agent, task_id),
        S.heartbeat(node, agent),
        S.log_subject(agent, a),
        S.session_subject(task_id, a),
        S.trace_subject(a, b),
    ]
    for subject in built:
        assert _tokens_ok(subject), subject
        assert "*" not in subject and ">" not in subject
        assert not S.is_reserved(subject)


@given(keys, ids)
def test_parsers_invert_builders(agent: str, task_id: str) -> None:
    assert S.parse_inbox_subject(S.agent_inbox(agent)) == agent
    assert S.parse_task_subject(S.task_update(task_id)) == (task_id, "update")
    assert S.parse_feed_subject(S.feed_subject(agent, task_id)) == (agent, task_id)
    assert S.parse_heartbeat_subject(S.heartbeat(agent)) == (agent, None)


@given(st.text(max_size=30))
def test_token_rule_matches_its_definition(value: str) -> None:
    expected = (
        value != ""
        and all(0x21 <= ord(c) <= 0x7E for c in value)
        and not any(c in ".*>" for c in value)
    )
    assert S.is_valid_token(value) is expected


@given(st.text(max_size=40))
def test_builders_refuse_or_produce_clean_subjects(value: str) -> None:
    try:
        subject = S.event_subject("domain", value)
    except SubjectError:
        assert not S.is_valid_token(value)
    else:
        assert subject.count(".") == 3 and _tokens_ok(subject)


def test_task_record_lookup_subject() -> None:
    assert S.task_get(TASK) == f"mesh.task.get.{TASK}"
    for bad in ("a.b", "*", ">", "", "x" * 129):
        with pytest.raises(SubjectError):
            S.task_get(bad)
    # A lookup is not a task subject; an update for a task named "get" still is.
    assert S.parse_task_subject(S.task_get(TASK)) is None
    assert S.parse_task_subject(S.task_update("get")) == S.TaskSubject("get", "update")


def _matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or token not in ("*", s[i]):
            return False
    return len(p) == len(s)


def test_patterns_intersect_is_exactly_a_shared_subject() -> None:
    # Every pattern of up to three tokens over a small alphabet against every
    # other: intersect iff some concrete subject (tokens a, b, c; up to four
    # long, enough to outlast any '>') matches both.
    import itertools

    def patterns() -> list[str]:
        out = []
        for n in (1, 2, 3):
            for tokens in itertools.product("ab*>", repeat=n):
                if ">" not in tokens[:-1]:
                    out.append(".".join(tokens))
        return out

    subjects_ = [".".join(t) for n in (1, 2, 3, 4) for t in itertools.product("abc", repeat=n)]
    all_patterns = patterns()
    for a in all_patterns:
        for b in all_patterns:
            shared = any(_matches(a, s) and _matches(b, s) for s in subjects_)
            assert S.patterns_intersect(a, b) is shared, (a, b)
    assert not S.patterns_intersect("mesh.event.metering.>", "mesh.event.demo.>")
    assert S.patterns_intersect("mesh.event.*.tick", "mesh.event.demo.>")
