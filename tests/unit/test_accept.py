"""The accept signal and the queued ack (§6.4a): shapes, ordering, caller rules."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnode.protocol.accept import (
    ACCEPTED,
    ADMISSION_ONLY_CODES,
    CallerAction,
    DeliveryPath,
    FirstReply,
    InboundOutcome,
    ReplyPlan,
    Stage,
    build_accept,
    build_queued_ack,
    caller_action,
    check_accept_shape,
    check_reply_order,
    is_accept,
    is_queued_ack,
    is_substantive_reply,
    may_follow_accept,
    plan_first_reply,
)
from meshnode.protocol.envelope import (
    build_envelope,
    decode_envelope,
    encode_envelope,
    sign_envelope,
)
from meshnode.protocol.errors import ERROR_CODES, ProtocolError
from meshnode.protocol.nkeys import KeyPair
from tests.conftest import load_fixture

NOW = 1_785_164_400_250


@pytest.fixture
def parties() -> tuple[KeyPair, KeyPair]:
    return KeyPair.generate(), KeyPair.generate()


def _request(requester: KeyPair, responder: KeyPair) -> dict[str, Any]:
    env = build_envelope(
        "request", requester.public_key, now_ms=NOW - 250, to=responder.public_key, payload={"offering": "chat", "input": {"text": "hi"}}
    )
    return sign_envelope(env, requester)


def test_build_accept_shape(parties: tuple[KeyPair, KeyPair]) -> None:
    requester, responder = parties
    request = _request(requester, responder)
    accept = build_accept(request, responder.public_key, now_ms=NOW)
    check_accept_shape(accept)
    assert accept["payload"] == {"status": "accepted"}
    assert accept["in_reply_to"] == request["id"]
    assert accept["to"] == requester.public_key and accept["from"] == responder.public_key
    assert "task_id" not in accept and "error" not in accept and "budget" not in accept
    assert accept["trace"]["trace_id"] == request["trace"]["trace_id"]
    assert accept["trace"]["parent_span_id"] == request["trace"]["span_id"]
    signed = sign_envelope(accept, responder)
    assert decode_envelope(encode_envelope(signed)) == signed
    assert is_accept(signed)


def test_build_accept_needs_a_request_to_answer(parties: tuple[KeyPair, KeyPair]) -> None:
    _, responder = parties
    with pytest.raises(ValueError):
        build_accept({"from": "U"}, responder.public_key, now_ms=NOW)
    with pytest.raises(ValueError):
        build_accept({"id": "x"}, responder.public_key, now_ms=NOW)
    # A malformed inbound trace is never copied: the accept starts a fresh root.
    accept = build_accept({"id": "x", "from": "U", "trace": {"trace_id": "nope"}}, responder.public_key, now_ms=NOW)
    assert accept["trace"]["parent_span_id"] is None


@pytest.mark.parametrize(
    ("mutate", "member"),
    [
        (lambda e: e.update(type="request"), "type"),
        (lambda e: e.update(payload={"status": "working"}), "payload.status"),
        (lambda e: e.update(payload="accepted"), "payload.status"),
        (lambda e: e.pop("in_reply_to"), "in_reply_to"),
        (lambda e: e.update(in_reply_to=""), "in_reply_to"),
        (lambda e: e.update(task_id=None), "task_id"),
        (lambda e: e.update(task_id="t1"), "task_id"),
        (lambda e: e.update(error={"code": "INTERNAL_ERROR"}), "error"),
    ],
)
def test_accept_shape_violations(mutate: Any, member: str) -> None:
    env = {"type": "respond", "in_reply_to": "r1", "payload": {"status": ACCEPTED}}
    check_accept_shape(env)
    bad = copy.deepcopy(env)
    mutate(bad)
    with pytest.raises(ProtocolError) as info:
        check_accept_shape(bad)
    assert info.value.code == "INVALID_ENVELOPE" and info.value.details == {"member": member}


def test_recognition_is_by_status() -> None:
    accept = {"type": "respond", "payload": {"status": "accepted"}}
    assert is_accept(accept) and not is_substantive_reply(accept)
    for status in ("completed", "failed", "working", "input_required", None):
        reply = {"type": "respond", "payload": {"status": status}}
        assert not is_accept(reply) and is_substantive_reply(reply)
    assert not is_accept({"type": "request", "payload": {"status": "accepted"}})
    assert not is_substantive_reply({"type": "emit", "payload": {}})


def test_caller_rules() -> None:
    accept = {"type": "respond", "payload": {"status": "accepted"}}
    assert caller_action(accept) is CallerAction.RESET_TIMEOUT
    assert caller_action({"type": "respond", "payload": {"status": "completed"}}) is CallerAction.RESOLVE
    assert caller_action({"type": "respond", "task_id": "t", "payload": {"status": "submitted"}}) is CallerAction.RESOLVE
    with pytest.raises(ValueError):
        caller_action({"type": "emit"})


@given(st.text(max_size=20))
def test_only_accepted_keeps_the_request_outstanding(status: str) -> None:
    action = caller_action({"type": "respond", "payload": {"status": status}})
    assert (action is CallerAction.RESET_TIMEOUT) == (status == "accepted")


# --- queued ack ----------------------------------------------------------------------


def test_queued_ack() -> None:
    assert build_queued_ack("inbox-1") == {"queued": True, "inbox_id": "inbox-1"}
    assert build_queued_ack("inbox-1", "held") == {"queued": True, "inbox_id": "inbox-1", "text": "held"}
    assert is_queued_ack(build_queued_ack("i", "t"))
    assert not is_queued_ack({"queued": "true", "inbox_id": "i"})
    assert not is_queued_ack({"queued": 1, "inbox_id": "i"})
    assert not is_queued_ack({"queued": True})
    assert not is_queued_ack({"queued": True, "inbox_id": ""})
    assert not is_queued_ack({"queued": True, "inbox_id": "i", "status": "accepted"})
    assert not is_queued_ack({"status": "accepted"})
    assert not is_queued_ack(["queued"])
    with pytest.raises(ValueError):
        build_queued_ack("")


def test_queued_ack_fixture_shape() -> None:
    shape = load_fixture("accept-signal.json")["queued_ack"]["shape"]
    assert is_queued_ack(shape)
    assert set(build_queued_ack("x", "y")) == set(shape)


# --- ordering ------------------------------------------------------------------------


def test_plan_first_reply_table() -> None:
    P, R, F = DeliveryPath, InboundOutcome, FirstReply
    expected = {
        (P.LIVE, R.ADMITTED): ReplyPlan(True, F.ACCEPT),
        (P.LIVE, R.BUDGET_REFUSAL): ReplyPlan(False, F.ADMISSION_REFUSAL),
        (P.LIVE, R.SIZE_REFUSAL): ReplyPlan(False, F.ADMISSION_REFUSAL),
        (P.LIVE, R.SILENT_REFUSAL): ReplyPlan(False, F.NOTHING),
        (P.MAILBOX_DRAIN, R.ADMITTED): ReplyPlan(False, F.SUBSTANTIVE),
        (P.MAILBOX_DRAIN, R.BUDGET_REFUSAL): ReplyPlan(False, F.ADMISSION_REFUSAL),
        (P.MAILBOX_DRAIN, R.SIZE_REFUSAL): ReplyPlan(False, F.ADMISSION_REFUSAL),
        (P.MAILBOX_DRAIN, R.SILENT_REFUSAL): ReplyPlan(False, F.NOTHING),
        (P.ATTENDED_INBOX, R.ADMITTED): ReplyPlan(False, F.QUEUED_ACK),
        (P.ATTENDED_INBOX, R.BUDGET_REFUSAL): ReplyPlan(False, F.QUEUED_ACK),
        (P.ATTENDED_INBOX, R.SIZE_REFUSAL): ReplyPlan(False, F.ADMISSION_REFUSAL),
        (P.ATTENDED_INBOX, R.SILENT_REFUSAL): ReplyPlan(False, F.NOTHING),
    }
    for (path, outcome), plan in expected.items():
        assert plan_first_reply(path, outcome) == plan, (path, outcome)


@given(st.sampled_from(list(DeliveryPath)), st.sampled_from(list(InboundOutcome)))
def test_an_accept_only_ever_opens_an_admitted_live_delivery(path: DeliveryPath, outcome: InboundOutcome) -> None:
    plan = plan_first_reply(path, outcome)
    assert plan.accept == (path is DeliveryPath.LIVE and outcome is InboundOutcome.ADMITTED)
    assert plan.accept == (plan.first_reply is FirstReply.ACCEPT)


def test_may_follow_accept() -> None:
    assert may_follow_accept(Stage.WORK)
    assert may_follow_accept(Stage.WORK, "OFFERING_NOT_FOUND")
    assert may_follow_accept(Stage.WORK, "SKILL_NOT_FOUND")
    assert may_follow_accept(Stage.WORK, "INPUT_INVALID")
    assert may_follow_accept(Stage.WORK, "CONTEXT_TOO_LARGE")  # a handler's own capacity, after admission
    assert not may_follow_accept(Stage.ADMISSION)
    assert not may_follow_accept(Stage.ADMISSION, "CONTEXT_TOO_LARGE")
    for code in ADMISSION_ONLY_CODES:
        assert code in ERROR_CODES
        assert not may_follow_accept(Stage.WORK, code), code


def test_check_reply_order() -> None:
    check_reply_order(False, Stage.ADMISSION, "BUDGET_INSUFFICIENT")
    check_reply_order(True, Stage.WORK, "INPUT_INVALID")
    with pytest.raises(RuntimeError):
        check_reply_order(True, Stage.ADMISSION, "CONTEXT_TOO_LARGE")
    with pytest.raises(RuntimeError):
        check_reply_order(True, Stage.WORK, "DEADLINE_UNMEETABLE")


def test_fixture_vector_is_an_accept() -> None:
    env = load_fixture("accept-signal.json")["accept"]["envelope"]["signed"]
    check_accept_shape(env)
    assert decode_envelope(encode_envelope(env)) == env
    assert caller_action(env) is CallerAction.RESET_TIMEOUT
