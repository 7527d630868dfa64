"""The inbound bridge's model: its settings, who is asking, who owns a task, and
the narrow view of the node it needs (the bridge reaches the node through
:class:`BridgeNode`, never the node the bridge)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from meshnode.protocol.a2a_extension import CLOCK_SKEW_S, EnvelopeCheck, IssuerTrust

if TYPE_CHECKING:
    from meshnode.agent import Reply
    from meshnode.node.hosted import HostedAgent

__all__ = [
    "ANONYMOUS",
    "BridgeNode",
    "BridgeSettings",
    "Inbound",
    "Requester",
    "caller_of",
    "dedup_caller",
    "may_see",
]

#: The caller key of requests without a trusted envelope.
ANONYMOUS = "anonymous"


class BridgeNode(Protocol):
    """What the inbound bridge uses of the node: its hosted agents, its clock,
    and the one outbound request path (so every §22 protection and the agent's
    admission apply to A2A work exactly as to any mesh caller)."""

    @property
    def agents(self) -> Mapping[str, HostedAgent]: ...

    def now_ms(self) -> int: ...

    async def send_request(
        self,
        hosted: HostedAgent,
        target: str,
        offering: str,
        input: Any,
        *,
        trace: Mapping[str, Any],
        timeout: float,
        config: Mapping[str, Any] | None = None,
        budget: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Reply: ...


@dataclass(frozen=True)
class BridgeSettings:
    """What the bridge needs from ``[a2a]``, already typed."""

    host: str
    port: int
    application: str
    expose: tuple[str, ...]
    #: ``listen = "fd://N"``: serve on this inherited listening socket (host and
    #: port are then read from it, see :meth:`bound_to`).
    listen_fd: int | None = None
    public_url: str | None = None
    max_mesh_hops: int = 8
    idempotency_retention_s: float = 86400.0
    send_wait_s: float = 30.0
    task_timeout_s: float = 600.0
    clock_skew_s: float = CLOCK_SKEW_S
    trust: IssuerTrust = field(default_factory=IssuerTrust)

    def bound_to(self, port: int, host: str | None = None) -> BridgeSettings:
        """These settings once the server listens on ``host:port``: a configured
        port 0 ("any free port") becomes the bound one, and an inherited socket
        (``listen_fd``) gives both, so every URL the bridge publishes (cards,
        discovery document, Status) names where it really serves. An explicit
        port is kept as configured."""
        if self.listen_fd is not None and host is not None:
            return replace(self, host=host, port=port)
        return replace(self, port=port) if self.port == 0 else self

    @property
    def base_url(self) -> str:
        """The base of every published URL: ``public_url`` when set, else ``http://host:port``."""
        if self.public_url:
            return self.public_url.rstrip("/")
        host = self.host if ":" not in self.host or self.host.startswith("[") else f"[{self.host}]"
        return f"http://{host}:{self.port}"


@dataclass
class Inbound:
    """What the HTTP layer learned from the raw request before the SDK parsed it."""

    activated: bool
    message: dict[str, Any]
    body_hash: str
    check: EnvelopeCheck | None = None
    traceparent: str | None = None
    tracestate: str | None = None


@dataclass(frozen=True)
class Requester:
    """Who asks for a task operation: ``caller`` is ``issuer:<id>`` when a
    trusted task-operation envelope proved it for exactly this ``method`` and
    task ``task_id``, else ``anonymous``."""

    caller: str
    method: str
    task_id: str | None



def caller_of(inbound: Inbound) -> str:
    """The caller a message is from: ``issuer:<id>`` of a trusted envelope, else anonymous."""
    check = inbound.check
    if check is not None and check.trusted and check.issuer:
        return f"issuer:{check.issuer}"
    return ANONYMOUS


def dedup_caller(caller: str, inbound: Inbound) -> str:
    """The idempotency key's caller: the trusted issuer, or for anonymous
    callers the message's body hash, so one anonymous caller replaying
    another's messageId with its own message gets a task of its own (and
    learns nothing of the other's)."""
    if caller != ANONYMOUS:
        return caller
    # A message with no canonical form has no hash to key on: never deduplicated.
    return f"{ANONYMOUS}:{inbound.body_hash or uuid.uuid4()}"


def may_see(owner: str, requester: str) -> bool:
    """A trusted caller's task is its issuer's alone; an anonymous caller's
    task is anyone's who holds its unguessable id (the id is the capability)."""
    return owner in (ANONYMOUS, requester)
