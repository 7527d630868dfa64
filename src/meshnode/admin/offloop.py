"""The status socket: an answer that needs no event loop (issue #23 item 10).

The admin server runs on the daemon's one asyncio loop. A plugin handler that
blocks that loop (``time.sleep(40)``) used to leave ``meshnode status`` waiting
on a socket nobody read, 30 s to a timeout (exit 75), with no word of why.

Beside the admin socket, the server binds a second one, :func:`status_socket_path`
(``admin.sock.status``), served by a small thread: each connection gets one
JSON line and is closed. The line comes from an ``answer`` callable that runs
in the thread; the daemon's reads only what the loop *publishes* (an encoded
status snapshot, the loop watchdog's last wakeup), never loop-owned objects.
The peer is authorised as on the admin socket (the daemon's user and root;
members of the admin group); the file has the admin socket's owner, group
and mode.

The line is ``{"result": {...}}`` or ``{"error": {"name", "message"}}``. The
CLI asks it only when the admin socket is slow to answer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import orjson

from .peers import PeerCredentials, PeerCredentialsFn, peer_in_group

__all__ = ["StatusResponder", "read_status_socket", "status_socket_path"]

_log = logging.getLogger("meshnode.admin")

#: How long the thread waits for a slow reader before giving up on it.
_SEND_TIMEOUT_S = 2.0
#: How often the thread looks whether it was asked to stop.
_POLL_S = 0.5


def status_socket_path(admin_socket: str | os.PathLike[str]) -> Path:
    """The status socket beside ``admin_socket`` (the CLI finds it from the admin path)."""
    path = Path(admin_socket)
    return path.with_name(path.name + ".status")


class StatusResponder:
    """Answer every connection on a listening socket with ``answer()``, in a thread.

    ``sock`` is bound and listening (the admin server binds it as privately as
    its own). ``answer`` runs in the thread and must only read values the loop
    publishes whole (immutable bytes, floats); an exception in it is logged
    and answered as an error. ``daemon_uid``/``group_gid``: who may connect.
    """

    def __init__(
        self,
        sock: socket.socket,
        answer: Callable[[], bytes],
        *,
        daemon_uid: int,
        group_gid: int | None,
        peer_credentials: PeerCredentialsFn,
    ) -> None:
        self._sock = sock
        self._answer = answer
        self._daemon_uid = daemon_uid
        self._group_gid = group_gid
        self._peer_credentials = peer_credentials
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._sock.settimeout(_POLL_S)
        self._thread = threading.Thread(target=self._serve, name="meshnode-status-socket", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop accepting and close the socket (blocks up to ``timeout`` for the thread)."""
        self._stopped.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
        with contextlib.suppress(OSError):
            self._sock.close()

    # -- in the thread -----------------------------------------------------------

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopped.is_set():
                    return
                continue
            with conn:
                try:
                    conn.settimeout(_SEND_TIMEOUT_S)
                    conn.sendall(self._reply(conn))
                except OSError:
                    pass  # the client went away: nothing to tell it

    def _reply(self, conn: socket.socket) -> bytes:
        try:
            peer = self._peer_credentials(conn)
        except OSError:
            return _error("PermissionDenied", "cannot identify peer")
        if not self._allowed(peer):
            _log.warning("status socket: refused uid=%d pid=%d", peer.uid, peer.pid)
            return _error("PermissionDenied", "not allowed to use the meshnode admin API")
        try:
            return b'{"result":' + self._answer() + b"}\n"
        except Exception:
            _log.exception("status socket: the answer failed")
            return _error("Internal", "the status socket's answer failed (see the daemon log)")

    def _allowed(self, peer: PeerCredentials) -> bool:
        # The admin socket's rule (AdminServer._authorize); blocking NSS is fine here.
        if peer.uid in (0, self._daemon_uid):
            return True
        if self._group_gid is None:
            return False
        return self._group_gid in peer.groups or peer_in_group(peer.uid, peer.gid, self._group_gid)


def _error(name: str, message: str) -> bytes:
    return orjson.dumps({"error": {"name": name, "message": message}}) + b"\n"


def read_status_socket(admin_socket: str | os.PathLike[str], timeout: float = 2.0) -> dict[str, object] | None:
    """The status socket's answer (its ``result``), or None when there is none to read.

    None: no status socket (a daemon without one, or not running), no answer
    in ``timeout``, or an error reply (the caller falls back to the admin
    socket's own answer or error). Blocking: call it off the loop.
    """
    path = status_socket_path(admin_socket)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(os.fspath(path))
            chunks = []
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
    except OSError:
        return None
    try:
        reply = orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError:
        return None
    result = reply.get("result") if isinstance(reply, dict) else None
    return result if isinstance(result, dict) else None
