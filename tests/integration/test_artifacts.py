"""Artifacts with real daemons on a real mesh (§7.5, §7.5.2, §7.5.3, §18.9, §5.6).

Node A runs the embedded mesh and with it the artifact store; node B joins
with an invite. Agents of the ``test-artifacts`` kind (tests/agents) put,
fetch, tamper and derive; the CLI drives ``meshnode artifacts``.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meshnode.protocol.rests_on import digest_of
from meshnode.protocol.timeutil import parse_rfc3339_ms
from meshnode.testing import DaemonProcess, DaemonSet, consistently, eventually
from tests.integration.cli_here import cli_here_bytes

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
NODE = {"plugin_modules": ["tests.agents:artifacts_plugin"]}


def _two_nodes(daemons: DaemonSet) -> tuple[DaemonProcess, DaemonProcess]:
    a = daemons.embedded("a", agents={"arts": {"plugin": "test-artifacts"}}, node=NODE)
    b = daemons.joined("b", via=a, agents={"arts_b": {"plugin": "test-artifacts"}}, node=NODE)
    return a, b


def _ok(result: dict[str, Any]) -> Any:
    assert result["status"] == "completed", result
    return result["output"]


def _error(result: dict[str, Any]) -> dict[str, Any]:
    assert result["status"] == "failed", result
    error: dict[str, Any] = result["error"]
    return error


def _cli(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[bytes]:
    """``meshnode artifacts ARGS`` in this process (tests/integration/cli_here.py: the
    imports of a fresh interpreter cost ~0.8 s a command)."""
    return cli_here_bytes("artifacts", *args, "--socket", daemon.socket_path)


def _cli_process(daemon: DaemonProcess, *args: str, stdin: bytes | None = None,
                 timeout: float = 120.0) -> subprocess.CompletedProcess[bytes]:
    """The same as a real process: for the test of the CLI's own streams and exit codes."""
    return subprocess.run(
        [sys.executable, "-m", "meshnode.cli", "artifacts", *args, "--socket", daemon.socket_path],
        capture_output=True, input=stdin, timeout=timeout,
    )


def test_a_20_mb_file_round_trips_between_agents_on_two_nodes(meshnode_daemons: DaemonSet) -> None:
    a, b = _two_nodes(meshnode_daemons)
    size = 20 * MiB
    expected = digest_of(random.Random(20).randbytes(size))

    started = time.monotonic()
    part = _ok(b.call("arts_b", "make", {"size": size, "seed": 20, "name": "twenty.bin"}, timeout=120))["part"]
    stored_s = time.monotonic() - started
    assert part["ref"].startswith("mesh:artifacts:") and len(part["ref"]) == len("mesh:artifacts:") + 22
    assert {k: v for k, v in part.items() if k != "ref"} == {
        "media_type": "application/octet-stream", "size": size, "digest": expected, "name": "twenty.bin",
    }

    started = time.monotonic()
    assert _ok(a.call("arts", "fetch", {"part": part}, timeout=120)) == {"size": size, "digest": expected}
    fetched_s = time.monotonic() - started
    print(f"20 MiB: stored in {stored_s:.1f}s, fetched and verified across nodes in {fetched_s:.1f}s")

    # The ref does not reveal its owner to whoever it is forwarded to (§18.5).
    seen_by_a = _ok(a.call("arts", "stat", {"ref": part["ref"]}))
    assert seen_by_a["size"] == size and seen_by_a["state"] == "live" and "owner" not in seen_by_a
    seen_by_b = _ok(b.call("arts_b", "stat", {"ref": part["ref"]}))
    assert seen_by_b["writer"] == b.agent_id("arts_b") and seen_by_b["owner"] == b.status()["node"]["id"]


def test_a_tampered_object_fails_the_fetch(meshnode_daemons: DaemonSet, tmp_path: Path) -> None:
    a = meshnode_daemons.embedded("a", agents={"arts": {"plugin": "test-artifacts"}}, node=NODE)
    part = _ok(a.call("arts", "make", {"size": 2 * MiB + 5, "seed": 3}))["part"]
    assert _ok(a.call("arts", "fetch", {"part": part}))["digest"] == part["digest"]

    # Overwrite the bytes straight in the JetStream object store, behind the store's back.
    assert _ok(a.call("arts", "tamper", {"ref": part["ref"]}))["size"] == part["size"]

    for target in ({"part": part}, {"ref": part["ref"]}):  # the sender's digest, or the store's record
        error = _error(a.call("arts", "fetch", target))
        assert error["code"] == "DEPENDENCY_FAILED"
        assert error["details"]["reason"] == "digest_mismatch"
        assert error["details"]["expected"] == part["digest"] and error["details"]["actual"] != part["digest"]

    out = tmp_path / "out.bin"
    proc = _cli(a, "get", part["ref"], "--out", str(out))
    assert proc.returncode == 1, proc.stderr
    assert b"digest_mismatch" in proc.stderr
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing unverified was left behind


def test_quota_and_object_size_refusals(meshnode_daemons: DaemonSet) -> None:
    a = meshnode_daemons.embedded(
        "a", agents={"arts": {"plugin": "test-artifacts"}}, node=NODE,
        extra={"artifacts": {"quota_bytes": "3MiB", "quota_objects": 3, "max_object_size": "2MiB",
                             "max_retention": "30d"}},
    )
    _ok(a.call("arts", "make", {"size": 2 * MiB, "seed": 1}))

    bytes_refused = _error(a.call("arts", "make", {"size": MiB + MiB // 2, "seed": 2}))
    assert bytes_refused["code"] == "QUOTA_EXCEEDED" and bytes_refused["retryable"] is False
    assert bytes_refused["details"] == {"limit": "bytes", "quota": 3 * MiB, "used": 2 * MiB,
                                        "requested": MiB + MiB // 2}

    too_large = _error(a.call("arts", "make", {"size": 2 * MiB + 1, "seed": 2}))
    assert too_large["code"] == "PAYLOAD_TOO_LARGE" and too_large["retryable"] is False
    assert too_large["details"]["limit"] == "max_object_bytes"

    for seed in (4, 5):
        _ok(a.call("arts", "make", {"size": 10, "seed": seed}))
    objects_refused = _error(a.call("arts", "make", {"size": 10, "seed": 6}))
    assert objects_refused["code"] == "QUOTA_EXCEEDED" and objects_refused["details"]["limit"] == "objects"

    proc = _cli(a, "usage", "--json")
    usage = json.loads(proc.stdout)
    assert usage["objects"] == 3 and usage["bytes"] == 2 * MiB + 20 and usage["quota_bytes"] == 3 * MiB

    long_kept = _error(a.call("arts", "make", {"size": 1, "seed": 7, "retention_s": 31 * 86400}))
    assert long_kept["code"] == "QUOTA_EXCEEDED" and long_kept["details"]["limit"] == "retention_s"


def test_a_reclaimed_ref_answers_gone_and_an_invented_one_not_found(meshnode_daemons: DaemonSet, tmp_path: Path) -> None:
    # The store's own sweep runs first at a random moment within a tenth of its
    # interval (5 min: within 30 s of the start); when it fell between the
    # artifact's expiry and the on-demand sweep below, that one found nothing to
    # reclaim (seen once under load). A 30-day interval puts it days away.
    a = meshnode_daemons.embedded("a", agents={"arts": {"plugin": "test-artifacts"}}, node=NODE,
                                  extra={"artifacts": {"sweep_interval": "30d"}})
    source = tmp_path / "note.txt"
    source.write_text("kept for one second")
    put = _cli(a, "put", str(source), "--retention", "1s", "--json")
    assert put.returncode == 0, put.stderr
    stored = json.loads(put.stdout)
    assert stored["name"] == "note.txt" and stored["media_type"] == "text/plain"
    assert _ok(a.call("arts", "stat", {"ref": stored["ref"]}))["state"] == "live"

    # Past its own expiry by the clock the store judges with (this host's); the sweep
    # runs on demand, so only the one-second retention itself is waited for.
    expires_ms = parse_rfc3339_ms(stored["expires_at"])
    eventually(lambda: time.time_ns() // 1_000_000 > expires_ms, what="the artifact's retention running out")
    assert a.admin("Artifacts.Sweep")["reclaimed"] == 1
    gone = _error(a.call("arts", "fetch", {"ref": stored["ref"]}))
    assert gone["code"] == "ARTIFACT_GONE" and gone["retryable"] is False
    assert gone["details"]["size"] == stored["size"] and gone["details"]["digest"] == stored["digest"]
    assert gone["details"]["reason"] == "expired" and gone["details"]["ref"] == stored["ref"]
    proc = _cli(a, "stat", stored["ref"])
    assert proc.returncode == 1 and b"ARTIFACT_GONE" in proc.stderr and stored["digest"].encode() in proc.stderr
    assert json.loads(_cli(a, "usage", "--json").stdout)["objects"] == 0  # the bytes are really gone

    invented = _error(a.call("arts", "fetch", {"ref": "mesh:artifacts:AAAAAAAAAAAAAAAAAAAAAA"}))
    assert invented["code"] == "NOT_FOUND"
    elsewhere = _error(a.call("arts", "fetch", {"ref": "mesh:rooms:r1/drive/x"}))
    assert elsewhere["code"] == "NOT_FOUND" and elsewhere["details"]["reason"] == "unknown_scheme"

    # Removal by the owner is the other way to go: gone, never "not found".
    again = json.loads(_cli(a, "put", str(source), "--json").stdout)
    assert json.loads(_cli(a, "rm", again["ref"], "--json").stdout) == {"ref": again["ref"], "removed": True}
    removed = _error(a.call("arts", "stat", {"ref": again["ref"]}))
    assert removed["code"] == "ARTIFACT_GONE" and removed["details"]["reason"] == "removed"


def test_an_oversized_output_becomes_a_ref_automatically(meshnode_daemons: DaemonSet) -> None:
    a, b = _two_nodes(meshnode_daemons)
    chars = 1_500_000  # well past the 1 MiB transport limit
    for target in (b.agent_id("arts_b"), "arts"):  # across the broker, and on the local path (§4.7)
        result = a.call(target, "big", {"chars": chars})
        pointer = _ok(result)
        assert pointer["media_type"] == "application/json" and pointer["ref"].startswith("mesh:artifacts:")
        [artifact] = result["artifacts"]
        assert artifact["id"] == pointer["artifact"] and artifact["name"] == "output"
        [part] = artifact["parts"]
        assert part == {"ref": pointer["ref"], "media_type": "application/json", "size": pointer["size"],
                        "digest": pointer["digest"], "name": "output.json"}
        expected = json.dumps({"text": "x" * chars}, separators=(",", ":")).encode()
        assert part["size"] == len(expected) and part["digest"] == digest_of(expected)
        # Any agent holding the ref part can read it back, verified.
        assert _ok(a.call("arts", "fetch", {"part": part})) == {"size": len(expected), "digest": digest_of(expected)}
    proc = _cli(a, "get", pointer["ref"])
    assert proc.returncode == 0 and json.loads(proc.stdout) == {"text": "x" * chars}


class _Recorder(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - the http.server hook name
        self.hits.append(self.path)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"fetched!")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def http_server() -> Iterator[tuple[str, list[str]]]:
    hits: list[str] = []
    handler = type("Recorder", (_Recorder,), {"hits": hits})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", hits
    finally:
        server.shutdown()
        server.server_close()


def test_a_requests_uri_file_is_never_fetched_by_the_node(
    meshnode_daemons: DaemonSet, http_server: tuple[str, list[str]]
) -> None:
    url, hits = http_server
    a, b = _two_nodes(meshnode_daemons)
    attached = _ok(a.call("arts", "make", {"size": 1000, "seed": 9, "name": "in.bin"}))["part"]
    files = [
        {"name": "chart.png", "media_type": "image/png", "uri": f"{url}/chart.png"},
        attached,
    ]
    resources = [{"uri": f"{url}/parser.git", "kind": "git", "access": "read-write",
                  "name": "parser", "description": "branch, then PR"}]
    seen = _ok(a.call("arts", "send_files", {"target": b.agent_id("arts_b"), "files": files, "resources": resources}))
    assert seen["files"] == files and seen["resources"] == resources
    assert seen["uris"] == [f"{url}/chart.png"]
    # Nothing marks "the node decided not to fetch": watch the peer for a while.
    consistently(lambda: hits == [], during=0.5, what="no fetch of the sender-chosen URIs")
    assert hits == [], f"the node dereferenced a sender-chosen address: {hits}"

    # Malformed attachments are refused before anything is sent, with the recipient's code.
    both = _error(a.call("arts", "send_files", {"target": b.agent_id("arts_b"),
                                                "files": [{"uri": f"{url}/x", "ref": attached["ref"]}]}))
    assert both["code"] == "INPUT_INVALID" and both["details"]["reason"] == "ref_xor_uri"
    assert hits == []


def test_rests_on_tells_fresh_from_stale_from_unchecked(meshnode_daemons: DaemonSet) -> None:
    a = meshnode_daemons.embedded("a", agents={"arts": {"plugin": "test-artifacts"}}, node=NODE)
    source = _ok(a.call("arts", "make", {"size": 4096, "seed": 11, "name": "invoices.zip"}))["part"]
    derived = a.call("arts", "derive", {"part": source})
    [artifact] = derived["artifacts"]
    assert artifact["id"] == _ok(derived)["artifact"]
    assert artifact["rests_on"] == [{"digest": source["digest"], "ref": source["ref"],
                                     "name": "invoices.zip", "role": "input"}]
    rests_on = artifact["rests_on"]

    assert _ok(a.call("arts", "verify", {"rests_on": rests_on})) == {"state": "fresh", "changed": [], "unreachable": []}
    assert _ok(a.call("arts", "verify", {"rests_on": None}))["state"] == "undeclared"
    _ok(a.call("arts", "tamper", {"ref": source["ref"]}))
    assert _ok(a.call("arts", "verify", {"rests_on": rests_on})) == {
        "state": "stale", "changed": [source["ref"]], "unreachable": []}
    assert _ok(a.call("arts", "verify", {"rests_on": rests_on, "countersigned": True}))["state"] == "not_applicable"
    assert _cli(a, "rm", source["ref"]).returncode == 0
    assert _ok(a.call("arts", "verify", {"rests_on": rests_on})) == {
        "state": "unchecked", "changed": [], "unreachable": [source["ref"]]}


def test_cli_streams_a_large_file_both_ways_with_progress(meshnode_daemons: DaemonSet, tmp_path: Path) -> None:
    a = meshnode_daemons.embedded("a", node=NODE)
    data = random.Random(5).randbytes(6 * MiB + 3)
    source = tmp_path / "big.bin"
    source.write_bytes(data)
    put = _cli_process(a, "put", str(source), "--name", "renamed.bin", "--media-type", "application/x-test")
    assert put.returncode == 0, put.stderr
    ref = put.stdout.decode().strip()
    assert b"uploaded" in put.stderr and b"(100%)" in put.stderr

    got = _cli_process(a, "get", ref)
    assert got.returncode == 0, got.stderr
    assert hashlib.sha256(got.stdout).digest() == hashlib.sha256(data).digest()
    assert b"fetched" in got.stderr

    stat = json.loads(_cli_process(a, "stat", ref, "--json").stdout)
    assert stat["name"] == "renamed.bin" and stat["media_type"] == "application/x-test" and stat["size"] == len(data)
    assert stat["writer"] == a.agent_id("cli")

    piped = _cli_process(a, "put", "-", "--name", "piped.txt", "--quiet", stdin=b"from stdin")
    assert piped.returncode == 0
    assert _cli_process(a, "get", piped.stdout.decode().strip()).stdout == b"from stdin"
    # `--out -` is stdout too, as `put -` is stdin (it wrote a file named "-" in the cwd).
    dashed = _cli_process(a, "get", piped.stdout.decode().strip(), "--out", "-")
    assert dashed.returncode == 0 and dashed.stdout == b"from stdin", dashed
    assert _cli_process(a, "get", "mesh:artifacts:AAAAAAAAAAAAAAAAAAAAAA").returncode == 1
    assert _cli_process(a, "put", str(tmp_path / "missing")).returncode == 66


def test_a_small_transport_limit_is_kept_by_every_message(meshnode_daemons: DaemonSet, tmp_path: Path) -> None:
    a = meshnode_daemons.embedded("a", agents={"arts": {"plugin": "test-artifacts"}}, node=NODE,
                                  extra={"mesh.embedded": {"max_payload": "128KiB"}})
    data = random.Random(8).randbytes(MiB + 1)
    source = tmp_path / "one.bin"
    source.write_bytes(data)
    put = _cli(a, "put", str(source), "--quiet")
    assert put.returncode == 0, put.stderr + a.log_tail().encode()
    ref = put.stdout.decode().strip()
    assert _ok(a.call("arts", "fetch", {"ref": ref})) == {"size": len(data), "digest": digest_of(data)}
    assert _cli(a, "get", ref).stdout == data
    pointer = _ok(a.call("arts", "big", {"chars": 200_000}))  # spilled at 128 KiB, not at 1 MiB
    assert pointer["size"] == len(json.dumps({"text": "x" * 200_000}, separators=(",", ":")))
    part = _ok(a.call("arts", "make", {"size": 300_000, "seed": 1}))["part"]
    assert _ok(a.call("arts", "fetch", {"part": part}))["digest"] == part["digest"]
