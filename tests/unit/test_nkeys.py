"""nkey encoding (§4, WIRE-NOTES): user keys and seeds, checksums, roles."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnode.protocol.nkeys import (
    KeyPair,
    NkeyError,
    Prefix,
    decode_public,
    decode_seed,
    encode_public,
    encode_seed,
    is_valid_public,
    verify,
)
from tests.conftest import load_fixture


def test_published_identity_pair() -> None:
    fixture = load_fixture("signature-tags.json")
    ids = fixture["identities"]
    seeds = {k: v for k, v in ids.items() if isinstance(v, str) and v.startswith("SU")}
    publics = {v for v in ids.values() if isinstance(v, str) and v.startswith("U")}
    assert seeds, "fixture has a published seed"
    for seed in seeds.values():
        assert KeyPair.from_seed(seed).public_key in publics


@given(st.binary(min_size=32, max_size=32))
def test_seed_round_trip(raw: bytes) -> None:
    seed = encode_seed(raw)
    assert seed.startswith("SU")
    role, back = decode_seed(seed)
    assert role is Prefix.USER and back == raw
    pair = KeyPair.from_seed(seed)
    assert pair.seed == seed
    assert pair.public_key.startswith("U") and len(pair.public_key) == 56
    assert decode_public(pair.public_key) == pair.raw_public


@pytest.mark.parametrize("role,letter", [(Prefix.USER, "U"), (Prefix.ACCOUNT, "A"), (Prefix.OPERATOR, "O")])
def test_roles(role: Prefix, letter: str) -> None:
    pair = KeyPair.generate(role)
    assert pair.public_key[0] == letter
    assert pair.seed[:2] == "S" + letter
    assert KeyPair.from_seed(pair.seed).public_key == pair.public_key


def test_bad_checksum_refused() -> None:
    key = KeyPair.generate().public_key
    flipped = key[:-1] + ("A" if key[-1] != "A" else "B")
    with pytest.raises(NkeyError, match="checksum|base32"):
        decode_public(flipped)
    assert not is_valid_public(flipped)


def test_wrong_prefix_refused() -> None:
    account = KeyPair.generate(Prefix.ACCOUNT).public_key
    with pytest.raises(NkeyError, match="expected a user key"):
        decode_public(account)
    assert is_valid_public(account, Prefix.ACCOUNT)
    assert not is_valid_public(account)


@pytest.mark.parametrize("bad", ["", "U", "u" * 56, "U" + "1" * 55, None, 42])
def test_malformed_refused(bad: object) -> None:
    assert not is_valid_public(bad)


def test_encode_refuses_wrong_lengths() -> None:
    with pytest.raises(NkeyError):
        encode_public(b"x" * 31)
    with pytest.raises(NkeyError):
        encode_seed(b"x" * 33)


def test_sign_and_verify() -> None:
    pair = KeyPair.generate()
    sig = pair.sign(b"message")
    assert verify(pair.public_key, b"message", sig)
    assert not verify(pair.public_key, b"messagE", sig)
    assert not verify(KeyPair.generate().public_key, b"message", sig)
    assert not verify("not-a-key", b"message", sig)
    assert not verify(pair.public_key, b"message", sig[:10])


def test_repr_never_shows_the_seed() -> None:
    pair = KeyPair.generate()
    assert pair.seed not in repr(pair)
    assert pair.public_key in repr(pair)
