"""NATS nkey encoding of Ed25519 keys (AgentMesh §4, WIRE-NOTES "Identities").

A public key is base32 (RFC 4648, unpadded) of ``prefix byte || 32-byte key ||
CRC-16/XMODEM little-endian``; user keys (agents, nodes) start with ``U``. A seed
is the same construction over a two-byte prefix (``S`` + the public prefix) and
the 32-byte Ed25519 seed, so a user seed starts with ``SU``.

Operator (``O``) and account (``A``) keys use the same scheme; the embedded
mesh mints them for the NATS JWT chain.
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
from dataclasses import dataclass
from enum import IntEnum

import nacl.exceptions
import nacl.signing

__all__ = [
    "KeyPair",
    "NkeyError",
    "Prefix",
    "decode_public",
    "decode_seed",
    "encode_public",
    "encode_seed",
    "is_valid_public",
    "verify",
]


class NkeyError(ValueError):
    """A malformed nkey: wrong length, bad base32, wrong prefix or bad checksum."""


class Prefix(IntEnum):
    """The first byte of an encoded key, which names its role."""

    SEED = 18 << 3  # 'S'
    OPERATOR = 14 << 3  # 'O'
    ACCOUNT = 0  # 'A'
    USER = 20 << 3  # 'U'
    SERVER = 13 << 3  # 'N'
    CLUSTER = 2 << 3  # 'C'


_PUBLIC_PREFIXES = frozenset(
    {Prefix.OPERATOR, Prefix.ACCOUNT, Prefix.USER, Prefix.SERVER, Prefix.CLUSTER}
)


def _crc16(data: bytes) -> int:
    # CRC-16/XMODEM: poly 0x1021, init 0 (binascii.crc_hqx is exactly that).
    return binascii.crc_hqx(data, 0)


def _b32encode(raw: bytes) -> str:
    return base64.b32encode(raw).decode("ascii").rstrip("=")


def _b32decode(text: str) -> bytes:
    if not text.isascii():
        raise NkeyError("nkey holds non-ASCII characters")
    padded = text + "=" * (-len(text) % 8)
    try:
        return base64.b32decode(padded, casefold=False)
    except (binascii.Error, ValueError) as exc:
        raise NkeyError(f"nkey is not valid base32: {exc}") from None


def _with_crc(raw: bytes) -> bytes:
    return raw + _crc16(raw).to_bytes(2, "little")


def _check_crc(raw: bytes) -> bytes:
    if len(raw) < 3:
        raise NkeyError("nkey too short")
    body, crc = raw[:-2], int.from_bytes(raw[-2:], "little")
    if _crc16(body) != crc:
        raise NkeyError("nkey checksum does not match")
    return body


def _check_key_material(raw: bytes, what: str, prefix: Prefix) -> None:
    """Refuse what cannot be encoded: 32 raw bytes under a public-key role prefix."""
    if len(raw) != 32:
        raise NkeyError(f"an Ed25519 {what} is 32 bytes")
    if prefix not in _PUBLIC_PREFIXES:
        raise NkeyError(f"{prefix!r} is not a public-key prefix")


def encode_public(key: bytes, prefix: Prefix = Prefix.USER) -> str:
    """Encode a 32-byte Ed25519 public key as an nkey string."""
    _check_key_material(key, "public key", prefix)
    return _b32encode(_with_crc(bytes([prefix]) + key))


@functools.lru_cache(maxsize=65536)
def _decode_public_cached(text: str) -> tuple[int, bytes]:
    if len(text) != 56:
        raise NkeyError(f"a public nkey is 56 characters, got {len(text)}")
    body = _check_crc(_b32decode(text))
    if len(body) != 33:
        raise NkeyError("public nkey has the wrong length")
    prefix = body[0]
    if prefix not in _PUBLIC_PREFIXES:
        raise NkeyError(f"unknown nkey prefix byte {prefix}")
    return prefix, body[1:]


def decode_public(text: str, expect: Prefix | None = Prefix.USER) -> bytes:
    """Decode a public nkey to its 32 raw bytes, checking prefix and checksum."""
    if not isinstance(text, str):
        raise NkeyError("an nkey is a string")
    prefix, key = _decode_public_cached(text)
    if expect is not None and prefix != expect:
        raise NkeyError(f"expected a {expect.name.lower()} key, got a {Prefix(prefix).name.lower()} key")
    return key


def is_valid_public(text: object, expect: Prefix | None = Prefix.USER) -> bool:
    """True when ``text`` is a well-formed public nkey of the expected role."""
    if not isinstance(text, str):
        return False
    try:
        decode_public(text, expect)
    except NkeyError:
        return False
    return True


def encode_seed(seed: bytes, prefix: Prefix = Prefix.USER) -> str:
    """Encode a 32-byte Ed25519 seed as an nkey seed string (``SU...`` for users)."""
    _check_key_material(seed, "seed", prefix)
    head = bytes([Prefix.SEED | (prefix >> 5), (prefix & 31) << 3])
    return _b32encode(_with_crc(head + seed))


def decode_seed(text: str) -> tuple[Prefix, bytes]:
    """Decode an nkey seed to (role prefix, 32-byte seed)."""
    if not isinstance(text, str):
        raise NkeyError("an nkey seed is a string")
    text = text.strip()
    body = _check_crc(_b32decode(text))
    if len(body) != 34:
        raise NkeyError("nkey seed has the wrong length")
    b0, b1 = body[0], body[1]
    if b0 & 0xF8 != Prefix.SEED:
        raise NkeyError("not an nkey seed (must start with S)")
    role = ((b0 & 7) << 5) | ((b1 & 0xF8) >> 3)
    if role not in _PUBLIC_PREFIXES:
        raise NkeyError(f"unknown seed role byte {role}")
    return Prefix(role), body[2:]


@dataclass(frozen=True, slots=True, repr=False)
class KeyPair:
    """An Ed25519 key pair with its nkey encodings.

    ``repr`` never shows the seed, so a key pair can appear in logs safely.
    """

    role: Prefix
    _signing_key: nacl.signing.SigningKey
    public_key: str

    @classmethod
    def generate(cls, role: Prefix = Prefix.USER) -> KeyPair:
        return cls.from_raw_seed(os.urandom(32), role)

    @classmethod
    def from_raw_seed(cls, seed: bytes, role: Prefix = Prefix.USER) -> KeyPair:
        sk = nacl.signing.SigningKey(seed)
        return cls(role, sk, encode_public(bytes(sk.verify_key), role))

    @classmethod
    def from_seed(cls, seed: str | bytes) -> KeyPair:
        """Load from an nkey seed string (``SU...``, ``SA...``, ``SO...``)."""
        text = seed.decode("ascii") if isinstance(seed, bytes) else seed
        role, raw = decode_seed(text)
        return cls.from_raw_seed(raw, role)

    @property
    def seed(self) -> str:
        """The nkey seed string. Secret: store it protected, never log it."""
        return encode_seed(bytes(self._signing_key), self.role)

    @property
    def raw_public(self) -> bytes:
        return bytes(self._signing_key.verify_key)

    def sign(self, message: bytes) -> bytes:
        """A detached 64-byte Ed25519 signature over ``message``."""
        return self._signing_key.sign(message).signature

    def __repr__(self) -> str:
        return f"KeyPair({self.role.name.lower()}, {self.public_key})"


@functools.lru_cache(maxsize=65536)
def _verify_key(raw: bytes) -> nacl.signing.VerifyKey:
    return nacl.signing.VerifyKey(raw)


def verify(public_key: str, message: bytes, signature: bytes, expect: Prefix | None = None) -> bool:
    """Verify a detached Ed25519 signature against a public nkey."""
    try:
        raw = decode_public(public_key, expect)
    except NkeyError:
        return False
    if len(signature) != 64:
        return False
    try:
        _verify_key(raw).verify(message, signature)
    except nacl.exceptions.BadSignatureError:
        return False
    return True
