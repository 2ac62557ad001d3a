"""A Runtime whose call committed but whose answer was lost sends the very same request again:
Room answers with what the first call wrote, even when that call ended the run's ledger row."""

from __future__ import annotations

from quayutec.v1 import common_pb2, room_pb2
from tests.room.conftest import Stub, World, agent_author, post
from tests.room.test_run_context import a_run, get_run

DONE = common_pb2.ACTION_OUTCOME_DONE


def ended(world: World, run_id: str) -> common_pb2.Run:
    """The succeeded row a run's last write carries (as Runtime's ``Ledger.next_row(final=True)``)."""
    run = a_run(world, run_id, status=common_pb2.RUN_STATUS_SUCCEEDED, step=common_pb2.RUN_STEP_ENDED)
    del run.actions[1:]
    run.ended_at.GetCurrentTime()
    return run


async def test_a_repeated_final_reply_returns_the_first_message(room: Stub, world: World) -> None:
    me = agent_author(world.acme_agent)
    row = ended(world, "run-reply")
    row.actions[0].outcome = common_pb2.ACTION_OUTCOME_DENIED
    first = await post(room, world, "the reply", author=me, dedupe_key="run:run-reply:reply", run=row)
    again = await post(room, world, "the reply", author=me, dedupe_key="run:run-reply:reply", run=row)
    assert again.deduplicated and again.message.message_id == first.message.message_id
    stored = await get_run(room, "run-reply")
    assert (stored.status, stored.posted_message_id) == (common_pb2.RUN_STATUS_SUCCEEDED, first.message.message_id)
    listed = await room.ListMessages(room_pb2.RoomServiceListMessagesRequest(room_id=world.room_id))
    assert [m.body for m in listed.messages] == ["the reply"]


async def test_a_repeated_final_write_returns_the_first_line(room: Stub, world: World) -> None:
    request = room_pb2.RoomServiceWriteMemoryRequest(
        room_id=world.room_id,
        author=agent_author(world.acme_agent),
        text="once",
        visibility=common_pb2.MEMORY_VISIBILITY_ROOM,
        run_id="run-mem",
        dedupe_key="run:run-mem:action:0",
        run=ended(world, "run-mem"),
        run_action_index=0,
    )
    first = await room.WriteMemory(request)
    again = await room.WriteMemory(request)
    assert again.deduplicated and again.line.memory_id == first.line.memory_id
    stored = await get_run(room, "run-mem")
    assert stored.status == common_pb2.RUN_STATUS_SUCCEEDED
    assert [(a.outcome, a.result_id) for a in stored.actions] == [(DONE, first.line.memory_id)]
    lines = await room.ListMemory(
        room_pb2.RoomServiceListMemoryRequest(room_id=world.room_id, reader_company_id=world.acme.company_id)
    )
    assert [line.text for line in lines.lines] == ["once"]


async def test_a_repeated_end_of_a_run_is_answered_with_the_ended_row(room: Stub, world: World) -> None:
    row = ended(world, "run-end")
    row.actions[0].outcome = common_pb2.ACTION_OUTCOME_NOT_DONE
    first = (await room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=row))).run
    again = (await room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=row))).run
    assert again == first
    assert again.status == common_pb2.RUN_STATUS_SUCCEEDED
