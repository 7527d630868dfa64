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
