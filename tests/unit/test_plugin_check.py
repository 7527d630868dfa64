"""``meshnode check-config`` checks each ``[agents.X]`` table against its plugin
(issue #18): an unknown kind (installed ones listed, a did-you-mean) and a
setting the plugin's ``Settings`` refuses are config errors like any other —
file, dotted key, expectation — with exit 78; the daemon words them the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshnode.agent import Agent, AgentSettings
from meshnode.config import load_config
from meshnode.daemon.plugin_check import agent_problems, unknown_kind_message
from meshnode.plugins import AgentCatalog


def _check(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshnode.cli", "check-config", "--config", str(path), *extra],
                          capture_output=True, text=True, timeout=60)


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "meshnode.toml"
    path.write_text(f'[admin]\nsocket = "{tmp_path}/a.sock"\n{body}', encoding="utf-8")
    return path


def test_unknown_plugin_is_refused_with_file_key_and_did_you_mean(tmp_path: Path) -> None:
    path = _write(tmp_path, '[agents.front]\nplugin = "ecoh"\n')
    proc = _check(path)
    assert proc.returncode == 78, proc.stderr
    assert f"{path}: agents.front.plugin: no installed plugin provides agent kind 'ecoh'" in proc.stderr
    assert "did you mean 'echo'?" in proc.stderr
    assert "installed: echo, " in proc.stderr  # the first-party plugins are installed with the repo
    problems = json.loads(_check(path, "--json").stdout)["problems"]
    assert problems[0]["file"] == str(path) and problems[0]["key"] == "agents.front.plugin"


def test_bad_plugin_setting_names_file_and_key(tmp_path: Path) -> None:
    path = _write(tmp_path, '[agents.sh]\nplugin = "shell"\ncommand = ["wc"]\ntimeout = "soon"\ncolour = 1\ncomand = 2\n')
    proc = _check(path)
    assert proc.returncode == 78, proc.stderr
    assert f"{path}: agents.sh.timeout: expected a valid number" in proc.stderr
    assert "got 'soon'" in proc.stderr
    assert f"{path}: agents.sh.colour: unknown key (expected one of: plugin, enabled, interaction, max_concurrency, allowance_file, allowance_any_owner, command," in proc.stderr
    assert f"{path}: agents.sh.comand: unknown key (did you mean 'command'? expected one of: plugin," in proc.stderr
    assert "ValidationError" not in proc.stderr and "pydantic" not in proc.stderr


def test_a_file_wrong_elsewhere_says_its_agent_tables_are_checked_in_a_second_round(tmp_path: Path) -> None:
    """The plugin checks need the rest of the file valid: a file wrong in both places
    listed only the first kind, and its second run surprised with more."""
    path = _write(tmp_path, '[node]\nnmae = "x"\n[agents.sh]\nplugin = "shell"\ncomand = 2\n')
    proc = _check(path)
    assert proc.returncode == 78 and f"{path}: node.nmae: unknown key" in proc.stderr, proc.stderr
    assert "agents.sh.comand" not in proc.stderr
    assert proc.stderr.rstrip().endswith(
        "(the [agents.*] tables are checked against their plugins once the rest is valid)")
    without_agents = _write(tmp_path, '[node]\nnmae = "x"\n')
    assert "are checked against their plugins" not in _check(without_agents).stderr


def test_good_plugins_pass_and_are_listed(tmp_path: Path) -> None:
    path = _write(tmp_path, '[agents.sh]\nplugin = "shell"\ncommand = ["wc", "-w"]\n')
    proc = _check(path)
    assert proc.returncode == 0, proc.stderr
    assert "plugins: echo" in proc.stdout
    assert json.loads(_check(path, "--json").stdout)["ok"] is True
    # --no-plugins checks the file alone.
    assert _check(_write(tmp_path, '[agents.x]\nplugin = "ecoh"\n'), "--no-plugins").returncode == 0


class _Settings(AgentSettings):
    size: int


class _Sized(Agent):
    Settings = _Settings


@pytest.mark.parametrize(("table", "key", "fragment"), [
    ('size = "big"', "agents.a.size", "expected a valid integer"),
    ("", "agents.a.size", "required key is missing"),
])
def test_agent_problems_word_settings_like_config_errors(tmp_path: Path, table: str, key: str, fragment: str) -> None:
    config = load_config(_write(tmp_path, f'[agents.a]\nplugin = "sized"\n{table}\n'), env={})
    catalog = AgentCatalog()
    catalog.register("sized", _Sized, "test")
    (problem,) = agent_problems(config, catalog)["a"]
    assert problem.file == str(tmp_path / "meshnode.toml") and problem.key == key and fragment in problem.message


def test_a_plugin_that_failed_to_load_is_named_as_such() -> None:
    catalog = AgentCatalog(failures={"greeter": "ImportError: no module named greeter"})
    message = unknown_kind_message("greeter", catalog)
    assert "installed but failed to load: ImportError" in message


def test_a_plugin_module_that_fails_to_load_is_the_files_problem(tmp_path: Path) -> None:
    path = _write(tmp_path, '[node]\nplugin_modules = ["no_such_module_here:Thing"]\n')
    proc = _check(path)
    assert proc.returncode == 78, proc.stderr
    assert (f"{path}: node.plugin_modules[0]: cannot load 'no_such_module_here:Thing': "
            "ModuleNotFoundError: No module named 'no_such_module_here'") in proc.stderr
    assert proc.stderr.count("no_such_module_here'") == 1  # said once, not by the loader's log too
