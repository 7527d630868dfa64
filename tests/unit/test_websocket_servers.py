"""``ws://`` / ``wss://`` in ``[mesh] servers`` without nats-py's WebSocket transport.

nats-py dials them with a transport that needs aiohttp, an optional
dependency. Without it every attempt failed with an ImportError and a
traceback, and the node never connected. ``meshnode check-config`` and the
daemon's start now name the key and the fix instead. The tests' environment
has aiohttp (the ``test`` extra pulls ``meshnode[websocket]``), so its absence
is made here the way nats-py sees it: ``nats.aio.transport.aiohttp`` is None.
"""

from __future__ import annotations

import json
from pathlib import Path

import nats.aio.transport
import pytest

from meshnode.cli import main
from meshnode.config import load_config
from meshnode.daemon.mesh import server_problems
from meshnode.transport.connection import websocket_unsupported

WS_CONFIG = """
[mesh]
servers = ["nats://10.0.0.1:4222", "wss://mesh.example.org:443"]
control_plane = "https://mesh.example.org:7422"
"""


@pytest.fixture
def no_aiohttp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nats.aio.transport, "aiohttp", None)


def _config(tmp_path: Path, text: str = WS_CONFIG) -> Path:
    path = tmp_path / "meshnode.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_websocket_urls_are_dialable_when_aiohttp_is_installed(tmp_path: Path) -> None:
    assert websocket_unsupported(["ws://a:80", "WSS://b:443", "nats://c:4222"]) == []
    assert server_problems(load_config(_config(tmp_path))) == []


def test_without_aiohttp_only_the_websocket_urls_are_named(no_aiohttp: None, tmp_path: Path) -> None:
    assert websocket_unsupported(["nats://c:4222", "tls://d:4222"]) == []
    assert websocket_unsupported(["ws://a:80", "nats://c:4222", "WSS://b:443"]) == ["ws://a:80", "WSS://b:443"]
    path = _config(tmp_path)
    [problem] = server_problems(load_config(path))
    assert problem.file == str(path) and problem.key == "mesh.servers[1]"
    assert "wss://mesh.example.org:443" in problem.message
    assert "pip install 'meshnode[websocket]'" in problem.message


def test_check_config_refuses_a_websocket_server_it_cannot_dial(
    no_aiohttp: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _config(tmp_path)
    assert main(["check-config", "--config", str(path), "--no-plugins", "--json"]) == 78
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    [problem] = report["problems"]
    assert problem["key"] == "mesh.servers[1]" and "meshnode[websocket]" in problem["message"]

