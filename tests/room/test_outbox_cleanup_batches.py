"""One cleanup pass deletes every delivered wake past the kept time, in as many batches as it takes.

The Room of these tests has its default schedule (a pass a minute, delivered wakes kept 7 days), so
nothing but the pass under test deletes these rows."""

from __future__ import annotations

import asyncpg

from services.room.cleanup import OutboxCleaner
from services.room.store import RoomStore
from tests.harness.room import room_config
from tests.room.conftest import Stub, World
from tests.room.test_outbox_cleanup import KEEP, _age, _deliver, _left, _wakes


async def test_one_pass_deletes_batch_after_batch(room: Stub, world: World, database_url: str) -> None:
    made = await _wakes(room, world, 7)
    await _deliver(room, made)
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    try:
        await _age(pool, made[:5], 10 * KEEP)
        cleaner = OutboxCleaner(
            RoomStore(pool, room_config(database_url).cipher), keep_seconds=2 * KEEP, interval_seconds=0, batch=2
        )
        deleted = await cleaner.clean_once()
        left = await _left(pool)
        assert await cleaner.clean_once() == 0
    finally:
        await pool.close()
    assert deleted == 5
    assert set(made[:5]).isdisjoint(left) and set(made[5:]) <= left
