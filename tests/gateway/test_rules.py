"""The room's rules from the Gateway's door: a person of a company, with its API key. Each rule of
docs/rules.md the Gateway reaches refuses with the code the table names, and nothing is written; a
company that is not a member learns no more than NOT_FOUND. Three companies: Acme creates the room,
Globex is a member, Initech is outside it (or a member, where a third member matters)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import asyncpg
import grpc
import pytest
from google.protobuf.field_mask_pb2 import FieldMask

from quayutec.config import ROOM
from quayutec.v1 import common_pb2, gateway_pb2, room_pb2_grpc
from tests.gateway.helpers import GatewayStub, create_room, expect_error, register_agent
from tests.gateway.test_membership import invite, park
from tests.harness.channels import callers_stub
from tests.harness.gateway import join_room
from tests.harness.room import room_state

NOT_FOUND, DENIED = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED
FAILED = grpc.StatusCode.FAILED_PRECONDITION
HOLD, DENY, AUTO = common_pb2.ACTION_RIGHT_HOLD, common_pb2.ACTION_RIGHT_DENY, common_pb2.ACTION_RIGHT_AUTO
UNSET = common_pb2.ACTION_RIGHT_UNSPECIFIED
T = 10


@dataclass
class Room:
    room_id: str
    acme_agent: common_pb2.Agent
    globex_agent: common_pb2.Agent
    initech_agent: common_pb2.Agent


@pytest.fixture
async def room(acme_gw: GatewayStub, globex_gw: GatewayStub, initech_gw: GatewayStub) -> Room:
    created = await create_room(acme_gw)
    await join_room(acme_gw, globex_gw, created.room_id)
    return Room(
        created.room_id,
        await register_agent(acme_gw, "planner"),
        await register_agent(globex_gw, "writer"),
        await register_agent(initech_gw, "outsider"),
    )


@pytest.fixture
async def room_stub(room_addr: str) -> AsyncIterator[room_pb2_grpc.RoomServiceStub]:
    async with callers_stub(room_addr, ROOM.grpc_service, room_pb2_grpc.RoomServiceStub) as stub:
        yield stub


async def not_found_like(call: Awaitable[Any], twin: Awaitable[Any], real_id: str, made_up: str) -> None:
    """``call`` (on something real of another company, or a room it is not in) answers exactly as
    ``twin`` (the same call on a made-up id): NOT_FOUND, the same message but for the id."""
    first = await expect_error(NOT_FOUND, call)
    second = await expect_error(NOT_FOUND, twin)
    assert (first.details() or "").replace(real_id, "<id>") == (second.details() or "").replace(made_up, "<id>")


async def send_task(gw: GatewayStub, room_id: str, to_agent_id: str, title: str = "job") -> common_pb2.Task:
    sent = await gw.SendTask(
        gateway_pb2.SendTaskRequest(room_id=room_id, person="Ada", to_agent_id=to_agent_id, title=title), timeout=T
    )
    task: common_pb2.Task = sent.task
    return task


def update(room_id: str, task_id: str, **fields: Any) -> gateway_pb2.UpdateTaskRequest:
    return gateway_pb2.UpdateTaskRequest(room_id=room_id, task_id=task_id, person="Ivy", **fields)


async def test_member_writes(acme_gw: GatewayStub, initech_gw: GatewayStub, room: Room, pool: asyncpg.Pool) -> None:
    """Initech writes nothing in a room it is not a member of, and learns only what a made-up room says."""
    task = await send_task(acme_gw, room.room_id, room.acme_agent.agent_id)
    before = await room_state(pool)
    r, made_up = room.room_id, str(uuid.uuid4())

    def writes(room_id: str) -> list[Awaitable[Any]]:
        g = gateway_pb2
        return [
            initech_gw.PostMessage(g.PostMessageRequest(room_id=room_id, person="Ivy", body="hi"), timeout=T),
            initech_gw.SendTask(
                g.SendTaskRequest(room_id=room_id, person="Ivy", to_agent_id=room.acme_agent.agent_id, title="t"),
                timeout=T,
            ),
            initech_gw.UpdateTask(update(room_id, task.task_id, note="mine"), timeout=T),
            initech_gw.UpdateTask(update(room_id, task.task_id, status=common_pb2.TASK_STATUS_CANCELLED), timeout=T),
            initech_gw.UploadFile(
                g.UploadFileRequest(room_id=room_id, person="Ivy", name="a.txt", content=b"a"), timeout=T
            ),
        ]

    for call, twin in zip(writes(r), writes(made_up), strict=True):
        await not_found_like(call, twin, r, made_up)
    assert await room_state(pool) == before


async def test_mentions_in_room_and_assignee_in_room(acme_gw: GatewayStub, room: Room, pool: asyncpg.Pool) -> None:
    """Initech's agent (its company not a member) is neither mentioned nor sent a task, and answers as
    an unknown agent does."""
    before = await room_state(pool)
    outsider, made_up = room.initech_agent.agent_id, str(uuid.uuid4())

    def post(agent_id: str) -> Awaitable[Any]:
        request = gateway_pb2.PostMessageRequest(
            room_id=room.room_id, person="Ada", body="@you", mention_agent_ids=[room.globex_agent.agent_id, agent_id]
        )
        call: Awaitable[Any] = acme_gw.PostMessage(request, timeout=T)
        return call

    await not_found_like(post(outsider), post(made_up), outsider, made_up)
    await not_found_like(
        send_task(acme_gw, room.room_id, outsider), send_task(acme_gw, room.room_id, made_up), outsider, made_up
    )
    assert await room_state(pool) == before


async def test_task_sender_or_assignee(
    acme_gw: GatewayStub, globex_gw: GatewayStub, initech_gw: GatewayStub, room: Room, pool: asyncpg.Pool
) -> None:
    """A task from Acme to its own agent and one from Acme to Initech's agent: Globex, a member, may
    neither note nor close them; Acme (the sender) and Initech (the assignee's company) may."""
    await join_room(acme_gw, initech_gw, room.room_id)
    acme_to_acme = await send_task(acme_gw, room.room_id, room.acme_agent.agent_id)
    acme_to_initech = await send_task(acme_gw, room.room_id, room.initech_agent.agent_id)
    before = await room_state(pool)
    for task in (acme_to_acme, acme_to_initech):
        for fields in ({"note": "Globex was here"}, {"status": common_pb2.TASK_STATUS_CANCELLED}):
            err = await expect_error(DENIED, globex_gw.UpdateTask(update(room.room_id, task.task_id, **fields)))
            assert "only the company that sent task" in (err.details() or "")
    assert await room_state(pool) == before
    noted = await initech_gw.UpdateTask(update(room.room_id, acme_to_initech.task_id, note="on it"), timeout=T)
    assert [u.note for u in noted.task.updates] == ["on it"]
    closed = await acme_gw.UpdateTask(
        update(room.room_id, acme_to_initech.task_id, status=common_pb2.TASK_STATUS_DONE), timeout=T
    )
    assert closed.task.status == common_pb2.TASK_STATUS_DONE


async def test_approval_owner_answers_another_companys_token_as_a_made_up_one(
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
    initech_gw: GatewayStub,
    room: Room,
    room_stub: room_pb2_grpc.RoomServiceStub,
    pool: asyncpg.Pool,
) -> None:
    """No existence oracle: Globex (a member) and Initech (outside) get for Acme's real token exactly the
    answer of a made-up one, for any index and either decision, pending or completed."""
    token = await park(room_stub, room.acme_agent, room.room_id)
    made_up = str(uuid.uuid4())

    def decide(gw: GatewayStub, t: str, index: int, approve: bool) -> Awaitable[Any]:
        request = gateway_pb2.DecideApprovalRequest(token=t, index=index, person="Eve", approve=approve)
        call: Awaitable[Any] = gw.DecideApproval(request, timeout=T)
        return call

    async def probe() -> None:
        for gw in (globex_gw, initech_gw):
            for index in (0, 1, 5):
                for approve in (True, False):
                    real, twin = decide(gw, token, index, approve), decide(gw, made_up, index, approve)
                    await not_found_like(real, twin, token, made_up)

    before = await room_state(pool)
    await probe()
    assert await room_state(pool) == before
    await decide(acme_gw, token, 0, True)
    assert (await decide(acme_gw, token, 1, False)).completed
    await probe()  # completed: still no different from a made-up token


async def test_membership_rules(
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
    initech_gw: GatewayStub,
    room: Room,
    pool: asyncpg.Pool,
) -> None:
    acme_id = (await acme_gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=T)).company.company_id
    globex_id = (await globex_gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=T)).company.company_id
    initech_id = (await initech_gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=T)).company.company_id
    invitation = await invite(acme_gw, room.room_id, initech_id)
    before = await room_state(pool)
    g, r, made_up = gateway_pb2, room.room_id, str(uuid.uuid4())
    # member-manages: Initech (invited, not a member) invites, leaves and removes nothing.
    for call, twin in [
        (
            initech_gw.InviteCompany(g.InviteCompanyRequest(room_id=r, company_id=globex_id), timeout=T),
            initech_gw.InviteCompany(g.InviteCompanyRequest(room_id=made_up, company_id=globex_id), timeout=T),
        ),
        (
            initech_gw.LeaveRoom(g.LeaveRoomRequest(room_id=r), timeout=T),
            initech_gw.LeaveRoom(g.LeaveRoomRequest(room_id=made_up), timeout=T),
        ),
        (
            initech_gw.RemoveMember(g.RemoveMemberRequest(room_id=r, company_id=globex_id), timeout=T),
            initech_gw.RemoveMember(g.RemoveMemberRequest(room_id=made_up, company_id=globex_id), timeout=T),
        ),
    ]:
        await not_found_like(call, twin, r, made_up)
    # invitee-answers: Initech's invitation is Initech's to answer; to Globex it is a made-up one.
    i = invitation.invitation_id
    await not_found_like(
        globex_gw.AcceptInvitation(g.AcceptInvitationRequest(invitation_id=i), timeout=T),
        globex_gw.AcceptInvitation(g.AcceptInvitationRequest(invitation_id=made_up), timeout=T),
        i,
        made_up,
    )
    await not_found_like(
        globex_gw.DeclineInvitation(g.DeclineInvitationRequest(invitation_id=i), timeout=T),
        globex_gw.DeclineInvitation(g.DeclineInvitationRequest(invitation_id=made_up), timeout=T),
        i,
        made_up,
    )
    # creator-stays, creator-removes, creator-not-removed.
    await expect_error(FAILED, acme_gw.LeaveRoom(g.LeaveRoomRequest(room_id=r), timeout=T), "creator")
    await expect_error(
        DENIED, globex_gw.RemoveMember(g.RemoveMemberRequest(room_id=r, company_id=acme_id), timeout=T), "created"
    )
    await expect_error(
        FAILED, acme_gw.RemoveMember(g.RemoveMemberRequest(room_id=r, company_id=acme_id), timeout=T), "itself"
    )
    assert await room_state(pool) == before


async def test_own_agent_rights(acme_gw: GatewayStub, globex_gw: GatewayStub, room: Room, pool: asyncpg.Pool) -> None:
    await acme_gw.SetAgentRights(
        gateway_pb2.SetAgentRightsRequest(agent_id=room.acme_agent.agent_id, remember=HOLD), timeout=T
    )
    before = await room_state(pool)
    real, made_up = room.acme_agent.agent_id, str(uuid.uuid4())
    await not_found_like(
        globex_gw.SetAgentRights(gateway_pb2.SetAgentRightsRequest(agent_id=real, remember=AUTO), timeout=T),
        globex_gw.SetAgentRights(gateway_pb2.SetAgentRightsRequest(agent_id=made_up, remember=AUTO), timeout=T),
        real,
        made_up,
    )
    await not_found_like(
        globex_gw.GetAgentRights(gateway_pb2.GetAgentRightsRequest(agent_id=real), timeout=T),
        globex_gw.GetAgentRights(gateway_pb2.GetAgentRightsRequest(agent_id=made_up), timeout=T),
        real,
        made_up,
    )
    assert await room_state(pool) == before


def rights(r: common_pb2.AgentRights) -> tuple[int, ...]:
    return (r.remember, r.create_task, r.update_task, r.close_task, r.cross_company_task)


async def test_rights_set_with_a_mask_changes_only_what_it_names(acme_gw: GatewayStub, room: Room) -> None:
    """`rights set --remember hold` then `rights set --create-task hold` leaves both held (issue 21 #5)."""
    agent_id = room.acme_agent.agent_id
    for field in ("remember", "create_task"):
        request = gateway_pb2.SetAgentRightsRequest(agent_id=agent_id, update_mask=FieldMask(paths=[field]))
        setattr(request, field, HOLD)
        await acme_gw.SetAgentRights(request, timeout=T)
    got = await acme_gw.GetAgentRights(gateway_pb2.GetAgentRightsRequest(agent_id=agent_id), timeout=T)
    assert rights(got.agent) == (HOLD, HOLD, UNSET, UNSET, UNSET)
    assert rights(got.effective) == (HOLD, HOLD, AUTO, AUTO, AUTO)
    # Without a mask an older client replaces them all, as it always did.
    replaced = await acme_gw.SetAgentRights(
        gateway_pb2.SetAgentRightsRequest(agent_id=agent_id, close_task=DENY), timeout=T
    )
    assert rights(replaced.rights) == (UNSET, UNSET, UNSET, DENY, UNSET)
    await expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        acme_gw.SetAgentRights(
            gateway_pb2.SetAgentRightsRequest(remember=HOLD, update_mask=FieldMask(paths=["everything"])), timeout=T
        ),
        "update_mask",
    )
