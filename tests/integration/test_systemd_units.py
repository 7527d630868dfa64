"""The shipped systemd units pass ``systemd-analyze verify`` without a warning."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "systemd"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("unit", ["meshnode.service", "meshnode-user.service"])
def test_unit_verifies_clean(unit: str, tmp_path: Path) -> None:
    meshnode = str(Path(sys.executable).with_name("meshnode"))
    text = (UNITS / unit).read_text()
    text = text.replace("/usr/local/bin/meshnode", meshnode).replace("%h/.local/bin/meshnode", meshnode)
    target = tmp_path / "meshnode.service"
    target.write_text(text)
    args = ["systemd-analyze", "verify"] + (["--user"] if "user" in unit else []) + [str(target)]
    env = {"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(tmp_path), "HOME": str(tmp_path)}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
    noise = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 0 and not noise, "\n".join(noise)
