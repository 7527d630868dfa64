"""NATS JWT v2 minting, decoding and verification (§4.8, §18.2), credentials files,
and the §14.3 permission sets they carry. Pure: no broker."""

from __future__ import annotations

import base64
import json

import pytest

from meshnode.protocol.nkeys import KeyPair, Prefix, verify
from meshnode.transport.grants import PatternSet
from meshnode.transport.jwt import (
    JetStreamLimits,
    JwtError,
    ResponsePermission,
    compute_jti,
    decode_jwt,
    format_creds,
    mint_account_jwt,
    mint_operator_jwt,
    mint_user_jwt,
    nats_auth_callbacks,
    parse_creds,
    renew_at,
    verify_jwt,
)
from meshnode.transport.permissions import (
    LEGACY_INBOX_PREFIX,
    inbox_prefix_for,
    node_denials,
    node_inbox_prefix,
    node_permissions,
    sdk_permissions,
)

NOW = 1_790_000_000

# Minted by nsc / the Go nats-io/jwt v2 library (published in public docs and
# tests): the reference for our jti derivation and signature check.
GO_OPERATOR_JWT = (
    "eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.eyJleHAiOjE3ODE2MzI0NjUsImp0aSI6IkJWQVZUQkc1M0"
    "1aMkFaSTVYUjRFNVlPS0xHTk5ZTE40SllYV0U3T1I1M0VQSDJOU0pFSEEiLCJpYXQiOjE2MjM5NTI0NjUsImlzcyI6Ik9D"
    "TENLS1UzS0lMWjZaRDRESDNWNTdUSkJESUdKSllMWk1RNEhKUU9DNFJFUVEyVkFUVU01SlA1IiwibmFtZSI6IklTZWNMLW"
    "9wZXJhdG9yIiwic3ViIjoiT0NMQ0tLVTNLSUxaNlpENERIM1Y1N1RKQkRJR0pKWUxaTVE0SEpRT0M0UkVRUTJWQVRVTTVK"
    "UDUiLCJuYXRzIjp7InR5cGUiOiJvcGVyYXRvciIsInZlcnNpb24iOjJ9fQ.PDlhAwk1cLHpbCCAJhKGKvv36J_NXc2PSsn"
    "6i3znmjDYHXG3C_HhO9zxsln9Bd9ViolRw_L10N1QwoMjzCBtBQ"
)
GO_OPERATOR_KEY = "OCLCKKU3KILZ6ZD4DH3V57TJBDIGJJYLZMQ4HJQOC4REQQ2VATUM5JP5"
GO_USER_JWT = (
    "eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.eyJqdGkiOiJETFRGNFpLVVdNNFRPRkVNQko0UEUzTVFFVl"
    "hIUkJJN0xZNDdZNEMzNTNMWlJKSU5CUkJRIiwiaWF0IjoxNjI0ODg1NzMwLCJpc3MiOiJBQVlKRFZMWkdXTjdZM0ZCUENW"
    "WENSVlFaREZNWUdIVTRZWExHU1hYN1UyNTRLSDVTQzNSNVFLTSIsIm5hbWUiOiJ1c2VyIiwic3ViIjoiVUQzQkdXSUJQVT"
    "NDV0w0SE9VVTRWSkVRV1RVQVNBRUc2T0ozWEhNM0VFSk5BMlBBM1VWTllUWk4iLCJuYXRzIjp7InB1YiI6e30sInN1YiI6"
    "e30sInN1YnMiOi0xLCJkYXRhIjotMSwicGF5bG9hZCI6LTEsInR5cGUiOiJ1c2VyIiwidmVyc2lvbiI6Mn19.YmFL5nRMk"
    "EOXe77sQJPPRv_vwi89tzhVVl0AVjE4sXWyoWIHiCepNw28DbpJ0p_MlT8Qf0SY2cjAhIm-Qi7lDw"
)
GO_USER_ISSUER = "AAYJDVLZGWN7Y3FBPCVXCRVQZDFMYGHU4YXLGSXX7U254KH5SC3R5QKM"


@pytest.fixture(scope="module")
def operator() -> KeyPair:
    return KeyPair.generate(Prefix.OPERATOR)


@pytest.fixture(scope="module")
def account() -> KeyPair:
    return KeyPair.generate(Prefix.ACCOUNT)


@pytest.fixture(scope="module")
def user() -> KeyPair:
    return KeyPair.generate(Prefix.USER)


def _user_jwt(account: KeyPair, user: KeyPair, **overrides: object) -> str:
    options: dict[str, object] = {
        "name": "node",
        "issued_at": NOW,
        "expires_at": NOW + 3600,
        "pub_allow": ["mesh.event.>"],
        "sub_allow": ["mesh.feed.>"],
    }
    options.update(overrides)
    return mint_user_jwt(account, user.public_key, **options)  # type: ignore[arg-type]


def _resign(token: str, claims: dict[str, object], key: KeyPair) -> str:
    header = token.split(".")[0]
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    sig = base64.urlsafe_b64encode(key.sign(f"{header}.{body}".encode())).rstrip(b"=").decode()
    return f"{header}.{body}.{sig}"


# --- interoperability with the Go library ---------------------------------------


@pytest.mark.parametrize(
    ("token", "issuer"), [(GO_OPERATOR_JWT, GO_OPERATOR_KEY), (GO_USER_JWT, GO_USER_ISSUER)]
)
def test_go_minted_tokens_verify_and_match_our_jti(token: str, issuer: str) -> None:
    claims = verify_jwt(token, issuer)
    assert compute_jti(claims) == claims["jti"]


def test_jti_hashes_standard_claims_only_with_go_escaping() -> None:
    base = {"iat": 1, "iss": "A", "name": "a<b>&c", "sub": "U"}
    assert compute_jti({**base, "nats": {"anything": 1}, "jti": "ignored"}) == compute_jti(base)
    assert compute_jti(base) != compute_jti({**base, "name": "a<b>&d"})
    assert len(compute_jti(base)) == 52  # base32 of 32 bytes, unpadded


# --- minting and round trips ------------------------------------------------------


def test_operator_jwt_round_trip(operator: KeyPair, account: KeyPair) -> None:
    token = mint_operator_jwt(
        operator, name="mesh", system_account=account.public_key, issued_at=NOW
    )
    header, claims = decode_jwt(token)
    assert header == {"typ": "JWT", "alg": "ed25519-nkey"}
    assert claims["iss"] == claims["sub"] == operator.public_key
    assert claims["nats"] == {
        "system_account": account.public_key, "type": "operator", "version": 2,
    }
    assert "exp" not in claims
    assert claims["jti"] == compute_jti(claims)
    assert verify_jwt(token, operator.public_key, now=NOW) == claims


def test_account_jwt_enables_jetstream_unless_told_not_to(
    operator: KeyPair, account: KeyPair
) -> None:
    token = mint_account_jwt(
        operator, account.public_key, name="MESH", issued_at=NOW, expires_at=NOW + 10,
        jetstream=JetStreamLimits(disk_storage=1 << 30, streams=10),
    )
    claims = verify_jwt(token, operator.public_key)
    limits = claims["nats"]["limits"]
    assert (claims["nats"]["type"], claims["sub"], claims["exp"]) == ("account", account.public_key, NOW + 10)
    assert limits["disk_storage"] == 1 << 30
    assert limits["mem_storage"] == -1 and limits["streams"] == 10 and limits["consumer"] == -1

    system = mint_account_jwt(operator, account.public_key, name="SYS", issued_at=NOW, jetstream=None)
    _, system_claims = decode_jwt(system)
    assert "disk_storage" not in system_claims["nats"]["limits"]
    assert "mem_storage" not in system_claims["nats"]["limits"]


def test_user_jwt_round_trip(account: KeyPair, user: KeyPair) -> None:
    token = _user_jwt(
        account, user, pub_deny=["mesh.peer.>"], response=ResponsePermission(max_msgs=2, ttl_s=1.5)
    )
    claims = verify_jwt(token, account.public_key, now=NOW + 1)
    nats = claims["nats"]
    assert claims["sub"] == user.public_key and claims["name"] == "node"
    assert (claims["iat"], claims["exp"]) == (NOW, NOW + 3600)
    assert nats["pub"] == {"allow": ["mesh.event.>"], "deny": ["mesh.peer.>"]}
    assert nats["sub"] == {"allow": ["mesh.feed.>"]}
    assert nats["resp"] == {"max": 2, "ttl": 1_500_000_000}  # Go duration: nanoseconds
    assert nats["bearer_token"] is False
    assert (nats["type"], nats["version"]) == ("user", 2)


def test_empty_allow_list_denies_everything(account: KeyPair, user: KeyPair) -> None:
    # nats-server reads an empty permission block as "no restriction".
    _, claims = decode_jwt(_user_jwt(account, user, pub_allow=[], sub_allow=[]))
    assert claims["nats"]["pub"] == {"deny": [">"]}
    assert claims["nats"]["sub"] == {"deny": [">"]}


@pytest.mark.parametrize("expires_at", [NOW, NOW - 1, None])
def test_user_jwt_requires_a_finite_future_expiry(
    account: KeyPair, user: KeyPair, expires_at: int | None
) -> None:
    with pytest.raises((ValueError, TypeError)):
        _user_jwt(account, user, expires_at=expires_at)


def test_minting_refuses_wrong_key_roles(operator: KeyPair, account: KeyPair, user: KeyPair) -> None:
    with pytest.raises(ValueError, match="account key pair"):
        _user_jwt(operator, user)
    with pytest.raises(ValueError, match="user nkey"):
        mint_user_jwt(
            account, account.public_key, name="x", issued_at=NOW, expires_at=NOW + 1,
            pub_allow=[">"], sub_allow=[">"],
        )
    with pytest.raises(ValueError, match="operator key pair"):
        mint_account_jwt(account, account.public_key, name="x", issued_at=NOW)
    with pytest.raises(ValueError, match="invalid permission subject"):
        _user_jwt(account, user, pub_allow=["mesh event"])


# --- verification failures ---------------------------------------------------------


def test_verify_rejects_another_issuer(account: KeyPair, user: KeyPair) -> None:
    other = KeyPair.generate(Prefix.ACCOUNT)
    with pytest.raises(JwtError, match="expected key"):
        verify_jwt(_user_jwt(account, user), other.public_key)


def test_verify_rejects_tampering(account: KeyPair, user: KeyPair) -> None:
    token = _user_jwt(account, user)
    header, body, sig = token.split(".")
    _, claims = decode_jwt(token)
    claims["nats"]["pub"]["allow"] = [">"]
    forged_body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    with pytest.raises(JwtError, match="signature"):
        verify_jwt(f"{header}.{forged_body}.{sig}", account.public_key)
    flipped = sig[:-2] + ("A" if sig[-2] != "A" else "B") + sig[-1]
    with pytest.raises(JwtError):
        verify_jwt(f"{header}.{body}.{flipped}", account.public_key)


def test_verify_rejects_a_user_signing_a_user(user: KeyPair) -> None:
    # Correctly signed, but a user key may not issue credentials.
    token = _user_jwt(KeyPair.generate(Prefix.ACCOUNT), user)
    _, claims = decode_jwt(token)
    claims["iss"] = user.public_key
    with pytest.raises(JwtError, match="signature"):
        verify_jwt(_resign(token, claims, user), user.public_key)


def test_verify_rejects_operator_jwt_not_self_signed(operator: KeyPair, account: KeyPair) -> None:
    token = mint_operator_jwt(operator, name="m", system_account=account.public_key, issued_at=NOW)
    _, claims = decode_jwt(token)
    other = KeyPair.generate(Prefix.OPERATOR)
    claims["iss"] = other.public_key
    with pytest.raises(JwtError, match="self-signed"):
        verify_jwt(_resign(token, claims, other), other.public_key)


def test_verify_checks_time_like_the_server(account: KeyPair, user: KeyPair) -> None:
    token = _user_jwt(account, user)
    verify_jwt(token, account.public_key, now=NOW + 3600)  # valid through its exp second
    with pytest.raises(JwtError, match="expired"):
        verify_jwt(token, account.public_key, now=NOW + 3601)
    _, claims = decode_jwt(token)
    claims["nbf"] = NOW + 10
    future = _resign(token, claims, account)
    with pytest.raises(JwtError, match="not yet valid"):
        verify_jwt(future, account.public_key, now=NOW)
    assert verify_jwt(future, account.public_key, now=NOW + 10)["nbf"] == NOW + 10


@pytest.mark.parametrize(
    "token",
    [
        "",
        "a.b",
        "a.b.c.d",
        "eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.!!!.c2ln",
        "eyJ0eXAiOiJKV1QiLCJhbGciOiJIUzI1NiJ9.e30.c2ln",  # alg HS256
        "eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.WzFd.c2ln",  # claims is a list
        "eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.bm90IGpzb24.c2ln",  # not JSON
    ],
)
def test_decode_rejects_malformed_tokens(token: str) -> None:
    with pytest.raises(JwtError):
        decode_jwt(token)


# --- renewal -------------------------------------------------------------------------


def test_renew_at_two_thirds_of_own_lifetime() -> None:
    assert renew_at({"iat": 1000, "exp": 4000}) == 3000
    assert renew_at({"iat": NOW, "exp": NOW + 86400}) == NOW + 57600
    for claims in ({"iat": 1000}, {"iat": 1000, "exp": 1000}, {"exp": 10}, {"iat": True, "exp": 9}):
        with pytest.raises(JwtError):
            renew_at(claims)


# --- credentials files ---------------------------------------------------------------


def test_creds_round_trip(account: KeyPair, user: KeyPair) -> None:
    token = _user_jwt(account, user)
    text = format_creds(token, user.seed)
    assert text.startswith("-----BEGIN NATS USER JWT-----\n" + token + "\n------END NATS USER JWT------\n")
    assert f"-----BEGIN USER NKEY SEED-----\n{user.seed}\n------END USER NKEY SEED------\n" in text
    assert parse_creds(text) == (token, user.seed)
    assert parse_creds(text.replace("\n", "\r\n")) == (token, user.seed)


def test_parse_creds_reads_nsc_layout() -> None:
    seed = KeyPair.generate(Prefix.USER).seed
    nsc_text = (
        f"-----BEGIN NATS USER JWT-----\n{GO_USER_JWT}\n------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "Some prose about keeping the seed secret.\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n\n"
        "*************************************************************\n"
    )
    assert parse_creds(nsc_text) == (GO_USER_JWT, seed)


def test_creds_refuse_missing_blocks_and_non_user_seeds(account: KeyPair, user: KeyPair) -> None:
    token = _user_jwt(account, user)
    with pytest.raises(JwtError):
        parse_creds(f"-----BEGIN NATS USER JWT-----\n{token}\n------END NATS USER JWT------\n")
    with pytest.raises(ValueError):
        format_creds(token, account.seed)


def test_auth_callbacks_sign_the_server_nonce(user: KeyPair) -> None:
    current = ["first"]
    user_jwt_cb, signature_cb = nats_auth_callbacks(lambda: current[0], user)
    assert user_jwt_cb() == b"first"
    current[0] = "renewed"
    assert user_jwt_cb() == b"renewed"  # read at every (re)connect
    signature = base64.b64decode(signature_cb("nonce-123"))
    assert verify(user.public_key, b"nonce-123", signature, expect=Prefix.USER)
    with pytest.raises(ValueError):
        nats_auth_callbacks(lambda: "x", KeyPair.generate(Prefix.ACCOUNT))


# --- §14.3 permission sets -------------------------------------------------------------


@pytest.fixture(scope="module")
def roster() -> tuple[str, list[str]]:
    return (
        KeyPair.generate(Prefix.USER).public_key,
        [KeyPair.generate(Prefix.USER).public_key for _ in range(2)],
    )


def test_participant_publishes_only_for_itself(roster: tuple[str, list[str]]) -> None:
    node, agents = roster
    pub, sub = node_permissions(node, agents)
    assert f"mesh.registry.register.{node}" in pub
    # Granted so the registry answers UNAUTHORIZED instead of a broker drop
    # (permissions module note); the registry is the gate.
    assert "mesh.registry.register" in pub
    assert "mesh.registry.register.*" not in pub
    assert f"mesh.heartbeat.{node}" in pub and f"mesh.heartbeat.{node}.*" in pub
    assert "mesh.heartbeat.>" not in pub and "mesh.heartbeat.*" not in pub
    for agent in agents:
        assert f"mesh.feed.{agent}.>" in pub
        assert f"mesh.metrics.{agent}" in pub and f"mesh.log.{agent}.>" in pub
        assert f"mesh.agent.{agent}.inbox" in sub
        assert f"$JS.API.CONSUMER.MSG.NEXT.MESH_INBOX_{agent}.>" in pub
    for shared in ("mesh.agent.*.inbox", "mesh.task.*.update", "mesh.task.*.stream",
                   "mesh.event.>", "mesh.trace.>", "mesh.artifacts.>"):
        assert shared in pub
    assert "mesh.feed.>" not in pub
    assert "$JS.API.>" not in pub
    # Besides INFO, only the purge of its own agents' mailboxes (the drain empties
    # what it committed: the mailbox refuses new mail at its bound, issue #22.4)
    # and reading them by sequence (a copy a lost connection left out).
    own_ops = {f"$JS.API.STREAM.{op}.MESH_INBOX_{agent}" for agent in agents for op in ("PURGE", "MSG.GET")}
    assert own_ops <= set(pub)
    assert not any(s.startswith("$JS.API.STREAM.") and "INFO" not in s and s not in own_ops for s in pub)
    assert not any(s.startswith("_INBOX") for s in pub)


def test_participant_manages_no_consumer_on_the_shared_streams(roster: tuple[str, list[str]]) -> None:
    """#22: no create, pull or delete on MESH_TASKS/EVENTS/FEED (names cannot be
    granted per owner); the consumer service does it, on this node's own subjects."""
    node, agents = roster
    pub, _ = node_permissions(node, agents)
    for stream in ("MESH_TASKS", "MESH_EVENTS", "MESH_FEED"):
        ops = [s for s in pub if s.startswith(("$JS.API.CONSUMER.", "$JS.ACK.")) and f".{stream}." in s]
        assert ops == [f"$JS.API.CONSUMER.INFO.{stream}.>", f"$JS.ACK.{stream}.>"], ops
    assert f"mesh.consumers.ensure.{node}" in pub and f"mesh.consumers.delete.{node}" in pub
    assert not any(s.startswith("mesh.consumers.") and s.endswith(("*", ">")) for s in pub)
    denied = node_denials("participant")
    for stream, consumer in (("MESH_TASKS", "mesh_task_manager"), ("MESH_FEED", "mesh_feed_state_writer")):
        for op in ("CREATE", "DURABLE.CREATE", "MSG.NEXT", "DELETE"):
            assert f"$JS.API.CONSUMER.{op}.{stream}.{consumer}" in denied
        assert f"$JS.API.CONSUMER.CREATE.{stream}.{consumer}.>" in denied
        assert f"$JS.ACK.{stream}.{consumer}.>" in denied
        assert f"$JS.API.CONSUMER.INFO.{stream}.{consumer}" not in denied  # reading stays allowed
    assert node_denials("service") == []
    _, service_sub = node_permissions(node, agents, role="service")
    assert "mesh.consumers.>" in service_sub


def test_participant_reads_only_its_own_inboxes(roster: tuple[str, list[str]]) -> None:
    node, agents = roster
    _, sub = node_permissions(node, agents)
    assert [s for s in sub if s.startswith("mesh.agent.")] == [
        f"mesh.agent.{agent}.inbox" for agent in agents
    ]
    assert f"{node_inbox_prefix(node)}.>" in sub
    assert "_INBOX.>" not in sub
    for shared in ("mesh.task.*.update", "mesh.task.*.stream", "mesh.event.>",
                   "mesh.event.registry.>", "mesh.feed.*.*",
                   "mesh.trace.>", "mesh.metrics.>", "mesh.log.>"):
        assert shared in sub
    # The four-token feed grammar: a participant cannot listen on (and answer)
    # the platform's lookup subject mesh.feed.get (§18.3).
    assert "mesh.feed.>" not in sub and "mesh.feed.get" not in sub


def test_nobody_is_granted_the_peer_namespace(roster: tuple[str, list[str]]) -> None:
    node, agents = roster
    for role in ("participant", "service"):
        pub, sub = node_permissions(node, agents, role=role)
        assert not any(s.startswith("mesh.peer") or s in (">", "mesh.>") for s in pub + sub)


def test_service_role_adds_service_subjects(roster: tuple[str, list[str]]) -> None:
    node, agents = roster
    pub, sub = node_permissions(node, agents, role="service")
    for subject in ("mesh.registry.>", "mesh.presence.>", "mesh.heartbeat.>",
                    "mesh.task.>", "mesh.artifacts.>", "mesh.feed.get"):
        assert subject in sub
    assert "$JS.API.>" in pub and "$KV.>" in pub
    participant_pub, participant_sub = node_permissions(node, agents)
    # Whatever a participant may subscribe to, a service node may too (its agent
    # grants are the wildcard forms).
    service_sub = PatternSet(sub)
    assert all(service_sub.covers(s) for s in participant_sub)


def test_a_service_node_holds_wildcard_agent_grants_at_any_roster_size() -> None:
    """A service node's agent grants are wildcards, constant in its roster (the
    broker copies the JWT into every JetStream request's client info, and the
    per-agent form would not fit its JWT limit); participants never get them."""
    node = KeyPair.generate(Prefix.USER).public_key
    agents = [KeyPair.generate(Prefix.USER).public_key for _ in range(2001)]
    pub, sub = node_permissions(node, agents, role="service")
    assert "mesh.agent.*.inbox" in sub and not any(s == f"mesh.agent.{agents[0]}.inbox" for s in sub)
    assert {"mesh.feed.*.>", "mesh.metrics.*", "mesh.log.*.>"} <= set(pub)
    assert "mesh.feed.get" in sub and "mesh.feed.>" not in sub  # the lookup subject stays as it was
    assert node_permissions(node, agents[:1], role="service") == (pub, sub)  # constant in the roster
    assert node_permissions(node, [], role="service") == (pub, sub)
    participant_pub, participant_sub = node_permissions(node, agents[:3])
    assert "mesh.agent.*.inbox" not in participant_sub and "mesh.metrics.*" not in participant_pub
    assert f"mesh.agent.{agents[0]}.inbox" in participant_sub


def test_options_and_validation(roster: tuple[str, list[str]]) -> None:
    node, agents = roster
    pub, _ = node_permissions(node, agents, require_connection_bound=False)
    assert "mesh.registry.register" in pub
    _, sub = node_permissions(node, agents, inbox_prefix=LEGACY_INBOX_PREFIX)
    assert "_INBOX.>" in sub
    for bad in (">", "*", "mesh", "A" * 56):
        with pytest.raises(ValueError):
            node_permissions(node, [bad])
        with pytest.raises(ValueError):
            node_permissions(bad, agents)
    with pytest.raises(ValueError):
        node_permissions(node, agents, inbox_prefix="_INBOX.>")
    assert node_permissions(node, agents * 2) == node_permissions(node, agents)


def test_sdk_profile_grants_one_agent_and_the_default_reply_prefix(roster: tuple[str, list[str]]) -> None:
    node, agents = roster
    agent, other = agents
    pub, sub = sdk_permissions(node, agent)
    assert "_INBOX.>" in sub and not any(s.startswith("_INBOX_") for s in sub)
    assert "mesh.registry.register" in pub and f"mesh.heartbeat.{node}" in pub
    assert f"mesh.agent.{agent}.inbox" in sub and f"mesh.agent.{other}.inbox" not in sub
    assert f"mesh.feed.{agent}.>" in pub and f"mesh.feed.{other}.>" not in pub
    assert not any(other in s for s in pub + sub)  # nothing of another agent's mailbox
    assert f"$JS.API.CONSUMER.MSG.NEXT.MESH_INBOX_{agent}.>" in pub
    for never in ("$JS.API.>", "mesh.agent.*.outbox", "mesh.agent.>", "mesh.registry.>", "_INBOX.>"):
        assert never not in pub
    assert inbox_prefix_for("sdk", node) == "_INBOX"
    assert inbox_prefix_for("node", node) == f"_INBOX_{node}"
    with pytest.raises(ValueError):
        sdk_permissions(node, "mesh.>")
