"""cancel.json (spec copy, v1) and cancel.ts-sdk.json (v2): §10.8, §10.8a, §7.3.

The v2 copy speaks the current spec and governs. The v1 copy predates two
changes: the enum grew from six reasons to eight (§10.8) and ``skill`` became
``offering`` (§8.5); ``exhausted`` also joined the terminal states (§7.2). Every
v1 case is run; where the current spec replaces its expectation the case is
recorded as superseded, with the section, and its legacy input must still be
accepted.
"""

from __future__ import annotations

import copy
from typing import Any

from meshnode.protocol.cancel import (
    CANCEL_REASONS,
    CANCELABLE_STATES,
    NEED_KINDS,
    StopFields,
    attribute,
    attribute_failed_update,
    build_cancel_request_payload,
    build_canceled_update_payload,
    build_failed_update_payload,
    check_cancelable,
    is_unmet_need,
    parse_cancel_input,
    parse_cancel_request,
    propagate,
    stop_fields_of_update,
    validate_stop_fields,
)
from meshnode.protocol.envelope import verify_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.offerings import normalize_request_payload
from meshnode.protocol.tasks import TERMINAL_STATES, TaskState, check_transition

from .. import Recorder
from ._signed_envelope import check_signed_envelope

FILES = ["cancel.json", "cancel.ts-sdk.json"]


def _raises(code: str, call: Any) -> ProtocolError:
    try:
        call()
    except ProtocolError as exc:
        assert exc.code == code, f"got {exc.code}, want {code}"
        return exc
    raise AssertionError(f"expected {code}, nothing was raised")


def _is_legacy(fixture: dict[str, Any]) -> bool:
    return fixture.get("version") == 1


def _check_reasons(fixture: dict[str, Any], rec: Recorder) -> None:
    listed = fixture["reasons"]["enum"]
    for reason in listed:
        with rec.case(f"reasons/{reason}"):
            assert reason in CANCEL_REASONS
            fields: dict[str, Any] = {"reason": reason}
            if reason == "needs_not_furnished":
                fields["unmet_need"] = "text:anything"
            assert validate_stop_fields(fields, reason_required=True).reason == reason
    name = "reasons/enum_is_closed"
    if _is_legacy(fixture) and set(listed) != set(CANCEL_REASONS):
        rec.superseded(
            name,
            "§10.8",
            f"v1 closes the enum at {len(listed)} reasons; §10.8 now has eight "
            "(needs_not_furnished and dependency_failed joined 2026-08-09)",
        )
        return
    with rec.case(name):
        assert tuple(listed) == CANCEL_REASONS, (listed, CANCEL_REASONS)
        assert set(fixture["reasons"]["descriptions"]) == set(CANCEL_REASONS)


def _check_shapes(fixture: dict[str, Any], rec: Recorder) -> None:
    for name, payload in fixture["shapes"].items():
        if name == "comment":
            continue
        if "input" in payload:
            with rec.case(f"shapes/{name}/accepted"):
                request = parse_cancel_request(payload)
                assert request.task_id == payload["input"]["task_id"]
                assert request.stop.members() == {
                    k: v for k, v in payload["input"].items() if k != "task_id"
                }
            stop = validate_stop_fields(payload["input"], reason_required=True)
            emitted = build_cancel_request_payload(
                payload["input"]["task_id"],
                payload["input"]["reason"],
                note=stop.note,
                unmet_need=stop.unmet_need,
                dependency=stop.dependency,
            )
            if "skill" in payload:
                rec.superseded(
                    f"shapes/{name}/emitted",
                    "§8.5",
                    "v1 pins payload.skill; §8.5 renamed it offering and implementations "
                    "MUST emit only the new name (the legacy form is still accepted above)",
                )
                with rec.case(f"shapes/{name}/emitted_current_vocabulary"):
                    assert emitted == normalize_request_payload(payload)
            else:
                with rec.case(f"shapes/{name}/emitted"):
                    assert emitted == payload, emitted
            continue
        with rec.case(f"shapes/{name}"):
            ending = stop_fields_of_update(payload)
            assert ending is not None, "an ending payload must be recognised"
            status = payload["status"]
            kwargs = {"note": ending.note, "unmet_need": ending.unmet_need, "dependency": ending.dependency}
            if status == "canceled":
                # a cancel always names its reason; a failure may be bare
                assert ending.reason is not None, "a canceled payload names its reason"
                rebuilt = build_canceled_update_payload(ending.reason, **kwargs)
            else:
                rebuilt = build_failed_update_payload(ending.reason, **kwargs)
            assert rebuilt == payload, rebuilt
            record = ending.record_fields(status)
            reason_key = "cancel_reason" if status == "canceled" else "failure_reason"
            assert "reason" not in record
            assert record.get(reason_key) == payload.get("reason")


def _check_propagation(fixture: dict[str, Any], rec: Recorder) -> None:
    for case in fixture["propagation"]["cases"]:
        with rec.case(f"propagation/{case['case']}"):
            original = validate_stop_fields(case["original"], reason_required=True)
            assert propagate(original).members() == case["forwarded"]


def _check_invalid(fixture: dict[str, Any], rec: Recorder) -> None:
    for case in fixture["invalid"]["cases"]:
        with rec.case(f"invalid/{case['case']}"):
            _raises("INVALID_ENVELOPE", lambda i=case["input"]: parse_cancel_input(i))
            payload = {"offering": "task.cancel", "input": case["input"]}
            _raises("INVALID_ENVELOPE", lambda p=payload: parse_cancel_request(p))
            # The canceled update carrying the same members is refused identically.
            update = {"status": "canceled", **{k: v for k, v in case["input"].items() if k != "task_id"}}
            _raises("INVALID_ENVELOPE", lambda u=update: stop_fields_of_update(u))


def _check_envelope(fixture: dict[str, Any], rec: Recorder) -> None:
    vector = fixture["envelope"]
    check_signed_envelope(rec, "envelope", vector, fixture["identities"]["sender_seed"], tamper_path=("payload", "input"))
    env = vector["signed"]
    name = "envelope/legacy_alias_accepted" if "skill" in env["payload"] else "envelope/accepted"
    with rec.case(name):
        request = parse_cancel_request(env["payload"])
        assert request.task_id == env["payload"]["input"]["task_id"]
        assert request.reason == env["payload"]["input"]["reason"]
        assert request.stop.note == env["payload"]["input"]["note"]
    with rec.case("envelope/changed_reason_fails"):
        tampered = copy.deepcopy(env)
        tampered["payload"]["input"]["reason"] = "policy"
        _raises("IDENTITY_MISMATCH", lambda: verify_envelope(tampered))


def _check_transitions(fixture: dict[str, Any], rec: Recorder) -> None:
    section = fixture["transitions"]
    for state in section["cancelable_from"]:
        with rec.case(f"transitions/cancelable_from/{state}"):
            check_cancelable(state)
            assert check_transition(state, TaskState.CANCELED) is TaskState.CANCELED
    for state in section["not_cancelable_from"]:
        with rec.case(f"transitions/not_cancelable_from/{state}"):
            _raises("TASK_NOT_CANCELABLE", lambda s=state: check_cancelable(s))
            _raises("TASK_INVALID_TRANSITION", lambda s=state: check_transition(s, TaskState.CANCELED))
    listed = set(section["cancelable_from"]) | set(section["not_cancelable_from"])
    name = "transitions/partition_is_complete"
    if _is_legacy(fixture) and listed != set(TaskState):
        rec.superseded(
            name,
            "§7.2",
            f"v1 lists no side for {sorted(s.value for s in set(TaskState) - listed)}; exhausted has since "
            "joined the terminal states (§7.2, §7.3), so it is not cancelable",
        )
        with rec.case("transitions/exhausted_not_cancelable"):
            _raises("TASK_NOT_CANCELABLE", lambda: check_cancelable(TaskState.EXHAUSTED))
        return
    with rec.case(name):
        assert set(section["cancelable_from"]) == CANCELABLE_STATES
        assert set(section["not_cancelable_from"]) == TERMINAL_STATES


def _check_unmet_need(fixture: dict[str, Any], rec: Recorder) -> None:
    section = fixture["unmet_need"]
    with rec.case("unmet_need/kinds"):
        assert tuple(section["kinds"]) == NEED_KINDS
    for value in section["valid"]:
        with rec.case(f"unmet_need/valid/{value}"):
            assert is_unmet_need(value)
            stop = validate_stop_fields(
                {"reason": "needs_not_furnished", "unmet_need": value}, reason_required=True
            )
            assert stop.unmet_need == value
    for value in section["invalid"]:
        with rec.case(f"unmet_need/invalid/{value!r}"):
            assert not is_unmet_need(value)
            _raises(
                "INVALID_ENVELOPE",
                lambda v=value: validate_stop_fields(
                    {"reason": "needs_not_furnished", "unmet_need": v}, reason_required=False
                ),
            )


def _check_attribution(fixture: dict[str, Any], rec: Recorder) -> None:
    for case in fixture["attribution"]["cases"]:
        with rec.case(f"attribution/{case['case']}"):
            declared = case.get("declared_needs")
            got = attribute(case["reason"], case.get("unmet_need"), declared)
            assert got == case["attribution"], got
            # Through the failed update a platform receives: an attribution the
            # party asserted in its payload is ignored.
            payload: dict[str, Any] = {"status": "failed"}
            for member in ("reason", "unmet_need", "dependency"):
                if case.get(member) is not None:
                    payload[member] = case[member]
            if "party_asserted_attribution" in case:
                payload["attribution"] = case["party_asserted_attribution"]
            assert attribute_failed_update(payload, declared) == case["attribution"]


def run(fixture: dict[str, Any], rec: Recorder) -> None:
    _check_reasons(fixture, rec)
    _check_shapes(fixture, rec)
    _check_propagation(fixture, rec)
    _check_invalid(fixture, rec)
    _check_envelope(fixture, rec)
    _check_transitions(fixture, rec)
    if "unmet_need" in fixture:
        _check_unmet_need(fixture, rec)
    if "attribution" in fixture:
        _check_attribution(fixture, rec)
    with rec.case("stop_fields/members_omit_unset"):
        assert StopFields().members() == {}
