"""CreateTask (with its wake), UpdateTask, GetTask and ListTasks."""

from __future__ import annotations

import uuid
from typing import Any

import grpc

from quayutec.v1 import common_pb2, room_pb2
from tests.room.conftest import Stub, World, agent_author, expect_error, person

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
MISSING = str(uuid.uuid4())


async def create(room: Stub, world: World, **fields: Any) -> room_pb2.RoomServiceCreateTaskResponse:
    base: dict[str, Any] = {
        "room_id": world.room_id,
        "from": person(world.acme.company_id),
        "to_agent_id": world.bolt_agent.agent_id,
        "title": "write the copy",
    }
    response: room_pb2.RoomServiceCreateTaskResponse = await room.CreateTask(
        room_pb2.RoomServiceCreateTaskRequest(**{**base, **fields})
    )
    return response


async def update(room: Stub, task_id: str, world: World, **fields: Any) -> room_pb2.RoomServiceUpdateTaskResponse:
    base: dict[str, Any] = {"task_id": task_id, "author": agent_author(world.bolt_agent)}
    response: room_pb2.RoomServiceUpdateTaskResponse = await room.UpdateTask(
        room_pb2.RoomServiceUpdateTaskRequest(**{**base, **fields})
    )
    return response


async def test_create_task_records_the_assignees_wake(room: Stub, world: World) -> None:
    created = await create(room, world, body="by Friday", run_id="run-9")
    task = created.task
    assert task.status == common_pb2.TASK_STATUS_OPEN and task.title == "write the copy" and task.body == "by Friday"
    assert getattr(task, "from").company_id == world.acme.company_id and task.run_id == "run-9"
    assert [(w.agent_id, w.kind, w.source_id) for w in created.wakes] == [
        (world.bolt_agent.agent_id, common_pb2.WAKE_KIND_TASK, task.task_id)
    ]
    got = await room.GetTask(room_pb2.RoomServiceGetTaskRequest(task_id=task.task_id, room_id=world.room_id))
    assert got.task == task


async def test_a_task_to_oneself_records_no_wake(room: Stub, world: World) -> None:
    created = await create(room, world, **{"from": agent_author(world.bolt_agent)})
    assert list(created.wakes) == []


async def test_task_dedupe_key(room: Stub, world: World) -> None:
    first = await create(room, world, dedupe_key="run:r1:task:0")
    again = await create(room, world, dedupe_key="run:r1:task:0", title="something else")
    assert again.deduplicated and again.task == first.task and list(again.wakes) == list(first.wakes)
    listed = await room.ListTasks(room_pb2.RoomServiceListTasksRequest(room_id=world.room_id))
    assert len(listed.tasks) == 1
    assert (await room.CountPendingWakes(room_pb2.RoomServiceCountPendingWakesRequest())).pending == 1


async def test_create_task_errors(room: Stub, world: World) -> None:
    await expect_error(INVALID, create(room, world, title=""), "title")
    await expect_error(INVALID, create(room, world, title="t" * 501), "title")
    await expect_error(INVALID, create(room, world, body="b" * (64 * 1024 + 1)), "body")
    await expect_error(INVALID, create(room, world, to_agent_id=""), "to_agent_id")
    await expect_error(NOT_FOUND, create(room, world, room_id=MISSING), "room")
    await expect_error(NOT_FOUND, create(room, world, to_agent_id=MISSING), "agent")
    await expect_error(NOT_FOUND, create(room, world, to_agent_id=world.crow_agent.agent_id), "not a member")
    await expect_error(
        grpc.StatusCode.PERMISSION_DENIED, create(room, world, **{"from": person(world.crow.company_id)}), "member"
    )


async def test_update_closes_once_and_stays_closed(room: Stub, world: World) -> None:
    task_id = (await create(room, world)).task.task_id
    noted = await update(room, task_id, world, note="drafting")
    assert noted.task.status == common_pb2.TASK_STATUS_OPEN and noted.update.note == "drafting"
    assert noted.update.status == common_pb2.TASK_STATUS_OPEN
    done = await update(room, task_id, world, note="done", status=common_pb2.TASK_STATUS_DONE, run_id="run-2")
    assert done.task.status == common_pb2.TASK_STATUS_DONE and done.update.run_id == "run-2"
    assert [u.note for u in done.task.updates] == ["drafting", "done"]
    await expect_error(grpc.StatusCode.FAILED_PRECONDITION, update(room, task_id, world, note="more"), "already done")
    await expect_error(
        grpc.StatusCode.FAILED_PRECONDITION,
        update(room, task_id, world, status=common_pb2.TASK_STATUS_CANCELLED),
    )
    got = await room.GetTask(room_pb2.RoomServiceGetTaskRequest(task_id=task_id))
    assert got.task.status == common_pb2.TASK_STATUS_DONE and len(got.task.updates) == 2


async def test_update_dedupe_key_returns_the_earlier_update_even_after_closing(room: Stub, world: World) -> None:
    task_id = (await create(room, world)).task.task_id
    first = await update(room, task_id, world, note="closing", status=common_pb2.TASK_STATUS_DONE, dedupe_key="u1")
    again = await update(room, task_id, world, note="closing", status=common_pb2.TASK_STATUS_DONE, dedupe_key="u1")
    assert again.deduplicated and again.update == first.update and len(again.task.updates) == 1


async def test_update_errors(room: Stub, world: World) -> None:
    task_id = (await create(room, world)).task.task_id
    await expect_error(INVALID, update(room, task_id, world), "note")
    await expect_error(INVALID, update(room, "bad", world, note="n"), "task_id")
    await expect_error(NOT_FOUND, update(room, MISSING, world, note="n"))
    other_room = (
        await room.CreateRoom(room_pb2.RoomServiceCreateRoomRequest(company_id=world.acme.company_id, name="other"))
    ).room.room_id
    await expect_error(NOT_FOUND, update(room, task_id, world, note="n", room_id=other_room))
    await expect_error(NOT_FOUND, room.GetTask(room_pb2.RoomServiceGetTaskRequest(task_id=task_id, room_id=other_room)))
    await expect_error(NOT_FOUND, room.GetTask(room_pb2.RoomServiceGetTaskRequest(task_id=MISSING)))


async def test_list_tasks_filters_and_pages(room: Stub, world: World) -> None:
    for_bolt = [(await create(room, world, title=f"b{i}")).task.task_id for i in range(3)]
    for_acme = (await create(room, world, title="a", to_agent_id=world.acme_agent.agent_id)).task.task_id
    await update(room, for_bolt[1], world, status=common_pb2.TASK_STATUS_CANCELLED, note="no longer needed")

    async def ids(**fields: Any) -> list[str]:
        got = await room.ListTasks(room_pb2.RoomServiceListTasksRequest(room_id=world.room_id, **fields))
        return [t.task_id for t in got.tasks]

    assert await ids() == [*for_bolt, for_acme]
    assert await ids(to_agent_id=world.bolt_agent.agent_id) == for_bolt
    assert await ids(to_agent_id=world.bolt_agent.agent_id, status=common_pb2.TASK_STATUS_OPEN) == [
        for_bolt[0],
        for_bolt[2],
    ]
    assert await ids(status=common_pb2.TASK_STATUS_CANCELLED) == [for_bolt[1]]
    first = await room.ListTasks(room_pb2.RoomServiceListTasksRequest(room_id=world.room_id, page_size=3))
    rest = await room.ListTasks(
        room_pb2.RoomServiceListTasksRequest(room_id=world.room_id, page_size=3, page_token=first.next_page_token)
    )
    assert [t.task_id for t in (*first.tasks, *rest.tasks)] == [*for_bolt, for_acme] and not rest.next_page_token
    cancelled = next(t for t in first.tasks if t.task_id == for_bolt[1])
    assert [u.note for u in cancelled.updates] == ["no longer needed"]
    await expect_error(NOT_FOUND, room.ListTasks(room_pb2.RoomServiceListTasksRequest(room_id=MISSING)))
    bad_status: Any = 9
    await expect_error(
        INVALID, room.ListTasks(room_pb2.RoomServiceListTasksRequest(room_id=world.room_id, status=bad_status))
    )
