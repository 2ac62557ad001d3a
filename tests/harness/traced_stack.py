"""The four services as processes (services.stack.LocalStack, as `quayutec up` runs them), exporting
their spans to a real Jaeger exactly as in production: the OTLP/gRPC exporter behind the batch span
processor, configured by the standard ``OTEL_*`` variables alone. Each service is a Jaeger service of
its own (``quayutec-gateway``, ``quayutec-room``, ``quayutec-claims``, ``quayutec-runtime``).

``traced_world`` adds what a flow needs: two companies with API keys, a room both are in, an agent
of the first on the stand-in model provider, and a Gateway client for each company.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from quayutec.db import create_pool
from quayutec.ledger import run_id_for
from quayutec.tls import ADMIN, GATEWAY
from quayutec.v1 import common_pb2, gateway_pb2, room_pb2, room_pb2_grpc
from services.client import GatewayClient
from services.demo import ended_run
from services.gateway.auth import create_api_key
from services.runtime.standin import StandinProvider
from services.stack import LocalStack
from tests.harness.jaeger import Jaeger

SERVICE_NAMES = ("quayutec-gateway", "quayutec-room", "quayutec-claims", "quayutec-runtime")


def otel_env(jaeger: Jaeger | str) -> dict[str, str]:
    """What an operator sets to trace to Jaeger (or to the OTLP/gRPC endpoint ``jaeger`` names): the
    endpoint and the exporter (metrics off: Jaeger takes none). The batch processor's delay is
    shortened so the tests need not wait 5 s per flush."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": jaeger if isinstance(jaeger, str) else jaeger.otlp_grpc,
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }


@asynccontextmanager
async def traced_stack(
    database_url: str, standin: StandinProvider, jaeger: Jaeger | str, extra_env: Mapping[str, str] | None = None
) -> AsyncIterator[LocalStack]:
    """The four services, each its own process, on ``database_url`` (already migrated), exporting to
    ``jaeger`` (or to the OTLP/gRPC endpoint it names); stopped (SIGTERM: each flushes its spans) at the end."""
    folder = Path(tempfile.mkdtemp(prefix="qy-traced-", dir="/tmp"))
    stack = LocalStack.with_ports(
        ephemeral=True,
        extra_env={
            "QUAYUTEC_RUNTIME_ANTHROPIC_BASE_URL": standin.base_url,
            "QUAYUTEC_RUNTIME_OPENAI_BASE_URL": standin.base_url,
            "QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS": "0.1",
            "QUAYUTEC_GATEWAY_POST_RATE": "0",
            **otel_env(jaeger),
            **(extra_env or {}),
        },
        data_dir=folder / "data",
    )
    stack.database_url = database_url
    try:
        await stack.start_all()
        yield stack
    finally:
        stack.stop_all()
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class World:
    stack: LocalStack
    acme: GatewayClient
    bolt: GatewayClient
    acme_key: str
    bolt_key: str
    acme_id: str
    bolt_id: str
    room_id: str
    agent_id: str
    model: str

    async def post(self, body: str, *, key: str = "") -> gateway_pb2.PostMessageResponse:
        """Ana of Acme posts ``body`` mentioning the agent."""
        request = gateway_pb2.PostMessageRequest(
            room_id=self.room_id, person="ana", body=body, mention_agent_ids=[self.agent_id], idempotency_key=key
        )
        response: gateway_pb2.PostMessageResponse = await self.acme.PostMessage(request)
        return response

    async def ended(self, wake_id: str) -> common_pb2.Run:
        return await ended_run(self.acme, run_id_for(self.agent_id, wake_id))


@asynccontextmanager
async def traced_world(stack: LocalStack, standin: StandinProvider) -> AsyncIterator[World]:
    tag = uuid.uuid4().hex[:6]
    async with (
        stack.channel("room", ADMIN) as room_channel,
        stack.channel("gateway", GATEWAY) as gw_channel,
    ):
        room = room_pb2_grpc.RoomServiceStub(room_channel)
        acme = (await room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name=f"Acme-{tag}"))).company
        bolt = (await room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name=f"Bolt-{tag}"))).company
        pool = await create_pool(stack.database_url, min_size=1, max_size=2)
        try:
            _, key_a = await create_api_key(pool, acme.company_id, "traced")
            _, key_b = await create_api_key(pool, bolt.company_id, "traced")
        finally:
            await pool.close()
        a, b = GatewayClient(gw_channel, key_a), GatewayClient(gw_channel, key_b)
        r = (await a.CreateRoom(gateway_pb2.CreateRoomRequest(name=f"traced-{tag}"))).room
        invited = await a.InviteCompany(gateway_pb2.InviteCompanyRequest(room_id=r.room_id, company_id=bolt.company_id))
        await b.AcceptInvitation(gateway_pb2.AcceptInvitationRequest(invitation_id=invited.invitation.invitation_id))
        agent = (
            await a.RegisterAgent(
                gateway_pb2.RegisterAgentRequest(
                    name=f"planner-{tag}",
                    provider=common_pb2.PROVIDER_ANTHROPIC,
                    model=f"traced-{tag}",
                    provider_key="sk-ant-traced-not-a-real-key",
                    system_prompt="You plan launches.",
                )
            )
        ).agent
        yield World(stack, a, b, key_a, key_b, acme.company_id, bolt.company_id, r.room_id, agent.agent_id, agent.model)


def code_of(exc: BaseException) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
