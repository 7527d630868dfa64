"""`meshnode status` for people: what the mesh block says about planned reconnects."""

from __future__ import annotations

from typing import Any

import pytest

from meshnode.cli.daemon import _print_status


def _status(planned: dict[str, int]) -> dict[str, Any]:
    return {
        "node": {"name": "n", "id": "UNODE"},
        "mesh": {"mode": "joined", "connected": True, "connected_url": "nats://127.0.0.1:4222", "urls": [],
                 "planned_reconnects": planned},
        "keystore": "file",
        "agents": [],
    }


def test_status_names_planned_reconnects_only_when_one_went_unbridged(capsys: pytest.CaptureFixture[str]) -> None:
    _print_status(_status({"bridged": 12, "unbridged": 0}))
    assert "planned reconnects" not in capsys.readouterr().out  # the usual case says nothing
    _print_status(_status({"bridged": 9, "unbridged": 3}))
    out = capsys.readouterr().out
    assert "3 of 12 planned reconnects unbridged" in out and "agents' buffers" in out


def test_status_names_meter_events_waiting_or_not_published(capsys: pytest.CaptureFixture[str]) -> None:
    """The metering line: only while events wait for JetStream, and when some
    read back from the usage log could not be published (an agent gone, a
    segment deleted first)."""
    status = _status({"bridged": 0, "unbridged": 0})
    status["metering"] = {"queued": 0, "waiting_in_log_from": None, "journal": "/d/usage.published",
                          "counters": {"published": 40}}
    _print_status(status)
    assert "metering" not in capsys.readouterr().out  # all published: nothing to say
    status["metering"] = {"queued": 256, "waiting_in_log_from": [3, 1024], "journal": "/d/usage.published",
                          "counters": {"published": 40, "orphaned": 2, "trimmed": 0}}
    _print_status(status)
    out = capsys.readouterr().out
    assert "metering  256 meter event(s) waiting for JetStream and more waiting in usage.jsonl" in out
    assert "metering  not published: 2 orphaned (see the log's WARNINGs)" in out


def test_status_says_why_a_hosted_agent_failed(capsys: pytest.CaptureFixture[str]) -> None:
    """An agent whose on_start raised is hosted (it has an id) and failed: the line
    says why, where it said "NOT registered (None)"."""
    status = _status({"bridged": 0, "unbridged": 0})
    status["agents"] = [{"name": "sh2", "id": "UAGENT", "plugin": "shell", "state": "failed", "registered": False,
                         "registration_error": None, "failure": "RuntimeError: command 'x' is not an executable"}]
    _print_status(status)
    out = capsys.readouterr().out
    assert "  sh2              UAGENT  shell        FAILED: RuntimeError: command 'x' is not an executable" in out
    assert "NOT registered" not in out


def test_no_daemon_at_the_default_socket_says_how_to_name_the_one_that_runs(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`meshnode status` in a shell without MESHNODE_CONFIG looked at the default
    socket and said only that nothing served it, with a daemon started from
    `--config FILE` running all along."""
    from meshnode.cli import main

    for name in ("MESHNODE_CONFIG", "CONFIGURATION_DIRECTORY", "STATE_DIRECTORY", "RUNTIME_DIRECTORY",
                 "INVOCATION_ID"):
        monkeypatch.delenv(name, raising=False)
    # A user's defaults under tmp_path, even where the tests run as root (whose
    # default is /etc/meshnode, which a machine may well have).
    monkeypatch.setattr("meshnode.config.values._geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    assert main(["status"]) == 69
    err = capsys.readouterr().err
    assert "is not running" in err and "neither --config nor $MESHNODE_CONFIG names a file" in err
    assert "MESHNODE_CONFIG=FILE" in err
    # Named explicitly, the socket is the one meant: no hint.
    config = tmp_path / "mn.toml"
    config.write_text(f'[node]\ndata_dir = "{tmp_path / "d"}"\n', encoding="utf-8")
    assert main(["status", "--config", str(config)]) == 69
    assert "neither --config" not in capsys.readouterr().err
