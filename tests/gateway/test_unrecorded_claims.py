"""Delivery hides no lost wake, and recovers soon after an outage.

An ALREADY_CLAIMED answer whose run has no ledger row (the claim's run stopped before it read the
room; here a stand-in Runtime that cannot take a claim over, like a Runtime of before the fence)
is logged, counted (quayutec.wakes.unrecorded_claims) and delivered again, and housekeeping records
the run NOT_STARTED; a Runtime of today then takes the wake over and acts on it, once. Settlements
refused while the Room is down are tried again until shortly before their leases end, so a Room
back from an outage settles them at once rather than after the lease.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from quayutec.ledger import run_id_for
from quayutec.telemetry import METER_NAME, Metrics
from quayutec.v1 import claims_pb2, claims_pb2_grpc, common_pb2, room_pb2, room_pb2_grpc, runtime_pb2_grpc
from services.gateway.config import DeliveryConfig
from services.gateway.delivery import WakeDelivery
from services.runtime.standin import StandinProvider
from services.stack import free_port
from tests.gateway.helpers import GatewayStub, eventually
from tests.gateway.runtime_standin import running_standin_runtime
from tests.gateway.test_delivery import FAST, pending, post_wakes, room_stub
from tests.harness.channels import service_channel
from tests.harness.gateway import authed_gateway, make_company, running_gateway
from tests.harness.room import running_room
from tests.harness.runtime import running_runtime

__all__ = ["room_stub"]  # a fixture of the delivery tests, used here

DELIVERED = room_pb2.WAKE_SETTLEMENT_DELIVERED


async def test_an_already_claimed_wake_whose_run_has_no_row_is_counted_recorded_and_then_finished(
    database_url: str,
    room_addr: str,
    claims_addr: str,
    acme_gw: GatewayStub,
    room_stub: room_pb2_grpc.RoomServiceStub,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="quayutec.gateway.delivery")
    await post_wakes(acme_gw, agents=1, messages=1)
    leased = await room_stub.LeaseWakes(
        room_pb2.RoomServiceLeaseWakesRequest(lease_owner="a dead replica", max_wakes=1, lease_seconds=1), timeout=10
    )
    (wake,) = leased.wakes
    run_id = run_id_for(wake.agent_id, wake.wake_id)
    # A Runtime claimed it and died before its run read the room: a claim, no ledger row.
    async with service_channel(claims_addr, "runtime") as channel:
        claims = claims_pb2_grpc.ClaimsServiceStub(channel)
        await claims.ClaimOnce(claims_pb2.ClaimOnceRequest(agent_id=wake.agent_id, wake_id=wake.wake_id), timeout=10)

    reader = InMemoryMetricReader()
    metrics = Metrics(MeterProvider(metric_readers=[reader]).get_meter(METER_NAME))
    config = DeliveryConfig(
        poll_interval_seconds=0.02,
        backoff_base_seconds=0.05,
        backoff_ceiling_seconds=0.2,
        expire_interval_seconds=0.05,
        not_started_after_seconds=1,
    )
    async with (
        running_standin_runtime(claims_addr, room_addr) as (runtime_addr, runtime),
        service_channel(runtime_addr, "gateway") as channel,
    ):
        delivery = WakeDelivery(room_stub, runtime_pb2_grpc.RuntimeServiceStub(channel), config, metrics=metrics)
        delivery.start()

        async def recorded_and_delivered_again() -> bool:
            try:
                got = await room_stub.GetRun(room_pb2.RoomServiceGetRunRequest(run_id=run_id), timeout=10)
            except grpc.aio.AioRpcError:
                return False
            return (
                got.run.status == common_pb2.RUN_STATUS_NOT_STARTED
                and runtime.answers("ALREADY_CLAIMED")[wake.wake_id] >= 3
            )

        try:
            await eventually(recorded_and_delivered_again)
        finally:
            await delivery.stop()
    answered = runtime.answers("ALREADY_CLAIMED")[wake.wake_id]
    assert delivery.unrecorded_claims == answered  # every one of them
    counted = [
        getattr(point, "value", None)
        for resource in reader.get_metrics_data().resource_metrics  # type: ignore[union-attr]
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "quayutec.wakes.unrecorded_claims"
        for point in metric.data.data_points
    ]
    assert counted == [answered]
    assert await pending(room_stub) == 1  # not marked delivered: nothing was done
    warned = [
        r.getMessage() for r in caplog.records if "StartRun answered ALREADY_CLAIMED but its run" in r.getMessage()
    ]
    assert len(warned) == answered
    row = (await room_stub.GetRun(room_pb2.RoomServiceGetRunRequest(run_id=run_id), timeout=10)).run
    assert row.error.startswith("not started: the wake was delivered")

    # A Runtime of today takes the claim over: its run reads the room and acts, once.
    with StandinProvider() as model:
        async with (
            running_runtime(claims_addr, room_addr, standin_url=model.base_url) as runtime_addr,
            running_gateway(database_url, room_addr, runtime_addr, **FAST),
        ):

            async def ended() -> bool:
                got = await room_stub.GetRun(room_pb2.RoomServiceGetRunRequest(run_id=run_id), timeout=10)
                return bool(got.run.step == common_pb2.RUN_STEP_ENDED)

            await eventually(ended)
            await eventually(lambda: _none_pending(room_stub))
        requests = len(model.requests())
    run = (await room_stub.GetRun(room_pb2.RoomServiceGetRunRequest(run_id=run_id), timeout=10)).run
    assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
    assert run.attempt and run.posted_message_id
    assert requests == 1


async def test_an_already_claimed_answer_saying_the_row_is_held_is_delivered_without_reading_the_row(
    claims_addr: str, room_addr: str, acme_gw: GatewayStub, room_stub: room_pb2_grpc.RoomServiceStub
) -> None:
    """A fenced Runtime's ALREADY_CLAIMED says the row is held (row_held): the Gateway settles the wake
    delivered on that answer, once, without reading the run's row (here there is none to read: a
    Gateway that read it would count an unrecorded claim and deliver the wake again)."""
    await post_wakes(acme_gw, agents=1, messages=1)
    leased = await room_stub.LeaseWakes(
        room_pb2.RoomServiceLeaseWakesRequest(lease_owner="a dead replica", max_wakes=1, lease_seconds=1), timeout=10
    )
    (wake,) = leased.wakes
    config = DeliveryConfig(poll_interval_seconds=0.02, backoff_base_seconds=0.05, backoff_ceiling_seconds=0.2)
    async with (
        running_standin_runtime(claims_addr, room_addr) as (runtime_addr, runtime),
        service_channel(runtime_addr, "gateway") as channel,
    ):
        runtime.script(wake.wake_id, "ROW_HELD")
        delivery = WakeDelivery(room_stub, runtime_pb2_grpc.RuntimeServiceStub(channel), config)
        delivery.start()
        try:
            await eventually(lambda: _none_pending(room_stub))
        finally:
            await delivery.stop()
    assert [c.answer for c in runtime.calls if c.request.wake_id == wake.wake_id] == ["ROW_HELD"]
    assert (delivery.delivered, delivery.unrecorded_claims) == (1, 0)


async def test_settlements_refused_while_the_room_is_down_land_when_it_is_back(database_url: str) -> None:
    """The Room is down for longer than a settlement used to be tried (5 s), well inside the lease:
    each settlement lands when the Room is back, by the delivery that made it (no lease expired)."""
    listen = f"127.0.0.1:{free_port()}"
    backoff = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 300)]
    async with running_room(database_url, QUAYUTEC_ROOM_LISTEN=listen) as room_addr:
        acme = await make_company(database_url, room_addr, "Acme")
        async with (
            running_gateway(database_url, room_addr, "127.0.0.1:9", QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false") as gw,
            authed_gateway(gw, acme.secret) as acme_gw,
        ):
            await post_wakes(acme_gw, agents=3, messages=2)
    async with service_channel(listen, "gateway", options=backoff) as channel:
        room = room_pb2_grpc.RoomServiceStub(channel)
        delivery = WakeDelivery(room, None, DeliveryConfig(lease_seconds=60))
        async with running_room(database_url, QUAYUTEC_ROOM_LISTEN=listen):
            wakes = await delivery._lease(100)
        assert len(wakes) == 6
        lease_ends = asyncio.get_running_loop().time() + 60
        settling = [asyncio.create_task(delivery._settle(w, lease_ends, DELIVERED)) for w in wakes]
        await asyncio.sleep(6.0)  # the outage: the settlements are refused UNAVAILABLE meanwhile
        assert not any(task.done() for task in settling)
        async with running_room(database_url, QUAYUTEC_ROOM_LISTEN=listen):
            await asyncio.gather(*settling)
            assert delivery.delivered == 6
            assert await pending(room) == 0
            again = await room.LeaseWakes(
                room_pb2.RoomServiceLeaseWakesRequest(lease_owner="another", max_wakes=10, lease_seconds=60)
            )
            assert list(again.wakes) == []


async def _none_pending(room: room_pb2_grpc.RoomServiceStub) -> bool:
    return await pending(room) == 0
