"""The outbound half of the A2A bridge: hosted agents calling external A2A agents.

A hosted agent calls a configured peer (``[a2a.peers.<name>]``) with the same
call it uses for a mesh agent, addressing it as ``a2a:<name>``::

    reply = await ctx.request("a2a:weather", "forecast", {"city": "Oslo"})

What happens (A2A v1.0 over JSON-RPC, the official ``a2a-sdk`` client):

1. The peer's Agent Card is read (cached for ``card_ttl``). A card that declares
   the AGBoss mesh extension (``https://agboss.dev/a2a/mesh/v1``) makes the peer
   an AGBoss peer: the call activates the extension (``A2A-Extensions``) and
   carries a signed envelope in ``message.metadata[uri].envelope`` — issuer,
   audience (the peer's application), origin, the call chain extended by this
   hop, the replay window (PT60S), ``bodyHash`` over exactly the Message JSON
   sent, and the budget and deadline left of the mesh work making the call.
   Every call carries a W3C ``traceparent`` continuing the mesh trace (§13.1).
2. An answer whose ``A2A-Extensions`` does not echo the URI is a call without
   the mesh (``mesh: false``): no report is expected, and that is recorded.
3. A completed task's run report (``task.metadata[uri].report``) is verified
   against the peer's key, our own bodyHash and the task's id; the call is
   charged ``max(verified spend, contract_price)`` once per task, durably
   (:mod:`meshnode.a2a.charges`). A report that fails verification is charged
   at the contract price, logged, and marked ``invalid``.
4. An ambiguous send (the connection dropped or timed out after the message
   may have arrived) is resent with the *same* messageId, only to the same
   peer, and only within the ``idempotencyRetention`` its card declares. With
   none declared nothing is resent: the caller gets ``TRANSPORT_TIMEOUT`` with
   ``details.ambiguous``.

5. ``config={"stream": True}`` streams (SendStreamingMessage): ``reply.task`` is
   an :class:`A2AStreamTask` (chunks per artifact update; the last status
   update's report verified and charged once).
6. Cancelling the handler while it waits on a call (§10.8 ``task.cancel``)
   sends CancelTask for the peer's task once, best-effort, and records the call
   as ``canceled`` at zero (reports belong to completed tasks only).
7. A task still open when the wait ends: ``TRANSPORT_TIMEOUT`` with
   ``details.task_id``; :meth:`A2AOutbound.resume` (``ctx.a2a_task``) follows it.
8. Every task operation on an AGBoss peer (the GetTask polls, CancelTask)
   proves the caller: a task-operation envelope by the message's issuer in the
   ``AGBoss-Mesh-Envelope`` header, over ``{"method", "id"}`` (meshnode's
   profile; a peer that does not know it ignores the header).

The reply is a :class:`meshnode.agent.Reply` whose envelope is
synthesized (``from: "a2a:<name>"``); ``envelope["meta"][EXTENSION_URI]`` says
what the bridge knows: ``mesh``, ``report``, ``charge``, ``message_id``,
``task_id``, ``attempts``.

The node reaches this class only through
:class:`meshnode.node.gateway.OutboundGateway`. The parts: :mod:`meshnode.a2a.peers`
(peer settings, cards, parts, one call's state), :mod:`meshnode.a2a.client`
(the SDK client and what a failed request means), :mod:`meshnode.a2a.stream`
(the streamed call's handle and its reader).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import httpx
import nacl.signing
from a2a.extensions.common import HTTP_EXTENSION_HEADER, get_requested_extensions
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    Message,
    SendMessageConfiguration,
    SendMessageRequest,
)
from google.protobuf import json_format

from meshnode.a2a.charges import Charge, ChargeStore, charge_amount
from meshnode.a2a.client import (
    Ambiguous,
    Unsent,
    answer_dict,
    classify,
    http_client,
    ints_from_wire,
    peer_client,
)
from meshnode.a2a.peers import (
    INTERRUPTED_STATES,
    TERMINAL_STATES,
    PeerCard,
    PeerSettings,
    Sent,
    card_url_of,
    input_parts,
    output_of_parts,
    read_card,
    report_of,
)
from meshnode.a2a.stream import A2AStreamTask
from meshnode.agent import RemoteError, Reply
from meshnode.aio import wait_for
from meshnode.node.gateway import CallContext
from meshnode.protocol.a2a_extension import (
    A2A_TARGET_PREFIX,
    EXTENSION_URI,
    TASK_ENVELOPE_HEADER,
    ReportInvalid,
    body_hash,
    build_envelope_claims,
    chain_meta_of,
    extend_chain,
    format_usd,
    sign_envelope,
    task_operation,
    unsecured_envelope,
    verify_report,
)
from meshnode.protocol.budget import parse_budget
from meshnode.protocol.envelope import trace_to_traceparent, valid_trace
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair, decode_seed

if TYPE_CHECKING:
    from meshnode.config import A2AConfig

__all__ = ["A2AOutbound", "A2AStreamTask", "CallContext"]

log = logging.getLogger("meshnode.a2a.outbound")


@dataclass
class _Outcome:
    answer: dict[str, Any]  # ProtoJSON StreamResponse: {"task": …} or {"message": …}
    mesh: bool
    attempts: int


def _signing_key(key: KeyPair) -> nacl.signing.SigningKey:
    return nacl.signing.SigningKey(decode_seed(key.seed)[1])


@dataclass
class A2AOutbound:
    """The bridge's client side, one per node. ``call`` is what ``ctx.request`` uses
    for an ``a2a:<name>`` target."""

    application: str
    signing: str
    peers: Mapping[str, PeerSettings]
    charges: ChargeStore
    node_key: KeyPair
    clock: Callable[[], float] = time.time
    #: Seconds between GetTask polls of a task that is still working.
    poll_interval_s: float = 0.2
    #: Seconds a CancelTask sent for abandoned work may take (best-effort).
    cancel_timeout_s: float = 5.0
    _cards: dict[str, PeerCard] = field(default_factory=dict)
    _card_locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    #: (peer, task id) of peer tasks a CancelTask went out for: sent once.
    _cancels_sent: set[tuple[str, str]] = field(default_factory=set)
    #: Calls whose wait ended with the peer's task still open, by (peer, task id):
    #: what :meth:`resume` needs to verify the task's report later (bounded, in memory).
    _open_tasks: dict[tuple[str, str], Sent] = field(default_factory=dict)
    #: Cancels in flight, held so the loop does not collect them mid-send.
    _background: set[asyncio.Task[Any]] = field(default_factory=set)
    #: Told of every charge recorded for the first time (the daemon publishes it
    #: for the mesh's ledger, §19.6); a failure is logged, the charge stands.
    on_charge: Callable[[Charge], Awaitable[None]] | None = None

    @classmethod
    def from_config(cls, config: A2AConfig, *, default_application: str, charges: ChargeStore,
                    node_key: KeyPair) -> A2AOutbound:
        peers = {
            name: PeerSettings(
                url=p.url,
                contract_price=Decimal(p.contract_price),
                audience=p.audience,
                issuer_key=p.issuer_key,
                timeout_s=p.timeout.total_seconds(),
                card_ttl_s=p.card_ttl.total_seconds(),
            )
            for name, p in config.peers.items()
        }
        return cls(config.application or default_application, config.signing, peers, charges, node_key)

    def _peer(self, name: str) -> PeerSettings:
        peer = self.peers.get(name)
        if peer is None:
            raise ProtocolError("NOT_FOUND", f"no A2A peer {name!r} is configured ([a2a.peers.{name}])",
                                {"peer": name})
        return peer

    async def card(self, name: str, *, refresh: bool = False) -> PeerCard:
        """The peer's card, read at most once per ``card_ttl``."""
        settings = self._peer(name)
        lock = self._card_locks.setdefault(name, asyncio.Lock())
        async with lock:
            cached = self._cards.get(name)
            if cached is not None and not refresh and self.clock() - cached.fetched_at < settings.card_ttl_s:
                return cached
            url = card_url_of(settings.url)
            try:
                async with http_client(timeout=settings.timeout_s) as http:
                    response = await http.get(url)
                    response.raise_for_status()
                    raw = response.json()
                if not isinstance(raw, dict):
                    raise ValueError("the card is not a JSON object")
                card = read_card(raw, settings, now=self.clock())
            except (httpx.HTTPError, ValueError, json_format.ParseError) as exc:
                raise ProtocolError("AGENT_UNAVAILABLE", f"the Agent Card of A2A peer {name!r} could not be read",
                                    {"peer": name, "reason": type(exc).__name__}) from exc
            self._cards[name] = card
            return card

    # -- the envelope -------------------------------------------------------------

    async def _envelope_claims(self, peer: PeerCard, call: CallContext, message: Mapping[str, Any],
                               timeout: float) -> dict[str, Any]:
        env = call.envelope or {}
        incoming = chain_meta_of(env) or {}
        chain_in = incoming.get("callChain")
        chain_in = [e for e in chain_in if isinstance(e, Mapping)] if isinstance(chain_in, list) else []
        execution_id = env.get("id") if isinstance(env.get("id"), str) else None
        payload = env.get("payload")
        start = payload.get("offering") if isinstance(payload, Mapping) else None
        exec_id = execution_id or f"call-{uuid.uuid4()}"
        start = start if isinstance(start, str) else None
        last = chain_in[-1] if chain_in else None
        if last is not None and last.get("application") == self.application and last.get("start") == start:
            # The inbound bridge already entered this hop (the work came in by A2A
            # on this very offering): one application hop, one chain entry.
            chain = [dict(e) for e in chain_in]
        else:
            chain = extend_chain(chain_in, application=self.application, start=start, execution_id=exec_id)
        origin_in = incoming.get("origin") if isinstance(incoming.get("origin"), Mapping) else {}
        root = origin_in.get("rootExecutionId") if isinstance(origin_in, Mapping) else None
        if not isinstance(root, str):
            first = chain_in[0].get("executionId") if chain_in else None
            root = first if isinstance(first, str) else exec_id
        origin = {"rootExecutionId": root, "executionId": exec_id}
        remaining, deadline_s = await self._limits(call, execution_id, timeout)
        return build_envelope_claims(
            issuer=self._issuer(call), audience=peer.audience, now=self.clock(), message=message,
            call_chain=chain, origin=origin, budget_remaining=remaining,
            deadline_remaining_s=deadline_s,
        )

    async def _limits(self, call: CallContext, execution_id: str | None,
                      timeout: float) -> tuple[Decimal | None, float]:
        """Budget and deadline left of the mesh work making the call: an explicit
        budget block wins, else the block of the request being handled (whose
        ceiling is reduced by what A2A calls of the same work were charged)."""
        block = call.budget
        explicit = block is not None
        if block is None and call.envelope is not None:
            block = call.envelope.get("budget")
        remaining: Decimal | None = None
        deadline_s = timeout  # the caller waits no longer than this, whatever the work's deadline
        if isinstance(block, Mapping):
            try:
                budget = parse_budget(block)
            except ProtocolError:
                budget = None
            if budget is not None:
                ceiling = budget.cost_ceiling
                if ceiling is not None and ceiling.currency == "USD":
                    remaining = Decimal(ceiling.amount_micro) / Decimal(1_000_000)
                    if not explicit and execution_id is not None:
                        remaining -= await self.charges.spent_by_execution(execution_id)
                    remaining = max(remaining, Decimal(0))
                if budget.deadline_ms is not None:
                    deadline_s = min(deadline_s, max(0.0, budget.deadline_ms / 1000 - self.clock()))
        # Whole milliseconds: the deadline is advice to the peer, not a stopwatch.
        return remaining, round(deadline_s, 3)

    def _issuer(self, call: CallContext) -> str:
        return call.agent_id if self.signing == "agent" else self.application

    def _task_headers(self, sent: Sent, method: str) -> dict[str, str]:
        """The headers of a task operation on ``sent``'s task: the call's own,
        and, for an AGBoss peer, the proof that this is the task's caller — a
        task-operation envelope by the same issuer that sent the message
        (meshnode's profile of the extension; a peer that does not know it
        ignores the header). Unsigned (``signing = "none"``) proves nothing."""
        headers = dict(sent.headers)
        if sent.peer.mesh and sent.task_id and self.signing != "none":
            claims = build_envelope_claims(
                issuer=self._issuer(sent.call), audience=sent.peer.audience, now=self.clock(),
                message=task_operation(method, sent.task_id),
            )
            headers[TASK_ENVELOPE_HEADER] = self._token(claims, sent.call)
        return headers

    def _token(self, claims: Mapping[str, Any], call: CallContext) -> str:
        if self.signing == "none":
            return unsecured_envelope(claims)
        key = call.agent_key if self.signing == "agent" else self.node_key
        return sign_envelope(claims, _signing_key(key))

    # -- one call -------------------------------------------------------------------

    async def call(self, name: str, offering: str, input: Any, call: CallContext, *,
                   timeout: float, stream: bool = False) -> Reply:
        """Send one message to peer ``name`` and wait for its outcome (see the module doc).

        ``stream``: SendStreamingMessage instead; the reply comes with the first
        event and, unless that already ended the task, carries an
        :class:`A2AStreamTask` as ``reply.task`` (chunks, result, cancel).

        Cancelling the awaiting coroutine (a ``task.cancel`` of the mesh work
        making the call, §10.8) sends CancelTask for the peer's task once,
        best-effort, and records the call as canceled (charged nothing)."""
        settings = self._peer(name)
        peer = await self.card(name)
        message_id = str(uuid.uuid4())
        message: dict[str, Any] = {"messageId": message_id, "role": "ROLE_USER", "parts": input_parts(input)}
        if offering:
            # A2A v1.0 has no skill selector on a message; we name the offering
            # plainly so a peer that maps skills can read it.
            message["metadata"] = {"skill": offering}
        # Exactly the JSON the SDK will put on the wire for this Message: the
        # proto's own ProtoJSON rendering (numbers as the proto holds them).
        proto = json_format.ParseDict(message, Message())
        sent = json_format.MessageToDict(proto)
        sent_hash = body_hash(sent)
        loop_start = time.monotonic()
        overall_deadline = loop_start + timeout
        headers: dict[str, str] = {}
        if valid_trace(call.trace):
            headers["traceparent"] = trace_to_traceparent(call.trace)
            if call.trace.get("tracestate"):
                headers["tracestate"] = str(call.trace["tracestate"])
        if peer.mesh:
            headers[HTTP_EXTENSION_HEADER] = EXTENSION_URI

        async def build() -> Message:
            msg = Message()
            msg.CopyFrom(proto)
            if peer.mesh:
                left = max(0.0, overall_deadline - time.monotonic())
                claims = await self._envelope_claims(peer, call, sent, left)
                msg.metadata.update({EXTENSION_URI: {"envelope": self._token(claims, call)}})
            return msg

        sent_state = Sent(name, settings, peer, call, message_id, sent_hash, headers)
        if stream:
            return await self._open_stream(sent_state, build, overall_deadline)
        try:
            outcome = await self._send(name, settings, peer, build, headers, overall_deadline, message_id)
            sent_state.mesh = outcome.mesh
            return await self._conclude(sent_state, outcome, overall_deadline)
        except asyncio.CancelledError:
            await self._abandon(sent_state)
            raise

    async def _send(self, name: str, settings: PeerSettings, peer: PeerCard,
                    build: Callable[[], Awaitable[Message]], headers: dict[str, str],
                    overall_deadline: float, message_id: str) -> _Outcome:
        first_sent: float | None = None
        attempts = 0
        while True:
            attempts += 1
            left = overall_deadline - time.monotonic()
            if left <= 0:
                raise self._timeout(name, message_id, attempts - 1, ambiguous=attempts > 1)
            msg = await build()
            echoed: list[str] = []
            try:
                if first_sent is None:
                    first_sent = self.clock()
                answer = await self._send_once(peer, msg, headers, min(settings.timeout_s, left), echoed)
                mesh = peer.mesh and EXTENSION_URI in get_requested_extensions(echoed)
                return _Outcome(answer, mesh, attempts)
            except Unsent as exc:
                raise ProtocolError("AGENT_UNAVAILABLE", f"A2A peer {name!r} could not be reached",
                                    {"peer": name, "message_id": message_id}) from exc
            except Ambiguous as exc:
                retention = peer.retention_s
                if retention is None:
                    log.warning("A2A call to %s (message %s) is ambiguous; the peer declares no "
                                "idempotencyRetention, so it is not resent", name, message_id)
                    raise self._timeout(name, message_id, attempts - 1, ambiguous=True,
                                        reason="the peer declares no idempotencyRetention") from exc
                if self.clock() - (first_sent or 0.0) >= retention or time.monotonic() >= overall_deadline:
                    raise self._timeout(name, message_id, attempts - 1, ambiguous=True,
                                        reason="the retention window or the wait ended") from exc
                log.info("A2A call to %s (message %s) is ambiguous; resending the same message", name,
                         message_id)
                await asyncio.sleep(min(0.2 * attempts, max(0.0, overall_deadline - time.monotonic())))

    @staticmethod
    def _timeout(name: str, message_id: str, resent: int, *, ambiguous: bool,
                 reason: str | None = None) -> ProtocolError:
        details: dict[str, Any] = {"peer": name, "message_id": message_id, "ambiguous": ambiguous,
                                   "resent": resent}
        if reason:
            details["reason"] = reason
        text = f"no answer from A2A peer {name!r}; the message may have arrived"
        return ProtocolError("TRANSPORT_TIMEOUT", text + (f" ({reason})" if reason else ""), details)

    async def _send_once(self, peer: PeerCard, msg: Message, headers: Mapping[str, str],
                         timeout: float, echoed: list[str]) -> dict[str, Any]:
        bodies: list[Any] = []
        async with peer_client(peer.card, headers, timeout=timeout, echoed=echoed, bodies=bodies) as (client, ctx):
            request = SendMessageRequest(message=msg, configuration=SendMessageConfiguration())
            try:
                async for event in client.send_message(request, context=ctx):
                    return ints_from_wire(answer_dict(event), bodies)
            except Exception as exc:
                classify(exc)
        raise ProtocolError("DEPENDENCY_FAILED", "the A2A peer answered nothing")

    # -- after the answer -------------------------------------------------------------

    async def _poll(self, sent: Sent, overall_deadline: float) -> dict[str, Any]:
        """GetTask for ``sent``'s task, proving its caller; {} when the poll failed
        in a way the caller's loop retries."""
        peer, settings, task_id = sent.peer, sent.settings, str(sent.task_id)
        headers = self._task_headers(sent, "GetTask")
        left = max(0.1, overall_deadline - time.monotonic())
        bodies: list[Any] = []
        async with peer_client(peer.card, headers, timeout=min(settings.timeout_s, left), bodies=bodies) as (client, ctx):
            try:
                task = await client.get_task(GetTaskRequest(id=task_id), context=ctx)
            except Exception as exc:
                try:
                    classify(exc)
                except (Ambiguous, Unsent):
                    return {}  # a failed poll is retried by the caller's loop
        return ints_from_wire(dict(json_format.MessageToDict(task)), bodies)

    async def _conclude(self, sent_state: Sent, outcome: _Outcome, overall_deadline: float) -> Reply:
        """The reply to a call from the peer's answer, following an open task by GetTask."""
        name, call, message_id = sent_state.name, sent_state.call, sent_state.message_id
        answer = outcome.answer
        info: dict[str, Any] = {"peer": name, "mesh": outcome.mesh, "message_id": message_id,
                                "attempts": outcome.attempts, "task_id": None, "report": None,
                                "charge": None}
        if "message" in answer:
            sent_state.finished = True
            msg = answer["message"]
            charge = await self._charge(sent_state, None)
            info.update(report=charge.report, charge=charge.to_object())
            return self._reply(name, call, "completed", output_of_parts(msg.get("parts") or []), info, None)
        task = answer.get("task") or {}
        task_id = str(task.get("id") or "")
        info["task_id"] = task_id or None
        sent_state.task_id = task_id or None
        while True:
            state = str((task.get("status") or {}).get("state") or "")
            if state in TERMINAL_STATES or state in INTERRUPTED_STATES:
                sent_state.finished = True
                break
            if time.monotonic() >= overall_deadline:
                self._remember_open(sent_state)
                raise ProtocolError("TRANSPORT_TIMEOUT",
                                    f"A2A task {task_id} of peer {name!r} did not finish before the wait ended"
                                    " (follow it with ctx.a2a_task)",
                                    {"peer": name, "task_id": task_id, "state": state, "ambiguous": False,
                                     "message_id": message_id})
            await asyncio.sleep(self.poll_interval_s)
            polled = await self._poll(sent_state, overall_deadline)
            if polled:
                task = polled
        status = TERMINAL_STATES.get(state) or INTERRUPTED_STATES[state]
        output = self._task_output(task)
        status_meta = ((task.get("status") or {}).get("message") or {}).get("metadata") or {}
        mesh_status = status_meta.get(EXTENSION_URI) if isinstance(status_meta, Mapping) else None
        if isinstance(mesh_status, Mapping):
            info["status"] = dict(mesh_status)  # {code, details} of a rejected/failed task
        if status == "completed":
            meta = task.get("metadata") or {}
            ext = meta.get(EXTENSION_URI) if isinstance(meta, Mapping) else None
            token = ext.get("report") if isinstance(ext, Mapping) else None
            charge = await self._charge(sent_state, token if isinstance(token, str) else None)
            info.update(report=charge.report, charge=charge.to_object())
        if status == "failed":
            code = mesh_status.get("code") if isinstance(mesh_status, Mapping) else None
            error = {"code": "DEPENDENCY_FAILED", "message": f"the A2A task of peer {name!r} failed",
                     "details": {"peer": name, "task_id": task_id, **({"a2a_code": code} if code else {})}}
            raise RemoteError(self._envelope(name, call, "failed", None, info, error))
        return self._reply(name, call, status, output, info, None)

    @staticmethod
    def _task_output(task: Mapping[str, Any]) -> Any:
        parts: list[dict[str, Any]] = []
        for artifact in task.get("artifacts") or []:
            parts.extend(artifact.get("parts") or [])
        if not parts:
            parts = list(((task.get("status") or {}).get("message") or {}).get("parts") or [])
        return output_of_parts(parts)

    async def _charge(self, sent: Sent, report_token: str | None) -> Charge:
        """Judge the report of ``sent``'s call and record the charge once;
        returns the charge that stands."""
        spend: Decimal | None = None
        note: str | None = None
        peer, task_id = sent.peer, sent.task_id
        if not sent.mesh:
            report = "not_expected"
        elif report_token is None:
            report = "missing"
        elif peer.issuer_key is None:
            report, note = "unverifiable", "no key for the peer's reports (set issuer_key)"
        elif not sent.sent_hash:
            report, note = "unverifiable", "the call that opened this task is not remembered (a restart?)"
        elif task_id is None:
            report, note = "invalid", "a report without a task"
        else:
            try:
                claims = verify_report(report_token, issuer_key=peer.issuer_key,
                                       expected_body_hash=sent.sent_hash, expected_execution_id=task_id)
                spend, report = claims.spend_total, "verified"
            except ReportInvalid as exc:
                report, note = "invalid", str(exc)
                log.warning("A2A peer %s sent an invalid run report for task %s (%s); "
                            "charging the contract price", sent.name, task_id, exc)
        charge = self._charge_row(sent, report, spend, charge_amount(sent.settings.contract_price, spend), note)
        if await self.charges.record(charge):
            await self._announce(charge)
            return charge
        stands = await self.charges.get(sent.name, charge.task_key)
        return stands if stands is not None else charge

    def _charge_row(self, sent: Sent, report: str, spend: Decimal | None, charged: Decimal,
                    note: str | None) -> Charge:
        env = sent.call.envelope or {}
        return Charge(
            peer=sent.name, task_key=f"task:{sent.task_id}" if sent.task_id else f"message:{sent.message_id}",
            message_id=sent.message_id, task_id=sent.task_id, agent=sent.call.agent_id,
            execution_id=env.get("id") if isinstance(env.get("id"), str) else None, mesh=sent.mesh,
            report=report, reported_spend=format_usd(spend) if spend is not None else None,
            contract_price=format_usd(sent.settings.contract_price), charged=format_usd(charged),
            currency="USD", charged_at_ms=int(self.clock() * 1000), note=note,
        )

    # -- a task the call's wait left behind ----------------------------------------------

    def _remember_open(self, sent: Sent) -> None:
        if sent.task_id:
            self._open_tasks[(sent.name, sent.task_id)] = sent
            while len(self._open_tasks) > 1000:  # oldest first out
                self._open_tasks.pop(next(iter(self._open_tasks)))

    async def resume(self, name: str, task_id: str, call: CallContext, *, timeout: float) -> A2AStreamTask:
        """A handle on task ``task_id`` of peer ``name`` — typically one a call's
        wait ended on (``TRANSPORT_TIMEOUT`` with ``details.task_id``) — followed by
        GetTask polls for up to ``timeout`` seconds: ``result()``, ``cancel()``.

        Its completion is charged once like any other pass; the run report is
        verified when this node still remembers the call that opened the task
        (not across a restart: then the report is ``unverifiable`` and the
        contract price is charged)."""
        settings = self._peer(name)
        peer = await self.card(name)
        known = self._open_tasks.pop((name, task_id), None)
        headers: dict[str, str] = {}
        if valid_trace(call.trace):
            headers["traceparent"] = trace_to_traceparent(call.trace)
        if peer.mesh:
            headers[HTTP_EXTENSION_HEADER] = EXTENSION_URI
        if known is not None:
            sent = Sent(name, settings, peer, known.call, known.message_id, known.sent_hash, headers,
                         mesh=known.mesh, task_id=task_id)
        else:
            sent = Sent(name, settings, peer, call, "", "", headers, mesh=peer.mesh, task_id=task_id)
        handle = A2AStreamTask(self, sent)
        handle.start(None, watch_until=time.monotonic() + timeout, name=f"a2a-resume:{name}:{task_id}")
        try:
            await handle._wait_first(timeout)
        except BaseException:
            handle.close()
            raise
        return handle

    # -- cancel (§10.8 across the bridge) ----------------------------------------------

    async def _abandon(self, sent: Sent) -> None:
        """The mesh work awaiting this call was canceled: cancel the peer's task.

        Runs in its own asyncio task, shielded, so a second cancel of the caller
        does not cut the CancelTask off; the caller's cancellation goes on."""
        work = asyncio.get_running_loop().create_task(
            self._cancel_peer(sent, "the calling mesh work was canceled"),
            name=f"a2a-cancel:{sent.name}:{sent.task_id}")
        self._background.add(work)
        work.add_done_callback(self._background.discard)
        try:
            await asyncio.shield(work)
        except BaseException:  # noqa: BLE001 - canceled again, or the cancel failed: both already logged
            pass

    async def _cancel_peer(self, sent: Sent, why: str) -> dict[str, Any] | None:
        """Send CancelTask for ``sent``'s task once (best-effort, ``cancel_timeout_s``)
        and record the call as canceled. Returns the peer's task as it answered
        (ProtoJSON), or None when nothing was (or could be) asked."""
        if sent.finished:
            return None
        sent.finished = True
        if sent.task_id is None:
            # A blocking SendMessage still in flight names no task: nothing to cancel.
            log.info("A2A call to %s (message %s) abandoned before the peer named a task: %s",
                     sent.name, sent.message_id, why)
            await self._record_canceled(sent, f"{why}; the peer had named no task, so no CancelTask was sent")
            return None
        key = (sent.name, sent.task_id)
        if key in self._cancels_sent:
            return None
        self._cancels_sent.add(key)
        answer: dict[str, Any] | None = None
        try:
            headers = self._task_headers(sent, "CancelTask")
            async with peer_client(sent.peer.card, headers, timeout=self.cancel_timeout_s) as (client, ctx):
                task = await wait_for(
                    client.cancel_task(CancelTaskRequest(id=sent.task_id), context=ctx), self.cancel_timeout_s)
            answer = dict(json_format.MessageToDict(task))
            state = str((answer.get("status") or {}).get("state") or "")
            note = f"{why}; CancelTask sent, the peer's task is {state or 'in an unknown state'}"
        except Exception as exc:  # best-effort: the peer may be gone or the task already over
            state = ""
            note = f"{why}; CancelTask sent, not confirmed ({type(exc).__name__})"
        log.info("A2A task %s of peer %s: %s", sent.task_id, sent.name, note)
        if state == "TASK_STATE_COMPLETED" and answer is not None:
            # It finished before the cancel landed: a completed task's report is
            # charged as on any other pass (once).
            await self._charge(sent, report_of(answer))
        else:
            await self._record_canceled(sent, note)
        return answer

    async def _record_canceled(self, sent: Sent, note: str) -> None:
        """A canceled call is recorded at zero: the extension's run report (and so
        any spend the caller could verify) belongs to completed tasks only."""
        try:
            row = self._charge_row(sent, "canceled", None, Decimal(0), note)
            if await self.charges.record(row):
                await self._announce(row)
        except Exception:
            log.exception("recording the canceled A2A call %s failed", sent.message_id)

    async def _announce(self, charge: Charge) -> None:
        if self.on_charge is None:
            return
        try:
            await self.on_charge(charge)
        except Exception as exc:  # the ledger misses it; the local table keeps it
            log.warning("A2A charge %s/%s not published for the ledger: %s", charge.peer, charge.task_key, exc)

    # -- streaming (SendStreamingMessage) ---------------------------------------------------

    async def _open_stream(self, sent: Sent, build: Callable[[], Awaitable[Message]],
                           overall_deadline: float) -> Reply:
        handle = A2AStreamTask(self, sent)
        handle.start(build, watch_until=overall_deadline, name=f"a2a-stream:{sent.name}:{sent.message_id}")
        try:
            await handle._wait_first(max(0.0, overall_deadline - time.monotonic()))
        except asyncio.CancelledError:
            await self._abandon(sent)
            handle.close()
            raise
        except BaseException:
            handle.close()
            raise
        if handle.final is not None:
            final = handle.final
            if final.get("error") is not None:
                raise RemoteError(final)
            return Reply(final, accepted=True)
        return Reply(handle.last_update, accepted=True, task=handle)

    async def _finish(self, sent: Sent, state: str, output: Any, token: str | None,
                      status_meta: Any, chunks: int) -> dict[str, Any]:
        """The closing envelope of a streamed call; a completed task is charged once."""
        sent.finished = True
        status = TERMINAL_STATES.get(state) or INTERRUPTED_STATES.get(state) or "completed"
        info: dict[str, Any] = {"peer": sent.name, "mesh": sent.mesh, "message_id": sent.message_id,
                                "attempts": 1, "task_id": sent.task_id, "report": None, "charge": None,
                                "streamed": True, "chunks": chunks}
        if isinstance(status_meta, Mapping):
            info["status"] = dict(status_meta)
        if status == "completed":
            charge = await self._charge(sent, token)
            info.update(report=charge.report, charge=charge.to_object())
        error: dict[str, Any] | None = None
        if status == "failed":
            code = status_meta.get("code") if isinstance(status_meta, Mapping) else None
            error = {"code": "DEPENDENCY_FAILED", "message": f"the A2A task of peer {sent.name!r} failed",
                     "details": {"peer": sent.name, "task_id": sent.task_id,
                                 **({"a2a_code": code} if code else {})}}
            output = None
        return self._envelope(sent.name, sent.call, status, output, info, error)

    def _envelope(self, name: str, call: CallContext, status: str, output: Any, info: Mapping[str, Any],
                  error: Mapping[str, Any] | None) -> dict[str, Any]:
        payload: dict[str, Any] = {"status": status}
        if output is not None:
            payload["output"] = output
        env: dict[str, Any] = {
            "type": "respond",
            "from": A2A_TARGET_PREFIX + name,
            "to": call.agent_id,
            "in_reply_to": info["message_id"],
            "trace": dict(call.trace),
            "payload": payload,
            "meta": {EXTENSION_URI: dict(info)},
        }
        if info.get("task_id"):
            env["task_id"] = info["task_id"]
        if error is not None:
            env["error"] = dict(error)
        return env

    def _reply(self, name: str, call: CallContext, status: str, output: Any, info: Mapping[str, Any],
               error: Mapping[str, Any] | None) -> Reply:
        return Reply(self._envelope(name, call, status, output, info, error), accepted=True)
