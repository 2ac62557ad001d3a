"""The ledger's fence (Run.attempt) and the runs that never started (RecordNotStartedRuns).

Every ledger write carries the writing run's attempt; the Room applies it only to a new row, a row
of the same attempt, or a NOT_STARTED or PARKED row (taken over), so at most one run of a wake reads
the room. Housekeeping records a NOT_STARTED row for each wake delivered, still pending and without
a row, so no claim stays out of the ledger.
"""

from __future__ import annotations

import uuid

import asyncpg
import grpc

from quayutec.ledger import continuation_attempt, run_id_for
from quayutec.v1 import common_pb2, room_pb2
from tests.room.conftest import Stub, World, agent_author, expect_error, post
from tests.room.test_rights_waitpoints import decide, park
from tests.room.test_run_context import a_run, context_request, get_run
from tests.room.test_runs_wakes import lease, settle

HELD = grpc.StatusCode.ALREADY_EXISTS
RETRY = room_pb2.WAKE_SETTLEMENT_RETRY


async def record(room: Stub, run: common_pb2.Run) -> common_pb2.Run:
    recorded: common_pb2.Run = (await room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=run))).run
    return recorded


async def not_started(room: Stub, older_than: int = 1) -> room_pb2.RoomServiceRecordNotStartedRunsResponse:
    request = room_pb2.RoomServiceRecordNotStartedRunsRequest(older_than_seconds=older_than)
    response: room_pb2.RoomServiceRecordNotStartedRunsResponse = await room.RecordNotStartedRuns(request)
    return response


async def run_events(room: Stub, world: World, run_id: str) -> list[int]:
    """The kinds of the room events of ``run_id`` that the agent's company (Acme) sees, in order."""
    got = await room.ReadRoomEvents(
        room_pb2.RoomServiceReadRoomEventsRequest(room_id=world.room_id, company_id=world.acme.company_id, limit=1000)
    )
    events = [entry.event for entry in got.entries]
    return [e.kind for e in events if e.WhichOneof("detail") == "run" and e.run.run_id == run_id]


async def test_a_row_refuses_every_write_of_another_attempt(room: Stub, world: World) -> None:
    first = a_run(world, "run-fenced", step=common_pb2.RUN_STEP_CLAIMED, attempt="first")
    await room.ReadRunContext(context_request(world, run=first))  # the first write: it holds the row
    other = a_run(world, "run-fenced", step=common_pb2.RUN_STEP_CLAIMED, attempt="second")
    await expect_error(HELD, room.ReadRunContext(context_request(world, run=other)), "held by another delivery's run")
    await expect_error(HELD, room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=other)), "stops without acting")
    reply = room_pb2.RoomServicePostMessageRequest(
        room_id=world.room_id,
        author=agent_author(world.acme_agent),
        body="a reply the fenced-out run must not post",
        run_id="run-fenced",
        dedupe_key="run:run-fenced:reply",
        run=other,
    )
    await expect_error(HELD, room.PostMessage(reply))
    messages = await room.ListMessages(room_pb2.RoomServiceListMessagesRequest(room_id=world.room_id))
    assert [m.body for m in messages.messages] == []  # nothing of the refused write was kept
    stored = await get_run(room, "run-fenced")
    assert (stored.attempt, stored.step) == ("first", common_pb2.RUN_STEP_CLAIMED)

    first.step = common_pb2.RUN_STEP_MODEL_CALLED  # the holder goes on writing
    assert (await record(room, first)).step == common_pb2.RUN_STEP_MODEL_CALLED
    first.status, first.step = common_pb2.RUN_STATUS_SUCCEEDED, common_pb2.RUN_STEP_ENDED
    first.ended_at.GetCurrentTime()
    ended = await record(room, first)
    assert (await record(room, ended)).attempt == "first"  # the holder's repeat of its last write
    await expect_error(HELD, room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=other)))  # ended, another's
    changed = common_pb2.Run()
    changed.CopyFrom(ended)
    changed.error = "rewritten"
    await expect_error(
        grpc.StatusCode.FAILED_PRECONDITION, room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=changed))
    )


async def test_a_parked_row_is_taken_over_by_one_continuation_of_its_decided_waitpoint(
    room: Stub, world: World
) -> None:
    waitpoint = await park(room, world, "run-parked", attempt="the run")
    row = await get_run(room, "run-parked")
    row.status = common_pb2.RUN_STATUS_RUNNING

    def as_attempt(attempt: str) -> room_pb2.RoomServiceRecordRunRequest:
        candidate = common_pb2.Run()
        candidate.CopyFrom(row)
        candidate.attempt = attempt
        return room_pb2.RoomServiceRecordRunRequest(run=candidate)

    one, two = (continuation_attempt(waitpoint.token, claimant) for claimant in ("one", "two"))
    # Not decided yet: no continuation may take it.
    await expect_error(HELD, room.RecordRun(as_attempt(one)))
    for index in (1, 2):  # its held actions
        await decide(room, waitpoint.token, index, world.acme.company_id)
    # A redelivery of the run's own wake (its claim refused) never takes a parked row: it read before.
    await expect_error(HELD, room.RecordRun(as_attempt("a redelivery of the message")))
    await expect_error(HELD, room.RecordRun(as_attempt(continuation_attempt(str(uuid.uuid4()), "x"))))
    assert (await room.RecordRun(as_attempt(one))).run.attempt == one
    await expect_error(HELD, room.RecordRun(as_attempt(two)))


async def test_a_wake_delivered_with_no_run_gets_a_not_started_row_which_one_run_takes_over(
    room: Stub, world: World, database_url: str
) -> None:
    agent = world.acme_agent.agent_id
    stuck, recorded, fresh, delivered = [
        (await post(room, world, f"@planner {n}", [agent])).wakes[0] for n in ("stuck", "recorded", "fresh", "done")
    ]
    leased = {w.wake_id for w in (await lease(room, "gw")).wakes}
    assert leased == {stuck.wake_id, recorded.wake_id, fresh.wake_id, delivered.wake_id}
    for wake in (stuck, recorded, fresh):  # each delivery failed: due again later
        await settle(room, wake.wake_id, "gw", RETRY, retry_after_ms=60_000, last_error="UNAVAILABLE: runtime gone")
    await settle(room, delivered.wake_id, "gw", room_pb2.WAKE_SETTLEMENT_DELIVERED)
    a_row = a_run(world, run_id_for(agent, recorded.wake_id), wake_id=recorded.wake_id, attempt="a run")
    await room.ReadRunContext(context_request(world, run=a_row))
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "UPDATE wake_outbox SET created_at = now() - interval '2 minutes' WHERE wake_id = ANY($1::uuid[])",
            [stuck.wake_id, recorded.wake_id, delivered.wake_id],
        )
    finally:
        await conn.close()

    got = await not_started(room, older_than=60)
    assert (got.recorded, got.checked) == (1, 2)  # stuck gets its row; recorded has one; fresh is too young
    assert (await not_started(room, older_than=60)).checked == 0  # each wake is looked at once
    run_id = run_id_for(agent, stuck.wake_id)
    row = await get_run(room, run_id)
    assert (row.status, row.attempt, row.wake_id) == (common_pb2.RUN_STATUS_NOT_STARTED, "", stuck.wake_id)
    assert row.company_id == world.acme.company_id
    assert row.error.startswith("not started: the wake was delivered once and no run has read the room")
    assert "UNAVAILABLE: runtime gone" in row.error
    assert (await get_run(room, a_row.run_id)).attempt == "a run"  # an existing row is left alone
    assert await run_events(room, world, run_id) == [common_pb2.ROOM_EVENT_KIND_RUN_NOT_STARTED]

    # The first run to write takes the row over; any other is then refused.
    taking = a_run(world, run_id, wake_id=stuck.wake_id, step=common_pb2.RUN_STEP_CLAIMED, attempt="redelivery")
    await room.ReadRunContext(context_request(world, run=taking))
    late = a_run(world, run_id, wake_id=stuck.wake_id, step=common_pb2.RUN_STEP_CLAIMED, attempt="stalled")
    await expect_error(HELD, room.ReadRunContext(context_request(world, run=late)))
    row = await get_run(room, run_id)
    assert (row.status, row.attempt, row.error) == (common_pb2.RUN_STATUS_RUNNING, "redelivery", "")
    assert await run_events(room, world, run_id) == [
        common_pb2.ROOM_EVENT_KIND_RUN_NOT_STARTED,
        common_pb2.ROOM_EVENT_KIND_RUN_STARTED,
    ]


async def test_not_started_is_recorded_by_housekeeping_only(room: Stub, world: World) -> None:
    run = a_run(world, "run-x", status=common_pb2.RUN_STATUS_NOT_STARTED)
    await expect_error(grpc.StatusCode.INVALID_ARGUMENT, room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=run)))
    for request, field in (
        (room_pb2.RoomServiceRecordNotStartedRunsRequest(older_than_seconds=0), "older_than_seconds"),
        (room_pb2.RoomServiceRecordNotStartedRunsRequest(older_than_seconds=60, limit=5000), "limit"),
    ):
        await expect_error(grpc.StatusCode.INVALID_ARGUMENT, room.RecordNotStartedRuns(request), field)
