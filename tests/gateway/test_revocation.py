"""Revocation takes effect everywhere within seconds: a revoked key's open streams end on every Gateway
replica sharing the database (by the revoke's notification, and by the periodic re-check when
notifications are missed), and session keys end with EndSession, with their company key, or at expiry.

Every wait here is a failsafe (the streams' own deadlines); nothing asserts on timing.
"""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import grpc
import pytest

from quayutec.v1 import gateway_pb2
from services.gateway.auth import create_api_key, list_api_keys, revoke_api_key
from tests.gateway.conftest import NOWHERE
from tests.gateway.helpers import GatewayStub, create_room, expect_error
from tests.gateway.test_watch import QUIET, caught_up, post, second_gateway
from tests.gateway.test_watch_rooms import next_heartbeat
from tests.harness.gateway import CompanyKey, authed_gateway, running_gateway

# An hour: the re-check cannot be what ends a stream in the notification tests.
NO_BACKSTOP = {"QUAYUTEC_GATEWAY_KEY_RECHECK_SECONDS": "3600"}
FAILSAFE_SECONDS = 60


def bearer(secret: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {secret}"),)


def watch_room(gw: GatewayStub, secret: str, room_id: str) -> Any:
    return gw.WatchRoom(
        gateway_pb2.WatchRoomRequest(room_id=room_id), metadata=bearer(secret), timeout=FAILSAFE_SECONDS
    )


def watch_rooms(gw: GatewayStub, secret: str) -> Any:
    return gw.WatchRooms(gateway_pb2.WatchRoomsRequest(), metadata=bearer(secret), timeout=FAILSAFE_SECONDS)


async def ended(call: Any) -> grpc.aio.AioRpcError:
    """Reads the stream to its end, which must be an error (the stream's deadline is the failsafe)."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    return err.value


def assert_revoked(err: grpc.aio.AioRpcError) -> None:
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, f"{err.code().name}: {err.details()}"
    assert "revoked" in (err.details() or "") and "while the stream was open" in (err.details() or ""), err.details()


async def test_a_revoked_keys_streams_end_on_two_replicas(
    database_url: str,
    room_addr: str,
    pool: asyncpg.Pool,
    acme: CompanyKey,
    globex: CompanyKey,
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
) -> None:
    room = await create_room(acme_gw)
    theirs = await create_room(globex_gw)
    doomed_id, doomed = await create_api_key(pool, acme.company_id, "to be revoked")
    async with (
        second_gateway(database_url, room_addr, doomed, **NO_BACKSTOP) as one,
        second_gateway(database_url, room_addr, doomed, **NO_BACKSTOP) as two,
    ):
        on_one = watch_room(one, doomed, room.room_id)
        on_two = watch_rooms(two, doomed)
        kept = watch_room(one, acme.secret, room.room_id)  # the company's other key
        bystander = watch_room(one, globex.secret, theirs.room_id)
        await caught_up(on_one)
        await next_heartbeat(on_two)
        await caught_up(kept)
        await caught_up(bystander)

        assert await revoke_api_key(pool, doomed_id)
        assert_revoked(await ended(on_one))
        assert_revoked(await ended(on_two))
        # Unary calls with it are refused as well; other keys and companies carry on.
        await expect_error(grpc.StatusCode.UNAUTHENTICATED, one.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10))
        await post(acme_gw, room.room_id, "still watched")
        await post(globex_gw, theirs.room_id, "globex too")
        for call, body in ((kept, "still watched"), (bystander, "globex too")):
            async for item in call:
                if any(e.message.body == body for e in item.events):
                    break
            call.cancel()


async def test_the_recheck_ends_a_revoked_keys_stream_when_notifications_are_missed(
    database_url: str, room_addr: str, pool: asyncpg.Pool, acme: CompanyKey, acme_gw: GatewayStub
) -> None:
    room = await create_room(acme_gw)
    doomed_id, doomed = await create_api_key(pool, acme.company_id, "to be revoked")
    deaf = {"QUAYUTEC_GATEWAY_KEY_NOTIFY": "false", "QUAYUTEC_GATEWAY_KEY_RECHECK_SECONDS": "0.2"}
    async with second_gateway(database_url, room_addr, doomed, **deaf) as gw:
        one = watch_room(gw, doomed, room.room_id)
        every = watch_rooms(gw, doomed)
        await caught_up(one)
        await next_heartbeat(every)
        assert await revoke_api_key(pool, doomed_id)
        assert_revoked(await ended(one))
        assert_revoked(await ended(every))


async def test_session_keys_end_with_end_session_with_their_company_key_and_at_expiry(
    database_url: str, room_addr: str, gateway_addr: str, pool: asyncpg.Pool, acme: CompanyKey, acme_gw: GatewayStub
) -> None:
    room = await create_room(acme_gw)
    made = await acme_gw.CreateSessionKey(
        gateway_pb2.CreateSessionKeyRequest(ttl_seconds=3600, label="console"), timeout=10
    )
    assert made.secret.startswith(f"qyk_{made.key_id}_") and made.expires_at.seconds > 0
    async with authed_gateway(gateway_addr, made.secret) as session:
        who = await session.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)
        assert who.company.company_id == acme.company_id
        await expect_error(
            grpc.StatusCode.PERMISSION_DENIED,
            session.CreateSessionKey(gateway_pb2.CreateSessionKeyRequest(ttl_seconds=600), timeout=10),
            "a session key cannot make another",
        )
        stream = watch_room(session, made.secret, room.room_id)
        await caught_up(stream)
        assert (await session.EndSession(gateway_pb2.EndSessionRequest(), timeout=10)).key_id == made.key_id
        assert_revoked(await ended(stream))
        await expect_error(
            grpc.StatusCode.UNAUTHENTICATED, session.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10), "revoked"
        )
    await expect_error(
        grpc.StatusCode.FAILED_PRECONDITION,
        acme_gw.EndSession(gateway_pb2.EndSessionRequest(), timeout=10),
        "quayutec keys revoke",
    )
    for ttl in (0, 59, 7 * 86_400 + 1):
        await expect_error(
            grpc.StatusCode.INVALID_ARGUMENT,
            acme_gw.CreateSessionKey(gateway_pb2.CreateSessionKeyRequest(ttl_seconds=ttl), timeout=10),
            "ttl_seconds must be between 60 and 604800",
        )

    # Revoking a company key revokes the session keys it made.
    parent_id, parent = await create_api_key(pool, acme.company_id, "parent")
    async with authed_gateway(gateway_addr, parent) as gw:
        child = await gw.CreateSessionKey(gateway_pb2.CreateSessionKeyRequest(ttl_seconds=600), timeout=10)
    await revoke_api_key(pool, parent_id)
    async with authed_gateway(gateway_addr, child.secret) as gw:
        await expect_error(grpc.StatusCode.UNAUTHENTICATED, gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10))

    # An expired session key is refused, and its open stream ends by the re-check.
    late = await acme_gw.CreateSessionKey(gateway_pb2.CreateSessionKeyRequest(ttl_seconds=600), timeout=10)
    async with second_gateway(database_url, room_addr, late.secret, QUAYUTEC_GATEWAY_KEY_RECHECK_SECONDS="0.2") as gw:
        stream = watch_room(gw, late.secret, room.room_id)
        await caught_up(stream)
        await pool.execute(
            "UPDATE api_keys SET expires_at = now() - interval '1 second' WHERE key_id = $1", uuid.UUID(late.key_id)
        )
        err = await ended(stream)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
        await expect_error(
            grpc.StatusCode.UNAUTHENTICATED, gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10), "expired"
        )

    # Session keys are listed only when asked for.
    listed = await list_api_keys(pool, acme.company_id)
    assert all(k.parent_key_id is None for k in listed)
    sessions = [k for k in await list_api_keys(pool, acme.company_id, sessions=True) if k.parent_key_id]
    assert {k.key_id for k in sessions} == {made.key_id, child.key_id, late.key_id}


async def test_a_company_key_has_a_bounded_number_of_live_session_keys(
    database_url: str, room_addr: str, acme: CompanyKey
) -> None:
    async with second_gateway(database_url, room_addr, acme.secret, QUAYUTEC_GATEWAY_MAX_SESSION_KEYS="2") as gw:
        for _ in range(2):
            await gw.CreateSessionKey(gateway_pb2.CreateSessionKeyRequest(ttl_seconds=60), timeout=10)
        await expect_error(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            gw.CreateSessionKey(gateway_pb2.CreateSessionKeyRequest(ttl_seconds=60), timeout=10),
            "QUAYUTEC_GATEWAY_MAX_SESSION_KEYS",
        )


async def test_a_revoked_keys_a2a_stream_ends_too(
    database_url: str, room_addr: str, pool: asyncpg.Pool, acme: CompanyKey, acme_gw: GatewayStub
) -> None:
    from a2a.types import a2a_pb2, a2a_pb2_grpc

    from services.gateway.a2a import tenant_of
    from tests.gateway.helpers import register_agent

    room = await create_room(acme_gw)
    agent = await register_agent(acme_gw, "helper")
    doomed_id, doomed = await create_api_key(pool, acme.company_id, "to be revoked")
    tenant = tenant_of(room.room_id, agent.agent_id)
    async with (
        running_gateway(database_url, room_addr, NOWHERE, **{**QUIET, **NO_BACKSTOP}) as addr,
        grpc.aio.insecure_channel(addr) as channel,
    ):
        stub = a2a_pb2_grpc.A2AServiceStub(channel)  # type: ignore[no-untyped-call]
        message = a2a_pb2.Message(message_id=str(uuid.uuid4()), role=a2a_pb2.ROLE_USER, parts=[a2a_pb2.Part(text="hi")])
        # Nothing delivers the wake here, so the task stays submitted and the stream stays open.
        call = stub.SendStreamingMessage(
            a2a_pb2.SendMessageRequest(tenant=tenant, message=message),
            metadata=bearer(doomed),
            timeout=FAILSAFE_SECONDS,
        )
        async for first in call:
            assert first.HasField("task")
            break
        assert await revoke_api_key(pool, doomed_id)
        assert_revoked(await ended(call))
