"""The CLI at the terminal (issue #18), against real daemons: ``call --stream``
prints chunks as they arrive, ``--no-wait`` prints the task id, ``tasks show``
and ``tasks cancel`` without ``--agent``, exit codes per the table, ``--json``
on every command that talks to a daemon, ``pub``/``sub`` round trips."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from meshnode.cli import exitcodes
from meshnode.testing import DaemonProcess, DaemonSet, eventually
from tests.integration.cli_here import cli_here

pytestmark = pytest.mark.integration

PLUGINS = {"plugin_modules": ["tests.agents:tasks_plugin"]}


@pytest.fixture(scope="module")
def node() -> Iterator[DaemonProcess]:
    """One daemon for the module's tests: each starts its own tasks and leaves
    nothing another reads (a daemon start per test cost ~3 s each)."""
    daemons = DaemonSet()
    try:
        yield daemons.embedded(
            "a", agents={"tasks": {"plugin": "test-tasks"}, "echo": {"plugin": "echo"}}, node=PLUGINS
        )
    finally:
        daemons.close()


def _cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshnode.cli", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _popen(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "meshnode.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)


def _read_until(stream: Any, wanted: Callable[[bytes], bool], timeout: float) -> bytes:
    """Read ``stream`` (unbuffered, from a pipe) until ``wanted(everything read)``."""
    seen = b""
    deadline = time.monotonic() + timeout
    fd = stream.fileno()
    while not wanted(seen):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out; read so far: {seen!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            assert chunk, f"the stream closed; read: {seen!r}"
            seen += chunk
    return seen


def _wait_for(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    eventually(check, what=what, timeout=timeout)


def test_call_stream_prints_chunks_before_the_stream_ends(node: DaemonProcess, tmp_path: Path) -> None:
    a = node
    gate = tmp_path / "gate"
    proc = _popen("call", "tasks", "gated", json.dumps({"gate": str(gate)}), "--stream", "--socket", a.socket_path)
    try:
        first = _read_until(proc.stdout, lambda seen: b"first" in seen, 30.0)
        # The first chunk is on stdout while the agent still holds the rest back.
        assert proc.poll() is None and b"last" not in first
        gate.touch()
        rest, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert (first + rest).decode().strip() == "first last"

    # --json: one JSON object per line, chunks then the result.
    gate2 = tmp_path / "gate2"
    gate2.touch()
    lines = _cli("call", "tasks", "gated", json.dumps({"gate": str(gate2)}), "--stream", "--json",
                 "--socket", a.socket_path)
    items = [json.loads(line) for line in lines.stdout.splitlines()]
    assert [i["data"] for i in items if i["kind"] == "chunk"] == ["first ", "last"]
    assert items[-1]["kind"] == "result" and items[-1]["status"] == "completed"

    # Asked without --stream, the joined text prints as text (it printed "\"first last\"").
    joined = _cli("call", "tasks", "gated", json.dumps({"gate": str(gate2)}), "--socket", a.socket_path)
    assert joined.stdout == "first last\n", joined


def test_a_long_task_shows_its_progress_live_on_a_terminal(node: DaemonProcess, tmp_path: Path) -> None:
    a = node
    gate = tmp_path / "gate"
    controller, terminal = pty.openpty()  # stderr is a terminal; stdout a pipe
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshnode.cli", "call", "tasks", "gated_task", json.dumps({"gate": str(gate)}),
         "--socket", a.socket_path],
        stdout=subprocess.PIPE, stderr=terminal, stdin=subprocess.DEVNULL,
    )
    os.close(terminal)
    # Held open to the end: closing the terminal's controller side would hang it up under the CLI.
    reader = os.fdopen(controller, "rb", buffering=0)
    try:
        seen = _read_until(reader, lambda s: b"waiting for the gate" in s, 30.0)
        assert proc.poll() is None  # the progress is shown while the task runs
        assert b"working" in seen
        gate.touch()
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.close()
    assert proc.returncode == 0 and json.loads(out) == {"opened": True}


def test_no_wait_prints_the_task_id_then_show_and_cancel_without_agent(node: DaemonProcess) -> None:
    a = node
    opened = _cli("call", "tasks", "slow", '{"steps": 400, "pause": 0.1}', "--no-wait", "--socket", a.socket_path)
    assert opened.returncode == 0, opened.stderr
    task_id = opened.stdout.strip()
    assert task_id.startswith("t") and " " not in task_id, opened.stdout

    def recorded() -> bool:
        return _cli("tasks", "show", task_id, "--json", "--socket", a.socket_path).returncode == 0

    _wait_for("the task manager's record", recorded)
    record = json.loads(_cli("tasks", "show", task_id, "--json", "--socket", a.socket_path).stdout)
    assert record["id"] == task_id and record["offering"] == "slow"
    shown = _cli("tasks", "show", task_id, "--socket", a.socket_path)
    assert shown.returncode == 0
    assert f"task       {task_id}" in shown.stdout and "offering   slow" in shown.stdout
    assert "responder  " + a.agent_id("tasks") in shown.stdout and not shown.stdout.lstrip().startswith("{")

    canceled = _cli("tasks", "cancel", task_id, "--json", "--socket", a.socket_path)
    assert canceled.returncode == 0, canceled.stderr
    _wait_for("the cancel to be recorded", lambda: json.loads(
        _cli("tasks", "show", task_id, "--json", "--socket", a.socket_path).stdout)["state"] == "canceled")


def test_exit_codes_follow_the_table(node: DaemonProcess, tmp_path: Path) -> None:
    a = node
    sock = a.socket_path
    assert _cli("call", "--socket", sock).returncode == exitcodes.EX_USAGE == 64  # argparse
    assert _cli("call", "echo", "echo", "x", "--text", "y", "--socket", sock).returncode == 64
    assert _cli("call", "echo", "echo", "--timeout", "99999", "--socket", sock).returncode == 64  # InvalidParameter
    assert _cli("call", "echo", "echo", "not json", "--socket", sock).returncode == exitcodes.EX_DATAERR == 65
    assert _cli("agents", "show", "nobody", "--socket", sock).returncode == 65  # NotFound
    failed = _cli("call", "echo", "no-such-offering", "--socket", sock)
    assert failed.returncode == exitcodes.EX_CHECK_FAILED == 1 and "OFFERING_NOT_FOUND" in failed.stderr
    assert _cli("status", "--socket", str(tmp_path / "none.sock")).returncode == exitcodes.EX_NOT_RUNNING == 69
    bad = tmp_path / "bad.toml"
    bad.write_text("[node]\nname = 3\n")
    assert _cli("status", "--config", str(bad)).returncode == exitcodes.EX_CONFIG == 78


# Commands run with --json against the daemon: each must print JSON (one document,
# or one per line). The unit test test_cli_terminal walks the parser for the flag.
def _json_commands(a: DaemonProcess, tmp_path: Path) -> list[list[str]]:
    note = tmp_path / "note.txt"
    note.write_text("hello")
    return [
        ["status"], ["status", "--brief"], ["mesh", "info"], ["mesh", "nodes"], ["agents", "list"],
        ["agents", "show", "echo"], ["agents", "restart", "echo"], ["presence"], ["presence", "--agent", a.agent_id("echo")],
        ["discover"], ["drain"], ["renew"], ["reload"], ["logs", "--lines", "5"], ["tasks", "list"],
        ["metrics"], ["metrics", "--prometheus"], ["inbox", "list"], ["a2a", "charges"],
        ["call", "echo", "echo", "--text", "hi"], ["pub", "demo", "ping", "{}"],
        ["artifacts", "put", str(note)], ["artifacts", "usage"],
        ["envelope", "keygen"], ["completion", "bash"], ["check-config", "--config", str(a.config_path)],
    ]


def test_json_on_every_command(node: DaemonProcess, tmp_path: Path) -> None:
    # In this process (tests/integration/cli_here.py): 29 fresh interpreters spent ~0.8 s
    # each on imports; the subprocess path is covered by every other test here.
    a = node
    for command in _json_commands(a, tmp_path):
        extra = [] if "--config" in command or command[0] in ("envelope", "completion") else ["--socket", a.socket_path]
        proc = cli_here(*command, "--json", *extra)
        assert proc.returncode == 0, (command, proc.stderr)
        try:
            json.loads(proc.stdout)
        except json.JSONDecodeError:
            for line in proc.stdout.splitlines():  # a stream: one JSON per line
                json.loads(line)
        if command == ["status"]:
            status = json.loads(proc.stdout)
            # Instants in JSON are RFC 3339 UTC.
            assert str(status["credential"]["expires_at"]).endswith("Z"), status["credential"]
    ref = json.loads(cli_here("artifacts", "put", str(tmp_path / "note.txt"), "--json",
                          "--socket", a.socket_path).stdout)["ref"]
    for command in (["artifacts", "stat", ref], ["artifacts", "rm", ref]):
        proc = cli_here(*command, "--json", "--socket", a.socket_path)
        assert proc.returncode == 0 and json.loads(proc.stdout), (command, proc.stderr)


def test_pub_sub_round_trip(node: DaemonProcess) -> None:
    a = node
    sub = _popen("sub", "demo.*", "--json", "--count", "2", "--socket", a.socket_path)
    try:
        _read_until(sub.stderr, lambda seen: b"listening on mesh.event.demo.*" in seen, 30.0)
        for n in (1, 2):
            published = _cli("pub", "demo", "tick", json.dumps({"n": n}), "--json", "--socket", a.socket_path)
            assert published.returncode == 0, published.stderr
            assert json.loads(published.stdout)["subject"] == "mesh.event.demo.tick"
        out, err = sub.communicate(timeout=30)
    finally:
        if sub.poll() is None:
            sub.kill()
    assert sub.returncode == 0, err
    events = [json.loads(line) for line in out.decode().splitlines()]
    cli_id = a.agent_id("cli")
    assert [e["data"] for e in events] == [{"n": 1}, {"n": 2}]
    assert all(e["from"] == cli_id and e["domain"] == "demo" and e["event_type"] == "tick" for e in events)
    assert all(e["ts"].endswith("Z") for e in events)


def test_sub_feed_prints_an_agents_feed_entries(meshnode_daemons: DaemonSet) -> None:
    a = meshnode_daemons.embedded(
        "a", agents={"owner": {"plugin": "test-feeder"}}, node={"plugin_modules": ["tests.agents:feeder_plugin"]}
    )
    sub = _popen("sub", "--feed", "owner", "status", "--json", "--count", "1", "--socket", a.socket_path)
    try:
        _read_until(sub.stderr, lambda seen: b"listening on mesh.feed." in seen, 30.0)
        answer = a.call("owner", "publish", {"topic": "status", "data": {"level": "ok"}})
        assert answer["status"] == "completed", answer
        out, err = sub.communicate(timeout=30)
    finally:
        if sub.poll() is None:
            sub.kill()
    assert sub.returncode == 0, err
    (entry,) = [json.loads(line) for line in out.decode().splitlines()]
    assert entry["from"] == a.agent_id("owner") and entry["topic"] == "status" and entry["data"] == {"level": "ok"}
    assert entry["subject"] == f"mesh.feed.{a.agent_id('owner')}.status"


def test_artifacts_get_refuses_binary_on_a_terminal(node: DaemonProcess, tmp_path: Path) -> None:
    a = node
    binary, text = tmp_path / "blob.bin", tmp_path / "note.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    text.write_text("plain words\n")
    refs = {}
    for path in (binary, text):
        put = _cli("artifacts", "put", str(path), "--socket", a.socket_path)
        assert put.returncode == 0, put.stderr
        refs[path.name] = put.stdout.strip()

    def get_to_terminal(ref: str) -> tuple[int, bytes, str]:
        controller, terminal = pty.openpty()  # stdout is a terminal
        try:
            proc = subprocess.run([sys.executable, "-m", "meshnode.cli", "artifacts", "get", ref,
                                   "--socket", a.socket_path], stdout=terminal, stderr=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL, text=True, timeout=60)
            os.close(terminal)
            shown = b""
            while select.select([controller], [], [], 0.2)[0]:
                try:
                    chunk = os.read(controller, 65536)
                except OSError:  # EIO: the terminal's other side is closed and drained
                    break
                if not chunk:
                    break
                shown += chunk
            return proc.returncode, shown, proc.stderr
        finally:
            os.close(controller)

    code, shown, err = get_to_terminal(refs["blob.bin"])
    assert code == exitcodes.EX_USAGE and shown == b"" and "--out" in err, err
    code, shown, err = get_to_terminal(refs["note.txt"])
    assert code == 0 and b"plain words" in shown, err
    # To a pipe, or with --out, the bytes are written as they are.
    piped = subprocess.run([sys.executable, "-m", "meshnode.cli", "artifacts", "get", refs["blob.bin"],
                            "--socket", a.socket_path], capture_output=True, timeout=60)
    assert piped.returncode == 0 and piped.stdout == binary.read_bytes()
