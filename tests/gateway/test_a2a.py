"""The A2A door, driven as another company would: the official a2a-sdk gRPC client against a real
Gateway + Room + Runtime + stand-in model on loopback."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.client.auth.credentials import CredentialService
from a2a.client.auth.interceptor import AuthInterceptor
from a2a.client.client import Client
from a2a.client.client_factory import minimal_agent_card
from a2a.types import a2a_pb2
from a2a.utils.errors import (
    A2AError,
    ContentTypeNotSupportedError,
    PushNotificationNotSupportedError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from quayutec.telemetry import SpanCapture
from quayutec.v1 import common_pb2, gateway_pb2
from services.gateway.a2a import SECURITY_SCHEME, SERVICE_NAME, tenant_of
from services.runtime.standin import ScriptedReply, StandinProvider, asked
from tests.gateway.helpers import GatewayStub, create_room, register_agent
from tests.gateway.test_membership import invite
from tests.harness.gateway import CompanyKey, authed_gateway, running_gateway
from tests.harness.otlp import Collector, Got, flushed_until
from tests.harness.runtime import running_runtime

A2A_SERVICE = SERVICE_NAME
FAST = {"QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS": "0.02", "QUAYUTEC_GATEWAY_POST_RATE": "0"}
# The prompt's line of an open task: "- task <id>: <title>: <body>" (our titles carry no colon).
TASK_LINE = re.compile(r"task ([0-9a-f-]{36}): ([^:\n]*):")


class _Key(CredentialService):
    """One company's API key for the card's bearer scheme, the way an A2A client holds credentials."""

    def __init__(self, secret: str) -> None:
        self._secret = secret

    async def get_credentials(self, security_scheme_name: str, context: ClientCallContext | None) -> str | None:
        return self._secret if security_scheme_name == SECURITY_SCHEME else None


def _factory(**config: Any) -> ClientFactory:
    return ClientFactory(
        ClientConfig(
            supported_protocol_bindings=["GRPC"],
            grpc_channel_factory=lambda url: grpc.aio.insecure_channel(url),
            **config,
        )
    )


async def send_once(
    card: a2a_pb2.AgentCard, secret: str, message: a2a_pb2.Message, *, wait: bool, deadline: float = 30
) -> a2a_pb2.Task:
    """SendMessage without a stream: non-blocking (the client's polling mode) or blocking."""
    client = _factory(streaming=False, polling=not wait).create(card, interceptors=[AuthInterceptor(_Key(secret))])
    try:
        request = a2a_pb2.SendMessageRequest(message=message)
        responses = [r async for r in client.send_message(request, context=ClientCallContext(timeout=deadline))]
    finally:
        await client.close()
    assert len(responses) == 1 and responses[0].HasField("task"), responses
    return responses[0].task


def _bearer(secret: str) -> ClientCallContext:
    return ClientCallContext(service_parameters={"authorization": f"Bearer {secret}"})


@asynccontextmanager
async def a2a_client(addr: str, tenant: str, secret: str | None) -> AsyncIterator[tuple[Client, a2a_pb2.AgentCard]]:
    """Discover the agent's card over gRPC (the authenticated extended card), then a client built from it."""
    bootstrap = minimal_agent_card(addr, ["GRPC"])
    bootstrap.supported_interfaces[0].tenant = tenant
    first = _factory().create(bootstrap)
    try:
        card = await first.get_extended_agent_card(
            a2a_pb2.GetExtendedAgentCardRequest(), context=_bearer(secret) if secret else None
        )
    finally:
        await first.close()
    client = _factory().create(card, interceptors=[AuthInterceptor(_Key(secret or ""))])
    try:
        yield client, card
    finally:
        await client.close()


def _message(text: str, message_id: str | None = None) -> a2a_pb2.Message:
    return a2a_pb2.Message(
        message_id=message_id or str(uuid.uuid4()), role=a2a_pb2.ROLE_USER, parts=[a2a_pb2.Part(text=text)]
    )


def _responder(body: Mapping[str, Any]) -> ScriptedReply | None:
    """The stand-in agent: a task whose title says "close" is answered and closed done; others answered."""
    text = asked(body)
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        for match in TASK_LINE.finditer(content if isinstance(content, str) else str(content)):
            task_id, title = match.group(1), match.group(2)
            if "close" in title:
                return ScriptedReply(
                    f"done: {title}",
                    tool_calls=(
                        {"name": "close_task", "arguments": {"task_id": task_id, "status": "done", "note": ""}},
                    ),
                )
    return ScriptedReply(f"answer to {text}")


async def _runs_for(gw: GatewayStub, agent_id: str, task_id: str) -> list[common_pb2.Run]:
    runs = (await gw.ListRuns(gateway_pb2.ListRunsRequest(agent_id=agent_id), timeout=10)).runs
    return [r for r in runs if r.wake_source_id == task_id]


async def test_another_company_sends_follows_lists_and_cancels_over_a2a(
    database_url: str,
    room_addr: str,
    claims_addr: str,
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
    globex: CompanyKey,
) -> None:
    room = await create_room(acme_gw)
    agent = await register_agent(acme_gw, "helper")
    invited = await invite(acme_gw, room.room_id, globex.company_id)
    await globex_gw.AcceptInvitation(
        gateway_pb2.AcceptInvitationRequest(invitation_id=invited.invitation_id), timeout=10
    )
    tenant = tenant_of(room.room_id, agent.agent_id)
    with StandinProvider() as standin:
        standin.set_responder("claude-test", _responder)
        async with (
            running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as runtime_addr,
            running_gateway(database_url, room_addr, runtime_addr, **FAST) as addr,
            a2a_client(addr, tenant, globex.secret) as (client, card),
        ):
            # The card: the agent, its owning company, the bearer scheme and the interface to call.
            assert card.name == "helper" and card.provider.organization == "Acme"
            assert card.security_schemes[SECURITY_SCHEME].http_auth_security_scheme.scheme == "bearer"
            assert [(i.protocol_binding, i.tenant, i.url) for i in card.supported_interfaces] == [
                ("GRPC", tenant, addr)
            ]
            assert card.capabilities.streaming and not card.capabilities.push_notifications

            # Send over a stream and see the reply arrive as task updates, to completion.
            request = a2a_pb2.SendMessageRequest(message=_message("please close the quarterly report"))
            events = [event async for event in client.send_message(request)]
            assert events[0].HasField("task") and events[0].task.status.state == a2a_pb2.TASK_STATE_SUBMITTED
            task_id = events[0].task.id
            artifacts = [e.artifact_update for e in events if e.HasField("artifact_update")]
            statuses = [e.status_update.status.state for e in events if e.HasField("status_update")]
            assert [a.artifact.parts[0].text for a in artifacts] == ["done: please close the quarterly report"]
            assert statuses[-1] == a2a_pb2.TASK_STATE_COMPLETED, statuses

            # Retrying the same messageId (non-blocking) gets the same task; the agent was woken once.
            again = _message("please close the quarterly report", request.message.message_id)
            retried = await send_once(card, globex.secret, again, wait=False)
            assert retried.id == task_id and retried.status.state == a2a_pb2.TASK_STATE_COMPLETED
            assert len(await _runs_for(acme_gw, agent.agent_id, task_id)) == 1

            # GetTask: the state, the request and the agent's reply as history and artifact.
            got = await client.get_task(a2a_pb2.GetTaskRequest(id=task_id))
            assert got.status.state == a2a_pb2.TASK_STATE_COMPLETED
            assert [(m.role, m.parts[0].text) for m in got.history] == [
                (a2a_pb2.ROLE_USER, "please close the quarterly report"),
                (a2a_pb2.ROLE_AGENT, "done: please close the quarterly report"),
            ]
            assert [a.parts[0].text for a in got.artifacts] == ["done: please close the quarterly report"]
            # The room sees the same task, from Globex to Acme's agent.
            room_task = (
                await acme_gw.GetTask(gateway_pb2.GetTaskRequest(room_id=room.room_id, task_id=task_id), timeout=10)
            ).task
            assert getattr(room_task, "from").company_id == globex.company_id
            assert room_task.status == common_pb2.TASK_STATUS_DONE

            # A blocking send returns once the agent has answered (it leaves working); then cancel it.
            blocking = await send_once(card, globex.secret, _message("look at the numbers"), wait=True, deadline=60)
            open_id = blocking.id
            assert blocking.status.state == a2a_pb2.TASK_STATE_INPUT_REQUIRED, blocking.status
            assert blocking.status.message.parts[0].text == "answer to look at the numbers"
            # A streamed send ends when the agent has answered without closing the task (input-required).
            asked_again = [e async for e in client.send_message(a2a_pb2.SendMessageRequest(message=_message("why")))]
            assert [a.artifact_update.artifact.parts[0].text for a in asked_again if a.HasField("artifact_update")] == [
                "answer to why"
            ]
            assert asked_again[-1].status_update.status.state == a2a_pb2.TASK_STATE_INPUT_REQUIRED, asked_again[-1]
            listed = await client.list_tasks(a2a_pb2.ListTasksRequest(include_artifacts=True))
            assert {t.id for t in listed.tasks} == {task_id, open_id, asked_again[0].task.id}
            only_done = await client.list_tasks(a2a_pb2.ListTasksRequest(status=a2a_pb2.TASK_STATE_COMPLETED))
            assert [t.id for t in only_done.tasks] == [task_id]
            canceled = await client.cancel_task(a2a_pb2.CancelTaskRequest(id=open_id))
            assert canceled.status.state == a2a_pb2.TASK_STATE_CANCELED
            with pytest.raises(TaskNotCancelableError):
                await client.cancel_task(a2a_pb2.CancelTaskRequest(id=open_id))
            with pytest.raises(UnsupportedOperationError, match="already"):
                async for _ in client.subscribe(a2a_pb2.SubscribeToTaskRequest(id=task_id)):
                    pass

            # SubscribeToTask follows a task sent without waiting, to its end.
            sent = await send_once(card, globex.secret, _message("close the books"), wait=False)
            followed = [e async for e in client.subscribe(a2a_pb2.SubscribeToTaskRequest(id=sent.id))]
            assert followed[0].HasField("task") and followed[0].task.id == sent.id
            assert followed[-1].status_update.status.state == a2a_pb2.TASK_STATE_COMPLETED, followed[-1]
    assert len(standin.requests("claude-test")) == 4


async def test_each_refusal_reads_as_a2a_and_grpc_define_it(
    database_url: str,
    room_addr: str,
    acme: CompanyKey,
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
    globex: CompanyKey,
    initech: CompanyKey,
    initech_gw: GatewayStub,
) -> None:
    room = await create_room(acme_gw)
    agent = await register_agent(acme_gw, "helper")
    outsider_agent = await register_agent(initech_gw, "outsider")
    invited = await invite(acme_gw, room.room_id, globex.company_id)
    await globex_gw.AcceptInvitation(
        gateway_pb2.AcceptInvitationRequest(invitation_id=invited.invitation_id), timeout=10
    )
    tenant = tenant_of(room.room_id, agent.agent_id)
    async with running_gateway(
        database_url, room_addr, "127.0.0.1:9", QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false", **FAST
    ) as addr:
        # No key, and a company that is not a member of the room.
        with pytest.raises(A2AError, match="UNAUTHENTICATED"):
            async with a2a_client(addr, tenant, None):
                pass
        with pytest.raises(A2AError, match=r"NOT_FOUND.*room"):
            async with a2a_client(addr, tenant, initech.secret):
                pass
        # An agent whose company is not in the room reads like an unknown one.
        unknown = tenant_of(room.room_id, str(uuid.uuid4()))
        for missing in (unknown, tenant_of(room.room_id, outsider_agent.agent_id)):
            with pytest.raises(A2AError, match=r"NOT_FOUND.*agent not found in this room"):
                async with a2a_client(addr, missing, acme.secret):
                    pass
        with pytest.raises(A2AError, match=r"INVALID_ARGUMENT.*tenant"):
            async with a2a_client(addr, "helper", globex.secret):
                pass

        async with a2a_client(addr, tenant, globex.secret) as (client, card):
            sent = await send_once(card, globex.secret, _message("a task for Acme's helper"), wait=False)
            assert sent.status.state == a2a_pb2.TASK_STATE_SUBMITTED
            with pytest.raises(TaskNotFoundError):
                await client.get_task(a2a_pb2.GetTaskRequest(id=str(uuid.uuid4())))
            with pytest.raises(TaskNotFoundError):
                await client.get_task(a2a_pb2.GetTaskRequest(id="not-a-task"))
            image = a2a_pb2.Message(
                message_id=str(uuid.uuid4()),
                role=a2a_pb2.ROLE_USER,
                parts=[a2a_pb2.Part(raw=b"\x89PNG", media_type="image/png")],
            )
            with pytest.raises(ContentTypeNotSupportedError, match="only text parts"):
                await send_once(card, globex.secret, image, wait=False)
            follow_up = _message("and one more thing")
            follow_up.task_id = sent.id
            with pytest.raises(UnsupportedOperationError, match="continuing"):
                await send_once(card, globex.secret, follow_up, wait=False)
            with pytest.raises(PushNotificationNotSupportedError):
                await client.create_task_push_notification_config(
                    a2a_pb2.TaskPushNotificationConfig(task_id=sent.id, url="http://127.0.0.1:9/hook")
                )

        # Another member company (here the agent's owner) does not see Globex's task through A2A.
        async with a2a_client(addr, tenant, acme.secret) as (acme_client, _):
            with pytest.raises(TaskNotFoundError):
                await acme_client.get_task(a2a_pb2.GetTaskRequest(id=sent.id))
            with pytest.raises(TaskNotFoundError):
                await acme_client.cancel_task(a2a_pb2.CancelTaskRequest(id=sent.id))
            assert list((await acme_client.list_tasks(a2a_pb2.ListTasksRequest())).tasks) == []

        # The raw status codes the A2A gRPC binding names, as any gRPC client sees them.
        async with grpc.aio.insecure_channel(addr) as channel:
            from a2a.types import a2a_pb2_grpc

            stub = a2a_pb2_grpc.A2AServiceStub(channel)  # type: ignore[no-untyped-call]
            metadata = (("authorization", f"Bearer {globex.secret}"),)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetTask(a2a_pb2.GetTaskRequest(tenant=tenant, id=str(uuid.uuid4())), metadata=metadata)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.CancelTask(a2a_pb2.CancelTaskRequest(tenant=tenant, id=sent.id), metadata=metadata)
                await stub.CancelTask(a2a_pb2.CancelTaskRequest(tenant=tenant, id=sent.id), metadata=metadata)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # A page token we never handed out is the caller's error, never INTERNAL.
            for forged in (str(2**63), "not-a-token"):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ListTasks(a2a_pb2.ListTasksRequest(tenant=tenant, page_token=forged), metadata=metadata)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()


async def test_a2a_sends_count_against_the_company_rate_limit_and_reflection_lists_the_service(
    database_url: str, room_addr: str, acme_gw: GatewayStub, acme: CompanyKey
) -> None:
    room = await create_room(acme_gw)
    agent = await register_agent(acme_gw, "helper")
    async with running_gateway(
        database_url,
        room_addr,
        "127.0.0.1:9",
        QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false",
        QUAYUTEC_GATEWAY_POST_RATE="0.001",
        QUAYUTEC_GATEWAY_POST_BURST="1",
    ) as addr:
        async with a2a_client(addr, tenant_of(room.room_id, agent.agent_id), acme.secret) as (_, card):
            await send_once(card, acme.secret, _message("the first one"), wait=False)
            with pytest.raises(A2AError, match="RESOURCE_EXHAUSTED"):
                await send_once(card, acme.secret, _message("one too many"), wait=False)

        def services() -> list[str]:
            from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
                ProtoReflectionDescriptorDatabase,
            )

            with grpc.insecure_channel(addr) as channel:
                return list(ProtoReflectionDescriptorDatabase(channel).get_services())

        assert "lf.a2a.v1.A2AService" in await asyncio.to_thread(services)


async def test_a2a_spans_name_the_task_and_the_message_id(
    collector: tuple[Collector, SpanCapture],
    database_url: str,
    room_addr: str,
    claims_addr: str,
    acme: CompanyKey,
) -> None:
    received, export = collector
    with StandinProvider() as standin:
        standin.set_responder("claude-test", _responder)
        async with (
            running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as runtime_addr,
            running_gateway(database_url, room_addr, runtime_addr, **FAST) as addr,
            authed_gateway(addr, acme.secret) as gw,
        ):
            room = await create_room(gw)
            agent = await register_agent(gw, "helper")
            async with a2a_client(addr, tenant_of(room.room_id, agent.agent_id), acme.secret) as (client, card):
                message = _message("please close the quarterly report")
                sent = await send_once(card, acme.secret, message, wait=False)
                await client.get_task(a2a_pb2.GetTaskRequest(id=sent.id))

            def seen(spans: list[Got]) -> bool:
                return any(s.name == f"{A2A_SERVICE}/GetTask" for s in spans)

            spans = await flushed_until(received, export, seen)
    servers = {s.name: s for s in spans if s.span.kind == Span.SPAN_KIND_SERVER and s.name.startswith(A2A_SERVICE)}
    send = servers[f"{A2A_SERVICE}/SendMessage"]
    assert send.attr("quayutec.task_id") == sent.id
    assert send.attr("quayutec.a2a.message_id") == message.message_id
    assert servers[f"{A2A_SERVICE}/GetTask"].attr("quayutec.task_id") == sent.id


async def test_an_archived_room_refuses_a2a_tasks_and_keeps_them_readable(
    database_url: str, room_addr: str, acme_gw: GatewayStub, globex_gw: GatewayStub, globex: CompanyKey
) -> None:
    """Issue 49: archiving is the Room's rule `room-open`, for the A2A door as for the Gateway's API."""
    room = await create_room(acme_gw, "archived over a2a")
    agent = await register_agent(acme_gw, "helper")
    invited = await invite(acme_gw, room.room_id, globex.company_id)
    await globex_gw.AcceptInvitation(
        gateway_pb2.AcceptInvitationRequest(invitation_id=invited.invitation_id), timeout=10
    )
    tenant = tenant_of(room.room_id, agent.agent_id)
    async with running_gateway(
        database_url, room_addr, "127.0.0.1:9", QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false", **FAST
    ) as addr:
        async with a2a_client(addr, tenant, globex.secret) as (_, card):
            sent = await send_once(card, globex.secret, _message("before the archiving"), wait=False)
        await acme_gw.ArchiveRoom(gateway_pb2.ArchiveRoomRequest(room_id=room.room_id), timeout=10)
        async with grpc.aio.insecure_channel(addr) as channel:
            from a2a.types import a2a_pb2_grpc

            stub = a2a_pb2_grpc.A2AServiceStub(channel)  # type: ignore[no-untyped-call]
            metadata = (("authorization", f"Bearer {globex.secret}"),)
            request = a2a_pb2.SendMessageRequest(tenant=tenant, message=_message("after it"))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SendMessage(request, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "is archived" in (err.value.details() or "")
            got = await stub.GetTask(a2a_pb2.GetTaskRequest(tenant=tenant, id=sent.id), metadata=metadata)
            assert got.id == sent.id
    tasks = await acme_gw.ListTasks(gateway_pb2.ListTasksRequest(room_id=room.room_id), timeout=10)
    assert [t.title for t in tasks.tasks] == ["before the archiving"]
