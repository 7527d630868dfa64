"""The admin API over real Unix sockets: wire protocol, binding, authorisation, client."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import socket
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

import meshnode
from meshnode.admin.client import (
    AdminClient,
    AdminConnectionError,
    AdminTimeout,
    ApiMismatch,
    DaemonNotRunning,
    ProtocolViolation,
    call_sync,
    exit_code_for,
)
from meshnode.admin.protocol import (
    API_VERSION,
    ERROR_NAMES,
    MAX_LINE_BYTES,
    AdminError,
    InternalError,
    InvalidParameter,
    InvalidRequest,
    Level,
    MethodNotFound,
    NotFound,
    NotReady,
    PermissionDenied,
    Refused,
    decode,
    encode,
    parse_reply,
    parse_request,
)
from meshnode.admin.server import (
    AdminServer,
    AdminSocketError,
    CallContext,
    MethodRegistry,
    PeerCredentials,
    PeerCredentialsFn,
    SocketInUse,
    param,
    peer_in_group,
    so_peercred,
)
from meshnode.cli import exitcodes
from meshnode.protocol.errors import ProtocolError
from meshnode.testing import eventually_async

# ------------------------------------------------------------------ fixtures & helpers


@pytest.fixture
def sock_dir(short_tmp_path: Path) -> Path:
    # Short paths: AF_UNIX caps sun_path at 108 bytes, pytest's tmp_path is long.
    return short_tmp_path


@pytest.fixture
def sock_path(sock_dir: Path) -> Path:
    return sock_dir / "a.sock"


async def echo(params: dict[str, Any], call: CallContext) -> Any:
    return params


async def whoami(params: dict[str, Any], call: CallContext) -> dict[str, Any]:
    return {"uid": call.uid, "gid": call.gid, "pid": call.pid, "level": call.level.label}


async def count(params: dict[str, Any], call: CallContext) -> AsyncIterator[int]:
    for i in range(param(params, "n", int)):
        yield i


def registry_with_basics() -> MethodRegistry:
    registry = MethodRegistry()
    registry.add("Echo", echo, doc="params: any; result: the params")
    registry.add("Whoami", whoami)
    registry.add("Count", count, streaming=True)
    return registry


class Raw:
    """A bare protocol client: write lines, read decoded lines."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, path: Path) -> Raw:
        reader, writer = await asyncio.open_unix_connection(
            os.fspath(path), limit=4 * MAX_LINE_BYTES
        )
        return cls(reader, writer)

    async def send(self, message: Any) -> None:
        self.writer.write(message if isinstance(message, bytes) else encode(message))
        await self.writer.drain()

    async def recv(self) -> Any:
        line = await asyncio.wait_for(self.reader.readline(), 5)
        assert line.endswith(b"\n"), f"connection closed (got {line!r})"
        return orjson.loads(line)

    async def at_eof(self) -> bool:
        return await asyncio.wait_for(self.reader.read(), 5) == b""

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


def fixed_peer(uid: int, gid: int, pid: int = 4242) -> PeerCredentialsFn:
    def lookup(sock: socket.socket) -> PeerCredentials:
        return PeerCredentials(pid=pid, uid=uid, gid=gid)

    return lookup


def own_group() -> str:
    return grp.getgrgid(os.getgid()).gr_name


def unused_id(taken: set[int]) -> int:
    candidate = 54321
    while candidate in taken:
        candidate += 1
    return candidate


# ------------------------------------------------------------------ protocol (pure)


def test_level_order_and_parse() -> None:
    assert Level.READ < Level.OPERATOR < Level.ADMIN
    assert Level.parse("operator") is Level.OPERATOR
    assert Level.parse(Level.ADMIN) is Level.ADMIN
    assert Level.ADMIN.label == "admin"
    with pytest.raises(ValueError):
        Level.parse("root")


def test_error_names_are_stable() -> None:
    assert set(ERROR_NAMES) == {
        "MethodNotFound",
        "InvalidParameter",
        "PermissionDenied",
        "InvalidRequest",
        "NotReady",
        "Internal",
        "NotFound",
        "Conflict",
        "Refused",
    }
    for name in ERROR_NAMES:
        rebuilt = AdminError.from_wire({"name": name, "message": "m", "params": {"k": 1}})
        assert rebuilt.name == name
        assert rebuilt.params == {"k": 1}
    assert type(AdminError.from_wire({"name": "NotFound"})) is NotFound
    other = AdminError.from_wire({"name": "Chat.RoomFull", "message": "full"})
    assert type(other) is AdminError and other.name == "Chat.RoomFull"


def test_retryable_hints() -> None:
    assert NotReady("starting").retryable
    assert not NotFound("x").retryable
    refused = Refused.from_protocol_error(ProtocolError("AGENT_OVERLOADED", "busy"))
    assert refused.code == "AGENT_OVERLOADED" and refused.retryable
    assert not Refused.from_protocol_error(ProtocolError("UNAUTHORIZED")).retryable


def test_encode_is_one_line() -> None:
    line = encode({"id": 1, "result": "a\nb"})
    assert line.endswith(b"\n") and line.count(b"\n") == 1


@pytest.mark.parametrize(
    "message",
    [
        [],
        {"method": "GetInfo"},
        {"id": True, "method": "GetInfo"},
        {"id": 1.5, "method": "GetInfo"},
        {"id": 1},
        {"id": 1, "method": "GetInfo", "params": []},
        {"id": 1, "method": "GetInfo", "more": "yes"},
    ],
)
def test_parse_request_rejects(message: Any) -> None:
    with pytest.raises(InvalidRequest):
        parse_request(message)


def test_parse_request_defaults() -> None:
    request = parse_request(decode(b'{"id":"a","method":"GetInfo"}\n'))
    assert (request.id, request.method, request.params, request.more) == ("a", "GetInfo", {}, False)
    with pytest.raises(InvalidRequest) as info:
        parse_request({"id": 7, "method": 3})
    assert info.value.request_id == 7


def test_parse_reply() -> None:
    assert parse_reply({"id": 1, "result": None}).result is None
    assert parse_reply({"id": 1, "result": 2, "continues": True}).continues
    error = parse_reply({"id": None, "error": {"name": "PermissionDenied", "message": "no"}}).error
    assert isinstance(error, PermissionDenied)
    for bad in ({"id": 1}, {"id": [], "result": 1}, {"id": 1, "error": "x"}, "x"):
        with pytest.raises(ValueError):
            parse_reply(bad)


def test_registry_validation() -> None:
    registry = MethodRegistry()
    registry.add("Echo", echo)
    with pytest.raises(ValueError):
        registry.add("Echo", echo)
    with pytest.raises(ValueError):
        registry.add("echo_lower", echo)
    with pytest.raises(TypeError):
        registry.add("Sync", lambda params, call: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError):
        registry.add("Gen", count)  # an async generator must be declared streaming
    with pytest.raises(ValueError):
        registry.add("Bad", echo, level="superuser")
    registry.add("Chat.Send", echo, level="operator")
    assert registry.names() == ["Chat.Send", "Echo"]
    assert registry.get("Chat.Send") is not None
    assert registry.get("Chat.Send").level is Level.OPERATOR  # type: ignore[union-attr]
    registry.remove("Chat.Send")
    assert "Chat.Send" not in registry and len(registry) == 1


def test_param_helper() -> None:
    assert param({"n": 3}, "n", int) == 3
    assert param({}, "n", int, 5) == 5
    with pytest.raises(InvalidParameter) as info:
        param({}, "n", int)
    assert info.value.params == {"parameter": "n"}
    with pytest.raises(InvalidParameter):
        param({"n": True}, "n", int)
    with pytest.raises(InvalidParameter):
        param({"n": "3"}, "n", int)


def test_server_rejects_unsafe_modes(sock_path: Path) -> None:
    for mode in (0o666, 0o602, 0o4600, 0o400):
        with pytest.raises(ValueError):
            AdminServer(sock_path, mode=mode)
    with pytest.raises(ValueError):
        AdminServer(sock_path, mode=0o660)  # group bits but no group


def test_getinfo_is_reserved(sock_path: Path) -> None:
    registry = MethodRegistry()
    AdminServer(sock_path, methods=registry)
    assert "GetInfo" in registry
    with pytest.raises(ValueError):
        AdminServer(sock_path, methods=registry)


# ------------------------------------------------------------------ request / reply


async def test_request_reply_and_getinfo(sock_path: Path) -> None:
    server = AdminServer(
        sock_path, methods=registry_with_basics(), info=lambda: {"node": "N1", "product": "x"}
    )
    async with server, AdminClient(sock_path) as client:
        assert await client.call("Echo", {"a": [1, 2]}) == {"a": [1, 2]}
        info = await client.call("GetInfo")
        assert info == {
            "node": "N1",
            "product": "meshnode",  # daemon extras never override the standard members
            "version": meshnode.__version__,
            "api_version": API_VERSION,
            "features": ["Count", "Echo", "GetInfo", "Whoami"],
            "level": "admin",
        }
        assert client.info == info


async def test_pipelined_requests_answer_in_order(sock_path: Path) -> None:
    async def slow(params: dict[str, Any], call: CallContext) -> str:
        await asyncio.sleep(0.05)
        return "slow"

    registry = registry_with_basics()
    registry.add("Slow", slow)
    async with AdminServer(sock_path, methods=registry):
        raw = await Raw.connect(sock_path)
        await raw.send(
            encode({"id": 1, "method": "Slow"})
            + encode({"id": "two", "method": "Echo", "params": {"x": 1}})
            + b"\n"  # blank lines are ignored
            + encode({"id": 3, "method": "Echo"})
        )
        assert await raw.recv() == {"id": 1, "result": "slow"}
        assert await raw.recv() == {"id": "two", "result": {"x": 1}}
        assert await raw.recv() == {"id": 3, "result": {}}
        await raw.close()


async def test_invalid_lines_get_invalid_request_and_connection_survives(sock_path: Path) -> None:
    async with AdminServer(sock_path, methods=registry_with_basics()):
        raw = await Raw.connect(sock_path)
        await raw.send(b"this is not json\n")
        reply = await raw.recv()
        assert reply["id"] is None and reply["error"]["name"] == "InvalidRequest"
        await raw.send({"id": 5, "params": {}})
        reply = await raw.recv()
        assert reply["id"] == 5 and reply["error"]["name"] == "InvalidRequest"
        await raw.send({"id": 6, "method": "Echo", "params": "nope"})
        assert (await raw.recv())["error"]["name"] == "InvalidRequest"
        await raw.send({"id": 7, "method": "Echo", "params": {"ok": True}})
        assert await raw.recv() == {"id": 7, "result": {"ok": True}}
        await raw.close()


async def test_error_names_on_the_wire(sock_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def missing(params: dict[str, Any], call: CallContext) -> None:
        raise NotFound("no agent 'zed'", {"agent": "zed"})

    async def refused(params: dict[str, Any], call: CallContext) -> None:
        raise ProtocolError("AGENT_UNAVAILABLE", "agent is stopping", retry_after_ms=500)

    async def broken(params: dict[str, Any], call: CallContext) -> None:
        raise RuntimeError("secret internals at /etc/meshnode/key")

    async def unserialisable(params: dict[str, Any], call: CallContext) -> object:
        return object()

    async def square(params: dict[str, Any], call: CallContext) -> int:
        n: int = param(params, "n", int)
        return n * n

    registry = registry_with_basics()
    registry.add("Missing", missing)
    registry.add("Refuse", refused)
    registry.add("Broken", broken)
    registry.add("Odd", unserialisable)
    registry.add("Square", square)
    async with AdminServer(sock_path, methods=registry), AdminClient(sock_path) as client:
        with pytest.raises(MethodNotFound) as e1:
            await client.call("Nope")
        assert e1.value.params == {"method": "Nope"}

        with pytest.raises(InvalidParameter) as e2:
            await client.call("Square", {"n": "three"})
        assert e2.value.params["parameter"] == "n"

        with pytest.raises(NotFound) as e3:
            await client.call("Missing")
        assert e3.value.params == {"agent": "zed"}

        with pytest.raises(Refused) as e4:
            await client.call("Refuse")
        assert e4.value.code == "AGENT_UNAVAILABLE"
        assert e4.value.params["retry_after_ms"] == 500 and e4.value.retryable

        with pytest.raises(InternalError) as e5:
            await client.call("Broken")
        assert "secret" not in str(e5.value) and "Traceback" not in str(e5.value)
        incident = e5.value.params["incident"]
        assert any(incident in r.getMessage() and r.exc_info is not None for r in caplog.records), (
            "the traceback is logged locally with the incident id"
        )

        with pytest.raises(InternalError):
            await client.call("Odd")

        # Error replies leave the connection usable.
        assert await client.call("Square", {"n": 4}) == 16


async def test_oversized_reply_becomes_internal(sock_path: Path) -> None:
    async def big(params: dict[str, Any], call: CallContext) -> str:
        return "x" * MAX_LINE_BYTES

    registry = MethodRegistry()
    registry.add("Big", big)
    async with AdminServer(sock_path, methods=registry), AdminClient(sock_path) as client:
        with pytest.raises(InternalError) as info:
            await client.call("Big")
        assert info.value.params == {"max_line_bytes": MAX_LINE_BYTES}


async def test_line_limit(sock_path: Path) -> None:
    async def size(params: dict[str, Any], call: CallContext) -> int:
        return len(params["pad"])

    registry = MethodRegistry()
    registry.add("Size", size)
    async with AdminServer(sock_path, methods=registry):
        raw = await Raw.connect(sock_path)
        # Exactly MAX_LINE_BYTES before the newline is still accepted.
        head = b'{"id":1,"method":"Size","params":{"pad":"'
        tail = b'"}}'
        pad = MAX_LINE_BYTES - len(head) - len(tail)
        await raw.send(head + b"p" * pad + tail + b"\n")
        assert await raw.recv() == {"id": 1, "result": pad}

        # One byte more: an error with id null, then the server hangs up.
        await raw.send(head + b"p" * (pad + 1) + tail + b"\n")
        reply = await raw.recv()
        assert reply["id"] is None
        assert reply["error"]["name"] == "InvalidRequest"
        assert reply["error"]["params"] == {"max_line_bytes": MAX_LINE_BYTES}
        assert await raw.at_eof()
        await raw.close()


# ------------------------------------------------------------------ streaming


async def test_streaming_marks_continues(sock_path: Path) -> None:
    async with AdminServer(sock_path, methods=registry_with_basics()):
        raw = await Raw.connect(sock_path)
        await raw.send({"id": 9, "method": "Count", "params": {"n": 3}, "more": True})
        replies = [await raw.recv() for _ in range(4)]
        assert replies == [
            {"id": 9, "result": 0, "continues": True},
            {"id": 9, "result": 1, "continues": True},
            {"id": 9, "result": 2, "continues": True},
            {"id": 9, "result": None},
        ]
        # A streaming method called without "more" is refused, not half-served.
        await raw.send({"id": 10, "method": "Count", "params": {"n": 3}})
        reply = await raw.recv()
        assert reply["id"] == 10 and reply["error"]["name"] == "InvalidRequest"
        await raw.close()


async def test_stream_with_send_and_final_result(sock_path: Path) -> None:
    async def progress(params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        assert call.streaming
        for pct in (25, 50, 75):
            await call.send({"progress": pct})
        return {"done": True}

    async def error_midway(params: dict[str, Any], call: CallContext) -> AsyncIterator[int]:
        yield 1
        raise NotFound("gone")

    registry = registry_with_basics()
    registry.add("Progress", progress, streaming=True)
    registry.add("Midway", error_midway, streaming=True)
    async with AdminServer(sock_path, methods=registry), AdminClient(sock_path) as client:
        assert [x async for x in client.stream("Count", {"n": 4})] == [0, 1, 2, 3]
        assert [x async for x in client.stream("Progress")] == [
            {"progress": 25},
            {"progress": 50},
            {"progress": 75},
            {"done": True},
        ]
        got: list[int] = []
        with pytest.raises(NotFound):
            async for item in client.stream("Midway"):
                got.append(item)
        assert got == [1]
        # Calling a streaming method with call() is a clear error.
        with pytest.raises(InvalidRequest):
            await client.call("Count", {"n": 1})
        assert await client.call("Echo", {"k": 1}) == {"k": 1}


async def test_send_outside_streaming_call_is_an_error(sock_path: Path) -> None:
    async def misuse(params: dict[str, Any], call: CallContext) -> None:
        await call.send("nope")

    registry = MethodRegistry()
    registry.add("Misuse", misuse)
    async with AdminServer(sock_path, methods=registry), AdminClient(sock_path) as client:
        with pytest.raises(InternalError):
            await client.call("Misuse")


async def test_slow_stream_does_not_block_other_connections(sock_path: Path) -> None:
    release = asyncio.Event()
    cleaned_up = asyncio.Event()

    async def follow(params: dict[str, Any], call: CallContext) -> AsyncIterator[str]:
        try:
            yield "first"
            await release.wait()
            yield "second"
        finally:
            cleaned_up.set()

    registry = registry_with_basics()
    registry.add("Follow", follow, streaming=True)
    async with AdminServer(sock_path, methods=registry):
        follower = AdminClient(sock_path)
        items = follower.stream("Follow")
        assert await anext(items) == "first"
        # The follower's connection is parked in a call; others are unaffected.
        async with AdminClient(sock_path) as other:
            assert await asyncio.wait_for(other.call("Echo", {"v": 1}), 2) == {"v": 1}
        release.set()
        assert await anext(items) == "second"
        with pytest.raises(StopAsyncIteration):
            await anext(items)
        await follower.close()

        # A client that hangs up mid-stream ends the call (its cleanup runs)
        # without waiting for the next item.
        release.clear()
        cleaned_up.clear()
        items = follower.stream("Follow")
        assert await anext(items) == "first"
        await items.aclose()  # stopping early drops the connection
        await asyncio.wait_for(cleaned_up.wait(), 2)
        assert await follower.call("Echo", {"again": 1}) == {"again": 1}
        await follower.close()


async def test_half_close_ends_a_stream_but_not_a_plain_call(sock_path: Path) -> None:
    stream_closed = asyncio.Event()
    applied = asyncio.Event()

    async def follow(params: dict[str, Any], call: CallContext) -> AsyncIterator[int]:
        try:
            yield 1
            await asyncio.Event().wait()
        finally:
            stream_closed.set()

    async def apply(params: dict[str, Any], call: CallContext) -> str:
        await asyncio.sleep(0.1)
        applied.set()
        return "applied"

    registry = MethodRegistry()
    registry.add("Follow", follow, streaming=True)
    registry.add("Apply", apply, level="admin")
    async with AdminServer(sock_path, methods=registry):
        raw = await Raw.connect(sock_path)
        await raw.send({"id": 1, "method": "Follow", "more": True})
        assert (await raw.recv())["result"] == 1
        raw.writer.write_eof()
        await asyncio.wait_for(stream_closed.wait(), 2)
        await raw.close()

        raw = await Raw.connect(sock_path)
        await raw.send({"id": 2, "method": "Apply"})
        await raw.close()  # gone before the reply
        await asyncio.wait_for(applied.wait(), 2)


# ------------------------------------------------------------------ binding


async def test_socket_mode_0600_without_group(sock_path: Path) -> None:
    async with AdminServer(sock_path, methods=MethodRegistry()):
        st = os.lstat(sock_path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.geteuid()
        # Only the final name remains; the temporary one is gone.
        assert os.listdir(sock_path.parent) == [sock_path.name]
    assert not sock_path.exists()


async def test_socket_mode_0660_with_group(sock_dir: Path) -> None:
    path = sock_dir / "run" / "a.sock"  # the runtime directory is created too
    async with AdminServer(path, group=own_group(), methods=MethodRegistry()):
        st = os.lstat(path)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == os.getgid()
        dir_st = os.stat(path.parent)
        assert stat.S_IMODE(dir_st.st_mode) == 0o750
        assert dir_st.st_gid == os.getgid()


async def test_runtime_directory_is_private_without_group(sock_dir: Path) -> None:
    path = sock_dir / "run" / "a.sock"
    async with AdminServer(path, methods=MethodRegistry()):
        assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700


async def test_no_window_with_wrong_permissions(
    sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final name appears only by link(), from a socket that already has its mode.

    Even with a wide-open process umask, the temporary socket is born 0600.
    """
    path = sock_dir / "a.sock"
    events: list[tuple[str, str, int, bool]] = []
    real_chmod, real_link = os.chmod, os.link

    def spy_chmod(target: Any, mode: int, **kwargs: Any) -> None:
        if Path(target).parent == sock_dir:
            before = stat.S_IMODE(os.lstat(target).st_mode)
            events.append(("chmod", os.fspath(target), before, path.exists()))
        real_chmod(target, mode, **kwargs)

    def spy_link(src: Any, dst: Any, **kwargs: Any) -> None:
        events.append(("link", os.fspath(src), stat.S_IMODE(os.lstat(src).st_mode), path.exists()))
        real_link(src, dst, **kwargs)

    # server.py calls os.chmod / os.link through the os module.
    monkeypatch.setattr(os, "chmod", spy_chmod)
    monkeypatch.setattr(os, "link", spy_link)
    old_umask = os.umask(0)
    try:
        server = AdminServer(path, group=own_group(), methods=MethodRegistry())
        await server.start()
    finally:
        os.umask(old_umask)
    try:
        assert [e[0] for e in events] == ["chmod", "link"]
        (_, chmod_target, born_mode, final_then), (_, link_src, linked_mode, final_at_link) = events
        assert chmod_target != os.fspath(path) and link_src == chmod_target
        assert born_mode & 0o077 == 0, "the temporary socket is private from birth"
        assert linked_mode == 0o660, "the socket has its final mode before it gets its name"
        assert not final_then and not final_at_link
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o660
        assert not Path(link_src).exists()
    finally:
        await server.close()


async def test_stale_socket_is_replaced(sock_path: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(os.fspath(sock_path))
    stale.close()  # the name stays, nothing listens: a crashed daemon's leftover
    old_inode = os.lstat(sock_path).st_ino
    async with AdminServer(sock_path, methods=MethodRegistry()), AdminClient(sock_path) as client:
        assert os.lstat(sock_path).st_ino != old_inode
        assert (await client.call("GetInfo"))["product"] == "meshnode"


async def test_live_socket_is_refused(sock_path: Path) -> None:
    async with AdminServer(sock_path, methods=MethodRegistry()):
        inode = os.lstat(sock_path).st_ino
        second = AdminServer(sock_path, methods=MethodRegistry())
        with pytest.raises(SocketInUse, match="already running"):
            await second.start()
        # The first daemon's socket is untouched and still answers.
        assert os.lstat(sock_path).st_ino == inode
        async with AdminClient(sock_path) as client:
            assert (await client.call("GetInfo"))["api_version"] == API_VERSION
        await second.close()  # a never-started server closes as a no-op
        assert os.lstat(sock_path).st_ino == inode
        assert len(os.listdir(sock_path.parent)) == 1, "the loser left no temporary socket"


async def test_non_socket_in_the_way_is_not_removed(sock_path: Path) -> None:
    sock_path.write_text("precious")
    with pytest.raises(AdminSocketError, match="not a socket"):
        await AdminServer(sock_path, methods=MethodRegistry()).start()
    assert sock_path.read_text() == "precious"


async def test_too_long_path_is_a_clear_error(sock_dir: Path) -> None:
    path = sock_dir / ("x" * 60) / ("y" * 60)
    with pytest.raises(AdminSocketError, match="AF_UNIX"):
        await AdminServer(path, methods=MethodRegistry()).start()
    assert not path.parent.exists(), "nothing is created for a path that cannot work"


async def test_existing_directory_unreachable_by_group_is_reported(
    sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    os.chmod(sock_dir, 0o700)
    async with AdminServer(sock_dir / "a.sock", group=own_group(), methods=MethodRegistry()):
        assert "not searchable by group" in caplog.text
        assert stat.S_IMODE(os.stat(sock_dir).st_mode) == 0o700, "an existing directory is kept"


async def test_unknown_group_is_a_clear_error(sock_path: Path) -> None:
    with pytest.raises(AdminSocketError, match="does not exist"):
        await AdminServer(sock_path, group="no-such-group-zz", methods=MethodRegistry()).start()


# ------------------------------------------------------------------ authorisation


def test_real_peercred_is_this_process() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        creds = so_peercred(left)
    assert creds == PeerCredentials(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())


async def test_real_peercred_connection_is_admin(sock_path: Path) -> None:
    async with AdminServer(sock_path, methods=registry_with_basics()), AdminClient(sock_path) as c:
        assert await c.call("Whoami") == {
            "uid": os.geteuid(),
            "gid": os.getegid(),
            "pid": os.getpid(),
            "level": "admin",
        }


async def test_stranger_is_refused(sock_path: Path) -> None:
    stranger = unused_id({0, os.geteuid()})
    group_gid = os.getgid()
    server = AdminServer(
        sock_path,
        group=own_group(),
        methods=registry_with_basics(),
        peer_credentials=fixed_peer(stranger, unused_id({group_gid, stranger})),
    )
    async with server:
        with pytest.raises(PermissionDenied):
            await AdminClient(sock_path).connect()
        # On the wire: an unsolicited error with id null, then the server hangs up.
        raw = await Raw.connect(sock_path)
        reply = await raw.recv()
        assert reply["id"] is None and reply["error"]["name"] == "PermissionDenied"
        assert await raw.at_eof()
        await raw.close()


async def test_without_group_only_admins_get_in(sock_path: Path) -> None:
    peer = fixed_peer(unused_id({0, os.geteuid()}), os.getgid())
    async with AdminServer(sock_path, methods=MethodRegistry(), peer_credentials=peer):
        with pytest.raises(PermissionDenied):
            await AdminClient(sock_path).connect()


async def test_group_member_is_operator_not_admin(sock_path: Path) -> None:
    async def restart(params: dict[str, Any], call: CallContext) -> str:
        return "restarting"

    async def wipe(params: dict[str, Any], call: CallContext) -> str:
        return "wiped"

    registry = registry_with_basics()
    registry.add("Restart", restart, level="operator")
    registry.add("Wipe", wipe, level=Level.ADMIN)
    member = unused_id({0, os.geteuid()})
    server = AdminServer(
        sock_path,
        group=own_group(),
        methods=registry,
        peer_credentials=fixed_peer(member, os.getgid(), pid=77),
    )
    async with server, AdminClient(sock_path) as client:
        assert client.info is not None and client.info["level"] == "operator"
        assert await client.call("Echo", {"read": "ok"}) == {"read": "ok"}
        assert await client.call("Restart") == "restarting"
        with pytest.raises(PermissionDenied) as info:
            await client.call("Wipe")
        assert info.value.params == {"method": "Wipe", "required": "admin", "level": "operator"}
        # Denial of one call does not end the connection.
        assert await client.call("Whoami") == {
            "uid": member,
            "gid": os.getgid(),
            "pid": 77,
            "level": "operator",
        }


async def test_uid_zero_is_admin(sock_path: Path) -> None:
    peer = fixed_peer(0, 0)
    server = AdminServer(sock_path, methods=registry_with_basics(), peer_credentials=peer)
    async with server, AdminClient(sock_path) as client:
        assert client.info is not None and client.info["level"] == "admin"


def test_peer_in_group_supplementary() -> None:
    me = os.geteuid()
    try:
        import pwd

        user = pwd.getpwuid(me)
    except KeyError:
        pytest.skip("the test user has no passwd entry")
    supplementary = set(os.getgrouplist(user.pw_name, user.pw_gid))
    for gid in supplementary:
        assert peer_in_group(me, unused_id(supplementary), gid)
    assert not peer_in_group(me, user.pw_gid, unused_id(supplementary))
    # A uid with no passwd entry is a member only through its primary gid.
    ghost = 3_999_999
    assert peer_in_group(ghost, 123, 123)
    assert not peer_in_group(ghost, 123, 124)


# ------------------------------------------------------------------ shutdown


async def test_close_finishes_calls_in_flight_and_ends_streams(sock_path: Path) -> None:
    started = asyncio.Event()

    async def slow(params: dict[str, Any], call: CallContext) -> str:
        started.set()
        await asyncio.sleep(0.2)
        return "finished"

    async def forever(params: dict[str, Any], call: CallContext) -> AsyncIterator[int]:
        yield 0
        await asyncio.Event().wait()
        yield 1  # pragma: no cover

    registry = registry_with_basics()
    registry.add("Slow", slow)
    registry.add("Forever", forever, streaming=True)
    server = AdminServer(sock_path, methods=registry, shutdown_timeout=5)
    await server.start()

    idle = await Raw.connect(sock_path)
    await idle.send({"id": 1, "method": "Echo"})
    assert (await idle.recv())["result"] == {}

    streamer = await Raw.connect(sock_path)
    await streamer.send({"id": 2, "method": "Forever", "more": True})
    assert (await streamer.recv())["continues"] is True

    worker = await Raw.connect(sock_path)
    await worker.send({"id": 3, "method": "Slow"})
    await started.wait()

    await asyncio.wait_for(server.close(), 3)
    assert not sock_path.exists()
    assert not server.serving
    assert await worker.recv() == {"id": 3, "result": "finished"}
    reply = await streamer.recv()
    assert reply["id"] == 2 and reply["error"]["name"] == "NotReady"
    assert await idle.at_eof() and await worker.at_eof() and await streamer.at_eof()
    for raw in (idle, streamer, worker):
        await raw.close()
    with pytest.raises(DaemonNotRunning):
        await AdminClient(sock_path).connect()


async def test_close_cancels_calls_over_budget(sock_path: Path) -> None:
    cancelled = asyncio.Event()
    started = asyncio.Event()

    async def stuck(params: dict[str, Any], call: CallContext) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    registry = MethodRegistry()
    registry.add("Stuck", stuck)
    server = AdminServer(sock_path, methods=registry, shutdown_timeout=0.1)
    await server.start()
    raw = await Raw.connect(sock_path)
    await raw.send({"id": 1, "method": "Stuck"})
    await eventually_async(started.is_set, what="the Stuck call running")
    await asyncio.wait_for(server.close(), 3)
    assert cancelled.is_set()
    assert await raw.at_eof()
    await raw.close()
    assert not sock_path.exists()


async def test_close_leaves_a_foreign_socket_alone(sock_path: Path) -> None:
    server = AdminServer(sock_path, methods=MethodRegistry())
    await server.start()
    os.unlink(sock_path)
    sock_path.write_text("someone else's")
    await server.close()
    assert sock_path.read_text() == "someone else's"


# ------------------------------------------------------------------ client failures


async def test_daemon_not_running_without_socket(sock_path: Path) -> None:
    with pytest.raises(DaemonNotRunning):
        await AdminClient(sock_path).call("GetInfo")
    with pytest.raises(DaemonNotRunning):
        await AdminClient(sock_path.parent / "missing-dir" / "a.sock").connect()


async def test_daemon_not_running_with_stale_socket(sock_path: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(os.fspath(sock_path))
    stale.close()
    with pytest.raises(DaemonNotRunning):
        await AdminClient(sock_path).connect()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def fake_server(path: Path, handler: Handler) -> AsyncIterator[None]:
    """A hand-written server on ``path``; its connections are closed on exit."""
    tasks: set[asyncio.Task[None]] = set()

    async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_unix_server(run, os.fspath(path))
    try:
        yield
    finally:
        server.close()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1)
        await server.wait_closed()


def fake_daemon(
    path: Path, reply_to_getinfo: bytes
) -> contextlib.AbstractAsyncContextManager[None]:
    """A fake daemon that answers the first request with ``reply_to_getinfo``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = orjson.loads(await reader.readline())
        writer.write(reply_to_getinfo.replace(b"$ID", str(request["id"]).encode()))
        await writer.drain()
        await reader.read()

    return fake_server(path, handle)


async def test_api_mismatch(sock_path: Path) -> None:
    async with fake_daemon(
        sock_path,
        b'{"id":$ID,"result":{"product":"meshnode","version":"9.0","api_version":"2",'
        b'"features":["GetInfo"]}}\n',
    ):
        with pytest.raises(ApiMismatch) as info:
            await AdminClient(sock_path).connect()
        assert info.value.api_version == "2"
        assert "admin API 2" in str(info.value) and f"API {API_VERSION}" in str(info.value)


async def test_api_mismatch_for_another_product(sock_path: Path) -> None:
    reply = b'{"id":$ID,"result":{"product":"other","api_version":"1"}}\n'
    async with fake_daemon(sock_path, reply):
        with pytest.raises(ApiMismatch):
            await AdminClient(sock_path).connect()


async def test_garbage_reply_is_a_protocol_violation(sock_path: Path) -> None:
    async with fake_daemon(sock_path, b"HTTP/1.0 400 Bad Request\n"):
        with pytest.raises(ProtocolViolation):
            await AdminClient(sock_path).connect()


async def test_daemon_hanging_up_mid_call(sock_path: Path) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()

    async with fake_server(sock_path, handle):
        with pytest.raises(AdminConnectionError):
            await AdminClient(sock_path).connect()


async def test_client_timeout(sock_path: Path) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with fake_server(sock_path, silent):
        with pytest.raises(AdminTimeout):
            await AdminClient(sock_path, timeout=0.1).connect()


async def test_call_sync(sock_path: Path) -> None:
    async with AdminServer(sock_path, methods=registry_with_basics()):
        result = await asyncio.to_thread(call_sync, sock_path, "Echo", {"sync": True})
    assert result == {"sync": True}


def test_call_sync_not_running(sock_path: Path) -> None:
    with pytest.raises(DaemonNotRunning):
        call_sync(sock_path, "GetInfo")


def test_exit_codes() -> None:
    assert exitcodes.EX_NOT_RUNNING == 69
    assert exitcodes.EX_ERROR == 70
    assert exitcodes.EX_TEMPFAIL == 75
    assert exitcodes.EX_API_MISMATCH == 76
    assert exitcodes.EX_NOPERM == 77
    cases: list[tuple[BaseException, int]] = [
        (DaemonNotRunning("/x"), exitcodes.EX_NOT_RUNNING),
        (AdminConnectionError("lost"), exitcodes.EX_NOT_RUNNING),
        (PermissionDenied("no"), exitcodes.EX_NOPERM),
        (ApiMismatch({"api_version": "2"}), exitcodes.EX_API_MISMATCH),
        (ProtocolViolation("junk"), exitcodes.EX_API_MISMATCH),
        (AdminTimeout("slow"), exitcodes.EX_TEMPFAIL),
        (NotReady("starting"), exitcodes.EX_TEMPFAIL),
        # Issue #18: admin errors map to the sysexits table (NotFound was 70 before).
        (NotFound("x"), exitcodes.EX_DATAERR),
        (AdminError("Chat.RoomFull", "full"), exitcodes.EX_ERROR),
    ]
    for exc, code in cases:
        assert exit_code_for(exc) == code, exc
    assert len({exitcodes.EX_NOT_RUNNING, exitcodes.EX_NOPERM, exitcodes.EX_API_MISMATCH}) == 3


async def test_a_parameter_with_no_canonical_form_is_invalid_parameter_not_internal(sock_path: Path) -> None:
    """Found by the admin fuzzer: ``Artifacts.Put {"name": 2**53}`` answered Internal."""
    from meshnode.protocol.canonical import canonicalize

    async def forward(params: dict[str, Any], call: CallContext) -> Any:
        return canonicalize(params).decode()  # what signing a forwarded parameter does

    registry = registry_with_basics()
    registry.add("Forward", forward)
    async with AdminServer(sock_path, methods=registry):
        raw = await Raw.connect(sock_path)
        await raw.send(encode({"id": 1, "method": "Forward", "params": {"name": 2**53}}))
        reply = await raw.recv()
        assert reply["error"]["name"] == "InvalidParameter"
        assert reply["error"]["params"]["path"] == "$.name"
        await raw.send(encode({"id": 2, "method": "Echo", "params": {"x": 1}}))
        assert await raw.recv() == {"id": 2, "result": {"x": 1}}
        await raw.close()
