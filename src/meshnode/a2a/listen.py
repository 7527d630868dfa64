"""The A2A bridge's listening sockets, opened by the daemon rather than by uvicorn.

uvicorn binds its own address when given a host and port, and a failed bind
ends in ``sys.exit(1)`` inside the server's task: a ``SystemExit`` that left
the daemon's event loop without its shutdown (measured: the process stayed up,
serving nothing, waiting on the inbox's SQLite thread). Binding here turns a
taken port into an ordinary start-up error that names ``[a2a] listen``.

``listen`` takes two forms:

- ``"host:port"``: every address ``host`` resolves to is bound (port 0 binds a
  free one, read back by the bridge);
- ``"fd://N"``: the listening TCP socket a supervisor opened and passed as
  file descriptor ``N`` (a systemd socket unit with ``ListenStream=``, which
  passes it as descriptor 3, or a test harness). The daemon never binds; the
  address it serves on is the socket's own, and the port stays the
  supervisor's across restarts.

The configuration checks the form (:func:`meshnode.config.a2a.listen_fd`).
"""

from __future__ import annotations

import errno
import os
import socket

__all__ = ["ListenError", "adopt_listener", "bind_listeners"]

#: The accept queue, as uvicorn's default.
BACKLOG = 2048


class ListenError(RuntimeError):
    """The bridge cannot listen where ``[a2a] listen`` says; the message says why and what to do."""


def adopt_listener(fd: int) -> socket.socket:
    """A socket serving the listening TCP socket passed as descriptor ``fd``
    (``listen = "fd://N"``): a duplicate of it. Descriptor ``fd`` itself stays
    open and as it was, whatever becomes of the duplicate: the server closes
    its socket at a stop, and a daemon that re-executes itself (a lapsed
    credential) must find descriptor ``fd`` again.

    Raises :class:`ListenError` when ``fd`` is not open, not a socket, not TCP
    or not listening.
    """
    where = f'[a2a] listen "fd://{fd}"'
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        reason = "is not open" if exc.errno == errno.EBADF else "is not a socket"
        raise ListenError(
            f"{where}: file descriptor {fd} {reason} ({exc.strerror}); the process that starts meshnode "
            f"must pass a listening TCP socket as descriptor {fd} (a systemd socket unit passes its "
            'first as 3), or set listen = "host:port"'
        ) from None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            raise ListenError(f"{where}: file descriptor {fd} is not a TCP socket ({sock.family.name}, {sock.type.name})")
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise ListenError(f"{where}: the socket on file descriptor {fd} is not listening (call listen() on it first)")
    finally:
        sock.detach()  # the descriptor is the caller's: never closed here
    serving = socket.socket(fileno=os.dup(fd))  # not inheritable, unlike fd
    serving.setblocking(False)
    return serving


def bind_listeners(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` resolves to, at ``port`` (0: a free one).

    Raises :class:`ListenError` naming the address and the cause (a port
    another process holds, an address this host does not have, a name that
    does not resolve); nothing stays bound then.
    """
    where = f"[a2a] listen {host}:{port}"
    bare = host.strip("[]")
    try:
        infos = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"{where}: {bare!r} does not resolve ({exc.strerror})") from None
    sockets: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            # A restart binds the port its previous run left in TIME_WAIT.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # "::" binds IPv6 only: a name with both families binds each itself.
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
            sock.setblocking(False)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise ListenError(_bind_failure(where, port, exc)) from None
    return sockets


def _bind_failure(where: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (
            f"{where}: the address is in use (another process, or an earlier meshnode still stopping, "
            f"holds port {port}); stop it or choose another port. A supervisor can hold the port "
            'across restarts and pass it as listen = "fd://N" (docs/configuration.md)'
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{where}: this host has no such address ({exc.strerror}); use one of its own addresses or 0.0.0.0"
    if exc.errno == errno.EACCES:
        return f"{where}: not permitted ({exc.strerror}); ports below 1024 need privileges, use a higher one"
    return f"{where}: {exc.strerror or exc}"
