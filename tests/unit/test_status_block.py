"""Status while the loop is blocked, and per-agent task figures (issue #23 item 10).

The task tally (a context variable and a loop task factory), the watchdog's
thread-safe ``blocked_now``, the status socket beside the admin socket, and
the status board the daemon answers it from.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import socket
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import orjson
import pytest

from meshnode.admin.offloop import read_status_socket, status_socket_path
from meshnode.admin.peers import PeerCredentials
from meshnode.admin.server import AdminServer, MethodRegistry
from meshnode.daemon.statusboard import StatusBoard
from meshnode.node import tasktally
from meshnode.node.looplag import UNATTRIBUTED, LoopWatchdog, running_for
from meshnode.node.tasktally import TaskCount
from meshnode.testing import eventually_async

# ------------------------------------------------------------------ the task tally


@pytest.fixture
async def tally() -> Any:
    tasktally.install()
    try:
        yield
    finally:
        tasktally.uninstall()


async def _wait_forever(release: asyncio.Event) -> None:
    await release.wait()


async def test_tasks_a_handler_spawns_are_counted_for_its_agent_until_they_end(tally: None) -> None:
    mine, other = TaskCount(), TaskCount()
    release = asyncio.Event()

    async def handler() -> None:
        with running_for("mine", mine):
            async def worker() -> None:
                # A task's task is the agent's too: the context is inherited.
                child = asyncio.create_task(_wait_forever(release))
                await release.wait()
                await child

            for _ in range(3):
                asyncio.ensure_future(worker())  # noqa: RUF006 - fire and forget, what the tally is for
        # After the handler: the node's own code again, not counted.
        asyncio.create_task(_wait_forever(release))  # noqa: RUF006

    await asyncio.create_task(handler())
    await eventually_async(lambda: mine.live == 6, what="three workers and their children counted")
    assert mine.total == 6 and other.live == 0
    release.set()
    await eventually_async(lambda: mine.live == 0, what="the ended tasks uncounted")
    assert mine.total == 6


async def test_an_explicit_context_is_the_one_read(tally: None) -> None:
    count = TaskCount()
    ctx = contextvars.copy_context()
    ctx.run(tasktally.CURRENT.set, count)
    release = asyncio.Event()
    release.set()
    await asyncio.get_running_loop().create_task(_wait_forever(release), context=ctx)
    assert count.total == 1
    await eventually_async(lambda: count.live == 0, what="the task uncounted")


async def test_the_tally_wraps_the_loops_own_factory_and_puts_it_back() -> None:
    loop = asyncio.get_running_loop()
    made: list[str] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any) -> asyncio.Future[Any]:
        made.append("outer")
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(factory)  # type: ignore[arg-type]
    try:
        tasktally.install()
        tasktally.install()  # idempotent: not wrapped twice
        assert tasktally.installed()
        count = TaskCount()
        token = tasktally.CURRENT.set(count)
        try:
            await asyncio.create_task(asyncio.sleep(0), name="named")
        finally:
            tasktally.CURRENT.reset(token)
        assert made == ["outer"] and count.total == 1
        tasktally.uninstall()
        assert loop.get_task_factory() is factory
    finally:
        loop.set_task_factory(None)


async def test_running_for_resets_the_count_with_the_owner(tally: None) -> None:
    outer, inner = TaskCount(), TaskCount()
    with running_for("drain", outer):
        with running_for("agent", inner):
            assert tasktally.CURRENT.get() is inner
        assert tasktally.CURRENT.get() is outer
    assert tasktally.CURRENT.get() is None


# ------------------------------------------------------------------ blocked_now


async def test_blocked_now_names_the_agent_while_the_loop_is_stuck() -> None:
    watchdog = LoopWatchdog(threshold_s=0.3, on_block=lambda lag, agent: None)
    assert watchdog.blocked_now() is None  # not started
    watchdog.start()
    seen: list[dict[str, Any]] = []
    stop = threading.Event()

    def watch() -> None:  # another thread, as the status socket's
        while not stop.wait(0.05):
            blocked = watchdog.blocked_now()
            if blocked is not None:
                seen.append(blocked)

    def block_until(sighted: Any, limit_s: float = 30.0) -> None:
        # The bug under test: the loop is blocked, here until the watcher thread has
        # sighted what the test asserts (a deadline bounds a failing case), so a
        # loaded machine only makes the block longer, never the test flaky.
        deadline = time.monotonic() + limit_s
        while not sighted() and time.monotonic() < deadline:
            time.sleep(0.01)

    thread = threading.Thread(target=watch)
    try:
        thread.start()
        assert watchdog.blocked_now() is None  # the loop is keeping its wakeups

        async def handler() -> None:
            with running_for("blocker"):
                block_until(lambda: any(b["for_s"] >= 0.6 for b in seen))

        await asyncio.create_task(handler())
        assert seen and all(b["agent"] == "blocker" for b in seen), seen
        assert max(b["for_s"] for b in seen) >= 0.6 and seen[0]["threshold_s"] == 0.3
        seen.clear()
        block_until(lambda: bool(seen) and seen[-1]["agent"] == UNATTRIBUTED)  # outside any handler
        assert seen and seen[-1]["agent"] == UNATTRIBUTED
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        await watchdog.stop()
    assert watchdog.blocked_now() is None


# ------------------------------------------------------------------ the status socket


@pytest.fixture
def sock_path(short_tmp_path: Path) -> Path:
    return short_tmp_path / "a.sock"


async def test_the_status_socket_answers_from_its_thread_while_the_loop_is_blocked(sock_path: Path) -> None:
    async with AdminServer(sock_path, methods=MethodRegistry(), status_answer=lambda: b'{"state":"serving"}'):
        side = status_socket_path(sock_path)
        assert side.is_socket() and (side.stat().st_mode & 0o777) == 0o600
        answers: list[Any] = []
        reader = threading.Thread(target=lambda: answers.append(read_status_socket(sock_path)))
        reader.start()
        # Joined *on the loop*: the loop is blocked until the thread has its answer.
        reader.join(timeout=10)
        assert answers == [{"state": "serving"}]
    assert not side.exists()  # removed with the admin socket
    assert read_status_socket(sock_path, timeout=1.0) is None


async def test_the_status_socket_refuses_who_the_admin_socket_refuses(sock_path: Path) -> None:
    def stranger(sock: socket.socket) -> PeerCredentials:
        return PeerCredentials(pid=1, uid=os.geteuid() + 4242, gid=4242)

    async with AdminServer(
        sock_path, methods=MethodRegistry(), peer_credentials=stranger, status_answer=lambda: b"{}"
    ):
        raw = await asyncio.to_thread(_raw_read, status_socket_path(sock_path))
        assert orjson.loads(raw)["error"]["name"] == "PermissionDenied"
        assert await asyncio.to_thread(read_status_socket, sock_path) is None


def _raw_read(path: Path) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(str(path))
        return sock.recv(65536)


async def test_a_stale_status_socket_is_replaced_and_a_file_is_not(sock_path: Path) -> None:
    side = status_socket_path(sock_path)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(side))
    stale.close()  # a dead daemon's
    async with AdminServer(sock_path, methods=MethodRegistry(), status_answer=lambda: b"{}"):
        assert await asyncio.to_thread(read_status_socket, sock_path) == {}
    side.write_text("not a socket")
    async with AdminServer(sock_path, methods=MethodRegistry(), status_answer=lambda: b"{}"):
        assert side.read_text() == "not a socket"  # left alone; only a warning
        assert await asyncio.to_thread(read_status_socket, sock_path) is None


# ------------------------------------------------------------------ the status board


async def test_the_board_answers_the_last_snapshot_with_blocked_and_its_age() -> None:
    class Stuck:
        def blocked_now(self) -> dict[str, Any] | None:
            return {"for_s": 12.5, "agent": "blocker", "threshold_s": 1.0}

    board = StatusBoard(lambda: None)
    first = orjson.loads(board.answer())
    assert first == {"state": "starting", "blocked": None, "snapshot_age_s": None}
    status = {"state": "serving", "agents": [{"name": "a"}], "blocked": None}
    board.publish(status)
    status["state"] = "changed after publishing"  # the board keeps its own bytes
    stuck = StatusBoard(lambda: Stuck())  # type: ignore[arg-type, return-value]
    stuck.publish({"state": "serving"})
    answer = orjson.loads(await asyncio.to_thread(stuck.answer))
    assert answer["blocked"] == {"for_s": 12.5, "agent": "blocker", "threshold_s": 1.0}
    assert answer["state"] == "serving" and 0 <= answer["snapshot_age_s"] < 5
    assert orjson.loads(board.answer())["state"] == "serving"


async def test_the_board_publishes_periodically_until_stopped() -> None:
    board = StatusBoard(lambda: None)
    n = 0

    def snapshot() -> dict[str, Any]:
        nonlocal n
        n += 1
        return {"n": n}

    board.start(snapshot, interval_s=0.05)
    try:
        await eventually_async(lambda: orjson.loads(board.answer()).get("n", 0) >= 3, what="three publications")
    finally:
        await board.stop()


# ------------------------------------------------------------------ meshnode status


def test_status_prints_the_status_sockets_answer_while_the_loop_is_blocked(
    sock_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from meshnode.cli import daemon as cli_daemon
    from meshnode.cli.exitcodes import EX_LOOP_BLOCKED

    monkeypatch.setattr(cli_daemon, "STATUS_SOCKET_AFTER_S", 0.2)
    release, serving = threading.Event(), threading.Event()

    async def stuck_status(params: dict[str, Any], call: Any) -> Any:
        release.wait(60)  # blocks the server's loop, as a plugin's time.sleep would
        return {"state": "serving"}

    answer = orjson.dumps({
        "state": "serving", "blocked": {"for_s": 3.0, "agent": "blocker", "threshold_s": 1.0},
        "snapshot_age_s": 1.5,
    })

    async def serve() -> None:
        registry = MethodRegistry()
        registry.add("Status", stuck_status)
        async with AdminServer(sock_path, methods=registry, status_answer=lambda: answer):
            serving.set()
            await asyncio.to_thread(release.wait, 60)

    server = threading.Thread(target=lambda: asyncio.run(serve()))
    server.start()
    try:
        assert serving.wait(30)
        args = argparse.Namespace(socket=str(sock_path), config=None, json=False, brief=False)
        assert cli_daemon.cmd_status(args) == EX_LOOP_BLOCKED
        out = capsys.readouterr().out
        assert "BLOCKED now, for 3.0 s, by a handler of agent blocker" in out and "1.5 s old" in out, out
        args.json = True
        assert cli_daemon.cmd_status(args) == EX_LOOP_BLOCKED
        assert orjson.loads(capsys.readouterr().out)["blocked"]["agent"] == "blocker"
    finally:
        release.set()
        server.join(timeout=30)
