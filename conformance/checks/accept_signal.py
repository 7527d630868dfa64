"""accept-signal.json: §6.4a accept wire shape, ordering, queued ack, caller rules."""

from __future__ import annotations

import copy
from typing import Any

from meshnode.protocol.accept import (
    ACCEPTED,
    CallerAction,
    DeliveryPath,
    FirstReply,
    InboundOutcome,
    Stage,
    build_accept,
    build_queued_ack,
    caller_action,
    check_accept_shape,
    is_accept,
    is_queued_ack,
    is_substantive_reply,
    may_follow_accept,
    plan_first_reply,
)
from meshnode.protocol.errors import ProtocolError, error_object
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.signing import ENVELOPE_TAG, sign_object
from meshnode.protocol.tasks import parse_state
from meshnode.protocol.timeutil import parse_rfc3339_ms

from .. import Recorder
from ._signed_envelope import check_signed_envelope

FILES = ["accept-signal.json"]

#: Each ordering scenario as the runtime sees it: (delivery path, admission outcome).
_SCENARIOS: dict[str, tuple[DeliveryPath, InboundOutcome]] = {
    "admitted_live": (DeliveryPath.LIVE, InboundOutcome.ADMITTED),
    "budget_refused_at_admission": (DeliveryPath.LIVE, InboundOutcome.BUDGET_REFUSAL),
    "oversize_refused": (DeliveryPath.LIVE, InboundOutcome.SIZE_REFUSAL),
    "stale_or_misaddressed": (DeliveryPath.LIVE, InboundOutcome.SILENT_REFUSAL),
    "attended_inbox": (DeliveryPath.ATTENDED_INBOX, InboundOutcome.ADMITTED),
    "work_fails_after_accept": (DeliveryPath.LIVE, InboundOutcome.ADMITTED),
}


def _expected_first_reply(text: str) -> FirstReply:
    """Classify the fixture's prose ``first_reply``."""
    lowered = text.lower()
    if lowered.startswith("the accept"):
        return FirstReply.ACCEPT
    if lowered.startswith("error respond"):
        return FirstReply.ADMISSION_REFUSAL
    if lowered.startswith("nothing"):
        return FirstReply.NOTHING
    if "queued ack" in lowered:
        return FirstReply.QUEUED_ACK
    raise AssertionError(f"unclassified first_reply {text!r}")


def _codes_named(text: str) -> list[str]:
    return [w.strip(",.()") for w in text.split() if w.strip(",.()").isupper() and "_" in w]


def run(fixture: dict[str, Any], rec: Recorder) -> None:
    identities = fixture["identities"]
    vector = fixture["accept"]["envelope"]
    env: dict[str, Any] = vector["signed"]
    check_signed_envelope(rec, "accept/envelope", vector, identities["sender_seed"])

    required = fixture["accept"]["required"]
    with rec.case("accept/required"):
        check_accept_shape(env)
        assert env["type"] == required["type"]
        assert env["payload"]["status"] == required["payload_status"] == ACCEPTED
        assert isinstance(env.get("in_reply_to"), str) and env["in_reply_to"]
        assert "task_id" not in env, "task_id must be absent on the wire"
        assert is_accept(env) and not is_substantive_reply(env)
        # Non-terminal, and not a Task state at all.
        assert required["terminal"] is False and parse_state(ACCEPTED) is None
        assert env["from"] == identities["responder"] and env["to"] == identities["requester"]

    with rec.case("accept/required/shape_violations_refused"):
        for member, value in (("task_id", None), ("task_id", "t1"), ("error", {"code": "X"})):
            bad = copy.deepcopy(env)
            bad[member] = value
            try:
                check_accept_shape(bad)
            except ProtocolError as exc:
                assert exc.code == "INVALID_ENVELOPE" and exc.details["member"] == member
            else:
                raise AssertionError(f"an accept with {member}={value!r} passed")
        no_reply = {k: v for k, v in env.items() if k != "in_reply_to"}
        try:
            check_accept_shape(no_reply)
        except ProtocolError:
            pass
        else:
            raise AssertionError("an accept without in_reply_to passed")

    with rec.case("accept/required/emitted_before_handler"):
        plan = plan_first_reply(DeliveryPath.LIVE, InboundOutcome.ADMITTED)
        assert required["emitted_before_handler"] is True
        assert plan.accept and plan.first_reply is FirstReply.ACCEPT

    with rec.case("accept/build_reproduces_vector"):
        # The admitted request, as far as the accept can see it: its id, its
        # sender, and the trace the accept continues.
        request = {
            "id": env["in_reply_to"],
            "from": identities["requester"],
            "trace": {
                "trace_id": env["trace"]["trace_id"],
                "span_id": env["trace"]["parent_span_id"],
                "parent_span_id": None,
            },
        }
        built = build_accept(request, identities["responder"], now_ms=parse_rfc3339_ms(env["ts"]))
        check_accept_shape(built)
        assert set(built) == set(env) - {"sig"}, sorted(set(built) ^ (set(env) - {"sig"}))
        for member in ("type", "ts", "from", "to", "in_reply_to", "payload"):
            assert built[member] == env[member], member
        assert built["trace"]["trace_id"] == env["trace"]["trace_id"]
        assert built["trace"]["parent_span_id"] == env["trace"]["parent_span_id"]
        # Random members (id, span) and the fixture's older version string are
        # the only differences; with those set, the bytes and signature match.
        built.update(id=env["id"], v=env["v"])
        built["trace"]["span_id"] = env["trace"]["span_id"]
        key = KeyPair.from_seed(identities["sender_seed"])
        assert sign_object(built, ENVELOPE_TAG, key) == env["sig"]

    for case in fixture["ordering"]["cases"]:
        with rec.case(f"ordering/{case['id']}"):
            scenario = _SCENARIOS.get(case["id"])
            assert scenario is not None, f"no runtime scenario mapped for {case['id']!r}"
            plan = plan_first_reply(*scenario)
            assert plan.accept is case["accept_sent"], (plan, case["accept_sent"])
            assert plan.first_reply is _expected_first_reply(case["first_reply"]), plan
            codes = _codes_named(case["first_reply"])
            if plan.first_reply is FirstReply.ADMISSION_REFUSAL:
                assert codes, "an admission refusal names its code"
                for code in codes:
                    assert not may_follow_accept(Stage.ADMISSION, code), code
                    assert error_object(code, "x")["retryable"] is False, code
            if "then" in case and plan.accept:
                # What follows the accept: the substantive respond, or a failure
                # of the work, which may follow an accept.
                for code in _codes_named(case["scenario"]):
                    assert may_follow_accept(Stage.WORK, code), code
                assert may_follow_accept(Stage.WORK)
                assert not may_follow_accept(Stage.ADMISSION)

    queued = fixture["queued_ack"]
    with rec.case("queued_ack/shape"):
        shape = queued["shape"]
        assert set(shape) == {"queued", "inbox_id", "text"}
        ack = build_queued_ack("0198c001-0000-7000-8000-0000000000aa", "held for a live session")
        assert set(ack) == set(shape) and ack["queued"] is shape["queued"] is True
        assert is_queued_ack(ack)
        assert is_queued_ack({"queued": True, "inbox_id": "x"}), "text is optional"

    with rec.case("queued_ack/pinned"):
        assert not is_queued_ack({"queued": "true", "inbox_id": "x"}), "queued must be boolean true"
        assert not is_queued_ack({"queued": True}), "inbox_id must be present"
        assert not is_queued_ack({"queued": True, "inbox_id": ""}), "inbox_id must be non-empty"
        assert is_queued_ack({"queued": True, "inbox_id": "x", "text": 7}), "text is never judged"

    with rec.case("queued_ack/disjointness"):
        assert not is_queued_ack(env["payload"]), "an accept's payload is not a queued ack"
        assert not is_queued_ack({"queued": True, "inbox_id": "x", "status": ACCEPTED})
        for path in DeliveryPath:
            for outcome in InboundOutcome:
                plan = plan_first_reply(path, outcome)
                assert not (plan.accept and plan.first_reply is FirstReply.QUEUED_ACK)
        attended = plan_first_reply(DeliveryPath.ATTENDED_INBOX, InboundOutcome.ADMITTED)
        assert not attended.accept and attended.first_reply is FirstReply.QUEUED_ACK

    semantics = fixture["caller_semantics"]
    substantive_bare = {"type": "respond", "in_reply_to": env["in_reply_to"], "payload": {"status": "completed"}}
    substantive_task = {
        "type": "respond",
        "in_reply_to": env["in_reply_to"],
        "task_id": "t-1",
        "payload": {"status": "working"},
    }
    with rec.case("caller_semantics/timeout_reset"):
        assert semantics["timeout_reset"]
        assert caller_action(env) is CallerAction.RESET_TIMEOUT

    with rec.case("caller_semantics/request_still_outstanding"):
        assert semantics["request_still_outstanding"]
        assert caller_action(env) is not CallerAction.RESOLVE
        assert caller_action(substantive_bare) is CallerAction.RESOLVE
        assert caller_action(substantive_task) is CallerAction.RESOLVE

    with rec.case("caller_semantics/not_a_mode_signal"):
        assert semantics["not_a_mode_signal"]
        # The accept carries neither mode marker: no task_id, and a status that
        # is neither terminal nor a Task state.
        assert "task_id" not in env and parse_state(env["payload"]["status"]) is None

    with rec.case("caller_semantics/deadline_unmoved"):
        assert semantics["deadline_unmoved"]
        assert "budget" not in env, "an accept carries no budget, so it cannot move the deadline"

    with rec.case("caller_semantics/dedup"):
        assert semantics["dedup"]
        # The accept carries the (from, id) pair every envelope deduplicates on.
        assert isinstance(env["from"], str) and isinstance(env["id"], str)
        assert env["id"] != env["in_reply_to"], "the accept has its own id"
