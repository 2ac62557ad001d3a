"""Membership by consent over a real Room: invitations, accept and decline, leave and remove."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import grpc

from quayutec.v1 import common_pb2, room_pb2
from tests.room.conftest import Stub, World, expect_error, person
from tests.room.test_rights_waitpoints import decide, decision_wakes, park

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
EXISTS = grpc.StatusCode.ALREADY_EXISTS
DENIED = grpc.StatusCode.PERMISSION_DENIED
FAILED = grpc.StatusCode.FAILED_PRECONDITION
MISSING = str(uuid.uuid4())


async def invite(room: Stub, room_id: str, company_id: str, by: str) -> common_pb2.Invitation:
    request = room_pb2.RoomServiceCreateInvitationRequest(
        room_id=room_id, company_id=company_id, invited_by_company_id=by
    )
    invitation: common_pb2.Invitation = (await room.CreateInvitation(request)).invitation
    return invitation


def accept(room: Stub, invitation_id: str, company_id: str) -> Any:
    return room.AcceptInvitation(
        room_pb2.RoomServiceAcceptInvitationRequest(invitation_id=invitation_id, company_id=company_id)
    )


def decline(room: Stub, invitation_id: str, company_id: str) -> Any:
    return room.DeclineInvitation(
        room_pb2.RoomServiceDeclineInvitationRequest(invitation_id=invitation_id, company_id=company_id)
    )


async def invitations(
    room: Stub, company_id: str, status: common_pb2.InvitationStatus.ValueType = common_pb2.INVITATION_STATUS_PENDING
) -> list[str]:
    request = room_pb2.RoomServiceListInvitationsRequest(company_id=company_id, status=status)
    return [i.invitation_id for i in (await room.ListInvitations(request)).invitations]


async def members(room: Stub, room_id: str) -> list[str]:
    listed = await room.ListMembers(room_pb2.RoomServiceListMembersRequest(room_id=room_id))
    return [m.company_id for m in listed.members]


async def wakes_of(pool: asyncpg.Pool, agent_id: str) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM wake_outbox WHERE agent_id = $1", agent_id))


async def test_an_invited_company_is_not_a_member_until_it_accepts(
    room: Stub, world: World, pool: asyncpg.Pool
) -> None:
    crow = world.crow.company_id
    pending = await invite(room, world.room_id, crow, world.bolt.company_id)
    assert pending.status == common_pb2.INVITATION_STATUS_PENDING and not pending.HasField("responded_at")
    assert (pending.room_name, pending.invited_by_company_name, pending.company_id) == ("launch", "Bolt", crow)
    assert await invitations(room, crow) == [pending.invitation_id]
    assert await invitations(room, world.bolt.company_id) == []

    # Not a member: the room is hidden from it, its agent cannot be mentioned, sent a task or run there.
    get = room_pb2.RoomServiceGetRoomRequest(room_id=world.room_id, member_company_id=crow)
    await expect_error(NOT_FOUND, room.GetRoom(get))
    assert not (await room.ListRooms(room_pb2.RoomServiceListRoomsRequest(company_id=crow))).rooms
    assert await members(room, world.room_id) == [world.acme.company_id, world.bolt.company_id]
    mention = room_pb2.RoomServicePostMessageRequest(
        room_id=world.room_id,
        author=person(world.acme.company_id),
        body="hi",
        mention_agent_ids=[world.crow_agent.agent_id],
    )
    await expect_error(NOT_FOUND, room.PostMessage(mention), "not a member")
    task = room_pb2.RoomServiceCreateTaskRequest(
        room_id=world.room_id, to_agent_id=world.crow_agent.agent_id, title="t"
    )
    getattr(task, "from").CopyFrom(person(world.acme.company_id))
    await expect_error(NOT_FOUND, room.CreateTask(task), "not a member")
    read = room_pb2.RoomServiceReadRunContextRequest(agent_id=world.crow_agent.agent_id, room_id=world.room_id)
    await expect_error(NOT_FOUND, room.ReadRunContext(read))
    own_post = room_pb2.RoomServicePostMessageRequest(room_id=world.room_id, author=person(crow), body="let me in")
    await expect_error(DENIED, room.PostMessage(own_post))
    assert await wakes_of(pool, world.crow_agent.agent_id) == 0

    # Invited once: a second invitation is refused, naming the pending one.
    await expect_error(
        EXISTS, room.CreateInvitation(_invite_request(world, crow, world.acme.company_id)), pending.invitation_id
    )
    # Only the invited company answers; to anyone else the invitation does not exist.
    await expect_error(NOT_FOUND, accept(room, pending.invitation_id, world.bolt.company_id))
    await expect_error(NOT_FOUND, decline(room, pending.invitation_id, world.acme.company_id))

    first = await accept(room, pending.invitation_id, crow)
    assert first.invitation.status == common_pb2.INVITATION_STATUS_ACCEPTED and first.invitation.HasField(
        "responded_at"
    )
    assert first.member.company_id == crow
    again = await accept(room, pending.invitation_id, crow)
    assert (again.invitation, again.member) == (first.invitation, first.member)
    assert await members(room, world.room_id) == [world.acme.company_id, world.bolt.company_id, crow]
    assert await invitations(room, crow) == []
    assert await invitations(room, crow, common_pb2.INVITATION_STATUS_ACCEPTED) == [pending.invitation_id]
    await expect_error(
        EXISTS, room.CreateInvitation(_invite_request(world, crow, world.acme.company_id)), "already a member"
    )
    await expect_error(FAILED, decline(room, pending.invitation_id, crow), "LeaveRoom")

    # A member now: its agent can be woken in the room.
    posted = await room.PostMessage(mention)
    assert [w.agent_id for w in posted.wakes] == [world.crow_agent.agent_id]


def _invite_request(world: World, company_id: str, by: str) -> room_pb2.RoomServiceCreateInvitationRequest:
    return room_pb2.RoomServiceCreateInvitationRequest(
        room_id=world.room_id, company_id=company_id, invited_by_company_id=by
    )


async def test_a_declined_invitation_cannot_be_accepted_and_errors_say_why(room: Stub, world: World) -> None:
    crow = world.crow.company_id
    first = await invite(room, world.room_id, crow, world.acme.company_id)
    declined = await decline(room, first.invitation_id, crow)
    assert declined.invitation.status == common_pb2.INVITATION_STATUS_DECLINED
    assert (await decline(room, first.invitation_id, crow)).invitation == declined.invitation
    await expect_error(FAILED, accept(room, first.invitation_id, crow), "declined")
    assert crow not in await members(room, world.room_id)
    assert await invitations(room, crow, common_pb2.INVITATION_STATUS_DECLINED) == [first.invitation_id]
    # A member may invite it again: a new invitation.
    second = await invite(room, world.room_id, crow, world.acme.company_id)
    assert second.invitation_id != first.invitation_id

    create = room.CreateInvitation
    await expect_error(NOT_FOUND, create(_invite_request(world, world.bolt.company_id, crow)), "room")  # not a member
    await expect_error(NOT_FOUND, create(_invite_request(world, MISSING, world.acme.company_id)), "company")
    missing_room = room_pb2.RoomServiceCreateInvitationRequest(
        room_id=MISSING, company_id=crow, invited_by_company_id=world.acme.company_id
    )
    await expect_error(NOT_FOUND, create(missing_room), "room")
    await expect_error(INVALID, create(_invite_request(world, "nope", world.acme.company_id)), "company_id")
    await expect_error(INVALID, create(_invite_request(world, crow, "")), "invited_by_company_id")
    await expect_error(NOT_FOUND, accept(room, MISSING, crow), "invitation")
    await expect_error(INVALID, accept(room, "x", crow), "invitation_id")
    bad_status = room_pb2.RoomServiceListInvitationsRequest(
        company_id=crow, status=common_pb2.InvitationStatus.ValueType(99)
    )
    await expect_error(INVALID, room.ListInvitations(bad_status), "InvitationStatus")
    bad_token = room_pb2.RoomServiceListInvitationsRequest(company_id=crow, page_token="garbage")
    await expect_error(INVALID, room.ListInvitations(bad_token), "page_token")


async def test_leave_and_remove_end_membership_and_only_the_creator_removes(room: Stub, world: World) -> None:
    acme, bolt, crow = world.acme.company_id, world.bolt.company_id, world.crow.company_id
    invited = await invite(room, world.room_id, crow, acme)
    await accept(room, invited.invitation_id, crow)

    def leave(company_id: str, room_id: str = world.room_id) -> Any:
        return room.LeaveRoom(room_pb2.RoomServiceLeaveRoomRequest(room_id=room_id, company_id=company_id))

    def remove(company_id: str, by: str) -> Any:
        return room.RemoveMember(
            room_pb2.RoomServiceRemoveMemberRequest(
                room_id=world.room_id, company_id=company_id, removed_by_company_id=by
            )
        )

    await expect_error(FAILED, leave(acme), "creator")
    await expect_error(DENIED, remove(crow, bolt), "created")
    await expect_error(FAILED, remove(acme, acme), "cannot remove itself")
    await expect_error(NOT_FOUND, leave(acme, MISSING), "room")

    await remove(crow, acme)
    assert await members(room, world.room_id) == [acme, bolt]
    await expect_error(NOT_FOUND, remove(crow, acme), "not a member")
    await expect_error(NOT_FOUND, remove(bolt, crow), "room")  # a removed company is an outsider
    # Its old invitation does not let it back in.
    await expect_error(FAILED, accept(room, invited.invitation_id, crow), "invite you again")

    await leave(bolt)
    assert await members(room, world.room_id) == [acme]
    await expect_error(NOT_FOUND, leave(bolt), "room")
    get = room_pb2.RoomServiceGetRoomRequest(room_id=world.room_id, member_company_id=bolt)
    await expect_error(NOT_FOUND, room.GetRoom(get))
    memory = room_pb2.RoomServiceListMemoryRequest(room_id=world.room_id, reader_company_id=bolt)
    await expect_error(NOT_FOUND, room.ListMemory(memory))


async def test_a_departure_expires_the_companys_pending_waitpoints_in_the_room_once(
    room: Stub, world: World, pool: asyncpg.Pool
) -> None:
    bolt_wp = await park(room, world, "run-bolt", agent_id=world.bolt_agent.agent_id)
    acme_wp = await park(room, world, "run-acme")
    assert bolt_wp.company_id == world.bolt.company_id

    left = await room.LeaveRoom(
        room_pb2.RoomServiceLeaveRoomRequest(room_id=world.room_id, company_id=world.bolt.company_id)
    )
    assert left.expired_waitpoints == 1
    got = await room.GetWaitpoint(room_pb2.RoomServiceGetWaitpointRequest(token=bolt_wp.token))
    assert got.waitpoint.status == common_pb2.WAITPOINT_STATUS_EXPIRED
    # One decision wake: its run continues once, ending the held actions undone.
    assert len(await decision_wakes(pool, bolt_wp.token)) == 1
    await expect_error(FAILED, decide(room, bolt_wp.token, 1, world.bolt.company_id), "expired")
    # Another company's approvals in the room are untouched.
    other = await room.GetWaitpoint(room_pb2.RoomServiceGetWaitpointRequest(token=acme_wp.token))
    assert other.waitpoint.status == common_pb2.WAITPOINT_STATUS_PENDING
    assert await decision_wakes(pool, acme_wp.token) == []


async def test_concurrent_invitations_and_answers_leave_one_invitation_and_one_membership(
    room: Stub, world: World, pool: asyncpg.Pool
) -> None:
    crow = world.crow.company_id
    request = _invite_request(world, crow, world.acme.company_id)
    results = await asyncio.gather(*(room.CreateInvitation(request) for _ in range(8)), return_exceptions=True)
    made = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(made) == 1 and len(refused) == 7 and all(e.code() == EXISTS for e in refused), results
    invitation_id = made[0].invitation.invitation_id

    answers = await asyncio.gather(
        *(accept(room, invitation_id, crow) for _ in range(4)),
        *(decline(room, invitation_id, crow) for _ in range(4)),
        return_exceptions=True,
    )
    # Whichever answer came first holds: every answer of its kind succeeds alike, every other is refused.
    accepted = [a for a in answers[:4] if not isinstance(a, BaseException)]
    declined = [a for a in answers[4:] if not isinstance(a, BaseException)]
    errors = [a for a in answers if isinstance(a, BaseException)]
    assert (len(accepted), len(declined)) in ((4, 0), (0, 4)), answers
    assert all(isinstance(e, grpc.aio.AioRpcError) and e.code() == FAILED for e in errors), errors
    assert len({a.invitation.SerializeToString() for a in accepted + declined}) == 1
    count = await pool.fetchval(
        "SELECT count(*) FROM room_members WHERE room_id = $1 AND company_id = $2", world.room_id, crow
    )
    assert count == (1 if accepted else 0)
