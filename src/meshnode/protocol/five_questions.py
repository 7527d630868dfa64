"""The five questions (AgentMesh §3.3.1), answered from a describe document (§10.14).

:func:`project_five_questions` copies each answer out of the declared bytes and
synthesizes nothing: an absent input is an absent answer member, and a
question nothing answered is an empty object (explicitly present, stating
nothing). The refusals answer is mechanical: the advertised offering ids as
the boundary, the admission text and access block when declared, and the
standard statement.

:func:`diff_answers` applies the consistency rule: spoken answers are
subordinate to declared ones, so every claimed member that differs from (or
has no) declared counterpart is a mismatch. Silence claims nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from .canonical import canonicalize

__all__ = ["QUESTIONS", "REFUSAL_STATEMENT", "diff_answers", "project_five_questions"]

#: The questions, in the order mismatches are reported.
QUESTIONS = ("identity", "capabilities", "usage", "terms", "refusals")
REFUSAL_STATEMENT = "Requests outside the declared offerings are refused."

#: §3.3.1 row 3: what "how are you used" reads from each advertised offering.
_USAGE_MEMBERS = (
    "input_modes",
    "output_modes",
    "input_schema",
    "output_schema",
    "streaming",
    "needs",
    "delivers",
    "reporting",
)


def _copy_members(
    target: dict[str, Any], source: Mapping[str, Any], pairs: tuple[tuple[str, str], ...]
) -> None:
    for answer_member, source_member in pairs:
        if source_member in source:
            target[answer_member] = copy.deepcopy(source[source_member])


def _card_level(describe: Mapping[str, Any], public: Mapping[str, Any], member: str) -> Any:
    """A card-level declaration, read where the describe document carries it."""
    if member in describe:
        return describe[member]
    return public.get(member)


def _usage(describe: Mapping[str, Any], public: Mapping[str, Any]) -> dict[str, Any]:
    usage: dict[str, Any] = {}
    details = public.get("offering_details")
    if isinstance(details, list):
        usage["offerings"] = [
            {"id": d.get("id"), **{m: copy.deepcopy(d[m]) for m in _USAGE_MEMBERS if m in d}}
            for d in details
            if isinstance(d, Mapping)
        ]
    _copy_members(
        usage,
        public,
        (("default_input_modes", "default_input_modes"), ("default_output_modes", "default_output_modes")),
    )
    _copy_members(usage, describe, (("interaction", "interaction"),))
    return usage


def _terms(describe: Mapping[str, Any], public: Mapping[str, Any]) -> dict[str, Any]:
    terms: dict[str, Any] = {}
    _copy_members(terms, public, (("skus", "skus"),))
    for member in ("data_use", "compliance"):
        value = _card_level(describe, public, member)
        if value is not None:
            terms[member] = copy.deepcopy(value)
    _copy_members(terms, describe, (("sealing", "sealing"),))
    _copy_members(terms, public, (("admission", "admission"), ("access", "access")))
    return terms


def project_five_questions(describe: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Project a describe document into the five answers (§3.3.1)."""
    raw_public = describe.get("public")
    public: Mapping[str, Any] = raw_public if isinstance(raw_public, Mapping) else {}

    identity: dict[str, Any] = {}
    _copy_members(
        identity,
        describe,
        (("agent_id", "agent_id"), ("name", "name"), ("owner", "owner"), ("card", "card")),
    )
    capabilities: dict[str, Any] = {}
    _copy_members(
        capabilities,
        public,
        (
            ("description", "description"),
            ("offerings", "offerings"),
            ("offering_details", "offering_details"),
        ),
    )
    advertised = public.get("offerings")
    refusals: dict[str, Any] = {
        "boundary": copy.deepcopy(advertised) if isinstance(advertised, list) else []
    }
    _copy_members(refusals, public, (("admission", "admission"), ("access", "access")))
    refusals["statement"] = REFUSAL_STATEMENT
    return {
        "identity": identity,
        "capabilities": capabilities,
        "usage": _usage(describe, public),
        "terms": _terms(describe, public),
        "refusals": refusals,
    }


def _same(a: Any, b: Any) -> bool:
    return canonicalize(a) == canonicalize(b)


def diff_answers(
    declared: Mapping[str, Any], claimed: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The mismatches between claimed and declared answers, in the fixed order.

    Only claimed members are compared. Each mismatch is ``{question, path,
    declared, claimed}``; ``declared`` is None (JSON null) when nothing was
    declared there. A claimed answer that is not an object mismatches at the
    question itself, beside the whole declared answer.
    """
    mismatches: list[dict[str, Any]] = []
    for question in QUESTIONS:
        if question not in claimed:
            continue
        said = claimed[question]
        answer = declared.get(question, {})
        if not isinstance(said, Mapping):
            if not _same(said, answer):
                mismatches.append(
                    {"question": question, "path": question, "declared": answer, "claimed": said}
                )
            continue
        for member in sorted(said):
            declared_here = isinstance(answer, Mapping) and member in answer
            backed = answer[member] if declared_here else None
            if not declared_here or not _same(backed, said[member]):
                mismatches.append(
                    {
                        "question": question,
                        "path": f"{question}.{member}",
                        "declared": backed,
                        "claimed": said[member],
                    }
                )
    return mismatches
