"""The four services in this process, with one company, one room and one agent, seen through the
public Gateway: what a test of a whole wake (post, delivery, run, reply) starts from."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from quayutec.ledger import run_id_for
from quayutec.v1 import common_pb2, gateway_pb2
from services.runtime.model import RetryPolicy
from services.runtime.standin import StandinProvider
from tests.harness.claims import running_claims
from tests.harness.gateway import CompanyKey, authed_gateway, ended_run, make_company, running_gateway
from tests.harness.room import running_room
from tests.harness.runtime import running_runtime


@dataclass
class Stack:
    gw: Any  # GatewayServiceStub with the company's key
    company: CompanyKey
    room_id: str
    agent_id: str
    model: str

    async def post(self, body: str) -> gateway_pb2.PostMessageResponse:
        """Post ``body`` as the person "ana", mentioning the agent."""
        response: gateway_pb2.PostMessageResponse = await self.gw.PostMessage(
            gateway_pb2.PostMessageRequest(
                room_id=self.room_id, person="ana", body=body, mention_agent_ids=[self.agent_id]
            ),
            timeout=10,
        )
        return response

    async def replied(self, body: str) -> tuple[gateway_pb2.PostMessageResponse, common_pb2.Run]:
        """Post ``body`` (the stand-in's next scripted reply answers it) and wait for the run's end."""
        posted = await self.post(body)
        (wake_id,) = posted.wake_ids
        return posted, await ended_run(self.gw, run_id_for(self.agent_id, wake_id))


@asynccontextmanager
async def wake_stack(
    database_url: str,
    standin: StandinProvider,
    *,
    policy: RetryPolicy | None = None,
    agent: gateway_pb2.RegisterAgentRequest | None = None,
    room_env: dict[str, str] | None = None,
    gateway_env: dict[str, str] | None = None,
) -> AsyncIterator[Stack]:
    """Claims, Room, Runtime (its model the stand-in) and a Gateway polling every 50 ms, company
    "Acme" with room "launch" and ``agent`` (by default a "planner" on a model of its own)."""
    async with (
        running_claims(database_url) as claims_addr,
        running_room(database_url, pool=None, resolver=None, **(room_env or {})) as room_addr,
        running_runtime(claims_addr, room_addr, standin_url=standin.base_url, policy=policy) as runtime_addr,
        running_gateway(
            database_url,
            room_addr,
            runtime_addr,
            QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS="0.05",
            QUAYUTEC_GATEWAY_POST_RATE="0",
            **(gateway_env or {}),
        ) as gateway_addr,
    ):
        company = await make_company(database_url, room_addr, "Acme")
        async with authed_gateway(gateway_addr, company.secret) as gw:
            room = (await gw.CreateRoom(gateway_pb2.CreateRoomRequest(name="launch"), timeout=10)).room
            agent = agent or gateway_pb2.RegisterAgentRequest(
                name="planner",
                provider=common_pb2.PROVIDER_ANTHROPIC,
                model=f"claude-stack-{uuid.uuid4().hex[:8]}",
                provider_key=f"sk-ant-{uuid.uuid4().hex}",
            )
            registered = (await gw.RegisterAgent(agent, timeout=10)).agent
            yield Stack(gw, company, room.room_id, registered.agent_id, registered.model)
