"""The Runtime's coalescing Claims client against a real Claims server over real gRPC."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import grpc
import pytest

from quayutec.server import GrpcServer
from quayutec.tls import load_identity
from quayutec.v1 import claims_pb2
from services.claims.servicer import ClaimsServicer
from services.claims.store import ClaimStore
from services.runtime.claims_client import ClaimsClient
from services.stack import free_port
from tests.harness.channels import TEST_MTLS, service_channel
from tests.harness.claims import claims_config, claims_stub, running_claims

TIMEOUT = 30.0


class Recording:
    """The real stub, noting which RPC each call made and how many claims it carried."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub
        self.calls: list[tuple[str, int]] = []
        self.sent = asyncio.Event()  # set when the first call leaves

    async def ClaimOnce(self, request: claims_pb2.ClaimOnceRequest, *, timeout: float) -> Any:  # noqa: ASYNC109
        self.calls.append(("ClaimOnce", 1))
        self.sent.set()
        return await self._stub.ClaimOnce(request, timeout=timeout)

    async def ClaimMany(self, request: claims_pb2.ClaimManyRequest, *, timeout: float) -> Any:  # noqa: ASYNC109
        self.calls.append(("ClaimMany", len(request.claims)))
        self.sent.set()
        return await self._stub.ClaimMany(request, timeout=timeout)


def request(agent_id: str, wake_id: str, claimant: str = "") -> claims_pb2.ClaimOnceRequest:
    return claims_pb2.ClaimOnceRequest(agent_id=agent_id, wake_id=wake_id, claimant=claimant)


def pair() -> tuple[str, str]:
    return f"agent-{uuid.uuid4()}", f"wake-{uuid.uuid4()}"


@pytest.fixture
async def stub(claims_addr: str) -> AsyncIterator[Recording]:
    async with service_channel(claims_addr, "runtime") as channel:
        yield Recording(claims_stub(channel))


@pytest.fixture
async def claims_addr(database_url: str) -> AsyncIterator[str]:
    async with running_claims(database_url) as addr:
        yield addr


async def test_concurrent_claims_leave_together_and_each_gets_its_own_answer(stub: Recording) -> None:
    client = ClaimsClient(stub)
    pairs = [pair() for _ in range(50)]
    asked = [request(*p, f"t{i}") for i, p in enumerate(pairs)]
    answers = await asyncio.gather(*(client.ClaimOnce(r, timeout=TIMEOUT) for r in asked))
    assert [a.claimed for a in answers] == [True] * 50
    assert stub.calls == [("ClaimMany", 50)]  # all asked in one turn of the loop: one call
    # Each answer is its own claim's: asked again, the same claimant gets the same time, others none.
    again = await asyncio.gather(*(client.ClaimOnce(r, timeout=TIMEOUT) for r in asked))
    assert [a.claimed for a in again] == [True] * 50
    assert [a.claimed_at for a in again] == [a.claimed_at for a in answers]
    others = await asyncio.gather(*(client.ClaimOnce(request(*p, "other"), timeout=TIMEOUT) for p in pairs))
    assert [a.claimed for a in others] == [False] * 50
    await client.close()


async def test_a_lone_claim_goes_as_claim_once_at_once(stub: Recording) -> None:
    client = ClaimsClient(stub)
    answer = await client.ClaimOnce(request(*pair(), "t"), timeout=TIMEOUT)
    assert answer.claimed is True
    assert stub.calls == [("ClaimOnce", 1)]
    await client.close()


async def test_two_claimants_of_one_wake_in_one_batch_exactly_one_gets_it(stub: Recording) -> None:
    client = ClaimsClient(stub)
    agent_id, wake_id = pair()
    asked = [request(agent_id, wake_id, f"delivery-{i % 2}") for i in range(6)] + [request(agent_id, wake_id)]
    answers = await asyncio.gather(*(client.ClaimOnce(r, timeout=TIMEOUT) for r in asked))
    assert stub.calls == [("ClaimMany", 7)]
    winners = {r.claimant for r, a in zip(asked, answers, strict=True) if a.claimed}
    assert winners == {"delivery-0"}  # the first in the batch; its own repeats are claimed again
    assert [a.claimed for a in answers] == [True, False, True, False, True, False, False]
    assert len({(a.claimed_at.seconds, a.claimed_at.nanos) for a in answers}) == 1
    await client.close()


async def test_claims_asked_during_a_call_go_in_the_next_one(database_url: str) -> None:
    # Claims that hold each commit for a while, so the first call is surely still in flight.
    async with (
        running_claims(database_url, test_commit_delay_seconds=0.5) as addr,
        service_channel(addr, "runtime") as channel,
    ):
        stub = Recording(claims_stub(channel))
        client = ClaimsClient(stub, max_items=3)
        first = asyncio.ensure_future(client.ClaimOnce(request(*pair(), "t"), timeout=TIMEOUT))
        await stub.sent.wait()
        later = [asyncio.ensure_future(client.ClaimOnce(request(*pair(), "t"), timeout=TIMEOUT)) for _ in range(5)]
        answers = await asyncio.gather(first, *later)
        await client.close()
    assert [a.claimed for a in answers] == [True] * 6
    assert stub.calls == [("ClaimOnce", 1), ("ClaimMany", 3), ("ClaimMany", 2)]


async def test_a_call_error_reaches_every_caller_of_the_batch(database_url: str) -> None:
    # Nothing listens on this port: the call fails UNAVAILABLE, and so does each claim it carried.
    async with service_channel(f"127.0.0.1:{free_port()}", "runtime") as channel:
        stub = Recording(claims_stub(channel))
        client = ClaimsClient(stub)
        results = await asyncio.gather(
            *(client.ClaimOnce(request(*pair(), "t"), timeout=TIMEOUT) for _ in range(5)), return_exceptions=True
        )
        await client.close()
    assert stub.calls == [("ClaimMany", 5)]
    assert all(isinstance(r, grpc.aio.AioRpcError) for r in results)
    assert {r.code() for r in results if isinstance(r, grpc.aio.AioRpcError)} == {grpc.StatusCode.UNAVAILABLE}


async def test_an_invalid_claim_fails_only_its_own_caller(stub: Recording) -> None:
    client = ClaimsClient(stub)
    good = [pair() for _ in range(3)]
    asked = [request(*good[0], "t"), request("", "w", "t"), request(*good[1], "t"), request(*good[2], "t")]
    results = await asyncio.gather(*(client.ClaimOnce(r, timeout=TIMEOUT) for r in asked), return_exceptions=True)
    bad = results[1]
    assert isinstance(bad, grpc.aio.AioRpcError)
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "agent_id is required" in (bad.details() or "")
    assert [r.claimed for i, r in enumerate(results) if i != 1] == [True, True, True]  # type: ignore[union-attr]
    # ClaimMany refused the whole call (nothing written); each claim was then asked alone.
    assert stub.calls[0] == ("ClaimMany", 4)
    assert sorted(stub.calls[1:]) == [("ClaimOnce", 1)] * 4
    await client.close()


async def test_a_timed_out_claim_asked_again_with_its_token_is_claimed(database_url: str) -> None:
    async with (
        running_claims(database_url, test_commit_delay_seconds=1.0) as addr,
        service_channel(addr, "runtime") as channel,
    ):
        client = ClaimsClient(claims_stub(channel))
        agent_id, wake_id = pair()
        mine = request(agent_id, wake_id, "delivery-1")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.ClaimOnce(mine, timeout=0.2)  # the server holds its commit for a second
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The first ask may have committed unseen: the same token is answered claimed, anyone else not.
        assert (await client.ClaimOnce(mine, timeout=TIMEOUT)).claimed is True
        assert (await client.ClaimOnce(request(agent_id, wake_id, "delivery-2"), timeout=TIMEOUT)).claimed is False
        await client.close()


async def test_a_claim_given_up_before_it_left_is_never_made(database_url: str) -> None:
    async with (
        running_claims(database_url, test_commit_delay_seconds=0.5) as addr,
        service_channel(addr, "runtime") as channel,
    ):
        stub = Recording(claims_stub(channel))
        client = ClaimsClient(stub)
        first = asyncio.ensure_future(client.ClaimOnce(request(*pair(), "t"), timeout=TIMEOUT))
        await stub.sent.wait()
        dropped_pair = pair()
        dropped = asyncio.ensure_future(client.ClaimOnce(request(*dropped_pair, "t"), timeout=TIMEOUT))
        kept = asyncio.ensure_future(client.ClaimOnce(request(*pair(), "t"), timeout=TIMEOUT))
        await asyncio.sleep(0)
        dropped.cancel()
        assert (await first).claimed is True
        assert (await kept).claimed is True
        await client.close()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await claims_stub(channel).GetClaim(
                claims_pb2.GetClaimRequest(agent_id=dropped_pair[0], wake_id=dropped_pair[1]), timeout=TIMEOUT
            )
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert stub.calls == [("ClaimOnce", 1), ("ClaimOnce", 1)]


async def test_a_claims_server_without_claim_many_is_asked_claim_by_claim(database_url: str) -> None:
    """An older Claims (no ClaimMany, as during a rolling upgrade): the real servicer with only
    ClaimOnce and GetClaim registered."""
    config = claims_config(database_url)
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    store = ClaimStore(pool, batch_max=256)
    servicer = ClaimsServicer(store)

    def register(server: grpc.aio.Server) -> None:
        handlers = {
            "ClaimOnce": grpc.unary_unary_rpc_method_handler(
                servicer.ClaimOnce,
                request_deserializer=claims_pb2.ClaimOnceRequest.FromString,
                response_serializer=claims_pb2.ClaimOnceResponse.SerializeToString,
            )
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("quayutec.v1.ClaimsService", handlers),))

    server = GrpcServer(
        service_names=("quayutec.v1.ClaimsService",),
        config=config.server,
        register=register,
        identity=load_identity("claims", TEST_MTLS),
    )
    port = await server.start()
    try:
        async with service_channel(f"127.0.0.1:{port}", "runtime") as channel:
            stub = Recording(claims_stub(channel))
            client = ClaimsClient(stub)
            asked = [request(*pair(), "t") for _ in range(3)]
            first = await asyncio.gather(*(client.ClaimOnce(r, timeout=TIMEOUT) for r in asked))
            second = await asyncio.gather(*(client.ClaimOnce(r, timeout=TIMEOUT) for r in asked))
            await client.close()
    finally:
        await server.stop()
        await pool.close()
    assert [a.claimed for a in first + second] == [True] * 6
    assert stub.calls == [("ClaimMany", 3)] + [("ClaimOnce", 1)] * 6
