"""Agents for the owner-allowance tests (``tests/integration/test_allowance.py``).

``spender`` spends what it is told: ``work`` declares an allowance estimate
(``input["estimate"]`` tokens, the ``allowance_estimate`` callable) and then
reports ``input["steps"]`` usages of ``input["tokens"]`` tokens each through
``ctx.report_usage``; ``stats`` says how many ``work`` handlers started and
finished, so a refused request is seen not to have run. ``watcher``
subscribes to ``agent.allowance_exceeded`` when it starts and keeps what it
saw (``seen``). Loaded with ``[node] plugin_modules = ["tests.agents.spender:plugin"]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from meshnode.agent import Agent, Context, Event, offering
from meshnode.plugins import hookimpl


def _estimate(input: Any) -> dict[str, int]:
    return {"tokens": int(input.get("estimate", 0)) if isinstance(input, dict) else 0}


class Spender(Agent):
    description = "spends tokens on the owner's allowance"
    started: ClassVar[int] = 0
    finished: ClassVar[int] = 0

    @offering("work", framing=False, allowance_estimate=_estimate)
    async def work(self, ctx: Context, input: Any) -> Any:
        type(self).started += 1
        for _ in range(int(input.get("steps", 1))):
            await ctx.report_usage(tokens=int(input.get("tokens", 0)))
        type(self).finished += 1
        return {"done": True}

    @offering("stats", framing=False)
    async def stats(self, ctx: Context, input: Any) -> Any:
        return {"started": type(self).started, "finished": type(self).finished}


class Watcher(Agent):
    description = "keeps the allowance_exceeded events it sees"
    accepts: ClassVar[list[str]] = ["agent.allowance_exceeded"]
    seen: ClassVar[list[Any]] = []

    async def on_event(self, ctx: Context, event: Event) -> None:
        type(self).seen.append({"sender": event.sender, "data": event.data})

    @offering("seen", framing=False)
    async def seen_events(self, ctx: Context, input: Any) -> Any:
        return list(type(self).seen)


class _Plugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("spender", Spender)
        register("watcher", Watcher)


plugin = _Plugin()
