"""The artifact bytes at the level of JetStream chunk messages (the ``mesh_artifacts`` object store).

The service writes and reads the object store stream directly, in the layout
any object store client reads: chunks of :data:`PIECE` bytes on
``$O.{bucket}.C.{nuid}`` and one meta record per key on ``$O.{bucket}.M.{key}``
(rolled up). Reads remember each object's chunk layout (sequence, offset, length)
so a ranged fetch reads only the chunks it needs.

Split out of :mod:`.artifacts` (issue #16) as a mixin of
:class:`~.artifacts.ArtifactService`, which supplies ``ctx`` and ``_maps``.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import orjson

from meshnode.protocol.artifacts import OBJECT_STORE_BUCKET
from meshnode.protocol.errors import ProtocolError
from meshnode.transport.errors import NotFound, StoreFull

from .base import ServiceContext

__all__ = ["PIECE", "STREAM", "ChunkedObjects"]

#: Size of each stored chunk message (the object store's customary default).
PIECE = 128 * 1024
STREAM = f"OBJ_{OBJECT_STORE_BUCKET}"
_CHUNK_MAPS = 256  # chunk layouts remembered per instance


def _meta_subject(key: str) -> str:
    return f"$O.{OBJECT_STORE_BUCKET}.M.{base64.urlsafe_b64encode(key.encode()).decode()}"


def _chunk_subject(nuid: str) -> str:
    return f"$O.{OBJECT_STORE_BUCKET}.C.{nuid}"


class ChunkedObjects:
    """Chunk-level reads and writes of the artifact object store (module docstring)."""

    ctx: ServiceContext
    _maps: OrderedDict[str, list[tuple[int, int, int]]]

    async def _publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> int:
        try:
            ack = await self.ctx.connection.jetstream.publish(subject, data, headers=headers)
        except StoreFull:
            # account limits, insufficient resources, storage exceeded, store failed (full)
            raise ProtocolError(
                "QUOTA_EXCEEDED",
                "the store is full",
                {"limit": "store_capacity"},
            ) from None
        return ack.seq

    async def _write(self, nuid: str, data: bytes) -> list[int]:
        """Append ``data`` to the chunk subject of ``nuid``; the stream sequences written."""
        subject = _chunk_subject(nuid)
        return [await self._publish(subject, data[i : i + PIECE]) for i in range(0, len(data), PIECE)]

    async def _purge(self, subject: str) -> None:
        with contextlib.suppress(NotFound):
            await self.ctx.connection.jetstream.purge_subject(STREAM, subject)

    async def _commit(self, key: str, nuid: str, size: int, chunks: int, sha: bytes, now_ms: int) -> None:
        """Publish the object's meta record, which makes it readable by any object store client."""
        info = {
            "name": key,
            "bucket": OBJECT_STORE_BUCKET,
            "nuid": nuid,
            "size": size,
            "chunks": chunks,
            "digest": "SHA-256=" + base64.urlsafe_b64encode(sha).decode(),
            "mtime": datetime.fromtimestamp(now_ms / 1000, UTC).isoformat(),
            "options": {"max_chunk_size": PIECE},
        }
        await self._publish(_meta_subject(key), orjson.dumps(info), headers={"Nats-Rollup": "sub"})

    async def _object_info(self, key: str) -> dict[str, Any] | None:
        """The object store's current meta record for ``key`` (None when absent or deleted)."""
        try:
            msg = await self.ctx.connection.jetstream.last_message(STREAM, _meta_subject(key), direct=True)
        except NotFound:
            return None
        try:
            info = orjson.loads(msg.data or b"")
        except orjson.JSONDecodeError:
            return None
        if not isinstance(info, dict) or info.get("deleted") or not isinstance(info.get("nuid"), str):
            return None
        return info

    async def _delete_object(self, key: str) -> None:
        info = await self._object_info(key)
        if info is not None:
            await self._purge(_chunk_subject(info["nuid"]))
            self._maps.pop(info["nuid"], None)
        await self._purge(_meta_subject(key))

    async def _walk(self, nuid: str, chunks: int) -> tuple[list[tuple[int, int, int]], Any]:
        """Read every chunk of ``nuid`` in order: its layout ``[(seq, start, length)]``
        and the SHA-256 of its bytes (what is stored, not what was claimed)."""
        js = self.ctx.connection.jetstream
        subject = _chunk_subject(nuid)
        layout: list[tuple[int, int, int]] = []
        sha = hashlib.sha256()
        seq, offset = 1, 0
        for _ in range(chunks):
            try:
                msg = await js.message(STREAM, seq=seq, subject=subject, next=True, direct=True)
            except NotFound:
                break
            data = msg.data or b""
            layout.append((msg.seq or 0, offset, len(data)))
            sha.update(data)
            offset += len(data)
            seq = (msg.seq or 0) + 1
        return layout, sha

    def _remember_layout(self, nuid: str, layout: list[tuple[int, int, int]]) -> None:
        self._maps[nuid] = layout
        self._maps.move_to_end(nuid)
        while len(self._maps) > _CHUNK_MAPS:
            self._maps.popitem(last=False)

    async def _layout(self, info: Mapping[str, Any]) -> list[tuple[int, int, int]]:
        nuid: str = info["nuid"]
        layout = self._maps.get(nuid)
        if layout is None:
            layout, _ = await self._walk(nuid, int(info.get("chunks") or 0))
            self._remember_layout(nuid, layout)
        else:
            self._maps.move_to_end(nuid)
        return layout

    async def _read(self, info: Mapping[str, Any], offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset+length)`` of the stored object, as stored."""
        layout = await self._layout(info)
        if not layout or length <= 0:
            return b""
        starts = [start for _, start, _ in layout]
        i = max(0, bisect.bisect_right(starts, offset) - 1)
        out = bytearray()
        end = offset + length
        js = self.ctx.connection.jetstream
        while i < len(layout) and layout[i][1] < end:
            seq, start, size = layout[i]
            if start + size > offset:
                try:
                    msg = await js.message(STREAM, seq=seq, direct=True)
                except NotFound:
                    self._maps.pop(info["nuid"], None)  # rewritten underneath us; relearn next time
                    raise
                data = msg.data or b""
                out += data[max(0, offset - start) : min(size, end - start)]
            i += 1
        return bytes(out)
