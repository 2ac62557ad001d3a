"""Wiring and lifecycle of the Room service: pool, migrations, store, servicer, gRPC server."""

from __future__ import annotations

import asyncpg

from quayutec.config import ROOM
from quayutec.migrate import ROOM as ROOM_COMPONENT
from quayutec.migrate import service_pool
from quayutec.server import GrpcServer
from quayutec.tls import load_identity
from quayutec.v1 import room_pb2_grpc
from services.room.cleanup import OutboxCleaner
from services.room.config import RoomConfig
from services.room.servicer import RoomServicer
from services.room.store import RoomStore


async def create_server(config: RoomConfig, *, pool: asyncpg.Pool | None = None) -> GrpcServer:
    """A Room server, not yet started; it opens (and on stop closes) its own pool unless given one."""
    identity = load_identity(ROOM.name, config.server.mtls)
    held = await service_pool(config.database, ROOM_COMPONENT, migrate_on_start=config.migrate_on_start, pool=pool)
    pool = held.pool
    store = RoomStore(pool, config.cipher)
    servicer = RoomServicer(store)
    cleaner = OutboxCleaner(
        store,
        keep_seconds=config.delivered_wakes_keep_seconds,
        interval_seconds=config.outbox_cleanup_interval_seconds,
    )
    cleaner.start()

    async def on_stop() -> None:
        await cleaner.stop()
        await held.close()

    return GrpcServer(
        service_names=(ROOM.grpc_service,),
        config=config.server,
        register=lambda server: room_pb2_grpc.add_RoomServiceServicer_to_server(servicer, server),
        on_stop=on_stop,
        identity=identity,
    )


async def main() -> None:
    server = await create_server(RoomConfig.from_env())
    await server.serve_until_signal()
