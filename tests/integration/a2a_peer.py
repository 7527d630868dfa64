"""An external A2A agent for the outbound-bridge tests: a real a2a-sdk server
(DefaultRequestHandlerV2 + JSON-RPC and card routes, served by uvicorn on
127.0.0.1 in a thread) with the AGBoss mesh extension's server side done with
the shared core (meshnode.protocol.a2a_extension).

The extension part is an ASGI wrapper around the SDK app, because the SDK
neither checks envelopes nor echoes ``A2A-Extensions``: it reads the raw JSON
of a SendMessage, verifies the envelope over the message exactly as received,
records what arrived (headers, claims), answers 401 with the stable code on a
failed check, deduplicates by messageId (a resend of the same message gets the
same answer, the same task), and echoes the extension when it activated it.
The executor completes each task with a signed run report — or a forged one,
as the test asks.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import nacl.signing
import uvicorn
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandlerV2
from a2a.server.routes.agent_card_routes import create_agent_card_routes
from a2a.server.routes.jsonrpc_routes import create_jsonrpc_routes
from a2a.server.tasks.inmemory_task_store import InMemoryTaskStore
from a2a.types.a2a_pb2 import (
    AgentCapabilities,
    AgentCard,
    AgentExtension,
    AgentInterface,
    AgentSkill,
    Artifact,
    Message,
    Part,
    Role,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from google.protobuf import json_format, struct_pb2
from starlette.applications import Starlette

from meshnode.protocol.a2a_extension import (
    EXTENSION_URI,
    IssuerTrust,
    MeshAuthError,
    body_hash,
    check_chain,
    sign_report,
    verify_envelope,
)
from meshnode.testing import eventually

Scope = MutableMapping[str, Any]
Event = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Event]]
Send = Callable[[Event], Awaitable[None]]


@dataclass
class Behaviour:
    """What the peer does; the test sets it before the daemon calls."""

    application: str = "weather-co"
    declare_extension: bool = True
    retention: str | None = "PT3600S"
    echo: bool = True
    #: "good", "bad_signature", "wrong_body", "wrong_task" or "none".
    report: str = "good"
    spend: str = "0.30"
    #: Seconds the first attempt of each message takes (to make the caller give up).
    first_attempt_delay: float = 0.0
    #: Answer at once with a working task and complete it this many seconds later
    #: (the caller then learns the outcome, and reads the report, by GetTask).
    answer_working_for: float = 0.0
    #: maxMeshHops of the chain check every envelope gets.
    max_hops: int = 8
    #: The card declares streaming (card fact: set before start).
    streaming: bool = False
    #: Stream the answer: a working task, this many artifact updates (text
    #: ``w<i> ``, ``chunk_delay`` apart), then the completed status with the report.
    stream_chunks: int = 0
    chunk_delay: float = 0.05


@dataclass
class Received:
    message_id: str
    headers: dict[str, str]
    claims: dict[str, Any] | None
    trusted: bool
    body_hash: str | None
    outcome: str  # "new", "duplicate", "401:<code>"


@dataclass
class Peer:
    behaviour: Behaviour
    report_key: nacl.signing.SigningKey = field(default_factory=nacl.signing.SigningKey.generate)
    received: list[Received] = field(default_factory=list)
    methods: list[str] = field(default_factory=list)  # JSON-RPC methods called, in order
    canceled: list[str] = field(default_factory=list)  # task ids a CancelTask reached the executor for
    port: int = 0
    _answers: dict[str, asyncio.Future[tuple[int, list[tuple[bytes, bytes]], bytes]]] = field(default_factory=dict)
    _activated: dict[str, str] = field(default_factory=dict)  # messageId -> verified bodyHash
    _attempts: dict[str, int] = field(default_factory=dict)
    _refused: dict[str, dict[str, Any]] = field(default_factory=dict)  # messageId -> {code, details}
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def issuer_key(self) -> str:
        return "ed25519:" + base64.urlsafe_b64encode(bytes(self.report_key.verify_key)).rstrip(b"=").decode()

    def sends(self) -> list[Received]:
        return [r for r in self.received if not r.outcome.startswith("401")]

    # -- the card and the SDK app ---------------------------------------------------

    def card(self) -> AgentCard:
        b = self.behaviour
        extensions = []
        if b.declare_extension:
            params = struct_pb2.Struct()
            if b.retention is not None:
                params.update({"idempotencyRetention": b.retention})
            params.update({"application": b.application})
            extensions.append(AgentExtension(uri=EXTENSION_URI, required=False, params=params))
        return AgentCard(
            name=b.application,
            description="a test peer",
            version="1.0.0",
            supported_interfaces=[AgentInterface(url=self.url + "/", protocol_binding="JSONRPC", protocol_version="1.0")],
            capabilities=AgentCapabilities(streaming=b.streaming, extensions=extensions),
            default_input_modes=["application/json", "text/plain"],
            default_output_modes=["application/json"],
            skills=[AgentSkill(id="forecast", name="forecast", description="weather", tags=["weather"])],
        )

    def _app(self) -> Starlette:
        card = self.card()
        handler = DefaultRequestHandlerV2(
            agent_executor=_Executor(self), task_store=InMemoryTaskStore(), agent_card=card
        )
        routes = [*create_agent_card_routes(card), *create_jsonrpc_routes(handler, "/")]
        return Starlette(routes=routes)

    # -- the extension, around the SDK app --------------------------------------------

    def asgi(self, inner: Starlette) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope["method"] != "POST":
                await inner(scope, receive, send)
                return
            body = b""
            while True:
                event = await receive()
                body += event.get("body", b"")
                if not event.get("more_body"):
                    break
            try:
                rpc = json.loads(body)
            except ValueError:
                rpc = {}
            self.methods.append(str(rpc.get("method")))
            if rpc.get("method") == "SendMessage" and self.behaviour.answer_working_for:
                rpc["params"].setdefault("configuration", {})["returnImmediately"] = True
                body = json.dumps(rpc).encode()
            if rpc.get("method") not in ("SendMessage", "SendStreamingMessage"):
                await inner(scope, _replay(body), self._echoing(send, activated=True))
                return
            headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
            message = rpc["params"]["message"]  # the raw JSON, as received
            message_id = message["messageId"]
            requested = EXTENSION_URI in headers.get("a2a-extensions", "")
            activated = requested and self.behaviour.declare_extension
            claims: dict[str, Any] | None = None
            trusted = False
            verified_hash: str | None = None
            if activated:
                token = ((message.get("metadata") or {}).get(EXTENSION_URI) or {}).get("envelope")
                try:
                    check = verify_envelope(
                        token, own_application=self.behaviour.application,
                        issuer_keys=IssuerTrust(allow=["*"]), now=time.time(), message=message,
                    )
                except MeshAuthError as exc:
                    self.received.append(Received(message_id, headers, None, False, None, f"401:{exc.code}"))
                    await _json(send, 401, {"code": exc.code})
                    return
                claims, trusted, verified_hash = check.claims, check.trusted, check.body_hash
                if trusted and verified_hash:
                    self._activated[message_id] = verified_hash
                refusal = check_chain(check.call_chain, application=self.behaviour.application,
                                      skill="forecast", max_hops=self.behaviour.max_hops)
                if refusal is not None:
                    self._refused[message_id] = refusal.metadata()
            first = self._answers.get(message_id)
            self.received.append(Received(message_id, headers, claims, trusted, verified_hash,
                                          "duplicate" if first else "new"))
            if first is not None:
                # The same message again (a resend): the same answer, the same task.
                status, out_headers, out_body = await asyncio.shield(first)
                await send({"type": "http.response.start", "status": status, "headers": out_headers})
                await send({"type": "http.response.body", "body": out_body})
                return
            future: asyncio.Future[tuple[int, list[tuple[bytes, bytes]], bytes]] = (
                asyncio.get_running_loop().create_future()
            )
            self._answers[message_id] = future
            captured: dict[str, Any] = {"body": b""}

            async def capture(event: Event) -> None:
                if event["type"] == "http.response.start":
                    captured["status"] = event["status"]
                    captured["headers"] = list(event.get("headers") or [])
                elif event["type"] == "http.response.body":
                    captured["body"] += event.get("body", b"")
                    if not event.get("more_body") and not future.done():
                        future.set_result((captured["status"], captured["headers"], captured["body"]))
                await send(event)

            await inner(scope, _replay(body), self._echoing(capture, activated=activated))

        return app

    def _echoing(self, send: Send, *, activated: bool) -> Send:
        async def wrapped(event: Event) -> None:
            if event["type"] == "http.response.start" and activated and self.behaviour.echo:
                event = dict(event)
                event["headers"] = [*(event.get("headers") or []), (b"a2a-extensions", EXTENSION_URI.encode())]
            await send(event)

        return wrapped

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> Peer:
        # Bind port 0 here and hand the listening socket to uvicorn: the port is
        # known before the card (which names it) is built, and never released
        # in between for another process to take.
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        self.port = int(listener.getsockname()[1])
        config = uvicorn.Config(self.asgi(self._app()), log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        self._server = server
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
        self._thread.start()
        eventually(lambda: server.started, timeout=15, what="the test A2A peer serving")
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> Peer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Executor(AgentExecutor):
    def __init__(self, peer: Peer) -> None:
        self.peer = peer

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        b = self.peer.behaviour
        message = context.message
        assert message is not None and context.task_id and context.context_id
        attempt = self.peer._attempts.get(message.message_id, 0) + 1
        self.peer._attempts[message.message_id] = attempt
        if attempt == 1 and b.first_attempt_delay:
            await asyncio.sleep(b.first_attempt_delay)
        task_id = context.task_id
        refused = self.peer._refused.get(message.message_id)
        if refused is not None:
            # The chain check: REJECTED, nothing run, the code and details for the caller.
            note = Message(message_id=f"r-{task_id}", role=Role.ROLE_AGENT, parts=[Part(text="rejected")])
            note.metadata.update({EXTENSION_URI: refused})
            await event_queue.enqueue_event(Task(
                id=task_id, context_id=context.context_id,
                status=TaskStatus(state=TaskState.TASK_STATE_REJECTED, message=note),
            ))
            return
        if b.answer_working_for:
            await event_queue.enqueue_event(Task(
                id=task_id, context_id=context.context_id, status=TaskStatus(state=TaskState.TASK_STATE_WORKING),
            ))
            await asyncio.sleep(b.answer_working_for)
        data = json_format.MessageToDict(message.parts[0]).get("data") if message.parts else None
        result = struct_pb2.Value()
        result.struct_value.update({"forecast": "sunny", "asked": data})
        task = Task(
            id=task_id, context_id=context.context_id,
            status=TaskStatus(state=TaskState.TASK_STATE_COMPLETED),
            artifacts=[Artifact(artifact_id="a1", name="forecast", parts=[Part(data=result)])],
        )
        verified_hash = self.peer._activated.get(message.message_id)
        if verified_hash is not None and b.report != "none":
            key = self.peer.report_key if b.report != "bad_signature" else nacl.signing.SigningKey.generate()
            report = sign_report(
                issuer=b.application,
                execution_id=task_id if b.report != "wrong_task" else "t-someone-else",
                spend_total=b.spend,
                body_hash=verified_hash if b.report != "wrong_body" else body_hash({"other": True}),
                issued_at=time.time(),
                signing_key=key,
            )
            task.metadata.update({EXTENSION_URI: {"report": report}})
        if b.stream_chunks:
            await event_queue.enqueue_event(Task(
                id=task_id, context_id=context.context_id, status=TaskStatus(state=TaskState.TASK_STATE_WORKING),
            ))
            for i in range(b.stream_chunks):
                await asyncio.sleep(b.chunk_delay)
                await event_queue.enqueue_event(TaskArtifactUpdateEvent(
                    task_id=task_id, context_id=context.context_id,
                    artifact=Artifact(artifact_id=f"w{i}", name="words", parts=[Part(text=f"w{i} ")]),
                    last_chunk=i == b.stream_chunks - 1,
                ))
            await event_queue.enqueue_event(TaskStatusUpdateEvent(
                task_id=task_id, context_id=context.context_id, status=task.status, metadata=task.metadata,
            ))
            return
        if b.answer_working_for:
            # The task exists already: its artifact, then the terminal status
            # (whose metadata the SDK merges into the task's).
            await event_queue.enqueue_event(TaskArtifactUpdateEvent(
                task_id=task_id, context_id=context.context_id, artifact=task.artifacts[0], last_chunk=True,
            ))
            await event_queue.enqueue_event(TaskStatusUpdateEvent(
                task_id=task_id, context_id=context.context_id, status=task.status, metadata=task.metadata,
            ))
            return
        await event_queue.enqueue_event(task)

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id and context.context_id
        self.peer.canceled.append(context.task_id)
        await event_queue.enqueue_event(TaskStatusUpdateEvent(
            task_id=context.task_id, context_id=context.context_id,
            status=TaskStatus(state=TaskState.TASK_STATE_CANCELED),
        ))


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> Event:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # no more body; wait for a disconnect that never comes
        return {"type": "http.disconnect"}

    return receive


async def _json(send: Send, status: int, obj: Any) -> None:
    body = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
