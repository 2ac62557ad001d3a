"""PostMessage and ListMessages, and the outbox: a message and its wakes commit together or not at all."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import grpc
import pytest

from quayutec.crypto import Fernet, MultiFernet
from quayutec.v1 import common_pb2, room_pb2
from services.room.store import AuthorRef, RoomStore
from tests.room.conftest import Stub, World, agent_author, expect_error, person, post
from tests.room.test_late_room_lock import next_event_held, until_locks_are_awaited

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
MISSING = str(uuid.uuid4())


async def test_post_records_a_wake_per_mentioned_agent(room: Stub, world: World) -> None:
    mentions = [world.acme_agent.agent_id, world.bolt_agent.agent_id, world.acme_agent.agent_id]
    posted = await post(room, world, "plan the launch", mentions)
    message = posted.message
    assert message.seq == 1 and message.body == "plan the launch" and not posted.deduplicated
    assert list(message.mention_agent_ids) == [world.acme_agent.agent_id, world.bolt_agent.agent_id]
    assert message.author.kind == common_pb2.AUTHOR_KIND_PERSON and message.author.person == "ana"
    assert sorted(w.agent_id for w in posted.wakes) == sorted([world.acme_agent.agent_id, world.bolt_agent.agent_id])
    for wake in posted.wakes:
        assert wake.kind == common_pb2.WAKE_KIND_MESSAGE and wake.source_id == message.message_id
        assert wake.room_id == world.room_id and wake.delivery_attempts == 0
    pending = await room.CountPendingWakes(room_pb2.RoomServiceCountPendingWakesRequest())
    assert pending.pending == 2 and pending.oldest_pending_age_ms >= 0


async def test_an_agent_never_wakes_itself(room: Stub, world: World) -> None:
    posted = await post(
        room,
        world,
        "reply",
        [world.acme_agent.agent_id, world.bolt_agent.agent_id],
        author=agent_author(world.acme_agent),
        run_id="run-1",
    )
    assert [w.agent_id for w in posted.wakes] == [world.bolt_agent.agent_id]
    assert posted.message.run_id == "run-1" and posted.message.author.agent_id == world.acme_agent.agent_id
    # An agent author may leave its company out: it is looked up.
    bare = common_pb2.Author(kind=common_pb2.AUTHOR_KIND_AGENT, agent_id=world.bolt_agent.agent_id)
    again = await post(room, world, "me too", author=bare)
    assert again.message.author.company_id == world.bolt.company_id


async def test_seq_is_strictly_increasing_under_concurrent_posts(room: Stub, world: World) -> None:
    posted = await asyncio.gather(*(post(room, world, f"m{i}") for i in range(40)))
    seqs = sorted(p.message.seq for p in posted)
    assert seqs == list(range(1, 41))
    listed = await room.ListMessages(room_pb2.RoomServiceListMessagesRequest(room_id=world.room_id, page_size=500))
    assert [m.seq for m in listed.messages] == list(range(1, 41))


async def test_dedupe_key_returns_the_first_message_and_records_nothing(room: Stub, world: World) -> None:
    first = await post(room, world, "once", [world.bolt_agent.agent_id], dedupe_key="run:r1:reply")
    again = await post(room, world, "twice?", [world.acme_agent.agent_id], dedupe_key="run:r1:reply")
    assert again.deduplicated and again.message == first.message and list(again.wakes) == list(first.wakes)
    racing = await asyncio.gather(*(post(room, world, "race", dedupe_key="k2") for _ in range(10)))
    assert len({r.message.message_id for r in racing}) == 1 and sum(not r.deduplicated for r in racing) == 1
    listed = await room.ListMessages(room_pb2.RoomServiceListMessagesRequest(room_id=world.room_id))
    assert [m.body for m in listed.messages] == ["once", "race"]
    pending = await room.CountPendingWakes(room_pb2.RoomServiceCountPendingWakesRequest())
    assert pending.pending == 1


async def test_post_errors(room: Stub, world: World) -> None:
    await expect_error(INVALID, post(room, world, ""), "body")
    await expect_error(INVALID, post(room, world, "x" * (64 * 1024 + 1)), "body")
    assert (await post(room, world, "x" * (64 * 1024))).message.seq == 1
    await expect_error(INVALID, post(room, world, "é" * (32 * 1024 + 1)), "bytes")  # 2 bytes each
    await expect_error(INVALID, post(room, world, "hi", [str(uuid.uuid4()) for _ in range(51)]), "50")
    await expect_error(INVALID, post(room, world, "hi", ["not-an-id"]), "mention_agent_ids")
    await expect_error(INVALID, post(room, world, "nul\x00"), "NUL")
    await expect_error(INVALID, post(room, world, "hi", author=common_pb2.Author()), "author.kind")
    await expect_error(
        INVALID, post(room, world, "hi", author=common_pb2.Author(kind=common_pb2.AUTHOR_KIND_PERSON)), "company_id"
    )
    await expect_error(NOT_FOUND, post(room, world, "hi", [MISSING]), MISSING)
    await expect_error(NOT_FOUND, post(room, world, "hi", [world.crow_agent.agent_id]), "not a member")
    await expect_error(
        NOT_FOUND,
        room.PostMessage(
            room_pb2.RoomServicePostMessageRequest(room_id=MISSING, author=person(world.acme.company_id), body="hi")
        ),
        "room",
    )
    unknown_agent = common_pb2.Author(kind=common_pb2.AUTHOR_KIND_AGENT, agent_id=MISSING)
    await expect_error(NOT_FOUND, post(room, world, "hi", author=unknown_agent), "author agent")
    await expect_error(grpc.StatusCode.PERMISSION_DENIED, post(room, world, "hi", author=person(world.crow.company_id)))
    await expect_error(
        grpc.StatusCode.PERMISSION_DENIED, post(room, world, "hi", author=agent_author(world.crow_agent))
    )
    wrong_company = common_pb2.Author(
        kind=common_pb2.AUTHOR_KIND_AGENT, agent_id=world.acme_agent.agent_id, company_id=world.bolt.company_id
    )
    await expect_error(INVALID, post(room, world, "hi", author=wrong_company), "does not belong")
    await expect_error(INVALID, post(room, world, "hi", dedupe_key="k" * 301), "dedupe_key")
    listed = await room.ListMessages(room_pb2.RoomServiceListMessagesRequest(room_id=world.room_id))
    assert len(listed.messages) == 1  # only the 64 KiB one


async def test_list_messages_pages_both_ways(room: Stub, world: World) -> None:
    for i in range(5):
        await post(room, world, f"m{i}")

    async def walk(newest_first: bool) -> list[str]:
        bodies: list[str] = []
        token = ""
        while True:
            page = await room.ListMessages(
                room_pb2.RoomServiceListMessagesRequest(
                    room_id=world.room_id, page_size=2, page_token=token, newest_first=newest_first
                )
            )
            bodies.extend(m.body for m in page.messages)
            token = page.next_page_token
            if not token:
                return bodies

    assert await walk(False) == ["m0", "m1", "m2", "m3", "m4"]
    assert await walk(True) == ["m4", "m3", "m2", "m1", "m0"]
    oldest = await room.ListMessages(room_pb2.RoomServiceListMessagesRequest(room_id=world.room_id, page_size=2))
    await expect_error(
        INVALID,
        room.ListMessages(
            room_pb2.RoomServiceListMessagesRequest(
                room_id=world.room_id, page_token=oldest.next_page_token, newest_first=True
            )
        ),
        "page_token",
    )
    await expect_error(NOT_FOUND, room.ListMessages(room_pb2.RoomServiceListMessagesRequest(room_id=MISSING)))


# -- the outbox: kill the transaction midway ---------------------------------------------------------------


@pytest.fixture
async def store(pool: asyncpg.Pool) -> RoomStore:
    return RoomStore(pool, MultiFernet([Fernet(Fernet.generate_key())]))


async def counts(pool: asyncpg.Pool) -> tuple[int, int]:
    messages = await pool.fetchval("SELECT count(*) FROM messages")
    wakes = await pool.fetchval("SELECT count(*) FROM wake_outbox")
    return int(messages), int(wakes)


async def post_via_store(store: RoomStore, world: World, **kwargs: object) -> object:
    return await store.post_message(
        room_id=world.room_id,
        author=AuthorRef(kind="person", company_id=world.acme.company_id, person="ana"),
        body="meant for the writer",
        mention_agent_ids=[world.bolt_agent.agent_id],
        run_id=None,
        dedupe_key=None,
        **kwargs,  # type: ignore[arg-type]
    )


async def waiting_pid(pool: asyncpg.Pool) -> int:
    """The backend of this database that waits for a lock (bounded)."""
    await until_locks_are_awaited(pool)
    return int(
        await pool.fetchval(
            "SELECT l.pid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE NOT l.granted AND a.datname = current_database() LIMIT 1"
        )
    )


async def test_nothing_of_a_post_is_seen_before_it_commits_whole(
    store: RoomStore, pool: asyncpg.Pool, world: World, database_url: str
) -> None:
    async with next_event_held(database_url, world.room_id):
        posting = asyncio.create_task(post_via_store(store, world))
        await until_locks_are_awaited(pool)  # its message written, its event waits
        assert await counts(pool) == (0, 0)
    await posting
    assert await counts(pool) == (1, 1)


async def test_backend_killed_inside_the_post_leaves_neither(
    store: RoomStore, pool: asyncpg.Pool, world: World, database_url: str
) -> None:
    async with next_event_held(database_url, world.room_id):
        posting = asyncio.create_task(post_via_store(store, world))
        pid = await waiting_pid(pool)
        assert await pool.fetchval("SELECT pg_terminate_backend($1)", pid)
        with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError, ConnectionError, OSError)):
            await posting
    assert await counts(pool) == (0, 0)
    await post_via_store(store, world)  # the pool recovers
    assert await counts(pool) == (1, 1)


async def test_event_insert_failing_rolls_the_message_and_wake_back(
    store: RoomStore, pool: asyncpg.Pool, world: World
) -> None:
    # A constraint no new event can meet: the post's event, written by its own statement, fails.
    await pool.execute("ALTER TABLE room_events ADD CONSTRAINT refuse_events CHECK (false) NOT VALID")
    try:
        with pytest.raises(asyncpg.CheckViolationError):
            await post_via_store(store, world)
        assert await counts(pool) == (0, 0)
    finally:
        await pool.execute("ALTER TABLE room_events DROP CONSTRAINT refuse_events")
    await post_via_store(store, world)
    assert await counts(pool) == (1, 1)


async def test_cancelled_inside_the_post_leaves_neither(
    store: RoomStore, pool: asyncpg.Pool, world: World, database_url: str
) -> None:
    # The cancel a client's deadline sends PostgreSQL (pg_cancel_backend) stops the post's one statement.
    async with next_event_held(database_url, world.room_id):
        posting = asyncio.create_task(post_via_store(store, world))
        assert await pool.fetchval("SELECT pg_cancel_backend($1)", await waiting_pid(pool))
        with pytest.raises(asyncpg.QueryCanceledError):
            await posting
    assert await counts(pool) == (0, 0)
