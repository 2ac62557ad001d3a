"""The Agent2Agent (A2A 1.0) door of the Gateway: the SDK's own gRPC service, over room tasks.

Every agent whose company is a member of a room is an A2A agent at the tenant
``rooms/<room_id>/agents/<agent_id>`` of the Gateway's gRPC address. The caller authenticates with
its company's API key as a bearer token (the same interceptor as the rest of the Gateway) and must
be a member of that room. A message sent there becomes a room task from the caller's company to the
agent; the A2A task id is the room task id and the A2A ``messageId`` is the task's idempotency key.

State mapping of a room task (the latest run its wake started decides while the task is open):
no run yet: submitted; a run executing: working; a run parked on an approval: input-required; the
last run failed or timed out: failed; the last run replied and the task is still open:
input-required (the agent has answered and waits for more, or for the sender to close it); closed
done: completed; closed cancelled: canceled.

A task's answers (its agent-role history, its artifacts, its status message) are only what the task's
assignee agent wrote: the replies its runs for the task posted and its own notes on the task. A note
by anyone else (a person, another agent, of any company) is never shown as the agent's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc
from a2a.server.context import ServerCallContext
from a2a.server.request_handlers.grpc_handler import GrpcHandler
from a2a.server.request_handlers.request_handler import RequestHandler
from a2a.types import a2a_pb2
from a2a.utils.errors import (
    ContentTypeNotSupportedError,
    InvalidParamsError,
    PushNotificationNotSupportedError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from opentelemetry import trace

from quayutec.errors import InvalidArgument, NotFound, status_for
from quayutec.telemetry import annotate
from quayutec.v1 import common_pb2, room_pb2
from services.gateway.auth import CallerContext
from services.gateway.ratelimit import PostRateLimiter
from services.gateway.servicer import (
    AGENT_NOT_IN_ROOM,
    MAX_BODY_BYTES,
    MAX_TITLE_BYTES,
    GatewayServicer,
    _is_uuid,
)
from services.gateway.watch import RoomEventHub

PROTOCOL_VERSION = "1.0"
# The SDK's A2A 1.0 gRPC service, served on the Gateway's port.
SERVICE_NAME = a2a_pb2.DESCRIPTOR.services_by_name["A2AService"].full_name
SECURITY_SCHEME = "quayutec-api-key"
A2A_PERSON = "A2A client"
MAX_MESSAGE_ID_BYTES = 200
# The span attribute of an A2A call's messageId (the task id is quayutec.task_id).
A2A_MESSAGE_ID_ATTRIBUTE = "quayutec.a2a.message_id"
# The runs and reply messages one task's view reads (newest first): bounded work per call.
RUNS_READ = 100
MESSAGES_READ = 200
MAX_A2A_PAGE_SIZE = 100
TEXT_MEDIA_TYPES = ("", "text/plain")
_TERMINAL = (
    a2a_pb2.TASK_STATE_COMPLETED,
    a2a_pb2.TASK_STATE_CANCELED,
    a2a_pb2.TASK_STATE_FAILED,
    a2a_pb2.TASK_STATE_REJECTED,
)
# A blocking SendMessage returns, and a SendStreamingMessage stream ends, once the task is in none of
# these (terminal, or interrupted: input-required), as A2A 1.0 defines; SubscribeToTask follows the
# task until it is terminal.
_IN_PROGRESS = (a2a_pb2.TASK_STATE_SUBMITTED, a2a_pb2.TASK_STATE_WORKING)
_STATUS_FILTER = {
    a2a_pb2.TASK_STATE_UNSPECIFIED: common_pb2.TASK_STATUS_UNSPECIFIED,
    a2a_pb2.TASK_STATE_COMPLETED: common_pb2.TASK_STATUS_DONE,
    a2a_pb2.TASK_STATE_CANCELED: common_pb2.TASK_STATUS_CANCELLED,
}


def tenant_of(room_id: str, agent_id: str) -> str:
    """The A2A tenant that addresses one agent of one room."""
    return f"rooms/{room_id}/agents/{agent_id}"


def parse_tenant(tenant: str) -> tuple[str, str]:
    """``(room_id, agent_id)`` of a tenant; NOT_FOUND-shaped errors for anything else."""
    parts = tenant.split("/")
    if len(parts) != 4 or parts[0] != "rooms" or parts[2] != "agents":
        if not tenant:
            raise InvalidArgument("tenant is required: rooms/<room_id>/agents/<agent_id> (the agent card names it)")
        raise InvalidArgument(f"tenant must read rooms/<room_id>/agents/<agent_id>, got {tenant[:120]!r}")
    room_id, agent_id = parts[1], parts[3]
    if not _is_uuid(agent_id):
        raise NotFound(f"agent {agent_id[:64]!r} not found in this room")
    return room_id, agent_id


def _text(message: a2a_pb2.Message) -> str:
    """The message's text; only text parts are accepted (our tasks carry text)."""
    texts: list[str] = []
    for part in message.parts:
        kind = part.WhichOneof("content")
        if kind != "text" or part.media_type not in TEXT_MEDIA_TYPES:
            raise ContentTypeNotSupportedError(
                f"only text parts (text/plain) are accepted by room agents, got a {kind or 'empty'} part"
                + (f" of {part.media_type}" if part.media_type else "")
            )
        texts.append(part.text)
    text = "\n".join(texts)
    if not text.strip():
        raise InvalidParamsError("message needs at least one non-empty text part")
    return text


def _title(text: str) -> str:
    line = text.strip().splitlines()[0].strip()
    encoded = line.encode("utf-8")
    if len(encoded) <= MAX_TITLE_BYTES:
        return line
    return encoded[: MAX_TITLE_BYTES - 3].decode("utf-8", "ignore") + "..."


def _agent_message(task_id: str, message_id: str, text: str) -> a2a_pb2.Message:
    return a2a_pb2.Message(
        message_id=message_id,
        context_id=task_id,
        task_id=task_id,
        role=a2a_pb2.ROLE_AGENT,
        parts=[a2a_pb2.Part(text=text)],
    )


class RoomAgentHandler(RequestHandler):
    """The A2A request handler over the Room, scoped to the calling company and the tenant's room."""

    def __init__(
        self,
        room: Any,
        caller: CallerContext,
        limiter: PostRateLimiter,
        gateway: GatewayServicer,
        *,
        room_timeout_seconds: float,
        block_seconds: float,
        card_url: Callable[[], str],
        watch: RoomEventHub | None = None,
    ) -> None:
        self._room = room
        self._caller = caller
        self._limiter = limiter
        self._gateway = gateway
        self._timeout = room_timeout_seconds
        self._block_seconds = block_seconds
        self._card_url = card_url
        self._watch = watch

    # --- addressing ---------------------------------------------------------------------------

    async def _address(self, tenant: str) -> tuple[str, str, str, common_pb2.Agent]:
        """``(company_id, room_id, agent_id, agent)``: the caller is a member of the room and the agent's
        company too; NOT_FOUND otherwise, one message for an unknown agent and one not in the room."""
        company_id = self._caller.company_id()
        room_id, agent_id = parse_tenant(tenant)
        await self._gateway._member_room(room_id, company_id)
        not_found = NotFound("agent not found in this room (unknown, or its company is not a member)")
        try:
            # As the caller's company may see it (the Room's rule `room-agents`): another company's
            # agent without its system prompt, provider or model.
            got = await self._room.GetAgent(
                room_pb2.RoomServiceGetAgentRequest(agent_id=agent_id, reader_company_id=company_id),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise not_found from None
            raise
        agent: common_pb2.Agent = got.agent
        try:
            await self._gateway._member_room(room_id, agent.company_id)
        except NotFound:
            raise not_found from None
        return company_id, room_id, agent_id, agent

    async def _room_task(self, room_id: str, agent_id: str, company_id: str, task_id: str) -> common_pb2.Task:
        """The room task behind an A2A task id, when it was sent to this agent by the caller's company."""
        annotate(company_id=company_id, room_id=room_id, agent_id=agent_id, task_id=task_id[:64])
        try:
            task = await self._gateway._task_in_room(room_id, task_id)
        except NotFound:
            raise TaskNotFoundError(f"task {task_id[:64]!r} not found for this agent") from None
        if task.to_agent_id != agent_id or getattr(task, "from").company_id != company_id:
            raise TaskNotFoundError(f"task {task_id[:64]!r} not found for this agent")
        return task

    # --- the view of a room task as an A2A task ------------------------------------------------

    async def _runs(self, task: common_pb2.Task) -> list[common_pb2.Run]:
        """The runs the task's wake started, oldest first (among the agent's latest RUNS_READ)."""
        response = await self._room.ListRuns(
            room_pb2.RoomServiceListRunsRequest(agent_id=task.to_agent_id, page_size=RUNS_READ),
            timeout=self._timeout,
        )
        runs = [
            r for r in response.runs if r.wake_kind == common_pb2.WAKE_KIND_TASK and r.wake_source_id == task.task_id
        ]
        runs.sort(key=lambda r: (r.started_at.seconds, r.started_at.nanos))
        return runs

    async def _replies(self, task: common_pb2.Task, runs: list[common_pb2.Run]) -> list[common_pb2.Message]:
        wanted = {r.posted_message_id for r in runs if r.posted_message_id}
        if not wanted:
            return []
        response = await self._room.ListMessages(
            room_pb2.RoomServiceListMessagesRequest(room_id=task.room_id, page_size=MESSAGES_READ, newest_first=True),
            timeout=self._timeout,
        )
        # The replies the assignee's own runs posted: its agent's messages only.
        found = [
            m
            for m in response.messages
            if m.message_id in wanted
            and m.author.kind == common_pb2.AUTHOR_KIND_AGENT
            and m.author.agent_id == task.to_agent_id
        ]
        found.sort(key=lambda m: m.seq)
        return found

    async def _view(self, task: common_pb2.Task, history_length: int | None = None) -> a2a_pb2.Task:
        runs = await self._runs(task)
        if runs and task.status == common_pb2.TASK_STATUS_OPEN:
            # Read the task again after its runs: a run closes its task before its ledger row ends, so
            # a run seen ended comes with the task as that run left it (not "replied but still open").
            task = await self._gateway._task_in_room(task.room_id, task.task_id)
        replies = await self._replies(task, runs)
        state = _state(task, runs)
        view = a2a_pb2.Task(id=task.task_id, context_id=task.task_id)
        view.status.state = state
        view.status.timestamp.CopyFrom(task.updated_at)
        history = [
            a2a_pb2.Message(
                message_id=f"{task.task_id}:request",
                context_id=task.task_id,
                task_id=task.task_id,
                role=a2a_pb2.ROLE_USER,
                parts=[a2a_pb2.Part(text=task.body or task.title)],
            )
        ]
        for reply in replies:
            history.append(_agent_message(task.task_id, reply.message_id, reply.body))
            view.artifacts.append(
                a2a_pb2.Artifact(artifact_id=reply.message_id, name="reply", parts=[a2a_pb2.Part(text=reply.body)])
            )
        for update in task.updates:
            if _assignee_wrote(task, update) and update.note.strip():
                history.append(_agent_message(task.task_id, update.update_id, update.note))
                view.artifacts.append(
                    a2a_pb2.Artifact(
                        artifact_id=update.update_id, name="task note", parts=[a2a_pb2.Part(text=update.note)]
                    )
                )
        if history_length is not None and history_length >= 0:
            history = history[len(history) - history_length :] if history_length else []
        view.history.extend(history)
        if replies and state != a2a_pb2.TASK_STATE_WORKING:
            view.status.message.CopyFrom(_agent_message(task.task_id, replies[-1].message_id, replies[-1].body))
        return view

    # --- RequestHandler -----------------------------------------------------------------------

    async def on_message_send(
        self, params: a2a_pb2.SendMessageRequest, context: ServerCallContext
    ) -> a2a_pb2.Task | a2a_pb2.Message:
        task = await self._send(params)
        view = await self._view(task)
        if params.configuration.return_immediately or view.status.state not in _IN_PROGRESS:
            return view
        return await self._wait_past_working(task, view, context)

    async def _send(self, params: a2a_pb2.SendMessageRequest) -> common_pb2.Task:
        company_id, room_id, agent_id, _ = await self._address(params.tenant)
        message = params.message
        if message.task_id or message.reference_task_ids:
            raise UnsupportedOperationError(
                "continuing or referencing a task is not supported: send a new message (a new task), and "
                "follow the task with GetTask or SubscribeToTask"
            )
        if params.configuration.HasField("task_push_notification_config"):
            raise PushNotificationNotSupportedError("push notifications are not supported: use SubscribeToTask")
        if not message.message_id:
            raise InvalidParamsError("message.message_id is required (it is the idempotency key)")
        if len(message.message_id.encode("utf-8")) > MAX_MESSAGE_ID_BYTES:
            raise InvalidParamsError(f"message.message_id must be at most {MAX_MESSAGE_ID_BYTES} bytes")
        text = _text(message)
        if len(text.encode("utf-8")) > MAX_BODY_BYTES:
            raise InvalidParamsError(f"the message text must be at most {MAX_BODY_BYTES} bytes")
        self._limiter.take(company_id)
        create = room_pb2.RoomServiceCreateTaskRequest(
            room_id=room_id,
            to_agent_id=agent_id,
            title=_title(text),
            body=text,
            # Namespaced by company and agent: another company's or agent's messageId never collides.
            dedupe_key=f"a2a:{company_id}:{agent_id}:{message.message_id}",
        )
        getattr(create, "from").CopyFrom(
            common_pb2.Author(kind=common_pb2.AUTHOR_KIND_PERSON, company_id=company_id, person=A2A_PERSON)
        )
        response = await self._gateway._write_to_room(
            self._room.CreateTask, create, company_id, room_id, AGENT_NOT_IN_ROOM
        )
        task: common_pb2.Task = response.task
        # The A2A call's span: findable by the task id and by the caller's messageId.
        annotate(company_id=company_id, room_id=room_id, agent_id=agent_id, task_id=task.task_id)
        trace.get_current_span().set_attribute(A2A_MESSAGE_ID_ATTRIBUTE, message.message_id)
        return task

    async def _wait_past_working(
        self, task: common_pb2.Task, view: a2a_pb2.Task, context: ServerCallContext
    ) -> a2a_pb2.Task:
        """Follow the task until it leaves submitted/working, the client's deadline or the configured cap."""
        grpc_context = context.state.get("grpc_context")
        remaining = grpc_context.time_remaining() if grpc_context is not None else None
        budget = self._block_seconds if remaining is None else min(self._block_seconds, max(0.0, remaining - 0.5))
        last = view
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(budget):
                async for current in self._follow(task):
                    last = current
                    if current.status.state not in _IN_PROGRESS:
                        break
        return last

    async def _follow(self, task: common_pb2.Task) -> AsyncIterator[a2a_pb2.Task]:
        """The task's view after every change the caller can see in the room, until it is terminal."""
        if self._watch is None:
            raise UnsupportedOperationError("streaming is not served by this Gateway")
        company_id = getattr(task, "from").company_id
        stream = aiter(self._watch.watch(task.room_id, company_id, None))
        try:
            first = True
            async for item in stream:
                if not first and not item.events:
                    continue
                first = False
                fresh = await self._gateway._task_in_room(task.room_id, task.task_id)
                view = await self._view(fresh)
                yield view
                if view.status.state in _TERMINAL:
                    return
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()

    async def on_message_send_stream(
        self, params: a2a_pb2.SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any, None]:
        task = await self._send(params)
        view = await self._view(task)
        yield view
        if view.status.state not in _IN_PROGRESS:
            return
        async for event in self._updates(task, view):
            yield event
            if isinstance(event, a2a_pb2.TaskStatusUpdateEvent) and event.status.state not in _IN_PROGRESS:
                return

    async def on_subscribe_to_task(
        self, params: a2a_pb2.SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Any, None]:
        company_id, room_id, agent_id, _ = await self._address(params.tenant)
        task = await self._room_task(room_id, agent_id, company_id, params.id)
        view = await self._view(task)
        if view.status.state in _TERMINAL:
            raise UnsupportedOperationError(
                f"task {task.task_id} is already {a2a_pb2.TaskState.Name(view.status.state)}: read it with GetTask"
            )
        yield view
        async for event in self._updates(task, view):
            yield event

    async def _updates(self, task: common_pb2.Task, sent: a2a_pb2.Task) -> AsyncIterator[Any]:
        """Status and artifact update events from ``sent`` on, until the task is terminal."""
        seen = {a.artifact_id for a in sent.artifacts}
        state = sent.status.state
        if state in _TERMINAL:
            return
        async for view in self._follow(task):
            for artifact in view.artifacts:
                if artifact.artifact_id not in seen:
                    seen.add(artifact.artifact_id)
                    yield a2a_pb2.TaskArtifactUpdateEvent(
                        task_id=view.id, context_id=view.context_id, artifact=artifact, last_chunk=True
                    )
            if view.status.state != state:
                state = view.status.state
                yield a2a_pb2.TaskStatusUpdateEvent(task_id=view.id, context_id=view.context_id, status=view.status)

    async def on_get_task(self, params: a2a_pb2.GetTaskRequest, context: ServerCallContext) -> a2a_pb2.Task | None:
        company_id, room_id, agent_id, _ = await self._address(params.tenant)
        task = await self._room_task(room_id, agent_id, company_id, params.id)
        return await self._view(task, params.history_length if params.HasField("history_length") else None)

    async def on_list_tasks(
        self, params: a2a_pb2.ListTasksRequest, context: ServerCallContext
    ) -> a2a_pb2.ListTasksResponse:
        company_id, room_id, agent_id, _ = await self._address(params.tenant)
        page_size = params.page_size if params.HasField("page_size") else 50
        if not 1 <= page_size <= MAX_A2A_PAGE_SIZE:
            raise InvalidParamsError(f"page_size must be between 1 and {MAX_A2A_PAGE_SIZE}, got {page_size}")
        status = _STATUS_FILTER.get(params.status, common_pb2.TASK_STATUS_OPEN)
        response = await self._room.ListTasks(
            room_pb2.RoomServiceListTasksRequest(
                room_id=room_id,
                to_agent_id=agent_id,
                status=status,
                page_size=page_size,
                page_token=params.page_token,
            ),
            timeout=self._timeout,
        )
        history_length = params.history_length if params.HasField("history_length") else 0
        tasks = []
        for task in response.tasks:
            if getattr(task, "from").company_id != company_id:
                continue
            view = await self._view(task, history_length)
            if params.status and view.status.state != params.status:
                continue
            if not params.include_artifacts:
                del view.artifacts[:]
            tasks.append(view)
        return a2a_pb2.ListTasksResponse(
            tasks=tasks, next_page_token=response.next_page_token, page_size=page_size, total_size=len(tasks)
        )

    async def on_cancel_task(self, params: a2a_pb2.CancelTaskRequest, context: ServerCallContext) -> a2a_pb2.Task:
        company_id, room_id, agent_id, _ = await self._address(params.tenant)
        task = await self._room_task(room_id, agent_id, company_id, params.id)
        if task.status != common_pb2.TASK_STATUS_OPEN:
            raise TaskNotCancelableError(
                f"task {task.task_id} is already {common_pb2.TaskStatus.Name(task.status)}: only an open task "
                "can be canceled"
            )
        self._limiter.take(company_id)
        response = await self._room.UpdateTask(
            room_pb2.RoomServiceUpdateTaskRequest(
                task_id=task.task_id,
                room_id=room_id,
                author=common_pb2.Author(kind=common_pb2.AUTHOR_KIND_PERSON, company_id=company_id, person=A2A_PERSON),
                status=common_pb2.TASK_STATUS_CANCELLED,
                dedupe_key=f"a2a:{company_id}:cancel:{task.task_id}",
            ),
            timeout=self._timeout,
        )
        return await self._view(response.task)

    async def on_get_extended_agent_card(
        self, params: a2a_pb2.GetExtendedAgentCardRequest, context: ServerCallContext
    ) -> a2a_pb2.AgentCard:
        _, room_id, _, agent = await self._address(params.tenant)
        company = await self._room.GetCompany(
            room_pb2.RoomServiceGetCompanyRequest(company_id=agent.company_id), timeout=self._timeout
        )
        return agent_card(agent, company.company.name, room_id, self._card_url())

    async def on_create_task_push_notification_config(self, params: Any, context: ServerCallContext) -> Any:
        raise PushNotificationNotSupportedError("push notifications are not supported: use SubscribeToTask")

    async def on_get_task_push_notification_config(self, params: Any, context: ServerCallContext) -> Any:
        raise PushNotificationNotSupportedError("push notifications are not supported: use SubscribeToTask")

    async def on_list_task_push_notification_configs(self, params: Any, context: ServerCallContext) -> Any:
        raise PushNotificationNotSupportedError("push notifications are not supported: use SubscribeToTask")

    async def on_delete_task_push_notification_config(self, params: Any, context: ServerCallContext) -> None:
        raise PushNotificationNotSupportedError("push notifications are not supported: use SubscribeToTask")


def _assignee_wrote(task: common_pb2.Task, update: common_pb2.TaskUpdate) -> bool:
    """Whether the task's assignee agent wrote ``update``: only its own notes are the agent's answer
    (a note by anyone else, a person or another agent, of any company, is never shown as one)."""
    return update.author.kind == common_pb2.AUTHOR_KIND_AGENT and update.author.agent_id == task.to_agent_id


def _state(task: common_pb2.Task, runs: list[common_pb2.Run]) -> a2a_pb2.TaskState:
    if task.status == common_pb2.TASK_STATUS_DONE:
        return a2a_pb2.TASK_STATE_COMPLETED
    if task.status == common_pb2.TASK_STATUS_CANCELLED:
        return a2a_pb2.TASK_STATE_CANCELED
    last = runs[-1].status if runs else common_pb2.RUN_STATUS_NOT_STARTED
    if last == common_pb2.RUN_STATUS_NOT_STARTED:  # no run has read the room yet
        return a2a_pb2.TASK_STATE_SUBMITTED
    if last == common_pb2.RUN_STATUS_PARKED:
        return a2a_pb2.TASK_STATE_INPUT_REQUIRED
    if last in (common_pb2.RUN_STATUS_FAILED, common_pb2.RUN_STATUS_TIMED_OUT):
        return a2a_pb2.TASK_STATE_FAILED
    if last == common_pb2.RUN_STATUS_SUCCEEDED:
        return a2a_pb2.TASK_STATE_INPUT_REQUIRED
    return a2a_pb2.TASK_STATE_WORKING


def agent_card(agent: common_pb2.Agent, company_name: str, room_id: str, url: str) -> a2a_pb2.AgentCard:
    """The card of one room agent: who it is, whose it is, what it does, and its gRPC interface.

    ``agent`` is as the caller's company sees it (the rule `room-agents`), so the description is the
    first line of its system prompt for its own company only; any other member reads a plain sentence
    of its name and company, as ListAgents shows them."""
    summary = agent.system_prompt.strip().splitlines()[0][:300] if agent.system_prompt.strip() else ""
    description = summary or f"{agent.name}, an agent of {company_name} in a Quayutec room"
    card = a2a_pb2.AgentCard(
        name=agent.name,
        description=description,
        version=PROTOCOL_VERSION,
        supported_interfaces=[
            a2a_pb2.AgentInterface(
                url=url,
                protocol_binding="GRPC",
                tenant=tenant_of(room_id, agent.agent_id),
                protocol_version=PROTOCOL_VERSION,
            )
        ],
        provider=a2a_pb2.AgentProvider(organization=company_name, url=url),
        capabilities=a2a_pb2.AgentCapabilities(streaming=True, push_notifications=False, extended_agent_card=True),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[
            a2a_pb2.AgentSkill(
                id="room-task",
                name="room task",
                description=f"takes a task in the room and replies in the room: {description}",
                tags=["room", "task"],
                input_modes=["text/plain"],
                output_modes=["text/plain"],
            )
        ],
    )
    card.security_schemes[SECURITY_SCHEME].http_auth_security_scheme.CopyFrom(
        a2a_pb2.HTTPAuthSecurityScheme(
            scheme="bearer",
            bearer_format="qyk_<key id>_<secret>",
            description="an API key of a member company of the room, sent as authorization: Bearer <key>",
        )
    )
    requirement = card.security_requirements.add()
    requirement.schemes[SECURITY_SCHEME].SetInParent()
    return card


class A2AGrpcHandler(GrpcHandler):
    """The SDK's gRPC servicer; our own errors (NOT_FOUND, PERMISSION_DENIED, ...) on streams end them
    with their status like the unary calls do through the error-mapping interceptor."""

    async def _handle_stream(self, request: Any, context: Any, handler_func: Any) -> AsyncIterator[Any]:
        try:
            async for item in super()._handle_stream(request, context, handler_func):
                yield item
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            code, message = status_for(exc)
            await context.abort(code, message)
