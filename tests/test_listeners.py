"""Every listener cuts connections that do nothing useful: a client that connects and never
finishes its handshake (gRPC) or its request (the console's HTTP), and a gRPC connection that
holds no call. Each test opens a bounded number of such connections to a real server and waits,
with a failsafe far below gRPC's own 120 s handshake default, for the server to close every one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from quayutec.config import GATEWAY, ROOM, ConnectionLimits, ServerConfig
from quayutec.server import connection_options
from tests.harness.gateway import running_gateway
from tests.harness.room import running_room

HALF_OPEN = 50
# The HTTP/2 client preface and an empty SETTINGS frame: a handshake done, then no call.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
FAILSAFE_SECONDS = 30.0


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def open_idle(port: int, count: int, first_bytes: bytes = b"") -> list[Conn]:
    """``count`` TCP connections to 127.0.0.1:``port``, each sending ``first_bytes`` and then nothing.
    The caller keeps the writers: a writer that is garbage-collected closes its connection."""
    conns = []
    for _ in range(count):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        if first_bytes:
            writer.write(first_bytes)
            await writer.drain()
        conns.append((reader, writer))
    return conns


async def closed_by_server(conns: Sequence[Conn], limit: float = FAILSAFE_SECONDS) -> int:
    """Waits until the server has closed every connection (end of stream or reset; we never close
    one first), at most ``limit`` seconds (a failsafe); returns how many it closed, then closes ours."""

    async def until_closed(reader: asyncio.StreamReader) -> bool:
        try:
            while await reader.read(65536):
                pass
        except ConnectionError:
            pass
        return True

    try:
        done = await asyncio.gather(
            *(asyncio.wait_for(until_closed(reader), limit) for reader, _ in conns), return_exceptions=True
        )
    finally:
        for _, writer in conns:
            writer.close()
    return sum(1 for d in done if d is True)


def test_every_limit_is_a_grpc_core_argument() -> None:
    options = dict(connection_options(ConnectionLimits(2.5, 300, 60, 20)))
    assert options["grpc.server_handshake_timeout_ms"] == 2500
    assert options["grpc.max_connection_idle_ms"] == 300_000
    assert options["grpc.keepalive_time_ms"] == 60_000
    assert options["grpc.keepalive_timeout_ms"] == 20_000
    env = {
        "QUAYUTEC_GRPC_HANDSHAKE_TIMEOUT_SECONDS": "3",
        "QUAYUTEC_GRPC_IDLE_SECONDS": "40",
        "QUAYUTEC_GRPC_KEEPALIVE_SECONDS": "50",
        "QUAYUTEC_GRPC_KEEPALIVE_TIMEOUT_SECONDS": "6",
    }
    assert ServerConfig.from_env(ROOM, env).connections == ConnectionLimits(3, 40, 50, 6)
    assert ServerConfig.from_env(GATEWAY, {}).connections == ConnectionLimits()


async def test_the_gateway_cuts_half_open_and_idle_connections(database_url: str) -> None:
    async with (
        running_room(database_url) as room_addr,
        running_gateway(
            database_url,
            room_addr,
            "127.0.0.1:9",
            QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false",
            QUAYUTEC_GRPC_HANDSHAKE_TIMEOUT_SECONDS="1",
            QUAYUTEC_GRPC_IDLE_SECONDS="2",
        ) as addr,
    ):
        port = int(addr.rpartition(":")[2])
        silent = await open_idle(port, HALF_OPEN)
        partial = await open_idle(port, 10, H2_PREFACE[:10])
        no_call = await open_idle(port, 10, H2_PREFACE)
        assert await closed_by_server(silent) == HALF_OPEN
        assert await closed_by_server(partial) == 10
        assert await closed_by_server(no_call) == 10
        # An open stream keeps its connection past the idle limit; the server still answers.
        async with grpc.aio.insecure_channel(addr) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=GATEWAY.grpc_service))
            first = await asyncio.wait_for(watch.read(), 10)
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            await asyncio.sleep(3)  # past the 2 s idle limit, with the stream open
            assert not watch.done()
            answer = await health.Check(health_pb2.HealthCheckRequest(service=GATEWAY.grpc_service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()


async def test_an_internal_service_cuts_an_unfinished_tls_handshake(database_url: str) -> None:
    async with running_room(database_url, QUAYUTEC_GRPC_HANDSHAKE_TIMEOUT_SECONDS="1") as addr:
        port = int(addr.rpartition(":")[2])
        silent = await open_idle(port, HALF_OPEN)
        # The first bytes of a TLS ClientHello, and then nothing.
        partial = await open_idle(port, 10, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
        assert await closed_by_server(silent) == HALF_OPEN
        assert await closed_by_server(partial) == 10


@pytest.mark.parametrize("bad", ["0", "-1", "soon"])
def test_a_bad_limit_stops_the_service_at_start(bad: str) -> None:
    from quayutec.config import ConfigError

    with pytest.raises(ConfigError, match="QUAYUTEC_GRPC_HANDSHAKE_TIMEOUT_SECONDS"):
        ServerConfig.from_env(ROOM, {"QUAYUTEC_GRPC_HANDSHAKE_TIMEOUT_SECONDS": bad})
