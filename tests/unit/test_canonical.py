"""Canonical JSON (§5.3): fixture vectors, agreement with the rfc8785 package, refusals."""

from __future__ import annotations

import math
import struct
from typing import TypeAlias

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.protocol.canonical import (
    MAX_SAFE_INTEGER,
    CanonicalJSONError,
    canonical_text,
    canonicalize,
    format_number,
    parse_json,
)
from tests.conftest import load_fixture

SAFE_INTS = st.integers(min_value=-MAX_SAFE_INTEGER, max_value=MAX_SAFE_INTEGER)
FINITE_FLOATS = st.floats(allow_nan=False, allow_infinity=False)
BOUNDARY_FLOATS = st.sampled_from(
    [0.0, -0.0, 1e21, 1e-7, 1e-6, 9.999999999999999e20, 5e-324, 1.7976931348623157e308,
     2.0**53, -(2.0**53), 2.0**53 + 2, 0.1, 1 / 3, 123456789012345680000.0]
)
KEYS = st.text(max_size=8) | st.sampled_from(["\ufb00", "\U0001f600", "\ue000", "\uffff", "a", ""])
SCALARS = st.none() | st.booleans() | SAFE_INTS | FINITE_FLOATS | BOUNDARY_FLOATS | st.text(max_size=20)
#: What JSON_VALUES draws: decoded JSON.
Json: TypeAlias = "None | bool | int | float | str | list[Json] | dict[str, Json]"
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(KEYS, children, max_size=5),
    max_leaves=30,
)


def test_every_fixture_vector() -> None:
    fixture = load_fixture("canonical-json.json")
    for vector in fixture["vectors"]:
        assert canonical_text(parse_json(vector["input_json"])) == vector["canonical"], vector["name"]
    for row in fixture["number_bits"]:
        value = struct.unpack(">d", bytes.fromhex(row["ieee754_hex"]))[0]
        assert canonical_text(value) == row["canonical"], row["ieee754_hex"]


@settings(max_examples=400, deadline=None)
@given(JSON_VALUES)
def test_identical_to_rfc8785_package(value: Json) -> None:
    assert canonicalize(value) == rfc8785.dumps(value)


@settings(max_examples=300, deadline=None)
@given(FINITE_FLOATS | BOUNDARY_FLOATS)
def test_numbers_round_trip_and_match_rfc8785(x: float) -> None:
    text = format_number(x)
    assert float(text) == x or (x == 0 and float(text) == 0)
    assert text.encode() == rfc8785.dumps(x)


@given(st.text(alphabet=st.characters(max_codepoint=0x3000), max_size=40))
def test_strings_escape_minimally(s: str) -> None:
    out = canonical_text(s)
    assert parse_json(out) == s
    for ch in s:
        if ord(ch) >= 0x20 and ch not in '"\\':
            assert ch in out  # emitted raw, never escaped


def test_utf16_key_order_differs_from_code_point_order() -> None:
    assert canonical_text({"\ufb00": 1, "\U0001f600": 2}) == '{"\U0001f600":2,"\ufb00":1}'


def test_absent_and_null_are_different_bytes() -> None:
    assert canonicalize({"a": None}) != canonicalize({})


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, {"x": [math.nan]}])
def test_nan_and_infinity_refused(bad: object) -> None:
    with pytest.raises(CanonicalJSONError, match="NaN and Infinity"):
        canonicalize(bad)


@pytest.mark.parametrize("n", [2**53, -(2**53), 2**64, 10**30])
def test_unsafe_integers_refused_with_path(n: int) -> None:
    with pytest.raises(CanonicalJSONError) as info:
        canonicalize({"outer": {"amount": n}})
    assert "$.outer.amount" in str(info.value)
    assert "2^53" in str(info.value)


def test_boundary_integers_accepted() -> None:
    assert canonicalize(MAX_SAFE_INTEGER) == b"9007199254740991"
    assert canonicalize(-MAX_SAFE_INTEGER) == b"-9007199254740991"


def test_parse_json_gives_ecmascript_numbers() -> None:
    assert parse_json("9007199254740993") == 9007199254740992.0
    assert canonical_text(parse_json("18446744073709551615")) == "18446744073709552000"
    with pytest.raises(ValueError):
        parse_json("NaN")
    with pytest.raises(ValueError):
        parse_json("[Infinity]")


@pytest.mark.parametrize("bad", [{1: "x"}, {"a": {1, 2}}, {"a": object()}, b"bytes"])
def test_non_json_values_refused(bad: object) -> None:
    with pytest.raises(CanonicalJSONError):
        canonicalize(bad)


def test_lone_surrogate_refused() -> None:
    with pytest.raises(CanonicalJSONError, match="surrogate"):
        canonicalize({"a": "\ud800"})


def test_tuples_and_subclasses_serialize_like_their_base() -> None:
    class Str(str):
        pass

    assert canonicalize({"a": (1, 2), "b": Str("x")}) == b'{"a":[1,2],"b":"x"}'
