"""systemd notify: READY=1 once serving, STOPPING=1 on SIGTERM, WATCHDOG=1 pings."""

from __future__ import annotations

import socket

import pytest

from meshnode.testing import DaemonSet, eventually

pytestmark = pytest.mark.integration


def test_ready_watchdog_stopping(meshnode_daemons: DaemonSet) -> None:
    node = meshnode_daemons.embedded("notify", agents={"echo": {"plugin": "echo"}}, start=False)
    path = str(node.workdir / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    try:
        node.start(env_extra={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"})
        messages: list[str] = []

        def watchdog_pinged() -> bool:
            try:
                messages.append(sock.recv(4096).decode())  # blocks up to the socket's 0.2 s
            except TimeoutError:
                pass
            return any("WATCHDOG=1" in m for m in messages)

        eventually(watchdog_pinged, interval=0, what="a WATCHDOG=1 notification", detail=lambda: messages)
        assert any("READY=1" in m for m in messages), messages
        assert any("WATCHDOG=1" in m for m in messages), messages
        assert node.stop() == 0
        tail: list[str] = []
        try:
            while True:
                tail.append(sock.recv(4096).decode())
        except TimeoutError:
            pass
        assert any("STOPPING=1" in m for m in tail), tail
    finally:
        sock.close()


def test_shutdown_budgets_fit_systemd_stop_timeout() -> None:
    from pathlib import Path

    from meshnode.daemon.lifecycle import shutdown_budget_total

    unit = Path(__file__).resolve().parents[2] / "systemd" / "meshnode.service"
    timeout = next(
        int(line.split("=", 1)[1].rstrip("s"))
        for line in unit.read_text().splitlines()
        if line.startswith("TimeoutStopSec=")
    )
    assert shutdown_budget_total() < timeout
