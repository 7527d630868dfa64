"""The tasks A2A callers open on the inbound bridge: created (or found again by
idempotency), executed as mesh requests by the bridge identity, followed and
mirrored as A2A tasks, answered when paused, cancelled, and ended with a
signed run report for a trusted caller."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import nacl.signing
from a2a.types.a2a_pb2 import Message, SendMessageRequest
from a2a.utils.errors import (
    InvalidParamsError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from google.protobuf.json_format import MessageToDict

from meshnode.a2a.inbound import (
    ANONYMOUS,
    BridgeNode,
    BridgeSettings,
    Inbound,
    caller_of,
    dedup_caller,
    may_see,
)
from meshnode.a2a.mapping import (
    FAILED_STATES,
    INTERRUPTED_A2A,
    TERMINAL_A2A,
    PartsRefused,
    chunk_part,
    coded_message,
    input_from_parts,
    output_artifact,
    select_offering,
    state_of,
)
from meshnode.a2a.store import BridgeStore
from meshnode.agent import RemoteError, RequestTimeout
from meshnode.aio import cancel_and_wait, wait_for
from meshnode.protocol.a2a_extension import (
    EXTENSION_URI,
    body_hash,
    check_chain,
    extend_chain,
    format_usd,
    sign_report,
)
from meshnode.protocol.envelope import child_trace, new_root_trace, trace_from_traceparent
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.nkeys import decode_seed
from meshnode.protocol.timeutil import format_ts

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent

__all__ = ["INTERRUPTED", "InboundTasks", "Live"]

log = logging.getLogger("meshnode.a2a")

#: The code of a task that was running when the daemon stopped.
INTERRUPTED = "INTERRUPTED"


def _now_iso() -> str:
    return format_ts(time.time_ns() // 1_000_000)


def _history_entry(message: Mapping[str, Any], task_id: str, context_id: str) -> dict[str, Any]:
    """A caller's message as the task's ``history`` keeps it: as received, named
    by the task, without the extension's envelope (a credential, not content)."""
    entry = {k: v for k, v in message.items() if k != "metadata"}
    meta = message.get("metadata")
    if isinstance(meta, Mapping):
        rest = {k: v for k, v in meta.items() if k != EXTENSION_URI}
        if rest:
            entry["metadata"] = rest
    entry["taskId"], entry["contextId"] = task_id, context_id
    return entry


def _parts_of(inbound: Inbound, msg: Message) -> list[dict[str, Any]]:
    """A message's parts as received: the raw JSON keeps numbers as sent (the
    SDK's Struct makes every number a float); what the SDK parsed otherwise."""
    raw_parts = inbound.message.get("parts")
    if isinstance(raw_parts, list) and all(isinstance(p, dict) for p in raw_parts):
        return raw_parts
    return [MessageToDict(p) for p in msg.parts]


@dataclass
class Live:
    """A task this process is executing: its current A2A object and listeners."""

    task: dict[str, Any]
    agent: str
    caller: str
    subscribers: list[asyncio.Queue[dict[str, Any] | None]] = field(default_factory=list)
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    runner: asyncio.Task[None] | None = None
    mesh_task: Any = None
    cancel_requested: bool = False
    cost_micro: int | None = None
    answering: bool = False  # a caller's answer to a paused task is being forwarded

    def publish(self, event: dict[str, Any] | None) -> None:
        for queue in list(self.subscribers):
            queue.put_nowait(event)


class InboundTasks:
    """The inbound bridge's tasks: the live ones of this process (``live``) and
    the stored ones (:class:`BridgeStore`, across restarts)."""

    def __init__(
        self, *, node: BridgeNode, bridge: HostedAgent, settings: BridgeSettings, store: BridgeStore
    ) -> None:
        self.node = node
        self.bridge = bridge
        self.settings = settings
        self.store = store
        self.live: dict[str, Live] = {}
        # Lookup-then-create of the idempotency row is one step: two concurrent
        # sends of the same message must not start two tasks.
        self._submit_lock = asyncio.Lock()
        self._signing_key = nacl.signing.SigningKey(decode_seed(bridge.key.seed)[1])

    def _now_ms(self) -> int:
        return self.node.now_ms()

    def hosted(self, name: str) -> HostedAgent | None:
        """The exposed, running hosted agent ``name``, or None."""
        if name not in self.settings.expose:
            return None
        hosted = self.node.agents.get(name)
        return hosted if hosted is not None and hosted.state == "running" else None

    async def recover(self) -> None:
        """At start: fail what the previous process left running, sweep what
        the retention window has passed."""
        now_ms = self._now_ms()
        for task in await self.store.unfinished():
            # Its runner died with the previous process: nothing follows it now.
            self._fail(task, INTERRUPTED)
            await self.store.update(task, now_ms=now_ms, terminal=True)
        retention_ms = int(self.settings.idempotency_retention_s * 1000)
        await self.store.sweep(
            idempotency_before_ms=now_ms - retention_ms, tasks_before_ms=now_ms - 2 * retention_ms
        )

    async def stop(self) -> None:
        """Stop the runners of live tasks (each records itself INTERRUPTED)."""
        for live in list(self.live.values()):
            if live.runner is not None and not live.runner.done():
                live.runner.cancel()
        runners = [lv.runner for lv in self.live.values() if lv.runner is not None]
        if runners:
            await asyncio.wait(runners, timeout=1.0)

    def _fail(self, task: dict[str, Any], code: str) -> None:
        task["status"] = {
            "state": "TASK_STATE_FAILED",
            "message": coded_message(code, task_id=task["id"], context_id=task["contextId"]),
            "timestamp": _now_iso(),
        }

    async def list_tasks(self, agent: str, requester: str) -> list[dict[str, Any]]:
        """``requester``'s own tasks on ``agent``, the newest first: a trusted
        caller's alone. An anonymous requester lists nothing — anonymous tasks
        are anyone's who holds the id, and listing them would hand the ids out."""
        if requester == ANONYMOUS:
            return []
        found = await self.store.owned(agent=agent, caller=requester)
        return [self.live[t["id"]].task if t["id"] in self.live else t for t in found]

    async def get_task(self, agent: str, task_id: str, requester: str = ANONYMOUS) -> dict[str, Any]:
        """The task as it stands; TaskNotFound when it is unknown, another
        agent's or not ``requester``'s to see (the three answer alike, so a
        task's existence does not leak)."""
        live = self.live.get(task_id)
        if live is not None and live.agent == agent:
            if not may_see(live.caller, requester):
                raise TaskNotFoundError
            return live.task
        found = await self.store.get(task_id)
        if found is None or found.agent != agent or not may_see(found.caller, requester):
            raise TaskNotFoundError
        return found.task

    async def submit(
        self, agent: str, params: SendMessageRequest, inbound: Inbound | None, *, streaming: bool
    ) -> tuple[Live | None, dict[str, Any]]:
        """Create (or find again) the task of a SendMessage. Returns the live
        execution when one runs in this process, and the task as it stands."""
        hosted = self.hosted(agent)
        if hosted is None:
            raise TaskNotFoundError(message="no such agent")
        msg = params.message
        if inbound is None:
            # Not a JSON-RPC body we could read ourselves (the SDK did): hash what it parsed.
            as_dict = MessageToDict(msg)
            inbound = Inbound(activated=False, message=as_dict, body_hash=body_hash(as_dict))
        if not msg.message_id:
            raise InvalidParamsError(message="message.messageId is required")
        if msg.task_id:
            return await self._answer_paused(agent, hosted, params, inbound)
        async with self._submit_lock:
            return await self._submit(agent, hosted, params, inbound, streaming=streaming)

    async def _submit(
        self,
        agent: str,
        hosted: HostedAgent,
        params: SendMessageRequest,
        inbound: Inbound,
        *,
        streaming: bool,
    ) -> tuple[Live | None, dict[str, Any]]:
        msg = params.message
        caller = caller_of(inbound)
        dedup_key = dedup_caller(caller, inbound)
        now_ms = self._now_ms()
        retention_ms = int(self.settings.idempotency_retention_s * 1000)
        seen = await self.store.remembered(
            agent=agent, caller=dedup_key, message_id=msg.message_id, not_before_ms=now_ms - retention_ms
        )
        if seen is not None:
            if seen.body_hash != inbound.body_hash:
                raise InvalidParamsError(message="this messageId was already used for another message")
            live = self.live.get(seen.task_id)
            if live is not None:
                return live, live.task
            found = await self.store.get(seen.task_id)
            if found is not None:
                return None, found.task
        metadata = inbound.message.get("metadata")
        advertised = [s.id for s in hosted.offerings.values() if s.advertise]
        try:
            offering = select_offering(
                hosted.offerings, advertised, metadata if isinstance(metadata, dict) else None
            )
            handler_input = input_from_parts(_parts_of(inbound, msg), hosted.offerings[offering].input_schema)
        except PartsRefused as exc:
            raise InvalidParamsError(message=str(exc)) from None
        task_id = str(uuid.uuid4())
        context_id = msg.context_id or str(uuid.uuid4())
        task: dict[str, Any] = {
            "id": task_id,
            "contextId": context_id,
            "status": {"state": "TASK_STATE_SUBMITTED", "timestamp": _now_iso()},
            "history": [_history_entry(inbound.message, task_id, context_id)],
        }
        check = inbound.check
        if check is not None:
            refusal = check_chain(
                check.call_chain,
                application=self.settings.application,
                skill=offering,
                max_hops=self.settings.max_mesh_hops,
            )
            if refusal is not None:
                task["status"] = {
                    "state": "TASK_STATE_REJECTED",
                    "message": coded_message(
                        refusal.code, task_id=task_id, context_id=context_id, details=refusal.details
                    ),
                    "timestamp": _now_iso(),
                }
                await self.store.create(
                    task, agent=agent, caller=caller, message_id=msg.message_id,
                    body_hash=inbound.body_hash, now_ms=now_ms, dedup_caller=dedup_key, terminal=True,
                )
                return None, task
        await self.store.create(
            task, agent=agent, caller=caller, message_id=msg.message_id,
            body_hash=inbound.body_hash, now_ms=now_ms, dedup_caller=dedup_key,
        )
        live = Live(task=task, agent=agent, caller=caller)
        self.live[task_id] = live
        config: dict[str, Any] = {}
        if streaming and hosted.offerings[offering].streaming:
            config["stream"] = True
        if params.configuration.accepted_output_modes:
            # The agent's own content-type admission judges them (§8.5).
            config["accepted_output"] = list(params.configuration.accepted_output_modes)
        live.runner = asyncio.get_running_loop().create_task(
            self._execute(live, hosted, offering, handler_input, inbound, config),
            name=f"a2a:{task_id}",
        )
        return live, task

    async def _answer_paused(
        self, agent: str, hosted: HostedAgent, params: SendMessageRequest, inbound: Inbound
    ) -> tuple[Live, dict[str, Any]]:
        """A message naming ``taskId``: the caller's answer to its task paused in
        INPUT_REQUIRED / AUTH_REQUIRED, forwarded to the agent as the mesh
        follow-up (§6.5: same task_id) by the bridge identity that opened it.
        The runner already following the task carries on with its updates.

        Only the task's caller may answer (the ownership rule of GetTask:
        anyone else, and an unknown task, get TaskNotFound); a ``contextId``
        must be the task's (InvalidParams); a task not paused, or ended, takes
        no message (UnsupportedOperation). Input the agent refuses
        (INPUT_INVALID) is InvalidParams and the task stays paused."""
        msg = params.message
        caller = caller_of(inbound)
        live = self.live.get(msg.task_id)
        if live is None or live.agent != agent or not may_see(live.caller, caller):
            ended = await self.get_task(agent, msg.task_id, caller)  # TaskNotFound: unknown or not theirs
            raise UnsupportedOperationError(
                message=f"the task is {ended['status'].get('state')}: it takes no further message"
            )
        task = live.task
        if msg.context_id and msg.context_id != task["contextId"]:
            raise InvalidParamsError(message="message.contextId is not the task's contextId")
        state = task["status"].get("state")
        mesh_task = live.mesh_task
        if state not in INTERRUPTED_A2A or mesh_task is None or live.answering:
            raise UnsupportedOperationError(message=f"the task is {state}, not waiting for input")
        # The round's own schema (the agent is hosted here) decides how text parts map.
        performing = hosted.tasks.get(mesh_task.task_id)
        schema = performing.round_schema if performing is not None else None
        try:
            answer = input_from_parts(_parts_of(inbound, msg), schema)
        except PartsRefused as exc:
            raise InvalidParamsError(message=str(exc)) from None
        task.setdefault("history", []).append(_history_entry(inbound.message, task["id"], task["contextId"]))
        live.answering = True
        # A blocking send returns at the next pause or the end, not at this one.
        live.settled.clear()
        try:
            await mesh_task.provide_input(answer, timeout=self.settings.send_wait_s)
        except ProtocolError as exc:
            if task["status"].get("state") in INTERRUPTED_A2A or live.done.is_set():
                live.settled.set()
            if exc.code == "INPUT_INVALID":
                raise InvalidParamsError(message="the input does not match what the task asked for") from None
            raise UnsupportedOperationError(message=f"the task did not take the input ({exc.code})") from None
        finally:
            live.answering = False
        if task["status"].get("state") in INTERRUPTED_A2A and not live.done.is_set():
            await self._status(live, "working")
        return live, task

    # -- execution ---------------------------------------------------------------

    async def _execute(
        self,
        live: Live,
        hosted: HostedAgent,
        offering: str,
        handler_input: Any,
        inbound: Inbound,
        config: dict[str, Any],
    ) -> None:
        task = live.task
        stream = bool(config.get("stream"))
        task_id = task["id"]
        check = inbound.check
        trusted = check is not None and check.trusted
        timeout = self.settings.task_timeout_s
        budget: dict[str, Any] | None = None
        if trusted and check is not None:
            block: dict[str, Any] = {"revision": 0}
            if check.budget is not None:
                micro = int((check.budget.remaining * 1_000_000).to_integral_value())
                block["cost_ceiling"] = {"amount_micro": micro, "currency": "USD"}
            if check.deadline_s is not None:
                block["deadline"] = format_ts(self._now_ms() + int(check.deadline_s * 1000))
                timeout = max(1.0, min(timeout, check.deadline_s))
            if len(block) > 1:
                budget = block
        chain = check.call_chain if check is not None else ()
        origin: dict[str, Any] = (
            dict(check.origin)
            if trusted and check is not None and check.origin is not None
            else {"rootExecutionId": task_id, "executionId": task_id}
        )
        meta = {
            EXTENSION_URI: {
                "callChain": extend_chain(
                    chain, application=self.settings.application, start=offering, execution_id=task_id
                ),
                "origin": origin,
            }
        }
        parent = (
            trace_from_traceparent(inbound.traceparent, inbound.tracestate)
            if inbound.traceparent
            else None
        )
        trace = child_trace(parent) if parent is not None else new_root_trace()
        try:
            try:
                reply = await self.node.send_request(
                    self.bridge,
                    hosted.agent_id,
                    offering,
                    handler_input,
                    trace=trace,
                    timeout=timeout,
                    config=config or None,
                    budget=budget,
                    meta=meta,
                )
            except RemoteError as exc:
                await self._finish(live, "failed", code=exc.code, inbound=inbound)
                return
            except RequestTimeout:
                await self._finish(live, "failed", code="TRANSPORT_TIMEOUT", inbound=inbound)
                return
            except ProtocolError as exc:
                await self._finish(live, "failed", code=exc.code, inbound=inbound)
                return
            self._note_cost(live, reply.envelope)
            if reply.task is None:
                err = reply.error
                code = str(err.get("code")) if err is not None else None
                await self._finish(live, reply.status, output=reply.output, code=code, inbound=inbound)
                return
            mesh_task = reply.task
            live.mesh_task = mesh_task
            await self._status(live, reply.status)
            streamed = False
            chunk_reader: asyncio.Task[None] | None = None
            if stream:

                async def read_chunks() -> None:
                    nonlocal streamed
                    first = True
                    async for chunk in mesh_task.stream(timeout=timeout):
                        streamed = True
                        live.publish(
                            {
                                "artifactUpdate": {
                                    "taskId": task_id,
                                    "contextId": task["contextId"],
                                    "artifact": {
                                        "artifactId": "output",
                                        "name": "output",
                                        "parts": [chunk_part(chunk)],
                                    },
                                    "append": not first,
                                    "lastChunk": False,
                                }
                            }
                        )
                        first = False
                    if not first:
                        # The mesh closes a stream with a data-less final chunk, so the
                        # last data chunk is not known as such when it arrives; holding
                        # each chunk back until the next would delay them all. The
                        # artifact is closed by an empty chunk with lastChunk instead.
                        live.publish(
                            {
                                "artifactUpdate": {
                                    "taskId": task_id,
                                    "contextId": task["contextId"],
                                    "artifact": {"artifactId": "output", "name": "output", "parts": []},
                                    "append": True,
                                    "lastChunk": True,
                                }
                            }
                        )

                # Chunks and state updates are read side by side: a stream that
                # fails midway ends with its failed update, not a chunk timeout.
                chunk_reader = asyncio.get_running_loop().create_task(read_chunks())
            try:
                async for env in mesh_task.updates(timeout=timeout):
                    if env.get("from") != hosted.agent_id:
                        continue
                    self._note_cost(live, env)
                    status = (env.get("payload") or {}).get("status")
                    if isinstance(status, str) and state_of(status) not in TERMINAL_A2A:
                        await self._status(live, status)
                if chunk_reader is not None and mesh_task.state == "completed":
                    # The final chunk is stored before the completed update: drain them.
                    with contextlib.suppress(Exception):
                        await wait_for(asyncio.shield(chunk_reader), timeout=30.0)
            finally:
                if chunk_reader is not None:
                    # Its own error is not ours to raise; a cancellation lost in the
                    # transport (aio.cancel_and_wait) is repeated, or the request hangs.
                    await cancel_and_wait(chunk_reader)
                    if not chunk_reader.cancelled():
                        chunk_reader.exception()  # retrieved, so never logged as unretrieved
            final = mesh_task.last_update
            payload = final.get("payload") if isinstance(final.get("payload"), Mapping) else {}
            err = final.get("error") if isinstance(final.get("error"), Mapping) else None
            await self._finish(
                live,
                str(payload.get("status") or "failed"),
                output=payload.get("output"),
                code=str(err.get("code")) if err is not None else None,
                inbound=inbound,
                streamed=streamed,
            )
        except asyncio.CancelledError:
            if live.cancel_requested:
                await self._finish(live, "canceled", inbound=inbound)
            else:
                self._fail(task, INTERRUPTED)
                with contextlib.suppress(Exception):
                    await self.store.update(task, now_ms=self._now_ms(), terminal=True)
                self._close(live)
            raise
        except TimeoutError:
            await self._finish(live, "failed", code="TRANSPORT_TIMEOUT", inbound=inbound)
        except Exception:
            log.exception("A2A task %s failed in the bridge", task_id)
            await self._finish(live, "failed", code="INTERNAL_ERROR", inbound=inbound)

    def _note_cost(self, live: Live, env: Mapping[str, Any]) -> None:
        """The agent's reported cost (``payload.cost``, §13.5), the spend of the report."""
        payload = env.get("payload")
        cost = payload.get("cost") if isinstance(payload, Mapping) else None
        if isinstance(cost, Mapping) and cost.get("currency") == "USD":
            micro = cost.get("amount_micro")
            if type(micro) is int and micro >= 0:
                live.cost_micro = micro

    async def _status(self, live: Live, mesh_status: str) -> None:
        state = state_of(mesh_status)
        task = live.task
        if task["status"].get("state") == state:
            return
        task["status"] = {"state": state, "timestamp": _now_iso()}
        await self.store.update(task, now_ms=self._now_ms(), terminal=False)
        if state in INTERRUPTED_A2A:
            live.settled.set()
        live.publish(
            {"statusUpdate": {"taskId": task["id"], "contextId": task["contextId"], "status": task["status"]}}
        )

    async def _finish(
        self,
        live: Live,
        mesh_status: str,
        *,
        inbound: Inbound,
        output: Any = None,
        code: str | None = None,
        streamed: bool = False,
    ) -> None:
        task = live.task
        if task["status"].get("state") in TERMINAL_A2A:
            self._close(live)
            return
        if live.cancel_requested and mesh_status != "completed":
            mesh_status = "canceled"
        state = state_of(mesh_status)
        status: dict[str, Any] = {"state": state, "timestamp": _now_iso()}
        if mesh_status in FAILED_STATES:
            # Only the stable code leaves: never the agent's message or details.
            stable = code or ("BUDGET_EXHAUSTED" if mesh_status == "exhausted" else "INTERNAL_ERROR")
            status["message"] = coded_message(stable, task_id=task["id"], context_id=task["contextId"])
        elif mesh_status == "rejected":
            status["message"] = coded_message(
                code or "REJECTED", task_id=task["id"], context_id=task["contextId"]
            )
        task["status"] = status
        if state == "TASK_STATE_COMPLETED":
            artifact = output_artifact(output)
            if artifact is not None:
                task["artifacts"] = [artifact]
            check = inbound.check
            if check is not None and check.trusted:
                spend = Decimal(live.cost_micro or 0).scaleb(-6)
                report = sign_report(
                    issuer=self.settings.application,
                    execution_id=task["id"],
                    spend_total=format_usd(spend),
                    body_hash=inbound.body_hash,
                    issued_at=time.time(),
                    signing_key=self._signing_key,
                )
                task["metadata"] = {EXTENSION_URI: {"report": report}}
        await self.store.update(task, now_ms=self._now_ms(), terminal=True)
        if state == "TASK_STATE_COMPLETED" and not streamed and "artifacts" in task:
            live.publish(
                {
                    "artifactUpdate": {
                        "taskId": task["id"],
                        "contextId": task["contextId"],
                        "artifact": task["artifacts"][0],
                        "append": False,
                        "lastChunk": True,
                    }
                }
            )
        final: dict[str, Any] = {"taskId": task["id"], "contextId": task["contextId"], "status": status}
        if "metadata" in task:
            final["metadata"] = task["metadata"]
        live.publish({"statusUpdate": final})
        self._close(live)

    def _close(self, live: Live) -> None:
        live.settled.set()
        live.done.set()
        live.publish(None)
        self.live.pop(live.task["id"], None)

    async def cancel(self, agent: str, task_id: str, requester: str = ANONYMOUS) -> dict[str, Any]:
        live = self.live.get(task_id)
        if live is None or live.agent != agent or not may_see(live.caller, requester):
            task = await self.get_task(agent, task_id, requester)  # raises TaskNotFound
            raise TaskNotCancelableError(message=f"task is {task['status'].get('state')}")
        live.cancel_requested = True
        if live.mesh_task is not None:
            try:
                await live.mesh_task.cancel("user_requested")
            except ProtocolError as exc:
                log.info("cancel of mesh task for %s: %s", task_id, exc)
            # The agent's canceled update ends the runner by itself; stopping it
            # mid-finish would lose the final status update it publishes.
            with contextlib.suppress(TimeoutError):
                await wait_for(live.done.wait(), timeout=10.0)
        if live.runner is not None and not live.runner.done():
            live.runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await wait_for(asyncio.shield(live.runner), timeout=10.0)
        return live.task
