"""A person's post through a delivering Gateway leases its own wakes to that Gateway's delivery loop,
which delivers them at once: no LeaseWakes for them, no new-wakes notification. A loop without free
places posts as before (the poll takes the wakes), and wakes leased to a loop that never delivers
them are delivered by another once their leases end, once."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg

from quayutec.v1 import common_pb2, gateway_pb2, room_pb2, room_pb2_grpc
from services.runtime.standin import StandinProvider
from tests.gateway.helpers import GatewayStub, create_room, eventually, register_agent
from tests.gateway.runtime_standin import BatchingStandinRuntime, running_standin_runtime
from tests.gateway.test_delivery import FAST, expire_leases, pending
from tests.harness.channels import service_channel
from tests.harness.gateway import CompanyKey, authed_gateway, running_gateway
from tests.harness.runtime import running_runtime

# A poll so long that within a test only a notification or the post's own lease can deliver a wake. One
# wake per LeaseWakes, so a poll in flight never holds every free place (8) a post might lease into.
SLOW_POLL = {
    "QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS": "600",
    "QUAYUTEC_GATEWAY_POST_RATE": "0",
    "QUAYUTEC_GATEWAY_DELIVERY_BATCH_SIZE": "1",
    "QUAYUTEC_GATEWAY_DELIVERY_CONCURRENCY": "8",
}


@asynccontextmanager
async def new_wake_notifications(database_url: str) -> AsyncIterator[asyncio.Queue[str]]:
    """The new-wakes notifications sent from now on (LISTEN quayutec_wakes), in commit order."""
    heard: asyncio.Queue[str] = asyncio.Queue()
    conn = await asyncpg.connect(database_url)
    try:
        await conn.add_listener("quayutec_wakes", lambda *args: heard.put_nowait(args[3]))
        yield heard
    finally:
        await conn.close()


async def wake_rows(pool: asyncpg.Pool, wake_ids: list[str]) -> dict[str, asyncpg.Record]:
    rows = await pool.fetch(
        "SELECT wake_id::text, lease_owner, delivery_attempts, delivered_at FROM wake_outbox"
        " WHERE wake_id = ANY($1::uuid[])",
        wake_ids,
    )
    return {r["wake_id"]: r for r in rows}


async def post(gw: GatewayStub, room_id: str, body: str, agent_ids: list[str]) -> list[str]:
    posted = await gw.PostMessage(
        gateway_pb2.PostMessageRequest(room_id=room_id, person="Ada", body=body, mention_agent_ids=agent_ids),
        timeout=10,
    )
    return list(posted.wake_ids)


async def test_a_post_through_a_delivering_gateway_delivers_its_own_wakes(
    database_url: str,
    room_addr: str,
    claims_addr: str,
    acme: CompanyKey,
    acme_gw: GatewayStub,
    pool: asyncpg.Pool,
) -> None:
    room = await create_room(acme_gw)
    agents = [(await register_agent(acme_gw, f"agent-{n}")).agent_id for n in range(2)]
    async with (
        new_wake_notifications(database_url) as heard,
        running_standin_runtime(claims_addr, room_addr, batching=True) as (runtime_addr, runtime),
        running_gateway(database_url, room_addr, runtime_addr, **SLOW_POLL) as addr,
        authed_gateway(addr, acme.secret) as gw,
        service_channel(room_addr, "gateway") as channel,
    ):
        assert isinstance(runtime, BatchingStandinRuntime)
        room_stub = room_pb2_grpc.RoomServiceStub(channel)
        leased = await post(gw, room.room_id, "@both hello", agents)
        await runtime.wait_until(lambda: sorted(c.request.wake_id for c in runtime.calls) == sorted(leased))
        await eventually(lambda: _none_pending(room_stub))
        # A post through the Gateway without a delivery loop: its wake is written unleased, notifies, and
        # the delivering Gateway leases it (LeaseWakes, on the notification). Notifications arrive in commit
        # order: had the first post sent one, it would come first.
        control = await post(acme_gw, room.room_id, "@agent-0 again", agents[:1])
        assert await asyncio.wait_for(heard.get(), timeout=30) == ""
        await eventually(lambda: _none_pending(room_stub))
        assert heard.empty(), "the post whose wakes were leased sent a new-wakes notification"
    rows = await wake_rows(pool, leased + control)
    owner = rows[control[0]]["lease_owner"]  # the delivering Gateway's loop
    assert owner
    for wake_id in leased:
        row = rows[wake_id]
        assert (row["lease_owner"], row["delivery_attempts"]) == (owner, 1) and row["delivered_at"], row
    # The post's wakes went to the Runtime in one StartRuns call, each claimed once.
    assert sorted(runtime.batches[0]) == sorted(leased)
    assert runtime.answers("ACCEPTED") == Counter(leased + control)


async def test_wakes_leased_by_posts_during_a_start_runs_call_go_together_in_the_next(
    database_url: str, room_addr: str, claims_addr: str, acme: CompanyKey, acme_gw: GatewayStub
) -> None:
    room = await create_room(acme_gw)
    agents = [(await register_agent(acme_gw, f"agent-{n}")).agent_id for n in range(3)]
    async with (
        running_standin_runtime(claims_addr, room_addr, batching=True) as (runtime_addr, runtime),
        running_gateway(database_url, room_addr, runtime_addr, **SLOW_POLL) as addr,
        authed_gateway(addr, acme.secret) as gw,
    ):
        assert isinstance(runtime, BatchingStandinRuntime)
        runtime.open.clear()  # the first post's StartRuns call is held
        first = await post(gw, room.room_id, "first", agents[:1])
        await runtime.wait_until(lambda: runtime.batches == [first])
        # Answered while that call is in flight: their wakes wait for it, then go in one call.
        later = [w for n in (1, 2) for w in await post(gw, room.room_id, f"post {n}", agents[n : n + 1])]
        runtime.open.set()
        await runtime.wait_until(lambda: len(runtime.answers("ACCEPTED")) == 3)
    assert [sorted(b) for b in runtime.batches] == [first, sorted(later)]
    assert runtime.answers("ACCEPTED") == Counter(first + later)


async def _none_pending(room: room_pb2_grpc.RoomServiceStub) -> bool:
    return await pending(room) == 0


async def test_a_full_delivery_loop_posts_without_a_lease_and_polls_the_wake(
    database_url: str,
    room_addr: str,
    claims_addr: str,
    acme: CompanyKey,
    acme_gw: GatewayStub,
    pool: asyncpg.Pool,
) -> None:
    room = await create_room(acme_gw)
    busy, later = [(await register_agent(acme_gw, name)).agent_id for name in ("busy", "later")]
    hung = await post(acme_gw, room.room_id, "@busy hang", [busy])
    full = {
        **FAST,
        "QUAYUTEC_GATEWAY_DELIVERY_CONCURRENCY": "1",
        "QUAYUTEC_GATEWAY_START_RUN_TIMEOUT_SECONDS": "3",
    }
    async with running_standin_runtime(claims_addr, room_addr) as (runtime_addr, runtime):
        runtime.script(hung[0], "HANG")  # holds the loop's one place until StartRun's deadline
        async with (
            running_gateway(database_url, room_addr, runtime_addr, **full) as addr,
            authed_gateway(addr, acme.secret) as gw,
        ):
            await runtime.wait_until(lambda: bool(runtime.calls))
            async with new_wake_notifications(database_url) as heard:
                polled = await post(gw, room.room_id, "@later hello", [later])
                # Written unleased (so it notified): the loop had no place for it.
                assert await asyncio.wait_for(heard.get(), timeout=30) == ""
            await runtime.wait_until(lambda: runtime.answers("ACCEPTED")[polled[0]] == 1)
    assert [c.answer for c in runtime.calls if c.request.wake_id == polled[0]] == ["ACCEPTED"]
    row = (await wake_rows(pool, polled))[polled[0]]
    assert row["delivery_attempts"] == 1 and row["lease_owner"] and row["delivered_at"], row


async def test_wakes_leased_to_a_gateway_that_never_delivers_them_are_delivered_once_after_the_lease(
    database_url: str, room_addr: str, claims_addr: str, acme: CompanyKey, acme_gw: GatewayStub, pool: asyncpg.Pool
) -> None:
    room = await create_room(acme_gw)
    orphan, other = [await register_agent(acme_gw, name) for name in ("orphan", "other")]
    async with service_channel(room_addr, "gateway") as channel:
        room_stub = room_pb2_grpc.RoomServiceStub(channel)
        # As a Gateway posts and then stops before delivering: the post's wake is leased to it.
        leased = await room_stub.PostMessage(
            room_pb2.RoomServicePostMessageRequest(
                room_id=room.room_id,
                author=common_pb2.Author(kind=common_pb2.AUTHOR_KIND_PERSON, company_id=acme.company_id, person="Ada"),
                body="@orphan hello",
                mention_agent_ids=[orphan.agent_id],
                lease_owner="a-gateway-that-stopped",
                lease_seconds=3600,
            ),
            timeout=10,
        )
        assert leased.leased
        wake_id = leased.wakes[0].wake_id
        with StandinProvider() as standin:
            async with (
                running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as runtime_addr,
                running_gateway(database_url, room_addr, runtime_addr, **FAST),
            ):
                # The running Gateway's loop delivers an unleased wake but leaves the leased one alone.
                await post(acme_gw, room.room_id, "@other hello", [other.agent_id])
                await eventually(lambda: _replies(acme_gw, room.room_id, other.agent_id, 1))
                assert await pending(room_stub) == 1
                assert (await wake_rows(pool, [wake_id]))[wake_id]["lease_owner"] == "a-gateway-that-stopped"
                await expire_leases(pool, [wake_id])  # as time would end it
                await eventually(lambda: _none_pending(room_stub))
                await eventually(lambda: _replies(acme_gw, room.room_id, orphan.agent_id, 1))
    runs = (await acme_gw.ListRuns(gateway_pb2.ListRunsRequest(agent_id=orphan.agent_id), timeout=10)).runs
    assert [(r.wake_id, r.status) for r in runs] == [(wake_id, common_pb2.RUN_STATUS_SUCCEEDED)]
    row = (await wake_rows(pool, [wake_id]))[wake_id]
    assert row["delivery_attempts"] == 2 and row["lease_owner"] != "a-gateway-that-stopped", row


async def _replies(gw: GatewayStub, room_id: str, agent_id: str, expected: int) -> bool:
    """Whether ``agent_id`` has replied exactly ``expected`` times in the room (more fails at once)."""
    messages = (await gw.ListMessages(gateway_pb2.ListMessagesRequest(room_id=room_id), timeout=10)).messages
    replies = sum(1 for m in messages if m.author.agent_id == agent_id)
    assert replies <= expected, f"{replies} replies from {agent_id}"
    return replies == expected
