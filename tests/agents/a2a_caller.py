"""A hosted agent that calls external A2A agents (``a2a:<peer>``) for the outbound
bridge tests; loaded with ``[node] plugin_modules = ["tests.agents.a2a_caller:plugin"]``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshnode.agent import Agent, Context, offering
from meshnode.plugins import hookimpl
from meshnode.protocol.a2a_extension import EXTENSION_URI
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


    @offering("slow", framing=False)
    async def slow(self, ctx: Context, input: Any) -> Any:
        """Defer (so the mesh caller can cancel it), then call the peer and wait —
        by GetTask polls, or in the peer's stream when ``input.stream``."""
        await ctx.defer()
        reply = await ctx.request(f"a2a:{input['peer']}", input.get("offering", "forecast"), input.get("input"),
                                  timeout=120, config={"stream": True} if input.get("stream") else None)
        if reply.task is not None:
            if ctx.task is not None:
                await ctx.task.progress("a2a-stream-open")  # the test waits for this before canceling
            async for _ in reply.task.stream(timeout=120):
                pass
        return reply.output

    @offering("stream", framing=False)
    async def stream(self, ctx: Context, input: Any) -> Any:
        """Stream from the peer; report the chunks and the closing envelope."""
        reply = await ctx.request(f"a2a:{input['peer']}", input.get("offering", "forecast"), input.get("input"),
                                  timeout=20, config={"stream": True})
        if reply.task is None:
            return {"opened": reply.status, "chunks": [], "status": reply.status, "output": reply.output,
                    "a2a": (reply.envelope.get("meta") or {}).get(EXTENSION_URI)}
        opened = reply.task.state
        chunks = [chunk async for chunk in reply.task.stream(timeout=20)]
        final = await reply.task.result(timeout=20)
        payload = final.get("payload") or {}
        return {"opened": opened, "chunks": chunks, "status": payload.get("status"),
                "output": payload.get("output"), "a2a": (final.get("meta") or {}).get(EXTENSION_URI)}

    @offering("follow", framing=False)
    async def follow(self, ctx: Context, input: Any) -> Any:
        """Pick up a peer's task a call's wait ended on, and wait for its end."""
        handle = await ctx.a2a_task(f"a2a:{input['peer']}", input["task_id"], timeout=30)
        final = await handle.result(timeout=30)
        payload = final.get("payload") or {}
        return {"status": payload.get("status"), "output": payload.get("output"),
                "a2a": (final.get("meta") or {}).get(EXTENSION_URI)}

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
#: The same plugin under another name, for a node that also loads another
#: module's ``plugin`` (plugin_modules are registered by attribute name).
caller_plugin = plugin
