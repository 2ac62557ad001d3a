"""bench/roundtrips.py's delay proxies: bytes go through unchanged both ways, each exchange is one
request burst, and a PostgreSQL URL (TCP or Unix socket) is reached through a proxy. No timing is
asserted."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
import pytest

from bench.roundtrips import DelayProxies, proxied_database_url


@pytest.fixture
def proxies() -> Iterator[DelayProxies]:
    made = DelayProxies()
    try:
        yield made
    finally:
        made.close()


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1024):
        writer.write(data.upper())
        await writer.drain()
    writer.close()


@pytest.mark.parametrize("delay_ms", [0.0, 3.0])
async def test_each_exchange_through_a_proxy_is_one_request_burst(proxies: DelayProxies, delay_ms: float) -> None:
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        host, _, proxy_port = proxies.open("Echo", "127.0.0.1", port).rpartition(":")
        proxies.set_delay(delay_ms)
        reader, writer = await asyncio.open_connection(host, int(proxy_port))
        for word in (b"one", b"two", b"three"):
            writer.write(word)
            assert await reader.readexactly(len(word)) == word.upper()
        writer.close()
        counted = proxies.take_counts()["Echo"]
        assert (counted.requests, counted.answers) == (3, 3)
        assert proxies.take_counts()["Echo"].requests == 0  # taken: a fresh count
    finally:
        server.close()


async def test_postgresql_is_reached_through_its_proxy(proxies: DelayProxies, pg_server_url: str) -> None:
    url = proxied_database_url(pg_server_url, proxies)
    assert url.split("@")[-1].startswith("127.0.0.1:")
    conn = await asyncpg.connect(url)
    try:
        proxies.take_counts()  # the start-up's exchanges
        assert await conn.fetchval("SELECT 41 + 1") == 42
    finally:
        await conn.close()
    assert proxies.take_counts()["PostgreSQL"].requests >= 1
