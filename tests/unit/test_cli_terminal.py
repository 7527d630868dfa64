"""The CLI at the terminal (issue #18), without a daemon: every command takes
``--json`` and ends its help with an example, completion scripts come from the
parser, the exit-code table, output formats, artifact progress."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

import pytest

from meshnode.admin import exitcodes as admin_exitcodes
from meshnode.admin.client import exit_code_for
from meshnode.admin.protocol import (
    AdminError,
    Conflict,
    InternalError,
    InvalidParameter,
    MethodNotFound,
    NotFound,
    NotReady,
    PermissionDenied,
    Refused,
)
from meshnode.cli import build_parser, exitcodes, main
from meshnode.cli.artifacts import _Progress, looks_binary
from meshnode.cli.completion import GENERATORS, command_tree
from meshnode.cli.daemon import _next_step, _store_line
from meshnode.cli.ops import _drain_line, _report_unregistered
from meshnode.cli.output import human_duration, human_size, human_time, rfc3339_fields

#: Commands that print nothing a script would parse, so they take no --json.
NO_JSON = {"run": "prints nothing on stdout: the daemon logs to stderr/journald"}


def _leaves(parser: argparse.ArgumentParser, path: str = "") -> list[tuple[str, argparse.ArgumentParser]]:
    found: list[tuple[str, argparse.ArgumentParser]] = []
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs and path:
        return [(path, parser)]
    for action in subs:
        for name, sub in action.choices.items():
            found += _leaves(sub, f"{path} {name}".strip())
    return found


def _all(parser: argparse.ArgumentParser, path: str = "") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)] if path else []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _all(sub, f"{path} {name}".strip())
    return found


def test_every_command_takes_json() -> None:
    leaves = _leaves(build_parser())
    assert len(leaves) > 40
    missing = [
        path for path, parser in leaves
        if path not in NO_JSON and not any("--json" in a.option_strings for a in parser._actions)
    ]
    assert missing == []


def test_every_commands_help_ends_with_an_example() -> None:
    for path, parser in _all(build_parser()):
        text = parser.format_help().rstrip().splitlines()
        example_at = max(i for i, line in enumerate(text) if line.startswith("Example:")) if any(
            line.startswith("Example:") for line in text) else None
        assert example_at is not None, path
        assert all("meshnode " in line and line.startswith("  ") for line in text[example_at + 1:]), (path, text[example_at:])
        assert len(text) > example_at + 1, path


def test_usage_errors_exit_64() -> None:
    with pytest.raises(SystemExit) as raised:
        build_parser().parse_args(["call"])
    assert raised.value.code == exitcodes.EX_USAGE == 64


def test_an_unknown_option_is_refused_by_its_command_naming_the_close_one(capsys: pytest.CaptureFixture[str]) -> None:
    """It was refused by ``meshnode`` itself, with the top-level usage and no hint."""
    with pytest.raises(SystemExit) as raised:
        main(["discover", "--capabilities", "x", "--offering-id=echo", "--json"])
    assert raised.value.code == exitcodes.EX_USAGE
    err = capsys.readouterr().err
    assert err.startswith("usage: meshnode discover ")
    assert ("meshnode discover: error: unrecognized arguments: --capabilities x --offering-id=echo "
            "(--capabilities: did you mean --capability?; --offering-id: did you mean --offering?)") in err
    with pytest.raises(SystemExit):
        main(["agents", "list", "--frobnicate"])
    assert "meshnode agents list: error: unrecognized arguments: --frobnicate\n" in capsys.readouterr().err
    with pytest.raises(SystemExit) as raised:
        build_parser().parse_args(["no-such-command"])
    assert raised.value.code == 64


def test_admin_errors_map_to_the_table() -> None:
    cases: list[tuple[BaseException, int]] = [
        (InvalidParameter("bad"), 64),
        (NotFound("x"), 65),
        (Conflict("exists"), 65),
        (NotReady("starting"), 75),
        (PermissionDenied("no"), 77),
        (MethodNotFound("Nope"), 76),
        (Refused("no", {"code": "OFFERING_NOT_FOUND"}), 1),
        (InternalError("bug"), 70),
        (AdminError("Chat.RoomFull", "full"), 70),
    ]
    for exc, code in cases:
        assert exit_code_for(exc) == code, exc
    assert "64    EX_USAGE" in (admin_exitcodes.__doc__ or "")  # the table is in the docstring


@pytest.mark.parametrize("shell", sorted(GENERATORS))
def test_completion_scripts_name_every_command(shell: str) -> None:
    parser = build_parser()
    tree = command_tree(parser)
    script = GENERATORS[shell](tree)
    for node in tree.walk():
        for name in node.children:
            assert name in script, (shell, node.path, name)
    assert "json" in script and "user_requested" in script  # options and their choices
    out = subprocess.run([sys.executable, "-m", "meshnode.cli", "completion", shell],
                         capture_output=True, text=True, check=True)
    assert out.stdout == script
    binary = shutil.which(shell)
    if binary is not None:  # the shell itself accepts it
        subprocess.run([binary, "-n"], input=out.stdout, text=True, check=True)


def test_bash_completion_completes_subcommands_and_choices() -> None:
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    script = GENERATORS["bash"](command_tree(build_parser()))

    def complete(*words: str) -> list[str]:
        quoted = " ".join(f"'{w}'" for w in words)
        probe = f'{script}\nCOMP_WORDS=(meshnode {quoted}); COMP_CWORD={len(words)}; _meshnode; echo "${{COMPREPLY[*]}}"'
        return subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout.split()

    assert {"list", "show", "cancel"} <= set(complete("tasks", ""))
    assert complete("logs", "--level", "") == ["debug", "info", "warning", "error", "critical"]
    assert complete("art") == ["artifacts"]
    assert "--stream" in complete("call", "echo", "echo", "--s")


def test_output_formats() -> None:
    assert human_time(0) == "1970-01-01 00:00:00Z"
    assert human_time("2026-12-01T23:38:15.123Z") == "2026-12-01 23:38:15Z"
    assert human_time(1_796_168_295) == human_time("2026-12-01T23:38:15Z") == human_time(1_796_168_295_000)
    assert human_time(None) == "-"
    converted = rfc3339_fields({"expires_at": 1_796_168_295, "nested": [{"retired_at": None, "count_at": 3}],
                                "size": 1_796_168_295})
    assert converted == {"expires_at": "2026-12-01T23:38:15.000Z", "nested": [{"retired_at": None, "count_at": 3}],
                         "size": 1_796_168_295}
    assert [human_size(n) for n in (0, 1023, 1024, 1536, 20 * 1024**2)] == ["0 B", "1023 B", "1.0 KiB", "1.5 KiB", "20.0 MiB"]
    assert [human_duration(s) for s in (0.4, 42, 65, 7380)] == ["0s", "42s", "1m05s", "2h03m"]


def test_artifact_progress_shows_rate_and_eta_in_one_unit_system() -> None:
    now = [100.0]
    progress = _Progress("fetched", 40 * 1024**2, quiet=False, clock=lambda: now[0])
    now[0] += 4.0
    assert progress.line(10 * 1024**2) == "fetched 10.0 MiB of 40.0 MiB (25%), 2.5 MiB/s, ETA 12s"
    now[0] += 12.0
    assert progress.line(40 * 1024**2) == "fetched 40.0 MiB of 40.0 MiB (100%), 2.5 MiB/s, in 16s"


def test_binary_is_told_from_text() -> None:
    assert looks_binary(b"\x89PNG\r\n\x1a\n\0\0")
    assert looks_binary(bytes(range(128, 256)))
    assert not looks_binary("héllo wörld\n".encode())
    assert not looks_binary("é".encode()[:1])  # a character cut at the end of the sample


def test_the_store_line_gives_measured_sizes_in_human_units() -> None:
    """It printed 'ok: 293366B stored, 880MiB reserved of 4GiB, 3216MiB headroom'
    (the configuration's spelling, exact only when a unit divides the count)."""
    line = _store_line({"state": "ok", "used_bytes": 293_366, "reserved_bytes": 880 * 2**20,
                        "limit_bytes": 4 * 2**30, "headroom_bytes": 3_372_220_416})
    assert line == "ok: 286.5 KiB stored, 880.0 MiB reserved of 4.0 GiB, 3.1 GiB headroom"


def test_a_drain_pass_is_said_in_words() -> None:
    """`meshnode drain` printed each agent's cumulative counters (passes, idle_skips, ...)."""
    nothing = {"agent": "echo", "failing": False, "pass": {"fetched": 0, "dispatched": 0}}
    assert _drain_line(nothing) is None
    busy = {"agent": "echo", "failing": False,
            "pass": {"fetched": 5, "committed": 3, "duplicates": 2, "dispatched": 3, "deferred": 1}}
    assert _drain_line(busy) == ("echo: fetched 5, 3 new, 2 already handled, 1 left while their live handlers "
                                 "run; 3 handed to their handlers")
    failing = {"agent": "echo", "failing": True, "last_error": "TimeoutError: no answer", "pass": {}}
    assert _drain_line(failing) == "echo: FAILING: TimeoutError: no answer"


def test_agents_add_says_which_hosted_agents_the_registry_did_not_take(capsys: pytest.CaptureFixture[str]) -> None:
    """`agents add` printed 'hosting w411 (...), running' for agents the registry had refused
    (the store full at ~400 mailboxes): hosted, yet undiscoverable, with no broker buffer."""
    error = "QUOTA_EXCEEDED: registry: the mesh's JetStream store refused the write"
    hosted = [{"name": f"w{i}", "registered": i < 3, "registration_error": None if i < 3 else error}
              for i in range(10)]
    _report_unregistered(hosted)
    assert capsys.readouterr().err == (
        f"meshnode: warning: 7 hosted agent(s) not registered (w3, w4, w5, w6, w7, ...): {error}\n")
    _report_unregistered(hosted[:3])
    assert capsys.readouterr().err == ""


def test_a_refusal_that_says_how_to_get_past_it_is_followed_by_the_step() -> None:
    refused = {"code": "AGREEMENT_REQUIRED", "details": {"sku": "summarize", "approval_url": "https://b.example/a"}}
    assert _next_step("summarizer", refused) == (
        "  approve its terms at https://b.example/a, or agree as this node's owner: "
        "meshnode agreements sign summarizer --sku summarize")
    assert _next_step("U1", {"code": "AGREEMENT_REQUIRED", "details": {"sku": "s"}}) == (
        "  agree as this node's owner: meshnode agreements sign U1 --sku s")
    short = {"code": "BUDGET_INSUFFICIENT", "details": {"estimate": {"amount_micro": 5000, "currency": "USD"}}}
    assert _next_step("x", short) == ("  the responder estimates 5000 micro-USD: send a budget whose cost_ceiling "
                                      "covers it")
    assert _next_step("x", {"code": "INTERNAL_ERROR"}) is None
