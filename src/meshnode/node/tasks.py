"""Tasks on the node: the responder's handle, streams, cancellation (§7, §10.5, §10.8, §11).

A request becomes a Task only when its handler defers, streams or pauses
(§7.0). The responder's first task reply goes to the requester's inbox (and is
also published on ``mesh.task.{id}.update`` so the task manager records it);
every later state travels on ``mesh.task.{id}.update`` with ``Nats-Msg-Id`` =
the envelope id (§18.8). Stream chunks travel on ``mesh.task.{id}.stream``:
unsigned by default, the final chunk signed and carrying ``chunk_count``
(§11.6), every chunk signed when the requester asked ``sign_chunks``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from meshnode.agent import FollowUp, InputTimeout, StreamBroken
from meshnode.aio import wait_for
from meshnode.node.allowance import tokens_of_usage
from meshnode.node.consumers import bind_shared, release_shared, request_for
from meshnode.node.pipeline import Intake, Refused, decode_verified
from meshnode.protocol import subjects
from meshnode.protocol.budget import Money, budget_exhausted_error, check_revision
from meshnode.protocol.cancel import CANCEL_REASONS, build_failed_update_payload, propagated_note
from meshnode.protocol.envelope import (
    build_envelope,
    child_trace,
    decode_envelope,
    new_root_trace,
    sign_envelope,
    verify_envelope,
)
from meshnode.protocol.errors import ProtocolError
from meshnode.protocol.offerings import offering_id_of
from meshnode.protocol.tasks import (
    PAUSED_STATES,
    TERMINAL_STATES,
    PausedTask,
    TaskState,
    check_state_update,
)
from meshnode.transport.jetstream import DurableSubscription
from meshnode.transport.messages import Message, Subscription
from meshnode.transport.permissions import JS_STREAM_INFO

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent
    from meshnode.node.port import NodePort

__all__ = ["FollowUp", "InputTimeout", "RequesterTask", "ResponderTask", "StreamBroken", "new_task_id"]

log = logging.getLogger("meshnode.tasks")


def new_task_id() -> str:
    """An unguessable task id that is one subject token (``^[A-Za-z0-9_-]{1,128}$``)."""
    return "t" + os.urandom(16).hex()


@dataclass
class ResponderTask:
    """The handler's side of a Task (implements :class:`meshnode.agent.ResponderTask`).

    Every method sends a signed update; only legal transitions are allowed
    (§7.3). When the handler returns, the node completes the task with its
    return value as ``output``; a raised Refusal fails it.
    """

    hosted: HostedAgent
    request: Mapping[str, Any]
    task_id: str
    state: str = "submitted"
    budget: Any = None
    delegates: list[tuple[str, str]] = field(default_factory=list)  # (agent, task_id) of sub-tasks
    _revision: asyncio.Event = field(default_factory=asyncio.Event)
    # The open input/auth round (§7.3): resolved by the requester's follow-up.
    _round: asyncio.Future[FollowUp] | None = None
    _answered: FollowUp | None = None
    round_schema: Mapping[str, Any] | None = None

    @property
    def requester(self) -> str:
        return str(self.request["from"])

    def paused(self) -> PausedTask:
        """This Task as the follow-up rule judges it (:func:`check_follow_up`)."""
        context_id = self.request.get("context_id")
        return PausedTask(
            task_id=self.task_id,
            requester=self.requester,
            state=self.state,
            context_id=context_id if isinstance(context_id, str) else None,
            offering=offering_id_of(self.request.get("payload")),
        )

    async def _send(
        self,
        state: str,
        *,
        message: str | None = None,
        output: Any = None,
        error: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        first: bool = False,
        artifacts: list[dict[str, Any]] | None = None,
        reply_to: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        # A task is born submitted; the first update may already say working (§10.5).
        check_state_update(self.state, state)  # raises TASK_INVALID_TRANSITION
        payload: dict[str, Any] = {"status": state}
        if message is not None:
            payload["message"] = message
        if output is not None:
            payload["output"] = output
        if extra:
            payload.update(extra)
        budget = None
        if first:
            # The first update founds the task record (§7.1): say which offering it
            # is and carry the request's budget, so the task manager can hold the
            # deadline (§7.7) and receipts can name the offering (§19.2).
            request_payload = self.request.get("payload")
            if isinstance(request_payload, Mapping) and isinstance(request_payload.get("offering"), str):
                payload.setdefault("offering", request_payload["offering"])
            if isinstance(self.request.get("budget"), Mapping):
                budget = self.request["budget"]
        node = self.hosted.node
        # A follow-up's answer replies to the follow-up (``reply_to``), not the opening request.
        answering = reply_to if reply_to is not None else self.request
        env = build_envelope(
            "respond",
            self.hosted.agent_id,
            now_ms=node.now_ms(),
            to=self.requester,
            in_reply_to=answering["id"],
            task_id=self.task_id,
            trace=child_trace(answering.get("trace")),
            context_id=self.request.get("context_id"),
            payload=payload,
            error=error,
            artifacts=artifacts,
            budget=budget,
            ids=node.ids,
        )
        sign_envelope(env, self.hosted.key)
        moved = first or state != self.state
        self.state = state
        journal = node.open_tasks
        if journal is not None and moved:
            # Recorded before the update goes out, so a crash from here on is told
            # to the requester at the next start (meshnode.node.open_tasks).
            journal.moved(self.hosted.agent_id, self.task_id, state, self.request, node.now_ms())
        if first or reply_to is not None:
            # The Task-creating reply, and the answer to a follow-up, go where
            # every direct respond goes (§6.5).
            await node.deliver(self.hosted, env, self.requester)
        await node.publish_task(subjects.task_update(self.task_id), env)
        if journal is not None and state in TERMINAL_STATES:
            journal.ended(self.hosted.agent_id, self.task_id)
        return env

    async def progress(
        self,
        message: str | None = None,
        *,
        usage: list[Mapping[str, Any]] | None = None,
        cost: Money | None = None,
    ) -> None:
        """A ``working`` update; cumulative usage and the cost so far may ride
        along (§13.5; ``payload.cost``, which the task manager records and the
        A2A bridge reports as the run's spend)."""
        extra: dict[str, Any] = {}
        if usage:
            extra["usage"] = list(usage)
        if cost is not None:
            extra["cost"] = cost.to_object()
        await self._send("working", message=message, extra=extra or None)
        allowance = self.hosted.node.allowance
        if usage and allowance is not None:
            # EXT-8: the report's token meters are the agent's spend (cumulative).
            await allowance.report(self.hosted, self.request, self, None,
                                   cumulative_tokens=tokens_of_usage(usage))

    async def require_input(
        self,
        problems: Sequence[Mapping[str, Any]],
        message: str | None = None,
        *,
        schema: Mapping[str, Any] | None = None,
    ) -> None:
        """Pause in ``input_required`` with §6.5 problem reports and return at once.

        The requester's follow-up (a request with this task_id) is then taken
        by :meth:`wait_for_input`; :meth:`ask_input` does both. ``schema``, when
        given, is the JSON Schema the follow-up's input must match: one that
        does not is refused INPUT_INVALID at the door and the Task stays paused.
        """
        self._open_round(schema)
        try:
            await self._send("input_required", message=message, extra={"problems": [dict(p) for p in problems]})
        except BaseException:
            self._close_round()
            raise

    async def require_auth(self, message: str | None = None, *, schema: Mapping[str, Any] | None = None) -> None:
        """Pause in ``auth_required`` and return at once (see :meth:`require_input`)."""
        self._open_round(schema)
        try:
            await self._send("auth_required", message=message)
        except BaseException:
            self._close_round()
            raise

    async def ask_input(
        self,
        problems: Sequence[Mapping[str, Any]],
        message: str | None = None,
        *,
        schema: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Pause in ``input_required`` and return the input of the requester's
        follow-up, the Task ``working`` again (§6.5, §7.3). On ``timeout``
        (seconds; None waits until a cancel) the Task is canceled and
        :class:`InputTimeout` raised."""
        await self.require_input(problems, message, schema=schema)
        return await self.wait_for_input(timeout)

    async def ask_auth(
        self, message: str | None = None, *, schema: Mapping[str, Any] | None = None, timeout: float | None = None
    ) -> Any:
        """Pause in ``auth_required`` and return the requester's follow-up input
        (its credentials), as :meth:`ask_input` does."""
        await self.require_auth(message, schema=schema)
        return await self.wait_for_input(timeout)

    @property
    def follow_up(self) -> FollowUp | None:
        """The latest follow-up taken (its envelope, e.g. for its ``files``)."""
        return self._answered

    async def wait_for_input(self, timeout: float | None = None) -> Any:
        """The input of the follow-up answering the round opened by
        :meth:`require_input`/:meth:`require_auth` (already taken, or awaited).
        On ``timeout`` the Task is canceled (reason ``policy``: the responder's
        wait ended, §10.8) and :class:`InputTimeout` raised."""
        round_ = self._round
        if round_ is None:
            if self._answered is not None:
                return self._answered.input
            raise RuntimeError("no input round is open: call require_input() or require_auth() first")
        try:
            follow = await wait_for(asyncio.shield(round_), timeout)
        except asyncio.CancelledError:
            self._close_round()  # canceled while waiting (a task.cancel, the node stopping)
            raise
        except TimeoutError:
            if self._answered is None:
                # Unanswered: a paused Task may only move on to canceled (or
                # exhausted), never fail (§7.3). Claim the round first, so a
                # follow-up arriving meanwhile is refused, not half-taken.
                self._close_round()
                note = f"no input arrived within {timeout:g} s"
                await self._send("canceled", extra={"reason": "policy", "note": note})
                raise InputTimeout(note) from None
            follow = await round_  # taken just now; its working update is on its way
        return follow.input

    def _open_round(self, schema: Mapping[str, Any] | None) -> None:
        if schema is not None:
            import jsonschema

            jsonschema.validators.validator_for(dict(schema)).check_schema(dict(schema))
        self._round = asyncio.get_running_loop().create_future()
        self._answered = None
        self.round_schema = schema

    def _close_round(self) -> None:
        if self._round is not None and not self._round.done():
            self._round.cancel()
        self._round = None
        self.round_schema = None

    async def take_follow_up(self, envelope: Mapping[str, Any], handler_input: Any) -> None:
        """Resume the Task with a follow-up the pipeline verified and matched
        (:func:`check_follow_up`): ``working`` goes to the requester's inbox as
        the answer to the follow-up and on the update subject, then the waiting
        handler gets the input. Raises INPUT_INVALID (Task still paused) when the
        round declared a schema the input does not match."""
        if self._round is None:
            # Paused at the cost ceiling: §7.7 resolves that by a budget
            # revision (or a cancel), not by a follow-up request.
            raise ProtocolError(
                "TASK_INVALID_TRANSITION",
                f"task {self.task_id} waits for a budget revision (§7.7), not for input",
                {"task_id": self.task_id, "from": self.state, "to": "working"},
            )
        if self.round_schema is not None:
            import jsonschema

            schema = dict(self.round_schema)
            validator = jsonschema.validators.validator_for(schema)(schema)
            error = jsonschema.exceptions.best_match(validator.iter_errors(handler_input))
            if error is not None:
                where = "/".join(str(p) for p in error.absolute_path) or "(input)"
                raise ProtocolError(
                    "INPUT_INVALID",
                    f"the follow-up's input does not match what task {self.task_id} asked for at {where}: "
                    f"{error.message}",
                    {"path": where, "task_id": self.task_id},
                )
        follow = FollowUp(handler_input, envelope)
        # Claimed before any await: a timeout firing during the send sees the
        # round answered, and a second follow-up sees the Task working.
        self._answered = follow
        round_ = self._round
        self._round = None
        self.round_schema = None
        try:
            await self._send("working", reply_to=envelope)
        finally:
            # Only now does the handler go on: its next update cannot overtake
            # the working one.
            if round_ is not None and not round_.done():
                round_.set_result(follow)

    async def fail(
        self,
        reason: str | None = None,
        *,
        note: str | None = None,
        unmet_need: str | None = None,
        dependency: str | None = None,
        error: Mapping[str, Any] | None = None,
    ) -> None:
        """End in ``failed``, optionally saying why from the closed §10.8 vocabulary
        (``needs_not_furnished`` needs ``unmet_need`` naming a need the offering
        declares; ``dependency_failed`` may name the ``dependency``). The platform,
        not this update, decides the attribution (§10.8a)."""
        fields = build_failed_update_payload(reason, note=note, unmet_need=unmet_need, dependency=dependency)
        fields.pop("status", None)
        await self._send("failed", error=error, extra=fields)

    async def reject(self, message: str | None = None) -> None:
        """Decline the task before work began (``submitted`` → ``rejected``)."""
        await self._send("rejected", message=message)

    async def pause_for_budget(self, spent: Money, estimate_to_finish: Money, *, timeout: float | None = None) -> Any:
        """Stop at the cost ceiling (§7.7): ``input_required`` with BUDGET_EXHAUSTED;
        returns the revised budget once the requester raises it (or None on timeout)."""
        self._revision.clear()
        node = self.hosted.node

        async def on_update(msg: Any) -> None:
            # Revisions ride the task's update subject (§7.7); only verified ones count.
            try:
                env = decode_envelope(msg.data)
            except ProtocolError:
                return
            if env.get("task_id") == self.task_id and env["from"] != self.hosted.agent_id:
                self.accept_revision(env)

        sub = await node.connection.subscribe(subjects.task_update(self.task_id), on_update)
        try:
            await self._send(
                "input_required",
                error=budget_exhausted_error(spent, estimate_to_finish),
                extra={"spent": spent.to_object()},
            )
            try:
                await wait_for(self._revision.wait(), timeout=timeout)
            except TimeoutError:
                return None
        finally:
            await sub.unsubscribe()
        await self._send("working", message="budget revised")
        return self.budget

    async def exhaust(self, message: str | None = None, *, output: Any = None) -> None:
        """End at the not-to-exceed cap (terminal ``exhausted``, not a failure)."""
        await self._send("exhausted", message=message, output=output)

    def accept_revision(self, env: Mapping[str, Any]) -> None:
        """A budget revision arrived on the update subject (from a party; checked)."""
        block = (env.get("payload") or {}).get("budget") if isinstance(env.get("payload"), Mapping) else None
        if block is None:
            return
        try:
            self.budget = check_revision(
                sender=str(env.get("from")),
                requester=self.requester,
                responder=self.hosted.agent_id,
                task_state=self.state,
                current=self.budget,
                block=block,
                now_ms=self.hosted.node.now_ms(),
            )
        except ProtocolError as exc:
            self.hosted.agent.log.info("budget revision refused: %s", exc)
            return
        self._revision.set()


class RequesterTask:
    """The caller's side of a Task its request became (§7.0, §11.3; implements
    :class:`meshnode.agent.RequesterTask`).

    ``await task.result()`` waits for the terminal update (replaying the task's
    updates from the start, so nothing published before the wait is missed);
    ``async for data in task.stream()`` yields chunk data with the stream's
    integrity checked; ``await task.record()`` asks the task manager.
    """

    def __init__(self, hosted: HostedAgent, opening: Mapping[str, Any], *, sign_chunks: bool = False) -> None:
        self.hosted = hosted
        self.opening = opening
        self.task_id = str(opening["task_id"])
        self.responder = str(opening["from"])
        self.sign_chunks = sign_chunks
        self.last_update: Mapping[str, Any] = opening
        self._live = False  # followed by a core subscription (no JetStream API granted)

    def _consumer_name(self, kind: str) -> str:
        """The requester's consumer on MESH_TASKS (§18.6 ``mesh_task_{task}_{requester}``)."""
        return f"mesh_task_{self.task_id}_{self.hosted.agent_id}" + ("" if kind == "u" else "_stream")

    async def _replay(self, subject: str, kind: str) -> tuple[asyncio.Queue[bytes], Subscription]:
        """Everything on ``subject`` from the start, queued for the reader: deliver
        all, so nothing published before the wait began is missed; the server reaps
        the consumer once idle."""
        queue: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_msg(msg: Message) -> None:
            await queue.put(msg.data)
            try:
                await msg.ack()
            except Exception:
                pass

        node = self.hosted.node
        if not node.grants.can_publish(JS_STREAM_INFO.format(stream="MESH_TASKS")):
            # A mesh built elsewhere (§14.3's example grants mesh.task.*.update but no
            # JetStream API): follow live. What the responder published before this
            # subscription is missed; a node on such a mesh says so in its docs.
            self._live = True
            return queue, await node.connection.subscribe(subject, on_msg)
        name = self._consumer_name(kind)

        async def direct() -> DurableSubscription:
            return await self.hosted.node.connection.jetstream.replay_push(
                subject,
                on_msg,
                stream="MESH_TASKS",
                name=name,
                max_deliver=3,
                inactive_threshold_s=120.0,
            )

        # The consumer service makes it (a participant holds no grant to): #22.
        request = request_for("MESH_TASKS", subject)
        try:
            sub = await bind_shared(self.hosted, request, name, on_msg, fallback=direct)
        except asyncio.CancelledError:
            # Cancelled (the caller's timeout, the agent stopping) while the
            # consumer may already exist: the service made it, or the bind was
            # under way. Nothing will release it, so delete it now rather than
            # leave it to the server's 120 s reap; in a task of its own, as this
            # one is being cancelled. Not on other errors: a refused ensure made
            # no consumer, and a delete would be counted as a failed release.
            self.hosted.spawn(
                release_shared(self.hosted, request, "MESH_TASKS", name), name=f"release {name}"
            )
            raise
        return queue, sub

    async def _release(self, sub: Subscription, subject: str, kind: str) -> None:
        """Unsubscribe and delete the replay consumer now. Unsubscribing alone left
        it on the server until its inactive threshold (120 s): at a few tasks a
        second the account filled with idle consumers and every new task failed
        ("maximum consumers limit reached", found by the soak). A failed delete
        is counted and logged once (:func:`release_shared`), not swallowed."""
        try:
            await sub.unsubscribe()
        finally:
            # A live follow (self._live) made no consumer to delete.
            if not self._live:
                await release_shared(self.hosted, request_for("MESH_TASKS", subject), "MESH_TASKS", self._consumer_name(kind))

    @property
    def state(self) -> str:
        payload = self.last_update.get("payload")
        return str(payload.get("status")) if isinstance(payload, Mapping) else "submitted"

    async def updates(self, timeout: float) -> AsyncGenerator[Mapping[str, Any]]:
        """Every signed update from the responder, in order, until a terminal one."""
        queue, sub = await self._replay(subjects.task_update(self.task_id), "u")
        seen: set[str] = set()
        refusals = self.hosted.node.refusals
        try:
            while True:
                data = await wait_for(queue.get(), timeout=timeout)
                # The task-update intake: decode ─► verify ─► once each ─► this
                # task ─► from one of its parties. Refusals are counted, silently.
                try:
                    env = decode_verified(data)
                    if env["id"] in seen:
                        raise Refused("duplicate")
                    if env.get("task_id") != self.task_id:
                        raise Refused("not_this_task")
                    seen.add(env["id"])
                    if env["from"] != self.responder and env["from"] != self.hosted.agent_id:
                        raise Refused("not_a_party")  # only the task's parties speak on it
                except Refused as refused:
                    refusals.count(Intake.TASK_UPDATE, refused.rule)
                    continue
                raw_payload = env.get("payload")
                payload: Mapping[str, Any] = raw_payload if isinstance(raw_payload, Mapping) else {}
                if env["from"] == self.responder and "status" in payload:
                    self.last_update = env
                yield env
                if env["from"] == self.responder and str(payload.get("status")) in _TERMINAL:
                    return
        finally:
            await self._release(sub, subjects.task_update(self.task_id), "u")

    async def result(self, timeout: float = 300.0, *, until_paused: bool = False) -> Mapping[str, Any]:
        """The terminal update (completed, failed, canceled, rejected, exhausted);
        with ``until_paused`` also an ``input_required``/``auth_required`` one,
        to be answered with :meth:`provide_input` before waiting again."""
        stop = _TERMINAL | _PAUSED if until_paused else _TERMINAL
        if self.state in stop:
            return self.last_update
        # The updates replay from the Task's start: a pause is news only once
        # the update this handle already holds (the opening reply, or the
        # working that answered a follow-up) has gone by.
        start_id = self.last_update.get("id")
        reached = False
        updates = self.updates(timeout)
        try:
            async for env in updates:
                reached = reached or env.get("id") == start_id
                if reached and env is self.last_update and self.state in stop:
                    break
        finally:
            await updates.aclose()
        return self.last_update

    async def provide_input(self, input: Any, *, timeout: float = 30.0, offering: str | None = None) -> Any:
        """Answer this Task's ``input_required``/``auth_required`` (§6.5): a new
        request with the same task_id and context_id carrying ``input``.

        Returns the Reply (the Task ``working`` again; this handle follows it
        on: ``result()``, ``updates()``). Raises RemoteError when the responder
        refuses it (TASK_NOT_FOUND, TASK_INVALID_TRANSITION, INPUT_INVALID).
        ``offering`` defaults to the one the Task's first update named.
        """
        payload = self.opening.get("payload")
        named = payload.get("offering") if isinstance(payload, Mapping) else None
        offering = offering or (named if isinstance(named, str) else None)
        if offering is None:
            raise ValueError("the task's first update names no offering: pass offering=")
        context_id = self.opening.get("context_id")
        reply = await self.hosted.node.send_request(
            self.hosted,
            self.responder,
            offering,
            input,
            trace=child_trace(self.opening.get("trace")),
            timeout=timeout,
            context_id=context_id if isinstance(context_id, str) else None,
            task_id=self.task_id,
        )
        if self.state not in _TERMINAL:  # an end seen meanwhile by updates() stands
            self.last_update = reply.envelope
        return reply

    async def stream(self, timeout: float = 60.0) -> AsyncIterator[Any]:
        """Chunk data in order; raises StreamBroken on a gap or a final chunk that
        does not verify or whose count does not match what arrived.

        Anybody may publish on ``mesh.task.*.stream`` (§14.3: the grant cannot
        name a runtime task id), so a chunk that is not the opener's — not JSON,
        another task's, from someone else, a signature that does not verify, an
        unsigned one where chunks are signed, an index already seen or not yet
        due — is dropped and counted (intake ``task_stream``), never fatal:
        the opener's stream completes around it. A chunk that is really
        missing still breaks the stream, at the final chunk's count.
        """
        queue, sub = await self._replay(subjects.task_stream(self.task_id), "s")
        expected = 0
        refusals = self.hosted.node.refusals
        try:
            while True:
                raw = await wait_for(queue.get(), timeout=timeout)
                try:
                    env, payload = self._chunk(raw, expected)
                except Refused as refused:
                    refusals.count(Intake.TASK_STREAM, refused.rule)
                    continue
                final = payload.get("final") is True
                expected += 1
                if "data" in payload:
                    yield payload["data"]
                if final:
                    if payload.get("chunk_count") != expected:
                        raise StreamBroken("the final chunk's chunk_count does not match what arrived")
                    return
        finally:
            await self._release(sub, subjects.task_stream(self.task_id), "s")

    def _chunk(self, raw: bytes, expected: int) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        """The chunk in ``raw`` if it is the opener's and the one due; raises Refused."""
        try:
            env = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise Refused("not_json", "a stream chunk is not JSON") from None
        payload = env.get("payload") if isinstance(env, dict) else None
        if not isinstance(payload, dict) or env.get("task_id") != self.task_id:
            raise Refused("not_this_task", "a chunk does not belong to this task")
        if env.get("from") != self.responder:
            raise Refused("not_a_party", "a chunk from someone other than the agent that opened the stream")
        final = payload.get("final") is True
        verified = final or self.sign_chunks or "sig" in env
        if verified:
            try:
                verify_envelope(env)
            except ProtocolError:
                raise Refused("identity_mismatch", "a chunk signature does not verify") from None
        elif self.sign_chunks:
            raise Refused("unsigned", "an unsigned chunk where the stream's chunks are signed")
        index = payload.get("chunk_index")
        if index != expected:
            if final and isinstance(index, int) and index > expected:
                # The opener's own signed final chunk past the one due: chunks
                # are really missing (an unsigned injection cannot get here).
                raise StreamBroken(f"chunk {index} arrived where {expected} was due (missing or injected)")
            # Earlier: a replayed or duplicated chunk. Later and unsigned:
            # injected, or a gap the final chunk's count will reveal.
            raise Refused("out_of_order", f"chunk {index!r} arrived where {expected} was due")
        return env, payload

    async def cancel(self, reason: str, note: str | None = None) -> Mapping[str, Any]:
        """Cancel with a reason from the closed enum (§10.8): the cancel request
        to the responder, and the ``canceled`` update the task manager records."""
        if reason not in CANCEL_REASONS:
            raise ProtocolError("INVALID_ENVELOPE", f"cancel reason {reason!r} is not one of the eight", {"member": "reason"})
        result: Mapping[str, Any] = await cancel_task(
            self.hosted.node, self.hosted, self.responder, self.task_id, reason, note
        )
        return result

    async def revise_budget(self, block: Mapping[str, Any]) -> None:
        """Send a budget revision (§7.7): absolute, with a higher ``revision``,
        as a task update carrying only the budget."""
        node = self.hosted.node
        env = build_envelope(
            "respond", self.hosted.agent_id, now_ms=node.now_ms(), to=self.responder, task_id=self.task_id,
            payload={"budget": dict(block)}, ids=node.ids,
        )
        sign_envelope(env, self.hosted.key)
        await node.publish_task(subjects.task_update(self.task_id), env)

    async def record(self) -> Mapping[str, Any]:
        """The task manager's record: the way back to a result after losing the stream."""
        record: Mapping[str, Any] = await self.hosted.node.service_call(
            self.hosted, f"mesh.task.get.{self.task_id}", "request", {"task_id": self.task_id}
        )
        return record


_TERMINAL: frozenset[str] = TERMINAL_STATES
_PAUSED: frozenset[str] = PAUSED_STATES


async def cancel_task(
    node: NodePort, hosted: HostedAgent, responder: str, task_id: str, reason: str, note: str | None, *, wait: bool = True
) -> dict[str, Any]:
    """Cancel a task this agent asked for (§10.8): the ``task.cancel`` request to
    the performer and the ``canceled`` update the task manager records. The
    cancel is effective for the caller when sent; the performer's answer is
    awaited only with ``wait``."""
    cancel_input: dict[str, Any] = {"task_id": task_id, "reason": reason}
    if note:
        cancel_input["note"] = note
    update = build_envelope(
        "respond", hosted.agent_id, now_ms=node.now_ms(), to=responder, task_id=task_id,
        payload={"status": "canceled", "reason": reason, **({"note": note} if note else {})}, ids=node.ids,
    )
    sign_envelope(update, hosted.key)
    await node.publish_task(subjects.task_update(task_id), update)
    if not wait:
        try:
            await node.send_request(hosted, responder, "task.cancel", cancel_input, trace=new_root_trace(), timeout=30)
        except ProtocolError as exc:
            log.info("forwarded cancel of %s: %s", task_id, exc)
        return {"task_id": task_id, "status": "canceled"}
    reply = await node.send_request(hosted, responder, "task.cancel", cancel_input, trace=new_root_trace(), timeout=30)
    out = reply.output
    return out if isinstance(out, dict) else {"task_id": task_id, "status": "canceled"}


def propagated(reason: str, note: str | None) -> tuple[str, str]:
    """(reason, note) for a cancel forwarded to a delegate (§10.8 propagation)."""
    return "upstream_cancelled", propagated_note(reason, note)


__all__ += ["TaskState", "propagated"]
