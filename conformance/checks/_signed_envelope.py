"""The standard signed-vector checks (fixtures README §4) for a signed envelope.

Not a check module (no FILES): shared by the accept, budget and cancel checks.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from meshnode.protocol.canonical import canonical_text
from meshnode.protocol.envelope import decode_envelope, verify_envelope
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import KeyPair, verify
from meshnode.protocol.signing import ENVELOPE_TAG, b64url_decode, sign_object, verify_object

from .. import Recorder


def _without_sig(env: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in env.items() if k != "sig"}


def _flip_first_letter(value: str) -> str:
    for i, ch in enumerate(value):
        if ch.isalpha():
            return value[:i] + ("b" if ch != "b" else "c") + value[i + 1 :]
    return value + "x"


def check_signed_envelope(
    rec: Recorder,
    name: str,
    vector: dict[str, Any],
    seed: str,
    *,
    env_member: str = "signed",
    tamper_path: tuple[str, ...] = ("payload",),
) -> None:
    """Record canonical / prefix / signature / decode / re-sign / tamper cases.

    ``tamper_path`` names a string member (or an object holding one) whose first
    letter is changed to prove that one changed byte fails verification.
    """
    env: dict[str, Any] = vector[env_member]
    prefix: str = vector["signed_bytes_prefix"]
    canonical: str = vector["canonical"]

    with rec.case(f"{name}/canonical"):
        got = canonical_text(_without_sig(env))
        assert got == canonical, f"canonical differs:\n got {got!r}\nwant {canonical!r}"

    with rec.case(f"{name}/prefix"):
        assert prefix == ENVELOPE_TAG + "\n", f"unexpected prefix {prefix!r}"

    with rec.case(f"{name}/signature"):
        raw = prefix.encode("ascii") + canonical.encode("utf-8")
        assert verify(env["from"], raw, b64url_decode(env["sig"])), "fixture bytes do not verify"
        assert verify_object(env, ENVELOPE_TAG, env["from"]), "object does not verify"
        verify_envelope(env)

    with rec.case(f"{name}/decode"):
        decoded = decode_envelope(json.dumps(env).encode("utf-8"))
        assert decoded == env

    with rec.case(f"{name}/resign"):
        key = KeyPair.from_seed(seed)
        assert key.public_key == env["from"], "the published seed does not own from"
        assert sign_object(env, ENVELOPE_TAG, key) == env["sig"], "re-signing gave another signature"

    with rec.case(f"{name}/tamper"):
        raw = prefix.encode("ascii") + canonical.encode("utf-8")
        sig = b64url_decode(env["sig"])
        for index in (len(prefix), len(raw) // 2, len(raw) - 2):
            flipped = bytearray(raw)
            flipped[index] ^= 0x01
            assert not verify(env["from"], bytes(flipped), sig), f"flipped byte {index} verified"
        bad_sig = bytearray(sig)
        bad_sig[0] ^= 0x01
        assert not verify(env["from"], bytes(raw), bytes(bad_sig)), "flipped signature verified"
        mutated = copy.deepcopy(env)
        holder: Any = mutated
        for key_name in tamper_path[:-1]:
            holder = holder[key_name]
        last = tamper_path[-1]
        target = holder[last]
        if isinstance(target, dict):
            member = sorted(k for k, v in target.items() if isinstance(v, str))[0]
            target[member] = _flip_first_letter(target[member])
        else:
            holder[last] = _flip_first_letter(target)
        try:
            verify_envelope(mutated)
        except ProtocolError as exc:
            assert exc.code == "IDENTITY_MISMATCH", exc.code
        else:
            raise AssertionError("a changed member still verified")
