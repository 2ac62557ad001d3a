"""A refused RegisterAgent, through the Gateway and the Room: the caller learns what to fix and
never what an internal name resolves to; each service writes one log line per refusal, without a
traceback. Names resolve through a table (tests.harness.egress): no DNS query leaves the machine.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from quayutec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import NOWHERE
from tests.harness.egress import PUBLIC, TableResolver
from tests.harness.gateway import authed_gateway, make_company, running_gateway
from tests.harness.room import running_room

TABLE = {"models.acme.test": (PUBLIC,), "db.internal.test": ("10.1.2.3",), "vault.internal.test": ("127.0.0.1",)}


def registration(base_url: str) -> gateway_pb2.RegisterAgentRequest:
    return gateway_pb2.RegisterAgentRequest(
        name="own",
        provider=common_pb2.PROVIDER_OPENAI_COMPATIBLE,
        model="own-1",
        base_url=base_url,
        provider_key="sk-own",
    )


@asynccontextmanager
async def gateway_of_acme(database_url: str) -> AsyncIterator[gateway_pb2_grpc.GatewayServiceStub]:
    """A Room resolving through TABLE (``flaky.test`` fails for now), a Gateway before it, and a
    stub of that Gateway holding company Acme's key."""
    resolver = TableResolver(TABLE, temporary={"flaky.test"})
    async with (
        running_room(database_url, resolver=resolver) as room_addr,
        running_gateway(database_url, room_addr, NOWHERE, QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false") as addr,
    ):
        acme = await make_company(database_url, room_addr, "Acme")
        async with authed_gateway(addr, acme.secret) as gateway:
            yield gateway


def refusal_lines(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger and "RegisterAgent refused" in r.getMessage()]


@pytest.mark.parametrize(
    ("host", "code", "says"),
    [
        ("flaky.test", grpc.StatusCode.UNAVAILABLE, "try again later"),
        ("nowhere.test", grpc.StatusCode.INVALID_ARGUMENT, "name a host that resolves"),
        ("db.internal.test", grpc.StatusCode.INVALID_ARGUMENT, "resolves to a non-public address"),
        ("vault.internal.test", grpc.StatusCode.INVALID_ARGUMENT, "resolves to a non-public address"),
    ],
)
async def test_a_refused_registration_is_one_line_per_service_and_no_traceback(
    database_url: str, caplog: pytest.LogCaptureFixture, host: str, code: grpc.StatusCode, says: str
) -> None:
    async with gateway_of_acme(database_url) as gateway:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await gateway.RegisterAgent(registration(f"https://{host}/v1"), timeout=10)
                assert refused.value.code() == code
                details = refused.value.details() or ""
                assert says in details and host in details
                for address in TABLE.get(host, ()):
                    assert address not in details
        assert not (await gateway.ListAgents(gateway_pb2.ListAgentsRequest(), timeout=10)).agents
    assert len(refusal_lines(caplog, "quayutec.gateway.registration")) == 3
    assert len(refusal_lines(caplog, "quayutec.room.registration")) == 3
    assert [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR] == []
    assert [r.getMessage() for r in caplog.records if r.name == "quayutec.errors"] == []


async def test_refusal_lines_are_bounded(database_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Anyone with a key can cause refusals: a burst logs a few lines, then the rest are counted."""
    async with gateway_of_acme(database_url) as gateway:
        with caplog.at_level(logging.INFO):
            for _ in range(30):
                with pytest.raises(grpc.aio.AioRpcError):
                    await gateway.RegisterAgent(registration("https://flaky.test/v1"), timeout=10)
    for logger in ("quayutec.gateway.registration", "quayutec.room.registration"):
        assert 1 <= len(refusal_lines(caplog, logger)) <= 10
