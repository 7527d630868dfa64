"""meshnode-core.json: the project's own regression vectors (conformance/vectors)."""

from __future__ import annotations

from typing import Any

from meshnode.protocol.attestations import key_claim_bytes, sign_key_claim, verify_vouch
from meshnode.protocol.canonical import canonical_text
from meshnode.protocol.envelope import decode_envelope, encode_envelope, sign_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.fencing import FrameProvenance, build_frame, fence_sender_text
from meshnode.protocol.nkeys import KeyPair
from meshnode.protocol.timeutil import parse_rfc3339_ms

from .. import Recorder

FILES = ["meshnode-core.json"]


def run(fixture: dict[str, Any], rec: Recorder) -> None:
    ids = fixture["identities"]
    for name in ("sender", "recipient", "node"):
        with rec.case(f"identities/{name}"):
            assert KeyPair.from_seed(ids[f"{name}_seed"]).public_key == ids[name]
    for i, row in enumerate(fixture["canonical"]):
        with rec.case(f"canonical/{i}"):
            assert canonical_text(row["value"]) == row["canonical"]
    sender = KeyPair.from_seed(ids["sender_seed"])
    for row in fixture["envelopes"]:
        with rec.case(f"envelopes/{row['name']}"):
            env = row["envelope"]
            body = {k: v for k, v in env.items() if k != "sig"}
            assert canonical_text(body) == row["canonical"]
            decode_envelope(encode_envelope(env))  # verifies
            assert sign_envelope(dict(body), sender)["sig"] == env["sig"]
            tampered = dict(env, ts="2000-01-01T00:00:00.000Z")
            try:
                decode_envelope(encode_envelope(tampered))
            except ProtocolError as exc:
                assert exc.code == "IDENTITY_MISMATCH"
            else:
                raise AssertionError("a changed member must break the signature")
    with rec.case("vouch"):
        vouch = fixture["vouch"]["signed"]
        assert canonical_text({k: v for k, v in vouch.items() if k != "sig"}) == fixture["vouch"]["canonical"]
        verify_vouch(vouch, now_ms=parse_rfc3339_ms(vouch["issued_at"]), expected_node=ids["node"], expected_agent=ids["recipient"])
    with rec.case("key_claim"):
        claim = fixture["key_claim"]
        assert key_claim_bytes(claim["issued_at"], ids["recipient"], None).decode() == claim["bytes"]
        assert sign_key_claim(KeyPair.from_seed(ids["recipient_seed"]), issued_at=claim["issued_at"]) == claim["signature"]
    for i, row in enumerate(fixture["fence"]):
        with rec.case(f"fence/{i}"):
            assert fence_sender_text(row["input"]) == row["expected"]
    with rec.case("frame"):
        f = fixture["frame"]
        assert str(build_frame(f["text"], FrameProvenance(f["sender"], f["received_at_ms"], f["trace_id"]))) == f["expected"]
