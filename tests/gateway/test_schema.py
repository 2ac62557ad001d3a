"""The Gateway's schema.sql and its migrations build the same tables and indexes."""

from __future__ import annotations

import asyncpg

from quayutec.db import create_pool
from quayutec.migrate import GATEWAY, migrate
from tests.conftest import create_test_database, drop_test_database

_COLUMNS = """
SELECT table_name, column_name, data_type, is_nullable, coalesce(column_default, '') AS column_default
FROM information_schema.columns WHERE table_schema = 'public' AND table_name <> 'quayutec_schema_migrations'
ORDER BY table_name, column_name
"""
_INDEXES = """
SELECT tablename, indexname, indexdef FROM pg_indexes
WHERE schemaname = 'public' AND tablename <> 'quayutec_schema_migrations' ORDER BY indexname
"""


async def _shape(url: str) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    conn = await asyncpg.connect(url)
    try:
        return [tuple(r) for r in await conn.fetch(_COLUMNS)], [tuple(r) for r in await conn.fetch(_INDEXES)]
    finally:
        await conn.close()


async def test_schema_matches_migrations(template_ready: str) -> None:
    from_schema = await create_test_database(template_ready, template=None)
    from_migrations = await create_test_database(template_ready, template=None)
    try:
        conn = await asyncpg.connect(from_schema)
        try:
            await conn.execute(GATEWAY.schema_path.read_text(encoding="utf-8"))
        finally:
            await conn.close()
        pool = await create_pool(from_migrations, min_size=1, max_size=1)
        try:
            assert [m.name for m in await migrate(pool, (GATEWAY,))] == [
                "init",
                "session_keys_revocation",
                "sign_in_providers",
                "key_dedupe_keys",
            ]
        finally:
            await pool.close()
        columns, indexes = await _shape(from_schema)
        assert {c[0] for c in columns} == {"api_keys", "sign_in_providers", "sign_in_domains"}
        assert (columns, indexes) == await _shape(from_migrations)
    finally:
        await drop_test_database(template_ready, from_schema)
        await drop_test_database(template_ready, from_migrations)
