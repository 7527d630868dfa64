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
        task = await ctx.defer("working", "starting")
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
        await ctx.defer("working")
        reply = await ctx.request(input["target"], "slow", {"steps": 100, "pause": 0.1})
        await asyncio.sleep(30)
        return {"child": reply.task.task_id if reply.task else None}

    @offering("reject")
    async def reject(self, ctx: Context, input: Any) -> Any:
        task = await ctx.defer("submitted")
        await task.reject("not today")
        return None


class TasksPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-tasks", Tasks)


tasks_plugin = TasksPlugin()


class Seller(Agent):
    """Budget admission with an estimate, and a pause at the ceiling (§7.7)."""

    description = "prices its work"

    async def admit(self, ctx: Context, offering: str, input: Any, budget: Any) -> None:
        from meshnode.protocol.budget import Money

        if offering != "metered":
            return
        ceiling = budget.cost_ceiling if budget is not None else None
        if ceiling is None or ceiling.amount_micro < 1000:
            raise Refusal("BUDGET_INSUFFICIENT", "this costs at least 1000 micro-USD",
                          {"estimate": Money(1000, "USD").to_object()})

    @offering("metered")
    async def metered(self, ctx: Context, input: Any) -> Any:
        from meshnode.protocol.budget import Money

        task = await ctx.defer("working")
        budget = await task.pause_for_budget(Money(1000, "USD"), Money(2000, "USD"), timeout=15)
        if budget is None:
            raise Refusal("BUDGET_EXHAUSTED", "no revision came")
        return {"finished": True, "revision": budget.revision}

    @offering("buy")
    async def buy(self, ctx: Context, input: Any) -> Any:
        budget = {"revision": 0, "cost_ceiling": {"amount_micro": 1000, "currency": "USD"}}
        reply = await ctx.request(input["target"], "metered", {}, budget=budget)
        assert reply.task is not None
        async for update in reply.task.updates(timeout=15):
            error = update.get("error") or {}
            if error.get("code") == "BUDGET_EXHAUSTED":
                await reply.task.revise_budget({"revision": 1, "cost_ceiling": {"amount_micro": 5000, "currency": "USD"}})
        final = reply.task.last_update
        return {"status": final["payload"]["status"], "output": final["payload"].get("output")}


class SellerPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-seller", Seller)


seller_plugin = SellerPlugin()


class Streams(Agent):
    """Honest and dishonest streams, and a consumer that checks them (§11.6)."""

    description = "stream integrity"

    @offering("honest", streaming=True, framing=False)
    async def honest(self, ctx: Context, input: Any) -> Any:
        for i in range(int((input or {}).get("n", 5))):
            yield f"c{i}"

    async def _lie(self, ctx: Context, how: str) -> None:
        from meshnode.protocol import subjects
        from meshnode.protocol.envelope import build_envelope, encode_envelope, sign_envelope
        from meshnode.protocol.nkeys import KeyPair

        hosted = ctx._hosted
        node = hosted.node
        task = await ctx.defer("working")
        if how == "gap":
            plan = [(0, False), (2, False), (3, True)]
        elif how == "truncated":
            plan = [(0, False), (1, True)]
        else:
            plan = [(0, False)]
        for index, final in plan:
            count = 5 if how == "truncated" else index + 1
            await node.publish_chunk(hosted, task, index, None if final else f"c{index}", final=final, sign=final,
                                     chunk_count=count if final else None)
        if how == "forged":
            stranger = KeyPair.generate()
            env = build_envelope("respond", stranger.public_key, now_ms=node.now_ms(), task_id=task.task_id,
                                 payload={"status": "working", "chunk_index": 1, "final": False, "data": "evil"})
            sign_envelope(env, stranger)
            await node.connection.publish(subjects.task_stream(task.task_id), encode_envelope(env))

    @offering("gap", streaming=True)
    async def gap(self, ctx: Context, input: Any) -> Any:
        await self._lie(ctx, "gap")
        return
        yield  # pragma: no cover - makes this an async generator

    @offering("truncated", streaming=True)
    async def truncated(self, ctx: Context, input: Any) -> Any:
        await self._lie(ctx, "truncated")
        return
        yield  # pragma: no cover

    @offering("forged", streaming=True)
    async def forged(self, ctx: Context, input: Any) -> Any:
        await self._lie(ctx, "forged")
        return
        yield  # pragma: no cover

    @offering("consume")
    async def consume(self, ctx: Context, input: Any) -> Any:
        from meshnode.node.tasks import StreamBroken

        reply = await ctx.request(input["target"], input["offering"], {"n": 5}, config={"stream": True})
        assert reply.task is not None
        try:
            chunks = [c async for c in reply.task.stream(timeout=5)]
        except StreamBroken as exc:
            return {"broken": exc.message}
        return {"chunks": chunks}


class StreamsPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-streams", Streams)


streams_plugin = StreamsPlugin()
