"""Agent kinds used only by the integration tests (loaded via [node] plugin_modules)."""

from __future__ import annotations

import asyncio
import contextvars
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshnode.agent import Agent, AgentSettings, Context, NotReady, Refusal, offering
from meshnode.plugins import hookimpl


class CrashOnStart(Agent):
    """Fails in on_start: the node must host the others and report this one."""

    description = "always fails to start"

    async def on_start(self, ctx: Context) -> None:
        raise RuntimeError("this agent cannot start")


class HangOnStart(Agent):
    """An on_start that never returns: only this agent may fail (issue #23 item 2)."""

    description = "never finishes starting"

    async def on_start(self, ctx: Context) -> None:
        await asyncio.Event().wait()


class NotReadyYet(Agent):
    """Raises NotReady until it has done so twice and its gate file exists (issue #23 item 2)."""

    description = "starts once its gate file exists"

    class Settings(AgentSettings):
        gate: str

    def __init__(self, name: str, settings: NotReadyYet.Settings) -> None:
        super().__init__(name, settings)
        self.gate = Path(settings.gate)
        self.attempts = 0

    async def on_start(self, ctx: Context) -> None:
        self.attempts += 1
        if self.attempts <= 2 or not self.gate.exists():
            raise NotReady(f"waiting for {self.gate.name} (attempt {self.attempts})", retry_after=0.2)

    @offering("ready")
    async def ready(self, ctx: Context, input: Any) -> Any:
        return {"attempts": self.attempts}


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


class Blocking(Agent):
    """Handlers that misuse the loop (issue #23 items 2, 10): one blocks it, one holds a slot."""

    description = "test agent that blocks the event loop or holds requests"

    #: Shared by every agent of this kind in the process: one agent releases
    #: another's held requests (the held one is at its limit and takes nothing).
    _release: asyncio.Event | None = None

    @classmethod
    def released(cls) -> asyncio.Event:
        if Blocking._release is None:
            Blocking._release = asyncio.Event()
        return Blocking._release

    @offering("block")
    async def block(self, ctx: Context, input: Any) -> Any:
        time.sleep(float(input or 1))  # the bug under test: a blocking call in a handler
        return {"blocked": input}

    @offering("block_until")
    async def block_until(self, ctx: Context, input: Any) -> Any:
        # Blocks the loop until the test creates the file (a deadline bounds a forgotten one).
        path, deadline = Path(input["file"]), time.monotonic() + float(input.get("max_s", 60))
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"released": path.exists()}

    #: Tasks the spawn offering left waiting, until spawned_release.
    _spawned_release: asyncio.Event | None = None

    @offering("spawn")
    async def spawn(self, ctx: Context, input: Any) -> Any:
        # Per-request work left running (issue #23 item 10): N tasks, each with a child of its own.
        if Blocking._spawned_release is None:
            Blocking._spawned_release = asyncio.Event()
        release = Blocking._spawned_release

        async def child() -> None:
            await release.wait()

        async def worker() -> None:
            grandchild = asyncio.create_task(child())
            await release.wait()
            await grandchild

        for _ in range(int(input)):
            asyncio.create_task(worker())  # noqa: RUF006 - the misuse under test
        return {"spawned": int(input)}

    @offering("spawned_release")
    async def spawned_release(self, ctx: Context, input: Any) -> Any:
        if Blocking._spawned_release is not None:
            Blocking._spawned_release.set()
            Blocking._spawned_release = None
        return {"released": True}

    @offering("keep")
    async def keep(self, ctx: Context, input: Any) -> Any:
        # A leaking handler (issue #23 item 10): 64 KiB kept per call for the agent's life.
        kept: list[bytearray] = self.__dict__.setdefault("kept", [])
        kept.append(bytearray(64 * 1024))
        return {"kept": len(kept)}

    @offering("hold")
    async def hold(self, ctx: Context, input: Any) -> Any:
        await self.released().wait()
        return {"held": input}

    @offering("release")
    async def release_held(self, ctx: Context, input: Any) -> Any:
        self.released().set()
        return {"released": True}


class TierProbe(Agent):
    """Says what it knows of the sender's node standing (§9.7)."""

    description = "reports the sender's attested node tier"

    @offering("tier")
    async def tier(self, ctx: Context, input: Any) -> Any:
        return {"sender_tier": ctx.sender_trust_tier}


class Picky(TierProbe):
    """Takes no work from agents on sandbox nodes."""

    description = "refuses sandbox senders"
    refuse_sandbox_senders = True


class Quitter(Agent):
    """Calls ``sys.exit`` (a plugin author's mistake): in its handler, in
    ``on_event`` (``quit.*`` events), in ``on_stop`` (``on_stop``), in
    ``on_start`` (``on_start``), in a task of its own (``in_background``), each
    that call's failure only; or in a task made in a context of its own
    (``untracked``), which the node cannot tell from its own and which ends
    the daemon's event loop: the daemon must exit, not hang."""

    description = "exits the process"
    accepts = ("quit.*",)

    class Settings(AgentSettings):
        on_start: bool = False
        on_stop: bool = False
        in_background: bool = False
        untracked: bool = False

    async def on_start(self, ctx: Context) -> None:
        settings = self.settings
        assert isinstance(settings, Quitter.Settings)
        if settings.on_start:
            sys.exit(4)
        loop = asyncio.get_running_loop()
        if settings.in_background:
            self._quitting = loop.create_task(self._quit_soon(5))
        if settings.untracked:
            self._quitting = loop.create_task(self._quit_soon(8), context=contextvars.Context())

    async def _quit_soon(self, status: int) -> None:
        sys.exit(status)  # runs once on_start has returned: the task's first step comes after

    async def on_event(self, ctx: Context, event: Any) -> None:
        sys.exit(6)

    async def on_stop(self) -> None:
        settings = self.settings
        assert isinstance(settings, Quitter.Settings)
        if settings.on_stop:
            sys.exit(7)

    @offering("quit", framing=False)
    async def quit(self, ctx: Context, input: Any) -> Any:
        sys.exit(3)


class TestAgents:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-crash-on-start", CrashOnStart)
        register("test-hang-on-start", HangOnStart)
        register("test-faulty", Faulty)
        register("test-not-ready", NotReadyYet)
        register("test-blocking", Blocking)
        register("test-presence-watch", PresenceWatch)
        register("test-tier", TierProbe)
        register("test-picky", Picky)
        register("test-quitter", Quitter)


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


class PresenceWatch(Listener):
    """Records presence's node_online/node_offline events (a stall must not cause an offline)."""

    description = "records presence.* events"
    accepts = ("presence.*",)


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

    @offering("drip", streaming=True, framing=False)
    async def drip(self, ctx: Context, input: Any) -> Any:
        """A slow stream that records each run of its handler (fsynced) in the
        file its input names, so a test can count runs across a crash."""
        import os

        fd = os.open(str(input["runs"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (ctx.envelope["id"] + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        for i in range(int(input.get("n", 100))):
            await asyncio.sleep(float(input.get("pause", 0.05)))
            yield f"{i} "

    @offering("gated", streaming=True, framing=False)
    async def gated(self, ctx: Context, input: Any) -> Any:
        """One chunk, then the rest only once the file its input names exists:
        a test sees the first chunk while the stream is still open."""
        import os

        yield "first "
        while not os.path.exists(str(input["gate"])):
            await asyncio.sleep(0.02)
        yield "last"

    @offering("gated_task")
    async def gated_task(self, ctx: Context, input: Any) -> Any:
        """A Task that reports progress, then completes only once the file its
        input names exists: a test sees the progress while the task still runs."""
        import os

        task = await ctx.defer("working", "starting")
        await task.progress("waiting for the gate")
        while not os.path.exists(str(input["gate"])):
            await asyncio.sleep(0.02)
        return {"opened": True}

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
        from meshnode.node.context import AgentContext
        from meshnode.protocol import subjects
        from meshnode.protocol.envelope import build_envelope, encode_envelope, sign_envelope
        from meshnode.protocol.nkeys import KeyPair

        assert isinstance(ctx, AgentContext)  # the daemon's context, whose hosted agent this test reaches into
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
            # A stranger's chunk, then one claiming the producer's id with a
            # signature that does not verify, then the producer's honest end:
            # the requester drops both and the stream completes.
            stranger = KeyPair.generate()
            env = build_envelope("respond", stranger.public_key, now_ms=node.now_ms(), task_id=task.task_id,
                                 payload={"status": "working", "chunk_index": 1, "final": False, "data": "evil"})
            sign_envelope(env, stranger)
            await node.connection.publish(subjects.task_stream(task.task_id), encode_envelope(env))
            env = build_envelope("respond", stranger.public_key, now_ms=node.now_ms(), task_id=task.task_id,
                                 payload={"status": "completed", "chunk_index": 1, "final": True, "chunk_count": 2,
                                          "data": "evil"})
            sign_envelope(env, stranger)
            env["from"] = hosted.agent_id
            await node.connection.publish(subjects.task_stream(task.task_id), encode_envelope(env))
            await node.publish_chunk(hosted, task, 1, None, final=True, sign=True, chunk_count=2)

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
        if input.get("report_task"):  # the task id, for a test that looks for its consumers
            return {"chunks": chunks, "task_id": reply.task.task_id}
        return {"chunks": chunks}


class StreamsPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-streams", Streams)


streams_plugin = StreamsPlugin()


# -- events, feeds and observability (issue 11) ------------------------------------


class Feeder(Agent):
    """Publishes and reads feeds, subscribes on demand, and misbehaves on request.

    The misbehaving offerings reach the node's connection directly (test-only):
    a real agent cannot publish raw bytes or on another agent's feed.
    """

    description = "feeds and events under test"
    feeds = {"status": "state", "changes": "stream"}

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.seen: list[dict[str, Any]] = []

    def _node(self, ctx: Context) -> Any:
        return ctx._hosted.node  # type: ignore[attr-defined]

    async def on_event(self, ctx: Context, event: Any) -> None:
        self.seen.append({
            "subject": event.subject, "sender": event.sender, "data": event.data, "topic": event.topic,
            "kind": event.kind, "domain": event.domain, "id": event.envelope["id"],
        })

    @offering("seen")
    async def seen_events(self, ctx: Context, input: Any) -> Any:
        return self.seen

    @offering("publish")
    async def publish(self, ctx: Context, input: Any) -> Any:
        msg_id = await ctx.publish_feed(input["topic"], input.get("data"), kind=input.get("kind"))
        return {"id": msg_id}

    @offering("subscribe_feed")
    async def subscribe_feed(self, ctx: Context, input: Any) -> Any:
        return await ctx.subscribe_feed(
            input["owner"], input.get("topic", "*"), durable=input.get("durable", True),
            replay=input.get("replay", False),
        )

    @offering("read_state")
    async def read_state(self, ctx: Context, input: Any) -> Any:
        event = await ctx.read_feed_state(input["owner"], input["topic"])
        if event is None:
            return {"found": False}
        return {"found": True, "data": event.data, "id": event.envelope["id"], "kind": event.kind}

    @offering("subscribe")
    async def subscribe(self, ctx: Context, input: Any) -> Any:
        return await ctx.subscribe(input["pattern"], durable=input.get("durable", True), replay=input.get("replay", False))

    @offering("emit")
    async def emit(self, ctx: Context, input: Any) -> Any:
        await ctx.emit(input.get("domain", "demo"), input.get("event_type", "tick"), input.get("data"))
        return {"emitted": True}

    @offering("emit_many")
    async def emit_many(self, ctx: Context, input: Any) -> Any:
        for n in range(int(input["n"])):
            try:
                await ctx.emit(input.get("domain", "burst"), "tick", {"n": n})
            except Refusal as exc:  # pragma: no cover - RATE_LIMITED is a ProtocolError
                return {"sent": n, "code": exc.code}
            except Exception as exc:
                return {"sent": n, "code": getattr(exc, "code", type(exc).__name__),
                        "retry_after_ms": getattr(exc, "retry_after_ms", None)}
        return {"sent": int(input["n"]), "code": None}

    @offering("publish_twice")
    async def publish_twice(self, ctx: Context, input: Any) -> Any:
        """One signed emit published twice: with the same Nats-Msg-Id through
        JetStream (``same_id``), or under two message ids (only the subscriber's
        duplicate memory can catch that)."""
        from meshnode.protocol.envelope import build_envelope, encode_envelope, sign_envelope

        node = self._node(ctx)
        hosted = ctx._hosted  # type: ignore[attr-defined]
        domain, event_type = input.get("domain", "demo"), input.get("event_type", "tick")
        env = build_envelope("emit", ctx.agent_id, now_ms=node.now_ms(), ids=node.ids,
                             payload={"domain": domain, "event_type": event_type, "data": input.get("data")})
        sign_envelope(env, hosted.key)
        raw = encode_envelope(env)
        subject = f"mesh.event.{domain}.{event_type}"
        if input.get("same_id", True):
            acks = [await node.connection.jetstream.publish(subject, raw, headers={"Nats-Msg-Id": env["id"]})
                    for _ in range(2)]
            return {"id": env["id"], "duplicate": [bool(a.duplicate) for a in acks], "seq": [a.seq for a in acks]}
        for suffix in ("", "-again"):
            await node.connection.jetstream.publish(subject, raw, headers={"Nats-Msg-Id": env["id"] + suffix})
        return {"id": env["id"]}

    @offering("publish_on")
    async def publish_on(self, ctx: Context, input: Any) -> Any:
        """A feed envelope signed by this agent, published on ``owner``'s feed subject."""
        from meshnode.protocol.envelope import encode_envelope, sign_envelope
        from meshnode.protocol.feeds import feed_envelope

        node = self._node(ctx)
        hosted = ctx._hosted  # type: ignore[attr-defined]
        env = feed_envelope(ctx.agent_id, input["topic"], input.get("kind", "state"), input.get("data"),
                            now_ms=node.now_ms(), ids=node.ids)
        sign_envelope(env, hosted.key)
        await node.connection.publish(f"mesh.feed.{input['owner']}.{input['topic']}", encode_envelope(env))
        await node.connection.flush()
        return {"id": env["id"]}

    @offering("log")
    async def log_line(self, ctx: Context, input: Any) -> Any:
        self.log.warning("a warning for the mesh log: %s", input.get("note", ""))
        return {"trace_id": ctx.trace.get("trace_id"), "span_id": ctx.trace.get("span_id")}


class FeederPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-feeder", Feeder)


feeder_plugin = FeederPlugin()


class Artifacts(Agent):
    """Puts, fetches, tampers with and derives from artifacts (§7.5); returns big outputs."""

    description = "exercises the artifact store"

    @offering("make", framing=False)
    async def make(self, ctx: Context, input: Any) -> Any:
        """``{size, seed, name?, retention_s?}`` → ``{part}``: deterministic bytes, stored."""
        import random

        data = random.Random(input.get("seed", 0)).randbytes(int(input["size"]))
        part = await ctx.put_artifact(data, name=input.get("name", "blob.bin"),
                                      media_type="application/octet-stream",
                                      retention_s=input.get("retention_s"))
        return {"part": part}

    @offering("fetch", framing=False)
    async def fetch(self, ctx: Context, input: Any) -> Any:
        """``{part | ref, max_bytes?}`` → ``{size, digest}`` of the verified bytes."""
        from meshnode.protocol.rests_on import digest_of

        data = await ctx.fetch_artifact(input.get("part") or input["ref"], max_bytes=input.get("max_bytes"))
        return {"size": len(data), "digest": digest_of(data)}

    @offering("stat", framing=False)
    async def stat(self, ctx: Context, input: Any) -> Any:
        return await ctx.stat_artifact(input["ref"])

    @offering("big", framing=False)
    async def big(self, ctx: Context, input: Any) -> Any:
        """An output larger than one message: ``{"text": "x" * chars}``."""
        return {"text": "x" * int(input["chars"])}

    @offering("files", framing=False)
    async def files(self, ctx: Context, input: Any) -> Any:
        """What the request attached, as the handler sees it (nothing fetched)."""
        return {"files": [dict(f.declared) for f in ctx.files],
                "resources": [dict(r.declared) for r in ctx.resources],
                "uris": [f.uri for f in ctx.files if not f.is_ref]}

    @offering("send_files", framing=False)
    async def send_files(self, ctx: Context, input: Any) -> Any:
        """``{target, files?, resources?}``: ask ``target``'s ``files`` offering with attachments."""
        reply = await ctx.request(input["target"], "files", {}, files=input.get("files"),
                                  resources=input.get("resources"))
        return reply.output

    @offering("tamper", framing=False)
    async def tamper(self, ctx: Context, input: Any) -> Any:
        """``{ref}``: flip one byte of the stored object, straight in the object store.

        Only on the node that runs the store (its connection administers JetStream).
        """
        import orjson

        from meshnode.protocol.artifacts import object_id_of

        js = ctx._hosted.node.connection.jetstream.native  # type: ignore[attr-defined]
        index = await js.key_value("mesh_artifacts_index")
        record = orjson.loads((await index.get(object_id_of(input["ref"]))).value)
        store = await js.object_store("mesh_artifacts")
        data = bytearray((await store.get(record["key"])).data)
        data[len(data) // 2] ^= 0xFF
        await store.put(record["key"], bytes(data))
        return {"tampered": record["key"], "size": len(data)}

    @offering("derive", framing=False)
    async def derive(self, ctx: Context, input: Any) -> Any:
        """``{part}``: a report computed from an input file, declaring what it rests on (§5.6)."""
        from meshnode.protocol.rests_on import entry_for

        data = await ctx.fetch_artifact(input["part"])
        report = await ctx.put_artifact(f"{len(data)} bytes".encode(), name="report.txt", media_type="text/plain")
        artifact = ctx.add_artifact([report], name="report", media_type="text/plain",
                                    rests_on=[entry_for(input["part"], role="input")])
        return {"artifact": artifact["id"]}

    @offering("verify", framing=False)
    async def verify(self, ctx: Context, input: Any) -> Any:
        """``{rests_on, countersigned?}`` → the §5.6 verdict."""
        verdict = await ctx.verify_rests_on(input.get("rests_on"), countersigned=bool(input.get("countersigned")))
        return verdict.as_dict()


class ArtifactsPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-artifacts", Artifacts)


artifacts_plugin = ArtifactsPlugin()


class Limited(Agent):
    """Publishes a rate limit; callers on meshnode keep to it without being told."""

    description = "two requests per second"
    rate_limits = {"requests_per_second": 2}

    @offering("ping", framing=False)
    async def ping(self, ctx: Context, input: Any) -> Any:
        return {"pong": input}

    @offering("burst", framing=False)
    async def burst(self, ctx: Context, input: Any) -> Any:
        import time as _time

        started = _time.monotonic()
        for i in range(int(input["n"])):
            await ctx.request(input["target"], "ping", i)
        return {"seconds": _time.monotonic() - started}


class LimitedPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-limited", Limited)


limited_plugin = LimitedPlugin()


class Collector(Agent):
    """An ordinary observer: records every span, log and metrics event it can read."""

    description = "records mesh.trace/log/metrics events"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.seen: list[dict[str, Any]] = []

    async def on_start(self, ctx: Context) -> None:
        for kind in ("trace", "log", "metrics"):
            await ctx.observe(kind)

    async def on_event(self, ctx: Context, event: Any) -> None:
        self.seen.append({"subject": event.subject, "sender": event.sender, "domain": event.domain,
                          "event_type": event.event_type, "data": event.data, "envelope": dict(event.envelope)})

    @offering("seen")
    async def seen_events(self, ctx: Context, input: Any) -> Any:
        kinds = (input or {}).get("subject_prefix", "mesh.")
        return [e for e in self.seen if e["subject"].startswith(kinds)]


class CollectorPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-collector", Collector)


collector_plugin = CollectorPlugin()


class Unfurnished(Agent):
    """Declares a need, then fails for want of it (§10.8, §10.8a)."""

    description = "needs a repository"

    @offering("fix", needs=[{"resource": "git", "access": "read-write"}])
    async def fix(self, ctx: Context, input: Any) -> Any:
        task = await ctx.defer("working")
        await task.fail("needs_not_furnished", note="no repository was granted", unmet_need="resource:git")


class UnfurnishedPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-unfurnished", Unfurnished)


unfurnished_plugin = UnfurnishedPlugin()


class A2ATarget(Agent):
    """What the A2A bridge tests call: priced admission and a reported cost,
    a stream, a failure with facts that must not leave, and slow work to cancel."""

    description = "an agent behind the A2A bridge"
    public = {
        "description": "Bridge test target.",
        "access": {
            "admission": "open",
            "schemes": [
                {"id": "mesh", "transport": "mesh", "type": "mesh-identity"},
                {"id": "bearer", "transport": "http", "type": "http", "scheme": "bearer"},
            ],
        },
    }

    async def admit(self, ctx: Context, offering: str, input: Any, budget: Any) -> None:
        from meshnode.protocol.budget import Money

        ceiling = budget.cost_ceiling if budget is not None else None
        if offering == "priced" and ceiling is not None and ceiling.amount_micro < 1000:
            raise Refusal("BUDGET_INSUFFICIENT", "this costs at least 1000 micro-USD",
                          {"estimate": Money(1000, "USD").to_object()})

    @offering("priced", input_schema={"type": "object", "properties": {"text": {"type": "string"}}},
              framing=False)
    async def priced(self, ctx: Context, input: Any) -> Any:
        from meshnode.protocol.budget import Money

        task = await ctx.defer("working")
        await task.progress("metering", cost=Money(250, "USD"))
        meta = ctx.envelope.get("meta") or {}
        return {"priced": (input or {}).get("text"), "meta": meta, "trace_id": ctx.trace.get("trace_id")}

    @offering("words", streaming=True, framing=False)
    async def words(self, ctx: Context, input: Any) -> Any:
        for word in str(input or "").split():
            await asyncio.sleep(0)
            yield word + " "

    @offering("broken-stream", streaming=True, framing=False)
    async def broken_stream(self, ctx: Context, input: Any) -> Any:
        yield "first "
        raise Refusal("STREAM_BROKE", "internal detail: the pipe burst")

    @offering("ask", framing=False)
    async def ask(self, ctx: Context, input: Any) -> Any:
        task = await ctx.defer("working")
        await task.require_input([{"input": "repo", "problem": "missing", "description": "which repository?"}])
        await asyncio.sleep(60)
        return None

    @offering("secret-fail", framing=False)
    async def secret_fail(self, ctx: Context, input: Any) -> Any:
        raise Refusal("QUOTA_HIT", "internal detail: zebra-17 is over quota", {"who": "zebra-17"})

    @offering("slow", framing=False)
    async def slow(self, ctx: Context, input: Any) -> Any:
        task = await ctx.defer("working")
        for _ in range(300):
            await asyncio.sleep(0.1)
        await task.progress("done")
        return "finished"


class A2ATargetPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-a2a", A2ATarget)


a2a_target_plugin = A2ATargetPlugin()


class Asker(Agent):
    """Input and auth rounds (§6.5, §7.3): pauses, and resumes with the follow-up."""

    description = "asks its caller for more"

    NAME_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}

    @offering("ask", framing=False)
    async def ask(self, ctx: Context, input: Any) -> Any:
        task = await ctx.defer("working")
        wait = float((input or {}).get("wait", 60))
        answer = await task.ask_input(
            [{"input": "name", "problem": "missing", "description": "whom shall I greet?"}],
            "who?", schema=self.NAME_SCHEMA, timeout=wait,
        )
        return {"hello": answer["name"], "rounds": 1}

    @offering("login", framing=False)
    async def login(self, ctx: Context, input: Any) -> Any:
        task = await ctx.defer("working")
        creds = await task.ask_auth("sign in, please", timeout=60)
        return {"user": (creds or {}).get("user")}

    @offering("converse", framing=False)
    async def converse(self, ctx: Context, input: Any) -> Any:
        """The requester's side as an agent: open a task on ``target``, answer its
        round with ``reply.task.provide_input``, and wait for the result."""
        reply = await ctx.request(input["target"], "ask", {})
        task = reply.task
        paused = await task.result(timeout=30, until_paused=True)
        asked = (paused.get("payload") or {}).get("problems")
        resumed = await task.provide_input({"name": input.get("name", "Ada")})
        final = await task.result(timeout=30)
        return {"paused": (paused.get("payload") or {}).get("status"), "problems": asked,
                "resumed": resumed.status, "final": (final.get("payload") or {}).get("status"),
                "output": (final.get("payload") or {}).get("output"), "task_id": task.task_id}

    @offering("butt-in", framing=False)
    async def butt_in(self, ctx: Context, input: Any) -> Any:
        """A stranger's follow-up to someone else's task: the refusal's code."""
        from meshnode.agent import RemoteError

        try:
            await ctx.request(input["target"], "ask", {"name": "Mallory"}, task_id=input["task_id"])
        except RemoteError as exc:
            return {"refused": exc.code}
        return {"refused": None}


class AskerPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-asker", Asker)


asker_plugin = AskerPlugin()


class Tally(Agent):
    """Echo that counts its own runs: appends ``<request id> <tag>`` to a file
    before it answers (the crash test's witness that a handler ran at most once
    per request, issue #23 item 1). A plain ``write()`` survives a SIGKILL (it
    is in the OS's hands); no fsync, so the handler does not block the loop the
    way a real echo does not."""

    description = "an echo that records every run of its handler"
    Settings = JournalSettings

    @offering("work", framing=False)
    async def work(self, ctx: Context, input: Any) -> Any:
        import os

        settings = self.settings
        assert isinstance(settings, JournalSettings)
        tag = str((input or {}).get("tag", ""))
        fd = os.open(settings.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{ctx.envelope['id']} {tag}\n".encode())
        finally:
            os.close(fd)
        return {"tag": tag}


class TallyPlugin:
    @hookimpl
    def meshnode_register_agents(self, register: Callable[[str, type[Agent]], None]) -> None:
        register("test-tally", Tally)


tally_plugin = TallyPlugin()

