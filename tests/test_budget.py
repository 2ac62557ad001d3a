"""The database connection budget: every replica's pool, added up, against the server's limit,
checked when a database service starts (quayutec.db.check_connection_budget)."""

from __future__ import annotations

from pathlib import Path

import asyncpg
import pytest

from quayutec.config import ConfigError, ConnectionBudget, DatabaseConfig
from quayutec.migrate import CLAIMS, service_pool


async def server_allows(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        row = await conn.fetchrow(
            "SELECT current_setting('max_connections')::int - current_setting('superuser_reserved_connections')::int"
            " - coalesce(current_setting('reserved_connections', true), '0')::int AS n"
        )
    finally:
        await conn.close()
    assert row is not None
    return int(row["n"])


def budget(gateways: int, reserved: int = 10) -> ConnectionBudget:
    return ConnectionBudget(shares=(("gateway", gateways, 10), ("room", 2, 10), ("claims", 2, 5)), reserved=reserved)


def test_the_budget_reads_every_services_replicas_and_pool() -> None:
    env = {
        "QUAYUTEC_GATEWAY_REPLICAS_MAX": "6",
        "QUAYUTEC_GATEWAY_DB_POOL_MAX": "8",
        "QUAYUTEC_ROOM_REPLICAS_MAX": "2",
        "QUAYUTEC_CLAIMS_DB_POOL_MAX": "5",
        "QUAYUTEC_DB_CONNECTIONS_RESERVED": "12",
    }
    got = ConnectionBudget.from_env(env)
    assert got.total == 6 * 8 + 2 * 10 + 1 * 5 + 12
    assert got.explain() == "gateway 6 × 8 + room 2 × 10 + claims 1 × 5 + reserved 12 = 85"
    assert DatabaseConfig.from_env(env, prefix="QUAYUTEC_ROOM_").budget == got


async def test_a_service_refuses_to_start_over_the_budget_naming_the_numbers(database_url: str) -> None:
    allowed = await server_allows(database_url)
    fits = (allowed - 10 - 20 - 10) // 10  # gateways that still fit beside room 2 × 10, claims 2 × 5, reserve 10
    config = DatabaseConfig(url=database_url, data_dir=Path("."), pool_min=1, pool_max=2, budget=budget(fits))
    held = await service_pool(config, CLAIMS, migrate_on_start=False)
    await held.close()
    over = DatabaseConfig(url=database_url, data_dir=Path("."), pool_min=1, pool_max=2, budget=budget(fits + 1))
    with pytest.raises(ConfigError) as refused:
        await service_pool(over, CLAIMS, migrate_on_start=False)
    message = str(refused.value)
    assert f"gateway {fits + 1} × 10 + room 2 × 10 + claims 2 × 5 + reserved 10 = {budget(fits + 1).total}" in message
    assert f"= {allowed})" in message and "QUAYUTEC_<SERVICE>_DB_POOL_MAX" in message
