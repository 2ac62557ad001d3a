"""Agent rights and held actions: a run parks on a waitpoint and continues once when decided."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import grpc
import pytest

from quayutec.ledger import run_id_for
from quayutec.v1 import common_pb2, room_pb2, runtime_pb2
from services.runtime.standin import StandinProvider
from tests.harness.claims import running_claims
from tests.harness.room import running_room
from tests.harness.runtime import RuntimeProcess, running_runtime
from tests.runtime.world import World, make_world, runtime_stub, start_request

AUTO, HOLD, DENY = common_pb2.ACTION_RIGHT_AUTO, common_pb2.ACTION_RIGHT_HOLD, common_pb2.ACTION_RIGHT_DENY
DONE, HELD = common_pb2.ACTION_OUTCOME_DONE, common_pb2.ACTION_OUTCOME_HELD
DENIED, NOT_DONE = common_pb2.ACTION_OUTCOME_DENIED, common_pb2.ACTION_OUTCOME_NOT_DONE


@pytest.fixture
async def backends(database_url: str) -> AsyncIterator[tuple[str, str]]:
    async with running_claims(database_url) as claims_addr, running_room(database_url) as room_addr:
        yield claims_addr, room_addr


# Channels the tests open to Runtimes; closed after each test (a dropped channel is collected early).
CHANNELS: list[grpc.aio.Channel] = []


@pytest.fixture
async def world(backends: tuple[str, str]) -> AsyncIterator[World]:
    yield await make_world(backends[1], backends[0], CHANNELS)
    while CHANNELS:
        await CHANNELS.pop().close()


async def set_rights(w: World, **rights: common_pb2.ActionRight.ValueType) -> None:
    await w.room.SetAgentRights(
        room_pb2.RoomServiceSetAgentRightsRequest(
            rights=common_pb2.AgentRights(company_id=w.company_a, agent_id=w.agent_a.agent_id, **rights)
        )
    )


def script(standin: StandinProvider, w: World) -> None:
    standin.enqueue_reply(
        "Noted; asking Bolt.",
        [
            {"name": "remember", "arguments": {"text": "launch on Friday", "private": False}},
            {"name": "create_task", "arguments": {"to_agent_id": w.agent_b.agent_id, "title": "Copy", "body": "x"}},
        ],
        model=w.model_a,
    )


async def start_and_wait(w: World, runtime: Any, statuses: tuple[int, ...]) -> common_pb2.Run:
    wake = (await w.post("@planner plan", [w.agent_a.agent_id])).wakes[0]
    started = await runtime.StartRun(start_request(wake))
    assert started.result == runtime_pb2.START_RUN_RESULT_ACCEPTED
    return await w.wait_for_run(started.run_id, statuses)


async def waitpoint_of(w: World, run_id: str) -> common_pb2.Waitpoint:
    listed = await w.room.ListWaitpoints(room_pb2.RoomServiceListWaitpointsRequest(company_id=w.company_a))
    found: list[common_pb2.Waitpoint] = [wp for wp in listed.waitpoints if wp.run_id == run_id]
    assert len(found) == 1
    return found[0]


async def decide(w: World, token: str, index: int, approve: bool, company: str | None = None) -> Any:
    return await w.room.DecideHeldAction(
        room_pb2.RoomServiceDecideHeldActionRequest(
            token=token, index=index, company_id=company or w.company_a, decided_by="ana", approve=approve
        )
    )


async def decision_wakes(w: World) -> list[common_pb2.Wake]:
    leased = await w.room.LeaseWakes(
        room_pb2.RoomServiceLeaseWakesRequest(lease_owner="test", max_wakes=500, lease_seconds=3600)
    )
    return [x for x in leased.wakes if x.kind == common_pb2.WAKE_KIND_DECISION]


PARKED = (common_pb2.RUN_STATUS_PARKED,)
ENDED = (common_pb2.RUN_STATUS_SUCCEEDED, common_pb2.RUN_STATUS_FAILED, common_pb2.RUN_STATUS_TIMED_OUT)


async def test_auto_hold_and_deny(backends: tuple[str, str], world: World, standin: StandinProvider) -> None:
    w = world
    await set_rights(w, remember=DENY, create_task=HOLD)
    script(standin, w)
    async with running_runtime(*backends, standin_url=standin.base_url) as addr:
        run = await start_and_wait(w, runtime_stub(addr, CHANNELS), PARKED)
    assert run.step == common_pb2.RUN_STEP_PARKED
    assert [a.outcome for a in run.actions] == [DENIED, HELD]
    assert run.posted_message_id  # the reply is posted before parking
    assert await w.memory(w.company_a) == []  # denied
    assert await w.tasks_for(w.agent_b.agent_id) == []  # held
    wp = await waitpoint_of(w, run.run_id)
    assert [h.index for h in wp.held] == [1]
    assert wp.status == common_pb2.WAITPOINT_STATUS_PENDING


async def test_cross_company_task_right_is_applied(
    backends: tuple[str, str], world: World, standin: StandinProvider
) -> None:
    w = world
    await set_rights(w, create_task=AUTO, cross_company_task=HOLD)
    script(standin, w)
    async with running_runtime(*backends, standin_url=standin.base_url) as addr:
        run = await start_and_wait(w, runtime_stub(addr, CHANNELS), PARKED)
    assert [a.outcome for a in run.actions] == [DONE, HELD]
    assert [m.text for m in await w.memory(w.company_a)] == ["launch on Friday"]


@pytest.mark.parametrize("approve", [True, False], ids=["approved", "denied"])
async def test_a_decision_continues_the_run_once(
    approve: bool, backends: tuple[str, str], world: World, standin: StandinProvider
) -> None:
    w = world
    await set_rights(w, create_task=HOLD)
    script(standin, w)
    async with (
        running_runtime(*backends, standin_url=standin.base_url) as one,
        running_runtime(*backends, standin_url=standin.base_url) as two,
    ):
        r1, r2 = runtime_stub(one, CHANNELS), runtime_stub(two, CHANNELS)
        run = await start_and_wait(w, r1, PARKED)
        assert [a.outcome for a in run.actions] == [DONE, HELD]
        # The run's own wake delivered again while it is parked: the fence refuses every such run.
        own = start_request(
            common_pb2.Wake(
                agent_id=run.agent_id,
                wake_id=run.wake_id,
                room_id=run.room_id,
                kind=run.wake_kind,
                source_id=run.wake_source_id,
            )
        )
        again = await asyncio.gather(*(rt.StartRun(own) for rt in [r1, r2] * 4))
        assert {a.result for a in again} == {runtime_pb2.START_RUN_RESULT_ALREADY_CLAIMED}
        assert (await w.run(run.run_id)).status == common_pb2.RUN_STATUS_PARKED
        assert len(standin.requests(w.model_a)) == 1
        wp = await waitpoint_of(w, run.run_id)
        decided = await asyncio.gather(*(decide(w, wp.token, 1, approve) for _ in range(12)))
        assert sum(d.completed for d in decided) == 1
        wakes = await decision_wakes(w)
        assert [x.source_id for x in wakes] == [wp.token]
        # The same continuation delivered many times, to two Runtime replicas at once.
        answers = await asyncio.gather(
            *(rt.StartRun(start_request(wakes[0])) for rt in [r1, r2] * 8),
        )
        assert [a.result for a in answers].count(runtime_pb2.START_RUN_RESULT_ACCEPTED) == 1
        assert {a.run_id for a in answers} == {run.run_id}
        done = await w.wait_for_run(run.run_id, ENDED)
        # And after the decision, once the continuation ran.
        again = await asyncio.gather(*(rt.StartRun(own) for rt in [r1, r2] * 4))
        assert {a.result for a in again} == {runtime_pb2.START_RUN_RESULT_ALREADY_CLAIMED}
    assert done.status == common_pb2.RUN_STATUS_SUCCEEDED, done.error
    assert len(standin.requests(w.model_a)) == 1
    assert done.actions[1].outcome == (DONE if approve else DENIED)
    assert "ana" in done.actions[1].detail
    assert len(await w.tasks_for(w.agent_b.agent_id)) == (1 if approve else 0)
    assert len(await w.messages_by(w.agent_a.agent_id)) == 1
    assert len(await w.memory(w.company_a)) == 1


async def test_another_company_cannot_decide(backends: tuple[str, str], world: World, standin: StandinProvider) -> None:
    w = world
    await set_rights(w, remember=HOLD)
    script(standin, w)
    async with running_runtime(*backends, standin_url=standin.base_url) as addr:
        run = await start_and_wait(w, runtime_stub(addr, CHANNELS), PARKED)
    wp = await waitpoint_of(w, run.run_id)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await decide(w, wp.token, 0, True, company=w.company_b)
    # Answered as an unknown token would be (the room's rule: no oracle of another company's approvals).
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert (await w.run(run.run_id)).status == common_pb2.RUN_STATUS_PARKED


async def test_a_parked_run_continues_on_a_fresh_runtime(
    backends: tuple[str, str], world: World, standin: StandinProvider
) -> None:
    w = world
    await set_rights(w, remember=HOLD, create_task=HOLD)
    script(standin, w)
    proc = RuntimeProcess(*backends, standin.base_url)
    try:
        await proc.wait_ready()
        run = await start_and_wait(w, runtime_stub(proc.addr, CHANNELS), PARKED)
    finally:
        proc.kill()  # the Runtime that parked the run is gone
    wp = await waitpoint_of(w, run.run_id)
    await decide(w, wp.token, 0, True)
    assert (await decide(w, wp.token, 1, True)).completed
    (wake,) = await decision_wakes(w)
    async with running_runtime(*backends, standin_url=standin.base_url) as addr:
        assert (await runtime_stub(addr, CHANNELS).StartRun(start_request(wake))).result == (
            runtime_pb2.START_RUN_RESULT_ACCEPTED
        )
        done = await w.wait_for_run(run.run_id, ENDED)
    assert done.status == common_pb2.RUN_STATUS_SUCCEEDED
    assert [a.outcome for a in done.actions] == [DONE, DONE]
    assert len(await w.memory(w.company_a)) == 1
    assert len(await w.tasks_for(w.agent_b.agent_id)) == 1


async def test_an_expired_token_ends_the_held_actions_undone(
    backends: tuple[str, str], world: World, standin: StandinProvider
) -> None:
    w = world
    await set_rights(w, create_task=HOLD)
    script(standin, w)
    async with running_runtime(*backends, standin_url=standin.base_url, waitpoint_ttl_seconds=1) as addr:
        rt = runtime_stub(addr, CHANNELS)
        run = await start_and_wait(w, rt, PARKED)
        wp = await waitpoint_of(w, run.run_id)
        expired = 0
        for _ in range(100):  # bounded: the token expires after 1 s
            expired = (await w.room.ExpireWaitpoints(room_pb2.RoomServiceExpireWaitpointsRequest(limit=10))).expired
            if expired:
                break
            await asyncio.sleep(0.1)
        assert expired == 1
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await decide(w, wp.token, 1, True)
        assert late.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        (wake,) = await decision_wakes(w)
        await rt.StartRun(start_request(wake))
        done = await w.wait_for_run(run.run_id, ENDED)
    assert done.status == common_pb2.RUN_STATUS_SUCCEEDED
    assert done.actions[1].outcome == NOT_DONE
    assert "expired" in done.actions[1].detail
    assert await w.tasks_for(w.agent_b.agent_id) == []


# A run's active time in the parking tests: far more than a run's active part takes even on a loaded
# machine, so only what a test does to the ledger can use it up.
ACTIVE_SECONDS = 60.0


async def park_then_decide(
    w: World, backends: tuple[str, str], standin: StandinProvider
) -> tuple[common_pb2.Run, common_pb2.Wake]:
    """A run parked on a Runtime that is then stopped, and its held action approved: (parked run,
    decision wake). Nothing of the run is left in any process."""
    await set_rights(w, create_task=HOLD)
    script(standin, w)
    async with running_runtime(*backends, standin_url=standin.base_url, run_seconds=ACTIVE_SECONDS) as addr:
        run = await start_and_wait(w, runtime_stub(addr, CHANNELS), PARKED)
    wp = await waitpoint_of(w, run.run_id)
    assert (await decide(w, wp.token, 1, True)).completed
    (wake,) = await decision_wakes(w)
    return run, wake


async def age_by(database_url: str, run_id: str, interval: str) -> None:
    """Move everything the database knows of the run's times back by ``interval``, as if it had
    waited parked that long."""
    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction():
            await conn.execute(
                f"UPDATE runs SET started_at = started_at - interval '{interval}',"
                f" updated_at = updated_at - interval '{interval}' WHERE run_id = $1",
                run_id,
            )
            await conn.execute(
                f"UPDATE waitpoints SET created_at = created_at - interval '{interval}' WHERE run_id = $1",
                run_id,
            )
            await conn.execute(
                f"UPDATE held_actions SET decided_at = decided_at - interval '{interval}'"
                " WHERE token = (SELECT token FROM waitpoints WHERE run_id = $1) AND decided_at IS NOT NULL",
                run_id,
            )
    finally:
        await conn.close()


async def test_time_parked_does_not_count(
    database_url: str, backends: tuple[str, str], world: World, standin: StandinProvider
) -> None:
    """Parked for an hour (far past its 60 s of active time), the run continues on a fresh Runtime
    and succeeds; its active time is what it had when it parked plus the continuation, not the hour."""
    w = world
    parked, wake = await park_then_decide(w, backends, standin)
    await age_by(database_url, parked.run_id, "1 hour")
    async with running_runtime(*backends, standin_url=standin.base_url, run_seconds=ACTIVE_SECONDS) as addr:
        assert (await runtime_stub(addr, CHANNELS).StartRun(start_request(wake))).result == (
            runtime_pb2.START_RUN_RESULT_ACCEPTED
        )
        done = await w.wait_for_run(parked.run_id, ENDED)
    assert done.status == common_pb2.RUN_STATUS_SUCCEEDED, done.error
    assert [a.outcome for a in done.actions] == [DONE, DONE]
    assert parked.active_ms <= done.active_ms < ACTIVE_SECONDS * 1000  # the hour parked is not in it
    assert run_id_for(w.agent_a.agent_id, done.wake_id) == parked.run_id


async def test_a_continuation_has_only_the_active_time_left(
    database_url: str, backends: tuple[str, str], world: World, standin: StandinProvider
) -> None:
    """Active time carries over a park: a run that had used its whole active time when it parked
    ends TIMED_OUT when it continues, and its approved action is not done."""
    w = world
    parked, wake = await park_then_decide(w, backends, standin)
    conn = await asyncpg.connect(database_url)
    try:  # it had spent its whole active time before parking
        await conn.execute(
            "UPDATE runs SET active_ms = $2 WHERE run_id = $1", parked.run_id, int(ACTIVE_SECONDS * 1000)
        )
    finally:
        await conn.close()
    async with running_runtime(*backends, standin_url=standin.base_url, run_seconds=ACTIVE_SECONDS) as addr:
        await runtime_stub(addr, CHANNELS).StartRun(start_request(wake))
        done = await w.wait_for_run(parked.run_id, ENDED)
    assert done.status == common_pb2.RUN_STATUS_TIMED_OUT
    assert done.error == f"stopped after {ACTIVE_SECONDS:g} s of active time"
    assert await w.tasks_for(w.agent_b.agent_id) == []  # the approved task was not written
