"""Hostile input gets a clear answer and no noise (issue 9 item 5), on real servers.

Forged page tokens are INVALID_ARGUMENT on every List RPC of Gateway and Room (walked from the
service descriptors). Bytes that do not decode as the request (corrupt protobuf, a string field that
is not UTF-8) are INVALID_ARGUMENT on every service, sent raw through a generic channel call; they are
logged as one warning without a traceback, at a bounded rate.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from quayutec.ratelog import RateLimitedLog
from quayutec.v1 import common_pb2, gateway_pb2, room_pb2, room_pb2_grpc
from services.stack import free_port
from tests.harness.channels import service_channel
from tests.harness.claims import running_claims
from tests.harness.gateway import make_company, running_gateway
from tests.harness.room import add_member, running_room
from tests.harness.runtime import running_runtime

NOWHERE = "127.0.0.1:9"  # nothing listens here: the Gateway's delivery and the Runtime's backends are unused
INVALID = grpc.StatusCode.INVALID_ARGUMENT

# Every list's name for its tokens (services/room/validate.py), so the out-of-range cursor is tried
# with the scope each list really uses.
SCOPES = (
    "rooms members agents tasks memory files runs messages-newest messages-oldest "
    "invitations-pending invitations-accepted invitations-declined "
    "waitpoints-pending waitpoints-completed waitpoints-expired"
).split()


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


FORGED = [
    *(_b64(f"{scope}:{2**63}") for scope in SCOPES),  # one past the largest bigint
    *(_b64(f"{scope}:{10**40}") for scope in ("rooms", "messages-oldest")),
    _b64("rooms:-1"),
    _b64("rooms: 12"),
    _b64("rooms:1_000"),
    _b64("rooms:١٢"),  # Arabic-Indic digits: int() would take them
    "%%%not-base64%%%",
    "cm9vbXM6MQ",  # missing padding
    "ü",
    "A" * 5000,
]

# Raw request bodies that do not decode: field 1 is a string in every request below.
BAD_UTF8 = b"\x0a\x02\xc3\x28"  # field 1, two bytes that are not UTF-8
TRUNCATED = b"\x0a\x10abc"  # field 1 says 16 bytes, three follow
GARBAGE = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"  # a varint longer than any varint
UNDECODABLE = (BAD_UTF8, TRUNCATED, GARBAGE)


@dataclass
class World:
    room_addr: str
    gateway_addr: str
    claims_addr: str
    runtime_addr: str
    company_id: str
    secret: str
    room_id: str
    agent_id: str


@pytest.fixture
async def world(database_url: str) -> AsyncIterator[World]:
    async with (
        running_room(database_url) as room_addr,
        running_claims(database_url) as claims_addr,
        running_runtime(claims_addr, room_addr) as runtime_addr,
        running_gateway(
            database_url, room_addr, NOWHERE, QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false", QUAYUTEC_GATEWAY_POST_RATE="0"
        ) as gateway_addr,
    ):
        acme = await make_company(database_url, room_addr)
        other = await make_company(database_url, room_addr)
        async with service_channel(room_addr, "gateway") as channel:
            room = room_pb2_grpc.RoomServiceStub(channel)
            made = await room.CreateRoom(room_pb2.RoomServiceCreateRoomRequest(company_id=acme.company_id, name="r"))
            await add_member(room, made.room.room_id, other.company_id, invited_by=acme.company_id)
            agent = await room.RegisterAgent(
                room_pb2.RoomServiceRegisterAgentRequest(
                    company_id=acme.company_id,
                    name="planner",
                    provider=common_pb2.PROVIDER_ANTHROPIC,
                    model="claude-x",
                    provider_key="sk-x",
                )
            )
        yield World(
            room_addr=room_addr,
            gateway_addr=gateway_addr,
            claims_addr=claims_addr,
            runtime_addr=runtime_addr,
            company_id=acme.company_id,
            secret=acme.secret,
            room_id=made.room.room_id,
            agent_id=agent.agent.agent_id,
        )


# Id fields a request must leave empty when the others are set (the Room's ListAgents takes a company
# or a room, not both).
LEFT_EMPTY = {("RoomServiceListAgentsRequest", "company_id")}


def _request(module: Any, type_name: str, world: World) -> Message:
    """A request of ``type_name`` with every id field naming something real, so only the token is wrong."""
    request: Message = getattr(module, type_name)()
    ids = {"room_id": world.room_id, "agent_id": world.agent_id, "to_agent_id": world.agent_id}
    for field in request.DESCRIPTOR.fields:
        if field.type != field.TYPE_STRING or not field.name.endswith("_id"):
            continue
        if (type_name, field.name) in LEFT_EMPTY:
            continue
        setattr(request, field.name, ids.get(field.name, world.company_id))
    return request


def _list_methods(module: Any, service: str) -> list[tuple[str, str]]:
    """(method path, request type name) of every RPC of ``service`` whose request has a page_token."""
    descriptor = module.DESCRIPTOR.services_by_name[service]
    return [
        (f"/{descriptor.full_name}/{m.name}", m.input_type.name)
        for m in descriptor.methods
        if "page_token" in m.input_type.fields_by_name
    ]


async def _unary(channel: grpc.aio.Channel, method: str, body: bytes, metadata: Any = None) -> bytes:
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    answer: bytes = await call(body, metadata=metadata, timeout=10)
    return answer


async def _expect(code: grpc.StatusCode, call: Any, says: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, f"{code.name} expected, got {err.value.code().name}: {err.value.details()}"
    assert says in (err.value.details() or ""), err.value.details()


async def test_forged_page_tokens_are_invalid_argument_on_every_list(world: World) -> None:
    bearer = (("authorization", f"Bearer {world.secret}"),)
    targets = [
        (world.room_addr, room_pb2, "RoomService", None),
        (world.gateway_addr, gateway_pb2, "GatewayService", bearer),
    ]
    walked = []
    for addr, module, service, metadata in targets:
        identity = "gateway" if service == "RoomService" else "admin"
        async with service_channel(addr, identity) if metadata is None else grpc.aio.insecure_channel(addr) as channel:
            for method, type_name in _list_methods(module, service):
                request = _request(module, type_name, world)
                # The request is right apart from the token: without one it is answered.
                await _unary(channel, method, request.SerializeToString(), metadata)
                for token in FORGED:
                    request.page_token = token  # type: ignore[attr-defined]
                    await _expect(INVALID, _unary(channel, method, request.SerializeToString(), metadata), "page_token")
                walked.append(method)
    assert {m.rsplit("/", 1)[1] for m in walked} >= {"ListRooms", "ListMessages", "ListRuns", "ListInvitations"}
    assert any(m.startswith("/quayutec.v1.GatewayService/") for m in walked)


async def test_undecodable_requests_are_invalid_argument_everywhere(world: World) -> None:
    bearer = (("authorization", f"Bearer {world.secret}"),)
    methods = [
        (world.room_addr, "gateway", "/quayutec.v1.RoomService/ListRooms", None),
        (world.room_addr, "runtime", "/quayutec.v1.RoomService/ReadRunContext", None),
        (world.claims_addr, "runtime", "/quayutec.v1.ClaimsService/ClaimOnce", None),
        (world.runtime_addr, "gateway", "/quayutec.v1.RuntimeService/StartRun", None),
        (world.gateway_addr, "", "/quayutec.v1.GatewayService/PostMessage", bearer),
        (world.room_addr, "admin", "/grpc.health.v1.Health/Check", None),
    ]
    for addr, identity, method, metadata in methods:
        # The Gateway is the public door (no client certificate); the others are reached as a service.
        public = addr == world.gateway_addr
        async with grpc.aio.insecure_channel(addr) if public else service_channel(addr, identity) as channel:
            for body in UNDECODABLE:
                await _expect(INVALID, _unary(channel, method, body, metadata), "does not decode")
            # The server is fine afterwards.
            health = await _unary(channel, "/grpc.health.v1.Health/Check", b"")
            assert health == b"\x08\x01"  # SERVING


async def test_the_plaintext_health_port_answers_undecodable_requests_cleanly(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone who reaches the probes' port gets INVALID_ARGUMENT and one short line, no traceback."""
    caplog.set_level(logging.INFO)
    health_addr = f"127.0.0.1:{free_port()}"
    async with (
        running_room(database_url, QUAYUTEC_ROOM_HEALTH_LISTEN=health_addr),
        grpc.aio.insecure_channel(health_addr) as channel,
    ):
        for body in UNDECODABLE:
            await _expect(INVALID, _unary(channel, "/grpc.health.v1.Health/Check", body), "does not decode")
        assert await _unary(channel, "/grpc.health.v1.Health/Check", b"") == b"\x08\x01"
    assert not [r for r in caplog.records if r.name.startswith("grpc") or r.exc_info is not None]
    assert [r for r in caplog.records if r.name == "quayutec.undecodable"]


async def test_an_undecodable_stream_message_is_invalid_argument(world: World) -> None:
    async with service_channel(world.room_addr, "admin") as channel:
        for method in (
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            "/grpc.health.v1.Health/Watch",
        ):
            if method.endswith("Watch"):
                call: Any = channel.unary_stream(method, request_serializer=None, response_deserializer=None)(
                    GARBAGE, timeout=10
                )
            else:
                call = channel.stream_stream(method, request_serializer=None, response_deserializer=None)(
                    iter([GARBAGE]), timeout=10
                )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            assert err.value.code() == INVALID, err.value.details()


async def test_an_unauthenticated_undecodable_request_is_refused_without_a_line(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with grpc.aio.insecure_channel(world.gateway_addr) as channel:
        for body in UNDECODABLE:
            await _expect(
                grpc.StatusCode.UNAUTHENTICATED, _unary(channel, "/quayutec.v1.GatewayService/ListRooms", body), "key"
            )
    assert not [r for r in caplog.records if r.name in ("quayutec.undecodable", "grpc._common")]


async def test_undecodable_requests_are_logged_briefly_and_at_a_bounded_rate(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    sent = 60
    started = time.monotonic()
    async with service_channel(world.room_addr, "gateway") as channel:
        for i in range(sent):
            await _expect(INVALID, _unary(channel, "/quayutec.v1.RoomService/ListRooms", UNDECODABLE[i % 3]), "decode")
    elapsed = time.monotonic() - started
    lines = [r for r in caplog.records if r.name == "quayutec.undecodable"]
    # The default: 10 at once, refilled at 10 a minute. A bound from the elapsed time, not a timing claim.
    assert 1 <= len(lines) <= 10 + int(elapsed / 6.0) + 1
    assert all(r.exc_info is None and r.levelno == logging.WARNING for r in lines)
    assert "ListRooms" in lines[0].getMessage() and "does not decode" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.name.startswith("grpc") or r.exc_info is not None]


def test_the_rate_limited_log_counts_what_it_drops(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("test.ratelog"), burst=3, per_seconds=30.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, "test.ratelog")
    written = [log.warning("bad %d", i) for i in range(10)]
    assert written == [True, True, True] + [False] * 7
    now[0] += 10.0  # one line's worth of refill
    assert log.warning("bad %d", 10) and not log.warning("bad %d", 11)
    assert [r.getMessage() for r in caplog.records] == [
        "bad 0",
        "bad 1",
        "bad 2",
        "bad 10 (7 similar lines suppressed)",
    ]
    assert log.suppressed == 1
