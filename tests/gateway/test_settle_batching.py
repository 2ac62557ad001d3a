"""Settling in batches: the delivery loop's settlements go to the Room in SettleWakes calls, one in
flight at a time, the next carrying whatever queued meanwhile; a call that fails leaves the leases
to expire (the wakes are delivered again later; the claim makes that harmless).

Against a real Room and Claims; the Room stub is the real one behind a pass-through that notes
which wakes each settling call carried (and can hold a call back, to queue others behind it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from quayutec.v1 import room_pb2, room_pb2_grpc, runtime_pb2_grpc
from services.gateway.config import DeliveryConfig
from services.gateway.delivery import WakeDelivery
from tests.gateway.conftest import NOWHERE
from tests.gateway.helpers import GatewayStub, eventually
from tests.gateway.runtime_standin import running_standin_runtime
from tests.gateway.test_delivery import pending, post_wakes
from tests.harness.channels import service_channel

DELIVERED, RETRY = room_pb2.WAKE_SETTLEMENT_DELIVERED, room_pb2.WAKE_SETTLEMENT_RETRY


class NotingRoom:
    """The real Room stub; SettleWakes and SettleWake calls are noted (and may wait for ``gate``) first."""

    def __init__(self, stub: room_pb2_grpc.RoomServiceStub) -> None:
        self._stub = stub
        self.settle_calls: list[list[str]] = []
        self.single_settles = 0
        self.gate: asyncio.Event | None = None
        self.called = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    async def SettleWakes(self, request: room_pb2.RoomServiceSettleWakesRequest, **kwargs: Any) -> Any:
        self.settle_calls.append([w.wake_id for w in request.wakes])
        self.called.set()
        if self.gate is not None:
            await self.gate.wait()
        return await self._stub.SettleWakes(request, **kwargs)

    async def SettleWake(self, request: room_pb2.RoomServiceSettleWakeRequest, **kwargs: Any) -> Any:
        self.single_settles += 1
        return await self._stub.SettleWake(request, **kwargs)


@pytest.fixture
async def room_stub(room_addr: str) -> AsyncIterator[room_pb2_grpc.RoomServiceStub]:
    async with service_channel(room_addr, "gateway") as channel:
        yield room_pb2_grpc.RoomServiceStub(channel)


def lease_ends(seconds: float) -> float:
    """When a lease taken now for ``seconds`` ends, on the event loop's clock (as the delivery loop notes it)."""
    return asyncio.get_running_loop().time() + seconds


async def test_settlements_queued_together_go_in_one_call(
    acme_gw: GatewayStub, room_stub: room_pb2_grpc.RoomServiceStub
) -> None:
    await post_wakes(acme_gw, agents=4, messages=5)
    room = NotingRoom(room_stub)
    delivery = WakeDelivery(room, None, DeliveryConfig())
    other = (
        await room_stub.LeaseWakes(
            room_pb2.RoomServiceLeaseWakesRequest(lease_owner="another replica", max_wakes=1, lease_seconds=60)
        )
    ).wakes[0]
    wakes = await delivery._lease(100)
    assert len(wakes) == 19
    # Every delivery queues before the first call goes out: one call carries them all, and the wake
    # whose lease another replica holds is refused (logged) while the others are settled.
    await asyncio.gather(*(delivery._settle(w, lease_ends(60), DELIVERED) for w in [*wakes, other]))
    assert room.settle_calls == [[w.wake_id for w in [*wakes, other]]]
    assert (delivery.delivered, delivery.retried, room.single_settles) == (19, 0, 0)
    assert await pending(room_stub) == 1  # the other replica's


async def test_the_next_call_carries_what_queued_while_one_was_in_flight(
    acme_gw: GatewayStub, room_stub: room_pb2_grpc.RoomServiceStub
) -> None:
    await post_wakes(acme_gw, agents=3, messages=2)
    room = NotingRoom(room_stub)
    delivery = WakeDelivery(room, None, DeliveryConfig())
    first, *rest = await delivery._lease(100)
    room.gate = asyncio.Event()
    settling_first = asyncio.create_task(delivery._settle(first, lease_ends(60), DELIVERED))
    await room.called.wait()  # the first call is out (and held), with the first wake alone
    settling_rest = [
        asyncio.create_task(delivery._settle(w, lease_ends(60), RETRY, error="runtime busy")) for w in rest
    ]
    await asyncio.sleep(0)  # each of those tasks runs up to its wait: its settlement is queued
    assert len(delivery._settle_queue) == len(rest)
    assert len(room.settle_calls) == 1  # one call in flight at a time
    room.gate.set()
    await asyncio.gather(settling_first, *settling_rest)
    assert room.settle_calls == [[first.wake_id], [w.wake_id for w in rest]]
    assert (delivery.delivered, delivery.retried) == (1, 5)
    assert await pending(room_stub) == 5  # due again later, no longer leased
    assert not (
        await room_stub.LeaseWakes(
            room_pb2.RoomServiceLeaseWakesRequest(lease_owner="another replica", max_wakes=10, lease_seconds=60)
        )
    ).wakes  # not due yet: each RETRY set its backoff


async def test_a_room_that_cannot_be_reached_leaves_the_leases_to_expire(
    acme_gw: GatewayStub, room_stub: room_pb2_grpc.RoomServiceStub
) -> None:
    await post_wakes(acme_gw, agents=2, messages=1)
    async with service_channel(NOWHERE, "gateway") as channel:
        unreachable = room_pb2_grpc.RoomServiceStub(channel)
        delivery = WakeDelivery(unreachable, None, DeliveryConfig(lease_seconds=2, start_run_timeout_seconds=1))
        leaser = WakeDelivery(room_stub, None, DeliveryConfig(), lease_owner=delivery.lease_owner)
        wakes = await leaser._lease(100)
        assert len(wakes) == 2
        # Tried again until shortly before the lease ends, then given up without raising.
        await asyncio.gather(*(delivery._settle(w, lease_ends(2), DELIVERED) for w in wakes))
    assert (delivery.delivered, delivery.retried) == (0, 0)
    assert await pending(room_stub) == 2  # still leased by the replica that could not settle them
    assert (await leaser._lease(100)) == []


async def test_the_delivery_loop_settles_every_wake_once_through_settle_wakes(
    database_url: str,
    room_addr: str,
    claims_addr: str,
    acme_gw: GatewayStub,
    room_stub: room_pb2_grpc.RoomServiceStub,
) -> None:
    _, wake_ids = await post_wakes(acme_gw, agents=5, messages=8)
    room = NotingRoom(room_stub)
    async with (
        running_standin_runtime(claims_addr, room_addr) as (runtime_addr, runtime),
        service_channel(runtime_addr, "gateway") as channel,
    ):
        delivery = WakeDelivery(
            room, runtime_pb2_grpc.RuntimeServiceStub(channel), DeliveryConfig(poll_interval_seconds=0.02)
        )
        delivery.start()
        try:
            await eventually(lambda: _none_pending(room_stub))
        finally:
            await delivery.stop()
    settled = [wake_id for call in room.settle_calls for wake_id in call]
    assert sorted(settled) == sorted(wake_ids)  # each wake settled once, in some SettleWakes call
    assert all(1 <= len(call) <= 500 for call in room.settle_calls)
    assert (delivery.delivered, room.single_settles) == (40, 0)
    assert sorted(c.request.wake_id for c in runtime.calls) == sorted(wake_ids)


async def _none_pending(room: room_pb2_grpc.RoomServiceStub) -> bool:
    return await pending(room) == 0
