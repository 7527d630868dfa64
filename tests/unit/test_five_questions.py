"""The five questions (§3.3.1) projected from a describe document built by intake."""

from __future__ import annotations

from meshnode.protocol.five_questions import (
    REFUSAL_STATEMENT,
    diff_answers,
    project_five_questions,
)
from meshnode.protocol.manifest import describe_document
from tests.unit.test_manifest import AGENT, NODE, base_manifest, register, with_key


def test_describe_of_a_stored_manifest_answers_the_five_questions() -> None:
    manifest = with_key(
        base_manifest(
            interaction="service",
            works_with=[{"service": "Acme"}],
            data_use={"promises": {"no_training": True}},
            public={"description": "Echoes.", "offerings": ["echo"], "admission": "ask first"},
        )
    )
    answers = project_five_questions(describe_document(register(manifest)))
    assert answers["identity"] == {"agent_id": AGENT.public_key, "name": "Echo", "owner": NODE.public_key}
    assert answers["capabilities"]["offerings"] == ["echo"]
    assert answers["usage"] == {
        "offerings": [{"id": "echo", "input_modes": ["text/plain"]}],
        "interaction": "service",
    }
    assert answers["terms"] == {
        "data_use": {"promises": {"no_training": True}},
        "sealing": "preferred",
        "admission": "ask first",
    }
    assert answers["refusals"] == {
        "boundary": ["echo"],
        "admission": "ask first",
        "statement": REFUSAL_STATEMENT,
    }


def test_diff_reports_only_claimed_members_in_order() -> None:
    declared = project_five_questions(
        {"agent_id": AGENT.public_key, "sealing": "required", "public": {"offerings": ["a"]}}
    )
    claimed = {
        "terms": {"sealing": "preferred"},
        "capabilities": {"offerings": ["a"]},
        "identity": {"name": "Someone"},
        "refusals": "nothing",
    }
    assert diff_answers(declared, claimed) == [
        {"question": "identity", "path": "identity.name", "declared": None, "claimed": "Someone"},
        {"question": "terms", "path": "terms.sealing", "declared": "required", "claimed": "preferred"},
        {
            "question": "refusals",
            "path": "refusals",
            "declared": declared["refusals"],
            "claimed": "nothing",
        },
    ]
    assert diff_answers(declared, declared) == []
