"""The generated references in docs/reference/ match the code they are generated from.

docs/reference/configuration.md comes from the settings schema and
docs/reference/cli.md from the argument parser, docs/reference/grants.md from
the credential permissions, all by
``scripts/gen_reference.py``. This regenerates them in memory: a field, option or
docstring changed without regenerating fails here.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_reference.py"


@functools.cache
def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_reference", module)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _rendered() -> dict[str, tuple[Path, str]]:
    return {path.name: (path, text) for path, text in _generator().render_all().items()}


@pytest.mark.parametrize("page", ["configuration.md", "cli.md", "grants.md"])
def test_generated_reference_is_current(page: str) -> None:
    path, expected = _rendered()[page]
    committed = path.read_text(encoding="utf-8") if path.exists() else ""
    assert committed == expected, (
        f"docs/reference/{page} is stale: run `python scripts/gen_reference.py` and commit the result"
    )


def test_configuration_reference_covers_every_table_and_key() -> None:
    """Spot checks that the generator walks nested tables, maps and lists of tables."""
    text = _rendered()["configuration.md"][1]
    for heading in ("## `[node]`", "## `[mesh.embedded]`", "## `[[mesh.embedded.exports]]`",
                    "## `[a2a.peers.<name>]`", "## `[agents.<name>]`"):
        assert heading in text
    assert "| `heartbeat_interval` | duration | `\"30s\"` |" in text
    assert "| `buffer_max_bytes` | size | `8MiB` |" in text
    assert "## `[storage]`" in text and "| `tasks_max_bytes` | size | `64MiB` |" in text


def test_cli_reference_covers_nested_commands() -> None:
    text = _rendered()["cli.md"][1]
    for heading in ("## `meshnode run`", "## `meshnode call`", "## `meshnode mesh invite`",
                    "## `meshnode artifacts get`"):
        assert heading in text
    assert "`--task-id` `TASK_ID`" in text
