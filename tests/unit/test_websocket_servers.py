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
import os
import subprocess
import sys
import textwrap
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



def _fresh_interpreter(code: str, *, path_first: Path | None = None) -> dict[str, object]:
    """``code`` run by a new interpreter (this one imported nats-py, aiohttp with
    it, long ago); it prints one JSON object."""
    env = dict(os.environ)
    if path_first is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path_first), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_aiohttp_is_imported_only_when_a_websocket_server_is_dialed() -> None:
    """nats-py imports aiohttp for its WebSocket transport alone; meshnode's
    transport defers it (0.25-0.45 s of every start) until a ws:// URL needs it."""
    seen = _fresh_interpreter("""
        import json, sys
        from meshnode.transport.connection import websocket_unsupported
        import nats.aio.transport
        before = "aiohttp" in sys.modules
        tcp_only = websocket_unsupported(["nats://c:4222"])
        after_tcp = "aiohttp" in sys.modules
        ws = websocket_unsupported(["ws://a:80"])
        print(json.dumps({"before": before, "after_tcp": after_tcp, "ws": ws,
                          "loaded": "aiohttp" in sys.modules,
                          "real": nats.aio.transport.aiohttp is sys.modules.get("aiohttp"),
                          "multidict": type(nats.aio.transport.multidict.CIMultiDict).__name__}))
    """)
    assert seen == {"before": False, "after_tcp": False, "ws": [], "loaded": True, "real": True,
                    "multidict": "type"}


def test_an_aiohttp_that_fails_to_import_is_reported_as_missing(tmp_path: Path) -> None:
    """As a broken or absent install: the deferred import fails where the
    eager one did, and the ws:// URLs are named (the daemon then refuses to
    start naming the key, tests/integration/test_websocket.py)."""
    (tmp_path / "aiohttp").mkdir()
    (tmp_path / "aiohttp" / "__init__.py").write_text('raise ImportError("aiohttp is not installed here")\n')
    seen = _fresh_interpreter("""
        import json
        from meshnode.transport.connection import websocket_unsupported
        import nats.aio.transport
        print(json.dumps({"ws": websocket_unsupported(["ws://a:80", "nats://c:4222"]),
                          "again": websocket_unsupported(["ws://a:80"]),
                          "nats_sees": repr(nats.aio.transport.aiohttp)}))
    """, path_first=tmp_path)
    assert seen == {"ws": ["ws://a:80"], "again": ["ws://a:80"], "nats_sees": "None"}
