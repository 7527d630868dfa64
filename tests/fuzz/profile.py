"""Case budgets for the hostile-input tests (issue #10).

CI runs a bounded number of cases per property (the ``ci`` profile); a long
run is selected with ``MESHNODE_FUZZ_LONG=1`` (the ``long`` profile, 50x the
cases) and ``MESHNODE_FUZZ_EXAMPLES=N`` overrides both. Deadlines are off:
a shared, slow machine must not turn into a flaky test.

The profiles are applied per test through :func:`fuzz_settings` rather than
loaded globally, so the rest of the suite keeps Hypothesis' own defaults.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

LONG = os.environ.get("MESHNODE_FUZZ_LONG", "") not in ("", "0")
_OVERRIDE = os.environ.get("MESHNODE_FUZZ_EXAMPLES")

settings.register_profile(
    "ci", deadline=None, derandomize=False, print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
        # The harnesses (a node runtime, an admin server) are built once per test
        # on purpose and shared by its cases; each case resets what it inspects.
        HealthCheck.function_scoped_fixture,
    ],
)
settings.register_profile("long", parent=settings.get_profile("ci"))


def fuzz_settings(ci_examples: int) -> settings:
    """Settings for one property: ``ci_examples`` in CI, 50x that in a long run."""
    examples = int(_OVERRIDE) if _OVERRIDE else (ci_examples * 50 if LONG else ci_examples)
    return settings(settings.get_profile("long" if LONG else "ci"), max_examples=examples)
