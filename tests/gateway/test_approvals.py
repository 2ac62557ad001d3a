"""Agent rights and approvals of held actions through the public door: only the owning company decides."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import asyncpg
import grpc
import pytest

from quayutec.config import ROOM
from quayutec.v1 import common_pb2, gateway_pb2, room_pb2, room_pb2_grpc
from tests.gateway.helpers import GatewayStub, create_room, expect_error, register_agent
from tests.gateway.runtime_standin import running_standin_runtime
from tests.harness.channels import callers_stub
from tests.harness.gateway import CompanyKey, gateway_config, join_room, running_gateway

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
HOLD, DENY, AUTO = common_pb2.ACTION_RIGHT_HOLD, common_pb2.ACTION_RIGHT_DENY, common_pb2.ACTION_RIGHT_AUTO


@pytest.fixture
async def room_stub(room_addr: str) -> AsyncIterator[room_pb2_grpc.RoomServiceStub]:
    async with callers_stub(room_addr, ROOM.grpc_service, room_pb2_grpc.RoomServiceStub) as stub:
        yield stub


async def test_rights_are_set_and_read_for_own_agents_only(
    acme_gw: GatewayStub, globex_gw: GatewayStub, acme: CompanyKey, room_stub: room_pb2_grpc.RoomServiceStub
) -> None:
    agent = await register_agent(acme_gw)
    default = await acme_gw.SetAgentRights(gateway_pb2.SetAgentRightsRequest(remember=HOLD), timeout=10)
    assert default.rights.company_id == acme.company_id and not default.rights.agent_id
    own = await acme_gw.SetAgentRights(
        gateway_pb2.SetAgentRightsRequest(agent_id=agent.agent_id, create_task=DENY), timeout=10
    )
    assert own.rights.agent_id == agent.agent_id
    got = await acme_gw.GetAgentRights(gateway_pb2.GetAgentRightsRequest(agent_id=agent.agent_id), timeout=10)
    assert got.company_default.remember == HOLD and got.agent.create_task == DENY
    effective = got.effective
    assert (effective.remember, effective.create_task, effective.update_task) == (HOLD, DENY, AUTO)
    # Another company can neither read nor set them; its own default is untouched.
    for call in (
        globex_gw.GetAgentRights(gateway_pb2.GetAgentRightsRequest(agent_id=agent.agent_id), timeout=10),
        globex_gw.SetAgentRights(gateway_pb2.SetAgentRightsRequest(agent_id=agent.agent_id, remember=AUTO), timeout=10),
    ):
        await expect_error(NOT_FOUND, call, "agent")
    theirs = await globex_gw.GetAgentRights(gateway_pb2.GetAgentRightsRequest(), timeout=10)
    assert theirs.effective.remember == AUTO


async def test_rights_validation(acme_gw: GatewayStub) -> None:
    await expect_error(
        INVALID,
        acme_gw.SetAgentRights(gateway_pb2.SetAgentRightsRequest(close_task=7), timeout=10),  # type: ignore[arg-type]
        "close_task",
    )
    await expect_error(
        NOT_FOUND, acme_gw.GetAgentRights(gateway_pb2.GetAgentRightsRequest(agent_id="nope"), timeout=10), "agent"
    )


async def _park_a_run(room: room_pb2_grpc.RoomServiceStub, agent: common_pb2.Agent, room_id: str) -> str:
    """Park a run of ``agent`` with two held actions, as the Runtime would; returns the token."""
    run = common_pb2.Run(
        run_id=f"run-{uuid.uuid4()}",
        agent_id=agent.agent_id,
        company_id=agent.company_id,
        room_id=room_id,
        wake_id=str(uuid.uuid4()),
        status=common_pb2.RUN_STATUS_RUNNING,
        step=common_pb2.RUN_STEP_REPLY_POSTED,
    )
    await room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=run), timeout=10)
    parked = common_pb2.Run()
    parked.CopyFrom(run)
    parked.status, parked.step = common_pb2.RUN_STATUS_PARKED, common_pb2.RUN_STEP_PARKED
    held = [
        common_pb2.HeldAction(
            index=n,
            kind=common_pb2.ACTION_KIND_REMEMBER,
            arguments_json='{"text": "x"}',
            decision=common_pb2.DECISION_PENDING,
        )
        for n in (0, 1)
    ]
    response = await room.CreateWaitpoint(
        room_pb2.RoomServiceCreateWaitpointRequest(run_id=run.run_id, held=held, expires_in_seconds=3600, run=parked),
        timeout=10,
    )
    return str(response.waitpoint.token)


async def test_only_the_owning_company_decides_and_the_run_continues_once(
    acme_gw: GatewayStub, globex_gw: GatewayStub, globex: CompanyKey, room_stub: room_pb2_grpc.RoomServiceStub
) -> None:
    room = await create_room(acme_gw)
    await join_room(acme_gw, globex_gw, room.room_id)
    agent = await register_agent(acme_gw)
    token = await _park_a_run(room_stub, agent, room.room_id)

    pending = await acme_gw.ListApprovals(gateway_pb2.ListApprovalsRequest(), timeout=10)
    assert [w.token for w in pending.waitpoints] == [token]
    assert not (await globex_gw.ListApprovals(gateway_pb2.ListApprovalsRequest(), timeout=10)).waitpoints

    decide = gateway_pb2.DecideApprovalRequest
    # Another company's real token is answered exactly as a made-up one (no oracle of what exists).
    made_up = str(uuid.uuid4())
    unknown = await expect_error(
        grpc.StatusCode.NOT_FOUND,
        globex_gw.DecideApproval(decide(token=made_up, index=0, person="Bob", approve=True), timeout=10),
    )
    err = await expect_error(
        grpc.StatusCode.NOT_FOUND,
        globex_gw.DecideApproval(decide(token=token, index=0, person="Bob", approve=True), timeout=10),
    )
    assert (err.details() or "").replace(token, "<token>") == (unknown.details() or "").replace(made_up, "<token>")
    assert agent.company_id not in (err.details() or "")
    first = await acme_gw.DecideApproval(decide(token=token, index=0, person="Ada", approve=True), timeout=10)
    assert not first.completed and not first.already_decided
    again = await acme_gw.DecideApproval(decide(token=token, index=0, person="Ada", approve=True), timeout=10)
    assert again.already_decided and not again.completed
    await expect_error(
        grpc.StatusCode.FAILED_PRECONDITION,
        acme_gw.DecideApproval(decide(token=token, index=0, person="Ada", approve=False), timeout=10),
    )
    last = await acme_gw.DecideApproval(decide(token=token, index=1, person="Ada", approve=False), timeout=10)
    assert last.completed and last.waitpoint.status == common_pb2.WAITPOINT_STATUS_COMPLETED
    repeat = await acme_gw.DecideApproval(decide(token=token, index=1, person="Ada", approve=False), timeout=10)
    assert not repeat.completed  # the run continues once
    done = await acme_gw.ListApprovals(
        gateway_pb2.ListApprovalsRequest(status=common_pb2.WAITPOINT_STATUS_COMPLETED), timeout=10
    )
    assert [w.token for w in done.waitpoints] == [token]
    assert not (await acme_gw.ListApprovals(gateway_pb2.ListApprovalsRequest(), timeout=10)).waitpoints

    await expect_error(
        NOT_FOUND, acme_gw.DecideApproval(decide(token=token, index=9, person="Ada", approve=True), timeout=10)
    )
    await expect_error(
        NOT_FOUND,
        acme_gw.DecideApproval(decide(token=str(uuid.uuid4()), index=0, person="Ada", approve=True), timeout=10),
    )


async def test_approval_validation(acme_gw: GatewayStub) -> None:
    decide = gateway_pb2.DecideApprovalRequest
    for request, code, field in [
        (decide(index=0, person="Ada"), INVALID, "token"),
        (decide(token=str(uuid.uuid4()), index=-1, person="Ada"), INVALID, "index"),
        (decide(token=str(uuid.uuid4()), index=0), INVALID, "person"),
        (decide(token="not-a-token", index=0, person="Ada"), NOT_FOUND, "approval"),
    ]:
        await expect_error(code, acme_gw.DecideApproval(request, timeout=10), field)
    await expect_error(
        INVALID, acme_gw.ListApprovals(gateway_pb2.ListApprovalsRequest(page_size=501), timeout=10), "page_size"
    )
    await expect_error(
        INVALID,
        acme_gw.ListApprovals(gateway_pb2.ListApprovalsRequest(status=8), timeout=10),  # type: ignore[arg-type]
        "status",
    )


async def test_concurrent_last_decisions_complete_the_approval_once(
    acme_gw: GatewayStub, room_stub: room_pb2_grpc.RoomServiceStub, pool: asyncpg.Pool
) -> None:
    room = await create_room(acme_gw)
    agent = await register_agent(acme_gw)
    token = await _park_a_run(room_stub, agent, room.room_id)
    decide = gateway_pb2.DecideApprovalRequest
    await acme_gw.DecideApproval(decide(token=token, index=0, person="Ada", approve=True), timeout=10)
    results = await asyncio.gather(
        *(
            acme_gw.DecideApproval(decide(token=token, index=1, person=f"P{n}", approve=True), timeout=30)
            for n in range(20)
        )
    )
    assert sum(r.completed for r in results) == 1
    assert sum(r.already_decided for r in results) == 19
    wakes = await pool.fetch("SELECT agent_id FROM wake_outbox WHERE kind = 'decision' AND source_id = $1", token)
    assert [str(w["agent_id"]) for w in wakes] == [agent.agent_id]


async def test_an_overdue_approval_expires_and_wakes_its_run_once(
    database_url: str,
    room_addr: str,
    claims_addr: str,
    acme_gw: GatewayStub,
    room_stub: room_pb2_grpc.RoomServiceStub,
    pool: asyncpg.Pool,
) -> None:
    room = await create_room(acme_gw)
    agent = await register_agent(acme_gw)
    overdue = await _park_a_run(room_stub, agent, room.room_id)
    waiting = await _park_a_run(room_stub, agent, room.room_id)
    await pool.execute("UPDATE waitpoints SET expires_at = now() - interval '1 minute' WHERE token = $1", overdue)
    fast = {"QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS": "0.02", "QUAYUTEC_GATEWAY_EXPIRE_INTERVAL_SECONDS": "0.05"}
    async with (
        running_standin_runtime(claims_addr, room_addr) as (runtime_addr, runtime),
        running_gateway(database_url, room_addr, runtime_addr, **fast),
    ):
        await runtime.wait_until(lambda: any(c.request.wake_source_id == overdue for c in runtime.calls))
    woken = [c for c in runtime.calls if c.request.wake_kind == common_pb2.WAKE_KIND_DECISION]
    assert [(c.request.wake_source_id, c.request.agent_id, c.answer) for c in woken] == [
        (overdue, agent.agent_id, "ACCEPTED")
    ]
    expired = await acme_gw.ListApprovals(
        gateway_pb2.ListApprovalsRequest(status=common_pb2.WAITPOINT_STATUS_EXPIRED), timeout=10
    )
    assert [w.token for w in expired.waitpoints] == [overdue]
    pending = await acme_gw.ListApprovals(gateway_pb2.ListApprovalsRequest(), timeout=10)
    assert [w.token for w in pending.waitpoints] == [waiting]
    await expect_error(
        grpc.StatusCode.FAILED_PRECONDITION,
        acme_gw.DecideApproval(
            gateway_pb2.DecideApprovalRequest(token=overdue, index=0, person="Ada", approve=True), timeout=10
        ),
        "expired",
    )


def test_the_expiry_interval_is_configurable() -> None:
    assert gateway_config("postgresql://x/y", "a:1", "b:2").delivery.expire_interval_seconds == 5.0
    config = gateway_config("postgresql://x/y", "a:1", "b:2", QUAYUTEC_GATEWAY_EXPIRE_INTERVAL_SECONDS="0.5")
    assert config.delivery.expire_interval_seconds == 0.5
