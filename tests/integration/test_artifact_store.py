"""The artifact store service as a component on a real nats-server (§7.5.2, §18.5, §18.7).

A service-role connection hosts the store; participant connections send it
signed requests exactly as nodes do. The clock is the test's, so lifetimes
can pass without waiting (envelopes are signed with the same clock).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from meshnode.protocol.artifacts import OBJECT_STORE_BUCKET, chunk_budget
from meshnode.protocol.envelope import (
    build_envelope,
    decode_envelope,
    encode_envelope,
    sign_envelope,
)
from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.protocol.rests_on import digest_of
from meshnode.services.artifacts import ArtifactLimits, ArtifactService
from meshnode.services.base import ServiceContext
from meshnode.transport.connection import MeshConnection
from meshnode.transport.embedded import EmbeddedNatsServer
from meshnode.transport.permissions import node_inbox_prefix
from meshnode.transport.streams import ensure_key_value, registry_bucket_config

pytestmark = pytest.mark.integration

KiB = 1024
DAY_MS = 86_400_000


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000_000

    def __call__(self) -> int:
        return self.now


async def _connect(mesh: EmbeddedNatsServer, key: KeyPair, jwt: str) -> MeshConnection:
    conn = MeshConnection([mesh.url], node_key=key, jwt_source=lambda: jwt, name="test",
                          inbox_prefix=node_inbox_prefix(key.public_key), connect_timeout=2.0)
    await conn.connect()
    return conn


@dataclass
class Store:
    mesh: EmbeddedNatsServer
    clock: Clock
    service_key: KeyPair
    service_conn: MeshConnection
    owners: dict[str, str]
    services: list[ArtifactService] = field(default_factory=list)
    conns: list[MeshConnection] = field(default_factory=list)
    agent_conn: dict[str, MeshConnection] = field(default_factory=dict)

    async def start(self, limits: ArtifactLimits, conn: MeshConnection | None = None) -> ArtifactService:
        async def owner_of(agent_id: str) -> str | None:
            return self.owners.get(agent_id)

        ctx = ServiceContext(connection=conn or self.service_conn, key=self.service_key,
                             node_id="N", now_ms=self.clock)
        service = ArtifactService(ctx, owner_of=owner_of, limits=limits)
        await service.start()
        self.services.append(service)
        return service

    async def node(self, agents: int = 1, *, owner: str | None = None) -> list[KeyPair]:
        """A participant node hosting ``agents`` registered agents (owner: the node key)."""
        key = KeyPair.generate(Prefix.USER)
        keys = [KeyPair.generate(Prefix.USER) for _ in range(agents)]
        jwt = self.mesh.mint_node_credential(key.public_key, [k.public_key for k in keys], 300)
        conn = await _connect(self.mesh, key, jwt)
        self.conns.append(conn)
        for agent in keys:
            self.owners[agent.public_key] = owner or key.public_key
            self.agent_conn[agent.public_key] = conn
        return keys

    async def call(self, agent: KeyPair, op: str, payload: dict[str, Any]) -> dict[str, Any]:
        """The reply envelope to ``mesh.artifacts.{op}``, checked to be bound to the request."""
        env = sign_envelope(build_envelope("request", agent.public_key, now_ms=self.clock(), payload=payload), agent)
        msg = await self.agent_conn[agent.public_key].request(f"mesh.artifacts.{op}", encode_envelope(env), timeout=10)
        reply = decode_envelope(msg.data)
        assert reply["in_reply_to"] == env["id"] and reply["to"] == agent.public_key
        assert reply["from"] == self.service_key.public_key
        return reply

    async def ok(self, agent: KeyPair, op: str, payload: dict[str, Any]) -> dict[str, Any]:
        reply = await self.call(agent, op, payload)
        assert "error" not in reply, reply["error"]
        return dict(reply["payload"])

    async def refused(self, agent: KeyPair, op: str, payload: dict[str, Any]) -> dict[str, Any]:
        reply = await self.call(agent, op, payload)
        assert reply["payload"] == {"status": "failed"}, reply
        return dict(reply["error"])

    async def fetch_all(self, agent: KeyPair, ref: str) -> bytes:
        out, offset = bytearray(), 0
        while True:
            got = await self.ok(agent, "fetch", {"ref": ref, "offset": offset})
            data = base64.b64decode(got["data"])
            out += data
            offset += len(data)
            if got["eof"] or not data:
                return bytes(out)

    async def upload(self, agent: KeyPair, data: bytes, *, piece: int, digest: str | None = None) -> dict[str, Any]:
        opened = await self.ok(agent, "put", {"media_type": "application/octet-stream", "size": len(data),
                                              "digest": digest or digest_of(data), "name": "up.bin"})
        reply: dict[str, Any] = {}
        for seq, start in enumerate(range(0, len(data), piece)):
            reply = await self.call(agent, "put", {"upload": opened["upload"], "seq": seq,
                                                   "data": base64.b64encode(data[start:start + piece]).decode()})
            if "error" in reply:
                return reply
        return reply


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture
async def store(mesh: EmbeddedNatsServer) -> AsyncIterator[Store]:
    service_key = KeyPair.generate(Prefix.USER)
    jwt = mesh.mint_node_credential(service_key.public_key, [], 300, role="service")
    conn = await _connect(mesh, service_key, jwt)
    world = Store(mesh, Clock(), service_key, conn, {})
    try:
        yield world
    finally:
        for service in world.services:
            await service.stop()
        for c in [*world.conns, conn]:
            with contextlib.suppress(Exception):
                await c.close(drain_timeout=1)


async def test_one_shot_put_then_fetch_by_ranges_and_stat(store: Store) -> None:
    service = await store.start(ArtifactLimits())
    writer, colleague = await store.node(2)
    [stranger] = await store.node(1)
    data = os.urandom(300 * KiB + 7)
    part = await store.ok(writer, "put", {"data": b64(data), "media_type": "application/pdf", "name": "r.pdf"})
    assert part["size"] == len(data) and part["digest"] == digest_of(data) and part["name"] == "r.pdf"
    assert part["expires_at"] == "2027-01-29T08:00:00.000Z"  # default: task retention + 7 days = 14 d

    first = await store.ok(stranger, "fetch", {"ref": part["ref"], "length": 100_000})
    assert base64.b64decode(first["data"]) == data[:100_000] and first["eof"] is False
    tail = await store.ok(stranger, "fetch", {"ref": part["ref"], "offset": 300 * KiB})
    assert base64.b64decode(tail["data"]) == data[300 * KiB:] and tail["eof"] is True
    past = await store.ok(stranger, "fetch", {"ref": part["ref"], "offset": len(data) + 5})
    assert past["data"] == "" and past["eof"] is True
    clamped = await store.ok(stranger, "fetch", {"ref": part["ref"], "length": 10**9})
    assert clamped["length"] == min(len(data), service.chunk_max)

    # Reads need only the ref; the owner and writer are shown to the owner's agents alone.
    assert "owner" not in await store.ok(stranger, "stat", {"ref": part["ref"]})
    by_colleague = await store.ok(colleague, "stat", {"ref": part["ref"]})
    assert by_colleague["writer"] == writer.public_key and by_colleague["state"] == "live"

    # The bytes are an ordinary object store object: any NATS client reads them.
    record = service.index.entries[part["object_id"]]
    assert record["key"] == f"{store.owners[writer.public_key]}/{part['object_id']}"
    obj = await (await store.service_conn.jetstream.native.object_store(OBJECT_STORE_BUCKET)).get(record["key"])
    assert obj.data == data


async def test_an_upload_session_is_checked_chunk_by_chunk_and_at_the_end(store: Store) -> None:
    service = await store.start(ArtifactLimits())
    writer, other = await store.node(2)
    data = os.urandom(2 * chunk_budget(store.service_conn.max_payload) + 99)
    opened = await store.ok(writer, "put", {"media_type": "application/octet-stream", "size": len(data),
                                            "digest": digest_of(data)})
    upload, step = opened["upload"], opened["chunk_max"]
    assert step == service.chunk_max

    gap = await store.refused(writer, "put", {"upload": upload, "seq": 1, "data": b64(data[:10])})
    assert gap["code"] == "INPUT_INVALID" and gap["details"]["expected_seq"] == 0
    foreign = await store.refused(other, "put", {"upload": upload, "seq": 0, "data": b64(data[:10])})
    assert foreign["code"] == "UNAUTHORIZED"
    over = await store.refused(writer, "put", {"upload": upload, "seq": 0, "data": b64(os.urandom(step + 1))})
    assert over["code"] == "INPUT_INVALID"

    usage = await store.ok(writer, "usage", {})
    assert usage["reserved_bytes"] == len(data) and usage["reserved_objects"] == 1
    reply: dict[str, Any] = {}
    for seq, start in enumerate(range(0, len(data), step)):
        reply = await store.ok(writer, "put", {"upload": upload, "seq": seq, "data": b64(data[start:start + step])})
    assert reply["size"] == len(data) and reply["digest"] == digest_of(data)
    assert await store.fetch_all(other, reply["ref"]) == data
    usage = await store.ok(writer, "usage", {})
    assert (usage["bytes"], usage["objects"], usage["reserved_bytes"]) == (len(data), 1, 0)
    finished = await store.refused(writer, "put", {"upload": upload, "seq": 3, "data": b64(b"x")})
    assert finished["code"] == "NOT_FOUND"

    # Declared digest not matching the bytes: refused at the end, nothing stored, nothing reserved.
    lie = await store.upload(writer, data[:300_000], piece=100_000, digest=digest_of(b"something else"))
    assert lie["error"]["code"] == "INPUT_INVALID" and lie["error"]["details"]["reason"] == "digest_mismatch"
    usage = await store.ok(writer, "usage", {})
    assert (usage["objects"], usage["reserved_objects"]) == (1, 0)

    opened = await store.ok(writer, "put", {"media_type": "text/plain", "size": 5, "digest": digest_of(b"hello")})
    assert await store.ok(writer, "put", {"upload": opened["upload"], "abort": True}) == {
        "upload": opened["upload"], "aborted": True}
    assert (await store.ok(writer, "usage", {}))["reserved_objects"] == 0


async def test_writes_need_an_owner_and_reads_only_the_ref(store: Store) -> None:
    await store.start(ArtifactLimits())
    [writer] = await store.node(1)
    [drifter] = await store.node(1)
    del store.owners[drifter.public_key]  # not a registered agent: no owner can be established
    for payload in ({"data": b64(b"x"), "media_type": "text/plain"},
                    {"media_type": "text/plain", "size": 1, "digest": digest_of(b"x")}):
        refused = await store.refused(drifter, "put", payload)
        assert refused["code"] == "UNAUTHORIZED" and refused["details"]["reason"] == "unattributable"
    assert (await store.refused(drifter, "usage", {}))["code"] == "UNAUTHORIZED"
    part = await store.ok(writer, "put", {"data": b64(b"shared"), "media_type": "text/plain"})
    assert await store.fetch_all(drifter, part["ref"]) == b"shared"
    bad_digest = await store.refused(writer, "put", {"data": b64(b"x"), "media_type": "text/plain",
                                                     "digest": digest_of(b"y")})
    assert bad_digest["details"]["reason"] == "digest_mismatch"
    assert (await store.refused(writer, "put", {"data": "%%%", "media_type": "t/p"}))["code"] == "INPUT_INVALID"
    assert (await store.refused(writer, "put", {"data": b64(b"x")}))["details"]["member"] == "payload.media_type"


async def test_quota_counts_uploads_in_progress(store: Store) -> None:
    await store.start(ArtifactLimits(quota_bytes=1000 * KiB, quota_objects=2, max_object_bytes=800 * KiB))
    [writer] = await store.node(1)
    begin = {"media_type": "application/octet-stream", "size": 600 * KiB, "digest": digest_of(b"")}
    await store.ok(writer, "put", begin)
    second = await store.refused(writer, "put", begin)
    assert second["code"] == "QUOTA_EXCEEDED" and second["details"] == {
        "limit": "bytes", "quota": 1000 * KiB, "used": 600 * KiB, "requested": 600 * KiB}
    too_big = await store.refused(writer, "put", {**begin, "size": 801 * KiB})
    assert too_big["code"] == "PAYLOAD_TOO_LARGE" and too_big["details"]["max"] == 800 * KiB
    await store.ok(writer, "put", {"data": b64(b"a"), "media_type": "text/plain"})
    objects = await store.refused(writer, "put", {"data": b64(b"b"), "media_type": "text/plain"})
    assert objects["code"] == "QUOTA_EXCEEDED" and objects["details"]["limit"] == "objects"


async def test_expiry_answers_gone_and_the_sweep_keeps_a_tombstone(store: Store) -> None:
    service = await store.start(ArtifactLimits(upload_idle_s=600))
    [writer] = await store.node(1)
    data = os.urandom(200 * KiB)
    part = await store.ok(writer, "put", {"data": b64(data), "media_type": "application/octet-stream",
                                          "retention_s": 60})
    keep = await store.ok(writer, "put", {"data": b64(b"keep"), "media_type": "text/plain", "retention_s": 3600})
    idle = await store.ok(writer, "put", {"media_type": "text/plain", "size": 10 * KiB, "digest": digest_of(b"")})
    key = service.index.entries[part["object_id"]]["key"]

    store.clock.now += 61_000
    early = await store.refused(writer, "fetch", {"ref": part["ref"]})  # gone by lifetime, before any sweep
    assert early["code"] == "ARTIFACT_GONE" and early["details"]["reason"] == "expired"
    assert await service._object_info(key) is not None

    store.clock.now += 600_000
    assert await service.sweep() == {"reclaimed": 1, "aborted_uploads": 1}
    assert await service._object_info(key) is None  # the bytes are deleted ...
    gone = await store.refused(writer, "stat", {"ref": part["ref"]})
    assert gone["code"] == "ARTIFACT_GONE" and gone["retryable"] is False  # ... the ref still tells
    assert gone["details"] == {"ref": part["ref"], "size": len(data), "digest": digest_of(data),
                               "reason": "expired", "gone_at": "2027-01-15T08:11:01.000Z"}
    assert (await store.refused(writer, "put", {"upload": idle["upload"], "seq": 0, "data": b64(b"x")}))["code"] == "NOT_FOUND"
    usage = await store.ok(writer, "usage", {})
    assert (usage["objects"], usage["bytes"], usage["reserved_objects"]) == (1, 4, 0)
    assert await store.fetch_all(writer, keep["ref"]) == b"keep"
    assert await service.sweep() == {"reclaimed": 0, "aborted_uploads": 0}
    never = await store.refused(writer, "fetch", {"ref": "mesh:artifacts:" + "A" * 22})
    assert never["code"] == "NOT_FOUND"


async def test_remove_is_for_the_owner_only(store: Store) -> None:
    await store.start(ArtifactLimits())
    writer, colleague = await store.node(2)
    [stranger] = await store.node(1)
    part = await store.ok(writer, "put", {"data": b64(b"mine"), "media_type": "text/plain"})
    assert (await store.refused(stranger, "remove", {"ref": part["ref"]}))["code"] == "UNAUTHORIZED"
    assert await store.ok(colleague, "remove", {"ref": part["ref"]}) == {"ref": part["ref"], "removed": True}
    assert await store.ok(writer, "remove", {"ref": part["ref"]}) == {"ref": part["ref"], "removed": False,
                                                                      "state": "gone"}
    gone = await store.refused(stranger, "fetch", {"ref": part["ref"]})
    assert gone["details"]["reason"] == "removed" and gone["details"]["digest"] == digest_of(b"mine")


async def test_two_instances_serve_one_upload_between_them(store: Store) -> None:
    first = await store.start(ArtifactLimits())
    jwt = store.mesh.mint_node_credential(store.service_key.public_key, [], 300, role="service")
    other_conn = await _connect(store.mesh, store.service_key, jwt)
    store.conns.append(other_conn)
    second = await store.start(ArtifactLimits(), conn=other_conn)
    served: dict[int, int] = {0: 0, 1: 0}
    for i, service in enumerate((first, second)):
        original = service._put_chunk

        async def counted(env: Any, payload: Any, original: Any = original, i: int = i) -> Any:
            served[i] += 1
            return await original(env, payload)

        service._put_chunk = counted  # type: ignore[method-assign]
    [writer] = await store.node(1)
    data = os.urandom(4 * 1024 * KiB)
    reply = await store.upload(writer, data, piece=64 * KiB)
    assert reply["payload"]["digest"] == digest_of(data), reply
    assert served[0] and served[1], f"one instance served every chunk: {served}"
    assert hashlib.sha256(await store.fetch_all(writer, reply["payload"]["ref"])).hexdigest() == digest_of(data)[7:]


async def test_without_a_registry_at_hand_owners_come_from_the_registry_bucket(store: Store) -> None:
    js = store.service_conn.jetstream.native
    await ensure_key_value(store.service_conn.jetstream, registry_bucket_config(1))
    ctx = ServiceContext(connection=store.service_conn, key=store.service_key, node_id="N", now_ms=store.clock)
    service = ArtifactService(ctx)  # no owner_of: it reads mesh_registry itself
    await service.start()
    store.services.append(service)
    registered, unknown = await store.node(2)
    kv = await js.key_value("mesh_registry")
    await kv.put(registered.public_key, orjson.dumps({"id": registered.public_key, "owner": "UOWNER"}))
    part = await store.ok(registered, "put", {"data": b64(b"attributed"), "media_type": "text/plain"})
    assert service.index.entries[part["object_id"]]["owner"] == "UOWNER"
    refused = await store.refused(unknown, "put", {"data": b64(b"anonymous"), "media_type": "text/plain"})
    assert refused["code"] == "UNAUTHORIZED" and refused["details"]["reason"] == "unattributable"
