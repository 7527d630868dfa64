"""The stored credential stands in for an unreachable control plane, but not for a roster change it does not cover.

At start a node whose control plane is away connects with the credential it
stored. A roster change needs one naming the new agents: the stored one was
used all the same, the new agent was hosted and shown running while the broker
refused its subscriptions. ``covering=True`` (the roster-change path) refuses
instead, unless the stored grants cover every agent anyway (a service-role
credential's wildcards). And the renewal check comes when a credential is due,
even a 6 s one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshnode.config import Config
from meshnode.daemon.credentials import (
    CREDENTIAL_FILE,
    CredentialUnavailable,
    obtain_credential,
    store_credential,
)
from meshnode.protocol.nkeys import KeyPair
from meshnode.transport.embedded import EmbeddedNatsServer

#: Nothing listens on the discard port: the control plane is unreachable, at once.
AWAY = Config.model_validate({"mesh": {"servers": ["nats://127.0.0.1:4222"], "control_plane": "http://127.0.0.1:9"}})


@pytest.fixture
def mesh(tmp_path: Path) -> EmbeddedNatsServer:
    return EmbeddedNatsServer(tmp_path / "mesh")  # keys only: minting needs no running broker


async def test_a_roster_change_is_refused_when_the_stored_credential_does_not_name_the_new_agent(
    mesh: EmbeddedNatsServer, tmp_path: Path
) -> None:
    node, kept, added = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    jwt = mesh.mint_node_credential(node.public_key, [kept.public_key], 3600)
    store_credential(tmp_path, jwt, [kept.public_key])
    with pytest.raises(CredentialUnavailable, match="does not cover 1 of the roster's agents") as refused:
        await obtain_credential(AWAY, tmp_path, node, [kept, added], covering=True)
    assert added.public_key in str(refused.value) and "http://127.0.0.1:9" in str(refused.value)
    # At start (no roster change to honour) the stored one stands in, as before.
    assert await obtain_credential(AWAY, tmp_path, node, [kept, added]) == jwt
    # A removal leaves a roster the stored credential still covers.
    assert await obtain_credential(AWAY, tmp_path, node, [], covering=True) == jwt


async def test_a_service_role_credential_covers_any_roster_change(mesh: EmbeddedNatsServer, tmp_path: Path) -> None:
    node, kept, added = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    jwt = mesh.mint_node_credential(node.public_key, [kept.public_key], 3600, role="service")
    store_credential(tmp_path, jwt, [kept.public_key])
    assert await obtain_credential(AWAY, tmp_path, node, [kept, added], covering=True) == jwt


def test_the_renewal_check_comes_when_the_credential_is_due_even_a_short_one(mesh: EmbeddedNatsServer) -> None:
    """A 6 s credential is due after 4 s and expires 2 s later. With a 5 s floor
    on the check it was renewed 1 s before it expired, and under load after."""
    from meshnode.daemon.mesh import next_renewal_check
    from meshnode.transport.jwt import decode_jwt

    short = mesh.mint_node_credential(KeyPair.generate().public_key, [], 6)
    issued = decode_jwt(short)[1]["iat"]
    assert next_renewal_check(short, issued) == 4.0
    assert next_renewal_check(short, issued + 3.5) == 0.5
    assert next_renewal_check(short, issued + 4.5) == 5.0  # overdue (a renewal failed): again in 5 s
    day = mesh.mint_node_credential(KeyPair.generate().public_key, [], 86_400)
    assert next_renewal_check(day, decode_jwt(day)[1]["iat"]) == 3600.0  # looked at hourly at most
    assert next_renewal_check("not a jwt", issued) == 60.0


def test_the_stored_credential_is_private_and_written_whole(mesh: EmbeddedNatsServer, tmp_path: Path) -> None:
    node, data_dir = KeyPair.generate(), tmp_path / "node"
    data_dir.mkdir()
    for ttl in (3600, 7200):  # written, then replaced
        store_credential(data_dir, mesh.mint_node_credential(node.public_key, [], ttl), [])
    assert (data_dir / CREDENTIAL_FILE).stat().st_mode & 0o777 == 0o600
    assert [p.name for p in data_dir.iterdir()] == [CREDENTIAL_FILE]  # no temporary left beside it


async def test_a_credential_stored_under_other_grants_is_renewed_at_start(
    mesh: EmbeddedNatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After an upgrade that changed the grants meshnode mints (a purge grant on
    the mailboxes, say), the stored credential ran until it was due on the old
    ones, the broker refusing what the new code did. Stored under another
    revision (or none: an older version's file), it is renewed at start; with
    the control plane away it still stands in."""
    import json

    from meshnode.transport.permissions import grants_revision

    node, agent = KeyPair.generate(), KeyPair.generate()
    jwt = mesh.mint_node_credential(node.public_key, [agent.public_key], 3600)
    store_credential(tmp_path, jwt, [agent.public_key])
    stored = json.loads((tmp_path / CREDENTIAL_FILE).read_text())
    assert stored["grants"] == grants_revision()
    with caplog.at_level("INFO", logger="meshnode"):
        assert await obtain_credential(AWAY, tmp_path, node, [agent]) == jwt
    assert "control plane unreachable" not in caplog.text  # this version's: used as it is
    del stored["grants"]  # what an earlier version wrote
    (tmp_path / CREDENTIAL_FILE).write_text(json.dumps(stored))
    caplog.clear()
    with caplog.at_level("INFO", logger="meshnode"):
        assert await obtain_credential(AWAY, tmp_path, node, [agent]) == jwt  # the fallback
    assert "predates this version's grants: renewing it now" in caplog.text
    assert "control plane unreachable" in caplog.text  # it was asked
    # A node with no control plane (a mesh built elsewhere) has nothing to renew
    # from: its stored credential is used as it is, without a word at every start.
    caplog.clear()
    no_plane = Config.model_validate({"mesh": {"servers": ["nats://127.0.0.1:4222"]}})
    with caplog.at_level("INFO", logger="meshnode"):
        assert await obtain_credential(no_plane, tmp_path, node, [agent]) == jwt
    assert caplog.text == ""


def test_the_grants_revision_follows_the_grants(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshnode.transport import permissions

    before = permissions.grants_revision()
    assert len(before) == 16 and before == permissions.grants_revision()
    permissions.grants_revision.cache_clear()
    monkeypatch.setattr(permissions, "node_denials", lambda role="participant": ["$JS.API.EXTRA"])
    try:
        assert permissions.grants_revision() != before
    finally:
        permissions.grants_revision.cache_clear()


async def test_an_operators_renewal_asks_the_control_plane_and_says_when_it_cannot(
    mesh: EmbeddedNatsServer, tmp_path: Path
) -> None:
    """`meshnode renew` on a joined node re-presented the fresh stored credential
    without asking the control plane: a credential minted under older grants
    stayed until due, though the drain's warning said renewing fixes it."""
    node, agent = KeyPair.generate(), KeyPair.generate()
    jwt = mesh.mint_node_credential(node.public_key, [agent.public_key], 3600)
    store_credential(tmp_path, jwt, [agent.public_key])
    assert await obtain_credential(AWAY, tmp_path, node, [agent]) == jwt  # fresh: no control plane asked
    with pytest.raises(CredentialUnavailable, match="the control plane did not answer .*in force stays"):
        await obtain_credential(AWAY, tmp_path, node, [agent], covering=True, renew=True)
