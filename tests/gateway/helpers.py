"""Small helpers shared by the Gateway tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from quayutec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

GatewayStub = gateway_pb2_grpc.GatewayServiceStub


async def expect_error(code: grpc.StatusCode, call: Awaitable[Any], says: str = "") -> grpc.aio.AioRpcError:
    """Await ``call`` and check it fails with ``code`` (and a message containing ``says``)."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, f"expected {code.name}, got {err.value.code().name}: {err.value.details()}"
    assert says in (err.value.details() or ""), err.value.details()
    return err.value


async def register_agent(gw: GatewayStub, name: str = "helper") -> common_pb2.Agent:
    response = await gw.RegisterAgent(
        gateway_pb2.RegisterAgentRequest(
            name=name, provider=common_pb2.PROVIDER_ANTHROPIC, model="claude-test", provider_key="sk-test-secret"
        ),
        timeout=10,
    )
    agent: common_pb2.Agent = response.agent
    return agent


async def create_room(gw: GatewayStub, name: str = "deal room") -> common_pb2.Room:
    response = await gw.CreateRoom(gateway_pb2.CreateRoomRequest(name=name), timeout=10)
    room: common_pb2.Room = response.room
    return room


async def eventually(predicate: Callable[[], Awaitable[bool]], within: float = 60.0) -> None:
    """Poll ``predicate`` (state held by another server) until it holds; fails after ``within`` seconds."""
    async with asyncio.timeout(within):
        while not await predicate():  # noqa: ASYNC110 - the state lives in another server; nothing to wait on
            await asyncio.sleep(0.05)
