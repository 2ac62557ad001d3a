"""New wakes reach the delivery loop by PostgreSQL notification, not only by its poll."""

from __future__ import annotations

from quayutec.v1 import gateway_pb2, room_pb2, room_pb2_grpc
from tests.gateway.helpers import GatewayStub, create_room, eventually, register_agent
from tests.gateway.runtime_standin import running_standin_runtime
from tests.harness.channels import service_channel
from tests.harness.gateway import running_gateway

# A poll so long that only a notification can deliver within the test's limit.
SLOW_POLL = {"QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS": "600", "QUAYUTEC_GATEWAY_POST_RATE": "0"}


async def test_a_committed_wake_is_delivered_without_waiting_for_the_poll(
    database_url: str, room_addr: str, claims_addr: str, acme_gw: GatewayStub
) -> None:
    room = await create_room(acme_gw)
    agent = await register_agent(acme_gw, "notified")

    async def post(body: str) -> str:
        posted = await acme_gw.PostMessage(
            gateway_pb2.PostMessageRequest(
                room_id=room.room_id, person="Ada", body=body, mention_agent_ids=[agent.agent_id]
            ),
            timeout=10,
        )
        return str(posted.wake_ids[0])

    async with (
        service_channel(room_addr, "gateway") as channel,
        running_standin_runtime(claims_addr, room_addr) as (runtime_addr, runtime),
        running_gateway(database_url, room_addr, runtime_addr, **SLOW_POLL),
    ):
        room_stub = room_pb2_grpc.RoomServiceStub(channel)

        async def delivered(wake_id: str) -> bool:
            pending = await room_stub.CountPendingWakes(room_pb2.RoomServiceCountPendingWakesRequest(), timeout=10)
            return any(c.request.wake_id == wake_id for c in runtime.calls) and pending.pending == 0

        first = await post("first")  # delivered by the loop's first poll or by its notification
        await eventually(lambda: delivered(first), within=30)
        # The loop now idles for 600 s; only the Room's notification can bring this one in time.
        second = await post("second")
        await eventually(lambda: delivered(second), within=30)
    assert [c.request.wake_id for c in runtime.calls] == [first, second]
