"""Presenting a re-issued credential (MeshLink.present): what a roster change
(an agent added or removed at runtime) waits for before it goes on."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest

from meshnode.config import Config
from meshnode.daemon import mesh
from meshnode.daemon.mesh import MeshLink
from meshnode.protocol.nkeys import KeyPair
from meshnode.testing import eventually_async
from tests.fakes import FakeConnection


def _link(tmp_path: Path, connection: FakeConnection) -> MeshLink:
    link = MeshLink(Config.model_validate({"node": {"data_dir": str(tmp_path)}}), tmp_path, KeyPair.generate(),
                    roster=list)
    link.connection = connection.as_connection()
    return link


async def test_a_reconnect_under_way_is_waited_out_then_the_credential_is_presented_by_a_new_one(
    tmp_path: Path,
) -> None:
    connection = FakeConnection()
    connection.is_connected = False  # reconnecting already: it may have sent the previous credential
    presenting = asyncio.create_task(_link(tmp_path, connection).present(wait=True))
    await eventually_async(lambda: connection.connected_waits == 1, what="present() waiting")
    assert connection.reconnects == 0 and not presenting.done()  # a reconnect now would be ignored
    connection.is_connected = True  # the earlier reconnect ends
    await eventually_async(lambda: connection.reconnects == 1, what="a reconnect of its own")
    await eventually_async(lambda: connection.connected_waits == 2, what="present() waiting again")
    assert not presenting.done()  # it waits for its own reconnect to be back too
    connection.is_connected = True
    await asyncio.wait_for(presenting, 10)


async def test_a_connection_that_does_not_come_back_fails_naming_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mesh, "_RECONNECT_WAIT_S", 0.2)
    connection = FakeConnection()
    with pytest.raises(ConnectionError, match=r"not back within 0.2 s after presenting .*127\.0\.0\.1:4222"):
        await _link(tmp_path, connection).present(wait=True)
    assert connection.reconnects == 1


async def test_without_wait_a_disconnected_link_is_left_to_its_own_reconnect(tmp_path: Path) -> None:
    connection = FakeConnection()
    connection.is_connected = False
    await _link(tmp_path, connection).present()
    assert connection.reconnects == 0
    connection.is_connected = True
    await _link(tmp_path, connection).present()
    assert connection.reconnects == 1


async def test_a_tenant_connection_lost_for_good_is_reported_like_the_nodes_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The node's own connection starts the node over when the client gives up for
    # good (an expired credential); a tenant's service connection went unheard,
    # leaving that tenant's registry and task manager deaf until a restart.
    made: list[FakeConnection] = []

    def fake_connection(*_: Any, **__: Any) -> FakeConnection:
        made.append(FakeConnection())
        return made[-1]

    monkeypatch.setattr(mesh, "MeshConnection", fake_connection)
    link = _link(tmp_path, FakeConnection())
    monkeypatch.setattr(link, "_mint_tenant_jwt", lambda tenant: f"jwt for {tenant}")
    lost: list[str] = []
    shutdown = cast(Any, type("Shutdown", (), {"push": lambda self, *a: None})())
    await link.connect_tenant("acme", shutdown, lambda: lost.append("acme"))
    assert lost == [] and link.tenant_connections["acme"] is made[0].as_connection()
    made[0].lose()
    assert lost == ["acme"]
