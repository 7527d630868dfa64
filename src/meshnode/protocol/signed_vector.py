"""The standard signed vector: a tag, canonical JSON minus the signature, a signature.

The shape the conformance fixtures publish for every signed object, checked
generically (:func:`verify_signed_vector`), with the two signature encodings
the protocol carries decoded strictly. Lives apart from :mod:`.attestations`
because it judges any signed object, not one kind of statement; the names are
re-exported there, where callers first found them.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from .canonical import CanonicalJSONError, canonicalize
from .nkeys import KeyPair, verify
from .signing import b64url_encode

__all__ = [
    "SignatureEncoding",
    "SignedVectorError",
    "decode_signature",
    "encode_signature",
    "standard_signed_bytes",
    "verify_signed_vector",
]


class SignatureEncoding(StrEnum):
    """How a signature is carried: base64url without padding (everything but
    the admission roster), or standard base64 with padding (the roster)."""

    BASE64URL = "base64url"
    BASE64 = "base64"


_B64URL_UNPADDED = re.compile(r"[A-Za-z0-9_-]*")
_B64_PADDED = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")


def encode_signature(raw: bytes, encoding: SignatureEncoding) -> str:
    """Encode signature bytes in ``encoding``."""
    if encoding is SignatureEncoding.BASE64:
        return base64.b64encode(raw).decode("ascii")
    return b64url_encode(raw)


def decode_signature(text: str, encoding: SignatureEncoding) -> bytes:
    """Strictly decode a signature in exactly ``encoding``; ValueError otherwise.

    Strict on purpose: a verifier that silently skips foreign characters can be
    made to read two different strings as one signature.
    """
    if not isinstance(text, str):
        raise ValueError("a signature is a string")
    if encoding is SignatureEncoding.BASE64:
        if len(text) % 4 or not _B64_PADDED.fullmatch(text):
            raise ValueError("not padded standard base64")
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"not padded standard base64: {exc}") from None
    if len(text) % 4 == 1 or not _B64URL_UNPADDED.fullmatch(text):
        raise ValueError("not unpadded base64url")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not unpadded base64url: {exc}") from None
    if b64url_encode(raw) != text:  # non-canonical trailing bits
        raise ValueError("not canonical base64url")
    return raw


class SignedVectorError(ValueError):
    """A signed vector failed one named check (``check``): ``canonical``,
    ``signature``, ``resign`` or ``shape``."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check = check


def _tag_prefix(tag: str) -> bytes:
    # Fixtures publish the prefix with its newline (`signed_bytes_prefix`);
    # callers may pass the bare tag. Either way the bytes are `tag` + LF.
    bare = tag[:-1] if tag.endswith("\n") else tag
    if not bare or "\n" in bare:
        raise ValueError("a signature tag is one line")
    return bare.encode("ascii") + b"\n"


def standard_signed_bytes(
    obj: Mapping[str, Any], tag: str, sig_member: str = "sig"
) -> tuple[bytes, bytes]:
    """``(canonical, signed)`` for a standard signed object: the canonical JSON
    of ``obj`` without ``sig_member``, and ``tag\\n`` + that canonical."""
    canonical = canonicalize({k: v for k, v in obj.items() if k != sig_member})
    return canonical, _tag_prefix(tag) + canonical


def verify_signed_vector(
    signed: Mapping[str, Any],
    *,
    tag: str,
    signer: str,
    encoding: SignatureEncoding = SignatureEncoding.BASE64URL,
    sig_member: str = "sig",
    canonical: str | None = None,
    seed: str | None = None,
) -> None:
    """Check a standard signed vector; raise :class:`SignedVectorError` naming the failed check.

    Rebuilds the canonical JSON of ``signed`` minus ``sig_member`` and, when
    ``canonical`` is given, compares it byte for byte; verifies the signature
    (decoded strictly in ``encoding``) over ``tag\\n`` + canonical against
    ``signer``; and, when ``seed`` is given, re-signs those bytes with the
    seed (Ed25519 is deterministic) and compares the encoded signature, after
    checking the seed's public key is ``signer``.
    """
    if not isinstance(signed, Mapping) or not isinstance(signed.get(sig_member), str):
        raise SignedVectorError("shape", f"no string {sig_member!r} member")
    try:
        rebuilt, message = standard_signed_bytes(signed, tag, sig_member)
    except (CanonicalJSONError, ValueError) as exc:
        raise SignedVectorError("canonical", str(exc)) from None
    if canonical is not None and rebuilt != canonical.encode("utf-8"):
        raise SignedVectorError(
            "canonical", f"rebuilt {rebuilt.decode('utf-8')!r} differs from {canonical!r}"
        )
    try:
        sig = decode_signature(signed[sig_member], encoding)
    except ValueError as exc:
        raise SignedVectorError("signature", str(exc)) from None
    if not verify(signer, message, sig):
        raise SignedVectorError("signature", f"does not verify against {signer}")
    if seed is not None:
        key = KeyPair.from_seed(seed)
        if key.public_key != signer:
            raise SignedVectorError("resign", "the seed does not belong to the signer")
        again = encode_signature(key.sign(message), encoding)
        if again != signed[sig_member]:
            raise SignedVectorError("resign", f"re-signed {again!r}, published {signed[sig_member]!r}")
