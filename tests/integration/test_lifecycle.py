"""Lifecycle surprises (issue #18), against real daemons on one shared mesh:
a taken port is named as such, ``join`` does not overwrite an edited
configuration, a gracefully stopped node is offline at once, ``agents add
--save`` survives a restart while an unsaved agent is deregistered by it (the
embedded node keeping its connection through both adds)."""

from __future__ import annotations

import errno
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from meshnode.cli import exitcodes
from meshnode.testing import DaemonProcess, DaemonSet, eventually

from .cli_here import cli_here

pytestmark = pytest.mark.integration


def _cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshnode.cli", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def daemons() -> Iterator[DaemonSet]:
    found = DaemonSet()
    try:
        yield found
    finally:
        found.close()


@pytest.fixture(scope="module")
def first(daemons: DaemonSet) -> DaemonProcess:
    return daemons.embedded("first", agents={"echo": {"plugin": "echo"}, "flaky": {"plugin": "echo"}},
                            node={"plugin_modules": ["tests.agents:plugin"]})


def _port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


@pytest.mark.parametrize("listener", ["port", "control_port"])
def test_a_taken_port_is_named(daemons: DaemonSet, first: DaemonProcess, listener: str) -> None:
    info = first.admin("Mesh.Info")
    taken = _port(info["nats_urls"][0] if listener == "port" else info["control_plane"])
    second = daemons.embedded(f"taken-{listener}", start=False, extra={"mesh.embedded": {listener: taken}})
    with pytest.raises(RuntimeError):
        second.start()
    log = second.log_text()
    who = "another nats-server?" if listener == "port" else "another meshnode?"
    assert f"port {taken} in use: {who} set [mesh.embedded] {listener} in {second.config_path}" in log, log
    assert "JETSTREAM" not in log and "Version:" not in log, "the broker's banner is not the error"


def test_a_taken_a2a_port_is_named_and_the_daemon_exits(daemons: DaemonSet) -> None:
    # The bridge binds [a2a] listen itself: a taken port fails the start with a
    # line naming the setting (uvicorn's own bind ended in sys.exit inside the
    # daemon's loop, and the daemon hung, serving nothing).
    held = daemons.listening_socket()
    port = held.getsockname()[1]
    second = daemons.embedded(
        "taken-a2a", agents={"echo": {"plugin": "echo"}}, start=False,
        extra={"a2a": {"listen": f"127.0.0.1:{port}", "expose": ["echo"]}},
    )
    with pytest.raises(RuntimeError, match="exited with 1 during start-up"):
        second.start()
    log = second.log_text()
    assert f"[a2a] listen 127.0.0.1:{port}: the address is in use" in log and 'listen = "fd://N"' in log, log


def test_a_second_daemon_on_the_same_data_directory_stops_before_touching_it(
    daemons: DaemonSet, first: DaemonProcess
) -> None:
    """A second ``meshnode run`` on a running node's data directory, with ports of
    its own (a copied configuration): it started its own nats-server on the
    running mesh's JetStream store before a taken port stopped it. It now stops
    at the data directory's lock, exit 75, naming the running daemon."""
    second = daemons.embedded("same-data-dir", start=False, node={"data_dir": str(first.data_dir)})
    with pytest.raises(RuntimeError, match="exited with 75 during start-up"):
        second.start()
    log = second.log_text()
    assert (f"another meshnode daemon (pid {first.pid}) is running with data directory {first.data_dir}: "
            "stop it first, or give this one a data directory of its own ([node] data_dir)") in log, log
    assert "started nats-server" not in log and "keys held by" not in log, log
    assert first.call("echo", "echo", "still serving")["output"] == {"ok": "still serving"}


def test_an_advertised_host_is_what_invites_and_mesh_info_give_and_what_a_joined_node_dials(
    daemons: DaemonSet, tmp_path: Path
) -> None:
    """A hub bound to every interface advertised 0.0.0.0 in its invites and in
    ``mesh info``: no other machine can dial that. ``[mesh.embedded]
    advertise_host`` names what they should dial; here ``localhost`` (the
    listeners stay on loopback, as every test's), which a node joined by the
    invite alone then uses for both the control plane and NATS."""
    hub = daemons.embedded("advertised", agents={"echo": {"plugin": "echo"}},
                           extra={"mesh.embedded": {"advertise_host": "localhost"}})
    info = hub.admin("Mesh.Info")
    [nats_url] = info["nats_urls"]
    assert re.fullmatch(r"nats://localhost:\d+", nats_url), info
    assert re.fullmatch(r"http://localhost:\d+", info["control_plane"]), info
    invite = tmp_path / "by-name.creds"
    invited = _cli("mesh", "invite", "by-name", "--out", str(invite), "--socket", hub.socket_path)
    invited.check_returncode()
    # The test hub's ports are picked at start and it listens on loopback: the invite says both.
    assert "note: [mesh.embedded] port and control_port = 0: the port was picked at this start" in invited.stderr
    assert f"note: the mesh is reachable on loopback only ({nats_url})" in invited.stderr
    text = invite.read_text(encoding="utf-8")
    assert f"# meshnode-nats: {nats_url}\n" in text and f"# meshnode-control-plane: {info['control_plane']}\n" in text
    data_dir = tmp_path / "by-name"
    _cli("join", str(invite), "--data-dir", str(data_dir), "--agent", "echo2=echo").check_returncode()
    joined_config = tomllib.loads((data_dir / "meshnode.toml").read_text(encoding="utf-8"))
    assert joined_config["mesh"] == {"servers": [nats_url], "control_plane": info["control_plane"]}
    # A node run from those URLs (the helper joins with its own invite and Mesh.Info's URLs).
    joined = daemons.joined("by-name-run", hub, agents={"echo2": {"plugin": "echo"}})
    assert joined.config["mesh"]["servers"] == [nats_url] and joined.status()["mesh"]["urls"] == [nats_url]
    echo_id = hub.agent_id("echo")
    assert joined.call(echo_id, "echo", "by name")["output"] == {"ok": "by name"}


def test_join_refuses_a_data_directory_a_running_daemon_holds(first: DaemonProcess, tmp_path: Path) -> None:
    """``join --force`` into a running node's data directory would replace its node
    key and credential under it: refused, exit 75, nothing written."""
    invite = tmp_path / "intruder.creds"
    _cli("mesh", "invite", "intruder", "--out", str(invite), "--socket", first.socket_path).check_returncode()
    keys_before = {p.name: p.read_bytes() for p in (first.data_dir / "keys").iterdir()}
    refused = _cli("join", str(invite), "--data-dir", str(first.data_dir), "--force",
                   "--config-out", str(tmp_path / "intruder.toml"))
    assert refused.returncode == exitcodes.EX_TEMPFAIL, refused.stderr
    assert (f"another meshnode daemon (pid {first.pid}) is running with data directory {first.data_dir}: "
            "stop it first, or join into another --data-dir") in refused.stderr
    assert {p.name: p.read_bytes() for p in (first.data_dir / "keys").iterdir()} == keys_before
    assert not (tmp_path / "intruder.toml").exists()
    assert first.call("echo", "echo", "untouched")["output"] == {"ok": "untouched"}


def test_a_joined_node_whose_mesh_does_not_answer_at_start_exits_75_naming_it(daemons: DaemonSet) -> None:
    """The first connection is bounded by [mesh] connect_timeout: the start failed after the
    connect stage's 30 s budget with "TimeoutError" and exit 1; it now names the servers and
    the last error, exit 75 (temporary: a supervisor's restart tries again)."""
    hub = daemons.embedded("gone-hub")
    node = daemons.joined("left-alone", hub, extra={"mesh": {"connect_timeout": "2s"}})
    servers = node.config["mesh"]["servers"]
    node.stop()
    hub.stop()
    with pytest.raises(RuntimeError, match="exited with 75 during start-up"):
        node.start()
    log = node.log_text()
    assert (f"cannot reach the mesh at {', '.join(servers)} within 2 s (last error: ConnectionRefusedError"
            in log), log
    assert f"([mesh] servers, [mesh] connect_timeout in {node.config_path})" in log, log


def test_a_node_started_after_its_invite_expired_is_refused_for_good(daemons: DaemonSet, tmp_path: Path) -> None:
    """An invite holds the node's key and enrolled whoever held it at any later time; now
    its first start must come within [mesh.embedded] invite_valid_for. Refused, the node
    says why and exits 78, which systemd does not restart (a retired node did the same
    with exit 1, restarted every 5 s for ever)."""
    hub = daemons.embedded("short-invites", extra={"mesh.embedded": {"invite_valid_for": "1s"}})
    invite = tmp_path / "stale.creds"
    _cli("mesh", "invite", "stale", "--out", str(invite), "--socket", hub.socket_path).check_returncode()

    def state() -> str:
        [node] = [n for n in hub.admin("Mesh.Nodes")["nodes"] if n["name"] == "stale"]
        return str(node["state"])

    assert state() == "invited"
    eventually(lambda: state() == "expired", timeout=30, what="the invite past its validity")
    data_dir = tmp_path / "stale"
    _cli("join", str(invite), "--data-dir", str(data_dir), "--agent", "e=echo").check_returncode()
    started = _cli("run", "--config", str(data_dir / "meshnode.toml"))
    assert started.returncode == exitcodes.EX_CONFIG, started.stderr[-2000:]
    assert ("the control plane refused a credential (403 invite_expired): the invite of node stale expired "
            "unused at ") in started.stderr
    assert "(meshnode mesh invite stale)" in started.stderr


def test_call_reads_its_input_or_text_from_stdin(first: DaemonProcess) -> None:
    """``-`` reads the input from stdin: a file piped in (``< report.txt``) rather than
    pasted into an argument (one argument is capped at 128 KiB, and shows in ps)."""
    document = "word " * 10_000  # 50 kB, under the recipient's default sender-text cap (64 Ki units)
    base = [sys.executable, "-m", "meshnode.cli", "call", "echo", "echo"]
    options = ["--socket", first.socket_path, "--json"]
    as_json = subprocess.run([*base, "-", *options], input=json.dumps({"doc": document}), capture_output=True,
                             text=True, timeout=60)
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["output"] == {"ok": {"doc": document}}
    as_text = subprocess.run([*base, "--text", "-", *options], input="from stdin\n", capture_output=True, text=True,
                             timeout=60)
    assert as_text.returncode == 0, as_text.stderr
    assert json.loads(as_text.stdout)["output"] == {"ok": {"text": "from stdin\n"}}


def test_join_does_not_overwrite_an_edited_config(first: DaemonProcess, tmp_path: Path) -> None:
    invite = tmp_path / "laptop.creds"
    assert _cli("mesh", "invite", "laptop-join", "--out", str(invite), "--socket", first.socket_path).returncode == 0
    data_dir = tmp_path / "data"
    joined = _cli("join", str(invite), "--data-dir", str(data_dir))
    assert joined.returncode == 0, joined.stderr
    config = data_dir / "meshnode.toml"
    # Running it again unchanged is harmless: the same text.
    assert _cli("join", str(invite), "--data-dir", str(data_dir)).returncode == 0
    edited = config.read_text() + '\n[agents.mine]\nplugin = "echo"  # my own\n'
    config.write_text(edited)

    refused = _cli("join", str(invite), "--data-dir", str(data_dir))
    assert refused.returncode == exitcodes.EX_CANTCREAT
    assert str(config) in refused.stderr and "--force" in refused.stderr
    assert config.read_text() == edited

    forced = _cli("join", str(invite), "--data-dir", str(data_dir), "--force", "--json")
    assert forced.returncode == 0, forced.stderr
    assert (data_dir / "meshnode.toml.bak").read_text() == edited
    assert "[agents.mine]" not in config.read_text()
    tomllib.loads(config.read_text())

    # Another invite into the same directory: a data dir is one node, whose key
    # is never replaced, not even with --force; the refusal comes first, naming it.
    other = tmp_path / "other.creds"
    assert _cli("mesh", "invite", "other-join", "--out", str(other), "--socket", first.socket_path).returncode == 0
    before = config.read_text()
    held = (data_dir / "keys" / "node.seed").read_text()
    for extra in ((), ("--force",)):
        again = _cli("join", str(other), "--data-dir", str(data_dir), *extra)
        assert again.returncode == exitcodes.EX_CANTCREAT, again.stderr
        assert "already holds another node's key" in again.stderr and "fresh --data-dir" in again.stderr
    assert config.read_text() == before and (data_dir / "keys" / "node.seed").read_text() == held


def _presence(node: DaemonProcess, node_id: str) -> str:
    return str(node.admin("Presence", {"node": node_id})["availability"])


def test_a_graceful_stop_is_offline_at_once(daemons: DaemonSet, first: DaemonProcess) -> None:
    laptop = daemons.joined("laptop", first, agents={"echo": {"plugin": "echo"}})
    node_id = laptop.status()["node"]["id"]
    agent_id = laptop.agent_id("echo")
    eventually(lambda: _presence(first, node_id) == "online", timeout=30)
    assert laptop.stop() == 0
    # The heartbeat interval is 30 s, so silence would take a minute to read as
    # offline: "at once" is inside one interval (25 s leaves a loaded machine room
    # and still tells the announced stop from silence).
    eventually(lambda: _presence(first, node_id) == "offline", timeout=25)
    found = first.admin("Discover", {"node": node_id})["agents"]
    assert {a["id"]: a["availability"] for a in found}.get(agent_id) == "offline"
    assert not re.search(r"WARNING .*(disconnected|connection error)", laptop.log_text()), laptop.log_tail()


def _availability(node: DaemonProcess, agent_id: str) -> str | None:
    found: dict[str, str | None] = {a["id"]: a.get("availability") for a in node.admin("Discover", {})["agents"]}
    return found.get(agent_id, "not listed")


def test_a_removed_agent_stays_removed_across_reloads_and_save_takes_it_out_of_the_file(
    first: DaemonProcess,
) -> None:
    """``agents remove`` of an agent in the file: a reload for anything else hosted it
    again, and nothing but editing the file by hand kept it out of the next start."""
    def hosted() -> set[str]:
        return {a["name"] for a in first.admin("Agents.List")["agents"]}

    added = _cli("agents", "add", "passer", "--plugin", "echo", "--save", "--socket", first.socket_path)
    assert added.returncode == 0, added.stderr
    removed = _cli("agents", "remove", "passer", "--socket", first.socket_path)
    assert removed.returncode == 0 and "removed passer" in removed.stdout, removed
    assert (f"[agents.passer] stays in {first.config_path}: the next start hosts it again "
            "(--save comments it out; a reload leaves it removed)") in removed.stderr
    report = first.admin("Reload")
    assert report["kept_removed"] == ["passer"] and "passer" not in report["added"], report
    assert "passer" not in hosted()

    # Added again, it is an agent like any other: removed with --save, it leaves the file.
    assert _cli("agents", "add", "passer", "--plugin", "echo", "--socket", first.socket_path).returncode == 0
    before = first.config_path.read_text(encoding="utf-8")
    saved = _cli("agents", "remove", "passer", "--save", "--json", "--socket", first.socket_path)
    assert saved.returncode == 0, saved.stderr
    assert json.loads(saved.stdout) == {"removed": "passer", "saved": True, "configured": True,
                                        "config_file": str(first.config_path)}
    text = first.config_path.read_text(encoding="utf-8")
    assert "passer" not in tomllib.loads(text)["agents"]
    assert "# [agents.passer]\n# plugin = \"echo\"" in text and len(text.splitlines()) == len(before.splitlines()) + 1
    report = first.admin("Reload")
    assert "kept_removed" not in report and report["added"] == report["removed"] == [], report
    assert "passer" not in hosted()


def test_agents_add_save_survives_a_restart_and_unsaved_is_deregistered(first: DaemonProcess) -> None:
    before = first.config_path.read_text()
    saved = _cli("agents", "add", "kept", "--plugin", "echo", "--save", "--socket", first.socket_path)
    assert saved.returncode == 0, saved.stderr
    assert f"saved as [agents.kept] in {first.config_path}" in saved.stdout
    text = first.config_path.read_text()
    assert text.startswith(before), "the user's text is kept as written"
    assert tomllib.loads(text)["agents"]["kept"] == {"plugin": "echo"}

    unsaved = _cli("agents", "add", "passing", "--plugin", "echo", "--socket", first.socket_path)
    assert unsaved.returncode == 0, unsaved.stderr
    assert "not saved to the configuration" in unsaved.stderr
    passing_id = first.agent_id("passing")
    assert passing_id in {a["id"] for a in first.admin("Discover", {})["agents"]}

    # The embedded node's credential (service role) grants no agent by name: an
    # added agent changes nothing in it, so the connection stays (no gap in the
    # live subscriptions, no drain pass of every agent after it). A joined node's
    # planned reconnect is checked in test_daemon_basic.
    log = first.log_text()
    assert "to present a new credential" not in log
    assert not re.search(r"WARNING .*disconnected from the mesh", log), first.log_tail()

    # flaky will fail to start after the restart: configured, so kept registered.
    flaky_id = first.agent_id("flaky")
    assert _availability(first, flaky_id) == "online"
    text = first.config_path.read_text()
    assert '[agents.flaky]\nplugin = "echo"' in text
    first.config_path.write_text(text.replace('[agents.flaky]\nplugin = "echo"',
                                              '[agents.flaky]\nplugin = "test-crash-on-start"'))

    assert first.stop() == 0
    first.start()
    names = {a["name"] for a in first.status()["agents"] if "id" in a}
    assert "kept" in names and "passing" not in names
    assert _availability(first, passing_id) == "not listed", "an agent not hosted after the restart is deregistered"
    assert "deregistered passing" in first.log_text()
    # Configured but not running: still registered (its buffer kept), shown offline.
    eventually(lambda: _availability(first, flaky_id) == "offline", timeout=30)


def test_an_invite_that_cannot_be_written_enrols_nobody(
    first: DaemonProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mesh invite --out FILE` with FILE already there refused to write, after the
    invite was made: a node key nobody holds was enrolled and its name taken
    ("already named") until someone retired it."""
    taken = tmp_path / "taken.creds"
    taken.write_text("someone else's invite", encoding="utf-8")
    refused = _cli("mesh", "invite", "unwritten", "--out", str(taken), "--socket", first.socket_path)
    assert refused.returncode == exitcodes.EX_CANTCREAT and "nothing was invited" in refused.stderr, refused.stderr
    assert taken.read_text(encoding="utf-8") == "someone else's invite"
    assert "unwritten" not in {n["name"] for n in first.admin("Mesh.Nodes")["nodes"]}

    # A write that fails once the invite is made (a full disk, a race) withdraws it.
    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("meshnode.control_plane.write_invite", disk_full)
    failed = cli_here("mesh", "invite", "unwritten", "--out", str(tmp_path / "new.creds"),
                      "--socket", first.socket_path)
    assert failed.returncode == exitcodes.EX_CANTCREAT, failed.stderr
    assert "No space left on device" in failed.stderr and "was withdrawn (retired)" in failed.stderr, failed.stderr
    assert [n["state"] for n in first.admin("Mesh.Nodes")["nodes"] if n["name"] == "unwritten"] == ["retired"]
    monkeypatch.undo()
    # The name is free for the invite that works.
    done = _cli("mesh", "invite", "unwritten", "--out", str(tmp_path / "ok.creds"), "--socket", first.socket_path)
    assert done.returncode == 0, done.stderr
