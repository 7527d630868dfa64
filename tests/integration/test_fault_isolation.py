"""Fault isolation with real daemons (issue #23): what one bad part may not do to the rest."""

from __future__ import annotations

import os
import stat

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
