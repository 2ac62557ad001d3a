"""Wiring and lifecycle of the Room service: pool, migrations, store, servicer, gRPC server."""

from __future__ import annotations

import asyncpg

from quayutec.config import ROOM
from quayutec.db import open_pool
from quayutec.migrate import ROOM as ROOM_COMPONENT
from quayutec.migrate import migrate
from quayutec.server import GrpcServer
from quayutec.v1 import room_pb2_grpc
from services.room.config import RoomConfig
from services.room.servicer import RoomServicer
from services.room.store import RoomStore


async def create_server(config: RoomConfig, *, pool: asyncpg.Pool | None = None) -> GrpcServer:
    """A Room server, not yet started; it opens (and on stop closes) its own pool unless given one."""
    owned = pool is None
    if pool is None:
        pool = await open_pool(config.database)
    try:
        if config.migrate_on_start:
            await migrate(pool, (ROOM_COMPONENT,))
    except BaseException:
        if owned:
            await pool.close()
        raise
    servicer = RoomServicer(RoomStore(pool, config.cipher))

    async def close_pool() -> None:
        if owned:
            await pool.close()

    return GrpcServer(
        service_names=(ROOM.grpc_service,),
        config=config.server,
        register=lambda server: room_pb2_grpc.add_RoomServiceServicer_to_server(servicer, server),
        on_stop=close_pool,
    )


async def main() -> None:
    server = await create_server(RoomConfig.from_env())
    await server.serve_until_signal()
