"""A post may lease its own wakes to the caller's delivery loop (PostMessage with lease_owner): written
leased in the post's statement, as LeaseWakes would lease them, with no new-wakes notification."""

from __future__ import annotations

import asyncio

import asyncpg
import grpc

from quayutec.v1 import room_pb2
from tests.room.conftest import Stub, World, expect_error, post
from tests.room.test_runs_wakes import lease

CHANNEL = "quayutec_wakes"


async def test_a_post_with_a_lease_owner_writes_its_wakes_leased_and_notifies_no_one(
    room: Stub, world: World, database_url: str
) -> None:
    mentions = [world.acme_agent.agent_id, world.bolt_agent.agent_id]
    heard: asyncio.Queue[str] = asyncio.Queue()
    listener = await asyncpg.connect(database_url)
    try:
        await listener.add_listener(CHANNEL, lambda *args: heard.put_nowait(args[3]))
        leased = await post(room, world, "go", mentions, lease_owner="gw-1", lease_seconds=60, dedupe_key="k1")
        assert leased.leased and not leased.deduplicated
        assert sorted(w.agent_id for w in leased.wakes) == sorted(mentions)
        assert {w.delivery_attempts for w in leased.wakes} == {1}  # as LeaseWakes would have answered them
        # Leased already: no other owner gets them, and their rows name the owner until the lease ends.
        assert not (await lease(room, "gw-2")).wakes
        rows = await listener.fetch(
            "SELECT lease_owner, delivery_attempts, lease_expires_at - now() AS left FROM wake_outbox"
            " WHERE wake_id = ANY($1::uuid[])",
            [w.wake_id for w in leased.wakes],
        )
        assert [(r["lease_owner"], r["delivery_attempts"]) for r in rows] == [("gw-1", 1)] * 2
        assert all(0 < r["left"].total_seconds() <= 60 for r in rows)
        # A repeat answers the earlier message and its wakes, and leases nothing (they were leased already).
        again = await post(room, world, "go", mentions, lease_owner="gw-3", lease_seconds=60, dedupe_key="k1")
        assert again.deduplicated and not again.leased
        assert {w.wake_id for w in again.wakes} == {w.wake_id for w in leased.wakes}
        assert {r["lease_owner"] for r in await listener.fetch("SELECT lease_owner FROM wake_outbox")} == {"gw-1"}
        # Without a lease owner, as before: unleased wakes and a notification. Notifications arrive in commit
        # order, so had the leased post sent one, it would be first.
        plain = await post(room, world, "again", mentions)
        assert not plain.leased and {w.delivery_attempts for w in plain.wakes} == {0}
        assert await asyncio.wait_for(heard.get(), timeout=30) == ""
        assert heard.empty()
        assert sorted(w.wake_id for w in (await lease(room, "gw-2")).wakes) == sorted(w.wake_id for w in plain.wakes)
    finally:
        await listener.close()


async def test_a_bad_lease_seconds_is_refused_and_writes_nothing(room: Stub, world: World, database_url: str) -> None:
    mentions = [world.acme_agent.agent_id]
    for seconds in (0, -1, 3601):
        await expect_error(
            grpc.StatusCode.INVALID_ARGUMENT,
            post(room, world, "go", mentions, lease_owner="gw-1", lease_seconds=seconds),
            "lease_seconds must be between 1 and 3600",
        )
    await expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        post(room, world, "go", mentions, lease_owner="x" * 1000, lease_seconds=60),
        "lease_owner",
    )
    # Without an owner, lease_seconds is not looked at (an older caller never sets either).
    assert not (await post(room, world, "go", mentions, lease_seconds=0)).leased
    messages = await room.ListMessages(room_pb2.RoomServiceListMessagesRequest(room_id=world.room_id, page_size=10))
    assert [m.body for m in messages.messages] == ["go"]
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM wake_outbox") == 1
        assert await conn.fetchval("SELECT count(*) FROM wake_outbox WHERE lease_owner IS NOT NULL") == 0
    finally:
        await conn.close()
