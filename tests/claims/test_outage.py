"""A database outage is UNAVAILABLE, never a false claimed=true, and claims outlive PostgreSQL restarts."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator

import asyncpg
import grpc
import pytest

from quayutec.db import create_pool
from quayutec.v1 import claims_pb2
from tests.harness.channels import service_channel
from tests.harness.claims import claims_stub, running_claims
from tests.harness.postgres import OwnPostgres

TIMEOUT = 30.0


@pytest.fixture
async def own_database_url(own_postgres: OwnPostgres) -> AsyncIterator[str]:
    own_postgres.start()  # a no-op when running; restarts it if an earlier test left it stopped
    yield own_postgres.url


def request(agent_id: str, wake_id: str) -> claims_pb2.ClaimOnceRequest:
    return claims_pb2.ClaimOnceRequest(agent_id=agent_id, wake_id=wake_id)


async def test_claim_survives_a_postgres_restart_and_outage_is_unavailable(
    own_postgres: OwnPostgres, own_database_url: str
) -> None:
    agent_id, wake_id = f"agent-{uuid.uuid4()}", f"wake-{uuid.uuid4()}"
    other = f"wake-{uuid.uuid4()}"
    async with (
        running_claims(own_database_url, acquire_timeout_seconds=2.0) as addr,
        service_channel(addr, "runtime") as channel,
    ):
        stub = claims_stub(channel)
        first = await stub.ClaimOnce(request(agent_id, wake_id), timeout=TIMEOUT)
        assert first.claimed is True

        await asyncio.to_thread(own_postgres.stop)
        for _ in range(3):  # first on the pooled (now dead) connection, then on reconnects
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ClaimOnce(request(agent_id, other), timeout=TIMEOUT)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetClaim(claims_pb2.GetClaimRequest(agent_id=agent_id, wake_id=wake_id), timeout=TIMEOUT)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        await asyncio.to_thread(own_postgres.start)
        # The same server, reconnected: the claim made before the restart is still there.
        again = await stub.ClaimOnce(request(agent_id, wake_id), timeout=TIMEOUT)
        assert again.claimed is False
        assert again.claimed_at == first.claimed_at
        # Nothing was claimed while the database was down.
        later = await stub.ClaimOnce(request(agent_id, other), timeout=TIMEOUT)
        assert later.claimed is True


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("batch_max", [1, 256])
async def test_connection_refused_is_unavailable(batch_max: int) -> None:
    url = f"postgresql://postgres@127.0.0.1:{closed_port()}/postgres"
    pool = await asyncpg.create_pool(url, min_size=0, max_size=2)
    try:
        async with (
            running_claims(url, pool=pool, migrate_on_start=False, batch_max=batch_max) as addr,
            service_channel(addr, "runtime") as channel,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await claims_stub(channel).ClaimOnce(request("a", "w"), timeout=TIMEOUT)
    finally:
        await pool.close()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_pool_acquire_timeout_is_unavailable(database_url: str) -> None:
    pool = await create_pool(database_url, min_size=1, max_size=1)
    try:
        async with (
            running_claims(database_url, pool=pool, acquire_timeout_seconds=0.2) as addr,
            service_channel(addr, "runtime") as channel,
            pool.acquire(),  # the only connection is busy for the whole call
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await claims_stub(channel).ClaimOnce(request("a", "w"), timeout=TIMEOUT)
    finally:
        await pool.close()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
