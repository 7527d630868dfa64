"""pytest collection of the conformance runner: one test per fixture file."""

from __future__ import annotations

import pytest

from conformance import FAILED, NOT_IMPLEMENTED, REQUIRED_FILES, fixture_paths, run_file

PATHS = fixture_paths()


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_fixture_file(path):  # type: ignore[no-untyped-def]
    report = run_file(path)
    failures = [f"{r.case}: {r.detail}" for r in report.results if r.status == FAILED]
    assert not failures, "\n".join(failures)
    if path.name in REQUIRED_FILES:
        missing = [r.case for r in report.results if r.status == NOT_IMPLEMENTED]
        assert not missing, f"required fixture has cases not implemented: {missing}"
    assert report.results, "no case was run"
