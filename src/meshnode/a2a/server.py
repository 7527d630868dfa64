"""The inbound A2A bridge: hosted agents served to A2A v1.0 clients over HTTP.

Served by the daemon (uvicorn inside its event loop) when ``[a2a] listen`` is
set. Each exposed agent has its JSON-RPC endpoint at ``/agents/<name>`` and its
Agent Card at ``/agents/<name>/.well-known/agent-card.json`` (and at
``/.well-known/agent-card.json`` when it is the only one).

A SendMessage becomes a mesh request to the hosted agent, sent by the node's
own bridge identity (the built-in ``a2a-bridge`` agent) and delivered locally
through the one inbound pipeline, so every §22 protection and the agent's
admission apply exactly as to any mesh caller. Its answer, or the Task it
opens, is followed and mirrored as an A2A task.

The AGBoss mesh extension (A2A-MESH-EXTENSION.md), when the request activates
it with the ``A2A-Extensions`` header (echoed on the answer):

1. the envelope at ``message.metadata[uri].envelope`` is checked on the raw
   JSON message as received, before the SDK parses anything, in the seed's
   order; a failed check answers HTTP 401 with a JSON-RPC error whose
   ``message`` and ``data.code`` are the stable code (``mesh.body-mismatch``…);
2. the chain check → a REJECTED task with ``status.message.metadata[uri] =
   {code, details}``, nothing run;
3. a trusted caller's budget and deadline become the mesh request's budget
   block (``cost_ceiling``, ``deadline``), so the agent's own admission sees
   them, and its origin is the execution's; call chain (extended by this hop)
   and origin ride in the request envelope's ``meta[uri]``;
4. a completed task of a trusted caller carries the signed run report at
   ``task.metadata[uri].report`` (and on the stream's last status update).

Idempotency: the same messageId from the same trusted caller (the verified
issuer) within ``idempotency_retention`` gets the same task, across restarts
(SQLite under the data dir), and the same messageId with another body is
refused; callers without a trusted envelope are told apart by nothing, so
theirs is keyed on (messageId, body hash): the very same message gets the same
task, another message under a reused messageId a task of its own.

Answering a paused task: a SendMessage whose ``message.taskId`` names a
task in INPUT_REQUIRED / AUTH_REQUIRED, sent by the caller that owns it (the
rule below) with its ``contextId`` (or none), is forwarded to the agent as the
mesh follow-up request (same task_id, §6.5); the task goes on as before.

Task ownership: a task belongs to the caller that created it. A trusted
caller's task is answered (GetTask, CancelTask, SubscribeToTask) only to a
request proving the same issuer — a task-operation envelope in the
``AGBoss-Mesh-Envelope`` header, signed over ``{"method", "id"}``; an
anonymous caller's task to whoever holds its unguessable id. Anyone else is
answered exactly as for an unknown task (TaskNotFound).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import nacl.signing
import uvicorn
from a2a.extensions.common import HTTP_EXTENSION_HEADER, get_requested_extensions
from a2a.server.context import ServerCallContext
from a2a.server.request_handlers.request_handler import RequestHandler
from a2a.server.routes.common import DefaultServerCallContextBuilder
from a2a.server.routes.jsonrpc_dispatcher import JsonRpcDispatcher
from a2a.types.a2a_pb2 import (
    AgentCard,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse,
    ListTasksRequest,
    ListTasksResponse,
    Message,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskArtifactUpdateEvent,
    TaskPushNotificationConfig,
    TaskStatusUpdateEvent,
)
from a2a.utils.errors import (
    InvalidParamsError,
    PushNotificationNotSupportedError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from google.protobuf.json_format import MessageToDict, ParseDict
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshnode.a2a.extension import (
    EXTENSION_URI,
    SIGNATURE_INVALID,
    EnvelopeCheck,
    IssuerTrust,
    MeshAuthError,
    body_hash,
    check_chain,
    extend_chain,
    format_usd,
    sign_report,
    verify_envelope,
)
from meshnode.a2a.mapping import (
    FAILED_STATES,
    INTERRUPTED_A2A,
    TERMINAL_A2A,
    PartsRefused,
    agent_card,
    chunk_part,
    coded_message,
    input_from_parts,
    output_artifact,
    select_offering,
    state_of,
)
from meshnode.a2a.store import BridgeStore
from meshnode.agent import RemoteError, RequestTimeout
from meshnode.protocol.canonical import CanonicalJSONError, parse_json
from meshnode.protocol.envelope import child_trace, new_root_trace, trace_from_traceparent
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.manifest import materialize_public_block
from meshnode.protocol.nkeys import decode_seed
from meshnode.protocol.timeutil import format_ts

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent
    from meshnode.node.runtime import Node

__all__ = ["A2ABridge", "BridgeSettings"]

log = logging.getLogger("meshnode.a2a")

#: The JSON-RPC error code of a 401 answer (outside the reserved range).
AUTH_ERROR_CODE = 401
#: The caller key of requests without a trusted envelope.
ANONYMOUS = "anonymous"
#: The code of a task that was running when the daemon stopped.
INTERRUPTED = "INTERRUPTED"
#: The largest request body read (a stranger's bytes are bounded before parsing).
MAX_BODY_BYTES = 4 * 1024 * 1024
#: How deep a request's JSON may nest (a data part's value included).
MAX_JSON_DEPTH = 64
#: JSON-RPC's own error codes answered by the bridge before the SDK parses.
PARSE_ERROR_CODE = -32700
INVALID_REQUEST_CODE = -32600
#: The HTTP header (an A2A service parameter) carrying a task-operation envelope.
TASK_ENVELOPE_HEADER = "AGBoss-Mesh-Envelope"
#: The JSON-RPC methods that act on an existing task, answered to its caller only.
TASK_METHODS = ("GetTask", "CancelTask", "SubscribeToTask")


@dataclass(frozen=True)
class BridgeSettings:
    """What the bridge needs from ``[a2a]``, already typed."""

    host: str
    port: int
    application: str
    expose: tuple[str, ...]
    public_url: str | None = None
    max_mesh_hops: int = 8
    idempotency_retention_s: float = 86400.0
    send_wait_s: float = 30.0
    task_timeout_s: float = 600.0
    trust: IssuerTrust = field(default_factory=IssuerTrust)

    @property
    def base_url(self) -> str:
        if self.public_url:
            return self.public_url.rstrip("/")
        host = self.host if ":" not in self.host or self.host.startswith("[") else f"[{self.host}]"
        return f"http://{host}:{self.port}"


@dataclass
class _Inbound:
    """What the HTTP layer learned from the raw request before the SDK parsed it."""

    activated: bool
    message: dict[str, Any]
    body_hash: str
    check: EnvelopeCheck | None = None
    traceparent: str | None = None
    tracestate: str | None = None


@dataclass(frozen=True)
class _Requester:
    """Who asks for a task operation: ``caller`` is ``issuer:<id>`` when a
    trusted task-operation envelope proved it for exactly this ``method`` and
    task ``task_id``, else ``anonymous``."""

    caller: str
    method: str
    task_id: str | None


@dataclass
class _Live:
    """A task this process is executing: its current A2A object and listeners."""

    task: dict[str, Any]
    agent: str
    caller: str
    subscribers: list[asyncio.Queue[dict[str, Any] | None]] = field(default_factory=list)
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    runner: asyncio.Task[None] | None = None
    mesh_task: Any = None
    cancel_requested: bool = False
    cost_micro: int | None = None
    answering: bool = False  # a caller's answer to a paused task is being forwarded

    def publish(self, event: dict[str, Any] | None) -> None:
        for queue in list(self.subscribers):
            queue.put_nowait(event)


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether parsed JSON nests more than ``limit`` arrays/objects deep (no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _rpc_error(rid: str | int | None, code: int, message: str) -> JSONResponse:
    """A JSON-RPC error answered by the bridge itself (HTTP 200, as the SDK answers errors)."""
    return JSONResponse({"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}})


class _QuietCallerErrors(logging.Filter):
    """The SDK logs a stranger's malformed JSON-RPC (bad params, bad base
    request) at ERROR with a traceback; they are the caller's errors, answered
    -32602/-32600, and must not let a stranger fill the log. Its own
    "Unhandled exception" (a bug on our side) is kept."""

    QUIET = ("Failed to parse request params", "Failed to validate base JSON-RPC request")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.QUIET))


logging.getLogger("a2a.server.routes.jsonrpc_dispatcher").addFilter(_QuietCallerErrors())


def _now_iso() -> str:
    return format_ts(time.time_ns() // 1_000_000)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: the daemon owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class A2ABridge:
    """The inbound A2A server of one node."""

    def __init__(
        self, *, node: Node, bridge: HostedAgent, settings: BridgeSettings, data_dir: Path
    ) -> None:
        self.node = node
        self.bridge = bridge
        self.settings = settings
        self.store = BridgeStore(data_dir / "a2a.sqlite3")
        self.live: dict[str, _Live] = {}
        # Lookup-then-create of the idempotency row is one step: two concurrent
        # sends of the same message must not start two tasks.
        self._submit_lock = asyncio.Lock()
        self._signing_key = nacl.signing.SigningKey(decode_seed(bridge.key.seed)[1])
        self._server: _Uvicorn | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._handler = _Handler(self)
        self._dispatcher = JsonRpcDispatcher(self._handler, context_builder=_ContextBuilder())

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        await self.store.open()
        now_ms = self._now_ms()
        for task in await self.store.unfinished():
            # Its runner died with the previous process: nothing follows it now.
            self._fail(task, INTERRUPTED)
            await self.store.update(task, now_ms=now_ms, terminal=True)
        retention_ms = int(self.settings.idempotency_retention_s * 1000)
        await self.store.sweep(
            idempotency_before_ms=now_ms - retention_ms, tasks_before_ms=now_ms - 2 * retention_ms
        )
        config = uvicorn.Config(
            self.app(),
            host=self.settings.host.strip("[]"),
            port=self.settings.port,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=1,
        )
        server = _Uvicorn(config)
        self._server = server
        self._serve_task = asyncio.get_running_loop().create_task(server.serve(), name="a2a-server")
        while not server.started:
            if self._serve_task.done():
                exc = self._serve_task.exception()
                raise RuntimeError(f"[a2a] listen {self.settings.host}:{self.settings.port}: {exc or 'server exited'}")
            await asyncio.sleep(0.02)
        log.info(
            "A2A bridge serving %s at %s (application %r, report key %s)",
            ", ".join(self.settings.expose) or "no agents",
            self.settings.base_url,
            self.settings.application,
            self.bridge.agent_id,
        )

    async def stop_intake(self) -> None:
        """Stop the HTTP server (open streams get a short grace)."""
        if self._server is not None and self._serve_task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._serve_task), timeout=1.5)
            if not self._serve_task.done():
                self._server.force_exit = True
                self._serve_task.cancel()
        for live in list(self.live.values()):
            if live.runner is not None and not live.runner.done():
                live.runner.cancel()
        runners = [lv.runner for lv in self.live.values() if lv.runner is not None]
        if runners:
            await asyncio.wait(runners, timeout=1.0)

    async def close(self) -> None:
        await self.store.close()

    def status(self) -> dict[str, Any]:
        """For ``meshnode status``: where it serves, as whom, what runs."""
        return {
            "url": self.settings.base_url,
            "expose": list(self.settings.expose),
            "application": self.settings.application,
            "report_key": self.bridge.agent_id,
            "running_tasks": len(self.live),
        }

    @property
    def bound_port(self) -> int | None:
        if self._server is None or not self._server.servers:
            return None
        sockets = self._server.servers[0].sockets
        return int(sockets[0].getsockname()[1]) if sockets else None

    def _now_ms(self) -> int:
        return self.node.now_ms()

    # -- HTTP ------------------------------------------------------------------

    def app(self) -> Starlette:
        routes = [
            Route("/agents/{name}/.well-known/agent-card.json", self._card, methods=["GET"]),
            Route("/agents/{name}", self._rpc, methods=["POST"]),
            Route("/.well-known/agent-card.json", self._default_card, methods=["GET"]),
        ]
        return Starlette(routes=routes)

    def hosted(self, name: str) -> HostedAgent | None:
        if name not in self.settings.expose:
            return None
        hosted = self.node.agents.get(name)
        return hosted if hosted is not None and hosted.state == "running" else None

    def card(self, name: str) -> dict[str, Any] | None:
        hosted = self.hosted(name)
        if hosted is None:
            return None
        public = materialize_public_block(hosted.manifest).get("public") or {}
        # Streaming is offered for every skill: a non-streaming offering streams
        # its status updates and its output as one artifact.
        return agent_card(
            hosted.manifest,
            public=public,
            url=f"{self.settings.base_url}/agents/{name}",
            idempotency_retention_s=self.settings.idempotency_retention_s,
            streaming=True,
            application=self.settings.application,
            issuer_key=self.bridge.agent_id,
        )

    async def _card(self, request: Request) -> Response:
        card = self.card(request.path_params["name"])
        if card is None:
            return JSONResponse({"error": "no such agent"}, status_code=404)
        return JSONResponse(card)

    async def _default_card(self, request: Request) -> Response:
        if len(self.settings.expose) != 1:
            return JSONResponse(
                {"error": "several agents are exposed: use /agents/<name>/.well-known/agent-card.json"},
                status_code=404,
            )
        return await self._card_for(self.settings.expose[0])

    async def _card_for(self, name: str) -> Response:
        card = self.card(name)
        if card is None:
            return JSONResponse({"error": "no such agent"}, status_code=404)
        return JSONResponse(card)

    async def _rpc(self, request: Request) -> Response:
        name = request.path_params["name"]
        if self.hosted(name) is None:
            return JSONResponse({"error": "no such agent"}, status_code=404)
        requested = get_requested_extensions(request.headers.getlist(HTTP_EXTENSION_HEADER))
        activated = EXTENSION_URI in requested
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return JSONResponse({"error": "request body too large"}, status_code=413)
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                return JSONResponse({"error": "request body too large"}, status_code=413)
            chunks.append(chunk)
        raw = b"".join(chunks)
        # Starlette reads a request's body once: hand the same bytes to the dispatcher.
        request._body = raw
        inbound: _Inbound | None = None
        # Parsed here first, so what the SDK's parser would turn into an
        # internal error (bytes that are not UTF-8, nesting past Python's
        # recursion limit) is answered as the caller's error, and nothing
        # nested deeper than MAX_JSON_DEPTH reaches the SDK or the agent.
        too_deep = f"Invalid request: JSON nested deeper than {MAX_JSON_DEPTH} levels"
        try:
            doc: Any = parse_json(raw)
        except ValueError:
            return _rpc_error(None, PARSE_ERROR_CODE, "Parse error: the body is not JSON text (UTF-8)")
        except RecursionError:
            return _rpc_error(None, INVALID_REQUEST_CODE, too_deep)
        if _deeper_than(doc, MAX_JSON_DEPTH):
            rid = doc.get("id") if isinstance(doc, dict) and type(doc.get("id")) in (str, int) else None
            return _rpc_error(rid, INVALID_REQUEST_CODE, too_deep)
        if isinstance(doc, dict) and doc.get("method") in ("SendMessage", "SendStreamingMessage"):
            params = doc.get("params")
            message = params.get("message") if isinstance(params, dict) else None
            if isinstance(message, dict):
                try:
                    inbound = self._precheck(message, activated, request)
                except MeshAuthError as exc:
                    return self._refusal(exc, doc, name, activated)
        requester: _Requester | None = None
        if isinstance(doc, dict) and doc.get("method") in TASK_METHODS:
            try:
                requester = self._task_requester(doc, activated, request)
            except MeshAuthError as exc:
                return self._refusal(exc, doc, name, activated)
        request.state.a2a_agent = name
        request.state.a2a_inbound = inbound
        request.state.a2a_requester = requester
        response = await self._dispatcher.handle_requests(request)
        if activated:
            response.headers[HTTP_EXTENSION_HEADER] = EXTENSION_URI
        return response

    def _refusal(self, exc: MeshAuthError, doc: Mapping[str, Any], name: str, activated: bool) -> Response:
        """The 401 of a failed envelope check: only its stable code leaves."""
        # Counted on the bridge identity and logged once a minute per
        # code (a stranger's flood must not flood the log too).
        self.bridge.signal(f"a2a.{exc.code}", None, f"{name}: {exc.reason}")
        rid = doc.get("id") if isinstance(doc.get("id"), (str, int)) else None
        refusal = JSONResponse(
            {
                "jsonrpc": "2.0",
                "id": rid,
                "error": {"code": AUTH_ERROR_CODE, "message": exc.code, "data": {"code": exc.code}},
            },
            status_code=401,
        )
        if activated:
            refusal.headers[HTTP_EXTENSION_HEADER] = EXTENSION_URI
        return refusal

    def _task_requester(self, doc: Mapping[str, Any], activated: bool, request: Request) -> _Requester:
        """Who asks for a task operation, from its task-operation envelope.

        The envelope (``AGBoss-Mesh-Envelope`` header, only when the extension
        is activated) is checked like a message's, in the same order and with
        the same 401 codes, its ``bodyHash`` over ``{"method": <method>,
        "id": <task id>}`` so it proves nothing for another task or method. A
        trusted one names its issuer as the requester; no envelope, or a claim
        (unsigned, unknown issuer), is the anonymous requester."""
        method = str(doc.get("method"))
        params = doc.get("params")
        task_id = params.get("id") if isinstance(params, dict) else None
        anonymous = _Requester(ANONYMOUS, method, task_id if isinstance(task_id, str) else None)
        tokens = request.headers.getlist(TASK_ENVELOPE_HEADER)
        if not activated or not tokens:
            return anonymous
        if len(tokens) > 1:
            raise MeshAuthError(SIGNATURE_INVALID, f"more than one {TASK_ENVELOPE_HEADER} header")
        if not isinstance(task_id, str):
            return anonymous  # the SDK refuses the request itself
        check = verify_envelope(
            tokens[0],
            own_application=self.settings.application,
            issuer_keys=self.settings.trust,
            now=time.time(),
            message={"method": method, "id": task_id},
        )
        if check.trusted and check.issuer:
            return _Requester(f"issuer:{check.issuer}", method, task_id)
        return anonymous

    def _precheck(self, message: dict[str, Any], activated: bool, request: Request) -> _Inbound:
        """The envelope checks, on the message exactly as received, before anything runs."""
        try:
            digest = body_hash(message)
        except CanonicalJSONError:
            digest = ""
        inbound = _Inbound(
            activated=activated,
            message=message,
            body_hash=digest,
            traceparent=request.headers.get("traceparent"),
            tracestate=request.headers.get("tracestate"),
        )
        if not activated:
            return inbound  # without activation the extension's metadata is inert
        meta = message.get("metadata")
        ext = meta.get(EXTENSION_URI) if isinstance(meta, dict) else None
        token = ext.get("envelope") if isinstance(ext, dict) else None
        if token is None:
            return inbound
        inbound.check = verify_envelope(
            token,
            own_application=self.settings.application,
            issuer_keys=self.settings.trust,
            now=time.time(),
            message=message,
        )
        return inbound

    # -- tasks -----------------------------------------------------------------

    def _caller(self, inbound: _Inbound) -> str:
        check = inbound.check
        if check is not None and check.trusted and check.issuer:
            return f"issuer:{check.issuer}"
        return ANONYMOUS

    @staticmethod
    def _dedup_caller(caller: str, inbound: _Inbound) -> str:
        """The idempotency key's caller: the trusted issuer, or for anonymous
        callers the message's body hash, so one anonymous caller replaying
        another's messageId with its own message gets a task of its own (and
        learns nothing of the other's)."""
        if caller != ANONYMOUS:
            return caller
        # A message with no canonical form has no hash to key on: never deduplicated.
        return f"{ANONYMOUS}:{inbound.body_hash or uuid.uuid4()}"

    @staticmethod
    def may_see(owner: str, requester: str) -> bool:
        """A trusted caller's task is its issuer's alone; an anonymous caller's
        task is anyone's who holds its unguessable id (the id is the capability)."""
        return owner in (ANONYMOUS, requester)

    def _fail(self, task: dict[str, Any], code: str) -> None:
        task["status"] = {
            "state": "TASK_STATE_FAILED",
            "message": coded_message(code, task_id=task["id"], context_id=task["contextId"]),
            "timestamp": _now_iso(),
        }

    async def get_task(self, agent: str, task_id: str, requester: str = ANONYMOUS) -> dict[str, Any]:
        """The task as it stands; TaskNotFound when it is unknown, another
        agent's or not ``requester``'s to see (the three answer alike, so a
        task's existence does not leak)."""
        live = self.live.get(task_id)
        if live is not None and live.agent == agent:
            if not self.may_see(live.caller, requester):
                raise TaskNotFoundError
            return live.task
        found = await self.store.get(task_id)
        if found is None or found.agent != agent or not self.may_see(found.caller, requester):
            raise TaskNotFoundError
        return found.task

    async def submit(
        self, agent: str, params: SendMessageRequest, inbound: _Inbound | None, *, streaming: bool
    ) -> tuple[_Live | None, dict[str, Any]]:
        """Create (or find again) the task of a SendMessage. Returns the live
        execution when one runs in this process, and the task as it stands."""
        hosted = self.hosted(agent)
        if hosted is None:
            raise TaskNotFoundError(message="no such agent")
        msg = params.message
        if inbound is None:
            # Not a JSON-RPC body we could read ourselves (the SDK did): hash what it parsed.
            as_dict = MessageToDict(msg)
            inbound = _Inbound(activated=False, message=as_dict, body_hash=body_hash(as_dict))
        if not msg.message_id:
            raise InvalidParamsError(message="message.messageId is required")
        if msg.task_id:
            return await self._answer_paused(agent, hosted, params, inbound)
        async with self._submit_lock:
            return await self._submit(agent, hosted, params, inbound, streaming=streaming)

    async def _submit(
        self,
        agent: str,
        hosted: HostedAgent,
        params: SendMessageRequest,
        inbound: _Inbound,
        *,
        streaming: bool,
    ) -> tuple[_Live | None, dict[str, Any]]:
        msg = params.message
        caller = self._caller(inbound)
        dedup_caller = self._dedup_caller(caller, inbound)
        now_ms = self._now_ms()
        retention_ms = int(self.settings.idempotency_retention_s * 1000)
        seen = await self.store.remembered(
            agent=agent, caller=dedup_caller, message_id=msg.message_id, not_before_ms=now_ms - retention_ms
        )
        if seen is not None:
            if seen.body_hash != inbound.body_hash:
                raise InvalidParamsError(message="this messageId was already used for another message")
            live = self.live.get(seen.task_id)
            if live is not None:
                return live, live.task
            found = await self.store.get(seen.task_id)
            if found is not None:
                return None, found.task
        metadata = inbound.message.get("metadata")
        advertised = [s.id for s in hosted.offerings.values() if s.advertise]
        try:
            offering = select_offering(
                hosted.offerings, advertised, metadata if isinstance(metadata, dict) else None
            )
            # The raw parts keep JSON numbers as sent (the SDK's Struct makes every number a float).
            raw_parts = inbound.message.get("parts")
            if isinstance(raw_parts, list) and all(isinstance(p, dict) for p in raw_parts):
                parts = raw_parts
            else:
                parts = [MessageToDict(p) for p in msg.parts]
            handler_input = input_from_parts(parts, hosted.offerings[offering].input_schema)
        except PartsRefused as exc:
            raise InvalidParamsError(message=str(exc)) from None
        task_id = str(uuid.uuid4())
        context_id = msg.context_id or str(uuid.uuid4())
        task: dict[str, Any] = {
            "id": task_id,
            "contextId": context_id,
            "status": {"state": "TASK_STATE_SUBMITTED", "timestamp": _now_iso()},
        }
        check = inbound.check
        if check is not None:
            refusal = check_chain(
                check.call_chain,
                application=self.settings.application,
                skill=offering,
                max_hops=self.settings.max_mesh_hops,
            )
            if refusal is not None:
                task["status"] = {
                    "state": "TASK_STATE_REJECTED",
                    "message": coded_message(
                        refusal.code, task_id=task_id, context_id=context_id, details=refusal.details
                    ),
                    "timestamp": _now_iso(),
                }
                await self.store.create(
                    task, agent=agent, caller=caller, message_id=msg.message_id,
                    body_hash=inbound.body_hash, now_ms=now_ms, dedup_caller=dedup_caller, terminal=True,
                )
                return None, task
        await self.store.create(
            task, agent=agent, caller=caller, message_id=msg.message_id,
            body_hash=inbound.body_hash, now_ms=now_ms, dedup_caller=dedup_caller,
        )
        live = _Live(task=task, agent=agent, caller=caller)
        self.live[task_id] = live
        config: dict[str, Any] = {}
        if streaming and hosted.offerings[offering].streaming:
            config["stream"] = True
        if params.configuration.accepted_output_modes:
            # The agent's own content-type admission judges them (§8.5).
            config["accepted_output"] = list(params.configuration.accepted_output_modes)
        live.runner = asyncio.get_running_loop().create_task(
            self._execute(live, hosted, offering, handler_input, inbound, config),
            name=f"a2a:{task_id}",
        )
        return live, task

    async def _answer_paused(
        self, agent: str, hosted: HostedAgent, params: SendMessageRequest, inbound: _Inbound
    ) -> tuple[_Live, dict[str, Any]]:
        """A message naming ``taskId``: the caller's answer to its task paused in
        INPUT_REQUIRED / AUTH_REQUIRED, forwarded to the agent as the mesh
        follow-up (§6.5: same task_id) by the bridge identity that opened it.
        The runner already following the task carries on with its updates.

        Only the task's caller may answer (the ownership rule of GetTask:
        anyone else, and an unknown task, get TaskNotFound); a ``contextId``
        must be the task's (InvalidParams); a task not paused, or ended, takes
        no message (UnsupportedOperation). Input the agent refuses
        (INPUT_INVALID) is InvalidParams and the task stays paused."""
        msg = params.message
        caller = self._caller(inbound)
        live = self.live.get(msg.task_id)
        if live is None or live.agent != agent or not self.may_see(live.caller, caller):
            ended = await self.get_task(agent, msg.task_id, caller)  # TaskNotFound: unknown or not theirs
            raise UnsupportedOperationError(
                message=f"the task is {ended['status'].get('state')}: it takes no further message"
            )
        task = live.task
        if msg.context_id and msg.context_id != task["contextId"]:
            raise InvalidParamsError(message="message.contextId is not the task's contextId")
        state = task["status"].get("state")
        mesh_task = live.mesh_task
        if state not in INTERRUPTED_A2A or mesh_task is None or live.answering:
            raise UnsupportedOperationError(message=f"the task is {state}, not waiting for input")
        # The round's own schema (the agent is hosted here) decides how text parts map.
        performing = hosted.tasks.get(mesh_task.task_id)
        schema = performing.round_schema if performing is not None else None
        try:
            raw_parts = inbound.message.get("parts")
            if isinstance(raw_parts, list) and all(isinstance(p, dict) for p in raw_parts):
                parts = raw_parts
            else:
                parts = [MessageToDict(p) for p in msg.parts]
            answer = input_from_parts(parts, schema)
        except PartsRefused as exc:
            raise InvalidParamsError(message=str(exc)) from None
        live.answering = True
        # A blocking send returns at the next pause or the end, not at this one.
        live.settled.clear()
        try:
            await mesh_task.provide_input(answer, timeout=self.settings.send_wait_s)
        except ProtocolError as exc:
            if task["status"].get("state") in INTERRUPTED_A2A or live.done.is_set():
                live.settled.set()
            if exc.code == "INPUT_INVALID":
                raise InvalidParamsError(message="the input does not match what the task asked for") from None
            raise UnsupportedOperationError(message=f"the task did not take the input ({exc.code})") from None
        finally:
            live.answering = False
        if task["status"].get("state") in INTERRUPTED_A2A and not live.done.is_set():
            await self._status(live, "working")
        return live, task

    # -- execution ---------------------------------------------------------------

    async def _execute(
        self,
        live: _Live,
        hosted: HostedAgent,
        offering: str,
        handler_input: Any,
        inbound: _Inbound,
        config: dict[str, Any],
    ) -> None:
        task = live.task
        stream = bool(config.get("stream"))
        task_id = task["id"]
        check = inbound.check
        trusted = check is not None and check.trusted
        timeout = self.settings.task_timeout_s
        budget: dict[str, Any] | None = None
        if trusted and check is not None:
            block: dict[str, Any] = {"revision": 0}
            if check.budget is not None:
                micro = int((check.budget.remaining * 1_000_000).to_integral_value())
                block["cost_ceiling"] = {"amount_micro": micro, "currency": "USD"}
            if check.deadline_s is not None:
                block["deadline"] = format_ts(self._now_ms() + int(check.deadline_s * 1000))
                timeout = max(1.0, min(timeout, check.deadline_s))
            if len(block) > 1:
                budget = block
        chain = check.call_chain if check is not None else ()
        origin: dict[str, Any] = (
            dict(check.origin)
            if trusted and check is not None and check.origin is not None
            else {"rootExecutionId": task_id, "executionId": task_id}
        )
        meta = {
            EXTENSION_URI: {
                "callChain": extend_chain(
                    chain, application=self.settings.application, start=offering, execution_id=task_id
                ),
                "origin": origin,
            }
        }
        parent = (
            trace_from_traceparent(inbound.traceparent, inbound.tracestate)
            if inbound.traceparent
            else None
        )
        trace = child_trace(parent) if parent is not None else new_root_trace()
        try:
            try:
                reply = await self.node.send_request(
                    self.bridge,
                    hosted.agent_id,
                    offering,
                    handler_input,
                    trace=trace,
                    timeout=timeout,
                    config=config or None,
                    budget=budget,
                    meta=meta,
                )
            except RemoteError as exc:
                await self._finish(live, "failed", code=exc.code, inbound=inbound)
                return
            except RequestTimeout:
                await self._finish(live, "failed", code="TRANSPORT_TIMEOUT", inbound=inbound)
                return
            except ProtocolError as exc:
                await self._finish(live, "failed", code=exc.code, inbound=inbound)
                return
            self._note_cost(live, reply.envelope)
            if reply.task is None:
                err = reply.error
                code = str(err.get("code")) if err is not None else None
                await self._finish(live, reply.status, output=reply.output, code=code, inbound=inbound)
                return
            mesh_task = reply.task
            live.mesh_task = mesh_task
            await self._status(live, reply.status)
            streamed = False
            chunk_reader: asyncio.Task[None] | None = None
            if stream:

                async def read_chunks() -> None:
                    nonlocal streamed
                    first = True
                    async for chunk in mesh_task.stream(timeout=timeout):
                        streamed = True
                        live.publish(
                            {
                                "artifactUpdate": {
                                    "taskId": task_id,
                                    "contextId": task["contextId"],
                                    "artifact": {
                                        "artifactId": "output",
                                        "name": "output",
                                        "parts": [chunk_part(chunk)],
                                    },
                                    "append": not first,
                                    "lastChunk": False,
                                }
                            }
                        )
                        first = False

                # Chunks and state updates are read side by side: a stream that
                # fails midway ends with its failed update, not a chunk timeout.
                chunk_reader = asyncio.get_running_loop().create_task(read_chunks())
            try:
                async for env in mesh_task.updates(timeout=timeout):
                    if env.get("from") != hosted.agent_id:
                        continue
                    self._note_cost(live, env)
                    status = (env.get("payload") or {}).get("status")
                    if isinstance(status, str) and state_of(status) not in TERMINAL_A2A:
                        await self._status(live, status)
                if chunk_reader is not None and mesh_task.state == "completed":
                    # The final chunk is stored before the completed update: drain them.
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(asyncio.shield(chunk_reader), timeout=30.0)
            finally:
                if chunk_reader is not None and not chunk_reader.done():
                    chunk_reader.cancel()
                    await asyncio.wait([chunk_reader])  # its own error is not ours to raise
            final = mesh_task.last_update
            payload = final.get("payload") if isinstance(final.get("payload"), Mapping) else {}
            err = final.get("error") if isinstance(final.get("error"), Mapping) else None
            await self._finish(
                live,
                str(payload.get("status") or "failed"),
                output=payload.get("output"),
                code=str(err.get("code")) if err is not None else None,
                inbound=inbound,
                streamed=streamed,
            )
        except asyncio.CancelledError:
            if live.cancel_requested:
                await self._finish(live, "canceled", inbound=inbound)
            else:
                self._fail(task, INTERRUPTED)
                with contextlib.suppress(Exception):
                    await self.store.update(task, now_ms=self._now_ms(), terminal=True)
                self._close(live)
            raise
        except TimeoutError:
            await self._finish(live, "failed", code="TRANSPORT_TIMEOUT", inbound=inbound)
        except Exception:
            log.exception("A2A task %s failed in the bridge", task_id)
            await self._finish(live, "failed", code="INTERNAL_ERROR", inbound=inbound)

    def _note_cost(self, live: _Live, env: Mapping[str, Any]) -> None:
        """The agent's reported cost (``payload.cost``, §13.5), the spend of the report."""
        payload = env.get("payload")
        cost = payload.get("cost") if isinstance(payload, Mapping) else None
        if isinstance(cost, Mapping) and cost.get("currency") == "USD":
            micro = cost.get("amount_micro")
            if type(micro) is int and micro >= 0:
                live.cost_micro = micro

    async def _status(self, live: _Live, mesh_status: str) -> None:
        state = state_of(mesh_status)
        task = live.task
        if task["status"].get("state") == state:
            return
        task["status"] = {"state": state, "timestamp": _now_iso()}
        await self.store.update(task, now_ms=self._now_ms(), terminal=False)
        if state in INTERRUPTED_A2A:
            live.settled.set()
        live.publish(
            {"statusUpdate": {"taskId": task["id"], "contextId": task["contextId"], "status": task["status"]}}
        )

    async def _finish(
        self,
        live: _Live,
        mesh_status: str,
        *,
        inbound: _Inbound,
        output: Any = None,
        code: str | None = None,
        streamed: bool = False,
    ) -> None:
        task = live.task
        if task["status"].get("state") in TERMINAL_A2A:
            self._close(live)
            return
        if live.cancel_requested and mesh_status != "completed":
            mesh_status = "canceled"
        state = state_of(mesh_status)
        status: dict[str, Any] = {"state": state, "timestamp": _now_iso()}
        if mesh_status in FAILED_STATES:
            # Only the stable code leaves: never the agent's message or details.
            stable = code or ("BUDGET_EXHAUSTED" if mesh_status == "exhausted" else "INTERNAL_ERROR")
            status["message"] = coded_message(stable, task_id=task["id"], context_id=task["contextId"])
        elif mesh_status == "rejected":
            status["message"] = coded_message(
                code or "REJECTED", task_id=task["id"], context_id=task["contextId"]
            )
        task["status"] = status
        if state == "TASK_STATE_COMPLETED":
            artifact = output_artifact(output)
            if artifact is not None:
                task["artifacts"] = [artifact]
            check = inbound.check
            if check is not None and check.trusted:
                spend = Decimal(live.cost_micro or 0).scaleb(-6)
                report = sign_report(
                    issuer=self.settings.application,
                    execution_id=task["id"],
                    spend_total=format_usd(spend),
                    body_hash=inbound.body_hash,
                    issued_at=time.time(),
                    signing_key=self._signing_key,
                )
                task["metadata"] = {EXTENSION_URI: {"report": report}}
        await self.store.update(task, now_ms=self._now_ms(), terminal=True)
        if state == "TASK_STATE_COMPLETED" and not streamed and "artifacts" in task:
            live.publish(
                {
                    "artifactUpdate": {
                        "taskId": task["id"],
                        "contextId": task["contextId"],
                        "artifact": task["artifacts"][0],
                        "append": False,
                        "lastChunk": True,
                    }
                }
            )
        final: dict[str, Any] = {"taskId": task["id"], "contextId": task["contextId"], "status": status}
        if "metadata" in task:
            final["metadata"] = task["metadata"]
        live.publish({"statusUpdate": final})
        self._close(live)

    def _close(self, live: _Live) -> None:
        live.settled.set()
        live.done.set()
        live.publish(None)
        self.live.pop(live.task["id"], None)

    async def cancel(self, agent: str, task_id: str, requester: str = ANONYMOUS) -> dict[str, Any]:
        live = self.live.get(task_id)
        if live is None or live.agent != agent or not self.may_see(live.caller, requester):
            task = await self.get_task(agent, task_id, requester)  # raises TaskNotFound
            raise TaskNotCancelableError(message=f"task is {task['status'].get('state')}")
        live.cancel_requested = True
        if live.mesh_task is not None:
            try:
                await live.mesh_task.cancel("user_requested")
            except ProtocolError as exc:
                log.info("cancel of mesh task for %s: %s", task_id, exc)
            # The agent's canceled update ends the runner by itself; stopping it
            # mid-finish would lose the final status update it publishes.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(live.done.wait(), timeout=10.0)
        if live.runner is not None and not live.runner.done():
            live.runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(live.runner), timeout=10.0)
        return live.task


class _ContextBuilder(DefaultServerCallContextBuilder):
    """Carries what the HTTP layer learned (agent, pre-checked envelope) to the handler."""

    def build(self, request: Request) -> ServerCallContext:
        context = super().build(request)
        context.state["a2a_agent"] = getattr(request.state, "a2a_agent", None)
        context.state["a2a_inbound"] = getattr(request.state, "a2a_inbound", None)
        context.state["a2a_requester"] = getattr(request.state, "a2a_requester", None)
        return context


def _task_proto(task: Mapping[str, Any]) -> Task:
    proto = Task()
    ParseDict(dict(task), proto, ignore_unknown_fields=True)
    return proto


async def _follow(live: _Live, queue: asyncio.Queue[dict[str, Any] | None]) -> AsyncGenerator[Any]:
    """The task as it stands, then its updates until it ends or pauses for the
    caller (INPUT_REQUIRED / AUTH_REQUIRED: the stream closes, as A2A streams
    do, and the caller's answering message opens the next one). ``queue`` is
    already subscribed, so nothing between the two is missed."""
    try:
        yield _task_proto(live.task)
        if live.task["status"].get("state") in INTERRUPTED_A2A and not live.answering:
            return
        while True:
            event = await queue.get()
            if event is None:
                return
            if "statusUpdate" in event:
                yield ParseDict(event["statusUpdate"], TaskStatusUpdateEvent(), ignore_unknown_fields=True)
                if event["statusUpdate"].get("status", {}).get("state") in INTERRUPTED_A2A:
                    return
            elif "artifactUpdate" in event:
                yield ParseDict(event["artifactUpdate"], TaskArtifactUpdateEvent(), ignore_unknown_fields=True)
    finally:
        with contextlib.suppress(ValueError):
            live.subscribers.remove(queue)


class _Handler(RequestHandler):
    """The SDK's request-handler interface, answered by the bridge."""

    def __init__(self, bridge: A2ABridge) -> None:
        self.bridge = bridge

    @staticmethod
    def _agent(context: ServerCallContext) -> str:
        return str(context.state.get("a2a_agent") or "")

    @staticmethod
    def _requester(context: ServerCallContext, method: str, task_id: str) -> str:
        """The proven caller of a task operation, when the proof is for exactly
        this method and task as the SDK parsed them; anonymous otherwise."""
        found = context.state.get("a2a_requester")
        if isinstance(found, _Requester) and found.method == method and found.task_id == task_id:
            return found.caller
        return ANONYMOUS

    async def on_get_task(self, params: GetTaskRequest, context: ServerCallContext) -> Task | None:
        requester = self._requester(context, "GetTask", params.id)
        return _task_proto(await self.bridge.get_task(self._agent(context), params.id, requester))

    async def on_list_tasks(self, params: ListTasksRequest, context: ServerCallContext) -> ListTasksResponse:
        raise UnsupportedOperationError(message="ListTasks is not supported by this bridge")

    async def on_cancel_task(self, params: CancelTaskRequest, context: ServerCallContext) -> Task | None:
        requester = self._requester(context, "CancelTask", params.id)
        return _task_proto(await self.bridge.cancel(self._agent(context), params.id, requester))

    async def on_message_send(self, params: SendMessageRequest, context: ServerCallContext) -> Task | Message:
        live, task = await self.bridge.submit(
            self._agent(context), params, context.state.get("a2a_inbound"), streaming=False
        )
        if live is not None and not params.configuration.return_immediately:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(live.settled.wait(), timeout=self.bridge.settings.send_wait_s)
            task = live.task
        return _task_proto(task)

    async def on_message_send_stream(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any]:
        bridge = self.bridge
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        live, task = await bridge.submit(
            self._agent(context), params, context.state.get("a2a_inbound"), streaming=True
        )
        if live is None or live.done.is_set():
            yield _task_proto(task)
            return
        live.subscribers.append(queue)
        async for event in _follow(live, queue):
            yield event

    async def on_subscribe_to_task(
        self, params: SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any]:
        agent = self._agent(context)
        requester = self._requester(context, "SubscribeToTask", params.id)
        live = self.bridge.live.get(params.id)
        if (
            live is None
            or live.agent != agent
            or live.done.is_set()
            or not self.bridge.may_see(live.caller, requester)
        ):
            await self.bridge.get_task(agent, params.id, requester)  # TaskNotFound when unknown or foreign
            raise UnsupportedOperationError(message="the task is in a terminal state")
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        live.subscribers.append(queue)
        async for event in _follow(live, queue):
            yield event

    async def on_create_task_push_notification_config(
        self, params: TaskPushNotificationConfig, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        raise PushNotificationNotSupportedError

    async def on_get_task_push_notification_config(
        self, params: GetTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        raise PushNotificationNotSupportedError

    async def on_list_task_push_notification_configs(
        self, params: ListTaskPushNotificationConfigsRequest, context: ServerCallContext
    ) -> ListTaskPushNotificationConfigsResponse:
        raise PushNotificationNotSupportedError

    async def on_delete_task_push_notification_config(
        self, params: DeleteTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> None:
        raise PushNotificationNotSupportedError

    async def on_get_extended_agent_card(
        self, params: GetExtendedAgentCardRequest, context: ServerCallContext
    ) -> AgentCard:
        raise UnsupportedOperationError(message="no extended agent card")
