"""The handler's view of the node: the concrete :class:`meshnode.agent.Context`."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshnode.agent import AgentInfo, Reply
from meshnode.node.artifacts import ArtifactClient, artifact_object, ref_part_of
from meshnode.node.gateway import CallContext
from meshnode.node.tasks import ResponderTask
from meshnode.protocol.a2a_extension import EXTENSION_URI, chain_meta_of, peer_name_of
from meshnode.protocol.artifacts import FileAttachment, Resource, parse_files, parse_resources
from meshnode.protocol.envelope import child_trace
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.metering import OBSERVED_METERS, is_meter_name
from meshnode.protocol.nkeys import is_valid_public
from meshnode.protocol.rests_on import Verdict

if TYPE_CHECKING:
    from meshnode.agent import Event
    from meshnode.node.hosted import HostedAgent

__all__ = ["AgentContext"]


class AgentContext:
    """Everything a handler may see and do, bound to one agent and one piece of work.

    Work a handler starts inherits this context's trace (§13.1): outbound
    requests and emits get a child span of the envelope being handled.
    """

    def __init__(
        self,
        hosted: HostedAgent,
        *,
        envelope: Mapping[str, Any] | None = None,
        text: str | None = None,
        trace: Mapping[str, Any] | None = None,
    ) -> None:
        self._hosted = hosted
        self._envelope: Mapping[str, Any] = envelope or {}
        self._text = text
        env_trace = self._envelope.get("trace") if envelope is not None else None
        self._trace: Mapping[str, Any] = trace or (env_trace if isinstance(env_trace, Mapping) else {})
        obs = hosted.node.observability
        if obs is not None:
            # Spans on: work started here is a child of this envelope's consumer span.
            self._trace = obs.enter(hosted, envelope, self._trace)
        #: The Task this request became, once the handler deferred or streamed.
        self.task: ResponderTask | None = None
        self._artifacts: list[dict[str, Any]] = []
        self._usage: dict[str, int] = {}

    @property
    def agent_id(self) -> str:
        return self._hosted.agent_id

    @property
    def sender(self) -> str:
        sender = self._envelope.get("from")
        return sender if isinstance(sender, str) else ""

    @property
    def envelope(self) -> Mapping[str, Any]:
        return self._envelope

    @property
    def sender_trust_tier(self) -> str | None:
        """The sender's node tier (verified | standard | sandbox) as an operator
        attestation this node trusts proved it (§9.7); None when none did."""
        trust = self._hosted.node.trust
        return trust.tier_of(self.sender) if trust is not None and self.sender else None

    @property
    def text(self) -> str | None:
        return self._text

    @property
    def trace(self) -> Mapping[str, Any]:
        return self._trace

    @property
    def log(self) -> logging.Logger:
        return self._hosted.agent.log

    def _child_trace(self) -> dict[str, Any]:
        return child_trace(self._trace or None)

    async def defer(self, status: str = "working", message: str | None = None) -> ResponderTask:
        """Make the request being handled a Task (§7.0) and answer with its id now.

        Returns the handle for progress, input/auth rounds, budget pauses and
        rejection; the handler's return value completes the task.
        """
        if not self._envelope or self._envelope.get("type") != "request":
            raise RuntimeError("defer() is for a request being handled")
        return await self._hosted.open_task(self, status, message)

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
        peer = peer_name_of(target)
        if peer is not None and task_id is not None:
            # Not carried to external A2A agents yet: refused, never silently dropped.
            raise ProtocolError(
                "INVALID_ENVELOPE",
                f"answering a paused task of an external A2A agent ({target}) is not supported",
                {"member": "task_id"},
            )
        if peer is not None:
            # An external A2A agent (``a2a:<peer>``, [a2a.peers.<peer>]): the bridge
            # carries this work's trace, chain, budget and deadline across (#8).
            return await self._hosted.node.call_a2a(
                self._hosted, peer, offering, input, envelope=self._envelope or None,
                trace=self._child_trace(), timeout=timeout, budget=budget,
                stream=bool(config and config.get("stream") is True),
            )
        if not is_valid_public(target):
            # A name (this node's agent, or a display name the registry lists):
            # resolved to the agent the registry answers for (§14.4).
            target = (await self.resolve(target)).id
        # Work that entered by A2A carries its call chain into mesh sub-requests,
        # so an A2A -> mesh -> A2A loop is seen by the peer's chain check.
        chain = chain_meta_of(self._envelope)
        reply = await self._hosted.node.send_request(
            self._hosted,
            target,
            offering,
            input,
            trace=self._child_trace(),
            timeout=timeout,
            config=config,
            budget=budget,
            # A follow-up names its Task's context (or none), never the one being handled.
            context_id=context_id if task_id is not None or context_id else (
                self._envelope.get("context_id") if self._envelope else None
            ),
            files=files,
            resources=resources,
            meta={EXTENSION_URI: chain} if chain is not None else None,
            task_id=task_id,
        )
        if self.task is not None and reply.task is not None and task_id is None:
            # A delegate of this task: a cancel of ours is forwarded to it (§10.8).
            self.task.delegates.append((target, reply.task.task_id))
        return reply

    async def resolve(self, target: str) -> AgentInfo:
        return await self._hosted.node.directory.resolve(self._hosted, target)

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
        return await self._hosted.node.directory.discover(
            self._hosted, capability=capability, offering=offering, name=name, tags=tags,
            availability=availability, limit=limit, exported_by=exported_by, **filters,
        )

    async def a2a_task(self, target: str, task_id: str, *, timeout: float = 30.0) -> Any:
        peer = peer_name_of(target)
        node = self._hosted.node
        if peer is None:
            raise ProtocolError("INVALID_ENVELOPE", f"{target!r} is not an A2A peer (a2a:<name>)",
                                {"target": target})
        if node.a2a is None:
            raise ProtocolError("NOT_FOUND", f"no A2A peer {peer!r} is configured ([a2a.peers.{peer}])",
                                {"peer": peer})
        call = CallContext(agent_id=self._hosted.agent_id, agent_key=self._hosted.key,
                           trace=self._child_trace(), envelope=self._envelope or None)
        return await node.a2a.resume(peer, task_id, call, timeout=timeout)

    async def subscribe(self, pattern: str, *, durable: bool = True, replay: bool = False) -> str:
        return await self._hosted.node.subscribe_events(
            self._hosted, pattern, durable=durable, replay=replay
        )

    async def report_usage(
        self,
        meter: str | None = None,
        quantity: int | None = None,
        *,
        tokens: int | None = None,
        cost_micro: int | None = None,
    ) -> None:
        if meter is not None or quantity is not None:
            self._report_meter(meter, quantity)
        for name, value in (("tokens", tokens), ("cost_micro", cost_micro)):
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"report_usage: {name} is a non-negative integer")
        allowance = self._hosted.node.allowance
        if allowance is None or not self._envelope or (tokens is None and cost_micro is None):
            return
        await allowance.report(self._hosted, self._envelope, self.task, self.defer,
                               tokens=tokens, cost_micro=cost_micro)

    async def emit(self, domain: str, event_type: str, data: Any = None) -> None:
        await self._hosted.node.emit(self._hosted, domain, event_type, data, trace=self._child_trace())

    # -- feeds and observers (§6.6a, §13; meshnode.node.pubsub) ------------------------

    async def publish_feed(self, topic: str, data: Any, *, kind: str | None = None) -> str:
        return await self._hosted.node.pubsub.publish_feed(
            self._hosted, topic, data, kind=kind, trace=self._child_trace()
        )

    async def subscribe_feed(
        self, owner: str, topic: str = "*", *, durable: bool = True, replay: bool = False
    ) -> str:
        return await self._hosted.node.pubsub.subscribe_feed(
            self._hosted, owner, topic, durable=durable, replay=replay
        )

    async def read_feed_state(self, owner: str, topic: str) -> Event | None:
        return await self._hosted.node.pubsub.read_feed_state(self._hosted, owner, topic)

    async def observe(self, kind: str, agent: str | None = None) -> str:
        return await self._hosted.node.pubsub.observe(self._hosted, kind, agent)

    # -- files and artifacts (§7.5) -------------------------------------------------

    @property
    def files(self) -> list[FileAttachment]:
        """The request's ``payload.files`` as declared (§7.5.3); nothing was fetched."""
        payload = self._envelope.get("payload")
        return parse_files(payload.get("files")) if isinstance(payload, Mapping) else []

    @property
    def resources(self) -> list[Resource]:
        """The request's ``payload.resources`` as declared (§7.5.5); nothing was touched."""
        payload = self._envelope.get("payload")
        return parse_resources(payload.get("resources")) if isinstance(payload, Mapping) else []

    @property
    def attached_artifacts(self) -> list[dict[str, Any]]:
        """Artifacts added with :meth:`add_artifact`, sent with the answer."""
        return self._artifacts

    def _store(self) -> ArtifactClient:
        return ArtifactClient(self._hosted)

    async def put_artifact(
        self,
        data: bytes | Path,
        *,
        name: str | None = None,
        media_type: str,
        retention_s: int | None = None,
    ) -> dict[str, Any]:
        if isinstance(data, Path):
            stored = await self._store().put_file(data, name=name, media_type=media_type, retention_s=retention_s)
        else:
            stored = await self._store().put_bytes(bytes(data), name=name, media_type=media_type, retention_s=retention_s)
        return ref_part_of(stored)

    async def fetch_artifact(
        self, ref: str | Mapping[str, Any] | FileAttachment, *, max_bytes: int | None = None
    ) -> bytes:
        return await self._store().fetch(ref, max_bytes=max_bytes)

    async def stat_artifact(self, ref: str | Mapping[str, Any] | FileAttachment) -> dict[str, Any]:
        return await self._store().stat(ref)

    def _report_meter(self, meter: str | None, quantity: int | None) -> None:
        """The declared-meter half of :meth:`report_usage` (§13.5)."""
        if not is_meter_name(meter):
            raise ValueError(f"report_usage: meter {meter!r} is not a meter name ([a-z0-9_]{{1,64}})")
        assert isinstance(meter, str)
        if meter in OBSERVED_METERS:
            raise ValueError(f"report_usage: {meter!r} is an observed meter (the platform counts it, §13.5)")
        if type(quantity) is not int or quantity < 0:
            raise ValueError(f"report_usage: quantity of {meter!r} must be a non-negative integer")
        self._usage[meter] = quantity  # cumulative: the latest report supersedes (§13.5)

    @property
    def usage_report(self) -> list[dict[str, Any]]:
        """The declared usage reported so far, as ``payload.usage`` (§13.5)."""
        return [{"meter": m, "quantity": q} for m, q in self._usage.items()]

    def add_artifact(
        self,
        parts: Sequence[Mapping[str, Any]],
        *,
        name: str,
        media_type: str | None = None,
        rests_on: Sequence[Mapping[str, Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        artifact = artifact_object(
            parts, name=name, media_type=media_type, rests_on=rests_on, meta=meta,
            now_ms=self._hosted.node.now_ms(),
        )
        self._artifacts.append(artifact)
        return artifact

    async def verify_rests_on(
        self, declared: Sequence[Mapping[str, Any]] | None, *, countersigned: bool = False
    ) -> Verdict:
        return await self._store().verify_rests_on(declared, countersigned=countersigned)
