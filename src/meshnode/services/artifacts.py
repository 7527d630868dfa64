"""The artifact store service (§7.5, §7.5.2, §18.5, §18.7): bytes too big to travel inline.

Bytes live in the JetStream object store ``mesh_artifacts`` under the key
``{owner}/{object_id}``; each object's metadata lives in the KV bucket
``mesh_artifacts_index`` keyed by object id; chunked uploads in progress live
in ``mesh_artifacts_uploads``. Every operation is request-reply on the queue
group ``mesh_artifacts`` and keeps no state in the instance that a second
instance would need (uploads, quota and tombstones are all in JetStream), so
several instances may serve at once.

Every answer is a ``respond`` signed by the service key (see :mod:`.base`):
the payload below, or ``{status: "failed"}`` with a §12 ``error``. Bytes ride
standard base64 (RFC 4648 §4, padded) in ``data``; one message carries at most
``chunk_max`` raw bytes (:func:`meshnode.protocol.artifacts.chunk_budget` of the
transport's max payload), so objects larger than that are uploaded as a
session and read back by ranges.

Subjects and payloads (the contract):

``mesh.artifacts.put`` — four shapes, told apart by their members:
    *One shot* ``{data, media_type, name?, digest?, retention_s?}``: the whole
    object in one message. *Begin* ``{media_type, size, digest, name?,
    retention_s?}`` (no ``data``): opens an upload session and answers
    ``{upload, chunk_max, expires_at}``. *Chunk* ``{upload, seq, data}``:
    ``seq`` counts from 0 with no gaps; answers ``{upload, seq, received}``,
    and the chunk that completes ``size`` finalizes: the stored bytes are read
    back and must match ``size`` and ``digest`` (else ``INPUT_INVALID`` with
    ``details.reason`` ``digest_mismatch``/``size_mismatch`` and the upload is
    discarded). *Abort* ``{upload, abort: true}`` → ``{upload, aborted: true}``.
    A stored object answers with its ref part plus the store's facts:
    ``{ref, media_type, size, digest, name?, expires_at, object_id}``.
    ``retention_s`` defaults to the task retention plus 7 days (§7.5.2).
    Errors: ``UNAUTHORIZED`` (``details.reason: "unattributable"``: the writer
    is not a registered agent, so no owner can be established; or a chunk for
    somebody else's upload), ``QUOTA_EXCEEDED`` (``details.limit``:
    ``bytes``/``objects``/``retention_s``/``store_capacity``, with
    ``quota``/``used``/``requested``), ``PAYLOAD_TOO_LARGE`` (``details.limit:
    "max_object_bytes"``), ``INPUT_INVALID`` (``details.member``), ``NOT_FOUND``
    for an unknown or expired upload.

``mesh.artifacts.fetch``
    ``{ref, offset?: 0, length?: chunk_max}`` → ``{ref, offset, data, length,
    size, digest, media_type, name?, eof}``: ``length`` is clamped to
    ``chunk_max``; ``size``/``digest`` are the ones recorded at write time (the
    reader verifies the bytes against them or against the ref part it holds);
    ``eof`` says no bytes follow. ``NOT_FOUND`` for a ref that never existed
    here (``details.reason: "unknown_scheme"`` for another store's ref);
    ``ARTIFACT_GONE`` with ``details {ref, size, digest, gone_at, reason:
    "expired"|"removed"|"missing"}`` for one whose bytes are gone.

``mesh.artifacts.stat``
    ``{ref}`` → ``{ref, media_type, size, digest, name?, created_at,
    expires_at, state: "live"}``, plus ``owner`` and ``writer`` when the caller
    belongs to the object's owner (a ref does not reveal its owner to whoever
    it is forwarded to, §18.5). Same errors as fetch.

``mesh.artifacts.remove``
    ``{ref}`` → ``{ref, removed: true}`` (the bytes are deleted now; the ref
    answers ``ARTIFACT_GONE`` from then on), ``{ref, removed: false, state:
    "gone"}`` when already gone. The owner only: ``UNAUTHORIZED`` otherwise.

``mesh.artifacts.usage``
    ``{}`` → ``{owner, bytes, objects, reserved_bytes, reserved_objects,
    quota_bytes, quota_objects, max_object_bytes, default_retention_s,
    max_retention_s, chunk_max}`` for the caller's owner.

Reclaim: :meth:`ArtifactService.sweep` (every ``sweep_interval_s``, and
callable) deletes the bytes of expired objects and keeps their index entry as
a tombstone (``state: "gone"``, size and digest unchanged), so the ref keeps
answering ``ARTIFACT_GONE`` and never collapses into ``NOT_FOUND``; it also
discards uploads idle past ``upload_idle_s``. An object whose lifetime has
passed answers ``ARTIFACT_GONE`` even before the sweep reaches it.

Rate limits: opening anything (one-shot put, begin, stat, remove, usage, a
fetch at offset 0) counts against the platform's shared per-sender budget
(§16.1); continuation messages (chunks of an open upload, fetches past offset
0) count against a separate, larger per-sender transfer budget, so moving a
large object is bounded by its size, not by the request budget.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import secrets
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import orjson

from meshnode.node.periodic import PeriodicJob
from meshnode.protocol import subjects
from meshnode.protocol.artifacts import (
    INDEX_BUCKET,
    UPLOADS_BUCKET,
    chunk_budget,
    object_id_of,
    ref_for,
    ref_part,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.ratelimit import SlidingWindowLimiter
from meshnode.protocol.rests_on import is_valid_digest
from meshnode.protocol.timeutil import format_ts
from meshnode.transport.connection import Message
from meshnode.transport.errors import Conflict, NotFound, TransportError
from meshnode.transport.jetstream import KV_DELETE_OPS
from meshnode.transport.streams import artifact_buckets, ensure_key_value, ensure_object_store

from .artifact_chunks import PIECE, STREAM, ChunkedObjects, _chunk_subject
from .artifact_limits import ArtifactLimits, OwnerResolver, check_limits, registry_owner_resolver
from .artifact_payloads import _b64decode, _int, _new_id, _payload, _str
from .base import Envelope, KVMirror, ServiceBase, ServiceContext

__all__ = [
    "PIECE",
    "STREAM",
    "ArtifactLimits",
    "ArtifactService",
    "OwnerResolver",
    "artifact_buckets",
    "registry_owner_resolver",
]


class ArtifactService(ChunkedObjects, ServiceBase):
    """The artifact store (module docstring)."""

    def __init__(
        self,
        ctx: ServiceContext,
        *,
        owner_of: OwnerResolver | None = None,
        limits: ArtifactLimits | None = None,
        sync_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(ctx, name="artifacts", queue="mesh_artifacts")
        self.limits = limits or ArtifactLimits()
        self.owner_of: OwnerResolver = owner_of or registry_owner_resolver(ctx)
        self._sync_timeout_s = sync_timeout_s
        self._index: KVMirror | None = None
        self._uploads: KVMirror | None = None
        self._maps: OrderedDict[str, list[tuple[int, int, int]]] = OrderedDict()
        self._transfer = SlidingWindowLimiter(limit=self.limits.transfer_limit, window_ms=60_000)
        self._sweeper: PeriodicJob | None = None

    # -- lifecycle -------------------------------------------------------------

    @property
    def chunk_max(self) -> int:
        """Raw bytes one message carries on this mesh (§18.9)."""
        return chunk_budget(self.ctx.connection.max_payload)

    async def start(self) -> None:
        """Create or open the buckets, load the index, then serve."""
        if self.running:
            return
        js = self.ctx.connection.jetstream
        store, index, uploads = artifact_buckets(self.ctx.replicas, self.ctx.stream_limits)
        await ensure_object_store(js, store)
        for config in (index, uploads):
            await ensure_key_value(js, config)
        self._index = KVMirror(self, await js.key_value(INDEX_BUCKET), "index")
        self._uploads = KVMirror(self, await js.key_value(UPLOADS_BUCKET), "uploads")
        self._running = True
        try:
            await self._index.start(self._sync_timeout_s)
            await self._uploads.start(self._sync_timeout_s)
        except BaseException:
            await self.stop()
            raise
        self.hook_reconnect(self._on_reconnect)
        await self.serve(subjects.ARTIFACTS_PUT, self._put)
        await self.serve(subjects.ARTIFACTS_FETCH, self._fetch)
        await self.serve(subjects.ARTIFACTS_STAT, self._stat)
        await self.serve(subjects.ARTIFACTS_REMOVE, self._remove)
        await self.serve(subjects.ARTIFACTS_USAGE, self._usage)
        await self.ctx.connection.flush()
        self._sweeper = PeriodicJob(
            "artifact-sweep", self._sweep_job, self.limits.sweep_interval_s, jitter=0.1, logger=self.log
        )
        self._sweeper.start()

    async def stop(self) -> None:
        if self._sweeper is not None:
            await self._sweeper.stop()
            self._sweeper = None
        await super().stop()

    async def _on_reconnect(self) -> None:
        # An ordered consumer can miss changes across a reconnect; a fresh
        # watch replays the latest value of every key, deletions included.
        if self.running:
            for mirror in (self._index, self._uploads):
                if mirror is not None:
                    mirror.restart()

    @property
    def index(self) -> KVMirror:
        assert self._index is not None, "the artifact service is not started"
        return self._index

    @property
    def uploads(self) -> KVMirror:
        assert self._uploads is not None, "the artifact service is not started"
        return self._uploads

    # -- admission: two budgets --------------------------------------------------

    async def admit(self, msg: Message, env: Envelope) -> bool:
        payload = env.get("payload")
        payload = payload if isinstance(payload, Mapping) else {}
        continuation = (msg.subject == subjects.ARTIFACTS_PUT and "upload" in payload) or (
            msg.subject == subjects.ARTIFACTS_FETCH and payload.get("offset") not in (None, 0)
        )
        if not continuation:
            return await super().admit(msg, env)
        decision = self._transfer.check(env["from"], self.ctx.now_ms())
        if decision.allowed:
            return True
        await self.reply(
            msg,
            env,
            error=ProtocolError(
                "RATE_LIMITED",
                "too many artifact transfer messages",
                {"limit": self._transfer.limit, "window_ms": self._transfer.window_ms},
                retry_after_ms=decision.retry_after_ms,
            ).to_object(),
        )
        return False

    # -- accounting ----------------------------------------------------------------

    async def _owner(self, agent_id: str) -> str:
        owner = await self.owner_of(agent_id)
        if not owner:
            # §7.5.2: a store that cannot establish the owner refuses the write.
            raise ProtocolError(
                "UNAUTHORIZED",
                "writes are accepted only from registered agents (no owner can be established)",
                {"reason": "unattributable", "agent_id": agent_id},
            )
        return owner

    def usage_of(self, owner: str) -> dict[str, int]:
        """Stored and reserved (uploads in progress) bytes and objects of ``owner``."""
        stored = [r for r in self.index.entries.values() if r.get("owner") == owner and r.get("state") == "live"]
        pending = [r for r in self.uploads.entries.values() if r.get("owner") == owner]
        return {
            "bytes": sum(int(r.get("size", 0)) for r in stored),
            "objects": len(stored),
            "reserved_bytes": sum(int(r.get("size", 0)) for r in pending),
            "reserved_objects": len(pending),
        }

    def _check_limits(self, owner: str, size: int, retention_s: int, *, exclude_upload: str | None = None) -> None:
        usage = self.usage_of(owner)
        if exclude_upload is not None:
            mine = self.uploads.entries.get(exclude_upload)
            if mine is not None:
                usage["reserved_bytes"] -= int(mine.get("size", 0))
                usage["reserved_objects"] -= 1
        check_limits(self.limits, usage, size, retention_s)

    def _retention(self, payload: Mapping[str, Any]) -> int:
        if payload.get("retention_s") is None:
            return self.limits.default_retention_s
        return _int(payload, "retention_s", minimum=1)

    # -- index records ----------------------------------------------------------------

    async def _record(self, ref: object) -> dict[str, Any]:
        """The index record behind ``ref``; NOT_FOUND when this store never minted it."""
        if not isinstance(ref, str) or not ref:
            raise ProtocolError("INPUT_INVALID", "ref is a non-empty string", {"member": "payload.ref"})
        object_id = object_id_of(ref)
        if object_id is None:
            raise ProtocolError(
                "NOT_FOUND",
                "no such object on this mesh (not a ref this store minted)",
                {"ref": ref, "reason": "unknown_scheme" if not ref.startswith("mesh:artifacts:") else "malformed"},
            )
        record = self.index.entries.get(object_id)
        if record is None:
            # Another instance may have just written it; the KV is authoritative.
            record, _ = await self.index.get(object_id)
        if record is None:
            raise ProtocolError("NOT_FOUND", "no such object on this mesh", {"ref": ref})
        return record

    def _gone(self, record: Mapping[str, Any], reason: str | None = None) -> ProtocolError:
        gone_ms = record.get("gone_ms") or record.get("expires_ms")
        details: dict[str, Any] = {
            "ref": record["ref"],
            "size": record["size"],
            "digest": record["digest"],
            "reason": reason or record.get("gone_reason") or "expired",
        }
        if isinstance(gone_ms, int):
            details["gone_at"] = format_ts(gone_ms)
        return ProtocolError(
            "ARTIFACT_GONE", "the artifact existed and its bytes have been reclaimed", details
        )

    def _live(self, record: Mapping[str, Any]) -> None:
        """Raise ARTIFACT_GONE unless the record's bytes are (still) to be served."""
        if record.get("state") != "live":
            raise self._gone(record)
        if int(record.get("expires_ms", 0)) <= self.ctx.now_ms():
            raise self._gone(record, "expired")

    def _part(self, record: Mapping[str, Any]) -> dict[str, Any]:
        part = ref_part(
            record["ref"],
            media_type=record["media_type"],
            size=record["size"],
            digest=record["digest"],
            name=record.get("name"),
        )
        part["expires_at"] = format_ts(int(record["expires_ms"]))
        part["object_id"] = record["object_id"]
        return part

    async def _store(
        self,
        *,
        object_id: str,
        owner: str,
        writer: str,
        media_type: str,
        name: str | None,
        size: int,
        digest: str,
        retention_s: int,
        nuid: str,
        chunks: int,
        sha: bytes,
    ) -> dict[str, Any]:
        now = self.ctx.now_ms()
        key = f"{owner}/{object_id}"
        await self._commit(key, nuid, size, chunks, sha, now)
        record: dict[str, Any] = {
            "object_id": object_id,
            "ref": ref_for(object_id),
            "key": key,
            "owner": owner,
            "writer": writer,
            "media_type": media_type,
            "size": size,
            "digest": digest,
            "created_ms": now,
            "expires_ms": now + retention_s * 1000,
            "retention_s": retention_s,
            "state": "live",
        }
        if name is not None:
            record["name"] = name
        try:
            revision = await self.index.kv.create(object_id, orjson.dumps(record))
        except BaseException:
            await self._delete_object(key)
            raise
        self.index.wrote(object_id, revision, record)
        self.log.info("stored %s (%d bytes) for %s, written by %s", record["ref"], size, owner, writer)
        return self._part(record)

    # -- put --------------------------------------------------------------------------

    async def _put(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        payload = _payload(env)
        if "upload" in payload:
            return await self._put_chunk(env, payload)
        writer = env["from"]
        owner = await self._owner(writer)
        media_type = _str(payload, "media_type", required=True, max_len=255)
        assert media_type is not None
        name = _str(payload, "name")
        retention_s = self._retention(payload)
        if "data" in payload:
            return await self._put_whole(writer, owner, media_type, name, retention_s, payload)
        size = _int(payload, "size")
        digest = payload.get("digest")
        if not is_valid_digest(digest):
            raise ProtocolError(
                "INPUT_INVALID", "digest is sha256:<64 lowercase hex>", {"member": "payload.digest"}
            )
        self._check_limits(owner, size, retention_s)
        if size == 0:
            return await self._put_whole(writer, owner, media_type, name, retention_s, {"data": "", "digest": digest})
        upload = _new_id()
        now = self.ctx.now_ms()
        record: dict[str, Any] = {
            "upload": upload,
            "object_id": _new_id(),
            "owner": owner,
            "writer": writer,
            "media_type": media_type,
            "size": size,
            "digest": digest,
            "retention_s": retention_s,
            "nuid": secrets.token_hex(11),
            "next_seq": 0,
            "received": 0,
            "pieces": 0,
            "touched_ms": now,
        }
        if name is not None:
            record["name"] = name
        revision = await self.uploads.kv.create(upload, orjson.dumps(record))
        self.uploads.wrote(upload, revision, record)
        return {
            "upload": upload,
            "chunk_max": self.chunk_max,
            "expires_at": format_ts(now + int(self.limits.upload_idle_s * 1000)),
        }

    async def _put_whole(
        self,
        writer: str,
        owner: str,
        media_type: str,
        name: str | None,
        retention_s: int,
        payload: Mapping[str, Any],
    ) -> Mapping[str, Any]:
        data = _b64decode(payload.get("data"), "payload.data")
        declared = payload.get("digest")
        if declared is not None and not is_valid_digest(declared):
            raise ProtocolError(
                "INPUT_INVALID", "digest is sha256:<64 lowercase hex>", {"member": "payload.digest"}
            )
        sha = hashlib.sha256(data).digest()
        digest = "sha256:" + sha.hex()
        if declared is not None and declared != digest:
            raise ProtocolError(
                "INPUT_INVALID",
                "the bytes do not match the declared digest",
                {"member": "payload.digest", "reason": "digest_mismatch", "expected": declared, "actual": digest},
            )
        self._check_limits(owner, len(data), retention_s)
        nuid = secrets.token_hex(11)
        seqs: list[int] = []
        try:
            seqs = await self._write(nuid, data)
        except BaseException:
            await self._purge(_chunk_subject(nuid))
            raise
        layout, offset = [], 0
        for seq in seqs:
            size = min(PIECE, len(data) - offset)
            layout.append((seq, offset, size))
            offset += size
        self._remember_layout(nuid, layout)
        return await self._store(
            object_id=_new_id(), owner=owner, writer=writer, media_type=media_type, name=name,
            size=len(data), digest=digest, retention_s=retention_s, nuid=nuid, chunks=len(seqs), sha=sha,
        )

    async def _put_chunk(self, env: Envelope, payload: Mapping[str, Any]) -> Mapping[str, Any]:
        upload = payload.get("upload")
        if not isinstance(upload, str) or not upload:
            raise ProtocolError("INPUT_INVALID", "upload is a string", {"member": "payload.upload"})
        record, revision = await self.uploads.get(upload)
        if record is None or self._upload_expired(record):
            raise ProtocolError("NOT_FOUND", "no such upload in progress", {"upload": upload})
        if record.get("writer") != env["from"]:
            raise ProtocolError(
                "UNAUTHORIZED", "an upload is continued only by the agent that began it", {"upload": upload}
            )
        if payload.get("abort") is True:
            await self._discard_upload(record)
            return {"upload": upload, "aborted": True}
        seq = _int(payload, "seq")
        if seq != record["next_seq"]:
            raise ProtocolError(
                "INPUT_INVALID",
                f"chunk {seq} arrived where chunk {record['next_seq']} was expected",
                {"member": "payload.seq", "reason": "out_of_order", "expected_seq": record["next_seq"]},
            )
        data = _b64decode(payload.get("data"), "payload.data")
        if not data or len(data) > self.chunk_max or record["received"] + len(data) > record["size"]:
            raise ProtocolError(
                "INPUT_INVALID",
                "a chunk holds 1..chunk_max bytes and never more than the declared size",
                {"member": "payload.data", "received": record["received"], "size": record["size"]},
            )
        written = await self._write(record["nuid"], data)
        updated = {
            **record,
            "next_seq": seq + 1,
            "received": record["received"] + len(data),
            "pieces": record["pieces"] + len(written),
            "touched_ms": self.ctx.now_ms(),
        }
        try:
            new_revision = await self.uploads.kv.update(upload, orjson.dumps(updated), last=revision)
        except Conflict:
            # Two writers raced on one upload; the bytes now on the chunk subject
            # cannot be trusted to be in order.
            await self._discard_upload(record)
            raise ProtocolError(
                "INPUT_INVALID", "chunks of one upload were sent concurrently; the upload is discarded",
                {"member": "payload.seq", "reason": "concurrent_chunks"},
            ) from None
        self.uploads.wrote(upload, new_revision, updated)
        if updated["received"] < updated["size"]:
            return {"upload": upload, "seq": seq, "received": updated["received"]}
        return await self._finalize(updated)

    async def _finalize(self, record: dict[str, Any]) -> Mapping[str, Any]:
        layout, sha = await self._walk(record["nuid"], record["pieces"])
        stored = sum(size for _, _, size in layout)
        actual = "sha256:" + sha.hexdigest()
        try:
            if stored != record["size"]:
                raise ProtocolError(
                    "INPUT_INVALID", "the stored bytes do not add up to the declared size",
                    {"member": "payload.size", "reason": "size_mismatch", "expected": record["size"], "actual": stored},
                )
            if actual != record["digest"]:
                raise ProtocolError(
                    "INPUT_INVALID", "the bytes do not match the declared digest",
                    {"member": "payload.digest", "reason": "digest_mismatch", "expected": record["digest"], "actual": actual},
                )
            # Re-checked at the end: another instance may have stored meanwhile.
            self._check_limits(record["owner"], record["size"], record["retention_s"], exclude_upload=record["upload"])
        except ProtocolError:
            await self._discard_upload(record)
            raise
        self._remember_layout(record["nuid"], layout)
        part = await self._store(
            object_id=record["object_id"], owner=record["owner"], writer=record["writer"],
            media_type=record["media_type"], name=record.get("name"), size=record["size"],
            digest=record["digest"], retention_s=record["retention_s"], nuid=record["nuid"],
            chunks=len(layout), sha=sha.digest(),
        )
        await self._forget_upload(record["upload"])
        return part

    def _upload_expired(self, record: Mapping[str, Any]) -> bool:
        idle_ms = int(self.limits.upload_idle_s * 1000)
        return int(record.get("touched_ms", 0)) + idle_ms <= self.ctx.now_ms()

    async def _forget_upload(self, upload: str) -> None:
        with contextlib.suppress(NotFound):
            await self.uploads.kv.delete(upload)
        self.uploads.entries.pop(upload, None)

    async def _discard_upload(self, record: Mapping[str, Any]) -> None:
        await self._purge(_chunk_subject(record["nuid"]))
        self._maps.pop(record["nuid"], None)
        await self._forget_upload(record["upload"])

    # -- fetch / stat / remove / usage ------------------------------------------------

    async def _fetch(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        payload = _payload(env)
        record = await self._record(payload.get("ref"))
        self._live(record)
        offset = _int(payload, "offset", default=0)
        length = min(_int(payload, "length", default=self.chunk_max, minimum=1), self.chunk_max)
        info = await self._object_info(record["key"])
        if info is None:
            raise self._gone(record, "missing")
        try:
            data = await self._read(info, offset, length)
        except NotFound:
            raise self._gone(record, "missing") from None
        stored = int(info.get("size") or 0)
        reply: dict[str, Any] = {
            "ref": record["ref"],
            "offset": offset,
            "length": len(data),
            "data": base64.b64encode(data).decode(),
            "size": record["size"],
            "digest": record["digest"],
            "media_type": record["media_type"],
            "eof": offset + len(data) >= stored,
        }
        if record.get("name") is not None:
            reply["name"] = record["name"]
        return reply

    async def _stat(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        record = await self._record(_payload(env).get("ref"))
        self._live(record)
        out = ref_part(
            record["ref"], media_type=record["media_type"], size=record["size"],
            digest=record["digest"], name=record.get("name"),
        )
        out.update(
            created_at=format_ts(int(record["created_ms"])),
            expires_at=format_ts(int(record["expires_ms"])),
            state="live",
        )
        caller_owner = await self.owner_of(env["from"])
        if env["from"] == record.get("writer") or (caller_owner and caller_owner == record.get("owner")):
            out.update(owner=record["owner"], writer=record["writer"])
        return out

    async def _remove(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        record = await self._record(_payload(env).get("ref"))
        caller_owner = await self.owner_of(env["from"])
        if not caller_owner or caller_owner != record.get("owner"):
            raise ProtocolError(
                "UNAUTHORIZED", "only the object's owner removes it", {"ref": record["ref"]}
            )
        if record.get("state") != "live" or not await self._reclaim(record, "removed"):
            return {"ref": record["ref"], "removed": False, "state": "gone"}
        return {"ref": record["ref"], "removed": True}

    async def _usage(self, msg: Message, env: Envelope) -> Mapping[str, Any]:
        owner = await self._owner(env["from"])
        limits = self.limits
        return {
            "owner": owner,
            **self.usage_of(owner),
            "quota_bytes": limits.quota_bytes,
            "quota_objects": limits.quota_objects,
            "max_object_bytes": limits.max_object_bytes,
            "default_retention_s": limits.default_retention_s,
            "max_retention_s": limits.max_retention_s,
            "chunk_max": self.chunk_max,
        }

    # -- reclaim ------------------------------------------------------------------------

    async def _reclaim(self, record: Mapping[str, Any], reason: str) -> bool:
        """Delete the bytes, keep the record as a tombstone (size and digest unchanged)."""
        object_id = record["object_id"]
        current, revision = await self.index.get(object_id)
        if current is None or current.get("state") != "live":
            return False
        await self._delete_object(current["key"])
        tombstone = {**current, "state": "gone", "gone_ms": self.ctx.now_ms(), "gone_reason": reason}
        try:
            new_revision = await self.index.kv.update(object_id, orjson.dumps(tombstone), last=revision)
        except Conflict:
            return False  # another instance wrote it meanwhile; its write stands
        self.index.wrote(object_id, new_revision, tombstone)
        self.log.info("reclaimed %s (%s)", current["ref"], reason)
        return True

    async def sweep(self, now_ms: int | None = None) -> dict[str, int]:
        """Reclaim every expired object and discard idle uploads; returns the counts."""
        now = self.ctx.now_ms() if now_ms is None else now_ms
        reclaimed = aborted = 0
        for record in list(self.index.entries.values()):
            if record.get("state") == "live" and int(record.get("expires_ms", 0)) <= now:
                try:
                    reclaimed += await self._reclaim(record, "expired")
                except TransportError as exc:
                    if exc.code is None:  # not a JetStream API refusal (a timeout, a disconnect)
                        raise
                    self.log.warning("reclaiming %s failed: %s", record.get("ref"), exc)
        idle_ms = int(self.limits.upload_idle_s * 1000)
        for record in list(self.uploads.entries.values()):
            if int(record.get("touched_ms", 0)) + idle_ms <= now:
                await self._discard_upload(record)
                aborted += 1
        with contextlib.suppress(Exception):
            await self._purge_upload_markers(now)
        if reclaimed or aborted:
            self.log.info("sweep reclaimed %d artifact(s), discarded %d idle upload(s)", reclaimed, aborted)
        return {"reclaimed": reclaimed, "aborted_uploads": aborted}

    async def _purge_upload_markers(self, now_ms: int) -> None:
        # Every finished upload leaves a delete marker under its unique key;
        # drop the ones every watcher has long seen, so the bucket stays small.
        kv = self.uploads.kv
        watcher = await kv.watch_all()
        old: list[str] = []
        try:
            async for entry in watcher:
                if entry is None:
                    break
                if (
                    entry.operation in KV_DELETE_OPS
                    and entry.created_ms is not None
                    and now_ms - entry.created_ms > self.limits.upload_idle_s * 1000
                ):
                    old.append(entry.key)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()
        for key in old:
            await self.ctx.connection.jetstream.purge_subject(
                f"KV_{UPLOADS_BUCKET}", f"$KV.{UPLOADS_BUCKET}.{key}"
            )

    async def _sweep_job(self) -> None:
        await self.sweep()
