"""Companies, rooms, members and agents over a real Room server."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import grpc

from quayutec.v1 import common_pb2, room_pb2, room_pb2_grpc
from tests.harness.channels import service_channel
from tests.harness.room import running_room
from tests.room.conftest import Stub, World, expect_error, make_agent, make_company

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
MISSING = str(uuid.uuid4())


async def test_create_and_get_company(room: Stub) -> None:
    made = await make_company(room, "Acme")
    got = (await room.GetCompany(room_pb2.RoomServiceGetCompanyRequest(company_id=made.company_id))).company
    assert got == made and got.name == "Acme" and got.created_at.seconds > 0


async def test_company_errors(room: Stub) -> None:
    await make_company(room, "Acme")
    await expect_error(
        grpc.StatusCode.ALREADY_EXISTS,
        room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name="Acme")),
        "Acme",
    )
    await expect_error(INVALID, room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name="")), "name")
    await expect_error(INVALID, room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name="x" * 201)), "200")
    await expect_error(INVALID, room.GetCompany(room_pb2.RoomServiceGetCompanyRequest(company_id="nope")), "company_id")
    await expect_error(NOT_FOUND, room.GetCompany(room_pb2.RoomServiceGetCompanyRequest(company_id=MISSING)))


async def test_create_room_makes_the_creator_a_member(room: Stub) -> None:
    acme = await make_company(room)
    made = (await room.CreateRoom(room_pb2.RoomServiceCreateRoomRequest(company_id=acme.company_id, name="r"))).room
    assert made.created_by_company_id == acme.company_id
    members = await room.ListMembers(room_pb2.RoomServiceListMembersRequest(room_id=made.room_id))
    assert [m.company_id for m in members.members] == [acme.company_id]
    got = await room.GetRoom(
        room_pb2.RoomServiceGetRoomRequest(room_id=made.room_id, member_company_id=acme.company_id)
    )
    assert got.room == made


async def test_room_errors(room: Stub, world: World) -> None:
    await expect_error(NOT_FOUND, room.CreateRoom(room_pb2.RoomServiceCreateRoomRequest(company_id=MISSING, name="r")))
    await expect_error(
        INVALID, room.CreateRoom(room_pb2.RoomServiceCreateRoomRequest(company_id=world.acme.company_id, name=""))
    )
    await expect_error(NOT_FOUND, room.GetRoom(room_pb2.RoomServiceGetRoomRequest(room_id=MISSING)))
    await expect_error(INVALID, room.GetRoom(room_pb2.RoomServiceGetRoomRequest(room_id="x")))
    await expect_error(
        NOT_FOUND,
        room.GetRoom(
            room_pb2.RoomServiceGetRoomRequest(room_id=world.room_id, member_company_id=world.crow.company_id)
        ),
    )
    await expect_error(INVALID, room.ListRooms(room_pb2.RoomServiceListRoomsRequest()), "company_id")


async def test_list_rooms_pages_with_an_opaque_token(room: Stub) -> None:
    acme = await make_company(room)
    other = await make_company(room)
    made = []
    for i in range(7):
        request = room_pb2.RoomServiceCreateRoomRequest(company_id=acme.company_id, name=f"room {i}")
        made.append((await room.CreateRoom(request)).room.room_id)
    await room.CreateRoom(room_pb2.RoomServiceCreateRoomRequest(company_id=other.company_id, name="not acme's"))
    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        page = await room.ListRooms(
            room_pb2.RoomServiceListRoomsRequest(company_id=acme.company_id, page_size=3, page_token=token)
        )
        seen.extend(r.room_id for r in page.rooms)
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert seen == made and pages == 3
    for bad in ("garbage!", "bWVtYmVyczoz", "cm9vbXM6eA=="):  # not base64; another list's token; a bad key
        await expect_error(
            INVALID,
            room.ListRooms(room_pb2.RoomServiceListRoomsRequest(company_id=acme.company_id, page_token=bad)),
            "page_token",
        )
    for size in (-1, 501):
        await expect_error(
            INVALID,
            room.ListRooms(room_pb2.RoomServiceListRoomsRequest(company_id=acme.company_id, page_size=size)),
            "page_size",
        )


async def test_register_and_get_agent_never_returns_the_key(room: Stub, database_url: str) -> None:
    acme = await make_company(room)
    request = room_pb2.RoomServiceRegisterAgentRequest(
        company_id=acme.company_id,
        name="planner",
        provider=common_pb2.PROVIDER_OPENAI_COMPATIBLE,
        model="llama",
        base_url="https://models.acme.test/v1",
        provider_key="sk-very-secret-123",
        system_prompt="Plan.",
    )
    response = await room.RegisterAgent(request)
    agent = response.agent
    assert agent.has_provider_key and agent.base_url == "https://models.acme.test/v1"
    assert agent.provider == common_pb2.PROVIDER_OPENAI_COMPATIBLE and agent.system_prompt == "Plan."
    got = await room.GetAgent(room_pb2.RoomServiceGetAgentRequest(agent_id=agent.agent_id))
    assert got.agent == agent
    listed = await room.ListAgents(room_pb2.RoomServiceListAgentsRequest(company_id=acme.company_id))
    assert list(listed.agents) == [agent]
    for answer in (response, got, listed):
        assert b"sk-very-secret-123" not in answer.SerializeToString()

    creds = await room.GetAgentCredentials(room_pb2.RoomServiceGetAgentCredentialsRequest(agent_id=agent.agent_id))
    assert creds.provider_key == "sk-very-secret-123" and creds.agent == agent

    conn = await asyncpg.connect(database_url)
    try:
        stored = await conn.fetchval("SELECT provider_key_encrypted FROM agents WHERE agent_id = $1", agent.agent_id)
        row_text = await conn.fetchval("SELECT a::text FROM agents a WHERE agent_id = $1", agent.agent_id)
    finally:
        await conn.close()
    assert stored and b"sk-very-secret-123" not in bytes(stored)
    assert "sk-very-secret-123" not in row_text


async def test_agent_without_key_and_agent_errors(room: Stub) -> None:
    acme = await make_company(room)
    bare = await make_agent(room, acme.company_id, key="")
    assert not bare.has_provider_key
    creds = await room.GetAgentCredentials(room_pb2.RoomServiceGetAgentCredentialsRequest(agent_id=bare.agent_id))
    assert creds.provider_key == ""

    def reg(**fields: Any) -> room_pb2.RoomServiceRegisterAgentRequest:
        base: dict[str, Any] = {
            "company_id": acme.company_id,
            "name": "a",
            "provider": common_pb2.PROVIDER_OPENAI,
            "model": "gpt",
        }
        return room_pb2.RoomServiceRegisterAgentRequest(**{**base, **fields})

    await expect_error(INVALID, room.RegisterAgent(reg(provider=common_pb2.PROVIDER_UNSPECIFIED)), "provider")
    await expect_error(INVALID, room.RegisterAgent(reg(model="")), "model")
    await expect_error(INVALID, room.RegisterAgent(reg(name="n" * 201)), "name")
    for url in ("ftp://x.test", "not a url", "https://", "http://user:pw@x.test/v1", "https://x.test:99999"):
        await expect_error(INVALID, room.RegisterAgent(reg(base_url=url)), "base_url")
    await expect_error(INVALID, room.RegisterAgent(reg(provider=common_pb2.PROVIDER_OPENAI_COMPATIBLE)), "base_url")
    await expect_error(NOT_FOUND, room.RegisterAgent(reg(company_id=MISSING)), "company")
    await expect_error(INVALID, room.RegisterAgent(reg(company_id="acme")), "company_id")
    await expect_error(NOT_FOUND, room.GetAgent(room_pb2.RoomServiceGetAgentRequest(agent_id=MISSING)))
    await expect_error(INVALID, room.GetAgent(room_pb2.RoomServiceGetAgentRequest(agent_id="")))
    await expect_error(
        NOT_FOUND, room.GetAgentCredentials(room_pb2.RoomServiceGetAgentCredentialsRequest(agent_id=MISSING))
    )
    await expect_error(INVALID, room.RegisterAgent(reg(base_url="http://127.0.0.1:8080/v1")), "plain_http")
    ok = await room.RegisterAgent(reg(base_url="https://models.acme.test/v1"))
    assert ok.agent.base_url == "https://models.acme.test/v1" and not ok.agent.has_provider_key


async def test_list_agents_pages(room: Stub) -> None:
    acme = await make_company(room)
    ids = [(await make_agent(room, acme.company_id, f"a{i}")).agent_id for i in range(5)]
    first = await room.ListAgents(room_pb2.RoomServiceListAgentsRequest(company_id=acme.company_id, page_size=4))
    second = await room.ListAgents(
        room_pb2.RoomServiceListAgentsRequest(company_id=acme.company_id, page_size=4, page_token=first.next_page_token)
    )
    assert [a.agent_id for a in (*first.agents, *second.agents)] == ids and not second.next_page_token
    empty = await room.ListAgents(room_pb2.RoomServiceListAgentsRequest(company_id=MISSING))
    assert not empty.agents
    listing = room_pb2.RoomServiceListAgentsRequest
    await expect_error(INVALID, room.ListAgents(listing()), "company_id")
    assert not (await room.ListAgents(listing(room_id=MISSING))).agents
    assert not (await room.ListAgents(listing(company_id=acme.company_id, room_id=MISSING))).agents


async def test_the_agents_in_a_room_are_its_member_companies_agents(room: Stub, world: World) -> None:
    """By room_id: every member company's agents (not an outsider's); with company_id too, that company's."""
    listing = room_pb2.RoomServiceListAgentsRequest
    in_room = await room.ListAgents(listing(room_id=world.room_id))
    assert [a.agent_id for a in in_room.agents] == [world.acme_agent.agent_id, world.bolt_agent.agent_id]
    bolts = await room.ListAgents(listing(room_id=world.room_id, company_id=world.bolt.company_id))
    assert [a.agent_id for a in bolts.agents] == [world.bolt_agent.agent_id]
    assert not (await room.ListAgents(listing(room_id=world.room_id, company_id=world.crow.company_id))).agents
    await expect_error(INVALID, room.ListAgents(listing(room_id="nope")), "room_id")


async def test_credentials_under_another_key_are_failed_precondition(room: Stub, database_url: str) -> None:
    acme = await make_company(room)
    agent = await make_agent(room, acme.company_id)
    other_key = "b3RoZXIta2V5LXF1YXl1dGVjLXJvb21zLTAwMDAwMDA="
    async with running_room(database_url, QUAYUTEC_ENCRYPTION_KEY=other_key) as addr:
        async with service_channel(addr, "runtime") as channel:
            other = room_pb2_grpc.RoomServiceStub(channel)
            await expect_error(
                grpc.StatusCode.FAILED_PRECONDITION,
                other.GetAgentCredentials(room_pb2.RoomServiceGetAgentCredentialsRequest(agent_id=agent.agent_id)),
                "QUAYUTEC_ENCRYPTION_KEY",
            )
