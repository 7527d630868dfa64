"""TLS end to end (#22.6): the embedded mesh serves its NATS listener and its control
plane over TLS from one test certificate (made here with the openssl CLI); a joined
node renews over HTTPS and connects over ``tls://`` trusting ``[mesh] ca_file``, and
a call crosses the two nodes. Clear-text and unverified clients are refused. The
WebSocket listener serves ``wss://`` from the same certificate, and a node joins over it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshnode.config import load_config
from meshnode.control_plane import ControlPlaneClient, ControlPlaneUnreachable
from meshnode.protocol.nkeys import KeyPair
from meshnode.testing import DaemonProcess, DaemonSet, render_toml, run_cli
from meshnode.transport.tls import client_context

pytestmark = pytest.mark.integration

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed P-256 certificate for 127.0.0.1 and localhost, valid one day."""
    if not Path(OPENSSL).exists():
        pytest.skip("the openssl CLI is needed to make a test certificate")
    root = tmp_path_factory.mktemp("tls")
    cert, key = root / "cert.pem", root / "key.pem"
    subprocess.run(
        [OPENSSL, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )
    key.chmod(0o600)
    return cert, key


@pytest.fixture(scope="module")
def nodes(certificate: tuple[Path, Path]) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    cert, key = certificate
    daemons = DaemonSet()
    try:
        # Its own connection pins its own certificate: serving means NATS over TLS works.
        host = daemons.embedded(
            "host", agents={"echo": {"plugin": "echo"}},
            extra={"mesh.embedded": {"tls_cert": str(cert), "tls_key": str(key), "websocket_port": 0}},
        )
        joined = daemons.joined("edge", host, agents={"echo": {"plugin": "echo"}}, start=False)
        joined.config["mesh"]["ca_file"] = str(cert)
        joined.config_path.write_text(render_toml(joined.config), encoding="utf-8")
        joined.start()
        yield host, joined
    finally:
        daemons.close()


def test_the_mesh_advertises_tls_and_a_joined_node_works_across_it(
    nodes: tuple[DaemonProcess, DaemonProcess],
) -> None:
    host, joined = nodes
    info = host.admin("Mesh.Info")
    assert all(url.startswith("tls://") for url in info["nats_urls"]), info
    assert info["control_plane"].startswith("https://"), info
    # The joined node renewed over HTTPS (it holds only the starter credential
    # otherwise, which grants nothing) and reaches the host's agent over TLS.
    echo = host.agent_id("echo")
    assert joined.call(echo, "echo", "over tls")["output"] == {"ok": "over tls"}


async def test_clear_text_and_unverified_clients_are_refused(
    nodes: tuple[DaemonProcess, DaemonProcess], certificate: tuple[Path, Path]
) -> None:
    host, _ = nodes
    cert, _ = certificate
    info = await asyncio.to_thread(host.admin, "Mesh.Info")
    invite = await asyncio.to_thread(host.admin, "Mesh.Invite", {"name": "probe"})
    key = KeyPair.from_seed(invite["node_seed"])
    # Without the CA the control plane's certificate does not verify.
    with pytest.raises(ControlPlaneUnreachable):
        await ControlPlaneClient(info["control_plane"], timeout_s=5.0).request_credential(key, [])
    # With it, renewal works over HTTPS.
    grant = await ControlPlaneClient(
        info["control_plane"], ssl_context=client_context(cert)
    ).request_credential(key, [])
    assert grant.jwt
    # The broker requires TLS: it says so, and a clear-text client never gets a PONG.
    port = int(info["nats_urls"][0].rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        banner = json.loads((await reader.readline()).removeprefix(b"INFO "))
        assert banner["tls_required"] is True
        writer.write(b'CONNECT {"verbose":false}\r\nPING\r\n')
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(4096), timeout=10.0)
        assert b"PONG" not in answer, answer
    finally:
        writer.close()


def test_join_writes_the_ca_file_into_the_configuration(
    nodes: tuple[DaemonProcess, DaemonProcess], certificate: tuple[Path, Path], tmp_path: Path
) -> None:
    host, _ = nodes
    cert, _ = certificate
    invite = tmp_path / "late.creds"
    run_cli("mesh", "invite", "late", "--out", str(invite), "--socket", host.socket_path)
    config = tmp_path / "late.toml"
    run_cli("join", str(invite), "--data-dir", str(tmp_path / "data"), "--config-out", str(config),
            "--ca-file", str(cert))
    mesh = load_config(config).mesh
    assert mesh.ca_file == cert and all(u.startswith("tls://") for u in mesh.servers)
    assert mesh.control_plane is not None and str(mesh.control_plane).startswith("https://")


def test_a_node_joins_over_wss_trusting_the_ca_file(
    nodes: tuple[DaemonProcess, DaemonProcess], certificate: tuple[Path, Path], meshnode_daemons: DaemonSet
) -> None:
    host, _ = nodes
    cert, _ = certificate
    wss = host.admin("Mesh.Info")["websocket_url"]
    assert wss.startswith("wss://127.0.0.1:"), wss
    node = meshnode_daemons.joined("wss-edge", host, agents={"echo": {"plugin": "echo"}}, start=False)
    node.config["mesh"].update(servers=[wss], ca_file=str(cert))
    node.config_path.write_text(render_toml(node.config), encoding="utf-8")
    node.start()
    assert node.status()["mesh"]["connected_url"] == wss
    assert node.call(host.agent_id("echo"), "echo", "over wss")["output"] == {"ok": "over wss"}
    assert host.call(node.agent_id("echo"), "echo", "back")["output"] == {"ok": "back"}
