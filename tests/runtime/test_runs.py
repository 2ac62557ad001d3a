"""Runs end to end on real servers: Claims, Room, Runtime and the stand-in provider."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from quayutec.egress import EgressPolicy
from quayutec.ledger import run_id_for
from quayutec.v1 import claims_pb2, common_pb2, room_pb2, runtime_pb2
from services.runtime.standin import StandinProvider
from tests.harness.claims import running_claims
from tests.harness.room import running_room
from tests.harness.runtime import running_runtime
from tests.runtime.world import FakeClock, World, held_replies, make_world, runtime_stub, start_request

LOOPBACK = "127.0.0.1/32"


@dataclass
class Stack:
    world: World
    runtime: Any
    standin: StandinProvider
    clock: FakeClock


@pytest.fixture
async def backends(database_url: str) -> AsyncIterator[tuple[str, str]]:
    # The stand-in on 127.0.0.1 is allow-listed, so an owner-supplied address may name it.
    async with (
        running_claims(database_url) as claims_addr,
        running_room(database_url, QUAYUTEC_RUNTIME_EGRESS_ALLOW=LOOPBACK) as room_addr,
    ):
        yield claims_addr, room_addr


async def _stack(backends: tuple[str, str], standin: StandinProvider, **overrides: Any) -> AsyncIterator[Stack]:
    claims_addr, room_addr = backends
    overrides.setdefault("egress", EgressPolicy.parse(LOOPBACK))
    clock = FakeClock()
    channels: list[grpc.aio.Channel] = []
    async with running_runtime(claims_addr, room_addr, standin_url=standin.base_url, clock=clock, **overrides) as addr:
        world = await make_world(room_addr, claims_addr, channels)
        yield Stack(world, runtime_stub(addr, channels), standin, clock)
    for channel in channels:
        await channel.close()


@pytest.fixture
async def stack(backends: tuple[str, str], standin: StandinProvider) -> AsyncIterator[Stack]:
    async for s in _stack(backends, standin):
        yield s


async def wake_a(s: Stack, body: str = "@planner please plan the launch") -> common_pb2.Wake:
    posted = await s.world.post(body, [s.world.agent_a.agent_id])
    assert len(posted.wakes) == 1
    return posted.wakes[0]


async def test_a_wake_is_acted_on_once(stack: Stack) -> None:
    wake = await wake_a(stack)
    first = await stack.runtime.StartRun(start_request(wake))
    assert first.result == runtime_pb2.START_RUN_RESULT_ACCEPTED
    assert first.run_id == run_id_for(wake.agent_id, wake.wake_id)
    run = await stack.world.wait_for_run(first.run_id)
    assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
    again = await asyncio.gather(*(stack.runtime.StartRun(start_request(wake)) for _ in range(16)))
    assert {r.result for r in again} == {runtime_pb2.START_RUN_RESULT_ALREADY_CLAIMED}
    assert {r.run_id for r in again} == {first.run_id}
    # The fence refused them for the row the first run holds, and the answer says so.
    assert not first.row_held and {r.row_held for r in again} == {True}
    replies = await stack.world.messages_by(stack.world.agent_a.agent_id)
    assert [m.message_id for m in replies] == [run.posted_message_id]
    assert len(stack.standin.requests(stack.world.model_a)) == 1
    assert run.step == common_pb2.RUN_STEP_ENDED
    assert [a.error_class for a in run.model_attempts] == ["ok"]


async def test_reply_then_actions_are_written_and_recorded(stack: Stack) -> None:
    w = stack.world
    stack.standin.enqueue_reply(
        "Plan drafted; asking Bolt for copy.",
        [
            {"name": "remember", "arguments": {"text": "launch is on Friday", "private": False}},
            {"name": "remember", "arguments": {"text": "budget is 10k", "private": True}},
            {
                "name": "create_task",
                "arguments": {"to_agent_id": w.agent_b.agent_id, "title": "Write copy", "body": "Two lines."},
            },
        ],
        model=w.model_a,
    )
    wake = await wake_a(stack)
    started = await stack.runtime.StartRun(start_request(wake))
    run = await w.wait_for_run(started.run_id)
    assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
    assert [a.outcome for a in run.actions] == [common_pb2.ACTION_OUTCOME_DONE] * 3
    assert all(a.result_id for a in run.actions)
    assert [m.text for m in await w.memory(w.company_b)] == ["launch is on Friday"]
    assert sorted(m.text for m in await w.memory(w.company_a)) == ["budget is 10k", "launch is on Friday"]
    tasks = await w.tasks_for(w.agent_b.agent_id)
    assert [t.title for t in tasks] == ["Write copy"]
    assert tasks[0].run_id == run.run_id
    reply = (await w.messages_by(w.agent_a.agent_id))[0]
    assert reply.body == "Plan drafted; asking Bolt for copy."
    assert reply.run_id == run.run_id


async def test_a_bad_declared_action_posts_and_writes_nothing(stack: Stack) -> None:
    w = stack.world
    stack.standin.enqueue_reply(
        "I will remember two things.",
        [
            {"name": "remember", "arguments": {"text": "fine", "private": False}},
            {"name": "remember", "arguments": {"private": False}},
        ],
        model=w.model_a,
    )
    wake = await wake_a(stack)
    run = await w.wait_for_run((await stack.runtime.StartRun(start_request(wake))).run_id)
    assert run.status == common_pb2.RUN_STATUS_FAILED
    assert "text must be a string" in run.error
    assert run.posted_message_id == ""
    assert await w.messages_by(w.agent_a.agent_id) == []
    assert await w.memory(w.company_a) == []


async def test_a_final_model_error_posts_nothing(stack: Stack) -> None:
    w = stack.world
    stack.standin.enqueue_fault("key_rejected", model=w.model_a)
    wake = await wake_a(stack)
    run = await w.wait_for_run((await stack.runtime.StartRun(start_request(wake))).run_id)
    assert run.status == common_pb2.RUN_STATUS_FAILED
    assert [a.error_class for a in run.model_attempts] == ["key_rejected"]
    assert [a.status_code for a in run.model_attempts] == [401]
    assert w.agent_a.model not in run.error or "key_rejected" in run.error
    assert "sk-ant-secret" not in run.SerializeToString().decode(errors="ignore")
    assert await w.messages_by(w.agent_a.agent_id) == []
    assert stack.clock.sleeps == []


async def test_every_attempt_and_wait_is_in_the_ledger(stack: Stack) -> None:
    w = stack.world
    stack.standin.enqueue_fault("rate_limit", model=w.model_a)
    stack.standin.enqueue_fault("overloaded", model=w.model_a)
    wake = await wake_a(stack)
    run = await w.wait_for_run((await stack.runtime.StartRun(start_request(wake))).run_id)
    assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
    assert [(a.number, a.status_code, a.error_class) for a in run.model_attempts] == [
        (1, 429, "rate_limited"),
        (2, 529, "overloaded"),
        (3, 200, "ok"),
    ]
    assert [a.wait_seconds for a in run.model_attempts] == [2.0, 8.0, 0.0]
    assert stack.clock.sleeps == [2.0, 8.0]
    assert len(stack.standin.requests(w.model_a)) == 3


async def test_an_owner_supplied_address_gets_one_request(stack: Stack) -> None:
    w = stack.world
    own = await w.register_own_model(stack.standin.base_url)
    stack.standin.enqueue_fault("overloaded", model="own-model-1")
    posted = await w.post("@own-model hello", [own.agent_id])
    run = await w.wait_for_run((await stack.runtime.StartRun(start_request(posted.wakes[0]))).run_id)
    assert run.status == common_pb2.RUN_STATUS_FAILED
    assert len(run.model_attempts) == 1
    assert len(stack.standin.requests("own-model-1")) == 1
    assert stack.clock.sleeps == []


async def test_a_task_wake_sees_the_task_and_can_close_it(stack: Stack) -> None:
    w = stack.world
    author = common_pb2.Author(kind=common_pb2.AUTHOR_KIND_PERSON, company_id=w.company_b, person="bo")
    request = room_pb2.RoomServiceCreateTaskRequest(
        room_id=w.room_id, to_agent_id=w.agent_a.agent_id, title="Pick a date", body="Before May."
    )
    getattr(request, "from").CopyFrom(author)  # `from` is a Python keyword
    created = await w.room.CreateTask(request)
    task_id = created.task.task_id
    stack.standin.enqueue_reply(
        "Friday it is.",
        [{"name": "close_task", "arguments": {"task_id": task_id, "status": "done", "note": "Friday"}}],
        model=w.model_a,
    )
    run = await w.wait_for_run((await stack.runtime.StartRun(start_request(created.wakes[0]))).run_id)
    assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
    prompt = str(stack.standin.requests(w.model_a)[0].body)
    assert "Pick a date" in prompt and task_id in prompt
    task = (await w.room.GetTask(room_pb2.RoomServiceGetTaskRequest(task_id=task_id))).task
    assert task.status == common_pb2.TASK_STATUS_DONE
    assert [u.note for u in task.updates] == ["Friday"]


async def test_the_active_time_limit_stops_a_run(backends: tuple[str, str], standin: StandinProvider) -> None:
    async for s in _stack(backends, standin, run_seconds=0.5):
        s.standin.enqueue_reply("too late", model=s.world.model_a, delay_seconds=3.0)
        wake = await wake_a(s)
        run = await s.world.wait_for_run((await s.runtime.StartRun(start_request(wake))).run_id)
        assert run.status == common_pb2.RUN_STATUS_TIMED_OUT
        assert "active time" in run.error
        assert await s.world.messages_by(s.world.agent_a.agent_id) == []


async def test_full_runtime_refuses_before_claiming(backends: tuple[str, str], standin: StandinProvider) -> None:
    async for s in _stack(backends, standin, max_runs=1):
        first = await wake_a(s, "@planner one")
        second = await wake_a(s, "@planner two")
        # The first run stays in its model call until the refusal has been seen.
        with held_replies(s.standin, s.world.model_a) as release:
            assert (await s.runtime.StartRun(start_request(first))).result == runtime_pb2.START_RUN_RESULT_ACCEPTED
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await s.runtime.StartRun(start_request(second))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await s.world.claims.GetClaim(
                    claims_pb2.GetClaimRequest(agent_id=second.agent_id, wake_id=second.wake_id)
                )
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            release.set()
            await s.world.wait_for_run(run_id_for(first.agent_id, first.wake_id))
        assert (await s.runtime.StartRun(start_request(second))).result == runtime_pb2.START_RUN_RESULT_ACCEPTED


async def test_start_run_validates_ids(stack: Stack) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.runtime.StartRun(runtime_pb2.StartRunRequest(agent_id="a", wake_id="", room_id="r"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "wake_id" in (err.value.details() or "")
