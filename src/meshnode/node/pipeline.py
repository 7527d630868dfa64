"""The one inbound pipeline: stage functions every intake picks from (§5.3, §22, §4.7).

Every way an envelope enters a node is an *intake* (:class:`Intake`). Each runs
some of the same stages, in this order, and nothing else judges the bytes::

    decode ─► verify ─► kind check ─► §22 guard ─► audit ─► route

* :func:`decode` parses and validates the wire bytes (no signature yet);
* :func:`verify` checks the signature (§5.3) — only then is ``from`` known;
* :func:`check_kind` refuses an envelope type the intake never takes;
* :func:`guard` runs the §22 protections (remember, fresh, addressed, hops,
  size) of an :class:`~meshnode.protocol.protections.InboundGuard`;
* audit is :meth:`Node.audit` (one audit path for local and remote, §4.7);
* routing is the intake's own (the request path, ``on_event``, a waiter).

Which intake runs which stages:

==================  =========================================================
inbox               decode, verify, guard (window by path), audit, route: a
                    request to :meth:`HostedAgent.on_request` (which runs
                    vouched, §5.3 step 2, answering UNAUTHORIZED), a respond
                    to the request waiting for it (:func:`receive`)
event               decode, verify, kind (emit), guard (event memory),
                    vouched (§5.3 step 2), audit, ``on_event``
                    (:func:`receive_event`)
feed                decode, verify, owner rule, guard (event memory), audit,
                    ``on_event`` (:meth:`PubSub.receive_feed`)
telemetry           decode, verify, kind and owner, guard (live), ``on_event``
                    — never audited (:meth:`PubSub.receive_telemetry`)
service             decode, verify, guard (live), kind (a request)
                    (:meth:`ServiceBase.intake`)
service_reply       decode, verify, bound to the request, pinned key
                    (:func:`receive_service_reply`)
task_update         decode, verify, once, this task, from a party
                    (:meth:`RequesterTask.updates`)
==================  =========================================================

A stage that refuses raises :class:`Refused` naming its *rule* (the local
signal); the intake catches it in one place and counts it with
:meth:`RefusalCounter.count` — one counter for the whole node, labelled by
intake and rule, shown in its metrics. A refusal follows §22.7: it is silent unless
the rule answers the sender (``Refused.answer``: CONTEXT_TOO_LARGE for the size
cap), and the intake decides whether it has a way to answer at all.

The stages are plain functions over plain values, module level, with no
per-message allocation on the accepted path: the live request path is the hot
path of the node.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Awaitable, Collection, Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final

from meshnode.agent import Event
from meshnode.protocol.accept import (
    DeliveryPath,
    FirstReply,
    InboundOutcome,
    ReplyPlan,
    plan_first_reply,
)
from meshnode.protocol.envelope import decode_envelope, verify_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.protections import DeliverySource, InboundGuard, InboundVerdict, Protection

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent

__all__ = [
    "Intake",
    "Path",
    "RefusalCounter",
    "Refused",
    "check_concurrency",
    "check_kind",
    "decode",
    "decode_verified",
    "first_reply",
    "guard",
    "receive",
    "receive_event",
    "receive_service_reply",
    "verify",
]

#: The delivery path: the one enum for how an envelope arrived (live
#: subscription, local delivery between agents of this node, or out of a
#: buffer: the mailbox drain and durable consumers). It selects the freshness
#: window (§22.3; local is judged live, §4.7) and, through
#: :func:`first_reply`, whether an accept is sent.
Path = DeliverySource


class Intake(StrEnum):
    """Where an envelope entered the node: the first label of every refusal."""

    #: Requests and responds to a hosted agent's inbox (:meth:`HostedAgent.receive`).
    INBOX = "inbox"
    #: Domain events (:meth:`HostedAgent.receive_event`).
    EVENT = "event"
    #: Feed deliveries (:meth:`PubSub.receive_feed`).
    FEED = "feed"
    #: Span, metric and log events for an observer (:meth:`PubSub.receive_telemetry`).
    TELEMETRY = "telemetry"
    #: Requests to a platform service (:meth:`ServiceBase.accept`).
    SERVICE = "service"
    #: A platform service's answer to this node (:meth:`Node.service_call`).
    SERVICE_REPLY = "service_reply"
    #: Updates of a Task this node asked for (:meth:`RequesterTask.updates`).
    TASK_UPDATE = "task_update"
    #: Chunks of a Task's stream this node reads (:meth:`RequesterTask.stream`).
    TASK_STREAM = "task_stream"


class Refused(Exception):
    """A stage refused the envelope.

    ``rule`` names the refusal (a §22.7 local signal such as
    ``inbound_duplicate``, or ``identity_mismatch`` for a forged signature);
    ``envelope`` is what was decoded (None when the bytes never became one);
    ``answer`` is the §12.1 error the sender must be told (only the size cap
    has one), else None: a silent refusal.
    """

    __slots__ = ("answer", "detail", "envelope", "error", "rule", "verdict")

    def __init__(
        self,
        rule: str,
        detail: str = "",
        *,
        envelope: Mapping[str, Any] | None = None,
        answer: Mapping[str, Any] | None = None,
        verdict: InboundVerdict | None = None,
        error: ProtocolError | None = None,
    ) -> None:
        super().__init__(rule, detail)
        self.rule = rule
        self.detail = detail
        self.envelope = envelope
        self.answer = answer
        #: The §22 guard's verdict, when the guard refused.
        self.verdict = verdict
        #: The protocol error behind the refusal (decode, verify), for an intake
        #: whose caller is told (a service reply: the caller's call fails with it).
        self.error = error

    def as_error(self) -> ProtocolError:
        """The refusal as the ProtocolError a waiting caller raises."""
        if self.error is not None:
            return self.error
        return ProtocolError("IDENTITY_MISMATCH" if self.envelope is not None else "INVALID_ENVELOPE", self.detail)


class RefusalCounter:
    """The one count of inbound refusals, labelled by intake and rule.

    One per node (:attr:`Node.refusals`); the daemon hands the same one to the
    platform services it hosts, so every intake of the process counts here,
    and the node's status and metrics show it
    (``meshnode_inbound_refused_total{intake, rule}``).
    """

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str]] = Counter()

    def count(self, intake: Intake, rule: str) -> None:
        self._counts[(intake.value, rule)] += 1

    def get(self, intake: Intake, rule: str) -> int:
        return self._counts[(intake.value, rule)]

    def by_label(self) -> dict[tuple[str, str], int]:
        """Every refusal count, keyed by (intake, rule)."""
        return dict(self._counts)

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{intake: {rule: count}}``, for JSON status and metrics."""
        out: dict[str, dict[str, int]] = {}
        for (intake, rule), n in sorted(self._counts.items()):
            out.setdefault(intake, {})[rule] = n
        return out

    def total(self, intake: Intake | None = None) -> int:
        return sum(n for (i, _), n in self._counts.items() if intake is None or i == intake.value)


# -- the stages -----------------------------------------------------------------


def decode(data: bytes | bytearray | memoryview | str) -> dict[str, Any]:
    """Stage 1: wire bytes to a validated envelope; its signature is not checked yet."""
    try:
        return decode_envelope(data, verify=False)
    except ProtocolError as exc:
        raise Refused(exc.code.lower(), exc.message, error=exc) from None


def verify(env: dict[str, Any]) -> dict[str, Any]:
    """Stage 2: the signature (§5.3). Nothing may be remembered about an envelope
    before this passes: an unverified ``from`` would let a forger pre-empt mail."""
    try:
        verify_envelope(env)
    except ProtocolError as exc:
        raise Refused(exc.code.lower(), exc.message, error=exc) from None
    return env


def decode_verified(data: bytes | bytearray | memoryview | str) -> dict[str, Any]:
    """Stages 1 and 2 together (the common case)."""
    return verify(decode(data))


def check_kind(env: Mapping[str, Any], allowed: Collection[str], rule: str) -> None:
    """Stage 3: refuse (as ``rule``) an envelope type this intake never takes."""
    if env["type"] not in allowed:
        raise Refused(rule, f"a {env['type']} envelope", envelope=env)


def guard(guard: InboundGuard, env: Mapping[str, Any], path: Path, now_ms: int) -> InboundVerdict:
    """Stage 4: the §22 protections, judged with ``path``'s freshness window.

    Returns the verdict of an accepted envelope (its sender-text measurement
    is what framing uses); raises :class:`Refused` with the verdict's local
    signal, and the §22.7 answer when the rule has one.
    """
    verdict = guard.check(env, source=path, now_ms=now_ms)
    if verdict.accepted:
        return verdict
    answer = verdict.answer.error if verdict.answer is not None else None
    raise Refused(verdict.local_signal or "refused", verdict.reason or "", envelope=env, answer=answer, verdict=verdict)


def check_concurrency(in_flight: int, limit: int, typical_ms: float = 0.0) -> None:
    """Admission (§7.7 slot, after the §22 guard): refuse busy past the agent's limit.

    ``in_flight`` requests are in the agent's handlers; one more than ``limit``
    is refused ``AGENT_OVERLOADED`` (retryable, §12) with a ``retry_after_ms``
    hint in the §16 shape (the typical handler time, 100 ms to 30 s) instead
    of being queued without bound: a handler that spawns work per request
    could grow a node to thousands of tasks and hundreds of MB. The refusal
    is the first reply (no accept) and counted as ``AGENT_OVERLOADED``.
    Raised as a ProtocolError, like every admission refusal.
    """
    if in_flight < limit:
        return
    raise ProtocolError(
        "AGENT_OVERLOADED",
        f"the agent is at its concurrency limit ({limit} requests in its handlers); retry later, "
        "or raise [agents.<name>] max_concurrency / [node] agent_max_concurrency",
        {"reason": "concurrency_limit", "max_concurrency": limit, "in_flight": in_flight},
        retry_after_ms=int(min(30_000.0, max(100.0, typical_ms))),
    )


# -- the first reply (§6.4a) ------------------------------------------------------

_ACCEPT_PATH: Final = {
    Path.LIVE: DeliveryPath.LIVE,
    Path.LOCAL: DeliveryPath.LIVE,  # a live delivery that did not transit the broker (§4.7)
    Path.MAILBOX: DeliveryPath.MAILBOX_DRAIN,
}


#: The two §5.3 step 2 refusal rules (UNAUTHORIZED when a request is answered).
SENDER_NOT_VOUCHED: Final = "sender_not_vouched"
SENDER_KEY_REVOKED: Final = "sender_key_revoked"


async def vouched(hosted: HostedAgent, env: Mapping[str, Any]) -> None:
    """Stage: §5.3 step 2, the sender is vouched for by a node, asked of the registry
    (:class:`~meshnode.node.trust.VouchMemo`, one look-up per sender, memoised).

    Raises :class:`Refused` (``sender_not_vouched`` / ``sender_key_revoked``) for a
    sender the registry says no node vouches for, or whose key was revoked. The
    node's own agents are vouched for by definition; when the check is off
    (``[protections] check_sender_vouch = false``) or the registry cannot say,
    the envelope passes (a registry outage must not become a mesh outage).
    The same rule for every intake that runs it: requests and events alike,
    because §5.3 is stated for the receiver of any envelope.
    """
    trust = hosted.node.trust
    sender = env["from"]
    if trust is None or _vouch_exempt(hosted, sender):
        return
    standing = await trust.status(hosted, sender)
    if standing == "revoked":
        raise Refused(SENDER_KEY_REVOKED, "the sender's key was revoked", envelope=env)
    if standing == "unvouched":
        raise Refused(SENDER_NOT_VOUCHED, "no node vouches for the sender", envelope=env)


#: Live requests of one agent that may wait for their senders' vouch look-ups
#: at once, each on a task of its own, while the agent's other mail goes on.
MAX_VOUCH_WAITS: Final = 64


def _vouch_exempt(hosted: HostedAgent, sender: str) -> bool:
    """Our own agents, and the platform's services: no node vouches for those."""
    node = hosted.node
    return sender in node.by_id or sender in node.platform_keys


def _awaits_registry(hosted: HostedAgent, env: Mapping[str, Any]) -> bool:
    """Whether :func:`vouched` would wait for the registry for ``env``'s sender."""
    trust = hosted.node.trust
    sender = env["from"]
    return not (trust is None or _vouch_exempt(hosted, sender) or trust.known(sender))


async def _request(
    hosted: HostedAgent,
    env: dict[str, Any],
    path: Path,
    reply: str | None,
    now_ms: int,
    data: bytes,
    inbox_id: int | None,
    wait: bool,
    taken: bool,
) -> str:
    """A request past the guard: routed by :meth:`HostedAgent.on_request`, its
    live pair settled or released by the outcome."""
    inbox = hosted.node.inbox
    try:
        outcome = await hosted.on_request(env, path, reply, now_ms, data, inbox_id, wait)
    except BaseException:
        if taken and inbox is not None:
            # Failed before a handler ran (an answer that went out was
            # committed first): a drain after a restart may still run it.
            inbox.release(hosted.agent_id, env["from"], env["id"])
        raise
    if taken and inbox is not None and outcome != "running":
        # Answered, refused or held without a background handler: the pair
        # is finished. A running handler settles it itself.
        inbox.settle(hosted.agent_id, env["from"], env["id"], now_ms)
    return "answered" if outcome == "running" else outcome


async def _vouch_wait(hosted: HostedAgent, work: Awaitable[str]) -> None:
    """A request waiting for its sender's vouch, on a task of its own: counted
    against MAX_VOUCH_WAITS while it lasts; a failure is logged as the live
    subscription logs one, never left in an unobserved task."""
    try:
        await work
    except Exception:
        hosted.agent.log.exception("inbound pipeline failed")
    finally:
        hosted.vouch_waits -= 1


def first_reply(path: Path, outcome: InboundOutcome, *, attended: bool = False) -> ReplyPlan:
    """What the requester gets first, by the pure rule :func:`plan_first_reply`:
    ``attended`` (an interactive agent with a node inbox) holds the request for
    a person's session whatever the path."""
    return plan_first_reply(DeliveryPath.ATTENDED_INBOX if attended else _ACCEPT_PATH[path], outcome)


# -- the intakes of a hosted agent --------------------------------------------------

#: How a hosted agent's own counters name a refusal of each intake (``refused.{prefix}{rule}``).
SIGNAL_PREFIX: Final[Mapping[Intake, str]] = {
    Intake.INBOX: "",
    Intake.EVENT: "event.",
    Intake.FEED: "feed.",
    Intake.TELEMETRY: "telemetry.",
}

_ANSWERS: Final = frozenset({"request", "respond"})
# Per-path names, made once: on 3.11 every ``member.value`` read is a descriptor call.
_PATH_NAME: Final[Mapping[Path, str]] = {p: p.value for p in Path}
_RECEIVED_COUNTER: Final[Mapping[Path, str]] = {p: f"received.{p.value}" for p in Path}
_EMITS: Final = frozenset({"emit"})
_REFUSED_BYTES_CAP: Final = 5000


async def receive(
    hosted: HostedAgent,
    data: bytes,
    *,
    source: Path | str,
    reply: str | None = None,
    inbox_id: int | None = None,
    wait: bool = False,
) -> str:
    """The inbox intake (:meth:`HostedAgent.receive`): decode ─► verify ─► §22 guard
    ─► audit ─► route a request (admission, accept, handler) or a respond (to the
    request waiting for it).

    ``source`` is ``live``, ``local`` or ``mailbox`` (a drained inbox row,
    ``inbox_id``). ``wait`` awaits the handler instead of running it in the
    background (the drain does, to record each row's outcome). Returns the
    outcome for the node inbox: ``refused``, ``answered`` or ``held``.
    """
    path = source if isinstance(source, DeliverySource) else Path(source)
    node = hosted.node
    now_ms = node.now_ms()
    counters = hosted.counters
    counters["received"] += 1
    counters[_RECEIVED_COUNTER[path]] += 1
    inbox = node.inbox
    try:
        try:
            env = decode_verified(data)
        except Refused:
            if path is not Path.MAILBOX:
                # The buffer holds the same bytes; the drain acks them unjudged. Only
                # the exact bytes are remembered: an unverified (from, id) must never
                # enter the duplicate memory, or a forger could pre-empt real mail.
                refused_bytes = hosted.refused_bytes
                refused_bytes[hashlib.sha256(data).digest()] = None
                if len(refused_bytes) > _REFUSED_BYTES_CAP:
                    refused_bytes.pop(next(iter(refused_bytes)))
            raise
        if hosted.remembered is not None:
            await hosted.load_remembered()  # the first delivery since the start
        try:
            guard(hosted.guard, env, path, now_ms)
        except Refused as refused:
            verdict = refused.verdict
            if inbox is not None and path is not Path.MAILBOX and (
                verdict is None or verdict.protection is not Protection.DUPLICATE
            ):
                inbox.remember(hosted.agent_id, env["from"], env["id"], now_ms)
            raise
    except Refused as refused:
        hosted.refuse(Intake.INBOX, refused.rule, refused.envelope, refused.detail)
        if (
            refused.answer is not None
            and refused.envelope is not None
            and refused.envelope["type"] == "request"
            and first_reply(path, InboundOutcome.SIZE_REFUSAL).first_reply is FirstReply.ADMISSION_REFUSAL
        ):
            # §22.7: the size cap answers (CONTEXT_TOO_LARGE), on every path, and
            # no accept precedes it; every other refusal is silent.
            await hosted.answer_refusal(refused.envelope, refused.answer, path)
        return "refused"
    kind = env["type"]
    taken = False
    if inbox is not None and path is Path.LIVE:
        # The broker buffers a copy of every live message, and a drain of that
        # copy — in this process or after a kill -9 — must never run it a second
        # time (issue #23). A respond's pair is queued for this loop turn's
        # group commit (it runs no handler: nothing irreversible waits on it,
        # and one commit per respond was the requester's largest cost); a
        # request is *taken* (the drain leaves its copy alone) and its pair is
        # committed right before the irreversible step: its handler starting
        # (HostedAgent._run_handler) or an answer going out (_answer). A request
        # caught by a crash before that is simply drained and run after the
        # restart, once. (A local delivery has no buffered copy.)
        if kind == "request":
            inbox.take(hosted.agent_id, env["from"], env["id"])
            taken = True
        else:
            inbox.commit_live_soon(hosted.agent_id, env["from"], env["id"], now_ms)
    elif inbox is not None and path is not Path.MAILBOX:
        inbox.remember(hosted.agent_id, env["from"], env["id"], now_ms)
    node.audit(hosted, env, direction="in", path=_PATH_NAME[path])
    if kind == "request":
        if path is Path.LIVE and hosted.vouch_waits < MAX_VOUCH_WAITS and _awaits_registry(hosted, env):
            # The live subscription hands over one message at a time, so a
            # registry look-up here held up every later message to this agent
            # (up to the look-up's timeout when its answer was lost in a
            # reconnect: the soak saw 5 s). A sender not judged lately is
            # judged on a task of its own; the rest go on. Only so many at
            # once: past that (a flood of new keys) the subscription waits
            # again, as the backpressure it always was.
            hosted.vouch_waits += 1
            hosted.spawn(
                _vouch_wait(hosted, _request(hosted, env, path, reply, now_ms, data, inbox_id, wait, taken)),
                f"{hosted.name}:{env['id']}:vouch",
            )
            return "answered"
        return await _request(hosted, env, path, reply, now_ms, data, inbox_id, wait, taken)
    if kind == "respond":
        if node.on_respond(hosted, env):
            return "answered"
        # A late answer (its caller stopped waiting, or the node was away):
        # keep it in the inbox where a person or the agent can read it.
        if inbox is not None and inbox_id is None:
            await inbox.hold(hosted.agent_id, env["from"], env["id"], "respond", data, now_ms)
        return "held" if inbox is not None else "answered"
    counters["ignored"] += 1
    return "refused"


async def receive_event(hosted: HostedAgent, data: bytes, *, subject: str, source: Path | str) -> bool:
    """The event intake (§6.7, §22.1; :meth:`HostedAgent.receive_event`): decode ─►
    verify ─► kind (an emit) ─► §22 guard with the event duplicate memory ─► audit
    ─► :meth:`Agent.on_event`.

    Returns True when the event reached the handler (callers ack either way:
    a refused event must not be redelivered). No reply path exists for an
    event: every refusal is local only (§22.7).
    """
    path = source if isinstance(source, DeliverySource) else Path(source)
    node = hosted.node
    now_ms = node.now_ms()
    hosted.counters["events.received"] += 1
    try:
        env = decode_verified(data)
        check_kind(env, _EMITS, "not_an_emit")
        guard(hosted.event_guard, env, path, now_ms)
        # §5.3 step 2 for events as for requests: an event is an envelope whose
        # sender the receiver acts on, and events have no reply path, so the
        # refusal is silent (§22.7) and counted (event / sender_not_vouched).
        await vouched(hosted, env)
    except Refused as refused:
        hosted.refuse(Intake.EVENT, refused.rule, refused.envelope, refused.detail)
        return False
    node.audit(hosted, env, direction="in", path=f"event-{path.value}")
    payload = env.get("payload")
    payload = payload if isinstance(payload, Mapping) else {}
    domain, event_type = payload.get("domain"), payload.get("event_type")
    event = Event(
        subject=subject,
        sender=env["from"],
        domain=domain if isinstance(domain, str) else None,
        event_type=event_type if isinstance(event_type, str) else None,
        data=payload.get("data"),
        envelope=env,
    )
    await hosted.dispatch_event(env, event, "events")
    return True


# -- a platform service's reply -------------------------------------------------------


def receive_service_reply(
    data: bytes,
    request: Mapping[str, Any],
    subject: str,
    service_keys: dict[str, str],
    refusals: RefusalCounter,
) -> dict[str, Any]:
    """The service-reply intake (:meth:`Node.service_call`): decode ─► verify ─►
    bound to ``request`` (its id, its sender) ─► signed by the service's key,
    pinned on first use (WIRE-NOTES: a later reply signed by another key is
    refused rather than trusted). A refusal is counted and raised as the
    ProtocolError the caller's call fails with."""
    try:
        reply = decode_verified(data)
        if reply.get("in_reply_to") != request["id"] or reply.get("to") != request["from"]:
            raise Refused("unbound_reply", "service reply is not bound to the request", envelope=reply)
        service = subject.split(".")[1] if subject.startswith("mesh.") else subject
        pinned = service_keys.setdefault(service, reply["from"])
        if reply["from"] != pinned:
            raise Refused("unpinned_key", f"{service} reply signed by an unpinned key", envelope=reply)
    except Refused as refused:
        refusals.count(Intake.SERVICE_REPLY, refused.rule)
        raise refused.as_error() from None
    return reply
