"""SettleWakes: many leases settled in one call, each by the rules of SettleWake."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import grpc

from quayutec.v1 import room_pb2
from tests.room.conftest import Stub, World, expect_error, post
from tests.room.test_runs_wakes import lease

INVALID = grpc.StatusCode.INVALID_ARGUMENT
DELIVERED, RETRY = room_pb2.WAKE_SETTLEMENT_DELIVERED, room_pb2.WAKE_SETTLEMENT_RETRY


def item(wake_id: str, owner: str, settlement: Any, **fields: Any) -> room_pb2.WakeToSettle:
    return room_pb2.WakeToSettle(wake_id=wake_id, lease_owner=owner, settlement=settlement, **fields)


def settle_all(room: Stub, *items: room_pb2.WakeToSettle) -> Any:
    return room.SettleWakes(room_pb2.RoomServiceSettleWakesRequest(wakes=items))


async def test_each_item_is_settled_by_its_lease_owner_only(room: Stub, world: World, database_url: str) -> None:
    wakes = [(await post(room, world, f"go {n}", [world.bolt_agent.agent_id])).wakes[0].wake_id for n in range(4)]
    first, second, third, fourth = wakes
    assert len((await lease(room, "gw-1", max_wakes=3)).wakes) == 3  # the oldest three
    assert [w.wake_id for w in (await lease(room, "gw-2")).wakes] == [fourth]
    missing = str(uuid.uuid4())

    answer = await settle_all(
        room,
        item(third, "gw-1", RETRY, retry_after_ms=3_600_000, last_error="runtime down"),
        item(first, "gw-1", DELIVERED),
        item(fourth, "gw-1", DELIVERED),  # gw-2 holds it
        item(missing, "gw-1", DELIVERED),
        item(second, "gw-1", DELIVERED),
    )
    got = [(r.wake_id, r.settled, r.error) for r in answer.results]
    assert got == [
        (third, True, ""),
        (first, True, ""),
        (fourth, False, f"the lease on wake {fourth} is no longer held by 'gw-1'"),
        (missing, False, f"wake {missing} not found"),
        (second, True, ""),
    ]
    assert all(r.settled_at.seconds > 0 for r in answer.results if r.settled)
    assert not any(r.HasField("settled_at") for r in answer.results if not r.settled)

    conn = await asyncpg.connect(database_url)
    try:
        rows = {
            str(r["wake_id"]): r
            for r in await conn.fetch(
                "SELECT wake_id, lease_owner, lease_expires_at, delivered_at, last_error, due_at > now() AS later "
                "FROM wake_outbox"
            )
        }
    finally:
        await conn.close()
    for delivered in (first, second):  # as SettleWake DELIVERED leaves it
        row = rows[delivered]
        assert row["delivered_at"] is not None and row["lease_owner"] == "gw-1" and row["lease_expires_at"] is None
    retried = rows[third]  # as SettleWake RETRY leaves it
    assert retried["delivered_at"] is None and retried["lease_owner"] is None and retried["later"]
    assert retried["last_error"] == "runtime down" and retried["lease_expires_at"] is None
    untouched = rows[fourth]
    assert untouched["lease_owner"] == "gw-2" and untouched["delivered_at"] is None
    assert untouched["lease_expires_at"] is not None

    # A repeated DELIVERED from the owner is settled again at the same time; anything else is refused.
    again = await settle_all(room, item(first, "gw-1", DELIVERED), item(second, "gw-2", DELIVERED))
    repeated, other = again.results
    assert repeated.settled and repeated.settled_at == answer.results[1].settled_at
    assert (other.settled, other.error) == (False, f"wake {second} was already delivered")
    retry_delivered = (await settle_all(room, item(first, "gw-1", RETRY))).results[0]
    assert (retry_delivered.settled, retry_delivered.error) == (False, f"wake {first} was already delivered")
    # The retried wake's lease is gone: its old owner cannot deliver on it.
    lost = (await settle_all(room, item(third, "gw-1", DELIVERED))).results[0]
    assert not lost.settled and "no longer held by 'gw-1'" in lost.error
    assert (await settle_all(room, item(fourth, "gw-2", DELIVERED))).results[0].settled
    assert (await room.CountPendingWakes(room_pb2.RoomServiceCountPendingWakesRequest())).pending == 1


async def test_settle_wakes_errors_settle_nothing(room: Stub, world: World) -> None:
    wake = (await post(room, world, "go", [world.bolt_agent.agent_id])).wakes[0].wake_id
    await lease(room, "gw")
    good = item(wake, "gw", DELIVERED)
    await expect_error(INVALID, settle_all(room), "1 to 500")
    too_many = [item(str(uuid.uuid4()), "gw", DELIVERED) for _ in range(501)]
    await expect_error(INVALID, settle_all(room, *too_many), "1 to 500")
    await expect_error(INVALID, settle_all(room, good, good), "more than once")
    await expect_error(INVALID, settle_all(room, good, item("bad", "gw", DELIVERED)), "wakes[1].wake_id")
    await expect_error(INVALID, settle_all(room, good, item(wake, "", DELIVERED)), "lease_owner")
    await expect_error(
        INVALID,
        settle_all(room, good, item(str(uuid.uuid4()), "gw", room_pb2.WAKE_SETTLEMENT_UNSPECIFIED)),
        "settlement",
    )
    await expect_error(
        INVALID, settle_all(room, good, item(str(uuid.uuid4()), "gw", RETRY, retry_after_ms=-1)), "retry_after_ms"
    )
    assert (await room.CountPendingWakes(room_pb2.RoomServiceCountPendingWakesRequest())).pending == 1
    # 500 items are accepted; the unknown ones answer not found.
    full = await settle_all(room, good, *too_many[:499])
    assert [r.settled for r in full.results] == [True] + [False] * 499
    assert (await room.CountPendingWakes(room_pb2.RoomServiceCountPendingWakesRequest())).pending == 0
