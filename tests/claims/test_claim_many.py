"""ClaimMany against a real PostgreSQL over real gRPC: per item, exactly ClaimOnce's answer."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import grpc
import pytest

from quayutec.v1 import claims_pb2, claims_pb2_grpc
from services.claims.servicer import MAX_CLAIM_MANY_ITEMS
from tests.harness.channels import service_channel
from tests.harness.claims import claims_stub, running_claims

TIMEOUT = 30.0


def item(agent_id: str, wake_id: str, claimant: str = "") -> claims_pb2.ClaimOnceRequest:
    return claims_pb2.ClaimOnceRequest(agent_id=agent_id, wake_id=wake_id, claimant=claimant)


def pair() -> tuple[str, str]:
    return f"agent-{uuid.uuid4()}", f"wake-{uuid.uuid4()}"


async def claim_many(
    stub: claims_pb2_grpc.ClaimsServiceAsyncStub, items: list[claims_pb2.ClaimOnceRequest]
) -> list[claims_pb2.ClaimOnceResponse]:
    response = await stub.ClaimMany(claims_pb2.ClaimManyRequest(claims=items), timeout=TIMEOUT)
    return list(response.answers)


async def test_distinct_pairs_are_all_claimed_in_order(claims: claims_pb2_grpc.ClaimsServiceAsyncStub) -> None:
    pairs = [pair() for _ in range(50)]
    answers = await claim_many(claims, [item(a, w, f"t-{i}") for i, (a, w) in enumerate(pairs)])
    assert [a.claimed for a in answers] == [True] * 50
    for (agent_id, wake_id), answer in zip(pairs, answers, strict=True):
        got = await claims.GetClaim(claims_pb2.GetClaimRequest(agent_id=agent_id, wake_id=wake_id), timeout=TIMEOUT)
        assert got.claimed_at == answer.claimed_at


async def test_two_claimants_of_one_pair_in_one_call_exactly_one_wins(
    claims: claims_pb2_grpc.ClaimsServiceAsyncStub,
) -> None:
    agent_id, wake_id = pair()
    answers = await claim_many(
        claims,
        [
            item(agent_id, wake_id, "delivery-1"),
            item(agent_id, wake_id, "delivery-2"),
            item(agent_id, wake_id, "delivery-1"),  # the claimant asking again in the same call
            item(agent_id, wake_id),  # no claimant: cannot ask again
        ],
    )
    assert [a.claimed for a in answers] == [True, False, True, False]
    assert len({(a.claimed_at.seconds, a.claimed_at.nanos) for a in answers}) == 1
    # Later calls: the claimant is answered claimed again, anyone else not.
    again = await claim_many(claims, [item(agent_id, wake_id, "delivery-2"), item(agent_id, wake_id, "delivery-1")])
    assert [a.claimed for a in again] == [False, True]
    once = await claims.ClaimOnce(item(agent_id, wake_id, "delivery-1"), timeout=TIMEOUT)
    assert once.claimed is True
    assert once.claimed_at == answers[0].claimed_at


async def test_an_earlier_claim_decides_each_item(claims: claims_pb2_grpc.ClaimsServiceAsyncStub) -> None:
    agent_id, wake_id = pair()
    first = await claims.ClaimOnce(item(agent_id, wake_id, "earlier"), timeout=TIMEOUT)
    fresh = pair()
    answers = await claim_many(
        claims,
        [item(agent_id, wake_id, "later"), item(*fresh, "later"), item(agent_id, wake_id, "earlier")],
    )
    assert [a.claimed for a in answers] == [False, True, True]
    assert answers[0].claimed_at == first.claimed_at == answers[2].claimed_at


async def test_concurrent_calls_with_overlapping_pairs_claim_each_pair_once(database_url: str) -> None:
    pairs = [pair() for _ in range(40)]
    async with running_claims(database_url) as addr, service_channel(addr, "runtime") as channel:
        stub = claims_stub(channel)
        calls = [[item(a, w, f"caller-{c}") for a, w in (pairs[c:] + pairs[:c])] for c in range(8)]
        answers = await asyncio.gather(*(claim_many(stub, items) for items in calls))
    won: dict[tuple[str, str], int] = {}
    for items, got in zip(calls, answers, strict=True):
        for request, answer in zip(items, got, strict=True):
            key = (request.agent_id, request.wake_id)
            won[key] = won.get(key, 0) + int(answer.claimed)
    assert won == {p: 1 for p in pairs}


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        (item("", "w"), "claims[1].agent_id is required"),
        (item("a", ""), "claims[1].wake_id is required"),
        (item("a", "é" * 101), "claims[1].wake_id is 202 bytes"),
        (item("a\x00b", "w"), "claims[1].agent_id must not contain a NUL"),
        (item("a", "w", "x" * 201), "claims[1].claimant is 201 bytes"),
    ],
)
async def test_an_invalid_item_refuses_the_call_naming_it_before_anything_is_written(
    claims: claims_pb2_grpc.ClaimsServiceAsyncStub, database_url: str, bad: claims_pb2.ClaimOnceRequest, named: str
) -> None:
    good = pair()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await claim_many(claims, [item(*good, "t"), bad])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in (info.value.details() or "")
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM agent_run_locks WHERE agent_id = $1", good[0]) == 0
    finally:
        await conn.close()


async def test_empty_and_oversized_calls_are_invalid_argument(claims: claims_pb2_grpc.ClaimsServiceAsyncStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await claim_many(claims, [])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "claims is empty" in (info.value.details() or "")
    agent_id = f"agent-{uuid.uuid4()}"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await claim_many(claims, [item(agent_id, f"w{i}") for i in range(MAX_CLAIM_MANY_ITEMS + 1)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {MAX_CLAIM_MANY_ITEMS}" in (info.value.details() or "")


async def test_only_the_runtime_may_call_claim_many(claims_addr: str) -> None:
    async with service_channel(claims_addr, "gateway") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await claim_many(claims_stub(channel), [item(*pair())])
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
