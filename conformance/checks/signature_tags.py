"""signature-tags.json: the tagged signatures of the vouch (§4.4), the room
descriptor (EXT-5 §2) and the admission roster (EXT-6 §3).

Each block is a standard signed vector: rebuild the canonical JSON from
``signed`` minus ``sig`` and compare it byte for byte, verify the signature
under the block's prefix with the published signer key, re-sign from the
published seed, and confirm that one flipped byte (of the signature, and of
the signed bytes) no longer verifies. The roster's signature is padded
standard base64; the others are unpadded base64url.
"""

from __future__ import annotations

import copy
from typing import Any

from meshnode.protocol.attestations import (
    SignatureEncoding,
    SignedVectorError,
    decode_signature,
    encode_signature,
    standard_signed_bytes,
    verify_signed_vector,
    verify_vouch,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import verify
from meshnode.protocol.timeutil import parse_rfc3339_ms

from .. import Recorder

FILES = ["signature-tags.json"]

_BLOCKS: dict[str, SignatureEncoding] = {
    "vouch": SignatureEncoding.BASE64URL,
    "room_descriptor": SignatureEncoding.BASE64URL,
    "admission_roster": SignatureEncoding.BASE64,
}


def _flipped_signature_fails(block: dict[str, Any], signer: str, encoding: SignatureEncoding) -> None:
    signed = block["signed"]
    raw = bytearray(decode_signature(signed["sig"], encoding))
    raw[0] ^= 0x01
    tampered = dict(signed, sig=encode_signature(bytes(raw), encoding))
    try:
        verify_signed_vector(tampered, tag=block["signed_bytes_prefix"], signer=signer, encoding=encoding)
    except SignedVectorError as exc:
        assert exc.check == "signature", f"failed the wrong check: {exc}"
    else:
        raise AssertionError("a signature with one flipped bit still verified")


def _flipped_message_fails(block: dict[str, Any], signer: str, encoding: SignatureEncoding) -> None:
    _, message = standard_signed_bytes(block["signed"], block["signed_bytes_prefix"])
    tampered = bytearray(message)
    tampered[-2] ^= 0x01  # inside the canonical JSON, before the closing brace
    sig = decode_signature(block["signed"]["sig"], encoding)
    assert verify(signer, message, sig), "the untampered bytes must verify"
    assert not verify(signer, bytes(tampered), sig), "signed bytes with one flipped bit still verified"


def _check_block(name: str, fixture: dict[str, Any], rec: Recorder) -> None:
    block = fixture[name]
    encoding = _BLOCKS[name]
    signer = fixture["identities"]["sender"]
    seed = fixture["identities"]["sender_seed"]
    tag = block["signed_bytes_prefix"]
    with rec.case(f"{name}/prefix"):
        assert tag.endswith("\n") and tag.count("\n") == 1, f"prefix {tag!r} is not one tagged line"
    with rec.case(f"{name}/canonical"):
        canonical, _ = standard_signed_bytes(block["signed"], tag)
        assert canonical == block["canonical"].encode("utf-8"), (
            f"rebuilt {canonical!r}, fixture {block['canonical']!r}"
        )
    with rec.case(f"{name}/verify"):
        verify_signed_vector(
            block["signed"], tag=tag, signer=signer, encoding=encoding, canonical=block["canonical"]
        )
    with rec.case(f"{name}/resign"):
        verify_signed_vector(block["signed"], tag=tag, signer=signer, encoding=encoding, seed=seed)
    with rec.case(f"{name}/flipped_signature_fails"):
        _flipped_signature_fails(block, signer, encoding)
    with rec.case(f"{name}/flipped_bytes_fail"):
        _flipped_message_fails(block, signer, encoding)
    with rec.case(f"{name}/wrong_encoding_refused"):
        other = (
            SignatureEncoding.BASE64
            if encoding is SignatureEncoding.BASE64URL
            else SignatureEncoding.BASE64URL
        )
        try:
            verify_signed_vector(block["signed"], tag=tag, signer=signer, encoding=other)
        except SignedVectorError:
            pass
        else:
            raise AssertionError(f"a {encoding} signature was accepted as {other}")


def _check_vouch_verifier(fixture: dict[str, Any], rec: Recorder) -> None:
    """The production verifier (not just the generic helper) accepts the vector."""
    vouch = fixture["vouch"]["signed"]
    node, agent = fixture["identities"]["sender"], fixture["identities"]["recipient"]
    issued_ms = parse_rfc3339_ms(vouch["issued_at"])
    with rec.case("vouch/verify_vouch_accepts"):
        verify_vouch(vouch, now_ms=issued_ms, expected_node=node, expected_agent=agent)
    with rec.case("vouch/verify_vouch_refuses_untagged_bytes_for_other_tag"):
        forged = copy.deepcopy(fixture["room_descriptor"]["signed"])
        forged.update({k: vouch[k] for k in ("node", "agent", "issued_at", "expires_at")})
        try:
            verify_vouch(forged, now_ms=issued_ms, expected_node=node, expected_agent=agent)
        except ProtocolError as exc:
            assert exc.code == "UNAUTHORIZED", exc.code
        else:
            raise AssertionError("a descriptor signature was accepted as a vouch")


def run(fixture: dict[str, Any], rec: Recorder) -> None:
    for name in _BLOCKS:
        _check_block(name, fixture, rec)
    _check_vouch_verifier(fixture, rec)
