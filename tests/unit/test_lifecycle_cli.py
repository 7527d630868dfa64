"""Lifecycle pieces without a daemon (issue #18): the systemd units
``install-service`` writes (and the repository's copies of them), the careful
append of ``agents add --save``, and the rate limit on a lost mesh's errors."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from meshnode.cli import main
from meshnode.cli.exitcodes import EX_CANTCREAT, EX_OK, EX_USAGE
from meshnode.cli.service import REFERENCE_HEADER, system_unit, user_unit
from meshnode.config.editing import SaveRefused, append_agent_table, comment_out_agent_table
from meshnode.transport.connection import _RepeatLimiter

REPO = Path(__file__).resolve().parents[2]


def test_the_repository_units_are_the_generated_ones() -> None:
    binary = "/usr/local/bin/meshnode"
    assert (REPO / "systemd" / "meshnode.service").read_text() == (
        REFERENCE_HEADER.format(binary=binary) + system_unit(binary, home_visible=False))
    home = "%h/.local/bin/meshnode"
    assert (REPO / "systemd" / "meshnode-user.service").read_text() == (
        REFERENCE_HEADER.format(binary=home) + user_unit(home))


def test_a_binary_under_home_stays_visible_to_the_system_unit(tmp_path: Path) -> None:
    assert "ProtectHome=yes" in system_unit("/nonexistent/bin/meshnode")
    unit = system_unit("/home/ada/meshnode/.venv/bin/meshnode")
    assert "ProtectHome=read-only" in unit and "ProtectHome=yes" not in unit
    assert "ExecStart=/home/ada/meshnode/.venv/bin/meshnode run --config /etc/meshnode/meshnode.toml" in unit
    # A script outside /home whose interpreter is under one (a venv on ~/.pyenv's python).
    script = tmp_path / "meshnode"
    script.write_text("#!/root/.pyenv/versions/3.11/bin/python3\nimport sys\n")
    assert "ProtectHome=read-only" in system_unit(str(script))


def test_install_service_writes_refuses_and_dry_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    binary = "/opt/meshnode/bin/meshnode"
    args = ["install-service", "--dir", str(tmp_path), "--binary", binary, "--no-create-user"]
    assert main([*args, "--dry-run"]) == EX_OK
    assert f"ExecStart={binary} run" in capsys.readouterr().out
    assert not (tmp_path / "meshnode.service").exists()

    assert main([*args, "--json"]) == EX_OK
    written = json.loads(capsys.readouterr().out)
    unit = tmp_path / "meshnode.service"
    assert written["unit"] == str(unit) and unit.read_text() == system_unit(binary, home_visible=False)
    assert main(args) == EX_OK  # the same text again: nothing to refuse

    unit.write_text(unit.read_text() + "Environment=MINE=1\n")
    assert main(args) == EX_CANTCREAT
    assert "--force" in capsys.readouterr().err
    assert main([*args, "--force"]) == EX_OK
    assert unit.read_text() == system_unit(binary, home_visible=False)

    assert main(["install-service", "--binary", "relative/meshnode", "--dry-run"]) == EX_USAGE


def test_user_unit_with_a_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["install-service", "--user", "--dir", str(tmp_path), "--binary", "/opt/m/bin/meshnode",
            "--config", "/srv/m.toml"]
    assert main(args) == EX_OK
    text = (tmp_path / "meshnode.service").read_text()
    assert "ExecStart=/opt/m/bin/meshnode run --config /srv/m.toml" in text
    assert "User=" not in text


def test_append_agent_table_keeps_the_users_text(tmp_path: Path) -> None:
    config = tmp_path / "meshnode.toml"
    original = '# my node\n[node]\nname = "n"   # a comment kept\n\n[agents.echo]\nplugin = "echo"'
    config.write_text(original)
    config.chmod(0o640)
    added = append_agent_table(config, "echo2", {"plugin": "echo", "greeting": "hi", "n": 2,
                                                 "tags": ["a", "b"], "nested": {"x": True}})
    text = config.read_text()
    assert text.startswith(original + "\n") and text.endswith(added)
    assert tomllib.loads(text)["agents"]["echo2"] == {
        "plugin": "echo", "greeting": "hi", "n": 2, "tags": ["a", "b"], "nested": {"x": True}}
    assert config.stat().st_mode & 0o777 == 0o640


def test_append_agent_table_refuses_what_it_cannot_do_cleanly(tmp_path: Path) -> None:
    config = tmp_path / "meshnode.toml"
    config.write_text('[agents.echo]\nplugin = "echo"\n')
    with pytest.raises(SaveRefused, match=r"already has \[agents.echo\]"):
        append_agent_table(config, "echo", {"plugin": "echo"})
    config.write_text("[node\n")
    with pytest.raises(SaveRefused, match="does not parse"):
        append_agent_table(config, "x", {"plugin": "echo"})
    assert config.read_text() == "[node\n"


def test_comment_out_agent_table_keeps_every_line_and_the_rest_of_the_file(tmp_path: Path) -> None:
    config = tmp_path / "meshnode.toml"
    original = (
        '# my node\n[node]\nname = "n"\n\n'
        '[agents.echo2]  # the second echo\nplugin = "echo"\ncommand = [\n  "wc",\n  "-w",\n]\n\n'
        '# the shell agent\n[agents.shell]\nplugin = "shell"\n\n'
        '[agents.echo2.extra]\nkey = 1\n'
        '[agents."echo3"]\nplugin = "echo"\n'
    )
    config.write_text(original)
    config.chmod(0o640)
    comment_out_agent_table(config, "echo2")
    text = config.read_text()
    assert tomllib.loads(text) == {"node": {"name": "n"}, "agents": {"shell": {"plugin": "shell"},
                                                                     "echo3": {"plugin": "echo"}}}
    # Nothing deleted: the table's lines (and its sub-table's) are commented out; a comment
    # just before the next table is that table's and stays.
    stamp = "# Removed by `meshnode agents remove --save` at DATE (uncomment to restore):\n"
    assert re.sub(r"at [0-9-]+ [0-9:]+ UTC", "at DATE", text) == (
        '# my node\n[node]\nname = "n"\n\n'
        f'{stamp}# [agents.echo2]  # the second echo\n# plugin = "echo"\n# command = [\n#   "wc",\n#   "-w",\n# ]\n\n'
        '# the shell agent\n[agents.shell]\nplugin = "shell"\n\n'
        f'{stamp}# [agents.echo2.extra]\n# key = 1\n'
        '[agents."echo3"]\nplugin = "echo"\n'
    )
    assert config.stat().st_mode & 0o777 == 0o640
    comment_out_agent_table(config, "echo3")  # a quoted key is the same table
    assert tomllib.loads(text.replace('[agents."echo3"]\nplugin = "echo"\n', ""))["agents"] == \
        tomllib.loads(config.read_text())["agents"]


def test_comment_out_agent_table_refuses_what_it_cannot_do_cleanly(tmp_path: Path) -> None:
    config = tmp_path / "meshnode.toml"
    inline = '[agents]\necho = { plugin = "echo" }\n'
    config.write_text(inline)
    with pytest.raises(SaveRefused, match="defines agent echo other than as an \\[agents.echo\\] table"):
        comment_out_agent_table(config, "echo")
    with pytest.raises(SaveRefused, match=r"has no \[agents.other\]"):
        comment_out_agent_table(config, "other")
    assert config.read_text() == inline
    # A line inside a multi-line string that looks like a header: the edit would change more.
    tricky = '[agents.echo]\nplugin = "echo"\n[agents.shell]\nplugin = "shell"\nnote = """\n[agents.echo]\n"""\n'
    config.write_text(tricky)
    with pytest.raises(SaveRefused, match="remove it by hand"):
        comment_out_agent_table(config, "echo")
    assert config.read_text() == tricky


def test_a_lost_mesh_is_reported_at_a_doubling_interval() -> None:
    now = [0.0]
    limiter = _RepeatLimiter(clock=lambda: now[0])
    reported = []
    for second in range(0, 200):
        now[0] = float(second)
        if limiter.due() is not None:
            reported.append(second)
    assert reported == [0, 10, 30, 70, 150]
    assert limiter.reset() == 200
    assert limiter.due() == 0  # a new episode is reported at once


@pytest.mark.parametrize("argv", [["agents", "add", "one"], ["agents", "add", "a", "b"],
                                  ["agents", "remove", "one"], ["agents", "remove", "a", "b"]])
def test_roster_commands_outwait_a_rate_limited_control_plane(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A joined node whose control plane rate-limits it waits up to
    RATE_LIMIT_PATIENCE_S for the credential of a roster change; the CLI gave up
    at its usual 30 s while the daemon went on adding."""
    from meshnode.cli import ops
    from meshnode.daemon.credentials import RATE_LIMIT_PATIENCE_S

    waited: list[float] = []

    def admin(args: object, method: str, params: object = None, *, timeout: float = 30.0) -> tuple[int, None]:
        waited.append(timeout)
        return 69, None  # as if the daemon were not running: the command stops there

    monkeypatch.setattr(ops, "_admin", admin)
    assert main([*argv, "--socket", "/nonexistent/admin.sock"]) == 69
    assert waited and min(waited) > RATE_LIMIT_PATIENCE_S + 30
