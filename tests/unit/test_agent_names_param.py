"""``Agents.Add`` / ``Agents.Remove`` name one agent (``name``) or several (``names``)."""

from __future__ import annotations

from typing import Any

import pytest

from meshnode.admin.protocol import InvalidParameter
from meshnode.daemon.methods import MAX_AGENTS_PER_CALL, _agent_names


def test_one_name_or_a_list_of_names() -> None:
    assert _agent_names({"name": "echo"}) == ["echo"]
    assert _agent_names({"names": ["a", "b"]}) == ["a", "b"]


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({}, "give name"),
        ({"name": "a", "names": ["b"]}, "not both"),
        ({"name": 3}, "name must be a string"),
        ({"names": "a"}, "names must be a list"),
        ({"names": []}, "names must be a list"),
        ({"names": ["a", 1]}, "names must be a list"),
        ({"names": ["x"] * 2 + ["y", "z", "y"]}, "names lists x, y more than once"),
        ({"names": [f"a{i}" for i in range(MAX_AGENTS_PER_CALL + 1)]}, "1 to 10,000"),
    ],
)
def test_a_malformed_list_is_refused_with_what_is_wrong(params: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidParameter) as refused:
        _agent_names(params)
    assert says in refused.value.message
