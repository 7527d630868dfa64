"""The plugin author's loop on a real daemon (issue #18, "The plugin loop").

One embedded node for the module hosts ``echo``, the test agents of
``tests/agents/finder.py`` (two ``twin`` agents share a display name) and a
``[agents.greeter]`` table whose plugin is not installed when the node starts.
The tests find agents by name, offering and capability from a handler; read a
handler's traceback back with ``meshnode logs``; scaffold the ``greeter`` plugin
with ``meshnode new-agent``, pip-install it into a directory already on the
daemon's path and host it with ``meshnode reload``, then run the scaffold's own
test; and see ``strict_plugins`` refuse an unknown plugin with exit 78.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meshnode.testing import DaemonProcess, DaemonSet, eventually, run_cli

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty directory on the daemon's path: plugins are pip-installed into it
    at run time (``pip install --target``), never into the test environment."""
    path = tmp_path_factory.mktemp("site")
    return path


@pytest.fixture(scope="module")
def node(site: Path) -> Iterator[DaemonProcess]:
    daemons = DaemonSet()
    try:
        daemon = daemons.embedded(
            "loop",
            agents={
                "echo": {"plugin": "echo"},
                "finder": {"plugin": "finder"},
                "twin-a": {"plugin": "twin"},
                "twin-b": {"plugin": "twin"},
                "greeter": {"plugin": "greeter", "greeting": "welcome"},  # installed later
            },
            node={"plugin_modules": ["tests.agents.finder:plugin"]},
            start=False,
        )
        daemon.start(env_extra={"PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])})

        def registered() -> bool:
            agents = {a["name"]: a for a in daemon.status()["agents"]}
            return all(agents.get(n, {}).get("registered") for n in ("echo", "finder", "twin-a", "twin-b"))

        eventually(registered, what="agents registered", timeout=60)
        yield daemon
    finally:
        daemons.close()


def _call(node: DaemonProcess, offering: str, input: Any) -> Any:
    result = node.call("finder", offering, input)
    assert result["status"] == "completed", result
    return result["output"]


def test_a_handler_finds_agents_by_name_offering_and_capability(node: DaemonProcess) -> None:
    echo_id, twin_a = node.agent_id("echo"), node.agent_id("twin-a")
    # ctx.request with a name where the id would go (the README's relay).
    asked = _call(node, "ask", {"name": "echo", "offering": "echo", "input": "hi"})
    assert asked == {"output": {"ok": "hi"}, "from": echo_id}
    # A local agent's configured name, and an id, resolve to this node's manifest.
    assert _call(node, "resolve", {"name": "twin-a"}) == {"id": twin_a, "name": "twin", "local": True,
                                                          "offerings": ["hi"]}
    assert _call(node, "resolve", {"name": echo_id})["name"] == "echo"
    # A display name two agents share is refused, naming both; an unknown one is NOT_FOUND.
    ambiguous = _call(node, "resolve", {"name": "twin"})["error"]
    assert ambiguous["code"] == "INVALID_QUERY" and ambiguous["details"]["reason"] == "ambiguous_name"
    assert sorted(ambiguous["details"]["candidates"]) == sorted([twin_a, node.agent_id("twin-b")])
    unknown = _call(node, "resolve", {"name": "nobody-here"})["error"]
    assert unknown["code"] == "NOT_FOUND" and "nobody-here" in unknown["message"]
    assert "finder" in unknown["message"]  # the local names are listed
    # Discovery through the registry (§6.3), by capability and by offering.
    twins = _call(node, "discover", {"capability": "twinning"})
    assert sorted(t["id"] for t in twins) == sorted([twin_a, node.agent_id("twin-b")])
    assert [a["id"] for a in _call(node, "discover", {"offering": "echo"})] == [echo_id]
    # `meshnode call` takes a registry name too, and says why an unknown one fails.
    failed = node.call("nobody-here", "echo", "x")
    assert failed["status"] == "failed" and failed["error"]["code"] == "NOT_FOUND"


def test_a_handlers_exception_is_logged_with_its_traceback(node: DaemonProcess) -> None:
    result = node.call("finder", "boom", {})
    assert result["error"]["code"] == "INTERNAL_ERROR"
    assert "undefined_name_in_a_handler" not in json.dumps(result)  # no details to the caller
    text = run_cli("logs", "--level", "error", "--socket", node.socket_path).stdout
    assert "handler for boom raised" in text
    assert "Traceback (most recent call last)" in text and "NameError" in text
    assert "undefined_name_in_a_handler" in text
    records = [json.loads(line) for line in
               run_cli("logs", "--level", "error", "--json", "--socket", node.socket_path).stdout.splitlines()]
    assert any("NameError" in r.get("exception", "") for r in records)


def _can_build_offline() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("setuptools", "wheel"))


def test_new_agent_pip_install_and_reload_host_it(node: DaemonProcess, site: Path, tmp_path: Path) -> None:
    status = {a["name"]: a for a in node.status()["agents"]}
    # Not hosted at start, and status says why in the words check-config uses.
    assert status["greeter"]["state"] == "failed", status["greeter"]
    assert status["greeter"]["failure"].startswith("agents.greeter.plugin: no installed plugin provides agent kind")
    # Before the plugin is installed, reload refuses and says what is missing.
    early = subprocess.run([sys.executable, "-m", "meshnode.cli", "reload", "--socket", node.socket_path],
                           capture_output=True, text=True, timeout=60)
    assert early.returncode != 0
    assert "agents.greeter.plugin" in early.stderr + early.stdout
    assert "no installed plugin provides agent kind 'greeter'" in early.stderr + early.stdout

    run_cli("new-agent", "greeter", "--dir", str(tmp_path))
    package = tmp_path / "greeter"
    assert {"pyproject.toml", "greeter/__init__.py", "tests/test_greeter.py"} <= {
        str(p.relative_to(package)) for p in package.rglob("*") if p.is_file()
    }
    offline = ["--no-build-isolation", "--no-index"] if _can_build_offline() else []

    def pip_install() -> None:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", *offline,
             "--target", str(site), str(package)],
            check=True, capture_output=True, text=True, timeout=240,
        )

    pip_install()
    report = json.loads(run_cli("reload", "--json", "--socket", node.socket_path).stdout)
    assert report["added"] == ["greeter"], report
    answer = node.call("greeter", "hello", {"name": "Ada"})
    assert answer["status"] == "completed" and answer["output"] == {"text": "welcome, Ada"}, answer
    status = {a["name"]: a for a in node.status()["agents"]}
    assert status["greeter"]["state"] == "running" and "failure" not in status["greeter"], status["greeter"]

    # An upgrade of a plugin agents run: the old code stays loaded, and reload says a restart is needed.
    pyproject = package / "pyproject.toml"
    pyproject.write_text(pyproject.read_text(encoding="utf-8").replace('version = "0.1.0"', 'version = "0.2.0"'),
                         encoding="utf-8")
    pip_install()
    report = json.loads(run_cli("reload", "--json", "--socket", node.socket_path).stdout)
    assert report["added"] == [] and len(report["requires_restart"]) == 1, report
    assert "plugin greeter: meshnode-greeter 0.1.0 -> meshnode-greeter 0.2.0 installed" in report["requires_restart"][0]
    assert "until the daemon restarts" in report["requires_restart"][0]

    # The scaffold's own test passes against it (its own daemon, meshnode.testing).
    env = {**os.environ, "PYTHONPATH": str(site)}
    generated = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=package, env=env, capture_output=True, text=True, timeout=240,
    )
    assert generated.returncode == 0, generated.stdout + generated.stderr


def test_an_editable_install_is_hosted_by_reload(tmp_path: Path) -> None:
    """``pip install -e``, as new-agent's next steps say, puts no module in
    site-packages but a ``.pth`` file, which an interpreter reads only as it
    starts: the running daemon found the entry point and failed to import it.
    reload reads the ``.pth`` files that appeared since. The daemon runs in a
    virtualenv of its own (over this environment's packages), so the install
    lands in a real site directory and leaves the test environment alone."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    venv_site = Path(subprocess.run(
        [python, "-c", "import site; print(site.getsitepackages()[0])"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip())
    # meshnode and its dependencies (editable ones too): this environment's site directory, read as one.
    here = sysconfig.get_paths()["purelib"]
    (venv_site / "_meshnode_test_env.pth").write_text(f"import site; site.addsitedir({here!r})\n", encoding="utf-8")
    daemons = DaemonSet()
    try:
        node = daemons.embedded(
            "editable", agents={"concierge": {"plugin": "concierge", "greeting": "welcome"}}, start=False,
        )
        node.start(python=python)
        run_cli("new-agent", "concierge", "--dir", str(tmp_path))
        offline = ["--no-build-isolation", "--no-index"] if _can_build_offline() else []
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *offline,
             "--target", str(venv_site), "-e", str(tmp_path / "concierge")],
            check=True, capture_output=True, text=True, timeout=240,
        )
        assert [p.name for p in venv_site.glob("*concierge*.pth")], "an editable install writes a .pth file"
        report = json.loads(run_cli("reload", "--json", "--socket", node.socket_path).stdout)
        assert report["added"] == ["concierge"], report
        answer = node.call("concierge", "hello", {"name": "Ada"})
        assert answer["status"] == "completed" and answer["output"] == {"text": "welcome, Ada"}, answer
        assert "(an editable install since the daemon started)" in node.log_tail()
    finally:
        daemons.close()


def test_strict_plugins_exits_78_naming_file_and_key(tmp_path: Path) -> None:
    daemons = DaemonSet()
    try:
        daemon = daemons.embedded("strict", agents={"front": {"plugin": "ecoh"}},
                                  node={"strict_plugins": True}, start=False)
        with pytest.raises(RuntimeError, match="exited with 78"):
            daemon.start()
        log = daemon.log_text()
        assert f"{daemon.config_path}: agents.front.plugin: no installed plugin provides agent kind 'ecoh'" in log
        assert "did you mean 'echo'?" in log
    finally:
        daemons.close()
