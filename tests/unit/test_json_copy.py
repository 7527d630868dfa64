"""copy_json: the registry's deep copy of decoded JSON, equal to copy.deepcopy's."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from meshnode.protocol.json_copy import copy_json

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


def _containers(value: Any) -> list[Any]:
    """Every dict and list inside ``value``, itself included."""
    found: list[Any] = []
    if isinstance(value, dict):
        found.append(value)
        for item in value.values():
            found += _containers(item)
    elif isinstance(value, list):
        found.append(value)
        for item in value:
            found += _containers(item)
    return found


@given(json_values)
def test_a_json_value_is_copied_as_deepcopy_copies_it(value: Any) -> None:
    copied = copy_json(value)
    assert copied == copy.deepcopy(value)
    original_ids = {id(c) for c in _containers(value)}
    assert not original_ids & {id(c) for c in _containers(copied)}, "no dict or list is shared"


def test_changing_the_copy_leaves_the_original_alone() -> None:
    manifest: dict[str, Any] = {"offerings": [{"id": "echo", "tags": ["a"]}], "node": {"vouch": {"sig": "x"}}}
    copied = copy_json(manifest)
    copied["offerings"][0]["tags"].append("b")
    copied["node"]["vouch"]["sig"] = "y"
    assert manifest == {"offerings": [{"id": "echo", "tags": ["a"]}], "node": {"vouch": {"sig": "x"}}}


def test_other_types_are_left_to_deepcopy() -> None:
    inner = [1, 2]
    value: dict[str, Any] = {"t": (inner, "x"), "s": {3}}
    copied = copy_json(value)
    assert copied == value
    assert copied["t"][0] is not inner and copied["s"] is not value["s"]


def test_a_read_only_mapping_becomes_a_dict() -> None:
    # Signed documents are kept behind read-only views; a copy is plain JSON again.
    from types import MappingProxyType

    inner = [1]
    # A dict of JSON values, whatever mappings went in (copy_json's T -> T cannot say so).
    copied: dict[str, Any] = copy_json({"doc": MappingProxyType({"price": {"amount": 5}, "tags": inner})})
    assert copied == {"doc": {"price": {"amount": 5}, "tags": [1]}}
    assert type(copied["doc"]) is dict and copied["doc"]["tags"] is not inner
