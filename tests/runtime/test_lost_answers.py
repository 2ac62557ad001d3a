"""A run's Room write commits and its answer is lost, every time the run asks again, until the run gives
up and ends: its ledger row must still name what the room holds (docs/durability.md, "What the ledger
keeps").

The Runtime calls the Room through a gRPC proxy of ours (tests/harness/proxy.py, AnswerLosingProxy) that
passes every call on to the real Room and loses the answers of one method after the Room gave them: the
write committed, with the run's row written in its transaction, and the Runtime sees UNAVAILABLE. Its
repeats (same dedupe key) are answered by the Room with the earlier write, and lost too; after its
retries the run ends FAILED with the error it saw, through RecordRun, which the proxy lets through.
Before the Room kept what a committed write recorded, that last row replaced the one the write's own
transaction had made: "no reply", or the action not_done, while the room held it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import grpc
import pytest

from quayutec.ledger import run_id_for
from quayutec.v1 import common_pb2, room_pb2, runtime_pb2
from services.runtime.standin import StandinProvider
from tests.harness.claims import running_claims
from tests.harness.ledger_check import ledger_disagreements
from tests.harness.proxy import AnswerLosingProxy
from tests.harness.room import running_room
from tests.harness.runtime import running_runtime
from tests.runtime.world import World, make_world, runtime_stub, start_request

ROOM_SERVICE = "/quayutec.v1.RoomService/"


@dataclass(frozen=True)
class Case:
    lost: str  # the Room method whose answers are lost
    action: int | None  # the declared action it writes (None: the reply)


# The lost write is never the run's last: the last write records the ended row itself, which no later
# write can change. Each case declares the lost kind of action first and another one after it.
CASES = [
    Case("PostMessage", None),
    Case("WriteMemory", 0),
    Case("CreateTask", 0),
    Case("UpdateTask", 0),
]


def declared(case: Case, w: World, task_id: str) -> list[dict[str, Any]]:
    remember: dict[str, Any] = {"name": "remember", "arguments": {"text": "launch on Friday", "private": False}}
    task = {"to_agent_id": w.agent_b.agent_id, "title": "Copy", "body": "x"}
    create: dict[str, Any] = {"name": "create_task", "arguments": task}
    update: dict[str, Any] = {"name": "update_task", "arguments": {"task_id": task_id, "note": "first numbers in"}}
    first = {"PostMessage": remember, "WriteMemory": remember, "CreateTask": create, "UpdateTask": update}[case.lost]
    return [first, create if first is remember else remember]


@pytest.fixture
async def backends(database_url: str) -> AsyncIterator[tuple[str, str]]:
    async with running_claims(database_url) as claims_addr, running_room(database_url) as room_addr:
        yield claims_addr, room_addr


async def held_by_room(w: World, db: asyncpg.Connection, run_id: str, case: Case) -> list[str]:
    """The ids of what the room holds of the lost write, with the run's id."""
    table, column = {
        "PostMessage": ("messages", "message_id"),
        "WriteMemory": ("memory_lines", "memory_id"),
        "CreateTask": ("tasks", "task_id"),
        "UpdateTask": ("task_updates", "update_id"),
    }[case.lost]
    rows = await db.fetch(f"SELECT {column}::text AS id FROM {table} WHERE run_id = $1", run_id)
    return [r["id"] for r in rows]


@pytest.mark.parametrize("case", CASES, ids=[c.lost for c in CASES])
async def test_a_write_whose_answer_is_lost_stays_in_the_ledger(
    case: Case, backends: tuple[str, str], standin: StandinProvider, database_url: str
) -> None:
    claims_addr, room_addr = backends
    channels: list[grpc.aio.Channel] = []
    w = await make_world(room_addr, claims_addr, channels)
    person = common_pb2.Author(kind=common_pb2.AUTHOR_KIND_PERSON, company_id=w.company_a, person="ana")
    request = room_pb2.RoomServiceCreateTaskRequest(
        room_id=w.room_id, to_agent_id=w.agent_a.agent_id, title="Budget", body="numbers"
    )
    getattr(request, "from").CopyFrom(person)
    budget = (await w.room.CreateTask(request)).task
    standin.enqueue_reply("Plan drafted.", declared(case, w, budget.task_id), model=w.model_a)
    proxy = AnswerLosingProxy(room_addr, server="room", caller="runtime")
    proxy.lose.add(ROOM_SERVICE + case.lost)
    db = await asyncpg.connect(database_url)
    try:
        await proxy.start()
        async with running_runtime(
            claims_addr, proxy.addr, standin_url=standin.base_url, room_retry_seconds=1.0
        ) as runtime_addr:
            wake = (await w.post("@planner plan the launch", [w.agent_a.agent_id])).wakes[0]
            started = await runtime_stub(runtime_addr, channels).StartRun(start_request(wake))
            assert started.result == runtime_pb2.START_RUN_RESULT_ACCEPTED
            run_id = run_id_for(wake.agent_id, wake.wake_id)
            run = await w.wait_for_run(run_id)

        # The run saw its call fail and ended with that error, once its retries were spent.
        assert proxy.lost.get(ROOM_SERVICE + case.lost, 0) >= 1
        assert run.status == common_pb2.RUN_STATUS_FAILED
        assert run.error.startswith("room call failed: UNAVAILABLE"), run.error
        # The write committed once, and the row names it.
        held = await held_by_room(w, db, run_id, case)
        assert len(held) == 1, held
        if case.action is None:
            assert run.posted_message_id == held[0]
        else:
            action = next(a for a in run.actions if a.index == case.action)
            assert (action.outcome, action.result_id) == (common_pb2.ACTION_OUTCOME_DONE, held[0])
            assert run.posted_message_id == (await w.messages_by(w.agent_a.agent_id))[0].message_id
        # The actions after the lost write were not done, and say so.
        after = [a for a in run.actions if a.index > (-1 if case.action is None else case.action)]
        assert all(a.outcome == common_pb2.ACTION_OUTCOME_NOT_DONE for a in after), after
        assert await ledger_disagreements(db, [w.room_id]) == []
    finally:
        await db.close()
        await proxy.stop()
        for channel in channels:
            await channel.close()
