"""systemd's notify protocol (sd_notify), self-contained.

READY=1 once serving, RELOADING=1 / READY=1 around a reload, STOPPING=1 at
shutdown, WATCHDOG=1 at half the watchdog interval. A no-op when the daemon
was not started by systemd (``NOTIFY_SOCKET`` unset).
"""

from __future__ import annotations

import os
import socket
import time

__all__ = ["Notifier"]


class Notifier:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        self._address = env.get("NOTIFY_SOCKET") or None
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        self.watchdog_interval: float | None = None
        if usec and usec.isdigit() and (not pid or pid == str(os.getpid())):
            self.watchdog_interval = int(usec) / 1_000_000

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *states: str) -> bool:
        """Send ``KEY=value`` lines; True when a notify socket took them."""
        if self._address is None:
            return False
        address = self._address
        if address.startswith("@"):  # abstract namespace socket
            address = "\0" + address[1:]
        message = "\n".join(states).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(address)
                sock.sendall(message)
        except OSError:
            return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *( [f"STATUS={status}"] if status else []))

    def reloading(self) -> bool:
        # MONOTONIC_USEC lets Type=notify-reload match the reload to this message.
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")
