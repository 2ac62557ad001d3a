"""Shared fixtures: a real PostgreSQL (DATABASE_URL or embedded), one fresh database per test.

A template database with every migration applied is made once per session; each test gets a
clone of it (``CREATE DATABASE ... TEMPLATE``), which takes milliseconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from quayutec.db import create_pool, embedded_ctl, embedded_database_url, embedded_pgdata, embedded_pid, with_database
from quayutec.migrate import migrate
from quayutec.telemetry import SpanCapture, configure_for_tests
from services.runtime.standin import StandinProvider
from tests.harness.channels import make_test_pki
from tests.harness.jaeger import Jaeger, running_jaeger
from tests.harness.otlp import Collector, otlp_collector

# Fixtures shared by modules that own a PostgreSQL of their own (outage tests).
pytest_plugins = ["tests.harness.postgres"]

# One template per test session, so sessions running side by side never drop each other's.
TEMPLATE_DB = f"quayutec_test_template_{os.getpid()}"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def test_pki() -> None:
    """The test PKI every server started here reads its own folder of (the tests are its admin)."""
    make_test_pki()


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """The admin URL of the PostgreSQL server the tests use."""
    url = os.environ.get("DATABASE_URL", "").strip()
    if url:
        yield url
        return
    data_dir = checkout_data_dir()
    pgdata = embedded_pgdata(data_dir)
    started = embedded_pid(pgdata) is None
    yield embedded_database_url(data_dir)
    if started:
        # This session started it, so it stops it: no server outlives the checkout that ran it.
        embedded_ctl("stop", pgdata)


def checkout_data_dir() -> Path:
    """The embedded PostgreSQL folder of this checkout's tests: short (the server's Unix socket
    lives in it) and outside the clone, but its own, so clones on one machine never share a server."""
    checkout = hashlib.sha256(str(REPO).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"qy-{checkout}"


async def _make_template(admin_url: str) -> None:
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE_DB} WITH (FORCE)")
        await conn.execute(f"CREATE DATABASE {TEMPLATE_DB}")
    finally:
        await conn.close()
    pool = await create_pool(with_database(admin_url, TEMPLATE_DB), min_size=1, max_size=2)
    try:
        await migrate(pool)
    finally:
        await pool.close()


async def _drop_template(admin_url: str) -> None:
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE_DB} WITH (FORCE)")
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def template_ready(pg_server_url: str) -> Iterator[str]:
    asyncio.run(_make_template(pg_server_url))
    yield pg_server_url
    asyncio.run(_drop_template(pg_server_url))


async def create_test_database(admin_url: str, *, template: str | None = TEMPLATE_DB) -> str:
    name = f"qt_{uuid.uuid4().hex[:16]}"
    conn = await asyncpg.connect(admin_url)
    try:
        clause = f" TEMPLATE {template}" if template else ""
        await conn.execute(f"CREATE DATABASE {name}{clause}")
    finally:
        await conn.close()
    return with_database(admin_url, name)


async def drop_test_database(admin_url: str, url: str) -> None:
    name = urlsplit(url).path.lstrip("/")
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        await conn.close()


@pytest.fixture
async def database_url(template_ready: str) -> AsyncIterator[str]:
    """A fresh, fully migrated database for one test."""
    url = await create_test_database(template_ready)
    yield url
    await drop_test_database(template_ready, url)


@pytest.fixture
async def empty_database_url(template_ready: str) -> AsyncIterator[str]:
    """A fresh database with no schema at all."""
    url = await create_test_database(template_ready, template=None)
    yield url
    await drop_test_database(template_ready, url)


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(database_url, min_size=1, max_size=10)
    yield p
    await p.close()


@pytest.fixture
def captured() -> Iterator[tuple[InMemorySpanExporter, SpanCapture]]:
    """The process's spans, kept in memory for one test (instrumentation switched on by it)."""
    exporter = InMemorySpanExporter()
    capture = configure_for_tests(exporter)
    try:
        yield exporter, capture
    finally:
        capture.close()


@pytest.fixture
async def collector() -> AsyncIterator[tuple[Collector, SpanCapture]]:
    """An OTLP/gRPC receiver in the test, with this process's spans exported to it (tests.harness.otlp)."""
    async with otlp_collector() as got:
        yield got


@pytest.fixture
def standin() -> Iterator[StandinProvider]:
    """The stand-in model provider (a real HTTP server on 127.0.0.1)."""
    with StandinProvider() as provider:
        yield provider


@pytest.fixture(scope="session")
def jaeger() -> Iterator[Jaeger]:
    """A real Jaeger v2 (tests.harness.jaeger) for the whole session: built by `make jaeger-bin` once,
    started from deploy/k8s/base/jaeger-config.yaml on ephemeral loopback ports, stopped at the end."""
    yield from running_jaeger()
