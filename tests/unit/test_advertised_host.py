"""What other machines are told to dial (``[mesh.embedded] advertise_host``):
a listener bound to every interface was advertised as 0.0.0.0, which no other
machine can dial."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from meshnode.config import EmbeddedMeshConfig
from meshnode.control_plane import ControlPlaneServer
from meshnode.daemon.mesh import advertised_host, reach_notes
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


def test_an_invite_says_when_its_urls_go_stale_or_reach_only_this_machine() -> None:
    """An invite from a hub on port 0 held URLs its next start would not answer, and
    one from a loopback hub (the default) works only on the hub's own machine: both
    were handed out without a word."""
    [only_here] = reach_notes(EmbeddedMeshConfig(), ["nats://127.0.0.1:4222"], "http://127.0.0.1:7422")
    assert only_here.startswith("the mesh is reachable on loopback only (nats://127.0.0.1:4222)")
    assert "[mesh.embedded] host and control_host beyond loopback" in only_here
    [stale, _] = reach_notes(EmbeddedMeshConfig(port=0, control_port=0), ["nats://localhost:1"], "http://[::1]:2")
    assert stale.startswith("[mesh.embedded] port and control_port = 0: the port was picked at this start")
    [control_only] = reach_notes(EmbeddedMeshConfig(host="0.0.0.0", control_port=0),
                                 ["nats://hub.example.org:4222"], "http://hub.example.org:5000")
    assert control_only.startswith("[mesh.embedded] control_port = 0")
    assert reach_notes(EmbeddedMeshConfig(host="0.0.0.0"), ["nats://hub.example.org:4222"],
                       "http://hub.example.org:7422") == []
    # One NATS URL beyond loopback is enough for another machine to connect ...
    assert reach_notes(EmbeddedMeshConfig(), ["nats://127.0.0.1:4222", "nats://192.0.2.7:4222"],
                       "http://192.0.2.7:7422") == []
    # ... but it needs the control plane first (the documented host = "0.0.0.0" alone left it on loopback).
    [no_credential] = reach_notes(EmbeddedMeshConfig(host="0.0.0.0"), ["nats://hub.example.org:4222"],
                                  "http://127.0.0.1:7422")
    assert no_credential.startswith("the control plane is reachable on loopback only (http://127.0.0.1:7422): "
                                    "a node on another machine cannot trade its invite for a credential")
    [no_connection] = reach_notes(EmbeddedMeshConfig(control_host="0.0.0.0"), ["nats://127.0.0.1:4222"],
                                  "http://hub.example.org:7422")
    assert no_connection.startswith("the mesh's NATS listener is reachable on loopback only")
