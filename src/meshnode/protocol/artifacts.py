"""Artifacts, ref parts, attached files and shared resources (AgentMesh §7.5, §18.5, §18.9).

Pure rules shared by the artifact store service and the agent API:

* **Refs** are opaque URIs (§7.5.1). This store mints ``mesh:artifacts:{object_id}``
  with a 128-bit random object id in base64url (§7.5.4, §18.5): 22 characters,
  no padding, no owner in it. Readers never parse a ref; only the store that
  minted it maps it back (:func:`object_id_of`).
* **Ref parts** carry ``ref``, ``media_type``, ``size`` (required) and
  ``digest`` (``sha256:<64 lowercase hex>``), ``name`` (optional):
  :func:`validate_ref_part`.
* **Files** attached to a request (``payload.files``, §7.5.3) carry exactly one
  of ``ref`` or ``uri``; **resources** (``payload.resources``, §7.5.5) carry a
  ``uri``, a ``kind`` and an ``access``. Both are surfaced to handlers as
  declared (:class:`FileAttachment`, :class:`Resource`); nothing here fetches.
* **Message budget** (§18.9): bytes ride base64 in a signed envelope, so one
  message carries at most :func:`chunk_budget` raw bytes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ProtocolError
from .rests_on import is_valid_digest

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_RETENTION_S",
    "ENVELOPE_ALLOWANCE",
    "INDEX_BUCKET",
    "OBJECT_STORE_BUCKET",
    "REF_SCHEME",
    "TASK_RETENTION_S",
    "UPLOADS_BUCKET",
    "FileAttachment",
    "Resource",
    "chunk_budget",
    "is_valid_object_id",
    "object_id_of",
    "parse_files",
    "parse_resources",
    "ref_for",
    "ref_part",
    "validate_ref_part",
]

REF_SCHEME = "mesh:artifacts:"
#: JetStream object store holding the bytes, keyed ``{owner}/{object_id}`` (§18.5).
OBJECT_STORE_BUCKET = "mesh_artifacts"
#: KV bucket holding each object's metadata, keyed by object id (§18.5).
INDEX_BUCKET = "mesh_artifacts_index"
#: KV bucket holding chunked uploads in progress (an implementation bucket).
UPLOADS_BUCKET = "mesh_artifacts_uploads"

DAY_S = 86_400
#: §18.4: tasks are kept 7 days; an artifact outlives its work by a grace window (§7.5.2).
TASK_RETENTION_S = 7 * DAY_S
DEFAULT_GRACE_S = 7 * DAY_S
DEFAULT_RETENTION_S = TASK_RETENTION_S + DEFAULT_GRACE_S

#: Room left in a message for the signed envelope around base64 data.
ENVELOPE_ALLOWANCE = 8192

_OBJECT_ID = re.compile(r"[A-Za-z0-9_-]{22}")
_ACCESS = ("read", "read-write")


def is_valid_object_id(value: object) -> bool:
    """True for a 22-character base64url string (128 bits, unpadded)."""
    return isinstance(value, str) and _OBJECT_ID.fullmatch(value) is not None


def ref_for(object_id: str) -> str:
    """The ref this store mints for ``object_id``."""
    if not is_valid_object_id(object_id):
        raise ValueError(f"not an object id: {object_id!r}")
    return REF_SCHEME + object_id


def object_id_of(ref: object) -> str | None:
    """The object id inside one of this store's refs, or None for any other string.

    For the store (and the node's client, to pick the store to ask) only: a
    reader treats refs as opaque (§7.5.1).
    """
    if not isinstance(ref, str) or not ref.startswith(REF_SCHEME):
        return None
    object_id = ref[len(REF_SCHEME) :]
    return object_id if is_valid_object_id(object_id) else None


def chunk_budget(max_payload: int) -> int:
    """Raw bytes that fit in one message as base64 inside a signed envelope (§18.9)."""
    room = max_payload - ENVELOPE_ALLOWANCE
    if room < 4:
        raise ValueError(f"max_payload {max_payload} leaves no room for data")
    return (room // 4) * 3


def _invalid(message: str, member: str, reason: str = "invalid") -> ProtocolError:
    return ProtocolError("INPUT_INVALID", message, {"member": member, "reason": reason})


def ref_part(
    ref: str, *, media_type: str, size: int, digest: str | None = None, name: str | None = None
) -> dict[str, Any]:
    """A §7.5 ref part; absent optional members are omitted."""
    part: dict[str, Any] = {"ref": ref, "media_type": media_type, "size": size}
    if digest is not None:
        part["digest"] = digest
    if name is not None:
        part["name"] = name
    return part


def validate_ref_part(part: object, *, member: str = "part") -> dict[str, Any]:
    """Check a ref part's shape (§7.5, §7.5.1) and return a copy; INPUT_INVALID when wrong."""
    if not isinstance(part, Mapping):
        raise _invalid("a ref part is an object", member)
    ref = part.get("ref")
    if not isinstance(ref, str) or not ref:
        raise _invalid("ref is a non-empty string", f"{member}.ref")
    if not isinstance(part.get("media_type"), str) or not part["media_type"]:
        raise _invalid("media_type is a non-empty string", f"{member}.media_type")
    size = part.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise _invalid("size is a non-negative integer", f"{member}.size")
    if "digest" in part and not is_valid_digest(part["digest"]):
        raise _invalid("digest is sha256:<64 lowercase hex>", f"{member}.digest")
    if "name" in part and not isinstance(part["name"], str):
        raise _invalid("name is a string", f"{member}.name")
    return dict(part)


@dataclass(frozen=True)
class FileAttachment:
    """One entry of a request's ``files`` (§7.5.3), exactly as the sender declared it.

    Exactly one of ``ref`` (bytes in a store this mesh resolves; fetch it with
    ``ctx.fetch_artifact(file)`` once you decide to) or ``uri`` (an address the
    sender chose: never fetched by the node; whether to dereference it is the
    handler's decision). ``name``, ``media_type``, ``size`` are advisory.
    """

    ref: str | None = None
    uri: str | None = None
    name: str | None = None
    media_type: str | None = None
    size: int | None = None
    digest: str | None = None
    declared: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_ref(self) -> bool:
        return self.ref is not None

    def part(self) -> dict[str, Any]:
        """This file as a ref part (for ``fetch_artifact``); only for ``ref`` files."""
        if self.ref is None:
            raise ValueError("a uri file has no ref part; the node never fetches uris")
        part: dict[str, Any] = {"ref": self.ref}
        for name in ("media_type", "size", "digest", "name"):
            value = getattr(self, name)
            if value is not None:
                part[name] = value
        return part


@dataclass(frozen=True)
class Resource:
    """One entry of a request's ``resources`` (§7.5.5): a live object both parties
    knowingly operate on. The node asserts nothing about it and never touches it."""

    uri: str
    kind: str
    access: str
    name: str | None = None
    description: str | None = None
    declared: Mapping[str, Any] = field(default_factory=dict)


def _opt_str(entry: Mapping[str, Any], name: str, member: str) -> str | None:
    value = entry.get(name)
    if value is not None and not isinstance(value, str):
        raise _invalid(f"{name} is a string", f"{member}.{name}")
    return value


def parse_files(value: object, *, member: str = "payload.files") -> list[FileAttachment]:
    """The request's ``files`` block (absent → empty); INPUT_INVALID when malformed."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _invalid("files is a list", member)
    files: list[FileAttachment] = []
    for i, entry in enumerate(value):
        where = f"{member}[{i}]"
        if not isinstance(entry, Mapping):
            raise _invalid("a file entry is an object", where)
        ref, uri = entry.get("ref"), entry.get("uri")
        if (ref is None) == (uri is None):
            raise _invalid("a file carries exactly one of ref or uri", where, "ref_xor_uri")
        for name, val in (("ref", ref), ("uri", uri)):
            if val is not None and (not isinstance(val, str) or not val):
                raise _invalid(f"{name} is a non-empty string", f"{where}.{name}")
        size = entry.get("size")
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
            raise _invalid("size is a non-negative integer", f"{where}.size")
        digest = entry.get("digest")
        if digest is not None and not is_valid_digest(digest):
            raise _invalid("digest is sha256:<64 lowercase hex>", f"{where}.digest")
        files.append(
            FileAttachment(
                ref=ref,
                uri=uri,
                name=_opt_str(entry, "name", where),
                media_type=_opt_str(entry, "media_type", where),
                size=size,
                digest=digest,
                declared=dict(entry),
            )
        )
    return files


def parse_resources(value: object, *, member: str = "payload.resources") -> list[Resource]:
    """The request's ``resources`` block (absent → empty); INPUT_INVALID when malformed."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _invalid("resources is a list", member)
    resources: list[Resource] = []
    for i, entry in enumerate(value):
        where = f"{member}[{i}]"
        if not isinstance(entry, Mapping):
            raise _invalid("a resource entry is an object", where)
        for name in ("uri", "kind"):
            if not isinstance(entry.get(name), str) or not entry[name]:
                raise _invalid(f"{name} is a required non-empty string", f"{where}.{name}")
        if entry.get("access") not in _ACCESS:
            raise _invalid("access is read or read-write", f"{where}.access")
        resources.append(
            Resource(
                uri=entry["uri"],
                kind=entry["kind"],
                access=entry["access"],
                name=_opt_str(entry, "name", where),
                description=_opt_str(entry, "description", where),
                declared=dict(entry),
            )
        )
    return resources
