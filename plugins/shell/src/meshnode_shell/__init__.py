"""The shell agent: one subprocess per request (the spec's "service agent" pattern).

Configuration (``[agents.<name>]`` with ``plugin = "shell"``)::

    command = ["wc", "-w"]     # argv; run without a shell
    timeout = 30               # seconds before the process is killed
    max_output_bytes = 65536   # stdout beyond this is cut (and said so)
    offering = "chat"          # the offering id it answers (default: chat, §10.7)

The request's sender text, already wrapped in the §22.6 provenance frame, is
written to the command's stdin; its stdout is the answer's ``text``. The
command never sees the envelope, the sender's raw text, or a shell.
A non-zero exit or a timeout is answered as INTERNAL_ERROR; stderr is logged
locally and never sent to the caller. A command not found on the ``PATH`` it
runs with fails the agent's start, naming it, rather than every request.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from typing import Any

from pydantic import Field

from meshnode.agent import Agent, AgentSettings, Context, Refusal, offering


class ShellSettings(AgentSettings):
    command: list[str] = Field(min_length=1, description="argv of the command to run")
    timeout: float = Field(default=30.0, gt=0, le=3600)
    max_output_bytes: int = Field(default=65536, gt=0)
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables")


class ShellAgent(Agent):
    description = "Runs a configured command per request; the sender's framed text is its stdin."
    version = "0.1.0"
    capabilities = ("shell",)
    interaction = "service"
    Settings = ShellSettings
    public = {"description": "A command-line tool behind a mesh inbox: send text, get its output."}

    async def on_start(self, ctx: Context) -> None:
        settings = self.settings
        assert isinstance(settings, ShellSettings)
        program = settings.command[0]
        path = _environment(settings)["PATH"]
        if shutil.which(program, path=path) is None:
            # Said once, at start (and in `meshnode status`), not as INTERNAL_ERROR on every request.
            raise RuntimeError(
                f"command {program!r} is not an executable found on PATH={path}: set [agents.{self.name}] "
                "command to an installed program (or env.PATH to where it is)"
            )

    @offering(
        "chat",
        name="Chat",
        description="Send {text}; the command's output comes back as {text}.",
        input_schema={
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        },
        input_modes=["text/plain"],
        output_modes=["text/plain"],
    )
    async def chat(self, ctx: Context, input: Any) -> Any:
        settings = self.settings
        assert isinstance(settings, ShellSettings)
        stdin = (ctx.text or "").encode("utf-8")
        env = _environment(settings)
        try:
            proc = await asyncio.create_subprocess_exec(
                *settings.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            self.log.error("cannot start %s: %s", settings.command[0], exc)
            raise Refusal("INTERNAL_ERROR", "the command could not be started") from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), timeout=settings.timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            self.log.warning("command timed out after %ss", settings.timeout)
            raise Refusal("INTERNAL_ERROR", "the command timed out") from None
        if err:
            self.log.info("command stderr: %s", err[:2000].decode("utf-8", "replace"))
        if proc.returncode != 0:
            raise Refusal("INTERNAL_ERROR", f"the command exited with status {proc.returncode}")
        truncated = len(out) > settings.max_output_bytes
        text = out[: settings.max_output_bytes].decode("utf-8", "replace")
        result: dict[str, Any] = {"text": text}
        if truncated:
            result["truncated"] = True
        return result


def _environment(settings: ShellSettings) -> dict[str, str]:
    """The command's whole environment: a PATH, a UTF-8 locale, and the configured ``env``."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", **settings.env}
