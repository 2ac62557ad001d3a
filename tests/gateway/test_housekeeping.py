"""The Gateway's housekeeping ends runs whose Runtime died (RUNNING rows untouched too long)."""

from __future__ import annotations

import asyncpg

from quayutec.v1 import common_pb2, room_pb2, room_pb2_grpc
from tests.gateway.helpers import GatewayStub, create_room, eventually, register_agent
from tests.gateway.runtime_standin import running_standin_runtime
from tests.harness.channels import service_channel
from tests.harness.gateway import running_gateway


async def test_a_dead_runtimes_run_is_ended_as_abandoned(
    database_url: str, room_addr: str, claims_addr: str, acme_gw: GatewayStub
) -> None:
    room = await create_room(acme_gw)
    agent = await register_agent(acme_gw, "orphaned")
    run = common_pb2.Run(
        run_id="run-orphaned",
        agent_id=agent.agent_id,
        room_id=room.room_id,
        status=common_pb2.RUN_STATUS_RUNNING,
        step=common_pb2.RUN_STEP_CLAIMED,
    )
    async with service_channel(room_addr, "runtime") as channel:
        room_stub = room_pb2_grpc.RoomServiceStub(channel)
        await room_stub.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=run))
        conn = await asyncpg.connect(database_url)
        try:  # its Runtime "died" two minutes ago
            await conn.execute(
                "UPDATE runs SET updated_at = now() - interval '120 seconds' WHERE run_id = $1", run.run_id
            )
        finally:
            await conn.close()

        async def ended() -> bool:
            got = await room_stub.GetRun(room_pb2.RoomServiceGetRunRequest(run_id=run.run_id))
            return bool(got.run.status == common_pb2.RUN_STATUS_FAILED)

        housekeeping = {
            "QUAYUTEC_GATEWAY_EXPIRE_INTERVAL_SECONDS": "0.1",
            "QUAYUTEC_GATEWAY_ABANDON_AFTER_SECONDS": "60",
        }
        async with (
            running_standin_runtime(claims_addr, room_addr) as (runtime_addr, _),
            running_gateway(database_url, room_addr, runtime_addr, **housekeeping),
        ):
            await eventually(ended, within=30)
        final = (await room_stub.GetRun(room_pb2.RoomServiceGetRunRequest(run_id=run.run_id))).run
    assert final.step == common_pb2.RUN_STEP_ENDED
    assert "abandoned" in final.error
