"""The agent API: what a plugin author writes against.

An agent is a subclass of :class:`Agent` that declares its manifest facts as
class attributes and its offerings as decorated async methods::

    from meshnode.agent import Agent, Context, Refusal, offering

    class Greeter(Agent):
        description = "Says hello."
        capabilities = ["greeting"]

        @offering("hello", description="Greets whoever asks",
                  input_schema={"type": "object", "properties": {"name": {"type": "string"}}})
        async def hello(self, ctx: Context, input: dict) -> dict:
            if input.get("name") == "":
                raise Refusal("INPUT_INVALID", "name must not be empty")
            return {"text": f"hello, {input.get('name', 'stranger')}"}

The node does everything else: it keeps the agent's key, vouches for it,
registers its manifest, verifies and checks every inbound envelope (§22)
before a handler sees it, sends the accept signal, fences sender text, signs
every reply, and routes requests between agents of the same node locally.

Contract for handlers (stable):

* An offering handler is ``async def handler(self, ctx, input) -> output``.
  ``input`` is ``payload.input`` of the request (already validated against the
  offering's ``input_schema`` when one is declared). The return value becomes
  ``payload.output`` of a ``completed`` respond.
* Raise :class:`Refusal` to answer with a §12 error (``failed``); any other
  exception is reported to the caller as ``INTERNAL_ERROR`` without details and
  logged locally.
* ``ctx.text`` is the sender text of the request wrapped in the §22.6 frame
  (or None when the payload carries no prose); ``ctx.envelope`` is the verified
  envelope verbatim — reaching past the frame is deliberate.
* Requests, emits and subscriptions made through ``ctx`` carry the trace of the
  work that made them, with no application code (§13.1).
* Files and artifacts (§7.5): ``ctx.files`` / ``ctx.resources`` are what the
  request attached, never fetched for you; ``ctx.put_artifact`` /
  ``ctx.fetch_artifact`` (digest-verified) / ``ctx.stat_artifact`` use the
  mesh artifact store; ``ctx.add_artifact`` attaches deliverables (with
  ``rests_on``) to the answer. An output too large for one message is stored
  as an artifact by the node and answered with a ref part (§18.9).
* Counterparts are found, never guessed (§14.4): ``ctx.request("echo", ...)``
  takes an agent id, the name of an agent of this node, or a display name the
  registry knows; ``ctx.resolve(name)`` and ``ctx.discover(capability=...,
  offering=...)`` return :class:`AgentInfo` records (cached for a while).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

from meshnode.agent.directory import AgentInfo, AgentNotFound, AmbiguousAgent
from meshnode.agent.replies import RemoteError, Reply, RequestQueued, RequestTimeout
from meshnode.agent.tasks import FollowUp, InputTimeout, RequesterTask, ResponderTask, StreamBroken
from meshnode.protocol.artifacts import FileAttachment, Resource
from meshnode.protocol.errors import ProtocolError

if TYPE_CHECKING:
    from meshnode.protocol.rests_on import Verdict

__all__ = [
    "Agent",
    "AgentInfo",
    "AgentNotFound",
    "AgentSettings",
    "AmbiguousAgent",
    "Context",
    "Event",
    "FileAttachment",
    "FollowUp",
    "InputTimeout",
    "NotReady",
    "OfferingSpec",
    "Refusal",
    "RemoteError",
    "Reply",
    "RequestQueued",
    "RequestTimeout",
    "RequesterTask",
    "Resource",
    "ResponderTask",
    "StreamBroken",
    "offering",
]


class NotReady(Exception):
    """Raised from ``on_start`` to mean "not yet, try me again later".

    For an agent that depends on something still coming up (a database, a
    model server, another agent): the node retries its start with a doubling
    delay (capped), shows the agent as ``retrying`` with ``reason`` in Status
    meanwhile, and fails it only once ``[node] agent_start_timeout`` has passed
    since the first attempt. Other agents are not held up. ``retry_after``
    (seconds) asks for a specific delay before the next attempt instead.
    """

    def __init__(self, reason: str = "not ready", *, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class Refusal(ProtocolError):
    """Raised by a handler to answer with a §12 error instead of an output.

    ``Refusal("INPUT_INVALID", "name must not be empty", {"field": "name"})``.
    The code must be one of §12.2; retryability follows the code.
    """

    def __init__(
        self,
        code: str,
        message: str = "",
        details: Mapping[str, Any] | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(code, message, dict(details or {}), retry_after_ms)


class AgentSettings(BaseModel):
    """Base for a plugin's own ``[agents.<name>]`` settings; unknown keys refused."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class OfferingSpec:
    """An offering as declared by a handler (§8.5)."""

    id: str
    handler_name: str
    name: str | None = None
    description: str | None = None
    tags: tuple[str, ...] = ()
    input_schema: Mapping[str, Any] | None = None
    output_schema: Mapping[str, Any] | None = None
    input_modes: tuple[str, ...] | None = None
    output_modes: tuple[str, ...] | None = None
    streaming: bool = False
    estimated_duration_ms: int | None = None
    needs: tuple[Mapping[str, Any], ...] = ()
    delivers: Mapping[str, Any] | None = None
    advertise: bool = True
    framing: bool = True
    #: §19.1: the offering's price (one of the five shapes); None = not priced here.
    price: Mapping[str, Any] | None = None
    #: The SKU id (``[a-z0-9-]{1,64}``); defaults to one derived from the offering id.
    sku: str | None = None
    #: §19.4: who bills for it; defaults to ``{"id": "internal"}``.
    billing_provider: Mapping[str, Any] | None = None
    #: EXT-8: what one request costs the owner's allowance, judged at admission:
    #: ``{"tokens": N}`` or ``{"cost_micro": N}``, or a callable of the input
    #: returning one; None = the sender text's length / 4, in tokens.
    allowance_estimate: Mapping[str, int] | Callable[[Any], Mapping[str, int]] | None = None

    def manifest_entry(self) -> dict[str, Any]:
        """The offering as it appears in the manifest (absent fields omitted)."""
        entry: dict[str, Any] = {"id": self.id}
        if self.name:
            entry["name"] = self.name
        if self.description:
            entry["description"] = self.description
        if self.tags:
            entry["tags"] = list(self.tags)
        if self.input_schema is not None:
            entry["input_schema"] = dict(self.input_schema)
        if self.output_schema is not None:
            entry["output_schema"] = dict(self.output_schema)
        if self.input_modes is not None:
            entry["input_modes"] = list(self.input_modes)
        if self.output_modes is not None:
            entry["output_modes"] = list(self.output_modes)
        if self.streaming:
            entry["streaming"] = True
        if self.estimated_duration_ms is not None:
            entry["estimated_duration_ms"] = self.estimated_duration_ms
        if self.needs:
            entry["needs"] = [dict(n) for n in self.needs]
        if self.delivers is not None:
            entry["delivers"] = dict(self.delivers)
        return entry


# A handler is a coroutine function, or an async generator function for a
# streaming offering (each yielded item is one chunk).
F = TypeVar("F", bound=Callable[..., Awaitable[Any] | AsyncIterator[Any]])


#: The methods the node calls itself; none of them is an offering's handler.
_LIFECYCLE_HOOKS = frozenset({"on_start", "on_stop", "on_event"})


def offering(
    id: str,
    *,
    name: str | None = None,
    description: str | None = None,
    tags: Sequence[str] = (),
    input_schema: Mapping[str, Any] | None = None,
    output_schema: Mapping[str, Any] | None = None,
    input_modes: Sequence[str] | None = None,
    output_modes: Sequence[str] | None = None,
    streaming: bool = False,
    estimated_duration_ms: int | None = None,
    needs: Sequence[Mapping[str, Any]] = (),
    delivers: Mapping[str, Any] | None = None,
    advertise: bool = True,
    framing: bool = True,
    price: Mapping[str, Any] | None = None,
    sku: str | None = None,
    billing_provider: Mapping[str, Any] | None = None,
    allowance_estimate: Mapping[str, int] | Callable[[Any], Mapping[str, int]] | None = None,
) -> Callable[[F], F]:
    """Declare an async method as the handler of offering ``id``.

    ``advertise=False`` keeps the offering out of the public block (§8.7):
    callers who know it can still use it.

    ``framing=True`` (the default, §22.6) hands the handler a copy of its input
    whose sender text is wrapped in the provenance frame. Turn it off only for
    an offering that never shows the text to a model, or that frames it itself.

    ``price`` (§19.1, e.g. ``{"model": "flat", "currency": "USD",
    "amount_micro": 2000}``) makes the offering a SKU of its own: the node
    builds ``{sku, covers: {offerings: [id]}, price, provider}``, computes its
    digest, lists it in the manifest's ``skus`` and (when advertised) the
    storefront, and refuses a paid request without an agreement
    (AGREEMENT_REQUIRED, §19.5) before the handler runs. ``sku`` names the
    SKU (default: the offering id, lower-cased, other characters as ``-``);
    ``billing_provider`` is who bills (§19.4, default ``{"id": "internal"}``).
    Agent-wide SKUs go in :attr:`Agent.skus`.

    ``allowance_estimate`` (EXT-8, only read when the owner set an allowance
    on this agent) is what one request will cost: ``{"tokens": N}`` (converted
    through the allowance's cost model) or ``{"cost_micro": N}``, or a
    callable of the input returning one. A request whose estimate exceeds
    what the allowance has left is refused BUDGET_INSUFFICIENT with the
    estimate before the handler runs. Undeclared: the sender text's length
    in characters / 4, in tokens. Report what the work really used with
    ``await ctx.report_usage(tokens=...)``.
    """

    def decorate(fn: F) -> F:
        if fn.__name__ in _LIFECYCLE_HOOKS:
            # A decorator left above a hook (a method inserted between the two) would
            # make the hook the handler and leave the real handler undecorated.
            raise TypeError(
                f"@offering({id!r}) decorates {fn.__name__}(), the agent's lifecycle hook, not a handler: "
                "put the decorator on the handler method"
            )
        fn.__meshnode_offering__ = OfferingSpec(  # type: ignore[attr-defined]
            id=id,
            handler_name=fn.__name__,
            name=name,
            description=description,
            tags=tuple(tags),
            input_schema=input_schema,
            output_schema=output_schema,
            input_modes=tuple(input_modes) if input_modes is not None else None,
            output_modes=tuple(output_modes) if output_modes is not None else None,
            streaming=streaming,
            estimated_duration_ms=estimated_duration_ms,
            needs=tuple(needs),
            delivers=delivers,
            advertise=advertise,
            framing=framing,
            price=price,
            sku=sku,
            billing_provider=billing_provider,
            allowance_estimate=allowance_estimate,
        )
        return fn

    return decorate


@dataclass(frozen=True)
class Event:
    """An event delivered to :meth:`Agent.on_event` (already verified and checked)."""

    subject: str
    sender: str
    domain: str | None
    event_type: str | None
    data: Any
    envelope: Mapping[str, Any]
    #: For a feed delivery (§6.6a): its topic and kind (``stream``/``state``);
    #: the owner is ``sender``. None for a domain event.
    topic: str | None = None
    kind: str | None = None


class Context(Protocol):
    """What a handler can see and do. Provided by the node; do not implement."""

    @property
    def agent_id(self) -> str:
        """This agent's id (its public key)."""

    @property
    def sender(self) -> str:
        """The verified ``from`` of the envelope being handled."""

    @property
    def envelope(self) -> Mapping[str, Any]:
        """The verified envelope, verbatim (signed bytes; never mutated)."""

    @property
    def text(self) -> str | None:
        """The sender text inside the §22.6 provenance frame, or None."""

    @property
    def sender_trust_tier(self) -> str | None:
        """The sender's node tier (``verified``/``standard``/``sandbox``) as an
        operator attestation this node trusts proves it, expiry checked (§9.7);
        None when nothing proves one (treat as unknown, not as standard)."""

    @property
    def trace(self) -> Mapping[str, Any]:
        """The trace context of the work being done (§13.1)."""

    @property
    def log(self) -> logging.Logger:
        """A logger named for this agent."""

    @property
    def task(self) -> ResponderTask | None:
        """The Task this request became, once :meth:`defer` was called (or a stream opened)."""

    async def defer(self, status: str = "working", message: str | None = None) -> ResponderTask:
        """Answer now with a Task id and keep working (§7.0).

        The returned handle sends ``progress()``, ``require_input(problems)``,
        ``require_auth()``, ``reject()``, ``pause_for_budget(spent, estimate)``
        and ``exhaust()`` updates on ``mesh.task.{id}.update``;
        ``await task.ask_input(problems)`` (or ``ask_auth()``) pauses and returns
        the input of the requester's follow-up once it arrives; the handler's
        return value completes the task and a raised Refusal fails it. A
        streaming offering (an async generator handler asked with
        ``config.stream``) becomes a Task without calling this.
        """

    async def resolve(self, target: str) -> AgentInfo:
        """The one agent ``target`` names: an agent id (``U...``), the name of an
        agent hosted on this node (its ``[agents.<name>]`` table), or a display
        name the registry lists (§14.4: the answer is the registry's manifest,
        never an id or subject built from the name).

        Raises :class:`AgentNotFound` (``NOT_FOUND``) when nothing answers to
        it and :class:`AmbiguousAgent` (``INVALID_QUERY``, the candidates in
        ``details``) when several agents elsewhere share the name. Answers are
        cached for 30 s, like manifests (one look-up in flight per name).
        """

    async def discover(
        self,
        *,
        capability: str | Sequence[str] | None = None,
        offering: str | None = None,
        name: str | None = None,
        tags: Sequence[str] | None = None,
        availability: str | None = None,
        limit: int = 50,
        exported_by: str | None = None,
        **filters: Any,
    ) -> list[AgentInfo]:
        """Agents the registry lists matching every filter given (§6.3, §9.3, AND):
        ``capability`` (one tag or all of several), ``offering`` (an offering
        id), ``name`` (display name), ``tags``, ``availability`` (``online``
        ...), and any other §9.3 filter as a keyword (``node=``, ``owner=``,
        ``version=``, ``trust_tier=``). Cached like :meth:`resolve`; the
        manifests found are cached too, so a request to one needs no look-up.

        ``exported_by="family"`` asks tenant ``family``'s registry instead of
        this node's tenant's, where ``family`` exported its discovery here
        (§15.2; ``[[mesh.embedded.exports]]`` ``discover = true``); it lists
        ``family``'s agents, of which only the exported ones can be called.
        Without that export: :class:`ProtocolError` ``AGENT_UNAVAILABLE``.
        """

    async def request(
        self,
        target: str,
        offering: str,
        input: Any = None,
        *,
        timeout: float = 30.0,
        config: Mapping[str, Any] | None = None,
        budget: Mapping[str, Any] | None = None,
        files: Sequence[Mapping[str, Any]] | None = None,
        resources: Sequence[Mapping[str, Any]] | None = None,
        task_id: str | None = None,
        context_id: str | None = None,
    ) -> Reply:
        """Send a request to agent ``target`` and await its substantive reply.

        ``target`` is anything :meth:`resolve` takes (an id, a local agent's
        name, a registry display name) or ``a2a:<peer>``.
        The target's inbox is resolved through the registry (or is local);
        the recipient's declared limits are pre-flighted first (§6.4b), so a
        refusal arrives with the recipient's own code. An accept resets the
        wait; silence past ``timeout`` raises ``RequestTimeout``, which says
        the request may be queued rather than lost (§6.4).

        ``files`` attaches files (§7.5.3): each ``{ref, ...}`` (a ref part from
        :meth:`put_artifact` is one) or ``{uri, name?, media_type?}``.
        ``resources`` points at live shared objects (§7.5.5): ``{uri, kind,
        access: "read"|"read-write", name?, description?}``. A large answer
        may arrive as a pointer in ``output`` and a ref part in
        ``reply.envelope["artifacts"]``; fetch it with :meth:`fetch_artifact`.

        ``target`` ``a2a:<peer>`` calls an external A2A agent (README, "A2A
        bridge (outbound)"); ``config={"stream": True}`` streams from it.

        ``task_id`` answers a Task of ``target`` paused in ``input_required``
        or ``auth_required`` (§6.5): ``input`` is what it asked for,
        ``offering`` and ``context_id`` the Task's (``reply.task.provide_input``
        fills them in). The reply is the Task ``working`` again. (Not for
        ``a2a:`` targets: refused INVALID_ENVELOPE.)
        """

    async def a2a_task(self, target: str, task_id: str, *, timeout: float = 30.0) -> Any:
        """A handle on task ``task_id`` of the A2A peer ``target`` (``a2a:<peer>``),
        e.g. one an ``a2a:`` request's wait ended on (``TRANSPORT_TIMEOUT`` with
        ``details.task_id``): followed by GetTask for up to ``timeout`` seconds;
        ``await handle.result()`` is its closing envelope, ``await
        handle.cancel(reason)`` cancels it (:class:`meshnode.a2a.outbound.A2AStreamTask`).
        """

    async def report_usage(
        self,
        meter: str | None = None,
        quantity: int | None = None,
        *,
        tokens: int | None = None,
        cost_micro: int | None = None,
    ) -> None:
        """Report what this piece of work used. Two independent reports share the call:

        * ``meter, quantity`` — a declared meter (§13.5) for the **buyer's bill**,
          e.g. ``await ctx.report_usage("tokens_out", 4210)``. Cumulative and
          superseding: a later report of the same meter replaces the earlier
          one (report the running total). The node sends it as ``payload.usage``
          of the answer (covered by its signature) and, for an offering a SKU
          prices on that meter, records and publishes the meter event the
          rating service charges (§19.6). ValueError for a meter name outside
          ``[a-z0-9_]{1,64}``, an observed meter's name (``requests``,
          ``bytes_out``, ...: the platform counts those) or a quantity that is
          not a non-negative integer.
        * ``tokens`` / ``cost_micro`` — this agent's own **spend** against its
          owner's allowance (EXT-8 metering): ``tokens`` converted through the
          owner's allowance cost model (floor-rounded), or ``cost_micro`` (money,
          micro-units of the allowance's currency). Each call adds to the spend
          of this request's Task, context and UTC day. Without an allowance on
          this agent it does nothing. When the spend crosses one of the owner's
          ceilings this raises ``ProtocolError`` BUDGET_EXHAUSTED (``on_exhausted:
          refuse``: let it propagate, the work stops), or waits with the Task
          paused in ``input_required`` until the owner raises the allowance
          (``ask_owner``; a declined hold raises BUDGET_INSUFFICIENT).
        """

    async def emit(self, domain: str, event_type: str, data: Any = None) -> None:
        """Publish an event on ``mesh.event.{domain}.{event_type}`` (§6.6).

        Fire-and-forget; the ``Nats-Msg-Id`` header is the envelope id, so a
        retried publish is stored once (§18.8).
        """

    async def subscribe(self, pattern: str, *, durable: bool = True, replay: bool = False) -> str:
        """Receive events on ``mesh.event.{pattern}`` (``scraping.*``, ``billing.>``)
        in :meth:`Agent.on_event`.

        Durable (default): a JetStream consumer that survives restarts;
        events are acked after ``on_event`` returns. ``replay=True`` starts
        from the oldest retained event. Every event passes the same checks as
        a request (§22). Patterns in the class's ``accepts`` are subscribed
        automatically when the agent starts.
        """

    # -- feeds and observers (§6.6a, §13) -------------------------------------------

    async def publish_feed(self, topic: str, data: Any, *, kind: str | None = None) -> str:
        """Publish on this agent's feed ``mesh.feed.{agent_id}.{topic}`` (§6.6a).

        ``kind`` is ``stream`` (an ordered history) or ``state`` (a current
        value, kept by the platform for late readers); it defaults to the kind
        declared in the class's ``feeds``, else ``stream``. The payload is
        ``{topic, kind, data}``; like every emit it is rate-limited per topic
        (``RATE_LIMITED``) and deduplicated by envelope id. Returns the id.
        """

    async def subscribe_feed(
        self, owner: str, topic: str = "*", *, durable: bool = True, replay: bool = False
    ) -> str:
        """Receive ``owner``'s feed ``topic`` (``*``: all its feeds) in :meth:`Agent.on_event`.

        Deliveries are :class:`Event` objects with ``topic`` and ``kind`` set;
        only envelopes signed by ``owner`` itself are delivered. Durable
        (default): a consumer on MESH_FEED that keeps what is published while
        this node is away. Subscribe *before* :meth:`read_feed_state`.
        """

    async def read_feed_state(self, owner: str, topic: str) -> Event | None:
        """The current value of ``owner``'s state feed ``topic`` without replaying
        history (``mesh.feed.get``), or None if it never published.

        Subscribe first, then read (§9.6): an update published in between
        arrives on the subscription, and a value older than one already
        delivered is never returned.
        """

    async def observe(self, kind: str, agent: str | None = None) -> str:
        """Receive span (``trace``), ``metrics`` or ``log`` events (§13.1–§13.3) of
        every agent, or of ``agent``, in :meth:`Agent.on_event` — for exporters
        and dashboards. Live only; each is verified and must come from the
        agent its subject names.
        """

    # -- files and artifacts (§7.5) ----------------------------------------------

    @property
    def files(self) -> list[FileAttachment]:
        """The request's attached files (``payload.files``, §7.5.3), as declared.

        Nothing was fetched: a ``ref`` file is fetched only when the handler
        calls :meth:`fetch_artifact`, and a ``uri`` file is never fetched by
        the node at all (dereferencing a sender-chosen address is the
        handler's decision to make, or not). Malformed entries were refused at
        admission with ``INPUT_INVALID``.
        """

    @property
    def resources(self) -> list[Resource]:
        """The request's shared resources (``payload.resources``, §7.5.5), as declared.

        The mesh asserts nothing about them and the node never touches them.
        """

    async def put_artifact(
        self,
        data: bytes | Path,
        *,
        name: str | None = None,
        media_type: str,
        retention_s: int | None = None,
    ) -> dict[str, Any]:
        """Store bytes or a file in the mesh artifact store; returns its ref part
        ``{ref, media_type, size, digest, name}`` (§7.5).

        This agent is the writer and its owner pays the quota (§7.5.2):
        ``QUOTA_EXCEEDED`` / ``PAYLOAD_TOO_LARGE`` raise as ``RemoteError``.
        Anything larger than one message is uploaded in chunks (a file is
        never read wholly into memory) and verified by the store against its
        size and digest. ``retention_s`` defaults to the task retention plus
        7 days. The ref is unguessable and is the read capability: whoever
        holds it can read the bytes.
        """

    async def fetch_artifact(
        self, ref: str | Mapping[str, Any] | FileAttachment, *, max_bytes: int | None = None
    ) -> bytes:
        """The bytes behind a ref, a ref part or a ``ref`` file, verified.

        The digest and size of the ref part (or, for a bare ref, the store's
        record) are checked: a mismatch raises ``ArtifactIntegrityError``
        (``DEPENDENCY_FAILED``, ``details.reason: digest_mismatch``), never
        returns data (§7.5.1). ``ARTIFACT_GONE`` (with the size and digest the
        ref had) tells an expired ref from ``NOT_FOUND`` (never existed, or a
        scheme no store here answers for). ``max_bytes`` refuses a larger
        object (``PAYLOAD_TOO_LARGE``) before any byte moves.
        """

    async def stat_artifact(self, ref: str | Mapping[str, Any] | FileAttachment) -> dict[str, Any]:
        """A ref's metadata without the bytes: ``{ref, media_type, size, digest,
        name?, created_at, expires_at, state}`` (owner and writer only to the owner)."""

    def add_artifact(
        self,
        parts: Sequence[Mapping[str, Any]],
        *,
        name: str,
        media_type: str | None = None,
        rests_on: Sequence[Mapping[str, Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Attach an artifact (§7.5) to this request's answer; returns it.

        ``parts`` are ref parts (from :meth:`put_artifact`), ``{text}`` or
        ``{data}`` parts. ``rests_on`` declares what the artifact was computed
        from (§5.6): entries ``{digest, ref?, name?, role?}``;
        ``meshnode.protocol.rests_on.entry_for(file_or_part, role="input")``
        builds one from an input that carries a digest.
        """

    async def verify_rests_on(
        self, declared: Sequence[Mapping[str, Any]] | None, *, countersigned: bool = False
    ) -> Verdict:
        """The §5.6 freshness of a statement's ``rests_on``: ``fresh``, ``stale``
        (an input moved; not a forgery), ``unchecked`` (something could not be
        obtained), ``undeclared`` (None), or ``not_applicable`` (a countersigned
        agreement: nothing is looked up). Cited refs are fetched and hashed.
        """


class Agent:
    """Base class for hosted agents. Subclass it and declare offerings.

    Class attributes are manifest facts (§8.1); the node fills in id, node,
    endpoint(s), protocol_version and the vouch. ``Settings`` is the pydantic
    model of this agent's ``[agents.<name>]`` table.
    """

    #: Human-readable display name (defaults to the configured agent name).
    display_name: ClassVar[str | None] = None
    description: ClassVar[str] = ""
    version: ClassVar[str] = "0.1.0"
    capabilities: ClassVar[Sequence[str]] = ()
    #: "service" (no person in the loop) or "interactive" (§8.3a).
    interaction: ClassVar[str] = "service"
    #: The storefront (§8.7): description/admission/access/links/...; the node
    #: materializes offerings from the advertised handlers.
    public: ClassVar[Mapping[str, Any] | None] = None
    provider: ClassVar[Mapping[str, Any] | None] = None
    limits: ClassVar[Mapping[str, Any] | None] = None
    rate_limits: ClassVar[Mapping[str, Any] | None] = None
    #: Event patterns subscribed durably at start (``"scraping.*"``; a leading
    #: ``mesh.event.`` is accepted); also published in the manifest.
    accepts: ClassVar[Sequence[str]] = ()
    emits: ClassVar[Sequence[str]] = ()
    #: Feeds this agent publishes (§6.6a): ``{"status": "state", "changes":
    #: "stream"}``. Each becomes ``mesh.feed.{agent_id}.{topic}`` in the
    #: manifest's ``emits``, which is what makes it discoverable.
    feeds: ClassVar[Mapping[str, str]] = {}
    visibility: ClassVar[str | None] = None
    #: Take no work from agents on sandbox-attested nodes (§9.7): refused
    #: UNAUTHORIZED (``sender_sandboxed``) before the handler runs. The tier is
    #: the sender's operator attestation, verified with its expiry; a sender
    #: whose tier nothing proves is not refused. ``ctx.sender_trust_tier``
    #: gives the same fact to a handler that decides for itself.
    refuse_sandbox_senders: ClassVar[bool] = False
    default_input_modes: ClassVar[Sequence[str] | None] = None
    default_output_modes: ClassVar[Sequence[str] | None] = None
    #: §19.1 SKUs declared whole (``{sku, covers, price, provider}``), e.g. an
    #: agent-wide one (``covers: {"agent": true}``). ``@offering(price=...)``
    #: adds one per priced offering; the node computes every digest.
    skus: ClassVar[Sequence[Mapping[str, Any]]] = ()
    Settings: ClassVar[type[AgentSettings]] = AgentSettings

    def __init__(self, name: str, settings: AgentSettings) -> None:
        self.name = name
        self.settings = settings
        self.log = logging.getLogger(f"meshnode.agent.{name}")

    @classmethod
    def offerings(cls) -> dict[str, OfferingSpec]:
        """Every declared offering, by id (subclass declarations win)."""
        found: dict[str, OfferingSpec] = {}
        for klass in reversed(cls.__mro__):
            for attr in vars(klass).values():
                spec = getattr(attr, "__meshnode_offering__", None)
                if isinstance(spec, OfferingSpec):
                    found[spec.id] = spec
        return found

    async def on_start(self, ctx: Context) -> None:
        """Called once the agent is hosted (before registration completes)."""

    async def on_stop(self) -> None:
        """Called when the agent is being stopped; release resources here."""

    async def on_event(self, ctx: Context, event: Event) -> None:
        """Called for each event on a subscription this agent made."""

    async def admit(self, ctx: Context, offering: str, input: Any, budget: Any) -> None:
        """Budget admission (§7.7), before the accept and before any work.

        ``budget`` is the request's parsed budget (``meshnode.protocol.budget.Budget``)
        or None. Raise ``Refusal("BUDGET_INSUFFICIENT", ..., {"estimate": {...}})`` or
        ``Refusal("DEADLINE_UNMEETABLE", ..., {"earliest_completion": ...})`` when the
        work will not fit: refuse-with-estimate is how a caller learns the price.
        A deadline already past is refused by the node without asking.
        """

