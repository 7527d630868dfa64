"""rests-on.json: §5.6 digests, entry shapes, the freshness verdict and carriage sites."""

from __future__ import annotations

from typing import Any

from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.rests_on import (
    CARRIAGE_NOT_SITES,
    CARRIAGE_SITES,
    MAX_ENTRIES,
    carriage_allowed,
    freshness,
    is_valid_digest,
    validate_rests_on,
)

from .. import Recorder

FILES = ["rests-on.json"]


def run(fixture: dict[str, Any], rec: Recorder) -> None:
    digest = fixture["digest"]
    for i, value in enumerate(digest["valid"]):
        with rec.case(f"digest/valid/{i}"):
            assert is_valid_digest(value), value
    for i, case in enumerate(digest["invalid"]):
        with rec.case(f"digest/invalid/{i}"):
            assert not is_valid_digest(case["value"]), case["why"]

    entries = fixture["entries"]
    with rec.case("entries/max_entries"):
        assert entries["max_entries"] == MAX_ENTRIES
        sample = dict(entries["valid"][0])
        validate_rests_on([sample] * MAX_ENTRIES)
        try:
            validate_rests_on([sample] * (MAX_ENTRIES + 1))
        except ProtocolError:
            pass
        else:
            raise AssertionError(f"{MAX_ENTRIES + 1} entries were accepted")
    for i, entry in enumerate(entries["valid"]):
        with rec.case(f"entries/valid/{i}"):
            assert validate_rests_on([entry]) == [entry]
    with rec.case("entries/valid/all_together"):
        validate_rests_on(list(entries["valid"]))
    for case in entries["invalid"]:
        with rec.case(f"entries/invalid/{case['case']}"):
            try:
                validate_rests_on(case["rests_on"])
            except ProtocolError as exc:
                assert exc.details.get("reason") == case["case"], (exc.details, case["case"])
            else:
                raise AssertionError(f"accepted: {case['why']}")

    for case in fixture["freshness"]["cases"]:
        with rec.case(f"freshness/{case['name']}"):
            observed: dict[str, Any] = case["observed"]
            calls: list[str] = []

            def observe(ref: str, observed: dict[str, Any] = observed, calls: list[str] = calls) -> Any:
                calls.append(ref)
                return observed.get(ref)

            verdict = freshness(case["declared"], observe, countersigned=bool(case.get("countersigned")))
            assert verdict.as_dict() == case["expected"], (verdict.as_dict(), case["expected"])
            if case.get("observe_must_not_be_called"):
                assert not calls, f"observed {calls} for a countersigned agreement"

    carriage = fixture["carriage"]
    for site in carriage["sites"]:
        with rec.case(f"carriage/site/{site['where']}"):
            assert carriage_allowed(site["where"]) and site["where"] in CARRIAGE_SITES
    for where in carriage["not_sites"]:
        with rec.case(f"carriage/not_site/{where}"):
            assert not carriage_allowed(where) and where in CARRIAGE_NOT_SITES
