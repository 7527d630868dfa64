"""Tasks as the plugin author sees them (§7, §10.5, §10.8, §11): the contract.

A request becomes a Task only when its handler defers, streams or pauses
(§7.0). Two handles exist, one per side:

* :class:`ResponderTask`: the handler's side, from ``await ctx.defer()``
  (``ctx.task``): progress, input and auth rounds, budget pauses, rejection;
* :class:`RequesterTask`: the caller's side, ``reply.task`` when an answer
  opened a Task: its result, its updates, its stream, cancel.

The node implements both (:mod:`meshnode.node.tasks`); these are what a plugin
author may rely on. The errors and values here are raised and returned by it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from meshnode.protocol.budget import Money
from meshnode.protocol.errors import ProtocolError

__all__ = ["FollowUp", "InputTimeout", "RequesterTask", "ResponderTask", "StreamBroken"]


@dataclass(frozen=True)
class FollowUp:
    """The requester's answer to an input or auth round: its (framed) input and
    the verified request envelope that carried it."""

    input: Any
    envelope: Mapping[str, Any]


class InputTimeout(asyncio.CancelledError):
    """No follow-up arrived within the wait: the Task was canceled (§7.3, paused →
    canceled). A CancelledError, so an uncaught one ends the handler the way a
    requester's cancel does, quietly; catch it to clean up."""


class StreamBroken(ProtocolError):
    """A stream ended wrong: truncated, a chunk missing or injected, or from
    someone other than the agent that opened it (§11.6)."""

    def __init__(self, message: str) -> None:
        super().__init__("INVALID_ENVELOPE", message, {"stream": "broken"})


class ResponderTask(Protocol):
    """The handler's side of a Task. Get one with ``await ctx.defer()``.

    Every method sends a signed update; only legal transitions are allowed
    (§7.3, else TASK_INVALID_TRANSITION). When the handler returns, the node
    completes the task with its return value as ``output``; a raised Refusal
    fails it.
    """

    @property
    def task_id(self) -> str:
        """The Task's id (one subject token)."""

    @property
    def state(self) -> str:
        """The state of the last update sent (§7.2)."""

    @property
    def requester(self) -> str:
        """The agent that asked for the work."""

    @property
    def request(self) -> Mapping[str, Any]:
        """The verified request that opened the Task."""

    @property
    def budget(self) -> Any:
        """The request's budget (``meshnode.protocol.budget.Budget``), revised as
        the requester revises it (§7.7); None without one."""

    @property
    def follow_up(self) -> FollowUp | None:
        """The latest follow-up taken (its envelope, e.g. for its ``files``)."""

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

    async def require_auth(self, message: str | None = None, *, schema: Mapping[str, Any] | None = None) -> None:
        """Pause in ``auth_required`` and return at once (see :meth:`require_input`)."""

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

    async def ask_auth(
        self, message: str | None = None, *, schema: Mapping[str, Any] | None = None, timeout: float | None = None
    ) -> Any:
        """Pause in ``auth_required`` and return the requester's follow-up input
        (its credentials), as :meth:`ask_input` does."""

    async def wait_for_input(self, timeout: float | None = None) -> Any:
        """The input of the follow-up answering the round opened by
        :meth:`require_input`/:meth:`require_auth` (already taken, or awaited).
        On ``timeout`` the Task is canceled (reason ``policy``: the responder's
        wait ended, §10.8) and :class:`InputTimeout` raised."""

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

    async def reject(self, message: str | None = None) -> None:
        """Decline the task before work began (``submitted`` → ``rejected``)."""

    async def pause_for_budget(self, spent: Money, estimate_to_finish: Money, *, timeout: float | None = None) -> Any:
        """Stop at the cost ceiling (§7.7): ``input_required`` with BUDGET_EXHAUSTED;
        returns the revised budget once the requester raises it (or None on timeout)."""

    async def exhaust(self, message: str | None = None, *, output: Any = None) -> None:
        """End at the not-to-exceed cap (terminal ``exhausted``, not a failure)."""


class RequesterTask(Protocol):
    """The caller's side of a Task its request became (§7.0, §11.3): ``reply.task``.

    ``await task.result()`` waits for the terminal update (replaying the task's
    updates from the start, so nothing published before the wait is missed);
    ``async for data in task.stream()`` yields chunk data with the stream's
    integrity checked; ``await task.record()`` asks the task manager.
    """

    @property
    def task_id(self) -> str:
        """The Task's id."""

    @property
    def responder(self) -> str:
        """The agent performing the Task."""

    @property
    def state(self) -> str:
        """The state of the last update seen from the responder."""

    @property
    def last_update(self) -> Mapping[str, Any]:
        """The last update seen (the opening reply until another arrives)."""

    def updates(self, timeout: float) -> AsyncGenerator[Mapping[str, Any]]:
        """Every signed update from the responder, in order, until a terminal one."""

    async def result(self, timeout: float = 300.0, *, until_paused: bool = False) -> Mapping[str, Any]:
        """The terminal update (completed, failed, canceled, rejected, exhausted);
        with ``until_paused`` also an ``input_required``/``auth_required`` one,
        to be answered with :meth:`provide_input` before waiting again."""

    async def provide_input(self, input: Any, *, timeout: float = 30.0, offering: str | None = None) -> Any:
        """Answer this Task's ``input_required``/``auth_required`` (§6.5): a new
        request with the same task_id and context_id carrying ``input``.

        Returns the Reply (the Task ``working`` again; this handle follows it
        on: ``result()``, ``updates()``). Raises RemoteError when the responder
        refuses it (TASK_NOT_FOUND, TASK_INVALID_TRANSITION, INPUT_INVALID).
        ``offering`` defaults to the one the Task's first update named.
        """

    def stream(self, timeout: float = 60.0) -> AsyncIterator[Any]:
        """Chunk data in order; raises :class:`StreamBroken` on a gap, an injection,
        a chunk from anyone but the opener, or a final chunk that does not verify."""

    async def cancel(self, reason: str, note: str | None = None) -> Mapping[str, Any]:
        """Cancel with a reason from the closed enum (§10.8): the cancel request
        to the responder, and the ``canceled`` update the task manager records."""

    async def revise_budget(self, block: Mapping[str, Any]) -> None:
        """Send a budget revision (§7.7): absolute, with a higher ``revision``,
        as a task update carrying only the budget."""

    async def record(self) -> Mapping[str, Any]:
        """The task manager's record: the way back to a result after losing the stream."""
