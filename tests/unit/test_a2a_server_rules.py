"""The A2A bridge's pure rules: JSON depth, task ownership, the idempotency key."""

from __future__ import annotations

from typing import Any

from meshnode.a2a.inbound import ANONYMOUS, Inbound, dedup_caller, may_see
from meshnode.a2a.intake import MAX_JSON_DEPTH, deeper_than


def nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def test_depth_counts_arrays_and_objects_without_recursing() -> None:
    assert not deeper_than(nested(MAX_JSON_DEPTH), MAX_JSON_DEPTH)
    assert deeper_than(nested(MAX_JSON_DEPTH + 1), MAX_JSON_DEPTH)
    assert deeper_than(nested(50_000), MAX_JSON_DEPTH)  # no RecursionError
    assert not deeper_than("scalar", 0) and not deeper_than([], 1) and deeper_than([[]], 1)


def test_a_trusted_task_is_its_issuers_an_anonymous_task_its_holders() -> None:
    assert may_see("issuer:a", "issuer:a")
    assert not may_see("issuer:a", "issuer:b")
    assert not may_see("issuer:a", ANONYMOUS)
    assert may_see(ANONYMOUS, ANONYMOUS) and may_see(ANONYMOUS, "issuer:a")


def test_anonymous_messages_are_deduplicated_on_their_body() -> None:
    def inbound(digest: str) -> Inbound:
        return Inbound(activated=False, message={}, body_hash=digest)

    assert dedup_caller("issuer:a", inbound("sha256:1")) == "issuer:a"
    assert dedup_caller(ANONYMOUS, inbound("sha256:1")) == "anonymous:sha256:1"
    # No canonical form, no hash: never the same key twice.
    assert dedup_caller(ANONYMOUS, inbound("")) != dedup_caller(ANONYMOUS, inbound(""))
