"""Fixtures for Room tests: a real Room server on a fresh database, a stub, and a small world."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from quayutec.config import ROOM
from quayutec.v1 import common_pb2, room_pb2, room_pb2_grpc
from tests.harness.channels import callers_stub
from tests.harness.room import add_member, running_room

Stub = Any  # RoomServiceStub


@pytest.fixture
async def room_addr(database_url: str) -> AsyncIterator[str]:
    async with running_room(database_url) as addr:
        yield addr


@pytest.fixture
async def room(room_addr: str) -> AsyncIterator[Stub]:
    """RoomService, each RPC called as the identity that makes it in production."""
    async with callers_stub(room_addr, ROOM.grpc_service, room_pb2_grpc.RoomServiceStub) as stub:
        yield stub


async def expect_error(code: grpc.StatusCode, call: Awaitable[Any], contains: str = "") -> str:
    """Awaits ``call``, asserts it failed with ``code`` (and ``contains`` in the details); returns the details."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == code, f"expected {code.name}, got {exc.code().name}: {exc.details()}"
        assert contains in (exc.details() or ""), exc.details()
        return exc.details() or ""
    raise AssertionError(f"expected {code.name}, the call succeeded")


def person(company_id: str, name: str = "ana") -> common_pb2.Author:
    return common_pb2.Author(kind=common_pb2.AUTHOR_KIND_PERSON, company_id=company_id, person=name)


def agent_author(agent: common_pb2.Agent) -> common_pb2.Author:
    return common_pb2.Author(kind=common_pb2.AUTHOR_KIND_AGENT, company_id=agent.company_id, agent_id=agent.agent_id)


async def make_company(room: Stub, name: str | None = None) -> common_pb2.Company:
    name = name or f"co-{uuid.uuid4().hex[:8]}"
    company: common_pb2.Company = (
        await room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name=name))
    ).company
    return company


async def make_agent(room: Stub, company_id: str, name: str = "helper", key: str = "sk-test") -> common_pb2.Agent:
    request = room_pb2.RoomServiceRegisterAgentRequest(
        company_id=company_id, name=name, provider=common_pb2.PROVIDER_ANTHROPIC, model="claude-x", provider_key=key
    )
    agent: common_pb2.Agent = (await room.RegisterAgent(request)).agent
    return agent


@dataclass
class World:
    """Acme and Bolt share a room; each has one agent. Crow is a company outside the room."""

    acme: common_pb2.Company
    bolt: common_pb2.Company
    crow: common_pb2.Company
    room_id: str
    acme_agent: common_pb2.Agent
    bolt_agent: common_pb2.Agent
    crow_agent: common_pb2.Agent


@pytest.fixture
async def world(room: Stub) -> World:
    acme_c, bolt_c, crow_c = [await make_company(room, n) for n in ("Acme", "Bolt", "Crow")]
    created = await room.CreateRoom(room_pb2.RoomServiceCreateRoomRequest(company_id=acme_c.company_id, name="launch"))
    room_id = created.room.room_id
    await add_member(room, room_id, bolt_c.company_id, invited_by=acme_c.company_id)
    return World(
        acme=acme_c,
        bolt=bolt_c,
        crow=crow_c,
        room_id=room_id,
        acme_agent=await make_agent(room, acme_c.company_id, "planner", "sk-acme-secret"),
        bolt_agent=await make_agent(room, bolt_c.company_id, "writer", "sk-bolt-secret"),
        crow_agent=await make_agent(room, crow_c.company_id, "outsider", "sk-crow-secret"),
    )


async def post(
    room: Stub, world: World, body: str = "hello", mentions: list[str] | None = None, **fields: Any
) -> room_pb2.RoomServicePostMessageResponse:
    fields.setdefault("author", person(world.acme.company_id))
    request = room_pb2.RoomServicePostMessageRequest(
        room_id=world.room_id, body=body, mention_agent_ids=mentions or [], **fields
    )
    response: room_pb2.RoomServicePostMessageResponse = await room.PostMessage(request)
    return response
