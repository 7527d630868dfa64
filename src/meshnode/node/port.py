"""What a hosted agent, its tasks, its context and pub/sub may ask of the node.

:class:`NodePort` is the narrow interface :mod:`meshnode.node.hosted`,
:mod:`~meshnode.node.tasks`, :mod:`~meshnode.node.context`,
:mod:`~meshnode.node.pubsub`, :mod:`~meshnode.node.trust`,
:mod:`~meshnode.node.observe` and :mod:`~meshnode.node.artifacts` depend on
instead of the whole :class:`meshnode.node.runtime.Node`: the clock and ids,
the one audit path and refusal counter, delivery and requests, task and
stream publishing, platform-service calls, events. ``Node`` implements it;
the unit tests use one fake of it (``tests/fakes.py``).

Members are read-only properties where the node holds state, so an
implementation may keep a plain attribute.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from meshnode.agent import Reply
    from meshnode.node.allowance import AllowanceKeeper
    from meshnode.node.commerce import AgreementGate
    from meshnode.node.directory import AgentDirectory
    from meshnode.node.gateway import OutboundGateway
    from meshnode.node.hosted import HostedAgent
    from meshnode.node.inbox import InboxStore
    from meshnode.node.observe import Observability
    from meshnode.node.open_tasks import OpenTaskJournal
    from meshnode.node.pipeline import RefusalCounter
    from meshnode.node.pubsub import PubSub
    from meshnode.node.runtime import NodeSettings
    from meshnode.node.trust import VouchMemo
    from meshnode.protocol.envelope import IdGenerator
    from meshnode.protocol.protections import DedupMemory, InboundGuard
    from meshnode.transport.connection import MeshConnection, Message
    from meshnode.transport.grants import Grants

__all__ = ["NodePort"]


class NodePort(Protocol):
    """The node as its agents' machinery sees it (see the module docstring)."""

    # -- state ----------------------------------------------------------------------

    @property
    def node_id(self) -> str:
        """The node's public key (its connection-bound subjects' token)."""
    @property
    def settings(self) -> NodeSettings: ...
    @property
    def connection(self) -> MeshConnection: ...
    @property
    def ids(self) -> IdGenerator: ...
    @property
    def counters(self) -> Counter[str]: ...
    @property
    def refusals(self) -> RefusalCounter:
        """Every inbound refusal, by intake and rule (:mod:`meshnode.node.pipeline`)."""
    @property
    def agents(self) -> Mapping[str, HostedAgent]:
        """The hosted agents by name."""
    @property
    def by_id(self) -> Mapping[str, HostedAgent]:
        """The hosted agents by agent id (a local recipient, §4.7)."""
    @property
    def inbox(self) -> InboxStore | None: ...
    @property
    def open_tasks(self) -> OpenTaskJournal | None:
        """The journal of this node's open Tasks (:mod:`meshnode.node.open_tasks`)."""
    @property
    def trust(self) -> VouchMemo | None: ...
    @property
    def observability(self) -> Observability | None: ...
    @property
    def pubsub(self) -> PubSub: ...
    @property
    def directory(self) -> AgentDirectory:
        """``ctx.discover`` / ``ctx.resolve``: counterparts found through the registry."""
    @property
    def a2a(self) -> OutboundGateway | None:
        """The outbound gateway (``a2a:<peer>`` targets), or None."""
    @property
    def trust_attestation(self) -> dict[str, Any] | None: ...
    @property
    def commerce(self) -> AgreementGate | None:
        """The §19.5 agreement check at admission, or None (nothing is gated)."""
    @property
    def allowance(self) -> AllowanceKeeper | None:
        """The owners' allowances (EXT-8) of the hosted agents, or None."""
    @property
    def trusted_operators(self) -> frozenset[str]: ...
    @property
    def platform_keys(self) -> Collection[str]:
        """The platform services' keys this node knows (never subject to §5.3 step 2)."""
    @property
    def grants(self) -> Grants:
        """What the node's own credential lets it publish and subscribe (§14.3)."""

    # -- bookkeeping ------------------------------------------------------------------

    def now_ms(self) -> int:
        """The node's clock, epoch milliseconds."""

    def audit(self, hosted: HostedAgent, env: Mapping[str, Any], *, direction: str, path: str) -> None:
        """Every envelope in or out passes here (§4.7: one audit path)."""

    def new_guard(self, agent_id: str, memory: DedupMemory | None = None) -> InboundGuard:
        """A §22 guard with the node's protections, for ``agent_id``."""

    # -- delivery and requests --------------------------------------------------------

    async def deliver(self, sender: HostedAgent, env: dict[str, Any], to_agent: str) -> None:
        """A signed envelope to an agent's inbox; locally when hosted here."""

    async def reply_plain(self, reply_subject: str, obj: Any) -> None:
        """A node-level delivery-status signal on a transport reply subject."""

    def on_respond(self, hosted: HostedAgent, env: Mapping[str, Any]) -> bool:
        """Route a checked respond to the request waiting for it."""

    def queued_locally(self, requester: str, request_id: str, inbox_id: str) -> None:
        """A request delivered locally was held for a person (§8.3a): the queued
        ack a transport reply would carry, given to the local requester's wait."""

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
        context_id: Any = None,
        files: Sequence[Mapping[str, Any]] | None = None,
        resources: Sequence[Mapping[str, Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
        task_id: str | None = None,
    ) -> Reply: ...

    async def call_a2a(
        self,
        hosted: HostedAgent,
        peer: str,
        offering: str,
        input: Any,
        *,
        envelope: Mapping[str, Any] | None,
        trace: Mapping[str, Any],
        timeout: float,
        budget: Mapping[str, Any] | None = None,
        stream: bool = False,
    ) -> Reply: ...

    async def service_call(
        self, hosted: HostedAgent, subject: str, kind: str, payload: Any, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """A signed request to a platform service; the verified reply's payload."""

    # -- tasks, streams, events -------------------------------------------------------

    async def publish_task(self, subject: str, env: Mapping[str, Any]) -> None: ...

    async def publish_chunk(
        self,
        hosted: HostedAgent,
        task: Any,
        index: int,
        data: Any,
        *,
        final: bool,
        sign: bool,
        chunk_count: int | None = None,
    ) -> None: ...

    async def emit(
        self, hosted: HostedAgent, domain: str, event_type: str, data: Any, *, trace: Mapping[str, Any]
    ) -> None: ...

    async def subscribe_events(
        self, hosted: HostedAgent, pattern: str, *, durable: bool = True, replay: bool = False
    ) -> str: ...

    async def durable_consume(
        self,
        hosted: HostedAgent,
        subject: str,
        *,
        stream: str,
        name: str,
        replay: bool,
        deliver: Callable[[Message], Awaitable[None]],
    ) -> Any: ...
