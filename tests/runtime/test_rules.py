"""The room's rules from the Runtime's door: an agent's declared action, through a real Runtime with the
stand-in provider declaring the tool call. An action a rule refuses is not done, is recorded REFUSED in
the run's ledger with the rule's id and words, and the run goes on with its other actions, as for a
`deny` right (docs/rules.md). Acme (A) created the room, Bolt (B) is a member; Crow (C) is a third
company, a member where the rule needs one and outside where it must not be."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Mapping
from typing import Any

import asyncpg
import grpc
import pytest

from quayutec.v1 import common_pb2, room_pb2, runtime_pb2
from services.runtime.standin import ScriptedReply, StandinProvider
from tests.harness.claims import running_claims
from tests.harness.room import add_member, room_state, running_room
from tests.harness.runtime import running_runtime
from tests.runtime.world import World, make_world, runtime_stub, start_request

DONE, REFUSED = common_pb2.ACTION_OUTCOME_DONE, common_pb2.ACTION_OUTCOME_REFUSED
HOLD = common_pb2.ACTION_RIGHT_HOLD
OPEN = common_pb2.TASK_STATUS_OPEN
# What an agent's refused action must leave as it was (its run's own ledger row and events aside).
CONTENT = ("messages", "tasks", "task_updates", "memory_lines", "files", "wake_outbox", "room_members")
CHANNELS: list[grpc.aio.Channel] = []


@pytest.fixture
async def backends(database_url: str) -> AsyncIterator[tuple[str, str]]:
    async with running_claims(database_url) as claims_addr, running_room(database_url) as room_addr:
        yield claims_addr, room_addr


@pytest.fixture
async def world(backends: tuple[str, str]) -> AsyncIterator[World]:
    yield await make_world(backends[1], backends[0], CHANNELS)
    while CHANNELS:
        await CHANNELS.pop().close()


@pytest.fixture
async def runtime(backends: tuple[str, str], standin: StandinProvider) -> AsyncIterator[Any]:
    async with running_runtime(*backends, standin_url=standin.base_url) as addr:
        yield runtime_stub(addr, CHANNELS)


async def crow(w: World, *, member: bool) -> common_pb2.Agent:
    """A third company with one agent; a member of the room when ``member``."""
    company = (await w.room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name=f"Crow {w.room_id}"))).company
    if member:
        await add_member(w.room, w.room_id, company.company_id, invited_by=w.company_a)
    agent: common_pb2.Agent = (
        await w.room.RegisterAgent(
            room_pb2.RoomServiceRegisterAgentRequest(
                company_id=company.company_id,
                name="outsider",
                provider=common_pb2.PROVIDER_ANTHROPIC,
                model=f"crow-{w.room_id}",
                provider_key="sk-crow",
            )
        )
    ).agent
    return agent


async def send_task(w: World, to_agent_id: str, title: str) -> common_pb2.Task:
    """A task from a person of Acme."""
    create = room_pb2.RoomServiceCreateTaskRequest(room_id=w.room_id, to_agent_id=to_agent_id, title=title)
    getattr(create, "from").CopyFrom(
        common_pb2.Author(kind=common_pb2.AUTHOR_KIND_PERSON, company_id=w.company_a, person="ana")
    )
    task: common_pb2.Task = (await w.room.CreateTask(create)).task
    return task


async def get_task(w: World, task_id: str) -> common_pb2.Task:
    got = await w.room.GetTask(room_pb2.RoomServiceGetTaskRequest(task_id=task_id, room_id=w.room_id))
    task: common_pb2.Task = got.task
    return task


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


async def run_agent(
    w: World, runtime: Any, agent: common_pb2.Agent, pool: asyncpg.Pool | None = None, tables: tuple[str, ...] = ()
) -> tuple[common_pb2.Run, dict[str, str]]:
    """Wake ``agent`` with a message from Acme and wait for its run to end; with ``pool``, also the
    state of ``tables`` once the wake is recorded, before the run starts."""
    wake = (await w.post("@agent over to you", [agent.agent_id])).wakes[0]
    before = await room_state(pool, tables) if pool is not None else {}
    started = await runtime.StartRun(start_request(wake))
    assert started.result == runtime_pb2.START_RUN_RESULT_ACCEPTED
    return await w.wait_for_run(started.run_id), before


def outcomes(run: common_pb2.Run) -> list[tuple[int, str]]:
    return [(a.outcome, a.rule) for a in run.actions]


async def test_another_companys_agent_neither_closes_nor_annotates_a_task_it_was_not_given(
    world: World, runtime: Any, standin: StandinProvider, pool: asyncpg.Pool
) -> None:
    """Issue 21, #1: Bolt's agent declares close_task and update_task on Acme's task to Acme's own agent,
    and on Acme's task to Crow's agent. Bolt's people may not touch them; neither may its agent."""
    w = world
    crow_agent = await crow(w, member=True)
    a_to_a = await send_task(w, w.agent_a.agent_id, "plan the launch")
    a_to_c = await send_task(w, crow_agent.agent_id, "price the launch")
    standin.enqueue_reply(
        "",
        [
            call("close_task", task_id=a_to_a.task_id, status="cancelled", note="Bolt cancels it"),
            call("update_task", task_id=a_to_a.task_id, note="Bolt's note on Acme's task"),
            call("close_task", task_id=a_to_c.task_id, status="done", note=""),
            call("update_task", task_id=a_to_c.task_id, note="Bolt's note on Acme's task to Crow"),
            call("remember", text="Bolt was asked", private=True),
        ],
        model=w.agent_b.model,
    )
    run, tasks_before = await run_agent(w, runtime, w.agent_b, pool, ("tasks", "task_updates"))

    for task in (a_to_a, a_to_c):
        now = await get_task(w, task.task_id)
        assert (now.status, list(now.updates)) == (OPEN, []), now
    assert await room_state(pool, ("tasks", "task_updates")) == tasks_before
    assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
    assert outcomes(run) == [(REFUSED, "task-sender-or-assignee")] * 4 + [(DONE, "")]
    for action in run.actions[:4]:
        assert f"company {w.company_b} is neither" in action.detail and not action.result_id
    assert [line.text for line in await w.memory(w.company_b)] == ["Bolt was asked"]  # the run went on


async def test_the_senders_and_the_assignees_agents_may(world: World, runtime: Any, standin: StandinProvider) -> None:
    """The rule is not a blanket refusal: Bolt's agent closes a task sent to it; Acme's agent notes a
    task Acme sent to Crow's agent."""
    w = world
    crow_agent = await crow(w, member=True)
    a_to_b = await send_task(w, w.agent_b.agent_id, "write the copy")
    a_to_c = await send_task(w, crow_agent.agent_id, "price the launch")
    close = call("close_task", task_id=a_to_b.task_id, status="done", note="written")
    standin.enqueue_reply("", [close], model=w.agent_b.model)
    standin.enqueue_reply("", [call("update_task", task_id=a_to_c.task_id, note="by Friday")], model=w.model_a)
    by_b, _ = await run_agent(w, runtime, w.agent_b)
    by_a, _ = await run_agent(w, runtime, w.agent_a)
    assert outcomes(by_b) == [(DONE, "")] and outcomes(by_a) == [(DONE, "")]
    assert (await get_task(w, a_to_b.task_id)).status == common_pb2.TASK_STATUS_DONE
    assert [u.note for u in (await get_task(w, a_to_c.task_id)).updates] == ["by Friday"]


async def test_a_task_to_an_agent_not_in_the_room_is_refused(
    world: World, runtime: Any, standin: StandinProvider, pool: asyncpg.Pool
) -> None:
    """assignee-in-room: Acme's agent sends tasks to Crow's agent (Crow is not a member) and to an id
    that names no agent; neither is created nor wakes anyone, and the run does its other actions."""
    w = world
    crow_agent = await crow(w, member=False)
    unknown = "8d0c4a6e-2f0b-4d8e-9d55-6c1f2b7a9e10"
    standin.enqueue_reply(
        "",
        [
            call("create_task", to_agent_id=crow_agent.agent_id, title="price it", body=""),
            call("create_task", to_agent_id=unknown, title="anyone?", body=""),
            call("remember", text="asked around", private=False),
        ],
        model=w.model_a,
    )
    run, before = await run_agent(w, runtime, w.agent_a, pool, ("tasks", "wake_outbox"))
    assert await room_state(pool, ("tasks", "wake_outbox")) == before
    assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
    assert outcomes(run) == [(REFUSED, "assignee-in-room")] * 2 + [(DONE, "")]
    assert crow_agent.agent_id in run.actions[0].detail and unknown in run.actions[1].detail


async def test_an_agent_whose_company_left_during_its_run_writes_nothing(
    world: World, runtime: Any, standin: StandinProvider, pool: asyncpg.Pool
) -> None:
    """member-writes: Bolt leaves the room while its agent's model is answering; each declared write
    (remember, create_task, update_task, close_task) is refused by the Room in its own transaction."""
    w = world
    a_to_b = await send_task(w, w.agent_b.agent_id, "write the copy")
    asked, leave_done = threading.Event(), threading.Event()

    def respond(body: Mapping[str, Any]) -> ScriptedReply:
        asked.set()
        leave_done.wait(timeout=4)  # within the Runtime's model timeout (5 s)
        return ScriptedReply(
            "",
            tool_calls=(
                call("remember", text="mine", private=False),
                call("create_task", to_agent_id=w.agent_a.agent_id, title="back to you", body=""),
                call("update_task", task_id=a_to_b.task_id, note="half done"),
                call("close_task", task_id=a_to_b.task_id, status="done", note=""),
            ),
        )

    standin.set_responder(w.agent_b.model, respond)
    wake = (await w.post("@writer go", [w.agent_b.agent_id])).wakes[0]
    started = await runtime.StartRun(start_request(wake))
    assert await asyncio.to_thread(asked.wait, 10)
    await w.room.LeaveRoom(room_pb2.RoomServiceLeaveRoomRequest(room_id=w.room_id, company_id=w.company_b))
    before = await room_state(pool, CONTENT)
    leave_done.set()
    run = await w.wait_for_run(started.run_id)
    assert await room_state(pool, CONTENT) == before
    assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
    assert outcomes(run) == [(REFUSED, "member-writes")] * 4
    assert all(f"company {w.company_b} is not a member of room {w.room_id}" == a.detail for a in run.actions)


async def test_an_approved_action_is_still_refused_by_the_rule(
    world: World, runtime: Any, standin: StandinProvider, pool: asyncpg.Pool
) -> None:
    """Bolt holds its agent's close_task; Bolt approves it; the continuation's write is still the Room's to
    refuse: Acme's task to Acme's agent stays open."""
    w = world
    a_to_a = await send_task(w, w.agent_a.agent_id, "plan the launch")
    await w.room.SetAgentRights(
        room_pb2.RoomServiceSetAgentRightsRequest(
            rights=common_pb2.AgentRights(company_id=w.company_b, close_task=HOLD)
        )
    )
    standin.enqueue_reply(
        "", [call("close_task", task_id=a_to_a.task_id, status="done", note="")], model=w.agent_b.model
    )
    wake = (await w.post("@writer", [w.agent_b.agent_id])).wakes[0]
    started = await runtime.StartRun(start_request(wake))
    parked = await w.wait_for_run(started.run_id, (common_pb2.RUN_STATUS_PARKED,))
    waitpoints = await w.room.ListWaitpoints(room_pb2.RoomServiceListWaitpointsRequest(company_id=w.company_b))
    (wp,) = [x for x in waitpoints.waitpoints if x.run_id == parked.run_id]
    decide = room_pb2.RoomServiceDecideHeldActionRequest(
        token=wp.token, index=0, company_id=w.company_b, decided_by="bo", approve=True
    )
    decided = await w.room.DecideHeldAction(decide)
    assert decided.completed
    leased = await w.room.LeaseWakes(
        room_pb2.RoomServiceLeaseWakesRequest(lease_owner="test", max_wakes=500, lease_seconds=3600)
    )
    (decision,) = [x for x in leased.wakes if x.kind == common_pb2.WAKE_KIND_DECISION]
    await runtime.StartRun(start_request(decision))
    run = await w.wait_for_run(parked.run_id)
    task = await get_task(w, a_to_a.task_id)
    assert (task.status, list(task.updates)) == (OPEN, [])
    assert outcomes(run) == [(REFUSED, "task-sender-or-assignee")]
    assert json.loads(run.actions[0].arguments_json)["task_id"] == a_to_a.task_id
