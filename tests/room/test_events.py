"""The room event log: every write path appends its event in its own transaction, with a gap-free
cursor; ReadRoomEvents scopes it to a member company; retention removes old events (OUT_OF_RANGE)."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import grpc

from quayutec.config import ROOM
from quayutec.v1 import common_pb2, room_pb2, room_pb2_grpc
from tests.harness.channels import callers_stub
from tests.harness.room import add_member, running_room
from tests.room.conftest import Stub, World, agent_author, expect_error, person, post
from tests.room.test_memory_files import remember, upload
from tests.room.test_rights_waitpoints import park
from tests.room.test_runs_wakes import a_run, record
from tests.room.test_tasks import create, update

K = common_pb2
NOT_FOUND = grpc.StatusCode.NOT_FOUND
COMPANY_ONLY = common_pb2.MEMORY_VISIBILITY_COMPANY


async def read(
    room: Stub, room_id: str, company_id: str = "", after: int = 0, limit: int = 0
) -> room_pb2.RoomServiceReadRoomEventsResponse:
    request = room_pb2.RoomServiceReadRoomEventsRequest(
        room_id=room_id, company_id=company_id, after=after, limit=limit
    )
    response: room_pb2.RoomServiceReadRoomEventsResponse = await room.ReadRoomEvents(request, timeout=10)
    return response


def kinds(response: room_pb2.RoomServiceReadRoomEventsResponse) -> list[int]:
    return [e.event.kind for e in response.entries]


async def test_every_write_path_appends_its_event_in_room_order(room: Stub, world: World) -> None:
    acme, bolt = world.acme.company_id, world.bolt.company_id
    start = (await read(room, world.room_id)).last_cursor  # Bolt's joining is already there
    posted = await post(room, world, "hello")
    task = (await create(room, world)).task
    await update(room, task.task_id, world, note="on it")
    await update(room, task.task_id, world, note="done", status=K.TASK_STATUS_DONE)
    await remember(room, world, "shared fact")
    await remember(room, world, "acme only", visibility=COMPANY_ONLY)
    await upload(room, world, "notes.txt", b"launch notes")
    await record(room, a_run(world, run_id="run-ev"))
    await park(room, world, run_id="run-ev")
    await room.LeaveRoom(room_pb2.RoomServiceLeaveRoomRequest(room_id=world.room_id, company_id=bolt))

    every = await read(room, world.room_id, after=start)
    assert [e.event.cursor for e in every.entries] == list(range(start + 1, every.last_cursor + 1))  # gap-free
    assert kinds(every) == [
        K.ROOM_EVENT_KIND_MESSAGE_POSTED,
        K.ROOM_EVENT_KIND_TASK_CREATED,
        K.ROOM_EVENT_KIND_TASK_UPDATED,
        K.ROOM_EVENT_KIND_TASK_CLOSED,
        K.ROOM_EVENT_KIND_MEMORY_WRITTEN,
        K.ROOM_EVENT_KIND_MEMORY_WRITTEN,
        K.ROOM_EVENT_KIND_FILE_UPLOADED,
        K.ROOM_EVENT_KIND_RUN_STARTED,
        K.ROOM_EVENT_KIND_RUN_PARKED,
        K.ROOM_EVENT_KIND_APPROVAL_AWAITING,
        K.ROOM_EVENT_KIND_MEMBER_LEFT,
    ]
    events = [e.event for e in every.entries]
    assert events[0].message == posted.message and events[0].room_id == world.room_id
    assert events[3].task.status == K.TASK_STATUS_DONE and len(events[3].task.updates) == 2
    assert events[6].file.name == "notes.txt" and events[6].file.size_bytes == len(b"launch notes")
    assert events[9].approval.run_id == "run-ev" and events[10].member.company_id == bolt
    audiences = [e.audience_company_id for e in every.entries]
    assert audiences == ["", "", "", "", "", acme, "", acme, acme, acme, ""]

    # Acme, a member, sees all of it; a company's reading skips no cursor it may see.
    assert kinds(await read(room, world.room_id, acme, after=start)) == kinds(every)
    # A non-member reads nothing at all.
    await expect_error(NOT_FOUND, read(room, world.room_id, bolt, after=start))
    await expect_error(NOT_FOUND, read(room, world.room_id, world.crow.company_id))


async def test_private_events_reach_only_their_company(room: Stub, world: World) -> None:
    acme, bolt = world.acme.company_id, world.bolt.company_id
    start = (await read(room, world.room_id)).last_cursor
    await remember(room, world, "acme's secret", visibility=COMPANY_ONLY)
    await record(room, a_run(world, run_id="run-private"))
    await remember(room, world, "bolt's secret", visibility=COMPANY_ONLY, author=agent_author(world.bolt_agent))
    await post(room, world, "public")

    seen_by_bolt = await read(room, world.room_id, bolt, after=start)
    texts = [e.event.memory.text for e in seen_by_bolt.entries if e.event.HasField("memory")]
    assert texts == ["bolt's secret"]
    assert K.ROOM_EVENT_KIND_RUN_STARTED not in kinds(seen_by_bolt)
    assert kinds(seen_by_bolt) == [K.ROOM_EVENT_KIND_MEMORY_WRITTEN, K.ROOM_EVENT_KIND_MESSAGE_POSTED]
    # The invisible cursors still count: Bolt continues after the newest one, not before it.
    assert seen_by_bolt.next_after == seen_by_bolt.last_cursor == start + 4
    seen_by_acme = await read(room, world.room_id, acme, after=start)
    assert [e.event.memory.text for e in seen_by_acme.entries if e.event.HasField("memory")] == ["acme's secret"]


async def test_a_change_that_does_not_commit_leaves_no_event(room: Stub, world: World, pool: asyncpg.Pool) -> None:
    before = (await read(room, world.room_id)).last_cursor
    # A closed task refuses a second close: its transaction rolls back, event and all.
    task = (await create(room, world)).task
    await update(room, task.task_id, world, status=K.TASK_STATUS_DONE)
    await expect_error(grpc.StatusCode.FAILED_PRECONDITION, update(room, task.task_id, world, note="again"))
    await expect_error(grpc.StatusCode.PERMISSION_DENIED, post(room, world, author=person(world.crow.company_id)))
    after = await read(room, world.room_id, after=before)
    assert kinds(after) == [K.ROOM_EVENT_KIND_TASK_CREATED, K.ROOM_EVENT_KIND_TASK_CLOSED]
    stored = await pool.fetchval("SELECT count(*) FROM room_events WHERE room_id = $1", uuid.UUID(world.room_id))
    assert stored == after.last_cursor


async def test_concurrent_writes_take_distinct_consecutive_cursors(room: Stub, world: World) -> None:
    start = (await read(room, world.room_id)).last_cursor
    await asyncio.gather(
        *(post(room, world, f"m{i}") for i in range(20)), *(remember(room, world, f"r{i}") for i in range(10))
    )
    got = await read(room, world.room_id, after=start)
    assert [e.event.cursor for e in got.entries] == list(range(start + 1, start + 31))
    # Messages appear in the order of their seq: cursor order is commit order.
    seqs = [e.event.message.seq for e in got.entries if e.event.HasField("message")]
    assert seqs == sorted(seqs) and len(seqs) == 20


async def test_member_joined_event_on_accept(room: Stub, world: World) -> None:
    start = (await read(room, world.room_id)).last_cursor
    await add_member(room, world.room_id, world.crow.company_id, invited_by=world.acme.company_id)
    got = await read(room, world.room_id, world.crow.company_id, after=start)
    assert kinds(got) == [K.ROOM_EVENT_KIND_MEMBER_JOINED]
    assert got.entries[0].event.member.company_id == world.crow.company_id


async def test_retention_removes_old_events_and_an_older_cursor_is_out_of_range(
    database_url: str, pool: asyncpg.Pool
) -> None:
    async with (
        running_room(
            database_url, QUAYUTEC_ROOM_EVENT_RETENTION_HOURS="1", QUAYUTEC_ROOM_EVENT_CLEANUP_SECONDS="1"
        ) as addr,
        callers_stub(addr, ROOM.grpc_service, room_pb2_grpc.RoomServiceStub) as room,
    ):
        company = (await room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name="Keep"))).company
        room_id = (
            await room.CreateRoom(room_pb2.RoomServiceCreateRoomRequest(company_id=company.company_id, name="r"))
        ).room.room_id
        for body in ("one", "two", "three"):
            await room.PostMessage(
                room_pb2.RoomServicePostMessageRequest(room_id=room_id, author=person(company.company_id), body=body)
            )
        # The first two are older than the one hour kept.
        await pool.execute(
            "UPDATE room_events SET created_at = now() - interval '2 hours' WHERE room_id = $1 AND seq <= 2",
            uuid.UUID(room_id),
        )
        async with asyncio.timeout(30):
            # The cleanup runs in the Room server; its result lives in the database.
            while await pool.fetchval("SELECT count(*) FROM room_events WHERE room_id = $1", uuid.UUID(room_id)) > 1:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        said = await expect_error(grpc.StatusCode.OUT_OF_RANGE, read(room, room_id, company.company_id, after=1))
        assert "kept 1 hours" in said and "after cursor 2" in said
        rest = await read(room, room_id, company.company_id, after=2)
        assert [e.event.message.body for e in rest.entries] == ["three"]


async def test_a_run_is_an_event_when_its_status_changes_only(room: Stub, world: World) -> None:
    start = (await read(room, world.room_id)).last_cursor
    run = a_run(world, run_id="run-status")
    await record(room, run)
    run.step = K.RUN_STEP_MODEL_CALLED
    await record(room, run)  # the same status: no event
    run.status = K.RUN_STATUS_SUCCEEDED
    run.step = K.RUN_STEP_ENDED
    run.ended_at.GetCurrentTime()
    await record(room, run)
    got = await read(room, world.room_id, world.acme.company_id, after=start)
    assert kinds(got) == [K.ROOM_EVENT_KIND_RUN_STARTED, K.ROOM_EVENT_KIND_RUN_ENDED]
    assert got.entries[1].event.run.status == K.RUN_STATUS_SUCCEEDED
    assert not (await read(room, world.room_id, world.bolt.company_id, after=start)).entries


async def test_a_run_event_carries_the_row_as_written(room: Stub, world: World) -> None:
    # The event is appended by the ledger write's own statement from the row it wrote (its snapshot): read
    # back, it is that row exactly, as GetRun returned it then, and stays so when the row moves on.
    start = (await read(room, world.room_id)).last_cursor
    run = a_run(world, run_id="run-snapshot", trace_id="t-1")
    run.actions.add(index=0, kind=K.ACTION_KIND_REMEMBER, arguments_json='{"text": "x"}')
    written = await record(room, run)
    run.status, run.step = K.RUN_STATUS_FAILED, K.RUN_STEP_ENDED
    run.ended_at.GetCurrentTime()
    ended = await record(room, run)
    got = await read(room, world.room_id, world.acme.company_id, after=start)
    assert [e.event.run for e in got.entries] == [written, ended]
    assert [e.audience_company_id for e in got.entries] == [world.acme.company_id] * 2


async def test_a_task_update_event_reads_back_as_before_from_either_form(
    room: Stub, world: World, pool: asyncpg.Pool
) -> None:
    # An update's event is appended by the update's own statement, carrying the task and its updates as a
    # snapshot; events written before carry a serialized RoomEvent (detail). Both read back as the task
    # with all its updates, oldest first, as UpdateTask answered it.
    start = (await read(room, world.room_id)).last_cursor
    task = (await create(room, world)).task
    noted = await update(room, task.task_id, world, note="on it")
    closed = await update(room, task.task_id, world, note="done", status=K.TASK_STATUS_DONE)
    got = (await read(room, world.room_id, after=start)).entries
    assert [e.event.task for e in got] == [task, noted.task, closed.task]
    assert [u.note for u in got[2].event.task.updates] == ["on it", "done"]

    # The same event as older code stored it (its bytes, as append_room_events wrote them) reads the same.
    stored = K.RoomEvent(kind=K.ROOM_EVENT_KIND_TASK_CLOSED, task=closed.task)
    await pool.execute(
        "WITH next AS (UPDATE rooms SET last_event_seq = last_event_seq + 1 WHERE room_id = $1"
        " RETURNING last_event_seq)"
        " INSERT INTO room_events (room_id, seq, kind, detail) SELECT $1, last_event_seq, 'task_closed', $2 FROM next",
        uuid.UUID(world.room_id),
        stored.SerializeToString(),
    )
    old = (await read(room, world.room_id, after=got[-1].event.cursor)).entries[0].event
    assert old.kind == got[2].event.kind and old.task == got[2].event.task
