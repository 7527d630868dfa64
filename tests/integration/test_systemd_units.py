"""The units ``meshnode install-service`` writes pass ``systemd-analyze verify``
without a warning, with this installation's real binary path (the repository's
copies in systemd/ are that output for /usr/local/bin/meshnode, see
tests/unit/test_lifecycle_cli.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


@pytest.mark.parametrize("kind", ["system", "user"])
def test_generated_unit_verifies_clean(kind: str, tmp_path: Path) -> None:
    meshnode = Path(sys.executable).with_name("meshnode")
    assert meshnode.exists(), "the test runs from an installed meshnode (make .venv/.installed)"
    units = tmp_path / "units"
    args = [str(meshnode), "install-service", "--dir", str(units), "--no-create-user"]
    if kind == "user":
        args.append("--user")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    unit = units / "meshnode.service"
    assert f"ExecStart={meshnode} run" in unit.read_text()

    verify = ["systemd-analyze", "verify"] + (["--user"] if kind == "user" else []) + [str(unit)]
    env = {"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(tmp_path), "HOME": str(tmp_path)}
    proc = subprocess.run(verify, capture_output=True, text=True, timeout=60, env=env)
    noise = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 0 and not noise, "\n".join(noise)
