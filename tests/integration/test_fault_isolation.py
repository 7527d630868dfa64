"""Fault isolation with real daemons (issue #23): what one bad part may not do to the rest."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import stat
import time

import pytest

from meshnode.testing import DaemonSet

pytestmark = pytest.mark.integration

TEST_PLUGINS = {"plugin_modules": ["tests.agents:plugin"]}


def test_a_failed_agent_is_listed_once_and_a_loose_data_dir_is_tightened(meshnode_daemons: DaemonSet) -> None:
    node = meshnode_daemons.embedded(
        "once",
        agents={"bad": {"plugin": "test-crash-on-start"}, "echo": {"plugin": "echo"}},
        node=TEST_PLUGINS,
        start=False,
    )
    # Pre-created by hand or a package, open to group and others (item 12).
    node.data_dir.mkdir(mode=0o755)
    os.chmod(node.data_dir, 0o755)
    node.start()
    status = node.status()
    names = [a["name"] for a in status["agents"]]
    assert names.count("bad") == 1 and names.count("echo") == 1, names
    bad = next(a for a in status["agents"] if a["name"] == "bad")
    assert bad["state"] == "failed" and "cannot start" in bad["failure"]
    assert status["agent_summary"]["failed"] == 1
    assert stat.S_IMODE(node.data_dir.stat().st_mode) == 0o700
    assert f"data directory {node.data_dir} was 0755" in node.log_text()
    assert node.call("echo", "echo", "up")["output"] == {"ok": "up"}


def test_an_unavailable_keystore_backend_exits_ex_config(meshnode_daemons: DaemonSet) -> None:
    if os.environ.get("CREDENTIALS_DIRECTORY"):
        pytest.skip("running under systemd credentials: the backend is available here")
    node = meshnode_daemons.embedded(
        "nokeys", extra={"keystore": {"backend": "systemd-credentials"}}, start=False
    )
    with pytest.raises(RuntimeError, match="exited with 78"):
        node.start()
    text = node.log_text()
    assert "systemd-credentials" in text and "LoadCredential" in text  # the backend and the fix


def test_a_second_sigint_still_does_the_inbox_final_write(meshnode_daemons: DaemonSet) -> None:
    # Item 6: a second interrupt forces the exit (130) but the duplicate memory
    # of the requests answered live (written behind dispatch) must be on disk,
    # or a restart would dispatch their buffered copies again.
    node = meshnode_daemons.embedded("force", agents={"echo": {"plugin": "echo"}})
    echo_id = node.agent_id("echo")
    calls = 20
    for i in range(calls):
        assert node.call("echo", "echo", i)["output"] == {"ok": i}
    assert node.process is not None
    # Right after the last answer: the pairs of the last calls may still be
    # behind (the write-behind runs every 50 ms) when the exit is forced. The
    # second signal goes once the first was taken ("stopping"): two sent back
    # to back are one pending signal to the kernel.
    node.process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 30
    while "stopping" not in node.log_text():
        assert time.monotonic() < deadline and node.process.poll() is None, node.log_tail()
        time.sleep(0.001)
    node.process.send_signal(signal.SIGINT)
    assert node.process.wait(timeout=30) == 130
    assert "second interrupt" in node.log_text()
    with contextlib.closing(sqlite3.connect(node.data_dir / "inbox.sqlite3")) as db:
        (remembered,) = db.execute("SELECT COUNT(*) FROM seen WHERE agent=?", (echo_id,)).fetchone()
    assert remembered == calls
