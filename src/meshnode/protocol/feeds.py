"""Feeds: owner-rooted event channels (AgentMesh §6.6a, §14.1, §18.3).

A feed publish is an ordinary ``emit`` envelope on ``mesh.feed.{owner}.{topic}``
whose payload is ``{topic, kind, data}`` — never the ``{domain, event_type,
data}`` of a domain event: a topic is one token and is never split on dots.
``kind`` is ``stream`` (an ordered history) or ``state`` (a current value),
carried in-band so the platform and subscribers learn it from traffic.

The state binding keeps the latest emit envelope of each state feed under the
KV key ``{owner}.{topic}`` and serves it on ``mesh.feed.get``: request
``{agent, topic}``, response ``{found, envelope}``.

Pure functions only; the clock is a parameter. Every reader of a feed (the
platform's state writer, a subscriber, a snapshot reader) applies
:func:`check_feed_envelope` to a *verified* envelope: the broker guarantees
only that the owner's node published, the signature that the owner spoke.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .envelope import IdGenerator, build_envelope
from .errors import ProtocolError
from .nkeys import is_valid_public
from .subjects import feed_subject, is_valid_id_token, parse_feed_subject
from .timeutil import try_parse_rfc3339

__all__ = [
    "FEED_KINDS",
    "FeedKind",
    "FeedPayload",
    "FeedRefused",
    "check_feed_envelope",
    "check_feed_kind",
    "feed_envelope",
    "feed_payload",
    "is_feed_kind",
    "lookup_request",
    "lookup_response",
    "parse_feed_payload",
    "parse_lookup_request",
    "supersedes",
]

FeedKind = Literal["stream", "state"]
FEED_KINDS: tuple[FeedKind, ...] = ("stream", "state")


class FeedRefused(ValueError):
    """An envelope that is not a valid publish on the feed it arrived on.

    ``reason`` is a stable token for counters and logs: ``not_a_feed``,
    ``not_an_emit``, ``not_owner``, ``bad_payload``, ``topic_mismatch``.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class FeedPayload:
    """The parsed ``{topic, kind, data}`` of a feed emit."""

    topic: str
    kind: FeedKind
    data: Any


def is_feed_kind(value: object) -> bool:
    """True for ``stream`` or ``state`` (§6.6a), nothing else."""
    return value in FEED_KINDS


def check_feed_kind(value: object) -> FeedKind:
    """Return ``value`` as a feed kind; raise ValueError for anything else."""
    if value == "stream":
        return "stream"
    if value == "state":
        return "state"
    raise ValueError(f"a feed kind is 'stream' or 'state', not {value!r:.40}")


def feed_payload(topic: str, kind: str, data: Any) -> dict[str, Any]:
    """The canonical member set ``{topic, kind, data}``; refuses a bad topic or kind."""
    if not is_valid_id_token(topic):
        raise ValueError(f"a feed topic is one token [A-Za-z0-9_-]{{1,128}}, not {topic!r:.80}")
    return {"topic": topic, "kind": check_feed_kind(kind), "data": data}


def parse_feed_payload(payload: object) -> FeedPayload | None:
    """The feed payload of an emit, or None when it is not one (a domain event, garbage)."""
    if not isinstance(payload, Mapping):
        return None
    topic, kind = payload.get("topic"), payload.get("kind")
    if not is_valid_id_token(topic) or not is_feed_kind(kind):
        return None
    assert isinstance(topic, str)
    return FeedPayload(topic, check_feed_kind(kind), payload.get("data"))


def feed_envelope(
    owner: str,
    topic: str,
    kind: str,
    data: Any,
    *,
    now_ms: int,
    trace: Mapping[str, Any] | None = None,
    ids: IdGenerator | None = None,
) -> dict[str, Any]:
    """An unsigned feed publish: an ``emit`` from the owner with no recipient (§6.6a).

    Feeds are open broadcast: no ``to``, never sealed, never mail.
    """
    feed_subject(owner, topic)  # validates owner and topic the way the subject does
    return build_envelope(
        "emit", owner, now_ms=now_ms, payload=feed_payload(topic, kind, data), trace=trace, ids=ids
    )


def check_feed_envelope(envelope: Mapping[str, Any], subject: str) -> FeedPayload:
    """Judge a verified envelope delivered on ``subject`` as a feed publish.

    It must be an ``emit``, its ``from`` must be the subject's owner token (the
    owner-only rule, checked by every reader rather than trusted to the grant),
    and its payload a feed payload naming the subject's topic. Raises
    :class:`FeedRefused`.
    """
    parsed = parse_feed_subject(subject)
    if parsed is None:
        raise FeedRefused("not_a_feed", subject[:120])
    if envelope.get("type") != "emit":
        raise FeedRefused("not_an_emit", str(envelope.get("type"))[:20])
    if envelope.get("from") != parsed.agent_id:
        raise FeedRefused("not_owner", f"{envelope.get('from')} published on {parsed.agent_id}'s feed")
    payload = parse_feed_payload(envelope.get("payload"))
    if payload is None:
        raise FeedRefused("bad_payload", "payload is not {topic, kind, data}")
    if payload.topic != parsed.topic:
        raise FeedRefused("topic_mismatch", f"payload topic {payload.topic!r} on topic {parsed.topic!r}")
    return payload


def _order_key(envelope: Mapping[str, Any]) -> tuple[int, str]:
    ts = try_parse_rfc3339(envelope.get("ts"))
    msg_id = envelope.get("id")
    return (ts if ts is not None else -1, msg_id if isinstance(msg_id, str) else "")


def supersedes(candidate: Mapping[str, Any], current: Mapping[str, Any] | None) -> bool:
    """True when ``candidate`` replaces ``current`` as a state feed's value.

    Ordered by ``ts`` then by ``id`` (UUIDv7 ids sort by time): a redelivered
    or late older publish never overwrites a newer one, and the same envelope
    twice is not an update.
    """
    if current is None:
        return True
    return _order_key(candidate) > _order_key(current)


def lookup_request(agent: str, topic: str) -> dict[str, str]:
    """The ``mesh.feed.get`` request payload ``{agent, topic}``."""
    if not is_valid_public(agent):
        raise ValueError(f"a feed owner is a user nkey, not {agent!r:.80}")
    if not is_valid_id_token(topic):
        raise ValueError(f"a feed topic is one token [A-Za-z0-9_-]{{1,128}}, not {topic!r:.80}")
    return {"agent": agent, "topic": topic}


def parse_lookup_request(payload: object) -> tuple[str, str]:
    """``(agent, topic)`` of a lookup request; ``INVALID_QUERY`` when malformed."""
    if not isinstance(payload, Mapping):
        raise ProtocolError("INVALID_QUERY", "a feed lookup names {agent, topic}")
    agent, topic = payload.get("agent"), payload.get("topic")
    if not is_valid_public(agent):
        raise ProtocolError("INVALID_QUERY", "agent must be the feed owner's key", {"member": "agent"})
    if not is_valid_id_token(topic):
        raise ProtocolError("INVALID_QUERY", "topic must be one feed topic token", {"member": "topic"})
    assert isinstance(agent, str) and isinstance(topic, str)
    return agent, topic


def lookup_response(envelope: Mapping[str, Any] | None) -> dict[str, Any]:
    """``{found: true, envelope}`` for a stored feed value, ``{found: false, envelope: null}``."""
    if envelope is None:
        return {"found": False, "envelope": None}
    return {"found": True, "envelope": dict(envelope)}
