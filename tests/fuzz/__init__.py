"""Hostile-input property tests (issue #10); case budgets in :mod:`tests.fuzz.profile`.

The A2A gateway is fuzzed next to its own tests, in
``tests/integration/test_a2a_fuzz.py`` (same MESHNODE_FUZZ_LONG / _EXAMPLES knobs).
"""
