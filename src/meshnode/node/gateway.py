"""What the node needs from an outbound gateway (the A2A bridge's client side).

The node does not import the gateway: it holds whatever implements
:class:`OutboundGateway` (the daemon plugs in :class:`meshnode.a2a.outbound.A2AOutbound`
when ``[a2a.peers]`` is set), and hands it a :class:`CallContext` describing the
mesh work making the call. Gateways sit above the node and reach it through
interfaces like this one, never the reverse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from meshnode.agent import Reply
from meshnode.protocol.nkeys import KeyPair

__all__ = ["CallContext", "OutboundGateway"]


@dataclass
class CallContext:
    """What the calling mesh work contributes to an outbound gateway call."""

    agent_id: str
    agent_key: KeyPair
    trace: Mapping[str, Any]
    #: The envelope of the mesh request being handled (None outside a handler).
    envelope: Mapping[str, Any] | None = None
    #: A budget block the caller passed explicitly to ``ctx.request``.
    budget: Mapping[str, Any] | None = None


class OutboundGateway(Protocol):
    """An outbound gateway to external agents addressed ``<scheme>:<peer>``.

    ``call`` sends one piece of work to peer ``peer`` and answers like a mesh
    request (a :class:`Reply`; its ``task`` a handle on a streamed or open
    call); ``resume`` is a handle on a task of the peer that a call's wait left
    behind (``result()``, ``cancel()``). Both raise
    :class:`meshnode.protocol.errors.ProtocolError` with the mesh's codes
    (``NOT_FOUND`` for an unconfigured peer, ``TRANSPORT_TIMEOUT``, ...).
    """

    async def call(self, peer: str, offering: str, input: Any, call: CallContext, /, *,
                   timeout: float, stream: bool = False) -> Reply: ...

    async def resume(self, peer: str, task_id: str, call: CallContext, /, *, timeout: float) -> Any: ...
