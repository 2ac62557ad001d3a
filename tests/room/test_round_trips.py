"""How many statements the Room sends PostgreSQL per hot RPC (each one a round trip, BEGIN and COMMIT too).

The wake path's cost is dominated by these round trips, and the room row's lock (the event cursor) is held
from the statement that takes it to COMMIT: these tests pin both the count and the order, so that neither
creeps back. They count statements (asyncpg's query logger on the Room's only pool connection); they never
time anything.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import grpc
import pytest
from asyncpg.connection import LoggedQuery

from quayutec.config import ROOM
from quayutec.db import create_pool
from quayutec.sql import Queries
from quayutec.v1 import common_pb2, room_pb2, room_pb2_grpc
from services.room.store import QUERIES_PATH
from tests.harness.channels import callers_stub
from tests.harness.room import running_room
from tests.room.conftest import Stub, World, agent_author, person, post
from tests.room.test_run_context import a_run, context_request, upload_guide

_NAMES = {sql: name for name, sql in Queries(QUERIES_PATH).items()}


class Statements:
    """The statements one connection sent, by query name (BEGIN and COMMIT by their keyword)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.result: Any = None
        self.error: grpc.StatusCode | None = None

    def record(self, logged: LoggedQuery) -> None:
        query = logged.query.strip()
        self.names.append(_NAMES.get(query) or query.split()[0].rstrip(";").upper())

    async def of(self, call: Any) -> list[str]:
        """The statements sent while awaiting ``call`` (its result in ``result``)."""
        await asyncio.sleep(0)  # loggers are called soon after each statement: let earlier ones land
        self.names.clear()
        self.error = None
        try:
            self.result = await call
        except grpc.aio.AioRpcError as error:  # a refusal: its code in ``error``
            self.result, self.error = None, error.code()
        await asyncio.sleep(0)
        return list(self.names)


@pytest.fixture
def statements() -> Statements:
    return Statements()


@pytest.fixture
async def room_pool(database_url: str, statements: Statements) -> AsyncIterator[asyncpg.Pool]:
    """The Room's pool as in production, but of one connection, which logs every statement it sends."""
    pool = await create_pool(database_url, min_size=1, max_size=1)
    async with pool.acquire() as conn:
        conn.add_query_logger(statements.record)
    yield pool
    await pool.close()


@pytest.fixture
async def room(database_url: str, room_pool: asyncpg.Pool) -> AsyncIterator[Stub]:
    """A Room on ``room_pool`` (its housekeeping loops run once at start, then not for an hour)."""
    hour = "3600"
    async with (
        running_room(
            database_url,
            pool=room_pool,
            QUAYUTEC_ROOM_EVENT_CLEANUP_SECONDS=hour,
            QUAYUTEC_ROOM_OUTBOX_CLEANUP_INTERVAL_SECONDS=hour,
        ) as addr,
        callers_stub(addr, ROOM.grpc_service, room_pb2_grpc.RoomServiceStub) as stub,
    ):
        yield stub


def reply_request(world: World, run: common_pb2.Run, body: str) -> room_pb2.RoomServicePostMessageRequest:
    return room_pb2.RoomServicePostMessageRequest(
        room_id=world.room_id,
        author=agent_author(world.acme_agent),
        body=body,
        run_id=run.run_id,
        dedupe_key=f"run:{run.run_id}:reply:{body}",
        run=run,
    )


async def test_post_message_round_trips(room: Stub, world: World, statements: Statements) -> None:
    await post(room, world, "warm up", [world.bolt_agent.agent_id], dedupe_key="warm-up")  # statements prepared
    mention = post(room, world, "@writer", [world.bolt_agent.agent_id], dedupe_key="k-1")
    assert await statements.of(mention) == [
        "BEGIN",
        "post_check",  # room, author membership (FOR SHARE), mentions, dedupe: one statement
        "insert_message_with_wakes",  # takes the room row's lock: only the events and COMMIT follow
        "append_room_events",
        "COMMIT",
    ]
    again = post(room, world, "@writer", [world.bolt_agent.agent_id], dedupe_key="k-1")
    assert await statements.of(again) == ["BEGIN", "post_check", "COMMIT"]
    plain = post(room, world, "no mentions, no dedupe key", author=person(world.bolt.company_id, "bo"))
    assert len(await statements.of(plain)) == 5


async def test_reply_with_its_ledger_row_round_trips(room: Stub, world: World, statements: Statements) -> None:
    run = a_run(world, "run-reply")
    await room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=run))
    await room.PostMessage(reply_request(world, run, "warm up"))
    expected = [
        "BEGIN",
        "post_check",
        "upsert_run_with_before",  # the ledger row, before the room row's lock
        "insert_message_with_wakes",
        "append_room_events",  # the message's event and the run's, when its status changed: one statement
        "COMMIT",
    ]
    assert await statements.of(room.PostMessage(reply_request(world, run, "the answer"))) == expected
    run.status = common_pb2.RUN_STATUS_SUCCEEDED  # a status change: one more event, no more round trips
    run.step = common_pb2.RUN_STEP_ENDED
    run.ended_at.GetCurrentTime()
    assert await statements.of(room.PostMessage(reply_request(world, run, "the last answer"))) == expected


async def test_read_run_context_round_trips(room: Stub, world: World, statements: Statements) -> None:
    await upload_guide(room, world)
    wake = await post(room, world, "When does the launch window open?", [world.acme_agent.agent_id])
    fields: dict[str, Any] = {
        "wake_kind": common_pb2.WAKE_KIND_MESSAGE,
        "wake_source_id": wake.message.message_id,
        "recent_messages": 20,
    }
    await room.ReadRunContext(context_request(world, **fields))  # statements prepared
    read = room.ReadRunContext(context_request(world, **fields))
    assert await statements.of(read) == ["run_context"]  # every read, passages included, in one statement
    context = statements.result
    assert context.passages and context.wake_text.startswith("When does")

    await room.ReadRunContext(context_request(world, run=a_run(world, "run-warm"), **fields))
    first = room.ReadRunContext(context_request(world, run=a_run(world, "run-ctx"), **fields))
    # The fence, the room read and RUN_STARTED (the room row's lock, after the ledger row's): one statement.
    assert await statements.of(first) == ["run_context_with_run"]
    assert statements.result.passages
    again = room.ReadRunContext(context_request(world, run=a_run(world, "run-ctx"), **fields))
    assert await statements.of(again) == ["run_context_with_run"]  # the same status: no event, one statement
    taken = context_request(world, run=a_run(world, "run-ctx", attempt="another delivery"), **fields)
    assert await statements.of(room.ReadRunContext(taken)) == ["run_context_with_run"]  # refused: no second read
    assert statements.error == grpc.StatusCode.ALREADY_EXISTS


async def test_record_run_round_trips(room: Stub, world: World, statements: Statements) -> None:
    await room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=a_run(world, "run-warm")))
    started = room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=a_run(world, "run-1")))
    assert await statements.of(started) == ["record_run"]  # the row and its RUN_STARTED event
    step = a_run(world, "run-1", step=common_pb2.RUN_STEP_WRITES_DONE)  # no status change: no event
    assert await statements.of(room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=step))) == ["record_run"]
    taken = a_run(world, "run-1", attempt="another delivery")  # the fence's answer from the same statement
    assert await statements.of(room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=taken))) == ["record_run"]
    assert statements.error == grpc.StatusCode.ALREADY_EXISTS
    events = room_pb2.RoomServiceReadRoomEventsRequest(room_id=world.room_id, company_id=world.acme.company_id)
    await room.ReadRoomEvents(events)  # statements prepared, the rows' types looked up once per connection
    assert await statements.of(room.ReadRoomEvents(events)) == ["read_room_events"]
    assert [e.event.kind for e in statements.result.entries][-1:] == [common_pb2.ROOM_EVENT_KIND_RUN_STARTED]


async def test_read_events_round_trips(room: Stub, world: World, statements: Statements) -> None:
    await post(room, world, "hello")
    request = room_pb2.RoomServiceReadRoomEventsRequest(room_id=world.room_id, company_id=world.acme.company_id)
    await room.ReadRoomEvents(request)  # statements prepared
    # The room's cursors, the reader's membership and the events: one statement, one snapshot.
    assert await statements.of(room.ReadRoomEvents(request)) == ["read_room_events"]
    assert statements.result.entries[-1].event.message.body == "hello"
    now = room_pb2.RoomServiceReadRoomEventsRequest(room_id=world.room_id, from_now=True)
    assert await statements.of(room.ReadRoomEvents(now)) == ["read_room_events"]


def test_the_fenced_write_is_the_same_in_each_statement_that_makes_it() -> None:
    # record_run and run_context_with_run each carry the fence (and the run's event) as CTEs: one text.
    queries = Queries(QUERIES_PATH)

    def fence(name: str) -> str:
        text = queries[name]
        return text[text.index("before AS (") : text.index("), appended AS (")]

    assert fence("record_run") == fence("run_context_with_run")
    assert "WHERE r.ended_at IS NULL" in fence("record_run")
