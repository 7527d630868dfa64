"""feeds.json: the owner-rooted feed channel (§6.6a, §14.1, §18.3).

Byte-level agreement on the subject grammar (build and parse), the feed emit
payload ``{topic, kind, data}``, the kind enum, the state-feed KV key and the
``mesh.feed.get`` lookup shapes. Payload comparisons are RFC 8785 canonical,
so member order carries no meaning. The ``separation`` block is behavioural;
what of it is decidable without a broker is checked on the envelope a feed
publish becomes (an ``emit`` with no recipient: never mail, never sealed),
and its delivery routing is asserted by the integration tests.
"""

from __future__ import annotations

from typing import Any

from meshnode.protocol.canonical import canonical_text
from meshnode.protocol.feeds import (
    check_feed_kind,
    feed_envelope,
    feed_payload,
    lookup_request,
    lookup_response,
    parse_lookup_request,
)
from meshnode.protocol.subjects import (
    FEED_GET,
    SubjectError,
    feed_state_key,
    feed_subject,
    parse_feed_subject,
)

from .. import Recorder

FILES = ["feeds.json"]


def run(fixture: dict[str, Any], rec: Recorder) -> None:
    subjects = fixture["subjects"]
    with rec.case("subjects/lookup_subject"):
        assert subjects["lookup_subject"] == FEED_GET
        assert parse_feed_subject(FEED_GET) is None, "the lookup subject must never parse as a feed"
    for case in subjects["build_cases"]:
        with rec.case(f"subjects/build/{case['id']}"):
            if case["verdict"] == "accept":
                got = feed_subject(case["agent"], case["topic"])
                assert got == case["subject"], f"got {got!r}"
            else:
                try:
                    got = feed_subject(case["agent"], case["topic"])
                except SubjectError:
                    pass
                else:
                    raise AssertionError(f"built {got!r} for a topic the fixture refuses")
    for case in subjects["parse_cases"]:
        with rec.case(f"subjects/parse/{case['id']}"):
            parsed = parse_feed_subject(case["subject"])
            if case["verdict"] == "accept":
                assert parsed is not None, "refused a valid feed subject"
                assert (parsed.agent_id, parsed.topic) == (case["agent"], case["topic"]), parsed
            else:
                assert parsed is None, f"parsed {parsed} from a subject the fixture refuses"

    payload = fixture["payload"]
    for case in payload["shape_cases"]:
        with rec.case(f"payload/shape/{case['id']}"):
            got = canonical_text(feed_payload(case["topic"], case["kind"], case["data"]))
            want = canonical_text(case["payload"])
            assert got == want, f"got {got}\nwant {want}"
            env = feed_envelope(
                fixture["identities"]["owner"], case["topic"], case["kind"], case["data"], now_ms=0
            )
            assert canonical_text(env["payload"]) == want, "the envelope carries another payload"
    for case in payload["kind_cases"]:
        with rec.case(f"payload/kind/{case['id']}"):
            try:
                check_feed_kind(case["kind"])
            except ValueError:
                accepted = False
            else:
                accepted = True
            assert accepted == (case["verdict"] == "accept"), f"kind {case['kind']!r}"

    state = fixture["state_binding"]
    for case in state["kv_key_cases"]:
        with rec.case(f"state/kv_key/{case['id']}"):
            assert feed_state_key(case["agent"], case["topic"]) == case["key"]
    for case in state["lookup_request_cases"]:
        with rec.case(f"state/lookup_request/{case['id']}"):
            request = lookup_request(case["agent"], case["topic"])
            assert canonical_text(request) == canonical_text(case["payload"]), request
            assert parse_lookup_request(case["payload"]) == (case["agent"], case["topic"])
    with rec.case("state/lookup_response_members"):
        members = set(state["lookup_response_members"])
        missing = lookup_response(None)
        assert set(missing) == members and missing == {"found": False, "envelope": None}, missing
        env = feed_envelope(fixture["identities"]["owner"], "status", "state", {"level": "ok"}, now_ms=0)
        found = lookup_response(env)
        assert set(found) == members and found["found"] is True and found["envelope"] == env, found

    with rec.case("separation/never_mail_never_sealed"):
        env = feed_envelope(fixture["identities"]["owner"], "status", "state", {"x": 1}, now_ms=0)
        assert env["type"] == "emit", "a feed publish is an ordinary emit (§6.6)"
        assert "to" not in env, "a feed has no recipient: it never routes to the mail path"
        assert not any(k in env for k in ("sealed", "ciphertext", "seal")), "feeds are never sealed"
        assert set(fixture["separation"]["never"]) >= {"mail", "sealing"}
