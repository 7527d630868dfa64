"""Inbound protections (§22.2-§22.5, §22.7) and the §21.2 relay guard."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tracemalloc
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnode.protocol.errors import ERROR_CODES
from meshnode.protocol.js_json import _careful_json
from meshnode.protocol.protections import (
    ABSENT,
    DEFAULT_DEDUP_CAPACITY,
    DEFAULT_FRESHNESS_WINDOW,
    DEFAULT_MAX_INBOUND_CHARS,
    LOCAL_SIGNAL_OVERSIZE,
    REFUSAL_RULES,
    DedupMemory,
    DeliverySource,
    FreshnessWindow,
    InboundGuard,
    Protection,
    check_addressing,
    check_freshness,
    compact_json,
    context_too_large_error,
    exceeds_hop_bound,
    exceeds_size_cap,
    measure_sender_text,
    sender_body,
    utf16_length,
)
from meshnode.protocol.timeutil import format_ts, parse_rfc3339_ms
from tests.conftest import load_fixture


def held(memory: DedupMemory, msg_ids: str) -> list[str]:
    """Which of ``msg_ids`` (one character each, from SENDER) ``memory`` holds, in order given."""
    return [msg_id for msg_id in msg_ids if (SENDER, msg_id) in memory]

SENDER = "UBMBH4BK6EIHQFVMHLSABFSQXB3JXUFZOXVZQTIERO33AD4HHAI3D7QP"
OTHER_SENDER = "UBZM2TEHNKQ7RTPRPYO6TYZZZ4XRCYSVUNTLMX763XGEN65Z2RNURY2R"
SELF = "UAKQRYZBYFOC65OQZVJ3QPCIERDTRNNZPMOJUYXC3DGPRCDWSKD4HV5A"
NOW_TS = "2026-07-26T12:00:00.000Z"
NOW = parse_rfc3339_ms(NOW_TS)
MINUTE = 60_000

FIXTURES = ("inbound-protections.json", "inbound-protections.ts-sdk.json")


def envelope(msg_id: str = "m-1", **members: Any) -> dict[str, Any]:
    env: dict[str, Any] = {
        "v": "0.3.0",
        "id": msg_id,
        "type": "request",
        "ts": NOW_TS,
        "from": SENDER,
        "payload": {"offering": "chat", "input": {"text": "hello"}},
    }
    env.update(members)
    return env


# --------------------------------------------------------------------------- dedup


class TestDedupMemory:
    def test_default_capacity_meets_the_recommended_minimum(self) -> None:
        assert DedupMemory().capacity == DEFAULT_DEDUP_CAPACITY == 5000

    @pytest.mark.parametrize("capacity", [0, -1, True, 1.5, None, "10"])
    def test_capacity_must_be_a_positive_integer(self, capacity: Any) -> None:
        with pytest.raises(ValueError, match="capacity"):
            DedupMemory(capacity)

    def test_second_sight_is_a_duplicate(self) -> None:
        memory = DedupMemory()
        assert memory.check_and_remember(SENDER, "a") is False
        assert memory.check_and_remember(SENDER, "a") is True
        assert len(memory) == 1

    def test_keyed_on_the_pair_not_the_id(self) -> None:
        memory = DedupMemory()
        assert memory.check_and_remember(SENDER, "a") is False
        assert memory.check_and_remember(OTHER_SENDER, "a") is False
        assert (SENDER, "a") in memory and (OTHER_SENDER, "a") in memory

    def test_evicts_the_first_seen_pair(self) -> None:
        memory = DedupMemory(3)
        for msg_id in "abcd":
            memory.check_and_remember(SENDER, msg_id)
        assert held(memory, "abcd") == ["b", "c", "d"]
        assert memory.check_and_remember(SENDER, "a") is False  # forgotten
        assert held(memory, "abcd") == ["a", "c", "d"]
        memory.check_and_remember(SENDER, "e")  # evicts c, the oldest left
        assert held(memory, "abcde") == ["a", "d", "e"]

    def test_a_repeat_does_not_refresh_its_age(self) -> None:
        memory = DedupMemory(2)
        memory.check_and_remember(SENDER, "a")
        memory.check_and_remember(SENDER, "b")
        assert memory.check_and_remember(SENDER, "a") is True
        memory.check_and_remember(SENDER, "c")
        assert (SENDER, "a") not in memory
        assert (SENDER, "b") in memory

    def test_restores_from_pairs_as_a_store_gives_them_back(self) -> None:
        stored = json.loads(json.dumps([(SENDER, "x"), (SENDER, "y"), (SENDER, "z")]))  # lists
        restored = DedupMemory.from_entries(stored, capacity=10)
        assert held(restored, "wxyz") == ["x", "y", "z"]
        assert restored.check_and_remember(SENDER, "y") is True

    def test_restore_keeps_the_newest_when_over_capacity(self) -> None:
        pairs = [(SENDER, str(i)) for i in range(5)]
        restored = DedupMemory.from_entries(pairs, capacity=2)
        assert held(restored, "01234") == ["3", "4"]

    def test_restore_keeps_a_repeated_pair_at_its_first_position(self) -> None:
        restored = DedupMemory.from_entries([(SENDER, "a"), (SENDER, "b"), (SENDER, "a")], capacity=2)
        assert held(restored, "ab") == ["a", "b"]
        restored.check_and_remember(SENDER, "c")  # a is still the oldest: it goes
        assert held(restored, "abc") == ["b", "c"]

    def test_restore_into_a_used_memory_keeps_its_own_pairs_newest(self) -> None:
        memory = DedupMemory(3)
        memory.check_and_remember(SENDER, "c")
        memory.restore([(SENDER, "x"), (SENDER, "a"), (SENDER, "c")])  # c: its own, and stored too
        assert held(memory, "xac") == ["x", "a", "c"]
        memory.restore([(SENDER, "y")])  # restored as older than all it holds: y is the one past capacity
        assert held(memory, "xacy") == ["x", "a", "c"]
        memory.check_and_remember(SENDER, "d")  # the oldest, x, goes first; c stays the newest but d
        memory.check_and_remember(SENDER, "e")
        assert held(memory, "xacde") == ["c", "d", "e"]

    @pytest.mark.parametrize("bad", [["ab"], [(SENDER,)], [(SENDER, "a", "b")], [(SENDER, 1)]])
    def test_restore_refuses_malformed_entries(self, bad: list[Any]) -> None:
        with pytest.raises(ValueError, match="pair"):
            DedupMemory.from_entries(bad)

    def test_a_copy_goes_on_alone(self) -> None:
        memory = DedupMemory(2)
        memory.check_and_remember(SENDER, "a")
        twin = memory.copy()
        twin.check_and_remember(SENDER, "b")
        twin.check_and_remember(SENDER, "c")  # evicts a in the copy only
        assert held(memory, "abc") == ["a"]
        assert held(twin, "abc") == ["b", "c"] and twin.capacity == 2

    @pytest.mark.parametrize(
        ("first", "second"),
        [
            # the same characters, split differently between sender and id
            (("ab", "c"), ("a", "bc")),
            (("a:", "b"), ("a", ":b")),
            (("1:a", "b"), ("1", ":ab")),
            # a lone surrogate (the stdlib decoder lets \\ud83d through) and its pair
            (("s", "\ud83d\ude00"), ("s", "\U0001f600")),
        ],
    )
    def test_pairs_that_share_their_characters_stay_apart(
        self, first: tuple[str, str], second: tuple[str, str]
    ) -> None:
        memory = DedupMemory()
        assert memory.check_and_remember(*first) is False
        assert memory.check_and_remember(*second) is False
        assert first in memory and second in memory and len(memory) == 2

    def test_a_fixed_hash_seed_does_not_make_the_keys_predictable(self) -> None:
        """An operator may pin PYTHONHASHSEED, which makes str hashes the same in
        every process; a pair's key must still differ from one process to the next."""
        probe = "from meshnode.protocol.protections import _pair_digest; print(_pair_digest('s', 'i'))"
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        keys = {
            subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
            for _ in range(2)
        }
        assert len(keys) == 2

    def test_only_a_pair_of_strings_is_ever_held(self) -> None:
        memory = DedupMemory()
        memory.check_and_remember(SENDER, "a")
        for probe in [SENDER, (SENDER,), (SENDER, "a", "b"), (SENDER, 1), [SENDER, "a"]]:
            assert probe not in memory

    def test_a_full_memory_costs_a_hash_an_entry_not_the_strings(self) -> None:
        """A node holds one memory per agent: at the spec's 5,000 pairs the decoded
        strings cost ~360 bytes an entry (1.8 MB an agent); their keyed hashes ~75."""
        pairs = [(f"A{n % 50:055d}", str(uuid.uuid4())) for n in range(5000)]
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            memory = DedupMemory(5000)
            for sender, msg_id in pairs:
                memory.check_and_remember(sender, msg_id)
            per_entry = (tracemalloc.get_traced_memory()[0] - before) / len(memory)
        finally:
            tracemalloc.stop()
        assert len(memory) == 5000
        assert per_entry < 110, f"{per_entry:.0f} bytes an entry"

    def test_restore_refuses_a_zero_capacity(self) -> None:
        with pytest.raises(ValueError):
            DedupMemory.from_entries([], capacity=0)

    @given(
        capacity=st.integers(min_value=1, max_value=8),
        deliveries=st.lists(
            st.tuples(st.sampled_from([SENDER, OTHER_SENDER]), st.sampled_from("abcdefghij")),
            max_size=60,
        ),
    )
    def test_matches_a_first_seen_fifo_model(
        self, capacity: int, deliveries: list[tuple[str, str]]
    ) -> None:
        memory = DedupMemory(capacity)
        model: list[tuple[str, str]] = []
        candidates = [(sender, msg_id) for sender in (SENDER, OTHER_SENDER) for msg_id in "abcdefghij"]
        for pair in deliveries:
            assert memory.check_and_remember(*pair) == (pair in model)
            if pair not in model:
                model.append(pair)
                if len(model) > capacity:
                    model.pop(0)
            assert len(memory) == len(model) <= capacity
            assert all((pair in memory) == (pair in model) for pair in candidates)


# --------------------------------------------------------------------------- freshness


class TestFreshnessWindow:
    def test_defaults_are_the_spec_values(self) -> None:
        window = FreshnessWindow()
        assert window.max_clock_skew_ahead_ms == 5 * MINUTE
        assert window.max_age_live_ms == 10 * MINUTE
        assert window.max_age_mailbox_ms == 7 * 24 * 60 * MINUTE
        assert window == DEFAULT_FRESHNESS_WINDOW

    @pytest.mark.parametrize(
        "field", ["max_clock_skew_ahead_ms", "max_age_live_ms", "max_age_mailbox_ms"]
    )
    @pytest.mark.parametrize("value", [0, -1, True, 1.5, None])
    def test_cannot_be_disabled(self, field: str, value: Any) -> None:
        with pytest.raises(ValueError, match="never disabled"):
            FreshnessWindow(**{field: value})

    def test_is_immutable(self) -> None:
        with pytest.raises(AttributeError):
            DEFAULT_FRESHNESS_WINDOW.max_age_live_ms = 1  # type: ignore[misc]

    def test_max_age_by_source(self) -> None:
        window = FreshnessWindow(1, 2, 3)
        assert window.max_age_ms("live") == window.max_age_ms(DeliverySource.LIVE) == 2
        assert window.max_age_ms("mailbox") == window.max_age_ms(DeliverySource.MAILBOX) == 3

    @pytest.mark.parametrize("source", ["", "LIVE", "drain", None])
    def test_unknown_source_is_an_error_not_a_window(self, source: Any) -> None:
        with pytest.raises(ValueError, match="delivery source"):
            FreshnessWindow().max_age_ms(source)
        with pytest.raises(ValueError, match="delivery source"):
            check_freshness("not even a timestamp", NOW, source)


class TestCheckFreshness:
    @pytest.mark.parametrize(
        ("ts", "source", "fresh"),
        [
            ("2026-07-26T12:00:00.000Z", "live", True),
            ("2026-07-26T11:50:00.000Z", "live", True),
            ("2026-07-26T11:49:59.999Z", "live", False),
            ("2026-07-26T12:05:00.000Z", "live", True),
            ("2026-07-26T12:05:00.001Z", "live", False),
            ("2026-07-26T12:05:00.001Z", "mailbox", False),
            ("2026-07-26T10:00:00.000Z", "live", False),
            ("2026-07-26T10:00:00.000Z", "mailbox", True),
            ("2026-07-19T12:00:00.000Z", "mailbox", True),
            ("2026-07-19T11:59:59.999Z", "mailbox", False),
        ],
    )
    def test_inclusive_bounds(self, ts: str, source: str, fresh: bool) -> None:
        assert check_freshness(ts, NOW, source) is fresh

    @pytest.mark.parametrize(
        "ts",
        [
            "2026-07-26T13:00:00+01:00",
            "2026-07-26T06:30:00-05:30",
            "2026-07-26t12:00:00z",
            "2026-07-26T12:00:00Z",
            "2026-07-26T12:00:00.000000000Z",
            "2026-07-26T12:00:00-00:00",
        ],
    )
    def test_any_rfc3339_form_is_read(self, ts: str) -> None:
        assert check_freshness(ts, NOW, "live") is True

    @pytest.mark.parametrize(
        "ts",
        [
            "",
            "not a timestamp",
            "2026-07-26",
            "2026-07-26 12:00:00Z",
            "2026-07-26T12:00:00",
            None,
            1785067200000,
            b"2026-07-26T12:00:00Z",
            ["2026-07-26T12:00:00Z"],
        ],
    )
    def test_unreadable_ts_is_refused(self, ts: Any) -> None:
        assert check_freshness(ts, NOW, "live") is False
        assert check_freshness(ts, NOW, "mailbox") is False

    def test_sub_microsecond_past_the_future_bound_is_refused(self) -> None:
        assert check_freshness("2026-07-26T12:05:00.0000000Z", NOW, "live") is True
        assert check_freshness("2026-07-26T12:05:00.0000001Z", NOW, "live") is False
        assert check_freshness("2026-07-26T12:04:59.9999999Z", NOW, "live") is True

    def test_a_custom_window_is_honoured(self) -> None:
        window = FreshnessWindow(max_clock_skew_ahead_ms=1, max_age_live_ms=2, max_age_mailbox_ms=3)
        assert check_freshness(format_ts(NOW + 1), NOW, "live", window) is True
        assert check_freshness(format_ts(NOW + 2), NOW, "live", window) is False
        assert check_freshness(format_ts(NOW - 2), NOW, "live", window) is True
        assert check_freshness(format_ts(NOW - 3), NOW, "live", window) is False
        assert check_freshness(format_ts(NOW - 3), NOW, "mailbox", window) is True
        assert check_freshness(format_ts(NOW - 4), NOW, "mailbox", window) is False

    @given(
        now=st.integers(min_value=10**12, max_value=4 * 10**12),
        drift=st.integers(min_value=-10 * MINUTE, max_value=8 * 24 * 60 * MINUTE),
        source=st.sampled_from(["live", "mailbox"]),
    )
    def test_accepts_exactly_the_inclusive_window(self, now: int, drift: int, source: str) -> None:
        window = DEFAULT_FRESHNESS_WINDOW
        expected = -window.max_clock_skew_ahead_ms <= drift <= window.max_age_ms(source)
        assert check_freshness(format_ts(now - drift), now, source) is expected

    @given(
        ahead=st.integers(min_value=1, max_value=10**6),
        live=st.integers(min_value=1, max_value=10**6),
        mailbox=st.integers(min_value=1, max_value=10**9),
    )
    def test_bounds_are_inclusive_for_any_window(self, ahead: int, live: int, mailbox: int) -> None:
        window = FreshnessWindow(ahead, live, mailbox)
        assert check_freshness(format_ts(NOW + ahead), NOW, "live", window)
        assert not check_freshness(format_ts(NOW + ahead + 1), NOW, "mailbox", window)
        assert check_freshness(format_ts(NOW - live), NOW, "live", window)
        assert not check_freshness(format_ts(NOW - live - 1), NOW, "live", window)
        assert check_freshness(format_ts(NOW - mailbox), NOW, "mailbox", window)
        assert not check_freshness(format_ts(NOW - mailbox - 1), NOW, "mailbox", window)

    @pytest.mark.parametrize("name", FIXTURES)
    def test_fixture_cases(self, name: str) -> None:
        for case in load_fixture(name)["freshness"]["cases"]:
            got = check_freshness(case["ts"], parse_rfc3339_ms(case["now"]), case["source"])
            assert got is (case["verdict"] == "accept"), case["id"]


# --------------------------------------------------------------------------- addressing, hops


class TestAddressing:
    def test_absent_to_is_accepted(self) -> None:
        assert check_addressing({"from": SENDER}, SELF) is True

    def test_own_id_is_accepted(self) -> None:
        assert check_addressing({"to": SELF}, SELF) is True

    @pytest.mark.parametrize(
        "to",
        [SELF[:-1] + "a", SELF.lower(), f" {SELF}", f"{SELF}\n", OTHER_SENDER, "", None, 1, [SELF]],
    )
    def test_anything_else_is_refused(self, to: Any) -> None:
        assert check_addressing({"to": to}, SELF) is False

    @given(st.text())
    def test_only_the_exact_id_passes(self, to: str) -> None:
        assert check_addressing({"to": to}, SELF) is (to == SELF)


class TestHopBound:
    @pytest.mark.parametrize(
        ("meta", "exceeded"),
        [
            (None, False),
            ({}, False),
            ({"hops": 0}, False),
            ({"hops": 3}, False),
            ({"hops": 4}, True),
            ({"hops": 100}, True),
        ],
    )
    def test_drops_only_over_three(self, meta: Any, exceeded: bool) -> None:
        env = envelope() if meta is None else envelope(meta=meta)
        assert exceeds_hop_bound(env) is exceeded

    def test_bound_is_configurable(self) -> None:
        assert exceeds_hop_bound(envelope(meta={"hops": 1}), max_hops=0) is True
        assert exceeds_hop_bound(envelope(meta={"hops": 5}), max_hops=5) is False


# --------------------------------------------------------------------------- size cap


class TestUtf16Length:
    @pytest.mark.parametrize(
        ("text", "units"),
        [
            ("", 0),
            ("abc", 3),
            ("é", 1),
            ("日本語", 3),
            ("\U0001f600", 2),
            ("\U0001f600a", 3),
            ("\ud800", 1),
        ],
    )
    def test_known_lengths(self, text: str, units: int) -> None:
        assert utf16_length(text) == units

    @given(st.text())
    def test_equals_utf16_encoding_length(self, text: str) -> None:
        assert utf16_length(text) == len(text.encode("utf-16-le")) // 2


class TestMeasureSenderText:
    def test_a_string_payload_is_the_text(self) -> None:
        got = measure_sender_text("hi \U0001f600")
        assert (got.text, got.measured, got.length, got.field) == (
            "hi \U0001f600",
            "hi \U0001f600",
            5,
            "self",
        )

    @pytest.mark.parametrize("field", ["text", "message", "prompt"])
    def test_each_rung(self, field: str) -> None:
        got = measure_sender_text({field: "hello", "other": "x" * 500})
        assert (got.text, got.length, got.field) == ("hello", 5, field)

    def test_rung_order(self) -> None:
        got = measure_sender_text({"prompt": "p", "message": "m", "text": "t"})
        assert (got.text, got.field) == ("t", "text")

    def test_null_rung_is_skipped(self) -> None:
        got = measure_sender_text({"text": None, "message": "hi"})
        assert (got.text, got.field) == ("hi", "message")

    @pytest.mark.parametrize(
        ("value", "measured"),
        [
            (42, "42"),
            (0, "0"),
            (False, "false"),
            ({"a": 1}, '{"a":1}'),
            ([1, "x"], '[1,"x"]'),
            (1.0, "1"),
            (1.5, "1.5"),
        ],
    )
    def test_non_string_rung_stops_the_walk_and_is_measured(
        self, value: Any, measured: str
    ) -> None:
        got = measure_sender_text({"text": value, "message": "x" * 1000})
        assert (got.text, got.measured, got.length, got.field) == (
            None,
            measured,
            len(measured),
            None,
        )

    def test_structured_payload_is_measured_whole(self) -> None:
        got = measure_sender_text({"rows": [1, 2, 3]})
        assert (got.text, got.measured, got.length, got.field) == (
            None,
            '{"rows":[1,2,3]}',
            16,
            None,
        )

    def test_null_measures_four_and_absent_measures_zero(self) -> None:
        assert measure_sender_text(None).length == 4
        assert measure_sender_text(ABSENT).length == 0
        assert measure_sender_text(ABSENT).measured == ""
        assert repr(ABSENT) == "ABSENT"

    def test_a_list_payload_is_not_a_ladder(self) -> None:
        got = measure_sender_text(["text", "message"])
        assert (got.text, got.measured) == (None, '["text","message"]')

    def test_measurement_uses_utf16_units(self) -> None:
        got = measure_sender_text({"blob": "\U0001f600"})
        assert got.measured == '{"blob":"\U0001f600"}'
        assert got.length == 13  # 11 ASCII characters and one astral character


class TestCompactJson:
    @pytest.mark.parametrize(
        ("value", "text"),
        [
            (1.0, "1"),
            (-0.0, "0"),
            (1e21, "1e+21"),
            (1e-7, "1e-7"),
            (0.1, "0.1"),
            (2**60, "1152921504606847000"),  # as an ECMAScript peer holds it
            (2**2000, "null"),  # Infinity as a double
            (math.nan, "null"),
            (math.inf, "null"),
            ("\ud800", '"\\ud800"'),  # a lone surrogate is escaped, as JSON.stringify does
            ('a\x7f\u2028\x01"\\', '"a\x7f\u2028\\u0001\\"\\\\"'),
            ({"b": 1, "a": 2}, '{"b":1,"a":2}'),  # the mapping's own order
            ((1, 2), "[1,2]"),
            ({"v": "1.5 and 12345678901234567"}, '{"v":"1.5 and 12345678901234567"}'),
        ],
    )
    def test_writes_what_json_stringify_writes(self, value: Any, text: str) -> None:
        assert compact_json(value) == text

    @pytest.mark.parametrize(
        ("value", "name"),
        [
            ({1, 2}, "set"),
            (b"x", "bytes"),
            (object(), "object"),
            ({1: "a"}, "dict"),
            ({"a": {1, 2}}, "dict"),
        ],
    )
    def test_a_value_with_no_json_form_measures_as_its_type_name(
        self, value: Any, name: str
    ) -> None:
        assert compact_json(value) == name

    def test_a_cycle_measures_as_its_type_name(self) -> None:
        cyclic: list[Any] = []
        cyclic.append(cyclic)
        assert compact_json(cyclic) == "list"
        assert compact_json({"text": cyclic}) == "dict"

    def test_shared_but_acyclic_values_are_written_twice(self) -> None:
        shared = {"k": 1.5}
        assert compact_json([shared, shared]) == '[{"k":1.5},{"k":1.5}]'

    def test_uuid_is_written_as_its_string(self) -> None:
        value = uuid.UUID(int=1)
        assert compact_json(value) == f'"{value}"'
        assert compact_json([value, 1.5]) == f'["{value}",1.5]'

    def test_depth_cannot_shrink_a_large_payload(self) -> None:
        nested: Any = "x" * 1000
        for _ in range(5000):  # far beyond orjson's and the interpreter's recursion limits
            nested = [nested]
        got = measure_sender_text(nested)
        assert got.length == 1000 + 2 + 2 * 5000
        assert exceeds_size_cap(got.length, 1000)

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(-(2**53) + 1, 2**53 - 1) | st.text(),
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.text(max_size=5), children, max_size=4)
        ),
        max_leaves=20,
    )

    number_like_text = st.sampled_from(["2026-12-02T06:00:05.123Z", "0.3", "1e5", "12345678901234567", "x"])
    mixed_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | number_like_text | st.text(max_size=5),
        lambda children: (
            st.lists(children, max_size=4)
            | st.tuples(children, children)
            | st.dictionaries(st.text(max_size=5), children, max_size=4)
        ),
        max_leaves=20,
    )

    @given(mixed_values)
    def test_the_fast_path_writes_what_the_careful_path_writes(self, value: Any) -> None:
        # Strings that look like numbers (timestamps, versions) no longer send a
        # value to the careful serializer (issue #21): whichever path a value
        # takes, the text must be the careful path's.
        assert compact_json(value) == _careful_json(value)

    def test_a_manifest_with_timestamps_measures_as_json_stringify_writes_it(self) -> None:
        value = {"protocol_version": "0.3", "node": {"attestation": {"issued_at": "2026-12-02T06:00:05.123Z"}},
                 "limits": {"n": 2**53 - 1}}
        assert compact_json(value) == json.dumps(value, separators=(",", ":"))

    @given(json_values)
    def test_round_trips_and_matches_the_stdlib_length(self, value: Any) -> None:
        text = compact_json(value)
        assert json.loads(text) == value
        expected = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        assert utf16_length(text) == utf16_length(expected)

    @given(st.floats(allow_nan=False, allow_infinity=False))
    def test_floats_round_trip(self, value: float) -> None:
        assert float(json.loads(compact_json({"f": value}))["f"]) == value


class TestSizeCap:
    def test_strictly_greater_refuses(self) -> None:
        assert exceeds_size_cap(100, 100) is False
        assert exceeds_size_cap(101, 100) is True
        assert exceeds_size_cap(DEFAULT_MAX_INBOUND_CHARS) is False
        assert exceeds_size_cap(DEFAULT_MAX_INBOUND_CHARS + 1) is True

    def test_zero_means_no_cap(self) -> None:
        assert exceeds_size_cap(10**9, 0) is False

    @given(st.integers(min_value=0, max_value=10**6), st.integers(min_value=1, max_value=10**6))
    def test_only_over_the_cap_refuses(self, length: int, cap: int) -> None:
        assert exceeds_size_cap(length, cap) is (length > cap)

    def test_error_object(self) -> None:
        error = context_too_large_error(101, 100)
        assert error["code"] == "CONTEXT_TOO_LARGE"
        assert error["retryable"] is False
        assert error["details"] == {"limit": "max_inbound_chars", "cap": 100, "measured": 101}
        assert isinstance(error["message"], str) and error["message"]

    @pytest.mark.parametrize("name", FIXTURES)
    def test_fixture_cases(self, name: str) -> None:
        for case in load_fixture(name)["size_cap"]["cases"]:
            got = measure_sender_text(case["input"])
            assert got.length == case["measured_chars"], case["id"]
            refused = exceeds_size_cap(got.length, case["max_inbound_chars"])
            assert refused is (case["verdict"] == "refuse"), case["id"]


class TestSenderBody:
    def test_request_input(self) -> None:
        assert sender_body(envelope()) == {"text": "hello"}

    def test_request_without_input_is_the_payload(self) -> None:
        assert sender_body(envelope(payload="hi")) == "hi"
        assert sender_body(envelope(payload={"text": "hi"})) == {"text": "hi"}

    def test_other_types_are_the_payload(self) -> None:
        payload = {"input": "not an input here", "status": "completed"}
        assert sender_body(envelope(type="respond", payload=payload)) is payload

    def test_no_payload_is_absent(self) -> None:
        env = envelope()
        del env["payload"]
        assert sender_body(env) is ABSENT

    def test_null_payload_is_null(self) -> None:
        assert sender_body(envelope(payload=None)) is None


# --------------------------------------------------------------------------- §22.7


class TestRefusalRules:
    def test_every_protection_has_a_rule(self) -> None:
        assert set(REFUSAL_RULES) == set(Protection)
        for protection, rule in REFUSAL_RULES.items():
            assert rule.protection is protection
            assert rule.handler_invoked is False
            assert rule.local_signal

    def test_only_the_size_cap_answers_the_sender(self) -> None:
        answering = [p for p, rule in REFUSAL_RULES.items() if rule.answers_sender]
        assert answering == [Protection.SIZE_CAP]
        for rule in REFUSAL_RULES.values():
            if not rule.answers_sender:
                assert rule.error_code is None and rule.retryable is None

    def test_size_cap_row(self) -> None:
        rule = REFUSAL_RULES[Protection.SIZE_CAP]
        assert rule.error_code == "CONTEXT_TOO_LARGE"
        assert rule.retryable is False is ERROR_CODES["CONTEXT_TOO_LARGE"]
        assert rule.local_signal == LOCAL_SIGNAL_OVERSIZE == "inbound_oversize"
        assert rule.local_signal_required is True

    def test_silent_rows_should_signal(self) -> None:
        rows = {rule.refusal for rule in REFUSAL_RULES.values()}
        assert rows == {"duplicate", "stale", "misaddressed", "hops_exceeded", "size_cap"}
        for rule in REFUSAL_RULES.values():
            if rule.protection is not Protection.SIZE_CAP:
                assert rule.local_signal_required is False

    @pytest.mark.parametrize("name", FIXTURES)
    def test_matches_the_fixture(self, name: str) -> None:
        refusals = load_fixture(name)["refusals"]
        by_row = {rule.refusal: rule for rule in REFUSAL_RULES.values()}
        for row, spec in refusals.items():
            if row == "comment":
                continue
            assert by_row[row].answers_sender is (spec["to_sender"] is not None), row
        size = refusals["size_cap"]
        assert by_row["size_cap"].error_code == size["to_sender"]["error_code"]
        assert by_row["size_cap"].retryable is size["to_sender"]["retryable"]
        assert by_row["size_cap"].local_signal == size["to_recipient"]["local_warning"]


# --------------------------------------------------------------------------- the guard


class TestInboundGuard:
    def guard(self, **options: Any) -> InboundGuard:
        return InboundGuard(SELF, **options)

    @pytest.mark.parametrize(
        "options",
        [
            {"max_inbound_chars": -1},
            {"max_inbound_chars": 1.5},
            {"max_hops": -1},
            {"max_hops": True},
        ],
    )
    def test_refuses_bad_configuration(self, options: dict[str, Any]) -> None:
        with pytest.raises(ValueError):
            self.guard(**options)

    def test_refuses_a_missing_self_id_and_a_bad_window(self) -> None:
        with pytest.raises(ValueError):
            InboundGuard("")
        with pytest.raises(TypeError):
            InboundGuard(SELF, window={"max_age_live_ms": 1})  # type: ignore[arg-type]

    def test_accepts_a_good_envelope_with_its_measurement(self) -> None:
        verdict = self.guard().check(envelope(to=SELF), source="live", now_ms=NOW)
        assert verdict.accepted
        assert verdict.protection is None and verdict.rule is None and verdict.answer is None
        assert not verdict.answers_sender
        assert verdict.local_signal is None and not verdict.local_signal_required
        assert verdict.measurement is not None
        assert (verdict.measurement.text, verdict.measurement.field) == ("hello", "text")

    def test_duplicate_is_silent_and_should_signal(self) -> None:
        guard = self.guard()
        assert guard.check(envelope(), source="live", now_ms=NOW).accepted
        verdict = guard.check(envelope(), source="mailbox", now_ms=NOW)
        assert not verdict.accepted
        assert verdict.protection is Protection.DUPLICATE
        assert verdict.answer is None
        assert verdict.local_signal == "inbound_duplicate"
        assert not verdict.local_signal_required

    def test_remembers_before_judging(self) -> None:
        guard = self.guard()
        stale = envelope(ts="2026-07-26T10:00:00.000Z")
        first = guard.check(stale, source="live", now_ms=NOW)
        assert first.protection is Protection.FRESHNESS
        again = guard.check(stale, source="mailbox", now_ms=NOW)  # the mailbox would forgive it
        assert again.protection is Protection.DUPLICATE

    def test_every_refusal_is_remembered(self) -> None:
        guard = self.guard(max_inbound_chars=1)
        refused = [
            envelope("a", ts="2020-01-01T00:00:00Z"),
            envelope("b", to=OTHER_SENDER),
            envelope("c", meta={"hops": 9}),
            envelope("d"),
        ]
        for env in refused:
            assert not guard.check(env, source="live", now_ms=NOW).accepted
        assert held(guard.memory, "abcd") == ["a", "b", "c", "d"] and len(guard.memory) == 4
        for env in refused:
            verdict = guard.check(env, source="live", now_ms=NOW)
            assert verdict.protection is Protection.DUPLICATE

    def test_window_is_chosen_by_source(self) -> None:
        verdict = self.guard().check(
            envelope(ts="2026-07-20T12:00:00Z"), source="mailbox", now_ms=NOW
        )
        assert verdict.accepted
        verdict = self.guard().check(envelope(ts="2026-07-20T12:00:00Z"), source="live", now_ms=NOW)
        assert verdict.protection is Protection.FRESHNESS
        assert verdict.local_signal == "inbound_stale"

    def test_order_freshness_before_addressing_before_hops_before_size(self) -> None:
        guard = self.guard(max_inbound_chars=1)
        everything_wrong = envelope(
            "1", ts="2020-01-01T00:00:00Z", to=OTHER_SENDER, meta={"hops": 9}
        )
        assert guard.check(everything_wrong, source="live", now_ms=NOW).protection is (
            Protection.FRESHNESS
        )
        misaddressed = envelope("2", to=OTHER_SENDER, meta={"hops": 9})
        verdict = guard.check(misaddressed, source="live", now_ms=NOW)
        assert verdict.protection is Protection.ADDRESSING
        assert verdict.local_signal == "inbound_misaddressed"
        relayed = envelope("3", meta={"hops": 9})
        verdict = guard.check(relayed, source="live", now_ms=NOW)
        assert verdict.protection is Protection.HOPS
        assert verdict.answer is None
        assert verdict.local_signal == "inbound_hops_exceeded"

    def test_size_cap_answers_the_sender_and_must_signal(self) -> None:
        env = envelope("big", payload={"offering": "chat", "input": {"text": "x" * 11}})
        verdict = self.guard(max_inbound_chars=10).check(env, source="mailbox", now_ms=NOW)
        assert not verdict.accepted
        assert verdict.protection is Protection.SIZE_CAP
        assert verdict.answers_sender and verdict.answer is not None
        assert verdict.answer.in_reply_to == "big"
        assert verdict.answer.to == SENDER
        assert verdict.answer.error == context_too_large_error(11, 10)
        assert verdict.local_signal == "inbound_oversize"
        assert verdict.local_signal_required
        assert verdict.measurement is not None and verdict.measurement.length == 11

    def test_at_the_cap_is_accepted_and_zero_is_no_cap(self) -> None:
        env = envelope(payload={"input": "x" * 10})
        assert self.guard(max_inbound_chars=10).check(env, source="live", now_ms=NOW).accepted
        env = envelope("huge", payload={"input": "x" * 100_000})
        assert self.guard(max_inbound_chars=0).check(env, source="live", now_ms=NOW).accepted

    def test_default_cap(self) -> None:
        guard = self.guard()
        assert guard.max_inbound_chars == DEFAULT_MAX_INBOUND_CHARS
        at = envelope("at", payload="x" * DEFAULT_MAX_INBOUND_CHARS)
        over = envelope("over", payload="x" * (DEFAULT_MAX_INBOUND_CHARS + 1))
        assert guard.check(at, source="live", now_ms=NOW).accepted
        assert guard.check(over, source="live", now_ms=NOW).protection is Protection.SIZE_CAP

    def test_body_override_is_what_gets_measured(self) -> None:
        guard = self.guard(max_inbound_chars=3)
        verdict = guard.check(envelope("a"), source="live", now_ms=NOW, body="hi")
        assert verdict.accepted
        verdict = guard.check(envelope("b"), source="live", now_ms=NOW, body=ABSENT)
        assert verdict.accepted and verdict.measurement is not None
        assert verdict.measurement.length == 0

    def test_unknown_source_raises_before_anything_is_remembered(self) -> None:
        guard = self.guard()
        with pytest.raises(ValueError, match="delivery source"):
            guard.check(envelope(), source="carrier-pigeon", now_ms=NOW)
        assert len(guard.memory) == 0

    @pytest.mark.parametrize(
        "name", ["window", "max_inbound_chars", "max_hops", "memory", "self_id"]
    )
    def test_settings_are_read_only(self, name: str) -> None:
        guard = self.guard()
        with pytest.raises(AttributeError):
            setattr(guard, name, None)

    def test_shared_memory_is_used(self) -> None:
        memory = DedupMemory(1)
        guard = self.guard(memory=memory)
        guard.check(envelope("a"), source="live", now_ms=NOW)
        assert held(memory, "a") == ["a"]
        assert guard.self_id == SELF

    def test_does_not_modify_the_envelope(self) -> None:
        env = envelope(to=SELF, meta={"hops": 1})
        before = json.dumps(env, sort_keys=True)
        self.guard().check(env, source="live", now_ms=NOW)
        assert json.dumps(env, sort_keys=True) == before

    @settings(max_examples=50)
    @given(
        capacity=st.integers(min_value=1, max_value=5),
        ids=st.lists(st.sampled_from("abcdefg"), max_size=40),
    )
    def test_memory_stays_bounded(self, capacity: int, ids: list[str]) -> None:
        guard = self.guard(memory=DedupMemory(capacity))
        for msg_id in ids:
            guard.check(envelope(msg_id), source="live", now_ms=NOW)
            assert len(guard.memory) <= capacity
