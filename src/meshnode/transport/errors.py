"""The transport's error taxonomy: what callers above transport/ catch instead of nats'.

Every call the JetStream facade and the connection make into nats-py runs under
:func:`translated`, which re-raises nats-py's exceptions as one of these
(``raise ... from`` the original, so the cause stays in tracebacks). The split
is by what a caller does about it, not by nats-py's class tree:

* :class:`NotFound` — no such stream, consumer, message or key (a deleted key
  counts as absent);
* :class:`Conflict` — an optimistic write lost: wrong last sequence on a
  revision-checked KV write, a key or stream that already exists;
* :class:`TransportTimeout` — no answer in time (also a :class:`TimeoutError`,
  so ``except TimeoutError`` keeps working);
* :class:`NoResponders` — nobody listens on the subject (or no stream stores it);
* :class:`StoreFull` — account limits, insufficient resources, storage exceeded;
* :class:`Unavailable` — JetStream answered 503 (no leader yet, recovering);
* :class:`PermissionDenied` — the credential does not allow it;
* :class:`NotConnected` — the client is reconnecting or closed;
* :class:`TransportError` — anything else the broker refused.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import nats.errors
import nats.js.errors

__all__ = [
    "Conflict",
    "ConsumerLimit",
    "EmbeddedMeshError",
    "NoResponders",
    "NotConnected",
    "NotFound",
    "PermissionDenied",
    "PortInUse",
    "Reconnecting",
    "StoreFull",
    "TransportError",
    "TransportTimeout",
    "Unavailable",
    "translate",
    "translated",
]

# JetStream API error codes (nats-server's errors.json) that mean "no room left":
# account resources exceeded, insufficient resources, storage resources exceeded,
# message too large for the stream, store failed (a full disk, a discard-new
# stream at its max_bytes or max_msgs).
_STORE_FULL_CODES = frozenset({10002, 10023, 10047, 10054, 10077})
_ALREADY_IN_USE = 10058  # stream name already in use with a different configuration
_WRONG_LAST_SEQUENCE = 10071
_CONSUMER_LIMIT = 10026  # "maximum consumers limit reached" (the stream's max_consumers)


class EmbeddedMeshError(RuntimeError):
    """The embedded broker could not be found, configured, started or kept running."""


class PortInUse(EmbeddedMeshError):
    """A port the embedded broker (or its control plane) was told to listen on is
    taken. ``listener`` says which: ``client``, ``monitoring``, ``cluster`` or
    ``control``; the owner adds which setting moves it (it knows its config)."""

    def __init__(self, port: int, listener: str, hint: str = "") -> None:
        self.port = port
        self.listener = listener
        self.hint = hint
        who = {"client": "another nats-server?", "cluster": "another nats-server?",
               "monitoring": "another nats-server?", "control": "another meshnode?"}.get(listener, "")
        super().__init__(f"port {port} in use: {who}" + (f" {hint}" if hint else ""))

    def with_hint(self, hint: str) -> PortInUse:
        return PortInUse(self.port, self.listener, hint)


class TransportError(Exception):
    """The broker refused or failed a call. ``code`` is the JetStream API status
    (404, 503, ...), ``err_code`` its finer error code, when the broker gave them."""

    def __init__(self, message: str, *, code: int | None = None, err_code: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.err_code = err_code

    @property
    def description(self) -> str:
        return str(self)


class NotFound(TransportError):
    """No such stream, consumer, message or key."""

    #: For a deleted KV key: its delete marker (a ``KvEntry``), else None.
    entry: Any = None


class Conflict(TransportError):
    """An optimistic write lost the race (wrong last sequence, already exists)."""


class TransportTimeout(TransportError, TimeoutError):
    """No answer within the timeout."""


class NoResponders(TransportError):
    """Nobody answers on the subject (no subscriber, or no stream stores it)."""


class StoreFull(TransportError):
    """The store has no room left (account limits, insufficient resources, full disk)."""


class ConsumerLimit(TransportError):
    """The stream holds as many consumers as its ``max_consumers`` allows."""


class Unavailable(TransportError):
    """JetStream is temporarily unavailable (503: no leader yet, recovering)."""


class PermissionDenied(TransportError):
    """The credential does not permit the call."""


class NotConnected(TransportError):
    """The connection is reconnecting or closed."""


class Reconnecting(NotConnected):
    """The client is between servers; a retry after the reconnect may succeed."""


def translate(exc: BaseException) -> TransportError:
    """The transport error for a nats-py exception (a generic one for anything else)."""
    if isinstance(exc, TransportError):
        return exc
    message = str(exc) or type(exc).__name__
    if isinstance(exc, nats.js.errors.APIError):
        # nats-py raises some of these (KeyNotFoundError, ...) without calling
        # APIError.__init__, so the attributes may be missing.
        code = getattr(exc, "code", None)
        err_code = getattr(exc, "err_code", None)
        message = getattr(exc, "description", None) or message
        kind: type[TransportError] = TransportError
        if isinstance(exc, nats.js.errors.NotFoundError) or code == 404:
            kind = NotFound
        elif isinstance(exc, nats.js.errors.KeyWrongLastSequenceError) or err_code in (
            _WRONG_LAST_SEQUENCE,
            _ALREADY_IN_USE,
        ):
            kind = Conflict
        elif err_code in _STORE_FULL_CODES:
            kind = StoreFull
        elif err_code == _CONSUMER_LIMIT:
            kind = ConsumerLimit
        elif isinstance(exc, nats.js.errors.ServiceUnavailableError) or code == 503:
            kind = Unavailable
        elif code == 403:
            kind = PermissionDenied
        return kind(message, code=code, err_code=err_code)
    if isinstance(exc, nats.errors.TimeoutError):
        return TransportTimeout(message)
    if isinstance(exc, nats.errors.NoRespondersError | nats.js.errors.NoStreamResponseError):
        return NoResponders(message)
    if isinstance(exc, nats.errors.ConnectionReconnectingError):
        return Reconnecting(message)
    if isinstance(
        exc,
        nats.errors.ConnectionClosedError
        | nats.errors.ConnectionDrainingError
        | nats.errors.NoServersError
        | nats.errors.OutboundBufferLimitError,
    ):
        return NotConnected(message)
    if "permissions violation" in message.lower():
        return PermissionDenied(message)
    return TransportError(message)


class translated:  # noqa: N801 - used as a function (``with translated():``)
    """Re-raise nats-py's exceptions raised inside the block as transport errors.

    A class rather than a generator context manager: it wraps every publish
    and every JetStream call (several per message), and ``contextlib``'s
    machinery cost five times as much (0.94 against 0.19 µs).
    """

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:  # never swallows: anything else propagates as it is
        if isinstance(exc, nats.errors.Error):
            raise translate(exc) from exc
