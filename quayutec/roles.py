"""One PostgreSQL role per service, owning nothing and allowed only its own tables: the database's
twin of ``quayutec.authz.RPC_CALLERS``.

``quayutec_owner`` owns every table (migrations run as it); ``quayutec_gateway``, ``quayutec_room``
and ``quayutec_claims`` may read and write their own component's tables and nothing else, and the
Claims role may only insert and read ``agent_run_locks``: a claim is never updated, deleted or
truncated, and PostgreSQL itself refuses it. The roles cannot log in; a service's sessions act as its
role (``quayutec.db.create_pool`` sends it when the connection starts), so the login of its URL must
be a member of the role, or a superuser. ``quayutec migrate`` (and every service that migrates on
start) creates the roles when they are missing, makes the user that runs it a member of them, and
grants each role its tables, after every migration: a new table gets its grants the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import asyncpg

OWNER = "quayutec_owner"
# The components (quayutec.migrate.COMPONENTS) whose services run as a role of their own.
SERVICE_ROLES = {"gateway": "quayutec_gateway", "room": "quayutec_room", "claims": "quayutec_claims"}
# Every table of a component grants its role these, unless it is listed below.
READ_WRITE = ("SELECT", "INSERT", "UPDATE", "DELETE")
LIMITED: dict[str, tuple[str, ...]] = {
    # A claim is forever: no UPDATE, DELETE or TRUNCATE of the claims' table by anyone but its owner.
    "agent_run_locks": ("SELECT", "INSERT"),
}
# The version table of quayutec.migrate: readable by every service, written only by migrations.
VERSION_TABLE = "quayutec_schema_migrations"

_CREATE_TABLE = re.compile(r"^\s*CREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?([a-z_][a-z0-9_]*)", re.I | re.M)


def service_role(service: str) -> str | None:
    """The role the sessions of ``service`` act as (None: it has no tables, or it is the admin CLI)."""
    return SERVICE_ROLES.get(service)


def tables_of(schema_sql: str) -> list[str]:
    """The tables a component's ``schema.sql`` creates."""
    return _CREATE_TABLE.findall(schema_sql)


def privileges_on(table: str) -> tuple[str, ...]:
    return LIMITED.get(table, READ_WRITE)


async def ensure_roles(conn: asyncpg.Connection) -> None:
    """Create the roles that are missing, make the current user a member of each (so it may act as
    them) and let the owner create tables in the ``public`` schema. Safe to run concurrently
    (another database of the same server may be migrating: roles belong to the whole server)."""
    for role in (OWNER, *SERVICE_ROLES.values()):
        exists = await conn.fetchval("SELECT true FROM pg_roles WHERE rolname = $1", role)
        if not exists:
            await conn.execute(
                f"DO $$ BEGIN CREATE ROLE {role} NOLOGIN; "
                "EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$"
            )
        member = await conn.fetchval(
            "SELECT rolsuper OR pg_has_role(current_user, $1, 'MEMBER') FROM pg_roles WHERE rolname = current_user",
            role,
        )
        if not member:
            await conn.execute(f"GRANT {role} TO CURRENT_USER")
    if not await conn.fetchval("SELECT has_schema_privilege($1, 'public', 'CREATE')", OWNER):
        await conn.execute(f"GRANT USAGE, CREATE ON SCHEMA public TO {OWNER}")


async def own_tables(conn: asyncpg.Connection, tables: Iterable[str]) -> None:
    """Hand the tables that exist (made before the roles were) to the owner role."""
    rows = await conn.fetch(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') AND c.relname = ANY($1::text[]) "
        "AND pg_get_userbyid(c.relowner) <> $2",
        list(tables),
        OWNER,
    )
    for row in rows:
        await conn.execute(f'ALTER TABLE "{row["relname"]}" OWNER TO {OWNER}')


async def grant_tables(conn: asyncpg.Connection, tables_by_role: dict[str, list[str]]) -> None:
    """Each role gets exactly its privileges on its tables (anything else granted before is revoked),
    and may read the version table. Run as the owner."""
    everyone = ", ".join(SERVICE_ROLES.values())
    for role, tables in tables_by_role.items():
        if role == OWNER:  # owns them: nothing to grant
            continue
        for table in tables:
            await conn.execute(f'REVOKE ALL ON TABLE "{table}" FROM PUBLIC, {everyone}')
            await conn.execute(f'GRANT {", ".join(privileges_on(table))} ON TABLE "{table}" TO {role}')
    await conn.execute(f"REVOKE ALL ON TABLE {VERSION_TABLE} FROM PUBLIC, {everyone}")
    await conn.execute(f"GRANT SELECT ON TABLE {VERSION_TABLE} TO {everyone}")
