"""What other machines are told to dial (``[mesh.embedded] advertise_host``):
a listener bound to every interface was advertised as 0.0.0.0, which no other
machine can dial."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from meshnode.control_plane import ControlPlaneServer
from meshnode.daemon.mesh import advertised_host
from meshnode.transport.embedded import EmbeddedNatsServer


def test_the_setting_wins_and_a_specific_bind_is_dialled_as_bound(caplog: pytest.LogCaptureFixture) -> None:
    assert advertised_host("0.0.0.0", "mesh.example.org", "host") == "mesh.example.org"
    assert advertised_host("127.0.0.1", None, "host") is None
    assert advertised_host("192.0.2.7", None, "control_host") is None
    assert not caplog.records


@pytest.mark.parametrize("bound", ["0.0.0.0", "::"])
def test_a_wildcard_bind_is_advertised_as_this_machines_name(
    bound: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("meshnode.daemon.mesh.socket.getfqdn", lambda: "hub.example.org")
    with caplog.at_level(logging.WARNING, logger="meshnode.daemon.mesh"):
        assert advertised_host(bound, None, "control_host") == "hub.example.org"
    [record] = caplog.records
    assert f"[mesh.embedded] control_host = {bound!r} listens on every interface" in record.getMessage()
    assert "set [mesh.embedded] advertise_host" in record.getMessage()


def test_the_control_plane_advertises_the_host_with_its_bound_port(tmp_path: Path) -> None:
    mesh = EmbeddedNatsServer(tmp_path / "mesh", host="0.0.0.0", advertise_host="hub.example.org")
    plane = ControlPlaneServer(mesh, tmp_path / "cp", host="0.0.0.0", port=17422, advertise_host="hub.example.org")
    assert plane.url == "http://hub.example.org:17422"
    v6 = ControlPlaneServer(mesh, tmp_path / "cp6", host="::", port=17422, advertise_host="2001:db8::7")
    assert v6.url == "http://[2001:db8::7]:17422"
