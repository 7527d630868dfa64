"""A hosted agent: its key, manifest, guards, counters and tasks, and the request route.

Every delivery enters through an intake of :mod:`meshnode.node.pipeline`
(:meth:`HostedAgent.receive` is the inbox intake, bound from there); what
passes the §22 guard is routed here, in a fixed order:

    admission (offering, content type, input schema, budget) ─► accept (as
    :func:`~meshnode.node.pipeline.first_reply` plans) ─► fence ─► handler ─►
    signed respond to the sender's inbox

Refusals follow §22.7: silent where it says silent, CONTEXT_TOO_LARGE where it
must answer; every refusal is counted by :meth:`HostedAgent.refuse` and raises
a local signal.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import jsonschema

from meshnode.agent import Agent, Event, OfferingSpec
from meshnode.aio import BackgroundTasks
from meshnode.node import pipeline
from meshnode.node.artifacts import spill_oversized_output
from meshnode.node.commerce import UNPRODUCED_OBSERVED_METERS, declared_skus
from meshnode.node.context import AgentContext
from meshnode.node.inbox import InboxStore, InboxUnwritable
from meshnode.node.looplag import running_for
from meshnode.node.manifests import describe
from meshnode.node.metrics import LatencyHistogram
from meshnode.node.pipeline import SIGNAL_PREFIX, Intake, Path, first_reply
from meshnode.node.pluginexit import PluginExited
from meshnode.node.states import AgentState
from meshnode.node.tasks import ResponderTask, cancel_task, new_task_id, propagated
from meshnode.node.tasktally import TaskCount
from meshnode.protocol.accept import FirstReply, InboundOutcome, build_queued_ack
from meshnode.protocol.artifacts import parse_files, parse_resources
from meshnode.protocol.budget import check_admission, parse_budget
from meshnode.protocol.cancel import check_cancelable, parse_cancel_input
from meshnode.protocol.commerce import Sku
from meshnode.protocol.envelope import build_envelope, child_trace, sign_envelope
from meshnode.protocol.errors import ProtocolError, error_object
from meshnode.protocol.fencing import FrameProvenance, frame_payload
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.offerings import normalize_request_payload, offering_id_of
from meshnode.protocol.preflight import check_content_type
from meshnode.protocol.protections import FreshnessWindow, InboundGuard
from meshnode.protocol.ratelimit import SlidingWindowLimiter
from meshnode.protocol.tasks import TERMINAL_STATES, check_follow_up

if TYPE_CHECKING:
    from meshnode.node.port import NodePort

__all__ = ["DESCRIBE_OFFERING", "HostedAgent"]

log = logging.getLogger("meshnode.pipeline")

DESCRIBE_OFFERING = "describe"
CANCEL_OFFERING = "task.cancel"
REGISTRY_PROBE_OFFERING = "__registry_probe__"



class _Slot:
    """One admitted request's place in :attr:`HostedAgent.in_flight`, released once."""

    __slots__ = ("held", "hosted")

    def __init__(self, hosted: HostedAgent) -> None:
        hosted.in_flight += 1
        self.hosted = hosted
        self.held = True

    def release(self, *_: object) -> None:
        if self.held:
            self.held = False
            self.hosted.in_flight -= 1


#: How long a stopping agent's cancelled handler may take to tell its requester.
_TELL_STOPPED_S = 2.0


class HostedAgent:
    """One agent hosted by this node: its key, manifest, guard, counters and tasks."""

    def __init__(
        self,
        node: NodePort,
        *,
        name: str,
        kind: str,
        agent: Agent,
        key: KeyPair,
        guard: InboundGuard,
        interaction: str,
        max_concurrency: int = 64,
    ) -> None:
        self.node = node
        self.name = name
        self.kind = kind
        self.agent = agent
        self.key = key
        self.agent_id = key.public_key
        self.guard = guard
        #: Reads the pairs the node inbox remembers for this agent (§22.2) into
        #: ``guard``'s memory; None once read (or with no inbox). See load_remembered.
        self.remembered: Callable[[], Awaitable[list[tuple[str, str]]]] | None = None
        self._remembering: asyncio.Future[None] | None = None
        self.interaction = interaction
        self.offerings: dict[str, OfferingSpec] = type(agent).offerings()
        self._validators: dict[str, jsonschema.protocols.Validator] = {}
        for spec in self.offerings.values():
            if spec.input_schema is not None:
                schema = dict(spec.input_schema)
                cls = jsonschema.validators.validator_for(schema)
                cls.check_schema(schema)
                self._validators[spec.id] = cls(schema)
        # §19.1: the SKUs the class declares, digests computed here (a malformed
        # SKU fails this agent's start, naming the member at fault).
        self.skus: tuple[Sku, ...] = declared_skus(type(agent).skus, self.offerings.values())
        for sku in self.skus:
            meter = sku.price.rated_meter
            if meter in UNPRODUCED_OBSERVED_METERS:
                # Said at start, not found on the invoice: nothing would ever be charged.
                agent.log.warning(
                    "SKU %r is priced on the observed meter %r, which this node does not produce yet "
                    "(only 'requests' and declared meters are metered): it will rate nothing; see "
                    "docs/guides/pricing.md, 'What is implemented, and what is not'", sku.sku, meter,
                )
        self.manifest: dict[str, Any] = {}
        self.vouch: dict[str, Any] = {}
        self.registered = False
        self.registration_error: str | None = None
        self.state: AgentState = AgentState.STARTING
        #: While on_start raises NotReady: {reason, attempts, next_in_s} (None otherwise).
        self.not_ready: dict[str, Any] | None = None
        #: Set by the node that starts this agent (Node.host) once its start settled
        #: (running, failed or stopped). Its inbox is subscribed before on_start (the
        #: responds to on_start's own requests arrive there), so a request arriving
        #: meanwhile waits on it: no handler runs before on_start returned. None: an
        #: agent no node starts (tests build some directly), never held.
        self.start_settled: asyncio.Event | None = None
        self._waiting_for_start = 0
        self.counters: Counter[str] = Counter()
        self.latency = LatencyHistogram()
        self._signal_logged: dict[str, float] = {}
        #: Digests of raw messages the live path could not verify (bounded, first in first out).
        self.refused_bytes: dict[bytes, None] = {}
        #: Live requests waiting on a task of their own for their sender's vouch
        #: look-up (pipeline.receive); bounded by pipeline.MAX_VOUCH_WAITS.
        self.vouch_waits = 0
        self.describe_limiter = SlidingWindowLimiter(limit=60, window_ms=60_000)
        # Events get their own duplicate memory (§22.2): a flood of events must
        # not evict the entries that keep requests from running twice.
        self.event_guard: InboundGuard = node.new_guard(key.public_key)
        self._tasks = BackgroundTasks()
        self.subscriptions: list[Any] = []
        # Tasks this agent is performing (§7), by task id, with the asyncio task
        # running each handler so a cancel can stop it.
        self.tasks: dict[str, ResponderTask] = {}
        self._task_runners: dict[str, asyncio.Task[Any]] = {}
        #: Set when the agent stops (the node stopping, the agent removed or
        #: restarted): a handler cancelled then tells its requester so.
        self.stopping = False
        #: Requests admitted and not finished (their handlers, running or about
        #: to), against the limit past which a request is refused busy (#23).
        self.in_flight = 0
        self.max_concurrency = max_concurrency
        #: The asyncio tasks this agent's handlers made (and those made in
        #: turn), counted by the loop's task factory (issue #23 item 10).
        self.spawned = TaskCount(name)

    async def load_remembered(self) -> None:
        """Read what the node inbox remembers into the duplicate memory, once.

        Awaited by the inbox intake before this agent's first §22.2 check, not
        at start-up: a restarted node whose agents had been busy read 5,000
        pairs for each of them before it could register any (1,000 busy agents
        registered 20-22 s after a restart instead of 6 s), and held the
        memories of agents that never heard from anyone again.

        The read is off the event loop (the inbox's reader thread,
        :meth:`InboxStore.read_seen`): 6-9 ms an agent of 5,000 pairs here
        (~60 ms with the inbox out of the page cache) held the loop and every
        other agent at each busy agent's first delivery after a restart. One
        read per agent: deliveries that come meanwhile wait for
        the same one, and the memory is filled on the loop before any of them
        goes on to its check. A failed read is raised to each, and tried again
        at the next delivery.
        """
        if self.remembered is None:
            return
        if self._remembering is None:
            self._remembering = asyncio.ensure_future(self._read_remembered(self.remembered))
            # Read here too: with every waiter cancelled, a failure would go unretrieved.
            self._remembering.add_done_callback(lambda f: f.cancelled() or f.exception())
        # Shielded: one delivery cancelled while it waits must not cancel the read the others wait for.
        await asyncio.shield(self._remembering)

    async def _read_remembered(self, read: Callable[[], Awaitable[list[tuple[str, str]]]]) -> None:
        try:
            pairs = await read()
        finally:
            self._remembering = None
        if self.remembered is read:
            self.guard.memory.restore(pairs)
            self.remembered = None

    # -- bookkeeping ---------------------------------------------------------

    def spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        """Run work owned by this agent; cancelled when the agent stops."""
        task: asyncio.Task[None] = self._tasks.spawn(coro, name=name)
        return task

    def status(self, drain: dict[str, Any] | None, subscriptions: list[dict[str, Any]]) -> dict[str, Any]:
        """This agent for ``meshnode status``; ``drain`` and ``subscriptions`` are the node's."""
        return {
            "name": self.name,
            "id": self.agent_id,
            "plugin": self.kind,
            "state": self.state,
            "not_ready": self.not_ready,
            # Requests held until its start settles (no handler runs before on_start returned).
            "waiting_for_start": self._waiting_for_start,
            "registered": self.registered,
            "registration_error": self.registration_error,
            "vouch_expires_at": self.vouch.get("expires_at"),
            "interaction": self.interaction,
            "offerings": sorted(self.offerings),
            "active_tasks": self.active_tasks,
            "in_flight": self.in_flight,
            "max_concurrency": self.max_concurrency,
            # Tasks its handlers spawned that still run (the handlers' own
            # tasks are active_tasks; memory is only the process's, see Status).
            "spawned_tasks": self.spawned.live,
            "spawned_tasks_total": self.spawned.total,
            "counters": dict(self.counters),
            "drain": drain,
            "subscriptions": subscriptions,
        }

    @property
    def active_tasks(self) -> int:
        return len(self._tasks)

    async def cancel_tasks(self, grace: float) -> None:
        """The agent stops: its handlers get ``grace`` seconds to finish, then are
        cancelled, each telling its requester the work stopped (:meth:`_tell_stopped`)."""
        self.stopping = True
        if not self._tasks:
            return
        _, pending = await asyncio.wait(list(self._tasks), timeout=grace)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    def signal(self, name: str, envelope: Mapping[str, Any] | None = None, detail: str = "") -> None:
        """A local signal (§22.7): always counted; logged at warning level once a
        minute per kind (then at debug), so a flood cannot flood the log too."""
        self.counters[f"refused.{name}"] += 1
        now = time.monotonic()
        loud = now - self._signal_logged.get(name, -1e9) >= 60.0
        if loud:
            self._signal_logged[name] = now
        level = logging.WARNING if loud else logging.DEBUG
        if not self.agent.log.isEnabledFor(level):
            return
        sender = envelope.get("from") if isinstance(envelope, Mapping) else None
        msg_id = envelope.get("id") if isinstance(envelope, Mapping) else None
        self.agent.log.log(
            level,
            "inbound refused (%s)%s%s%s%s",
            name,
            f" from {sender}" if sender else "",
            f" id {msg_id}" if msg_id else "",
            f": {detail}" if detail else "",
            " (further ones this minute are counted, see status)" if loud else "",
        )

    def clamp_mailbox_window(self, retention_ms: int) -> None:
        """Never judge drained mail by a window longer than the buffer's real retention."""
        window = self.guard.window
        if retention_ms <= 0 or window.max_age_mailbox_ms <= retention_ms:
            return
        clamped = FreshnessWindow(
            max_clock_skew_ahead_ms=window.max_clock_skew_ahead_ms,
            max_age_live_ms=min(window.max_age_live_ms, retention_ms),
            max_age_mailbox_ms=retention_ms,
        )
        self.agent.log.info("mailbox window clamped to the buffer's retention (%d s)", retention_ms // 1000)
        self.guard = InboundGuard(
            self.agent_id,
            window=clamped,
            max_inbound_chars=self.guard.max_inbound_chars,
            max_hops=self.guard.max_hops,
            memory=self.guard.memory,
        )

    def refuse(self, intake: Intake, rule: str, envelope: Mapping[str, Any] | None = None, detail: str = "") -> None:
        """Count a refusal the one way (the node's counter, by intake and rule) and
        raise this agent's local signal for it (§22.7)."""
        self.node.refusals.count(intake, rule)
        self.signal(SIGNAL_PREFIX[intake] + rule, envelope, detail)

    def count_refusal(self, rule: str) -> None:
        """An admission refusal of the inbox intake that is answered, not logged."""
        self.node.refusals.count(Intake.INBOX, rule)
        self.counters[f"refused.{rule}"] += 1

    # -- the intakes (meshnode.node.pipeline) ----------------------------------------

    #: The inbox intake: every delivery path (live, local, mailbox) enters here.
    receive = pipeline.receive
    #: The event intake.
    receive_event = pipeline.receive_event

    async def dispatch_event(
        self, env: dict[str, Any], event: Event, counter: str, *, observed: bool = True
    ) -> None:
        """Route a checked event, feed or telemetry delivery to :meth:`Agent.on_event`.

        ``observed`` closes the delivery's consumer span (§13.1.1); telemetry is
        never observed, so observing spans cannot produce spans.
        """
        ctx = AgentContext(self, envelope=env)
        ok = True
        try:
            with running_for(self.name, self.spawned, f"on_event for {event.subject}"):
                await self.agent.on_event(ctx, event)
        except asyncio.CancelledError:
            raise
        except Exception:
            ok = False
            self.counters[f"{counter}.failed"] += 1
            self.agent.log.exception("on_event failed for %s", event.subject)
        else:
            self.counters[f"{counter}.handled"] += 1
        obs = self.node.observability
        if observed and obs is not None:
            obs.event_done(self, env, ok)

    async def answer_refusal(self, request: Mapping[str, Any], error: Mapping[str, Any], path: Path) -> None:
        """The §22.7 answer of a refusal that must answer (CONTEXT_TOO_LARGE)."""
        await self._answer(request, status="failed", error=error, path=path)

    async def on_request(
        self,
        env: dict[str, Any],
        source: Path,
        reply: str | None,
        now_ms: int,
        data: bytes,
        inbox_id: int | None,
        wait: bool,
    ) -> str:
        """Route a request that passed the §22 guard: describe, the sender's vouch,
        cancel, the attended inbox, follow-ups, admission, then the handler, with
        the first reply :func:`~meshnode.node.pipeline.first_reply` plans.

        Returns the outcome for the node inbox, or ``running`` when the handler
        was started in the background (it settles its live pair itself)."""
        payload = normalize_request_payload(env.get("payload"))
        offering_id = payload.get("offering") if isinstance(payload, Mapping) else None
        if offering_id == DESCRIBE_OFFERING:
            await self._describe(env, now_ms, source)
            return "answered"
        trust = self.node.trust
        if trust is not None and offering_id != DESCRIBE_OFFERING and env["from"] not in self.node.by_id:
            # §5.3 step 2: a node must vouch for the sender (describe stays open to
            # strangers). The pipeline's stage, as for events; a request is answered.
            try:
                await pipeline.vouched(self, env)
            except pipeline.Refused as refused:
                self.count_refusal(refused.rule)
                error = error_object("UNAUTHORIZED", "no node vouches for the sender", {"reason": refused.rule})
                await self._answer(env, status="failed", error=error, path=source)
                return "answered"
            if self.agent.refuse_sandbox_senders and trust.tier_of(env["from"]) == "sandbox":
                # The agent's own policy (§9.7: sandbox hosts are for trying things).
                self.count_refusal("sender_sandboxed")
                error = error_object(
                    "UNAUTHORIZED", "this agent takes no work from sandbox nodes", {"reason": "sender_sandboxed"}
                )
                await self._answer(env, status="failed", error=error, path=source)
                return "answered"
        if offering_id == CANCEL_OFFERING:
            await self._on_cancel(env, payload, source)
            return "answered"
        if offering_id == REGISTRY_PROBE_OFFERING and reply:
            # §18.7 plumbing: any answer proves liveness; it rides the reply subject.
            await self.node.reply_plain(reply, {"alive": True})
            return "answered"
        # What the requester gets first if admission passes (§6.4a, the pure rule).
        inbox = self.node.inbox
        plan = first_reply(source, InboundOutcome.ADMITTED, attended=self.interaction == "interactive" and inbox is not None)
        if plan.first_reply is FirstReply.QUEUED_ACK and inbox is not None:
            # §8.3a: a person's session answers; nothing runs now, so no accept.
            if inbox_id is None:
                commerce = self.node.commerce
                if commerce is not None and self.skus and isinstance(offering_id, str):
                    # §19.5 before the hold, as before any work: a paid offering
                    # a person answers is not held (nor answerable) without an
                    # agreement. (A copy drained later was checked when held.)
                    try:
                        await commerce.check(self, env, offering_id, now_ms)
                    except ProtocolError as exc:
                        self.count_refusal(exc.code)
                        await self._answer(env, status="failed", error=exc.to_object(), path=source)
                        return "answered"
                try:
                    inbox_id = await inbox.hold(self.agent_id, env["from"], env["id"], "request", data, now_ms)
                except InboxUnwritable as exc:
                    # Not held, so not handled: no queued ack, and the pair is taken
                    # back from the duplicate memories, so the copy the broker still
                    # buffers (nothing acked it) is held by a drain once the disk
                    # takes writes again (§16.4). Nothing is lost.
                    self.guard.memory.forget(env["from"], env["id"])
                    inbox.forget(self.agent_id, env["from"], env["id"])
                    self.refuse(Intake.INBOX, "inbox_unwritable", env, exc.cause)
                    return "refused"
            if reply:
                await self.node.reply_plain(reply, build_queued_ack(str(inbox_id)))
            elif source is Path.LOCAL:
                # The local path has no transport reply subject (§4.7): the same
                # signal in process, or a local caller waited out its timeout.
                self.node.queued_locally(env["from"], env["id"], str(inbox_id))
            self.counters["held"] += 1
            return "held"
        if env.get("task_id") is not None:
            # A follow-up answering a paused task (§6.5, §7.3): it resumes the
            # handler already waiting in ask_input()/wait_for_input(); no second
            # handler runs, no accept is sent (see _on_follow_up).
            await self._on_follow_up(env, payload, offering_id, now_ms, source)
            return "answered"
        if self.state is not AgentState.RUNNING and self.start_settled is not None:
            refusal = await self._until_started()
            if refusal is not None:
                self.count_refusal(refusal.code)
                await self._answer(env, status="failed", error=refusal.to_object(), path=source)
                return "answered"
        try:
            spec, handler_input = self._admit(env, payload, offering_id, now_ms)
            commerce = self.node.commerce
            if commerce is not None and self.skus:
                # §19.5, in the §7.7/§22 slot: no agreement to a paid SKU, no work.
                await commerce.check(self, env, spec.id, now_ms)
            if self.node.allowance is not None:
                # EXT-8 through §7.7: the owner's allowance, before any work.
                await self.node.allowance.admit(self, env, spec, handler_input)
            await self._admit_budget(env, spec, handler_input)
            if not wait:
                # The drain (wait) runs its rows a bounded number at a time and
                # must not turn a backlog into refusals; every other path is
                # refused busy past the limit instead of queued without bound.
                pipeline.check_concurrency(self.in_flight, self.max_concurrency, self.latency.average_ms)
        except ProtocolError as exc:
            # Refused at admission: the refusal is the first reply, no accept (§6.4a).
            self.count_refusal(exc.code)
            await self._answer(env, status="failed", error=exc.to_object(), path=source)
            return "answered"
        text: str | None = None
        if spec.framing:
            framed = frame_payload(handler_input, FrameProvenance.from_envelope(env, now_ms))
            handler_input = framed.payload
            if framed.field is not None and isinstance(framed.payload, Mapping):
                text = framed.payload.get(framed.field)
            elif framed.field is not None and isinstance(framed.payload, str):
                text = framed.payload
        self.counters["dispatched"] += 1
        # Counted from here (no await since the check) until the handler
        # returns, before its answer goes out: a local requester woken by that
        # answer may send its next request before this runner's task is done.
        # The runner's done callback releases a slot whose handler never ran
        # (a runner cancelled before its first step).
        slot = _Slot(self)
        if wait:
            try:
                if plan.accept:
                    await self._answer(env, status="accepted", path=source, accept=True)
                await self._run_handler(env, spec, handler_input, text, source, slot)
            finally:
                slot.release()
            return "answered"
        if not plan.accept:  # a drained request: its first reply is the substantive one
            runner = self.spawn(self._run_handler(env, spec, handler_input, text, source, slot), f"{self.name}:{env['id']}")
            runner.add_done_callback(slot.release)
            return "running"
        # Admission passed and a live handler is about to run (§6.4a): the accept
        # goes out first. The handler's task is created *before* the accept is
        # published so that its first step is scheduled ahead of the client's
        # flusher: a handler that answers at once puts its respond in the same
        # socket write as the accept (one write per round trip instead of two).
        # The gate keeps the order when the accept's delivery has to wait: the
        # handler never starts before the accept is out.
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def run_after_accept() -> None:
            if not gate.done():
                try:
                    await gate
                except asyncio.CancelledError:
                    # Never started: nothing is committed, so a drain (after a
                    # restart) still runs the buffered copy, once.
                    if self.node.inbox is not None:
                        self.node.inbox.release(self.agent_id, env["from"], env["id"])
                    raise
            await self._run_handler(env, spec, handler_input, text, source, slot)

        runner = self.spawn(run_after_accept(), f"{self.name}:{env['id']}")
        runner.add_done_callback(slot.release)
        try:
            await self._answer(env, status="accepted", path=source, accept=True)
        except BaseException:
            runner.cancel()  # the accept could not go out: nothing runs (as before)
            raise
        gate.set_result(None)
        return "running"

    def _admit(
        self, env: Mapping[str, Any], payload: Any, offering_id: Any, now_ms: int
    ) -> tuple[OfferingSpec, Any]:
        """Admission checks that answer instead of an accept (§6.4, §6.4a, §7.7)."""
        if not isinstance(payload, Mapping) or not isinstance(offering_id, str):
            raise ProtocolError("INVALID_ENVELOPE", "a request payload names an offering", {"member": "payload.offering"})
        spec = self.offerings.get(offering_id)
        if spec is None:
            advertised = sorted(s.id for s in self.offerings.values() if s.advertise)
            raise ProtocolError(
                "OFFERING_NOT_FOUND",
                f"offering {offering_id!r} is not offered by this agent",
                {"requested_offering": offering_id, "available_offerings": advertised},
            )
        config = payload.get("config")
        if config is not None and not isinstance(config, Mapping):
            raise ProtocolError("INVALID_ENVELOPE", "payload.config must be an object", {"member": "payload.config"})
        accepted = config.get("accepted_output") if isinstance(config, Mapping) else None
        if accepted is not None:
            if not isinstance(accepted, list) or not all(isinstance(a, str) for a in accepted):
                raise ProtocolError("INVALID_ENVELOPE", "config.accepted_output must be a list of media types")
            check_content_type(self.manifest, offering_id, accepted)
        # Attached files and resources are checked for shape only: nothing a
        # sender names is fetched before (or by) admission (§7.5.3, §7.5.5).
        parse_files(payload.get("files"))
        parse_resources(payload.get("resources"))
        handler_input = payload.get("input")
        validator = self._validators.get(offering_id)
        if validator is not None:
            error = jsonschema.exceptions.best_match(validator.iter_errors(handler_input))
            if error is not None:
                where = "/".join(str(p) for p in error.absolute_path) or "(input)"
                raise ProtocolError(
                    "INPUT_INVALID",
                    f"input does not match the offering's schema at {where}: {error.message}",
                    {"path": where, "validator": str(error.validator)},
                )
        if env.get("budget") is not None:
            check_admission(parse_budget(env["budget"]), now_ms)
        return spec, handler_input

    async def _admit_budget(self, env: Mapping[str, Any], spec: OfferingSpec, handler_input: Any) -> None:
        """The agent's own admission hook (§7.7): refusals here come instead of an accept."""
        if type(self.agent).admit is Agent.admit:
            return
        budget = parse_budget(env["budget"]) if env.get("budget") is not None else None
        await self.agent.admit(AgentContext(self, envelope=env), spec.id, handler_input, budget)

    async def _run_handler(
        self,
        env: dict[str, Any],
        spec: OfferingSpec,
        handler_input: Any,
        text: str | None,
        source: Path,
        slot: _Slot | None = None,
    ) -> None:
        """Run the handler and answer; then the live pair is settled (done) in
        the node inbox. A handler cancelled by a stopping node is settled only
        when its requester was told (:meth:`_tell_stopped`): otherwise, after a
        restart its buffered copy is kept as ``interrupted``, not run."""
        inbox = self.node.inbox if source is Path.LIVE else None
        if inbox is not None:
            # Committed right before the handler starts, inline (with whatever
            # else is queued riding along): a drain of the buffered copy never
            # runs it again, even after a kill -9 (issue #23), and a crash
            # mid-handler leaves it interrupted. _handle runs the handler before
            # its first await, so nothing else runs in between.
            inbox.commit_live_now(self.agent_id, env["from"], env["id"], self.node.now_ms())
        self._mark_started(env, source)
        try:
            await self._handle(env, spec, handler_input, text, source, slot)
        except asyncio.CancelledError:
            raise
        except BaseException:
            self._settle_live(env, inbox)
            raise
        self._settle_live(env, inbox)

    def _mark_started(self, request: Mapping[str, Any], source: Path) -> None:
        """A drained request reaches its irreversible step (its handler, an
        answer, a cancel, a follow-up): its inbox row is committed as started,
        inline, so a crash from here on keeps it interrupted, and a crash
        before (in the pipeline's awaits) lets it run once after the restart."""
        inbox = self.node.inbox
        if source is Path.MAILBOX and inbox is not None:
            inbox.mark_started(self.agent_id, request["from"], request["id"], self.node.now_ms())

    def _settle_live(self, env: Mapping[str, Any], inbox: InboxStore | None) -> None:
        if inbox is not None:
            inbox.settle(self.agent_id, env["from"], env["id"], self.node.now_ms())

    async def _until_started(self) -> ProtocolError | None:
        """Hold a request until this agent's start settled; None once it runs,
        else the refusal (AGENT_UNAVAILABLE, retryable: §6.4's "not accepting
        requests"). At most ``max_concurrency`` requests wait; one more is
        refused at once rather than held without bound."""
        settled = self.start_settled
        assert settled is not None
        if not settled.is_set():
            if self._waiting_for_start >= self.max_concurrency:
                return ProtocolError(
                    "AGENT_UNAVAILABLE",
                    f"agent {self.name} is starting and already holds {self._waiting_for_start} requests until it runs",
                    {"reason": "starting"},
                )
            self._waiting_for_start += 1
            try:
                await settled.wait()
            finally:
                self._waiting_for_start -= 1
        if self.state is AgentState.RUNNING:
            return None
        return ProtocolError(
            "AGENT_UNAVAILABLE", f"agent {self.name} is not running: it is {self.state}",
            {"reason": "not_started", "state": str(self.state)},
        )

    async def _handle(
        self,
        env: dict[str, Any],
        spec: OfferingSpec,
        handler_input: Any,
        text: str | None,
        source: Path,
        slot: _Slot | None = None,
    ) -> None:
        ctx = AgentContext(self, envelope=env, text=text)
        handler = getattr(self.agent, spec.handler_name)
        config = (env.get("payload") or {}).get("config") if isinstance(env.get("payload"), Mapping) else None
        wants_stream = isinstance(config, Mapping) and config.get("stream") is True
        started = time.perf_counter()
        try:
            try:
                # The loop-lag watchdog names this agent if its handler blocks the loop.
                with running_for(self.name, self.spawned, f"the handler for {spec.id}"):
                    if self.node.allowance is not None:
                        # Held for the owner at admission (ask_owner): waits here, unstarted.
                        await self.node.allowance.before_handler(self, env, lambda: self.open_task(ctx, "working"))
                    if inspect.isasyncgenfunction(handler):
                        output = await self._run_streaming(ctx, handler, handler_input, wants_stream, config)
                    else:
                        output = await handler(ctx, handler_input)
            finally:
                self.latency.observe((time.perf_counter() - started) * 1000)
                if slot is not None:
                    slot.release()  # the handler is done; its answer is not a slot
        except ProtocolError as exc:
            self.counters["failed"] += 1
            if ctx.task is not None:
                await self._finish_task(ctx.task, "failed", error=exc.to_object())
            else:
                await self._answer(env, status="failed", error=exc.to_object(), path=source)
        except asyncio.CancelledError:
            if ctx.task is not None and ctx.task.state == "canceled":
                return  # stopped by a cancel; its update is already out
            if self.stopping:
                await self._tell_stopped(ctx, env, source)
            raise
        except Exception as exc:
            self.counters["failed"] += 1
            if isinstance(exc, PluginExited):  # its sys.exit(), stopped at running_for
                self.agent.log.error("%s; answered as failed", exc, exc_info=exc)
            else:
                self.agent.log.exception("handler for %s raised", spec.id)
            error = error_object("INTERNAL_ERROR", "the agent failed while handling the request")
            if ctx.task is not None:
                await self._finish_task(ctx.task, "failed", error=error)
            else:
                await self._answer(env, status="failed", error=error, path=source)
        else:
            self.counters["completed"] += 1
            usage = ctx.usage_report or None  # declared meters the handler reported (§13.5)
            try:
                # Artifacts the handler attached, and the output itself stored
                # as one when the answer would not fit the transport (§18.9).
                output, artifacts = await spill_oversized_output(self, env, output, ctx.attached_artifacts or None)
            except Exception as exc:
                self.counters["failed"] += 1
                if isinstance(exc, ProtocolError):
                    error = exc.to_object()
                else:
                    self.agent.log.exception("storing the output of %s as an artifact failed", spec.id)
                    error = error_object("INTERNAL_ERROR", "the output could not be stored as an artifact")
                if ctx.task is not None:
                    await self._finish_task(ctx.task, "failed", error=error)
                else:
                    await self._answer(env, status="failed", error=error, path=source)
                return
            if ctx.task is not None:
                receipt = await self._finish_task(ctx.task, "completed", output=output, artifacts=artifacts,
                                                  usage=usage)
            else:
                receipt = await self._answer(env, status="completed", output=output, artifacts=artifacts,
                                             path=source, usage=usage)
            if self.node.commerce is not None and self.skus:
                # §13.5: the requests meter, and the declared meters under the id
                # of the respond whose signature covers their report.
                await self.node.commerce.delivered(self, env, spec.id, self.node.now_ms(), usage=usage,
                                                   receipt_id=receipt, task_id=ctx.task.task_id if ctx.task else None)
        finally:
            if ctx.task is not None:
                self.tasks.pop(ctx.task.task_id, None)
                self._task_runners.pop(ctx.task.task_id, None)

    async def _tell_stopped(self, ctx: AgentContext, env: Mapping[str, Any], source: Path) -> None:
        """A handler cancelled because its agent stops: the requester is told
        rather than left waiting on a Task that stays ``working`` for ever (or,
        without one, until its own timeout). A working Task fails
        AGENT_UNAVAILABLE (retryable), a paused or just-opened one is canceled
        (reason ``policy``: it cannot fail, §7.3), a plain request gets the failed
        respond. Best effort, bounded: the stop must not wait on the mesh."""
        self.counters["stopped"] += 1
        error = error_object(
            "AGENT_UNAVAILABLE",
            "the agent stopped before it finished this request (its node is stopping, or the agent was "
            "restarted or removed); the work did not complete",
            {"reason": "agent_stopped"},
        )
        try:
            async with asyncio.timeout(_TELL_STOPPED_S):
                task = ctx.task
                if task is None:
                    await self._answer(env, status="failed", error=error, path=source)
                elif task.state == "working":
                    await self._finish_task(task, "failed", error=error)
                elif task.state not in TERMINAL_STATES:
                    await task._send("canceled", extra={"reason": "policy", "note": error["message"]})
        except Exception as exc:  # the mesh already gone: the requester's deadline is its answer
            self.agent.log.warning("could not tell %s that its request stopped: %s: %s",
                                   env.get("from"), type(exc).__name__, exc)
            return
        # Answered: settled like any answered request, so the next start does not
        # keep its buffered copy as interrupted.
        self._settle_live(env, self.node.inbox if source is Path.LIVE else None)

    async def open_task(self, ctx: AgentContext, state: str = "submitted", message: str | None = None) -> ResponderTask:
        """Turn the request being handled into a Task (§7.0): the first task reply."""
        if ctx.task is not None:
            return ctx.task
        task = ResponderTask(self, ctx.envelope, new_task_id())
        budget_block = ctx.envelope.get("budget")
        if budget_block is not None:
            task.budget = parse_budget(budget_block)
        ctx.task = task
        self.tasks[task.task_id] = task
        runner = asyncio.current_task()
        if runner is not None:
            self._task_runners[task.task_id] = runner
        await task._send(state, message=message, first=True)
        self.counters["tasks.opened"] += 1
        return task

    async def _finish_task(
        self,
        task: ResponderTask,
        state: str,
        *,
        output: Any = None,
        error: Mapping[str, Any] | None = None,
        artifacts: list[dict[str, Any]] | None = None,
        usage: list[dict[str, Any]] | None = None,
    ) -> str | None:
        """End ``task`` in ``state``; the id of the terminal update, None when none went out."""
        if task.state in TERMINAL_STATES:
            return None
        try:
            sent = await task._send(state, output=output, error=error, artifacts=artifacts,
                                    extra={"usage": usage} if usage else None)
            return str(sent["id"])
        except ProtocolError as exc:
            self.agent.log.warning("task %s could not end as %s: %s", task.task_id, state, exc)
        except Exception as exc:  # the transport: logged here, never an unretrieved task exception
            self.agent.log.error("task %s could not publish its %s update: %s: %s",
                                 task.task_id, state, type(exc).__name__, exc)
        return None

    async def _run_streaming(
        self, ctx: AgentContext, handler: Any, handler_input: Any, wants_stream: bool, config: Any
    ) -> Any:
        """Run an async-generator handler: a stream when asked (§10.5, §11), else
        its chunks joined into one bare answer."""
        chunks: list[Any] = []
        if not wants_stream:
            async for chunk in handler(ctx, handler_input):
                chunks.append(chunk)
            return "".join(chunks) if all(isinstance(c, str) for c in chunks) else chunks
        sign_chunks = isinstance(config, Mapping) and config.get("sign_chunks") is True
        task = await self.open_task(ctx, "working")
        index = 0
        async for chunk in handler(ctx, handler_input):
            await self.node.publish_chunk(self, task, index, chunk, final=False, sign=sign_chunks)
            chunks.append(chunk)
            index += 1
        await self.node.publish_chunk(self, task, index, None, final=True, sign=True, chunk_count=index + 1)
        self.counters["stream.chunks"] += index
        return "".join(chunks) if all(isinstance(c, str) for c in chunks) else chunks

    async def _on_cancel(self, env: Mapping[str, Any], payload: Mapping[str, Any], source: Path) -> None:
        """``task.cancel`` (§10.8): validated at the door, then the handler is stopped."""
        try:
            request = parse_cancel_input(payload.get("input"), env.get("task_id"))
            task = self.tasks.get(request.task_id)
            if task is None:
                raise ProtocolError("TASK_NOT_FOUND", f"no task {request.task_id} here", {"task_id": request.task_id})
            if env["from"] not in (task.requester, self.agent_id):
                raise ProtocolError("UNAUTHORIZED", "only the task's requester may cancel it")
            check_cancelable(task.state)
        except ProtocolError as exc:
            await self._answer(env, status="failed", error=exc.to_object(), path=source)
            return
        stop = request.stop
        extra = stop.members()
        self._mark_started(env, source)
        try:
            await task._send("canceled", extra=extra)
        except ProtocolError as exc:
            await self._answer(env, status="failed", error=exc.to_object(), path=source)
            return
        runner = self._task_runners.get(task.task_id)
        if runner is not None and not runner.done():
            runner.cancel()
        for agent_id, child_task in list(task.delegates):
            reason, note = propagated(str(request.reason), stop.note)
            self.spawn(cancel_task(self.node, self, agent_id, child_task, reason, note, wait=False),
                       f"{self.name}:propagate:{child_task}")
        self.counters["tasks.canceled"] += 1
        await self._answer(env, status="completed", output={"task_id": task.task_id, "status": "canceled"}, path=source)

    async def _on_follow_up(
        self, env: Mapping[str, Any], payload: Any, offering_id: Any, now_ms: int, source: Path
    ) -> None:
        """A request naming a ``task_id``: the requester's answer to an input or
        auth round. It has passed everything above it in the pipeline (signature,
        §22 guard, the sender's vouch); here it is matched to a Task of this agent
        by :func:`check_follow_up` (same sender as the Task's requester, Task
        paused, same context and offering) and hands its input, framed like the
        original request's, to the waiting handler. Anything else is answered
        with the rule's error (a stranger, an unknown or ended task, and a task
        lost in a restart all get TASK_NOT_FOUND) and resumes nothing."""
        task_id = str(env["task_id"])
        task = self.tasks.get(task_id)
        try:
            check_follow_up(
                task.paused() if task is not None else None,
                task_id=task_id,
                sender=str(env["from"]),
                context_id=env.get("context_id"),
                offering=offering_id,
            )
            assert task is not None
            handler_input = payload.get("input") if isinstance(payload, Mapping) else None
            spec = self.offerings.get(str(offering_id_of(task.request.get("payload"))))
            if spec is not None and spec.framing:
                handler_input = frame_payload(handler_input, FrameProvenance.from_envelope(env, now_ms)).payload
            self._mark_started(env, source)
            await task.take_follow_up(env, handler_input)
        except ProtocolError as exc:
            self.count_refusal(f"follow_up.{exc.code}")
            await self._answer(env, status="failed", error=exc.to_object(), path=source)
            return
        self.counters["follow_ups"] += 1

    async def _describe(self, env: Mapping[str, Any], now_ms: int, source: Path) -> None:
        """§10.14: a document, not a conversation — never the agent's code."""
        decision = self.describe_limiter.check(env["from"], now_ms)
        if not decision.allowed:
            await self._answer(
                env,
                status="failed",
                error=error_object("RATE_LIMITED", "describe is rate-limited per requester", retry_after_ms=decision.retry_after_ms),
                path=source,
            )
            return
        self.counters["describe"] += 1
        await self._answer(env, status="completed", output=describe(self.manifest), path=source)

    async def answer(
        self,
        request: Mapping[str, Any],
        *,
        status: str,
        output: Any = None,
        error: Mapping[str, Any] | None = None,
    ) -> None:
        """Answer a request later, as this agent (a person replying from the inbox)."""
        await self._answer(request, status=status, output=output, error=error, path=Path.LIVE)

    async def _answer(
        self,
        request: Mapping[str, Any],
        *,
        status: str,
        output: Any = None,
        error: Mapping[str, Any] | None = None,
        path: Path,
        accept: bool = False,
        artifacts: list[dict[str, Any]] | None = None,
        usage: list[dict[str, Any]] | None = None,
    ) -> str | None:
        """Sign a respond and deliver it to the requester's inbox (§6.5); its id
        (None when it could not be delivered). ``usage`` is the §13.5 usage report."""
        inbox = self.node.inbox
        if (
            not accept and path is Path.LIVE and inbox is not None
            and inbox.taken(self.agent_id, request["from"], request["id"])
        ):
            # An answer without a handler (a refusal, describe, a cancel): the
            # pair is committed before the answer goes out, so a drain of the
            # buffered copy after a crash does not answer it a second time.
            inbox.commit_live_now(self.agent_id, request["from"], request["id"], self.node.now_ms(), settled=True)
        # The same for a drained request answered without a handler: its row is
        # started before the answer goes out, so a crash does not answer it twice.
        self._mark_started(request, path)
        payload: dict[str, Any] = {"status": status}
        if output is not None:
            payload["output"] = output
        if usage:
            payload["usage"] = usage
        env = build_envelope(
            "respond",
            self.agent_id,
            now_ms=self.node.now_ms(),
            to=request["from"],
            in_reply_to=request["id"],
            trace=child_trace(request.get("trace")),
            context_id=request.get("context_id"),
            payload=payload,
            error=error,
            artifacts=artifacts,
            ids=self.node.ids,
        )
        sign_envelope(env, self.key)
        try:
            await self.node.deliver(self, env, request["from"])
        except ProtocolError as exc:
            if accept or status == "failed":
                self.agent.log.warning("could not deliver a respond to %s: %s", request["from"], exc)
                return None
            # The answer itself cannot travel (e.g. larger than the transport
            # carries): tell the requester so instead of leaving it waiting.
            await self._answer(request, status="failed", error=exc.to_object(), path=path)
            return None
        return str(env["id"])
