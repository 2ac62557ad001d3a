"""Fixtures for Claims tests: a real Claims server on a fresh database, and a client stub."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from quayutec.v1 import claims_pb2_grpc
from tests.harness.channels import service_channel
from tests.harness.claims import claims_stub, running_claims


@pytest.fixture
async def claims_addr(database_url: str) -> AsyncIterator[str]:
    async with running_claims(database_url) as addr:
        yield addr


@pytest.fixture
async def claims(claims_addr: str) -> AsyncIterator[claims_pb2_grpc.ClaimsServiceAsyncStub]:
    async with service_channel(claims_addr, "runtime") as channel:
        yield claims_stub(channel)
