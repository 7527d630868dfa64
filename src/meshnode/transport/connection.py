"""The node's one NATS connection.

Wraps nats-py with what the node needs and nothing else: the credential is
read through a callback at *every* (re)connect, so a renewed JWT is what a
reconnect presents (never the one from the first connect); the node key signs
the server nonce; reconnects are announced to listeners from the client's own
connection events (the inbox drain re-runs on them, §16.4). A planned
reconnect (a new credential to present) is bridged: a second connection holds every live
subscription while the first is away, so it misses nothing (see
:meth:`MeshConnection.reconnect`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

from nats.aio.client import Client

from meshnode.aio import BackgroundTasks, wait_for
from meshnode.protocol.nkeys import KeyPair

from .cluster import cluster_size_of
from .errors import Reconnecting, translated
from .jetstream import JetStream
from .messages import Message, MessageHandler, Subscription, wrap_handler

__all__ = [
    "WEBSOCKET_EXTRA",
    "ConnectionListener",
    "MeshConnection",
    "Message",
    "MessageHandler",
    "Subscription",
    "flush_written",
    "websocket_unsupported",
]

log = logging.getLogger("meshnode.transport")

ConnectionListener = Callable[[], Awaitable[None]]

#: What to install for ``ws://`` / ``wss://`` servers (nats-py's WebSocket transport needs aiohttp).
WEBSOCKET_EXTRA = "pip install 'meshnode[websocket]'"


def websocket_unsupported(urls: Sequence[str]) -> list[str]:
    """The ``ws://`` / ``wss://`` URLs of ``urls`` this process cannot dial.

    nats-py dials them with its WebSocket transport, which needs aiohttp, an
    optional dependency (:data:`WEBSOCKET_EXTRA`). Without it nats-py fails
    every attempt with an ImportError, logged with a traceback each time, and
    the node never connects: so a node is told before it tries.
    """
    websocket = [u for u in urls if u.lower().startswith(("ws://", "wss://"))]
    if not websocket:
        return []
    import nats.aio.transport

    aiohttp: Any = getattr(nats.aio.transport, "aiohttp", None)
    if aiohttp is None:
        return websocket
    try:
        aiohttp.ClientSession  # noqa: B018 - the first use, which imports it (see meshnode.transport)
    except ImportError:  # an aiohttp that cannot import: as nats-py sees a missing one
        setattr(nats.aio.transport, "aiohttp", None)  # noqa: B010 - nats-py's own module global
        return websocket
    return []


def _retrieve(task: asyncio.Task[Any]) -> None:
    # An abandoned request's outcome (a timeout, a closed connection) is nobody's
    # to raise: read it so that asyncio does not log it as never retrieved.
    if not task.cancelled():
        task.exception()


async def flush_written(nc: Client, timeout: float = 5) -> None:
    """Return once the broker has read every command ``nc`` was given so far.

    nats-py's own ``flush`` is not that barrier: it writes its PING straight to
    the socket while earlier SUBs and PUBs may still sit in the client's pending
    buffer, so the PONG can come back before the broker saw them (measured: a
    SUB written after the flush's PING, and a publish from another connection
    then missed it). So the pending buffer is written out first (the client's
    own flush hand-off, waited for), then the PING/PONG round trip proves the
    broker read it. Anything holding a raw nats-py client uses this instead of
    ``Client.flush``.
    """
    write_pending = getattr(nc, "_flush_pending", None)
    if write_pending is not None and nc.is_connected:
        await wait_for(write_pending(force_flush=True), timeout)
    # nats-py types the timeout as int but waits with asyncio.wait_for.
    await nc.flush(timeout=timeout)  # type: ignore[arg-type]


class _Client(Client):
    """nats-py's client, with its protocol parser emptied at every (re)connect.

    nats-py means to reset its parser on a reconnect, but checks for the
    reconnecting state only after ``_process_connect_init`` has set it to
    connecting, so the reset never happens (nats-py 2.16). Its parser is
    emptied only when the reconnect is asked for, and the old connection's
    read loop can still feed it one more chunk before it is cancelled: the
    tail of a message cut at the chunk's end stayed in the buffer, the new
    connection's bytes were appended to it, and the parser never found a
    control line again. Every PONG was lost with the rest: the reconnect's
    flush timed out, every retry too, for good, while the broker showed the
    connection up. Seen with roster changes a few milliseconds apart at 1,000
    agents (issue #21); ``tests/integration/test_planned_reconnect.py``
    plays it.
    """

    #: Set while a bridge stands in for this client (see MeshConnection.reconnect).
    overlap: _OverlapCopies | None = None

    async def _process_connect_init(self) -> None:
        # Every byte parsed from here on comes from the connection being set up.
        self._ps.reset()
        await super()._process_connect_init()

    def look_for_copies(self, sids: Collection[int]) -> None:
        """A bridge is about to hold this client's subscriptions ``sids``: from
        now on drop a second copy of a message on them (:class:`_OverlapCopies`)."""
        if self.overlap is None:
            self.overlap = _OverlapCopies()
            # Every message goes through _process_msg. The filter shadows it on
            # this client alone, and only while a bridge is open: as an override
            # on the class it cost every message 0.3-0.65 µs, bridge or not.
            vars(self)["_process_msg"] = self._process_first_copies
        self.overlap.bridges += 1
        self.overlap.sids.update(sids)

    def stop_looking_for_copies(self) -> int:
        """A bridge is gone; with none left, the filter goes, and this returns
        how many copies it dropped (0 while another bridge is still open)."""
        overlap = self.overlap
        if overlap is None:
            return 0
        overlap.bridges -= 1
        if overlap.bridges > 0:
            return 0
        self.overlap = None
        vars(self).pop("_process_msg", None)
        return overlap.dropped

    async def _process_first_copies(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes
    ) -> None:
        overlap = self.overlap
        if overlap is None or overlap.first_copy(sid, subject, reply, data, headers):
            await super()._process_msg(sid, subject, reply, data, headers)


#: How long a planned reconnect waits for the replies of requests already out (see
#: MeshConnection._replies_in_flight), when no bridge could be opened.
PLANNED_CUT_WAIT_S = 1.0

#: How long a bridge stays open waiting for the connection it stands in for to
#: be back; past it the bridge closes and the reconnect counts as unbridged.
BRIDGE_HOLD_S = 60.0


class MeshConnection:
    """One authenticated connection to the mesh, shared by every hosted agent.

    ``jwt_source`` returns the node's current user JWT; it is consulted on every
    connect and reconnect. ``node_key`` signs the server's nonce. Either may be
    None for an unauthenticated server (tests against a plain nats-server).
    """

    def __init__(
        self,
        servers: Sequence[str],
        *,
        node_key: KeyPair | None,
        jwt_source: Callable[[], str] | None,
        name: str = "meshnode",
        inbox_prefix: str | None = None,
        connect_timeout: float = 5.0,
        reconnect_wait: float = 1.0,
        reconnect_buffer_bytes: int = 8 * 1024 * 1024,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.servers = list(servers)
        # TLS to the broker (``tls://`` URLs, or a server that requires it).
        self._tls = tls
        self._node_key = node_key
        self._jwt_source = jwt_source
        self._name = name
        # Each node reads replies only under its own prefix (the JWT grants no
        # other inbox), so nobody else's replies or drained mail reach it.
        self._inbox_prefix = inbox_prefix
        self._connect_timeout = connect_timeout
        self._reconnect_wait = reconnect_wait
        self._reconnect_buffer_bytes = reconnect_buffer_bytes
        self._nc: Client | None = None
        self._jetstream: JetStream | None = None
        self._reconnect_listeners: list[ConnectionListener] = []
        self._disconnect_listeners: list[ConnectionListener] = []
        self._error_listeners: list[Callable[[str], None]] = []
        self._lost_listeners: list[Callable[[], None]] = []
        self._closing = False
        self._lost_reported = False
        # A reconnect we asked for (a new credential to present): its disconnect
        # is routine, logged at INFO, not a WARNING about a lost mesh.
        self._planned_reconnect = False
        #: Disconnects so far: a request that spans one may have lost its answer.
        self.disconnects = 0
        # While the mesh is unreachable nats-py reports each failed attempt (every
        # reconnect_wait); the first is a WARNING, repeats only at a doubling interval.
        self._error_log = _RepeatLimiter()
        self._tasks = BackgroundTasks()
        self.last_error: str | None = None
        # Set by every (re)connect; ping waits on it while the client is between servers.
        self._back: asyncio.Event | None = None
        # Flushes waiting for their PONG: a disconnect cancels them (see flush).
        self._flushing: set[asyncio.Future[None]] = set()
        # The bridge standing in for the connection during the planned reconnect
        # under way (None: none, or it could not be opened); see reconnect.
        self._bridge: _Bridge | None = None
        #: Planned reconnects that a bridge covered, and those it could not.
        self.bridged_reconnects = 0
        self.unbridged_reconnects = 0
        #: Second copies of a message that came by both the bridge and the
        #: connection, dropped before anything read them (_OverlapCopies).
        self.overlap_copies_dropped = 0

    # -- lifecycle ---------------------------------------------------------

    async def connect(self) -> None:
        # With several servers (a cluster) nats-py fails over across the list and
        # every server the cluster announces, forever, waiting reconnect_wait
        # between rounds; publishes made while it is between servers are held in
        # a bounded buffer and flushed on reconnect (a full buffer raises to the
        # publisher rather than dropping silently).
        options = self._client_options(
            servers=self.servers,
            name=self._name,
            reconnect_time_wait=self._reconnect_wait,
            max_reconnect_attempts=-1,
            allow_reconnect=True,
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
            closed_cb=self._on_closed,
        )
        nc = _Client()
        await nc.connect(**options)
        self._nc = nc
        self._jetstream = JetStream(self._nc.jetstream(), self._nc)

    def _client_options(self, **specific: Any) -> dict[str, Any]:
        """nats-py connect options of this node's connections (its own and a
        bridge): its credential, read at every connect, and the nonce signed
        with its key; its private reply prefix; TLS; ``specific`` beside them."""
        options: dict[str, Any] = {
            "connect_timeout": self._connect_timeout,
            "pending_size": self._reconnect_buffer_bytes,
            **specific,
        }
        if self._inbox_prefix:
            options["inbox_prefix"] = self._inbox_prefix
        if self._tls is not None:
            options["tls"] = self._tls
        if self._jwt_source is not None and self._node_key is not None:
            key = self._node_key
            source = self._jwt_source
            options["user_jwt_cb"] = lambda: source().encode("ascii")
            options["signature_cb"] = lambda nonce: _sign_nonce(key, nonce)
        return options

    async def close(self, drain_timeout: float = 5.0) -> None:
        self._closing = True
        bridge, self._bridge = self._bridge, None
        if bridge is not None and not bridge.is_closed:
            with contextlib.suppress(Exception):
                await bridge.close()
        nc, self._nc = self._nc, None
        if nc is None:
            return
        try:
            if nc.is_connected:
                await wait_for(nc.drain(), timeout=drain_timeout)
        except Exception as exc:  # a failed drain must not block shutdown
            log.warning("drain on close failed: %s", exc)
        if not nc.is_closed:
            try:
                await nc.close()
            except Exception as exc:
                # Stopping while the mesh is unreachable: nats-py flushes its
                # pending buffer into a transport that is already gone. Nothing
                # is left to close, so this is not a failed shutdown stage.
                log.info("closed the mesh connection while it was down (%s: %s)", type(exc).__name__, exc)
        for task in list(self._tasks):
            task.cancel()

    # -- state -------------------------------------------------------------

    @property
    def nc(self) -> Client:
        """nats-py's client, for transport/ and tests; callers above use the methods here."""
        if self._nc is None:
            raise RuntimeError("not connected")
        return self._nc

    @property
    def jetstream(self) -> JetStream:
        """JetStream on this connection, through the transport facade."""
        if self._jetstream is None:
            raise RuntimeError("not connected")
        return self._jetstream

    @property
    def is_connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    @property
    def connected_url(self) -> str | None:
        if self._nc is None or self._nc.connected_url is None:
            return None
        url = self._nc.connected_url
        return f"{url.scheme}://{url.hostname}:{url.port}"

    @property
    def known_servers(self) -> list[str]:
        """Every server this client can fail over to: the configured ones plus
        those the cluster announced (INFO ``connect_urls``), as ``host:port``."""
        if self._nc is None:
            return []
        pool = [f"{u.hostname}:{u.port}" for u in self._nc.servers]
        info = getattr(self._nc, "_server_info", None) or {}
        announced = [str(u) for u in info.get("connect_urls") or []]
        return list(dict.fromkeys([*pool, *announced]))

    def cluster_size(self) -> int:
        """How many servers the mesh has, as far as this client can tell (at least 1).

        A lower bound while a cluster is still forming its routes: the replica
        count derived from it (``min(3, size)``) can be pinned with ``[mesh] replicas``.
        """
        return cluster_size_of(self.servers, self.known_servers)

    @property
    def inbox_prefix(self) -> str | None:
        """The private reply-inbox prefix this connection was given (None: nats-py's ``_INBOX``)."""
        return self._inbox_prefix

    @property
    def max_payload(self) -> int:
        """The server's advertised maximum message size (§18.9)."""
        return int(self.nc.max_payload)

    async def reconnect(self) -> None:
        """Reconnect now, presenting the credential the JWT source returns now
        (used after a re-minted credential, e.g. when an agent is added).

        Bridged: before the cut a second connection (the *bridge*, presenting
        the same new credential) subscribes to every subject the connection
        has a live subscription on, its reply inbox and JetStream push
        consumers included, and hands what it receives to this connection's
        own processing, as if read here (so answers and acks go out here).
        Before the cut this connection leaves those subscriptions to the
        bridge, and pauses its pulled ones (JetStream fetches), reading what
        the broker sent until then (:meth:`_hand_over`). The bridge closes once
        the connection is back with its subscriptions in force.
        A reconnect used to leave a gap of ~70 ms to 1 s at every roster
        change and renewal: live mail sent then found no subscriber, a
        buffered agent got it late from its drain (one JetStream call per
        agent), a sandbox agent (no buffer, §16.4) not at all, a reply due
        then was lost, and a push consumer's delivery came again only after
        its ack wait (30 s). In the overlap a message can reach both
        connections; the client drops the second copy (:class:`_OverlapCopies`). When the
        bridge cannot be opened, the reconnect goes on without it, as before.
        Either way the reconnect listeners run (the drain re-runs on every
        reconnect, §16.4).
        """
        self._planned_reconnect = True
        nc = self.nc
        # nats-py stamps a server at every connect, a successful one too, and waits
        # reconnect_wait before connecting to a server stamped within that time:
        # its back-off for a failing server. A planned reconnect soon after the
        # previous one (an agent added, then removed: two roster changes a moment
        # apart) kept the node off the mesh for the whole wait, and its agents'
        # live mail went to their buffers (the soak counted the timeouts). The
        # server is healthy, so this reconnect skips the back-off; a reconnect
        # after a failure (fail_over, a lost connection) keeps it.
        server = getattr(nc, "_current_server", None)
        if server is not None and hasattr(server, "last_attempt"):
            server.last_attempt = None
        bridge = await self._open_bridge(nc) if nc.is_connected else None
        # From here a subscription made through this connection is held by the
        # bridge too (see subscribe); those made while it opened are caught up
        # by the hand-over.
        self._bridge = bridge
        if bridge is None:
            await self._replies_in_flight(PLANNED_CUT_WAIT_S)
        if nc.is_connected:
            await self._hand_over(nc, bridge)
        # No await from the hand-over's last look at the subscriptions to the
        # cut (force_reconnect marks the client reconnecting before it yields):
        # nothing subscribed in between can be left on the old connection alone.
        # Back to the same server, not a random one of the pool (nats-py shuffles
        # it at every reconnect): on a cluster the bridge (opened on this server)
        # and the reconnected client then meet at one server, which proves the
        # handover; a move left a moment in which the other servers learned the
        # new interest after the bridge's end. One-shot: if this server fails,
        # the next attempt is nats-py's usual choice, with its back-off.
        if server is not None and nc.is_connected and hasattr(nc, "_reconnect_to_server_handler"):
            def home_first(servers: list[Any], info: dict[str, Any]) -> tuple[Any, float]:
                nc._reconnect_to_server_handler = None
                return (server if any(s.uri.netloc == server.uri.netloc for s in servers) else None), 0.0

            nc._reconnect_to_server_handler = home_first
        await nc.force_reconnect()
        if bridge is not None:
            self._tasks.spawn(self._close_bridge_when_back(bridge))

    async def _open_bridge(self, nc: Client) -> _Bridge | None:
        """A connection holding ``nc``'s live subscriptions, proven in force at
        the broker; None when it cannot be had (the reconnect then has a gap).

        Held: every subscription with a callback (the node's core
        subscriptions, nats-py's reply inbox, the drain's fetch inboxes, the
        JetStream push consumers' deliver subjects), not those a duplicate
        would upset (see :func:`_bridgeable`).
        """
        subscriptions = [sub for sub in list(getattr(nc, "_subs", {}).values()) if _bridgeable(sub)]
        url = nc.connected_url
        if url is None:
            return None
        options = self._client_options(
            servers=[url.geturl()],
            name=f"{self._name} (bridge)",
            allow_reconnect=False,
            max_reconnect_attempts=0,
            error_cb=self._on_bridge_error,
        )
        bridge = _Bridge(nc)
        _overlap_begins(nc, [sub._id for sub in subscriptions])
        try:
            await bridge.connect(**options)
            for sub in subscriptions:
                await bridge.hold(sub)
            await flush_written(bridge, self._connect_timeout)
        except Exception as exc:
            log.info("no bridge for the planned reconnect (%s: %s): live mail sent during it goes to the "
                     "agents' buffers", type(exc).__name__, exc)
            with contextlib.suppress(Exception):
                await bridge.close()
            self.overlap_copies_dropped += _overlap_ends(nc)
            return None
        log.debug("bridged the planned reconnect: %d subscription(s)", len(subscriptions))
        return bridge

    async def _hand_over(self, nc: Client, bridge: _Bridge | None) -> None:
        """Before the cut, unsubscribe at the broker what ``bridge`` holds and
        every pulled subscription, then read what the broker sent until then.
        nats-py keeps those subscriptions and subscribes them again on the new
        connection.

        Without it a message the broker gave ``nc`` just before the cut, still
        on its way, was lost with the connection:

        * A plain subscription's copy reached the bridge too, but a queue
          group's member (a platform service) gets each message alone, and the
          bridge had none: measured, a steady publisher lost a few messages in
          one run of four.
        * A pulled subscription (no callback: its messages wait in its queue
          for a JetStream fetch) is not bridged, as a copy would reach the next
          fetch. A delivery to a fetch under way was lost, and the consumer
          gave it again only after its ack wait (30 s): measured, a service's
          one-at-a-time fetch lost one in two runs of three. Once unsubscribed
          the broker sends the fetch nothing more, and what it sent before is
          in the queue when the cut comes; the stream keeps the rest for the
          next fetch.

        A subscription made after the bridge took its list (an agent hosted
        while another roster change reconnects) is caught up here: the bridge
        holds it too before the connection lets it go. Without that it stayed
        on the old connection alone, and its live mail from the cut until the
        connection was back found no subscriber (a sandbox agent's was lost,
        §16.4). The look is repeated until a pass finds nothing new, so the
        subscriptions made during the hand-over's own round trips are caught
        too.

        Best effort: if the read cannot be proven in time, the cut goes on, and
        only what was on its way is exposed, as before.
        """
        handed: set[int] = set()
        try:
            while True:
                subs = list(getattr(nc, "_subs", {}).values())
                held: list[int] = []
                if bridge is not None:
                    late = [sub for sub in subs if _bridgeable(sub) and not bridge.holds(sub._id)]
                    for sub in late:
                        await bridge.hold(sub)
                    if late:
                        # In force at the bridge before the connection lets them go.
                        await flush_written(bridge, self._connect_timeout)
                    held = bridge.held_sids()
                pulled = [sub._id for sub in subs if _pulled(sub)]
                due = [sid for sid in (*held, *pulled) if sid not in handed]
                if not due:
                    return
                for sid in due:
                    await nc._send_unsubscribe(sid)
                handed.update(due)
                await flush_written(nc, self._connect_timeout)
        except Exception as exc:
            log.debug("handing the subscriptions over before the cut: %s: %s", type(exc).__name__, exc)

    async def _close_bridge_when_back(self, bridge: _Bridge) -> None:
        """Drain ``bridge`` once the connection is back (its subscriptions went
        out and were flushed before nats-py calls it reconnected), or after
        :data:`BRIDGE_HOLD_S`. Draining takes in what the broker sent the
        bridge before its unsubscriptions, then closes it."""
        try:
            await self.wait_connected(BRIDGE_HOLD_S)
        finally:
            if self._bridge is bridge:
                self._bridge = None
            try:
                if bridge.is_connected:
                    await bridge.drain()
                elif not bridge.is_closed:
                    await bridge.close()
                # The broker gave the connection its copy of the bridge's last
                # messages no later than the bridge's: once a round trip shows
                # the connection has read that far, no copy is left to come.
                home = bridge.home
                if home.is_connected:
                    await flush_written(home, self._connect_timeout)
            except Exception as exc:  # the bridge's end is nobody's failure
                log.debug("closing the reconnect's bridge: %s: %s", type(exc).__name__, exc)
            finally:
                self.overlap_copies_dropped += _overlap_ends(bridge.home)

    async def _on_bridge_error(self, exc: Exception) -> None:
        # A subscription the new credential no longer grants (an agent just
        # removed) is refused on the bridge too: nothing to report.
        log.debug("reconnect bridge: %s: %s", type(exc).__name__, exc)

    async def _replies_in_flight(self, timeout: float) -> None:
        """Wait (up to ``timeout``) for the replies of the requests already out.

        A reply sent to the connection being cut is lost, and its request waits
        out its whole timeout (5 s for JetStream calls). A drain pass waiting so
        let a busy agent's buffer fill, and the mail of the next roster change
        found it full and was lost. A planned cut can wait a moment for them:
        they take milliseconds. Requests started meanwhile are not waited for.
        """
        nc = self.nc
        waiting = [f for f in getattr(nc, "_resp_map", {}).values() if not f.done()]
        if waiting:
            await asyncio.wait(waiting, timeout=timeout)

    def on_reconnect(self, listener: ConnectionListener) -> None:
        self._reconnect_listeners.append(listener)

    def on_disconnect(self, listener: ConnectionListener) -> None:
        self._disconnect_listeners.append(listener)

    def on_lost(self, listener: Callable[[], None]) -> None:
        """Called when the client gives up for good without being asked to close
        (nats-py closes on an authorization error, e.g. a credential that expired
        while the host slept): the owner must start over with a fresh credential."""
        self._lost_listeners.append(listener)

    def on_error(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(message)`` for every asynchronous error the client reports.

        The broker refuses a publish or subscription outside the credential's
        permissions only this way (``nats: permissions violation for publish
        to "..."``); a listener is how such a refusal is counted rather than lost.
        """
        self._error_listeners.append(listener)

    # -- messaging -----------------------------------------------------------

    async def publish(
        self,
        subject: str,
        payload: bytes,
        *,
        reply: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        with translated():
            await self.nc.publish(subject, payload, reply=reply, headers=headers)

    async def subscribe(
        self, subject: str, handler: MessageHandler, *, queue: str = ""
    ) -> Subscription:
        with translated():
            sub = await self.nc.subscribe(subject, queue=queue, cb=wrap_handler(handler))
        # Made while a planned reconnect's bridge stands in (after the cut the
        # connection is away until it is back): the bridge holds it too, or its
        # live mail until then found no subscriber.
        bridge = self._bridge
        if bridge is not None and bridge.is_connected and _bridgeable(sub):
            try:
                await bridge.hold(sub)
            except Exception as exc:  # the bridge is best effort; the subscription stands
                log.debug("holding a new subscription on the reconnect's bridge: %s: %s", type(exc).__name__, exc)
        return Subscription(sub)

    async def request(
        self, subject: str, payload: bytes, *, timeout: float, headers: dict[str, str] | None = None
    ) -> Message:
        """Publish and wait for one answer. Raises :class:`~.errors.NoResponders`
        when nobody listens, :class:`~.errors.TransportTimeout` when none came."""
        # nats-py waits for the reply with 3.11's asyncio.wait_for, which loses a
        # cancellation that arrives in the same loop iteration as the reply
        # (meshnode.aio.wait_for); a caller cancelled then went on as if not
        # (an A2A stream reader kept reading a finished task's stream). Awaited
        # through a shield as a task of its own, the caller's cancellation
        # always reaches the caller; the orphaned request is cancelled too.
        inner = asyncio.get_running_loop().create_task(
            self.nc.request(subject, payload, timeout=timeout, headers=headers)
        )
        inner.add_done_callback(_retrieve)
        with translated():
            try:
                return Message(await asyncio.shield(inner))
            except asyncio.CancelledError:
                inner.cancel()
                raise

    def new_inbox(self) -> str:
        return str(self.nc.new_inbox())

    async def ping(self, timeout: float) -> None:
        """One PING/PONG round trip with the broker within ``timeout`` seconds.

        Raises :class:`~.errors.TransportTimeout` when no PONG came (a frozen
        broker keeps the TCP connection open, so only this tells), and
        ConnectionError while the client is between servers.
        """
        if self._nc is not None and self._nc.is_closed:
            # nats-py can close without calling closed_cb: see _report_lost.
            self._report_lost()
            raise ConnectionError(f"the connection is closed for good ({self._closed_reason()})")
        started = time.monotonic()
        # Between servers? A planned reconnect (an agent added or removed
        # re-presents the credential) takes milliseconds and says nothing about
        # the broker: the soak's churn had the broker watch log an unresponsive
        # broker and count an episode for one. Wait for the client to be back,
        # within half the deadline; still away is the finding.
        if not await self.wait_connected(timeout / 2):
            raise ConnectionError("not connected (the client is reconnecting)")
        remaining = max(0.001, timeout - (time.monotonic() - started))
        with translated():
            # nats-py types the timeout as int but waits with asyncio.wait_for.
            await self.nc.flush(timeout=remaining)  # type: ignore[arg-type]

    async def wait_connected(self, timeout: float) -> bool:
        """Whether the client is connected, waiting up to ``timeout`` seconds for
        it to be back while it is between servers (woken by the reconnect, not polled)."""
        if not self.is_connected:
            with contextlib.suppress(TimeoutError):
                await wait_for(self._until_connected(), timeout=timeout)
        return self.is_connected

    async def _until_connected(self) -> None:
        if self._back is None:
            self._back = asyncio.Event()
        while not self.is_connected:
            # Cleared only after looking: the reconnected callback sets it later.
            self._back.clear()
            await self._back.wait()

    async def fail_over(self) -> None:
        """Drop a connection whose broker stopped answering: the client reconnects,
        trying the other servers it knows first if it has any. Unlike
        :meth:`reconnect` this is not a planned reconnect (logged as a lost mesh)."""
        if self.is_connected:
            await self.nc.force_reconnect()

    async def flush(self, timeout: float = 5) -> None:
        """Return once everything published or subscribed so far has reached the
        broker, or went with a connection that was cut meanwhile.

        The exactly-once bookkeeping marks an answer delivered on this barrier;
        :func:`flush_written` says why nats-py's own flush is not enough.

        A disconnect while the PING is out ends that attempt at once: nats-py
        forgets the PONGs it waited for when it reconnects, so the flush used to
        wait out its whole timeout. With a roster change every two seconds no
        barrier got through; every live request's buffered copy then counted as
        still running, the drain could purge nothing, and the agent's buffer
        filled up and refused the mail of the next reconnect. The flush is tried
        again on the new connection, within the same timeout (nats-py carries its
        pending buffer over; what was already on the old socket is not proven).
        Raises :class:`Reconnecting` when not connected again within the timeout.
        """
        deadline = time.monotonic() + timeout
        while True:
            if not await self.wait_connected(max(0.0, deadline - time.monotonic())):
                raise Reconnecting("not connected within the flush's timeout (the client is reconnecting)")
            attempt = asyncio.ensure_future(flush_written(self.nc, max(0.001, deadline - time.monotonic())))
            self._flushing.add(attempt)
            try:
                with translated():
                    await attempt
                return
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not attempt.cancelled() or current is None or current.cancelling():
                    raise  # this flush itself was cancelled
                # Cut by a disconnect (_on_disconnected): its PONG will never come.
            finally:
                self._flushing.discard(attempt)

    # -- connection events -------------------------------------------------

    def _spawn(self, coro: Awaitable[None]) -> None:
        async def run() -> None:
            await coro

        self._tasks.spawn(run())

    async def _on_error(self, exc: Exception) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self._closing or self._planned_reconnect:
            log.info("mesh connection: %s (while %s)", self.last_error,
                     "closing" if self._closing else "reconnecting on purpose")
        else:
            repeats = self._error_log.due()
            if repeats is None:
                log.debug("mesh connection error (again): %s", self.last_error)
            elif repeats == 0:
                log.warning("mesh connection error: %s", self.last_error)
            else:
                log.warning("mesh connection error: %s (%d more since the last report; still retrying)",
                            self.last_error, repeats)
        for listener in self._error_listeners:
            try:
                listener(str(exc))
            except Exception:  # a listener must never break the client's error path
                log.exception("connection error listener failed")

    async def _on_disconnected(self) -> None:
        self.disconnects += 1
        for attempt in list(self._flushing):
            attempt.cancel()  # the connection its PING went out on is gone (see flush)
        if self._closing:
            log.info("disconnected from the mesh (closing)")
        elif self._planned_reconnect:
            log.info("disconnected from the mesh to present a new credential; reconnecting")
        else:
            log.warning("disconnected from the mesh")
        for listener in self._disconnect_listeners:
            self._spawn(listener())

    async def _on_reconnected(self) -> None:
        planned, self._planned_reconnect = self._planned_reconnect, False
        if planned:
            # Covered: a bridge subscribed before the cut and still up now (it
            # never reconnects, so up now means up throughout).
            bridge = self._bridge
            if bridge is not None and bridge.is_connected:
                self.bridged_reconnects += 1
            else:
                self.unbridged_reconnects += 1
        if self._back is not None:
            self._back.set()
        repeats = self._error_log.reset()
        if repeats:
            log.info("reconnected to the mesh at %s (after %d failed attempt(s))", self.connected_url, repeats)
        else:
            log.info("reconnected to the mesh at %s", self.connected_url)
        for listener in self._reconnect_listeners:
            self._spawn(listener())

    async def _on_closed(self) -> None:
        log.info("mesh connection closed")
        self._report_lost()

    def _closed_reason(self) -> str:
        server_error = self._nc.last_error if self._nc is not None else None
        return str(self.last_error or server_error or "no reason given")

    def _report_lost(self) -> None:
        """Tell the lost listeners, once, that the client closed without being asked to.

        Two paths lead here: nats-py's closed_cb, and :meth:`ping` finding the
        client closed. The second is needed because nats-py's close can fail
        half-way and skip its callbacks: on a server error (an expired
        credential) it writes its pending buffer into the transport the server
        already closed, which uvloop refuses with RuntimeError, and the close
        task dies unobserved. Seen after a host slept past its credential: jobs
        woke and published before the error was read, and the daemon waited on a
        dead client forever. The broker watch pings every few seconds, so that
        case is noticed within one interval.
        """
        if self._closing or self._lost_reported:
            return
        self._lost_reported = True
        log.error("the mesh connection was closed for good (%s)", self._closed_reason())
        for listener in self._lost_listeners:
            listener()


class _RepeatLimiter:
    """Rate-limits a repeating report: the first at once, then after 10 s, 20 s,
    40 s, ... (capped at 10 min) while it keeps repeating; :meth:`reset` when it
    stops. ``due()`` says whether to report now and how many were skipped."""

    FIRST_S = 10.0
    CAP_S = 600.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._next: float | None = None
        self._interval = self.FIRST_S
        self._skipped = 0
        self._total = 0

    def due(self) -> int | None:
        now = self._clock()
        self._total += 1
        if self._next is None:
            self._next, self._interval, self._skipped = now + self.FIRST_S, self.FIRST_S, 0
            return 0
        if now < self._next:
            self._skipped += 1
            return None
        skipped, self._skipped = self._skipped, 0
        self._interval = min(self._interval * 2, self.CAP_S)
        self._next = now + self._interval
        return skipped

    def reset(self) -> int:
        """Forget the episode; returns how many times it was reported to :meth:`due`."""
        total = self._total
        self._next, self._interval, self._skipped, self._total = None, self.FIRST_S, 0, 0
        return total


class _OverlapCopies:
    """The messages a client processed while a bridge stood in for it, so that
    the second copy of one is dropped before anything reads it.

    While a bridge is open both it and the client (before the cut, and again
    once back) listen on the same subjects, so a message published then can
    arrive by both. Every envelope intake drops the second copy (§22.2), but
    as a refused duplicate, logged as a WARNING: the soak's joined node logged
    ~3 a minute, one after each roster change, as if a peer replayed mail.
    Both copies are the same bytes from the same broker, so a copy is known
    by its subscription, subject, reply, headers and body. Only the
    subscriptions a bridge holds are looked at: on those every message is
    unique in those parts (an envelope has its own id, a JetStream delivery's
    ack subject its delivery count, a reply or a mailbox fetch's status its
    own inbox subject), whereas a pulled subscription's fetches get the same
    status bytes again and again. A copy comes within moments of the first;
    what was seen is kept for :data:`HORIZON_S`.
    """

    #: Far longer than the two copies' arrivals apart (the same broker sends
    #: both at once), and it bounds the memory to the traffic of those seconds.
    HORIZON_S = 10.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # Membership in a set, age order in a deque: a dict used as a FIFO
        # costs O(evicted) per eviction (next(iter(d)) walks the holes that
        # front deletions leave; see DedupMemory).
        self._seen: set[bytes] = set()
        self._order: deque[tuple[float, bytes]] = deque()
        #: The subscriptions the open bridges hold (the client's ids).
        self.sids: set[int] = set()
        self.bridges = 0
        self.dropped = 0

    def first_copy(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> bool:
        """False for a second copy of a message on a held subscription (the caller drops it)."""
        if sid not in self.sids:
            return True
        now = self._clock()
        seen, order = self._seen, self._order
        while order and now - order[0][0] >= self.HORIZON_S:
            seen.discard(order.popleft()[1])
        digest = hashlib.blake2b(digest_size=16)
        for part in (subject, reply or b"", headers or b""):
            digest.update(len(part).to_bytes(4, "big"))
            digest.update(part)
        digest.update(sid.to_bytes(8, "big"))
        digest.update(data)
        key = digest.digest()
        if key in seen:
            self.dropped += 1
            return False
        seen.add(key)
        order.append((now, key))
        return True


def _overlap_begins(nc: Client, sids: Collection[int]) -> None:
    if isinstance(nc, _Client):
        nc.look_for_copies(sids)


def _overlap_ends(nc: Client) -> int:
    return nc.stop_looking_for_copies() if isinstance(nc, _Client) else 0


def _pulled(sub: Any) -> bool:
    """Whether ``sub``'s messages wait in its queue for a reader (a JetStream
    fetch, ``next_msg``) rather than going to a callback."""
    return getattr(sub, "_cb", None) is None


def _bridgeable(sub: Any) -> bool:
    """Whether a bridge may hold ``sub``: one with a callback, whose handling a
    second copy of a message cannot upset.

    In the moment both connections listen, a message can arrive on both.
    Left out: a subscription that ends itself after a count (a copy would
    count), and an ordered JetStream consumer (a copy is a sequence gap to it,
    which it answers by recreating its consumer). A JetStream push consumer
    otherwise is held: a copy is one delivery seen twice, which the client
    drops (:class:`_OverlapCopies`).
    """
    if _pulled(sub) or getattr(sub, "_max_msgs", 0) > 0:
        return False
    jsi = getattr(sub, "_jsi", None)
    return jsi is None or not getattr(jsi, "_ordered", False)


class _Bridge(_Client):
    """A connection standing in for ``home`` while it reconnects: every message
    it receives on a held subscription is handed to ``home`` as if ``home`` had
    read it from its own socket, under that subscription's id.

    So the message goes through ``home``'s own processing: the subscription's
    queue and task (its messages stay in order, one at a time), its pending
    limits, JetStream's control messages and flow control, and a
    subscription dropped meanwhile (an agent removed) gets nothing. The message
    is bound to ``home``: answers and acks go out there, and nats-py holds them
    while ``home`` is away.
    """

    def __init__(self, home: Client) -> None:
        super().__init__()
        self._home = home
        self._home_sids: dict[int, int] = {}  # the bridge's sid -> the held subscription's sid
        self._held: set[int] = set()  # the held subscriptions' sids at home, holding begun

    async def hold(self, sub: Any) -> None:
        """Subscribe to what ``sub`` (one of ``home``'s) listens on; no callback
        of its own, as its messages go to ``home``. Holding a subscription held
        already does nothing."""
        if sub._id in self._held:
            return
        self._held.add(sub._id)
        overlap = getattr(self._home, "overlap", None)
        if isinstance(overlap, _OverlapCopies):
            overlap.sids.add(sub._id)  # both connections may get its mail now
        own = await self.subscribe(sub._subject, queue=sub._queue or "")
        self._home_sids[own._id] = sub._id

    def holds(self, home_sid: int) -> bool:
        """Whether this bridge holds (or is taking up) ``home``'s subscription ``home_sid``."""
        return home_sid in self._held

    @property
    def home(self) -> Client:
        """The client this bridge stands in for."""
        return self._home

    def held_sids(self) -> list[int]:
        """The ids, at ``home``, of the subscriptions this bridge holds."""
        return list(self._home_sids.values())

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        home_sid = self._home_sids.get(sid)
        if home_sid is not None:
            await self._home._process_msg(home_sid, subject, reply, data, headers)


def _sign_nonce(key: KeyPair, nonce: str | bytes) -> bytes:
    raw = nonce.encode() if isinstance(nonce, str) else nonce
    return base64.b64encode(key.sign(raw))
