"""Schema migrations: numbered SQL files per component, a version table, one transaction each.

Each component (a service that owns tables) keeps ``sql/schema.sql`` (the whole schema as it now
stands) and ``sql/migrations/NNNN_name.sql``. ``python -m quayutec.migrate`` applies every
component's pending migrations; services also apply their own on start unless told not to.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import asyncpg

from quayutec import roles
from quayutec.config import DatabaseConfig
from quayutec.datadir import DataDirLock, share
from quayutec.db import check_connection_budget, open_pool
from quayutec.dbhealth import DatabaseHealth

ROOT = Path(__file__).resolve().parent.parent
_MIGRATION_NAME = re.compile(r"^(?P<version>\d{4})_(?P<name>[a-z0-9_]+)\.sql$")
_LOCK_KEY = 0x51_75_61_79  # one advisory lock for all migrations of this database

VERSION_TABLE_SQL = """
CREATE TABLE IF NOT EXISTS quayutec_schema_migrations (
    component text NOT NULL,
    version integer NOT NULL,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (component, version)
)
"""


@dataclass(frozen=True)
class Migration:
    component: str
    version: int
    name: str
    path: Path


@dataclass(frozen=True)
class Component:
    """A service that owns tables, and the folder of its SQL."""

    name: str
    sql_dir: Path

    @property
    def schema_path(self) -> Path:
        return self.sql_dir / "schema.sql"

    def migrations(self) -> list[Migration]:
        found: list[Migration] = []
        for path in sorted((self.sql_dir / "migrations").glob("*.sql")):
            match = _MIGRATION_NAME.match(path.name)
            if match is None:
                raise ValueError(f"{path}: migration files are named NNNN_name.sql")
            found.append(Migration(self.name, int(match["version"]), match["name"], path))
        versions = [m.version for m in found]
        if versions != list(range(1, len(found) + 1)):
            raise ValueError(f"{self.sql_dir}/migrations: versions must run 1, 2, 3... without gaps, got {versions}")
        return found


CLAIMS = Component("claims", ROOT / "services" / "claims" / "sql")
ROOM = Component("room", ROOT / "services" / "room" / "sql")
GATEWAY = Component("gateway", ROOT / "services" / "gateway" / "sql")
COMPONENTS: tuple[Component, ...] = (CLAIMS, ROOM, GATEWAY)


async def applied_versions(conn: asyncpg.Connection, component: str) -> set[int]:
    rows = await conn.fetch("SELECT version FROM quayutec_schema_migrations WHERE component = $1", component)
    return {int(r["version"]) for r in rows}


async def migrate(pool: asyncpg.Pool, components: tuple[Component, ...] = COMPONENTS) -> list[Migration]:
    """Apply pending migrations, each in its own transaction; safe to run from many processes at once."""
    applied: list[Migration] = []
    # Each component's tables, by the role of its service (a component with no role of its own: owner only).
    tables = {
        roles.SERVICE_ROLES.get(c.name, roles.OWNER): roles.tables_of(c.schema_path.read_text("utf-8"))
        for c in components
    }
    async with pool.acquire() as conn:
        await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
        try:
            # Migrations run as the owner role, which owns every table (quayutec.roles).
            await roles.ensure_roles(conn)
            await roles.own_tables(conn, [roles.VERSION_TABLE, *(t for ts in tables.values() for t in ts)])
            await conn.execute(f"SET ROLE {roles.OWNER}")
            await conn.execute(VERSION_TABLE_SQL)
            for component in components:
                done = await applied_versions(conn, component.name)
                for migration in component.migrations():
                    if migration.version in done:
                        continue
                    async with conn.transaction():
                        await conn.execute(migration.path.read_text(encoding="utf-8"))
                        await conn.execute(
                            "INSERT INTO quayutec_schema_migrations (component, version, name) VALUES ($1, $2, $3)",
                            migration.component,
                            migration.version,
                            migration.name,
                        )
                    applied.append(migration)
            await roles.grant_tables(conn, tables)
        finally:
            await conn.execute("RESET ROLE")
            await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
    return applied


@dataclass(frozen=True)
class ServicePool:
    """A service's pool, and whether the service opened it (and so closes it); on the embedded
    PostgreSQL, the service's share of the data folder too (released on close)."""

    pool: asyncpg.Pool
    owned: bool
    folder: DataDirLock | None = None
    # The service's gRPC health follows whether it reaches its database (GrpcServer's health_watch).
    health: DatabaseHealth | None = None

    async def close(self) -> None:
        try:
            if self.health is not None:
                await self.health.stop()
            if self.owned:
                await self.pool.close()
        finally:
            if self.folder is not None:
                self.folder.release()


async def service_pool(
    database: DatabaseConfig, component: Component, *, migrate_on_start: bool, pool: asyncpg.Pool | None = None
) -> ServicePool:
    """The pool a service runs on (``pool``, or its own, once the connection budget of every replica is
    checked against the server's limit), with its component migrated when asked. A service on the
    embedded PostgreSQL shares the data folder with other services started on their own, and refuses
    to start in a folder a stack (`quayutec up`, the demo) owns (``DataDirTaken``)."""
    folder = share(database.data_dir) if pool is None and database.url is None else None
    try:
        if migrate_on_start and pool is None:
            # As the login of DATABASE_URL, not the service's role: migrations run as the owner role.
            await migrate_database(replace(database, url=database.admin_url or database.url), (component,))
        opened = pool or await open_pool(database)
        health = DatabaseHealth(
            opened, interval=database.health_interval_seconds, timeout=database.acquire_timeout_seconds
        )
        held = ServicePool(opened, owned=pool is None, folder=folder, health=health)
    except BaseException:
        if folder is not None:
            folder.release()
        raise
    try:
        if held.owned and database.budget is not None:
            await check_connection_budget(held.pool, database.budget, component.name)
        if migrate_on_start and not held.owned:
            await migrate(held.pool, (component,))
    except BaseException:
        await held.close()
        raise
    return held


async def migrate_database(database: DatabaseConfig, components: tuple[Component, ...] = COMPONENTS) -> list[Migration]:
    """``components`` migrated on a pool of their own (one connection, the login's own role)."""
    pool = await open_pool(replace(database, role=None, pool_min=1, pool_max=1))
    try:
        return await migrate(pool, components)
    finally:
        await pool.close()


async def apply_all(components: tuple[Component, ...] = COMPONENTS) -> list[Migration]:
    """``quayutec migrate``: the components' pending migrations on ``DATABASE_URL`` (or embedded)."""
    applied = await migrate_database(DatabaseConfig.from_env(), components)
    for m in applied:
        print(f"applied {m.component} {m.version:04d}_{m.name}")
    print(f"schema up to date ({len(applied)} applied)")
    return applied


async def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m quayutec.migrate", description="Apply schema migrations.")
    parser.add_argument("--component", choices=[c.name for c in COMPONENTS], action="append")
    opts = parser.parse_args(argv)
    await apply_all(tuple(c for c in COMPONENTS if not opts.component or c.name in opts.component))
    return 0


def main() -> None:
    raise SystemExit(asyncio.run(_main(sys.argv[1:])))


if __name__ == "__main__":
    main()
