"""Writes take the room row's lock (the event cursor) last: what still holds with it taken late.

A post holds its author's membership row FOR SHARE from its checks to COMMIT, so a departure (which
deletes that row before it takes the room row) waits for the post and its event comes after the post's.
Two posts with one dedupe key that both pass the check record one message: the second, which waited for
the room row, fails on the unique key, rolls back whole and finds the first on its retry.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import grpc
import pytest
from cryptography.fernet import Fernet

from quayutec.crypto import MultiFernet
from quayutec.errors import RuleBroken
from quayutec.v1 import common_pb2, room_pb2
from services.room.store import AuthorRef, Posted, RoomStore, RunRecord
from tests.room.conftest import Stub, World

WAIT_SECONDS = 20.0
Hook = Callable[[asyncpg.Connection], Awaitable[None]]


@pytest.fixture
async def store(pool: asyncpg.Pool) -> RoomStore:
    return RoomStore(pool, MultiFernet([Fernet(Fernet.generate_key())]))


def bolt_person(world: World) -> AuthorRef:
    return AuthorRef(kind="person", company_id=world.bolt.company_id, person="bo")


@asynccontextmanager
async def next_event_held(database_url: str, room_id: str) -> AsyncIterator[None]:
    """Another transaction holding room ``room_id``'s next event cursor (an uncommitted event there): a post
    writes its message and wakes, then waits at its own event, inside its one statement, until this ends
    (rolled back)."""
    blocker = await asyncpg.connect(database_url)
    try:
        await blocker.execute("BEGIN")
        await blocker.execute(
            "INSERT INTO room_events (room_id, seq, kind, detail) "
            "SELECT room_id, last_event_seq + 1, 'held', '\\x00'::bytea FROM rooms WHERE room_id = $1",
            uuid.UUID(room_id),
        )
        yield
    finally:
        await blocker.execute("ROLLBACK")
        await blocker.close()


async def locks_awaited(pool: asyncpg.Pool) -> int:
    """How many backends of this database wait for a lock now."""
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE NOT l.granted AND a.datname = current_database()"
        )
    )


async def until_locks_are_awaited(pool: asyncpg.Pool, count: int = 1) -> None:
    """Returns once ``count`` backends of this database wait for a lock (bounded)."""
    async with asyncio.timeout(WAIT_SECONDS):
        while await locks_awaited(pool) < count:  # noqa: ASYNC110 - the waits are in PostgreSQL
            await asyncio.sleep(0.02)


async def event_kinds(pool: asyncpg.Pool, room_id: str) -> list[str]:
    rows = await pool.fetch("SELECT kind FROM room_events WHERE room_id = $1 ORDER BY seq", uuid.UUID(room_id))
    return [r["kind"] for r in rows]


async def test_a_departure_waits_for_a_post_past_its_checks_and_its_event_comes_after(
    store: RoomStore, pool: asyncpg.Pool, room: Stub, world: World, database_url: str
) -> None:
    # The post is stopped after its checks, before it takes the room row: its ledger row is locked by
    # another connection, so its upsert waits there.
    run = common_pb2.Run(
        run_id="run-held",
        agent_id=world.bolt_agent.agent_id,
        room_id=world.room_id,
        status=common_pb2.RUN_STATUS_RUNNING,
        step=common_pb2.RUN_STEP_MODEL_CALLED,
    )
    await store.record_run(run)
    blocker = await asyncpg.connect(database_url)
    try:
        await blocker.execute("BEGIN")
        await blocker.execute("SELECT 1 FROM runs WHERE run_id = 'run-held' FOR UPDATE")
        posting = asyncio.create_task(
            store.post_message(
                room_id=world.room_id,
                author=bolt_person(world),
                body="last words",
                mention_agent_ids=[],
                run_id=None,
                dedupe_key=None,
                run=RunRecord(run),
            )
        )
        await until_locks_are_awaited(pool, 1)  # the post, past its checks, waits for its ledger row
        leave = room_pb2.RoomServiceLeaveRoomRequest(room_id=world.room_id, company_id=world.bolt.company_id)
        leaving = asyncio.ensure_future(room.LeaveRoom(leave, timeout=WAIT_SECONDS))
        await until_locks_are_awaited(pool, 2)  # the departure waits for the post's membership lock
        assert not leaving.done() and not posting.done()
    finally:
        await blocker.execute("COMMIT")
        await blocker.close()
    await posting
    await leaving
    assert (await event_kinds(pool, world.room_id))[-2:] == ["message_posted", "member_left"]
    with pytest.raises(RuleBroken) as refused:
        await store.post_message(
            room_id=world.room_id,
            author=bolt_person(world),
            body="after leaving",
            mention_agent_ids=[],
            run_id=None,
            dedupe_key=None,
        )
    assert (refused.value.code, refused.value.rule) == (grpc.StatusCode.PERMISSION_DENIED, "member-writes")


async def test_two_posts_with_one_dedupe_key_record_one_message(
    store: RoomStore, pool: asyncpg.Pool, world: World, database_url: str
) -> None:
    def post() -> Coroutine[Any, Any, Posted]:
        return store.post_message(
            room_id=world.room_id,
            author=bolt_person(world),
            body="once",
            mention_agent_ids=[world.acme_agent.agent_id],
            run_id=None,
            dedupe_key="once",
        )

    async with next_event_held(database_url, world.room_id):
        first = asyncio.create_task(post())  # its message written (room row locked), it waits at its event
        await until_locks_are_awaited(pool)
        second = asyncio.create_task(post())  # passes its check (the first is not committed), then waits
        await until_locks_are_awaited(pool, 2)
    one, other = await first, await second
    assert not one.deduplicated and other.deduplicated
    assert other.row["message_id"] == one.row["message_id"]
    assert [w["wake_id"] for w in other.wakes] == [w["wake_id"] for w in one.wakes] and len(one.wakes) == 1
    room_id = uuid.UUID(world.room_id)
    assert await pool.fetchval("SELECT count(*) FROM messages WHERE room_id = $1", room_id) == 1
    assert await pool.fetchval("SELECT last_seq FROM rooms WHERE room_id = $1", room_id) == 1  # no gap
    assert (await event_kinds(pool, world.room_id)).count("message_posted") == 1
