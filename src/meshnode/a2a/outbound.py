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

The reply is a :class:`meshnode.agent.Reply` whose envelope is
synthesized (``from: "a2a:<name>"``); ``envelope["meta"][EXTENSION_URI]`` says
what the bridge knows: ``mesh``, ``report``, ``charge``, ``message_id``,
``task_id``, ``attempts``.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import httpx
import nacl.signing
from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.client.card_resolver import parse_agent_card
from a2a.extensions.common import HTTP_EXTENSION_HEADER, get_requested_extensions
from a2a.types.a2a_pb2 import (
    AgentCard,
    CancelTaskRequest,
    GetTaskRequest,
    Message,
    SendMessageConfiguration,
    SendMessageRequest,
    StreamResponse,
)
from a2a.utils.constants import AGENT_CARD_WELL_KNOWN_PATH, PROTOCOL_VERSION_CURRENT, VERSION_HEADER
from google.protobuf import json_format

from meshnode.a2a.charges import Charge, ChargeStore, charge_amount
from meshnode.a2a.extension import (
    EXTENSION_URI,
    ReportInvalid,
    body_hash,
    build_envelope_claims,
    extend_chain,
    format_usd,
    parse_duration,
    parse_verify_key,
    sign_envelope,
    unsecured_envelope,
    verify_report,
)
from meshnode.a2a.routing import A2A_TARGET_PREFIX, chain_meta_of, peer_name_of
from meshnode.agent import RemoteError, Reply
from meshnode.protocol.budget import parse_budget
from meshnode.protocol.envelope import trace_to_traceparent, valid_trace
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair, decode_seed

if TYPE_CHECKING:
    from meshnode.config import A2AConfig

__all__ = [
    "A2A_TARGET_PREFIX",
    "A2AOutbound",
    "A2AStreamTask",
    "CallContext",
    "PeerCard",
    "PeerSettings",
    "chain_meta_of",
    "input_parts",
    "output_of_parts",
    "peer_name_of",
]

log = logging.getLogger("meshnode.a2a.outbound")

_TERMINAL = {
    "TASK_STATE_COMPLETED": "completed",
    "TASK_STATE_FAILED": "failed",
    "TASK_STATE_CANCELED": "canceled",
    "TASK_STATE_REJECTED": "rejected",
}
_INTERRUPTED = {
    "TASK_STATE_INPUT_REQUIRED": "input_required",
    "TASK_STATE_AUTH_REQUIRED": "auth_required",
}

# --- parts ----------------------------------------------------------------------


def input_parts(value: Any) -> list[dict[str, Any]]:
    """A mesh request input as A2A parts (ProtoJSON): a string is one text part,
    anything else (an object, a list, a number) one data part; None is an empty
    data object (a Message needs a part)."""
    if isinstance(value, str):
        return [{"text": value}]
    return [{"data": {} if value is None else value}]


def output_of_parts(parts: list[dict[str, Any]]) -> Any:
    """A2A parts as a mesh output: one data part → its data; only text parts → the
    text joined; nothing → None; anything else → the parts as sent (ProtoJSON)."""
    if not parts:
        return None
    if len(parts) == 1 and "data" in parts[0]:
        return parts[0]["data"]
    if all("text" in p for p in parts):
        return "".join(str(p["text"]) for p in parts)
    return parts


# --- peers and cards ------------------------------------------------------------


@dataclass(frozen=True)
class PeerSettings:
    """One ``[a2a.peers.<name>]`` table, typed."""

    url: str
    contract_price: Decimal
    audience: str | None = None
    issuer_key: str | None = None
    timeout_s: float = 30.0
    card_ttl_s: float = 600.0


@dataclass(frozen=True)
class PeerCard:
    """What the bridge read from a peer's Agent Card."""

    card: AgentCard
    raw: dict[str, Any]
    fetched_at: float
    #: The card declares the mesh extension.
    mesh: bool
    #: ``params.idempotencyRetention`` in seconds; None when not declared.
    retention_s: float | None
    audience: str | None
    issuer_key: nacl.signing.VerifyKey | None


def card_url_of(url: str) -> str:
    """The card URL of a configured peer URL (a ``….json`` URL is the card itself)."""
    if url.split("?", 1)[0].endswith(".json"):
        return url
    return url.rstrip("/") + AGENT_CARD_WELL_KNOWN_PATH


def read_card(raw: Mapping[str, Any], settings: PeerSettings, *, now: float) -> PeerCard:
    """Interpret a fetched card: the extension's declaration and what it binds."""
    card = parse_agent_card(copy.deepcopy(dict(raw)))
    declared: Mapping[str, Any] | None = None
    caps = raw.get("capabilities")
    for ext in (caps.get("extensions") if isinstance(caps, Mapping) else None) or []:
        if isinstance(ext, Mapping) and ext.get("uri") == EXTENSION_URI:
            declared = ext
            break
    params = declared.get("params") if declared is not None else None
    params = params if isinstance(params, Mapping) else {}
    retention: float | None = None
    if "idempotencyRetention" in params:
        try:
            retention = parse_duration(params["idempotencyRetention"])
        except ValueError:
            log.warning("A2A peer %s declares a malformed idempotencyRetention %r: no resends",
                        settings.url, params["idempotencyRetention"])
    audience = settings.audience or _str(params.get("application")) or _str(raw.get("name"))
    key_text = settings.issuer_key or _str(params.get("issuerKey"))
    key: nacl.signing.VerifyKey | None = None
    if key_text:
        try:
            key = parse_verify_key(key_text)
        except ValueError:
            log.warning("A2A peer %s: its card's issuerKey is not an Ed25519 key; reports unverifiable",
                        settings.url)
    return PeerCard(card, dict(raw), now, declared is not None, retention, audience, key)


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


# --- the call -------------------------------------------------------------------


@dataclass
class CallContext:
    """What the calling mesh work contributes to an outbound A2A call."""

    agent_id: str
    agent_key: KeyPair
    trace: Mapping[str, Any]
    #: The envelope of the mesh request being handled (None outside a handler).
    envelope: Mapping[str, Any] | None = None
    #: A budget block the caller passed explicitly to ``ctx.request``.
    budget: Mapping[str, Any] | None = None


@dataclass
class _Outcome:
    answer: dict[str, Any]  # ProtoJSON StreamResponse: {"task": …} or {"message": …}
    mesh: bool
    attempts: int


@dataclass
class _Sent:
    """One message sent to a peer, and what is known of its task so far."""

    name: str
    settings: PeerSettings
    peer: PeerCard
    call: CallContext
    message_id: str
    sent_hash: str
    headers: dict[str, str]
    mesh: bool = False
    task_id: str | None = None
    #: The task reached a terminal or interrupted state (nothing left to cancel).
    finished: bool = False


class _Ambiguous(Exception):
    pass


class _Unsent(Exception):
    pass


def _signing_key(key: KeyPair) -> nacl.signing.SigningKey:
    return nacl.signing.SigningKey(decode_seed(key.seed)[1])


def _causes(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


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
    _open_tasks: dict[tuple[str, str], _Sent] = field(default_factory=dict)
    #: Cancels in flight, held so the loop does not collect them mid-send.
    _background: set[asyncio.Task[Any]] = field(default_factory=set)

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

    def _http(self, **kwargs: Any) -> httpx.AsyncClient:
        headers = {VERSION_HEADER: PROTOCOL_VERSION_CURRENT}
        return httpx.AsyncClient(headers=headers, **kwargs)

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
                async with self._http(timeout=settings.timeout_s) as http:
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
        issuer = call.agent_id if self.signing == "agent" else self.application
        return build_envelope_claims(
            issuer=issuer, audience=peer.audience, now=self.clock(), message=message,
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

        sent_state = _Sent(name, settings, peer, call, message_id, sent_hash, headers)
        if stream:
            return await self._open_stream(sent_state, build, overall_deadline)
        try:
            outcome = await self._send(name, settings, peer, build, headers, overall_deadline, message_id)
            sent_state.mesh = outcome.mesh
            return await self._conclude(name, settings, peer, call, outcome, headers, overall_deadline,
                                        message_id, sent_hash, sent_state)
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
            except _Unsent as exc:
                raise ProtocolError("AGENT_UNAVAILABLE", f"A2A peer {name!r} could not be reached",
                                    {"peer": name, "message_id": message_id}) from exc
            except _Ambiguous as exc:
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
        async def on_response(response: httpx.Response) -> None:
            echoed.extend(response.headers.get_list(HTTP_EXTENSION_HEADER))

        async with self._http(timeout=timeout, event_hooks={"response": [on_response]}) as http:
            client = ClientFactory(ClientConfig(streaming=False, httpx_client=http)).create(peer.card)
            ctx = ClientCallContext(service_parameters=dict(headers), timeout=timeout)
            request = SendMessageRequest(message=msg, configuration=SendMessageConfiguration())
            try:
                async for event in client.send_message(request, context=ctx):
                    return self._answer_dict(event)
            except Exception as exc:
                self._classify(exc)
                raise
        raise ProtocolError("DEPENDENCY_FAILED", "the A2A peer answered nothing")

    @staticmethod
    def _answer_dict(event: StreamResponse) -> dict[str, Any]:
        return dict(json_format.MessageToDict(event))

    @staticmethod
    def _classify(exc: BaseException) -> None:
        """Re-raise a send failure as unsent, ambiguous or a peer's refusal."""
        for cause in _causes(exc):
            if isinstance(cause, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
                raise _Unsent() from exc
            if isinstance(cause, httpx.HTTPStatusError):
                response = cause.response
                code: str | None = None
                try:
                    body = response.json()
                    if isinstance(body, Mapping):
                        found = body.get("code")
                        err = body.get("error")
                        if found is None and isinstance(err, Mapping):
                            found = err.get("code")
                        code = found if isinstance(found, str) else None
                except ValueError:
                    pass
                status = response.status_code
                mapped = "UNAUTHORIZED" if status in (401, 403) else "DEPENDENCY_FAILED"
                details: dict[str, Any] = {"http_status": status}
                if code:
                    details["code"] = code
                raise ProtocolError(mapped, f"the A2A peer refused the call (HTTP {status})", details) from exc
            if isinstance(cause, (httpx.TimeoutException, httpx.TransportError)):
                raise _Ambiguous() from exc
        raise ProtocolError("DEPENDENCY_FAILED", f"the A2A call failed: {type(exc).__name__}",
                            {"a2a_error": type(exc).__name__}) from exc

    # -- after the answer -------------------------------------------------------------

    async def _poll(self, peer: PeerCard, task_id: str, headers: Mapping[str, str],
                    overall_deadline: float, settings: PeerSettings) -> dict[str, Any]:
        echoed: list[str] = []

        async def on_response(response: httpx.Response) -> None:
            echoed.extend(response.headers.get_list(HTTP_EXTENSION_HEADER))

        left = max(0.1, overall_deadline - time.monotonic())
        async with self._http(timeout=min(settings.timeout_s, left), event_hooks={"response": [on_response]}) as http:
            client = ClientFactory(ClientConfig(streaming=False, httpx_client=http)).create(peer.card)
            ctx = ClientCallContext(service_parameters=dict(headers), timeout=min(settings.timeout_s, left))
            try:
                task = await client.get_task(GetTaskRequest(id=task_id), context=ctx)
            except Exception as exc:
                try:
                    self._classify(exc)
                except (_Ambiguous, _Unsent):
                    return {}  # a failed poll is retried by the caller's loop
                raise
        return dict(json_format.MessageToDict(task))

    async def _conclude(self, name: str, settings: PeerSettings, peer: PeerCard, call: CallContext,
                        outcome: _Outcome, headers: Mapping[str, str], overall_deadline: float,
                        message_id: str, sent_hash: str, sent_state: _Sent) -> Reply:
        answer = outcome.answer
        info: dict[str, Any] = {"peer": name, "mesh": outcome.mesh, "message_id": message_id,
                                "attempts": outcome.attempts, "task_id": None, "report": None,
                                "charge": None}
        if "message" in answer:
            sent_state.finished = True
            msg = answer["message"]
            charge = await self._charge(name, settings, peer, call, outcome.mesh, message_id,
                                        task_id=None, report_token=None, sent_hash=sent_hash)
            info.update(report=charge.report, charge=charge.to_object())
            return self._reply(name, call, "completed", output_of_parts(msg.get("parts") or []), info, None)
        task = answer.get("task") or {}
        task_id = str(task.get("id") or "")
        info["task_id"] = task_id or None
        sent_state.task_id = task_id or None
        while True:
            state = str((task.get("status") or {}).get("state") or "")
            if state in _TERMINAL or state in _INTERRUPTED:
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
            polled = await self._poll(peer, task_id, headers, overall_deadline, settings)
            if polled:
                task = polled
        status = _TERMINAL.get(state) or _INTERRUPTED[state]
        output = self._task_output(task)
        status_meta = ((task.get("status") or {}).get("message") or {}).get("metadata") or {}
        mesh_status = status_meta.get(EXTENSION_URI) if isinstance(status_meta, Mapping) else None
        if isinstance(mesh_status, Mapping):
            info["status"] = dict(mesh_status)  # {code, details} of a rejected/failed task
        if status == "completed":
            meta = task.get("metadata") or {}
            ext = meta.get(EXTENSION_URI) if isinstance(meta, Mapping) else None
            token = ext.get("report") if isinstance(ext, Mapping) else None
            charge = await self._charge(name, settings, peer, call, outcome.mesh, message_id,
                                        task_id=task_id, report_token=token if isinstance(token, str) else None,
                                        sent_hash=sent_hash)
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

    async def _charge(self, name: str, settings: PeerSettings, peer: PeerCard, call: CallContext,
                      mesh: bool, message_id: str, *, task_id: str | None, report_token: str | None,
                      sent_hash: str) -> Charge:
        """Judge the report and record the charge once; returns the charge that stands."""
        spend: Decimal | None = None
        note: str | None = None
        if not mesh:
            report = "not_expected"
        elif report_token is None:
            report = "missing"
        elif peer.issuer_key is None:
            report, note = "unverifiable", "no key for the peer's reports (set issuer_key)"
        elif not sent_hash:
            report, note = "unverifiable", "the call that opened this task is not remembered (a restart?)"
        elif task_id is None:
            report, note = "invalid", "a report without a task"
        else:
            try:
                claims = verify_report(report_token, issuer_key=peer.issuer_key,
                                       expected_body_hash=sent_hash, expected_execution_id=task_id)
                spend, report = claims.spend_total, "verified"
            except ReportInvalid as exc:
                report, note = "invalid", str(exc)
                log.warning("A2A peer %s sent an invalid run report for task %s (%s); "
                            "charging the contract price", name, task_id, exc)
        env = call.envelope or {}
        execution_id = env.get("id") if isinstance(env.get("id"), str) else None
        task_key = f"task:{task_id}" if task_id else f"message:{message_id}"
        charge = Charge(
            peer=name, task_key=task_key, message_id=message_id, task_id=task_id, agent=call.agent_id,
            execution_id=execution_id, mesh=mesh, report=report,
            reported_spend=format_usd(spend) if spend is not None else None,
            contract_price=format_usd(settings.contract_price),
            charged=format_usd(charge_amount(settings.contract_price, spend)), currency="USD",
            charged_at_ms=int(self.clock() * 1000), note=note,
        )
        if await self.charges.record(charge):
            return charge
        stands = await self.charges.get(name, task_key)
        return stands if stands is not None else charge

    # -- a task the call's wait left behind ----------------------------------------------

    def _remember_open(self, sent: _Sent) -> None:
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
            sent = _Sent(name, settings, peer, known.call, known.message_id, known.sent_hash, headers,
                         mesh=known.mesh, task_id=task_id)
        else:
            sent = _Sent(name, settings, peer, call, "", "", headers, mesh=peer.mesh, task_id=task_id)
        handle = A2AStreamTask(self, sent)
        handle._watch_until = time.monotonic() + timeout
        handle._pump = asyncio.get_running_loop().create_task(
            self._pump(sent, handle, None), name=f"a2a-resume:{name}:{task_id}")
        try:
            await handle._wait_first(timeout)
        except BaseException:
            handle.close()
            raise
        return handle

    # -- cancel (§10.8 across the bridge) ----------------------------------------------

    async def _abandon(self, sent: _Sent) -> None:
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

    async def _cancel_peer(self, sent: _Sent, why: str) -> dict[str, Any] | None:
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
            async with self._http(timeout=self.cancel_timeout_s) as http:
                client = ClientFactory(ClientConfig(streaming=False, httpx_client=http)).create(sent.peer.card)
                ctx = ClientCallContext(service_parameters=dict(sent.headers), timeout=self.cancel_timeout_s)
                task = await asyncio.wait_for(
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
            await self._charge(sent.name, sent.settings, sent.peer, sent.call, sent.mesh, sent.message_id,
                               task_id=sent.task_id, report_token=_report_of(answer), sent_hash=sent.sent_hash)
        else:
            await self._record_canceled(sent, note)
        return answer

    async def _record_canceled(self, sent: _Sent, note: str) -> None:
        """A canceled call is recorded at zero: the extension's run report (and so
        any spend the caller could verify) belongs to completed tasks only."""
        env = sent.call.envelope or {}
        execution_id = env.get("id") if isinstance(env.get("id"), str) else None
        task_key = f"task:{sent.task_id}" if sent.task_id else f"message:{sent.message_id}"
        try:
            await self.charges.record(Charge(
                peer=sent.name, task_key=task_key, message_id=sent.message_id, task_id=sent.task_id,
                agent=sent.call.agent_id, execution_id=execution_id, mesh=sent.mesh, report="canceled",
                reported_spend=None, contract_price=format_usd(sent.settings.contract_price), charged="0",
                currency="USD", charged_at_ms=int(self.clock() * 1000), note=note,
            ))
        except Exception:
            log.exception("recording the canceled A2A call %s failed", sent.message_id)

    # -- streaming (SendStreamingMessage) ---------------------------------------------------

    async def _open_stream(self, sent: _Sent, build: Callable[[], Awaitable[Message]],
                           overall_deadline: float) -> Reply:
        handle = A2AStreamTask(self, sent)
        handle._watch_until = overall_deadline
        handle._pump = asyncio.get_running_loop().create_task(
            self._pump(sent, handle, build), name=f"a2a-stream:{sent.name}:{sent.message_id}")
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

    async def _read_stream(self, sent: _Sent, handle: A2AStreamTask, msg: Message, echoed: list[str],
                           on_response: Callable[[httpx.Response], Awaitable[None]]) -> None:
        settings = sent.settings
        async with self._http(timeout=settings.timeout_s, event_hooks={"response": [on_response]}) as http:
            client = ClientFactory(ClientConfig(streaming=True, httpx_client=http)).create(sent.peer.card)
            ctx = ClientCallContext(service_parameters=dict(sent.headers), timeout=settings.timeout_s)
            request = SendMessageRequest(message=msg, configuration=SendMessageConfiguration())
            try:
                async for event in client.send_message(request, context=ctx):
                    sent.mesh = sent.peer.mesh and EXTENSION_URI in get_requested_extensions(echoed)
                    await handle._event(self._answer_dict(event))
                    if handle.final is not None:
                        return
            except Exception as exc:
                self._classify(exc)
                raise

    async def _pump(self, sent: _Sent, handle: A2AStreamTask,
                    build: Callable[[], Awaitable[Message]] | None) -> None:
        """Read the peer's event stream into ``handle`` (one task owns the HTTP stream);
        with no ``build`` (a resumed task) only follow the task by GetTask."""
        echoed: list[str] = []

        async def on_response(response: httpx.Response) -> None:
            echoed.extend(response.headers.get_list(HTTP_EXTENSION_HEADER))

        settings = sent.settings
        try:
            if build is not None:
                await self._read_stream(sent, handle, await build(), echoed, on_response)
            # The stream ended (or the peer does not stream and answered once, or
            # this is a resumed task) with the task still open: follow it by GetTask.
            first = True
            while handle.final is None and sent.task_id:
                if time.monotonic() >= handle._watch_until:
                    self._remember_open(sent)
                    raise ProtocolError(
                        "TRANSPORT_TIMEOUT",
                        f"A2A task {sent.task_id} of peer {sent.name!r} did not finish before the wait ended"
                        " (follow it with ctx.a2a_task)",
                        {"peer": sent.name, "task_id": sent.task_id, "ambiguous": False,
                         "message_id": sent.message_id})
                if not first or build is not None:
                    await asyncio.sleep(self.poll_interval_s)
                first = False
                polled = await self._poll(sent.peer, sent.task_id, sent.headers, handle._watch_until, settings)
                if polled:
                    await handle._event({"task": polled})
            if handle.final is None:
                raise ProtocolError("DEPENDENCY_FAILED", f"the A2A stream of peer {sent.name!r} ended early",
                                    {"peer": sent.name, "message_id": sent.message_id})
        except _Unsent:
            handle._fail(ProtocolError("AGENT_UNAVAILABLE", f"A2A peer {sent.name!r} could not be reached",
                                       {"peer": sent.name, "message_id": sent.message_id}))
        except _Ambiguous:
            # A stream is not resent: its chunks may have been seen already.
            handle._fail(ProtocolError(
                "TRANSPORT_TIMEOUT", f"the A2A stream of peer {sent.name!r} broke off",
                {"peer": sent.name, "message_id": sent.message_id, "task_id": sent.task_id,
                 "ambiguous": True, "resent": 0}))
        except ProtocolError as exc:
            handle._fail(exc)
        except asyncio.CancelledError:
            handle._fail(ProtocolError("TRANSPORT_TIMEOUT", "the A2A stream was closed",
                                       {"peer": sent.name, "task_id": sent.task_id}))
            raise
        except Exception as exc:
            log.exception("the A2A stream of peer %s failed", sent.name)
            handle._fail(ProtocolError("DEPENDENCY_FAILED", f"the A2A stream failed: {type(exc).__name__}",
                                       {"peer": sent.name}))

    async def _finish(self, sent: _Sent, state: str, output: Any, token: str | None,
                      status_meta: Any, chunks: int) -> dict[str, Any]:
        """The closing envelope of a streamed call; a completed task is charged once."""
        sent.finished = True
        status = _TERMINAL.get(state) or _INTERRUPTED.get(state) or "completed"
        info: dict[str, Any] = {"peer": sent.name, "mesh": sent.mesh, "message_id": sent.message_id,
                                "attempts": 1, "task_id": sent.task_id, "report": None, "charge": None,
                                "streamed": True, "chunks": chunks}
        if isinstance(status_meta, Mapping):
            info["status"] = dict(status_meta)
        if status == "completed":
            charge = await self._charge(sent.name, sent.settings, sent.peer, sent.call, sent.mesh,
                                        sent.message_id, task_id=sent.task_id, report_token=token,
                                        sent_hash=sent.sent_hash)
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


def _report_of(container: Mapping[str, Any]) -> str | None:
    """``metadata[uri].report`` of a task or a status update (ProtoJSON), if any."""
    meta = container.get("metadata")
    ext = meta.get(EXTENSION_URI) if isinstance(meta, Mapping) else None
    token = ext.get("report") if isinstance(ext, Mapping) else None
    return token if isinstance(token, str) else None


_OPEN_STATES = {"TASK_STATE_SUBMITTED": "submitted", "TASK_STATE_WORKING": "working"}


class A2AStreamTask:
    """The caller's handle on a streamed A2A call — the A2A twin of
    :class:`meshnode.node.tasks.RequesterTask`, so a handler consumes a peer's
    stream as it consumes a mesh one::

        reply = await ctx.request("a2a:weather", "forecast", input, config={"stream": True})
        if reply.task is not None:
            async for data in reply.task.stream():   # one item per artifact update
                ...
            final = await reply.task.result()        # the closing envelope (status, output, meta)

    Each ``artifactUpdate`` of the peer is one chunk (its parts read as
    :func:`output_of_parts` reads them); the stream's last status update is the
    result, and its run report is verified and charged once (as on the plain
    path). ``cancel()`` sends CancelTask; cancelling a handler while it waits in
    ``stream()`` or ``result()`` does too (once, best-effort).
    """

    def __init__(self, bridge: A2AOutbound, sent: _Sent) -> None:
        self._bridge = bridge
        self._sent = sent
        self.responder = A2A_TARGET_PREFIX + sent.name
        self.chunks: list[Any] = []
        self._parts: list[dict[str, Any]] = []
        self._status_parts: list[dict[str, Any]] = []
        self._task_meta: dict[str, Any] = {}
        self.final: dict[str, Any] | None = None
        self.last_update: dict[str, Any] = {}
        self._error: ProtocolError | None = None
        self._first = asyncio.Event()
        self._changed = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        #: When following the task by GetTask stops (monotonic seconds).
        self._watch_until = time.monotonic() + 300.0

    @property
    def task_id(self) -> str | None:
        return self._sent.task_id

    @property
    def state(self) -> str:
        payload = self.last_update.get("payload")
        status = payload.get("status") if isinstance(payload, Mapping) else None
        return str(status) if isinstance(status, str) else "submitted"

    # -- fed by the pump ---------------------------------------------------------

    def _notify(self) -> None:
        self._first.set()
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _fail(self, error: ProtocolError) -> None:
        if self.final is None and self._error is None:
            self._error = error
        self._sent.finished = True
        self._notify()

    async def _event(self, event: Mapping[str, Any]) -> None:
        sent = self._sent
        if "message" in event:
            parts = list(event["message"].get("parts") or [])
            output = output_of_parts(parts)
            self.chunks.append(output)
            self.final = await self._bridge._finish(sent, "TASK_STATE_COMPLETED", output, None, None,
                                                    len(self.chunks))
            self.last_update = self.final
            self._notify()
            return
        state = ""
        token: str | None = None
        status: Mapping[str, Any] = {}
        if "task" in event:
            task = event["task"]
            sent.task_id = sent.task_id or (str(task.get("id")) if task.get("id") else None)
            if not self._parts:  # a task snapshot (first event, or a GetTask poll) brings its artifacts
                for artifact in task.get("artifacts") or []:
                    parts = list(artifact.get("parts") or [])
                    self._parts.extend(parts)
                    self.chunks.append(output_of_parts(parts))
            status = task.get("status") or {}
            state = str(status.get("state") or "")
            token = _report_of(task)
        elif "artifactUpdate" in event:
            parts = list((event["artifactUpdate"].get("artifact") or {}).get("parts") or [])
            self._parts.extend(parts)
            self.chunks.append(output_of_parts(parts))
            self._notify()
            return
        elif "statusUpdate" in event:
            update = event["statusUpdate"]
            sent.task_id = sent.task_id or (str(update.get("taskId")) if update.get("taskId") else None)
            status = update.get("status") or {}
            state = str(status.get("state") or "")
            token = _report_of(update)
        else:
            return
        self._status_parts = list((status.get("message") or {}).get("parts") or [])
        status_meta = ((status.get("message") or {}).get("metadata") or {}).get(EXTENSION_URI)
        if state in _TERMINAL or state in _INTERRUPTED:
            output = output_of_parts(self._parts or self._status_parts)
            self.final = await self._bridge._finish(sent, state, output, token, status_meta, len(self.chunks))
            self.last_update = self.final
        else:
            info = {"peer": sent.name, "mesh": sent.mesh, "message_id": sent.message_id, "attempts": 1,
                    "task_id": sent.task_id, "report": None, "charge": None, "streamed": True}
            self.last_update = self._bridge._envelope(sent.name, sent.call, _OPEN_STATES.get(state, "working"),
                                                      None, info, None)
        self._notify()

    async def _wait_first(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._first.wait(), timeout=max(timeout, 0.001))
        except TimeoutError:
            raise ProtocolError(
                "TRANSPORT_TIMEOUT", f"no answer from A2A peer {self._sent.name!r}; the message may have arrived",
                {"peer": self._sent.name, "message_id": self._sent.message_id, "ambiguous": True, "resent": 0},
            ) from None
        if self._error is not None and self.final is None:
            raise self._error

    # -- the caller's side -------------------------------------------------------

    async def stream(self, timeout: float = 60.0) -> AsyncIterator[Any]:
        """Chunk data in order, until the task ends; raises the stream's failure
        (a ProtocolError) if it broke off. ``timeout``: the wait for each chunk."""
        index = 0
        try:
            while True:
                changed = self._changed
                if index < len(self.chunks):
                    index += 1
                    yield self.chunks[index - 1]
                    continue
                if self._error is not None:
                    raise self._error
                if self.final is not None:
                    return
                await asyncio.wait_for(changed.wait(), timeout=timeout)
        except asyncio.CancelledError:
            await self._abandon()
            raise

    async def result(self, timeout: float = 300.0) -> Mapping[str, Any]:
        """The closing envelope (``payload.status`` completed, failed, canceled,
        rejected, input_required or auth_required; ``meta[uri]`` the charge)."""
        try:
            deadline = time.monotonic() + timeout
            while self.final is None:
                if self._error is not None:
                    raise self._error
                changed = self._changed
                await asyncio.wait_for(changed.wait(), timeout=max(0.001, deadline - time.monotonic()))
            return self.final
        except asyncio.CancelledError:
            await self._abandon()
            raise

    async def cancel(self, reason: str = "caller_abandoned", note: str | None = None) -> Mapping[str, Any]:
        """CancelTask for the peer's task (once); the stream ends canceled.
        ``reason``/``note`` are recorded with the call (A2A's CancelTask has no reason)."""
        why = f"canceled by the caller ({reason}{': ' + note if note else ''})"
        await self._bridge._cancel_peer(self._sent, why)
        self._end_canceled(why)
        return {"task_id": self.task_id, "status": "canceled"}

    def close(self) -> None:
        """Stop reading the peer's stream (the peer's task is not canceled)."""
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()

    async def _abandon(self) -> None:
        if self.final is None:
            await self._bridge._abandon(self._sent)
            self._end_canceled("the calling mesh work was canceled")

    def _end_canceled(self, why: str) -> None:
        self.close()
        if self.final is None:
            sent = self._sent
            info = {"peer": sent.name, "mesh": sent.mesh, "message_id": sent.message_id, "attempts": 1,
                    "task_id": sent.task_id, "report": "canceled", "charge": None, "streamed": True,
                    "chunks": len(self.chunks), "note": why}
            self.final = self._bridge._envelope(sent.name, sent.call, "canceled", None, info, None)
            self.last_update = self.final
            self._notify()
