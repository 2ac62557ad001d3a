"""Start a real Room server for tests: ``async with running_room(database_url) as addr: ...``.

The server reads its config through ``RoomConfig.from_env`` from a fixed environment, so
``env_overrides`` take the variable names (``QUAYUTEC_ENCRYPTION_KEY="..."``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import asyncpg

from quayutec.egress import Resolver
from quayutec.v1 import common_pb2, room_pb2
from services.room.config import RoomConfig
from services.room.server import create_server
from tests.harness.channels import TEST_MTLS
from tests.harness.egress import TableResolver

# A fixed key, so servers restarted on one database can read each other's provider keys.
TEST_ENCRYPTION_KEY = "dGVzdC1vbmx5LWtleS1xdWF5dXRlYy1yb29tcy0wMDA="


def room_config(database_url: str, **env_overrides: str) -> RoomConfig:
    """A Room config on 127.0.0.1:0 against ``database_url``, serving mTLS from the test PKI."""
    config = RoomConfig.from_env(
        {
            "DATABASE_URL": database_url,
            "QUAYUTEC_ROOM_LISTEN": "127.0.0.1:0",
            "QUAYUTEC_ROOM_GRACE_SECONDS": "1",
            "QUAYUTEC_ENCRYPTION_KEY": TEST_ENCRYPTION_KEY,
            **env_overrides,
        }
    )
    if config.server.mtls is not None and config.server.mtls.from_files:
        return config
    return replace(config, server=replace(config.server, mtls=TEST_MTLS))


@asynccontextmanager
async def running_room(
    database_url: str, *, pool: asyncpg.Pool | None = None, resolver: Resolver | None = None, **env_overrides: str
) -> AsyncIterator[str]:
    """Yields "127.0.0.1:PORT" of a started Room server; stops it on exit. Agent base URL hosts
    resolve through ``resolver`` (default: the test table; no DNS query leaves the machine)."""
    server = await create_server(
        room_config(database_url, **env_overrides), pool=pool, resolver=resolver or TableResolver()
    )
    port = await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop()


async def add_member(room: Any, room_id: str, company_id: str, *, invited_by: str) -> common_pb2.RoomMember:
    """Make a company a member through the Room as the Gateway does: ``invited_by`` (a member company)
    invites it and it accepts. ``room`` is a RoomServiceStub."""
    invited = await room.CreateInvitation(
        room_pb2.RoomServiceCreateInvitationRequest(
            room_id=room_id, company_id=company_id, invited_by_company_id=invited_by
        ),
        timeout=10,
    )
    accepted = await room.AcceptInvitation(
        room_pb2.RoomServiceAcceptInvitationRequest(
            invitation_id=invited.invitation.invitation_id, company_id=company_id
        ),
        timeout=10,
    )
    member: common_pb2.RoomMember = accepted.member
    return member


# Every table a room's rules guard; a refused write leaves each of them exactly as it was.
GUARDED_TABLES = (
    "messages",
    "tasks",
    "task_updates",
    "memory_lines",
    "files",
    "passages",
    "room_members",
    "room_invitations",
    "agent_rights",
    "waitpoints",
    "held_actions",
    "wake_outbox",
    "room_events",
    "rooms",
)


async def room_state(pool: asyncpg.Pool, tables: tuple[str, ...] = GUARDED_TABLES) -> dict[str, str]:
    """Every row of ``tables`` (names from this module only), as one count and digest per table: equal
    before and after a call when the call wrote nothing there."""
    state = {}
    for table in tables:
        state[table] = await pool.fetchval(
            f"SELECT count(*) || ':' || md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), '')) FROM {table} t"
        )
    return state
