"""``meshnode envelope``: the debugging CLI, driven as a user would drive it."""

from __future__ import annotations

import json
import os
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
    path.chmod(0o600)
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


def test_keygen_out_writes_a_private_file_that_sign_takes(tmp_path: Path) -> None:
    """keygen's example was ``keygen > agent.json``: the seed in a file of the umask's
    mode (0644), and one sign could not read (it wanted the bare seed)."""
    path = tmp_path / "agent.json"
    made = run("keygen", "--out", str(path))
    assert made.returncode == 0, made.stderr
    written = json.loads(path.read_text())
    assert made.stdout == written["public_key"] + "\n" and written["seed"].startswith("SU")
    assert path.stat().st_mode & 0o777 == 0o600
    again = run("keygen", "--out", str(path))
    assert again.returncode == 73 and f"{path} exists; not replacing a key" in again.stderr
    assert json.loads(path.read_text()) == written
    signed = run("sign", "--seed-file", str(path), stdin='{"type":"emit","payload":{"n":1}}')
    assert signed.returncode == 0 and signed.stderr == "", signed.stderr
    assert json.loads(signed.stdout)["from"] == written["public_key"]


def test_a_seed_readable_by_others_is_warned_about(tmp_path: Path, seed_file: tuple[Path, KeyPair]) -> None:
    path, key = seed_file
    path.chmod(0o644)
    signed = run("sign", "--seed-file", str(path), stdin='{"type":"emit","payload":{"n":1}}')
    assert signed.returncode == 0
    assert (f"warning: seed file {path} is readable by others (mode 0644): it holds a secret key; "
            f"chmod 600 {path}") in signed.stderr
    redirected = tmp_path / "redirected.json"
    fd = os.open(redirected, os.O_WRONLY | os.O_CREAT, 0o644)
    os.fchmod(fd, 0o644)
    with os.fdopen(fd, "w") as out:
        made = subprocess.run([sys.executable, "-m", "meshnode.cli", "envelope", "keygen"], stdout=out,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    assert made.returncode == 0 and "seed" in json.loads(redirected.read_text())
    assert "the seed went to a file that is readable by others (mode 0644)" in made.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"public_key": "U"}')
    refused = run("sign", "--seed-file", str(bad), stdin="{}")
    assert refused.returncode == 65 and 'JSON without a "seed" string' in refused.stderr
