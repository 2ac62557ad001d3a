"""ClaimOnce and GetClaim against a real PostgreSQL over real gRPC."""

from __future__ import annotations

import asyncio
import random
import uuid
from pathlib import Path

import asyncpg
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from quayutec.v1 import claims_pb2, claims_pb2_grpc
from tests.harness.channels import service_channel
from tests.harness.claims import claims_stub, running_claims

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 30.0


def pair() -> tuple[str, str]:
    return f"agent-{uuid.uuid4()}", f"wake-{uuid.uuid4()}"


async def claim(
    stub: claims_pb2_grpc.ClaimsServiceAsyncStub, agent_id: str, wake_id: str
) -> claims_pb2.ClaimOnceResponse:
    request = claims_pb2.ClaimOnceRequest(agent_id=agent_id, wake_id=wake_id)
    answer: claims_pb2.ClaimOnceResponse = await stub.ClaimOnce(request, timeout=TIMEOUT)
    return answer


async def test_first_claim_wins_and_later_ones_get_its_time(claims: claims_pb2_grpc.ClaimsServiceAsyncStub) -> None:
    agent_id, wake_id = pair()
    first = await claim(claims, agent_id, wake_id)
    again = await claim(claims, agent_id, wake_id)
    assert first.claimed is True
    assert again.claimed is False
    assert again.claimed_at == first.claimed_at
    assert first.claimed_at.seconds > 0


@pytest.mark.parametrize("batch_max", [1, 256])
async def test_64_concurrent_claims_of_one_pair_make_exactly_one(database_url: str, batch_max: int) -> None:
    agent_id, wake_id = pair()
    async with running_claims(database_url, batch_max=batch_max) as addr:
        channels = [service_channel(addr, "runtime") for _ in range(4)]
        try:
            stubs = [claims_stub(c) for c in channels]
            answers = await asyncio.gather(*(claim(stubs[i % 4], agent_id, wake_id) for i in range(64)))
        finally:
            for c in channels:
                await c.close()
    assert sum(a.claimed for a in answers) == 1
    assert len({(a.claimed_at.seconds, a.claimed_at.nanos) for a in answers}) == 1


async def test_1000_distinct_pairs_all_claim(claims: claims_pb2_grpc.ClaimsServiceAsyncStub, database_url: str) -> None:
    pairs = [pair() for _ in range(1000)]
    sem = asyncio.Semaphore(100)

    async def one(p: tuple[str, str]) -> bool:
        async with sem:
            return (await claim(claims, *p)).claimed

    assert all(await asyncio.gather(*(one(p) for p in pairs)))
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM agent_run_locks") == 1000
    finally:
        await conn.close()


async def test_repeated_pairs_across_concurrent_batches_claim_once_each(
    claims: claims_pb2_grpc.ClaimsServiceAsyncStub,
) -> None:
    pairs = [pair() for _ in range(200)]
    calls = pairs * 3
    random.Random(7).shuffle(calls)
    answers = await asyncio.gather(*(claim(claims, *p) for p in calls))
    won: dict[tuple[str, str], int] = {}
    times: dict[tuple[str, str], set[tuple[int, int]]] = {}
    for p, a in zip(calls, answers, strict=True):
        won[p] = won.get(p, 0) + int(a.claimed)
        times.setdefault(p, set()).add((a.claimed_at.seconds, a.claimed_at.nanos))
    assert set(won.values()) == {1}
    assert all(len(t) == 1 for t in times.values())


async def test_claim_survives_a_restart_of_the_claims_server(database_url: str) -> None:
    agent_id, wake_id = pair()
    async with running_claims(database_url) as addr, service_channel(addr, "runtime") as channel:
        first = await claim(claims_stub(channel), agent_id, wake_id)
    async with running_claims(database_url) as addr, service_channel(addr, "runtime") as channel:
        again = await claim(claims_stub(channel), agent_id, wake_id)
    assert first.claimed is True
    assert again.claimed is False
    assert again.claimed_at == first.claimed_at


async def test_get_claim_reads_a_claim(claims: claims_pb2_grpc.ClaimsServiceAsyncStub) -> None:
    agent_id, wake_id = pair()
    made = await claim(claims, agent_id, wake_id)
    got = await claims.GetClaim(claims_pb2.GetClaimRequest(agent_id=agent_id, wake_id=wake_id), timeout=TIMEOUT)
    assert (got.agent_id, got.wake_id, got.claimed_at) == (agent_id, wake_id, made.claimed_at)


async def test_get_claim_of_an_unclaimed_pair_is_not_found(claims: claims_pb2_grpc.ClaimsServiceAsyncStub) -> None:
    agent_id, wake_id = pair()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await claims.GetClaim(claims_pb2.GetClaimRequest(agent_id=agent_id, wake_id=wake_id), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("agent_id", "wake_id", "field"),
    [
        ("", "w", "agent_id"),
        ("a", "", "wake_id"),
        ("a" * 201, "w", "agent_id"),
        ("a", "é" * 101, "wake_id"),  # 101 characters but 202 bytes
        ("a\x00b", "w", "agent_id"),
    ],
)
@pytest.mark.parametrize("method", ["ClaimOnce", "GetClaim"])
async def test_invalid_ids_are_invalid_argument_naming_the_field(
    claims: claims_pb2_grpc.ClaimsServiceAsyncStub, agent_id: str, wake_id: str, field: str, method: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if method == "ClaimOnce":
            await claim(claims, agent_id, wake_id)
        else:
            await claims.GetClaim(claims_pb2.GetClaimRequest(agent_id=agent_id, wake_id=wake_id), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (info.value.details() or "")


async def test_ids_of_exactly_200_bytes_are_accepted(claims: claims_pb2_grpc.ClaimsServiceAsyncStub) -> None:
    answer = await claim(claims, "é" * 100, "w" * 200)
    assert answer.claimed is True


async def test_health_is_serving_and_reflection_lists_the_service(claims_addr: str) -> None:
    async with service_channel(claims_addr, "runtime") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "quayutec.v1.ClaimsService"):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = [s.name async for r in call for s in r.list_services_response.service]
    assert "quayutec.v1.ClaimsService" in names


@pytest.mark.parametrize("batch_max", [1, 256])
async def test_the_claimant_may_ask_again_and_no_one_else(database_url: str, batch_max: int) -> None:
    agent_id, wake_id = pair()
    mine = claims_pb2.ClaimOnceRequest(agent_id=agent_id, wake_id=wake_id, claimant="delivery-1")
    other = claims_pb2.ClaimOnceRequest(agent_id=agent_id, wake_id=wake_id, claimant="delivery-2")
    anonymous = claims_pb2.ClaimOnceRequest(agent_id=agent_id, wake_id=wake_id)
    async with running_claims(database_url, batch_max=batch_max) as addr, service_channel(addr, "runtime") as channel:
        stub = claims_stub(channel)
        # The claimant and others ask at once, many times: only the claimant is ever answered claimed.
        answers = await asyncio.gather(*(stub.ClaimOnce(r, timeout=TIMEOUT) for r in [mine, other, anonymous] * 20))
        first_claimant = {r.claimant for r, a in zip([mine, other, anonymous] * 20, answers, strict=True) if a.claimed}
        assert len(first_claimant) == 1  # one delivery made the claim; whichever it was
        winner = next(r for r in (mine, other, anonymous) if r.claimant in first_claimant)
        assert len({(a.claimed_at.seconds, a.claimed_at.nanos) for a in answers}) == 1
        if winner.claimant:
            asked_again = await asyncio.gather(*(stub.ClaimOnce(winner, timeout=TIMEOUT) for _ in range(5)))
            assert all(a.claimed for a in asked_again)
        for loser in (r for r in (mine, other, anonymous) if r is not winner):
            assert (await stub.ClaimOnce(loser, timeout=TIMEOUT)).claimed is False
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT claimant FROM agent_run_locks WHERE agent_id = $1", agent_id)
    finally:
        await conn.close()
    assert [r["claimant"] for r in rows] == [winner.claimant]


async def test_a_claimant_token_is_validated(claims: claims_pb2_grpc.ClaimsServiceAsyncStub) -> None:
    agent_id, wake_id = pair()
    for bad, message in (("x" * 201, "claimant is 201 bytes"), ("a\x00b", "claimant must not contain a NUL")):
        request = claims_pb2.ClaimOnceRequest(agent_id=agent_id, wake_id=wake_id, claimant=bad)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await claims.ClaimOnce(request, timeout=TIMEOUT)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (info.value.details() or "")
    assert (await claim(claims, agent_id, wake_id)).claimed is True  # nothing was claimed by the refused calls
