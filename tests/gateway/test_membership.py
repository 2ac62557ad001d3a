"""Room membership by consent through the public door: invite, accept or decline, leave, remove.

A company that has not accepted, or has left or been removed, sees nothing of the room, and
nothing of its agents is woken or acted on there.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import grpc
import pytest

from quayutec.v1 import common_pb2, gateway_pb2, room_pb2, room_pb2_grpc, runtime_pb2, runtime_pb2_grpc
from services.runtime.standin import StandinProvider
from tests.gateway.helpers import GatewayStub, create_room, eventually, expect_error, register_agent
from tests.gateway.test_trust import room_calls
from tests.harness.channels import service_channel
from tests.harness.gateway import CompanyKey, join_room, running_gateway
from tests.harness.runtime import running_runtime

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
EXISTS = grpc.StatusCode.ALREADY_EXISTS
DENIED = grpc.StatusCode.PERMISSION_DENIED
FAILED = grpc.StatusCode.FAILED_PRECONDITION
PENDING, ACCEPTED, DECLINED = (
    common_pb2.INVITATION_STATUS_PENDING,
    common_pb2.INVITATION_STATUS_ACCEPTED,
    common_pb2.INVITATION_STATUS_DECLINED,
)
FAST = {"QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS": "0.02", "QUAYUTEC_GATEWAY_POST_RATE": "0"}


@pytest.fixture
async def room_stub(room_addr: str) -> AsyncIterator[room_pb2_grpc.RoomServiceStub]:
    async with service_channel(room_addr, "runtime") as channel:
        yield room_pb2_grpc.RoomServiceStub(channel)


async def invite(gw: GatewayStub, room_id: str, company_id: str) -> common_pb2.Invitation:
    response = await gw.InviteCompany(
        gateway_pb2.InviteCompanyRequest(room_id=room_id, company_id=company_id), timeout=10
    )
    invitation: common_pb2.Invitation = response.invitation
    return invitation


async def invitations(
    gw: GatewayStub, status: common_pb2.InvitationStatus.ValueType = PENDING
) -> list[common_pb2.Invitation]:
    response = await gw.ListInvitations(gateway_pb2.ListInvitationsRequest(status=status), timeout=10)
    return list(response.invitations)


def mention(room_id: str, agent_id: str) -> gateway_pb2.PostMessageRequest:
    return gateway_pb2.PostMessageRequest(room_id=room_id, person="Ada", body="@you", mention_agent_ids=[agent_id])


async def wakes_of(pool: asyncpg.Pool, agent_id: str, kinds: tuple[str, ...] = ("message", "task")) -> int:
    """How many wakes of these kinds were ever recorded for the agent."""
    sql = "SELECT count(*) FROM wake_outbox WHERE agent_id = $1 AND kind = ANY ($2::text[])"
    return int(await pool.fetchval(sql, agent_id, list(kinds)))


async def park(room: room_pb2_grpc.RoomServiceStub, agent: common_pb2.Agent, room_id: str) -> str:
    """Park a run of ``agent`` with two held remember actions, as the Runtime would; returns the token."""
    run = common_pb2.Run(
        run_id=f"run-{uuid.uuid4()}",
        agent_id=agent.agent_id,
        company_id=agent.company_id,
        room_id=room_id,
        wake_id=str(uuid.uuid4()),
        status=common_pb2.RUN_STATUS_PARKED,
        step=common_pb2.RUN_STEP_PARKED,
    )
    for index in (0, 1):
        run.actions.add(
            index=index,
            kind=common_pb2.ACTION_KIND_REMEMBER,
            arguments_json=f'{{"text": "held {index}", "private": false}}',
            outcome=common_pb2.ACTION_OUTCOME_HELD,
        )
    held = [common_pb2.HeldAction(index=a.index, kind=a.kind, arguments_json=a.arguments_json) for a in run.actions]
    response = await room.CreateWaitpoint(
        room_pb2.RoomServiceCreateWaitpointRequest(run_id=run.run_id, held=held, expires_in_seconds=3600, run=run),
        timeout=10,
    )
    return str(response.waitpoint.token)


async def sees_nothing(gw: GatewayStub, room_id: str, agent_id: str, task_id: str) -> None:
    """Every room-scoped RPC answers NOT_FOUND, as for a room that does not exist; the room is not listed."""
    for call in room_calls(gw, room_id, agent_id, task_id).values():
        await expect_error(NOT_FOUND, call(), "room")
    rooms = (await gw.ListRooms(gateway_pb2.ListRoomsRequest(), timeout=10)).rooms
    assert room_id not in [r.room_id for r in rooms]


async def test_an_invited_company_sees_and_wakes_nothing_until_it_accepts(
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
    initech_gw: GatewayStub,
    acme: CompanyKey,
    globex: CompanyKey,
    pool: asyncpg.Pool,
) -> None:
    room = await create_room(acme_gw, "launch")
    acme_agent = await register_agent(acme_gw, "planner")
    globex_agent = await register_agent(globex_gw, "writer")
    task = await acme_gw.SendTask(
        gateway_pb2.SendTaskRequest(room_id=room.room_id, person="Ada", to_agent_id=acme_agent.agent_id, title="t"),
        timeout=10,
    )
    invited = await invite(acme_gw, room.room_id, globex.company_id)
    assert invited.status == PENDING and invited.company_id == globex.company_id
    assert (invited.room_name, invited.invited_by_company_name) == ("launch", "Acme")

    # Pending: not a member.
    await sees_nothing(globex_gw, room.room_id, acme_agent.agent_id, task.task.task_id)
    members = await acme_gw.ListMembers(gateway_pb2.ListMembersRequest(room_id=room.room_id), timeout=10)
    assert [m.company_id for m in members.members] == [acme.company_id]
    # Its agent answers exactly like an agent that does not exist, and no wake is recorded for it.
    unknown = await expect_error(NOT_FOUND, acme_gw.PostMessage(mention(room.room_id, str(uuid.uuid4())), timeout=10))
    err = await expect_error(NOT_FOUND, acme_gw.PostMessage(mention(room.room_id, globex_agent.agent_id), timeout=10))
    assert err.details() == unknown.details()
    send = gateway_pb2.SendTaskRequest(room_id=room.room_id, person="Ada", to_agent_id=globex_agent.agent_id, title="t")
    err = await expect_error(NOT_FOUND, acme_gw.SendTask(send, timeout=10))
    assert err.details() == unknown.details()
    assert await wakes_of(pool, globex_agent.agent_id) == 0

    # Only the invited company sees and answers its invitation.
    assert [i.invitation_id for i in await invitations(globex_gw)] == [invited.invitation_id]
    assert await invitations(acme_gw) == [] and await invitations(initech_gw) == []
    accept = gateway_pb2.AcceptInvitationRequest(invitation_id=invited.invitation_id)
    decline = gateway_pb2.DeclineInvitationRequest(invitation_id=invited.invitation_id)
    foreign = await expect_error(NOT_FOUND, initech_gw.AcceptInvitation(accept, timeout=10), "invitation")
    await expect_error(NOT_FOUND, initech_gw.DeclineInvitation(decline, timeout=10), "invitation")
    missing = str(uuid.uuid4())
    unknown_invitation = await expect_error(
        NOT_FOUND, globex_gw.AcceptInvitation(gateway_pb2.AcceptInvitationRequest(invitation_id=missing), timeout=10)
    )
    # Someone else's invitation reads exactly like one that does not exist.
    assert (foreign.details() or "").replace(invited.invitation_id, "ID") == (
        unknown_invitation.details() or ""
    ).replace(missing, "ID")
    # Invited once is enough.
    await expect_error(
        EXISTS,
        acme_gw.InviteCompany(
            gateway_pb2.InviteCompanyRequest(room_id=room.room_id, company_id=globex.company_id), timeout=10
        ),
        "pending invitation",
    )

    first = await globex_gw.AcceptInvitation(accept, timeout=10)
    assert first.invitation.status == ACCEPTED and first.member.company_id == globex.company_id
    again = await globex_gw.AcceptInvitation(accept, timeout=10)
    assert (again.invitation, again.member) == (first.invitation, first.member)
    assert await invitations(globex_gw) == []
    assert [i.invitation_id for i in await invitations(globex_gw, ACCEPTED)] == [invited.invitation_id]
    await expect_error(
        EXISTS,
        acme_gw.InviteCompany(
            gateway_pb2.InviteCompanyRequest(room_id=room.room_id, company_id=globex.company_id), timeout=10
        ),
        "already a member",
    )

    # A member now: it sees the room and its agent can be woken there.
    listed = await globex_gw.ListMessages(gateway_pb2.ListMessagesRequest(room_id=room.room_id), timeout=10)
    assert listed.messages == []
    got = await globex_gw.GetTask(
        gateway_pb2.GetTaskRequest(room_id=room.room_id, task_id=task.task.task_id), timeout=10
    )
    assert got.task.task_id == task.task.task_id
    posted = await acme_gw.PostMessage(mention(room.room_id, globex_agent.agent_id), timeout=10)
    assert len(posted.wake_ids) == 1 and await wakes_of(pool, globex_agent.agent_id) == 1


async def test_a_declined_invitation_cannot_be_accepted(
    acme_gw: GatewayStub, globex_gw: GatewayStub, globex: CompanyKey
) -> None:
    room = await create_room(acme_gw)
    invited = await invite(acme_gw, room.room_id, globex.company_id)
    decline = gateway_pb2.DeclineInvitationRequest(invitation_id=invited.invitation_id)
    declined = await globex_gw.DeclineInvitation(decline, timeout=10)
    assert declined.invitation.status == DECLINED
    assert (await globex_gw.DeclineInvitation(decline, timeout=10)).invitation == declined.invitation
    accept = gateway_pb2.AcceptInvitationRequest(invitation_id=invited.invitation_id)
    await expect_error(FAILED, globex_gw.AcceptInvitation(accept, timeout=10), "declined")
    await expect_error(
        NOT_FOUND, globex_gw.ListMessages(gateway_pb2.ListMessagesRequest(room_id=room.room_id), timeout=10)
    )
    assert [i.invitation_id for i in await invitations(globex_gw, DECLINED)] == [invited.invitation_id]
    # A member may ask again: a new invitation, which it may accept.
    again = await invite(acme_gw, room.room_id, globex.company_id)
    assert again.invitation_id != invited.invitation_id
    await globex_gw.AcceptInvitation(gateway_pb2.AcceptInvitationRequest(invitation_id=again.invitation_id), timeout=10)
    await expect_error(FAILED, globex_gw.DeclineInvitation(decline_of(again), timeout=10), "LeaveRoom")

    # Malformed requests say what to fix.
    await expect_error(INVALID, globex_gw.AcceptInvitation(gateway_pb2.AcceptInvitationRequest(), timeout=10))
    await expect_error(
        NOT_FOUND,
        globex_gw.DeclineInvitation(gateway_pb2.DeclineInvitationRequest(invitation_id="../x"), timeout=10),
        "invitation",
    )
    bad = gateway_pb2.ListInvitationsRequest(status=common_pb2.InvitationStatus.ValueType(42))
    await expect_error(INVALID, globex_gw.ListInvitations(bad, timeout=10), "status")
    await expect_error(
        INVALID,
        globex_gw.ListInvitations(gateway_pb2.ListInvitationsRequest(page_size=501), timeout=10),
        "page_size",
    )


def decline_of(invitation: common_pb2.Invitation) -> gateway_pb2.DeclineInvitationRequest:
    return gateway_pb2.DeclineInvitationRequest(invitation_id=invitation.invitation_id)


async def test_invitations_page(acme_gw: GatewayStub, globex_gw: GatewayStub, globex: CompanyKey) -> None:
    rooms = [await create_room(acme_gw, f"room {n}") for n in range(3)]
    made = [(await invite(acme_gw, r.room_id, globex.company_id)).invitation_id for r in rooms]
    first = await globex_gw.ListInvitations(gateway_pb2.ListInvitationsRequest(page_size=2), timeout=10)
    assert [i.invitation_id for i in first.invitations] == made[:2] and first.next_page_token
    rest = await globex_gw.ListInvitations(
        gateway_pb2.ListInvitationsRequest(page_size=2, page_token=first.next_page_token), timeout=10
    )
    assert [i.invitation_id for i in rest.invitations] == made[2:] and not rest.next_page_token


async def test_leaving_loses_access_at_once_and_wakes_nothing_more(
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
    globex: CompanyKey,
    pool: asyncpg.Pool,
    room_stub: room_pb2_grpc.RoomServiceStub,
) -> None:
    room = await create_room(acme_gw)
    acme_agent = await register_agent(acme_gw, "planner")
    globex_agent = await register_agent(globex_gw, "writer")
    task = await acme_gw.SendTask(
        gateway_pb2.SendTaskRequest(room_id=room.room_id, person="Ada", to_agent_id=acme_agent.agent_id, title="t"),
        timeout=10,
    )
    await join_room(acme_gw, globex_gw, room.room_id)
    await globex_gw.PostMessage(
        gateway_pb2.PostMessageRequest(room_id=room.room_id, person="Bo", body="hi"), timeout=10
    )
    await acme_gw.PostMessage(mention(room.room_id, globex_agent.agent_id), timeout=10)
    assert await wakes_of(pool, globex_agent.agent_id) == 1
    token = await park(room_stub, globex_agent, room.room_id)
    assert [
        w.token for w in (await globex_gw.ListApprovals(gateway_pb2.ListApprovalsRequest(), timeout=10)).waitpoints
    ] == [token]

    await globex_gw.LeaveRoom(gateway_pb2.LeaveRoomRequest(room_id=room.room_id), timeout=10)

    await sees_nothing(globex_gw, room.room_id, acme_agent.agent_id, task.task.task_id)
    members = await acme_gw.ListMembers(gateway_pb2.ListMembersRequest(room_id=room.room_id), timeout=10)
    assert globex.company_id not in [m.company_id for m in members.members]
    await expect_error(NOT_FOUND, acme_gw.PostMessage(mention(room.room_id, globex_agent.agent_id), timeout=10))
    assert await wakes_of(pool, globex_agent.agent_id) == 1  # none new
    # One decision wake: the parked run continues once, to end its held actions undone (see below).
    assert await wakes_of(pool, globex_agent.agent_id, ("decision",)) == 1
    # Its pending approval in the room expired with the departure: deciding it now changes nothing.
    assert not (await globex_gw.ListApprovals(gateway_pb2.ListApprovalsRequest(), timeout=10)).waitpoints
    decide = gateway_pb2.DecideApprovalRequest(token=token, index=0, person="Bo", approve=True)
    await expect_error(FAILED, globex_gw.DecideApproval(decide, timeout=10), "expired")
    # Its old invitation does not let it back in; rejoining takes a new one.
    accepted = await invitations(globex_gw, ACCEPTED)
    accept = gateway_pb2.AcceptInvitationRequest(invitation_id=accepted[0].invitation_id)
    await expect_error(FAILED, globex_gw.AcceptInvitation(accept, timeout=10), "invite you again")
    # The creator cannot leave its own room.
    await expect_error(
        FAILED, acme_gw.LeaveRoom(gateway_pb2.LeaveRoomRequest(room_id=room.room_id), timeout=10), "creator"
    )
    await expect_error(INVALID, acme_gw.LeaveRoom(gateway_pb2.LeaveRoomRequest(), timeout=10), "room_id")


async def test_writes_sent_straight_to_the_room_answer_as_a_membership_check_first_would(
    acme_gw: GatewayStub, globex_gw: GatewayStub
) -> None:
    """PostMessage and SendTask go to the Room without a GetRoom first; what a company outside the
    room learns is still only NOT_FOUND for the room, whatever the Room would have refused first
    (a body it cannot store) or answered before admitting the author (a retried idempotency key)."""
    room = await create_room(acme_gw)
    agent = await register_agent(acme_gw, "planner")
    await join_room(acme_gw, globex_gw, room.room_id)
    keyed = gateway_pb2.PostMessageRequest(room_id=room.room_id, person="Bo", body="once", idempotency_key="k1")
    task = gateway_pb2.SendTaskRequest(
        room_id=room.room_id, person="Bo", to_agent_id=agent.agent_id, title="t", idempotency_key="k2"
    )
    first = await globex_gw.PostMessage(keyed, timeout=10)
    first_task = await globex_gw.SendTask(task, timeout=10)
    # A member's retry returns the first write; a NUL body is the Room's INVALID_ARGUMENT.
    assert (await globex_gw.PostMessage(keyed, timeout=10)).message.message_id == first.message.message_id
    assert (await globex_gw.SendTask(task, timeout=10)).task.task_id == first_task.task.task_id
    nul = gateway_pb2.PostMessageRequest(room_id=room.room_id, person="Bo", body="a\x00b")
    await expect_error(INVALID, globex_gw.PostMessage(nul, timeout=10), "NUL")

    await globex_gw.LeaveRoom(gateway_pb2.LeaveRoomRequest(room_id=room.room_id), timeout=10)

    for call in (
        globex_gw.PostMessage(keyed, timeout=10),
        globex_gw.SendTask(task, timeout=10),
        globex_gw.PostMessage(nul, timeout=10),
    ):
        err = await expect_error(NOT_FOUND, call, "room")
        assert err.details() == f"room {room.room_id!r} not found"
    messages = await acme_gw.ListMessages(gateway_pb2.ListMessagesRequest(room_id=room.room_id), timeout=10)
    assert [m.message_id for m in messages.messages] == [first.message.message_id]


async def test_only_the_creator_removes_a_member(
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
    initech_gw: GatewayStub,
    acme: CompanyKey,
    globex: CompanyKey,
    initech: CompanyKey,
) -> None:
    room = await create_room(acme_gw)
    for gw in (globex_gw, initech_gw):
        await join_room(acme_gw, gw, room.room_id)
    acme_agent = await register_agent(acme_gw, "planner")

    def remove(gw: GatewayStub, company_id: str) -> Any:
        return gw.RemoveMember(gateway_pb2.RemoveMemberRequest(room_id=room.room_id, company_id=company_id), timeout=10)

    await expect_error(DENIED, remove(globex_gw, initech.company_id), "created")
    await expect_error(DENIED, remove(globex_gw, acme.company_id))
    await expect_error(FAILED, remove(acme_gw, acme.company_id), "cannot remove itself")
    await expect_error(NOT_FOUND, remove(acme_gw, str(uuid.uuid4())), "not a member")
    await expect_error(NOT_FOUND, remove(acme_gw, "nope"), "not a member")
    await expect_error(INVALID, remove(acme_gw, ""), "company_id")

    await remove(acme_gw, initech.company_id)
    await sees_nothing(initech_gw, room.room_id, acme_agent.agent_id, str(uuid.uuid4()))
    members = await acme_gw.ListMembers(gateway_pb2.ListMembersRequest(room_id=room.room_id), timeout=10)
    assert [m.company_id for m in members.members] == [acme.company_id, globex.company_id]
    await expect_error(NOT_FOUND, remove(acme_gw, initech.company_id), "not a member")


async def test_a_departed_or_pending_companys_agents_are_never_run(
    database_url: str,
    room_addr: str,
    claims_addr: str,
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
    initech_gw: GatewayStub,
    initech: CompanyKey,
    pool: asyncpg.Pool,
    room_stub: room_pb2_grpc.RoomServiceStub,
) -> None:
    room = await create_room(acme_gw)
    globex_agent = (
        await globex_gw.RegisterAgent(
            gateway_pb2.RegisterAgentRequest(
                name="writer", provider=common_pb2.PROVIDER_ANTHROPIC, model="globex-model", provider_key="sk-g"
            ),
            timeout=10,
        )
    ).agent
    initech_agent = await register_agent(initech_gw, "pending")
    await join_room(acme_gw, globex_gw, room.room_id)
    await invite(acme_gw, room.room_id, initech.company_id)  # never accepted
    # A wake recorded while Globex is a member, and a parked run of its agent (delivery is off so far).
    posted = await acme_gw.PostMessage(mention(room.room_id, globex_agent.agent_id), timeout=10)
    token = await park(room_stub, globex_agent, room.room_id)
    approve = gateway_pb2.DecideApprovalRequest(token=token, index=0, person="Bo", approve=True)
    assert not (await globex_gw.DecideApproval(approve, timeout=10)).completed  # index 1 still waits
    await expect_error(NOT_FOUND, acme_gw.PostMessage(mention(room.room_id, initech_agent.agent_id), timeout=10))
    await globex_gw.LeaveRoom(gateway_pb2.LeaveRoomRequest(room_id=room.room_id), timeout=10)

    with StandinProvider() as standin:
        async with (
            running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as runtime_addr,
            running_gateway(database_url, room_addr, runtime_addr, **FAST),
        ):

            async def settled() -> bool:
                pending = await pool.fetchval(
                    "SELECT count(*) FROM wake_outbox WHERE agent_id = $1 AND delivered_at IS NULL",
                    globex_agent.agent_id,
                )
                runs = (await globex_gw.ListRuns(gateway_pb2.ListRunsRequest(), timeout=10)).runs
                return pending == 0 and len(runs) == 2 and all(r.ended_at.seconds > 0 for r in runs)

            await eventually(settled)
            # Delivered again, the wake is not acted on twice: its claim is spent.
            async with service_channel(runtime_addr, "gateway") as channel:
                again = await runtime_pb2_grpc.RuntimeServiceStub(channel).StartRun(
                    runtime_pb2.StartRunRequest(
                        agent_id=globex_agent.agent_id,
                        wake_id=posted.wake_ids[0],
                        room_id=room.room_id,
                        wake_kind=common_pb2.WAKE_KIND_MESSAGE,
                        wake_source_id=posted.message.message_id,
                    ),
                    timeout=10,
                )
            assert again.result == runtime_pb2.START_RUN_RESULT_ALREADY_CLAIMED
        # No model was asked for the departed company's agent.
        assert standin.requests("globex-model") == []

    runs = {r.wake_id: r for r in (await globex_gw.ListRuns(gateway_pb2.ListRunsRequest(), timeout=10)).runs}
    woken = runs[posted.wake_ids[0]]
    assert woken.status == common_pb2.RUN_STATUS_FAILED and "not a member" in woken.error, woken
    assert not woken.posted_message_id
    parked = next(r for r in runs.values() if r.wake_id != posted.wake_ids[0])
    assert parked.ended_at.seconds > 0
    # The approved action was refused by the Room's rule (not a member), the undecided one ended undone.
    outcomes = [(a.outcome, a.detail) for a in parked.actions]
    assert outcomes[0][0] == common_pb2.ACTION_OUTCOME_REFUSED and "not a member" in outcomes[0][1], parked
    assert parked.actions[0].rule == "member-writes", parked
    assert outcomes[1][0] == common_pb2.ACTION_OUTCOME_NOT_DONE, parked
    # Nothing was written in the room by Globex's agent, and the pending invitee's agent never had a wake.
    messages = (await acme_gw.ListMessages(gateway_pb2.ListMessagesRequest(room_id=room.room_id), timeout=10)).messages
    assert [m.author.kind for m in messages] == [common_pb2.AUTHOR_KIND_PERSON]
    memory = (await acme_gw.ListMemory(gateway_pb2.ListMemoryRequest(room_id=room.room_id), timeout=10)).lines
    assert list(memory) == []
    assert await wakes_of(pool, initech_agent.agent_id) == 0
    await expect_error(
        FAILED,
        globex_gw.DecideApproval(
            gateway_pb2.DecideApprovalRequest(token=token, index=0, person="Bo", approve=True), timeout=10
        ),
        "expired",
    )
