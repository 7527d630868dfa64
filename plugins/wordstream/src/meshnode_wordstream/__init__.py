"""The wordstream agent: a streaming offering (§10.5, §11) in a dozen lines.

Asked with ``config.stream: true`` it answers with a Task and streams one chunk
per word on ``mesh.task.{id}.stream``; asked plainly it answers with all words
at once. Try: ``meshnode call wordstream words --text "hello streaming world" --stream``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from meshnode.agent import Agent, Context, offering


class WordStreamAgent(Agent):
    description = "Streams the words of its input back, one chunk per word."
    version = "0.1.0"
    capabilities = ("streaming-demo",)
    public = {"description": "Echoes your text back as a stream of words."}

    @offering(
        "words",
        description="Streams the words of {text}.",
        input_schema={"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        output_modes=["text/plain"],
        streaming=True,
        framing=False,  # the words go back to the sender, never to a model
    )
    async def words(self, ctx: Context, input: Any) -> AsyncIterator[str]:
        for word in input["text"].split():
            await asyncio.sleep(0)  # yield to the loop between chunks
            yield word + " "
