"""The conformance runner: every published AgentMesh fixture against meshnode.protocol.

Fixtures are read from ``$MESHNODE_FIXTURES`` (default ``../shared/conformance/fixtures``
relative to the repository root); the project's own vectors from
``conformance/vectors``. Each fixture file is handled by a check module in
``conformance/checks`` that declares the file names it knows (``FILES``) and a
``run(fixture, rec)`` function that records one result per case.

A case the runner cannot judge yet is reported as *not implemented*, never as
passed; a case of a legacy copy that the spec has since replaced is reported as
*superseded*, with the section that replaced it.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
VECTORS_DIR = Path(__file__).resolve().parent / "vectors"

#: Files that must pass at 100% (issue #2).
REQUIRED_FILES = (
    "canonical-json.json",
    "signature-tags.json",
    "inbound-protections.json",
    "inbound-protections.ts-sdk.json",
    "accept-signal.json",
    "sender-preflight.json",
    "sender-preflight.ts-sdk.json",
    "cancel.json",
    "cancel.ts-sdk.json",
    "budget.json",
    "budget.ts-sdk.json",
    "manifest-signing.json",
    "manifest-signing.ts-sdk.json",
    "feeds.json",
    "rests-on.json",
    # Economics and the owner allowance (issue #19).
    "commerce.json",
    "allowance.json",
)

PASSED, FAILED, NOT_IMPLEMENTED, SUPERSEDED = "passed", "failed", "not_implemented", "superseded"


def fixtures_dir() -> Path:
    env = os.environ.get("MESHNODE_FIXTURES")
    if env:
        return Path(env)
    return (REPO_ROOT / ".." / "shared" / "conformance" / "fixtures").resolve()


@dataclass
class CaseResult:
    case: str
    status: str
    detail: str = ""
    section: str = ""


@dataclass
class FileReport:
    file: str
    results: list[CaseResult] = field(default_factory=list)
    error: str = ""

    def count(self, status: str) -> int:
        return sum(1 for r in self.results if r.status == status)

    def as_record(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "run": len(self.results),
            "passed": self.count(PASSED),
            "failed": self.count(FAILED),
            "not_implemented": self.count(NOT_IMPLEMENTED),
            "superseded": self.count(SUPERSEDED),
            "failures": [
                {"case": r.case, "detail": r.detail} for r in self.results if r.status == FAILED
            ],
            "superseded_cases": [
                {"case": r.case, "section": r.section, "detail": r.detail}
                for r in self.results
                if r.status == SUPERSEDED
            ],
            **({"error": self.error} if self.error else {}),
        }


class Recorder:
    """Collects one result per case for a fixture file."""

    def __init__(self, report: FileReport) -> None:
        self.report = report

    @contextmanager
    def case(self, name: str) -> Iterator[None]:
        """Run a case body; an exception or failed assertion records a failure."""
        try:
            yield
        except AssertionError as exc:
            self.report.results.append(CaseResult(name, FAILED, str(exc) or "assertion failed"))
        except Exception as exc:  # a crash is a failure, with its cause
            detail = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
            self.report.results.append(CaseResult(name, FAILED, detail))
        else:
            self.report.results.append(CaseResult(name, PASSED))

    def passed(self, name: str) -> None:
        self.report.results.append(CaseResult(name, PASSED))

    def failed(self, name: str, detail: str) -> None:
        self.report.results.append(CaseResult(name, FAILED, detail))

    def not_implemented(self, name: str, why: str = "") -> None:
        self.report.results.append(CaseResult(name, NOT_IMPLEMENTED, why))

    def superseded(self, name: str, section: str, why: str) -> None:
        self.report.results.append(CaseResult(name, SUPERSEDED, why, section))


Check = Callable[[dict[str, Any], Recorder], None]


def _load_checks() -> dict[str, Check]:
    checks: dict[str, Check] = {}
    from . import checks as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for name in getattr(module, "FILES", ()):
            checks[name] = module.run
    return checks


def _count_cases(obj: Any) -> int:
    """A rough count of the cases in a fixture no check understands yet."""
    if isinstance(obj, dict):
        n = 0
        for key, value in obj.items():
            if key in ("cases", "vectors", "valid", "invalid") and isinstance(value, list):
                n += len(value)
            else:
                n += _count_cases(value)
        return n
    return 0


def run_file(path: Path, checks: dict[str, Check] | None = None) -> FileReport:
    checks = _load_checks() if checks is None else checks
    report = FileReport(path.name)
    try:
        fixture = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        report.error = f"cannot read fixture: {exc}"
        report.results.append(CaseResult("<load>", FAILED, report.error))
        return report
    check = checks.get(path.name)
    if check is None:
        rec = Recorder(report)
        for i in range(max(1, _count_cases(fixture))):
            rec.not_implemented(f"case-{i}", "no check for this fixture yet")
        return report
    try:
        check(fixture, Recorder(report))
    except Exception as exc:  # the check itself crashed
        report.error = f"{type(exc).__name__}: {exc}"
        report.results.append(CaseResult("<check>", FAILED, traceback.format_exc(limit=5)))
    return report


def fixture_paths() -> list[Path]:
    paths: list[Path] = []
    directory = fixtures_dir()
    if directory.is_dir():
        paths.extend(sorted(directory.glob("*.json")))
    if VECTORS_DIR.is_dir():
        paths.extend(sorted(VECTORS_DIR.glob("*.json")))
    return paths


def run_all() -> list[FileReport]:
    checks = _load_checks()
    return [run_file(p, checks) for p in fixture_paths()]
