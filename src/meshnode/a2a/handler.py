"""The a2a-sdk's request-handler interface of the inbound bridge: each JSON-RPC
method the SDK dispatches, answered by :class:`meshnode.a2a.execution.InboundTasks`."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.request_handlers.request_handler import RequestHandler
from a2a.server.routes.common import DefaultServerCallContextBuilder
from a2a.types.a2a_pb2 import (
    AgentCard,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse,
    ListTasksRequest,
    ListTasksResponse,
    Message,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskArtifactUpdateEvent,
    TaskPushNotificationConfig,
    TaskState,
    TaskStatusUpdateEvent,
)
from a2a.utils.errors import (
    InvalidParamsError,
    PushNotificationNotSupportedError,
    UnsupportedOperationError,
)
from a2a.utils.task import apply_history_length
from google.protobuf.json_format import ParseDict
from starlette.requests import Request

from meshnode.a2a.execution import InboundTasks, Live
from meshnode.a2a.inbound import ANONYMOUS, Requester, may_see
from meshnode.a2a.mapping import INTERRUPTED_A2A
from meshnode.aio import wait_for
from meshnode.protocol.timeutil import try_parse_rfc3339

__all__ = ["ContextBuilder", "Handler"]


class ContextBuilder(DefaultServerCallContextBuilder):
    """Carries what the HTTP layer learned (agent, pre-checked envelope) to the handler."""

    def build(self, request: Request) -> ServerCallContext:
        context = super().build(request)
        context.state["a2a_agent"] = getattr(request.state, "a2a_agent", None)
        context.state["a2a_inbound"] = getattr(request.state, "a2a_inbound", None)
        context.state["a2a_requester"] = getattr(request.state, "a2a_requester", None)
        context.state["a2a_answered"] = getattr(request.state, "a2a_answered", None)
        return context


def _task_proto(task: Mapping[str, Any]) -> Task:
    proto = Task()
    ParseDict(dict(task), proto, ignore_unknown_fields=True)
    return proto


def _answer(context: ServerCallContext, task: Mapping[str, Any], config: Any = None) -> Task:
    """The task as the SDK's answer (its ``history`` cut to the request's
    ``historyLength``, when given), and as it stands for the HTTP layer, which
    renders its integers as integers again (the proto's Struct made them doubles)."""
    answered = context.state.get("a2a_answered")
    if isinstance(answered, list):
        answered.append(copy.deepcopy(dict(task)))
    proto: Task = apply_history_length(_task_proto(task), config)
    return proto


#: ListTasks pages: the default and the largest page.
LIST_PAGE = 50
LIST_PAGE_MAX = 100


def _listed(tasks: list[dict[str, Any]], params: ListTasksRequest) -> ListTasksResponse:
    """One page of ``tasks`` (the newest first) filtered as ListTasks asks."""
    if params.context_id:
        tasks = [t for t in tasks if t.get("contextId") == params.context_id]
    if params.status:
        wanted = TaskState.Name(params.status)
        tasks = [t for t in tasks if (t.get("status") or {}).get("state") == wanted]
    if params.HasField("status_timestamp_after"):
        after_us = params.status_timestamp_after.ToMicroseconds()
        tasks = [t for t in tasks if (try_parse_rfc3339((t.get("status") or {}).get("timestamp")) or 0) > after_us]
    size = params.page_size if params.HasField("page_size") else LIST_PAGE
    if not 1 <= size <= LIST_PAGE_MAX:
        raise InvalidParamsError(message=f"pageSize is 1 to {LIST_PAGE_MAX}")
    try:
        offset = int(params.page_token or 0)
    except ValueError:
        raise InvalidParamsError(message="pageToken is not one this bridge gave") from None
    if offset < 0:
        raise InvalidParamsError(message="pageToken is not one this bridge gave")
    page: list[Task] = []
    for task in tasks[offset:offset + size]:
        proto = apply_history_length(_task_proto(task), params)
        if not params.include_artifacts:
            proto.ClearField("artifacts")
        page.append(proto)
    more = offset + size < len(tasks)
    return ListTasksResponse(tasks=page, next_page_token=str(offset + size) if more else "", page_size=size,
                             total_size=len(tasks))


def _record(context: ServerCallContext, event: Mapping[str, Any]) -> None:
    """Note a streamed event (a StreamResponse as ProtoJSON) as it stands, for
    the HTTP layer to render its integers as integers, in the order sent."""
    answered = context.state.get("a2a_answered")
    if isinstance(answered, list):
        answered.append(copy.deepcopy(dict(event)))


async def _follow(
    live: Live, queue: asyncio.Queue[dict[str, Any] | None], context: ServerCallContext
) -> AsyncGenerator[Any]:
    """The task as it stands, then its updates until it ends or pauses for the
    caller (INPUT_REQUIRED / AUTH_REQUIRED: the stream closes, as A2A streams
    do, and the caller's answering message opens the next one). ``queue`` is
    already subscribed, so nothing between the two is missed."""
    try:
        _record(context, {"task": live.task})
        yield _task_proto(live.task)
        if live.task["status"].get("state") in INTERRUPTED_A2A and not live.answering:
            return
        while True:
            event = await queue.get()
            if event is None:
                return
            _record(context, event)
            if "statusUpdate" in event:
                yield ParseDict(event["statusUpdate"], TaskStatusUpdateEvent(), ignore_unknown_fields=True)
                if event["statusUpdate"].get("status", {}).get("state") in INTERRUPTED_A2A:
                    return
            elif "artifactUpdate" in event:
                yield ParseDict(event["artifactUpdate"], TaskArtifactUpdateEvent(), ignore_unknown_fields=True)
    finally:
        with contextlib.suppress(ValueError):
            live.subscribers.remove(queue)


class Handler(RequestHandler):
    """The SDK's request-handler interface, answered by the bridge's tasks."""

    def __init__(self, tasks: InboundTasks) -> None:
        self.tasks = tasks

    @staticmethod
    def _agent(context: ServerCallContext) -> str:
        return str(context.state.get("a2a_agent") or "")

    @staticmethod
    def _requester(context: ServerCallContext, method: str, task_id: str | None) -> str:
        """The proven caller of a task operation, when the proof is for exactly
        this method and task as the SDK parsed them; anonymous otherwise."""
        found = context.state.get("a2a_requester")
        if isinstance(found, Requester) and found.method == method and found.task_id == task_id:
            return found.caller
        return ANONYMOUS

    async def on_get_task(self, params: GetTaskRequest, context: ServerCallContext) -> Task | None:
        requester = self._requester(context, "GetTask", params.id)
        return _answer(context, await self.tasks.get_task(self._agent(context), params.id, requester), params)

    async def on_list_tasks(self, params: ListTasksRequest, context: ServerCallContext) -> ListTasksResponse:
        """The requester's own tasks on this agent (a trusted caller's, proven as
        for GetTask; an anonymous requester's list is empty)."""
        requester = self._requester(context, "ListTasks", None)
        return _listed(await self.tasks.list_tasks(self._agent(context), requester), params)

    async def on_cancel_task(self, params: CancelTaskRequest, context: ServerCallContext) -> Task | None:
        requester = self._requester(context, "CancelTask", params.id)
        return _answer(context, await self.tasks.cancel(self._agent(context), params.id, requester))

    async def on_message_send(self, params: SendMessageRequest, context: ServerCallContext) -> Task | Message:
        live, task = await self.tasks.submit(
            self._agent(context), params, context.state.get("a2a_inbound"), streaming=False
        )
        if live is not None and not params.configuration.return_immediately:
            with contextlib.suppress(TimeoutError):
                await wait_for(live.settled.wait(), timeout=self.tasks.settings.send_wait_s)
            task = live.task
        return _answer(context, task, params.configuration)

    async def on_message_send_stream(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any]:
        tasks = self.tasks
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        live, task = await tasks.submit(
            self._agent(context), params, context.state.get("a2a_inbound"), streaming=True
        )
        if live is None or live.done.is_set():
            _record(context, {"task": task})
            yield _task_proto(task)
            return
        live.subscribers.append(queue)
        async for event in _follow(live, queue, context):
            yield event

    async def on_subscribe_to_task(
        self, params: SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any]:
        agent = self._agent(context)
        requester = self._requester(context, "SubscribeToTask", params.id)
        live = self.tasks.live.get(params.id)
        if (
            live is None
            or live.agent != agent
            or live.done.is_set()
            or not may_see(live.caller, requester)
        ):
            await self.tasks.get_task(agent, params.id, requester)  # TaskNotFound when unknown or foreign
            raise UnsupportedOperationError(message="the task is in a terminal state")
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        live.subscribers.append(queue)
        async for event in _follow(live, queue, context):
            yield event

    async def on_create_task_push_notification_config(
        self, params: TaskPushNotificationConfig, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        raise PushNotificationNotSupportedError

    async def on_get_task_push_notification_config(
        self, params: GetTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        raise PushNotificationNotSupportedError

    async def on_list_task_push_notification_configs(
        self, params: ListTaskPushNotificationConfigsRequest, context: ServerCallContext
    ) -> ListTaskPushNotificationConfigsResponse:
        raise PushNotificationNotSupportedError

    async def on_delete_task_push_notification_config(
        self, params: DeleteTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> None:
        raise PushNotificationNotSupportedError

    async def on_get_extended_agent_card(
        self, params: GetExtendedAgentCardRequest, context: ServerCallContext
    ) -> AgentCard:
        raise UnsupportedOperationError(message="no extended agent card")
