"""Cancel and the endings vocabulary (§10.8, §10.8a, §7.3)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnode.protocol.cancel import (
    CANCEL_REASONS,
    CANCELABLE_STATES,
    NEED_KINDS,
    CancelReason,
    StopFields,
    attribute,
    attribute_failed_update,
    build_cancel_request_payload,
    build_canceled_update_payload,
    build_failed_update_payload,
    check_cancelable,
    is_cancel_request,
    is_unmet_need,
    parse_cancel_input,
    parse_cancel_request,
    propagate,
    propagated_note,
    stop_fields_of_update,
    validate_stop_fields,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.offerings import declared_needs
from meshnode.protocol.tasks import TERMINAL_STATES, TaskState
from tests.conftest import load_fixture

TASK = "0198c001-0000-7000-8000-00000000cafe"


def invalid(call: Callable[[], object], member: str | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        call()
    assert info.value.code == "INVALID_ENVELOPE"
    if member is not None:
        assert info.value.details == {"member": member}
    return info.value


def test_the_eight_reasons() -> None:
    assert CANCEL_REASONS == (
        "user_requested",
        "superseded",
        "deadline_exceeded",
        "budget_exhausted",
        "upstream_cancelled",
        "policy",
        "needs_not_furnished",
        "dependency_failed",
    )
    assert NEED_KINDS == ("resource", "file", "credential", "text")


@pytest.mark.parametrize("value", ["credential:Salesforce", "resource:git-repo", "file:application/pdf", "text:a:b:c"])
def test_unmet_need_valid(value: str) -> None:
    assert is_unmet_need(value)


@pytest.mark.parametrize("value", ["Salesforce", "licence:Salesforce", "credential:", ":Salesforce", "", "credential: ", "Credential:x", None, 3])
def test_unmet_need_invalid(value: object) -> None:
    assert not is_unmet_need(value)


# --- validation -------------------------------------------------------------------


def test_cancel_input_valid() -> None:
    request = parse_cancel_input({"task_id": TASK, "reason": "superseded", "note": "replanned"})
    assert request.task_id == TASK and request.reason is CancelReason.SUPERSEDED
    assert request.stop == StopFields(CancelReason.SUPERSEDED, "replanned")
    assert parse_cancel_input({"reason": "policy"}, envelope_task_id=TASK).task_id == TASK


@pytest.mark.parametrize(
    ("fields", "member"),
    [
        ({}, "reason"),
        ({"reason": None}, "reason"),
        ({"reason": "bored"}, "reason"),
        ({"reason": "User_Requested"}, "reason"),
        ({"reason": 1}, "reason"),
        ({"reason": "policy", "note": 42}, "note"),
        ({"reason": "policy", "note": None}, "note"),
        ({"reason": "needs_not_furnished"}, "unmet_need"),
        ({"reason": "needs_not_furnished", "unmet_need": "the licence"}, "unmet_need"),
        ({"reason": "needs_not_furnished", "unmet_need": None}, "unmet_need"),
        ({"reason": "user_requested", "unmet_need": "credential:x"}, "unmet_need"),
        ({"reason": "policy", "dependency": "Colorado DMV"}, "dependency"),
        ({"reason": "dependency_failed", "dependency": ""}, "dependency"),
        ({"reason": "dependency_failed", "dependency": 5}, "dependency"),
    ],
)
def test_cancel_members_refused_at_the_door(fields: dict[str, Any], member: str) -> None:
    invalid(lambda: validate_stop_fields(fields, reason_required=True), member)
    invalid(lambda: parse_cancel_input({"task_id": TASK, **fields}), member)


def test_cancel_input_task_id() -> None:
    invalid(lambda: parse_cancel_input({"reason": "policy"}), "task_id")
    invalid(lambda: parse_cancel_input({"task_id": "a.b", "reason": "policy"}), "task_id")
    invalid(lambda: parse_cancel_input("not an object"), "input")


def test_failed_update_reason_optional_but_validated_identically() -> None:
    assert validate_stop_fields({}, reason_required=False) == StopFields()
    assert validate_stop_fields({"note": "gave up"}, reason_required=False) == StopFields(note="gave up")
    invalid(lambda: validate_stop_fields({"unmet_need": "file:x"}, reason_required=False), "unmet_need")
    invalid(lambda: validate_stop_fields({"dependency": "x"}, reason_required=False), "dependency")
    invalid(lambda: validate_stop_fields({"reason": "bored"}, reason_required=False), "reason")
    invalid(lambda: validate_stop_fields({"reason": "needs_not_furnished"}, reason_required=False), "unmet_need")
    stop = validate_stop_fields(
        {"reason": "dependency_failed", "dependency": "Colorado DMV"}, reason_required=False
    )
    assert stop.dependency == "Colorado DMV"
    assert validate_stop_fields({"reason": "dependency_failed"}, reason_required=False).dependency is None


def test_stop_fields_of_update() -> None:
    assert stop_fields_of_update({"status": "working"}) is None
    assert stop_fields_of_update("nope") is None
    assert stop_fields_of_update({"status": "failed"}) == StopFields()
    invalid(lambda: stop_fields_of_update({"status": "canceled"}), "reason")
    stop = stop_fields_of_update({"status": "canceled", "reason": "budget_exhausted", "note": "n"})
    assert stop == StopFields(CancelReason.BUDGET_EXHAUSTED, "n")


def test_record_fields_keep_the_endings_apart() -> None:
    stop = StopFields(CancelReason.NEEDS_NOT_FURNISHED, "n", "credential:x")
    assert stop.record_fields("canceled") == {"cancel_reason": "needs_not_furnished", "note": "n", "unmet_need": "credential:x"}
    assert stop.record_fields(TaskState.FAILED) == {"failure_reason": "needs_not_furnished", "note": "n", "unmet_need": "credential:x"}
    assert StopFields().record_fields("failed") == {}
    with pytest.raises(ValueError):
        stop.record_fields("completed")


# --- building -------------------------------------------------------------------------


def test_builders_emit_only_current_names_and_omit_unset() -> None:
    assert build_cancel_request_payload(TASK, "user_requested") == {
        "offering": "task.cancel",
        "input": {"task_id": TASK, "reason": "user_requested"},
    }
    assert build_cancel_request_payload(TASK, CancelReason.NEEDS_NOT_FURNISHED, unmet_need="file:text/csv", note="n") == {
        "offering": "task.cancel",
        "input": {"task_id": TASK, "reason": "needs_not_furnished", "note": "n", "unmet_need": "file:text/csv"},
    }
    assert build_canceled_update_payload("deadline_exceeded") == {"status": "canceled", "reason": "deadline_exceeded"}
    assert build_failed_update_payload() == {"status": "failed"}
    assert build_failed_update_payload("dependency_failed", dependency="DMV") == {
        "status": "failed",
        "reason": "dependency_failed",
        "dependency": "DMV",
    }
    invalid(lambda: build_cancel_request_payload(TASK, "bored"))
    invalid(lambda: build_canceled_update_payload("needs_not_furnished"))
    invalid(lambda: build_cancel_request_payload("a.b", "policy"))


def test_cancel_request_recognition_and_legacy_skill() -> None:
    legacy = {"skill": "task.cancel", "input": {"task_id": TASK, "reason": "policy"}}
    assert is_cancel_request(legacy)
    assert parse_cancel_request(legacy).reason is CancelReason.POLICY
    assert not is_cancel_request({"offering": "chat"})
    invalid(lambda: parse_cancel_request({"offering": "chat", "input": {}}), "offering")


def test_fixture_shapes_rebuild_byte_for_byte() -> None:
    shapes = load_fixture("cancel.ts-sdk.json")["shapes"]
    for name, payload in shapes.items():
        if name == "comment":
            continue
        if "input" in payload:
            request = parse_cancel_request(payload)
            rebuilt = build_cancel_request_payload(request.task_id, request.reason, **_kwargs(request.stop))
        else:
            stop = stop_fields_of_update(payload)
            assert stop is not None
            if payload["status"] == "canceled":
                assert stop.reason is not None  # a canceled update names its reason
                rebuilt = build_canceled_update_payload(stop.reason, **_kwargs(stop))
            else:
                rebuilt = build_failed_update_payload(stop.reason, **_kwargs(stop))
        assert rebuilt == payload, name


def _kwargs(stop: StopFields) -> dict[str, Any]:
    return {"note": stop.note, "unmet_need": stop.unmet_need, "dependency": stop.dependency}


# --- cancelability -------------------------------------------------------------------------


def test_cancelable_states() -> None:
    assert {s.value for s in CANCELABLE_STATES} == {"submitted", "working", "input_required", "auth_required"}
    for state in CANCELABLE_STATES:
        check_cancelable(state)
    for state in TERMINAL_STATES:
        with pytest.raises(ProtocolError) as info:
            check_cancelable(state.value)
        assert info.value.code == "TASK_NOT_CANCELABLE"
        assert info.value.details == {"state": state.value}
    with pytest.raises(ValueError):
        check_cancelable("accepted")


# --- propagation ---------------------------------------------------------------------------


def test_propagated_note_format() -> None:
    assert propagated_note("user_requested") == "user_requested"
    assert propagated_note("deadline_exceeded", "overdue since 16:00Z") == "deadline_exceeded: overdue since 16:00Z"
    assert propagated_note(CancelReason.POLICY, "") == "policy: "


def test_propagation_composes_and_drops_qualifiers() -> None:
    first = propagate(StopFields(CancelReason.NEEDS_NOT_FURNISHED, "sign-in expired", "credential:x"))
    assert first == StopFields(CancelReason.UPSTREAM_CANCELLED, "needs_not_furnished: sign-in expired")
    second = propagate(first)
    assert second.members() == {
        "reason": "upstream_cancelled",
        "note": "upstream_cancelled: needs_not_furnished: sign-in expired",
    }
    with pytest.raises(ValueError):
        propagate(StopFields())


@given(st.sampled_from(CANCEL_REASONS), st.one_of(st.none(), st.text(max_size=30)))
def test_propagated_cancel_always_validates(reason: str, note: str | None) -> None:
    forwarded = propagate(StopFields(CancelReason(reason), note))
    assert forwarded.reason is CancelReason.UPSTREAM_CANCELLED
    assert forwarded.note is not None and forwarded.note.startswith(reason)
    again = validate_stop_fields(forwarded.members(), reason_required=True)
    assert again == forwarded


# --- attribution ----------------------------------------------------------------------------


def test_attribution_rules() -> None:
    declared = {"credential:Salesforce", "file:text/csv"}
    assert attribute("needs_not_furnished", "credential:Salesforce", declared) == "client"
    assert attribute(CancelReason.NEEDS_NOT_FURNISHED, "credential:Salesforce", declared) == "client"
    assert attribute("needs_not_furnished", "credential:Other", declared) == "provider"
    assert attribute("needs_not_furnished", "credential:Salesforce", None) == "provider"
    assert attribute("needs_not_furnished", None, declared) == "provider"
    assert attribute("dependency_failed", None, declared) == "provider"
    assert attribute(None, None, declared) == "provider"
    assert attribute("user_requested", "credential:Salesforce", declared) == "provider"


def test_asserted_attribution_is_ignored_and_malformed_fails_closed() -> None:
    payload = {"status": "failed", "reason": "needs_not_furnished", "unmet_need": "credential:x", "attribution": "client"}
    assert attribute_failed_update(payload, set()) == "provider"
    assert attribute_failed_update(payload, {"credential:x"}) == "client"
    assert attribute_failed_update({"status": "failed", "reason": "bogus", "attribution": "client"}, {"x"}) == "provider"
    assert attribute_failed_update({"status": "working"}, {"x"}) == "provider"


def test_attribution_against_a_registered_manifest() -> None:
    manifest = {"offerings": [{"id": "a", "needs": [{"credential": "Salesforce", "scope": "read"}]}]}
    payload = {"status": "failed", "reason": "needs_not_furnished", "unmet_need": "credential:Salesforce"}
    assert attribute_failed_update(payload, declared_needs(manifest, "a")) == "client"
    assert attribute_failed_update(payload, declared_needs("unreadable")) == "provider"


@given(
    st.one_of(st.none(), st.sampled_from(CANCEL_REASONS)),
    st.one_of(st.none(), st.text(max_size=20)),
    st.one_of(st.none(), st.frozensets(st.text(max_size=20), max_size=4)),
)
def test_client_only_with_a_declared_need(reason: str | None, need: str | None, declared: frozenset[str] | None) -> None:
    if attribute(reason, need, declared) == "client":
        assert reason == "needs_not_furnished"
        assert declared is not None and need in declared and is_unmet_need(need)
