"""The node runtime: hosts agents on one connection (AgentMesh §3.2, §4, D.3).

The node holds every hosted agent's key, vouches for each (§4.4), registers
it on the connection-bound subject, subscribes its inbox, heartbeats for all
of them (§10.10), delivers locally between its own agents (§4.7) and sends
their requests, emits and answers. Each agent is isolated: one that fails to
start or whose handler crashes is reported and stopped alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import orjson

from meshnode.agent import Agent, AgentSettings, RemoteError, Reply
from meshnode.aio import wait_for
from meshnode.node import tasktally
from meshnode.node.allowance import AllowanceKeeper
from meshnode.node.commerce import AgreementGate
from meshnode.node.consumers import bind_shared, request_for
from meshnode.node.context import AgentContext
from meshnode.node.directory import AgentDirectory
from meshnode.node.drain import InboxDrain, failure_digest, pass_slots
from meshnode.node.gateway import CallContext, OutboundGateway
from meshnode.node.hosted import HostedAgent
from meshnode.node.inbox import InboxStore
from meshnode.node.looplag import LoopWatchdog, running_for
from meshnode.node.manifests import build_manifest
from meshnode.node.observe import Observability
from meshnode.node.open_tasks import OpenTaskJournal
from meshnode.node.pending import DeliveryWatch, PendingRequests, SendPacer
from meshnode.node.periodic import FailureDigest, PeriodicJob
from meshnode.node.pipeline import Path, RefusalCounter, receive_service_reply
from meshnode.node.pubsub import PubSub
from meshnode.node.resolver import NO_RESPONDERS, NOT_GRANTED, ManifestCache
from meshnode.node.settings import NodeSettings, wall_clock_ms
from meshnode.node.states import AgentState
from meshnode.node.supervise import supervise_retrying
from meshnode.node.tasks import RequesterTask, cancel_task
from meshnode.node.trust import VouchMemo
from meshnode.protocol import subjects
from meshnode.protocol.artifacts import parse_files, parse_resources
from meshnode.protocol.attestations import default_vouch_ttl_ms, make_vouch, renew_at_ms
from meshnode.protocol.envelope import (
    IdGenerator,
    build_envelope,
    encode_envelope,
    new_root_trace,
    sign_envelope,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair, is_valid_public
from meshnode.protocol.preflight import (
    check_envelope_size,
    preflight_request,
)
from meshnode.protocol.protections import DedupMemory, InboundGuard
from meshnode.protocol.tasks import TERMINAL_STATES, check_task_id
from meshnode.transport.connection import MeshConnection, Message
from meshnode.transport.errors import NoResponders, TransportTimeout
from meshnode.transport.grants import Grants, register_subjects
from meshnode.transport.jetstream import DurableSubscription
from meshnode.transport.permissions import JS_STREAM_INFO

__all__ = ["Node", "NodeSettings", "wall_clock_ms"]

log = logging.getLogger("meshnode.node")

#: Service calls asked again when their answer was lost to a reconnect: reads
#: and registrations (deregistrations included), idempotent by construction.
#: Other requests (tasks, artifacts, agreements) may not be run twice.
_RESENDABLE_KINDS = frozenset({"discover", "register"})


#: How often a node checks that the registry still holds its registrations.
REGISTRATION_CHECK_S = 60.0


class Node:
    """One node: its key, its connection, and the agents it hosts."""

    def __init__(
        self,
        *,
        settings: NodeSettings,
        node_key: KeyPair,
        connection: MeshConnection,
        clock: Callable[[], int] = wall_clock_ms,
        refusals: RefusalCounter | None = None,
        inbox: InboxStore | None = None,
        check_sender_vouch: bool = False,
        trust_attestation: dict[str, Any] | None = None,
        a2a: OutboundGateway | None = None,
        grants: Grants | None = None,
    ) -> None:
        self.settings = settings
        #: What the node's credential lets it publish (§14.3); a mesh built
        #: elsewhere may grant less than meshnode's own credentials do.
        self.grants = grants if grants is not None else Grants.unrestricted()
        # The registration subjects to try, in order; narrowed to the one that
        # worked once a registry answered (see register()).
        self._no_drain_logged = False
        self._register_subjects: list[str] = list(
            register_subjects(self.grants, subjects.registry_register(node_key.public_key))
        )
        self.key = node_key
        self.node_id = node_key.public_key
        self.connection = connection
        self._clock = clock
        self.ids = IdGenerator()
        self.pending = PendingRequests()
        self.agents: dict[str, HostedAgent] = {}
        #: Moves whenever an agent is hosted or unhosted: a client reading the
        #: roster in pages (Status, Agents.List) sees whether it changed between them.
        self.roster_version = 0
        self.by_id: dict[str, HostedAgent] = {}
        self.started_ms = clock()
        self.counters: Counter[str] = Counter()
        #: Agents configured here that are not running (failed to start): agent id
        #: -> name. Their registrations stay (they are meant to come back, with
        #: their broker buffer), so each beat says they are offline (§10.10
        #: per-agent override) and discovery does not show them online.
        self.absent_agents: dict[str, str] = {}
        #: Every inbound refusal of every intake, counted the one way (shared
        #: with the platform services the daemon hosts, when it passes one).
        self.refusals = refusals if refusals is not None else RefusalCounter()
        self.service_keys: dict[str, str] = {}  # service name -> key pinned on first use
        #: Keys of the platform services (§5.3 step 2 does not apply to them: no
        #: node vouches for a service): those pinned from service replies, those
        #: the pinned registry names in its registration replies, and the node's
        #: own services' (the daemon adds them).
        self.platform_keys: set[str] = set()
        # Targets' manifests, one registry look-up in flight per target (#21).
        self.manifest_cache = ManifestCache(self, ttl_s=settings.resolve_ttl_s)
        self.directory = AgentDirectory(self, self.manifest_cache)
        self._jobs: dict[str, PeriodicJob] = {}
        #: A handler blocking the loop is logged, counted and followed by a beat (#23).
        self.watchdog = LoopWatchdog(threshold_s=settings.loop_block_threshold_s, on_block=self._loop_blocked)
        # Delivery-status signals of requests in flight (§18.7): request id ->
        # (requester, whether the target has a buffer), under one subscription.
        self.watch = DeliveryWatch(connection, self.pending)
        self.inbox: InboxStore | None = inbox
        #: Tasks open here, so a crash can be told to their requesters at the next start.
        self.open_tasks: OpenTaskJournal | None = OpenTaskJournal(inbox) if inbox is not None else None
        if inbox is not None:
            # A live request is settled only once its answer reached the broker
            # (one PING/PONG per batch of settles): a pair settled while the answer
            # still sat in the client's write buffer would make a drain after a
            # kill -9 ack the copy of a request whose answer never left (#23).
            inbox.settle_barrier = self._answers_sent
        self.pacer = SendPacer(self.now_ms)
        # Senders' vouches checked against the registry (§9.2), when configured.
        self.trust: VouchMemo | None = VouchMemo(self) if check_sender_vouch else None
        #: The operator-signed §9.7 attestation of this node (trust_tier, role),
        #: carried in every manifest's ``node`` member for any verifier; None
        #: when the mesh issued none.
        self.trust_attestation: dict[str, Any] | None = trust_attestation
        # Events and feeds (meshnode.node.pubsub); observability publishing is
        # None unless the operator turned some of it on (meshnode.node.observe).
        self.pubsub = PubSub(self, emit_limit=settings.emit_limit, emit_window_ms=settings.emit_window_ms)
        self.observability: Observability | None = None
        self.drains: dict[str, InboxDrain] = {}
        # Shared by every agent's drain: how many passes read the broker at once,
        # and one digest of their failures (see node/drain.py).
        self._drain_slots = pass_slots()
        self._drain_failures = failure_digest()
        self._refusals: dict[str, FailureDigest] = {}  # registration refusals, by reason
        # The outbound gateway ([a2a.peers]; the daemon plugs in the A2A bridge's
        # client, meshnode.a2a.outbound.A2AOutbound); None when no peer is configured.
        self.a2a: OutboundGateway | None = a2a
        #: The §19.5 agreement check (the daemon plugs it in); None gates nothing.
        self.commerce: AgreementGate | None = None
        #: The owners' allowances (EXT-8; the daemon plugs it in); None meters nothing.
        self.allowance: AllowanceKeeper | None = None
        connection.on_reconnect(self._on_reconnect)
        connection.on_error(self._on_connection_error)

    @property
    def trusted_operators(self) -> frozenset[str]:
        """Operators whose §9.7 attestations this node believes: its own mesh's,
        the issuer of the attestation its control plane gave it (local policy)."""
        own = self.trust_attestation
        if not own or own.get("subject") != self.node_id:
            return frozenset()
        issuer = own.get("issuer")
        return frozenset((issuer,)) if isinstance(issuer, str) else frozenset()

    async def _on_reconnect(self) -> None:
        # A gap in the live subscription is exactly when the buffer holds mail
        # nothing dispatched: drain now (§16.4), each agent's pass as it can.
        for drain in self.drains.values():
            drain.trigger()
        # The broker came back: perhaps a mesh node that restarted without its
        # store. Whether the registry still knows this node's agents is asked now.
        job = self._jobs.get("registration-check")
        if job is not None:
            job.trigger()

    def _on_connection_error(self, message: str) -> None:
        if "slow consumer" in message:
            # The client dropped messages before a live handler saw them; the
            # buffers hold them: every drain looks on its next pass.
            for drain in self.drains.values():
                drain.note_live_mail()

    # -- basics --------------------------------------------------------------

    def now_ms(self) -> int:
        return self._clock()

    def audit(self, hosted: HostedAgent, env: Mapping[str, Any], *, direction: str, path: str) -> None:
        """Every envelope in or out, local or remote, passes here (§4.7: one audit path)."""
        self.counters[f"{direction}.{env.get('type')}.{path}"] += 1
        if self.observability is not None:
            self.observability.on_audit(hosted, env, direction, path)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s %s %s id=%s from=%s to=%s path=%s trace=%s",
                hosted.name,
                direction,
                env.get("type"),
                env.get("id"),
                env.get("from"),
                env.get("to"),
                path,
                (env.get("trace") or {}).get("trace_id"),
            )

    # -- hosting -------------------------------------------------------------

    def new_guard(self, agent_id: str, memory: DedupMemory | None = None) -> InboundGuard:
        return InboundGuard(
            agent_id,
            window=self.settings.freshness,
            max_inbound_chars=self.settings.max_inbound_chars,
            memory=memory or DedupMemory(self.settings.dedup_entries),
        )

    async def host(
        self,
        *,
        name: str,
        kind: str,
        agent_class: type[Agent],
        settings: Mapping[str, Any],
        key: KeyPair,
        interaction: str | None = None,
        max_concurrency: int | None = None,
    ) -> HostedAgent:
        """Instantiate, subscribe, start and register one agent.

        Raises on a failure to instantiate or subscribe; a registration refusal
        is recorded on the agent (``registration_error``) and logged, and the
        agent keeps serving local traffic.
        """
        if name in self.agents:
            raise ValueError(f"an agent named {name!r} is already hosted")
        with running_for(name, None, "its settings or constructor"):  # the plugin's code too
            parsed: AgentSettings = agent_class.Settings.model_validate(dict(settings))
            agent = agent_class(name, parsed)
        hosted = HostedAgent(
            self,
            name=name,
            kind=kind,
            agent=agent,
            key=key,
            guard=self.new_guard(key.public_key),
            interaction=interaction or agent_class.interaction,
            max_concurrency=max_concurrency or self.settings.agent_max_concurrency,
        )
        inbox = self.inbox
        if inbox is not None:
            # The duplicate memory survives restarts: what the inbox remembers is
            # read at the agent's first delivery (HostedAgent.load_remembered).
            agent_id, entries = key.public_key, self.settings.dedup_entries
            hosted.remembered = lambda: inbox.read_seen(agent_id, entries)
        hosted.start_settled = settled = asyncio.Event()  # requests wait on it (HostedAgent._until_started)
        self.agents[name] = hosted
        self.by_id[hosted.agent_id] = hosted
        self.roster_version += 1
        try:
            hosted.vouch = self._vouch(hosted.agent_id)
            hosted.manifest = self.build_manifest(hosted)
            await self._subscribe_inbox(hosted)
            def retrying(attempt: int, reason: str, delay: float) -> None:
                hosted.state = AgentState.RETRYING
                hosted.not_ready = {"reason": reason, "attempts": attempt, "next_in_s": delay}

            async def on_start() -> None:
                # Tasks on_start leaves running (a plugin's background loop) are
                # the agent's, and so is a block of the loop while it runs.
                # A sys.exit() in it fails this agent only (PluginExited).
                with running_for(hosted.name, hosted.spawned, "on_start"):
                    await agent.on_start(AgentContext(hosted, trace=new_root_trace()))

            await supervise_retrying(
                on_start,
                name=name,
                warn_s=self.settings.agent_start_warn_s,
                timeout_s=self.settings.agent_start_timeout_s,
                on_retry=retrying,
            )
            hosted.not_ready = None
            for pattern in agent_class.accepts:
                # The manifest's accepts are the patterns the agent subscribes to.
                tail = pattern.removeprefix("mesh.event.")
                await self.pubsub.subscribe_events(hosted, tail, durable=True)
            hosted.state = AgentState.RUNNING
        except BaseException:
            # A cancelled start too (a daemon stopped during start-up): the
            # agent never ran, so nothing of it keeps listening.
            hosted.state = AgentState.FAILED
            settled.set()
            await self._unsubscribe(hosted)
            raise
        settled.set()
        await self.register(hosted)
        self._schedule_vouch_renewal(hosted)
        if self.inbox is not None and self._may_drain(hosted):
            drain = InboxDrain(self, hosted, self.inbox, interval_s=self.settings.drain_interval_s,
                               slots=self._drain_slots, digest=self._drain_failures)
            self.drains[name] = drain
            drain.start()
        return hosted

    def _may_drain(self, hosted: HostedAgent) -> bool:
        """Whether the credential lets the node read ``hosted``'s redelivery buffer.

        meshnode's own credentials always do; §14.3's example grants no
        JetStream API, so there the live path is the only one: mail that arrives
        while the node is away stays in the broker's buffer (up to its limits)
        and is not drained. Said once rather than failing every drain pass.
        """
        stream = subjects.inbox_stream_name(hosted.agent_id)
        if self.grants.can_publish(JS_STREAM_INFO.format(stream=stream)):
            return True
        if not self._no_drain_logged:
            self._no_drain_logged = True
            log.info(
                "the node credential grants no JetStream API on %s: mail that arrives while this node "
                "is offline is not drained (only live delivery), for this and any such agent",
                stream,
            )
        return False

    async def unhost(self, name: str, *, deregister: bool = False, grace: float = 5.0) -> None:
        """Stop one agent: unsubscribe, let handlers finish, call on_stop.

        Registration (and with it the broker's offline buffer) is kept unless
        ``deregister``: a node that stops for a while must still get its mail.
        """
        hosted = self.agents.get(name)
        if hosted is None:
            return
        job = self._jobs.pop(f"vouch:{name}", None)
        if job is not None:
            await job.stop()
        drain = self.drains.pop(name, None)
        if drain is not None:
            await drain.stop()
        await self._unsubscribe(hosted)
        await hosted.cancel_tasks(grace)
        async def on_stop() -> None:
            with running_for(name, hosted.spawned, "on_stop"):  # a sys.exit() in it: PluginExited
                await hosted.agent.on_stop()

        try:
            await wait_for(on_stop(), timeout=grace)
        except Exception as exc:
            log.warning("agent %s on_stop failed: %s", name, exc)
        if deregister and hosted.registered:
            try:
                await self.deregister(hosted)
            except Exception as exc:
                log.warning("deregistering %s failed: %s", name, exc)
        hosted.state = AgentState.STOPPED
        if hosted.start_settled is not None:
            hosted.start_settled.set()  # a request still waiting for its start is refused
        del self.agents[name]
        self.by_id.pop(hosted.agent_id, None)
        self.roster_version += 1
        self.pubsub.forget(hosted)

    async def _subscribe_inbox(self, hosted: HostedAgent) -> None:
        async def on_message(msg: Message) -> None:
            drain = self.drains.get(hosted.name)
            if drain is not None:
                drain.note_live_mail(len(msg.data))
            try:
                await hosted.receive(msg.data, source=Path.LIVE, reply=msg.reply or None)
            except Exception:  # the pipeline must never kill the subscription
                hosted.agent.log.exception("inbound pipeline failed")

        sub = await self.connection.subscribe(subjects.agent_inbox(hosted.agent_id), on_message)
        hosted.subscriptions.append(sub)

    async def _unsubscribe(self, hosted: HostedAgent) -> None:
        subs, hosted.subscriptions = hosted.subscriptions, []
        for sub in subs:
            try:
                await sub.unsubscribe()
            except Exception:  # already gone with the connection
                pass

    # -- vouch, manifest, registration ----------------------------------------

    def _vouch(self, agent_id: str) -> dict[str, Any]:
        now = self.now_ms()
        ttl = default_vouch_ttl_ms(
            self.settings.availability_class, configured_ttl_ms=self.settings.vouch_ttl_ms
        )
        return make_vouch(self.key, agent_id, now, now + ttl)

    async def revouch(self, hosted: HostedAgent) -> None:
        """A fresh vouch and a re-registration now (renew-now, or at two thirds)."""
        hosted.vouch = self._vouch(hosted.agent_id)
        hosted.manifest = self.build_manifest(hosted)
        await self.register(hosted)

    def _schedule_vouch_renewal(self, hosted: HostedAgent) -> None:
        async def renew() -> None:
            if self.now_ms() < renew_at_ms(hosted.vouch) and hosted.registered:
                return
            await self.revouch(hosted)

        misses = 0  # checks in a row that found the agent unregistered

        def next_check() -> float:
            # Wake at the renewal point (two thirds of the vouch's own life),
            # and also every 10 minutes so a missed registration is retried.
            # A registration that failed (a registry that timed out under a
            # start of thousands of agents, issue #21) is retried after 5 s,
            # then 10, 20, 40, 60 s, each stretched by up to half (never past
            # 60 s), so the agents that failed together do not all come back together.
            nonlocal misses
            due = (renew_at_ms(hosted.vouch) - self.now_ms()) / 1000
            if hosted.registered:
                misses = 0
            else:
                retry = min(60.0, 5.0 * 2**misses * random.uniform(1.0, 1.5))
                misses = min(misses + 1, 8)
                due = min(due, retry)
            return max(5.0, min(due, 600.0))

        job = PeriodicJob(f"vouch:{hosted.name}", renew, next_check, jitter=0.05, first_delay=next_check())
        self._jobs[job.name] = job
        job.start()

    def _node_member(self, hosted: HostedAgent) -> dict[str, Any]:
        node: dict[str, Any] = {"id": self.node_id, "attestation": hosted.vouch}
        if self.trust_attestation is not None:
            # Portable (§9.7): verifiable against the operator key alone, by the
            # registry and by anyone who reads the manifest back.
            node["trust_attestation"] = self.trust_attestation
        return node

    async def set_trust_attestation(self, attestation: dict[str, Any] | None) -> None:
        """Carry a new operator attestation; re-register every agent that carried the old one."""
        if attestation == self.trust_attestation:
            return
        self.trust_attestation = attestation

        async def reregister(hosted: HostedAgent) -> None:
            if hosted.manifest:
                hosted.manifest = self.build_manifest(hosted)
                await self.register(hosted)

        await self.each_agent(reregister)

    async def each_agent(self, step: Callable[[HostedAgent], Awaitable[None]]) -> None:
        """``step`` for every hosted agent, ``settings.registrations_at_once`` at a
        time: each is mostly a wait on the registry, and one after another a
        10,000-agent node took minutes. Every agent gets its step even when
        another's fails; the first failure is raised once all are done."""
        gate = asyncio.Semaphore(self.settings.registrations_at_once)

        async def one(hosted: HostedAgent) -> None:
            async with gate:
                await step(hosted)

        outcomes = await asyncio.gather(*(one(h) for h in list(self.agents.values())), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    def build_manifest(self, hosted: HostedAgent) -> dict[str, Any]:
        """The manifest this node registers for ``hosted`` (:func:`meshnode.node.manifests.build_manifest`)."""
        return build_manifest(hosted, self._node_member(hosted), self.settings.max_inbound_chars)

    async def service_call(
        self, hosted: HostedAgent, subject: str, kind: str, payload: Any, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """A signed request to a platform service; returns the verified reply's payload.

        ``timeout`` (seconds) defaults to ``settings.registry_timeout_s``.
        """
        return await self._service_call_as(hosted.key, subject, kind, payload, timeout=timeout)

    async def _service_call_as(
        self, key: KeyPair, subject: str, kind: str, payload: Any, *, timeout: float | None = None
    ) -> dict[str, Any]:
        if not self.grants.can_publish(subject):
            # The broker would drop it and the caller wait out the timeout; on a
            # mesh built elsewhere (§14.3's example grants no mesh.registry.get.*)
            # that is every lookup. Answer at once, as the service's absence.
            raise ProtocolError(
                "AGENT_UNAVAILABLE",
                f"the node credential does not grant publishing to {subject}",
                {"reason": NOT_GRANTED, "subject": subject},
            )
        for attempt in (1, 2):
            env = build_envelope(
                kind, key.public_key, now_ms=self.now_ms(), payload=payload, ids=self.ids
            )
            sign_envelope(env, key)
            disconnects = self.connection.disconnects
            try:
                msg = await self.connection.request(
                    subject, encode_envelope(env), timeout=timeout or self.settings.registry_timeout_s
                )
            except NoResponders:
                raise ProtocolError(
                    "AGENT_UNAVAILABLE", f"no service answers on {subject}",
                    {"reason": NO_RESPONDERS, "subject": subject},
                ) from None
            except TransportTimeout:
                # An answer sent while the connection was down is lost with it:
                # a planned reconnect (a roster change) falls inside a look-up
                # now and then (the soak saw a vouch look-up time out, and the
                # sender let through as unknown). Asked again once, as a new
                # envelope (the service remembers ids), for the kinds that may
                # be: reads and registrations, which write the same state twice.
                if attempt == 1 and kind in _RESENDABLE_KINDS and self.connection.disconnects != disconnects:
                    continue
                raise ProtocolError("TRANSPORT_TIMEOUT", f"no answer on {subject}") from None
            break
        reply = receive_service_reply(msg.data, env, subject, self.service_keys, self.refusals)
        self.platform_keys.add(reply["from"])  # verified and pinned: a platform key
        if reply.get("error"):
            raise RemoteError(reply)
        payload_out = reply.get("payload")
        return payload_out if isinstance(payload_out, dict) else {}

    async def register(self, hosted: HostedAgent) -> None:
        """Register on the connection-bound subject (§4.4 b); refusals are surfaced.

        When the credential grants the untokenized ``mesh.registry.register`` too
        (§14.3's example; meshnode's own credentials also grant it, so the
        registry can answer UNAUTHORIZED), a bound attempt that *nobody listens
        to* (no responders: a registry that serves the untokenized form only) is
        retried there, and once that succeeds the untokenized subject is kept
        for every later registration (logged once). A timeout or a refusal is
        never retried on the other form: meshnode's registry listens on the
        bound subject, so its own nodes never fall back. Without the bound grant
        the untokenized subject is the only one.
        """
        try:
            await self._register_once(hosted)
        except ProtocolError as exc:
            hosted.registered = False
            hosted.registration_error = f"{exc.code}: {exc.message}"
            # One digest per reason: a registry that times out for thousands of
            # agents makes a few lines, and a different reason still shows at once.
            digest = self._refusals.get(exc.code)
            if digest is None:
                digest = self._refusals[exc.code] = FailureDigest(
                    f"registrations ({exc.code})", log, level=logging.ERROR, verb="refused")
            digest.failing(f"registration of {hosted.name} ({hosted.agent_id})", hosted.registration_error)
            return
        hosted.registered = True
        hosted.registration_error = None
        log.info("registered %s as %s", hosted.name, hosted.agent_id)

    async def _register_once(self, hosted: HostedAgent) -> None:
        candidates = self._register_subjects
        unanswered: str | None = None  # the bound subject nobody listened on
        for i, subject in enumerate(candidates):
            last = i == len(candidates) - 1
            try:
                answer = await self.service_call(hosted, subject, "register", hosted.manifest)
            except ProtocolError as exc:
                if last or exc.code != "AGENT_UNAVAILABLE":
                    raise
                unanswered = subject
                continue
            if unanswered is not None:
                log.info(
                    "no registry listens on %s; registered on %s, kept from now on (spec §14.1: both forms are accepted)",
                    unanswered, subject,
                )
                self._register_subjects = [subject]
            # The registry's signed word (its key pinned) for its sibling services' keys.
            named = answer.get("platform_keys")
            if isinstance(named, list):
                self.platform_keys.update(k for k in named if isinstance(k, str) and is_valid_public(k))
            return

    async def deregister(self, hosted: HostedAgent) -> None:
        await self.service_call(hosted, "mesh.registry.deregister", "register", {"deregister": True})
        hosted.registered = False

    async def deregister_stale(self, name: str, key: KeyPair) -> bool:
        """Deregister an agent this node hosted before but does not host now.

        A restart without an agent (removed from the configuration, disabled,
        added at runtime and not saved) left its registration behind, and with
        this node beating, discovery would show it ``online`` though nothing
        answers it. Its key is still in the keystore, so it can sign its own
        deregistration (§9.2: an agent deregisters only itself). True when a
        registration existed.
        """
        reply = await self._service_call_as(key, "mesh.registry.deregister", "register", {"deregister": True})
        existed = bool(reply.get("existed"))
        if existed:
            log.info("deregistered %s (%s): hosted here before, not now", name, key.public_key)
        return existed

    async def resolve(self, requester: HostedAgent, target: str) -> dict[str, Any]:
        """The target's manifest: hosted here, cached, or from the registry (§14.4)."""
        local = self.by_id.get(target)
        if local is not None:
            return local.manifest
        return await self.manifest_cache.resolve(requester, target)

    # -- delivery --------------------------------------------------------------

    async def _answers_sent(self) -> None:
        """Everything published so far has reached the broker (a flush round trip)."""
        await self.connection.flush(timeout=5)

    async def deliver(self, sender: HostedAgent, env: dict[str, Any], to_agent: str) -> None:
        """Send a signed envelope to an agent's inbox: locally when hosted here (§4.7)."""
        data = encode_envelope(env)
        target = self.by_id.get(to_agent)
        self.audit(sender, env, direction="out", path="local" if target else "live")
        if target is not None:
            await target.receive(data, source=Path.LOCAL)
            return
        check_envelope_size(len(data), self.connection.max_payload)
        await self.connection.publish(subjects.agent_inbox(to_agent), data)

    def queued_locally(self, requester: str, request_id: str, inbox_id: str) -> None:
        self.pending.mark_queued(requester, request_id, inbox_id, acked=True)

    async def reply_plain(self, reply_subject: str, obj: Any) -> None:
        """Node-level delivery-status signal on a transport reply subject (§18.7)."""
        await self.connection.publish(reply_subject, orjson.dumps(obj))

    def on_respond(self, hosted: HostedAgent, env: Mapping[str, Any]) -> bool:
        """Route a checked respond to the request waiting for it; False when none is."""
        if self.pending.deliver(hosted.agent_id, env):
            return True
        hosted.counters["unmatched_respond"] += 1
        hosted.agent.log.info(
            "respond %s from %s matches no request in flight", env.get("in_reply_to"), env.get("from")
        )
        return False

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
    ) -> Reply:
        """Pre-flight, sign and send a request; await the substantive reply.

        ``task_id`` makes it a follow-up answering a Task paused in
        ``input_required``/``auth_required`` (§6.5): ``input`` is the input
        asked for, ``offering`` and ``context_id`` the Task's. Its answer is
        the Task ``working`` again (a Reply with ``task``), or an error
        (TASK_NOT_FOUND, TASK_INVALID_TRANSITION, INPUT_INVALID).

        ``files`` and ``resources`` ride in the payload beside the input
        (§7.5.3, §7.5.5), checked here as the recipient would check them.
        ``meta`` is the envelope's extension metadata (the A2A bridge puts the
        mesh extension's call chain and origin there).
        """
        manifest = await self.resolve(hosted, target)
        await self.pacer.wait_turn(hosted.agent_id, target, manifest, timeout, hosted.counters)
        payload: dict[str, Any] = {"offering": offering}
        if input is not None:
            payload["input"] = input
        if config:
            payload["config"] = dict(config)
        if files:
            payload["files"] = [dict(f) for f in files]
            parse_files(payload["files"])
        if resources:
            payload["resources"] = [dict(r) for r in resources]
            parse_resources(payload["resources"])
        preflight_request(payload, manifest)
        env = build_envelope(
            "request",
            hosted.agent_id,
            now_ms=self.now_ms(),
            to=target,
            payload=payload,
            trace=trace,
            budget=budget,
            context_id=context_id if isinstance(context_id, str) else None,
            meta=meta,
            task_id=check_task_id(task_id) if task_id is not None else None,
            ids=self.ids,
        )
        sign_envelope(env, hosted.key)
        data = encode_envelope(env)
        self.pending.open(hosted.agent_id, env["id"], target)
        local = self.by_id.get(target)
        self.audit(hosted, env, direction="out", path="local" if local else "live")
        try:
            if local is not None:
                await local.receive(data, source=Path.LOCAL)
            else:
                check_envelope_size(len(data), self.connection.max_payload)
                endpoints = manifest.get("endpoints")
                inbox = endpoints.get("inbox") if isinstance(endpoints, Mapping) else None
                inbox = inbox if isinstance(inbox, str) else manifest.get("endpoint")
                if not isinstance(inbox, str):
                    raise ProtocolError("AGENT_UNAVAILABLE", "the target's manifest names no inbox")
                await self.watch.publish(hosted.agent_id, env["id"], inbox, data,
                                         buffered=not manifest.get("sandbox", False))
            reply = await self.pending.wait(hosted.agent_id, env["id"], timeout)
        finally:
            self.pending.close(hosted.agent_id, env["id"])
            self.watch.forget(env["id"])
        if reply.error is not None or reply.status == "failed":
            raise RemoteError(reply.envelope)
        if reply.task_id is not None and reply.status not in TERMINAL_STATES:
            sign_chunks = bool(config and config.get("sign_chunks"))
            reply = dataclasses.replace(reply, task=RequesterTask(hosted, reply.envelope, sign_chunks=sign_chunks))
        return reply

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
    ) -> Reply:
        """Call the external A2A agent ``[a2a.peers.<peer>]`` for ``hosted``
        through the outbound gateway the daemon plugged in (:class:`OutboundGateway`)."""
        if self.a2a is None:
            raise ProtocolError("NOT_FOUND", f"no A2A peer {peer!r} is configured ([a2a.peers.{peer}])",
                                {"peer": peer})
        call = CallContext(agent_id=hosted.agent_id, agent_key=hosted.key, trace=trace,
                           envelope=envelope, budget=budget)
        self.counters["a2a.calls"] += 1
        return await self.a2a.call(peer, offering, input, call, timeout=timeout, stream=stream)

    # -- tasks -----------------------------------------------------------------

    async def publish_task(self, subject: str, env: Mapping[str, Any]) -> None:
        """A task update through JetStream: acked (backpressure), deduplicated by
        ``Nats-Msg-Id`` = envelope id (§18.8), recorded by MESH_TASKS."""
        data = encode_envelope(env)
        check_envelope_size(len(data), self.connection.max_payload)
        # Retried through an ack lost in a reconnect: MESH_TASKS deduplicates a stored repeat.
        await self.connection.jetstream.publish_deduplicated(subject, data, msg_id=str(env["id"]))

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
    ) -> None:
        """One stream chunk on ``mesh.task.{id}.stream`` (§11.2, §11.6)."""
        payload: dict[str, Any] = {"status": "completed" if final else "working", "chunk_index": index, "final": final}
        if data is not None:
            payload["data"] = data
            payload["content_type"] = "text/plain" if isinstance(data, str) else "application/json"
        if final:
            payload["chunk_count"] = chunk_count
        env = build_envelope(
            "respond",
            hosted.agent_id,
            now_ms=self.now_ms(),
            to=task.requester,
            in_reply_to=task.request["id"],
            task_id=task.task_id,
            trace=task.request.get("trace"),
            payload=payload,
            ids=self.ids,
        )
        if sign:
            sign_envelope(env, hosted.key)
        subject = subjects.task_stream(task.task_id)
        if final or index % 64 == 63:
            # The final chunk, and every 64th, wait for the stream's ack: bounded
            # in-flight chunks (§11.4) and everything stored in order before "final".
            await self.connection.jetstream.publish_deduplicated(subject, encode_envelope(env), msg_id=str(env["id"]))
        else:
            await self.connection.publish(subject, encode_envelope(env))

    async def cancel_task(
        self, hosted: HostedAgent, responder: str, task_id: str, reason: str, note: str | None, *, wait: bool = True
    ) -> dict[str, Any]:
        """Cancel a task ``hosted`` asked for (:func:`meshnode.node.tasks.cancel_task`)."""
        return await cancel_task(self, hosted, responder, task_id, reason, note, wait=wait)

    # -- events ----------------------------------------------------------------

    async def subscribe_events(
        self, hosted: HostedAgent, pattern: str, *, durable: bool = True, replay: bool = False
    ) -> str:
        """Subscribe ``hosted`` to ``mesh.event.{pattern}`` (:meth:`PubSub.subscribe_events`)."""
        return await self.pubsub.subscribe_events(hosted, pattern, durable=durable, replay=replay)

    async def emit(
        self, hosted: HostedAgent, domain: str, event_type: str, data: Any, *, trace: Mapping[str, Any]
    ) -> None:
        """Publish ``hosted``'s event (:meth:`PubSub.emit`)."""
        await self.pubsub.emit(hosted, domain, event_type, data, trace=trace)

    async def durable_consume(
        self,
        hosted: HostedAgent,
        subject: str,
        *,
        stream: str,
        name: str,
        replay: bool,
        deliver: Callable[[Message], Awaitable[None]],
    ) -> DurableSubscription:
        """A durable push consumer (§18.6 config) whose messages are acked only once
        ``deliver`` — the pipeline and the agent's handler — has run: a crash before
        the ack redelivers, a refusal is acked (it must not come back)."""

        async def on_durable(msg: Message) -> None:
            try:
                await deliver(msg)
            except Exception:
                hosted.agent.log.exception("%s pipeline failed", stream)
            await msg.ack()

        async def direct() -> DurableSubscription:
            return await self.connection.jetstream.durable_push(
                subject, on_durable, stream=stream, durable=name, replay=replay, max_deliver=5
            )

        # Made by the consumer service, which asserts its configuration: a
        # participant may not create consumers on the shared streams (#22).
        return await bind_shared(hosted, request_for(stream, subject, replay=replay), name, on_durable, fallback=direct)


    # -- heartbeat -------------------------------------------------------------

    def heartbeat_payload(self, availability: str = "online") -> dict[str, Any]:
        active = sum(h.active_tasks for h in self.agents.values())
        load = os.getloadavg()[0] / (os.cpu_count() or 1) if hasattr(os, "getloadavg") else 0.0
        return {
            "availability": availability,
            "active_tasks": active,
            "capacity": max(1, len(self.agents)) * 16,
            "uptime_seconds": max(0, (self.now_ms() - self.started_ms) // 1000),
            "load": round(min(load, 1.0), 3),
        }

    async def heartbeat(self, availability: str = "online") -> None:
        """One signed beat from the node key on mesh.heartbeat.{node_id} (§10.10)."""
        env = build_envelope(
            "emit", self.node_id, now_ms=self.now_ms(), payload=self.heartbeat_payload(availability), ids=self.ids
        )
        sign_envelope(env, self.key)
        await self.connection.publish(subjects.heartbeat(self.node_id), encode_envelope(env))
        self.counters["heartbeats"] += 1
        if availability != "offline":
            await self._beat_absent_agents()

    async def _beat_absent_agents(self) -> None:
        """The per-agent ``offline`` override for every agent configured here but
        not running: failed to start, or failed since (supervised)."""
        absent = dict(self.absent_agents)
        absent.update({h.agent_id: h.name for h in self.agents.values() if h.state == AgentState.FAILED})
        for agent_id in absent:
            if agent_id in self.by_id and self.by_id[agent_id].state != AgentState.FAILED:
                continue  # came back meanwhile
            env = build_envelope(
                "emit", self.node_id, now_ms=self.now_ms(), payload={"availability": "offline"}, ids=self.ids
            )
            sign_envelope(env, self.key)
            await self.connection.publish(subjects.heartbeat(self.node_id, agent_id), encode_envelope(env))

    async def say_offline(self) -> None:
        """A graceful stop's last beat: ``availability: offline`` (§10.10).

        Presence takes a node at its word, so the mesh sees this node (and
        discovery its agents) offline at once rather than after two missed
        beats. The heartbeat job stops first, so no later "online" beat
        contradicts it. Best effort: a stop must not wait on a lost mesh.
        """
        job = self._jobs.pop("heartbeat", None)
        if job is not None:
            await job.stop()
        try:
            await self.heartbeat("offline")
            await self.connection.flush(timeout=2)
        except Exception as exc:
            log.info("could not announce going offline (%s); presence will notice the silence", exc)

    def _loop_blocked(self, lag_s: float, agent: str) -> None:
        """The watchdog saw the loop stalled ``lag_s`` (on the loop, right after)."""
        self.counters["loop_blocks"] += 1
        hosted = self.agents.get(agent)
        if hosted is not None:
            hosted.counters["loop_blocked"] += 1
            log.warning(
                "the event loop was blocked for %.1f s by a handler of agent %s: everything on this node "
                "(heartbeats, other agents, the admin socket) waited; a handler must await, not block "
                "(run blocking work with asyncio.to_thread)", lag_s, agent,
            )
        else:
            log.warning("the event loop was blocked for %.1f s outside any agent's handler", lag_s)
        # Presence judges silence (2 x heartbeat interval): beat now rather than
        # at the next tick, so a stall is followed at once by proof of life.
        job = self._jobs.get("heartbeat")
        if job is not None:
            job.trigger()

    def start_watchdog(self) -> None:
        """Start the loop-lag watchdog and the per-agent task tally (idempotent);
        stopped by :meth:`stop_jobs`."""
        self.watchdog.start()
        tasktally.install()

    def start_heartbeat(self) -> None:
        job = PeriodicJob("heartbeat", self.heartbeat, self.settings.heartbeat_interval_s, first_delay=0.0)
        self._jobs[job.name] = job
        job.start()

    def start_registration_check(self) -> None:
        """Check every REGISTRATION_CHECK_S that the registry still holds this
        node's registrations (:meth:`check_registrations`)."""
        job = PeriodicJob("registration-check", self.check_registrations, REGISTRATION_CHECK_S, jitter=0.1)
        self._jobs[job.name] = job
        job.start()

    async def check_registrations(self) -> None:
        """Ask the registry for one registered agent of this node; when it answers
        NOT_FOUND, its store was lost or reset (a mesh node whose JetStream
        directory was wiped, a rebuilt cluster): register every agent again.
        Without this the mesh knew none of this node's agents (they
        could not be found, and their requests were refused as unvouched) until
        each vouch's renewal, up to two days later. One look-up a minute per node."""
        probe = next((h for h in self.agents.values() if h.registered and h.manifest), None)
        if probe is None:
            return
        subject = subjects.registry_get(probe.agent_id)
        if not self.grants.can_publish(subject):
            return  # a mesh built elsewhere may grant no look-up: nothing to ask with
        try:
            await self.service_call(probe, subject, "discover", {"agent_id": probe.agent_id})
        except RemoteError as exc:
            if exc.code != "NOT_FOUND":
                return
        except ProtocolError:
            return  # the registry away or slow: not the question asked here
        else:
            return
        log.warning(
            "the registry no longer knows this node's agents (%s: NOT_FOUND): its store was lost or reset; "
            "registering every agent again", probe.name,
        )

        async def again(hosted: HostedAgent) -> None:
            if hosted.manifest:
                await self.register(hosted)

        await self.each_agent(again)

    async def stop_jobs(self) -> None:
        for job in list(self._jobs.values()):
            await job.stop()
        self._jobs.clear()
        await self.watchdog.stop()
        tasktally.uninstall()
        for drain in self.drains.values():
            await drain.stop()
        if self.observability is not None:
            await self.observability.stop()
        await self.pubsub.stop()
        await self.manifest_cache.close()  # refreshes in flight
        await self.directory.close()

    # -- status ----------------------------------------------------------------

    def agent_status(self, hosted: HostedAgent) -> dict[str, Any]:
        entry = hosted.status(self.drain_status(hosted.name), self.pubsub.subscriptions(hosted))
        if self.allowance is not None:
            # EXT-8: Tasks held for the owner (ask_owner) until the allowance is raised.
            entry["allowance_held"] = sorted(self.allowance.holds.get(hosted.agent_id, {}))
        return entry

    def drain_status(self, name: str) -> dict[str, Any] | None:
        """The mailbox drain of agent ``name`` for status, or None without one."""
        drain = self.drains.get(name)
        return drain.status() if drain is not None else None
