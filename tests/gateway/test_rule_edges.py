"""Edges of the room's rules through the Gateway, as a company's client reaches them: an invitation
dies with its sender's membership, a room's creator lists and withdraws pending invitations, and an
A2A agent card shows another company's agent without its system prompt."""

from __future__ import annotations

from typing import Any

import grpc

from quayutec.v1 import common_pb2, gateway_pb2
from services.gateway.a2a import tenant_of
from tests.gateway.helpers import GatewayStub, create_room, expect_error
from tests.gateway.test_a2a import a2a_client
from tests.gateway.test_membership import invite
from tests.harness.gateway import CompanyKey, join_room

PENDING, WITHDRAWN = common_pb2.INVITATION_STATUS_PENDING, common_pb2.INVITATION_STATUS_WITHDRAWN


def room_invitations(gw: GatewayStub, room_id: str, status: common_pb2.InvitationStatus.ValueType = PENDING) -> Any:
    return gw.ListRoomInvitations(gateway_pb2.ListRoomInvitationsRequest(room_id=room_id, status=status), timeout=10)


def accept(gw: GatewayStub, invitation_id: str) -> Any:
    return gw.AcceptInvitation(gateway_pb2.AcceptInvitationRequest(invitation_id=invitation_id), timeout=10)


def withdraw(gw: GatewayStub, invitation_id: str) -> Any:
    return gw.WithdrawInvitation(gateway_pb2.WithdrawInvitationRequest(invitation_id=invitation_id), timeout=10)


async def test_an_invitation_dies_with_its_senders_membership(
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
    initech_gw: GatewayStub,
    globex: CompanyKey,
    initech: CompanyKey,
) -> None:
    """Acme's room: Globex (a member) invites Initech, then Acme removes Globex. Initech's accept is
    refused, it never becomes a member, and Acme sees the invitation withdrawn."""
    room = await create_room(acme_gw)
    await join_room(acme_gw, globex_gw, room.room_id)
    invitation = await invite(globex_gw, room.room_id, initech.company_id)
    listed = await room_invitations(acme_gw, room.room_id)
    assert [i.invitation_id for i in listed.invitations] == [invitation.invitation_id]
    await acme_gw.RemoveMember(
        gateway_pb2.RemoveMemberRequest(room_id=room.room_id, company_id=globex.company_id), timeout=10
    )
    await expect_error(grpc.StatusCode.FAILED_PRECONDITION, accept(initech_gw, invitation.invitation_id), "withdrawn")
    members = await acme_gw.ListMembers(gateway_pb2.ListMembersRequest(room_id=room.room_id), timeout=10)
    assert initech.company_id not in [m.company_id for m in members.members]
    assert (await room_invitations(acme_gw, room.room_id)).invitations == []
    gone = await room_invitations(acme_gw, room.room_id, WITHDRAWN)
    assert [(i.invitation_id, i.status) for i in gone.invitations] == [(invitation.invitation_id, WITHDRAWN)]


async def test_the_creator_lists_and_withdraws_pending_invitations(
    acme_gw: GatewayStub, globex_gw: GatewayStub, initech_gw: GatewayStub, initech: CompanyKey
) -> None:
    room = await create_room(acme_gw)
    await join_room(acme_gw, globex_gw, room.room_id)
    invitation = await invite(globex_gw, room.room_id, initech.company_id)
    # Only the creator lists a room's invitations; a company outside the room finds no room.
    await expect_error(grpc.StatusCode.PERMISSION_DENIED, room_invitations(globex_gw, room.room_id), "created")
    await expect_error(grpc.StatusCode.NOT_FOUND, room_invitations(initech_gw, room.room_id))
    # The invited company cannot withdraw it; the creator can, and again changes nothing.
    await expect_error(grpc.StatusCode.NOT_FOUND, withdraw(initech_gw, invitation.invitation_id))
    withdrawn = await withdraw(acme_gw, invitation.invitation_id)
    assert withdrawn.invitation.status == WITHDRAWN
    assert (await withdraw(acme_gw, invitation.invitation_id)).invitation.status == WITHDRAWN
    await expect_error(grpc.StatusCode.FAILED_PRECONDITION, accept(initech_gw, invitation.invitation_id), "withdrawn")
    # Its sender may withdraw its own: a new invitation, withdrawn by Globex.
    again = await invite(globex_gw, room.room_id, initech.company_id)
    assert (await withdraw(globex_gw, again.invitation_id)).invitation.status == WITHDRAWN
    # An accepted one cannot be withdrawn.
    third = await invite(acme_gw, room.room_id, initech.company_id)
    await accept(initech_gw, third.invitation_id)
    await expect_error(grpc.StatusCode.FAILED_PRECONDITION, withdraw(acme_gw, third.invitation_id), "accepted")


async def test_an_agent_card_shows_another_companys_agent_without_its_system_prompt(
    gateway_addr: str, acme_gw: GatewayStub, globex_gw: GatewayStub, acme: CompanyKey, globex: CompanyKey
) -> None:
    room = await create_room(acme_gw)
    await join_room(acme_gw, globex_gw, room.room_id)
    prompt = "You are Acme's negotiator; our floor price is 41 dollars.\nNever reveal it."
    agent = (
        await acme_gw.RegisterAgent(
            gateway_pb2.RegisterAgentRequest(
                name="negotiator",
                provider=common_pb2.PROVIDER_ANTHROPIC,
                model="claude-test",
                provider_key="sk-test-secret",
                system_prompt=prompt,
            ),
            timeout=10,
        )
    ).agent
    tenant = tenant_of(room.room_id, agent.agent_id)
    async with a2a_client(gateway_addr, tenant, globex.secret) as (_, card):
        text = str(card)
        assert "floor price" not in text and "negotiator" in card.name
        assert card.description == "negotiator, an agent of Acme in a Quayutec room"
        assert card.provider.organization == "Acme"
    async with a2a_client(gateway_addr, tenant, acme.secret) as (_, own):
        assert own.description == prompt.splitlines()[0]
    # The same as ListAgents shows Globex.
    listed = await globex_gw.ListAgents(gateway_pb2.ListAgentsRequest(room_id=room.room_id), timeout=10)
    seen = next(a for a in listed.agents if a.agent_id == agent.agent_id)
    assert seen.system_prompt == ""
