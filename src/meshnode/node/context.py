"""The handler's view of the node: the concrete :class:`meshnode.agent.Context`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from meshnode.node.outbound import Reply
from meshnode.node.tasks import ResponderTask
from meshnode.protocol.envelope import child_trace

if TYPE_CHECKING:
    from meshnode.node.hosted import HostedAgent

__all__ = ["AgentContext"]


class AgentContext:
    """Everything a handler may see and do, bound to one agent and one piece of work.

    Work a handler starts inherits this context's trace (§13.1): outbound
    requests and emits get a child span of the envelope being handled.
    """

    def __init__(
        self,
        hosted: HostedAgent,
        *,
        envelope: Mapping[str, Any] | None = None,
        text: str | None = None,
        trace: Mapping[str, Any] | None = None,
    ) -> None:
        self._hosted = hosted
        self._envelope: Mapping[str, Any] = envelope or {}
        self._text = text
        env_trace = self._envelope.get("trace") if envelope is not None else None
        self._trace: Mapping[str, Any] = trace or (env_trace if isinstance(env_trace, Mapping) else {})
        #: The Task this request became, once the handler deferred or streamed.
        self.task: ResponderTask | None = None

    @property
    def agent_id(self) -> str:
        return self._hosted.agent_id

    @property
    def sender(self) -> str:
        sender = self._envelope.get("from")
        return sender if isinstance(sender, str) else ""

    @property
    def envelope(self) -> Mapping[str, Any]:
        return self._envelope

    @property
    def text(self) -> str | None:
        return self._text

    @property
    def trace(self) -> Mapping[str, Any]:
        return self._trace

    @property
    def log(self) -> logging.Logger:
        return self._hosted.agent.log

    def _child_trace(self) -> dict[str, Any]:
        return child_trace(self._trace or None)

    async def defer(self, status: str = "working", message: str | None = None) -> ResponderTask:
        """Make the request being handled a Task (§7.0) and answer with its id now.

        Returns the handle for progress, input/auth rounds, budget pauses and
        rejection; the handler's return value completes the task.
        """
        if not self._envelope or self._envelope.get("type") != "request":
            raise RuntimeError("defer() is for a request being handled")
        return await self._hosted.open_task(self, status, message)

    async def request(
        self,
        target: str,
        offering: str,
        input: Any = None,
        *,
        timeout: float = 30.0,
        config: Mapping[str, Any] | None = None,
        budget: Mapping[str, Any] | None = None,
    ) -> Reply:
        reply = await self._hosted.node.send_request(
            self._hosted,
            target,
            offering,
            input,
            trace=self._child_trace(),
            timeout=timeout,
            config=config,
            budget=budget,
            context_id=self._envelope.get("context_id") if self._envelope else None,
        )
        if self.task is not None and reply.task is not None:
            # A delegate of this task: a cancel of ours is forwarded to it (§10.8).
            self.task.delegates.append((target, reply.task.task_id))
        return reply

    async def subscribe(self, pattern: str, *, durable: bool = True, replay: bool = False) -> str:
        return await self._hosted.node.subscribe_events(
            self._hosted, pattern, durable=durable, replay=replay
        )

    async def emit(self, domain: str, event_type: str, data: Any = None) -> None:
        await self._hosted.node.emit(self._hosted, domain, event_type, data, trace=self._child_trace())
