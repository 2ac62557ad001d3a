"""What the services need to follow a primary and never wait on a dead socket (quayutec.db):
multi-host URLs kept whole and connected through, a statement that timed out ends its connection,
every database socket carries TCP_USER_TIMEOUT and keepalives, errors of a server that is no longer
the primary are UNAVAILABLE, and a replica's health says whether it reaches its database."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from quayutec.config import DatabaseConfig
from quayutec.db import TcpTimeouts, connection_socket, create_pool, open_pool, single_host_urls, with_database
from quayutec.errors import status_for
from tests.harness.channels import service_channel
from tests.harness.claims import running_claims
from tests.harness.postgres import OwnPostgres

# Bounds on waits that end when something happens (never asserted as timings).
WAIT_SECONDS = 30.0
MULTI = "postgresql://svc@db-1.internal:5432,db-2.internal:5433/quayutec?target_session_attrs=read-write"


def dead_loopback_port() -> int:
    """A loopback port nothing listens on (bound, then closed): connecting is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def host_first(url: str, host: str, port: int) -> str:
    """``url`` with ``host:port`` listed before its own host, asking for the read-write server."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    if "host" in query:  # a Unix socket folder (the embedded server): hosts and ports go in the query
        query["host"] = f"{host},{query['host']}"
        query["port"] = f"{port},{query.get('port', '5432')}"
        netloc = parts.netloc
    else:
        userinfo, _, hostport = parts.netloc.rpartition("@")
        netloc = f"{userinfo}@{host}:{port},{hostport}" if userinfo else f"{host}:{port},{hostport}"
    query["target_session_attrs"] = "read-write"
    return urlunsplit((parts.scheme, netloc, parts.path, urlencode(query, safe="/,"), parts.fragment))


def dead_host_first(url: str) -> str:
    """``url`` with a dead loopback host listed before its own, asking for the read-write server."""
    return host_first(url, "127.0.0.1", dead_loopback_port())


def test_multi_host_urls_stay_whole() -> None:
    assert with_database(MULTI, "other") == MULTI.replace("/quayutec?", "/other?")
    config = DatabaseConfig.from_env({"DATABASE_URL": MULTI}, prefix="QUAYUTEC_ROOM_")
    assert config.url == MULTI and config.role == "quayutec_room"
    own = MULTI.replace("svc@", "room@")
    room = DatabaseConfig.from_env({"DATABASE_URL": MULTI, "QUAYUTEC_ROOM_DATABASE_URL": own}, prefix="QUAYUTEC_ROOM_")
    assert room.url == own and room.admin_url == MULTI
    assert DatabaseConfig.from_env({"DATABASE_URL": MULTI, "QUAYUTEC_ROOM_DATABASE_URL": own}).url == MULTI


async def test_a_multi_host_url_connects_to_the_host_that_answers(database_url: str) -> None:
    url = dead_host_first(database_url)
    pool = await create_pool(url, min_size=1, max_size=1, role="quayutec_room")
    try:
        assert await pool.fetchval("SELECT current_database()") == urlsplit(database_url).path.lstrip("/")
        assert await pool.fetchval("SELECT count(*) FROM rooms") == 0
    finally:
        await pool.close()
    # The same URL, pointed at another database by our helper, still lists both hosts.
    assert dead_host_first is not None and "127.0.0.1" in with_database(url, "postgres")


async def test_a_statement_that_timed_out_ends_its_connection(database_url: str) -> None:
    """asyncpg would wait for the server to confirm the cancellation and give the same connection
    back; ours is terminated, and the next caller gets a fresh one."""
    pool = await create_pool(database_url, min_size=1, max_size=1)
    try:
        async with pool.acquire() as conn:
            first = conn.get_server_pid()
        with pytest.raises(TimeoutError):
            async with pool.acquire() as conn:
                await conn.execute("SELECT pg_sleep(30)", timeout=0.2)
        async with pool.acquire() as conn:
            assert conn.get_server_pid() != first
        assert status_for(TimeoutError())[0] == grpc.StatusCode.UNAVAILABLE
    finally:
        await pool.close()


async def test_a_wait_for_a_connection_is_bounded(database_url: str) -> None:
    pool = await create_pool(database_url, min_size=1, max_size=1, acquire_timeout=0.2)
    try:
        async with pool.acquire():
            with pytest.raises(TimeoutError):
                async with pool.acquire():
                    pass
    finally:
        await pool.close()


async def test_a_read_only_server_is_unavailable_and_its_connections_are_dropped(database_url: str) -> None:
    """As after a failover, when the connection still reaches the old primary, now a standby."""
    pool = await create_pool(database_url, min_size=2, max_size=2)
    try:
        async with pool.acquire() as conn:
            await conn.execute("SET default_transaction_read_only = on")  # stands in for a demoted server
            pid = conn.get_server_pid()
        with pytest.raises(asyncpg.ReadOnlySQLTransactionError) as refused:
            async with pool.acquire() as conn:
                assert conn.get_server_pid() == pid
                await conn.execute("CREATE TEMPORARY TABLE written (id int)")
        assert status_for(refused.value)[0] == grpc.StatusCode.UNAVAILABLE
        for _ in range(2):
            async with pool.acquire() as conn:
                assert conn.get_server_pid() != pid
                await conn.execute("CREATE TEMPORARY TABLE written (id int)")
                await conn.execute("DROP TABLE written")
    finally:
        await pool.close()
    for exc in (asyncpg.AdminShutdownError("shutting down"), asyncpg.CannotConnectNowError("starting up")):
        assert status_for(exc)[0] == grpc.StatusCode.UNAVAILABLE


async def test_tcp_sockets_carry_keepalives_and_a_user_timeout() -> None:
    """Both sides: our socket's options, and the server settings asked of PostgreSQL (which it
    applies to its end of a TCP connection). Checked on a real TCP socket to a loopback listener."""
    tcp = TcpTimeouts(8.0)
    assert tcp.server_settings() == {
        "tcp_keepalives_idle": "4",
        "tcp_keepalives_interval": "1",
        "tcp_keepalives_count": "3",
        "tcp_user_timeout": "8000",
    }
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname()) as client:
            assert tcp.apply(client)
            assert client.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 8000
            assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 4
    with socket.socket(socket.AF_UNIX) as unix:
        assert not tcp.apply(unix)


async def test_every_pooled_session_asks_the_server_for_them(database_url: str) -> None:
    pool = await open_pool(DatabaseConfig(url=database_url, data_dir=Path("."), tcp_timeout_seconds=6.0))
    try:
        async with pool.acquire() as conn:
            assert connection_socket(conn) is not None
            # Set from the session's start (PostgreSQL shows 0 for them on a Unix socket, but takes them).
            sources = dict(
                await conn.fetch(
                    "SELECT name, source FROM pg_settings WHERE name = ANY($1::text[])",
                    list(TcpTimeouts().server_settings()),
                )
            )
            assert sources == {name: "client" for name in TcpTimeouts().server_settings()}, sources
    finally:
        await pool.close()


async def eventually(check: Callable[[], Awaitable[bool]]) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_SECONDS
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "not reached in time"
        await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
def own_pg(own_postgres: OwnPostgres) -> OwnPostgres:
    own_postgres.start()
    return own_postgres


async def test_health_is_not_serving_while_the_database_is_unreachable(own_pg: OwnPostgres) -> None:
    from dataclasses import replace

    database = DatabaseConfig(url=own_pg.url, data_dir=Path("."), role="quayutec_claims", health_interval_seconds=0.2)
    async with (
        running_claims(own_pg.url, database=replace(database, acquire_timeout_seconds=1.0)) as addr,
        service_channel(addr, "runtime") as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)

        def status_is(wanted: int, service: str = "quayutec.v1.ClaimsService") -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                return bool(reply.status == wanted)

            return check

        await eventually(status_is(health_pb2.HealthCheckResponse.SERVING))
        await asyncio.to_thread(own_pg.stop)
        try:
            await eventually(status_is(health_pb2.HealthCheckResponse.NOT_SERVING))
            # The process itself (liveness) is fine: a database outage restarts nothing.
            assert await status_is(health_pb2.HealthCheckResponse.SERVING, "")()
        finally:
            await asyncio.to_thread(own_pg.start)
        await eventually(status_is(health_pb2.HealthCheckResponse.SERVING))


async def test_the_admin_commands_take_a_multi_host_url(database_url: str) -> None:
    """`quayutec migrate` and an admin command that reads the database, given the dead host first."""
    from tests.test_cli import quayutec

    env = {"DATABASE_URL": dead_host_first(database_url)}
    migrated = await quayutec("migrate", env=env)
    assert migrated.returncode == 0, migrated.stderr
    assert "schema up to date" in migrated.stdout
    listed = await quayutec("keys", "list", "--company", "00000000-0000-0000-0000-000000000000", env=env)
    # It reached the database: the company was looked up there and is not found.
    assert "error: no company 00000000-0000-0000-0000-000000000000 in this database" in listed.stderr, listed.stderr


async def test_a_listen_connection_that_dies_listens_again(database_url: str) -> None:
    """The Gateway's LISTEN connection, ended by the server (as when the primary goes away), is
    replaced: it listens again and the next notification arrives."""
    from services.gateway.notify import Listener

    pool = await create_pool(database_url, min_size=1, max_size=2, role="quayutec_gateway")
    got: list[str] = []
    listened: list[int] = []
    listener = Listener(pool, {"quayutec_probe": got.append}, lambda: listened.append(1))
    listener.start()
    admin = await asyncpg.connect(database_url)
    try:
        await eventually(lambda: _true(listener.listening.is_set()))
        ended = await admin.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND query LIKE 'LISTEN%'"
        )
        assert ended >= 1
        await eventually(lambda: _true(len(listened) >= 2 and listener.listening.is_set()))
        await admin.execute("SELECT pg_notify('quayutec_probe', 'after')")
        await eventually(lambda: _true(got == ["after"]))
    finally:
        await admin.close()
        await listener.stop()
        await pool.close()


async def _true(value: bool) -> bool:
    return value


def test_a_multi_host_url_splits_into_one_url_per_host() -> None:
    assert single_host_urls(MULTI) == [
        "postgresql://svc@db-1.internal:5432/quayutec?target_session_attrs=read-write",
        "postgresql://svc@db-2.internal:5433/quayutec?target_session_attrs=read-write",
    ]
    socket_form = "postgresql://u@/quayutec?host=/run/a,/run/b&port=5432&target_session_attrs=read-write"
    assert single_host_urls(socket_form) == [
        "postgresql://u@/quayutec?target_session_attrs=read-write&host=/run/a&port=5432",
        "postgresql://u@/quayutec?target_session_attrs=read-write&host=/run/b&port=5432",
    ]
    one = "postgresql://u@db:5432/quayutec"
    assert single_host_urls(one) == [one]


async def test_a_silent_first_host_costs_one_connect_timeout_not_every_connection(database_url: str) -> None:
    """A host that accepts and never answers (a primary whose machine died) listed first: each host
    gets its own connect timeout, so the server after it is reached, and the pool then starts from it."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # the kernel completes handshakes; nothing ever speaks
    try:
        url = host_first(database_url, "127.0.0.1", int(silent.getsockname()[1]))
        pool = await create_pool(url, min_size=2, max_size=2, connect_timeout=1.0)
        try:
            assert await pool.fetchval("SELECT 1") == 1
            # Both connections opened; a third one made now starts from the host that worked.
            async with pool.acquire() as a, pool.acquire() as b:
                assert await a.fetchval("SELECT 2") == 2 and await b.fetchval("SELECT 3") == 3
        finally:
            await pool.close()
    finally:
        silent.close()
