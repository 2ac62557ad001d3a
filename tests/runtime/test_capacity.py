"""Runs in flight: the open-file budget checked at start, and a provider pool that fits the run cap."""

from __future__ import annotations

import asyncio
import resource

import pytest

from quayutec.config import ConfigError
from services.runtime.capacity import FD_RESERVE, check_fd_budget, fds_needed, raise_fd_limit
from services.runtime.config import RuntimeConfig
from services.runtime.model import make_http_client


def test_fd_budget_names_the_setting_and_the_limit_to_fix() -> None:
    check_fd_budget(1000, fds_needed(1000))  # exactly enough
    with pytest.raises(ConfigError) as raised:
        check_fd_budget(2048, 1024)
    message = str(raised.value)
    assert "QUAYUTEC_RUNTIME_MAX_RUNS=2048" in message
    assert "1024" in message and "ulimit" in message
    assert f"at most {1024 - FD_RESERVE}" in message


def test_raising_the_soft_limit_never_lowers_it() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = raise_fd_limit()
    assert limit >= soft
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] in (limit, resource.RLIM_INFINITY)
    if hard != resource.RLIM_INFINITY:
        assert limit <= hard


def test_the_default_cap_fits_this_machine_and_the_reserve() -> None:
    default = RuntimeConfig.from_env({}).max_runs
    assert default >= 1000
    assert fds_needed(default) == default + FD_RESERVE


async def test_every_run_in_flight_gets_its_own_provider_connection() -> None:
    """150 requests held open at once by a server that answers none until all have arrived: a
    client sized for 150 runs opens 150 connections (httpx's default pool of 100 would queue 50)."""
    runs = 150
    arrived = 0
    all_in = asyncio.Event()
    peers: set[object] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal arrived
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
            0,
        )
        await reader.readexactly(length)
        peers.add(writer.get_extra_info("peername"))
        arrived += 1
        if arrived == runs:
            all_in.set()
        await all_in.wait()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with make_http_client(30.0, trust_env=False, max_connections=runs) as client:
            answers = await asyncio.gather(
                *(client.post(f"http://127.0.0.1:{port}/v1/messages", json={"n": i}) for i in range(runs))
            )
    finally:
        server.close()
        await server.wait_closed()
    assert [a.status_code for a in answers] == [200] * runs
    assert len(peers) == runs


def test_a_pool_smaller_than_one_connection_is_refused() -> None:
    with pytest.raises(ValueError, match="max_connections"):
        make_http_client(5.0, max_connections=0)
