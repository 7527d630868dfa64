"""The echo agent: answers every request with ``{"ok": <input>}``.

The smallest useful agent, and the one the quickstart calls.
"""

from __future__ import annotations

from typing import Any

from meshnode.agent import Agent, Context, offering


class EchoAgent(Agent):
    description = "Answers every request with {ok: <input>}."
    version = "0.1.0"
    capabilities = ("echo",)
    interaction = "service"
    public = {"description": "Echoes its input back, unchanged, under the key ok."}

    @offering(
        "echo",
        name="Echo",
        description="Returns {ok: input}.",
        input_modes=["application/json", "text/plain"],
        output_modes=["application/json"],
        # Echo hands nothing to a model: it returns the input exactly as sent.
        framing=False,
    )
    async def echo(self, ctx: Context, input: Any) -> Any:
        return {"ok": input}
