"""start_up_heap: young collections only during start-up, then one full collection, then frozen."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from meshnode.daemon.startup_gc import start_up_heap


@pytest.fixture
def collections() -> Iterator[list[int]]:
    """The generation of every collection the interpreter runs while the test does
    (and nothing left frozen for the tests after it)."""
    assert gc.get_freeze_count() == 0
    seen: list[int] = []

    def record(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    try:
        yield seen
    finally:
        gc.callbacks.remove(record)
        gc.unfreeze()


def _enough() -> int:
    """Survivors enough to call for a full collection whatever the heap holds already:
    CPython runs one once those promoted since the last exceed a quarter of the rest."""
    return max(300_000, len(gc.get_objects()) // 2)


def _build_long_lived(n: int) -> list[Any]:
    """Many tracked objects that survive (and so would be promoted and trigger full collections)."""
    kept: list[Any] = []
    for i in range(n):
        node: dict[str, Any] = {"i": i}
        node["self"] = node  # a cycle, as agents and their tasks make
        kept.append(node)
    return kept


def test_no_full_collection_inside_and_one_on_the_way_out(collections: list[int]) -> None:
    before = gc.get_threshold()
    with start_up_heap():
        n = _enough()
        kept = _build_long_lived(n)
        inside = list(collections)
    assert 0 in inside, "the young generation still runs"
    assert 2 not in inside, "no full collection during the block"
    assert collections[len(inside):].count(2) == 1, "exactly one full collection at the end"
    assert gc.get_threshold() == before
    assert len(kept) == n


def test_what_survives_the_start_is_frozen_and_later_collections_skip_it(collections: list[int]) -> None:
    with start_up_heap():
        kept = _build_long_lived(_enough())
    assert gc.get_freeze_count() >= len(kept)
    walked = {id(o) for o in gc.get_objects()}  # the generations a collection walks
    assert id(kept[0]) not in walked and id(kept[-1]) not in walked
    made_after: dict[str, object] = {}
    made_after["self"] = made_after
    assert id(made_after) in {id(o) for o in gc.get_objects()}, "what is made after the start is collected as before"


def test_a_failed_start_restores_the_thresholds_and_forces_no_collection(collections: list[int]) -> None:
    # A failed or cancelled start shuts down next, promptly: no heap walk on its way.
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), start_up_heap():
        raise RuntimeError("a start-up stage failed")
    assert gc.get_threshold() == before
    assert 2 not in collections
    assert gc.get_freeze_count() == 0


def test_without_the_block_the_same_work_runs_full_collections(collections: list[int]) -> None:
    # The control: the build above does trigger full collections when nothing defers them.
    n = _enough()
    kept = _build_long_lived(n)
    assert 2 in collections and len(kept) == n
