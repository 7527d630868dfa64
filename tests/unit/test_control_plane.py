"""The credential control plane without a broker: signed renewal requests (WIRE-NOTES
"Credential renewal", §4.8), invite files, enrolment state and refusals, the
strict HTTP/1.1 parser, and the client's handling of answers."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import stat
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NatsClient

from meshnode.control_plane import (
    MAX_ROSTER,
    ControlPlaneClient,
    ControlPlaneServer,
    ControlPlaneStateError,
    ControlPlaneUnreachable,
    CredentialRefused,
    CredentialRequestError,
    InviteBundle,
    InviteError,
    node_credential_request,
    parse_invite,
    read_invite,
    verify_node_credential_request,
    write_invite,
)
from meshnode.protocol.nkeys import KeyPair, Prefix, verify
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.jwt import decode_jwt, format_creds, verify_jwt
from tests.fakes import ManualClock

NOW = 1_790_000_000
NATS_URL = "nats://127.0.0.1:4222"
CP_URL = "http://127.0.0.1:7422"


@pytest.fixture(scope="module")
def node() -> KeyPair:
    return KeyPair.generate(Prefix.USER)


@pytest.fixture(scope="module")
def agents() -> list[KeyPair]:
    return [KeyPair.generate(Prefix.USER) for _ in range(3)]


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _refusal(body: object, now: int = NOW) -> CredentialRequestError:
    with pytest.raises(CredentialRequestError) as caught:
        verify_node_credential_request(body, now)
    return caught.value


# --- signing and verifying requests ------------------------------------------------


def test_request_signs_the_wire_notes_strings(node: KeyPair, agents: list[KeyPair]) -> None:
    body = node_credential_request(node, agents, NOW)
    assert set(body) == {"node_id", "ts", "node_sig", "agents"}
    assert body["node_id"] == node.public_key and body["ts"] == NOW
    ids = sorted(a.public_key for a in agents)
    node_sig = base64.b64decode(body["node_sig"], validate=True)  # standard, padded
    assert body["node_sig"].endswith("=")
    assert verify(
        node.public_key, f"mesh-node-cred-v1:{NOW}:{node.public_key}:{','.join(ids)}".encode(),
        node_sig,
    )
    for agent, entry in zip(agents, body["agents"], strict=True):
        assert entry["id"] == agent.public_key
        assert verify(
            agent.public_key,
            f"mesh-node-agent-v1:{NOW}:{node.public_key}:{agent.public_key}".encode(),
            base64.b64decode(entry["sig"], validate=True),
        )
    assert verify_node_credential_request(body, NOW) == (
        node.public_key, [a.public_key for a in agents]
    )


def test_empty_roster_is_the_node_alone(node: KeyPair) -> None:
    body = node_credential_request(node, [], NOW)
    assert base64.b64decode(body["node_sig"]) and body["agents"] == []
    assert verify_node_credential_request(body, NOW) == (node.public_key, [])


def test_tampered_agent_signature_is_401(node: KeyPair, agents: list[KeyPair]) -> None:
    body = node_credential_request(node, agents, NOW)
    raw = bytearray(base64.b64decode(body["agents"][1]["sig"]))
    raw[0] ^= 1
    body["agents"][1]["sig"] = _b64(bytes(raw))
    error = _refusal(body)
    assert (error.status, error.code) == (401, "bad_signature")
    assert agents[1].public_key in error.error


def test_agent_signatures_cannot_be_swapped_or_reused(
    node: KeyPair, agents: list[KeyPair]
) -> None:
    body = node_credential_request(node, agents[:2], NOW)
    body["agents"][0]["sig"], body["agents"][1]["sig"] = (
        body["agents"][1]["sig"], body["agents"][0]["sig"],
    )
    assert _refusal(body).status == 401
    # An agent signature made for another node does not vouch for this one.
    other = KeyPair.generate()
    foreign = node_credential_request(other, agents[:1], NOW)["agents"][0]
    body = node_credential_request(node, agents[:1], NOW)
    body["agents"][0] = foreign
    assert _refusal(body).code == "bad_signature"


def test_node_signature_covers_the_roster(node: KeyPair, agents: list[KeyPair]) -> None:
    body = node_credential_request(node, agents[:2], NOW)
    extra = node_credential_request(node, agents[2:], NOW)["agents"][0]
    body["agents"].append(extra)  # a valid agent signature, added after the node signed
    assert (_refusal(body).status, _refusal(body).code) == (401, "bad_signature")
    # Signed by someone else's key altogether.
    body = node_credential_request(node, agents, NOW)
    body["node_sig"] = node_credential_request(agents[0], agents, NOW)["node_sig"]
    assert _refusal(body).status == 401


def test_node_signature_over_an_unsorted_roster_is_refused(
    node: KeyPair, agents: list[KeyPair]
) -> None:
    ids = [a.public_key for a in agents]
    unsorted = sorted(ids, reverse=True)
    assert unsorted != sorted(ids)
    body = node_credential_request(node, agents, NOW)
    body["node_sig"] = _b64(
        node.sign(f"mesh-node-cred-v1:{NOW}:{node.public_key}:{','.join(unsorted)}".encode())
    )
    error = _refusal(body)
    assert (error.status, error.code) == (401, "bad_signature")
    # The order of the agents list itself does not matter: the message sorts.
    body = node_credential_request(node, agents, NOW)
    body["agents"].reverse()
    assert verify_node_credential_request(body, NOW)[1] == list(reversed(ids))


def test_stale_or_future_ts_is_401(node: KeyPair, agents: list[KeyPair]) -> None:
    body = node_credential_request(node, agents, NOW)
    for now in (NOW + 301, NOW - 301):
        error = _refusal(body, now)
        assert (error.status, error.code) == (401, "stale_request")
    assert verify_node_credential_request(body, NOW + 300)[0] == node.public_key
    assert verify_node_credential_request(body, NOW - 300)[0] == node.public_key
    assert verify_node_credential_request(body, NOW + 3000, max_skew_s=3600)[0] == node.public_key


def test_base64url_signatures_are_accepted(node: KeyPair, agents: list[KeyPair]) -> None:
    body = node_credential_request(node, agents, NOW)

    def url(sig: str) -> str:
        return base64.urlsafe_b64encode(base64.b64decode(sig)).decode().rstrip("=")

    body["node_sig"] = url(body["node_sig"])
    for entry in body["agents"]:
        entry["sig"] = url(entry["sig"])
    assert verify_node_credential_request(body, NOW)[0] == node.public_key
    body["node_sig"] = "not base64 at all!"
    assert _refusal(body).code == "bad_signature"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b.pop("node_sig"),
        lambda b: b.pop("agents"),
        lambda b: b.update(extra=1),
        lambda b: b.update(ts=True),
        lambda b: b.update(ts=str(NOW)),
        lambda b: b.update(ts=float(NOW)),
        lambda b: b.update(node_id="UNOTAKEY"),
        lambda b: b.update(node_id=KeyPair.generate(Prefix.ACCOUNT).public_key),
        lambda b: b.update(node_sig=12),
        lambda b: b.update(agents={}),
        lambda b: b["agents"].append(dict(b["agents"][0])),
        lambda b: b["agents"][0].update(note="x"),
        lambda b: b["agents"][0].update(id="mesh.agent.*"),
        lambda b: b["agents"].append("agent"),
    ],
)
def test_malformed_requests_are_400(
    node: KeyPair, agents: list[KeyPair], mutate: Callable[[dict[str, Any]], object]
) -> None:
    body = node_credential_request(node, agents, NOW)
    mutate(body)
    error = _refusal(body)
    assert (error.status, error.code) == (400, "malformed_request")
    assert set(error.body()) == {"error", "code"}


def test_malformed_bodies_and_oversized_rosters(node: KeyPair) -> None:
    not_objects: list[object] = [None, [], "x", 1]
    for not_an_object in not_objects:
        assert _refusal(not_an_object).status == 400
    roster = [KeyPair.generate() for _ in range(MAX_ROSTER + 1)]
    with pytest.raises(ValueError, match="at most"):
        node_credential_request(node, roster, NOW)
    body = node_credential_request(node, roster[:1], NOW)
    body["agents"] = body["agents"] * (MAX_ROSTER + 1)
    assert _refusal(body).status == 400


def test_request_builder_refuses_bad_input(node: KeyPair, agents: list[KeyPair]) -> None:
    with pytest.raises(ValueError, match="twice"):
        node_credential_request(node, [agents[0], agents[0]], NOW)
    with pytest.raises(ValueError, match="user"):
        node_credential_request(KeyPair.generate(Prefix.ACCOUNT), agents, NOW)
    with pytest.raises(ValueError, match="ts"):
        node_credential_request(node, agents, 0)


# --- invite files ---------------------------------------------------------------------


@pytest.fixture
def mesh_keys_only(tmp_path: Path) -> EmbeddedNatsServer:
    """An embedded mesh that is never started: enough to mint with its keys."""
    return EmbeddedNatsServer(tmp_path / "data")


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(NOW)


@pytest.fixture
def control(
    tmp_path: Path, mesh_keys_only: EmbeddedNatsServer, clock: ManualClock
) -> ControlPlaneServer:
    return ControlPlaneServer(
        mesh_keys_only, tmp_path / "cp", port=0, nats_urls=[NATS_URL], clock=clock
    )


def test_invite_file_round_trip(tmp_path: Path, control: ControlPlaneServer) -> None:
    bundle = control.invite("alpha")
    node_name, node_seed, jwt = bundle  # a plain triple
    assert node_name == "alpha" and node_seed.startswith("SU")
    assert node_seed not in repr(bundle)

    path = tmp_path / "alpha.creds"
    write_invite(path, bundle, [NATS_URL, "wss://mesh.example:443"], CP_URL)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert format_creds(jwt, node_seed) in text  # the standard creds blocks, unchanged
    assert f"# meshnode-nats: {NATS_URL}" in text
    assert f"# meshnode-control-plane: {CP_URL}" in text

    invite = read_invite(path)
    assert (invite.node_seed, invite.jwt) == (node_seed, jwt)
    assert invite.nats_urls == (NATS_URL, "wss://mesh.example:443")
    assert invite.control_plane_url == CP_URL
    assert invite.name == "alpha"
    assert invite.node_id == bundle.node_id == KeyPair.from_seed(node_seed).public_key
    assert node_seed not in repr(invite) and jwt not in repr(invite)

    with pytest.raises(FileExistsError):
        write_invite(path, bundle, [NATS_URL], CP_URL)
    write_invite(path, bundle, [NATS_URL], None, overwrite=True)
    assert read_invite(path).control_plane_url is None
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_invite_file_is_readable_by_nats_py(tmp_path: Path, control: ControlPlaneServer) -> None:
    # nats-py's own line-oriented creds readers must skip our comment lines.
    bundle = control.invite("alpha")
    path = tmp_path / "alpha.creds"
    write_invite(path, bundle, [NATS_URL], CP_URL)
    client = NatsClient()
    assert bytes(client._read_creds_user_jwt(str(path))).decode() == bundle.jwt
    assert bytes(client._read_creds_user_nkey(str(path))).decode() == bundle.node_seed


def test_plain_creds_parse_without_urls(control: ControlPlaneServer) -> None:
    bundle = control.invite("plain")
    invite = parse_invite(format_creds(bundle.jwt, bundle.node_seed))
    assert (invite.node_seed, invite.jwt) == (bundle.node_seed, bundle.jwt)
    assert invite.nats_urls is None and invite.control_plane_url is None and invite.name is None


def test_invite_parse_refuses_bad_files(control: ControlPlaneServer) -> None:
    bundle = control.invite("alpha")
    other = control.invite("beta")
    with pytest.raises(InviteError, match="credentials"):
        parse_invite("# meshnode-nats: nats://x:4222\n")
    with pytest.raises(InviteError, match="not issued"):
        parse_invite(format_creds(bundle.jwt, other.node_seed))
    creds = format_creds(bundle.jwt, bundle.node_seed)
    for line in (
        "# meshnode-nats: http://wrong-scheme:4222",
        "# meshnode-control-plane: nats://wrong-scheme:7422",
        f"# meshnode-node-id: {other.node_id}",
        "# meshnode-node-name: has space",
    ):
        with pytest.raises(InviteError):
            parse_invite(line + "\n" + creds)
    # Several nats lines accumulate; unknown meshnode lines are ignored.
    invite = parse_invite(
        "# meshnode-nats: nats://a:4222, nats://b:4222\n# meshnode-nats: tls://c:4222\n"
        "# meshnode-future-field: whatever\n" + creds
    )
    assert invite.nats_urls == ("nats://a:4222", "nats://b:4222", "tls://c:4222")


def test_write_invite_refuses_values_that_would_corrupt_the_file(
    tmp_path: Path, control: ControlPlaneServer
) -> None:
    bundle = control.invite("alpha")
    for urls, cp in (
        (["nats://a:4222\n-----BEGIN NATS USER JWT-----"], CP_URL),
        (["nats://host---x:4222"], CP_URL),
        ([NATS_URL], "ftp://cp.example"),
    ):
        with pytest.raises(ValueError):
            write_invite(tmp_path / "x.creds", bundle, urls, cp)
    assert not (tmp_path / "x.creds").exists()
    with pytest.raises(ValueError):
        write_invite(tmp_path / "x.creds", InviteBundle("a--b", bundle.node_seed, bundle.jwt),
                     [NATS_URL], CP_URL)


# --- enrolment, issuing and refusals (no HTTP) ---------------------------------------------


def test_invite_enrols_and_mints_a_starter_credential(
    control: ControlPlaneServer, mesh_keys_only: EmbeddedNatsServer
) -> None:
    bundle = control.invite("alpha")
    claims = verify_jwt(bundle.jwt, mesh_keys_only.account_public_key, now=NOW)
    assert claims["sub"] == bundle.node_id
    assert claims["exp"] - claims["iat"] == 3600  # an hour, and it grants nothing at all
    assert "agentmesh:role:starter" in claims["nats"]["tags"]
    for direction in ("pub", "sub"):
        assert not claims["nats"][direction].get("allow"), direction
    assert "resp" not in claims["nats"]
    [node] = control.list_nodes()
    assert (node.node_id, node.name, node.retired) == (bundle.node_id, "alpha", False)
    assert node.credential_expires_at == NOW + 3600
    assert stat.S_IMODE(os.stat(control.state_path).st_mode) == 0o600
    with pytest.raises(ValueError, match="already named"):
        control.invite("alpha")
    with pytest.raises(ValueError):
        control.invite("bad name")


def test_issue_credential_covers_exactly_the_roster(
    control: ControlPlaneServer, mesh_keys_only: EmbeddedNatsServer, agents: list[KeyPair]
) -> None:
    bundle = control.invite("alpha")
    key = KeyPair.from_seed(bundle.node_seed)
    answer = control.issue_credential(node_credential_request(key, agents[:2], NOW))
    assert answer["node_id"] == key.public_key
    assert answer["agents"] == [a.public_key for a in agents[:2]]
    assert answer["expires_at"] == NOW + 86400
    assert answer["mesh"] == {
        "name": "meshnode-local", "protocol": "0.3",
        "nats_endpoints": [NATS_URL], "endpoints": [NATS_URL],
        "inbox_prefix": f"_INBOX_{key.public_key}",
    }
    claims = verify_jwt(answer["jwt"], mesh_keys_only.account_public_key, now=NOW)
    assert claims["exp"] == answer["expires_at"]
    inboxes = {s for s in claims["nats"]["sub"]["allow"] if s.startswith("mesh.agent.")}
    assert inboxes == {f"mesh.agent.{a.public_key}.inbox" for a in agents[:2]}


def _code(control: ControlPlaneServer, body: dict[str, Any]) -> tuple[int, str | None]:
    with pytest.raises(CredentialRequestError) as caught:
        control.issue_credential(body)
    return caught.value.status, caught.value.code


def test_reads_follow_every_change_of_nodes_json(
    tmp_path: Path, control: ControlPlaneServer, mesh_keys_only: EmbeddedNatsServer, clock: ManualClock,
    agents: list[KeyPair],
) -> None:
    # The registry asks on every registration (retired? which tier?), so reads are
    # served from the last parse while the file is unchanged; every change must show.
    agent = agents[0].public_key
    key = KeyPair.from_seed(control.invite("alpha").node_seed)
    assert control.trust_tier_of(key.public_key) == "standard" and not control.agent_retired(agent)
    control.retire_agent(agent)  # a write by this process
    assert control.agent_retired(agent)

    # Another process (the CLI) changes the file: a second control plane on the same directory.
    other = ControlPlaneServer(mesh_keys_only, tmp_path / "cp", port=0, nats_urls=[NATS_URL], clock=clock)
    other.retire_node(key.public_key)
    assert [n.retired for n in control.list_nodes()] == [True]
    sandbox = KeyPair.from_seed(other.invite("beta", trust_tier="sandbox").node_seed)
    assert control.trust_tier_of(sandbox.public_key) == "sandbox"

    # A loosened mode is still restricted at the next read, as a fresh read does.
    state_file = control.state_path
    os.chmod(state_file, 0o644)
    assert control.trust_tier_of(sandbox.public_key) == "sandbox"
    assert stat.S_IMODE(os.stat(state_file).st_mode) == 0o600

    # A damaged file is reported, not served from the last good parse.
    state_file.write_text("{not json")
    os.chmod(state_file, 0o600)
    with pytest.raises(ControlPlaneStateError):
        control.agent_retired(agent)


def test_refusals_carry_the_revocation_codes(
    control: ControlPlaneServer, clock: ManualClock, agents: list[KeyPair]
) -> None:
    stranger = KeyPair.generate()
    assert _code(control, node_credential_request(stranger, [], NOW)) == (403, "node_unknown")

    key = KeyPair.from_seed(control.invite("alpha").node_seed)
    control.issue_credential(node_credential_request(key, agents, NOW))

    paused = control.pause_agent(agents[0].public_key)
    assert "credentials covering it stay usable until" in paused
    assert _code(control, node_credential_request(key, agents, NOW)) == (403, "agent_paused")
    control.resume_agent(agents[0].public_key)
    control.issue_credential(node_credential_request(key, agents, NOW))

    retired = control.retire_agent(agents[1].public_key)
    assert retired.startswith(f"agent {agents[1].public_key} retired: credentials covering it")
    assert "stay usable until" in retired and "(up to 24 h)" in retired
    assert "renewal of any credential covering it is now refused" in retired
    assert _code(control, node_credential_request(key, agents, NOW)) == (403, "agent_terminated")
    with pytest.raises(ValueError, match="permanent"):
        control.resume_agent(agents[1].public_key)
    # The node renews for the roster without the retired agent.
    control.issue_credential(node_credential_request(key, [agents[0], agents[2]], NOW))

    clock.now = NOW + 3600
    message = control.retire_node(key.public_key)
    assert "credential stays usable until" in message
    assert "(up to 23 h)" in message  # the last 24 h credential; the 1 h starter has lapsed
    assert message.endswith("renewal is now refused")
    assert control.retire_node(key.public_key) == message  # idempotent
    body = node_credential_request(key, [], NOW + 3600)
    assert _code(control, body) == (403, "node_retired")
    with pytest.raises(LookupError):
        control.retire_node(stranger.public_key)
    with pytest.raises(ValueError, match="retired"):
        control.enrol_node(key.public_key, "alpha")


def test_retire_message_when_nothing_is_valid_any_more(
    control: ControlPlaneServer, clock: ManualClock
) -> None:
    node_id = control.invite("alpha").node_id
    clock.now = NOW + 8 * 24 * 3600
    message = control.retire_node(node_id)
    assert "no credential issued to it is still valid" in message


def test_an_invite_not_used_within_its_validity_expires(
    control: ControlPlaneServer, clock: ManualClock, agents: list[KeyPair]
) -> None:
    """An invite holds the node's key: unused, it enrolled whoever held the file at
    any later time. Its first credential must now come within invite_valid_s (7 days)."""
    late = control.invite("late")
    late_key = KeyPair.from_seed(late.node_seed)
    on_time = control.invite("on-time")
    on_time_key = KeyPair.from_seed(on_time.node_seed)
    [listed] = [n for n in control.list_nodes() if n.name == "late"]
    assert listed.invite_expires_at == NOW + 7 * 86400
    clock.now = NOW + 86400
    control.issue_credential(node_credential_request(on_time_key, agents[:1], clock.now))  # within: used
    clock.now = NOW + 7 * 86400 + 1
    with pytest.raises(CredentialRequestError) as refused:
        control.issue_credential(node_credential_request(late_key, agents[:1], clock.now))
    assert (refused.value.status, refused.value.code) == (403, "invite_expired")
    assert "the invite of node late expired unused at " in refused.value.error
    assert "(meshnode mesh invite late)" in refused.value.error
    # The node that started in time renews as usual; its invite no longer matters.
    control.issue_credential(node_credential_request(on_time_key, agents[:1], clock.now))
    assert [n.invite_expires_at for n in control.list_nodes() if n.name == "on-time"] == [None]


def test_invites_that_never_expire_and_state_from_before_they_did(
    tmp_path: Path, mesh_keys_only: EmbeddedNatsServer, clock: ManualClock, agents: list[KeyPair]
) -> None:
    forever = ControlPlaneServer(mesh_keys_only, tmp_path / "forever", port=0, nats_urls=[NATS_URL],
                                 clock=clock, invite_valid_s=None)
    key = KeyPair.from_seed(forever.invite("patient").node_seed)
    clock.now = NOW + 365 * 86400
    forever.issue_credential(node_credential_request(key, agents[:1], clock.now))
    # A nodes.json written before invites expired has no invite_expires_at: no deadline.
    state = tmp_path / "forever" / "nodes.json"
    data = json.loads(state.read_text())
    for record in data["nodes"].values():
        record.pop("invite_expires_at")
    state.write_text(json.dumps(data))
    assert [n.invite_expires_at for n in forever.list_nodes()] == [None]


def test_a_node_is_retired_by_the_name_it_was_invited_under(
    control: ControlPlaneServer, clock: ManualClock
) -> None:
    """``mesh nodes`` shows names; ``mesh retire --node laptop`` said "node laptop is not enrolled"."""
    node_id = control.invite("laptop").node_id
    assert control.retire_node("laptop").startswith(f"node laptop ({node_id}) retired")
    # The name is the active node's: the retired one that had it before is not meant.
    again = control.invite("laptop").node_id
    assert control.retire_node("laptop").startswith(f"node laptop ({again}) retired")
    # Both retired: the name no longer says which.
    with pytest.raises(LookupError, match=r"2 nodes were invited as 'laptop' \(.*\): name the one to retire by its id"):
        control.retire_node("laptop")
    assert control.retire_node(node_id).startswith(f"node laptop ({node_id}) retired")  # by id, as always
    with pytest.raises(LookupError, match=r"no node with the id or name 'nobody' is enrolled"):
        control.retire_node("nobody")


def test_state_is_shared_through_the_file(
    tmp_path: Path, control: ControlPlaneServer, mesh_keys_only: EmbeddedNatsServer
) -> None:
    # A second instance (the CLI, say) retiring a node takes effect at once.
    key = KeyPair.from_seed(control.invite("alpha").node_seed)
    other = ControlPlaneServer(mesh_keys_only, tmp_path / "cp", nats_urls=[NATS_URL])
    other.retire_node(key.public_key)
    assert _code(control, node_credential_request(key, [], NOW)) == (403, "node_retired")


def test_a_corrupt_state_file_fails_closed(
    control: ControlPlaneServer
) -> None:
    key = KeyPair.from_seed(control.invite("alpha").node_seed)
    control.state_path.write_text("{not json")
    with pytest.raises(ControlPlaneStateError):
        control.issue_credential(node_credential_request(key, [], NOW))
    with pytest.raises(ControlPlaneStateError):
        control.list_nodes()


def test_mint_and_refusal_logs_hold_no_secrets(
    control: ControlPlaneServer, agents: list[KeyPair], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    bundle = control.invite("alpha")
    key = KeyPair.from_seed(bundle.node_seed)
    answer = control.issue_credential(node_credential_request(key, agents, NOW), peer="10.0.0.1")
    control.retire_node(key.public_key)
    with pytest.raises(CredentialRequestError):
        control.issue_credential(node_credential_request(key, agents, NOW), peer="10.0.0.1")
    logged = caplog.text
    assert "issued a participant credential" in logged and "node_retired" in logged
    for secret in (bundle.jwt, bundle.node_seed, answer["jwt"]):
        assert secret not in logged
    for fragment in (bundle.jwt.split(".")[1][:40], answer["jwt"].split(".")[2]):
        assert fragment not in logged


def test_role_of_picks_the_permissions(tmp_path: Path, mesh_keys_only: EmbeddedNatsServer) -> None:
    server = ControlPlaneServer(
        mesh_keys_only, tmp_path / "cp", nats_urls=[NATS_URL], role_of=lambda _: "service",
    )
    key = KeyPair.from_seed(server.invite("services").node_seed)
    answer = server.issue_credential(node_credential_request(key, [], int(time.time())))
    _, claims = decode_jwt(answer["jwt"])
    assert "$JS.API.>" in claims["nats"]["pub"]["allow"]


# --- HTTP: the strict server, the client ------------------------------------------------


@pytest.fixture
async def running(control: ControlPlaneServer, clock: ManualClock) -> AsyncIterator[ControlPlaneServer]:
    clock.now = time.time()
    await control.start()
    try:
        yield control
    finally:
        await control.stop()


async def _raw(port: int, data: bytes, *, half_close: bool = True) -> tuple[int, dict[str, Any]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        if half_close:
            writer.write_eof()
        response = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"Content-Type: application/json" in head and b"Connection: close" in head
    return status, json.loads(body)


async def test_http_mesh_info(running: ControlPlaneServer) -> None:
    status, body = await _raw(
        running.port, b"GET /v1/mesh HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    assert status == 200
    assert body == {
        "name": "meshnode-local", "protocol": "0.3", "nats_endpoints": [NATS_URL],
        "control_plane": f"http://127.0.0.1:{running.port}",
        "inbox_prefixes": {"node": "_INBOX_{node_id}", "sdk": "_INBOX"},
    }
    info = await ControlPlaneClient(running.url).mesh_info()
    assert info.nats_endpoints == (NATS_URL,) and info.name == "meshnode-local"


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\n\r\n", 404, "not_found"),
        (b"DELETE /v1/mesh HTTP/1.1\r\nHost: x\r\n\r\n", 405, "method_not_allowed"),
        (b"GET /v1/node-credential HTTP/1.1\r\nHost: x\r\n\r\n", 405, "method_not_allowed"),
        (b"POST /v1/node-credential HTTP/1.1\r\nHost: x\r\n\r\n", 411, "length_required"),
        (b"POST /v1/node-credential HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
         b"2\r\n{}\r\n0\r\n\r\n", 501, "not_implemented"),
        (b"POST /v1/node-credential HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
         b"Content-Length: 2\r\n\r\n{}", 400, "malformed_request"),
        (b"POST /v1/node-credential HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
         400, "malformed_request"),
        (b"POST /v1/node-credential HTTP/1.1\r\nHost: x\r\nContent-Length: 999999\r\n\r\n",
         413, "payload_too_large"),
        (b"POST /v1/node-credential HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
         b"Content-Length: 2\r\n\r\n{}", 415, "unsupported_media_type"),
        (b"POST /v1/node-credential HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n{x}",
         400, "malformed_request"),
        (b"POST /v1/node-credential HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n[]",
         400, "malformed_request"),
        (b"GET /v1/mesh HTTP/1.1\r\n\r\n", 400, "malformed_request"),  # no Host
        (b"GET /v1/mesh HTTP/1.1\nHost: x\r\n\r\n", 400, "malformed_request"),  # bare LF
        (b"GET /v1/mesh HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", 400, "malformed_request"),
        (b"GET  /v1/mesh HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed_request"),
        (b"GET /v1/mesh HTTP/2.0\r\nHost: x\r\n\r\n", 400, "malformed_request"),
    ],
)
async def test_http_parser_is_strict(
    running: ControlPlaneServer, request_bytes: bytes, status: int, code: str
) -> None:
    got, body = await _raw(running.port, request_bytes)
    assert (got, body["code"]) == (status, code)
    assert isinstance(body["error"], str) and body["error"]


async def test_http_head_and_body_limits(running: ControlPlaneServer) -> None:
    huge = b"GET /v1/mesh HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 17000 + b"\r\n\r\n"
    status, body = await _raw(running.port, huge)
    assert (status, body["code"]) == (431, "headers_too_large")
    # A declared body over 256 KiB is refused before it is read, and the answer
    # still reaches a client that goes on sending it.
    big = b"x" * (256 * 1024 + 1)
    status, body = await _raw(
        running.port,
        b"POST /v1/node-credential HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(big)}\r\n\r\n".encode() + big,
    )
    assert (status, body["code"]) == (413, "payload_too_large")


async def test_http_slow_client_times_out(
    tmp_path: Path, mesh_keys_only: EmbeddedNatsServer
) -> None:
    server = ControlPlaneServer(
        mesh_keys_only, tmp_path / "cp", port=0, nats_urls=[NATS_URL], request_timeout_s=0.2
    )
    async with server:
        status, body = await _raw(
            server.port, b"POST /v1/node-credential HTTP/1.1\r\nHost: x\r\n", half_close=False
        )
    assert (status, body["code"]) == (408, "timeout")


async def test_client_renews_over_http(
    running: ControlPlaneServer, agents: list[KeyPair]
) -> None:
    key = KeyPair.from_seed(running.invite("alpha").node_seed)
    grant = await ControlPlaneClient(running.url).request_credential(key, agents)
    assert grant.nats_endpoints == (NATS_URL,) and grant.mesh_name == "meshnode-local"
    assert decode_jwt(grant.jwt)[1]["exp"] == grant.expires_at
    assert grant.jwt not in repr(grant)
    with pytest.raises(CredentialRefused) as caught:
        await ControlPlaneClient(running.url).request_credential(KeyPair.generate(), agents)
    assert (caught.value.status, caught.value.code) == (403, "node_unknown")
    assert caught.value.revoked and not caught.value.retryable


async def test_client_when_nothing_listens() -> None:
    # A port held bound but not listening refuses connections, and nothing
    # else can take it meanwhile (a released port could be).
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        with pytest.raises(ControlPlaneUnreachable):
            await ControlPlaneClient(f"http://127.0.0.1:{port}").mesh_info()


async def _fake_server(answer: bytes, *, hang: bool = False) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if hang:
            await asyncio.sleep(10)
        writer.write(answer)
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def test_client_reads_other_servers_answers() -> None:
    # Chunked framing (a proxy in front of a real control plane), the
    # {error: {code, message}} shape and a Retry-After header.
    chunks = json.dumps({"name": "m", "endpoints": ["nats://m:4222"]}).encode()
    server = await _fake_server(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + f"{len(chunks[:5]):x}\r\n".encode() + chunks[:5] + b"\r\n"
        + f"{len(chunks[5:]):x};ext=1\r\n".encode() + chunks[5:] + b"\r\n0\r\n\r\n"
    )
    async with server:
        port = server.sockets[0].getsockname()[1]
        info = await ControlPlaneClient(f"http://127.0.0.1:{port}/api/").mesh_info()
    assert info.nats_endpoints == ("nats://m:4222",) and info.name == "m"

    body = json.dumps({"error": {"code": "AGENT_PAUSED", "message": "paused"}}).encode()
    server = await _fake_server(
        b"HTTP/1.1 403 Forbidden\r\nRetry-After: 7\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    async with server:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(CredentialRefused) as caught:
            await ControlPlaneClient(f"http://127.0.0.1:{port}").mesh_info()
    refusal = caught.value
    assert (refusal.status, refusal.code, refusal.error) == (403, "agent_paused", "paused")
    assert refusal.retry_after_ms == 7000 and refusal.revoked

    server = await _fake_server(b"garbage\r\n\r\n")
    async with server:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(ControlPlaneUnreachable):
            await ControlPlaneClient(f"http://127.0.0.1:{port}").mesh_info()

    server = await _fake_server(b"", hang=True)
    async with server:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(ControlPlaneUnreachable, match="no answer"):
            await ControlPlaneClient(f"http://127.0.0.1:{port}", timeout_s=0.2).mesh_info()


def test_client_url_validation() -> None:
    for url in ("ftp://x", "http://", "http://u:p@x", "http://x/?q=1", "nats://x:4222"):
        with pytest.raises(ValueError):
            ControlPlaneClient(url)


# --- SDK enrolment tokens (POST /v1/bootstrap) --------------------------------------


def _bootstrap_code(control: ControlPlaneServer, body: object) -> tuple[int, str | None]:
    with pytest.raises(CredentialRequestError) as caught:
        control.bootstrap(body)
    return caught.value.status, caught.value.code


def test_token_is_stored_hashed_and_exchanged_once(
    control: ControlPlaneServer, mesh_keys_only: EmbeddedNatsServer, agents: list[KeyPair]
) -> None:
    token, record = control.create_token("sdk-bot", trust_tier="verified")
    assert token.startswith("am_") and record.expires_at == NOW + 7 * 24 * 3600
    assert token not in control.state_path.read_text()
    answer = control.bootstrap({"token": token, "agent_id": agents[0].public_key})
    assert set(answer) >= {"jwt", "seed", "creds", "mesh", "expires_at", "label", "renew_url"}
    assert answer["label"] == "sdk-bot" and answer["expires_at"] == "2026-09-22T14:13:20Z"
    assert answer["renew_url"].endswith("/v1/node-credential")
    assert answer["mesh"]["endpoints"] == [NATS_URL] and answer["mesh"]["inbox_prefix"] == "_INBOX"
    node_id = KeyPair.from_seed(answer["seed"]).public_key
    assert answer["node_id"] == node_id and node_id != agents[0].public_key
    claims = verify_jwt(answer["jwt"], mesh_keys_only.account_public_key, now=NOW)
    assert claims["sub"] == node_id and "agentmesh:profile:sdk" in claims["nats"]["tags"]
    assert "_INBOX.>" in claims["nats"]["sub"]["allow"]
    [node] = control.list_nodes()
    assert (node.profile, node.agent_id, node.trust_tier) == ("sdk", agents[0].public_key, "verified")
    assert control.sdk_agent_of(node_id) == agents[0].public_key
    # A self-vouch (the Python SDK's default node key is the agent's): the agent
    # key answers for itself, with the enrolment's tier; other keys for nothing.
    assert control.sdk_agent_of(agents[0].public_key) == agents[0].public_key
    assert control.trust_tier_of(agents[0].public_key) == "verified"
    assert control.sdk_agent_of(agents[1].public_key) is None
    # Single use, whoever asks.
    assert _bootstrap_code(control, {"token": token, "agent_id": agents[1].public_key}) == (403, "token_used")
    # Renewal keeps the one agent; another roster is refused.
    key = KeyPair.from_seed(answer["seed"])
    renewed = control.issue_credential(node_credential_request(key, agents[:1], NOW))
    assert renewed["mesh"]["inbox_prefix"] == "_INBOX"
    assert _code(control, node_credential_request(key, agents[:2], NOW)) == (403, "roster_mismatch")
    control.retire_node(node_id)
    assert control.sdk_agent_of(node_id) is None
    assert control.sdk_agent_of(agents[0].public_key) is None
    assert _code(control, node_credential_request(key, agents[:1], NOW)) == (403, "node_retired")


def test_expired_revoked_and_unknown_tokens_are_refused(
    control: ControlPlaneServer, clock: ManualClock, agents: list[KeyPair]
) -> None:
    agent = agents[0].public_key
    short, _ = control.create_token("short", ttl_s=60)
    revoked, _ = control.create_token("revoked")
    assert "revoked" in control.revoke_token("revoked")
    with pytest.raises(LookupError):
        control.revoke_token("revoked")  # no longer pending
    clock.now = NOW + 61
    assert _bootstrap_code(control, {"token": short, "agent_id": agent}) == (403, "token_expired")
    assert _bootstrap_code(control, {"token": revoked, "agent_id": agent}) == (403, "token_revoked")
    assert _bootstrap_code(control, {"token": "am_guess", "agent_id": agent}) == (403, "token_invalid")
    assert _bootstrap_code(control, {"token": "nope", "agent_id": agent}) == (400, "malformed_request")
    assert _bootstrap_code(control, {"token": short, "agent_id": "x"}) == (400, "malformed_request")
    assert _bootstrap_code(control, []) == (400, "malformed_request")
    states = {t.name: t.state(int(clock.now)) for t in control.list_tokens()}
    assert states == {"short": "expired", "revoked": "revoked"}
    # A retired agent is not enrolled again through a fresh token.
    fresh, _ = control.create_token("fresh")
    control.retire_agent(agent)
    assert _bootstrap_code(control, {"token": fresh, "agent_id": agent}) == (403, "agent_terminated")
    with pytest.raises(ValueError, match="pending token"):
        control.create_token("fresh")
