"""Agent kinds used only by the integration tests (loaded via [node] plugin_modules)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from meshnode.agent import Agent, AgentSettings, Context, Refusal, offering
from meshnode.plugins import hookimpl


class CrashOnStart(Agent):
    """Fails in on_start: the node must host the others and report this one."""

    description = "always fails to start"

    async def on_start(self, ctx: Context) -> None:
        raise RuntimeError("this agent cannot start")


class Faulty(Agent):
    """Handlers that crash, refuse, answer big, or call another agent."""

    description = "test agent with misbehaving handlers"

    @offering("crash")
    async def crash(self, ctx: Context, input: Any) -> Any:
        raise ZeroDivisionError("handler bug with a secret detail")

    @offering("refuse")
    async def refuse(self, ctx: Context, input: Any) -> Any:
        raise Refusal("UNAUTHORIZED", "not for you", {"why": "test"})

    @offering("text", framing=True)
    async def text(self, ctx: Context, input: Any) -> Any:
        return {"framed": ctx.text, "input": input}

    @offering("relay")
    async def relay(self, ctx: Context, input: Any) -> Any:
        reply = await ctx.request(input["target"], input.get("offering", "echo"), input.get("input"))
        return {"relayed": reply.output, "from": reply.envelope["from"], "trace_id": ctx.trace.get("trace_id"),
                "reply_trace_id": reply.envelope["trace"]["trace_id"]}

    @offering("sleep")
    async def sleep(self, ctx: Context, input: Any) -> Any:
        await asyncio.sleep(float(input or 1))
        return {"slept": input}

    @offering("schema", input_schema={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    async def schema(self, ctx: Context, input: Any) -> Any:
        return {"n": input["n"]}


class TestAgents:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-crash-on-start", CrashOnStart)
        register("test-faulty", Faulty)


plugin = TestAgents()


class Listener(Agent):
    """Records every event it receives on demo.* (subscribed through accepts)."""

    description = "records demo.* events"
    accepts = ("demo.*",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.seen: list[dict[str, Any]] = []

    async def on_event(self, ctx: Context, event: Any) -> None:
        self.seen.append({"subject": event.subject, "sender": event.sender, "data": event.data,
                          "trace_id": event.envelope["trace"]["trace_id"]})

    @offering("seen")
    async def seen_events(self, ctx: Context, input: Any) -> Any:
        return self.seen

    @offering("emit")
    async def emit(self, ctx: Context, input: Any) -> Any:
        await ctx.emit(input.get("domain", "demo"), input.get("event_type", "tick"), input.get("data"))
        return {"emitted": True, "trace_id": ctx.trace.get("trace_id")}


class ListenerPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-listener", Listener)


listener_plugin = ListenerPlugin()


class Attended(Agent):
    """A person's session: requests are held in the inbox (§8.3a)."""

    description = "a person reads and answers these"
    interaction = "interactive"

    @offering("chat")
    async def chat(self, ctx: Context, input: Any) -> Any:  # pragma: no cover - never runs live
        raise AssertionError("an interactive agent's handler is not run by the node")


class AttendedPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-attended", Attended)


attended_plugin = AttendedPlugin()


class JournalSettings(AgentSettings):
    path: str


class Journal(Agent):
    """Appends the id of every request it handles to a file, fsynced, then answers."""

    description = "records each dispatch durably"
    Settings = JournalSettings

    @offering("work", framing=False)
    async def work(self, ctx: Context, input: Any) -> Any:
        import os

        settings = self.settings
        assert isinstance(settings, JournalSettings)
        fd = os.open(settings.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (ctx.envelope["id"] + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        await asyncio.sleep(0.01)
        return {"done": input}


class JournalPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-journal", Journal)


journal_plugin = JournalPlugin()


class Tasks(Agent):
    """Deferred, streamed and delegating work (§7, §10.5, §10.8)."""

    description = "exercises tasks"

    @offering("slow")
    async def slow(self, ctx: Context, input: Any) -> Any:
        task = await ctx.defer("working", "starting")  # type: ignore[attr-defined]
        steps = int((input or {}).get("steps", 3))
        for i in range(steps):
            await asyncio.sleep(float((input or {}).get("pause", 0.05)))
            await task.progress(f"step {i + 1} of {steps}")
        return {"done": steps}

    @offering("words", streaming=True, framing=False)
    async def words(self, ctx: Context, input: Any) -> Any:
        for word in str((input or {}).get("text", "")).split():
            await asyncio.sleep(0)
            yield word + " "

    @offering("delegate")
    async def delegate(self, ctx: Context, input: Any) -> Any:
        await ctx.defer("working")  # type: ignore[attr-defined]
        reply = await ctx.request(input["target"], "slow", {"steps": 100, "pause": 0.1})
        await asyncio.sleep(30)
        return {"child": reply.task.task_id if reply.task else None}

    @offering("reject")
    async def reject(self, ctx: Context, input: Any) -> Any:
        task = await ctx.defer("submitted")  # type: ignore[attr-defined]
        await task.reject("not today")
        return None


class TasksPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-tasks", Tasks)


tasks_plugin = TasksPlugin()
