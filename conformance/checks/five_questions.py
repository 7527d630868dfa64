"""five-questions.json: §3.3.1 projection of a describe document into the five
answers, and the consistency diff between declared and claimed answers.

Both comparisons are byte-exact after RFC 8785 canonicalization, so member
order in the fixture carries no meaning.
"""

from __future__ import annotations

from typing import Any

from meshnode.protocol.canonical import canonical_text
from meshnode.protocol.five_questions import (
    REFUSAL_STATEMENT,
    diff_answers,
    project_five_questions,
)

from .. import Recorder

FILES = ["five-questions.json"]


def run(fixture: dict[str, Any], rec: Recorder) -> None:
    with rec.case("refusal_statement"):
        assert fixture["refusal_statement"] == REFUSAL_STATEMENT, fixture["refusal_statement"]
    cases = {case["name"]: case for case in fixture["projection"]["cases"]}
    for name, case in cases.items():
        with rec.case(f"projection/{name}"):
            got = canonical_text(project_five_questions(case["describe"]))
            want = canonical_text(case["expected"])
            assert got == want, f"got {got}\nwant {want}"
    for case in fixture["diff"]["cases"]:
        with rec.case(f"diff/{case['name']}"):
            declared = project_five_questions(cases[case["declared_case"]]["describe"])
            claimed = (
                case["claimed"] if "claimed" in case else cases[case["claimed_case"]]["expected"]
            )
            got = canonical_text(diff_answers(declared, claimed))
            want = canonical_text(case["expected"])
            assert got == want, f"got {got}\nwant {want}"
