"""Wiring and lifecycle of the Claims service: pool, migrations, store, servicer, gRPC server."""

from __future__ import annotations

import asyncpg

from quayutec.config import CLAIMS
from quayutec.migrate import CLAIMS as CLAIMS_COMPONENT
from quayutec.migrate import service_pool
from quayutec.server import GrpcServer
from quayutec.tls import load_identity
from quayutec.v1 import claims_pb2_grpc
from services.claims.config import ClaimsConfig
from services.claims.servicer import ClaimsServicer
from services.claims.store import ClaimStore


async def create_server(config: ClaimsConfig, *, pool: asyncpg.Pool | None = None) -> GrpcServer:
    """A Claims server, not yet started; it opens (and on stop closes) its own pool unless given one."""
    identity = load_identity(CLAIMS.name, config.server.mtls)
    held = await service_pool(config.database, CLAIMS_COMPONENT, migrate_on_start=config.migrate_on_start, pool=pool)
    pool = held.pool
    store = ClaimStore(
        pool,
        batch_max=config.batch_max,
        max_batches_in_flight=config.batch_in_flight,
        acquire_timeout_seconds=config.acquire_timeout_seconds,
        test_commit_delay_seconds=config.test_commit_delay_seconds,
    )
    servicer = ClaimsServicer(store)

    return GrpcServer(
        service_names=(CLAIMS.grpc_service,),
        config=config.server,
        register=lambda server: claims_pb2_grpc.add_ClaimsServiceServicer_to_server(servicer, server),
        on_stop=held.close,
        identity=identity,
        health_watch=held.health,
    )


async def main() -> None:
    server = await create_server(ClaimsConfig.from_env())
    await server.serve_until_signal()
