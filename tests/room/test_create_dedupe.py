"""Dedupe keys on the Room's creates (rooms, invitations, agents): a repeat from the same company answers
the first object, the same key of another company makes its own, concurrent repeats make one, and the
inviter's right to invite is checked before a repeat is answered. A real Room server."""

from __future__ import annotations

import asyncio

import grpc

from quayutec.v1 import common_pb2, room_pb2
from tests.room.conftest import Stub, expect_error, make_company


def _room(company_id: str, name: str, key: str) -> room_pb2.RoomServiceCreateRoomRequest:
    return room_pb2.RoomServiceCreateRoomRequest(company_id=company_id, name=name, dedupe_key=key)


def _agent(company_id: str, key: str) -> room_pb2.RoomServiceRegisterAgentRequest:
    return room_pb2.RoomServiceRegisterAgentRequest(
        company_id=company_id, name="keyed", provider=common_pb2.PROVIDER_ANTHROPIC, model="m", dedupe_key=key
    )


async def test_rooms_and_agents_are_made_once_per_company_and_key(room: Stub) -> None:
    acme, globex = await make_company(room, "Acme"), await make_company(room, "Globex")
    concurrent = await asyncio.gather(*(room.CreateRoom(_room(acme.company_id, "r", "k1")) for _ in range(8)))
    assert len({r.room.room_id for r in concurrent}) == 1
    theirs = await room.CreateRoom(_room(globex.company_id, "r", "k1"))
    assert theirs.room.room_id != concurrent[0].room.room_id
    listed = await room.ListRooms(room_pb2.RoomServiceListRoomsRequest(company_id=acme.company_id))
    assert [r.room_id for r in listed.rooms] == [concurrent[0].room.room_id]

    agents = await asyncio.gather(*(room.RegisterAgent(_agent(acme.company_id, "k1")) for _ in range(8)))
    assert len({a.agent.agent_id for a in agents}) == 1
    their_agent = await room.RegisterAgent(_agent(globex.company_id, "k1"))
    assert their_agent.agent.agent_id != agents[0].agent.agent_id
    mine = await room.ListAgents(room_pb2.RoomServiceListAgentsRequest(company_id=acme.company_id))
    assert [a.agent_id for a in mine.agents] == [agents[0].agent.agent_id]

    await expect_error(
        grpc.StatusCode.INVALID_ARGUMENT, room.CreateRoom(_room(acme.company_id, "r", "k" * 301)), "dedupe_key"
    )


async def test_an_invitation_repeat_is_answered_only_while_the_inviter_may_invite(room: Stub) -> None:
    acme, globex, initech = [await make_company(room, n) for n in ("Acme", "Globex", "Initech")]
    made = (await room.CreateRoom(_room(acme.company_id, "r", ""))).room

    def invite(company_id: str, by: str) -> room_pb2.RoomServiceCreateInvitationRequest:
        return room_pb2.RoomServiceCreateInvitationRequest(
            room_id=made.room_id, company_id=company_id, invited_by_company_id=by, dedupe_key="k1"
        )

    first, again = await asyncio.gather(
        *(room.CreateInvitation(invite(globex.company_id, acme.company_id)) for _ in range(2))
    )
    assert first.invitation == again.invitation
    # Globex is no member: its invite under the same key is refused (the room is not found for it),
    # not answered with Acme's.
    await expect_error(grpc.StatusCode.NOT_FOUND, room.CreateInvitation(invite(initech.company_id, globex.company_id)))
    await room.AcceptInvitation(
        room_pb2.RoomServiceAcceptInvitationRequest(
            invitation_id=first.invitation.invitation_id, company_id=globex.company_id
        )
    )
    theirs = await room.CreateInvitation(invite(initech.company_id, globex.company_id))
    assert theirs.invitation.invitation_id != first.invitation.invitation_id
    await room.LeaveRoom(room_pb2.RoomServiceLeaveRoomRequest(room_id=made.room_id, company_id=globex.company_id))
    await expect_error(grpc.StatusCode.NOT_FOUND, room.CreateInvitation(invite(initech.company_id, globex.company_id)))
