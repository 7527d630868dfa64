"""``meshnode call`` input too large for the admin line is said before connecting
(it was a ValueError traceback), with exit 65 and the way out."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path


def test_an_input_over_the_admin_line_is_refused_before_connecting(tmp_path: Path) -> None:
    big = json.dumps({"x": "a" * 2_000_000})
    proc = subprocess.run(
        [sys.executable, "-m", "meshnode.cli", "call", "echo", "echo", "-", "--socket", str(tmp_path / "none.sock")],
        input=big, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 65, proc.stderr  # not 69: nothing was asked of a daemon
    assert re.search(r"the request is 2,000,\d{3} bytes, over the admin protocol's 1,048,576-byte line", proc.stderr)
    assert "meshnode artifacts put FILE" in proc.stderr and "Traceback" not in proc.stderr
