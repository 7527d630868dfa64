"""Test helpers for meshnode and for plugin authors: real daemons, real NATS.

:class:`DaemonProcess` runs ``meshnode run`` as a subprocess with its own
data directory, configuration and short admin-socket path, waits until it
serves, and talks to it over the admin socket. The pytest plugin
(:mod:`meshnode.testing.pytest_plugin`, loaded automatically when meshnode is
installed) provides the ``meshnode_daemons`` fixture that stops every daemon a
test started::

    def test_my_agent(meshnode_daemons):
        node = meshnode_daemons.embedded("one", agents={"mine": {"plugin": "my-plugin"}})
        result = node.call("mine", "my-offering", {"text": "hi"})
        assert result["status"] == "completed"
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshnode.admin.client import call_sync
from meshnode.testing.waiting import (
    DEFAULT_TIMEOUT_S,
    WaitTimeout,
    consistently,
    consistently_async,
    eventually,
    eventually_async,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DaemonProcess",
    "DaemonSet",
    "WaitTimeout",
    "consistently",
    "consistently_async",
    "eventually",
    "eventually_async",
]


def _stop_with_parent() -> None:
    """In the child: SIGTERM when the test process dies, however it dies, so an
    interrupted test run never leaves daemons behind (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table, e.g. one entry of an array of tables
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def render_toml(tables: dict[str, dict[str, Any]]) -> str:
    """A tiny TOML writer for flat tables (enough for test configurations)."""
    lines: list[str] = []
    for table, values in tables.items():
        lines.append(f"[{table}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items())
        lines.append("")
    return "\n".join(lines)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


#: Offsets into this process's slice for :meth:`DaemonSet.port_for_restarts`:
#: random start (runs do not all try the same ports first), never repeated.
_RESTART_PORTS = itertools.count(random.randrange(1_000_000))


class DaemonProcess:
    """One ``meshnode run`` subprocess."""

    def __init__(self, workdir: Path, name: str, config: dict[str, dict[str, Any]]) -> None:
        self.name = name
        self.workdir = workdir
        self.config_path = workdir / "meshnode.toml"
        self.log_path = workdir / "daemon.log"
        self.socket_path = str(config["admin"]["socket"])
        self.data_dir = Path(config["node"]["data_dir"])
        self.config = config
        self.config_path.write_text(render_toml(config), encoding="utf-8")
        self.process: subprocess.Popen[bytes] | None = None
        self._log_start = 0
        #: Descriptors every start passes on, under the same numbers (a listening
        #: socket held across restarts: ``[a2a] listen = "fd://N"``).
        self.pass_fds: tuple[int, ...] = ()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(
        self,
        timeout: float = 60.0,
        *,
        env_extra: dict[str, str] | None = None,
        wait: bool = True,
        python: str | None = None,
    ) -> DaemonProcess:
        """Launch ``meshnode run``; with ``wait`` (the default) return once Status
        says "serving" (raising if it exits first or ``timeout`` passes).
        ``python`` is the interpreter to run it with (default: this one), e.g.
        another virtualenv's, whose site directory a test installs into."""
        env = dict(os.environ)
        # Make the repository (test plugin modules) importable in the daemon.
        root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        env.pop("NOTIFY_SOCKET", None)
        env.update(env_extra or {})
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        # Where this run's lines begin: a restart's failure shows its own log.
        self._log_start = log.tell()
        try:
            self.process = subprocess.Popen(
                [python or sys.executable, "-m", "meshnode.cli", "run", "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=_stop_with_parent,
                pass_fds=self.pass_fds,
            )
        finally:
            log.close()
        if not wait:
            return self
        started = time.monotonic()
        deadline = started + timeout
        seen = "no answer on the admin socket"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"daemon {self.name} exited with {self.process.returncode} during start-up:\n"
                    f"{self.log_tail(since_start=True)}"
                )
            if os.path.exists(self.socket_path):
                try:
                    # The socket answers while agents still start: ready is "serving".
                    status = call_sync(self.socket_path, "Status", {"agents": False}, timeout=5.0)
                    if status.get("state") == "serving":
                        return self
                    seen = f"state {status.get('state')!r}, stage {status.get('stage')!r}"
                except Exception as exc:
                    seen = f"admin socket: {type(exc).__name__}: {exc}"
            # A Status costs the daemon O(agents): polled ten times a second through
            # a 10,000-agent start it was 7 % of the daemon's samples (py-spy), so a
            # long start is polled once a second (a quick one as often as before).
            time.sleep(0.1 if time.monotonic() - started < 5.0 else 1.0)
        # What the daemon last said comes first: a long log tail gets cut in the middle.
        raise RuntimeError(
            f"daemon {self.name} did not become ready in {timeout}s (last seen: {seen}); "
            f"this start's log:\n{self.log_tail(since_start=True)}"
        )

    def stop(self, timeout: float = 40.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it overruns. Returns the exit status."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else None
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL the daemon (a crash), leaving its children to their own fate."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def admin(self, method: str, params: dict[str, Any] | None = None, timeout: float = 60.0) -> Any:
        return call_sync(self.socket_path, method, params, timeout=timeout)

    def status(self) -> dict[str, Any]:
        """``Status`` with every page of its agent list."""
        result: dict[str, Any] = call_sync(self.socket_path, "Status", timeout=60.0, listing=True)
        return result

    def agent_id(self, name: str) -> str:
        for agent in self.status()["agents"]:
            if agent["name"] == name:
                return str(agent["id"])
        raise KeyError(name)

    def call(self, agent: str, offering: str, input: Any = None, timeout: float = 30.0) -> dict[str, Any]:
        params: dict[str, Any] = {"agent": agent, "offering": offering, "timeout": timeout}
        if input is not None:
            params["input"] = input
        result: dict[str, Any] = self.admin("Call", params, timeout=timeout + 10)
        return result

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60, *, since_start: bool = False) -> str:
        """The log's last ``lines``; with ``since_start``, only the latest start's."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start if since_start else 0)
                text = f.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            text = ""
        return "\n".join(text.splitlines()[-lines:])


class DaemonSet:
    """Creates daemons under short temporary paths and stops them all at the end."""

    def __init__(self) -> None:
        # Short paths: a Unix socket path must stay under ~100 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="mn-", dir="/tmp"))
        self.daemons: list[DaemonProcess] = []
        self._held: list[socket.socket] = []

    def port_for_restarts(self) -> int:
        """A free loopback port that no port-0 bind and no outgoing connection can take.

        For a listener that only the child itself can bind (the embedded
        nats-server) and that must come back on the same port after a restart.
        A port read back from a port-0 bind lies in the kernel's ephemeral
        range, which every outgoing connection draws from: while the listener
        is down, any connection on the host may take it. A port below that range
        is only ever taken by a bind that names it; these are spread over the
        xdist workers (each its own slice) and never handed out twice, and a
        port found taken is skipped.
        """
        low = _ephemeral_low()
        worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
        slices = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
        first, last = (10_000 if low > 11_000 else 1024), low - 1
        span = (last - first + 1) // slices
        if span < 100:
            raise RuntimeError(f"the ephemeral port range starts at {low}: too few ports below it for tests")
        start = first + (worker % slices) * span
        while True:
            port = start + next(_RESTART_PORTS) % span
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port

    def listening_socket(self) -> socket.socket:
        """A loopback TCP socket listening on a free port, held open until :meth:`close`.

        For ``[a2a] listen = "fd://N"`` with :attr:`DaemonProcess.pass_fds`: a
        daemon restarted on it serves the same port, and nothing can take the
        port between its runs (no bind-then-release race).
        """
        sock = socket.create_server(("127.0.0.1", 0))
        self._held.append(sock)
        return sock

    def _workdir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(mode=0o700)
        return path

    def _base(self, name: str, workdir: Path, agents: dict[str, dict[str, Any]], node: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
        config: dict[str, dict[str, Any]] = {
            "node": {"name": name, "data_dir": str(workdir / "data"), **(node or {})},
            "admin": {"socket": str(workdir / "admin.sock")},
            "keystore": {"backend": "file"},
            "logging": {"level": "debug" if os.environ.get("MESHNODE_TEST_DEBUG") else "info"},
        }
        for agent_name, table in agents.items():
            config[f"agents.{agent_name}"] = dict(table)
        return config

    def embedded(
        self,
        name: str,
        *,
        agents: dict[str, dict[str, Any]] | None = None,
        node: dict[str, Any] | None = None,
        extra: dict[str, dict[str, Any]] | None = None,
        start: bool = True,
        pass_fds: tuple[int, ...] = (),
    ) -> DaemonProcess:
        """A daemon running the embedded mesh (and the platform services);
        ``pass_fds`` go to every start (see :meth:`listening_socket`)."""
        workdir = self._workdir(name)
        config = self._base(name, workdir, agents or {}, node)
        # Port 0 for both listeners: each binds a free port itself and Mesh.Info reports
        # the bound one (no bind-then-release race). A restart binds anew; a test
        # that restarts this node under joined ones gives it ports from port_for_restarts.
        config["mesh.embedded"] = {"port": 0, "control_port": 0}
        for table, values in (extra or {}).items():
            config.setdefault(table, {}).update(values)
        daemon = DaemonProcess(workdir, name, config)
        daemon.pass_fds = pass_fds
        self.daemons.append(daemon)
        return daemon.start() if start else daemon

    def joined(
        self,
        name: str,
        via: DaemonProcess,
        *,
        agents: dict[str, dict[str, Any]] | None = None,
        node: dict[str, Any] | None = None,
        start: bool = True,
        invite_args: Sequence[str] = (),
        extra: dict[str, dict[str, Any]] | None = None,
    ) -> DaemonProcess:
        """A daemon that joins ``via``'s mesh with an invite, as a person would.

        ``invite_args`` go to ``meshnode mesh invite`` (``--tenant``, ``--trust-tier``);
        ``extra`` adds to the configuration's tables (as for :meth:`embedded`).
        """
        workdir = self._workdir(name)
        invite = workdir / "invite.creds"
        run_cli("mesh", "invite", name, "--out", str(invite), "--socket", via.socket_path, *invite_args)
        info = via.admin("Mesh.Info")
        config = self._base(name, workdir, agents or {}, node)
        config["mesh"] = {"servers": info["nats_urls"], "control_plane": info["control_plane"]}
        data_dir = Path(config["node"]["data_dir"])
        run_cli("join", str(invite), "--data-dir", str(data_dir), "--config-out", str(workdir / "joined.toml"))
        for table, values in (extra or {}).items():
            config.setdefault(table, {}).update(values)
        daemon = DaemonProcess(workdir, name, config)
        self.daemons.append(daemon)
        return daemon.start() if start else daemon

    def close(self) -> None:
        for daemon in reversed(self.daemons):
            try:
                daemon.stop()
            except Exception:
                daemon.kill()
        for sock in self._held:
            sock.close()
        shutil.rmtree(self.root, ignore_errors=True)


def run_cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``meshnode ARGS`` and raise with its output when it fails."""
    proc = subprocess.run(
        [sys.executable, "-m", "meshnode.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"meshnode {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc
