"""The AGBoss mesh extension core: envelope checks in the seed's order, chain
limits, run reports, durations and money."""

from __future__ import annotations

import base64
import hashlib
import json
from decimal import Decimal
from typing import Any

import nacl.signing
import pytest
import rfc8785

from meshnode.protocol.a2a_extension import (
    CLOCK_SKEW_S,
    EXTENSION_URI,
    ChainRefusal,
    IssuerTrust,
    MeshAuthError,
    ReplayCache,
    ReportInvalid,
    body_hash,
    build_envelope_claims,
    check_chain,
    extend_chain,
    format_duration,
    format_instant,
    format_usd,
    parse_duration,
    parse_usd,
    parse_verify_key,
    sign_envelope,
    sign_report,
    unsecured_envelope,
    verify_envelope,
    verify_report,
)
from meshnode.protocol.nkeys import KeyPair, decode_seed

NOW = 1_800_000_000.0
KEY = nacl.signing.SigningKey(b"\x01" * 32)
OTHER = nacl.signing.SigningKey(b"\x02" * 32)
MESSAGE: dict[str, Any] = {
    "messageId": "m-1",
    "role": "ROLE_USER",
    "parts": [{"text": "héllo"}],
    "metadata": {"skill": "echo"},
}


def _claims(**over: Any) -> dict[str, Any]:
    c = build_envelope_claims(
        issuer="caller-app",
        audience="me",
        now=NOW,
        message=MESSAGE,
        call_chain=[{"application": "caller-app", "start": "plan", "executionId": "e0"}],
        origin={"rootExecutionId": "r0", "executionId": "e0"},
        budget_remaining="1.50",
        deadline_remaining_s=30,
    )
    c.update(over)
    return {k: v for k, v in c.items() if v is not None}


def _known(issuer: str) -> nacl.signing.VerifyKey | None:
    return KEY.verify_key if issuer == "caller-app" else None


def _verify(token: str, *, now: float = NOW, message: dict[str, Any] | None = None) -> Any:
    return verify_envelope(
        token,
        own_application="me",
        issuer_keys=_known,
        now=now,
        message=MESSAGE if message is None else message,
    )


def _code(token: str, **kw: Any) -> str:
    with pytest.raises(MeshAuthError) as exc:
        _verify(token, **kw)
    return exc.value.code


# --- body hash -------------------------------------------------------------------


def test_body_hash_is_jcs_without_the_extension_metadata() -> None:
    msg = {**MESSAGE, "metadata": {"skill": "echo", EXTENSION_URI: {"envelope": "x"}}}
    expected = "sha256:" + hashlib.sha256(rfc8785.dumps(MESSAGE)).hexdigest()
    assert body_hash(msg) == expected
    assert body_hash(MESSAGE) == expected


def test_body_hash_drops_metadata_left_empty() -> None:
    bare = {"messageId": "m", "role": "ROLE_USER", "parts": []}
    with_ext = {**bare, "metadata": {EXTENSION_URI: {"envelope": "x"}}}
    assert body_hash(with_ext) == body_hash(bare)
    # An empty metadata that never held the extension is part of the message.
    assert body_hash({**bare, "metadata": {}}) != body_hash(bare)


# --- envelope: success -----------------------------------------------------------


def test_signed_known_issuer_is_trusted_and_parsed() -> None:
    check = _verify(sign_envelope(_claims(), KEY))
    assert check.trusted and check.signed and check.issuer == "caller-app"
    assert check.budget is not None and check.budget.remaining == Decimal("1.50")
    assert check.deadline_s == 30
    assert check.origin == {"rootExecutionId": "r0", "executionId": "e0"}
    assert check.call_chain[0]["application"] == "caller-app"
    assert check.body_hash == body_hash(MESSAGE)


def test_unsecured_claim_is_accepted_but_never_trusted() -> None:
    check = _verify(unsecured_envelope(_claims(audience=None)))
    assert not check.trusted and not check.signed
    assert check.call_chain  # the chain is still read, for the chain checks


def test_signed_by_unknown_issuer_is_a_claim() -> None:
    check = _verify(sign_envelope(_claims(issuer="stranger"), OTHER))
    assert not check.trusted and check.signed


def test_hash_covers_the_message_with_its_envelope_in_metadata() -> None:
    token = sign_envelope(_claims(), KEY)
    sent = {**MESSAGE, "metadata": {**MESSAGE["metadata"], EXTENSION_URI: {"envelope": token}}}
    assert _verify(token, message=sent).trusted


# --- envelope: each 401, in order ------------------------------------------------


def test_audience_mismatch() -> None:
    assert _code(sign_envelope(_claims(audience="someone-else"), KEY)) == "mesh.audience-mismatch"
    # Also for an unsecured claim addressed elsewhere.
    assert _code(unsecured_envelope(_claims(audience="x"))) == "mesh.audience-mismatch"


def test_audience_missing_when_signed() -> None:
    assert _code(sign_envelope(_claims(audience=None), KEY)) == "mesh.audience-missing"


def test_audience_is_checked_before_the_signature() -> None:
    token = sign_envelope(_claims(audience="elsewhere"), OTHER)  # also a bad signature
    assert _code(token) == "mesh.audience-mismatch"
    token = sign_envelope(_claims(audience=None), OTHER)
    assert _code(token) == "mesh.audience-missing"


def test_signature_invalid_for_known_issuer() -> None:
    assert _code(sign_envelope(_claims(), OTHER)) == "mesh.signature-invalid"


def test_tampered_payload_is_signature_invalid() -> None:
    head, _body, sig = sign_envelope(_claims(), KEY).split(".")
    forged = (
        base64.urlsafe_b64encode(
            json.dumps(_claims(budget={"remaining": "999", "currency": "USD"})).encode()
        )
        .rstrip(b"=")
        .decode()
    )
    assert _code(f"{head}.{forged}.{sig}") == "mesh.signature-invalid"


@pytest.mark.parametrize(
    "token",
    ["", "a.b", "not.a.jws", "....", 42],
)
def test_malformed_token_is_signature_invalid(token: Any) -> None:
    assert _code(token) == "mesh.signature-invalid"


def test_wrong_typ_or_alg_is_signature_invalid() -> None:
    from meshnode.protocol.a2a_jws import jws

    bad_typ = jws({"alg": "EdDSA", "typ": "JWT"}, _claims(), KEY)
    bad_alg = jws({"alg": "HS256", "typ": "agboss-mesh"}, _claims(), KEY)
    none_with_sig = unsecured_envelope(_claims(audience=None)) + "AAAA"
    for token in (bad_typ, bad_alg, none_with_sig):
        assert _code(token) == "mesh.signature-invalid"


def test_expired_and_future_envelopes() -> None:
    token = sign_envelope(_claims(), KEY)
    assert _verify(token, now=NOW + 59).trusted
    assert _code(token, now=NOW + 61) == "mesh.envelope-expired"
    assert _code(token, now=NOW - 120) == "mesh.envelope-expired"


def test_expires_in_is_honoured_and_capped() -> None:
    short = sign_envelope(_claims(expiresIn="PT5S"), KEY)
    assert _code(short, now=NOW + 6) == "mesh.envelope-expired"
    huge = sign_envelope(_claims(expiresIn="P30D"), KEY)
    assert _code(huge, now=NOW + 3600) == "mesh.envelope-expired"


def test_missing_or_malformed_issued_at_when_signed() -> None:
    assert _code(sign_envelope(_claims(issuedAt=None), KEY)) == "mesh.envelope-expired"
    assert _code(sign_envelope(_claims(issuedAt="yesterday"), KEY)) == "mesh.envelope-expired"
    assert _code(sign_envelope(_claims(expiresIn="soon"), KEY)) == "mesh.envelope-expired"


def test_numeric_issued_at_is_epoch_seconds() -> None:
    assert _verify(sign_envelope(_claims(issuedAt=NOW), KEY)).trusted


def test_body_mismatch() -> None:
    token = sign_envelope(_claims(), KEY)
    other = {**MESSAGE, "parts": [{"text": "changed"}]}
    assert _code(token, message=other) == "mesh.body-mismatch"
    assert _code(sign_envelope(_claims(bodyHash=None), KEY)) == "mesh.body-mismatch"


def test_signature_checked_before_window_and_body() -> None:
    token = sign_envelope(_claims(), OTHER)
    assert _code(token, now=NOW + 3600, message={"x": 1}) == "mesh.signature-invalid"


def test_window_checked_before_body() -> None:
    token = sign_envelope(_claims(), KEY)
    assert _code(token, now=NOW + 3600, message={"x": 1}) == "mesh.envelope-expired"


def test_unsecured_claim_with_hash_and_window_is_checked_too() -> None:
    token = unsecured_envelope(_claims(audience=None))
    assert _code(token, message={"x": 1}) == "mesh.body-mismatch"
    assert _code(token, now=NOW + 3600) == "mesh.envelope-expired"
    bare = unsecured_envelope({"issuer": "x", "callChain": []})
    assert not _verify(bare).trusted


def test_malformed_budget_or_chain_is_refused() -> None:
    for over in (
        {"budget": {"remaining": 1.5}},
        {"budget": {"remaining": "1", "currency": "EUR"}},
        {"deadline": {"remaining": "soon"}},
        {"callChain": "a"},
        {"callChain": [{"start": "x"}]},
        {"origin": "x"},
    ):
        assert _code(sign_envelope(_claims(**over), KEY)) == "mesh.signature-invalid"


# --- issuer trust -----------------------------------------------------------------


def test_issuer_trust_configured_and_nkey() -> None:
    kp = KeyPair.generate()
    nk_key = nacl.signing.SigningKey(decode_seed(kp.seed)[1])
    configured = IssuerTrust({"caller-app": KEY.verify_key})
    assert configured("caller-app") == KEY.verify_key
    assert configured(kp.public_key) is None  # nkeys need the allow policy
    assert configured("stranger") is None
    allow_nkey = IssuerTrust({"caller-app": KEY.verify_key}, allow=[kp.public_key])
    assert allow_nkey(kp.public_key) == nk_key.verify_key
    assert allow_nkey("caller-app") is None  # not listed
    star = IssuerTrust({"caller-app": KEY.verify_key}, allow=["*"])
    assert star(kp.public_key) == nk_key.verify_key and star("caller-app") is not None
    assert star("not-an-nkey") is None


def test_nkey_issuer_verifies_from_its_id() -> None:
    kp = KeyPair.generate()
    sk = nacl.signing.SigningKey(decode_seed(kp.seed)[1])
    token = sign_envelope(_claims(issuer=kp.public_key), sk)
    check = verify_envelope(
        token, own_application="me", issuer_keys=IssuerTrust(allow=["*"]), now=NOW, message=MESSAGE
    )
    assert check.trusted
    forged = sign_envelope(_claims(issuer=kp.public_key), OTHER)
    with pytest.raises(MeshAuthError, match="signature-invalid"):
        verify_envelope(
            forged,
            own_application="me",
            issuer_keys=IssuerTrust(allow=["*"]),
            now=NOW,
            message=MESSAGE,
        )


def test_parse_verify_key_forms() -> None:
    raw = bytes(KEY.verify_key)
    kp = KeyPair.generate()
    assert parse_verify_key(base64.urlsafe_b64encode(raw).decode().rstrip("=")) == KEY.verify_key
    assert parse_verify_key("ed25519:" + base64.b64encode(raw).decode()) == KEY.verify_key
    assert bytes(parse_verify_key(kp.public_key)) == kp.raw_public
    for bad in ("", "abc", base64.b64encode(b"x" * 31).decode()):
        with pytest.raises(ValueError):
            parse_verify_key(bad)


# --- chain ------------------------------------------------------------------------


def test_chain_ok_loop_and_hops() -> None:
    chain = [{"application": "a", "start": "plan"}, {"application": "me", "start": "other"}]
    assert check_chain(chain, application="me", skill="echo", max_hops=5) is None
    loop = check_chain(chain, application="me", skill="other", max_hops=5)
    assert loop == ChainRefusal(
        "limit.mesh-loop",
        {"entry": {"application": "me", "start": "other"}, "chain": chain},
    )
    hops = check_chain(chain, application="me", skill="echo", max_hops=2)
    assert hops is not None and hops.code == "limit.hops"
    assert hops.details["maxMeshHops"] == 2 and hops.details["chain"] == chain
    assert hops.metadata() == {"code": "limit.hops", "details": hops.details}
    # Without a skill, any entry of this application is a loop.
    assert check_chain(chain, application="me", skill=None, max_hops=5) is not None
    assert check_chain([], application="me", skill="x", max_hops=0) is not None


def test_extend_chain_appends_this_hop() -> None:
    out = extend_chain([{"application": "a"}], application="me", start="echo", execution_id="t1")
    assert out == [
        {"application": "a"},
        {"application": "me", "executionId": "t1", "start": "echo"},
    ]


# --- report -----------------------------------------------------------------------


def test_report_round_trip_and_each_refusal() -> None:
    bh = body_hash(MESSAGE)
    token = sign_report(
        issuer="me",
        execution_id="task-1",
        spend_total="0.25",
        body_hash=bh,
        issued_at=NOW,
        signing_key=KEY,
    )
    header = json.loads(base64.urlsafe_b64decode(token.split(".")[0] + "=="))
    assert header == {"alg": "EdDSA", "typ": "agboss-mesh-report"}
    r = verify_report(
        token, issuer_key=KEY.verify_key, expected_body_hash=bh, expected_execution_id="task-1"
    )
    assert r.spend_total == Decimal("0.25") and r.issuer == "me" and r.currency == "USD"
    assert r.claims["schema"] == 1
    cases = [
        {
            "issuer_key": OTHER.verify_key,
            "expected_body_hash": bh,
            "expected_execution_id": "task-1",
        },
        {
            "issuer_key": KEY.verify_key,
            "expected_body_hash": "sha256:0",
            "expected_execution_id": "task-1",
        },
        {"issuer_key": KEY.verify_key, "expected_body_hash": bh, "expected_execution_id": "task-2"},
    ]
    for kw in cases:
        with pytest.raises(ReportInvalid):
            verify_report(token, **kw)  # type: ignore[arg-type]
    with pytest.raises(ReportInvalid):
        verify_report(
            sign_envelope({"schema": 1}, KEY),
            issuer_key=KEY.verify_key,
            expected_body_hash=bh,
            expected_execution_id="task-1",
        )
    with pytest.raises(ReportInvalid):
        verify_report(
            "x.y", issuer_key=KEY.verify_key, expected_body_hash=bh, expected_execution_id="task-1"
        )
    with pytest.raises(ValueError):
        sign_report(
            issuer="me",
            execution_id="t",
            spend_total="-1",
            body_hash=bh,
            issued_at=NOW,
            signing_key=KEY,
        )


# --- durations and money ----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("PT60S", 60),
        ("PT1.5S", 1.5),
        ("PT86400S", 86400),
        ("P1DT2H", 93600),
        ("PT2M", 120),
        ("P1D", 86400),
        ("PT0S", 0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "P", "PT", "60", "P1Y", "P1W", "PT-1S", "P1DT", 60])
def test_parse_duration_refuses(bad: Any) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_format_duration() -> None:
    assert format_duration(86400) == "PT86400S"
    assert format_duration(1.5) == "PT1.5S"
    assert format_duration(0) == "PT0S"
    assert parse_duration(format_duration(12.25)) == 12.25
    with pytest.raises(ValueError):
        format_duration(-1)


def test_usd_strings() -> None:
    assert parse_usd("0.25") == Decimal("0.25")
    for bad in ("-1", "1e3", "", 1.5, "NaN", " 1"):
        with pytest.raises(ValueError):
            parse_usd(bad)
    assert format_usd(Decimal("1.500")) == "1.5"
    assert format_usd(Decimal("3")) == "3"
    assert format_usd(Decimal("1E+2")) == "100"
    assert format_usd("0.000") == "0"
    with pytest.raises(ValueError):
        format_usd(Decimal("-1"))


# --- the replay window and the replay cache (issue #20, gap 4) -----------------------


def test_a_sender_cannot_widen_the_window_past_the_seeds_plus_the_skew() -> None:
    # Issued 300 s ago with PT600S: accepted before (capped at 600 s), refused now.
    wide = sign_envelope(_claims(issuedAt=format_instant(NOW - 300), expiresIn="PT600S"), KEY)
    assert _code(wide) == "mesh.envelope-expired"
    long = sign_envelope(_claims(expiresIn="PT600S"), KEY)
    assert _verify(long, now=NOW + 60 + CLOCK_SKEW_S).trusted  # PT60S plus the default skew
    assert _code(long, now=NOW + 60 + CLOCK_SKEW_S + 1) == "mesh.envelope-expired"
    # The skew is configurable, both ways of the window.
    tight = verify_envelope(long, own_application="me", issuer_keys=_known, now=NOW + 65, message=MESSAGE,
                            clock_skew_s=5)
    assert tight.trusted and tight.expires_at_s == NOW + 65
    with pytest.raises(MeshAuthError):
        verify_envelope(long, own_application="me", issuer_keys=_known, now=NOW + 66, message=MESSAGE,
                        clock_skew_s=5)
    with pytest.raises(MeshAuthError):
        verify_envelope(long, own_application="me", issuer_keys=_known, now=NOW - 6, message=MESSAGE,
                        clock_skew_s=5)


def test_a_trusted_envelope_is_accepted_once_inside_its_window() -> None:
    cache = ReplayCache()
    token = sign_envelope(_claims(), KEY)
    check = _verify(token)
    cache.check(check, now=NOW)
    with pytest.raises(MeshAuthError) as replayed:
        cache.check(_verify(token, now=NOW + 1), now=NOW + 1)
    assert replayed.value.code == "mesh.envelope-expired" and "replayed" in replayed.value.reason
    # Another envelope over the same message (a resend with a new issuedAt) is no replay.
    cache.check(_verify(sign_envelope(_claims(issuedAt=format_instant(NOW + 0.001)), KEY), now=NOW + 1),
                now=NOW + 1)
    # Claims bind nothing and are not remembered.
    claim = verify_envelope(unsecured_envelope(_claims(audience=None)), own_application="me",
                            issuer_keys=_known, now=NOW, message=MESSAGE)
    cache.check(claim, now=NOW)
    cache.check(claim, now=NOW)
    assert len(cache) == 2


def test_the_replay_cache_is_bounded_and_forgets_what_expired() -> None:
    cache = ReplayCache(max_entries=3)
    checks = [_verify(sign_envelope(_claims(issuedAt=format_instant(NOW + i / 1000)), KEY), now=NOW + 1)
              for i in range(4)]
    for c in checks:
        cache.check(c, now=NOW + 1)
    assert len(cache) == 3
    cache.check(checks[0], now=NOW + 1)  # the oldest went first: no longer remembered
    later = _verify(sign_envelope(_claims(issuedAt=format_instant(NOW + 200)), KEY), now=NOW + 200)
    cache.check(later, now=NOW + 200)
    assert len(cache) == 1  # the full cache dropped what had expired
