"""ReadRunContext (a run's view of its room in one call) and ledger rows recorded with each write."""

from __future__ import annotations

import uuid
from typing import Any

import grpc

from quayutec.v1 import common_pb2, room_pb2, room_pb2_grpc
from tests.harness.channels import service_channel
from tests.harness.room import running_room
from tests.room.conftest import Stub, World, agent_author, expect_error, make_agent, person, post

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
FAILED = grpc.StatusCode.FAILED_PRECONDITION
MISSING = str(uuid.uuid4())
AUTO, HOLD, DENY = common_pb2.ACTION_RIGHT_AUTO, common_pb2.ACTION_RIGHT_HOLD, common_pb2.ACTION_RIGHT_DENY
GUIDE = (
    "Launch window\n\nThe rocket launch window opens at dawn on the fourth.\n\n"
    "Catering\n\nLunch is served at noon in the hangar."
)


def context_request(world: World, **fields: Any) -> room_pb2.RoomServiceReadRunContextRequest:
    fields.setdefault("agent_id", world.acme_agent.agent_id)
    fields.setdefault("room_id", world.room_id)
    return room_pb2.RoomServiceReadRunContextRequest(**fields)


async def read_context(room: Stub, world: World, **fields: Any) -> room_pb2.RoomServiceReadRunContextResponse:
    response: room_pb2.RoomServiceReadRunContextResponse = await room.ReadRunContext(context_request(world, **fields))
    return response


def a_run(world: World, run_id: str = "run-1", agent: common_pb2.Agent | None = None, **fields: Any) -> common_pb2.Run:
    """A running ledger row of ``agent`` (Acme's by default) declaring a remember, a create_task and an update."""
    agent = agent or world.acme_agent
    base: dict[str, Any] = {
        "run_id": run_id,
        "agent_id": agent.agent_id,
        "room_id": world.room_id,
        "wake_kind": common_pb2.WAKE_KIND_MESSAGE,
        "status": common_pb2.RUN_STATUS_RUNNING,
        "step": common_pb2.RUN_STEP_MODEL_CALLED,
    }
    run = common_pb2.Run(**{**base, **fields})
    for index, kind in enumerate(
        (common_pb2.ACTION_KIND_REMEMBER, common_pb2.ACTION_KIND_CREATE_TASK, common_pb2.ACTION_KIND_UPDATE_TASK)
    ):
        run.actions.add(index=index, kind=kind, arguments_json="{}", outcome=common_pb2.ACTION_OUTCOME_PENDING)
    return run


async def get_run(room: Stub, run_id: str) -> common_pb2.Run:
    run: common_pb2.Run = (await room.GetRun(room_pb2.RoomServiceGetRunRequest(run_id=run_id))).run
    return run


def outcomes(run: common_pb2.Run) -> list[tuple[int, Any, str]]:
    return [(a.index, a.outcome, a.result_id) for a in run.actions]


async def set_rights(room: Stub, **fields: Any) -> None:
    await room.SetAgentRights(room_pb2.RoomServiceSetAgentRightsRequest(rights=common_pb2.AgentRights(**fields)))


async def remember(room: Stub, world: World, text: str, author: common_pb2.Author, private: bool = False) -> Any:
    visibility = common_pb2.MEMORY_VISIBILITY_COMPANY if private else common_pb2.MEMORY_VISIBILITY_ROOM
    request = room_pb2.RoomServiceWriteMemoryRequest(
        room_id=world.room_id, author=author, text=text, visibility=visibility
    )
    return await room.WriteMemory(request)


async def create_task(room: Stub, world: World, **fields: Any) -> room_pb2.RoomServiceCreateTaskResponse:
    base: dict[str, Any] = {
        "room_id": world.room_id,
        "from": person(world.bolt.company_id, "bo"),
        "to_agent_id": world.acme_agent.agent_id,
        "title": "check the launch window",
    }
    response: room_pb2.RoomServiceCreateTaskResponse = await room.CreateTask(
        room_pb2.RoomServiceCreateTaskRequest(**{**base, **fields})
    )
    return response


async def upload_guide(room: Stub, world: World) -> None:
    await room.UploadFile(
        room_pb2.RoomServiceUploadFileRequest(
            room_id=world.room_id,
            author=person(world.acme.company_id),
            name="guide.md",
            content_type="text/markdown",
            content=GUIDE.encode(),
        )
    )


async def test_a_message_wake_reads_the_whole_view(room: Stub, world: World) -> None:
    await upload_guide(room, world)
    acme, bolt = world.acme.company_id, world.bolt.company_id
    await remember(room, world, "launch date is May 4", person(acme))
    await remember(room, world, "our floor price is 90", person(acme), private=True)
    await remember(room, world, "bolt budget is 120", person(bolt), private=True)
    await set_rights(room, company_id=acme, remember=HOLD, create_task=HOLD)
    await set_rights(room, company_id=acme, agent_id=world.acme_agent.agent_id, create_task=DENY)
    await set_rights(room, company_id=bolt, agent_id=world.bolt_agent.agent_id, update_task=DENY)
    bodies = [f"note {i}" for i in range(24)]
    for body in bodies:
        await post(room, world, body)
    wake = await post(room, world, "when does the launch window open?", [world.acme_agent.agent_id])
    second_acme = await make_agent(room, acme, "second")

    got = await read_context(
        room,
        world,
        wake_kind=common_pb2.WAKE_KIND_MESSAGE,
        wake_source_id=wake.message.message_id,
        recent_messages=5,
    )
    assert got.agent == world.acme_agent and got.provider_key == "sk-acme-secret"
    assert got.wake_text == "when does the launch window open?"
    assert got.passages and got.passages[0].file_name == "guide.md" and "dawn" in got.passages[0].text
    assert [m.body for m in got.messages] == [*bodies[-4:], wake.message.body]  # the newest 5, oldest first
    assert [m.text for m in got.memory] == ["our floor price is 90", "launch date is May 4"]  # not Bolt's line
    assert [a.agent_id for a in got.room_agents] == [
        world.acme_agent.agent_id,
        second_acme.agent_id,
        world.bolt_agent.agent_id,
    ]  # Crow's agent is not in the room
    assert b"sk-bolt-secret" not in got.SerializeToString()  # only the waking agent's own key
    rights = got.rights
    assert (rights.company_id, rights.agent_id) == (acme, world.acme_agent.agent_id)
    assert (rights.remember, rights.create_task, rights.update_task, rights.close_task) == (HOLD, DENY, AUTO, AUTO)
    assert rights.cross_company_task == AUTO
    assert not got.open_tasks

    default = await read_context(room, world, wake_kind=common_pb2.WAKE_KIND_MESSAGE)
    assert len(default.messages) == 20 and default.messages[-1].message_id == wake.message.message_id
    assert default.wake_text == "" and not default.passages  # no source: nothing to search for
    one = await read_context(
        room, world, wake_kind=common_pb2.WAKE_KIND_MESSAGE, wake_source_id=wake.message.message_id, max_passages=1
    )
    assert len(one.passages) == 1


async def test_a_task_wake_reads_the_task_text_and_open_tasks(room: Stub, world: World) -> None:
    await upload_guide(room, world)
    task = (await create_task(room, world, body="is it still at dawn?")).task
    await room.UpdateTask(
        room_pb2.RoomServiceUpdateTaskRequest(
            task_id=task.task_id, author=person(world.bolt.company_id, "bo"), note="any news?"
        )
    )
    closed = (await create_task(room, world, title="old one")).task
    await room.UpdateTask(
        room_pb2.RoomServiceUpdateTaskRequest(
            task_id=closed.task_id, author=agent_author(world.acme_agent), status=common_pb2.TASK_STATUS_DONE
        )
    )
    await create_task(room, world, title="not for acme", to_agent_id=world.bolt_agent.agent_id)

    got = await read_context(room, world, wake_kind=common_pb2.WAKE_KIND_TASK, wake_source_id=task.task_id)
    assert got.wake_text == "check the launch window\nis it still at dawn?"
    assert got.passages and "dawn" in got.passages[0].text
    assert [t.task_id for t in got.open_tasks] == [task.task_id]
    assert [u.note for u in got.open_tasks[0].updates] == ["any news?"]
    listed = await room.ListTasks(
        room_pb2.RoomServiceListTasksRequest(
            room_id=world.room_id, to_agent_id=world.acme_agent.agent_id, status=common_pb2.TASK_STATUS_OPEN
        )
    )
    assert list(got.open_tasks) == list(listed.tasks)
    # All rights unset: everything resolves to the built-in AUTO.
    assert [getattr(got.rights, f) for f in ("remember", "create_task", "close_task")] == [AUTO, AUTO, AUTO]

    decision = await read_context(room, world, wake_kind=common_pb2.WAKE_KIND_DECISION, wake_source_id=MISSING)
    assert decision.wake_text == "" and not decision.passages and decision.open_tasks
    unknown = await read_context(room, world, wake_kind=common_pb2.WAKE_KIND_MESSAGE, wake_source_id=MISSING)
    assert unknown.wake_text == "" and not unknown.passages
    # A task id is not a message id, and a task of another room is not found.
    crossed = await read_context(room, world, wake_kind=common_pb2.WAKE_KIND_MESSAGE, wake_source_id=task.task_id)
    assert crossed.wake_text == ""


async def test_read_run_context_not_found_and_invalid(room: Stub, world: World) -> None:
    await expect_error(NOT_FOUND, room.ReadRunContext(context_request(world, agent_id=MISSING)), "agent")
    await expect_error(NOT_FOUND, room.ReadRunContext(context_request(world, room_id=MISSING)), "room")
    outsider = context_request(world, agent_id=world.crow_agent.agent_id)
    await expect_error(NOT_FOUND, room.ReadRunContext(outsider), "not a member")
    await expect_error(INVALID, room.ReadRunContext(context_request(world, agent_id="nope")), "agent_id")
    await expect_error(INVALID, room.ReadRunContext(context_request(world, room_id="")), "room_id")
    bad_source = context_request(world, wake_kind=common_pb2.WAKE_KIND_MESSAGE, wake_source_id="x")
    await expect_error(INVALID, room.ReadRunContext(bad_source), "wake_source_id")
    await expect_error(INVALID, room.ReadRunContext(context_request(world, recent_messages=201)), "recent_messages")
    await expect_error(INVALID, room.ReadRunContext(context_request(world, max_passages=51)), "max_passages")
    await expect_error(INVALID, room.ReadRunContext(context_request(world, wake_kind=99)), "wake_kind")


async def test_a_run_outside_the_room_reads_nothing_and_leaves_no_ledger_row(room: Stub, world: World) -> None:
    # The fence and the read are one statement: the row is written only when the agent's company is a
    # member (as the read requires), so a refused read leaves nothing behind.
    crow = world.crow_agent.agent_id
    outsider = context_request(world, agent_id=crow, run=a_run(world, "run-outsider", agent=world.crow_agent))
    await expect_error(NOT_FOUND, room.ReadRunContext(outsider), "not a member")
    await expect_error(NOT_FOUND, room.GetRun(room_pb2.RoomServiceGetRunRequest(run_id="run-outsider")))


async def test_read_run_context_with_an_undecryptable_key(room: Stub, world: World, database_url: str) -> None:
    other_key = "b3RoZXIta2V5LXF1YXl1dGVjLXJvb21zLTAwMDAwMDA="
    async with running_room(database_url, QUAYUTEC_ENCRYPTION_KEY=other_key) as addr:
        async with service_channel(addr, "runtime") as channel:
            other = room_pb2_grpc.RoomServiceStub(channel)
            await expect_error(FAILED, other.ReadRunContext(context_request(world)), "QUAYUTEC_ENCRYPTION_KEY")


async def test_each_write_records_its_run_with_the_id_filled_in(room: Stub, world: World) -> None:
    me = agent_author(world.acme_agent)
    run = a_run(world)
    posted = await post(room, world, "on it", author=me, run_id="run-1", run=run)
    stored = await get_run(room, "run-1")
    assert stored.posted_message_id == posted.message.message_id
    assert stored.status == common_pb2.RUN_STATUS_RUNNING and stored.company_id == world.acme.company_id

    run.posted_message_id = posted.message.message_id
    written = await room.WriteMemory(
        room_pb2.RoomServiceWriteMemoryRequest(
            room_id=world.room_id,
            author=me,
            text="dawn on the 4th",
            visibility=common_pb2.MEMORY_VISIBILITY_ROOM,
            run_id="run-1",
            run=run,
            run_action_index=0,
        )
    )
    done, pending = common_pb2.ACTION_OUTCOME_DONE, common_pb2.ACTION_OUTCOME_PENDING
    assert outcomes(await get_run(room, "run-1")) == [
        (0, done, written.line.memory_id),
        (1, pending, ""),
        (2, pending, ""),
    ]

    run.CopyFrom(await get_run(room, "run-1"))
    task = await create_task(
        room, world, **{"from": me}, to_agent_id=world.bolt_agent.agent_id, run_id="run-1", run=run, run_action_index=1
    )
    assert outcomes(await get_run(room, "run-1"))[1] == (1, done, task.task.task_id)

    run.CopyFrom(await get_run(room, "run-1"))
    updated = await room.UpdateTask(
        room_pb2.RoomServiceUpdateTaskRequest(
            task_id=task.task.task_id, author=me, note="see memory", run_id="run-1", run=run, run_action_index=2
        )
    )
    final = await get_run(room, "run-1")
    assert outcomes(final) == [
        (0, done, written.line.memory_id),
        (1, done, task.task.task_id),
        (2, done, updated.update.update_id),
    ]
    assert final.posted_message_id == posted.message.message_id


async def test_a_mismatched_run_is_refused_and_nothing_is_written(room: Stub, world: World) -> None:
    me = agent_author(world.acme_agent)
    other_room = a_run(world, room_id=MISSING)
    await expect_error(INVALID, post(room, world, "x", author=me, run=other_room), "run.room_id")
    bolts = a_run(world, agent=world.bolt_agent)
    await expect_error(INVALID, post(room, world, "x", author=me, run=bolts), "run.agent_id")
    no_such_action = room_pb2.RoomServiceWriteMemoryRequest(
        room_id=world.room_id,
        author=me,
        text="x",
        visibility=common_pb2.MEMORY_VISIBILITY_ROOM,
        run=a_run(world),
        run_action_index=7,
    )
    await expect_error(INVALID, room.WriteMemory(no_such_action), "index 7")
    task = (await create_task(room, world)).task
    bad_update = room_pb2.RoomServiceUpdateTaskRequest(task_id=task.task_id, author=me, note="n", run=other_room)
    await expect_error(INVALID, room.UpdateTask(bad_update), "run.room_id")
    messages = await room.ListMessages(room_pb2.RoomServiceListMessagesRequest(room_id=world.room_id))
    memory = await room.ListMemory(
        room_pb2.RoomServiceListMemoryRequest(room_id=world.room_id, reader_company_id=world.acme.company_id)
    )
    got = await room.GetTask(room_pb2.RoomServiceGetTaskRequest(task_id=task.task_id))
    assert not messages.messages and not memory.lines and not got.task.updates
    await expect_error(NOT_FOUND, room.GetRun(room_pb2.RoomServiceGetRunRequest(run_id="run-1")))
    # A person's write may carry a run of any agent of the room.
    await post(room, world, "by hand", run=bolts)
    assert (await get_run(room, "run-1")).agent_id == world.bolt_agent.agent_id


async def test_a_refused_ledger_row_rolls_the_write_back(room: Stub, world: World) -> None:
    me = agent_author(world.acme_agent)
    ended = a_run(world, status=common_pb2.RUN_STATUS_SUCCEEDED, step=common_pb2.RUN_STEP_ENDED)
    ended.ended_at.GetCurrentTime()
    before = (await room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=ended))).run
    # Each write would change the ended row (its id filled in): refused, and the write is not there.
    await expect_error(FAILED, post(room, world, "late reply", author=me, run=ended), "ended")
    memory = room_pb2.RoomServiceWriteMemoryRequest(
        room_id=world.room_id,
        author=me,
        text="late",
        visibility=common_pb2.MEMORY_VISIBILITY_ROOM,
        run=ended,
        run_action_index=0,
    )
    await expect_error(FAILED, room.WriteMemory(memory), "ended")
    await expect_error(
        FAILED, create_task(room, world, **{"from": me}, run=ended, run_action_index=1, dedupe_key="t1"), "ended"
    )
    task = (await create_task(room, world)).task
    closing = room_pb2.RoomServiceUpdateTaskRequest(
        task_id=task.task_id, author=me, status=common_pb2.TASK_STATUS_DONE, run=ended, run_action_index=2
    )
    await expect_error(FAILED, room.UpdateTask(closing), "ended")
    messages = await room.ListMessages(room_pb2.RoomServiceListMessagesRequest(room_id=world.room_id))
    lines = await room.ListMemory(
        room_pb2.RoomServiceListMemoryRequest(room_id=world.room_id, reader_company_id=world.acme.company_id)
    )
    tasks = await room.ListTasks(room_pb2.RoomServiceListTasksRequest(room_id=world.room_id))
    assert not messages.messages and not lines.lines
    assert [(t.task_id, t.status, len(t.updates)) for t in tasks.tasks] == [
        (task.task_id, common_pb2.TASK_STATUS_OPEN, 0)
    ]  # neither the refused task nor the closing update
    pending = await room.LeaseWakes(
        room_pb2.RoomServiceLeaseWakesRequest(lease_owner="t", max_wakes=10, lease_seconds=5)
    )
    assert [w.source_id for w in pending.wakes] == [task.task_id]  # no wake of the refused task
    assert await get_run(room, "run-1") == before


async def test_a_deduplicated_write_records_the_earlier_id(room: Stub, world: World) -> None:
    me = agent_author(world.acme_agent)
    first = await post(room, world, "reply", author=me, dedupe_key="reply-1", run=a_run(world))
    retry = await post(room, world, "reply", author=me, dedupe_key="reply-1", run=a_run(world, "run-2"))
    assert retry.deduplicated and retry.message.message_id == first.message.message_id
    assert (await get_run(room, "run-1")).posted_message_id == first.message.message_id
    assert (await get_run(room, "run-2")).posted_message_id == first.message.message_id

    request = room_pb2.RoomServiceWriteMemoryRequest(
        room_id=world.room_id,
        author=me,
        text="once",
        visibility=common_pb2.MEMORY_VISIBILITY_ROOM,
        dedupe_key="mem-1",
        run=a_run(world, "run-3"),
        run_action_index=0,
    )
    line = (await room.WriteMemory(request)).line
    again = await room.WriteMemory(request)
    assert again.deduplicated and again.line.memory_id == line.memory_id
    assert outcomes(await get_run(room, "run-3"))[0] == (0, common_pb2.ACTION_OUTCOME_DONE, line.memory_id)

    task_args: dict[str, Any] = {"from": me, "dedupe_key": "task-1", "run_action_index": 1}
    task = (await create_task(room, world, run=a_run(world, "run-4"), **task_args)).task
    repeat = await create_task(room, world, run=a_run(world, "run-5"), **task_args)
    assert repeat.deduplicated and repeat.task.task_id == task.task_id
    assert outcomes(await get_run(room, "run-5"))[1] == (1, common_pb2.ACTION_OUTCOME_DONE, task.task_id)

    update_request = room_pb2.RoomServiceUpdateTaskRequest(
        task_id=task.task_id, author=me, note="n", dedupe_key="u-1", run=a_run(world, "run-6"), run_action_index=2
    )
    update = (await room.UpdateTask(update_request)).update
    update_again = await room.UpdateTask(update_request)
    assert update_again.deduplicated and update_again.update.update_id == update.update_id
    assert outcomes(await get_run(room, "run-6"))[2] == (2, common_pb2.ACTION_OUTCOME_DONE, update.update_id)

    messages = await room.ListMessages(room_pb2.RoomServiceListMessagesRequest(room_id=world.room_id))
    lines = await room.ListMemory(
        room_pb2.RoomServiceListMemoryRequest(room_id=world.room_id, reader_company_id=world.acme.company_id)
    )
    got = await room.GetTask(room_pb2.RoomServiceGetTaskRequest(task_id=task.task_id))
    assert len(messages.messages) == 1 and len(lines.lines) == 1 and len(got.task.updates) == 1


async def test_read_run_context_records_the_run_first(room: Stub, world: World) -> None:
    run = a_run(world, "run-ctx", step=common_pb2.RUN_STEP_CLAIMED)
    await read_context(room, world, run=run)
    stored = await get_run(room, "run-ctx")
    assert (stored.status, stored.step) == (common_pb2.RUN_STATUS_RUNNING, common_pb2.RUN_STEP_CLAIMED)
    assert stored.company_id == world.acme_agent.company_id
    other = a_run(world, "run-other", agent=world.bolt_agent)
    await expect_error(INVALID, read_context(room, world, run=other), "run.agent_id")
    await expect_error(NOT_FOUND, room.GetRun(room_pb2.RoomServiceGetRunRequest(run_id="run-other")), "run")
    missing = a_run(world, "run-missing-room", room_id=MISSING)
    await expect_error(NOT_FOUND, read_context(room, world, run=missing, room_id=MISSING), "room")
    gone = room.GetRun(room_pb2.RoomServiceGetRunRequest(run_id="run-missing-room"))
    await expect_error(NOT_FOUND, gone, "run")  # rolled back with the failed read
