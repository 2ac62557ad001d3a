"""The whole path through the public door: post, wake, delivery, a real Runtime's run, the reply, the ledger."""

from __future__ import annotations

import grpc

from quayutec.v1 import common_pb2, gateway_pb2
from services.runtime.standin import StandinProvider
from tests.gateway.helpers import GatewayStub, create_room, eventually, expect_error, register_agent
from tests.harness.gateway import running_gateway
from tests.harness.runtime import running_runtime

FAST = {"QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS": "0.02", "QUAYUTEC_GATEWAY_POST_RATE": "0"}


async def test_a_mention_becomes_one_run_and_a_reply(
    database_url: str, room_addr: str, claims_addr: str, acme_gw: GatewayStub, globex_gw: GatewayStub
) -> None:
    room = await create_room(acme_gw)
    agent = await register_agent(acme_gw, "helper")
    with StandinProvider() as standin:
        async with (
            running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as runtime_addr,
            running_gateway(database_url, room_addr, runtime_addr, **FAST),
        ):
            posted = await acme_gw.PostMessage(
                gateway_pb2.PostMessageRequest(
                    room_id=room.room_id, person="Ada", body="@helper hello", mention_agent_ids=[agent.agent_id]
                ),
                timeout=10,
            )

            async def ended() -> bool:
                runs = await acme_gw.ListRuns(gateway_pb2.ListRunsRequest(agent_id=agent.agent_id), timeout=10)
                return bool(runs.runs) and runs.runs[0].ended_at.seconds > 0

            await eventually(ended)
    runs = (await acme_gw.ListRuns(gateway_pb2.ListRunsRequest(), timeout=10)).runs
    assert len(runs) == 1
    run = runs[0]
    assert run.wake_id == posted.wake_ids[0] and run.status == common_pb2.RUN_STATUS_SUCCEEDED, run
    assert (await acme_gw.GetRun(gateway_pb2.GetRunRequest(run_id=run.run_id), timeout=10)).run.run_id == run.run_id
    await expect_error(
        grpc.StatusCode.NOT_FOUND, globex_gw.GetRun(gateway_pb2.GetRunRequest(run_id=run.run_id), timeout=10)
    )
    messages = (await acme_gw.ListMessages(gateway_pb2.ListMessagesRequest(room_id=room.room_id), timeout=10)).messages
    assert [m.author.kind for m in messages] == [common_pb2.AUTHOR_KIND_PERSON, common_pb2.AUTHOR_KIND_AGENT]
    assert messages[1].author.agent_id == agent.agent_id and messages[1].run_id == run.run_id
