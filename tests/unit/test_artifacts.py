"""Pure parts of artifacts (§7.5, §5.6, §18.9): refs, attachments, rests_on, the client's checks."""

from __future__ import annotations

import base64
import os
from collections import Counter
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest

from meshnode.node import artifacts as node_artifacts
from meshnode.node.artifacts import (
    ArtifactClient,
    ArtifactIntegrityError,
    artifact_object,
    spill_oversized_output,
)
from meshnode.protocol.artifacts import (
    FileAttachment,
    chunk_budget,
    is_valid_object_id,
    object_id_of,
    parse_files,
    parse_resources,
    ref_for,
    validate_ref_part,
)
from meshnode.protocol.envelope import build_envelope, encode_envelope, sign_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair, Prefix
from meshnode.protocol.rests_on import digest_of, entry_for, freshness, validate_rests_on
from tests.fakes import FakeNode

D1 = "sha256:" + "1" * 64
D2 = "sha256:" + "2" * 64
OID = "AbCdEfGhIjKlMnOpQrSt_-"


# --------------------------------------------------------------------------- refs and parts


def test_refs_are_minted_from_128_bit_ids_and_only_this_store_maps_them_back() -> None:
    assert is_valid_object_id(OID) and len(base64.urlsafe_b64decode(OID + "==")) == 16
    assert ref_for(OID) == f"mesh:artifacts:{OID}"
    assert object_id_of(ref_for(OID)) == OID
    for other in ("mesh:rooms:r/drive/x", "mesh:artifacts:short", "https://x/y", 7, None):
        assert object_id_of(other) is None
    with pytest.raises(ValueError):
        ref_for("../../etc")


@pytest.mark.parametrize("max_payload", [64 * 1024, 1024 * 1024, 8 * 1024 * 1024])
def test_a_chunk_budget_of_bytes_fits_one_message(max_payload: int) -> None:
    key = KeyPair.generate(Prefix.USER)
    data = os.urandom(chunk_budget(max_payload))
    env = build_envelope("request", key.public_key, now_ms=1_800_000_000_000, payload={
        "upload": OID, "seq": 123_456, "data": base64.b64encode(data).decode()})
    assert len(encode_envelope(sign_envelope(env, key))) <= max_payload


def test_ref_parts_are_checked() -> None:
    good = {"ref": "mesh:artifacts:x", "media_type": "text/plain", "size": 3, "digest": D1, "name": "a"}
    assert validate_ref_part(good) == good
    for bad in ({**good, "size": -1}, {**good, "size": True}, {**good, "digest": "sha1:x"},
                {**good, "media_type": ""}, {k: v for k, v in good.items() if k != "ref"}, "mesh:artifacts:x"):
        with pytest.raises(ProtocolError) as exc:
            validate_ref_part(bad)
        assert exc.value.code == "INPUT_INVALID"


def test_files_carry_exactly_one_of_ref_or_uri_and_are_surfaced_as_declared() -> None:
    declared = [{"name": "r.pdf", "media_type": "application/pdf", "ref": "mesh:artifacts:x", "size": 9, "digest": D1},
                {"name": "c.png", "uri": "https://example.com/c.png", "extra": "kept"}]
    ref_file, uri_file = parse_files(declared)
    assert ref_file.is_ref and ref_file.part() == {"ref": "mesh:artifacts:x", "media_type": "application/pdf",
                                                    "size": 9, "digest": D1, "name": "r.pdf"}
    assert not uri_file.is_ref and uri_file.uri == "https://example.com/c.png" and uri_file.declared == declared[1]
    with pytest.raises(ValueError):
        uri_file.part()  # a uri file has no ref part: there is nothing for the node to fetch
    assert parse_files(None) == []
    for bad, reason in (([{"ref": "r", "uri": "u"}], "ref_xor_uri"), ([{"name": "n"}], "ref_xor_uri"),
                        ([{"uri": ""}], "invalid"), ([{"uri": "u", "size": -2}], "invalid"),
                        ([{"uri": "u", "digest": "nope"}], "invalid"), ({"uri": "u"}, "invalid"), (["u"], "invalid")):
        with pytest.raises(ProtocolError) as exc:
            parse_files(bad)
        assert exc.value.code == "INPUT_INVALID" and exc.value.details["reason"] == reason


def test_resources_need_uri_kind_and_access() -> None:
    [res] = parse_resources([{"uri": "https://g/x", "kind": "git", "access": "read-write", "name": "x"}])
    assert (res.uri, res.kind, res.access, res.name, res.description) == ("https://g/x", "git", "read-write", "x", None)
    for bad in ([{"uri": "u", "kind": "git", "access": "write"}], [{"uri": "u", "access": "read"}],
                [{"kind": "git", "access": "read"}], [{"uri": "u", "kind": "git", "access": "read", "name": 3}]):
        with pytest.raises(ProtocolError):
            parse_resources(bad)


# --------------------------------------------------------------------------- rests_on


def test_rests_on_entries_from_parts_and_the_verdicts() -> None:
    part = {"ref": "mesh:artifacts:a", "media_type": "text/csv", "size": 3, "digest": D1, "name": "in.csv"}
    entry = entry_for(part, role="input")
    assert entry == {"digest": D1, "ref": "mesh:artifacts:a", "name": "in.csv", "role": "input"}
    assert entry_for(FileAttachment(ref="mesh:artifacts:a", digest=D1).part()) == {"digest": D1, "ref": "mesh:artifacts:a"}
    with pytest.raises(ProtocolError):
        entry_for({"ref": "mesh:artifacts:a"})  # nothing to rest on without a digest
    assert validate_rests_on([entry, {"digest": D2, "role": "rate-schedule"}])[1] == {"digest": D2, "role": "rate-schedule"}
    assert freshness([entry], {"mesh:artifacts:a": D1}).state == "fresh"
    assert freshness([entry], lambda ref: D2).as_dict() == {"state": "stale", "changed": ["mesh:artifacts:a"],
                                                           "unreachable": []}
    assert freshness([entry], {}).state == "unchecked"
    assert freshness(None, {}).state == "undeclared"

    def never(ref: str) -> str:
        raise AssertionError("a countersigned agreement's refs are not looked up")

    assert freshness([entry], never, countersigned=True).state == "not_applicable"
    assert digest_of(b"") == "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_artifact_objects_check_their_parts_and_rests_on() -> None:
    part = {"ref": "mesh:artifacts:a", "media_type": "text/plain", "size": 1, "digest": D1}
    artifact = artifact_object([part, {"text": "summary"}], name="report", media_type="text/plain",
                               rests_on=[{"digest": D2, "role": "input"}], now_ms=1_800_000_000_000)
    assert artifact["parts"] == [part, {"text": "summary"}] and artifact["created_at"] == "2027-01-15T08:00:00.000Z"
    assert artifact["rests_on"] == [{"digest": D2, "role": "input"}] and len(artifact["id"]) == 36
    with pytest.raises(ProtocolError):
        artifact_object([{"ref": "x"}], name="r", now_ms=0)
    with pytest.raises(ProtocolError):
        artifact_object([part], name="r", rests_on=[], now_ms=0)
    with pytest.raises(ProtocolError):
        artifact_object([{"bytes": "?"}], name="r", now_ms=0)


# --------------------------------------------------------------------------- the client, against a scripted store


class ScriptedStore:
    """Answers ``service_call`` like the store would, from one object's bytes."""

    def __init__(self, data: bytes, *, digest: str | None = None, size: int | None = None, step: int = 4) -> None:
        self.data = data
        self.digest = digest or digest_of(data)
        self.size = len(data) if size is None else size
        self.step = step
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail_on: str | None = None

    async def service_call(self, hosted: Any, subject: str, kind: str, payload: Any, *, timeout: float | None = None) -> dict[str, Any]:
        self.calls.append((subject, dict(payload)))
        if self.fail_on and self.fail_on in str(payload):
            raise ProtocolError("INTERNAL_ERROR", "scripted failure")
        if subject == "mesh.artifacts.fetch":
            offset = payload["offset"]
            chunk = self.data[offset : offset + self.step]
            return {"ref": payload["ref"], "offset": offset, "data": base64.b64encode(chunk).decode(),
                    "length": len(chunk), "size": self.size, "digest": self.digest,
                    "media_type": "application/octet-stream", "eof": offset + len(chunk) >= len(self.data)}
        if subject == "mesh.artifacts.put":
            if "data" in payload and "upload" not in payload:
                return {"ref": "mesh:artifacts:" + OID, "media_type": payload["media_type"],
                        "size": len(base64.b64decode(payload["data"])), "digest": payload["digest"],
                        "expires_at": "t", "object_id": OID}
            if "upload" not in payload:
                return {"upload": "U1", "chunk_max": 10**9, "expires_at": "t"}
            if payload.get("abort"):
                return {"upload": "U1", "aborted": True}
            self.data += base64.b64decode(payload["data"])
            if len(self.data) < self.size:
                return {"upload": "U1", "seq": payload["seq"], "received": len(self.data)}
            return {"ref": "mesh:artifacts:" + OID, "media_type": "m", "size": len(self.data),
                    "digest": digest_of(self.data), "expires_at": "t", "object_id": OID}
        raise AssertionError(subject)


class _StoreNode(FakeNode):
    """The fake node, its platform-service calls answered by a scripted artifact store."""

    def __init__(self, store: ScriptedStore) -> None:
        super().__init__(now_ms=1_800_000_000_000)
        self.store = store

    async def service_call(
        self, hosted: Any, subject: str, kind: str, payload: Any, *, timeout: float | None = None
    ) -> dict[str, Any]:
        return await self.store.service_call(hosted, subject, kind, payload, timeout=timeout)


def _hosted(store: ScriptedStore, max_payload: int = 1024 * 1024) -> Any:
    node = _StoreNode(store)
    node.connection.max_payload = max_payload
    return SimpleNamespace(node=node, counters=Counter())


async def test_fetch_verifies_size_and_digest_and_never_returns_bad_bytes() -> None:
    data = b"0123456789abcdef!"
    ref = "mesh:artifacts:" + OID
    good = ScriptedStore(data)
    assert await ArtifactClient(_hosted(good)).fetch({"ref": ref, "digest": digest_of(data), "size": len(data)}) == data
    assert len(good.calls) == 5  # ranges of 4 bytes, offset by offset
    assert await ArtifactClient(_hosted(ScriptedStore(data))).fetch(ref) == data  # bare ref: the store's record

    with pytest.raises(ArtifactIntegrityError) as exc:  # the ref part's digest is the one that counts
        await ArtifactClient(_hosted(ScriptedStore(data))).fetch({"ref": ref, "digest": D1})
    assert exc.value.code == "DEPENDENCY_FAILED" and exc.value.details["reason"] == "digest_mismatch"
    with pytest.raises(ArtifactIntegrityError) as exc:  # the store serves fewer bytes than promised
        await ArtifactClient(_hosted(ScriptedStore(data, size=len(data) + 1))).fetch(ref)
    assert exc.value.details["reason"] == "size_mismatch"
    with pytest.raises(ArtifactIntegrityError):  # ... or more
        await ArtifactClient(_hosted(ScriptedStore(data))).fetch({"ref": ref, "size": len(data) - 3})
    refused = ScriptedStore(data)
    with pytest.raises(ProtocolError) as error:
        await ArtifactClient(_hosted(refused)).fetch({"ref": ref, "size": len(data)}, max_bytes=4)
    assert error.value.code == "PAYLOAD_TOO_LARGE" and not refused.calls  # refused before any byte moved
    for elsewhere in ("https://example.com/x", "mesh:rooms:r/drive/x"):
        with pytest.raises(ProtocolError) as error:
            await ArtifactClient(_hosted(ScriptedStore(data))).fetch(elsewhere)
        assert error.value.details == {"ref": elsewhere, "reason": "unknown_scheme"}


async def test_put_sends_one_message_or_a_session_of_chunks_within_the_budget() -> None:
    small = ScriptedStore(b"")
    stored = await ArtifactClient(_hosted(small)).put_bytes(b"tiny", name="t", media_type="text/plain")
    assert stored["size"] == 4 and len(small.calls) == 1 and small.calls[0][1]["digest"] == digest_of(b"tiny")

    data = os.urandom(3 * chunk_budget(64 * 1024) + 10)
    session = ScriptedStore(b"", size=len(data))
    progress: list[tuple[int, int]] = []
    stored = await ArtifactClient(_hosted(session, 64 * 1024)).put_bytes(
        data, name="b", media_type="m", progress=lambda done, total: progress.append((done, total)))
    assert session.data == data and stored["digest"] == digest_of(data)
    chunks = [p for s, p in session.calls if "upload" in p]
    assert [c["seq"] for c in chunks] == [0, 1, 2, 3]
    assert all(len(base64.b64decode(c["data"])) <= chunk_budget(64 * 1024) for c in chunks)
    assert progress[-1] == (len(data), len(data))

    failing = ScriptedStore(b"", size=len(data))
    failing.fail_on = "'seq': 2"
    with pytest.raises(ProtocolError):
        await ArtifactClient(_hosted(failing, 64 * 1024)).put_bytes(data, name="b", media_type="m")
    assert failing.calls[-1][1] == {"upload": "U1", "abort": True}  # a broken upload is given back


async def test_only_an_output_too_large_for_one_message_is_spilled(monkeypatch: pytest.MonkeyPatch) -> None:
    stored: list[tuple[bytes, str, str]] = []

    async def put_bytes(self: ArtifactClient, data: bytes, *, name: str | None, media_type: str, **_: Any) -> dict[str, Any]:
        stored.append((data, name or "", media_type))
        return {"ref": "mesh:artifacts:" + OID, "media_type": media_type, "size": len(data),
                "digest": digest_of(data), "name": name, "expires_at": "t", "object_id": OID}

    monkeypatch.setattr(node_artifacts.ArtifactClient, "put_bytes", put_bytes)
    hosted = _hosted(ScriptedStore(b""), 64 * 1024)
    request: Mapping[str, Any] = {"id": "r1", "from": "U"}
    small = {"text": "fits"}
    assert await spill_oversized_output(hosted, request, small, None) == (small, None)
    attached = [{"id": "a", "name": "kept", "parts": [{"text": "x"}]}]
    assert await spill_oversized_output(hosted, request, small, attached) == (small, attached)

    pointer, artifacts = await spill_oversized_output(hosted, request, {"text": "y" * 70_000}, attached)
    assert stored[-1][1:] == ("output.json", "application/json") and stored[-1][0].startswith(b'{"text":"yyy')
    assert artifacts is not None and artifacts[0] == attached[0] and artifacts[1]["id"] == pointer["artifact"]
    assert artifacts[1]["parts"] == [{"ref": pointer["ref"], "media_type": "application/json",
                                      "size": len(stored[-1][0]), "digest": digest_of(stored[-1][0]),
                                      "name": "output.json"}]
    assert hosted.counters["outputs_spilled"] == 1

    _, artifacts = await spill_oversized_output(hosted, request, "z" * 70_000, None)
    assert stored[-1][1:] == ("output.txt", "text/plain; charset=utf-8") and stored[-1][0] == b"z" * 70_000
    assert artifacts is not None and len(artifacts) == 1
