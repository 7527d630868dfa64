"""The Task model (§7.2, §7.3, §6.5): states, the closed transition table, task_id, problems."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.tasks import (
    PROBLEM_CODES,
    TERMINAL_STATES,
    TRANSITIONS,
    TaskState,
    check_state_update,
    check_task_id,
    check_transition,
    is_terminal,
    is_valid_problem,
    is_valid_task_id,
    legal_targets,
    parse_state,
    problem_complaints,
    validate_problems,
)

S = TaskState

#: The §7.3 table, written out independently of the module's own constant.
SPEC_TABLE = {
    (None, "submitted"),
    ("submitted", "working"),
    ("working", "completed"),
    ("working", "failed"),
    ("working", "input_required"),
    ("working", "auth_required"),
    ("working", "canceled"),
    ("working", "exhausted"),
    ("input_required", "working"),
    ("auth_required", "working"),
    ("input_required", "canceled"),
    ("input_required", "exhausted"),
    ("auth_required", "canceled"),
    ("auth_required", "exhausted"),
    ("submitted", "canceled"),
    ("submitted", "exhausted"),
    ("submitted", "rejected"),
}

ALL_STATES = [s.value for s in TaskState]


def test_nine_states_with_exact_wire_values() -> None:
    assert ALL_STATES == [
        "submitted",
        "working",
        "input_required",
        "auth_required",
        "completed",
        "failed",
        "canceled",
        "rejected",
        "exhausted",
    ]


def test_terminal_set() -> None:
    assert {s.value for s in TERMINAL_STATES} == {
        "completed",
        "failed",
        "canceled",
        "rejected",
        "exhausted",
    }
    assert is_terminal("exhausted") and is_terminal(S.REJECTED)
    assert not is_terminal("input_required")
    with pytest.raises(ValueError):
        is_terminal("accepted")


def test_accepted_is_not_a_task_state() -> None:
    assert parse_state("accepted") is None
    assert parse_state("Working") is None  # exact bytes, no case folding
    assert parse_state(None) is None
    assert parse_state("working") is S.WORKING


def test_table_matches_the_spec_exactly() -> None:
    assert {(None if f is None else f.value, t.value) for f, t in TRANSITIONS} == SPEC_TABLE


@pytest.mark.parametrize(("frm", "to"), sorted(SPEC_TABLE, key=str))
def test_every_listed_transition_is_legal(frm: str | None, to: str) -> None:
    assert check_transition(frm, to) == to


@given(st.sampled_from([None, *ALL_STATES]), st.sampled_from(ALL_STATES))
def test_the_table_is_closed(frm: str | None, to: str) -> None:
    if (frm, to) in SPEC_TABLE:
        assert check_transition(frm, to) is TaskState(to)
    else:
        with pytest.raises(ProtocolError) as info:
            check_transition(frm, to)
        assert info.value.code == "TASK_INVALID_TRANSITION"
        assert info.value.details["to"] == to


@given(st.sampled_from(sorted(s.value for s in TERMINAL_STATES)), st.sampled_from(ALL_STATES))
def test_nothing_leaves_a_terminal_state(frm: str, to: str) -> None:
    with pytest.raises(ProtocolError):
        check_transition(frm, to)


def test_exhausted_reachable_from_every_non_terminal_state() -> None:
    for state in TaskState:
        if state not in TERMINAL_STATES:
            assert S.EXHAUSTED in legal_targets(state)


def test_rejected_only_from_submitted() -> None:
    assert {f for f, t in TRANSITIONS if t is S.REJECTED} == {S.SUBMITTED}


def test_unknown_states_are_invalid_transitions() -> None:
    for frm, to in (("accepted", "working"), ("working", "accepted"), ("bogus", "bogus")):
        with pytest.raises(ProtocolError) as info:
            check_transition(frm, to)
        assert info.value.code == "TASK_INVALID_TRANSITION"
    assert not info.value.retryable


def test_legal_targets() -> None:
    assert legal_targets(None) == {S.SUBMITTED}
    assert legal_targets("working") == {
        S.COMPLETED,
        S.FAILED,
        S.INPUT_REQUIRED,
        S.AUTH_REQUIRED,
        S.CANCELED,
        S.EXHAUSTED,
    }
    assert legal_targets("completed") == frozenset()
    assert legal_targets("nonsense") == frozenset()


def test_state_update_distinguishes_progress_from_transition() -> None:
    assert check_state_update("working", "working") is False  # a progress update
    assert check_state_update("submitted", "working") is True
    with pytest.raises(ProtocolError):
        check_state_update("completed", "completed")  # a terminal state is never restated
    with pytest.raises(ProtocolError):
        check_state_update("completed", "working")


@pytest.mark.parametrize(
    "value",
    ["0198c001-0000-7000-8000-00000000cafe", "a", "A_b-9", "x" * 128],
)
def test_valid_task_ids(value: str) -> None:
    assert is_valid_task_id(value)
    assert check_task_id(value) == value


@pytest.mark.parametrize(
    "value",
    ["", "x" * 129, "a.b", "a*", "a>", "a b", "tab\t", "é", None, 7, "a/b"],
)
def test_invalid_task_ids(value: object) -> None:
    assert not is_valid_task_id(value)
    with pytest.raises(ProtocolError) as info:
        check_task_id(value, "input.task_id")
    assert info.value.code == "INVALID_ENVELOPE"
    assert info.value.details == {"member": "input.task_id"}


@given(st.text(alphabet=st.characters(codec="ascii"), max_size=140))
def test_task_id_rule_is_the_token_regex(value: str) -> None:
    expected = 1 <= len(value) <= 128 and all(c.isalnum() or c in "_-" for c in value)
    assert is_valid_task_id(value) is expected


# --- problems -----------------------------------------------------------------


def test_problem_codes_closed_set() -> None:
    assert {"missing", "unreadable", "wrong_format", "no_permission", "other"} == PROBLEM_CODES


def test_valid_problem_reports() -> None:
    report = {"input": "invoices", "problem": "wrong_format", "description": "send CSV", "expected": "text/csv"}
    assert is_valid_problem(report)
    assert is_valid_problem({"input": "repo", "problem": "other", "description": "branch is protected"})
    assert validate_problems([report]) == [report]


@pytest.mark.parametrize(
    ("report", "fragment"),
    [
        ({"problem": "missing", "description": "d"}, "input"),
        ({"input": " ", "problem": "missing", "description": "d"}, "input"),
        ({"input": "x", "problem": "lost", "description": "d"}, "problem"),
        ({"input": "x", "problem": "missing"}, "description"),
        ({"input": "x", "problem": "missing", "description": ""}, "description"),
        ({"input": "x", "problem": "missing", "description": "d", "expected": 3}, "expected"),
        ("not an object", "object"),
    ],
)
def test_invalid_problem_reports(report: object, fragment: str) -> None:
    complaints = problem_complaints(report)
    assert complaints and any(fragment in c for c in complaints)
    assert not is_valid_problem(report)


def test_validate_problems_names_every_complaint() -> None:
    with pytest.raises(ValueError, match=r"problems\[1\]: description"):
        validate_problems(
            [
                {"input": "a", "problem": "missing", "description": "d"},
                {"input": "b", "problem": "missing"},
            ]
        )
    with pytest.raises(ValueError):
        validate_problems([])
    with pytest.raises(ValueError):
        validate_problems("missing")
