"""The control plane's HTTP listener over the enrolment state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import ssl as _ssl
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from meshnode.aio import wait_for
from meshnode.protocol.ratelimit import SlidingWindowLimiter
from meshnode.transport.errors import EmbeddedMeshError
from meshnode.transport.lifecycle import AsyncService
from meshnode.transport.permissions import Role
from meshnode.transport.serverconf import is_loopback_host

from .enrolment import CredentialIssuer, Enrolment, participant
from .http import _json_body, _linger, _read_request, _Request, _response_bytes
from .wire import (
    DEFAULT_INVITE_TTL_S,
    DEFAULT_INVITE_VALID_S,
    DEFAULT_PORT,
    DEFAULT_SKEW_S,
    MAX_REQUEST_HEAD,
    ControlPlaneStateError,
    CredentialRequestError,
    verify_node_credential_request,
)

log = logging.getLogger("meshnode.transport.control_plane")  # the name operators filter on


class ControlPlaneServer(Enrolment, AsyncService):
    """The control plane of an embedded mesh: :class:`~.enrolment.Enrolment` served
    over HTTP/1.1 (``POST /v1/node-credential``, ``GET /v1/mesh``, and
    ``POST /v1/bootstrap`` for SDK agents' enrolment tokens).

    ``ssl`` serves HTTPS. ``port=0`` picks a free port; :attr:`port` then reads
    the bound one back from the socket.

    Denial of service is bounded three ways, none of which lets one local
    process lock out another on the same host:

    * **Rate.** A request whose node signature verifies for an enrolled,
      unretired node counts against that node key (``node_rate_limit`` per
      ``rate_window_ms``); every other request (junk, unknown keys, ``GET``)
      counts against its peer address (``rate_limit``). A flood from 127.0.0.1
      therefore exhausts only the address budget, and a legitimate node on
      the same host still renews: its signed request never touches it.
    * **Time.** The request head must arrive within ``head_timeout_s`` of the
      connection (TLS handshake included) and the whole request within
      ``request_timeout_s``.
    * **Connections.** At ``max_connections`` a new connection evicts the
      oldest one still waiting for its request (an idle or trickling client)
      instead of being refused, so held-open connections cannot starve a
      client that sends its request at once (a renewal does).
    """

    def __init__(
        self,
        embedded: CredentialIssuer,
        state_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        credential_ttl_s: int = 86400,
        mesh_name: str = "meshnode-local",
        role_of: Callable[[str], Role] = participant,
        invite_ttl_s: int = DEFAULT_INVITE_TTL_S,
        invite_valid_s: int | None = DEFAULT_INVITE_VALID_S,
        nats_urls: Sequence[str] | None = None,
        public_url: str | None = None,
        advertise_host: str | None = None,
        ssl: _ssl.SSLContext | None = None,
        max_skew_s: int = DEFAULT_SKEW_S,
        clock: Callable[[], float] = time.time,
        rate_limit: int = 30,
        rate_window_ms: int = 60_000,
        node_rate_limit: int = 30,
        max_connections: int = 64,
        request_timeout_s: float = 10.0,
        head_timeout_s: float = 5.0,
    ) -> None:
        super().__init__(
            embedded,
            state_dir,
            host=host,
            port=port,
            credential_ttl_s=credential_ttl_s,
            mesh_name=mesh_name,
            role_of=role_of,
            invite_ttl_s=invite_ttl_s,
            invite_valid_s=invite_valid_s,
            nats_urls=nats_urls,
            public_url=public_url,
            advertise_host=advertise_host,
            ssl=ssl,
            max_skew_s=max_skew_s,
            clock=clock,
        )
        if max_connections < 1 or request_timeout_s <= 0 or head_timeout_s <= 0:
            raise ValueError("max_connections and the timeouts must be positive")
        self._limiter = SlidingWindowLimiter(rate_limit, rate_window_ms, max_keys=10_000)
        self._node_limiter = SlidingWindowLimiter(node_rate_limit, rate_window_ms, max_keys=10_000)
        self._last_sweep_ms = 0
        self._max_connections = max_connections
        self._request_timeout_s = request_timeout_s
        self._head_timeout_s = min(head_timeout_s, request_timeout_s)
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        # Connections still waiting for their request, oldest first: the ones
        # a new connection may evict at the limit.
        self._waiting: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
        self._evicted: set[asyncio.Task[Any]] = set()

    # -- lifecycle --

    async def start(self) -> None:
        """Start listening. Raises OSError when the port is taken."""
        if self._server is not None:
            raise RuntimeError("the control plane is already running")
        self._store.load()  # fail at start, not at the first renewal, on a broken state file
        self._server = await asyncio.start_server(
            self._handle, self.host, self._port, limit=MAX_REQUEST_HEAD, ssl=self._ssl,
            ssl_handshake_timeout=self._head_timeout_s if self._ssl is not None else None,
        )
        self._port = self._server.sockets[0].getsockname()[1]
        if self._ssl is None and not is_loopback_host(self.host):
            log.warning(
                "control plane serves plain HTTP on %s: rosters travel in clear text "
                "(credentials still need the node key to be used); prefer TLS", self.host,
            )
        log.info("control plane listening on %s", self.url)

    async def stop(self) -> None:
        """Stop listening and drop connections in progress. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.wait(list(self._handlers))
        await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is None:
            writer.close()
            return
        if len(self._handlers) >= self._max_connections and not self._evict_oldest_waiting():
            # Every slot is serving a request it has fully received: refuse.
            writer.close()
            return
        self._handlers.add(task)
        self._waiting[task] = writer
        try:
            await self._serve_one(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except asyncio.CancelledError:
            if self._server is not None and task not in self._evicted:
                raise
        except Exception:
            log.exception("control plane: unexpected error while serving a request")
        finally:
            self._handlers.discard(task)
            self._waiting.pop(task, None)
            self._evicted.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await wait_for(writer.wait_closed(), 1.0)

    def _evict_oldest_waiting(self) -> bool:
        """Drop the oldest connection that has not sent its request yet; False if none."""
        for task, writer in self._waiting.items():
            del self._waiting[task]
            self._evicted.add(task)
            log.info("control plane: at %d connections; dropping one idle since accept", self._max_connections)
            writer.transport.abort()
            task.cancel()
            self._handlers.discard(task)
            return True
        return False

    def _authenticated_node(self, request: _Request) -> str | None:
        """The enrolled, unretired node whose signature a credential request carries, else None.

        Only this decides which budget a request spends (the node key's, or its
        address's); :meth:`issue_credential` checks everything again, roster
        included.
        """
        if request.method != "POST" or request.path != "/v1/node-credential":
            return None
        try:
            body = _json_body(request)
            claimed = body.get("node_id") if isinstance(body, dict) else None
            node = self._store.current().nodes.get(claimed) if isinstance(claimed, str) else None
            if node is None or node.retired:
                return None  # checked first: junk costs no signature verification
            node_id, _ = verify_node_credential_request(body, int(self._clock()), self.max_skew_s)
        except (CredentialRequestError, ControlPlaneStateError):
            return None
        return node_id

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else "unknown"

        status: int
        payload: Mapping[str, Any]
        extra: dict[str, str] = {}
        request: _Request | None = None
        try:
            async with asyncio.timeout(self._request_timeout_s):
                request = await _read_request(reader, head_timeout_s=self._head_timeout_s)
        except TimeoutError:
            status, payload = 408, {"error": "request not received in time", "code": "timeout"}
        except CredentialRequestError as exc:
            status, payload = exc.status, exc.body()
        task = asyncio.current_task()
        if task is not None:
            self._waiting.pop(task, None)  # received (or given up on): no longer evictable

        now_ms = int(time.monotonic() * 1000)
        if now_ms - self._last_sweep_ms > self._limiter.window_ms:
            self._limiter.sweep(now_ms)
            self._node_limiter.sweep(now_ms)
            self._last_sweep_ms = now_ms
        node_id = self._authenticated_node(request) if request is not None else None
        if node_id is not None:
            decision, scope = self._node_limiter.check(node_id, now_ms), "node key"
        else:
            decision, scope = self._limiter.check(peer, now_ms), "address"
        if not decision.allowed:
            status = 429
            payload = {
                "error": f"too many requests from this {scope}",
                "code": "rate_limited",
                "retry_after_ms": decision.retry_after_ms,
            }
            extra["Retry-After"] = str(math.ceil(decision.retry_after_ms / 1000))
            log.warning("control plane: rate-limited %s %s", scope, node_id or peer)
        elif request is not None:
            status, payload, extra = self._dispatch(request, peer)
        writer.write(_response_bytes(status, payload, extra))
        async with asyncio.timeout(self._request_timeout_s):
            await writer.drain()
        if request is None:
            await _linger(reader, writer)

    def _dispatch(
        self, request: _Request, peer: str
    ) -> tuple[int, Mapping[str, Any], dict[str, str]]:
        routes = {"/v1/node-credential": "POST", "/v1/mesh": "GET", "/v1/bootstrap": "POST"}
        allowed = routes.get(request.path)
        if allowed is None:
            return 404, {"error": f"no such endpoint {request.path}", "code": "not_found"}, {}
        if request.method != allowed:
            return (
                405,
                {"error": f"{request.path} accepts {allowed} only", "code": "method_not_allowed"},
                {"Allow": allowed},
            )
        try:
            if allowed == "GET":
                try:
                    return 200, self.mesh_info(), {}
                except EmbeddedMeshError:
                    raise CredentialRequestError(
                        503, "the mesh has not started yet", "mesh_unavailable"
                    ) from None
            if request.path == "/v1/bootstrap":
                # The AgentMesh SDKs' first credential: an enrolment token
                # exchanged for one agent's sdk-profile credential.
                return 200, self.bootstrap(_json_body(request), peer=peer), {}
            return 200, self.issue_credential(_json_body(request), peer=peer), {}
        except CredentialRequestError as exc:
            extra = {}
            if exc.retry_after_ms is not None:
                extra["Retry-After"] = str(math.ceil(exc.retry_after_ms / 1000))
            return exc.status, exc.body(), extra
        except ControlPlaneStateError as exc:
            log.error("control plane: %s; refusing every credential until it is fixed", exc)
            return 500, {"error": "enrolment state unreadable", "code": "internal_error"}, {}
        except Exception:
            log.exception("control plane: failed to serve %s %s", request.method, request.path)
            return 500, {"error": "internal error", "code": "internal_error"}, {}
