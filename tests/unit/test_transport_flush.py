"""MeshConnection against the wire: the delivery barrier writes earlier publishes before its PING (issue #23, exactly-once), a cancelled request is cancelled, and a client that closes on a server error is reported lost.

The node marks an answer delivered once ``MeshConnection.flush`` returns, so
the broker must have read the answer's bytes by then. nats-py's own flush
writes the PING straight to the socket while publishes can still sit in its
pending buffer: the broker would answer PONG before reading them. This test
puts a minimal NATS-protocol peer on a loopback socket (port 0) and records
the order in which the commands arrive: every PUB sent before the barrier
must come before the barrier's PING, however the client's tasks are scheduled.
"""

from __future__ import annotations

import asyncio
import json

import nats

from meshnode.testing import eventually_async
from meshnode.transport.connection import MeshConnection, flush_written


class _ProtocolPeer:
    """Speaks just enough NATS to accept one client and answer its PINGs."""

    def __init__(self) -> None:
        self.commands: list[str] = []
        self.server: asyncio.Server | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = {"server_id": "peer", "version": "2.10.0", "proto": 1, "max_payload": 1 << 20, "headers": True}
        writer.write(f"INFO {json.dumps(info)}\r\n".encode())
        await writer.drain()
        self.writer = writer
        try:
            while line := await reader.readline():
                verb, _, rest = line.decode().rstrip("\r\n").partition(" ")
                if verb in ("PUB", "HPUB"):
                    size = int(rest.split()[-1])
                    await reader.readexactly(size + 2)
                self.commands.append(verb)
                if verb == "PING":
                    writer.write(b"PONG\r\n")
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def commands_before_ping(self, since: int) -> list[str]:
        """The commands read from index ``since`` up to the first PING after it, which must have come."""
        arrived = self.commands[since:]
        assert "PING" in arrived, arrived
        return arrived[: arrived.index("PING")]

    async def expire(self) -> None:
        """What nats-server does when the client's credential expires: -ERR, then close."""
        assert self.writer is not None
        self.writer.write(b"-ERR 'User Authentication Expired'\r\n")
        self.writer.close()
        await self.writer.wait_closed()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def test_flush_writes_pending_publishes_before_its_ping() -> None:
    peer = _ProtocolPeer()
    port = await peer.start()
    conn = MeshConnection([f"nats://127.0.0.1:{port}"], node_key=None, jwt_source=None)
    await conn.connect()
    try:
        for round_no in range(20):
            before = len(peer.commands)
            await conn.publish(f"answers.{round_no}", b"x" * 64)
            await conn.flush(timeout=5)
            # The PONG came back, so the peer has read everything up to the PING.
            assert "PUB" in peer.commands_before_ping(before), (
                f"round {round_no}: the barrier's PING reached the broker before the publish: {peer.commands[before:]}"
            )
    finally:
        await conn.close()
        await peer.stop()


async def test_flush_written_sends_a_raw_clients_subscriptions_before_its_ping() -> None:
    # nats-py's own flush wrote its PING ahead of a buffered SUB (seen in a real
    # nats-server trace), so another connection's publish missed the subscriber.
    peer = _ProtocolPeer()
    port = await peer.start()
    client = await nats.connect(f"nats://127.0.0.1:{port}", allow_reconnect=False, connect_timeout=2)
    try:
        for round_no in range(20):
            before = len(peer.commands)
            await client.subscribe(f"interest.{round_no}")
            await flush_written(client, timeout=5)
            assert "SUB" in peer.commands_before_ping(before), (
                f"round {round_no}: the barrier's PING reached the broker before the SUB: {peer.commands[before:]}"
            )
    finally:
        await client.close()
        await peer.stop()


class _SwallowingClient:
    """A stand-in for nats-py's client whose request() behaves as 3.11's
    asyncio.wait_for does when the reply lands with the cancellation: the
    cancellation is swallowed and the reply returned."""

    def __init__(self) -> None:
        self.waiting = asyncio.Event()
        self.swallowed = False

    async def request(self, subject: str, payload: bytes, *, timeout: float, headers: object = None) -> object:
        self.waiting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.swallowed = True
        return object()


async def test_a_cancelled_request_raises_even_where_the_client_swallows_it() -> None:
    conn = MeshConnection(["nats://127.0.0.1:1"], node_key=None, jwt_source=None)
    client = _SwallowingClient()
    conn._nc = client  # type: ignore[assignment]
    caller = asyncio.get_running_loop().create_task(conn.request("x", b"", timeout=30.0))
    await client.waiting.wait()
    caller.cancel()
    try:
        await caller
    except asyncio.CancelledError:
        pass
    assert caller.cancelled()
    await eventually_async(lambda: client.swallowed, what="the orphaned request cancelled too")


async def test_a_client_closed_without_its_callback_is_reported_lost_by_the_next_ping() -> None:
    # A host that slept past its credential: on waking, work published before the
    # client read the server's -ERR, so nats-py's close wrote its pending buffer
    # into the socket the server had closed; uvloop (the daemon's loop) refuses
    # that write, the close task died half-way, and closed_cb never came. The
    # daemon then waited on a dead client (the integration test
    # test_a_node_that_slept_past_its_credential_heals_itself, in CI). That race
    # needs two processes and a sleeping host; here the client closes for the
    # same server error with its callback taken away, which is the state it left.
    peer = _ProtocolPeer()
    port = await peer.start()
    conn = MeshConnection([f"nats://127.0.0.1:{port}"], node_key=None, jwt_source=None)
    lost: list[str] = []
    await conn.connect()
    conn.on_lost(lambda: lost.append("lost"))
    try:
        await conn.flush(timeout=5)
        conn.nc._closed_cb = None  # what a close that died before its callbacks leaves
        await peer.expire()
        await eventually_async(lambda: conn.nc.is_closed, what="nats-py closing on the server's -ERR")
        assert not lost
        for _ in range(2):
            try:
                await conn.ping(1.0)
            except ConnectionError as exc:
                assert "closed for good" in str(exc) and "authentication expired" in str(exc).lower(), exc
            else:
                raise AssertionError("a closed client answered a ping")
        assert lost == ["lost"], "reported once, at the first ping that found the client closed"
    finally:
        await conn.close()
        await peer.stop()
