"""The test harness's ports (meshnode.testing): a listener a daemon inherits, and
ports for a child that must come back on the same one after a restart."""

from __future__ import annotations

import os
import socket

from meshnode.testing import DaemonSet, _ephemeral_low


def test_ports_for_restarts_lie_below_the_ephemeral_range_and_are_free() -> None:
    daemons = DaemonSet()
    try:
        ports = [daemons.port_for_restarts() for _ in range(20)]
        assert len(set(ports)) == len(ports)
        low = _ephemeral_low()
        for port in ports:
            assert port < low, (port, low)
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
    finally:
        daemons.close()


def test_a_held_listener_stays_open_until_the_set_closes() -> None:
    daemons = DaemonSet()
    held = daemons.listening_socket()
    port = held.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # queued in its backlog: it listens
    assert os.get_inheritable(held.fileno()) is False  # passed on only through pass_fds
    daemons.close()
    assert held.fileno() == -1
