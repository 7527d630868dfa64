"""The README's first agent runs as written.

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
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from meshnode.testing import DaemonSet, run_cli

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
