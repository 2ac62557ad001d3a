"""What every database session of ours asks of PostgreSQL (quayutec.db.create_pool): a transaction
left open and silent, as when a replica is cut off from the database before its COMMIT arrives, is
ended by the server after QUAYUTEC_DB_IDLE_IN_TRANSACTION_SECONDS and its locks released, so the
other replicas' writes to the same rows go on.

Found by the cluster bed: host a cut from the database for 9 s left one of Room's transactions open
on the server (its client gone, its COMMIT lost), holding the room's sequence row; every later post
to that room waited on it for over a minute, until the bed stopped."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from pathlib import Path

import asyncpg
import grpc
import pytest

from quayutec.config import ConfigError, DatabaseConfig
from quayutec.db import create_pool, open_pool
from quayutec.errors import status_for

# Bounds on waits that end when PostgreSQL acts (never asserted as timings).
WAIT_SECONDS = 30.0


async def session_timeout(pool: asyncpg.Pool) -> str:
    return str(await pool.fetchval("SHOW idle_in_transaction_session_timeout"))


def test_the_setting_is_read_and_checked() -> None:
    assert DatabaseConfig.from_env({}).idle_in_transaction_seconds == 10.0
    shorter = DatabaseConfig.from_env({"QUAYUTEC_DB_IDLE_IN_TRANSACTION_SECONDS": "2.5"})
    assert shorter.idle_in_transaction_seconds == 2.5
    for bad, says in (("-1", "at least 0"), ("nan", "finite"), ("inf", "finite"), ("soon", "a number")):
        with pytest.raises(ConfigError) as refused:
            DatabaseConfig.from_env({"QUAYUTEC_DB_IDLE_IN_TRANSACTION_SECONDS": bad})
        assert "QUAYUTEC_DB_IDLE_IN_TRANSACTION_SECONDS" in str(refused.value) and says in str(refused.value)


def test_the_plan_cache_mode_is_read_and_checked() -> None:
    assert DatabaseConfig.from_env({}).plan_cache_mode == "force_generic_plan"
    assert DatabaseConfig.from_env({"QUAYUTEC_DB_PLAN_CACHE_MODE": "auto"}).plan_cache_mode == "auto"
    with pytest.raises(ConfigError) as refused:
        DatabaseConfig.from_env({"QUAYUTEC_DB_PLAN_CACHE_MODE": "generic"})
    assert "QUAYUTEC_DB_PLAN_CACHE_MODE must be one of force_generic_plan, auto, force_custom_plan" in str(
        refused.value
    )


async def test_every_service_pool_plans_as_configured(database_url: str) -> None:
    config = DatabaseConfig(url=database_url, data_dir=Path("."), pool_min=1, pool_max=1)
    generic, auto = await open_pool(config), await open_pool(replace(config, plan_cache_mode="auto"))
    try:
        assert await generic.fetchval("SHOW plan_cache_mode") == "force_generic_plan"
        assert await auto.fetchval("SHOW plan_cache_mode") == "auto"
        # A statement prepared on a forced session is planned once, for any value: its plan keeps the
        # parameter ($1); under auto its first executions are planned for their value (7).
        for pool, shows in ((generic, "$1"), (auto, "7")):
            async with pool.acquire() as conn:
                await conn.execute("PREPARE probe_plan(int) AS SELECT n FROM generate_series(1, 10) AS n WHERE n = $1")
                plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN EXECUTE probe_plan(7)"))
                await conn.execute("DEALLOCATE probe_plan")
            assert f"(n = {shows})" in plan, plan
    finally:
        await generic.close()
        await auto.close()


async def test_every_service_pool_carries_the_timeout(database_url: str) -> None:
    default = await open_pool(DatabaseConfig(url=database_url, data_dir=Path("."), pool_min=1, pool_max=2))
    off = await open_pool(
        DatabaseConfig(url=database_url, data_dir=Path("."), pool_min=1, pool_max=2, idle_in_transaction_seconds=0)
    )
    try:
        assert await session_timeout(default) == "10s"
        assert await session_timeout(off) == "0"
    finally:
        await default.close()
        await off.close()


async def test_a_transaction_whose_commit_never_comes_releases_its_locks(database_url: str) -> None:
    table = f"idle_probe_{uuid.uuid4().hex[:8]}"
    setup = await asyncpg.connect(database_url)
    await setup.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, n int NOT NULL)")
    await setup.execute(f"INSERT INTO {table} VALUES (1, 0)")
    cut_off = await create_pool(database_url, min_size=1, max_size=1, idle_in_transaction_seconds=1.0)
    others = await create_pool(database_url, min_size=1, max_size=1)
    try:
        assert await session_timeout(cut_off) == "1s"
        stalled = await cut_off.acquire()
        # The replica's transaction takes the row, then nothing more arrives from it: to PostgreSQL this
        # is what a COMMIT lost in a partition looks like.
        await stalled.execute("BEGIN")
        await stalled.execute(f"UPDATE {table} SET n = n + 1 WHERE id = 1")
        # Another replica's write to the same row waits for that lock, then goes on once the server
        # has ended the silent session (bounded: it would otherwise wait for as long as TCP takes).
        async with asyncio.timeout(WAIT_SECONDS):
            await others.execute(f"UPDATE {table} SET n = n + 10 WHERE id = 1")
        assert await others.fetchval(f"SELECT n FROM {table} WHERE id = 1") == 10  # the lost one rolled back
        # The session that went silent learns it is over at its next word; nothing of it was kept, so
        # the caller is told UNAVAILABLE (retry), like any lost connection, never INTERNAL.
        with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError, ConnectionError)) as ended:
            await stalled.execute("COMMIT")
        assert status_for(ended.value) == (grpc.StatusCode.UNAVAILABLE, "the database is unavailable; retry later")
        await cut_off.release(stalled)
        assert await cut_off.fetchval(f"SELECT n FROM {table} WHERE id = 1") == 10  # the pool recovers
    finally:
        await cut_off.close()
        await others.close()
        await setup.execute(f"DROP TABLE {table}")
        await setup.close()


def test_the_statement_bounds_are_read_and_refused_out_of_range() -> None:
    default = DatabaseConfig.from_env({})
    assert (default.statement_timeout_seconds, default.client_check_seconds) == (30.0, 2.0)
    set_ = DatabaseConfig.from_env(
        {"QUAYUTEC_DB_STATEMENT_TIMEOUT_SECONDS": "12", "QUAYUTEC_DB_CLIENT_CHECK_SECONDS": "0"}
    )
    assert (set_.statement_timeout_seconds, set_.client_check_seconds) == (12.0, 0.0)
    refused = (
        ({"QUAYUTEC_DB_STATEMENT_TIMEOUT_SECONDS": "0"}, "QUAYUTEC_DB_STATEMENT_TIMEOUT_SECONDS must be at least 0.1"),
        ({"QUAYUTEC_DB_STATEMENT_TIMEOUT_SECONDS": "31"}, "exceeds QUAYUTEC_DB_COMMAND_TIMEOUT_SECONDS (30)"),
        (
            {"QUAYUTEC_DB_STATEMENT_TIMEOUT_SECONDS": "20", "QUAYUTEC_DB_COMMAND_TIMEOUT_SECONDS": "10"},
            "QUAYUTEC_DB_STATEMENT_TIMEOUT_SECONDS (20) exceeds",
        ),
        ({"QUAYUTEC_DB_CLIENT_CHECK_SECONDS": "-1"}, "QUAYUTEC_DB_CLIENT_CHECK_SECONDS must be at least 0"),
        ({"QUAYUTEC_DB_CLIENT_CHECK_SECONDS": "61"}, "QUAYUTEC_DB_CLIENT_CHECK_SECONDS must be at most 60"),
    )
    for env, says in refused:
        with pytest.raises(ConfigError) as error:
            DatabaseConfig.from_env(env)
        assert says in str(error.value), error.value


async def test_every_service_pool_bounds_its_statements_on_the_server(database_url: str) -> None:
    config = DatabaseConfig(url=database_url, data_dir=Path("."), pool_min=1, pool_max=1)
    default, set_ = (
        await open_pool(config),
        await open_pool(replace(config, statement_timeout_seconds=1.5, client_check_seconds=0)),
    )
    try:
        assert await default.fetchval("SHOW statement_timeout") == "30s"
        assert await default.fetchval("SHOW client_connection_check_interval") == "2s"
        assert await set_.fetchval("SHOW statement_timeout") == "1500ms"
        assert await set_.fetchval("SHOW client_connection_check_interval") == "0"
        # The server ends a statement that waits past the bound, however long its caller would wait.
        with pytest.raises(asyncpg.QueryCanceledError):
            await set_.fetchval("SELECT pg_sleep(60)", timeout=WAIT_SECONDS)
    finally:
        await default.close()
        await set_.close()


async def test_a_cancelled_call_cancels_its_statement_in_the_server(database_url: str) -> None:
    # The server's own bounds off, so that only the cancel request can end the statement: a statement
    # waiting on a row lock whose call is cancelled must not commit once the lock is released.
    pool = await create_pool(
        database_url, min_size=1, max_size=1, client_check_seconds=0, statement_timeout_seconds=600, command_timeout=600
    )
    holder = await asyncpg.connect(database_url)
    table = f"cancel_probe_{uuid.uuid4().hex[:8]}"
    try:
        await holder.execute(f"CREATE TABLE {table} (n int PRIMARY KEY, v int NOT NULL)")
        await holder.execute(f"INSERT INTO {table} VALUES (1, 0)")
        lock = holder.transaction()
        await lock.start()
        await holder.execute(f"SELECT 1 FROM {table} WHERE n = 1 FOR UPDATE")
        call = asyncio.ensure_future(pool.execute(f"UPDATE {table} SET v = 1 WHERE n = 1"))
        waiting = (
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_SECONDS
        while await holder.fetchval(waiting) != 1:
            assert loop.time() < deadline, "the update never waited on the lock"
            await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        deadline = loop.time() + WAIT_SECONDS
        while await holder.fetchval(waiting) != 0:
            assert loop.time() < deadline, "the cancelled call's statement still waits in PostgreSQL"
            await asyncio.sleep(0.05)
        await lock.rollback()
        assert await holder.fetchval(f"SELECT v FROM {table} WHERE n = 1") == 0
    finally:
        await holder.execute(f"DROP TABLE IF EXISTS {table}")
        await holder.close()
        await pool.close()
