"""Provider-key encryption settings, and that schema.sql and the migrations build the same tables."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import asyncpg
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from quayutec.config import ConfigError
from quayutec.crypto import KEY_FILE_NAME, Fernet, load_fernet
from quayutec.migrate import ROOM
from quayutec.v1 import room_pb2, room_pb2_grpc
from tests.harness.channels import service_channel
from tests.harness.room import running_room

ROOM_TABLES = (
    "companies",
    "rooms",
    "room_members",
    "agents",
    "messages",
    "tasks",
    "task_updates",
    "memory_lines",
    "files",
    "passages",
    "runs",
    "wake_outbox",
)


def test_key_from_the_environment() -> None:
    key = Fernet.generate_key().decode()
    cipher = load_fernet({"QUAYUTEC_ENCRYPTION_KEY": key}, Path("/nonexistent"))
    assert Fernet(key.encode()).decrypt(cipher.encrypt(b"sk-1")) == b"sk-1"


def test_rotation_decrypts_with_any_listed_key() -> None:
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    token = load_fernet({"QUAYUTEC_ENCRYPTION_KEY": old}, Path("/x")).encrypt(b"sk-old")
    rotated = load_fernet({"QUAYUTEC_ENCRYPTION_KEY": f"{new},{old}"}, Path("/x"))
    assert rotated.decrypt(token) == b"sk-old"
    assert Fernet(new.encode()).decrypt(rotated.encrypt(b"sk-new")) == b"sk-new"


@pytest.mark.parametrize("bad", ["short", "not base64 at all!!", "é" * 44])
def test_a_malformed_key_names_the_variable(bad: str) -> None:
    with pytest.raises(ConfigError, match="QUAYUTEC_ENCRYPTION_KEY"):
        load_fernet({"QUAYUTEC_ENCRYPTION_KEY": bad}, Path("/x"))


def test_without_the_variable_a_0600_key_file_is_made_once_and_shared(tmp_path: Path) -> None:
    first = load_fernet({}, tmp_path / "data")
    path = tmp_path / "data" / KEY_FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    second = load_fernet({}, tmp_path / "data")
    assert second.decrypt(first.encrypt(b"sk-shared")) == b"sk-shared"
    assert [p.name for p in path.parent.iterdir()] == [KEY_FILE_NAME]  # no temporary file left behind


def test_a_key_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    load_fernet({}, tmp_path)
    os.chmod(tmp_path / KEY_FILE_NAME, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_fernet({}, tmp_path)


async def _describe(url: str) -> list[tuple[str, ...]]:
    conn = await asyncpg.connect(url)
    try:
        columns = await conn.fetch(
            """SELECT table_name, column_name, data_type, is_nullable, coalesce(column_default, ''),
                      coalesce(generation_expression, ''), is_identity
               FROM information_schema.columns WHERE table_schema = 'public' AND table_name = ANY($1::text[])""",
            list(ROOM_TABLES),
        )
        indexes = await conn.fetch(
            "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE tablename = ANY($1::text[])", list(ROOM_TABLES)
        )
        constraints = await conn.fetch(
            """SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint
               WHERE conrelid::regclass::text = ANY($1::text[])""",
            list(ROOM_TABLES),
        )
    finally:
        await conn.close()
    return sorted(tuple(str(v) for v in r) for r in [*columns, *indexes, *constraints])


async def test_schema_sql_matches_the_migrations(database_url: str, empty_database_url: str) -> None:
    conn = await asyncpg.connect(empty_database_url)
    try:
        await conn.execute(ROOM.schema_path.read_text(encoding="utf-8"))
    finally:
        await conn.close()
    from_schema = await _describe(empty_database_url)
    from_migrations = await _describe(database_url)
    assert from_schema == from_migrations
    assert {r[0] for r in from_schema} >= set(ROOM_TABLES)


async def test_a_room_server_migrates_an_empty_database_on_start(empty_database_url: str) -> None:
    async with running_room(empty_database_url) as addr, service_channel(addr, "admin") as channel:
        stub = room_pb2_grpc.RoomServiceStub(channel)
        made = await stub.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name="Acme"))
        assert made.company.name == "Acme"
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(service="quayutec.v1.RoomService"))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
