"""Every component's migrations build exactly its schema.sql, once, and are recorded.

Generic over ``quayutec.migrate.COMPONENTS``: every component has its schema.sql and migrations/.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from quayutec.db import create_pool
from quayutec.migrate import COMPONENTS, Component, migrate
from tests.conftest import create_test_database, drop_test_database

VERSION_TABLE = "quayutec_schema_migrations"

# Each query lists one kind of schema object of the user schemas, in a stable order.
CATALOG_QUERIES: dict[str, str] = {
    "tables": f"""
        SELECT table_schema, table_name, table_type FROM information_schema.tables
        WHERE table_schema NOT IN ('pg_catalog', 'information_schema') AND table_name <> '{VERSION_TABLE}'
        ORDER BY 1, 2""",
    "columns": f"""
        SELECT table_schema, table_name, column_name, data_type, udt_name, is_nullable, column_default,
               character_maximum_length, numeric_precision, is_identity, is_generated, generation_expression
        FROM information_schema.columns
        WHERE table_schema NOT IN ('pg_catalog', 'information_schema') AND table_name <> '{VERSION_TABLE}'
        ORDER BY 1, 2, 3""",
    "constraints": f"""
        SELECT n.nspname, c.relname, k.conname, k.contype, pg_get_constraintdef(k.oid, true)
        FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') AND c.relname <> '{VERSION_TABLE}'
        ORDER BY 1, 2, 3""",
    "indexes": f"""
        SELECT schemaname, tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname NOT IN ('pg_catalog', 'information_schema') AND tablename <> '{VERSION_TABLE}'
        ORDER BY 1, 2, 3""",
    "sequences": """
        SELECT sequence_schema, sequence_name, data_type, start_value, increment FROM information_schema.sequences
        ORDER BY 1, 2""",
    "types": """
        SELECT n.nspname, t.typname, t.typtype,
               array(SELECT e.enumlabel::text FROM pg_enum e WHERE e.enumtypid = t.oid ORDER BY e.enumsortorder)
        FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
        WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast') AND t.typtype IN ('e', 'd', 'c')
          AND NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = t.typrelid AND c.relkind <> 'c')
        ORDER BY 1, 2""",
    "functions": """
        SELECT n.nspname, p.proname, pg_get_function_identity_arguments(p.oid), pg_get_functiondef(p.oid)
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname NOT IN ('pg_catalog', 'information_schema') AND p.prokind IN ('f', 'p')
        ORDER BY 1, 2, 3""",
    "triggers": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid, true)
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        WHERE NOT t.tgisinternal ORDER BY 1, 2""",
    "views": """
        SELECT schemaname, viewname, definition FROM pg_views
        WHERE schemaname NOT IN ('pg_catalog', 'information_schema') ORDER BY 1, 2""",
}


async def catalog(pool: asyncpg.Pool) -> dict[str, list[tuple[Any, ...]]]:
    async with pool.acquire() as conn:
        return {kind: [tuple(r) for r in await conn.fetch(sql)] for kind, sql in CATALOG_QUERIES.items()}


@pytest.fixture
async def second_empty_database_url(template_ready: str) -> AsyncIterator[str]:
    url = await create_test_database(template_ready, template=None)
    yield url
    await drop_test_database(template_ready, url)


def test_every_component_has_a_schema_and_migrations() -> None:
    """None is left out of the tests below for lacking its files: a component without them fails here."""
    assert COMPONENTS
    for c in COMPONENTS:
        assert c.schema_path.is_file(), f"{c.name}: {c.schema_path} is missing"
        assert list((c.sql_dir / "migrations").glob("*.sql")), f"{c.name}: no migrations in {c.sql_dir / 'migrations'}"


@pytest.mark.parametrize("component", COMPONENTS, ids=lambda c: c.name)
async def test_migrations_build_the_same_catalog_as_schema_sql(
    component: Component, empty_database_url: str, second_empty_database_url: str
) -> None:
    # Components before this one (COMPONENTS is in dependency order) are migrated in both databases.
    earlier = COMPONENTS[: COMPONENTS.index(component)]
    from_schema = await create_pool(empty_database_url, min_size=1, max_size=1)
    from_migrations = await create_pool(second_empty_database_url, min_size=1, max_size=1)
    try:
        await migrate(from_schema, earlier)
        await from_schema.execute(component.schema_path.read_text(encoding="utf-8"))
        await migrate(from_migrations, (*earlier, component))
        expected, got = await catalog(from_schema), await catalog(from_migrations)
    finally:
        await from_schema.close()
        await from_migrations.close()
    for kind in CATALOG_QUERIES:
        assert got[kind] == expected[kind], f"{component.name}: {kind} differ between migrations and schema.sql"


async def test_migrate_twice_is_a_no_op_and_records_each_migration(empty_database_url: str) -> None:
    components = COMPONENTS
    pool = await create_pool(empty_database_url, min_size=1, max_size=2)
    try:
        applied = await migrate(pool, components)
        before = await catalog(pool)
        again = await migrate(pool, components)
        after = await catalog(pool)
        rows = await pool.fetch(f"SELECT component, version, name FROM {VERSION_TABLE}")
    finally:
        await pool.close()
    expected = {(m.component, m.version, m.name) for c in components for m in c.migrations()}
    assert {(m.component, m.version, m.name) for m in applied} == expected
    assert again == []
    assert after == before
    assert {(r["component"], r["version"], r["name"]) for r in rows} == expected
    assert len(rows) == len(expected)
