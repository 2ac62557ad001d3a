"""One asyncpg pool per process, on ``DATABASE_URL`` or an embedded PostgreSQL (pgserver)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
from asyncpg import connect_utils

from quayutec.config import ConfigError, ConnectionBudget, DatabaseConfig
from quayutec.errors import is_connection_error

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
    """``url`` pointed at database ``dbname`` (keeps every host, socket, credential and parameter,
    so a multi-host URL such as ``postgresql://u@h1:5432,h2:5432/db?target_session_attrs=read-write``
    stays one)."""
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


# SQLSTATEs after which no connection of the pool is worth keeping: the server became read-only (a
# demoted primary: 25006) or is going away (57P01 admin_shutdown, 57P02 crash_shutdown, 57P03
# cannot_connect_now). The pool reconnects, and a multi-host URL finds the new primary.
_SERVER_GONE_SQLSTATES = frozenset({"25006", "57P01", "57P02", "57P03"})


def _leaves_connection_unusable(exc: BaseException) -> bool:
    """A statement that timed out or was cancelled (its answer may still come, or never: the network
    may have eaten it), or any error that means the connection or its server is gone: the connection
    is terminated (its socket closed at once, no polite goodbye that could wait behind lost packets)."""
    return isinstance(exc, (TimeoutError, asyncio.CancelledError)) or is_connection_error(exc)


# The cancel requests in flight (a task is kept referenced until it is done).
_CANCEL_REQUESTS: set[asyncio.Task[None]] = set()


def send_cancel_request(conn: Any, bound: float) -> asyncio.Task[None] | None:
    """Ask PostgreSQL, on a connection of its own, to cancel whatever statement ``conn``'s backend runs
    (its CancelRequest), in the background within ``bound`` seconds; returns that task, or None when the
    connection is already closed.

    asyncpg sends this request itself when a statement's task is cancelled or times out, from a task
    of the connection; but terminating the connection (what we do with a connection left in doubt)
    cancels that task before it has even connected (``Connection.terminate`` cleans up its tasks).
    Without the request, a backend waiting on a row lock does not notice its client left, and once the
    lock is released its statement commits for a caller that is gone: a run's fenced ledger write for a
    Runtime that was killed, say. So the request is sent here, from the connection's address and its
    backend's key read before it is terminated (asyncpg 0.32's own fields and cancel routine; a pinned
    version, and tests/test_db_sessions.py finds out when they change)."""
    raw = getattr(conn, "_con", conn)  # a pool's connection proxy holds the connection
    protocol = getattr(raw, "_protocol", None)
    if raw is None or protocol is None or raw.is_closed():
        return None
    loop = asyncio.get_running_loop()
    addr, params = raw._addr, raw._params
    pid, secret = protocol.backend_pid, protocol.backend_secret

    async def send() -> None:
        try:
            async with asyncio.timeout(bound):
                await connect_utils._cancel(loop=loop, addr=addr, params=params, backend_pid=pid, backend_secret=secret)
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            _log.warning("could not ask PostgreSQL to cancel the statement of backend %s: %s", pid, exc)

    task = loop.create_task(send(), name=f"cancel backend {pid}")
    _CANCEL_REQUESTS.add(task)
    task.add_done_callback(_CANCEL_REQUESTS.discard)
    return task


class _AcquireContext(asyncpg.pool.PoolAcquireContext):  # type: ignore[misc]
    async def __aexit__(self, *exc: object) -> None:
        error = exc[1]
        if isinstance(error, BaseException) and self.connection is not None and _leaves_connection_unusable(error):
            if isinstance(error, (TimeoutError, asyncio.CancelledError)):
                # The statement may still run (or wait on a lock) in its backend: cancel it there.
                send_cancel_request(self.connection, self.pool.cancel_timeout)
            self.connection.terminate()
            if getattr(error, "sqlstate", None) in _SERVER_GONE_SQLSTATES:
                await self.pool.expire_connections()
        await super().__aexit__(*exc)


class Pool(asyncpg.Pool):  # type: ignore[misc]
    """asyncpg's pool with a bounded wait for a connection by default, and connections that a timed out,
    cancelled or failed statement left in doubt terminated instead of given back."""

    def __init__(self, *args: Any, acquire_timeout: float | None, cancel_timeout: float = 5.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.acquire_timeout = acquire_timeout
        # How long a cancel request (send_cancel_request) may take to reach the server.
        self.cancel_timeout = cancel_timeout

    def acquire(self, *, timeout: float | None = None) -> _AcquireContext:
        return _AcquireContext(self, self.acquire_timeout if timeout is None else timeout)


@dataclass(frozen=True)
class TcpTimeouts:
    """How a database socket finds out its peer is gone: data unacknowledged for ``seconds`` aborts
    the connection (TCP_USER_TIMEOUT), and an idle one is probed (keepalives) so silence is noticed
    in about as long. Set on our side of each socket and asked of the server for its side."""

    seconds: float = 10.0

    @property
    def keepalive_idle(self) -> int:
        return max(1, round(self.seconds / 2))

    @property
    def keepalive_interval(self) -> int:
        return max(1, round(self.seconds / 10))

    keepalive_count: int = 3

    @property
    def user_timeout_ms(self) -> int:
        return round(self.seconds * 1000)

    def server_settings(self) -> dict[str, str]:
        """The server's side (ignored by PostgreSQL on a Unix socket)."""
        return {
            "tcp_keepalives_idle": str(self.keepalive_idle),
            "tcp_keepalives_interval": str(self.keepalive_interval),
            "tcp_keepalives_count": str(self.keepalive_count),
            "tcp_user_timeout": str(self.user_timeout_ms),
        }

    def apply(self, sock: Any) -> bool:
        """Our side, on a connected socket; False when it is not TCP (a Unix socket)."""
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, self.keepalive_idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, self.keepalive_interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, self.keepalive_count)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, self.user_timeout_ms)
        return True


def connection_socket(conn: asyncpg.Connection) -> Any:
    """The socket under an asyncpg connection (asyncpg keeps its transport private)."""
    transport = getattr(conn, "_transport", None)
    return None if transport is None else transport.get_extra_info("socket")


def single_host_urls(url: str) -> list[str]:
    """``url`` split into one URL per host it lists, in order (hosts in the netloc,
    ``postgresql://u@h1:5432,h2:5432/db``, or in the query, ``?host=h1,h2&port=p1,p2``); a URL with one
    host is returned as it is."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    fields = dict(query)
    if "host" in fields:
        hosts = fields["host"].split(",")
        ports = fields.get("port", "").split(",") if fields.get("port") else []
        if len(hosts) < 2:
            return [url]
        if len(ports) == 1:
            ports = ports * len(hosts)
        urls = []
        for i, host in enumerate(hosts):
            one = [(k, v) for k, v in query if k not in ("host", "port")] + [("host", host)]
            if ports:
                one.append(("port", ports[i] if i < len(ports) else ports[-1]))
            urls.append(urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(one, safe="/"), parts.fragment)))
        return urls
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    hosts = hostlist.split(",")
    if len(hosts) < 2:
        return [url]
    return [
        urlunsplit((parts.scheme, f"{userinfo}{at}{host}", parts.path, parts.query, parts.fragment)) for host in hosts
    ]


# What a host that is not the primary, not up yet or silent answers: try the next host.
_NEXT_HOST_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.TargetServerAttributeNotMatched,
    asyncpg.CannotConnectNowError,
    asyncpg.InvalidCatalogNameError,
)


class HostByHost:
    """A pool's way to open a connection on a multi-host URL: each host in turn, each within the
    whole connect timeout, starting from the host that last worked.

    asyncpg's own multi-host connect spends one timeout on the whole list, so a silent host listed
    first (a primary whose machine died: no refusal comes back) uses all of it and the hosts after it
    are never tried; each new connection then fails until the dead host is taken out of the URL."""

    def __init__(self) -> None:
        self.preferred = 0

    async def __call__(self, dsn: str, *, timeout: float = 60.0, **kwargs: Any) -> asyncpg.Connection:  # noqa: ASYNC109
        urls = single_host_urls(dsn)
        if len(urls) == 1:
            return await asyncpg.connect(dsn, timeout=timeout, **kwargs)
        start = self.preferred % len(urls)
        last: BaseException | None = None
        for step in range(len(urls)):
            index = (start + step) % len(urls)
            try:
                conn = await asyncpg.connect(urls[index], timeout=timeout, **kwargs)
            except _NEXT_HOST_ERRORS as exc:
                last = exc
                continue
            self.preferred = index
            return conn
        assert last is not None
        raise last


async def create_pool(
    url: str,
    *,
    min_size: int = 1,
    max_size: int = 10,
    idle_in_transaction_seconds: float = 10.0,
    statement_timeout_seconds: float = 30.0,
    client_check_seconds: float = 2.0,
    plan_cache_mode: str = "force_generic_plan",
    role: str | None = None,
    acquire_timeout: float | None = 5.0,
    command_timeout: float = 30.0,
    connect_timeout: float = 5.0,
    tcp: TcpTimeouts = TcpTimeouts(),
) -> Pool:
    """An asyncpg pool; fails fast with a clear message when PostgreSQL is unreachable.

    Its sessions carry ``idle_in_transaction_session_timeout``: when a replica is cut off from the
    database between two statements of a transaction (its COMMIT lost on the way), PostgreSQL ends
    that session after ``idle_in_transaction_seconds`` and rolls the transaction back, instead of
    holding its row locks (a room's sequence row, a run's ledger row) until TCP notices, which can
    take minutes. Nothing of ours keeps a transaction open between statements for long.

    They bound every statement on the server's side too, so that no backend works on for a caller
    that is gone: ``statement_timeout`` (``statement_timeout_seconds``, no longer than the statement's
    own wait, ``command_timeout``) ends a statement that runs or waits on a lock that long, and
    ``client_connection_check_interval`` (``client_check_seconds``; 0: off) has a backend that runs a
    statement look at its client's socket that often and stop, rolling back, once the client has
    closed it. A call the service gave up (cancelled, timed out) also has its statement cancelled
    at once (``send_cancel_request``).

    They also carry ``plan_cache_mode`` (QUAYUTEC_DB_PLAN_CACHE_MODE): with ``force_generic_plan`` a
    prepared statement is planned once per connection. Under ``auto`` PostgreSQL kept planning the
    wake's long one-statement writes and room read again at every call, for their values.

    Every wait is bounded: ``acquire_timeout`` for a pooled connection, ``command_timeout`` for a
    statement, ``connect_timeout`` for a new connection (each host of a multi-host URL in turn, ``HostByHost``), and
    ``tcp`` for a socket whose peer fell silent. ``role``: the role every session runs as (sent at
    connection start, so even ``RESET ROLE`` keeps it; ``quayutec.roles``)."""
    settings = {
        "idle_in_transaction_session_timeout": str(round(idle_in_transaction_seconds * 1000)),
        "statement_timeout": str(round(statement_timeout_seconds * 1000)),
        "client_connection_check_interval": str(round(client_check_seconds * 1000)),
        "plan_cache_mode": plan_cache_mode,
        **tcp.server_settings(),
    }
    if role is not None:
        settings["role"] = role

    async def on_connect(conn: asyncpg.Connection) -> None:
        try:
            tcp.apply(connection_socket(conn))
        except (OSError, AttributeError) as exc:  # pragma: no cover - a transport without a settable socket
            _log.warning("could not set TCP keepalives on a database connection: %s", exc)

    pool = Pool(
        url,
        min_size=min_size,
        max_size=max_size,
        max_queries=50_000,
        max_inactive_connection_lifetime=300.0,
        connect=HostByHost(),
        setup=None,
        init=on_connect,
        reset=_no_session_reset,
        loop=None,
        connection_class=asyncpg.Connection,
        record_class=asyncpg.Record,
        acquire_timeout=acquire_timeout,
        cancel_timeout=connect_timeout,
        command_timeout=command_timeout,
        timeout=connect_timeout,
        server_settings=settings,
    )
    try:
        await pool
    except asyncpg.InsufficientPrivilegeError as exc:
        if role is None:
            raise
        raise ConfigError(
            f"the database login may not act as role {role} ({exc}): run `quayutec migrate` (it creates the "
            "roles and grants them to the user that runs it), or grant the role to this service's login "
            "(docs/operations.md, PostgreSQL in production)"
        ) from exc
    return pool


async def open_pool(config: DatabaseConfig) -> Pool:
    url = await resolve_database_url(config)
    return await create_pool(
        url,
        min_size=config.pool_min,
        max_size=config.pool_max,
        idle_in_transaction_seconds=config.idle_in_transaction_seconds,
        statement_timeout_seconds=config.statement_timeout_seconds,
        client_check_seconds=config.client_check_seconds,
        plan_cache_mode=config.plan_cache_mode,
        role=config.role,
        acquire_timeout=config.acquire_timeout_seconds,
        command_timeout=config.command_timeout_seconds,
        connect_timeout=config.connect_timeout_seconds,
        tcp=TcpTimeouts(config.tcp_timeout_seconds),
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
