"""manifest-signing.json (spec and TS-SDK copies): the §8.3 manifest key claim.

For each vector: rebuild the four-component newline-joined string from its
fields and compare it to ``canonical``; verify ``signature`` against ``id``
through the manifest-level verifier; re-sign from ``agent_seed`` and get the
same signature; confirm the published ``trust`` block carries the same
values; and confirm the claim no longer verifies for another agent, with a
substituted encryption key, or with a newline smuggled into a component.
"""

from __future__ import annotations

from typing import Any

from meshnode.protocol.attestations import (
    MANIFEST_KEY_CLAIM_TAG,
    key_claim_bytes,
    key_claim_verifies,
    sign_key_claim,
    verify_key_claim,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair

from .. import Recorder

FILES = ["manifest-signing.json", "manifest-signing.ts-sdk.json"]

_VECTORS = ("key_claim_v1", "key_claim_v1_no_encryption_key")
_OTHER_AGENT = "UAKQRYZBYFOC65OQZVJ3QPCIERDTRNNZPMOJUYXC3DGPRCDWSKD4HV5A"


def _manifest(vector: dict[str, Any]) -> dict[str, Any]:
    manifest: dict[str, Any] = {
        "id": vector["id"],
        "trust": {"issued_at": vector["issued_at"], "signature": vector["signature"]},
    }
    if vector["encryption_key"]:
        manifest["encryption_key"] = vector["encryption_key"]
    return manifest


def _refused(manifest: dict[str, Any], expected_agent: str, code: str) -> None:
    try:
        verify_key_claim(manifest, expected_agent=expected_agent)
    except ProtocolError as exc:
        assert exc.code == code, f"refused with {exc.code}, expected {code}"
    else:
        raise AssertionError("the altered claim still verified")


def _check_vector(name: str, vector: dict[str, Any], rec: Recorder) -> None:
    with rec.case(f"{name}/type"):
        assert vector["type"] == MANIFEST_KEY_CLAIM_TAG, vector["type"]
    with rec.case(f"{name}/canonical"):
        rebuilt = key_claim_bytes(vector["issued_at"], vector["id"], vector["encryption_key"])
        assert rebuilt == vector["canonical"].encode("utf-8"), (
            f"rebuilt {rebuilt!r}, fixture {vector['canonical']!r}"
        )
        assert rebuilt.count(b"\n") == 3, "always four components"
    with rec.case(f"{name}/verify"):
        verify_key_claim(_manifest(vector), expected_agent=vector["id"])
    with rec.case(f"{name}/resign"):
        key = KeyPair.from_seed(vector["agent_seed"])
        assert key.public_key == vector["id"], "the seed does not belong to id"
        again = sign_key_claim(
            key, issued_at=vector["issued_at"], encryption_key=vector["encryption_key"] or None
        )
        assert again == vector["signature"], f"re-signed {again!r}, fixture {vector['signature']!r}"
    if "trust" in vector:
        with rec.case(f"{name}/trust_block_names"):
            trust = vector["trust"]
            assert trust["issued_at"] == vector["issued_at"]
            assert trust["signature"] == vector["signature"]
    with rec.case(f"{name}/refused_for_another_agent"):
        _refused(_manifest(vector), _OTHER_AGENT, "IDENTITY_MISMATCH")
        assert not key_claim_verifies(_manifest(vector), expected_agent=_OTHER_AGENT)
    with rec.case(f"{name}/refused_with_substituted_key"):
        forged = _manifest(vector)
        forged["encryption_key"] = "A" * 43
        _refused(forged, vector["id"], "INVALID_MANIFEST")
    with rec.case(f"{name}/newline_component_refused"):
        try:
            key_claim_bytes(vector["issued_at"] + "\n", vector["id"], vector["encryption_key"])
        except ValueError:
            pass
        else:
            raise AssertionError("a component with a newline was accepted")


def run(fixture: dict[str, Any], rec: Recorder) -> None:
    for name in _VECTORS:
        _check_vector(name, fixture[name], rec)
