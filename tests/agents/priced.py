"""A priced agent for the economics tests (``tests/integration/test_agreements.py``).

``summarize`` is a paid offering (flat price per request, §19.1); ``generate``
is priced per unit of the declared ``tokens_out`` meter, which its handler
reports (``ctx.report_usage``); the flat amount is
read from ``MESHNODE_TEST_PRICE_MICRO`` when the class is defined, so a test
restarts the daemon with another value to move the SKU's digest. ``runs``
counts handler runs, so a refused request is seen not to have run. Loaded with
``[node] plugin_modules = ["tests.agents.priced:plugin"]``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, ClassVar

from meshnode.agent import Agent, Context, offering
from meshnode.plugins import hookimpl

PRICE_MICRO = int(os.environ.get("MESHNODE_TEST_PRICE_MICRO", "2000"))


class Priced(Agent):
    description = "summarizes for a flat fee"
    runs: ClassVar[int] = 0

    @offering("summarize", price={"model": "flat", "currency": "USD", "amount_micro": PRICE_MICRO}, framing=False)
    async def summarize(self, ctx: Context, input: Any) -> Any:
        type(self).runs += 1
        return {"summary": str(input)[:10], "runs": type(self).runs}

    @offering("generate", price={"model": "per_unit", "currency": "USD", "meter": "tokens_out", "amount_micro": 3},
              framing=False)
    async def generate(self, ctx: Context, input: Any) -> Any:
        # The plugin's whole economics: report the declared meter (§13.5).
        tokens = int((input or {}).get("tokens", 0))
        await ctx.report_usage("tokens_out", tokens)
        return {"tokens": tokens}

    @offering("ping", framing=False)
    async def ping(self, ctx: Context, input: Any) -> Any:
        return {"runs": type(self).runs}


class _Plugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("priced", Priced)


plugin = _Plugin()
