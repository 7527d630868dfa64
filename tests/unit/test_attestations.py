"""Vouch (§4.4), owner attestation (§8.6), trust attestation (§9.7), key claim (§8.3),
and the standard signed-vector checker."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.protocol import attestations
from meshnode.protocol.attestations import (
    DAY_MS,
    HOUR_MS,
    VOUCH_TTL_DECLARED_MS,
    VOUCH_TTL_DEFAULT_MS,
    SignatureEncoding,
    SignedVectorError,
    decode_signature,
    default_vouch_ttl_ms,
    encode_signature,
    key_claim_bytes,
    key_claim_verifies,
    make_key_claim,
    make_owner_attestation,
    make_trust_attestation,
    make_vouch,
    renew_at_ms,
    same_standing_until,
    sign_key_claim,
    standard_signed_bytes,
    verify_key_claim,
    verify_owner_attestation,
    verify_signed_vector,
    verify_trust_attestation,
    verify_vouch,
    vouch_needs_renewal,
)
from meshnode.protocol.canonical import canonicalize
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair, Prefix, verify
from meshnode.protocol.signing import VOUCH_TAG, b64url_encode, verify_object
from meshnode.protocol.timeutil import parse_rfc3339_ms
from tests.conftest import load_fixture

T0 = 1_785_000_000_000  # 2026-07-25T…, a fixed clock for every test

NODE = KeyPair.generate()
AGENT = KeyPair.generate()
OTHER = KeyPair.generate()
OPERATOR = KeyPair.generate(Prefix.OPERATOR)
ACCOUNT = KeyPair.generate(Prefix.ACCOUNT)


def _refusal(exc: pytest.ExceptionInfo[ProtocolError]) -> tuple[str, str, str | None]:
    err = exc.value
    return err.code, err.details.get("reason", ""), err.details.get("field")


def _vouch(**overrides: Any) -> dict[str, Any]:
    vouch: dict[str, Any] = make_vouch(NODE, AGENT.public_key, T0, T0 + VOUCH_TTL_DEFAULT_MS)
    vouch.update(overrides)
    return vouch


# ── vouch ────────────────────────────────────────────────────────────────────


def test_vouch_is_tagged_and_verifies() -> None:
    vouch = _vouch()
    assert set(vouch) == {"node", "agent", "issued_at", "expires_at", "sig"}
    assert vouch["issued_at"].endswith("Z") and parse_rfc3339_ms(vouch["issued_at"]) == T0
    assert verify_object(vouch, VOUCH_TAG, NODE.public_key)
    assert not verify_object(vouch, "agentmesh-envelope-v1", NODE.public_key)
    verify_vouch(vouch, now_ms=T0 + 1, expected_node=NODE.public_key, expected_agent=AGENT.public_key)


def test_forged_vouch_is_unauthorized() -> None:
    forged = dict(_vouch())
    # Signed by another key while claiming to be NODE's statement.
    forged["sig"] = make_vouch(OTHER, AGENT.public_key, T0, T0 + HOUR_MS)["sig"]
    with pytest.raises(ProtocolError) as exc:
        verify_vouch(forged, now_ms=T0, expected_node=NODE.public_key)
    assert _refusal(exc) == ("UNAUTHORIZED", "vouch_signature_invalid", "sig")


def test_tampered_vouch_fails_signature() -> None:
    tampered = _vouch(expires_at="2099-01-01T00:00:00.000Z")
    with pytest.raises(ProtocolError) as exc:
        verify_vouch(tampered, now_ms=T0)
    assert _refusal(exc) == ("UNAUTHORIZED", "vouch_signature_invalid", "sig")


def test_vouch_for_another_agent_or_node() -> None:
    with pytest.raises(ProtocolError) as exc:
        verify_vouch(_vouch(), now_ms=T0, expected_agent=OTHER.public_key)
    assert _refusal(exc) == ("UNAUTHORIZED", "vouch_agent_mismatch", "agent")
    with pytest.raises(ProtocolError) as exc:
        verify_vouch(_vouch(), now_ms=T0, expected_node=OTHER.public_key)
    assert _refusal(exc) == ("UNAUTHORIZED", "vouch_signer_mismatch", "node")


def test_vouch_expiry_is_enforced() -> None:
    vouch = _vouch()
    expires = T0 + VOUCH_TTL_DEFAULT_MS
    verify_vouch(vouch, now_ms=expires)  # the instant of expiry has not yet passed
    with pytest.raises(ProtocolError) as exc:
        verify_vouch(vouch, now_ms=expires + 1)
    assert _refusal(exc) == ("UNAUTHORIZED", "vouch_expired", "expires_at")


@pytest.mark.parametrize(
    ("vouch", "field"),
    [
        ("not an object", None),
        ({"node": NODE.public_key}, "agent"),
        ({**make_vouch(NODE, AGENT.public_key, T0, T0 + 1), "sig": 5}, "sig"),
        ({**make_vouch(NODE, AGENT.public_key, T0, T0 + 1), "node": "UNOTAKEY"}, "node"),
        ({**make_vouch(NODE, AGENT.public_key, T0, T0 + 1), "agent": ACCOUNT.public_key}, "agent"),
    ],
)
def test_malformed_vouch_is_refused(vouch: object, field: str | None) -> None:
    with pytest.raises(ProtocolError) as exc:
        verify_vouch(vouch, now_ms=T0)
    assert exc.value.code == "UNAUTHORIZED"
    assert exc.value.details["reason"] == "vouch_malformed"
    assert exc.value.details.get("field") == field


def test_vouch_with_unreadable_timestamps_is_malformed() -> None:
    bad = {"node": NODE.public_key, "agent": AGENT.public_key, "issued_at": "yesterday", "expires_at": "2030-01-01T00:00:00Z"}
    bad["sig"] = b64url_encode(NODE.sign(VOUCH_TAG.encode() + b"\n" + canonicalize(bad)))
    with pytest.raises(ProtocolError) as exc:
        verify_vouch(bad, now_ms=T0)
    assert _refusal(exc) == ("UNAUTHORIZED", "vouch_malformed", "issued_at")


def test_legacy_untagged_vouch_only_in_the_draft_window() -> None:
    body = {k: v for k, v in _vouch().items() if k != "sig"}
    legacy = {**body, "sig": b64url_encode(NODE.sign(canonicalize(body)))}
    with pytest.raises(ProtocolError) as exc:
        verify_vouch(legacy, now_ms=T0)
    assert exc.value.details["reason"] == "vouch_signature_invalid"
    verify_vouch(legacy, now_ms=T0, accept_legacy_untagged=True)


def test_make_vouch_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="nkey"):
        make_vouch(NODE, "not-a-key", T0, T0 + 1)
    with pytest.raises(ValueError, match="expire after"):
        make_vouch(NODE, AGENT.public_key, T0, T0)


def test_published_vouch_verifies() -> None:
    fixture = load_fixture("signature-tags.json")
    vouch = fixture["vouch"]["signed"]
    ids = fixture["identities"]
    now = parse_rfc3339_ms(vouch["issued_at"])
    verify_vouch(vouch, now_ms=now, expected_node=ids["sender"], expected_agent=ids["recipient"])
    rebuilt = make_vouch(
        KeyPair.from_seed(ids["sender_seed"]),
        ids["recipient"],
        now,
        parse_rfc3339_ms(vouch["expires_at"]),
    )
    assert rebuilt == vouch, "minting the same vouch reproduces the published bytes"


# ── durations and renewal ───────────────────────────────────────────────────


def test_default_vouch_durations() -> None:
    assert default_vouch_ttl_ms() == VOUCH_TTL_DEFAULT_MS == 72 * HOUR_MS
    assert default_vouch_ttl_ms("always_on") == VOUCH_TTL_DECLARED_MS == 30 * DAY_MS
    assert default_vouch_ttl_ms("intermittent") == 30 * DAY_MS
    assert default_vouch_ttl_ms("sometimes") == 72 * HOUR_MS  # unreadable counts as undeclared
    assert default_vouch_ttl_ms("always_on", configured_ttl_ms=5_000) == 5_000
    with pytest.raises(ValueError):
        default_vouch_ttl_ms(configured_ttl_ms=0)


def test_renewal_at_two_thirds_of_its_own_life() -> None:
    vouch = _vouch()
    assert renew_at_ms(vouch) == T0 + 48 * HOUR_MS
    long_vouch = make_vouch(NODE, AGENT.public_key, T0, T0 + 30 * DAY_MS)
    assert renew_at_ms(long_vouch) == T0 + 20 * DAY_MS
    assert not vouch_needs_renewal(vouch, T0 + 48 * HOUR_MS - 1)
    assert vouch_needs_renewal(vouch, T0 + 48 * HOUR_MS)
    assert vouch_needs_renewal({"issued_at": "garbage"}, T0)
    with pytest.raises(ValueError):
        renew_at_ms({"issued_at": "garbage", "expires_at": "2030-01-01T00:00:00Z"})


# ── owner attestation ───────────────────────────────────────────────────────


def test_owner_attestation_round_trip_and_spellings() -> None:
    owner = KeyPair.generate()
    att = make_owner_attestation(owner, AGENT.public_key, T0, T0 + DAY_MS)
    assert att["node"] == owner.public_key  # the vouch shape, §8.6
    verify_owner_attestation(att, now_ms=T0, owner=owner.public_key, agent=AGENT.public_key)
    # An attestation that names its signer "owner" instead is accepted too.
    body = {"owner": owner.public_key, "agent": AGENT.public_key, "issued_at": att["issued_at"], "expires_at": att["expires_at"]}
    spelled = {**body, "sig": b64url_encode(owner.sign(VOUCH_TAG.encode() + b"\n" + canonicalize(body)))}
    verify_owner_attestation(spelled, now_ms=T0, owner=owner.public_key, agent=AGENT.public_key)


def test_owner_attestation_refusals() -> None:
    owner = KeyPair.generate()
    att = make_owner_attestation(owner, AGENT.public_key, T0, T0 + DAY_MS)
    with pytest.raises(ProtocolError) as exc:
        verify_owner_attestation(att, now_ms=T0, owner=OTHER.public_key, agent=AGENT.public_key)
    assert _refusal(exc) == ("UNAUTHORIZED", "owner_attestation_signer_mismatch", "owner_attestation.node")
    with pytest.raises(ProtocolError) as exc:
        verify_owner_attestation(att, now_ms=T0 + 2 * DAY_MS, owner=owner.public_key, agent=AGENT.public_key)
    assert _refusal(exc) == ("UNAUTHORIZED", "owner_attestation_expired", "owner_attestation.expires_at")
    with pytest.raises(ProtocolError) as exc:
        verify_owner_attestation(att, now_ms=T0, owner=owner.public_key, agent=OTHER.public_key)
    assert _refusal(exc)[1] == "owner_attestation_agent_mismatch"


# ── trust attestation ───────────────────────────────────────────────────────


def _trust(**claims: str) -> dict[str, Any]:
    return make_trust_attestation(OPERATOR, NODE.public_key, claims or {"trust_tier": "verified"}, T0, T0 + DAY_MS)


def test_trust_attestation_round_trip() -> None:
    att = _trust(trust_tier="standard", role="service")
    assert att["type"] == "agentmesh-trust-attestation-v1"
    assert set(att) == {"type", "issuer", "subject", "claims", "issued_at", "expires_at", "sig"}
    claims = verify_trust_attestation(att, now_ms=T0, expected_subject=NODE.public_key, trusted_issuers={OPERATOR.public_key})
    assert claims == {"trust_tier": "standard", "role": "service"}
    account_issued = make_trust_attestation(ACCOUNT, NODE.public_key, {"role": "participant"}, T0, T0 + 1)
    assert verify_trust_attestation(account_issued, now_ms=T0) == {"role": "participant"}


def test_an_attestation_stands_in_for_a_fresh_one_of_the_same_standing_while_it_lasts() -> None:
    held = _trust(trust_tier="standard", role="service")
    fresh = make_trust_attestation(OPERATOR, NODE.public_key, {"trust_tier": "standard", "role": "service"},
                                   T0 + HOUR_MS, T0 + DAY_MS + HOUR_MS)
    assert same_standing_until(held, fresh, T0 + DAY_MS)
    assert not same_standing_until(held, fresh, T0 + DAY_MS + 1), "it would lapse before then"
    other_tier = make_trust_attestation(OPERATOR, NODE.public_key, {"trust_tier": "sandbox", "role": "service"},
                                        T0 + HOUR_MS, T0 + DAY_MS + HOUR_MS)
    assert not same_standing_until(held, other_tier, T0), "a changed standing is always taken"
    other_issuer = make_trust_attestation(ACCOUNT, NODE.public_key, {"trust_tier": "standard", "role": "service"},
                                          T0 + HOUR_MS, T0 + DAY_MS + HOUR_MS)
    assert not same_standing_until(held, other_issuer, T0)
    assert not same_standing_until(None, fresh, T0) and not same_standing_until(held, None, T0)
    assert not same_standing_until({**held, "expires_at": "soon"}, fresh, T0)


def test_trust_attestation_signs_the_bare_canonical_with_in_object_type() -> None:
    att = _trust()
    body = canonicalize({k: v for k, v in att.items() if k != "sig"})
    assert att["sig"] == b64url_encode(OPERATOR.sign(body))


def test_trust_attestation_prefixed_form_is_accepted_on_input() -> None:
    att = _trust()
    body = canonicalize({k: v for k, v in att.items() if k != "sig"})
    prefixed = {**att, "sig": b64url_encode(OPERATOR.sign(b"agentmesh-trust-attestation-v1\n" + body))}
    assert verify_trust_attestation(prefixed, now_ms=T0) == {"trust_tier": "verified"}


@pytest.mark.parametrize("tag", ["agentmesh-trust-attestation-v2", None, "agentmesh-vouch-v1"])
def test_unknown_trust_attestation_tag_is_rejected(tag: str | None) -> None:
    att = _trust()
    if tag is None:
        del att["type"]
    else:
        att["type"] = tag
    with pytest.raises(ProtocolError) as exc:
        verify_trust_attestation(att, now_ms=T0)
    assert _refusal(exc) == ("UNAUTHORIZED", "trust_attestation_unknown_type", "type")


def test_trust_attestation_refusals() -> None:
    att = _trust()
    cases: list[tuple[dict[str, Any], dict[str, Any], str, str | None]] = [
        ({**att, "claims": {"trust_tier": "gold"}}, {}, "trust_attestation_malformed", "claims"),
        ({**att, "claims": {"trust_tier": "verified", "extra": "x"}}, {}, "trust_attestation_malformed", "claims"),
        ({**att, "claims": {"trust_tier": "sandbox"}}, {}, "trust_attestation_signature_invalid", "sig"),
        ({k: v for k, v in att.items() if k != "expires_at"}, {}, "trust_attestation_malformed", "expires_at"),
        ({**att, "issuer": NODE.public_key}, {}, "trust_attestation_malformed", "issuer"),
        (att, {"expected_subject": OTHER.public_key}, "trust_attestation_subject_mismatch", "subject"),
        (att, {"trusted_issuers": {ACCOUNT.public_key}}, "trust_attestation_untrusted_issuer", "issuer"),
        (att, {"now_ms": T0 + DAY_MS + 1}, "trust_attestation_expired", "expires_at"),
    ]
    for candidate, kwargs, reason, field in cases:
        with pytest.raises(ProtocolError) as exc:
            verify_trust_attestation(candidate, **{"now_ms": T0, **kwargs})
        assert _refusal(exc) == ("UNAUTHORIZED", reason, field), (reason, exc.value.details)



def test_a_verified_trust_attestation_is_not_verified_again_but_still_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """One node's attestation rides in each of its agents' manifests: its signature is
    verified once; its lifetime, subject and issuer are checked on every call, and any
    byte changed is verified (and refused) afresh."""
    calls: list[bytes] = []

    def counting(key: str, body: bytes, sig: bytes) -> bool:
        calls.append(body)
        return verify(key, body, sig)

    monkeypatch.setattr(attestations, "verify", counting)
    att = make_trust_attestation(OPERATOR, NODE.public_key, {"trust_tier": "verified"}, T0 + 7, T0 + DAY_MS)
    for _ in range(3):
        assert verify_trust_attestation(att, now_ms=T0, expected_subject=NODE.public_key) == {"trust_tier": "verified"}
    assert len(calls) == 1
    with pytest.raises(ProtocolError) as exc:
        verify_trust_attestation(att, now_ms=T0 + DAY_MS + 1)
    assert _refusal(exc)[1] == "trust_attestation_expired"
    with pytest.raises(ProtocolError) as exc:
        verify_trust_attestation(att, now_ms=T0, expected_subject=OTHER.public_key)
    assert _refusal(exc)[1] == "trust_attestation_subject_mismatch"
    with pytest.raises(ProtocolError) as exc:
        verify_trust_attestation({**att, "claims": {"trust_tier": "standard"}}, now_ms=T0)
    assert _refusal(exc)[1] == "trust_attestation_signature_invalid"
    assert len(calls) == 3  # the altered one: both signed forms tried, neither holds

def test_make_trust_attestation_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="operator or account"):
        make_trust_attestation(NODE, AGENT.public_key, {"role": "service"}, T0, T0 + 1)
    with pytest.raises(ValueError, match="claims"):
        make_trust_attestation(OPERATOR, NODE.public_key, {"role": "admin"}, T0, T0 + 1)
    with pytest.raises(ValueError, match="claims"):
        make_trust_attestation(OPERATOR, NODE.public_key, {}, T0, T0 + 1)


# ── manifest key claim ──────────────────────────────────────────────────────


X25519 = b64url_encode(bytes(range(32)))


def _claimed(encryption_key: str | None = X25519) -> dict[str, Any]:
    manifest: dict[str, Any] = {"id": AGENT.public_key, "trust": {"tenant": "ACCT"}}
    if encryption_key is not None:
        manifest["encryption_key"] = encryption_key
    manifest["trust"] = make_key_claim(AGENT, issued_at_ms=T0, encryption_key=encryption_key, trust=manifest["trust"])
    return manifest


def test_key_claim_bytes_layout() -> None:
    assert key_claim_bytes("2026-07-25T00:00:00.000Z", "UID", "KEY") == (
        b"agentmesh-manifest-key-v1\n2026-07-25T00:00:00.000Z\nUID\nKEY"
    )
    assert key_claim_bytes("T", "UID", None) == b"agentmesh-manifest-key-v1\nT\nUID\n"
    assert key_claim_bytes("T", "UID", "") == b"agentmesh-manifest-key-v1\nT\nUID\n"


@pytest.mark.parametrize("position", [0, 1, 2])
def test_key_claim_component_with_newline_is_refused(position: int) -> None:
    parts = ["2026-07-25T00:00:00.000Z", AGENT.public_key, X25519]
    parts[position] += "\nX"
    with pytest.raises(ValueError, match="newline"):
        key_claim_bytes(*parts)


def test_key_claim_round_trip_preserves_trust_members() -> None:
    manifest = _claimed()
    assert manifest["trust"]["tenant"] == "ACCT"
    assert manifest["trust"]["issued_at"] == "2026-07-25T17:20:00.000Z"
    verify_key_claim(manifest, expected_agent=AGENT.public_key)
    assert key_claim_verifies(manifest, expected_agent=AGENT.public_key)
    without_key = _claimed(None)
    verify_key_claim(without_key, expected_agent=AGENT.public_key)


def test_key_claim_refusals_name_their_field() -> None:
    good = _claimed()
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({**good, "encryption_key": b64url_encode(bytes(32))}, "INVALID_MANIFEST", "trust.signature"),
        ({**good, "trust": {"issued_at": good["trust"]["issued_at"]}}, "INVALID_MANIFEST", "trust.signature"),
        ({k: v for k, v in good.items() if k != "trust"}, "INVALID_MANIFEST", "trust"),
        ({**good, "trust": {**good["trust"], "issued_at": "not a time"}}, "INVALID_MANIFEST", "trust.issued_at"),
        ({**good, "trust": {**good["trust"], "signature": "***"}}, "INVALID_MANIFEST", "trust.signature"),
        ({**good, "encryption_key": "a\nb"}, "INVALID_MANIFEST", "trust.signature"),
        ({**good, "encryption_key": 7}, "INVALID_MANIFEST", "encryption_key"),
        ({**good, "id": "nope"}, "INVALID_MANIFEST", "id"),
    ]
    for manifest, code, field in cases:
        with pytest.raises(ProtocolError) as exc:
            verify_key_claim(manifest, expected_agent=None)
        assert (exc.value.code, exc.value.details["field"]) == (code, field)
    # A claim for agent B cannot answer for agent A.
    with pytest.raises(ProtocolError) as exc:
        verify_key_claim(good, expected_agent=OTHER.public_key)
    assert (exc.value.code, exc.value.details["field"]) == ("IDENTITY_MISMATCH", "id")
    assert not key_claim_verifies(good, expected_agent=OTHER.public_key)
    assert not key_claim_verifies("not a manifest", expected_agent=AGENT.public_key)


@pytest.mark.parametrize("name", ["manifest-signing.json", "manifest-signing.ts-sdk.json"])
def test_published_key_claims(name: str) -> None:
    fixture = load_fixture(name)
    for vector_name in ("key_claim_v1", "key_claim_v1_no_encryption_key"):
        vector = fixture[vector_name]
        assert key_claim_bytes(vector["issued_at"], vector["id"], vector["encryption_key"]) == vector["canonical"].encode()
        key = KeyPair.from_seed(vector["agent_seed"])
        sig = sign_key_claim(key, issued_at=vector["issued_at"], encryption_key=vector["encryption_key"])
        assert sig == vector["signature"]
        manifest = {"id": vector["id"], "trust": {"issued_at": vector["issued_at"], "signature": sig}}
        if vector["encryption_key"]:
            manifest["encryption_key"] = vector["encryption_key"]
        verify_key_claim(manifest, expected_agent=vector["id"])


# ── signature encodings and the standard signed vector ──────────────────────


def test_signature_encodings_are_strict() -> None:
    raw = bytes(range(64))
    url = encode_signature(raw, SignatureEncoding.BASE64URL)
    std = encode_signature(raw, SignatureEncoding.BASE64)
    assert "=" not in url and std.endswith("==")
    assert decode_signature(url, SignatureEncoding.BASE64URL) == raw
    assert decode_signature(std, SignatureEncoding.BASE64) == raw
    for text, encoding in [
        (url + "==", SignatureEncoding.BASE64URL),  # padding is not base64url-unpadded
        (std, SignatureEncoding.BASE64URL),  # '+' and '/' are not in the url alphabet
        (std.rstrip("="), SignatureEncoding.BASE64),  # unpadded is not padded standard
        (url.replace("A", "-"), SignatureEncoding.BASE64),
        ("A", SignatureEncoding.BASE64URL),
        ("AB", SignatureEncoding.BASE64URL),  # non-canonical trailing bits
    ]:
        with pytest.raises(ValueError):
            decode_signature(text, encoding)


def test_verify_signed_vector_names_the_failed_check() -> None:
    obj: dict[str, Any] = {"b": 1, "a": "x"}
    canonical, message = standard_signed_bytes(obj, "agentmesh-test-v1\n")
    assert canonical == b'{"a":"x","b":1}' and message == b"agentmesh-test-v1\n" + canonical
    for encoding in SignatureEncoding:
        signed = {**obj, "sig": encode_signature(NODE.sign(message), encoding)}
        verify_signed_vector(signed, tag="agentmesh-test-v1", signer=NODE.public_key, encoding=encoding, canonical=canonical.decode(), seed=NODE.seed)
        failures = [
            ({**signed, "b": 2}, {}, "signature"),
            (signed, {"canonical": '{"a":"y","b":1}'}, "canonical"),
            (signed, {"signer": OTHER.public_key}, "signature"),
            (signed, {"seed": OTHER.seed}, "resign"),
            (signed, {"tag": "agentmesh-other-v1"}, "signature"),
            ({"b": 1}, {}, "shape"),
        ]
        for candidate, kwargs, check in failures:
            args: dict[str, Any] = {"tag": "agentmesh-test-v1", "signer": NODE.public_key, "encoding": encoding, **kwargs}
            with pytest.raises(SignedVectorError) as exc:
                verify_signed_vector(candidate, **args)
            assert exc.value.check == check, (kwargs, exc.value)


def test_published_roster_uses_padded_base64() -> None:
    fixture = load_fixture("signature-tags.json")
    block = fixture["admission_roster"]
    ids = fixture["identities"]
    verify_signed_vector(
        block["signed"],
        tag=block["signed_bytes_prefix"],
        signer=ids["sender"],
        encoding=SignatureEncoding.BASE64,
        canonical=block["canonical"],
        seed=ids["sender_seed"],
    )
    with pytest.raises(SignedVectorError):
        verify_signed_vector(block["signed"], tag=block["signed_bytes_prefix"], signer=ids["sender"])


# ── property tests: verifiers only ever answer with ProtocolError ───────────

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**60), 2**60) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=60),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=20,
)
VOUCH_LIKE = st.fixed_dictionaries(
    {},
    optional={
        "node": st.sampled_from([NODE.public_key, OTHER.public_key, "x"]) | JSON,
        "agent": st.sampled_from([AGENT.public_key, "y"]) | JSON,
        "issued_at": st.sampled_from(["2026-07-25T00:00:00Z", "bad"]) | JSON,
        "expires_at": st.sampled_from(["2030-07-25T00:00:00Z", "2020-01-01T00:00:00Z"]) | JSON,
        "sig": st.sampled_from([_vouch()["sig"], "!!", ""]) | JSON,
        "type": st.sampled_from(["agentmesh-trust-attestation-v1"]) | JSON,
        "issuer": st.sampled_from([OPERATOR.public_key]) | JSON,
        "subject": st.sampled_from([NODE.public_key]) | JSON,
        "claims": st.sampled_from([{"trust_tier": "verified"}])
        | st.fixed_dictionaries({"trust_tier": JSON})
        | JSON,
    },
)


@settings(max_examples=300, deadline=None)
@given(VOUCH_LIKE | JSON)
def test_verifiers_raise_only_protocol_errors(candidate: object) -> None:
    for check in (
        lambda: verify_vouch(candidate, now_ms=T0),
        lambda: verify_trust_attestation(candidate, now_ms=T0),
        lambda: verify_owner_attestation(candidate, now_ms=T0, owner=NODE.public_key, agent=AGENT.public_key),
        lambda: verify_key_claim(candidate),
    ):
        try:
            check()
        except ProtocolError as exc:
            assert exc.code in {"UNAUTHORIZED", "INVALID_MANIFEST", "IDENTITY_MISMATCH"}


@given(st.text(max_size=100), st.sampled_from(list(SignatureEncoding)))
def test_decode_signature_only_raises_value_error(text: str, encoding: SignatureEncoding) -> None:
    try:
        raw = decode_signature(text, encoding)
    except ValueError:
        return
    assert encode_signature(raw, encoding) == text
