"""The admin methods behind ``meshnode artifacts`` (§7.5, §18.5, §18.7); the
store itself is one of the platform services (:mod:`meshnode.daemon.platform`).

Every admin method speaks to the store as the node's CLI identity (``cli``),
so the store sees an ordinary registered agent: the writer is ``cli``, the
owner is this node's owner.

Bytes cross the admin socket base64-encoded, in pieces of at most
:data:`ADMIN_PIECE` raw bytes so that every line stays under the admin
protocol's 1 MiB limit. The daemon never opens a path named by a client:
the socket is local, but the daemon may run as a service user that can read
(its own keys) and write what the caller cannot, so files are read and
written by the CLI, on the caller's side of the socket.

Methods (params → result):

``Artifacts.Put`` (operator)
    One of the store's ``mesh.artifacts.put`` shapes, passed through: one shot
    ``{data, media_type, name?, digest?, retention_s?}``; begin ``{media_type,
    size, digest, name?, retention_s?}`` → ``{upload, chunk_max, expires_at}``;
    chunk ``{upload, seq, data}`` → ``{upload, seq, received}`` or, for the last
    one, the stored object; abort ``{upload, abort: true}``. ``data`` holds at
    most :data:`ADMIN_PIECE` bytes. A stored object is ``{ref, media_type,
    size, digest, name?, expires_at, object_id}``.
``Artifacts.Get`` (operator, streaming)
    ``{ref, max_bytes?}`` → intermediate ``{offset, size, data}`` pieces in order, then
    ``{ref, media_type, size, digest, name?}`` once the whole object verified
    against its recorded size and digest. A mismatch ends the stream with
    ``Refused`` (``DEPENDENCY_FAILED``, ``details.reason: digest_mismatch``):
    discard what was received.
``Artifacts.Stat`` / ``Artifacts.Remove`` (operator)
    ``{ref}`` → the store's ``stat`` / ``remove`` answer.
``Artifacts.Usage`` (operator)
    ``{}`` → the store's ``usage`` answer for this node's owner.
``Artifacts.Sweep`` (admin; a node that runs the store)
    ``{}`` → ``{reclaimed, aborted_uploads}`` after a reclaim pass now.

Store refusals arrive as ``Refused`` with the §12 error object as ``params``.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

from meshnode.admin.protocol import InvalidParameter, NotFound
from meshnode.admin.server import CallContext, MethodRegistry
from meshnode.node.artifacts import ArtifactClient
from meshnode.node.builtin import CLI_AGENT_NAME
from meshnode.protocol import subjects
from meshnode.services.artifacts import ArtifactService

if TYPE_CHECKING:
    from meshnode.daemon.main import Daemon

__all__ = ["ADMIN_PIECE", "register_artifact_methods"]

#: Raw bytes per admin message (base64 of it stays well under the 1 MiB line limit).
ADMIN_PIECE = 512 * 1024
#: How long a put through the admin socket may take (the last chunk reads the object back).
_PUT_TIMEOUT_S = 120.0
_PUT_KEYS = frozenset({"data", "media_type", "name", "digest", "retention_s", "size", "upload", "seq", "abort"})


def register_artifact_methods(daemon: Daemon, methods: MethodRegistry) -> None:
    """Add the ``Artifacts.*`` admin methods (module docstring)."""
    ops = _ArtifactMethods(daemon)
    methods.add("Artifacts.Put", ops.put, level="operator",
                doc="params: a mesh.artifacts.put shape (data <= 512 KiB) -> the store's answer")
    methods.add("Artifacts.Get", ops.get, level="operator", streaming=True,
                doc="params {ref, max_bytes?} -> {offset, data}... then {ref, media_type, size, digest, name?} (verified)")
    methods.add("Artifacts.Stat", ops.stat, level="operator",
                doc="params {ref} -> {ref, media_type, size, digest, name?, created_at, expires_at, state}")
    methods.add("Artifacts.Remove", ops.remove, level="operator",
                doc="params {ref} -> {ref, removed}; the owner only")
    methods.add("Artifacts.Usage", ops.usage, level="operator",
                doc="params {} -> {owner, bytes, objects, quota_bytes, quota_objects, ...}")
    methods.add("Artifacts.Sweep", ops.sweep, level="admin",
                doc="params {} -> {reclaimed, aborted_uploads}; reclaim expired artifacts now (store node only)")


class _ArtifactMethods:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def _client(self) -> ArtifactClient:
        node = self.daemon.node
        if node is None or CLI_AGENT_NAME not in node.agents:
            raise NotFound("the node is not running")
        return ArtifactClient(node.agents[CLI_AGENT_NAME])

    @staticmethod
    def _ref(params: dict[str, Any]) -> str:
        ref = params.get("ref")
        if not isinstance(ref, str) or not ref:
            raise InvalidParameter("ref (a string) is required")
        return ref

    async def put(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        unknown = set(params) - _PUT_KEYS
        if unknown:
            raise InvalidParameter(f"unknown parameters: {', '.join(sorted(unknown))}")
        data = params.get("data")
        if isinstance(data, str) and len(data) > (ADMIN_PIECE // 3 + 1) * 4:
            raise InvalidParameter(f"data holds at most {ADMIN_PIECE} bytes per call")
        return await self._client().call(subjects.ARTIFACTS_PUT, params, timeout=_PUT_TIMEOUT_S)

    async def get(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        ref = self._ref(params)
        max_bytes = params.get("max_bytes")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
            raise InvalidParameter("max_bytes is a non-negative integer")
        sent, total = 0, 0

        def learn(done: int, size: int) -> None:
            nonlocal total
            total = size

        async def forward(data: bytes) -> None:
            nonlocal sent
            for i in range(0, len(data), ADMIN_PIECE):
                piece = data[i : i + ADMIN_PIECE]
                await call.send({"offset": sent, "size": total, "data": base64.b64encode(piece).decode()})
                sent += len(piece)

        return await self._client().fetch_into(ref, forward, max_bytes=max_bytes, progress=learn)

    async def stat(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        return await self._client().stat(self._ref(params))

    async def remove(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        return await self._client().remove(self._ref(params))

    async def usage(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        return await self._client().usage()

    async def sweep(self, params: dict[str, Any], call: CallContext) -> dict[str, Any]:
        service = next((s for s in self.daemon.services if isinstance(s, ArtifactService)), None)
        if service is None:
            raise NotFound("this node serves no artifact store (only an embedded-mesh node does)")
        return await service.sweep()
