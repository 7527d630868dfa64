"""Manifest intake (§8, §6.2, §4.4, §8.6, §9.7): refusals, drop-whole rules,
registry-materialized fields, describe, and the sandbox clamp."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshnode.protocol.attestations import (
    DAY_MS,
    make_key_claim,
    make_owner_attestation,
    make_vouch,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.manifest import (
    check_registration,
    clamp_for_sandbox,
    derive_sealing,
    describe_document,
    materialize_public_block,
    parse_cadence_ms,
    validate_registration,
)
from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.protocol.signing import b64url_encode
from tests.conftest import load_fixture

T0 = 1_785_000_000_000
NODE = KeyPair.generate()
AGENT = KeyPair.generate()
OTHER = KeyPair.generate()
X25519 = b64url_encode(bytes(range(32)))
INBOX = f"mesh.agent.{AGENT.public_key}.inbox"


def base_manifest(**overrides: Any) -> dict[str, Any]:
    """A minimal valid registration from AGENT, hosted by NODE, vouched at T0."""
    manifest: dict[str, Any] = {
        "id": AGENT.public_key,
        "name": "Echo",
        "description": "Returns what it was sent.",
        "version": "1.2.3",
        "protocol_version": "0.3.0",
        "endpoint": INBOX,
        "node": {
            "id": NODE.public_key,
            "attestation": make_vouch(NODE, AGENT.public_key, T0, T0 + 3 * DAY_MS),
        },
        "capabilities": ["echo"],
        "offerings": [
            {"id": "echo", "name": "Echo", "description": "Echoes.", "input_modes": ["text/plain"]}
        ],
    }
    manifest.update(overrides)
    return manifest


def with_key(manifest: dict[str, Any], encryption_key: str = X25519) -> dict[str, Any]:
    manifest["encryption_key"] = encryption_key
    manifest["trust"] = make_key_claim(AGENT, issued_at_ms=T0, encryption_key=encryption_key)
    return manifest


def register(manifest: object, **kwargs: Any) -> dict[str, Any]:
    return validate_registration(manifest, sender=AGENT.public_key, now_ms=T0 + 1, **kwargs)


def refusal(manifest: object, **kwargs: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as exc:
        register(manifest, **kwargs)
    return exc.value


def assert_invalid(manifest: object, field: str) -> None:
    err = refusal(manifest)
    assert (err.code, err.details.get("field")) == ("INVALID_MANIFEST", field), err


def dropped(manifest: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    result = check_registration(manifest, sender=AGENT.public_key, now_ms=T0 + 1)
    return result.manifest, result.dropped


# ── the happy path and registry defaults ────────────────────────────────────


def test_minimal_manifest_is_stored_with_registry_defaults() -> None:
    stored = register(base_manifest())
    assert stored["owner"] == NODE.public_key
    assert stored["visibility"] == "public"
    assert stored["endpoints"] == {"inbox": INBOX}
    assert "sandbox" not in stored and "sealing" not in stored and "public" not in stored
    assert stored["offerings"][0]["id"] == "echo"


def test_input_is_not_mutated() -> None:
    original = base_manifest(public={"offerings": ["echo"], "offering_details": [{"id": "x"}]})
    snapshot = copy.deepcopy(original)
    register(original)
    assert original == snapshot


def test_endpoints_are_kept_and_completed() -> None:
    events = f"mesh.agent.{AGENT.public_key}.events"
    stored = register(base_manifest(endpoints={"events": events}))
    assert stored["endpoints"] == {"events": events, "inbox": INBOX}
    assert_invalid(base_manifest(endpoints={"inbox": "mesh.agent.*.inbox"}), "endpoints.inbox")
    assert_invalid(base_manifest(endpoints=["inbox"]), "endpoints")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"endpoint": f"mesh.agent.{OTHER.public_key}.inbox"}, "endpoint"),
        ({"endpoints": {"inbox": f"mesh.agent.{OTHER.public_key}.inbox"}}, "endpoints.inbox"),
        ({"endpoints": {"feed": f"mesh.feed.{OTHER.public_key}.status"}}, "endpoints.feed"),
        ({"endpoints": {"events": "mesh.registry.discover"}}, "endpoints.events"),
    ],
)
def test_an_endpoint_that_is_not_the_agents_own_is_refused(
    overrides: dict[str, Any], field: str
) -> None:
    # §14.4: callers address stored endpoints verbatim, so another agent's
    # inbox there would redirect this agent's callers to the victim.
    err = refusal(base_manifest(**overrides))
    assert (err.code, err.details["field"], err.details["reason"]) == (
        "UNAUTHORIZED", field, "endpoint_not_own"
    )
    assert "allow_foreign_endpoints" in err.message
    # The operator's documented way out stores them verbatim.
    stored = register(base_manifest(**overrides), own_endpoints_only=False)
    assert stored["endpoints"]


def test_own_feed_endpoints_are_accepted() -> None:
    feed = f"mesh.feed.{AGENT.public_key}.status"
    assert register(base_manifest(endpoints={"status": feed}))["endpoints"]["status"] == feed


def test_liveness_and_registrant_sandbox_are_not_stored() -> None:
    stored = register(base_manifest(availability="online", last_heartbeat="now", sandbox=False))
    assert not {"availability", "last_heartbeat", "sandbox"} & set(stored)
    stored = register(base_manifest(sandbox=True))
    assert "sandbox" not in stored, "a registrant cannot declare itself sandboxed or not"


# ── §6.2 identity and required fields ───────────────────────────────────────


def test_from_must_match_id() -> None:
    with pytest.raises(ProtocolError) as exc:
        validate_registration(base_manifest(), sender=OTHER.public_key, now_ms=T0)
    assert exc.value.code == "IDENTITY_MISMATCH"
    assert exc.value.details["field"] == "id"


@pytest.mark.parametrize(
    "field",
    ["id", "name", "description", "version", "protocol_version", "endpoint", "node", "capabilities", "offerings"],
)
def test_missing_required_field_is_named(field: str) -> None:
    manifest = base_manifest()
    del manifest[field]
    assert_invalid(manifest, field)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("id", "not-a-key"),
        ("id", KeyPair.from_raw_seed(bytes(32), Prefix.ACCOUNT).public_key),  # fixed: ids must not vary (xdist)
        ("name", "   "),
        ("description", 3),
        ("version", "1.0"),
        ("version", "v1.0.0"),
        ("protocol_version", "zero"),
        ("endpoint", "mesh.agent.>"),
        ("endpoint", "mesh..inbox"),
        ("capabilities", "echo"),
        ("offerings", {"id": "echo"}),
        ("interaction", "batch"),
        ("visibility", "everyone"),
        ("default_input_modes", "text/plain"),
        ("accepts", "mesh.event.>"),
        ("meta", []),
        ("skus", {}),
        ("works_with", {"service": "x"}),
        ("encryption_key", "not a key"),
        ("sealing", "always"),
        ("public", "storefront"),
        ("owner", "someone"),
    ],
)
def test_malformed_field_is_named(field: str, value: object) -> None:
    assert_invalid(base_manifest(**{field: value}), field)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"capabilities": ["ok", ""]}, "capabilities[1]"),
        ({"provider": {"url": "https://x"}}, "provider.name"),
        ({"limits": {"max_inbound_chars": -1}}, "limits.max_inbound_chars"),
        ({"rate_limits": {"requests_per_second": "10"}}, "rate_limits.requests_per_second"),
        ({"extensions": [{"description": "no uri"}]}, "extensions[0].uri"),
        ({"extensions": [{"uri": "mesh://x", "required": "yes"}]}, "extensions[0].required"),
        ({"works_with": [{"domain": "acme.com"}]}, "works_with[0].service"),
        ({"works_with": [{"service": "Acme", "domain": 1}]}, "works_with[0].domain"),
        ({"descriptor": {"digest": "ABC"}}, "descriptor.digest"),
        ({"trust": {"tenant": 5}}, "trust.tenant"),
        ({"skus": [1]}, "skus[0]"),
    ],
)
def test_nested_refusals_name_the_member(overrides: dict[str, Any], field: str) -> None:
    assert_invalid(base_manifest(**overrides), field)


def test_not_an_object_is_invalid() -> None:
    values: tuple[object, ...] = (None, [], "manifest", 42)
    for value in values:
        assert_invalid(value, "manifest")


# ── §8.5 offerings ──────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("offering", "field"),
    [
        ("echo", "offerings[0]"),
        ({"name": "no id"}, "offerings[0].id"),
        ({"id": ""}, "offerings[0].id"),
        ({"id": "e", "input_schema": "string"}, "offerings[0].input_schema"),
        ({"id": "e", "output_schema": [1]}, "offerings[0].output_schema"),
        ({"id": "e", "input_modes": "text/plain"}, "offerings[0].input_modes"),
        ({"id": "e", "output_modes": ["ok", 3]}, "offerings[0].output_modes[1]"),
        ({"id": "e", "tags": [None]}, "offerings[0].tags[0]"),
        ({"id": "e", "streaming": "no"}, "offerings[0].streaming"),
        ({"id": "e", "estimated_duration_ms": -5}, "offerings[0].estimated_duration_ms"),
        ({"id": "e", "examples": {}}, "offerings[0].examples"),
        ({"id": "e", "needs": {"text": "x"}}, "offerings[0].needs"),
        ({"id": "e", "needs": [{"text": "x", "file": "a/b"}]}, "offerings[0].needs[0]"),
        ({"id": "e", "needs": [{"resource": ""}]}, "offerings[0].needs[0].resource"),
        ({"id": "e", "needs": [{"resource": "git", "access": "all"}]}, "offerings[0].needs[0].access"),
        ({"id": "e", "delivers": {"interim": "yes"}}, "offerings[0].delivers.interim"),
        ({"id": "e", "name": 7}, "offerings[0].name"),
    ],
)
def test_offering_shape_refusals(offering: object, field: str) -> None:
    assert_invalid(base_manifest(offerings=[offering]), field)


def test_offering_ids_are_unique() -> None:
    assert_invalid(base_manifest(offerings=[{"id": "a"}, {"id": "b"}, {"id": "a"}]), "offerings[2].id")


def test_empty_offerings_are_allowed() -> None:
    assert register(base_manifest(offerings=[]))["offerings"] == []


def test_legacy_skill_names_are_read_and_never_emitted() -> None:
    manifest = base_manifest(
        skills=[{"id": "legacy"}],
        public={"skills": ["legacy"], "skill_details": [{"id": "forged"}]},
    )
    del manifest["offerings"]
    stored = register(manifest)
    assert stored["offerings"] == [{"id": "legacy"}]
    assert stored["public"]["offerings"] == ["legacy"]
    assert stored["public"]["offering_details"] == [{"id": "legacy"}]
    assert "skills" not in stored and not {"skills", "skill_details"} & set(stored["public"])


def test_current_names_win_over_legacy_aliases() -> None:
    stored = register(base_manifest(skills=[{"id": "old"}]))
    assert [o["id"] for o in stored["offerings"]] == ["echo"]
    assert "skills" not in stored


# ── §8.5.2 reporting: dropped, never served ─────────────────────────────────


@pytest.mark.parametrize(
    "reporting",
    [
        {"level": "hourly"},
        {"level": "check_ins"},
        {"level": "check_ins", "every": "P1M"},
        {"level": "check_ins", "every": "p1w"},
        {"level": "on_change", "every": "P1D"},
        {"every": "P1D"},
        "check_ins",
    ],
)
def test_unreadable_reporting_is_dropped_from_the_offering(reporting: object) -> None:
    manifest = base_manifest(public={"offerings": ["echo"]})
    manifest["offerings"][0]["reporting"] = reporting
    stored, lost = dropped(manifest)
    assert "reporting" not in stored["offerings"][0]
    assert "reporting" not in stored["public"]["offering_details"][0]
    assert lost == ["offerings[0].reporting"]


@pytest.mark.parametrize(
    ("reporting", "kept"),
    [
        ({"level": "records_only"}, {"level": "records_only"}),
        ({"level": "on_change", "note": "extra"}, {"level": "on_change"}),
        ({"level": "check_ins", "every": "P1W"}, {"level": "check_ins", "every": "P1W"}),
    ],
)
def test_readable_reporting_is_kept_and_materialized(reporting: dict[str, Any], kept: dict[str, Any]) -> None:
    manifest = base_manifest(public={"offerings": ["echo"]})
    manifest["offerings"][0]["reporting"] = reporting
    stored, lost = dropped(manifest)
    assert stored["offerings"][0]["reporting"] == kept
    assert stored["public"]["offering_details"][0]["reporting"] == kept
    assert lost == []


@pytest.mark.parametrize(
    ("text", "ms"),
    [("P1W", 604_800_000), ("PT45S", 45_000), ("P1DT12H", 129_600_000), ("P5DT6H30M", 455_400_000)],
)
def test_cadence_grammar_accepts(text: str, ms: int) -> None:
    assert parse_cadence_ms(text) == ms


@pytest.mark.parametrize(
    "text", ["P1M", "P1Y", "P0D", "PT0S", "P", "PT", "P1DT", "1W", "P1W2D", "P1.5D", "P1D ", "-P1D", "PT1M2H", "P١D", 7]
)
def test_cadence_grammar_refuses(text: object) -> None:
    assert parse_cadence_ms(text) is None


def test_cadence_grammar_matches_the_sow_fixture() -> None:
    every = load_fixture("sow-reporting.json")["every"]
    for case in every["valid"]:
        assert parse_cadence_ms(case["value"]) == case["ms"], case
    for case in every["invalid"]:
        assert parse_cadence_ms(case["value"]) is None, case


# ── §8.10 data_use and §8.11 compliance: dropped whole ──────────────────────

GOOD_DATA_USE: dict[str, Any] = {
    "promises": {"no_training": True, "no_third_party_sharing": True},
    "retention": {"max_days": 30},
    "processors": [{"service": "Anthropic API", "domain": "anthropic.com", "purpose": "inference"}],
    "processed_in": ["us", "de"],
}


@pytest.mark.parametrize(
    "data_use",
    [
        {"promises": {"no_training": False}},
        {"promises": {"no_training": "yes"}},
        {"promises": {"no_selling": True}},
        {"retention": {"max_days": 2.5}},
        {"retention": {"max_days": 0}},
        {"retention": {"max_days": "30"}},
        {"processors": [{"domain": "anthropic.com"}]},
        {"processors": [{"service": "  "}]},
        {"processors": [{"service": "x" * 121}]},
        {"processors": [{"service": "A"}, {"service": "A"}]},
        {"processors": [{"service": f"p{i}"} for i in range(17)]},
        {"processors": "Anthropic API"},
        {"processed_in": ["US"]},
        {"processed_in": ["usa"]},
        {"transport": {"sealed": True}},
        "we keep nothing",
    ],
)
def test_unreadable_data_use_is_dropped_whole(data_use: object) -> None:
    stored, lost = dropped(base_manifest(data_use=data_use))
    assert "data_use" not in stored
    assert lost == ["data_use"]


def test_readable_data_use_is_kept_verbatim() -> None:
    cases: list[dict[str, Any]] = [GOOD_DATA_USE, {"processors": []}, {"retention": {"max_days": 7.0}}]
    for data_use in cases:
        stored, lost = dropped(base_manifest(data_use=data_use))
        assert stored["data_use"] == data_use and lost == []


@pytest.mark.parametrize(
    "compliance",
    [
        [{"standard": "SOC 2"}],
        [{"standard": "soc2", "scope": "  "}],
        [{"standard": "soc2", "attestation": {"url": ""}}],
        [{"standard": "soc2", "attestation": {"expires_at": "soon"}}],
        [{"standard": "soc2", "badge": "gold"}],
        [{"scope": "everything"}],
        {"standard": "soc2"},
    ],
)
def test_unreadable_compliance_is_dropped_whole(compliance: object) -> None:
    good = {"standard": "gdpr", "scope": "as processor"}
    value = [good, *compliance] if isinstance(compliance, list) else compliance
    stored, lost = dropped(base_manifest(compliance=value))
    assert "compliance" not in stored
    assert lost == ["compliance"]


def test_readable_compliance_is_kept() -> None:
    compliance = [
        {"standard": "soc2", "scope": "pipeline", "attestation": {"by": "Auditors LLP", "url": "https://x/soc2", "expires_at": "2027-03-01"}},
        {"standard": "pci-dss"},
    ]
    stored, lost = dropped(base_manifest(compliance=compliance))
    assert stored["compliance"] == compliance and lost == []


def test_declarations_inside_the_public_block_follow_the_same_rule() -> None:
    stored, lost = dropped(base_manifest(public={"data_use": {"promises": {"no_training": False}}, "compliance": [{"standard": "iso27001"}]}))
    assert "data_use" not in stored["public"] and stored["public"]["compliance"] == [{"standard": "iso27001"}]
    assert lost == ["public.data_use"]


# ── §8.12 access: shapes, never bindings ────────────────────────────────────

MESH_SCHEME = {"id": "mesh", "transport": "mesh", "type": "mesh-identity"}
KEY_SCHEME = {"id": "gateway-key", "transport": "http", "type": "apiKey", "in": "header", "name": "X-Api-Key", "description": "issued by the operator once admitted"}
OAUTH_SCHEME = {
    "id": "oauth",
    "transport": "http",
    "type": "oauth2",
    "flows": {
        "authorizationCode": {
            "authorizationUrl": "https://auth.example.com/authorize",
            "tokenUrl": "https://auth.example.com/token",
            "scopes": {"read:tokens": "read your usage"},
        },
        "password": {"tokenUrl": "https://auth.example.com/token"},
    },
}


def access_of(access: object) -> tuple[dict[str, Any] | None, list[str]]:
    stored, lost = dropped(base_manifest(public={"access": access}))
    return stored["public"].get("access"), lost


def test_readable_access_is_kept() -> None:
    access = {"admission": "screened", "schemes": [MESH_SCHEME, KEY_SCHEME, OAUTH_SCHEME]}
    kept, lost = access_of(access)
    assert lost == []
    assert kept is not None
    assert kept["admission"] == "screened"
    assert kept["schemes"][0] == MESH_SCHEME and kept["schemes"][1] == KEY_SCHEME
    assert kept["schemes"][2]["flows"]["password"] == {"tokenUrl": "https://auth.example.com/token", "scopes": {}}


def test_access_is_normalized_to_the_member_list() -> None:
    kept, lost = access_of(
        {
            "admission": "open",
            "note": "benign extra",
            "schemes": [
                {**MESH_SCHEME, "in": "header", "name": "X"},
                {"id": "basic", "transport": "http", "type": "http", "scheme": "bearer", "bearerFormat": "JWT", "x-docs": "see site"},
            ],
        }
    )
    assert lost == []
    assert kept == {
        "admission": "open",
        "schemes": [MESH_SCHEME, {"id": "basic", "transport": "http", "type": "http", "scheme": "bearer", "bearerFormat": "JWT"}],
    }


def test_unrecognized_admission_is_unstated_never_open() -> None:
    kept, lost = access_of({"admission": "anyone", "schemes": []})
    assert kept == {"schemes": []} and lost == []
    kept, lost = access_of({"admission": "anyone"})
    assert kept is None and lost == ["public.access"]


def test_empty_schemes_is_a_statement() -> None:
    kept, _ = access_of({"schemes": []})
    assert kept == {"schemes": []}


@pytest.mark.parametrize(
    "access",
    [
        {"schemes": [{**KEY_SCHEME, "value": "abc"}]},
        {"schemes": [{**KEY_SCHEME, "description": "use sk-live-4f9a8b7c6d5e4f3a2b1c"}]},
        {"schemes": [{**KEY_SCHEME, "description": "send Bearer 8f7e6d5c4b3a29181716"}]},
        {"schemes": [{**KEY_SCHEME, "description": "token eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig"}]},
        {"schemes": [{**KEY_SCHEME, "description": "key 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"}]},
        {"schemes": [{**KEY_SCHEME, "description": "-----BEGIN PRIVATE KEY-----"}]},
        {"schemes": [{**KEY_SCHEME, "client_secret": "s"}]},
        {"schemes": [{**KEY_SCHEME, "tenant_id": "acme"}]},
        {"schemes": [{**MESH_SCHEME, "account": KeyPair.generate(Prefix.ACCOUNT).public_key}]},
        {"schemes": [{**MESH_SCHEME, "description": f"account {KeyPair.generate(Prefix.ACCOUNT).public_key}"}]},
        {"schemes": [{"id": "oidc", "transport": "http", "type": "openIdConnect", "openIdConnectUrl": "https://login.example.com/{tenant}/.well-known/openid-configuration"}]},
        {"schemes": [{"id": "oidc", "transport": "http", "type": "openIdConnect", "openIdConnectUrl": "https://login.example.com/oidc?tenant=acme"}]},
        {"schemes": [{"id": "oidc", "transport": "http", "type": "openIdConnect", "openIdConnectUrl": "https://user:pw@login.example.com/oidc"}]},
        {"schemes": [{**KEY_SCHEME, "description": "see /home/ops/keys.txt"}], "path": "/etc/mesh/key"},
        {"schemes": [{**KEY_SCHEME, "description": "file:///etc/mesh/key"}]},
        {"schemes": [{**KEY_SCHEME, "name": "/var/run/key"}]},
    ],
)
def test_secret_shaped_access_is_dropped_whole(access: dict[str, Any]) -> None:
    kept, lost = access_of(access)
    assert kept is None
    assert lost == ["public.access"]


@pytest.mark.parametrize(
    "access",
    [
        ["open"],
        {"admission": 3},
        {"schemes": {"mesh": MESH_SCHEME}},
        {"schemes": ["mesh"]},
        {"schemes": [{"transport": "mesh", "type": "mesh-identity"}]},
        {"schemes": [{"id": "m", "transport": "smtp", "type": "mesh-identity"}]},
        {"schemes": [{"id": "m", "transport": "mesh", "type": "apiKey"}]},
        {"schemes": [{"id": "h", "transport": "http", "type": "mesh-identity"}]},
        {"schemes": [{"id": "k", "transport": "http", "type": "apiKey", "in": "body", "name": "X"}]},
        {"schemes": [{"id": "k", "transport": "http", "type": "apiKey", "in": "header"}]},
        {"schemes": [{"id": "h", "transport": "http", "type": "http"}]},
        {"schemes": [{"id": "o", "transport": "http", "type": "oauth2", "flows": {"magic": {}}}]},
        {"schemes": [{"id": "o", "transport": "http", "type": "oauth2", "flows": {"implicit": {"tokenUrl": "https://x/t"}}}]},
        {"schemes": [{"id": "c", "transport": "http", "type": "openIdConnect", "openIdConnectUrl": "not a url"}]},
        {"schemes": [MESH_SCHEME, MESH_SCHEME]},
        {"schemes": [{**MESH_SCHEME, "description": 5}]},
    ],
)
def test_unreadable_access_is_dropped_whole(access: object) -> None:
    kept, lost = access_of(access)
    assert kept is None
    assert lost == ["public.access"]


def test_access_from_the_five_questions_fixture_survives() -> None:
    fixture = load_fixture("five-questions.json")
    access = fixture["projection"]["cases"][0]["describe"]["public"]["access"]
    kept, lost = access_of(access)
    assert kept == access and lost == []


# ── §4.3/§8.3 encryption key and key claim, §8.9 sealing ────────────────────


def test_encryption_key_requires_a_valid_key_claim() -> None:
    stored = register(with_key(base_manifest()))
    assert stored["encryption_key"] == X25519 and "signature" in stored["trust"]
    assert_invalid(base_manifest(encryption_key=X25519), "trust")
    forged = with_key(base_manifest())
    forged["encryption_key"] = b64url_encode(bytes(32))  # substituted after signing
    assert_invalid(forged, "trust.signature")
    other_agent = base_manifest(encryption_key=X25519, trust=make_key_claim(OTHER, issued_at_ms=T0, encryption_key=X25519))
    assert_invalid(other_agent, "trust.signature")


def test_unverifiable_claim_without_a_key_is_not_stored() -> None:
    manifest = base_manifest(trust={"tenant": "ACME", "issued_at": "2026-07-25T00:00:00Z", "signature": "bm9wZQ"})
    stored, lost = dropped(manifest)
    assert stored["trust"] == {"tenant": "ACME"}
    assert lost == ["trust.signature"]
    good = base_manifest(trust=make_key_claim(AGENT, issued_at_ms=T0))
    stored, lost = dropped(good)
    assert stored["trust"] == good["trust"] and lost == []


def test_sealing_requires_an_encryption_key() -> None:
    assert_invalid(base_manifest(sealing="required"), "sealing")
    assert register(with_key(base_manifest(sealing="preferred")))["sealing"] == "preferred"


def test_sealing_derivation_order() -> None:
    credential = [{"id": "dmv", "needs": [{"credential": "Colorado DMV", "scope": "renew a plate"}]}]
    works_with = [{"service": "Acme CRM", "domain": "acme.example"}]
    assert "sealing" not in register(base_manifest(offerings=credential, works_with=works_with))
    assert register(with_key(base_manifest(offerings=credential, works_with=works_with)))["sealing"] == "required"
    assert register(with_key(base_manifest(works_with=works_with)))["sealing"] == "preferred"
    assert "sealing" not in register(with_key(base_manifest()))
    assert "sealing" not in register(with_key(base_manifest(works_with=[])))
    # An explicit decision wins, including the decision to declare none.
    assert register(with_key(base_manifest(offerings=credential, sealing="preferred")))["sealing"] == "preferred"
    assert "sealing" not in register(with_key(base_manifest(offerings=credential, sealing=None)))
    assert "sealing" not in register(with_key(base_manifest(offerings=credential)), derive_sealing_posture=False)


def test_derive_sealing_alone() -> None:
    assert derive_sealing({"encryption_key": X25519, "offerings": [{"needs": [{"credential": "x"}]}]}) == "required"
    assert derive_sealing({"offerings": [{"needs": [{"credential": "x"}]}]}) is None


# ── §8.3a, §8.6 interaction, visibility, owner ──────────────────────────────


def test_interaction_values() -> None:
    for style in ("service", "interactive"):
        assert register(base_manifest(interaction=style))["interaction"] == style
    assert "interaction" not in register(base_manifest())


def test_visibility_tiers() -> None:
    for tier in ("public", "unlisted", "private"):
        assert register(base_manifest(visibility=tier))["visibility"] == tier
    assert register(base_manifest(visibility="organization"))["visibility"] == "private"


def test_owner_defaults_to_the_node_and_other_owners_need_an_attestation() -> None:
    owner = KeyPair.generate()
    assert register(base_manifest(owner=NODE.public_key))["owner"] == NODE.public_key
    assert_invalid(base_manifest(owner=owner.public_key), "owner_attestation")
    attestation = make_owner_attestation(owner, AGENT.public_key, T0, T0 + DAY_MS)
    stored = register(base_manifest(owner=owner.public_key, owner_attestation=attestation))
    assert stored["owner"] == owner.public_key and stored["owner_attestation"] == attestation
    assert_invalid(base_manifest(owner=owner.public_key, owner_attestation={**attestation, "sig": ""}), "owner_attestation.sig")
    assert_invalid(base_manifest(owner=owner.public_key, owner_attestation="signed"), "owner_attestation")


@pytest.mark.parametrize(
    ("make", "reason", "field"),
    [
        (lambda o: make_owner_attestation(OTHER, AGENT.public_key, T0, T0 + DAY_MS), "owner_attestation_signer_mismatch", "owner_attestation.node"),
        (lambda o: {**make_owner_attestation(o, AGENT.public_key, T0, T0 + DAY_MS), "node": o.public_key, "sig": make_owner_attestation(OTHER, AGENT.public_key, T0, T0 + DAY_MS)["sig"]}, "owner_attestation_signature_invalid", "owner_attestation.sig"),
        (lambda o: make_owner_attestation(o, OTHER.public_key, T0, T0 + DAY_MS), "owner_attestation_agent_mismatch", "owner_attestation.agent"),
        (lambda o: make_owner_attestation(o, AGENT.public_key, T0 - 2 * DAY_MS, T0 - DAY_MS), "owner_attestation_expired", "owner_attestation.expires_at"),
    ],
)
def test_bad_owner_attestation_is_unauthorized(make: Any, reason: str, field: str) -> None:
    owner = KeyPair.generate()
    err = refusal(base_manifest(owner=owner.public_key, owner_attestation=make(owner)))
    assert (err.code, err.details["reason"], err.details["field"]) == ("UNAUTHORIZED", reason, field)


# ── §4.4 the vouch at registration ──────────────────────────────────────────


def vouched(attestation: dict[str, Any], node_id: str | None = None) -> dict[str, Any]:
    return base_manifest(node={"id": node_id or NODE.public_key, "attestation": attestation})


@pytest.mark.parametrize(
    ("attestation", "reason", "field"),
    [
        ({**make_vouch(NODE, AGENT.public_key, T0, T0 + DAY_MS), "sig": make_vouch(OTHER, AGENT.public_key, T0, T0 + DAY_MS)["sig"]}, "vouch_signature_invalid", "node.attestation.sig"),
        (make_vouch(OTHER, AGENT.public_key, T0, T0 + DAY_MS), "vouch_signer_mismatch", "node.attestation.node"),
        (make_vouch(NODE, OTHER.public_key, T0, T0 + DAY_MS), "vouch_agent_mismatch", "node.attestation.agent"),
        (make_vouch(NODE, AGENT.public_key, T0 - 2 * DAY_MS, T0 - DAY_MS), "vouch_expired", "node.attestation.expires_at"),
        ({**make_vouch(NODE, AGENT.public_key, T0, T0 + DAY_MS), "expires_at": "2099-01-01T00:00:00.000Z"}, "vouch_signature_invalid", "node.attestation.sig"),
    ],
)
def test_bad_vouch_is_unauthorized(attestation: dict[str, Any], reason: str, field: str) -> None:
    err = refusal(vouched(attestation))
    assert (err.code, err.details["reason"], err.details["field"]) == ("UNAUTHORIZED", reason, field)


@pytest.mark.parametrize(
    ("node", "field"),
    [
        ("UNODE", "node"),
        ({"attestation": {}}, "node.id"),
        ({"id": "nope", "attestation": {}}, "node.id"),
        ({"id": NODE.public_key}, "node.attestation"),
        ({"id": NODE.public_key, "attestation": {"node": NODE.public_key}}, "node.attestation.agent"),
        ({"id": NODE.public_key, "attestation": {**make_vouch(NODE, AGENT.public_key, T0, T0 + 1), "sig": 5}}, "node.attestation.sig"),
        ({"id": NODE.public_key, "attestation": make_vouch(NODE, AGENT.public_key, T0, T0 + DAY_MS), "profile": "fast"}, "node.profile"),
    ],
)
def test_malformed_node_is_invalid(node: object, field: str) -> None:
    assert_invalid(base_manifest(node=node), field)


def test_connection_bound_registration() -> None:
    register(base_manifest(), subject_node=NODE.public_key, require_connection_bound=True)
    err = refusal(base_manifest(), subject_node=OTHER.public_key)
    assert (err.code, err.details["reason"]) == ("UNAUTHORIZED", "subject_node_mismatch")
    err = refusal(base_manifest(), require_connection_bound=True)
    assert (err.code, err.details["reason"]) == ("UNAUTHORIZED", "untokenized_registration")


def test_node_profile_keeps_only_readable_declared_attributes() -> None:
    manifest = base_manifest()
    manifest["node"]["profile"] = {
        "availability_class": "always_on",
        "reachability": "satellite",
        "capacity": {"max_agents": 4},
        "trust_tier": "verified",
        "role": "service",
    }
    stored, lost = dropped(manifest)
    assert stored["node"]["profile"] == {"availability_class": "always_on", "capacity": {"max_agents": 4}}
    assert sorted(lost) == ["node.profile.reachability", "node.profile.role", "node.profile.trust_tier"]


# ── §8.7 materialization ────────────────────────────────────────────────────


def test_registry_materialized_fields_discard_registrant_values() -> None:
    offerings: list[dict[str, Any]] = [
        {"id": "a", "name": "A", "description": "first", "tags": ["t"], "input_modes": ["application/pdf"], "output_modes": ["text/plain"], "input_schema": {"type": "object"}, "examples": [{"input": 1, "output": 2}], "streaming": True, "estimated_duration_ms": 50, "needs": [{"file": "application/pdf"}], "delivers": {"final": "text/plain"}},
        {"id": "b", "name": "B"},
        {"id": "hidden"},
    ]
    manifest = base_manifest(
        offerings=offerings,
        default_input_modes=["text/plain"],
        default_output_modes=["application/json"],
        public={
            "description": "storefront",
            "offerings": ["a", "ghost", "b", "a"],
            "offering_details": [{"id": "a", "name": "LIES", "input_modes": ["*/*"]}],
            "default_input_modes": ["*/*"],
            "default_output_modes": ["*/*"],
        },
    )
    public = register(manifest)["public"]
    assert public["description"] == "storefront"
    assert public["offerings"] == ["a", "b"]
    expected_a = {k: v for k, v in offerings[0].items() if k != "examples"}
    assert public["offering_details"] == [expected_a, {"id": "b", "name": "B"}]
    assert public["default_input_modes"] == ["text/plain"]
    assert public["default_output_modes"] == ["application/json"]


def test_materialization_without_advertised_offerings_or_defaults() -> None:
    public = register(base_manifest(public={"description": "d", "offering_details": [{"id": "echo"}], "default_input_modes": ["*/*"]}))["public"]
    assert public == {"description": "d"}


def test_materialize_public_block_alone() -> None:
    assert materialize_public_block({"id": "x"}) == {"id": "x"}
    out = materialize_public_block({"offerings": [{"id": "e", "examples": []}], "public": {"offerings": ["e", 3]}})
    assert out["public"] == {"offerings": ["e"], "offering_details": [{"id": "e"}]}


@pytest.mark.parametrize(
    ("public", "field"),
    [
        ({"description": 1}, "public.description"),
        ({"offerings": "echo"}, "public.offerings"),
        ({"example_queries": [""]}, "public.example_queries[0]"),
        ({"links": [{"rel": "sibling"}]}, "public.links[0].handle"),
        ({"skus": [[]]}, "public.skus[0]"),
        ({"uis": [{"url": "http://x.example", "label": "Dash"}]}, "public.uis[0].url"),
        ({"uis": [{"url": "https://x.example"}]}, "public.uis[0].label"),
        ({"uis": [{"url": "https://x.example", "label": "Dash", "audience": "everyone"}]}, "public.uis[0].audience"),
        ({"uis": [{"url": "https://x.example", "label": "Dash", "access": "secret"}]}, "public.uis[0].access"),
        ({"uis": [{"url": "https://x.example", "label": "Dash", "offering": "ghost"}]}, "public.uis[0].offering"),
    ],
)
def test_public_block_refusals(public: dict[str, Any], field: str) -> None:
    assert_invalid(base_manifest(public=public), field)


def test_uis_with_unknown_kind_are_kept() -> None:
    ui = {"url": "https://x.example/dash", "label": "Dash", "kind": "hologram", "audience": "client", "access": "open", "offering": "echo"}
    assert register(base_manifest(public={"uis": [ui]}))["public"]["uis"] == [ui]


def test_descriptor_pointer() -> None:
    digest = "a" * 64
    assert register(base_manifest(descriptor={"digest": digest}))["descriptor"] == {"digest": digest}
    stored = register(base_manifest(descriptor={"digest": "b" * 64}), descriptor_digest=digest)
    assert stored["descriptor"] == {"digest": digest}


# ── §8.6 sandbox, §10.14 describe ───────────────────────────────────────────


def test_sandbox_registration_is_clamped() -> None:
    stored = register(base_manifest(visibility="public"), sandbox=True)
    assert stored["sandbox"] is True and stored["visibility"] == "unlisted"
    assert register(base_manifest(visibility="private"), sandbox=True)["visibility"] == "private"


def test_clamp_for_sandbox() -> None:
    assert clamp_for_sandbox({})["visibility"] == "unlisted"
    assert clamp_for_sandbox({"visibility": "public"})["visibility"] == "unlisted"
    for tier in ("unlisted", "private"):
        assert clamp_for_sandbox({"visibility": tier})["visibility"] == tier


def test_describe_document() -> None:
    stored = register(
        with_key(
            base_manifest(
                interaction="service",
                works_with=[{"service": "Acme"}],
                data_use={"processors": []},
                meta={"internal": True},
                public={"description": "d", "offerings": ["echo"], "admission": "ask"},
            )
        )
    )
    doc = describe_document(stored)
    assert set(doc) == {"agent_id", "name", "owner", "interaction", "sealing", "works_with", "data_use", "public"}
    assert doc["agent_id"] == AGENT.public_key
    assert doc["public"] == stored["public"]
    card = {"card": {"handle": "Echo.ops@example.com"}, "registrar_sig": "c2ln"}
    assert describe_document(stored, card=card)["card"] == card
    bare = describe_document({"id": AGENT.public_key})
    assert bare == {"agent_id": AGENT.public_key}


# ── property tests: only ProtocolError, whatever arrives ────────────────────

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**60), 2**60) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=25,
)
FIELDS = sorted(
    set(base_manifest())
    | {"public", "data_use", "compliance", "owner", "owner_attestation", "encryption_key", "trust", "sealing", "visibility", "interaction", "endpoints", "works_with", "limits", "skills"}
)


def _check(candidate: object) -> None:
    try:
        stored = register(candidate)
    except ProtocolError as exc:
        assert exc.code in {"INVALID_MANIFEST", "IDENTITY_MISMATCH", "UNAUTHORIZED"}
        if exc.code == "INVALID_MANIFEST":
            assert isinstance(exc.details.get("field"), str)
        return
    assert stored["id"] == AGENT.public_key
    assert not {"skills"} & set(stored)


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_arbitrary_json_raises_only_protocol_errors(candidate: object) -> None:
    _check(candidate)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=4), st.lists(st.sampled_from(FIELDS), max_size=2))
def test_mutated_manifest_raises_only_protocol_errors(replace: dict[str, Any], remove: list[str]) -> None:
    manifest = base_manifest(**replace)
    for name in remove:
        manifest.pop(name, None)
    _check(manifest)


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_arbitrary_public_block_never_crashes(public: object) -> None:
    _check(base_manifest(public={"offerings": ["echo"], "access": public, "uis": public} if isinstance(public, dict) else public))
