"""How many statements the Room sends PostgreSQL per hot RPC (each one a round trip, BEGIN and COMMIT too).

The wake path's cost is dominated by these round trips, and the room row's lock (the event cursor) is held
from the statement that takes it to COMMIT: these tests pin both the count and the order, so that neither
creeps back. They count statements (asyncpg's query logger on the Room's only pool connection); they never
time anything.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
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
    # The rules' facts (room, author's membership FOR SHARE, mentions, dedupe key), the message, its wakes and
    # its event: one statement, the room row's lock taken by it last.
    assert await statements.of(mention) == ["post_message"]
    again = post(room, world, "@writer", [world.bolt_agent.agent_id], dedupe_key="k-1")
    assert await statements.of(again) == ["post_message"]  # the repeat is answered from the same statement
    assert statements.result.deduplicated
    plain = post(room, world, "no mentions, no dedupe key", author=person(world.bolt.company_id, "bo"))
    assert await statements.of(plain) == ["post_message"]


async def test_reply_with_its_ledger_row_round_trips(room: Stub, world: World, statements: Statements) -> None:
    run = a_run(world, "run-reply")
    await room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=run))
    await room.PostMessage(reply_request(world, run, "warm up"))
    # The facts, the ledger row through the fence, the message, its wakes and both events: one statement.
    assert await statements.of(room.PostMessage(reply_request(world, run, "the answer"))) == ["post_message"]
    run.status = common_pb2.RUN_STATUS_SUCCEEDED  # a status change: one more event, no more round trips
    run.step = common_pb2.RUN_STEP_ENDED
    run.ended_at.GetCurrentTime()
    last = reply_request(world, run, "the last answer")
    assert await statements.of(room.PostMessage(last)) == ["post_message"]
    # A retried reply answers the earlier message, and records the row with its id: one more statement.
    assert await statements.of(room.PostMessage(last)) == ["post_message", "record_run"]
    assert statements.result.deduplicated
    events = room_pb2.RoomServiceReadRoomEventsRequest(room_id=world.room_id, company_id=world.acme.company_id)
    got = (await room.ReadRoomEvents(events)).entries
    assert [e.event.kind for e in got][-2:] == [
        common_pb2.ROOM_EVENT_KIND_RUN_ENDED,
        common_pb2.ROOM_EVENT_KIND_MESSAGE_POSTED,
    ]
    ended, posted = got[-2].event, got[-1].event
    assert ended.run.posted_message_id == posted.message.message_id and posted.message.body == "the last answer"


async def test_a_post_the_rules_refuse_writes_nothing(room: Stub, world: World, statements: Statements) -> None:
    # The post's statement writes only under facts the rules allow; the rules decide, here, from the facts
    # it returns. Each refusal: one statement, and nothing of it written (no message, event, wake or row).
    await post(room, world, "first", dedupe_key="taken")
    listing = room_pb2.RoomServiceListMessagesRequest(room_id=world.room_id)
    every_event = room_pb2.RoomServiceReadRoomEventsRequest(room_id=world.room_id, limit=1000)

    async def written() -> tuple[int, int, int]:
        messages = (await room.ListMessages(listing)).messages
        events = await room.ReadRoomEvents(every_event)
        wakes = await room.CountPendingWakes(room_pb2.RoomServiceCountPendingWakesRequest())
        return len(messages), events.last_cursor, wakes.pending

    before = await written()
    crow, acme = world.crow_agent, world.acme_agent
    outsider_reply = reply_request(world, a_run(world, "run-outsider", agent=crow), "from outside")
    outsider_reply.author.CopyFrom(agent_author(crow))
    mentioning_outsider = reply_request(world, a_run(world, "run-mentions", agent=acme), "@crow")
    mentioning_outsider.mention_agent_ids.append(crow.agent_id)
    cases: list[tuple[grpc.StatusCode, Callable[[], Awaitable[Any]]]] = [
        (
            grpc.StatusCode.PERMISSION_DENIED,
            lambda: post(room, world, "outsider", author=person(world.crow.company_id)),
        ),
        (grpc.StatusCode.NOT_FOUND, lambda: post(room, world, "@crow", [crow.agent_id])),
        (grpc.StatusCode.NOT_FOUND, lambda: post(room, world, "@nobody", [str(uuid.uuid4())])),
        (
            grpc.StatusCode.ALREADY_EXISTS,
            lambda: post(room, world, "x", author=person(world.bolt.company_id), dedupe_key="taken"),
        ),
        (grpc.StatusCode.PERMISSION_DENIED, lambda: room.PostMessage(outsider_reply)),
        (grpc.StatusCode.NOT_FOUND, lambda: room.PostMessage(mentioning_outsider)),
    ]
    for code, call in cases:
        assert await statements.of(call()) == ["post_message"]
        assert statements.error == code
    assert await written() == before
    for run_id in ("run-outsider", "run-mentions"):
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await room.GetRun(room_pb2.RoomServiceGetRunRequest(run_id=run_id))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def remember_request(
    world: World, run: common_pb2.Run, text: str, author: common_pb2.Author | None = None, **fields: Any
) -> room_pb2.RoomServiceWriteMemoryRequest:
    return room_pb2.RoomServiceWriteMemoryRequest(
        room_id=world.room_id,
        author=author or agent_author(world.acme_agent),
        text=text,
        visibility=common_pb2.MEMORY_VISIBILITY_COMPANY,
        run_id=run.run_id,
        dedupe_key=f"run:{run.run_id}:memory:{text}",
        run=run,
        run_action_index=0,
        **fields,
    )


async def test_write_memory_with_its_ledger_row_round_trips(room: Stub, world: World, statements: Statements) -> None:
    run = a_run(world, "run-memory")
    await room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=run))
    await room.WriteMemory(remember_request(world, run, "warm up"))
    events = room_pb2.RoomServiceReadRoomEventsRequest(room_id=world.room_id, company_id=world.acme.company_id)
    start = (await room.ReadRoomEvents(events)).last_cursor
    # The facts, the ledger row through the fence, the line and its event: one statement.
    written = room.WriteMemory(remember_request(world, run, "dawn on the 4th"))
    assert await statements.of(written) == ["write_memory"]
    line = statements.result.line
    assert await statements.of(room.WriteMemory(remember_request(world, run, "dawn on the 4th"))) == [
        "write_memory",
        "record_run",  # a repeat answers the earlier line, and records the row with its id
    ]
    assert statements.result.deduplicated and statements.result.line == line
    events.after = start
    got = (await room.ReadRoomEvents(events)).entries
    assert [(e.event.memory, e.audience_company_id) for e in got] == [(line, world.acme.company_id)]
    private = room_pb2.RoomServiceReadRoomEventsRequest(room_id=world.room_id, company_id=world.bolt.company_id)
    private.after = start
    assert not (await room.ReadRoomEvents(private)).entries  # a line private to Acme: Bolt sees no event of it

    # Refused by a rule (Crow is not a member; another company's dedupe key): nothing of it written.
    outsider = remember_request(world, a_run(world, "run-crow", agent=world.crow_agent), "x")
    outsider.author.CopyFrom(agent_author(world.crow_agent))
    outsider.run.room_id = world.room_id
    taken = remember_request(world, a_run(world, "run-bolt", agent=world.bolt_agent), "dawn on the 4th")
    taken.author.CopyFrom(agent_author(world.bolt_agent))
    taken.dedupe_key = remember_request(world, run, "dawn on the 4th").dedupe_key
    cases = [(grpc.StatusCode.PERMISSION_DENIED, outsider), (grpc.StatusCode.ALREADY_EXISTS, taken)]
    for code, request in cases:
        assert await statements.of(room.WriteMemory(request)) == ["write_memory"]
        assert statements.error == code
    every = room_pb2.RoomServiceReadRoomEventsRequest(room_id=world.room_id, after=start, limit=1000)
    assert len((await room.ReadRoomEvents(every)).entries) == 1
    for run_id in ("run-crow", "run-bolt"):
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await room.GetRun(room_pb2.RoomServiceGetRunRequest(run_id=run_id))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND


async def test_create_task_with_its_ledger_row_round_trips(room: Stub, world: World, statements: Statements) -> None:
    run = a_run(world, "run-task")
    await room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=run))
    me = agent_author(world.acme_agent)

    def task(title: str, **fields: Any) -> Any:
        request: dict[str, Any] = {"from": me, "to_agent_id": world.bolt_agent.agent_id, "title": title}
        request.update(run_id=run.run_id, dedupe_key=f"run:{run.run_id}:task:{title}", run=run, run_action_index=1)
        return room.CreateTask(room_pb2.RoomServiceCreateTaskRequest(room_id=world.room_id, **{**request, **fields}))

    await task("warm up")
    events = room_pb2.RoomServiceReadRoomEventsRequest(room_id=world.room_id, company_id=world.bolt.company_id)
    start = (await room.ReadRoomEvents(events)).last_cursor
    # The facts (the author's and the assignee's memberships FOR SHARE), the ledger row through the fence,
    # the task, the assignee's wake and the event: one statement.
    assert await statements.of(task("write the copy")) == ["create_task"]
    created = statements.result
    assert [w.agent_id for w in created.wakes] == [world.bolt_agent.agent_id]
    assert await statements.of(task("write the copy")) == ["create_task", "record_run"]  # a repeat
    assert statements.result.deduplicated and statements.result.task == created.task
    assert list(statements.result.wakes) == list(created.wakes)
    events.after = start
    assert [e.event.task for e in (await room.ReadRoomEvents(events)).entries] == [created.task]

    # Refused by a rule (Crow outside the room, an assignee outside it, another company's key): nothing written.
    outsider = {"from": person(world.crow.company_id), "run_id": "", "dedupe_key": "", "run": None}
    cases: list[tuple[grpc.StatusCode, Callable[[], Awaitable[Any]]]] = [
        (grpc.StatusCode.PERMISSION_DENIED, lambda: task("x", **outsider)),
        (grpc.StatusCode.NOT_FOUND, lambda: task("y", to_agent_id=world.crow_agent.agent_id)),
        (grpc.StatusCode.NOT_FOUND, lambda: task("z", to_agent_id=str(uuid.uuid4()))),
        (
            grpc.StatusCode.ALREADY_EXISTS,
            lambda: task("write the copy", **{"from": person(world.bolt.company_id), "run": None, "run_id": ""}),
        ),
    ]
    for code, call in cases:
        assert await statements.of(call()) == ["create_task"]
        assert statements.error == code
    every = room_pb2.RoomServiceReadRoomEventsRequest(room_id=world.room_id, after=start, limit=1000)
    assert len((await room.ReadRoomEvents(every)).entries) == 1
    tasks = await room.ListTasks(room_pb2.RoomServiceListTasksRequest(room_id=world.room_id))
    assert sorted(t.title for t in tasks.tasks) == ["warm up", "write the copy"]


def update_request(
    world: World, task_id: str, note: str, run: common_pb2.Run | None = None, **fields: Any
) -> room_pb2.RoomServiceUpdateTaskRequest:
    """An update of ``task_id`` by Bolt's agent, with ``run``'s ledger row (its action 2) when given."""
    request: dict[str, Any] = {"task_id": task_id, "author": agent_author(world.bolt_agent), "note": note}
    if run is not None:
        request.update(run_id=run.run_id, dedupe_key=f"run:{run.run_id}:update:{note}", run=run, run_action_index=2)
    return room_pb2.RoomServiceUpdateTaskRequest(**{**request, **fields})


async def new_task(room: Stub, world: World, title: str, to: common_pb2.Agent | None = None) -> common_pb2.Task:
    """A task Acme's person sends (to Bolt's agent unless ``to``)."""
    assignee = (to or world.bolt_agent).agent_id
    request: dict[str, Any] = {"room_id": world.room_id, "from": person(world.acme.company_id), "title": title}
    request["to_agent_id"] = assignee
    task: common_pb2.Task = (await room.CreateTask(room_pb2.RoomServiceCreateTaskRequest(**request))).task
    return task


async def test_update_task_with_its_ledger_row_round_trips(room: Stub, world: World, statements: Statements) -> None:
    run = a_run(world, "run-update", agent=world.bolt_agent)
    await room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=run))
    warm, task = await new_task(room, world, "warm up"), await new_task(room, world, "write the copy")
    await room.UpdateTask(update_request(world, warm.task_id, "warm up", run))
    events = room_pb2.RoomServiceReadRoomEventsRequest(room_id=world.room_id, company_id=world.bolt.company_id)
    start = (await room.ReadRoomEvents(events)).last_cursor
    # The facts (the task locked, the author's membership FOR SHARE, the dedupe key), the ledger row through
    # the fence, the update, the task's status and the event: one statement.
    assert await statements.of(room.UpdateTask(update_request(world, task.task_id, "on it", run))) == ["update_task"]
    noted = statements.result
    assert noted.task.status == common_pb2.TASK_STATUS_OPEN and [u.note for u in noted.task.updates] == ["on it"]
    assert noted.update == noted.task.updates[0] and not noted.deduplicated
    # A repeat answers the earlier update, and records the row with its id: one more statement.
    again = room.UpdateTask(update_request(world, task.task_id, "on it", run))
    assert await statements.of(again) == ["update_task", "record_run"]
    assert statements.result.deduplicated and statements.result.update == noted.update
    assert statements.result.task == noted.task

    run.status = common_pb2.RUN_STATUS_SUCCEEDED  # a status change: the run's event too, no more round trips
    run.step = common_pb2.RUN_STEP_ENDED
    run.ended_at.GetCurrentTime()
    close = update_request(world, task.task_id, "done", run, status=common_pb2.TASK_STATUS_DONE)
    assert await statements.of(room.UpdateTask(close)) == ["update_task"]
    closed = statements.result
    assert closed.task.status == common_pb2.TASK_STATUS_DONE
    assert [u.note for u in closed.task.updates] == ["on it", "done"] and closed.update == closed.task.updates[-1]
    stored = (await room.GetRun(room_pb2.RoomServiceGetRunRequest(run_id=run.run_id))).run
    assert stored.status == common_pb2.RUN_STATUS_SUCCEEDED and stored.actions[2].result_id == closed.update.update_id

    # Each event carries the task with every update so far, as the update's answer did.
    events.after = start
    got = [e.event for e in (await room.ReadRoomEvents(events)).entries]
    assert [e.kind for e in got] == [
        common_pb2.ROOM_EVENT_KIND_TASK_UPDATED,
        common_pb2.ROOM_EVENT_KIND_RUN_ENDED,
        common_pb2.ROOM_EVENT_KIND_TASK_CLOSED,
    ]
    assert got[0].task == noted.task and got[2].task == closed.task
    assert got[1].run.actions[2].result_id == closed.update.update_id


async def test_an_update_the_rules_refuse_writes_nothing(
    room: Stub, world: World, statements: Statements, pool: asyncpg.Pool
) -> None:
    # The update's statement writes only under facts the rules allow; the rules decide, here, from the facts
    # it returns. Each refusal: one statement, and nothing of it written (no update, event, status or row).
    run = a_run(world, "run-held", agent=world.bolt_agent)
    await room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=run))
    task, acmes = await new_task(room, world, "write the copy"), await new_task(room, world, "ours", world.acme_agent)
    done = await new_task(room, world, "already done")
    await room.UpdateTask(update_request(world, task.task_id, "taken", dedupe_key="taken"))
    await room.UpdateTask(update_request(world, done.task_id, "", status=common_pb2.TASK_STATUS_DONE))

    async def written() -> tuple[int, int, list[tuple[str, int]], int]:
        counts = await pool.fetchrow(
            "SELECT (SELECT count(*) FROM task_updates) AS updates, (SELECT count(*) FROM room_events) AS events"
        )
        statuses = await pool.fetch("SELECT title, status FROM tasks ORDER BY pos")
        runs = await pool.fetchval("SELECT count(*) FROM runs")
        return counts["updates"], counts["events"], [(r["title"], r["status"]) for r in statuses], runs

    before = await written()
    held = a_run(world, "run-held", agent=world.bolt_agent, attempt="another delivery")
    elsewhere = a_run(world, "run-elsewhere", agent=world.bolt_agent, room_id=str(uuid.uuid4()))
    crow = person(world.crow.company_id)
    cases: list[tuple[grpc.StatusCode, room_pb2.RoomServiceUpdateTaskRequest]] = [
        (grpc.StatusCode.PERMISSION_DENIED, update_request(world, task.task_id, "outsider", author=crow)),
        (grpc.StatusCode.PERMISSION_DENIED, update_request(world, acmes.task_id, "neither sender nor assignee")),
        (grpc.StatusCode.FAILED_PRECONDITION, update_request(world, done.task_id, "again")),
        (grpc.StatusCode.NOT_FOUND, update_request(world, str(uuid.uuid4()), "no such task")),
        (grpc.StatusCode.NOT_FOUND, update_request(world, task.task_id, "wrong room", room_id=str(uuid.uuid4()))),
        (
            grpc.StatusCode.ALREADY_EXISTS,  # another company's dedupe key
            update_request(world, task.task_id, "mine", author=person(world.acme.company_id), dedupe_key="taken"),
        ),
        (grpc.StatusCode.ALREADY_EXISTS, update_request(world, task.task_id, "fenced", held)),  # the fence
        (grpc.StatusCode.INVALID_ARGUMENT, update_request(world, task.task_id, "run of another room", elsewhere)),
    ]
    for code, request in cases:
        assert await statements.of(room.UpdateTask(request)) == ["update_task"], request.note
        assert statements.error == code, request.note
    assert await written() == before
    stored = (await room.GetRun(room_pb2.RoomServiceGetRunRequest(run_id=run.run_id))).run
    assert stored.attempt == run.attempt and not stored.actions[2].result_id  # the fenced row is as it was


async def test_an_update_that_waited_for_another_is_sent_again(
    room: Stub, world: World, statements: Statements, database_url: str
) -> None:
    # Another update of the task commits while this one's statement waits for the task's lock: the statement
    # read the task's updates before that one, so it writes nothing and is sent again in a transaction that
    # locks the task first; the update's answer and event carry both updates.
    task = await new_task(room, world, "write the copy")
    await room.UpdateTask(update_request(world, task.task_id, "warm up"))
    other = await asyncpg.connect(database_url)
    try:
        tx = other.transaction()
        await tx.start()
        await other.execute(
            "INSERT INTO task_updates (task_id, author_kind, author_company_id, author_person, note, status)"
            " VALUES ($1, 'person', $2, 'ana', 'meanwhile', 'open')",
            uuid.UUID(task.task_id),
            uuid.UUID(world.acme.company_id),
        )
        await other.execute("UPDATE tasks SET updated_at = now() WHERE task_id = $1", uuid.UUID(task.task_id))
        mine = asyncio.ensure_future(statements.of(room.UpdateTask(update_request(world, task.task_id, "mine"))))
        for _ in range(1000):  # until the update's statement waits for the task's lock (10 s at most)
            waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
            if await other.fetchval(waiting):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the update never waited for the task's lock")
        await tx.commit()
        assert await mine == ["update_task", "BEGIN", "lock_task", "update_task", "COMMIT"]
    finally:
        await other.close()
    updated = statements.result
    assert [u.note for u in updated.task.updates] == ["warm up", "meanwhile", "mine"]
    events = room_pb2.RoomServiceReadRoomEventsRequest(room_id=world.room_id, company_id=world.bolt.company_id)
    last = (await room.ReadRoomEvents(events)).entries[-1].event
    assert last.kind == common_pb2.ROOM_EVENT_KIND_TASK_UPDATED and last.task == updated.task


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


def test_the_fenced_write_is_the_same_in_each_statement_that_makes_it(tmp_path: Path) -> None:
    # Each statement that writes a ledger row carries the fence (and the run's event) as CTEs, written once in
    # queries.sql as the fragment fenced_run_write.
    queries = Queries(QUERIES_PATH)
    # The fence keeps what a committed write recorded (the fragment kept_run_writes, named in it).
    assert "{{kept_run_writes}}" in queries.fragments["fenced_run_write"]
    fence = queries.fragments["fenced_run_write"].replace("{{kept_run_writes}}", queries.fragments["kept_run_writes"])
    assert "WHERE r.ended_at IS NULL" in fence and "up AS (" in fence
    for name in ("record_run", "run_context_with_run", "post_message", "write_memory", "create_task", "update_task"):
        assert queries[name].count(fence) == 1, name
        assert "{{" not in queries[name]
    # A statement naming a fragment the file does not have is refused when the file is loaded.
    broken = tmp_path / "queries.sql"
    broken.write_text("-- name: q\nSELECT 1 FROM {{no_such_part}};\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no_such_part"):
        Queries(broken)


async def test_a_post_that_leases_its_wakes_is_still_one_statement(
    room: Stub, world: World, statements: Statements
) -> None:
    await post(room, world, "warm up", [world.bolt_agent.agent_id], dedupe_key="warm-up")  # statements prepared
    leased = post(room, world, "@writer", [world.bolt_agent.agent_id], lease_owner="gw-1", lease_seconds=30)
    # The lease is set by the post's own statement: no LeaseWakes, no second statement.
    assert await statements.of(leased) == ["post_message"]
    assert statements.result.leased and [w.delivery_attempts for w in statements.result.wakes] == [1]
