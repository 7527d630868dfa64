"""The data directory at start: one daemon per directory (meshnode.daemon.datalock,
the lock a daemon takes before it touches anything there), and a directory that
cannot be made is the configuration's error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshnode.daemon.datalock import LOCK_FILE, DataDirBusy, DataDirLock


def test_a_held_directory_is_refused_naming_the_holder(tmp_path: Path) -> None:
    first = DataDirLock.acquire(tmp_path)
    lock_file = tmp_path / LOCK_FILE
    assert lock_file.read_text() == f"{os.getpid()}\n"
    assert lock_file.stat().st_mode & 0o777 == 0o600
    # flock belongs to the open file: a second open, even in this process, is another taker.
    with pytest.raises(DataDirBusy) as refused:
        DataDirLock.acquire(tmp_path)
    assert refused.value.holder == os.getpid()
    assert str(refused.value) == (
        f"another meshnode daemon (pid {os.getpid()}) is running with data directory {tmp_path}: "
        "stop it first, or give this one a data directory of its own ([node] data_dir)"
    )
    first.release()
    first.release()  # idempotent
    again = DataDirLock.acquire(tmp_path)  # free once released (the file stays)
    assert again.held
    again.release()


def test_the_lock_is_not_inherited_by_child_processes(tmp_path: Path) -> None:
    """The broker the daemon starts must not hold the node's lock: a broker
    outliving a killed daemon would keep the next start out."""
    lock = DataDirLock.acquire(tmp_path)
    try:
        assert not os.get_inheritable(lock._fd)
    finally:
        lock.release()


def test_a_data_directory_that_cannot_be_made_is_named_as_the_configurations(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    config = tmp_path / "meshnode.toml"
    config.write_text(f'[node]\ndata_dir = "{blocker}/data"\n[admin]\nsocket = "{tmp_path}/a.sock"\n', encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "meshnode.cli", "run", "--config", str(config)],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 78, proc.stderr  # EX_CONFIG, as for any setting that cannot work here
    assert f"{config}: node.data_dir: cannot create the data directory {blocker}/data: Not a directory" in proc.stderr
