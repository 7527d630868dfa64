"""How full the mesh's JetStream store is: the account's use, limit and
reservations, and every bounded stream's fill (issue #22.3).

Read with the JetStream API (``$JS.API.INFO`` and the stream list) on the
node's own connection, so a service node sees its own account. The figures
are nats-server's own: ``storage`` is bytes stored, ``reserved_storage`` the
sum of the bounded streams' ``max_bytes`` (each reserved at creation), and
``max_storage`` the account's limit from its JWT (-1: none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
from nats.js.api import DiscardPolicy

from .errors import TransportError, translated
from .jetstream import JetStream

__all__ = ["DROPS_OLDEST", "BoundedStream", "StoreUsage", "read_store_usage"]

#: How :meth:`StoreUsage.pressure` ends the reason of a full stream that drops
#: its oldest messages (rather than refusing writes).
DROPS_OLDEST = "full, it drops its oldest messages"


@dataclass(frozen=True, slots=True)
class BoundedStream:
    """One stream with a ``max_bytes``: what it holds against its bound.

    ``discards_old``: at its bound the stream drops its oldest messages to take
    new ones (every platform stream), rather than refusing writes (a mailbox,
    a key-value bucket). Either is worth a warning, but they are different
    news: the first loses history, the second refuses work.
    """

    name: str
    bytes: int
    max_bytes: int
    messages: int
    discards_old: bool = False

    @property
    def ratio(self) -> float:
        return self.bytes / self.max_bytes if self.max_bytes > 0 else 0.0


@dataclass(frozen=True, slots=True)
class StoreUsage:
    """The account's JetStream file store, as nats-server reports it."""

    used: int
    reserved: int
    limit: int
    """-1 when the account has no storage limit (an external mesh may not set one)."""
    streams: tuple[BoundedStream, ...] = field(default_factory=tuple)

    @property
    def headroom(self) -> int | None:
        """Bytes neither stored nor reserved; None without an account limit."""
        if self.limit < 0:
            return None
        return max(0, self.limit - max(self.used, self.reserved))

    def pressure(self, threshold: float) -> list[str]:
        """What is at or past ``threshold`` of its bound, each naming the store."""
        reasons = []
        if self.limit > 0:
            for what, value in (("stored", self.used), ("reserved", self.reserved)):
                if value >= threshold * self.limit:
                    reasons.append(
                        f"account store: {value} of {self.limit} bytes {what} ({value / self.limit:.0%})"
                    )
        for s in self.streams:
            if s.max_bytes > 0 and s.ratio >= threshold:
                full = DROPS_OLDEST if s.discards_old else "full, it refuses writes"
                reasons.append(f"stream {s.name}: {s.bytes} of {s.max_bytes} bytes ({s.ratio:.0%}); {full}")
        return reasons

    def as_dict(self, threshold: float = 1.0) -> dict[str, Any]:
        """JSON form; the mailboxes (one per agent) only when at ``threshold``."""
        return {
            "used_bytes": self.used,
            "reserved_bytes": self.reserved,
            "limit_bytes": self.limit,
            "headroom_bytes": self.headroom,
            "streams": [
                {"name": s.name, "bytes": s.bytes, "max_bytes": s.max_bytes, "messages": s.messages}
                for s in self.streams
                if not s.name.startswith("MESH_INBOX_") or s.ratio >= threshold
            ],
        }


async def read_store_usage(jetstream: JetStream, *, timeout: float = 5.0) -> StoreUsage:
    """The account's store use and every bounded stream's fill.

    Raises :class:`TransportError` (e.g. PermissionDenied for a credential
    without the JetStream API) when the broker does not answer.
    """
    js = jetstream.native
    with translated():
        # The raw API answer: nats-py's AccountInfo has no reserved_storage.
        msg = await js._nc.request("$JS.API.INFO", b"", timeout=timeout)
        streams = await js.streams_info()
    info = orjson.loads(msg.data)
    if "error" in info:
        err = info["error"]
        raise TransportError(
            str(err.get("description", "account info refused")),
            code=err.get("code"),
            err_code=err.get("err_code"),
        )
    limits = info.get("limits") or {}
    bounded = tuple(
        BoundedStream(
            str(s.config.name),
            int(s.state.bytes or 0),
            int(s.config.max_bytes or -1),
            int(s.state.messages or 0),
            s.config.discard == DiscardPolicy.OLD,
        )
        for s in sorted(streams, key=lambda s: str(s.config.name))
        if s.config.max_bytes and s.config.max_bytes > 0
    )
    return StoreUsage(
        used=int(info.get("storage", 0)),
        reserved=int(info.get("reserved_storage", 0)),
        limit=int(limits.get("max_storage", -1)),
        streams=bounded,
    )
