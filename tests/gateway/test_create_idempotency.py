"""Idempotency keys on every create: a repeat of a key from the same company answers the first object
(room, agent, invitation, API key, session key); another company's same key makes its own; the rules
are checked before a repeat is answered. A real Gateway against a real Room and PostgreSQL."""

from __future__ import annotations

import uuid

import grpc

from quayutec.v1 import common_pb2, gateway_pb2
from tests.gateway.helpers import GatewayStub, create_room, expect_error
from tests.harness.gateway import CompanyKey, authed_gateway

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND


def _key() -> str:
    return f"create-{uuid.uuid4()}"


async def _room_ids(gw: GatewayStub, name: str) -> list[str]:
    listed = await gw.ListRooms(gateway_pb2.ListRoomsRequest(page_size=500), timeout=10)
    return [r.room_id for r in listed.rooms if r.name == name]


async def test_a_room_created_twice_with_one_key_is_one_room_and_another_companys_key_makes_its_own(
    acme_gw: GatewayStub, globex_gw: GatewayStub, acme: CompanyKey, globex: CompanyKey
) -> None:
    key = _key()
    first = await acme_gw.CreateRoom(gateway_pb2.CreateRoomRequest(name="keyed", idempotency_key=key), timeout=10)
    again = await acme_gw.CreateRoom(gateway_pb2.CreateRoomRequest(name="keyed", idempotency_key=key), timeout=10)
    assert again.room == first.room
    assert await _room_ids(acme_gw, "keyed") == [first.room.room_id]
    # The same key with another name still answers the first room (the key names the create).
    other = await acme_gw.CreateRoom(gateway_pb2.CreateRoomRequest(name="renamed", idempotency_key=key), timeout=10)
    assert other.room.room_id == first.room.room_id and other.room.name == "keyed"
    assert await _room_ids(acme_gw, "renamed") == []

    theirs = await globex_gw.CreateRoom(gateway_pb2.CreateRoomRequest(name="keyed", idempotency_key=key), timeout=10)
    assert theirs.room.room_id != first.room.room_id
    assert theirs.room.created_by_company_id == globex.company_id
    assert await _room_ids(globex_gw, "keyed") == [theirs.room.room_id]
    assert await _room_ids(acme_gw, "keyed") == [first.room.room_id]

    # Without a key every call makes a room, of a name not taken (a taken one: tests/gateway/test_names.py).
    plain = [await create_room(acme_gw, f"unkeyed {n}") for n in range(2)]
    assert [await _room_ids(acme_gw, f"unkeyed {n}") for n in range(2)] == [[r.room_id] for r in plain]


async def test_a_key_of_200_bytes_is_accepted_and_201_refused(acme_gw: GatewayStub) -> None:
    """The Gateway namespaces the key by company before the Room sees it; the longest key still fits."""
    key = "k" * 200
    first = await acme_gw.CreateRoom(gateway_pb2.CreateRoomRequest(name="long key", idempotency_key=key), timeout=10)
    again = await acme_gw.CreateRoom(gateway_pb2.CreateRoomRequest(name="long key", idempotency_key=key), timeout=10)
    assert again.room.room_id == first.room.room_id
    posted = await acme_gw.PostMessage(
        gateway_pb2.PostMessageRequest(room_id=first.room.room_id, person="ana", body="hi", idempotency_key=key),
        timeout=10,
    )
    assert posted.message.body == "hi"
    too_long = gateway_pb2.CreateRoomRequest(name="long key", idempotency_key=key + "k")
    await expect_error(INVALID, acme_gw.CreateRoom(too_long, timeout=10), "idempotency_key must be at most 200 bytes")


def _agent(name: str, key: str) -> gateway_pb2.RegisterAgentRequest:
    return gateway_pb2.RegisterAgentRequest(
        name=name,
        provider=common_pb2.PROVIDER_ANTHROPIC,
        model="claude-test",
        provider_key="sk-test-secret",
        idempotency_key=key,
    )


async def _agent_ids(gw: GatewayStub, name: str) -> list[str]:
    listed = await gw.ListAgents(gateway_pb2.ListAgentsRequest(page_size=500), timeout=10)
    return [a.agent_id for a in listed.agents if a.name == name]


async def test_an_agent_registered_twice_with_one_key_is_one_agent_and_another_companys_key_makes_its_own(
    acme_gw: GatewayStub, globex_gw: GatewayStub, globex: CompanyKey
) -> None:
    key = _key()
    first = await acme_gw.RegisterAgent(_agent("keyed helper", key), timeout=10)
    again = await acme_gw.RegisterAgent(_agent("keyed helper", key), timeout=10)
    assert again.agent == first.agent
    assert await _agent_ids(acme_gw, "keyed helper") == [first.agent.agent_id]

    theirs = await globex_gw.RegisterAgent(_agent("keyed helper", key), timeout=10)
    assert theirs.agent.agent_id != first.agent.agent_id and theirs.agent.company_id == globex.company_id
    assert await _agent_ids(globex_gw, "keyed helper") == [theirs.agent.agent_id]
    assert await _agent_ids(acme_gw, "keyed helper") == [first.agent.agent_id]


async def test_an_invitation_sent_twice_with_one_key_is_one_and_the_rule_is_checked_before_a_repeat(
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
    globex: CompanyKey,
    initech: CompanyKey,
) -> None:
    room = await create_room(acme_gw, "invitations")
    key = _key()

    def invite(company_id: str) -> gateway_pb2.InviteCompanyRequest:
        return gateway_pb2.InviteCompanyRequest(room_id=room.room_id, company_id=company_id, idempotency_key=key)

    first = await acme_gw.InviteCompany(invite(globex.company_id), timeout=10)
    again = await acme_gw.InviteCompany(invite(globex.company_id), timeout=10)
    assert again.invitation == first.invitation
    sent = await acme_gw.ListInvitations(gateway_pb2.ListInvitationsRequest(sent=True), timeout=10)
    assert [i.invitation_id for i in sent.invitations] == [first.invitation.invitation_id]

    # Globex, a member now, uses the same key: its own invitation, not Acme's.
    await globex_gw.AcceptInvitation(
        gateway_pb2.AcceptInvitationRequest(invitation_id=first.invitation.invitation_id), timeout=10
    )
    # After it was accepted, Acme's repeat still answers the first invitation (not "already a member").
    repeat = await acme_gw.InviteCompany(invite(globex.company_id), timeout=10)
    assert repeat.invitation.invitation_id == first.invitation.invitation_id
    theirs = await globex_gw.InviteCompany(invite(initech.company_id), timeout=10)
    assert theirs.invitation.invitation_id != first.invitation.invitation_id
    assert theirs.invitation.invited_by_company_id == globex.company_id

    # Once Globex has left the room, its repeat is refused as any write of a non-member is.
    await globex_gw.LeaveRoom(gateway_pb2.LeaveRoomRequest(room_id=room.room_id), timeout=10)
    await expect_error(NOT_FOUND, globex_gw.InviteCompany(invite(initech.company_id), timeout=10))


async def test_an_api_key_made_twice_with_one_key_is_one_key_with_one_secret(
    gateway_addr: str, acme_gw: GatewayStub, globex_gw: GatewayStub, globex: CompanyKey
) -> None:
    key = _key()
    first = await acme_gw.CreateApiKey(gateway_pb2.CreateApiKeyRequest(label="ci", idempotency_key=key), timeout=10)
    again = await acme_gw.CreateApiKey(gateway_pb2.CreateApiKeyRequest(label="ci", idempotency_key=key), timeout=10)
    assert again.key.key_id == first.key.key_id and again.secret == first.secret
    listed = await acme_gw.ListApiKeys(gateway_pb2.ListApiKeysRequest(), timeout=10)
    assert [k.key_id for k in listed.keys if k.label == "ci"] == [first.key.key_id]
    async with authed_gateway(gateway_addr, again.secret) as made:
        assert (await made.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)).company.name == "Acme"

    theirs = await globex_gw.CreateApiKey(gateway_pb2.CreateApiKeyRequest(label="ci", idempotency_key=key), timeout=10)
    assert theirs.key.key_id != first.key.key_id and theirs.secret != first.secret
    async with authed_gateway(gateway_addr, theirs.secret) as made:
        assert (await made.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)).company.company_id == globex.company_id

    # A session key under the same key is its own create (keys are namespaced by kind too).
    session = await acme_gw.CreateSessionKey(
        gateway_pb2.CreateSessionKeyRequest(ttl_seconds=600, label="console", idempotency_key=key), timeout=10
    )
    session_again = await acme_gw.CreateSessionKey(
        gateway_pb2.CreateSessionKeyRequest(ttl_seconds=600, label="console", idempotency_key=key), timeout=10
    )
    assert session.key_id != first.key.key_id
    assert (session_again.key_id, session_again.secret) == (session.key_id, session.secret)
    assert session_again.expires_at == session.expires_at
    listed = await acme_gw.ListApiKeys(gateway_pb2.ListApiKeysRequest(include_sessions=True), timeout=10)
    assert [k.key_id for k in listed.keys if k.label == "console"] == [session.key_id]

    # A session key may not make an API key: refused before any earlier answer is given.
    async with authed_gateway(gateway_addr, session.secret) as console:
        await expect_error(
            grpc.StatusCode.PERMISSION_DENIED,
            console.CreateApiKey(gateway_pb2.CreateApiKeyRequest(label="ci", idempotency_key=key), timeout=10),
        )
