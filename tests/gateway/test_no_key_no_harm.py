"""A client with no key cannot take a door down: health checks and reflection, open to anyone, have a
budget of their own (and per source), so holding more of their streams than a server's whole call
limit never refuses an authenticated PostMessage or WatchRooms, nor a probe's Check on the internal
services' plaintext health ports. Real servers and real clients; every loop is bounded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from quayutec.config import GATEWAY, ROOM
from quayutec.v1 import gateway_pb2
from services.room.server import create_server as create_room_server
from tests.gateway.conftest import NOWHERE
from tests.gateway.helpers import create_room
from tests.gateway.test_watch import auth
from tests.harness.gateway import CompanyKey, authed_gateway, running_gateway
from tests.harness.room import room_config

# Separate connections (not the process-wide shared one), as separate attackers' clients would use.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


@asynccontextmanager
async def channels(addr: str, count: int) -> AsyncIterator[list[grpc.aio.Channel]]:
    async with AsyncExitStack() as stack:
        opened = [
            await stack.enter_async_context(grpc.aio.insecure_channel(addr, options=OWN_CONNECTION))
            for _ in range(count)
        ]
        yield opened


async def first_answer(call: Any) -> grpc.StatusCode:
    """OK when the stream's first item arrives (the stream is then held open), else its refusal's code."""
    try:
        await asyncio.wait_for(call.read(), 30)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def open_streams(chans: Sequence[grpc.aio.Channel], count: int, service: str) -> list[Any]:
    """``count`` no-key streams spread over ``chans``: health Watch and reflection in turn."""
    calls: list[Any] = []
    for n in range(count):
        channel = chans[n % len(chans)]
        if n % 2:
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=120)
            calls.append(reflect)
        else:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=service), timeout=120
            )
            calls.append(watch)
    return calls


async def held(calls: Sequence[Any]) -> list[grpc.StatusCode]:
    async def answer(call: Any) -> grpc.StatusCode:
        if hasattr(call, "write"):  # reflection: ask, so its first answer comes
            try:
                await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            except asyncio.InvalidStateError:
                pass  # already ended by the server: read() says how
        return await first_answer(call)

    return list(await asyncio.gather(*(answer(c) for c in calls)))


async def served_with_a_key(addr: str, key: CompanyKey) -> None:
    """An authenticated PostMessage and a WatchRooms that delivers it."""
    async with authed_gateway(addr, key.secret) as gw:
        room = await create_room(gw, "still served")
        # From the room's start, not from now: a stream set up after the post commits still delivers it.
        start = gateway_pb2.RoomCursor(room_id=room.room_id, cursor=0)
        rooms = gw.WatchRooms(gateway_pb2.WatchRoomsRequest(after=[start]), metadata=auth(key), timeout=60)
        posted = await gw.PostMessage(
            gateway_pb2.PostMessageRequest(room_id=room.room_id, person="Ada", body="still here"), timeout=30
        )
        async with asyncio.timeout(30):
            async for item in rooms:
                if any(
                    e.HasField("message") and e.message.message_id == posted.message.message_id for e in item.events
                ):
                    break
        rooms.cancel()


async def test_more_no_key_streams_than_the_call_limit_refuse_no_authenticated_call(
    database_url: str, room_addr: str, acme: CompanyKey
) -> None:
    """The finding as seen: 1,100 health Watch and reflection streams with no key (the default limit
    is 1,024 concurrent calls) on a few connections; PostMessage and WatchRooms are still served."""
    async with (
        running_gateway(database_url, room_addr, NOWHERE, QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false") as addr,
        channels(addr, 4) as chans,
    ):
        calls = open_streams(chans, 1100, GATEWAY.grpc_service)
        try:
            codes = await held(calls)
            # One source holds at most its share (QUAYUTEC_GRPC_OPEN_CALLS_PER_SOURCE, 8); the rest is
            # refused at once instead of being queued or counted against anyone else.
            assert codes.count(grpc.StatusCode.OK) == 8, {c: codes.count(c) for c in set(codes)}
            assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 1092
            await served_with_a_key(addr, acme)
            # The held streams are still open: it is the budget, not their end, that lets the call in.
            assert sum(1 for c in calls if not c.done()) == 8
        finally:
            for call in calls:
                call.cancel()


async def test_at_a_small_call_limit_keyed_calls_get_every_place_while_no_key_streams_are_held(
    database_url: str, room_addr: str, acme: CompanyKey
) -> None:
    """With the limit at 12: the no-key budget held whole (and 40 more tried, past the keyed limit),
    authenticated calls still get all 12 places, and the 13th is the one refused."""
    async with (
        running_gateway(
            database_url,
            room_addr,
            NOWHERE,
            QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false",
            QUAYUTEC_GRPC_MAX_CALLS="12",
            QUAYUTEC_GRPC_OPEN_CALLS="6",
            QUAYUTEC_GRPC_OPEN_CALLS_PER_SOURCE="6",
        ) as addr,
        channels(addr, 2) as chans,
        authed_gateway(addr, acme.secret) as gw,
    ):
        room = await create_room(gw, "at the limit")
        no_key = open_streams(chans, 46, GATEWAY.grpc_service)
        keyed: list[Any] = []
        try:
            codes = await held(no_key)
            assert codes.count(grpc.StatusCode.OK) == 6 and codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 40
            # 11 WatchRooms held (each answers its first heartbeat), then a PostMessage: 12 places.
            for _ in range(11):
                call = gw.WatchRooms(gateway_pb2.WatchRoomsRequest(), metadata=auth(acme), timeout=60)
                keyed.append(call)
                assert await first_answer(call) == grpc.StatusCode.OK
            await gw.PostMessage(
                gateway_pb2.PostMessageRequest(room_id=room.room_id, person="Ada", body="the twelfth"), timeout=30
            )
            # The limit holds for keyed calls: a 13th stream is refused, by the keyed budget.
            extra = gw.WatchRooms(gateway_pb2.WatchRoomsRequest(), metadata=auth(acme), timeout=60)
            keyed.append(extra)
            assert await first_answer(extra) == grpc.StatusCode.OK
            refused: grpc.aio.AioRpcError | None = None
            try:
                await gw.PostMessage(
                    gateway_pb2.PostMessageRequest(room_id=room.room_id, person="Ada", body="the thirteenth"),
                    timeout=30,
                )
            except grpc.aio.AioRpcError as exc:
                refused = exc
            assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "QUAYUTEC_GRPC_MAX_CALLS" in (refused.details() or "")
        finally:
            for call in (*no_key, *keyed):
                call.cancel()


async def test_held_watch_streams_never_refuse_a_probes_check_on_the_plaintext_health_port(
    database_url: str,
) -> None:
    """The Room's plaintext health port (for kubelets): 40 Watch streams held over 5 connections (20
    made the Check fail before), then 20 Checks on fresh connections, each SERVING."""
    config = room_config(database_url, QUAYUTEC_ROOM_HEALTH_LISTEN="127.0.0.1:0")
    server = await create_room_server(config)
    await server.start()
    addr = f"127.0.0.1:{server.health_port}"
    try:
        async with channels(addr, 5) as chans:
            watches = [
                health_pb2_grpc.HealthStub(chans[n % 5]).Watch(
                    health_pb2.HealthCheckRequest(service=ROOM.grpc_service), timeout=120
                )
                for n in range(40)
            ]
            try:
                # One source holds at most 8 Watch streams; the rest are refused at once.
                answers = await asyncio.gather(*(first_answer(w) for w in watches))
                assert answers.count(grpc.StatusCode.OK) == 8
                assert answers.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 32
                for _ in range(20):
                    async with grpc.aio.insecure_channel(addr, options=OWN_CONNECTION) as probe:
                        answer = await health_pb2_grpc.HealthStub(probe).Check(
                            health_pb2.HealthCheckRequest(service=ROOM.grpc_service), timeout=10
                        )
                        assert answer.status == health_pb2.HealthCheckResponse.SERVING
            finally:
                for watch in watches:
                    watch.cancel()
    finally:
        await server.stop()
