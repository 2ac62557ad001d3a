"""Start a real Claims server for tests: ``async with running_claims(database_url) as addr: ...``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import asyncpg

from quayutec.config import DatabaseConfig, ServerConfig
from quayutec.roles import service_role
from quayutec.v1 import claims_pb2_grpc
from services.claims.config import ClaimsConfig
from services.claims.server import create_server
from tests.harness.channels import TEST_MTLS


def claims_config(database_url: str, **overrides: object) -> ClaimsConfig:
    """A Claims config on 127.0.0.1:0 (mTLS from the test PKI) against ``database_url``; ``overrides``
    replace fields."""
    config = ClaimsConfig(
        server=ServerConfig(listen="127.0.0.1:0", grace_seconds=1.0, mtls=TEST_MTLS),
        # As the Claims role, as the service runs (quayutec.roles): the tests see what PostgreSQL allows it.
        database=DatabaseConfig(url=database_url, data_dir=Path(".quayutec"), role=service_role("claims")),
    )
    return replace(config, **overrides)  # type: ignore[arg-type]


@asynccontextmanager
async def running_claims(
    database_url: str, *, pool: asyncpg.Pool | None = None, **overrides: object
) -> AsyncIterator[str]:
    """Yields "127.0.0.1:PORT" of a started Claims server; stops it on exit."""
    server = await create_server(claims_config(database_url, **overrides), pool=pool)
    port = await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop()


def claims_stub(channel: Any) -> claims_pb2_grpc.ClaimsServiceAsyncStub:
    """The typed async stub of ClaimsService on a ``grpc.aio`` channel."""
    return cast("claims_pb2_grpc.ClaimsServiceAsyncStub", claims_pb2_grpc.ClaimsServiceStub(channel))
