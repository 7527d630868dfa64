"""The inbound bridge's HTTP intake: Agent Cards, and the JSON-RPC endpoint of
each exposed agent, where a request's bytes are bounded and parsed, and its
mesh-extension envelope checked, before the a2a-sdk's dispatcher sees it."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from a2a.extensions.common import HTTP_EXTENSION_HEADER, get_requested_extensions
from a2a.server.routes.jsonrpc_dispatcher import JsonRpcDispatcher
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from meshnode.a2a.execution import InboundTasks
from meshnode.a2a.handler import ContextBuilder, Handler
from meshnode.a2a.inbound import ANONYMOUS, BridgeSettings, Inbound, Requester
from meshnode.a2a.mapping import agent_card, ints_as_sent
from meshnode.protocol.a2a_extension import (
    EXTENSION_URI,
    SIGNATURE_INVALID,
    TASK_ENVELOPE_HEADER,
    TASK_METHODS,
    EnvelopeCheck,
    MeshAuthError,
    ReplayCache,
    body_hash,
    task_operation,
    verify_envelope,
)
from meshnode.protocol.canonical import CanonicalJSONError, parse_json
from meshnode.protocol.manifest import materialize_public_block

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent

__all__ = ["MAX_JSON_DEPTH", "HttpIntake", "deeper_than"]

#: The JSON-RPC error code of a 401 answer (outside the reserved range).
AUTH_ERROR_CODE = 401
#: The largest request body read (a stranger's bytes are bounded before parsing).
MAX_BODY_BYTES = 4 * 1024 * 1024
#: How deep a request's JSON may nest (a data part's value included).
MAX_JSON_DEPTH = 64
#: JSON-RPC's own error codes answered by the bridge before the SDK parses.
PARSE_ERROR_CODE = -32700
INVALID_REQUEST_CODE = -32600


#: Where the discovery document lists every exposed agent and its card.
DISCOVERY_PATH = "/.well-known/agent-cards.json"


def deeper_than(value: Any, limit: int) -> bool:
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


def auth_error_info(code: str) -> dict[str, Any]:
    """The ``google.rpc.ErrorInfo`` detail of a 401: reason and ``metadata.code`` are the mesh code."""
    return {
        "@type": "type.googleapis.com/google.rpc.ErrorInfo",
        "reason": code,
        "domain": "agboss.dev",
        "metadata": {"code": code},
    }


def www_authenticate(application: str, code: str) -> str:
    """The ``WWW-Authenticate`` challenge of a 401: the mesh extension's
    envelope, for ``application``, and the stable code of what failed."""
    quoted = application.replace("\\", "\\\\").replace('"', '\\"')
    return f'AGBoss-Mesh realm="{quoted}", uri="{EXTENSION_URI}", error="{code}"'


def _with_ints(response: JSONResponse, task: Mapping[str, Any]) -> JSONResponse:
    """The SDK's JSON answer with the task's integers rendered as integers: the
    SDK renders a task from its proto, whose Struct holds every number as a
    double (an agent's ``{"n": 2}`` would leave as ``{"n": 2.0}``)."""
    try:
        body = json.loads(bytes(response.body))
    except ValueError:
        return response
    result = body.get("result") if isinstance(body, dict) else None
    if not isinstance(result, dict):
        return response
    inner = result.get("task")
    rendered: dict[str, Any] = inner if isinstance(inner, dict) else result
    if rendered.get("id") != task.get("id"):
        return response
    fixed = ints_as_sent(rendered, task)
    body["result"] = {**result, "task": fixed} if rendered is not result else fixed
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(body, status_code=response.status_code, headers=headers)


async def _events_with_ints(events: AsyncIterator[Any], answered: list[dict[str, Any]]) -> AsyncIterator[Any]:
    """The SDK's SSE events with each result's integers rendered as integers,
    paired in order with the events the handler noted (see :func:`_with_ints`)."""
    async for event in events:
        data = event.get("data") if isinstance(event, dict) else None
        if isinstance(data, str) and answered:
            try:
                body = json.loads(data)
            except ValueError:
                body = None
            if isinstance(body, dict) and isinstance(body.get("result"), dict):
                body["result"] = ints_as_sent(body["result"], answered.pop(0))
                event = {**event, "data": json.dumps(body, ensure_ascii=False)}
        yield event


class HttpIntake:
    """The Starlette app of the inbound bridge (:meth:`app`)."""

    def __init__(self, *, tasks: InboundTasks, bridge: HostedAgent, settings: BridgeSettings) -> None:
        self.tasks = tasks
        self.bridge = bridge
        self.settings = settings
        self._dispatcher = JsonRpcDispatcher(Handler(tasks), context_builder=ContextBuilder())
        self._replays = ReplayCache()

    def app(self) -> Starlette:
        routes = [
            Route("/agents/{name}/.well-known/agent-card.json", self._card, methods=["GET"]),
            Route("/agents/{name}", self._rpc, methods=["POST"]),
            Route("/.well-known/agent-card.json", self._default_card, methods=["GET"]),
            Route(DISCOVERY_PATH, self._discovery, methods=["GET"]),
        ]
        return Starlette(routes=routes)

    def card(self, name: str) -> dict[str, Any] | None:
        hosted = self.tasks.hosted(name)
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
        return await self._card_for(request.path_params["name"])

    def discovery(self) -> dict[str, Any]:
        """The discovery document: every exposed, running agent with its
        endpoint, its card's URL and the card itself (A2A defines one card per
        well-known path; a host serving several agents lists them here)."""
        agents: list[dict[str, Any]] = []
        for name in self.settings.expose:
            card = self.card(name)
            if card is None:
                continue
            url = f"{self.settings.base_url}/agents/{name}"
            agents.append({
                "name": name,
                "description": card.get("description", ""),
                "url": url,
                "agentCardUrl": f"{url}/.well-known/agent-card.json",
                "card": card,
            })
        return {"application": self.settings.application, "agents": agents}

    async def _discovery(self, request: Request) -> Response:
        return JSONResponse(self.discovery())

    async def _default_card(self, request: Request) -> Response:
        if len(self.settings.expose) != 1:
            return JSONResponse(
                {"error": "several agents are exposed: use /agents/<name>/.well-known/agent-card.json"
                          f" (all of them are listed at {DISCOVERY_PATH})"},
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
        if self.tasks.hosted(name) is None:
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
        inbound: Inbound | None = None
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
        if deeper_than(doc, MAX_JSON_DEPTH):
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
        requester: Requester | None = None
        if isinstance(doc, dict) and doc.get("method") in TASK_METHODS:
            try:
                requester = self._task_requester(doc, activated, request)
            except MeshAuthError as exc:
                return self._refusal(exc, doc, name, activated)
        request.state.a2a_agent = name
        request.state.a2a_inbound = inbound
        request.state.a2a_requester = requester
        answered: list[dict[str, Any]] = []
        request.state.a2a_answered = answered
        response = await self._dispatcher.handle_requests(request)
        if answered and isinstance(response, JSONResponse):
            response = _with_ints(response, answered[-1])
        elif isinstance(getattr(response, "body_iterator", None), AsyncIterator):
            # A stream (SSE): its events, in the order the handler noted them.
            response.body_iterator = _events_with_ints(response.body_iterator, answered)  # type: ignore[attr-defined]
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
                # data: A2A v1.0's list of typed details, as the SDK answers its
                # other errors; the ErrorInfo's metadata keeps the seed's {code}.
                "error": {"code": AUTH_ERROR_CODE, "message": exc.code, "data": [auth_error_info(exc.code)]},
                # The seed's own shape, 401 {"code": …}: what a reader that knows
                # nothing of JSON-RPC (and meshnode's outbound, first) reads.
                "code": exc.code,
            },
            status_code=401,
            # RFC 9110 §11.6.1: a 401 names the challenge to meet, here the
            # extension's envelope for this application.
            headers={"WWW-Authenticate": www_authenticate(self.settings.application, exc.code)},
        )
        if activated:
            refusal.headers[HTTP_EXTENSION_HEADER] = EXTENSION_URI
        return refusal

    def _task_requester(self, doc: Mapping[str, Any], activated: bool, request: Request) -> Requester:
        """Who asks for a task operation, from its task-operation envelope.

        The envelope (``AGBoss-Mesh-Envelope`` header, only when the extension
        is activated) is checked like a message's, in the same order and with
        the same 401 codes, its ``bodyHash`` over ``{"method": <method>,
        "id": <task id>}`` so it proves nothing for another task or method. A
        trusted one names its issuer as the requester; no envelope, or a claim
        (unsigned, unknown issuer), is the anonymous requester."""
        method = str(doc.get("method"))
        params = doc.get("params")
        task_id = params.get("id") if isinstance(params, dict) and method != "ListTasks" else None
        anonymous = Requester(ANONYMOUS, method, task_id if isinstance(task_id, str) else None)
        tokens = request.headers.getlist(TASK_ENVELOPE_HEADER)
        if not activated or not tokens:
            return anonymous
        if len(tokens) > 1:
            raise MeshAuthError(SIGNATURE_INVALID, f"more than one {TASK_ENVELOPE_HEADER} header")
        if not isinstance(task_id, str) and method != "ListTasks":
            return anonymous  # the SDK refuses the request itself
        check = self._verify(tokens[0], task_operation(method, task_id))
        if check.trusted and check.issuer:
            return Requester(f"issuer:{check.issuer}", method, task_id)
        return anonymous

    def _precheck(self, message: dict[str, Any], activated: bool, request: Request) -> Inbound:
        """The envelope checks, on the message exactly as received, before anything runs."""
        try:
            digest = body_hash(message)
        except CanonicalJSONError:
            digest = ""
        inbound = Inbound(
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
        inbound.check = self._verify(token, message)
        return inbound

    def _verify(self, token: Any, message: Mapping[str, Any]) -> EnvelopeCheck:
        """An envelope's checks in the seed's order, then the replay cache: a
        trusted envelope is accepted once inside its window."""
        now = time.time()
        check = verify_envelope(
            token,  # not a string: refused as malformed
            own_application=self.settings.application,
            issuer_keys=self.settings.trust,
            now=now,
            message=message,
            clock_skew_s=self.settings.clock_skew_s,
        )
        self._replays.check(check, now=now)
        return check
