"""Fixtures for Gateway tests: a real Room, a real Claims, companies with keys, authed stubs."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from quayutec.v1 import gateway_pb2_grpc
from tests.harness.claims import running_claims
from tests.harness.gateway import CompanyKey, authed_gateway, make_company, running_gateway
from tests.harness.room import running_room

# Nothing listens here: for Gateways whose delivery loop is off.
NOWHERE = "127.0.0.1:9"


@pytest.fixture
async def room_addr(database_url: str) -> AsyncIterator[str]:
    async with running_room(database_url) as addr:
        yield addr


@pytest.fixture
async def claims_addr(database_url: str) -> AsyncIterator[str]:
    async with running_claims(database_url) as addr:
        yield addr


@pytest.fixture
async def gateway_addr(database_url: str, room_addr: str) -> AsyncIterator[str]:
    """A Gateway without delivery or rate limit, for API tests."""
    async with running_gateway(
        database_url, room_addr, NOWHERE, QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false", QUAYUTEC_GATEWAY_POST_RATE="0"
    ) as addr:
        yield addr


@pytest.fixture
async def acme(database_url: str, room_addr: str) -> CompanyKey:
    return await make_company(database_url, room_addr, "Acme")


@pytest.fixture
async def globex(database_url: str, room_addr: str) -> CompanyKey:
    return await make_company(database_url, room_addr, "Globex")


@pytest.fixture
async def initech(database_url: str, room_addr: str) -> CompanyKey:
    return await make_company(database_url, room_addr, "Initech")


@pytest.fixture
async def acme_gw(gateway_addr: str, acme: CompanyKey) -> AsyncIterator[gateway_pb2_grpc.GatewayServiceStub]:
    async with authed_gateway(gateway_addr, acme.secret) as stub:
        yield stub


@pytest.fixture
async def globex_gw(gateway_addr: str, globex: CompanyKey) -> AsyncIterator[gateway_pb2_grpc.GatewayServiceStub]:
    async with authed_gateway(gateway_addr, globex.secret) as stub:
        yield stub


@pytest.fixture
async def initech_gw(gateway_addr: str, initech: CompanyKey) -> AsyncIterator[gateway_pb2_grpc.GatewayServiceStub]:
    async with authed_gateway(gateway_addr, initech.secret) as stub:
        yield stub
