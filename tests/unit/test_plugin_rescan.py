"""``rescan_installed`` reads the ``.pth`` files that appeared in a site
directory since the process started (an editable install's), each once, as
:mod:`site` does at start: path lines join ``sys.path``, import lines run.
In a fresh interpreter, so this test process's import state stays as it is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, sys
from pathlib import Path
from meshnode.plugins import rescan_installed

site_dir, source = Path(sys.argv[1]), Path(sys.argv[2])
before = rescan_installed([str(site_dir)])       # nothing new yet
(source / "rescan_probe_mod.py").write_text("VALUE = 42\\n")
(site_dir / "rescan_probe_finder.py").write_text("import sys\\nRUNS = getattr(sys, 'rescan_runs', 0)\\n"
                                                 "def install():\\n    sys.rescan_runs = RUNS + 1\\n")
(site_dir / "a-path.pth").write_text(f"# a comment\\n{source}\\n")
(site_dir / "b-import.pth").write_text("import rescan_probe_finder; rescan_probe_finder.install()\\n")
first = rescan_installed([str(site_dir)])
import rescan_probe_mod
second = rescan_installed([str(site_dir)])
print(json.dumps({"before": before, "first": [Path(p).name for p in first], "second": second,
                  "value": rescan_probe_mod.VALUE, "runs": sys.rescan_runs, "on_path": str(source) in sys.path}))
"""


def test_new_path_files_are_read_once(tmp_path: Path) -> None:
    site_dir, source = tmp_path / "site", tmp_path / "src"
    site_dir.mkdir()
    source.mkdir()
    # The site directory on sys.path, as a real one is (the import line's module lives there).
    proc = subprocess.run([sys.executable, "-c", f"import sys; sys.path.append({str(site_dir)!r})\n{SCRIPT}",
                           str(site_dir), str(source)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "before": [], "first": ["a-path.pth", "b-import.pth"], "second": [], "value": 42, "runs": 1, "on_path": True,
    }
