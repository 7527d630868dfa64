"""A hosted agent that calls external A2A agents (``a2a:<peer>``) for the outbound
bridge tests; loaded with ``[node] plugin_modules = ["tests.agents.a2a_caller:plugin"]``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshnode.a2a.extension import EXTENSION_URI
from meshnode.agent import Agent, Context, offering
from meshnode.plugins import hookimpl
from meshnode.protocol.errors import ProtocolError


class A2ACaller(Agent):
    """Calls the peer its input names and reports what the bridge said."""

    description = "calls external A2A agents"

    @offering("call", framing=False)
    async def call(self, ctx: Context, input: Any) -> Any:
        try:
            reply = await ctx.request(
                f"a2a:{input['peer']}", input.get("offering", "forecast"), input.get("input"),
                timeout=float(input.get("timeout", 20)),
            )
        except ProtocolError as exc:
            return {"error": exc.to_object(), "handler_trace": dict(ctx.trace)}
        meta = reply.envelope.get("meta") or {}
        return {
            "status": reply.status,
            "output": reply.output,
            "a2a": meta.get(EXTENSION_URI),
            "hop_trace": reply.envelope.get("trace"),
            "handler_trace": dict(ctx.trace),
        }


    @offering("relay", framing=False)
    async def relay(self, ctx: Context, input: Any) -> Any:
        """A mesh hop in between: ask agent ``input.target`` (its ``call``) to call the peer."""
        reply = await ctx.request(input["target"], "call", {"peer": input["peer"]}, timeout=30)
        return reply.output


class A2ACallerPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-a2a-caller", A2ACaller)


plugin = A2ACallerPlugin()
