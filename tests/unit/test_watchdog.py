"""The per-test watchdog of tests/conftest.py ends a hung test with its stacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_hung_async_test_is_interrupted_with_its_task_stacks(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import asyncio\n\n"
        "async def test_waits_forever():\n"
        "    await asyncio.Event().wait()\n"
    )
    env = dict(os.environ, MESHNODE_TEST_TIMEOUT="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-o", "asyncio_mode=auto",
         "-p", "no:cacheprovider", str(probe)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "test_waits_forever still running after 1s" in out, out
    # The pending task's await is named, not only the loop's thread stack.
    assert "in test_waits_forever" in out and "asyncio.Event().wait()" in out, out
