"""The admin server: the daemon's Unix-socket JSON API (see :mod:`.protocol`).

The method table is :mod:`.methods`, who the peer is :mod:`.peers`; their
names are re-exported here, where the daemon has always imported them.

The daemon builds a :class:`MethodRegistry`, adds its methods, and runs an
:class:`AdminServer` on it::

    registry = MethodRegistry()
    registry.add("ListAgents", list_agents, level="read", doc="...")
    server = AdminServer("/run/meshnode/admin.sock", group="meshnode", methods=registry)
    await server.start()
    ...
    await server.close()

A method is ``async def method(params: dict, call: CallContext) -> result``.
A streaming method (``streaming=True``) is an async generator whose every
yielded value is sent at once with ``continues: true``; or an ``async def``
that sends intermediate replies with :meth:`CallContext.send` and returns the
last one. Raise an :class:`~.protocol.AdminError` subclass (``InvalidParameter``,
``NotFound``, ...) to answer with that error; a
:class:`~meshnode.protocol.errors.ProtocolError` becomes ``Refused``; anything
else becomes a generic ``Internal`` error and is logged here with its traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import secrets
import socket
import stat
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshnode import __version__
from meshnode.aio import wait_for
from meshnode.protocol.canonical import CanonicalJSONError
from meshnode.protocol.errors import ProtocolError

from .methods import CallContext, Method, MethodFn, MethodRegistry, param
from .offloop import StatusResponder, status_socket_path
from .peers import PeerCredentials, PeerCredentialsFn, peer_in_group, so_peercred
from .protocol import (
    API_VERSION,
    MAX_LINE_BYTES,
    PRODUCT,
    AdminError,
    InternalError,
    InvalidParameter,
    InvalidRequest,
    Level,
    MethodNotFound,
    NotReady,
    PermissionDenied,
    Refused,
    Request,
    decode,
    encode,
    error_reply,
    parse_request,
    result_reply,
)

__all__ = [
    "AdminServer",
    "AdminSocketError",
    "CallContext",
    "Method",
    "MethodFn",
    "MethodRegistry",
    "PeerCredentials",
    "PeerCredentialsFn",
    "SocketInUse",
    "param",
    "peer_in_group",
    "so_peercred",
]

_log = logging.getLogger("meshnode.admin")

#: sun_path is 108 bytes on Linux, including the terminating NUL.
_MAX_SOCKET_PATH = 107
#: How long close() waits for the final write of a call cut off by shutdown.
_FAREWELL_TIMEOUT = 1.0


# --------------------------------------------------------------------------- errors


class AdminSocketError(RuntimeError):
    """The admin socket could not be set up (bad path, group, mode or directory)."""


class SocketInUse(AdminSocketError):
    """Another process is listening on the admin socket path (a daemon already runs)."""


class _PeerGone(Exception):
    """The client went away; nothing more can be sent on this connection."""


def _resolve_group(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isdigit():
            return int(group)
        raise AdminSocketError(f"admin socket group {group!r} does not exist") from None


# --------------------------------------------------------------------------- connections


class _Signal:
    def __init__(self, name: str) -> None:
        self.name = name


_EOF = _Signal("eof")
_OVERSIZE = _Signal("oversize")


@dataclass(eq=False)
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    task: asyncio.Task[None]
    max_line: int
    # Small bound: a pipelining client is paused (by socket back-pressure)
    # rather than buffered without limit.
    lines: asyncio.Queue[bytes | _Signal] = field(default_factory=lambda: asyncio.Queue(8))
    eof: asyncio.Event = field(default_factory=asyncio.Event)
    call: asyncio.Task[None] | None = None
    streaming: bool = False

    async def send(self, message: Mapping[str, Any]) -> None:
        data = encode(message)
        if len(data) > self.max_line + 1:
            raise InternalError(
                "reply too large for the admin protocol", {"max_line_bytes": self.max_line}
            )
        if self.writer.is_closing():
            raise _PeerGone
        try:
            self.writer.write(data)
            await self.writer.drain()
        except (ConnectionError, OSError) as exc:
            raise _PeerGone from exc


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    # The umask is process-wide. Callers hold it only across synchronous
    # calls (no await), so no other coroutine observes it; a worker thread
    # that creates a file meanwhile only gets stricter permissions.
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


# --------------------------------------------------------------------------- server


class AdminServer:
    """Serve a :class:`MethodRegistry` on a Unix socket, authorising each peer.

    ``group``: the admin group whose members get ``operator`` access; the socket
    (and a runtime directory created here) are owned by it. ``mode``: the socket
    file mode, default ``0o660`` with a group and ``0o600`` without; any world
    bit is refused. ``info``: extra members for ``GetInfo`` (called per call;
    cannot override the standard members). ``peer_credentials``: replaces the
    ``SO_PEERCRED`` lookup (tests). ``shutdown_timeout``: :meth:`close`'s budget.
    ``status_answer``: the encoded ``result`` the status socket beside this one
    answers from a thread, when the loop cannot (:mod:`.offloop`); it runs in
    that thread, so it may only read what the loop publishes whole.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        group: str | None = None,
        mode: int | None = None,
        methods: MethodRegistry | None = None,
        info: Callable[[], Mapping[str, Any]] | None = None,
        peer_credentials: PeerCredentialsFn | None = None,
        max_line: int = MAX_LINE_BYTES,
        shutdown_timeout: float = 5.0,
        status_answer: Callable[[], bytes] | None = None,
    ) -> None:
        if mode is None:
            mode = 0o660 if group else 0o600
        if mode & ~0o770:
            raise ValueError(f"admin socket mode {mode:#o}: only user and group bits are allowed")
        if mode & 0o600 != 0o600:
            raise ValueError(f"admin socket mode {mode:#o}: the owner needs read and write")
        if mode & 0o070 and not group:
            raise ValueError(f"admin socket mode {mode:#o} grants group access but no group is set")
        self.path = Path(socket_path)
        self.group = group
        self.mode = mode
        self.methods = methods if methods is not None else MethodRegistry()
        self.shutdown_timeout = shutdown_timeout
        self._info = info
        self._peer_credentials: PeerCredentialsFn = peer_credentials or so_peercred
        self._max_line = max_line
        self._daemon_uid = os.geteuid()
        self._group_gid: int | None = None
        self._server: asyncio.Server | None = None
        self._socket_id: tuple[int, int] | None = None
        self._connections: set[_Connection] = set()
        self._closing = False
        self._status_answer = status_answer
        self._status: StatusResponder | None = None
        self._status_id: tuple[int, int] | None = None
        self.methods.add(
            "GetInfo",
            self._get_info,
            level=Level.READ,
            doc="""
            Who is serving, and what it can do. Call it first.

            params: none.
            result: {"product": "meshnode", "version": str, "api_version": "1",
                     "features": [method name, ...], "level": "read"|"operator"|"admin",
                     ...daemon facts}
            """,
        )

    # ----------------------------------------------------------------- lifecycle

    @property
    def serving(self) -> bool:
        return self._server is not None and not self._closing

    async def start(self) -> None:
        """Bind and start accepting.

        When this returns, the socket is at :attr:`path` with its final owner,
        group and mode; it never existed there with any other. Raises
        :class:`SocketInUse` if a live server holds the path, and
        :class:`AdminSocketError` for other setup failures.
        """
        if self._server is not None:
            raise RuntimeError("admin server already started")
        self._closing = False
        self._group_gid = _resolve_group(self.group) if self.group else None
        final = self.path
        # A short random name: sun_path is small, and the directory is ours.
        temp = final.parent / f".~{secrets.token_hex(4)}"
        for candidate in (final, temp):
            if len(os.fsencode(candidate)) > _MAX_SOCKET_PATH:
                raise AdminSocketError(
                    f"admin socket path {str(candidate)!r} is longer than "
                    f"{_MAX_SOCKET_PATH} bytes (AF_UNIX limit); choose a shorter one"
                )
        self._prepare_directory(final.parent)
        sock = self._bind_private(temp)
        installed = False
        try:
            await self._install(temp, final)
            installed = True
            st = os.lstat(final)
            self._socket_id = (st.st_dev, st.st_ino)
            self._server = await asyncio.start_unix_server(
                self._on_connect, sock=sock, limit=self._max_line
            )
        except BaseException:
            sock.close()
            if installed:
                self._unlink_own_socket()
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
        _log.info("admin API listening on %s (mode %#o, group %s)", final, self.mode, self.group)
        if self._status_answer is not None:
            self._start_status_socket(self._status_answer)

    def _start_status_socket(self, answer: Callable[[], bytes]) -> None:
        """Bind the status socket as privately as the admin socket; a failure only warns.

        The admin socket is ours by now, so whatever socket sits at the status
        path is a dead daemon's: it is replaced (a file that is no socket is not).
        """
        final = status_socket_path(self.path)
        temp = final.parent / f".~{secrets.token_hex(4)}"
        if len(os.fsencode(final)) > _MAX_SOCKET_PATH:
            _log.warning("no status socket: %s is longer than %d bytes (AF_UNIX limit); "
                         "meshnode status waits on the admin socket alone", final, _MAX_SOCKET_PATH)
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISSOCK(os.lstat(final).st_mode):
                    raise AdminSocketError(f"{final} exists and is not a socket; not replacing it")
            sock = self._bind_private(temp)
            try:
                os.replace(temp, final)
                st = os.lstat(final)
            except OSError:
                sock.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)
                raise
        except (AdminSocketError, OSError) as exc:
            _log.warning("no status socket (meshnode status waits on the admin socket alone): %s", exc)
            return
        self._status_id = (st.st_dev, st.st_ino)
        self._status = StatusResponder(
            sock, answer, daemon_uid=self._daemon_uid, group_gid=self._group_gid,
            peer_credentials=self._peer_credentials,
        )
        self._status.start()

    def _stop_status_socket(self) -> None:
        responder, self._status = self._status, None
        if responder is None:
            return
        path = status_socket_path(self.path)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) == self._status_id:
                os.unlink(path)
        self._status_id = None
        responder.stop()

    async def close(self, timeout: float | None = None) -> None:
        """Stop accepting, end calls in progress, and remove the socket file.

        Idle connections close at once. Streaming calls end with a ``NotReady``
        error. Other calls get ``timeout`` seconds (default
        :attr:`shutdown_timeout`) to finish and reply; then they are cancelled.
        """
        if self._server is None or self._closing:
            return
        self._closing = True
        budget = self.shutdown_timeout if timeout is None else timeout
        self._server.close()
        # The name goes first: a client that starts now sees "not running"
        # rather than a socket that never answers.
        self._unlink_own_socket()
        # Quick (the thread looks every 0.5 s) and off the loop.
        await asyncio.to_thread(self._stop_status_socket)
        for conn in list(self._connections):
            if conn.call is None:
                conn.task.cancel()
            elif conn.streaming:
                conn.call.cancel()
        tasks = {conn.task for conn in self._connections}
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=budget)
            if pending:
                _log.warning(
                    "admin: cancelling %d call(s) still running after %.1fs: %s",
                    len(pending),
                    budget,
                    ", ".join(sorted(c.call.get_name() for c in self._connections if c.call)),
                )
                for task in pending:
                    task.cancel()
                await asyncio.wait(pending, timeout=_FAREWELL_TIMEOUT)
        with contextlib.suppress(Exception):
            await wait_for(self._server.wait_closed(), _FAREWELL_TIMEOUT)
        self._server = None
        _log.info("admin API closed")

    async def __aenter__(self) -> AdminServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ----------------------------------------------------------------- binding

    def _prepare_directory(self, directory: Path) -> None:
        if directory.is_dir():
            st = directory.stat()
            if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
                _log.warning(
                    "admin socket directory %s is world-writable: anyone can replace the socket",
                    directory,
                )
            group_can_enter = st.st_gid == self._group_gid and st.st_mode & stat.S_IXGRP
            if self._group_gid is not None and not (group_can_enter or st.st_mode & stat.S_IXOTH):
                _log.warning(
                    "admin socket directory %s is not searchable by group %s: "
                    "its members cannot reach the socket",
                    directory,
                    self.group,
                )
            return
        dir_mode = 0o750 if self._group_gid is not None else 0o700
        try:
            with _umask(0o077):
                directory.mkdir(parents=True, mode=dir_mode, exist_ok=True)
            if self._group_gid is not None:
                os.chown(directory, -1, self._group_gid)
            os.chmod(directory, dir_mode)
        except OSError as exc:
            raise AdminSocketError(
                f"cannot create admin socket directory {directory}: {exc}"
            ) from exc

    def _bind_private(self, temp: Path) -> socket.socket:
        """A listening socket at ``temp`` that already has its final owner and mode."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Born 0600 whatever the process umask, so not even the temporary
            # name is ever reachable by anyone else.
            with _umask(0o177):
                sock.bind(os.fspath(temp))
            # Listening before the final name exists: a concurrent starter that
            # probes the name sees a live server, never a "stale" one to delete.
            sock.listen(128)
            if self._group_gid is not None:
                # Group first, then mode: 0660 never applies to the wrong group.
                os.chown(temp, -1, self._group_gid)
            os.chmod(temp, self.mode)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise AdminSocketError(f"cannot bind admin socket {temp}: {exc}") from exc
        return sock

    async def _install(self, temp: Path, final: Path) -> None:
        """Give the prepared socket its final name.

        ``link`` rather than ``rename``: it fails if the name exists, so we can
        never silently replace a socket another daemon installed a moment ago.
        An existing socket is removed only when nothing answers on it.
        """
        for _ in range(3):
            try:
                os.link(temp, final)
                return
            except FileExistsError:
                pass
            except OSError as exc:
                raise AdminSocketError(f"cannot install admin socket {final}: {exc}") from exc
            try:
                st = os.lstat(final)
            except FileNotFoundError:
                continue
            if not stat.S_ISSOCK(st.st_mode):
                raise AdminSocketError(f"{final} exists and is not a socket; not replacing it")
            if await _is_live(final):
                raise SocketInUse(
                    f"another process is serving {final} (is a meshnode daemon already running?)"
                )
            with contextlib.suppress(FileNotFoundError):
                again = os.lstat(final)
                if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
                    continue  # replaced while we probed: look again
                try:
                    os.unlink(final)
                except OSError as exc:
                    raise AdminSocketError(f"cannot remove stale socket {final}: {exc}") from exc
                _log.info("removed stale admin socket %s", final)
        raise AdminSocketError(f"could not install admin socket {final}: it keeps reappearing")

    def _unlink_own_socket(self) -> None:
        if self._socket_id is None:
            return
        try:
            st = os.lstat(self.path)
            # Only our inode: if another daemon took the path over, leave it.
            if (st.st_dev, st.st_ino) == self._socket_id:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.warning("cannot remove admin socket %s: %s", self.path, exc)
        self._socket_id = None

    # ----------------------------------------------------------------- connections

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        conn = _Connection(reader, writer, task, self._max_line)
        self._connections.add(conn)
        try:
            if not self._closing:
                await self._serve(conn)
        except _PeerGone:
            pass
        except asyncio.CancelledError:
            if not self._closing:
                raise
        except Exception:
            _log.exception("admin: connection handler failed")
        finally:
            self._connections.discard(conn)
            writer.close()
            with contextlib.suppress(Exception):
                await wait_for(writer.wait_closed(), _FAREWELL_TIMEOUT)

    async def _serve(self, conn: _Connection) -> None:
        try:
            peer = self._peer_credentials(conn.writer.get_extra_info("socket"))
        except OSError as exc:
            _log.warning("admin: cannot read peer credentials, refusing: %s", exc)
            await conn.send(error_reply(None, PermissionDenied("cannot identify peer")))
            return
        level = await self._authorize(peer)
        if level is None:
            _log.warning(
                "admin: refused connection from uid=%d gid=%d pid=%d", peer.uid, peer.gid, peer.pid
            )
            await conn.send(
                error_reply(
                    None,
                    PermissionDenied(
                        "not allowed to use the meshnode admin API"
                        + (f" (join group {self.group!r})" if self.group else ""),
                        {"uid": peer.uid},
                    ),
                )
            )
            return
        _log.debug("admin: connection from uid=%d pid=%d as %s", peer.uid, peer.pid, level.label)
        reader_task = asyncio.create_task(self._read_lines(conn), name="admin:reader")
        try:
            while not self._closing:
                item = await conn.lines.get()
                if item is _EOF:
                    return
                if item is _OVERSIZE:
                    await conn.send(
                        error_reply(
                            None,
                            InvalidRequest(
                                f"request line longer than {self._max_line} bytes",
                                {"max_line_bytes": self._max_line},
                            ),
                        )
                    )
                    return
                assert isinstance(item, bytes)
                await self._handle_line(conn, peer, level, item)
        finally:
            reader_task.cancel()

    async def _read_lines(self, conn: _Connection) -> None:
        try:
            while True:
                try:
                    line = await conn.reader.readuntil(b"\n")
                except asyncio.IncompleteReadError as exc:
                    # EOF. A last line without its newline is still accepted
                    # (printf '{...}' | socat ...).
                    if exc.partial.strip():
                        await conn.lines.put(exc.partial)
                    break
                except asyncio.LimitOverrunError:
                    await conn.lines.put(_OVERSIZE)
                    return
                except (ConnectionError, OSError):
                    break
                if line.strip():
                    await conn.lines.put(line)
            await conn.lines.put(_EOF)
        finally:
            conn.eof.set()

    async def _authorize(self, peer: PeerCredentials) -> Level | None:
        if peer.uid in (0, self._daemon_uid):
            return Level.ADMIN
        if self._group_gid is None:
            return None
        if self._group_gid in peer.groups:
            return Level.OPERATOR
        member = await asyncio.to_thread(peer_in_group, peer.uid, peer.gid, self._group_gid)
        return Level.OPERATOR if member else None

    async def _handle_line(
        self, conn: _Connection, peer: PeerCredentials, level: Level, line: bytes
    ) -> None:
        try:
            request = parse_request(decode(line))
        except InvalidRequest as exc:
            await conn.send(error_reply(exc.request_id, exc))
            return
        method = self.methods.get(request.method)
        if method is None:
            error: AdminError = MethodNotFound(
                f"no method {request.method!r}", {"method": request.method}
            )
        elif level < method.level:
            error = PermissionDenied(
                f"{method.name} needs {method.level.label} access; this connection has {level.label}",
                {"method": method.name, "required": method.level.label, "level": level.label},
            )
        elif method.streaming and not request.more:
            error = InvalidRequest(
                f'{method.name} streams replies: send the request with "more": true',
                {"method": method.name},
            )
        else:
            await self._run_call(conn, peer, level, request, method)
            return
        await conn.send(error_reply(request.id, error))

    async def _run_call(
        self,
        conn: _Connection,
        peer: PeerCredentials,
        level: Level,
        request: Request,
        method: Method,
    ) -> None:
        async def send_continue(result: Any) -> None:
            await conn.send(result_reply(request.id, result, continues=True))

        call = CallContext(
            peer=peer,
            level=level,
            method=method.name,
            request_id=request.id,
            sender=send_continue if request.more else None,
        )
        call_task = asyncio.create_task(
            self._invoke(conn, request, method, call), name=f"admin:{method.name}"
        )
        conn.call, conn.streaming = call_task, method.streaming
        try:
            if not method.streaming:
                # A state-changing call runs to completion even if the client
                # hangs up: half-applied admin actions are worse than a lost reply.
                await call_task
                return
            # A follow-style call may never end by itself: stop it when the
            # client hangs up (or half-closes) instead of on the next write.
            eof_wait = asyncio.create_task(conn.eof.wait())
            try:
                await asyncio.wait({call_task, eof_wait}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                eof_wait.cancel()
            if not call_task.done():
                call_task.cancel()
                await asyncio.wait({call_task})
                raise _PeerGone
            if call_task.cancelled():
                if self._closing:
                    await wait_for(
                        conn.send(error_reply(request.id, NotReady("the daemon is shutting down"))),
                        _FAREWELL_TIMEOUT,
                    )
                raise _PeerGone
            call_task.result()
        finally:
            conn.call, conn.streaming = None, False
            if not call_task.done():
                call_task.cancel()

    async def _invoke(
        self, conn: _Connection, request: Request, method: Method, call: CallContext
    ) -> None:
        """Run one call and write its final reply (or error)."""
        try:
            outcome = method.fn(request.params, call)
            if isinstance(outcome, AsyncIterator):
                try:
                    async for item in outcome:
                        await call.send(item)
                finally:
                    # Run the generator's cleanup now (cancelled or client gone),
                    # not whenever it is garbage-collected.
                    aclose = getattr(outcome, "aclose", None)
                    if aclose is not None:
                        await aclose()
                final: Any = None
            else:
                final = await outcome
            await conn.send(result_reply(request.id, final))
        except _PeerGone:
            raise
        except AdminError as exc:
            await conn.send(error_reply(request.id, exc))
        except ProtocolError as exc:
            await conn.send(error_reply(request.id, Refused.from_protocol_error(exc)))
        except CanonicalJSONError as exc:
            # A parameter the method forwards into a signed envelope holds a value
            # with no canonical form (an integer beyond ±(2^53-1)): the caller's
            # to fix, not a daemon bug (was an Internal error).
            await conn.send(
                error_reply(
                    request.id,
                    InvalidParameter(
                        f"a parameter cannot be carried in a signed message: {exc}", {"path": exc.path}
                    ),
                )
            )
        except Exception:
            # The traceback stays here; the client gets a handle to find it.
            incident = secrets.token_hex(4)
            _log.exception(
                "admin: %s failed (incident %s, uid=%d pid=%d)",
                method.name,
                incident,
                call.uid,
                call.pid,
            )
            await conn.send(
                error_reply(
                    request.id,
                    InternalError(
                        f"internal error in {method.name} (see the daemon log, incident {incident})",
                        {"incident": incident},
                    ),
                )
            )

    # ----------------------------------------------------------------- built-ins

    async def _get_info(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        extra = dict(self._info()) if self._info is not None else {}
        return {
            **extra,
            "product": PRODUCT,
            "version": __version__,
            "api_version": API_VERSION,
            "features": self.methods.names(),
            "level": call.level.label,
        }


async def _is_live(path: Path) -> bool:
    """Whether something accepts connections on the socket at ``path``."""
    try:
        _, writer = await wait_for(asyncio.open_unix_connection(os.fspath(path)), 2.0)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except TimeoutError:
        return True  # bound and listening, merely slow or with a full backlog
    except OSError as exc:
        raise AdminSocketError(f"cannot tell whether {path} is in use: {exc}") from exc
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return True
