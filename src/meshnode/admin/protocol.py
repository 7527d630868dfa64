"""The meshnode admin protocol (API version 1).

The daemon serves its admin API on a Unix stream socket (by default under the
runtime directory, e.g. ``/run/meshnode/admin.sock``). The protocol is a small,
varlink-flavoured JSON line protocol; any tool that can write a line to a Unix
socket can speak it (``socat - UNIX-CONNECT:/run/meshnode/admin.sock``).

Framing
-------
* Every message is one JSON object encoded as UTF-8 on a single line,
  terminated by ``\\n``. Messages never contain a raw newline (JSON escapes it).
* A line may hold at most 1 MiB (1,048,576 bytes, not counting the ``\\n``).
  The server answers a longer line with an ``InvalidRequest`` error (``"id":
  null``, ``params.max_line_bytes``) and closes the connection. Replies obey
  the same limit; a result that would not fit becomes an ``Internal`` error.
* A connection carries any number of requests. The server handles them one at
  a time, in order, and replies in the same order; a client may pipeline.
  Slow calls on one connection never delay other connections.

Request
-------
``{"id": <string|integer>, "method": "<Name>", "params": {...}, "more": true}``

* ``id`` (required): chosen by the client, echoed in every reply to this call.
* ``method`` (required): ``GetInfo``, or a name such as ``ListAgents``; plugin
  methods are namespaced with dots (``Chat.Send``).
* ``params`` (optional, default ``{}``): an object; its shape is per method.
* ``more`` (optional, default ``false``): the client accepts several replies.
  Required for streaming (follow-style) methods; calling one without it is an
  ``InvalidRequest``.

Reply
-----
``{"id": ..., "result": <any JSON>}`` or
``{"id": ..., "error": {"name": "<StableName>", "message": "...", "params": {...}}}``

* A streaming call sends ``{"id": ..., "result": ..., "continues": true}`` for
  every reply but the last; the last reply has no ``continues`` member. When a
  stream simply ends, its last reply is ``{"id": ..., "result": null}`` (the
  end-of-stream marker). An error reply always ends the call.
* ``error.name`` is the contract; ``error.message`` is human text and may change
  between releases; ``error.params`` carries structured detail (always an
  object, possibly empty).
* An error that cannot be tied to a request carries ``"id": null``. Two of
  them end the connection (the server closes it right after): a refused peer
  and an oversized line. A line that is not a valid request gets an
  ``InvalidRequest`` reply (echoing the ``id`` when one could be read) and the
  connection stays open.
* To stop a streaming call, close the connection (shutting down the sending
  side is enough); the server ends the call at once. A non-streaming call
  always runs to completion, even if its client has gone: an admin action is
  never left half-applied because a terminal closed.
* When the daemon shuts down, idle connections are closed, a streaming call
  ends with a ``NotReady`` error, and other calls get a few seconds to finish.

Stable error names
------------------
=================  ==========================================================
MethodNotFound     No such method. ``params.method``.
InvalidParameter   ``params`` is malformed for this method. ``params.parameter``
                   names the offending member when known.
PermissionDenied   The peer may not connect (``id: null``, connection closed)
                   or may not call this method (``params.required``,
                   ``params.level``).
InvalidRequest     The line is not a valid request (bad JSON, missing ``id`` or
                   ``method``, streaming method without ``more``, too long).
NotReady           The daemon cannot do this yet or any more (starting,
                   shutting down). Retry later.
Internal           A bug in the daemon. The message is generic;
                   ``params.incident`` matches a traceback in the daemon log.
NotFound           The thing named in ``params`` does not exist.
Conflict           The request contradicts the current state (already
                   running, name taken).
Refused            The mesh protocol refused the operation; ``params`` is the
                   AgentMesh §12 error object (``code``, ``message``,
                   ``retryable``, optional ``details``, ``retry_after_ms``).
=================  ==========================================================

Access levels
-------------
Each connection is authorised once, from the peer's kernel credentials
(``SO_PEERCRED``), into a level; each method declares the minimum level it
needs. Levels are ordered ``read < operator < admin``:

* ``admin``: uid 0, or the uid the daemon runs as.
* ``operator``: a member (primary or supplementary) of the configured admin
  group. Operators can call every ``read`` method too.
* anyone else is refused: a ``PermissionDenied`` reply with ``"id": null``,
  then the connection closes.

First call
----------
A client should call ``GetInfo`` first and stop if ``api_version`` is not the
one it speaks. ``GetInfo`` (level ``read``, no params) returns::

    {"product": "meshnode", "version": "0.1.0", "api_version": "1",
     "features": ["GetInfo", ...],   # every method the daemon serves
     "level": "admin",               # this connection's access level
     ...}                            # further daemon facts (node id, ...)
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from meshnode.protocol.errors import ProtocolError

__all__ = [
    "API_VERSION",
    "CONFLICT",
    "ERROR_NAMES",
    "INTERNAL",
    "INVALID_PARAMETER",
    "INVALID_REQUEST",
    "MAX_LINE_BYTES",
    "METHOD_NOT_FOUND",
    "NOT_FOUND",
    "NOT_READY",
    "PERMISSION_DENIED",
    "PRODUCT",
    "REFUSED",
    "AdminError",
    "Conflict",
    "InternalError",
    "InvalidParameter",
    "InvalidRequest",
    "Level",
    "MethodNotFound",
    "NotFound",
    "NotReady",
    "PermissionDenied",
    "Refused",
    "Reply",
    "Request",
    "RequestId",
    "decode",
    "encode",
    "error_reply",
    "is_valid_method_name",
    "parse_reply",
    "parse_request",
    "request_message",
    "result_reply",
]

#: The admin API version. Bumped only on an incompatible change; adding
#: methods, optional params or result members is compatible.
API_VERSION = "1"
#: ``GetInfo.product``: lets a client tell our socket from someone else's.
PRODUCT = "meshnode"
#: Largest line (without its ``\n``) either side accepts.
MAX_LINE_BYTES = 1024 * 1024

METHOD_NOT_FOUND = "MethodNotFound"
INVALID_PARAMETER = "InvalidParameter"
PERMISSION_DENIED = "PermissionDenied"
INVALID_REQUEST = "InvalidRequest"
NOT_READY = "NotReady"
INTERNAL = "Internal"
NOT_FOUND = "NotFound"
CONFLICT = "Conflict"
REFUSED = "Refused"

#: Every stable error name of API version 1.
ERROR_NAMES: frozenset[str] = frozenset(
    {
        METHOD_NOT_FOUND,
        INVALID_PARAMETER,
        PERMISSION_DENIED,
        INVALID_REQUEST,
        NOT_READY,
        INTERNAL,
        NOT_FOUND,
        CONFLICT,
        REFUSED,
    }
)

RequestId = str | int

_METHOD_NAME = re.compile(r"[A-Z][A-Za-z0-9]*(?:\.[A-Z][A-Za-z0-9]*)*")


def is_valid_method_name(name: str) -> bool:
    """``GetInfo``, ``Chat.Send``: CamelCase segments joined by dots."""
    return _METHOD_NAME.fullmatch(name) is not None


class Level(enum.IntEnum):
    """Access levels, ordered: a higher level may call every lower-level method."""

    READ = 1
    OPERATOR = 2
    ADMIN = 3

    @property
    def label(self) -> str:
        """The wire spelling: ``read``, ``operator``, ``admin``."""
        return self.name.lower()

    @classmethod
    def parse(cls, value: Level | str) -> Level:
        """Accept a :class:`Level` or its wire spelling; raise ``ValueError`` otherwise."""
        if isinstance(value, Level):
            return value
        try:
            return cls[value.upper()]
        except KeyError:
            raise ValueError(f"unknown access level {value!r} (read, operator, admin)") from None


# --------------------------------------------------------------------------- errors


class AdminError(Exception):
    """An error reply: a stable ``name``, human ``message`` and structured ``params``.

    Method implementations raise it (or a subclass) to send that error; the
    client raises it when the daemon answers with an error. Subclasses exist
    for every stable name, so callers can ``except NotFound``.
    """

    def __init__(
        self, name: str, message: str = "", params: Mapping[str, Any] | None = None
    ) -> None:
        self.name = name
        self.message = message or name
        self.params: dict[str, Any] = dict(params or {})
        super().__init__(f"{self.name}: {self.message}")

    @property
    def retryable(self) -> bool:
        """Whether the same call may succeed later without any change by the caller."""
        if self.name == NOT_READY:
            return True
        return self.name == REFUSED and self.params.get("retryable") is True

    def to_wire(self) -> dict[str, Any]:
        """The ``error`` member of a reply."""
        return {"name": self.name, "message": self.message, "params": self.params}

    @classmethod
    def from_wire(cls, error: Mapping[str, Any]) -> AdminError:
        """Rebuild the most specific exception for a reply's ``error`` member."""
        name = str(error.get("name", INTERNAL))
        message = str(error.get("message", ""))
        raw_params = error.get("params")
        params = raw_params if isinstance(raw_params, Mapping) else {}
        specific = _BY_NAME.get(name)
        if specific is not None:
            return specific(message, params)
        return AdminError(name, message, params)


class _NamedError(AdminError):
    error_name: ClassVar[str]

    def __init__(self, message: str = "", params: Mapping[str, Any] | None = None) -> None:
        super().__init__(self.error_name, message, params)


class MethodNotFound(_NamedError):
    """No such method (``params.method``)."""

    error_name = METHOD_NOT_FOUND


class InvalidParameter(_NamedError):
    """``params`` is malformed for the method (``params.parameter`` when known)."""

    error_name = INVALID_PARAMETER


class PermissionDenied(_NamedError):
    """The peer may not connect, or may not call this method."""

    error_name = PERMISSION_DENIED


class InvalidRequest(_NamedError):
    """The line is not a valid request.

    ``request_id`` is the id read from the line, if any, so the reply can echo it.
    """

    error_name = INVALID_REQUEST

    def __init__(
        self,
        message: str = "",
        params: Mapping[str, Any] | None = None,
        *,
        request_id: RequestId | None = None,
    ) -> None:
        super().__init__(message, params)
        self.request_id = request_id


class NotReady(_NamedError):
    """Not possible yet / any more (starting, shutting down): retry later."""

    error_name = NOT_READY


class InternalError(_NamedError):
    """A daemon bug; ``params.incident`` points at the traceback in the daemon log."""

    error_name = INTERNAL


class NotFound(_NamedError):
    """The named thing does not exist."""

    error_name = NOT_FOUND


class Conflict(_NamedError):
    """The request contradicts the current state."""

    error_name = CONFLICT


class Refused(_NamedError):
    """The mesh protocol refused; ``params`` is the §12 error object."""

    error_name = REFUSED

    @classmethod
    def from_protocol_error(cls, exc: ProtocolError) -> Refused:
        return cls(exc.message, exc.to_object())

    @property
    def code(self) -> str | None:
        """The §12 code (``AGENT_UNAVAILABLE``, ...), if the daemon sent one."""
        code = self.params.get("code")
        return code if isinstance(code, str) else None


_BY_NAME: dict[str, type[_NamedError]] = {
    cls.error_name: cls
    for cls in (
        MethodNotFound,
        InvalidParameter,
        PermissionDenied,
        InvalidRequest,
        NotReady,
        InternalError,
        NotFound,
        Conflict,
        Refused,
    )
}


# --------------------------------------------------------------------------- messages


def encode(message: Mapping[str, Any]) -> bytes:
    """One message as a ``\\n``-terminated line. Raises ``TypeError`` if not JSON-able."""
    return orjson.dumps(message) + b"\n"


def decode(line: bytes) -> Any:
    """Parse one line (with or without its ``\\n``). Raises :class:`InvalidRequest`."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"not a JSON line: {exc}") from None


def _is_request_id(value: object) -> bool:
    # bool is an int subclass, but true/false as an id is a client bug.
    return isinstance(value, str | int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class Request:
    """A parsed request line."""

    id: RequestId
    method: str
    params: dict[str, Any]
    more: bool = False


def parse_request(message: Any) -> Request:
    """Validate a decoded request. Raises :class:`InvalidRequest`."""
    if not isinstance(message, dict):
        raise InvalidRequest("a request must be a JSON object")
    request_id = message.get("id")
    if not _is_request_id(request_id):
        raise InvalidRequest('a request needs an "id" (string or integer)')
    assert isinstance(request_id, str | int)
    method = message.get("method")
    if not isinstance(method, str) or not method:
        raise InvalidRequest('a request needs a "method" (string)', request_id=request_id)
    params = message.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise InvalidRequest('"params" must be an object', request_id=request_id)
    more = message.get("more", False)
    if not isinstance(more, bool):
        raise InvalidRequest('"more" must be a boolean', request_id=request_id)
    return Request(id=request_id, method=method, params=params, more=more)


def request_message(
    request_id: RequestId,
    method: str,
    params: Mapping[str, Any] | None = None,
    *,
    more: bool = False,
) -> dict[str, Any]:
    """A request object (``more`` is only written when true)."""
    message: dict[str, Any] = {"id": request_id, "method": method, "params": dict(params or {})}
    if more:
        message["more"] = True
    return message


def result_reply(request_id: RequestId, result: Any, *, continues: bool = False) -> dict[str, Any]:
    """A result reply; ``continues`` is only written when true."""
    reply: dict[str, Any] = {"id": request_id, "result": result}
    if continues:
        reply["continues"] = True
    return reply


def error_reply(request_id: RequestId | None, error: AdminError) -> dict[str, Any]:
    """An error reply (``request_id`` is ``None`` for connection-level errors)."""
    return {"id": request_id, "error": error.to_wire()}


@dataclass(frozen=True, slots=True)
class Reply:
    """A parsed reply line."""

    id: RequestId | None
    result: Any = None
    error: AdminError | None = None
    continues: bool = False


def parse_reply(message: Any) -> Reply:
    """Validate a decoded reply. Raises ``ValueError`` if it is not one."""
    if not isinstance(message, dict):
        raise ValueError("a reply must be a JSON object")
    reply_id = message.get("id")
    if reply_id is not None and not _is_request_id(reply_id):
        raise ValueError('reply "id" must be a string, an integer or null')
    continues = message.get("continues", False)
    if not isinstance(continues, bool):
        raise ValueError('reply "continues" must be a boolean')
    if "error" in message:
        error = message["error"]
        if not isinstance(error, dict) or not isinstance(error.get("name"), str):
            raise ValueError('reply "error" must be an object with a "name"')
        return Reply(id=reply_id, error=AdminError.from_wire(error))
    if "result" not in message:
        raise ValueError('a reply needs "result" or "error"')
    return Reply(id=reply_id, result=message["result"], continues=continues)
