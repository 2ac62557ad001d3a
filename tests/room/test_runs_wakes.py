"""The run ledger (RecordRun upsert, the ended-row refusal) and wake leasing (LeaseWakes, SettleWake)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg
import grpc

from quayutec.v1 import common_pb2, room_pb2
from tests.room.conftest import Stub, World, expect_error, post

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
FAILED = grpc.StatusCode.FAILED_PRECONDITION


def a_run(world: World, run_id: str = "run-1", **fields: Any) -> common_pb2.Run:
    base: dict[str, Any] = {
        "run_id": run_id,
        "agent_id": world.acme_agent.agent_id,
        "room_id": world.room_id,
        "wake_id": str(uuid.uuid4()),
        "wake_kind": common_pb2.WAKE_KIND_MESSAGE,
        "status": common_pb2.RUN_STATUS_RUNNING,
        "step": common_pb2.RUN_STEP_CLAIMED,
    }
    return common_pb2.Run(**{**base, **fields})


async def record(room: Stub, run: common_pb2.Run) -> common_pb2.Run:
    stored: common_pb2.Run = (await room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=run))).run
    return stored


async def test_record_run_upserts_the_whole_row(room: Stub, world: World) -> None:
    run = a_run(world, trace_id="0af7651916cd43dd8448eb211c80319c")
    first = await record(room, run)
    assert first.company_id == world.acme.company_id  # filled in from the agent
    assert first.started_at.seconds > 0 and first.status == common_pb2.RUN_STATUS_RUNNING
    run.step = common_pb2.RUN_STEP_REPLY_POSTED
    run.posted_message_id = str(uuid.uuid4())
    run.actions.add(
        index=0,
        kind=common_pb2.ACTION_KIND_REMEMBER,
        arguments_json='{"text": "x"}',
        outcome=common_pb2.ACTION_OUTCOME_HELD,
    )
    run.model_attempts.add(number=1, status_code=429, error_class="rate_limited", retryable=True, wait_seconds=2.0)
    run.model_attempts.add(number=2, status_code=200, error_class="ok", duration_ms=120)
    second = await record(room, run)
    assert second.started_at == first.started_at and second.step == common_pb2.RUN_STEP_REPLY_POSTED
    assert list(second.actions) == list(run.actions) and list(second.model_attempts) == list(run.model_attempts)
    got = (await room.GetRun(room_pb2.RoomServiceGetRunRequest(run_id="run-1"))).run
    assert got == second


async def test_an_ended_run_cannot_change(room: Stub, world: World) -> None:
    ended_at = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    run = a_run(world, status=common_pb2.RUN_STATUS_SUCCEEDED, step=common_pb2.RUN_STEP_ENDED, active_ms=1500)
    run.ended_at.FromDatetime(ended_at)
    stored = await record(room, run)
    assert stored.ended_at.ToDatetime(tzinfo=UTC) == ended_at
    # The same write again (a retry) is accepted and changes nothing.
    assert await record(room, run) == stored
    changed = common_pb2.Run()
    changed.CopyFrom(run)
    changed.error = "late"
    await expect_error(FAILED, record(room, changed), "ended")
    reopened = common_pb2.Run()
    reopened.CopyFrom(run)
    reopened.ClearField("ended_at")
    await expect_error(FAILED, record(room, reopened), "ended")
    got = (await room.GetRun(room_pb2.RoomServiceGetRunRequest(run_id=run.run_id))).run
    assert got == stored


async def test_run_errors_and_listing(room: Stub, world: World) -> None:
    await expect_error(INVALID, record(room, a_run(world, run_id="")), "run_id")
    await expect_error(INVALID, record(room, a_run(world, agent_id="")), "agent_id")
    await expect_error(INVALID, record(room, a_run(world, room_id="")), "room_id")
    await expect_error(NOT_FOUND, room.GetRun(room_pb2.RoomServiceGetRunRequest(run_id="nope")))
    await expect_error(INVALID, room.GetRun(room_pb2.RoomServiceGetRunRequest()))
    for i in range(3):
        await record(room, a_run(world, f"a{i}"))
    await record(room, a_run(world, "b0", agent_id=world.bolt_agent.agent_id))
    await expect_error(INVALID, room.ListRuns(room_pb2.RoomServiceListRunsRequest()), "agent_id or company_id")
    by_agent = await room.ListRuns(room_pb2.RoomServiceListRunsRequest(agent_id=world.acme_agent.agent_id, page_size=2))
    rest = await room.ListRuns(
        room_pb2.RoomServiceListRunsRequest(
            agent_id=world.acme_agent.agent_id, page_size=2, page_token=by_agent.next_page_token
        )
    )
    assert [r.run_id for r in (*by_agent.runs, *rest.runs)] == ["a2", "a1", "a0"] and not rest.next_page_token
    by_company = await room.ListRuns(room_pb2.RoomServiceListRunsRequest(company_id=world.bolt.company_id))
    assert [r.run_id for r in by_company.runs] == ["b0"]


# -- wakes --------------------------------------------------------------------------------------------------


def lease(room: Stub, owner: str, max_wakes: int = 500, seconds: int = 60) -> Any:
    return room.LeaseWakes(
        room_pb2.RoomServiceLeaseWakesRequest(lease_owner=owner, max_wakes=max_wakes, lease_seconds=seconds)
    )


def settle(room: Stub, wake_id: str, owner: str, settlement: Any, **fields: Any) -> Any:
    return room.SettleWake(
        room_pb2.RoomServiceSettleWakeRequest(wake_id=wake_id, lease_owner=owner, settlement=settlement, **fields)
    )


async def test_two_concurrent_owners_never_lease_the_same_wake(room: Stub, world: World) -> None:
    mentions = [world.acme_agent.agent_id, world.bolt_agent.agent_id]
    made = {w.wake_id for _ in range(30) for w in (await post(room, world, "go", mentions)).wakes}
    assert len(made) == 60
    leased: dict[str, list[str]] = {"a": [], "b": []}
    attempts: list[int] = []

    async def drain(owner: str) -> None:
        while True:
            got = (await lease(room, owner, max_wakes=3)).wakes
            if not got:
                return
            leased[owner].extend(w.wake_id for w in got)
            attempts.extend(w.delivery_attempts for w in got)

    await asyncio.gather(drain("a"), drain("b"), drain("a"), drain("b"))
    everything = leased["a"] + leased["b"]
    assert len(everything) == len(set(everything)) == 60 and set(everything) == made
    assert attempts == [1] * 60 and leased["a"] and leased["b"]
    assert (await room.CountPendingWakes(room_pb2.RoomServiceCountPendingWakesRequest())).pending == 60


async def test_an_expired_lease_makes_the_wake_due_again(room: Stub, world: World, database_url: str) -> None:
    wake = (await post(room, world, "go", [world.bolt_agent.agent_id])).wakes[0]
    first = (await lease(room, "gw-1")).wakes
    assert [w.wake_id for w in first] == [wake.wake_id] and first[0].delivery_attempts == 1
    assert list((await lease(room, "gw-2")).wakes) == []  # still leased
    conn = await asyncpg.connect(database_url)
    try:  # expire the lease without waiting for it
        await conn.execute("UPDATE wake_outbox SET lease_expires_at = now() - interval '1 second'")
    finally:
        await conn.close()
    again = (await lease(room, "gw-2")).wakes
    assert [w.wake_id for w in again] == [wake.wake_id] and again[0].delivery_attempts == 2
    # The first owner lost its lease: it cannot settle any more.
    await expect_error(FAILED, settle(room, wake.wake_id, "gw-1", room_pb2.WAKE_SETTLEMENT_DELIVERED), "gw-1")
    await settle(room, wake.wake_id, "gw-2", room_pb2.WAKE_SETTLEMENT_DELIVERED)


async def test_settle_retry_then_delivered(room: Stub, world: World, database_url: str) -> None:
    wake = (await post(room, world, "go", [world.bolt_agent.agent_id])).wakes[0]
    await lease(room, "gw-1")
    retried = await settle(
        room, wake.wake_id, "gw-1", room_pb2.WAKE_SETTLEMENT_RETRY, retry_after_ms=3_600_000, last_error="runtime down"
    )
    assert retried.settled_at.seconds > 0
    assert list((await lease(room, "gw-1")).wakes) == []  # not due for an hour
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow("SELECT lease_owner, last_error, due_at > now() AS later FROM wake_outbox")
        assert row["lease_owner"] is None and row["last_error"] == "runtime down" and row["later"]
        await conn.execute("UPDATE wake_outbox SET due_at = now()")
    finally:
        await conn.close()
    # A settled-for-retry lease is gone: the old owner cannot deliver on it.
    await expect_error(FAILED, settle(room, wake.wake_id, "gw-1", room_pb2.WAKE_SETTLEMENT_DELIVERED))
    got = (await lease(room, "gw-2")).wakes
    assert [w.delivery_attempts for w in got] == [2]
    delivered = await settle(room, wake.wake_id, "gw-2", room_pb2.WAKE_SETTLEMENT_DELIVERED)
    again = await settle(room, wake.wake_id, "gw-2", room_pb2.WAKE_SETTLEMENT_DELIVERED)  # idempotent
    assert again.settled_at == delivered.settled_at
    await expect_error(FAILED, settle(room, wake.wake_id, "gw-2", room_pb2.WAKE_SETTLEMENT_RETRY), "delivered")
    pending = await room.CountPendingWakes(room_pb2.RoomServiceCountPendingWakesRequest())
    assert pending.pending == 0 and pending.oldest_pending_age_ms == 0
    assert list((await lease(room, "gw-3")).wakes) == []


async def test_wake_errors(room: Stub, world: World) -> None:
    await expect_error(INVALID, lease(room, ""), "lease_owner")
    await expect_error(INVALID, lease(room, "gw", max_wakes=0), "max_wakes")
    await expect_error(INVALID, lease(room, "gw", max_wakes=501), "max_wakes")
    await expect_error(INVALID, lease(room, "gw", seconds=0), "lease_seconds")
    await expect_error(INVALID, lease(room, "gw", seconds=3601), "lease_seconds")
    missing = str(uuid.uuid4())
    await expect_error(NOT_FOUND, settle(room, missing, "gw", room_pb2.WAKE_SETTLEMENT_DELIVERED))
    await expect_error(INVALID, settle(room, "bad", "gw", room_pb2.WAKE_SETTLEMENT_DELIVERED), "wake_id")
    await expect_error(INVALID, settle(room, missing, "gw", room_pb2.WAKE_SETTLEMENT_UNSPECIFIED), "settlement")
    await expect_error(
        INVALID, settle(room, missing, "gw", room_pb2.WAKE_SETTLEMENT_RETRY, retry_after_ms=-1), "retry_after_ms"
    )
