"""Shared test helpers: where the published fixtures live."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conformance import fixtures_dir


def load_fixture(name: str) -> dict[str, Any]:
    """Load a published fixture by file name, skipping the test when absent."""
    path: Path = fixtures_dir() / name
    if not path.is_file():
        pytest.skip(f"fixture {name} not found under {fixtures_dir()} (set MESHNODE_FIXTURES)")
    data: dict[str, Any] = json.loads(path.read_bytes())
    return data
