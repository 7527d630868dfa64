"""``meshnode call`` input too large for the admin line is said before connecting
(it was a ValueError traceback), with exit 65 and the way out."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def test_an_input_over_the_admin_line_is_refused_before_connecting(tmp_path: Path) -> None:
    big = json.dumps({"x": "a" * 2_000_000})
    proc = subprocess.run(
        [sys.executable, "-m", "meshnode.cli", "call", "echo", "echo", "-", "--socket", str(tmp_path / "none.sock")],
        input=big, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 65, proc.stderr  # not 69: nothing was asked of a daemon
    assert re.search(r"the request is 2,000,\d{3} bytes, over the admin protocol's 1,048,576-byte line", proc.stderr)
    assert "meshnode artifacts put FILE" in proc.stderr and "Traceback" not in proc.stderr


def test_the_admin_call_outwaits_the_daemon(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`call --timeout 60` to a task that ran 40 s failed at 30 s ("the daemon did
    not answer in time", exit 75): the admin call had its own 30 s bound. A call
    that waits for a task waits as long as the daemon follows it (the daemon
    bounds the task's silence); one that does not, past the request's timeout;
    the roster and renewal commands past their own waits."""
    from meshnode.cli import daemon, main

    asked: list[tuple[str, float | None]] = []

    def fake_call_sync(socket: str, method: str, params: Any = None, *, timeout: float | None = 30.0,
                       **kwargs: Any) -> Any:
        asked.append((method, timeout))
        if method == "Call":
            return {"status": "completed", "output": "ok"}
        return {"added": [], "removed": [], "restarted": [], "requires_restart": [], "allowances": {},
                "credential": {}, "vouches": {}}

    monkeypatch.setattr(daemon, "call_sync", fake_call_sync)
    sock = str(tmp_path / "admin.sock")
    assert main(["call", "tasks", "slow", "--timeout", "60", "--json", "--socket", sock]) == 0
    assert main(["call", "tasks", "slow", "--timeout", "60", "--no-wait", "--json", "--socket", sock]) == 0
    assert asked == [("Call", None), ("Call", 75.0)]
    asked.clear()
    assert main(["reload", "--json", "--socket", sock]) == 0
    assert main(["renew", "--json", "--socket", sock]) == 0
    assert [(method, timeout is None or timeout >= 300) for method, timeout in asked] == [
        ("Reload", True), ("Renew.Now", True)]
