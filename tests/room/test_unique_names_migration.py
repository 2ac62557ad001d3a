"""Migration 0016 on a database that holds duplicate names (as every stack before it could): no row is
lost, the oldest of each group keeps its name, the later ones get a visible suffix, and the unique
indexes hold from then on. Run on a real PostgreSQL, migrated to 0015 first."""

from __future__ import annotations

import shutil
from pathlib import Path

import asyncpg
import pytest

from quayutec.db import create_pool
from quayutec.migrate import CLAIMS, ROOM, Component, migrate


def _room_before_0016(folder: Path) -> Component:
    """The Room's migrations as they stood before 0016 (same component name, so the real ROOM
    component applies only 0016 afterwards)."""
    (folder / "migrations").mkdir()
    for path in sorted((ROOM.sql_dir / "migrations").glob("*.sql")):
        if int(path.name[:4]) < 16:
            shutil.copy(path, folder / "migrations" / path.name)
    shutil.copy(ROOM.schema_path, folder / "schema.sql")
    return Component(ROOM.name, folder)


async def test_0016_renames_later_duplicates_with_a_suffix_and_loses_no_row(
    empty_database_url: str, tmp_path: Path
) -> None:
    pool = await create_pool(empty_database_url, min_size=1, max_size=1)
    try:
        await migrate(pool, (CLAIMS, _room_before_0016(tmp_path)))
        acme = await pool.fetchval("INSERT INTO companies (name) VALUES ('Acme') RETURNING company_id")
        globex = await pool.fetchval("INSERT INTO companies (name) VALUES ('Globex') RETURNING company_id")
        agents = [
            (acme, "planner"),
            (acme, "Planner "),
            (acme, "planner (2)"),  # a name the suffix would have given: the next free number is taken
            (acme, "planner"),
            (acme, "  writer"),
            (globex, "planner"),  # another company's: not a duplicate
        ]
        agent_ids = [
            await pool.fetchval(
                "INSERT INTO agents (company_id, name, provider, model) VALUES ($1, $2, 'anthropic', 'm')"
                " RETURNING agent_id",
                company,
                name,
            )
            for company, name in agents
        ]
        rooms = [(acme, "launch"), (acme, "LAUNCH"), (acme, "launch"), (globex, "launch")]
        room_ids = []
        for n, (company, name) in enumerate(rooms):
            room_ids.append(
                await pool.fetchval(
                    "INSERT INTO rooms (name, created_by_company_id, created_at)"
                    " VALUES ($1, $2, now() + $3 * interval '1 second') RETURNING room_id",
                    name,
                    company,
                    n,
                )
            )
        with pytest.raises(asyncpg.UniqueViolationError):  # not yet: the index comes with 0016
            await pool.execute("CREATE UNIQUE INDEX probe ON agents (company_id, lower(name))")

        applied = await migrate(pool, (CLAIMS, ROOM))
        assert [(m.component, m.version) for m in applied] == [("room", 16)]

        named = {r["agent_id"]: r["name"] for r in await pool.fetch("SELECT agent_id, name FROM agents")}
        assert [named[a] for a in agent_ids] == [
            "planner",
            "Planner (3)",
            "planner (2)",
            "planner (4)",
            "writer",
            "planner",
        ]
        titled = {r["room_id"]: r["name"] for r in await pool.fetch("SELECT room_id, name FROM rooms")}
        assert [titled[r] for r in room_ids] == ["launch", "LAUNCH (2)", "launch (3)", "launch"]

        # The indexes hold from now on, compared trimmed and case ignored.
        with pytest.raises(asyncpg.UniqueViolationError) as err:
            await pool.execute(
                "INSERT INTO agents (company_id, name, provider, model) VALUES ($1, 'WRITER', 'anthropic', 'm')", acme
            )
        assert err.value.constraint_name == "agents_company_name"
        with pytest.raises(asyncpg.UniqueViolationError) as err:
            await pool.execute("INSERT INTO rooms (name, created_by_company_id) VALUES ('Launch', $1)", globex)
        assert err.value.constraint_name == "rooms_creator_name"
    finally:
        await pool.close()
