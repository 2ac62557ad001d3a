"""Wiring and lifecycle of the Room service: pool, migrations, store, servicer, gRPC server, event cleanup."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import asyncpg
import grpc

from quayutec.config import ROOM
from quayutec.egress import Resolver
from quayutec.migrate import ROOM as ROOM_COMPONENT
from quayutec.migrate import service_pool
from quayutec.server import GrpcServer
from quayutec.telemetry import record_housekeeping
from quayutec.tls import load_identity
from quayutec.v1 import room_pb2_grpc
from services.room.cleanup import OutboxCleaner
from services.room.config import RoomConfig
from services.room.servicer import RoomServicer
from services.room.store import RoomStore

_log = logging.getLogger("quayutec.room")

# Most events one cleanup statement removes; a full batch is followed at once by another.
EVENT_CLEANUP_BATCH = 10_000


async def clean_events(store: RoomStore, config: RoomConfig, stopping: asyncio.Event) -> None:
    """Removes room events older than the retention, every ``event_cleanup_seconds``, until stopped.
    Every replica may run it: a removed event is simply gone for all."""
    while not stopping.is_set():
        started_ns, removed = time.time_ns(), 0
        try:
            while True:
                pruned = await store.prune_events(config.event_retention_hours * 3600, EVENT_CLEANUP_BATCH)
                removed += pruned
                if pruned < EVENT_CLEANUP_BATCH:
                    break
            record_housekeeping("remove old room events", started_ns, {"removed": removed})
        except Exception as exc:
            _log.warning("removing old room events failed (%s); trying again next interval", type(exc).__name__)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), timeout=config.event_cleanup_seconds)


async def create_server(
    config: RoomConfig, *, pool: asyncpg.Pool | None = None, resolver: Resolver | None = None
) -> GrpcServer:
    """A Room server, not yet started; it opens (and on stop closes) its own pool unless given one.
    ``resolver`` resolves agents' base URL hosts (default: the system's)."""
    identity = load_identity(ROOM.name, config.server.mtls)
    held = await service_pool(config.database, ROOM_COMPONENT, migrate_on_start=config.migrate_on_start, pool=pool)
    pool = held.pool
    store = RoomStore(pool, config.cipher)
    servicer = RoomServicer(store, config.egress, resolver, event_retention_hours=config.event_retention_hours)
    stopping = asyncio.Event()
    cleanup: list[asyncio.Task[None]] = []
    cleaner = OutboxCleaner(
        store,
        keep_seconds=config.delivered_wakes_keep_seconds,
        interval_seconds=config.outbox_cleanup_interval_seconds,
    )

    def register(server: grpc.aio.Server) -> None:
        room_pb2_grpc.add_RoomServiceServicer_to_server(servicer, server)
        cleanup.append(asyncio.create_task(clean_events(store, config, stopping), name="room-event-cleanup"))
        cleaner.start()

    async def on_stop() -> None:
        stopping.set()
        try:
            await cleaner.stop()
            for task in cleanup:
                await task
        finally:
            await held.close()

    return GrpcServer(
        service_names=(ROOM.grpc_service,),
        config=config.server,
        register=register,
        on_stop=on_stop,
        identity=identity,
        health_watch=held.health,
    )


async def main() -> None:
    server = await create_server(RoomConfig.from_env())
    await server.serve_until_signal()
