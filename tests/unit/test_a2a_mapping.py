"""A2A ⇄ mesh mappings: offering selection, parts, outputs, states, the card."""

from __future__ import annotations

from typing import Any

import pytest
from a2a.client.card_resolver import parse_agent_card

from meshnode.a2a.mapping import (
    PartsRefused,
    agent_card,
    coded_message,
    input_from_parts,
    integers_by_schema,
    ints_as_sent,
    output_artifact,
    project_security,
    select_offering,
    state_of,
)
from meshnode.protocol.a2a_extension import EXTENSION_URI

TEXT_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}}


def test_select_offering() -> None:
    offerings = {"a": 1, "b": 2}
    assert select_offering(offerings, ["a", "b"], {"skill": "b"}) == "b"
    assert select_offering({"a": 1}, ["a"], None) == "a"
    with pytest.raises(PartsRefused, match="several skills"):
        select_offering(offerings, ["a", "b"], {})
    with pytest.raises(PartsRefused, match="names no skill"):
        select_offering(offerings, ["a", "b"], {"skill": "zzz"})


def test_input_from_parts() -> None:
    assert input_from_parts([{"data": {"n": 1}}], None) == {"n": 1}
    assert input_from_parts([{"text": "a"}, {"text": "b"}], None) == "a\nb"
    assert input_from_parts([{"text": "hi"}], TEXT_SCHEMA) == {"text": "hi"}
    assert input_from_parts([], None) is None
    refused: list[list[dict[str, Any]]] = [
        [{"url": "https://x/y"}],
        [{"raw": "AAAA"}],
        [{"data": 1}, {"text": "x"}],
        [{"data": 1}, {"data": 2}],
        [{"metadata": {}}],
    ]
    for parts in refused:
        with pytest.raises(PartsRefused):
            input_from_parts(parts, None)


def test_outputs_and_states() -> None:
    assert output_artifact("hi") == {"artifactId": "output", "name": "output", "parts": [{"text": "hi"}]}
    assert output_artifact({"a": 1})["parts"] == [{"data": {"a": 1}}]  # type: ignore[index]
    assert output_artifact(None) is None
    assert state_of("rejected") == "TASK_STATE_REJECTED"
    assert state_of("exhausted") == "TASK_STATE_FAILED"
    assert state_of("input_required") == "TASK_STATE_INPUT_REQUIRED"
    msg = coded_message("limit.hops", task_id="t", context_id="c", details={"maxMeshHops": 2})
    assert msg["metadata"] == {EXTENSION_URI: {"code": "limit.hops", "details": {"maxMeshHops": 2}}}


def test_security_projection_never_carries_mesh_identity() -> None:
    public: dict[str, Any] = {
        "access": {
            "schemes": [
                {"id": "mesh", "transport": "mesh", "type": "mesh-identity"},
                {"id": "key", "transport": "http", "type": "apiKey", "in": "header", "name": "X-Key"},
                {"id": "oidc", "transport": "http", "type": "openIdConnect",
                 "openIdConnectUrl": "https://id.example/.well-known/openid-configuration"},
                {"id": "tls", "transport": "http", "type": "mutualTLS"},
                {"id": "odd", "transport": "http", "type": "unknown"},
            ]
        }
    }
    schemes, requirements = project_security(public)
    assert set(schemes) == {"key", "oidc", "tls"}
    assert schemes["key"] == {"apiKeySecurityScheme": {"location": "header", "name": "X-Key"}}
    assert requirements == [{"schemes": {k: {"list": []}}} for k in ("key", "oidc", "tls")]
    assert project_security({}) == ({}, [])
    assert project_security({"access": {"schemes": [{"id": "m", "transport": "mesh", "type": "mesh-identity"}]}}) == ({}, [])


def test_card_is_valid_for_the_sdk() -> None:
    manifest = {
        "name": "Echo",
        "description": "echoes",
        "version": "1.2.3",
        "offerings": [
            {"id": "echo", "name": "Echo", "input_modes": ["text/plain"]},
            {"id": "hidden"},
        ],
        "provider": {"organization": "Acme", "url": "https://acme.example"},
    }
    public = {"description": "Echoes things.", "offerings": ["echo"]}
    card = agent_card(manifest, public=public, url="http://h/agents/echo", idempotency_retention_s=86400)
    parsed = parse_agent_card(dict(card))
    assert [s.id for s in parsed.skills] == ["echo"]
    assert card["description"] == "Echoes things."
    ext = card["capabilities"]["extensions"][0]
    assert ext["uri"] == EXTENSION_URI and ext["params"] == {"idempotencyRetention": "PT86400S"}
    assert ext["required"] is False
    assert "securitySchemes" not in card
    assert card["provider"] == {"organization": "Acme", "url": "https://acme.example"}


# --- integers through a protobuf Struct (issue #20, gap 2) ---------------------------


def test_whole_floats_become_ints_where_the_schema_says_integer() -> None:
    schema = {
        "type": "object",
        "properties": {
            "to": {"type": "integer"},
            "every": {"type": "number"},
            "maybe": {"type": ["integer", "null"]},
            "steps": {"type": "array", "items": {"type": "integer"}},
            "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
            "nested": {"anyOf": [{"type": "object", "properties": {"n": {"type": "integer"}}}]},
            "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
        },
    }
    value = {"to": 2.0, "every": 1.0, "maybe": 3.0, "steps": [1.0, 2.0], "pair": [4.0, "x"],
             "nested": {"n": 5.0}, "counts": {"a": 6.0}, "other": 7.0}
    out = input_from_parts([{"data": value}], schema)
    assert out == value
    assert type(out["to"]) is int and type(out["every"]) is float and type(out["maybe"]) is int
    assert [type(v) for v in out["steps"]] == [int, int] and type(out["pair"][0]) is int
    assert type(out["nested"]["n"]) is int and type(out["counts"]["a"]) is int
    assert type(out["other"]) is float  # no schema says integer there


def test_a_fractional_float_is_left_for_validation_to_refuse() -> None:
    out = input_from_parts([{"data": {"to": 2.5}}], {"type": "object", "properties": {"to": {"type": "integer"}}})
    assert out == {"to": 2.5}
    assert integers_by_schema(True, {"type": "integer"}) is True  # a bool is no number here


def test_ints_as_sent_restores_what_a_struct_made_doubles() -> None:
    original = {"id": "t", "artifacts": [{"parts": [{"data": {"n": 2, "f": 2.5, "list": [1, 2.0]}}]}]}
    rendered = {"id": "t", "artifacts": [{"parts": [{"data": {"n": 2.0, "f": 2.5, "list": [1.0, 2.0]}}]}],
                "extra": 1.0}
    out = ints_as_sent(rendered, original)
    data = out["artifacts"][0]["parts"][0]["data"]
    assert type(data["n"]) is int and type(data["f"]) is float
    assert [type(v) for v in data["list"]] == [int, float] and type(out["extra"]) is float
