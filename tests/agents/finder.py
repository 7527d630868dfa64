"""Agents for the plugin-loop tests (``tests/integration/test_plugin_loop.py``):
``finder`` finds counterparts with ``ctx.resolve`` / ``ctx.discover`` / a named
``ctx.request`` and has a handler with a bug; ``twin`` is hosted twice under one
display name. Loaded with ``[node] plugin_modules = ["tests.agents.finder:plugin"]``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshnode.agent import Agent, AgentInfo, Context, offering
from meshnode.plugins import hookimpl
from meshnode.protocol.errors import ProtocolError


def _info(found: AgentInfo) -> dict[str, Any]:
    return {"id": found.id, "name": found.name, "local": found.local, "offerings": list(found.offerings)}


class Finder(Agent):
    description = "finds other agents"

    @offering("resolve", framing=False)
    async def resolve(self, ctx: Context, input: Any) -> Any:
        try:
            return _info(await ctx.resolve(input["name"]))
        except ProtocolError as exc:
            return {"error": exc.to_object()}

    @offering("discover", framing=False)
    async def discover(self, ctx: Context, input: Any) -> Any:
        found = await ctx.discover(**input)
        return sorted((_info(f) for f in found), key=lambda f: f["id"])

    @offering("ask", framing=False)
    async def ask(self, ctx: Context, input: Any) -> Any:
        """``ctx.request`` with a name where an id would go."""
        reply = await ctx.request(input["name"], input["offering"], input.get("input"))
        return {"output": reply.output, "from": reply.envelope.get("from")}

    @offering("boom", framing=False)
    async def boom(self, ctx: Context, input: Any) -> Any:
        return undefined_name_in_a_handler  # type: ignore[name-defined]  # noqa: F821 - the bug under test


class Twin(Agent):
    description = "one of two agents with the same display name"
    display_name = "twin"
    capabilities = ["twinning"]

    @offering("hi", framing=False)
    async def hi(self, ctx: Context, input: Any) -> Any:
        return "hi"


class _Plugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("finder", Finder)
        register("twin", Twin)


plugin = _Plugin()
