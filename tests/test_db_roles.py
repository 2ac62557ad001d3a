"""The database enforces what it can (quayutec.roles): each service's sessions act as a role of its
own that may touch only its own tables, and the Claims role may insert and read claims but never
update, delete or truncate one: PostgreSQL refuses it, however the statement is spelled."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from quayutec import roles
from quayutec.config import DatabaseConfig
from quayutec.db import create_pool, open_pool
from quayutec.migrate import CLAIMS, COMPONENTS, VERSION_TABLE_SQL, migrate
from services.claims.config import ClaimsConfig

TABLES = {c.name: roles.tables_of(c.schema_path.read_text("utf-8")) for c in COMPONENTS}


@pytest.fixture
async def claims_pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await create_pool(database_url, min_size=1, max_size=1, role=roles.service_role("claims"))
    yield pool
    await pool.close()


async def test_the_claims_role_may_claim_and_read_but_never_release_a_claim(
    claims_pool: asyncpg.Pool, database_url: str
) -> None:
    agent_id, wake_id = f"agent-{uuid.uuid4()}", f"wake-{uuid.uuid4()}"
    assert await claims_pool.fetchval("SELECT current_user") == "quayutec_claims"
    await claims_pool.execute("INSERT INTO agent_run_locks (agent_id, wake_id) VALUES ($1, $2)", agent_id, wake_id)
    assert await claims_pool.fetchval("SELECT count(*) FROM agent_run_locks WHERE wake_id = $1", wake_id) == 1
    refused = [
        "DELETE FROM agent_run_locks WHERE wake_id = $1",
        'DELETE FROM "agent_run_locks" WHERE wake_id = $1',  # the spelling a regular expression missed
        "DELETE FROM public.agent_run_locks WHERE wake_id = $1",
        "UPDATE agent_run_locks SET claimant = 'someone else' WHERE wake_id = $1",
        "UPDATE agent_run_locks SET wake_id = wake_id || '-released' WHERE wake_id = $1",
    ]
    for statement in refused:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await claims_pool.execute(statement, wake_id)
    escapes = ("TRUNCATE agent_run_locks", "DROP TABLE agent_run_locks", "RESET ROLE; DELETE FROM agent_run_locks")
    for statement in escapes:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await claims_pool.execute(statement)
    # The claim is still there, as the owner sees it.
    admin = await asyncpg.connect(database_url)
    try:
        assert await admin.fetchval("SELECT count(*) FROM agent_run_locks WHERE wake_id = $1", wake_id) == 1
    finally:
        await admin.close()


async def test_each_service_role_touches_only_its_own_tables(database_url: str) -> None:
    assert all(TABLES.values()) and "api_keys" in TABLES["gateway"] and "messages" in TABLES["room"]
    for service, role in roles.SERVICE_ROLES.items():
        pool = await create_pool(database_url, min_size=1, max_size=1, role=role)
        try:
            for owner, tables in TABLES.items():
                for table in tables:
                    if owner == service:
                        await pool.fetch(f'SELECT * FROM "{table}" LIMIT 1')
                    else:
                        with pytest.raises(asyncpg.InsufficientPrivilegeError):
                            await pool.fetch(f'SELECT * FROM "{table}" LIMIT 1')
                        with pytest.raises(asyncpg.InsufficientPrivilegeError):
                            await pool.execute(f'DELETE FROM "{table}"')
            # Every role reads the schema's version, and none may change it or make a table.
            assert await pool.fetchval("SELECT count(*) FROM quayutec_schema_migrations") > 0
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await pool.execute("DELETE FROM quayutec_schema_migrations")
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await pool.execute("CREATE TABLE not_ours (id int)")
        finally:
            await pool.close()


async def test_a_service_pool_from_its_settings_runs_as_its_role(database_url: str) -> None:
    """ClaimsConfig.from_env gives the Claims service its role, and its pool acts as it."""
    config = ClaimsConfig.from_env({"DATABASE_URL": database_url, "QUAYUTEC_CLAIMS_LISTEN": "127.0.0.1:0"})
    assert config.database.role == "quayutec_claims"
    assert DatabaseConfig.from_env({}).role is None  # the admin commands act as their login
    pool = await open_pool(config.database)
    try:
        assert await pool.fetchval("SELECT current_user") == "quayutec_claims"
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await pool.execute("DELETE FROM agent_run_locks")
    finally:
        await pool.close()


async def test_migrations_hand_tables_made_before_the_roles_to_the_owner(empty_database_url: str) -> None:
    """A database migrated before the roles existed (its tables owned by the login) gets them on the
    next migration: the owner role owns every table and each service role its grants."""
    conn = await asyncpg.connect(empty_database_url)
    try:
        # The Claims component as it was migrated before the roles: by the login, owning its tables.
        await conn.execute(VERSION_TABLE_SQL)
        for migration in CLAIMS.migrations():
            await conn.execute(migration.path.read_text("utf-8"))
            await conn.execute(
                "INSERT INTO quayutec_schema_migrations (component, version, name) VALUES ($1, $2, $3)",
                migration.component,
                migration.version,
                migration.name,
            )
        owner = "SELECT tableowner FROM pg_tables WHERE tablename = 'agent_run_locks'"
        assert await conn.fetchval(owner) != roles.OWNER
        pool = await create_pool(empty_database_url, min_size=1, max_size=1)
        try:
            await migrate(pool)
        finally:
            await pool.close()
        owners = dict(
            await conn.fetch(
                "SELECT tablename, tableowner FROM pg_tables"
                " WHERE schemaname = 'public' AND tablename = ANY($1::text[])",
                [t for ts in TABLES.values() for t in ts] + [roles.VERSION_TABLE],
            )
        )
        assert set(owners.values()) == {roles.OWNER}, owners
        assert await conn.fetchval("SELECT has_table_privilege('quayutec_claims', 'agent_run_locks', 'INSERT')")
        assert not await conn.fetchval("SELECT has_table_privilege('quayutec_claims', 'agent_run_locks', 'DELETE')")
    finally:
        await conn.close()


def test_the_claims_tables_are_listed_from_its_schema() -> None:
    assert roles.tables_of((Path(__file__).parent.parent / "services/claims/sql/schema.sql").read_text()) == [
        "agent_run_locks"
    ]
    assert roles.privileges_on("agent_run_locks") == ("SELECT", "INSERT")
