"""The node's side of the artifact store (§7.5, §18.7, §18.9): put, fetch, stat, spill.

:class:`ArtifactClient` speaks the store's payload contract (see
:mod:`meshnode.services.artifacts`) as one hosted agent, through
``Node.service_call`` (signed requests, bound and key-pinned replies). It
uploads anything larger than one message as a session of chunks, fetches by
ranges, and verifies every fetched object against the digest and size the
caller holds (§7.5.1: a mismatch is a failed fetch).

:func:`spill_oversized_output` is what lets a handler return more than the
transport carries (§6.4b, §18.9): the output is stored as an artifact and the
respond carries a ref part instead.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from meshnode.protocol import subjects
from meshnode.protocol.artifacts import (
    REF_SCHEME,
    FileAttachment,
    chunk_budget,
    validate_ref_part,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.rests_on import Verdict, digest_of, freshness, validate_rests_on
from meshnode.protocol.timeutil import format_ts

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent

__all__ = [
    "RESPOND_ALLOWANCE",
    "ArtifactClient",
    "ArtifactIntegrityError",
    "Progress",
    "artifact_object",
    "ref_part_of",
    "spill_oversized_output",
]

#: ``progress(done_bytes, total_bytes)``: once with 0 when the size is known, then after every chunk.
Progress = Callable[[int, int], None]
#: Room kept for a respond's envelope around its output when judging the fit.
RESPOND_ALLOWANCE = 4096
#: Seconds allowed per byte for the store to read an object back (on top of a floor).
_READBACK_S_PER_BYTE = 1 / (8 * 1024**2)


class ArtifactIntegrityError(ProtocolError):
    """A fetched object's bytes do not match the digest or size its ref promised (§7.5.1).

    A failed fetch, never returned as data. Code ``DEPENDENCY_FAILED`` (the
    store is the dependency that failed), ``details.reason`` ``digest_mismatch``
    or ``size_mismatch``.
    """

    def __init__(self, ref: str, reason: str, expected: Any, actual: Any) -> None:
        super().__init__(
            "DEPENDENCY_FAILED",
            f"fetched bytes of {ref} do not match the {'digest' if reason == 'digest_mismatch' else 'size'} it promised",
            {"ref": ref, "reason": reason, "expected": expected, "actual": actual},
        )


def _ref_and_part(target: str | Mapping[str, Any] | FileAttachment) -> tuple[str, Mapping[str, Any]]:
    if isinstance(target, FileAttachment):
        return target.part()["ref"], target.part()
    if isinstance(target, str):
        return target, {}
    if isinstance(target, Mapping) and isinstance(target.get("ref"), str):
        return target["ref"], target
    raise ProtocolError("INPUT_INVALID", "expected a ref, a ref part or a ref file", {"member": "ref"})


def _too_large(ref: str, size: int, limit: int) -> ProtocolError:
    return ProtocolError(
        "PAYLOAD_TOO_LARGE", f"{ref} holds {size} bytes, more than the {limit} allowed",
        {"ref": ref, "size": size, "limit": limit},
    )


def _check_scheme(ref: str) -> None:
    if not ref.startswith(REF_SCHEME):
        # §7.5.1: a ref whose scheme no store here answers for is unresolvable;
        # it is never guessed at (and never fetched as if it were a URL).
        raise ProtocolError(
            "NOT_FOUND", "unresolvable reference: no store on this node answers for it",
            {"ref": ref, "reason": "unknown_scheme"},
        )


def ref_part_of(reply: Mapping[str, Any]) -> dict[str, Any]:
    """The §7.5 ref part inside a store reply (which also carries ``expires_at``, ``object_id``)."""
    return {k: reply[k] for k in ("ref", "media_type", "size", "digest", "name") if k in reply}


class ArtifactClient:
    """The artifact store, as one hosted agent sees it (writer = that agent)."""

    def __init__(self, hosted: HostedAgent) -> None:
        self.hosted = hosted
        self.node = hosted.node

    @property
    def chunk_max(self) -> int:
        """Raw bytes one message carries on this connection (§18.9)."""
        return chunk_budget(self.node.connection.max_payload)

    async def call(
        self, subject: str, payload: Mapping[str, Any], *, timeout: float | None = None
    ) -> dict[str, Any]:
        """One request to the store; a failed answer raises ``RemoteError``."""
        return await self.node.service_call(self.hosted, subject, "request", dict(payload), timeout=timeout)

    # -- put ---------------------------------------------------------------------

    async def put_bytes(
        self,
        data: bytes,
        *,
        name: str | None,
        media_type: str,
        retention_s: int | None = None,
        progress: Progress | None = None,
    ) -> dict[str, Any]:
        """Store ``data``; returns the store's reply (the ref part plus ``expires_at``, ``object_id``)."""
        if len(data) <= self.chunk_max:
            payload: dict[str, Any] = {
                "data": base64.b64encode(data).decode(),
                "media_type": media_type,
                "digest": digest_of(data),
            }
            if name is not None:
                payload["name"] = name
            if retention_s is not None:
                payload["retention_s"] = retention_s
            reply = await self.call(subjects.ARTIFACTS_PUT, payload)
            if progress is not None:
                progress(len(data), len(data))
            return reply
        view = memoryview(data)

        async def read(offset: int, size: int) -> bytes:
            return bytes(view[offset : offset + size])

        return await self.put_stream(
            read, size=len(data), digest=digest_of(data), name=name, media_type=media_type,
            retention_s=retention_s, progress=progress,
        )

    async def put_file(
        self,
        path: Path,
        *,
        name: str | None = None,
        media_type: str,
        retention_s: int | None = None,
        progress: Progress | None = None,
    ) -> dict[str, Any]:
        """Store a file, read in chunks (never wholly in memory); ``name`` defaults to its name."""
        size, digest = await asyncio.to_thread(_size_and_digest, path)
        label = name if name is not None else path.name
        if size <= self.chunk_max:
            data = await asyncio.to_thread(path.read_bytes)
            return await self.put_bytes(data, name=label, media_type=media_type, retention_s=retention_s, progress=progress)
        handle = await asyncio.to_thread(path.open, "rb")
        try:

            async def read(offset: int, count: int) -> bytes:
                return await asyncio.to_thread(_read_at, handle, offset, count)

            return await self.put_stream(
                read, size=size, digest=digest, name=label, media_type=media_type,
                retention_s=retention_s, progress=progress,
            )
        finally:
            await asyncio.to_thread(handle.close)

    async def put_stream(
        self,
        read: Callable[[int, int], Awaitable[bytes]],
        *,
        size: int,
        digest: str,
        name: str | None,
        media_type: str,
        retention_s: int | None = None,
        progress: Progress | None = None,
    ) -> dict[str, Any]:
        """Upload ``size`` bytes obtained from ``read(offset, count)`` as a session.

        The store verifies ``size`` and ``digest`` against what it stored before
        it mints a ref; an upload that fails midway is aborted.
        """
        begin: dict[str, Any] = {"media_type": media_type, "size": size, "digest": digest}
        if name is not None:
            begin["name"] = name
        if retention_s is not None:
            begin["retention_s"] = retention_s
        opened = await self.call(subjects.ARTIFACTS_PUT, begin)
        if "ref" in opened:  # an empty object is stored at once
            return opened
        upload = opened["upload"]
        step = min(int(opened.get("chunk_max") or self.chunk_max), self.chunk_max)
        offset = seq = 0
        try:
            while offset < size:
                data = await read(offset, min(step, size - offset))
                if not data:
                    raise ProtocolError("INPUT_INVALID", "the source ended before its declared size")
                last = offset + len(data) >= size
                # The last chunk makes the store read the object back to verify it.
                timeout = max(10.0, self.node.settings.registry_timeout_s) + (size * _READBACK_S_PER_BYTE if last else 0)
                reply = await self.call(
                    subjects.ARTIFACTS_PUT,
                    {"upload": upload, "seq": seq, "data": base64.b64encode(data).decode()},
                    timeout=timeout,
                )
                offset += len(data)
                seq += 1
                if progress is not None:
                    progress(offset, size)
            if "ref" not in reply:
                raise ProtocolError("INTERNAL_ERROR", "the store did not finish the upload")
            return reply
        except BaseException:
            try:
                await self.call(subjects.ARTIFACTS_PUT, {"upload": upload, "abort": True})
            except Exception:  # the store may have discarded it already
                pass
            raise

    # -- fetch ---------------------------------------------------------------------

    async def fetch_range(self, ref: str, offset: int, length: int | None = None) -> dict[str, Any]:
        """One range of a stored object; ``data`` already decoded to bytes."""
        payload: dict[str, Any] = {"ref": ref, "offset": offset}
        if length is not None:
            payload["length"] = length
        reply = await self.call(subjects.ARTIFACTS_FETCH, payload)
        try:
            reply["data"] = base64.b64decode(reply.get("data") or "", validate=True)
        except ValueError:
            raise ProtocolError("DEPENDENCY_FAILED", "the store answered with data that is not base64", {"ref": ref}) from None
        return reply

    async def _ranges(self, ref: str) -> AsyncIterator[dict[str, Any]]:
        """Every range of ``ref`` in order, until the store says nothing follows."""
        offset = 0
        while True:
            reply = await self.fetch_range(ref, offset)
            yield reply
            data: bytes = reply["data"]
            if reply.get("eof") or not data:
                return
            offset += len(data)

    async def fetch_into(
        self,
        target: str | Mapping[str, Any] | FileAttachment,
        write: Callable[[bytes], Awaitable[None]],
        *,
        max_bytes: int | None = None,
        progress: Progress | None = None,
    ) -> dict[str, Any]:
        """Fetch an object range by range into ``write``, verifying size and digest.

        Expected size and digest come from the ref part when it carries them
        (the sender's claim travels with the pointer, §7.5.1), else from the
        store's record. ``max_bytes`` refuses (PAYLOAD_TOO_LARGE) before any
        byte moves. Returns the verified ``{ref, media_type, size, digest,
        name?}``; raises :class:`ArtifactIntegrityError` on a mismatch, after
        which whatever ``write`` received must be discarded.
        """
        ref, part = _ref_and_part(target)
        _check_scheme(ref)
        sha = hashlib.sha256()
        offset = 0
        size: int | None = part.get("size") if isinstance(part.get("size"), int) else None
        digest = part.get("digest") if isinstance(part.get("digest"), str) else None
        first: dict[str, Any] = {}
        if max_bytes is not None and size is not None and size > max_bytes:
            raise _too_large(ref, size, max_bytes)
        async for reply in self._ranges(ref):
            if not first:
                first = reply
                size = size if size is not None else int(reply["size"])
                digest = digest if digest is not None else reply.get("digest")
                if max_bytes is not None and size > max_bytes:
                    raise _too_large(ref, size, max_bytes)
                if progress is not None:
                    progress(0, size)
            assert size is not None
            data: bytes = reply["data"]
            if offset + len(data) > size or (offset + len(data) == size and not reply.get("eof") and data):
                # More bytes than the ref promised: never hand them on.
                raise ArtifactIntegrityError(ref, "size_mismatch", size, f"more than {size}")
            if data:
                sha.update(data)
                await write(data)
                offset += len(data)
                if progress is not None:
                    progress(offset, size)
        if offset != size:
            raise ArtifactIntegrityError(ref, "size_mismatch", size, offset)
        actual = "sha256:" + sha.hexdigest()
        if digest is not None and actual != digest:
            raise ArtifactIntegrityError(ref, "digest_mismatch", digest, actual)
        verified = {"ref": ref, "media_type": first.get("media_type"), "size": size, "digest": actual}
        if first.get("name") is not None:
            verified["name"] = first["name"]
        return verified

    async def fetch(
        self, target: str | Mapping[str, Any] | FileAttachment, *, max_bytes: int | None = None
    ) -> bytes:
        """The whole object, verified (see :meth:`fetch_into`)."""
        chunks: list[bytes] = []

        async def collect(data: bytes) -> None:
            chunks.append(data)

        await self.fetch_into(target, collect, max_bytes=max_bytes)
        return b"".join(chunks)

    # -- the rest ------------------------------------------------------------------

    async def stat(self, target: str | Mapping[str, Any] | FileAttachment) -> dict[str, Any]:
        ref, _ = _ref_and_part(target)
        _check_scheme(ref)
        return await self.call(subjects.ARTIFACTS_STAT, {"ref": ref})

    async def remove(self, target: str | Mapping[str, Any]) -> dict[str, Any]:
        ref, _ = _ref_and_part(target)
        _check_scheme(ref)
        return await self.call(subjects.ARTIFACTS_REMOVE, {"ref": ref})

    async def usage(self) -> dict[str, Any]:
        return await self.call(subjects.ARTIFACTS_USAGE, {})

    async def observe(self, ref: str) -> str | None:
        """The digest of the bytes at ``ref`` now, or None when they cannot be obtained (§5.6).

        Hashes what is there, whatever the store's record says: this is the
        verifier looking, not a reader trusting.
        """
        if not ref.startswith(REF_SCHEME):
            return None
        sha = hashlib.sha256()
        seen, bound = 0, None
        try:
            async for reply in self._ranges(ref):
                data: bytes = reply["data"]
                bound = bound if bound is not None else int(reply["size"]) + self.chunk_max
                seen += len(data)
                if seen > bound:
                    return None  # a store that never ends is not an observation
                sha.update(data)
        except ProtocolError:
            return None
        return "sha256:" + sha.hexdigest()

    async def verify_rests_on(
        self, declared: Sequence[Mapping[str, Any]] | None, *, countersigned: bool = False
    ) -> Verdict:
        """The §5.6 verdict, observing each cited ref by fetching and hashing its bytes."""
        if countersigned or declared is None:
            return freshness(declared, {}, countersigned=countersigned)
        entries = validate_rests_on(list(declared))
        observed: dict[str, str | None] = {}
        for entry in entries:
            ref = entry.get("ref")
            if isinstance(ref, str) and ref not in observed:
                observed[ref] = await self.observe(ref)
        return freshness(entries, observed)


def _size_and_digest(path: Path) -> tuple[int, str]:
    sha = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        while block := handle.read(1024 * 1024):
            sha.update(block)
            size += len(block)
    return size, "sha256:" + sha.hexdigest()


def _read_at(handle: Any, offset: int, count: int) -> bytes:
    handle.seek(offset)
    data: bytes = handle.read(count)
    return data


def artifact_object(
    parts: Sequence[Mapping[str, Any]],
    *,
    name: str,
    now_ms: int,
    media_type: str | None = None,
    rests_on: Sequence[Mapping[str, Any]] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A §7.5 artifact: ``id``, ``name``, ``parts`` (ref parts checked), ``created_at``,
    and ``media_type``, ``rests_on`` (§5.6, checked), ``meta`` when given."""
    checked: list[dict[str, Any]] = []
    for i, part in enumerate(parts):
        if "ref" in part:
            checked.append(validate_ref_part(part, member=f"parts[{i}]"))
        elif "text" in part or "data" in part:
            checked.append(dict(part))
        else:
            raise ProtocolError("INPUT_INVALID", "a part is text, data or a ref", {"member": f"parts[{i}]"})
    artifact: dict[str, Any] = {"id": str(uuid.uuid4()), "name": name, "parts": checked, "created_at": format_ts(now_ms)}
    if media_type is not None:
        artifact["media_type"] = media_type
    if rests_on is not None:
        artifact["rests_on"] = validate_rests_on(list(rests_on), member="artifact.rests_on")
    if meta:
        artifact["meta"] = dict(meta)
    return artifact


async def spill_oversized_output(
    hosted: HostedAgent,
    request: Mapping[str, Any],
    output: Any,
    artifacts: list[dict[str, Any]] | None,
) -> tuple[Any, list[dict[str, Any]] | None]:
    """Keep ``output`` inline when the respond fits the transport, else store it (§18.9).

    A spilled output becomes an artifact with one ref part (JSON as
    ``application/json``, a string as ``text/plain; charset=utf-8``) and the
    output is replaced by a small pointer: ``{artifact, ref, media_type, size,
    digest, note}``. The same happens on the local path, so a local and a
    remote caller see the same answer (§4.7).
    """
    try:
        encoded = orjson.dumps(output)
        around = orjson.dumps(artifacts or [])
    except TypeError:
        return output, artifacts  # not JSON; the respond's own encoding reports it
    context_id = request.get("context_id")
    allowance = RESPOND_ALLOWANCE + (len(context_id) if isinstance(context_id, str) else 0)
    if len(encoded) + len(around) + allowance <= hosted.node.connection.max_payload:
        return output, artifacts
    if isinstance(output, str):
        data, media_type, name = output.encode(), "text/plain; charset=utf-8", "output.txt"
    else:
        data, media_type, name = encoded, "application/json", "output.json"
    stored = await ArtifactClient(hosted).put_bytes(data, name=name, media_type=media_type)
    part = ref_part_of(stored)
    artifact = artifact_object([part], name="output", media_type=media_type, now_ms=hosted.node.now_ms())
    pointer = {
        "artifact": artifact["id"],
        "ref": part["ref"],
        "media_type": media_type,
        "size": part["size"],
        "digest": part["digest"],
        "note": "the output was larger than one message carries (§18.9); it is stored as this artifact",
    }
    hosted.counters["outputs_spilled"] += 1
    return pointer, [*(artifacts or []), artifact]
