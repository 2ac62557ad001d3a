"""Every listener cuts connections that do nothing useful: a client that connects and never
finishes its handshake (gRPC) or its request (the console's HTTP), a gRPC connection that holds
no call; and the console reads no request body past its cap or its deadline. Each test opens a
bounded number of such connections to a real server and waits, with a failsafe far below gRPC's
own 120 s handshake default, for the server to close every one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from quayutec.channels import KEEPALIVE_MS, internal_channel
from quayutec.config import GATEWAY, ROOM, ConnectionLimits, ServerConfig
from quayutec.httpserve import HttpLimits
from quayutec.server import connection_options
from services.stack import REPO, free_port
from tests.harness.channels import pki_identity
from tests.harness.gateway import running_gateway
from tests.harness.room import running_room

HALF_OPEN = 50
# The HTTP/2 client preface and an empty SETTINGS frame: a handshake done, then no call.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
FAILSAFE_SECONDS = 30.0


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def open_idle(port: int, count: int, first_bytes: bytes = b"", *, source: str | None = None) -> list[Conn]:
    """``count`` TCP connections to 127.0.0.1:``port`` (from ``source``, another loopback address, when
    given), each sending ``first_bytes`` and then nothing. The caller keeps the writers: a writer that is
    garbage-collected closes its connection."""
    conns = []
    for _ in range(count):
        local = (source, 0) if source else None
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=local)
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


async def test_our_own_keepalive_pings_never_get_a_connection_closed(database_url: str) -> None:
    """Internal channels ping every KEEPALIVE_MS, idle or not, to find a silent peer; the server must
    accept that (a client pinging more often than the server allows gets GOAWAY "too many pings"
    on its third ping, and its open calls end). Idle for four ping periods: the channel stays READY
    and the one connection it opened serves the next call."""
    async with running_room(database_url) as addr:
        async with internal_channel(addr, identity=pki_identity("runtime"), server="room") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            await health.Check(health_pb2.HealthCheckRequest(service=ROOM.grpc_service), timeout=10)
            seen = [channel.get_state(try_to_connect=False)]

            async def record_changes() -> None:
                while True:
                    await channel.wait_for_state_change(seen[-1])
                    seen.append(channel.get_state(try_to_connect=False))

            recorder = asyncio.create_task(record_changes())
            await asyncio.sleep(4 * KEEPALIVE_MS / 1000 + 1)
            recorder.cancel()
            assert seen == [grpc.ChannelConnectivity.READY]
            await health.Check(health_pb2.HealthCheckRequest(service=ROOM.grpc_service), timeout=10)


@pytest.mark.parametrize("bad", ["0", "-1", "soon"])
def test_a_bad_limit_stops_the_service_at_start(bad: str) -> None:
    from quayutec.config import ConfigError

    with pytest.raises(ConfigError, match="QUAYUTEC_GRPC_HANDSHAKE_TIMEOUT_SECONDS"):
        ServerConfig.from_env(ROOM, {"QUAYUTEC_GRPC_HANDSHAKE_TIMEOUT_SECONDS": bad})


# -- the console (HTTP) -------------------------------------------------------------------------------


@pytest.fixture
def console(tmp_path: Path) -> Iterator[int]:
    """``python -m services.console`` with short limits (1 s head and body, 1 KiB bodies); yields its port.
    Its Gateway address is a closed local port: these tests never get past the console's own door."""
    with running_console_process(
        tmp_path,
        QUAYUTEC_CONSOLE_HEADER_TIMEOUT_SECONDS="1",
        QUAYUTEC_CONSOLE_BODY_TIMEOUT_SECONDS="1",
        QUAYUTEC_CONSOLE_KEEP_ALIVE_SECONDS="1",
        QUAYUTEC_CONSOLE_MAX_BODY_BYTES="1024",
    ) as port:
        yield port


@contextlib.contextmanager
def running_console_process(tmp_path: Path, **env: str) -> Iterator[int]:
    """``python -m services.console`` with ``env``; yields its port once it answers /healthz."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.console"],
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": str(REPO),
            "QUAYUTEC_DATA_DIR": str(tmp_path),
            "QUAYUTEC_CONSOLE_LISTEN": f"127.0.0.1:{port}",
            "QUAYUTEC_GATEWAY_ADDR": "127.0.0.1:9",
            **env,
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"the console exited: {proc.stderr.read() if proc.stderr else ''}"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if s.recv(100).startswith(b"HTTP/1.1 200"):
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the console did not start"
            time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


async def answer_and_close(port: int, request: bytes) -> bytes:
    """Sends ``request`` and reads until the server closes the connection (failsafe-bounded)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), FAILSAFE_SECONDS)
    finally:
        writer.close()


async def test_the_console_cuts_clients_that_never_finish_a_request(console: int) -> None:
    silent = await open_idle(console, HALF_OPEN)
    partial_line = await open_idle(console, 10, b"GET / HT")
    partial_headers = await open_idle(console, 10, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    assert await closed_by_server(silent) == HALF_OPEN
    assert await closed_by_server(partial_line) == 10
    assert await closed_by_server(partial_headers) == 10
    # A kept-alive connection that goes quiet after its answer is closed too.
    (kept,) = await open_idle(console, 1, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert await closed_by_server([kept]) == 1


async def test_the_console_bounds_request_bodies(console: int) -> None:
    head = b"POST /signin HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\n"
    declared = await answer_and_close(console, head + b"Content-Length: 5000\r\n\r\n" + b"a" * 100)
    assert declared.startswith(b"HTTP/1.1 413 ")
    chunk = b"a" * 600
    streamed = await answer_and_close(
        console,
        head + b"Transfer-Encoding: chunked\r\n\r\n" + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 2 + b"0\r\n\r\n",
    )
    assert streamed.startswith(b"HTTP/1.1 413 ")
    slow = await answer_and_close(console, head + b"Content-Length: 100\r\n\r\napi_key=")
    assert slow.startswith(b"HTTP/1.1 408 ")
    # Within the limits the console answers as usual (the sign-in form asks for its token first).
    page = await answer_and_close(console, b"GET /signin HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert page.startswith(b"HTTP/1.1 200 ")
    small = await answer_and_close(console, head + b"Content-Length: 9\r\nConnection: close\r\n\r\napi_key=x")
    assert small.startswith(b"HTTP/1.1 403 "), small[:200]  # no CSRF token: refused by the page itself


@pytest.mark.parametrize("per_source", ["0", "100"])
async def test_one_address_holding_half_sent_requests_does_not_take_the_console(
    tmp_path: Path, per_source: str
) -> None:
    """Slowloris from 127.0.0.2: 500 requests whose headers never end, held open (the head deadline is
    60 s here). With no per-source limit ("0") they fill QUAYUTEC_CONSOLE_MAX_CONNECTIONS and everyone
    else is answered 503 (the finding); with the default (100 per address), /healthz and a real page
    still answer 200 to another address every time."""
    with running_console_process(
        tmp_path / per_source,
        QUAYUTEC_CONSOLE_HEADER_TIMEOUT_SECONDS="60",
        QUAYUTEC_CONSOLE_MAX_CONNECTIONS_PER_SOURCE=per_source,
    ) as port:
        held = await open_idle(port, 500, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ", source="127.0.0.2")
        try:
            statuses = []
            for path in ("/healthz", "/signin") * 10:
                request = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
                statuses.append((await answer_and_close(port, request))[:12])
            if per_source == "0":
                assert b"HTTP/1.1 503" in statuses, statuses
            else:
                assert statuses == [b"HTTP/1.1 200"] * 20, statuses
                # The source's connections past its 100 were closed at once; its 100 are still held.
                assert await closed_by_server(held[100:]) == 400
        finally:
            for _, writer in held:
                writer.close()


def test_the_console_limits_are_settings() -> None:
    assert HttpLimits.from_env({}) == HttpLimits(10.0, 30.0, 5, 500, 1024 * 1024)
    assert HttpLimits.from_env({"QUAYUTEC_CONSOLE_MAX_BODY_BYTES": "4096"}).max_body_bytes == 4096
