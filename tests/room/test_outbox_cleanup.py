"""Delivered wakes leave the outbox after the kept time; pending, leased and recent ones stay."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from quayutec.v1 import room_pb2
from tests.harness.room import running_room
from tests.room.conftest import Stub, World, post
from tests.room.test_runs_wakes import lease, settle

KEEP = 3600


@pytest.fixture
async def room_addr(database_url: str) -> AsyncIterator[str]:
    """A Room whose cleanup runs every 50 ms and keeps delivered wakes an hour."""
    async with running_room(
        database_url,
        QUAYUTEC_ROOM_OUTBOX_CLEANUP_INTERVAL_SECONDS="0.05",
        QUAYUTEC_ROOM_DELIVERED_WAKES_KEEP_SECONDS=str(KEEP),
    ) as addr:
        yield addr


async def _wakes(room: Stub, world: World, count: int) -> list[str]:
    return [(await post(room, world, f"go {i}", [world.bolt_agent.agent_id])).wakes[0].wake_id for i in range(count)]


async def _deliver(room: Stub, wake_ids: list[str]) -> None:
    leased = {w.wake_id for w in (await lease(room, "gw-1")).wakes}
    assert set(wake_ids) <= leased
    for wake_id in wake_ids:
        await settle(room, wake_id, "gw-1", room_pb2.WAKE_SETTLEMENT_DELIVERED)


async def _age(pool: asyncpg.Pool, wake_ids: list[str], seconds: int) -> None:
    await pool.execute(
        "UPDATE wake_outbox SET delivered_at = delivered_at - $2::integer * interval '1 second' "
        "WHERE wake_id = ANY($1::uuid[])",
        wake_ids,
        seconds,
    )


async def _left(pool: asyncpg.Pool) -> set[str]:
    return {str(r["wake_id"]) for r in await pool.fetch("SELECT wake_id FROM wake_outbox")}


async def test_the_schedule_deletes_only_delivered_wakes_past_the_kept_time(
    room: Stub, world: World, database_url: str
) -> None:
    old, recent, pending = await _wakes(room, world, 3)
    await _deliver(room, [old, recent])  # ``pending`` stays leased by gw-1, not delivered
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1)
    try:
        await _age(pool, [old], KEEP + 60)
        for _ in range(400):  # the Room's loop runs every 50 ms; bounded wait, no timing asserted
            if old not in await _left(pool):
                break
            await asyncio.sleep(0.05)
        left = await _left(pool)
    finally:
        await pool.close()
    assert old not in left
    assert {recent, pending} <= left
    assert (await room.CountPendingWakes(room_pb2.RoomServiceCountPendingWakesRequest())).pending == 1
