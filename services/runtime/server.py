"""Runtime wiring and lifecycle: channels and HTTP client, executor, servicer, server."""

from __future__ import annotations

import asyncio
import signal

import grpc
import httpcore
import httpx

from quayutec.channels import internal_channel
from quayutec.config import CLAIMS, ROOM, RUNTIME
from quayutec.egress import Resolver
from quayutec.server import GrpcServer
from quayutec.tls import load_identity
from quayutec.v1 import claims_pb2_grpc, room_pb2_grpc, runtime_pb2_grpc
from services.runtime.backend import RetryingRoom
from services.runtime.capacity import ensure_fd_budget
from services.runtime.claims_client import ClaimsClient
from services.runtime.config import RuntimeConfig
from services.runtime.model import Clock, RealClock, RetryPolicy, make_http_client, make_owner_http_client
from services.runtime.run import RunExecutor
from services.runtime.servicer import RuntimeServicer


async def create_server(
    config: RuntimeConfig,
    *,
    http: httpx.AsyncClient | None = None,
    clock: Clock | None = None,
    policy: RetryPolicy | None = None,
    resolver: Resolver | None = None,
    dialer: httpcore.AsyncNetworkBackend | None = None,
) -> GrpcServer:
    """The Runtime server; it owns (and closes) its channels and, unless given one, its HTTP client.

    Owner-supplied base URLs go through a second client whose transport applies the egress policy
    to the address it dials; ``resolver`` and ``dialer`` replace the system's there (tests)."""
    identity = load_identity(RUNTIME.name, config.server.mtls)
    own_http = http is None
    http_client = http or make_http_client(config.model_timeout_seconds, max_connections=config.max_runs)
    owner_http = make_owner_http_client(
        config.model_timeout_seconds,
        config.egress,
        max_connections=config.max_runs,
        resolver=resolver,
        dialer=dialer,
    )
    # No transparent retries: the executor retries what is safe to repeat itself (services.runtime.backend).
    claims_channel = internal_channel(
        config.claims_addr, identity=identity, server=CLAIMS.name, retry_unavailable=False
    )
    room_channel = internal_channel(config.room_addr, identity=identity, server=ROOM.name, retry_unavailable=False)
    # Concurrent claims share one ClaimMany call (services.runtime.claims_client).
    claims = ClaimsClient(claims_pb2_grpc.ClaimsServiceStub(claims_channel))
    executor = RunExecutor(
        config=config,
        claims=claims,
        room=RetryingRoom(room_pb2_grpc.RoomServiceStub(room_channel), retry_seconds=config.room_retry_seconds),
        http=http_client,
        owner_http=owner_http,
        policy=policy or RetryPolicy(),
        clock=clock or RealClock(),
    )

    def register(server: grpc.aio.Server) -> None:
        runtime_pb2_grpc.add_RuntimeServiceServicer_to_server(RuntimeServicer(executor), server)

    if config.failpoints:  # crash tests let runs paused at a failpoint go on with SIGUSR1
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, executor.release_failpoints)

    async def on_stop() -> None:
        if config.failpoints:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR1)
        await executor.shutdown(config.server.grace_seconds)
        await claims.close()
        await claims_channel.close()
        await room_channel.close()
        if own_http:
            await http_client.aclose()
        await owner_http.aclose()

    return GrpcServer(
        service_names=[RUNTIME.grpc_service],
        config=config.server,
        register=register,
        on_stop=on_stop,
        identity=identity,
    )


async def main() -> None:
    config = RuntimeConfig.from_env()
    ensure_fd_budget(config.max_runs)
    server = await create_server(config)
    await server.serve_until_signal()
