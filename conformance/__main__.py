"""``python -m conformance [--json] [--verbose]``: run every fixture and print a table."""

from __future__ import annotations

import argparse
import json
import sys

from . import FAILED, NOT_IMPLEMENTED, REQUIRED_FILES, fixtures_dir, run_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__)
    parser.add_argument("--json", action="store_true", help="one JSON record per file")
    parser.add_argument("--verbose", "-v", action="store_true", help="list failing cases")
    args = parser.parse_args(argv)

    reports = run_all()
    fixtures_present = fixtures_dir().is_dir()
    failed = any(r.count(FAILED) for r in reports)
    missing_required = [
        r.file for r in reports if r.file in REQUIRED_FILES and r.count(NOT_IMPLEMENTED)
    ]

    if args.json:
        json.dump([r.as_record() for r in reports], sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        if not fixtures_present:
            print(f"note: no fixtures at {fixtures_dir()} (set MESHNODE_FIXTURES); "
                  "running the project's own vectors only")
        width = max([len(r.file) for r in reports] + [4])
        print(f"{'file':<{width}}  {'run':>5} {'passed':>6} {'failed':>6} {'not impl':>8} {'supersed':>8}")
        for r in reports:
            rec = r.as_record()
            flag = "  (required)" if r.file in REQUIRED_FILES else ""
            print(
                f"{r.file:<{width}}  {rec['run']:>5} {rec['passed']:>6} {rec['failed']:>6} "
                f"{rec['not_implemented']:>8} {rec['superseded']:>8}{flag}"
            )
            if args.verbose or rec["failed"]:
                for res in r.results:
                    if res.status == FAILED:
                        print(f"    FAILED {res.case}: {res.detail.splitlines()[0] if res.detail else ''}")
            if args.verbose:
                for res in r.results:
                    if res.status == "superseded":
                        print(f"    superseded {res.case} ({res.section}): {res.detail}")
        passed = sum(r.count("passed") for r in reports)
        nfail = sum(r.count(FAILED) for r in reports)
        skipped = sum(r.count(NOT_IMPLEMENTED) + r.count("superseded") for r in reports)
        # Not-implemented and superseded cases are reported as skipped, never as passed.
        print(f"conformance: {passed} passed, {nfail} failed, {skipped} skipped")
    if missing_required:
        print(f"required files with cases not implemented: {', '.join(missing_required)}",
              file=sys.stderr)
    return 1 if failed or missing_required else 0


if __name__ == "__main__":
    raise SystemExit(main())
