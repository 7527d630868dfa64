"""The inbound A2A bridge: hosted agents served to A2A v1.0 clients over HTTP.

Served by the daemon (uvicorn inside its event loop) when ``[a2a] listen`` is
set. Each exposed agent has its JSON-RPC endpoint at ``/agents/<name>`` and its
Agent Card at ``/agents/<name>/.well-known/agent-card.json`` (and at
``/.well-known/agent-card.json`` when it is the only one); the discovery
document ``/.well-known/agent-cards.json`` lists every exposed agent with its
endpoint and card.

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

Task ownership (meshnode's profile of the extension, which defines envelopes
on messages only): a task belongs to the caller that created it. A trusted
caller's task is answered (GetTask, CancelTask, SubscribeToTask) only to a
request proving the same issuer — a task-operation envelope in the
``AGBoss-Mesh-Envelope`` header (an A2A service parameter, with the extension
activated), signed over ``{"method", "id"}`` and checked like a message's
envelope; meshnode's outbound sends one on every task operation. An
anonymous caller's task is answered to whoever holds its unguessable id.
Anyone else is answered exactly as for an unknown task (TaskNotFound).
ListTasks lists the requester's own tasks on the agent (a trusted caller's,
proven as above over ``{"method": "ListTasks"}``); an anonymous requester's
list is empty, since anonymous task ids are capabilities. A task's ``history``
holds the caller's messages (the first and each answer to a pause, without
the envelope), cut to ``historyLength`` when a request gives one.

Only the JSON-RPC binding is served: the intake's checks (body bounds, the
envelope on the raw message, the 401s) are written against the JSON-RPC body
before the SDK parses it; an HTTP+JSON (REST) binding needs its own intake.

The replay window is the seed's PT60S (a longer ``expiresIn`` is capped at it
plus ``[a2a] clock_skew``) and a trusted envelope is accepted once inside it:
the same token again answers 401 ``mesh.envelope-expired``.

The parts: :mod:`meshnode.a2a.inbound` (settings, callers, ownership, the
node view :class:`~meshnode.a2a.inbound.BridgeNode`),
:mod:`meshnode.a2a.intake` (HTTP: cards, body limits, envelope checks, 401s),
:mod:`meshnode.a2a.handler` (the SDK's JSON-RPC methods),
:mod:`meshnode.a2a.execution` (the tasks and their mesh requests); this module
wires them and runs the HTTP server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette

from meshnode.a2a.execution import InboundTasks
from meshnode.a2a.inbound import BridgeNode, BridgeSettings
from meshnode.a2a.intake import HttpIntake
from meshnode.a2a.listen import adopt_listener, bind_listeners
from meshnode.a2a.store import BridgeStore
from meshnode.aio import wait_for

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent

__all__ = ["A2ABridge", "BridgeSettings"]

log = logging.getLogger("meshnode.a2a")


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: the daemon owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class A2ABridge:
    """The inbound A2A server of one node: its tasks (:class:`InboundTasks`),
    its HTTP intake (:class:`HttpIntake`) and the uvicorn server serving it."""

    def __init__(
        self, *, node: BridgeNode, bridge: HostedAgent, settings: BridgeSettings, data_dir: Path
    ) -> None:
        self.bridge = bridge
        self.settings = settings
        self.store = BridgeStore(data_dir / "a2a.sqlite3")
        self.tasks = InboundTasks(node=node, bridge=bridge, settings=settings, store=self.store)
        self.intake = HttpIntake(tasks=self.tasks, bridge=bridge, settings=settings)
        self._server: _Uvicorn | None = None
        self._serve_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Open the store, recover its tasks, listen (raising
        :class:`~meshnode.a2a.listen.ListenError` naming ``[a2a] listen`` when
        it cannot) and serve."""
        # Listen first: a taken port fails the start before anything is recovered.
        settings = self.settings
        if settings.listen_fd is not None:
            sockets = [adopt_listener(settings.listen_fd)]
        else:
            sockets = await asyncio.to_thread(bind_listeners, settings.host, settings.port)
        try:
            await self.store.open()
            await self.tasks.recover()
        except BaseException:
            for sock in sockets:
                sock.close()
            raise
        config = uvicorn.Config(
            self.app(),
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=1,
        )
        server = _Uvicorn(config)
        self._server = server
        self._serve_task = asyncio.get_running_loop().create_task(server.serve(sockets=sockets), name="a2a-server")
        while not server.started:
            if self._serve_task.done():
                exc = self._serve_task.exception()
                raise RuntimeError(f"[a2a] listen {self.settings.host}:{self.settings.port}: {exc or 'server exited'}")
            await asyncio.sleep(0.02)
        # The address really served (``listen = "host:0"`` binds any free port, an
        # inherited socket has its own); nothing has the URL before this, so no
        # card can have been served with the unbound one.
        host, port = sockets[0].getsockname()[:2]
        self._publish(self.settings.bound_to(int(port), str(host)))
        log.info(
            "A2A bridge serving %s at %s (application %r, report key %s)",
            ", ".join(self.settings.expose) or "no agents",
            self.settings.base_url,
            self.settings.application,
            self.bridge.agent_id,
        )

    def _publish(self, settings: BridgeSettings) -> None:
        """Use ``settings`` everywhere the bridge builds what it publishes."""
        self.settings = settings
        self.intake.settings = settings
        self.tasks.settings = settings

    async def stop_intake(self) -> None:
        """Stop the HTTP server (open streams get a short grace), then the live tasks' runners."""
        if self._server is not None and self._serve_task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await wait_for(asyncio.shield(self._serve_task), timeout=1.5)
            if not self._serve_task.done():
                self._server.force_exit = True
                self._serve_task.cancel()
        await self.tasks.stop()

    async def close(self) -> None:
        await self.store.close()

    def status(self) -> dict[str, Any]:
        """For ``meshnode status``: where it serves, as whom, what runs."""
        return {
            "url": self.settings.base_url,
            "expose": list(self.settings.expose),
            "application": self.settings.application,
            "report_key": self.bridge.agent_id,
            "running_tasks": len(self.tasks.live),
        }

    def app(self) -> Starlette:
        return self.intake.app()

