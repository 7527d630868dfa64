"""Transport-level message and subscription types, so nothing above transport/
handles nats-py's ``Msg`` or ``Subscription``.

A :class:`Message` is what a subscription handler, a request or a JetStream
fetch hands back: subject, payload, reply subject and headers, plus, for a
message delivered by a JetStream consumer, its stream sequence, its storage
time and the acknowledgements (which raise transport errors, never nats').
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription

from .errors import translated

__all__ = ["Message", "MessageHandler", "Subscription"]


#: Token counts of a JetStream ack subject: ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>...``
#: (9 tokens), or with domain and account hash after ``ACK`` (11, or 12 with a trailing token).
_ACK_V1_TOKENS = 9
_ACK_V2_TOKENS = 11


def _ack_token(msg: Msg, v1_index: int, v2_index: int) -> int | None:
    """A number token of a JetStream delivery's ack subject, or None when the
    reply subject is not shaped like one."""
    tokens = (msg.reply or "").split(".")
    if (len(tokens) == _ACK_V1_TOKENS or len(tokens) >= _ACK_V2_TOKENS) and tokens[0] == "$JS" and tokens[1] == "ACK":
        token = tokens[v1_index if len(tokens) == _ACK_V1_TOKENS else v2_index]
        if token.isdigit():
            return int(token)
    return None


def _stream_sequence(msg: Msg) -> int:
    """The stream sequence from a JetStream delivery's ack subject.

    Read straight from the one token, because the drain reads the sequence of
    every buffered copy it re-reads: nats-py's ``metadata`` parses all of the
    subject into a dataclass (a ``datetime`` included) at several µs a copy.
    Anything not shaped like an ack subject goes to nats-py, which says why.
    """
    seq = _ack_token(msg, 5, 7)
    return seq if seq is not None else int(msg.metadata.sequence.stream)


def _delivery_count(msg: Msg) -> int:
    """How many times the consumer has delivered this message, this time included
    (the ack subject's ``delivered`` token)."""
    count = _ack_token(msg, 4, 6)
    return count if count is not None else int(msg.metadata.num_delivered)


class Message:
    """One message off the mesh."""

    __slots__ = ("_msg", "_sequence")

    def __init__(self, msg: Msg) -> None:
        self._msg = msg
        self._sequence: int | None = None

    @property
    def subject(self) -> str:
        return str(self._msg.subject)

    @property
    def data(self) -> bytes:
        return bytes(self._msg.data)

    @property
    def reply(self) -> str:
        """The reply subject ("" when the sender wants no answer)."""
        return str(self._msg.reply or "")

    @property
    def headers(self) -> dict[str, str] | None:
        return self._msg.headers

    @property
    def sequence(self) -> int:
        """The stream sequence of a message a JetStream consumer delivered."""
        seq = self._sequence
        if seq is None:  # read from the ack subject once: the drain asks several times
            seq = self._sequence = _stream_sequence(self._msg)
        return seq

    @property
    def deliveries(self) -> int:
        """How many times a JetStream consumer has delivered this message (1 the first time)."""
        return _delivery_count(self._msg)

    @property
    def stored_ms(self) -> int:
        """When the stream stored a JetStream-delivered message (epoch ms)."""
        return int(self._msg.metadata.timestamp.timestamp() * 1000)

    async def ack(self) -> None:
        """Acknowledge a JetStream delivery: the broker may forget it."""
        with translated():
            await self._msg.ack()

    async def nak(self, delay: float | None = None) -> None:
        """Hand a JetStream delivery back for redelivery (after ``delay`` seconds)."""
        with translated():
            await self._msg.nak(delay=delay)

    async def in_progress(self) -> None:
        """Extend a JetStream delivery's ack deadline."""
        with translated():
            await self._msg.in_progress()

    async def respond(self, data: bytes) -> None:
        with translated():
            await self._msg.respond(data)

    def __repr__(self) -> str:
        return f"Message(subject={self.subject!r}, {len(self._msg.data)} bytes)"


MessageHandler = Callable[[Message], Awaitable[None]]


def wrap_handler(handler: MessageHandler) -> Callable[[Msg], Awaitable[None]]:
    """A nats-py callback that hands ``handler`` a :class:`Message`."""

    async def callback(msg: Msg) -> None:
        await handler(Message(msg))

    return callback


class Subscription:
    """A live subscription (core or JetStream push); :meth:`unsubscribe` ends it."""

    __slots__ = ("_sub",)

    def __init__(self, sub: NatsSubscription | Any) -> None:
        self._sub = sub

    @property
    def subject(self) -> str:
        return str(self._sub.subject)

    async def unsubscribe(self) -> None:
        with translated():
            await self._sub.unsubscribe()

    async def drain(self) -> None:
        with translated():
            await self._sub.drain()
