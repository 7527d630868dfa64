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

The reply is a :class:`meshnode.node.outbound.Reply` whose envelope is
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
from collections.abc import Awaitable, Callable, Mapping
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
from meshnode.node.outbound import RemoteError, Reply
from meshnode.protocol.budget import parse_budget
from meshnode.protocol.envelope import trace_to_traceparent, valid_trace
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair, decode_seed

if TYPE_CHECKING:
    from meshnode.config import A2AConfig

__all__ = [
    "A2A_TARGET_PREFIX",
    "A2AOutbound",
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
    _cards: dict[str, PeerCard] = field(default_factory=dict)
    _card_locks: dict[str, asyncio.Lock] = field(default_factory=dict)

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
                   timeout: float) -> Reply:
        """Send one message to peer ``name`` and wait for its outcome (see the module doc)."""
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

        outcome = await self._send(name, settings, peer, build, headers, overall_deadline, message_id)
        return await self._conclude(name, settings, peer, call, outcome, headers, overall_deadline,
                                    message_id, sent_hash)

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
                        message_id: str, sent_hash: str) -> Reply:
        answer = outcome.answer
        info: dict[str, Any] = {"peer": name, "mesh": outcome.mesh, "message_id": message_id,
                                "attempts": outcome.attempts, "task_id": None, "report": None,
                                "charge": None}
        if "message" in answer:
            msg = answer["message"]
            charge = await self._charge(name, settings, peer, call, outcome.mesh, message_id,
                                        task_id=None, report_token=None, sent_hash=sent_hash)
            info.update(report=charge.report, charge=charge.to_object())
            return self._reply(name, call, "completed", output_of_parts(msg.get("parts") or []), info, None)
        task = answer.get("task") or {}
        task_id = str(task.get("id") or "")
        info["task_id"] = task_id or None
        while True:
            state = str((task.get("status") or {}).get("state") or "")
            if state in _TERMINAL or state in _INTERRUPTED:
                break
            if time.monotonic() >= overall_deadline:
                raise ProtocolError("TRANSPORT_TIMEOUT",
                                    f"A2A task {task_id} of peer {name!r} did not finish before the wait ended",
                                    {"peer": name, "task_id": task_id, "state": state, "ambiguous": False})
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
