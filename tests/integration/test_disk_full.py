"""A node whose inbox disk fills up: it refuses to ack, says so, and recovers losing nothing.

Node ``b``'s data directory is a small tmpfs (mounted by the test, so it needs
root; without it the test skips and the SQLite fault paths are still covered
by tests/unit/test_inbox_faults.py). The test fills the filesystem to the last
byte, then sends requests to two agents on ``b``:

* ``desk`` (interactive): each request must be held in the inbox, which
  cannot be written. The node must not queue-ack it and must not ack the
  broker's copy, so it waits in the redelivery buffer (§16.4);
* ``work`` (a service that journals every dispatch to a file on another
  disk): handled live, answered, and its buffered copies must not be
  dispatched a second time after recovery.

While full, Status shows ``inbox.writable: false`` with SQLite's reason and the
log says so once. Then the filler is removed: the next drain pass takes every
buffered desk request into the inbox (nothing lost) and the journal still
shows each work request exactly once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from meshnode.testing import DaemonProcess, DaemonSet, eventually, render_toml

pytestmark = pytest.mark.integration

PLUGINS = {"plugin_modules": ["tests.agents:journal_plugin", "tests.agents:attended_plugin"]}
DURING_FAULT = 6
BIG = "x" * 40_000  # each held request needs fresh pages


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    saved = path.with_name(path.name + ".saved")
    shutil.copytree(path, saved)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(saved)
        return False
    shutil.copytree(saved, path, dirs_exist_ok=True)
    shutil.rmtree(saved)
    return True


def _fill(path: Path) -> Path:
    """Write a filler file until the filesystem has not one byte left."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def _held_ids(node: DaemonProcess, agent: str) -> set[str]:
    rows = node.admin("Inbox.List", {"agent": agent, "states": ["held"], "limit": 1000})["messages"]
    return {str(r["msg_id"]) for r in rows}


def test_a_full_inbox_disk_refuses_to_ack_reports_it_and_recovers_losing_nothing(meshnode_daemons: DaemonSet) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (the SQLite fault paths: tests/unit/test_inbox_faults.py)")
    a = meshnode_daemons.embedded("a", agents={})
    journal = meshnode_daemons.root / "journal.log"  # on the big disk: the handler itself keeps working
    b = meshnode_daemons.joined(
        "b", via=a, node=PLUGINS, start=False,
        agents={"desk": {"plugin": "test-attended"}, "work": {"plugin": "test-journal", "path": str(journal)}},
    )
    b.config["inbox"] = {"drain_interval": "1s"}
    b.config_path.write_text(render_toml(b.config), encoding="utf-8")
    if not _mount_tmpfs(b.data_dir, "24m"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        b.start()
        desk, work = b.agent_id("desk"), b.agent_id("work")
        assert a.call(desk, "chat", {"text": "before"}, timeout=10)["status"] == "queued"
        assert b.status()["inbox"]["writable"] is True

        filler = _fill(b.data_dir)
        desk_ids: list[str] = []
        work_done = 0
        for i in range(DURING_FAULT):
            held = a.call(desk, "chat", {"text": f"during {i}", "pad": BIG}, timeout=1.5)
            if held["status"] == "queued":
                continue  # still fit in pages SQLite had in hand: held, fine
            # No queued ack for a message nobody holds: the caller sees silence.
            assert held["status"] == "failed" and held["error"]["code"] == "TRANSPORT_TIMEOUT", held
            desk_ids.append(held["error"]["details"]["request_id"])
            done = a.call(work, "work", {"i": i}, timeout=10)
            assert done["status"] == "completed", done
            work_done += 1
        assert desk_ids, "the inbox never filled up"

        inbox = b.status()["inbox"]
        assert inbox["writable"] is False and "full" in str(inbox["fault"]), inbox
        log = b.log_text()
        # Said clearly and once (not once per failed write): the inbox's own error line.
        assert sum("meshnode.inbox" in line and "cannot be written" in line for line in log.splitlines()) == 1
        assert not (_held_ids(b, "desk") & set(desk_ids))

        filler.unlink()  # space returns
        got = eventually(lambda: set(desk_ids) <= _held_ids(b, "desk"), timeout=60,
                         detail=lambda: f"lost during the fault: {set(desk_ids) - _held_ids(b, 'desk')}\n{b.log_tail()}")
        assert got, f"lost during the fault: {set(desk_ids) - _held_ids(b, 'desk')}\n{b.log_tail()}"
        assert eventually(lambda: b.status()["inbox"]["writable"] is True)
        assert "writable again" in b.log_text()
        # The work requests ran live once; their buffered copies were acked after
        # recovery without a second dispatch.
        b.admin("Drain.Now")
        dispatched = Counter(line.strip() for line in journal.read_text().splitlines() if line.strip())
        assert len(dispatched) == work_done and max(dispatched.values()) == 1, dispatched
        assert b.process is not None and b.process.poll() is None
        print(f"disk full: {len(desk_ids)} held requests buffered by the broker during the fault, all held after "
              f"recovery; {work_done} live requests dispatched once each; 0 lost")
    finally:
        b.stop()
        if subprocess.run(["umount", str(b.data_dir)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(b.data_dir)], capture_output=True)
