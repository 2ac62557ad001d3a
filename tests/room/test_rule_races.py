"""Rule races and edges over a real Room and PostgreSQL: a task is never created for an agent whose
company's MEMBER_LEFT event came first (the assignee's membership is locked as a mention's is), and
a repeat of a write (a dedupe key the room holds) is answered only after the rules pass."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import grpc

from quayutec.v1 import common_pb2, room_pb2
from tests.room.conftest import Stub, World, expect_error, make_company, person
from tests.room.test_tasks import create

TASKS = 240


async def test_no_task_for_an_agent_is_created_after_its_company_left(
    room: Stub, world: World, pool: asyncpg.Pool
) -> None:
    """240 tasks to Bolt's agent, 16 at a time, race Bolt's departure (sent after the first 80): each is
    created before Bolt's MEMBER_LEFT event (in the room's commit order) or refused; none after. (Before
    the assignee's membership was locked, 2-4 of about 200 were created after it.)"""
    started = asyncio.Event()
    outcomes: list[str] = []
    in_flight = asyncio.Semaphore(16)  # a steady stream of tasks, so the departure lands amid them

    async def send(n: int) -> None:
        async with in_flight:
            try:
                await create(room, world, title=f"task {n}")
                outcomes.append("created")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND, exc.details()
                outcomes.append("refused")
            if len(outcomes) == TASKS // 3:
                started.set()

    async def leave() -> None:
        await started.wait()
        await room.LeaveRoom(
            room_pb2.RoomServiceLeaveRoomRequest(room_id=world.room_id, company_id=world.bolt.company_id)
        )

    async with asyncio.timeout(120):
        await asyncio.gather(leave(), *(send(n) for n in range(TASKS)))
        # The departure has committed: ten more are refused.
        await asyncio.gather(*(send(TASKS + n) for n in range(10)))
    assert len(outcomes) == TASKS + 10 and outcomes[-10:] == ["refused"] * 10
    rows = await pool.fetch(
        "SELECT seq, kind FROM room_events WHERE room_id = $1 AND kind IN ('task_created', 'member_left') ORDER BY seq",
        world.room_id,
    )
    kinds = [r["kind"] for r in rows]
    assert kinds.count("member_left") == 1, kinds[:5]
    left_at = kinds.index("member_left")
    assert kinds[left_at + 1 :] == [], f"{len(kinds) - left_at - 1} tasks created after MEMBER_LEFT"
    # Every created task has its event, before the departure's.
    assert outcomes.count("created") == left_at >= TASKS // 3
    stored = await pool.fetchval("SELECT count(*) FROM tasks WHERE room_id = $1", world.room_id)
    assert stored == left_at


async def test_a_repeat_is_answered_only_after_the_rules_pass(room: Stub, world: World) -> None:
    """A dedupe key Acme used: Bolt repeating it is refused (not handed Acme's task or memory); a company
    that is not a member repeating it is refused as a non-member; Acme's own repeat is answered."""
    task = (await create(room, world, title="acme's plan", dedupe_key="plan-1")).task
    again = await create(room, world, title="acme's plan", dedupe_key="plan-1")
    assert again.task.task_id == task.task_id and again.deduplicated
    bolt = person(world.bolt.company_id, "bo")
    refused = await expect_error(
        grpc.StatusCode.ALREADY_EXISTS, create(room, world, dedupe_key="plan-1", **{"from": bolt})
    )
    assert "acme's plan" not in refused and task.task_id not in refused
    crow = person(world.crow.company_id, "cy")
    await expect_error(grpc.StatusCode.PERMISSION_DENIED, create(room, world, dedupe_key="plan-1", **{"from": crow}))

    def remember(author: common_pb2.Author) -> Any:
        return room.WriteMemory(
            room_pb2.RoomServiceWriteMemoryRequest(
                room_id=world.room_id,
                author=author,
                text="acme's secret plan",
                visibility=common_pb2.MEMORY_VISIBILITY_ROOM,
                dedupe_key="mem-1",
            )
        )

    await remember(person(world.acme.company_id))
    refused = await expect_error(grpc.StatusCode.ALREADY_EXISTS, remember(bolt))
    assert "secret" not in refused

    def post(author: common_pb2.Author) -> Any:
        return room.PostMessage(
            room_pb2.RoomServicePostMessageRequest(
                room_id=world.room_id, author=author, body="acme's words", dedupe_key="msg-1"
            )
        )

    await post(person(world.acme.company_id))
    await expect_error(grpc.StatusCode.ALREADY_EXISTS, post(bolt))
    # A company that left cannot get its own earlier write answered either: the member rule comes first.
    outsider = await make_company(room, "Dove")
    await expect_error(grpc.StatusCode.PERMISSION_DENIED, post(person(outsider.company_id)))


async def test_concurrent_updates_of_one_task_each_land_once_in_order(room: Stub, world: World) -> None:
    """16 updates of one task at once: each is written once, and each one's event carries the task with
    every update before it and itself last (an update whose statement waited for another's lock is sent
    again with the task locked first, so none misses the updates committed while it waited)."""
    task = (await create(room, world)).task
    events = room_pb2.RoomServiceReadRoomEventsRequest(room_id=world.room_id, limit=1000)
    start = (await room.ReadRoomEvents(events)).last_cursor
    notes = [f"note {n}" for n in range(16)]

    async def note(text: str) -> Any:
        request = room_pb2.RoomServiceUpdateTaskRequest(task_id=task.task_id, author=person(world.bolt.company_id))
        request.note, request.dedupe_key = text, text
        return await room.UpdateTask(request)

    answers = await asyncio.gather(*(note(n) for n in notes))
    final = (await room.GetTask(room_pb2.RoomServiceGetTaskRequest(task_id=task.task_id))).task
    assert sorted(u.note for u in final.updates) == sorted(notes)
    events.after = start
    got = [e.event.task for e in (await room.ReadRoomEvents(events)).entries]
    assert [list(t.updates) for t in got] == [list(final.updates[: n + 1]) for n in range(len(notes))]
    for answer in answers:  # each answer is its event's task
        assert answer.task == got[[u.update_id for u in final.updates].index(answer.update.update_id)]
