"""Trust between companies at the public door: room membership, revoked keys, rate limits, outages."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import grpc

from quayutec.v1 import common_pb2, gateway_pb2
from services.gateway.auth import create_api_key, revoke_api_key
from tests.gateway.conftest import NOWHERE
from tests.gateway.helpers import GatewayStub, create_room, expect_error, register_agent
from tests.harness.gateway import CompanyKey, authed_gateway, make_company, running_gateway

NOT_FOUND = grpc.StatusCode.NOT_FOUND


def room_calls(gw: GatewayStub, room_id: str, agent_id: str, task_id: str) -> dict[str, Callable[[], Awaitable[Any]]]:
    """Every room-scoped RPC with an otherwise valid request for ``room_id``."""
    g = gateway_pb2
    return {
        "InviteCompany": lambda: gw.InviteCompany(
            g.InviteCompanyRequest(room_id=room_id, company_id=str(uuid.uuid4())), timeout=10
        ),
        "ListMembers": lambda: gw.ListMembers(g.ListMembersRequest(room_id=room_id), timeout=10),
        "PostMessage": lambda: gw.PostMessage(
            g.PostMessageRequest(room_id=room_id, person="Eve", body="hi"), timeout=10
        ),
        "ListMessages": lambda: gw.ListMessages(g.ListMessagesRequest(room_id=room_id), timeout=10),
        "SendTask": lambda: gw.SendTask(
            g.SendTaskRequest(room_id=room_id, person="Eve", to_agent_id=agent_id, title="t"), timeout=10
        ),
        "UpdateTask": lambda: gw.UpdateTask(
            g.UpdateTaskRequest(room_id=room_id, task_id=task_id, person="Eve", note="n"), timeout=10
        ),
        "ListTasks": lambda: gw.ListTasks(g.ListTasksRequest(room_id=room_id), timeout=10),
        "GetTask": lambda: gw.GetTask(g.GetTaskRequest(room_id=room_id, task_id=task_id), timeout=10),
        "ListMemory": lambda: gw.ListMemory(g.ListMemoryRequest(room_id=room_id), timeout=10),
        "UploadFile": lambda: gw.UploadFile(
            g.UploadFileRequest(room_id=room_id, person="Eve", name="a.txt", content=b"hello"), timeout=10
        ),
        "ListFiles": lambda: gw.ListFiles(g.ListFilesRequest(room_id=room_id), timeout=10),
        "SearchPassages": lambda: gw.SearchPassages(g.SearchPassagesRequest(room_id=room_id, query="x"), timeout=10),
        "LeaveRoom": lambda: gw.LeaveRoom(g.LeaveRoomRequest(room_id=room_id), timeout=10),
        "RemoveMember": lambda: gw.RemoveMember(
            g.RemoveMemberRequest(room_id=room_id, company_id=str(uuid.uuid4())), timeout=10
        ),
    }


async def test_a_company_outside_a_room_gets_not_found_on_every_room_rpc(
    acme_gw: GatewayStub, globex_gw: GatewayStub
) -> None:
    room = await create_room(acme_gw)
    agent = await register_agent(acme_gw)
    task = await acme_gw.SendTask(
        gateway_pb2.SendTaskRequest(room_id=room.room_id, person="Ada", to_agent_id=agent.agent_id, title="secret"),
        timeout=10,
    )
    missing_id = str(uuid.uuid4())
    real = room_calls(globex_gw, room.room_id, agent.agent_id, task.task.task_id)
    missing = room_calls(globex_gw, missing_id, agent.agent_id, task.task.task_id)
    malformed = room_calls(globex_gw, "../etc/passwd", agent.agent_id, task.task.task_id)
    assert len(real) == 14
    for name, call in real.items():
        err = await expect_error(NOT_FOUND, call(), "room")
        # Indistinguishable from a room that does not exist, bar the id it names.
        other = await expect_error(NOT_FOUND, missing[name]())
        assert (err.details() or "").replace(room.room_id, "ID") == (other.details() or "").replace(missing_id, "ID")
        await expect_error(NOT_FOUND, malformed[name](), "room")
    # Nothing was written by the outsider.
    messages = await acme_gw.ListMessages(gateway_pb2.ListMessagesRequest(room_id=room.room_id), timeout=10)
    assert not messages.messages
    assert not (await globex_gw.ListRooms(gateway_pb2.ListRoomsRequest(), timeout=10)).rooms


async def test_a_revoked_key_stops_working_at_once(gateway_addr: str, acme: CompanyKey, pool: asyncpg.Pool) -> None:
    async with authed_gateway(gateway_addr, acme.secret) as gw:
        assert (await gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)).company.company_id == acme.company_id
        assert await revoke_api_key(pool, acme.key_id)
        await expect_error(
            grpc.StatusCode.UNAUTHENTICATED, gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10), "revoked"
        )
        await expect_error(grpc.StatusCode.UNAUTHENTICATED, gw.ListRooms(gateway_pb2.ListRoomsRequest(), timeout=10))
    # Another key of the same company still works.
    _, secret = await create_api_key(pool, acme.company_id, "second")
    async with authed_gateway(gateway_addr, secret) as gw:
        assert (await gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)).company.company_id == acme.company_id


async def test_a_company_cannot_pose_as_another(acme_gw: GatewayStub, globex: CompanyKey) -> None:
    # The Author is built from the key's company; a request has no field to name another company.
    room = await create_room(acme_gw)
    posted = await acme_gw.PostMessage(
        gateway_pb2.PostMessageRequest(room_id=room.room_id, person=f"{globex.name} CEO", body="trust me"), timeout=10
    )
    assert posted.message.author.company_id != globex.company_id
    assert posted.message.author.kind == common_pb2.AUTHOR_KIND_PERSON


async def test_rate_limit_answers_resource_exhausted_with_retry_after(database_url: str, room_addr: str) -> None:
    acme = await make_company(database_url, room_addr, "Acme")
    globex = await make_company(database_url, room_addr, "Globex")
    async with (
        running_gateway(
            database_url,
            room_addr,
            NOWHERE,
            QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false",
            QUAYUTEC_GATEWAY_POST_RATE="0.01",
            QUAYUTEC_GATEWAY_POST_BURST="3",
        ) as addr,
        authed_gateway(addr, acme.secret) as acme_gw,
        authed_gateway(addr, globex.secret) as globex_gw,
    ):
        room = await create_room(acme_gw)
        post = gateway_pb2.PostMessageRequest(room_id=room.room_id, person="Ada", body="hi")
        for _ in range(3):
            await acme_gw.PostMessage(post, timeout=10)
        err = await expect_error(grpc.StatusCode.RESOURCE_EXHAUSTED, acme_gw.PostMessage(post, timeout=10), "retry")
        trailers = dict(err.trailing_metadata() or ())
        assert int(trailers["retry-after-ms"]) > 0
        # The other posting RPCs share the bucket; reads do not.
        await expect_error(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            acme_gw.UploadFile(
                gateway_pb2.UploadFileRequest(room_id=room.room_id, person="Ada", name="a", content=b"x"), timeout=10
            ),
        )
        await acme_gw.ListMessages(gateway_pb2.ListMessagesRequest(room_id=room.room_id), timeout=10)
        # Another company has its own bucket.
        other_room = await create_room(globex_gw)
        await globex_gw.PostMessage(
            gateway_pb2.PostMessageRequest(room_id=other_room.room_id, person="Bob", body="hi"), timeout=10
        )


async def test_room_unreachable_is_unavailable(database_url: str, pool: asyncpg.Pool) -> None:
    _, secret = await create_api_key(pool, str(uuid.uuid4()), "")
    async with (
        running_gateway(database_url, NOWHERE, NOWHERE, QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false") as addr,
        authed_gateway(addr, secret) as gw,
    ):
        await expect_error(grpc.StatusCode.UNAVAILABLE, gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10))
