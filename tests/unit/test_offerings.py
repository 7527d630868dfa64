"""Offerings (§8.5): legacy skill aliases on input, new names only on output, mode resolution."""

from __future__ import annotations

import copy

from hypothesis import given
from hypothesis import strategies as st

from meshnode.protocol.offerings import (
    ResolvedModes,
    current_key,
    declared_needs,
    find_offering,
    need_reference,
    normalize_discover_query,
    normalize_error_object,
    normalize_keys,
    normalize_manifest_aliases,
    normalize_request_payload,
    offering_id_of,
    resolve_modes,
)


def test_current_key_renames_every_legacy_token() -> None:
    assert current_key("skill") == "offering"
    assert current_key("skills") == "offerings"
    assert current_key("skill_details") == "offering_details"
    assert current_key("skill_output_modes") == "offering_output_modes"
    assert current_key("skill_id") == "offering_id"
    assert current_key("requested_skill") == "requested_offering"
    assert current_key("available_skills") == "available_offerings"
    for unchanged in ("offering", "input", "skillful", "skillset", "config"):
        assert current_key(unchanged) == unchanged


def test_request_payload_alias_and_input_untouched() -> None:
    legacy = {"skill": "summarize", "input": {"skill": "kept as data", "skills": [1]}, "config": {"stream": False}}
    original = copy.deepcopy(legacy)
    normalized = normalize_request_payload(legacy)
    assert normalized == {
        "offering": "summarize",
        "input": {"skill": "kept as data", "skills": [1]},
        "config": {"stream": False},
    }
    assert legacy == original, "the signed payload must not be mutated"
    assert offering_id_of(legacy) == "summarize"
    assert offering_id_of({"offering": "x"}) == "x"
    assert offering_id_of({"input": 1}) is None
    assert offering_id_of("a bare string") is None
    assert normalize_request_payload("text") == "text"
    assert normalize_request_payload(None) is None


def test_current_name_wins_over_its_alias() -> None:
    assert normalize_request_payload({"skill": "old", "offering": "new"}) == {"offering": "new"}
    assert normalize_request_payload({"offering": "new", "skill": "old"}) == {"offering": "new"}


def test_manifest_aliases() -> None:
    legacy = {
        "id": "U...",
        "skills": [{"id": "a", "skill_output_modes": ["text/plain"], "input_modes": ["text/plain"]}],
        "public": {"skills": ["a"], "skill_details": [{"id": "a", "skill_tags": ["t"]}]},
        "default_output_modes": ["application/json"],
    }
    original = copy.deepcopy(legacy)
    manifest = normalize_manifest_aliases(legacy)
    assert legacy == original
    assert "skills" not in manifest
    assert manifest["offerings"] == [{"id": "a", "offering_output_modes": ["text/plain"], "input_modes": ["text/plain"]}]
    assert manifest["public"] == {"offerings": ["a"], "offering_details": [{"id": "a", "offering_tags": ["t"]}]}
    assert manifest["default_output_modes"] == ["application/json"]
    current = {"id": "U...", "offerings": [], "public": {"offerings": []}}
    assert normalize_manifest_aliases(current) == current


def test_discover_query_and_error_object() -> None:
    assert normalize_discover_query({"skill_id": "x", "limit": 3}) == {"offering_id": "x", "limit": 3}
    assert normalize_discover_query([1]) == [1]
    legacy_error = {
        "code": "SKILL_NOT_FOUND",
        "message": "m",
        "retryable": False,
        "details": {"requested_skill": "x", "available_skills": ["a"]},
    }
    assert normalize_error_object(legacy_error) == {
        "code": "OFFERING_NOT_FOUND",
        "message": "m",
        "retryable": False,
        "details": {"requested_offering": "x", "available_offerings": ["a"]},
    }
    assert normalize_error_object({"code": "INPUT_INVALID"}) == {"code": "INPUT_INVALID"}


def test_find_offering() -> None:
    manifest = {"skills": [{"id": "a"}, {"id": "b", "skill_x": 1}, "junk"]}
    assert find_offering(manifest, "b") == {"id": "b", "offering_x": 1}
    assert find_offering(manifest, "c") is None
    assert find_offering({"offerings": "not a list"}, "a") is None


MANIFEST = {
    "offerings": [
        {"id": "own", "input_modes": ["application/pdf"], "output_modes": ["text/markdown"]},
        {"id": "inherits"},
        {"id": "empty_modes", "output_modes": []},
    ],
    "default_input_modes": ["text/plain"],
    "default_output_modes": ["application/json"],
}


def test_resolution_order() -> None:
    assert resolve_modes(MANIFEST, "own") == ResolvedModes(
        ("application/pdf",), ("text/markdown",), "offering", "offering"
    )
    assert resolve_modes(MANIFEST, "inherits") == ResolvedModes(
        ("text/plain",), ("application/json",), "defaults", "defaults"
    )
    # An empty list declares nothing, so the defaults apply.
    assert resolve_modes(MANIFEST, "empty_modes").output_source == "defaults"
    bare = {"offerings": [{"id": "x"}]}
    assert resolve_modes(bare, "x") == ResolvedModes(None, None, "unstated", "unstated")
    assert resolve_modes(bare, None).output_source == "unstated"


def test_resolution_reads_legacy_manifests_and_public_defaults() -> None:
    legacy = {"skills": [{"id": "x", "output_modes": ["image/png"]}]}
    assert resolve_modes(legacy, "x").output_modes == ("image/png",)
    describe_only = {"offerings": [{"id": "x"}], "public": {"default_input_modes": ["text/csv"]}}
    assert resolve_modes(describe_only, "x").input_modes == ("text/csv",)


def test_needs_references() -> None:
    assert need_reference({"credential": "Salesforce", "scope": "read"}) == "credential:Salesforce"
    assert need_reference({"resource": "git", "access": "read-write"}) == "resource:git"
    assert need_reference({"file": "application/pdf"}) == "file:application/pdf"
    assert need_reference({"text": "your brand guidelines"}) == "text:your brand guidelines"
    assert need_reference({"licence": "x"}) is None
    assert need_reference({"credential": ""}) is None
    assert need_reference("credential:x") is None


def test_declared_needs() -> None:
    manifest = {
        "offerings": [
            {"id": "a", "needs": [{"credential": "Salesforce"}, {"file": "text/csv"}, {"bogus": 1}]},
            {"id": "b", "needs": [{"resource": "git"}]},
            {"id": "c"},
        ]
    }
    assert declared_needs(manifest) == frozenset({"credential:Salesforce", "file:text/csv", "resource:git"})
    assert declared_needs(manifest, "b") == frozenset({"resource:git"})
    assert declared_needs(manifest, "c") == frozenset()
    assert declared_needs({"skills": [{"id": "a", "needs": [{"text": "t"}]}]}) == frozenset({"text:t"})
    # Unreadable declarations are None, which attribution fails closed on.
    assert declared_needs(None) is None
    assert declared_needs({"id": "no offerings"}) is None


names = st.from_regex(r"[a-z]{1,6}(_[a-z]{1,6}){0,3}", fullmatch=True)


@given(st.dictionaries(names, st.integers(), max_size=8))
def test_normalized_keys_never_carry_legacy_tokens(obj: dict[str, int]) -> None:
    out = normalize_keys(obj)
    for key in out:
        assert "skill" not in key.split("_") and "skills" not in key.split("_")
    # Every current name survives with its own value.
    for key, value in obj.items():
        if current_key(key) == key:
            assert out[key] == value


@given(st.dictionaries(names, st.integers(), max_size=8))
def test_normalization_is_idempotent(obj: dict[str, int]) -> None:
    once = normalize_keys(obj)
    assert normalize_keys(once) == once
