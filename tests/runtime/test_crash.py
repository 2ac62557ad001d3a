"""Crash tests: Runtime as a separate process, killed with SIGKILL at each step boundary.

After the kill the same wake is delivered again, many times and concurrently, to a fresh
Runtime: it is never acted on twice, the ledger shows the partial run, and the next message to
the agent starts a fresh run that sees what the dead one posted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import grpc
import pytest

from quayutec.ledger import run_id_for
from quayutec.v1 import common_pb2, runtime_pb2
from services.runtime.standin import StandinProvider
from tests.harness.claims import running_claims
from tests.harness.ledger_check import ledger_disagreements
from tests.harness.room import running_room
from tests.harness.runtime import RuntimeProcess, running_runtime
from tests.runtime.world import World, make_world, runtime_stub, start_request

REPLY = "First run: plan drafted."


@dataclass(frozen=True)
class Case:
    kill_at: str  # a failpoint, or "model_call" (killed while the provider is answering)
    step: int  # the ledger's last step when killed
    replies: int  # replies in the room after the kill
    memory: int  # memory lines after the kill
    tasks: int  # tasks for agent B after the kill


CASES = [
    Case("claimed", common_pb2.RUN_STEP_CLAIMED, 0, 0, 0),
    Case("model_call", common_pb2.RUN_STEP_CLAIMED, 0, 0, 0),
    Case("reply_posted", common_pb2.RUN_STEP_REPLY_POSTED, 1, 0, 0),
    Case("action_written", common_pb2.RUN_STEP_REPLY_POSTED, 1, 1, 0),
]


@pytest.fixture
async def backends(database_url: str) -> AsyncIterator[tuple[str, str]]:
    async with running_claims(database_url) as claims_addr, running_room(database_url) as room_addr:
        yield claims_addr, room_addr


async def counts(w: World) -> tuple[int, int, int]:
    return (
        len(await w.messages_by(w.agent_a.agent_id)),
        len(await w.memory(w.company_a)),
        len(await w.tasks_for(w.agent_b.agent_id)),
    )


@pytest.mark.parametrize("case", CASES, ids=[c.kill_at for c in CASES])
async def test_killed_run_is_never_redone(
    case: Case, backends: tuple[str, str], standin: StandinProvider, database_url: str
) -> None:
    claims_addr, room_addr = backends
    channels: list[grpc.aio.Channel] = []
    w = await make_world(room_addr, claims_addr, channels)
    standin.enqueue_reply(
        REPLY,
        [
            {"name": "remember", "arguments": {"text": "launch on Friday", "private": False}},
            {"name": "create_task", "arguments": {"to_agent_id": w.agent_b.agent_id, "title": "Copy", "body": "x"}},
        ],
        model=w.model_a,
        delay_seconds=60.0 if case.kill_at == "model_call" else 0.0,
    )
    failpoint = "" if case.kill_at == "model_call" else case.kill_at
    proc = RuntimeProcess(claims_addr, room_addr, standin.base_url, failpoints=failpoint)
    try:
        await proc.wait_ready()
        wake = (await w.post("@planner plan the launch", [w.agent_a.agent_id])).wakes[0]
        started = await runtime_stub(proc.addr, channels).StartRun(start_request(wake))
        assert started.result == runtime_pb2.START_RUN_RESULT_ACCEPTED
        if case.kill_at == "model_call":
            await wait_until(lambda: len(standin.requests(w.model_a)) == 1)
        else:
            await proc.wait_for_line(f"failpoint {case.kill_at} reached")
    finally:
        proc.kill()

    run_id = run_id_for(wake.agent_id, wake.wake_id)
    dead = await w.run(run_id)
    assert dead.status == common_pb2.RUN_STATUS_RUNNING
    assert dead.step == case.step
    assert await counts(w) == (case.replies, case.memory, case.tasks)
    if case.kill_at == "action_written":
        outcomes = [a.outcome for a in dead.actions]
        assert outcomes == [common_pb2.ACTION_OUTCOME_DONE, common_pb2.ACTION_OUTCOME_PENDING]
    assert await disagreements(database_url) == []

    async with running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as fresh_addr:
        fresh = runtime_stub(fresh_addr, channels)
        again = await asyncio.gather(*(fresh.StartRun(start_request(wake)) for _ in range(24)))
        assert {r.result for r in again} == {runtime_pb2.START_RUN_RESULT_ALREADY_CLAIMED}
        assert await counts(w) == (case.replies, case.memory, case.tasks)
        assert (await w.run(run_id)).step == case.step

        standin.reset()  # a run killed before its model call leaves its scripted reply queued
        standin.enqueue_reply("Second run: picking up.", model=w.model_a)
        nxt = (await w.post("@planner where are we?", [w.agent_a.agent_id])).wakes[0]
        assert (await fresh.StartRun(start_request(nxt))).result == runtime_pb2.START_RUN_RESULT_ACCEPTED
        second = await w.wait_for_run(run_id_for(nxt.agent_id, nxt.wake_id))
        assert second.status == common_pb2.RUN_STATUS_SUCCEEDED, second.error
        prompt = str(standin.requests(w.model_a)[-1].body)
        assert ("First run: plan drafted." in prompt) == (case.replies == 1)
        assert ("launch on Friday" in prompt) == (case.memory == 1)

    replies, memory, tasks = await counts(w)
    assert (replies, memory, tasks) == (case.replies + 1, case.memory, case.tasks)
    assert await disagreements(database_url) == []
    for channel in channels:
        await channel.close()


async def disagreements(database_url: str) -> list[str]:
    """Every ledger row against the room's rows of its run (tests/harness/ledger_check.py)."""
    db = await asyncpg.connect(database_url)
    try:
        return await ledger_disagreements(db)
    finally:
        await db.close()


async def wait_until(predicate: object, limit: float = 30.0) -> None:
    assert callable(predicate)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)
