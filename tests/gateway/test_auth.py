"""API keys: made, listed and revoked by services.gateway.auth; checked by the Gateway's interceptor."""

from __future__ import annotations

import uuid

import asyncpg
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from quayutec.errors import InvalidArgument
from quayutec.v1 import gateway_pb2, gateway_pb2_grpc
from services.gateway.auth import create_api_key, list_api_keys, parse_key_id, revoke_api_key
from tests.harness.gateway import authed_gateway, running_gateway

# Nothing listens here: authentication must fail before any backend is called.
NOWHERE = "127.0.0.1:9"


async def test_create_list_revoke_keys(pool: asyncpg.Pool) -> None:
    company = str(uuid.uuid4())
    key_id, secret = await create_api_key(pool, company, "ci")
    assert secret.startswith(f"qyk_{key_id}_")
    assert parse_key_id(secret) == uuid.UUID(key_id)
    other_id, _ = await create_api_key(pool, company, "laptop")
    keys = await list_api_keys(pool, company)
    assert [(k.key_id, k.label, k.revoked) for k in keys] == [(key_id, "ci", False), (other_id, "laptop", False)]
    assert await revoke_api_key(pool, key_id) is True
    assert await revoke_api_key(pool, key_id) is True  # idempotent
    assert await revoke_api_key(pool, str(uuid.uuid4())) is False
    assert await revoke_api_key(pool, "not-a-key") is False
    assert [k.revoked for k in await list_api_keys(pool, company)] == [True, False]
    assert await list_api_keys(pool, str(uuid.uuid4())) == []


async def test_only_the_hash_is_stored(pool: asyncpg.Pool) -> None:
    key_id, secret = await create_api_key(pool, str(uuid.uuid4()), "")
    row = await pool.fetchrow("SELECT * FROM api_keys WHERE key_id = $1", uuid.UUID(key_id))
    assert row is not None
    assert secret.encode() not in bytes(row["key_hash"]) and len(row["key_hash"]) == 32
    # qyk_<key id>_<secret>: the secret part itself may hold "_" (URL-safe base64), so split twice only.
    secret_part = secret.split("_", 2)[2]
    assert len(secret_part) >= 32 and secret_part not in str(dict(row))


async def test_create_key_validates(pool: asyncpg.Pool) -> None:
    with pytest.raises(InvalidArgument, match="company_id"):
        await create_api_key(pool, "acme", "x")
    with pytest.raises(InvalidArgument, match="label"):
        await create_api_key(pool, str(uuid.uuid4()), "x" * 201)


@pytest.mark.parametrize(
    ("metadata", "says"),
    [
        ((), "no API key"),
        ((("authorization", "qyk_abc"),), "malformed authorization"),
        ((("authorization", "Basic dXNlcjpwdw=="),), "malformed authorization"),
        ((("authorization", "Bearer "),), "malformed authorization"),
        ((("authorization", "Bearer sk-something"),), "malformed API key"),
        ((("authorization", f"Bearer qyk_{uuid.uuid4()}_abcdef"),), "unknown API key"),
    ],
)
async def test_calls_without_a_good_key_are_unauthenticated(
    database_url: str, metadata: tuple[tuple[str, str], ...], says: str
) -> None:
    async with (
        running_gateway(database_url, NOWHERE, NOWHERE, QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false") as addr,
        grpc.aio.insecure_channel(addr) as channel,
    ):
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.WhoAmI(gateway_pb2.WhoAmIRequest(), metadata=metadata, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert says in (err.value.details() or "")
        assert "authorization: Bearer <api key>" in (err.value.details() or "")


async def test_wrong_secret_of_a_real_key_is_unknown(database_url: str, pool: asyncpg.Pool) -> None:
    key_id, secret = await create_api_key(pool, str(uuid.uuid4()), "")
    forged = f"qyk_{key_id}_{'A' * 43}"
    assert forged != secret
    async with (
        running_gateway(database_url, NOWHERE, NOWHERE, QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false") as addr,
        authed_gateway(addr, forged) as gw,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await gw.ListRooms(gateway_pb2.ListRoomsRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "unknown API key" in (err.value.details() or "")


async def test_health_needs_no_key(database_url: str) -> None:
    async with (
        running_gateway(database_url, NOWHERE, NOWHERE, QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false") as addr,
        grpc.aio.insecure_channel(addr) as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)
        response = await health.Check(health_pb2.HealthCheckRequest(service="quayutec.v1.GatewayService"))
        assert response.status == health_pb2.HealthCheckResponse.SERVING
