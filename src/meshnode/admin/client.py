"""The admin client: what the ``meshnode`` CLI uses to talk to the daemon.

::

    async with AdminClient("/run/meshnode/admin.sock") as client:
        agents = await client.call("ListAgents")
        async for line in client.stream("FollowLog", {"agent": "echo"}):
            print(line)

    result = call_sync(path, "GetInfo")          # from synchronous code

Connecting calls ``GetInfo`` first and refuses a daemon that speaks another
API version. Failures are typed so the CLI can tell them apart (and
:func:`exit_code_for` turns each into its exit code):

* :class:`DaemonNotRunning`: no socket, or nothing listening on it.
* :class:`~.protocol.PermissionDenied`: cannot open the socket, or the daemon
  refused this user or this call.
* :class:`ApiMismatch`: the daemon speaks another API version (or is not
  meshnode).
* :class:`~.protocol.AdminError` (and its subclasses ``NotFound``, ``Conflict``,
  ``Refused``, ...): the daemon answered the call with an error.
* :class:`AdminConnectionError`, :class:`AdminTimeout`,
  :class:`ProtocolViolation`: the connection broke, the daemon did not answer
  in time, or it answered with something that is not the protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import orjson

from .exitcodes import (
    EX_API_MISMATCH,
    EX_CHECK_FAILED,
    EX_DATAERR,
    EX_ERROR,
    EX_NOPERM,
    EX_NOT_RUNNING,
    EX_TEMPFAIL,
    EX_USAGE,
)
from .protocol import (
    API_VERSION,
    CONFLICT,
    INTERNAL,
    INVALID_PARAMETER,
    INVALID_REQUEST,
    MAX_LINE_BYTES,
    METHOD_NOT_FOUND,
    NOT_FOUND,
    PRODUCT,
    REFUSED,
    AdminError,
    MethodNotFound,
    NotReady,
    PermissionDenied,
    Reply,
    encode,
    parse_reply,
    request_message,
)

__all__ = [
    "AdminClient",
    "AdminClientError",
    "AdminConnectionError",
    "AdminTimeout",
    "ApiMismatch",
    "DaemonNotRunning",
    "ProtocolViolation",
    "RequestTooLarge",
    "call_listing",
    "call_sync",
    "exit_code_for",
    "merge_pages",
]


class AdminClientError(Exception):
    """A failure on the client side of the admin API (not an error reply)."""


class AdminConnectionError(AdminClientError):
    """Could not connect to the daemon, or it closed the connection mid-call."""


class DaemonNotRunning(AdminConnectionError):
    """No daemon: the socket does not exist, or nothing is listening on it."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        super().__init__(f"meshnode is not running (nothing serves {socket_path})")


class ApiMismatch(AdminClientError):
    """The daemon speaks another admin API version (``info`` is its ``GetInfo``)."""

    def __init__(self, info: Mapping[str, Any]) -> None:
        self.info = dict(info)
        self.api_version = info.get("api_version")
        super().__init__(
            f"the daemon at the socket is {info.get('product')!s} {info.get('version')!s} "
            f"with admin API {self.api_version!s}; this client speaks {PRODUCT} admin API "
            f"{API_VERSION}"
        )


class ProtocolViolation(AdminClientError):
    """The daemon sent something that is not a valid reply."""


class AdminTimeout(AdminClientError, TimeoutError):
    """The daemon did not answer in time."""


class RequestTooLarge(AdminClientError, ValueError):
    """A request longer than the admin protocol's line: said before anything is sent."""

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(
            f"the request is {size:,} bytes, over the admin protocol's {limit:,}-byte line; an input "
            "this large could not reach an agent either (one message is at most the mesh's max_payload, "
            "1 MiB by default): store it as an artifact (meshnode artifacts put FILE) and send its reference"
        )


class AdminClient:
    """One connection to the daemon's admin socket.

    Calls on one client are serialised (the server answers in order anyway);
    use several clients for concurrent calls. ``timeout`` bounds connecting
    and each non-streaming call; ``None`` waits forever. After a timeout,
    a broken connection or an abandoned stream, the next call reconnects.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        timeout: float | None = 30.0,
        max_line: int = MAX_LINE_BYTES,
    ) -> None:
        self.socket_path = os.fspath(socket_path)
        self.timeout = timeout
        #: The daemon's ``GetInfo`` result, once connected.
        self.info: dict[str, Any] | None = None
        self._max_line = max_line
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._next_id = 0
        self._lock = asyncio.Lock()

    # ----------------------------------------------------------------- connection

    async def connect(self) -> dict[str, Any]:
        """Connect (if not connected) and return the daemon's ``GetInfo``."""
        async with self._lock:
            return await self._ensure_connected()

    async def close(self) -> None:
        writer = self._writer
        self._abort()
        if writer is not None:
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def __aenter__(self) -> AdminClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _abort(self) -> None:
        # The connection's state is unknown (a reply may still be in flight):
        # drop it rather than risk reading another call's reply.
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
        self.info = None

    async def _ensure_connected(self) -> dict[str, Any]:
        if self._writer is not None and self.info is not None:
            return self.info
        try:
            async with asyncio.timeout(self.timeout):
                reader, writer = await self._open()
                self._reader, self._writer = reader, writer
                try:
                    info = await self._roundtrip("GetInfo", {})
                except MethodNotFound:
                    raise ApiMismatch({"product": "unknown", "api_version": None}) from None
        except TimeoutError:
            self._abort()
            raise AdminTimeout(f"the daemon at {self.socket_path} did not answer") from None
        except BaseException:
            self._abort()
            raise
        if not isinstance(info, dict):
            self._abort()
            raise ProtocolViolation("GetInfo did not return an object")
        if info.get("product") != PRODUCT or info.get("api_version") != API_VERSION:
            self._abort()
            raise ApiMismatch(info)
        self.info = info
        return info

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.open_unix_connection(self.socket_path, limit=self._max_line)
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError) as exc:
            raise DaemonNotRunning(self.socket_path) from exc
        except PermissionError as exc:
            raise PermissionDenied(
                f"no permission to open {self.socket_path} (is your user in the admin group?)",
                {"socket": self.socket_path},
            ) from exc
        except OSError as exc:
            raise AdminConnectionError(f"cannot connect to {self.socket_path}: {exc}") from exc

    # ----------------------------------------------------------------- calls

    async def call(self, method: str, params: Mapping[str, Any] | None = None) -> Any:
        """Call ``method`` and return its result; raise its error as :class:`AdminError`."""
        async with self._lock:
            await self._ensure_connected()
            try:
                async with asyncio.timeout(self.timeout):
                    return await self._roundtrip(method, params)
            except AdminError:
                raise  # a complete error reply: the connection is still in step
            except TimeoutError:
                self._abort()
                raise AdminTimeout(f"{method}: the daemon did not answer in time") from None
            except BaseException:
                self._abort()
                raise

    async def stream(
        self, method: str, params: Mapping[str, Any] | None = None
    ) -> AsyncGenerator[Any, None]:
        """Call a streaming method; yield each result as it arrives.

        The final ``null`` end-of-stream marker is not yielded. No timeout
        applies between items (a follow call may be idle for long). Stopping
        early (``break``) closes the connection, since the daemon would keep
        streaming into it; the client reconnects on its next call.
        """
        async with self._lock:
            await self._ensure_connected()
            assert self._writer is not None
            request_id = self._take_id()
            finished = False
            try:
                await self._send(request_message(request_id, method, params, more=True))
                while True:
                    reply = await self._read_reply(request_id)
                    if reply.error is not None:
                        finished = True
                        raise reply.error
                    if reply.continues:
                        yield reply.result
                        continue
                    finished = True
                    if reply.result is not None:
                        yield reply.result
                    return
            finally:
                if not finished:
                    self._abort()

    # ----------------------------------------------------------------- wire

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id

    async def _roundtrip(self, method: str, params: Mapping[str, Any] | None) -> Any:
        request_id = self._take_id()
        await self._send(request_message(request_id, method, params))
        reply = await self._read_reply(request_id)
        if reply.error is not None:
            raise reply.error
        if reply.continues:
            raise ProtocolViolation(
                f"{method}: several replies to a call that did not ask for more"
            )
        return reply.result

    async def _send(self, message: Mapping[str, Any]) -> None:
        assert self._writer is not None
        data = encode(message)
        if len(data) > self._max_line + 1:
            raise RequestTooLarge(len(data) - 1, self._max_line)
        try:
            self._writer.write(data)
            await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            raise AdminConnectionError(f"lost the connection to the daemon: {exc}") from exc

    async def _read_reply(self, request_id: int) -> Reply:
        assert self._reader is not None
        try:
            line = await self._reader.readuntil(b"\n")
        except asyncio.IncompleteReadError:
            raise AdminConnectionError("the daemon closed the connection") from None
        except asyncio.LimitOverrunError:
            raise ProtocolViolation(f"reply longer than {self._max_line} bytes") from None
        except (ConnectionError, OSError) as exc:
            raise AdminConnectionError(f"lost the connection to the daemon: {exc}") from exc
        try:
            reply = parse_reply(orjson.loads(line))
        except ValueError as exc:
            raise ProtocolViolation(f"not a valid admin reply: {exc}") from None
        if reply.id is None and reply.error is not None:
            # About the connection, not the call (refused peer, line too long);
            # the daemon closes the connection after it.
            self._abort()
            raise reply.error
        if reply.id != request_id:
            raise ProtocolViolation(f"reply for id {reply.id!r} while waiting for {request_id}")
        return reply


#: A listing whose roster changed between its pages is read again from the start, this many times in all.
LISTING_ATTEMPTS = 5


def merge_pages(pages: list[dict[str, Any]]) -> dict[str, Any]:
    """The first page with ``agents`` holding every page's entries (a list is
    joined, a mapping by name is merged)."""
    merged = dict(pages[0])
    agents = merged.get("agents")
    if isinstance(agents, list):
        merged["agents"] = [entry for page in pages for entry in page.get("agents") or []]
    elif isinstance(agents, dict):
        merged["agents"] = {name: entry for page in pages for name, entry in (page.get("agents") or {}).items()}
    merged["agents_next"] = None
    return merged


async def call_listing(
    client: AdminClient,
    method: str,
    params: Mapping[str, Any] | None = None,
    *,
    combine: Callable[[list[dict[str, Any]]], dict[str, Any]] = merge_pages,
) -> Any:
    """``method`` (``Status``, ``Agents.List``, ``Metrics``) with its whole agent list.

    The daemon answers an agent list in pages that fit a reply
    (:mod:`meshnode.daemon.paging`); this reads them all and returns
    ``combine(pages)`` (by default :func:`merge_pages`). A roster change
    between pages (``roster_version`` moved) starts over; after
    LISTING_ATTEMPTS changes in a row the last reading is returned with
    ``roster_changed: true`` (an agent may be missing from it, or listed twice).
    """
    base = dict(params or {})
    for attempt in range(1, LISTING_ATTEMPTS + 1):
        first = await client.call(method, base)
        if not isinstance(first, dict) or first.get("agents_next") is None:
            return first
        pages = [first]
        changed = False
        while (offset := pages[-1].get("agents_next")) is not None:
            page = await client.call(method, {**base, "agents_offset": offset})
            pages.append(page)
            if page.get("roster_version") != first.get("roster_version"):
                changed = True
                break
        if not changed or attempt == LISTING_ATTEMPTS:
            merged = combine(pages)
            if changed:
                merged["roster_changed"] = True
            return merged
    raise AssertionError("unreachable")  # pragma: no cover


def call_sync(
    socket_path: str | os.PathLike[str],
    method: str,
    params: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = 30.0,
    listing: bool = False,
    combine: Callable[[list[dict[str, Any]]], dict[str, Any]] = merge_pages,
) -> Any:
    """One call from synchronous code (the CLI): connect, check the API, call, close.

    ``listing``: the call answers an agent list in pages; read them all
    (:func:`call_listing`, with ``combine``). Must not be called from a
    running event loop.
    """

    size = len(encode(request_message(0, method, params))) - 1  # without its newline
    if size > MAX_LINE_BYTES:
        raise RequestTooLarge(size, MAX_LINE_BYTES)  # before connecting: nothing to ask the daemon

    async def run() -> Any:
        async with AdminClient(socket_path, timeout=timeout) as client:
            if listing:
                return await call_listing(client, method, params, combine=combine)
            return await client.call(method, params)

    return asyncio.run(run())


def exit_code_for(exc: BaseException) -> int:
    """The CLI exit code for an admin failure (see :mod:`meshnode.admin.exitcodes`)."""
    if isinstance(exc, AdminConnectionError):
        return EX_NOT_RUNNING
    if isinstance(exc, PermissionDenied):
        return EX_NOPERM
    if isinstance(exc, ApiMismatch | ProtocolViolation):
        return EX_API_MISMATCH
    if isinstance(exc, AdminTimeout | NotReady | TimeoutError):
        return EX_TEMPFAIL
    if isinstance(exc, RequestTooLarge):
        return EX_DATAERR
    if isinstance(exc, AdminError):
        return _EXIT_BY_ERROR_NAME.get(exc.name, EX_ERROR)
    return EX_ERROR


#: Admin error names and their exit codes (the table in :mod:`meshnode.admin.exitcodes`).
#: A name not listed (Internal, or a plugin's own) is an internal error, 70.
_EXIT_BY_ERROR_NAME: dict[str, int] = {
    INVALID_PARAMETER: EX_USAGE,
    INVALID_REQUEST: EX_USAGE,
    NOT_FOUND: EX_DATAERR,
    CONFLICT: EX_DATAERR,
    METHOD_NOT_FOUND: EX_API_MISMATCH,
    # The mesh said no (§12 error object in params): the same as a call answered failed.
    REFUSED: EX_CHECK_FAILED,
    INTERNAL: EX_ERROR,
}
