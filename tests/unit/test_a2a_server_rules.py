"""The A2A bridge's pure rules: JSON depth, task ownership, the idempotency key."""

from __future__ import annotations

from typing import Any

from meshnode.a2a.server import ANONYMOUS, MAX_JSON_DEPTH, A2ABridge, _deeper_than, _Inbound


def nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def test_depth_counts_arrays_and_objects_without_recursing() -> None:
    assert not _deeper_than(nested(MAX_JSON_DEPTH), MAX_JSON_DEPTH)
    assert _deeper_than(nested(MAX_JSON_DEPTH + 1), MAX_JSON_DEPTH)
    assert _deeper_than(nested(50_000), MAX_JSON_DEPTH)  # no RecursionError
    assert not _deeper_than("scalar", 0) and not _deeper_than([], 1) and _deeper_than([[]], 1)


def test_a_trusted_task_is_its_issuers_an_anonymous_task_its_holders() -> None:
    assert A2ABridge.may_see("issuer:a", "issuer:a")
    assert not A2ABridge.may_see("issuer:a", "issuer:b")
    assert not A2ABridge.may_see("issuer:a", ANONYMOUS)
    assert A2ABridge.may_see(ANONYMOUS, ANONYMOUS) and A2ABridge.may_see(ANONYMOUS, "issuer:a")


def test_anonymous_messages_are_deduplicated_on_their_body() -> None:
    def inbound(digest: str) -> _Inbound:
        return _Inbound(activated=False, message={}, body_hash=digest)

    assert A2ABridge._dedup_caller("issuer:a", inbound("sha256:1")) == "issuer:a"
    assert A2ABridge._dedup_caller(ANONYMOUS, inbound("sha256:1")) == "anonymous:sha256:1"
    # No canonical form, no hash: never the same key twice.
    assert A2ABridge._dedup_caller(ANONYMOUS, inbound("")) != A2ABridge._dedup_caller(ANONYMOUS, inbound(""))
