"""A participant flooding the mesh's store (issue #22.3, #22.4, #23.9), real daemons and nats-server.

One mesh for the module, configured with small bounds so a flood of a few
MiB reaches them: a participant credential (an ordinary ``meshnode mesh
invite``, renewed for its roster) floods the streams it may publish on, and the platform keeps
registering, discovering and recording tasks; the flood is bounded, the
oversize message is refused at the flooder's PubAck, ``status`` reports the
store low, and a flood to an offline agent's mailbox leaves the requests
buffered before it deliverable.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.errors import APIError

from meshnode.control_plane import ControlPlaneClient
from meshnode.protocol.nkeys import KeyPair
from meshnode.testing import DaemonProcess, DaemonSet, eventually, eventually_async
from meshnode.testing import run_cli as _run_cli
from meshnode.transport.connection import flush_written
from meshnode.transport.jetstream import JetStream
from meshnode.transport.jwt import nats_auth_callbacks
from meshnode.transport.permissions import node_inbox_prefix
from meshnode.transport.streams import (
    SweepCursor,
    ensure_inbox_stream,
    purge_acked_mailboxes,
    purge_acked_page,
)

pytestmark = pytest.mark.integration

KIB = 1024
MIB = 1024 * KIB
PLUGINS = {"plugin_modules": ["tests.agents:tasks_plugin"]}
TASKS_BOUND = 2 * MIB
MAILBOX_BOUND = 1 * MIB
MAX_MSG = 256 * KIB
ACCOUNT = 26 * MIB

# Every platform object bounded small (19 MiB reserved in all).
STORAGE = {
    "tasks_max_bytes": TASKS_BOUND,
    "events_max_bytes": 1 * MIB,
    "feed_max_bytes": 1 * MIB,
    "heartbeat_max_bytes": 1 * MIB,
    "registry_events_max_bytes": 1 * MIB,
    "metering_max_bytes": 1 * MIB,
    "registry_max_bytes": 2 * MIB,
    "task_records_max_bytes": 2 * MIB,
    "feed_state_max_bytes": 1 * MIB,
    "artifacts_max_bytes": 4 * MIB,
    "artifact_index_max_bytes": 1 * MIB,
    "artifact_uploads_max_bytes": 1 * MIB,
    "agreements_max_bytes": 1 * MIB,
    "max_msg_size": MAX_MSG,
    "low_store_warning": 0.8,
    "check_interval": "300ms",
}


@pytest.fixture(scope="module")
def store_mesh() -> Iterator[tuple[DaemonSet, DaemonProcess, DaemonProcess]]:
    daemons = DaemonSet()
    try:
        host = daemons.embedded(
            "store",
            agents={"echo": {"plugin": "echo"}, "tasks": {"plugin": "test-tasks"}},
            node=PLUGINS,
            extra={
                # The account gets 26 of the server's 64 MiB: the platform's 19 MiB,
                # the mailboxes of the agents here and a few more.
                "mesh.embedded": {"jetstream_max_store": 64 * MIB, "account_max_store": ACCOUNT},
                "storage": STORAGE,
                "inbox": {"buffer_max_bytes": MAILBOX_BOUND, "buffer_max_msgs": 500},
            },
        )
        away = daemons.joined("away", via=host, agents={"echo_away": {"plugin": "echo"}})
        yield daemons, host, away
    finally:
        daemons.close()


class Flooder:
    """A participant's raw NATS connection with its roster credential: enrolled
    by an ordinary invite, renewed over the control plane as any node does."""

    def __init__(self, seed: str, control_plane: str) -> None:
        self.key = KeyPair.from_seed(seed)
        self.control_plane = control_plane
        self.nc: Any = None

    async def __aenter__(self) -> Flooder:
        grant = await ControlPlaneClient(self.control_plane).request_credential(self.key, [KeyPair.generate()])
        user_jwt, sign = nats_auth_callbacks(lambda: grant.jwt, self.key)
        self.nc = await nats.connect(
            grant.nats_endpoints[0],
            user_jwt_cb=user_jwt,
            signature_cb=sign,
            inbox_prefix=node_inbox_prefix(self.key.public_key),
            allow_reconnect=False,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()


@pytest.fixture(scope="module")
def flooder_creds(store_mesh: tuple[DaemonSet, DaemonProcess, DaemonProcess]) -> tuple[str, str]:
    """The invite's node seed and the control plane's URL."""
    _daemons, host, _away = store_mesh
    invite = host.admin("Mesh.Invite", {"name": "flooder"})
    return str(invite["node_seed"]), str(host.admin("Mesh.Info")["control_plane"])


def _stream(host: DaemonProcess, name: str) -> dict[str, Any] | None:
    storage = host.status()["storage"] or {}
    return next((s for s in storage.get("streams", []) if s["name"] == name), None)


def test_a_task_stream_flood_is_bounded_refused_oversize_and_the_platform_keeps_working(
    store_mesh: tuple[DaemonSet, DaemonProcess, DaemonProcess], flooder_creds: tuple[str, str]
) -> None:
    _daemons, host, away = store_mesh
    seed, control = flooder_creds
    junk = os.urandom(64 * KIB)

    async def flood() -> tuple[int, APIError]:
        async with Flooder(seed, control) as f:
            js = f.nc.jetstream()
            acked = 0
            # Three times the stream's bound, spread over many task subjects as the attack was.
            for i in range(3 * TASKS_BOUND // len(junk)):
                await js.publish(f"mesh.task.tjunk{i}.update", junk)
                acked += 1
            with pytest.raises(APIError) as refused:
                await js.publish("mesh.task.tbig.update", os.urandom(MAX_MSG + KIB))
            return acked, refused.value

    acked, refused = asyncio.run(flood())
    # Discard-old at the bound: the flood only ever evicts its own history.
    assert acked == 3 * TASKS_BOUND // (64 * KIB)
    # The oversize message is refused at the flooder's PubAck, saying why.
    assert refused.err_code == 10054 and "message size exceeds maximum" in str(refused.description)
    tasks = eventually(lambda: _stream(host, "MESH_TASKS"), what="MESH_TASKS in status")
    assert tasks["max_bytes"] == TASKS_BOUND and tasks["bytes"] <= TASKS_BOUND

    # The platform is untouched: a registration, discovery, a call across the
    # mesh and a task record that reaches its final state.
    added = away.admin("Agents.Add", {"name": "late", "config": {"plugin": "echo"}})
    assert added["registered"] is True, added
    found = host.admin("Discover", {"agent_ids": [added["id"]]})["agents"]
    assert [a["id"] for a in found] == [added["id"]]
    assert host.call(added["id"], "echo", "after the flood")["output"] == {"ok": "after the flood"}
    done = away.call(host.agent_id("tasks"), "slow", {"steps": 2})
    assert done["status"] == "completed" and done["task_id"], done
    record = eventually(
        lambda: (r := away.admin("Tasks.Show", {"task_id": done["task_id"]})).get("state") == "completed" and r,
        what="the task record reaching completed",
    )
    assert record["state"] == "completed"
    away.admin("Agents.Remove", {"name": "late"})


def test_status_and_metrics_report_the_store_and_a_full_stream_is_logged_once(
    store_mesh: tuple[DaemonSet, DaemonProcess, DaemonProcess], flooder_creds: tuple[str, str]
) -> None:
    _daemons, host, _away = store_mesh
    seed, control = flooder_creds

    async def fill() -> None:
        async with Flooder(seed, control) as f:
            js = f.nc.jetstream()
            for i in range(2 * TASKS_BOUND // (64 * KIB)):
                await js.publish(f"mesh.task.tfill{i}.update", os.urandom(64 * KIB))

    asyncio.run(fill())
    # The account's own reservations can make the state low before the watch's
    # next check has seen the full stream: wait for the check that did.
    storage = eventually(
        lambda: (s := host.status()["storage"]) and s["state"] == "low"
        and any(r.startswith("stream MESH_TASKS:") for r in s["low"]) and s,
        what="status saying low, naming the full MESH_TASKS stream",
        detail=lambda: host.status()["storage"],
    )
    # The account's figures: its limit, the reservations of every bounded
    # object (the platform's and one mailbox per agent), and the headroom left.
    assert storage["limit_bytes"] == ACCOUNT
    assert storage["reserved_bytes"] >= 19 * MIB
    assert 0 < storage["headroom_bytes"] <= ACCOUNT - storage["reserved_bytes"]
    # MESH_TASKS drops its oldest messages at its bound (the broker's own
    # config, read back): the warning must not say its writes are refused.
    (tasks_reason,) = [r for r in storage["low"] if r.startswith("stream MESH_TASKS:")]
    assert tasks_reason.endswith("full, it drops its oldest messages"), tasks_reason
    text = host.log_text()
    assert text.count("JetStream store low: stream MESH_TASKS") == 1, text
    (warning,) = [line for line in text.splitlines() if "JetStream store low: stream MESH_TASKS" in line]
    assert "refuses writes" not in warning and "to keep more history" in warning, warning  # it refuses nothing
    metrics = host.admin("Metrics")["runtime"]
    assert metrics["jetstream_store_limit_bytes"] == ACCOUNT and metrics["jetstream_store_low"] == 1
    prom = host.admin("Metrics", {"format": "prometheus"})["text"]
    assert "meshnode_jetstream_store_headroom_bytes " in prom
    human = _run_cli("status", "--socket", host.socket_path).stdout
    assert "store     low:" in human and "LOW     stream MESH_TASKS" in human


def test_a_flood_to_an_offline_agent_keeps_the_requests_buffered_before_it(
    store_mesh: tuple[DaemonSet, DaemonProcess, DaemonProcess], flooder_creds: tuple[str, str]
) -> None:
    _daemons, host, away = store_mesh
    seed, control = flooder_creds
    target = away.agent_id("echo_away")
    mailbox = f"MESH_INBOX_{target}"
    assert host.call(target, "echo", "warm-up")["status"] == "completed"
    assert away.stop() == 0

    before = {m["msg_id"] for m in host.admin("Inbox.List", {"states": ["held"], "agent": "cli"})["messages"]}
    for i in range(5):
        result = host.call(target, "echo", {"n": i}, timeout=0.5)
        assert result["status"] == "failed" and result["error"]["code"] == "TRANSPORT_TIMEOUT"

    async def flood() -> None:
        # Twice the mailbox's bound of junk, on core NATS as a participant may.
        async with Flooder(seed, control) as f:
            for _ in range(2 * MAILBOX_BOUND // (32 * KIB)):
                await f.nc.publish(f"mesh.agent.{target}.inbox", os.urandom(32 * KIB))
            await flush_written(f.nc)

    asyncio.run(flood())
    # Full and refusing (discard-new): the junk stops at the bound and the
    # five requests buffered before it are still there.
    full = eventually(
        lambda: (s := _stream(host, mailbox)) and s["bytes"] >= 0.8 * MAILBOX_BOUND and s,
        what="the mailbox at its bound",
    )
    assert full["bytes"] <= MAILBOX_BOUND and full["max_bytes"] == MAILBOX_BOUND

    away.start()

    def late() -> list[dict[str, Any]]:
        held = host.admin("Inbox.List", {"states": ["held"], "agent": "cli"})["messages"]
        return [m for m in held if m["msg_id"] not in before]

    answers = eventually(lambda: len(late()) >= 5 and late(), what="the five late answers",
                         detail=away.log_tail)
    assert sorted(m["output"]["ok"]["n"] for m in answers) == [0, 1, 2, 3, 4]
    # The drain emptied the mailbox it committed, so it takes mail again.
    eventually(lambda: (s := _stream(host, mailbox)) is None or s["messages"] == 0,
               what="the drained mailbox purged", retry_on=(Exception,))
    assert host.call(target, "echo", "back")["output"] == {"ok": "back"}


def test_a_registration_past_the_accounts_store_is_refused_quota_exceeded_naming_the_store(
    store_mesh: tuple[DaemonSet, DaemonProcess, DaemonProcess],
) -> None:
    # Each agent reserves its mailbox; past the account's limit nats-server
    # refuses the reservation (10047) and the registry answers QUOTA_EXCEEDED
    # naming the JetStream store, not INTERNAL_ERROR.
    _daemons, host, away = store_mesh
    headroom = host.status()["storage"]["headroom_bytes"]
    added: list[str] = []
    refused: dict[str, Any] | None = None
    try:
        for i in range(headroom // MAILBOX_BOUND + 2):
            result = away.admin("Agents.Add", {"name": f"extra{i}", "config": {"plugin": "echo"}})
            added.append(f"extra{i}")
            if not result["registered"]:
                refused = result
                break
        assert refused is not None, f"{len(added)} agents registered within {headroom} bytes of headroom"
        error = str(refused.get("registration_error"))
        assert "QUOTA_EXCEEDED" in error and "JetStream store" in error, refused
        assert "reserving the mailbox MESH_INBOX_" in error and "buffer_max_bytes" in error
        assert "INTERNAL_ERROR" not in error
        # The agents registered before the limit still work.
        if len(added) > 1:
            first = away.agent_id(added[0])
            assert host.call(first, "echo", "still")["output"] == {"ok": "still"}
    finally:
        for name in added:
            away.admin("Agents.Remove", {"name": name})


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True)
    return done.returncode == 0


def _fill(path: Path) -> Path:
    """A filler file that leaves the filesystem not one byte."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 20, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * chunk)
    finally:
        os.close(fd)
    return filler


def test_a_mesh_host_whose_disk_filled_comes_back_when_space_returns_losing_nothing() -> None:
    # #23.9: the host's own data disk (the embedded broker's store) fills; a
    # restart while full fails and says why; once space returns the next start
    # (systemd's Restart=) serves again, and the task record written before is
    # still there (the broker's store survived).
    daemons = DaemonSet()
    try:
        host = daemons.embedded(
            "disk",
            agents={"echo": {"plugin": "echo"}, "tasks": {"plugin": "test-tasks"}},
            node=PLUGINS,
            extra={"mesh.embedded": {"jetstream_max_store": 24 * MIB}, "storage": STORAGE},
            start=False,
        )
        store = host.data_dir / "mesh"
        if not _mount_tmpfs(store, "40m"):
            pytest.skip("needs root and mount to give the broker's store a small tmpfs")
        try:
            host.start()
            done = host.call("tasks", "slow", {"steps": 1})
            assert done["status"] == "completed" and done["task_id"], done

            def recorded() -> dict[str, Any] | None:
                record: dict[str, Any] = host.admin("Tasks.Show", {"task_id": done["task_id"]})
                return record if record.get("state") == "completed" else None

            eventually(recorded, what="the task record before the fill", retry_on=(Exception,))
            assert host.stop() == 0
            filler = _fill(store)
            # A full disk is temporary: EX_TEMPFAIL (75), saying so, not a bare 1.
            with pytest.raises(RuntimeError, match="exited with 75"):
                host.start()
            assert "is full; free space and start again" in host.log_text(), host.log_tail()
            filler.unlink()
            host.start()
            assert host.call("echo", "echo", "after")["output"] == {"ok": "after"}
            record = eventually(recorded, what="the task record after recovery", retry_on=(Exception,),
                                detail=host.log_tail)
            assert record["state"] == "completed"
            host.stop()
        finally:
            subprocess.run(["umount", "-l", str(store)], capture_output=True, check=False)
    finally:
        daemons.close()


async def test_the_registry_purges_what_any_client_acked_and_a_full_mailbox_keeps_the_rest(
    mesh: Any, node_factory: Any
) -> None:
    # Not a meshnode node: a client that drains its mailbox through the §18.6
    # durable and acks, but never purges (as an SDK does). The platform's sweep
    # gives the room back; at its bound the mailbox refuses, keeping the oldest.
    service = await node_factory(0, role="service")
    client = await node_factory(1)
    agent = client.agent_ids[0]
    stream = f"MESH_INBOX_{agent}"
    platform = JetStream(service.client.jetstream(), service.client)
    await ensure_inbox_stream(platform, agent, max_bytes=64 * KIB, max_msgs=10)
    for i in range(6):
        await client.client.publish(f"mesh.agent.{agent}.inbox", f"m{i}".encode())
    await flush_written(client.client)
    js = client.client.jetstream()
    await eventually_async(lambda: _messages(js, stream, 6), what="six buffered")
    reader = await js.pull_subscribe(f"mesh.agent.{agent}.inbox", durable=f"inbox_{agent}", stream=stream)
    for msg in await reader.fetch(4, timeout=5):
        await msg.ack_sync()
    purged = await purge_acked_mailboxes(platform)
    assert purged == {stream: 4}
    state = (await js.stream_info(stream)).state
    assert (state.messages, state.first_seq) == (2, 5)
    for i in range(6, 30):  # a flood past max_msgs
        await client.client.publish(f"mesh.agent.{agent}.inbox", f"m{i}".encode())
    await flush_written(client.client)
    await eventually_async(lambda: _messages(js, stream, 10), what="the mailbox at its bound")
    state = (await js.stream_info(stream)).state
    assert (state.messages, state.first_seq, state.last_seq) == (10, 5, 14)  # the newest refused
    # The registry's sweep takes one page of the stream listing per tick (#21):
    # on this small mesh the first page is the whole listing, so one pass.
    for msg in await reader.fetch(3, timeout=5):
        await msg.ack_sync()
    cursor = SweepCursor()
    page, listed = await purge_acked_page(platform, cursor.offset)
    assert page == {stream: 7}
    cursor.advance(listed)
    assert (cursor.offset, cursor.passes) == (0, 1), listed
    state = (await js.stream_info(stream)).state
    assert (state.messages, state.first_seq) == (7, 8)


async def _messages(js: Any, stream: str, count: int) -> bool:
    return bool((await js.stream_info(stream)).state.messages == count)
