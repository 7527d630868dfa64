"""``meshnode envelope``: the debugging CLI, driven as a user would drive it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshnode.protocol.envelope import decode_envelope
from meshnode.protocol.nkeys import KeyPair


def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshnode.cli", "envelope", *args],
        input=stdin, capture_output=True, text=True, timeout=60,
    )


@pytest.fixture
def seed_file(tmp_path: Path) -> tuple[Path, KeyPair]:
    key = KeyPair.generate()
    path = tmp_path / "agent.seed"
    path.write_text(key.seed)
    return path, key


def test_canonical_outputs_jcs_bytes() -> None:
    out = run("canonical", stdin='{"b": 1.0, "a": [1e21, "\\u000b"], "\\ufb00": 0, "\\ud83d\\ude00": 1}')
    assert out.returncode == 0
    assert out.stdout == '{"a":[1e+21,"\\u000b"],"b":1,"\U0001f600":1,"\ufb00":0}'


def test_canonical_refuses_invalid_input() -> None:
    out = run("canonical", stdin="{not json")
    assert out.returncode == 65 and "invalid input" in out.stderr


def test_sign_then_verify(seed_file: tuple[Path, KeyPair]) -> None:
    path, key = seed_file
    signed = run("sign", "--seed-file", str(path), stdin='{"type":"request","payload":{"offering":"echo"}}')
    assert signed.returncode == 0, signed.stderr
    env = json.loads(signed.stdout)
    assert env["from"] == key.public_key
    decode_envelope(signed.stdout)  # verifies
    ok = run("verify", "--json", stdin=signed.stdout)
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] is True


def test_verify_names_the_failed_check(seed_file: tuple[Path, KeyPair]) -> None:
    path, _ = seed_file
    signed = run("sign", "--seed-file", str(path), stdin='{"type":"emit","payload":{"n":1}}').stdout
    tampered = signed.replace('"n": 1', '"n": 2')
    bad_sig = run("verify", "--json", stdin=tampered)
    assert bad_sig.returncode == 1
    assert json.loads(bad_sig.stdout)["check"] == "signature"
    env = json.loads(signed)
    env["v"] = "1.0.0"
    bad_version = run("verify", stdin=json.dumps(env))
    assert bad_version.returncode == 65 and "version check failed" in bad_version.stdout
    not_json = run("verify", "--json", stdin="nope")
    assert not_json.returncode == 65 and json.loads(not_json.stdout)["check"] == "json"


def test_sign_refuses_foreign_from(seed_file: tuple[Path, KeyPair]) -> None:
    path, _ = seed_file
    other = KeyPair.generate().public_key
    out = run("sign", "--seed-file", str(path), stdin=json.dumps({"type": "emit", "from": other}))
    assert out.returncode == 65 and "seed is for" in out.stderr


def test_sign_with_unreadable_seed_file(tmp_path: Path) -> None:
    out = run("sign", "--seed-file", str(tmp_path / "missing"), stdin="{}")
    assert out.returncode == 66
