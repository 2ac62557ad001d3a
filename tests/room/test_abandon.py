"""AbandonStaleRuns: a RUNNING row whose Runtime died is ended, its undone actions marked, and a late
write from the dead run is refused."""

from __future__ import annotations

import re

import asyncpg
import grpc

from quayutec.v1 import common_pb2, room_pb2
from tests.room.conftest import Stub, World, agent_author, expect_error
from tests.room.test_rights_waitpoints import decide, park
from tests.room.test_run_context import a_run, get_run


async def age(database_url: str, run_id: str, seconds: int) -> None:
    """Make a row look untouched for ``seconds`` (as if its Runtime had died that long ago)."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "UPDATE runs SET updated_at = now() - $2::bigint * interval '1 second' WHERE run_id = $1", run_id, seconds
        )
    finally:
        await conn.close()


def idle_seconds(error: str) -> int:
    """N of housekeeping's "abandoned: no progress recorded for N s; not redone"."""
    match = re.fullmatch(r"abandoned: no progress recorded for (\d+) s; not redone", error)
    assert match is not None, error
    return int(match.group(1))


async def record(room: Stub, run: common_pb2.Run) -> None:
    await room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=run))


async def abandon(room: Stub, older_than: int = 600) -> int:
    got = await room.AbandonStaleRuns(room_pb2.RoomServiceAbandonStaleRunsRequest(older_than_seconds=older_than))
    return int(got.abandoned)


async def test_only_stale_running_rows_are_abandoned(room: Stub, world: World, database_url: str) -> None:
    stale = a_run(world, "run-stale", step=common_pb2.RUN_STEP_REPLY_POSTED)
    stale.actions[0].outcome = common_pb2.ACTION_OUTCOME_DONE
    fresh = a_run(world, "run-fresh")
    parked = a_run(world, "run-parked", status=common_pb2.RUN_STATUS_PARKED, step=common_pb2.RUN_STEP_PARKED)
    for run in (stale, fresh, parked):
        await record(room, run)
    await age(database_url, "run-stale", 601)
    await age(database_url, "run-parked", 10_000)
    assert await abandon(room) == 1
    assert await abandon(room) == 0  # once
    ended = await get_run(room, "run-stale")
    assert (ended.status, ended.step) == (common_pb2.RUN_STATUS_FAILED, common_pb2.RUN_STEP_ENDED)
    assert idle_seconds(ended.error) >= 601
    assert ended.HasField("ended_at")
    assert [a.outcome for a in ended.actions] == [
        common_pb2.ACTION_OUTCOME_DONE,
        common_pb2.ACTION_OUTCOME_NOT_DONE,
        common_pb2.ACTION_OUTCOME_NOT_DONE,
    ]
    assert (await get_run(room, "run-fresh")).status == common_pb2.RUN_STATUS_RUNNING
    assert (await get_run(room, "run-parked")).status == common_pb2.RUN_STATUS_PARKED


async def test_a_late_write_from_an_abandoned_run_is_refused(room: Stub, world: World, database_url: str) -> None:
    zombie = a_run(world, "run-zombie")
    await record(room, zombie)
    await age(database_url, "run-zombie", 3600)
    assert await abandon(room) == 1
    await expect_error(grpc.StatusCode.FAILED_PRECONDITION, record(room, zombie), "ended")
    late = room_pb2.RoomServiceWriteMemoryRequest(
        room_id=world.room_id,
        author=agent_author(world.acme_agent),
        text="written after the run was abandoned",
        visibility=common_pb2.MEMORY_VISIBILITY_ROOM,
        run_id="run-zombie",
        run=zombie,
        run_action_index=0,
    )
    await expect_error(grpc.StatusCode.FAILED_PRECONDITION, room.WriteMemory(late), "ended")
    lines = await room.ListMemory(
        room_pb2.RoomServiceListMemoryRequest(room_id=world.room_id, reader_company_id=world.acme.company_id)
    )
    assert list(lines.lines) == []


async def test_abandon_validates_its_bounds(room: Stub) -> None:
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, abandon(room, older_than=10), "older_than_seconds")
    bad_limit = room_pb2.RoomServiceAbandonStaleRunsRequest(older_than_seconds=600, limit=5000)
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, room.AbandonStaleRuns(bad_limit), "limit")


async def age_decisions(database_url: str, token: str, seconds: int) -> None:
    """Make a waitpoint's decisions look ``seconds`` old."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "UPDATE held_actions SET decided_at = now() - $2::bigint * interval '1 second'"
            " WHERE token = $1::uuid AND decided_at IS NOT NULL",
            token,
            seconds,
        )
    finally:
        await conn.close()


async def test_a_parked_run_whose_token_completed_long_ago_is_ended(
    room: Stub, world: World, database_url: str
) -> None:
    done = await park(room, world, "run-never-continued")
    await decide(room, done.token, 1, world.acme.company_id, approve=True)
    await decide(room, done.token, 2, world.acme.company_id, approve=False)
    half = await park(room, world, "run-half-decided")
    await decide(room, half.token, 1, world.acme.company_id)
    recent = await park(room, world, "run-just-decided")
    await decide(room, recent.token, 1, world.acme.company_id)
    await decide(room, recent.token, 2, world.acme.company_id)
    for run_id in ("run-never-continued", "run-half-decided", "run-just-decided"):
        await age(database_url, run_id, 10_000)  # parked long ago: that alone is no reason to end it
    await age_decisions(database_url, done.token, 700)
    await age_decisions(database_url, half.token, 700)  # still pending: it waits for its last decision

    assert await abandon(room) == 1
    assert await abandon(room) == 0
    ended = await get_run(room, "run-never-continued")
    assert (ended.status, ended.step) == (common_pb2.RUN_STATUS_FAILED, common_pb2.RUN_STEP_ENDED)
    assert idle_seconds(ended.error) >= 700
    assert [a.outcome for a in ended.actions] == [
        common_pb2.ACTION_OUTCOME_DONE,
        common_pb2.ACTION_OUTCOME_NOT_DONE,
        common_pb2.ACTION_OUTCOME_NOT_DONE,
    ]
    assert (await get_run(room, "run-half-decided")).status == common_pb2.RUN_STATUS_PARKED
    assert (await get_run(room, "run-just-decided")).status == common_pb2.RUN_STATUS_PARKED


async def test_a_run_that_moved_on_after_it_was_found_stale_is_left_alone(
    room: Stub, world: World, database_url: str
) -> None:
    run = a_run(world, "run-slow")
    await record(room, run)
    await age(database_url, "run-slow", 601)
    await record(room, run)  # progress recorded: no longer stale
    assert await abandon(room) == 0
    assert (await get_run(room, "run-slow")).status == common_pb2.RUN_STATUS_RUNNING
