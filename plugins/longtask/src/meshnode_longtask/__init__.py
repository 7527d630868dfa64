"""The longtask agent: work that outlives the reply window (§7.0).

It answers at once with a Task id (``working``), reports progress on
``mesh.task.{id}.update`` and completes with its output; a cancel stops it.
Try: ``meshnode call longtask count '{"to": 5, "every": 1}'`` or, to get the task id
and come back later, ``--no-wait`` then ``meshnode tasks show ID``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from meshnode.agent import Agent, Context, offering


class LongTaskAgent(Agent):
    description = "Counts slowly, as a Task with progress updates."
    version = "0.1.0"
    capabilities = ("task-demo",)
    public = {"description": "Counts to a number, slowly, reporting progress as it goes."}

    @offering(
        "count",
        description="Counts to {to}, one step every {every} seconds.",
        input_schema={
            "type": "object",
            "properties": {
                "to": {"type": "integer", "minimum": 1, "maximum": 10000},
                "every": {"type": "number", "minimum": 0, "maximum": 60},
            },
            "required": ["to"],
        },
        estimated_duration_ms=10_000,
        framing=False,
    )
    async def count(self, ctx: Context, input: Any) -> Any:
        task = await ctx.defer("working", "counting")
        every = float(input.get("every", 1.0))
        for n in range(1, input["to"] + 1):
            await asyncio.sleep(every)
            await task.progress(f"{n} of {input['to']}")
        return {"counted": input["to"]}
