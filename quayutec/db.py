"""One asyncpg pool per process, on ``DATABASE_URL`` or an embedded PostgreSQL (pgserver)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from quayutec.config import ConfigError, ConnectionBudget, DatabaseConfig

_log = logging.getLogger("quayutec.db")

# Unix sockets live in the data folder; their path must stay under the kernel's limit (108 bytes).
_MAX_SOCKET_DIR = 90


def quiet_pgserver() -> None:
    """Silence what pgserver says on every start: platformdirs' RuntimeDirWarning (no
    XDG_RUNTIME_DIR, as in containers and CI) and its INFO log lines. Its errors still show."""
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR", category=UserWarning)
    logging.getLogger("pgserver").setLevel(logging.WARNING)


def embedded_pgdata(data_dir: Path) -> Path:
    """The embedded PostgreSQL's folder inside a data folder."""
    return data_dir / "pgdata"


def embedded_pid(pgdata: Path) -> int | None:
    """The pid of the PostgreSQL serving ``pgdata`` when one is running, else None."""
    try:
        first = (pgdata / "postmaster.pid").read_text().splitlines()[0]
        pid = int(first.strip())
    except (OSError, IndexError, ValueError):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        return pid
    return pid if b"postgres" in cmdline else None


def embedded_database_url(data_dir: Path) -> str:
    """Start (or reuse) the embedded PostgreSQL in ``data_dir/pgdata`` and return its URL.

    The server outlives this process: every service of one machine shares it. Whoever started it
    stops it (``quayutec up``, the demo, the test session), or ``quayutec db stop`` does.
    """
    quiet_pgserver()
    import pgserver  # imported lazily: only the embedded mode needs it

    pgdata = embedded_pgdata(data_dir)
    if len(str(pgdata)) > _MAX_SOCKET_DIR:
        raise ValueError(
            f"the embedded PostgreSQL folder {pgdata} is too long for a Unix socket path; "
            "set QUAYUTEC_DATA_DIR to a shorter folder or set DATABASE_URL"
        )
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    server = pgserver.get_server(str(pgdata), cleanup_mode=None)
    return str(server.get_uri())


def with_database(url: str, dbname: str) -> str:
    """``url`` pointed at database ``dbname`` (keeps host, socket and credentials)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{dbname}", parts.query, parts.fragment))


async def resolve_database_url(config: DatabaseConfig) -> str:
    if config.url:
        return config.url
    return await asyncio.to_thread(embedded_database_url, config.data_dir)


async def _no_session_reset(conn: asyncpg.Connection) -> None:
    """Our code leaves no session state (no SET, LISTEN or held advisory lock) on a released
    connection, and asyncpg still rolls back an open transaction itself; skipping its reset query
    saves one round trip per acquire."""


async def create_pool(
    url: str, *, min_size: int = 1, max_size: int = 10, idle_in_transaction_seconds: float = 10.0
) -> asyncpg.Pool:
    """An asyncpg pool; fails fast with a clear message when PostgreSQL is unreachable.

    Its sessions carry ``idle_in_transaction_session_timeout``: when a replica is cut off from the
    database between two statements of a transaction (its COMMIT lost on the way), PostgreSQL ends
    that session after ``idle_in_transaction_seconds`` and rolls the transaction back, instead of
    holding its row locks (a room's sequence row, a run's ledger row) until TCP notices, which can
    take minutes. Nothing of ours keeps a transaction open between statements for long."""
    settings = {"idle_in_transaction_session_timeout": str(round(idle_in_transaction_seconds * 1000))}
    pool = await asyncpg.create_pool(
        url,
        min_size=min_size,
        max_size=max_size,
        command_timeout=30,
        reset=_no_session_reset,
        server_settings=settings,
    )
    if pool is None:  # pragma: no cover - asyncpg returns None only without await
        raise RuntimeError("asyncpg.create_pool returned no pool")
    return pool


async def open_pool(config: DatabaseConfig) -> asyncpg.Pool:
    url = await resolve_database_url(config)
    return await create_pool(
        url,
        min_size=config.pool_min,
        max_size=config.pool_max,
        idle_in_transaction_seconds=config.idle_in_transaction_seconds,
    )


async def check_connection_budget(pool: asyncpg.Pool, budget: ConnectionBudget, service: str) -> int:
    """Refuse to start (ConfigError, with the numbers) when every replica's pool could not be open at
    once: the budget over what the server gives ordinary roles (``max_connections`` less its
    superuser and reserved slots). Returns the connections left over."""
    async with pool.acquire() as conn:
        row = await conn.fetchrow(
            "SELECT current_setting('max_connections')::int AS max_connections,"
            " current_setting('superuser_reserved_connections')::int AS superuser_reserved,"
            " coalesce(current_setting('reserved_connections', true), '0')::int AS reserved"
        )
    assert row is not None
    available = int(row["max_connections"]) - int(row["superuser_reserved"]) - int(row["reserved"])
    spare = available - budget.total
    if spare < 0:
        raise ConfigError(
            f"{service}: the database connection budget ({budget.explain()}) exceeds what PostgreSQL allows "
            f"(max_connections {row['max_connections']} - superuser_reserved_connections "
            f"{row['superuser_reserved']} - reserved_connections {row['reserved']} = {available}); lower "
            "QUAYUTEC_<SERVICE>_DB_POOL_MAX or QUAYUTEC_<SERVICE>_REPLICAS_MAX (and the HPA's maxReplicas with it), "
            "or raise max_connections"
        )
    _log.info("%s: database connection budget %s of %d", service, budget.explain(), available)
    return spare


# Run in a child Python that never imports gRPC: a process with gRPC threads that forks to run
# PostgreSQL's tools as another user (pgserver does so when we are root) can crash the child.
_EMBEDDED_CTL = """
import os, sys, warnings
from pathlib import Path
warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR", category=UserWarning)
import pgserver
from pgserver import _commands
pgdata = Path(sys.argv[2])
if sys.argv[1] == "start":
    print(pgserver.get_server(pgdata, cleanup_mode=None).get_uri())
else:
    _commands.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=pgdata, user="pgserver" if os.geteuid() == 0 else None)
"""


def embedded_ctl(action: Literal["start", "stop"], pgdata: Path) -> str:
    """Start (returns its URL) or stop an embedded PostgreSQL in ``pgdata``, from a child process."""
    done = subprocess.run(
        [sys.executable, "-c", _EMBEDDED_CTL, action, str(pgdata)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else ""
