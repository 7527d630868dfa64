"""The README runs as written: its quickstart, its second node and its first agent.

The quickstart's configuration file and CLI lines, and the second node's
commands, are read out of README.md and run against real daemons (see
:func:`test_readme_quickstart_and_second_node`).

The plugin module, its ``pyproject.toml`` and the node configuration are cut out
of README.md itself (the fenced blocks whose first line names the file), the
plugin is pip-installed into a temporary directory that the daemon gets on its
path, a real daemon hosts it, and the README's own ``meshnode call`` lines are
run against it. When the README's example stops working, this fails.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

from meshnode.admin.client import call_sync
from meshnode.testing import DaemonSet, eventually, run_cli

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
FENCE = re.compile(r"^```(?P<lang>\w*)\n(?P<body>.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks() -> list[tuple[str, str]]:
    return [(m["lang"], m["body"]) for m in FENCE.finditer(README.read_text(encoding="utf-8"))]


def _file_block(suffix: str) -> tuple[str, str]:
    """(path, text) of the one block whose first line is ``# <path ending in suffix>``."""
    found = []
    for _, body in _blocks():
        first = body.split("\n", 1)[0]
        if first.startswith("# ") and first[2:].strip().endswith(suffix):
            found.append((first[2:].strip(), body))
    assert len(found) == 1, f"README.md should have exactly one block headed '# ...{suffix}', found {len(found)}"
    return found[0]


def _call_lines() -> list[list[str]]:
    """The ``meshnode call front-desk ...`` commands of the README's first-agent section."""
    calls = []
    for lang, body in _blocks():
        if lang != "sh":
            continue
        for line in body.splitlines():
            if line.startswith(".venv/bin/meshnode call front-desk "):
                calls.append(shlex.split(line, comments=True)[1:])
    return calls


def _can_build_here() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("setuptools", "wheel"))


def test_readme_plugin_example_runs(meshnode_daemons: DaemonSet, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    module_path, module_text = _file_block("/__init__.py")
    pyproject_path, pyproject_text = _file_block("/pyproject.toml")
    _, node_text = _file_block("my-node.toml")

    # Lay the plugin out as the README's paths say (my-agent/pyproject.toml, ...).
    project = tmp_path / Path(pyproject_path).parent
    (project / Path(module_path).relative_to(Path(pyproject_path).parent)).parent.mkdir(parents=True)
    (project / "pyproject.toml").write_text(pyproject_text, encoding="utf-8")
    (tmp_path / module_path).write_text(module_text, encoding="utf-8")
    pyproject = tomllib.loads(pyproject_text)
    assert {"build-system", "project"} <= set(pyproject), "the README's pyproject is complete"

    # pip-install it, as the README says. With setuptools and wheel in this
    # environment no index is needed; otherwise pip fetches the build backend.
    site = tmp_path / "site"
    offline = ["--no-build-isolation", "--no-index"] if _can_build_here() else []
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *offline,
         "--target", str(site), str(project)],
        check=True, capture_output=True, text=True, timeout=240,
    )
    monkeypatch.setenv("PYTHONPATH", str(site))  # the daemon adds the repository root itself

    node_config = tomllib.loads(node_text)
    agents = node_config.pop("agents")
    assert not node_config, "the README's node config holds only [agents.*] tables"
    node = meshnode_daemons.embedded("readme", agents=agents)
    by_name = {a["name"]: a for a in node.status()["agents"]}
    assert by_name["front-desk"]["state"] == "running" and by_name["front-desk"]["registered"]

    calls = _call_lines()
    assert len(calls) == 2, calls
    hello, relay = calls
    greeted = run_cli(*hello, "--socket", node.socket_path).stdout
    assert greeted.strip() == "welcome, Ada"

    # The relay finds the echo agent by name (ctx.resolve), no id pasted in.
    relayed = json.loads(run_cli(*relay, "--socket", node.socket_path).stdout)
    assert relayed == {"status": "completed", "echoed": {"ok": "hi"}, "from": "echo"}


def _section(title: str) -> str:
    """The README text under ``## title``, up to the next ``## `` heading."""
    text = README.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(title)}\n(?P<body>.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"README.md has no '## {title}' section"
    return match["body"]


def _sh_lines(section: str) -> list[str]:
    """The shell lines of a section's ``sh`` blocks, continuation lines joined."""
    lines: list[str] = []
    for m in FENCE.finditer(section):
        if m["lang"] == "sh":
            lines += m["body"].replace("\\\n", " ").splitlines()
    return [line for line in lines if line.strip()]


def _meshnode_words(line: str) -> list[str]:
    """``.venv/bin/meshnode ARGS  # comment`` -> ARGS (the README uses the venv's path throughout)."""
    words = shlex.split(line, comments=True)
    assert words[0] == ".venv/bin/meshnode", f"README line does not use .venv/bin/meshnode: {line!r}"
    return words[1:]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "meshnode.cli", *args], capture_output=True, text=True,
                          timeout=90, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"meshnode {shlex.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
    return proc


def test_readme_quickstart_and_second_node(meshnode_daemons: DaemonSet, monkeypatch: pytest.MonkeyPatch) -> None:
    # -- Two commands: `make run` runs the daemon with the README's config file.
    quick = _section("Two commands")
    config_rel = re.search(r"`make run` runs `meshnode run --config (?P<path>\S+)`", quick)
    assert config_rel, "the README says which configuration `make run` uses"
    config_file = README.parent / config_rel["path"]
    makefile = (README.parent / "Makefile").read_text(encoding="utf-8")
    assert f"run --config $(or $(CONFIG),{config_rel['path']})" in makefile, "the README and the Makefile agree"
    agents = tomllib.loads(config_file.read_text(encoding="utf-8"))["agents"]
    # The same agents on an embedded mesh of free ports (the shipped file uses 4222,
    # which a test must not take).
    first = meshnode_daemons.embedded("quickstart", agents=agents)

    lines = _sh_lines(quick)
    export = next(line for line in lines if line.startswith("export MESHNODE_CONFIG="))
    assert "config/meshnode.toml" in export
    monkeypatch.setenv("MESHNODE_CONFIG", str(first.config_path))  # "so the CLI finds the admin socket"
    outputs = {}
    for line in lines:
        if line.startswith(".venv/bin/meshnode "):
            words = _meshnode_words(line)
            outputs[shlex.join(words[:3])] = _cli(*words).stdout
    assert any(a["name"] == "echo" and a["id"] in outputs["status"] for a in first.status()["agents"]), \
        "`status` shows each agent with its id"
    echoed = outputs["call echo echo"]
    assert json.loads(echoed) == {"ok": {"hello": "world"}}, echoed  # echo answers {ok: INPUT}
    counted = outputs["call shell chat"]
    assert re.search(r"\d+", counted), counted  # wc -w of the framed message
    described = outputs["call echo describe"]
    assert first.agent_id("echo") in described

    # -- A second node: invite on the first, join and run on the second.
    second = _section("A second node")
    home = Path(tempfile.mkdtemp(prefix="mn-home-", dir="/tmp"))  # short: the admin socket lives under it
    joined: subprocess.Popen[bytes] | None = None
    try:
        monkeypatch.chdir(home)  # the invite is written and read relative to the current directory
        run_line = call_line = None
        placeholders = 0
        for line in _sh_lines(second):
            if line.lstrip().startswith("#"):
                continue
            # "<an agent id from the first node's status>": the id `status` shows there.
            line, n = re.subn(r"<[^<>]*agent id[^<>]*>", first.agent_id("echo"), line)
            placeholders += n
            words = [w.replace("~/", f"{home}/") for w in _meshnode_words(line)]
            if words[0] == "run":
                run_line = words
            elif words[0] == "call":
                call_line = words
            else:
                _cli(*words)
        assert run_line is not None and call_line is not None
        config = Path(run_line[run_line.index("--config") + 1])
        assert config.exists(), "`join` wrote the configuration the README runs"
        socket_path = tomllib.loads(config.read_text())["admin"]["socket"]
        with open(home / "daemon.log", "wb") as log:
            joined = subprocess.Popen([sys.executable, "-m", "meshnode.cli", *run_line], stdout=log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

        def serving() -> bool:
            assert joined is not None and joined.poll() is None, (home / "daemon.log").read_text()
            try:
                return bool(call_sync(socket_path, "Status", {"agents": False}, timeout=5.0).get("state") == "serving")
            except Exception:  # not listening yet
                return False

        eventually(serving, timeout=60)
        assert placeholders == 1, "the README's cross-node call names an agent id placeholder"
        answered = _cli(*call_line).stdout
        assert "hi across nodes" in answered, answered
    finally:
        if joined is not None and joined.poll() is None:
            joined.send_signal(signal.SIGTERM)
            joined.wait(timeout=40)
        shutil.rmtree(home, ignore_errors=True)
