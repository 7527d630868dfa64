"""A node's consumers on the shared streams, asked of the consumer service (#22, §18.6).

A participant's credential holds no consumer-management grant on MESH_TASKS,
MESH_EVENTS or MESH_FEED (:mod:`meshnode.transport.permissions` says why): the
consumer service (:mod:`meshnode.services.consumers`) creates, asserts and
deletes them for the agent that signs the request, delivering under this
node's private inbox prefix, and the node binds the push consumer it is told
about. Where no consumer service answers (a mesh of an older version, or a
service-role node before its own services are up) the node falls back to
making the consumer itself, which works exactly where its credential allows.

A failed release (a task consumer the node could not delete) is logged once
per reason and counted in the agent's ``consumers.release_failed`` counter,
never swallowed: left behind, the consumer lingers until the server reaps it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from meshnode.protocol import subjects
from meshnode.protocol.errors import ProtocolError
from meshnode.transport.errors import NotFound, TransportError
from meshnode.transport.jetstream import DurableSubscription
from meshnode.transport.messages import Message

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent

__all__ = ["bind_shared", "release_shared", "request_for"]

log = logging.getLogger(__name__)

_warned: set[str] = set()


def _warn_once(key: str, message: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def request_for(stream: str, subject: str, *, replay: bool = False) -> dict[str, Any]:
    """The consumer-service request for a consumer of ``subject`` on ``stream``."""
    if stream == subjects.MESH_EVENTS:
        return {"kind": "event", "pattern": subject.removeprefix("mesh.event."), "replay": replay}
    if stream == subjects.FEED_STREAM:
        return {"kind": "feed", "subject": subject, "replay": replay}
    parts = subject.split(".")
    if stream == subjects.MESH_TASKS and len(parts) == 4 and parts[3] in ("update", "stream"):
        return {"kind": f"task_{parts[3]}", "task_id": parts[2]}
    raise ValueError(f"no shared consumer for {subject!r} on {stream}")


def _no_service(exc: ProtocolError) -> bool:
    # No consumer service on this mesh (yet): no responders, or nobody answered.
    return exc.code in ("AGENT_UNAVAILABLE", "TRANSPORT_TIMEOUT")


async def bind_shared(
    hosted: HostedAgent,
    request: Mapping[str, Any],
    name: str,
    handler: Callable[[Message], Awaitable[None]],
    *,
    fallback: Callable[[], Awaitable[DurableSubscription]],
) -> DurableSubscription:
    """Have the consumer service make (or repair) ``name`` and bind it.

    Raises RemoteError when the service refuses (QUOTA_EXCEEDED, ...): that
    refusal, with its reason, is the caller's to surface.
    """
    node = hosted.node
    connection = node.connection
    prefix = connection.inbox_prefix
    if not prefix or prefix == "_INBOX":
        return await fallback()  # the service delivers under a node's private prefix only
    deliver = f"{prefix}.c.{name}"
    try:
        answer = await node.service_call(
            hosted, subjects.consumers_ensure(node.node_id), "request", {**request, "deliver_subject": deliver}
        )
    except ProtocolError as exc:
        if not _no_service(exc):
            raise
        _warn_once("no-service", "no consumer service answers (%s): nodes make their own consumers", exc)
        return await fallback()
    stream = str(answer.get("stream"))
    bound = str(answer.get("name", name))
    action = answer.get("action")
    if action in ("updated", "recreated"):
        log.warning("consumer %s on %s had drifted and was %s by the consumer service", bound, stream, action)
    return await connection.jetstream.bind_push(stream, bound, str(answer.get("deliver_subject") or deliver), handler)


async def release_shared(
    hosted: HostedAgent, request: Mapping[str, Any], stream: str, name: str
) -> None:
    """Delete ``name`` now (through the service, else directly); failures counted, logged once."""
    node = hosted.node
    try:
        await node.service_call(hosted, subjects.consumers_delete(node.node_id), "request", dict(request))
        return
    except ProtocolError as exc:
        if not _no_service(exc):
            hosted.counters["consumers.release_failed"] += 1
            _warn_once(f"release:{exc.code}", "deleting consumer %s on %s was refused: %s (counted in "
                       "consumers.release_failed; it lingers until the server reaps it)", name, stream, exc)
            return
    try:
        await node.connection.jetstream.delete_consumer(stream, name)
    except NotFound:
        pass
    except TransportError as exc:
        hosted.counters["consumers.release_failed"] += 1
        _warn_once(f"release-direct:{type(exc).__name__}", "deleting consumer %s on %s failed: %s (counted in "
                   "consumers.release_failed; it lingers until the server reaps it)", name, stream, exc)
