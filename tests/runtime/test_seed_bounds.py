"""The seed's bounds on a run, on a Runtime made as ``python -m services.runtime`` makes it: its
settings read by ``RuntimeConfig.from_env`` from an environment that names only its peers, its
providers, its certificate and the loopback address an owner may use (every bound at its default),
and its retry policy the server's own. Only the clock is injected: the waits are recorded instead of
slept, so nothing here depends on how long anything takes.

- A provider that answers every request 529 (Anthropic) or 503 (OpenAI) gets exactly 3 requests,
  with waits of 2 s and then 8 s between them (no retry-after was named).
- An owner-supplied address gets exactly 1 request.
- A run's active time is 300 s, and the server applies the active time it reads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from quayutec.v1 import common_pb2, runtime_pb2
from services.runtime.config import RuntimeConfig
from services.runtime.server import create_server
from services.runtime.standin import StandinProvider
from tests.harness.channels import mtls_env
from tests.harness.claims import running_claims
from tests.harness.egress import TableResolver
from tests.harness.room import running_room
from tests.runtime.world import FakeClock, World, make_world, runtime_stub, start_request

# The stand-in listens on loopback, so an owner-supplied address may name it (Room and Runtime).
LOOPBACK = "127.0.0.1/32"
# Far more failures than any retry policy would ask for: the provider keeps failing.
ALWAYS = 100


def runtime_env(claims_addr: str, room_addr: str, standin_url: str) -> dict[str, str]:
    """What a deployment must tell a Runtime; every bound is left to its default."""
    return {
        "QUAYUTEC_RUNTIME_LISTEN": "127.0.0.1:0",
        "QUAYUTEC_CLAIMS_ADDR": claims_addr,
        "QUAYUTEC_ROOM_ADDR": room_addr,
        "QUAYUTEC_RUNTIME_ANTHROPIC_BASE_URL": standin_url,
        "QUAYUTEC_RUNTIME_OPENAI_BASE_URL": standin_url,
        "QUAYUTEC_RUNTIME_EGRESS_ALLOW": LOOPBACK,
        **mtls_env("runtime"),
    }


@dataclass
class Stack:
    world: World
    runtime: Any  # RuntimeServiceStub, as the Gateway calls it
    standin: StandinProvider
    clock: FakeClock


@asynccontextmanager
async def runtime_from_env(env: Mapping[str, str], clock: FakeClock) -> AsyncIterator[str]:
    """A Runtime server built from ``RuntimeConfig.from_env(env)`` with no policy given (the server's
    own); yields its address."""
    server = await create_server(RuntimeConfig.from_env(env), clock=clock, resolver=TableResolver())
    port = await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop()


@asynccontextmanager
async def default_stack(database_url: str, standin: StandinProvider, **env: str) -> AsyncIterator[Stack]:
    channels: list[grpc.aio.Channel] = []
    clock = FakeClock()
    async with (
        running_claims(database_url) as claims_addr,
        running_room(database_url, QUAYUTEC_RUNTIME_EGRESS_ALLOW=LOOPBACK) as room_addr,
        runtime_from_env({**runtime_env(claims_addr, room_addr, standin.base_url), **env}, clock) as addr,
    ):
        try:
            world = await make_world(room_addr, claims_addr, channels)
            yield Stack(world, runtime_stub(addr, channels), standin, clock)
        finally:
            for channel in channels:
                await channel.close()


async def run_of(s: Stack, agent: common_pb2.Agent) -> common_pb2.Run:
    """Wake ``agent`` with a message and wait for its run to end."""
    posted = await s.world.post(f"@{agent.name} please plan the launch", [agent.agent_id])
    (wake,) = posted.wakes
    started = await s.runtime.StartRun(start_request(wake), timeout=10)
    assert started.result == runtime_pb2.START_RUN_RESULT_ACCEPTED
    return await s.world.wait_for_run(started.run_id)


@pytest.mark.parametrize(("wire", "status"), [("anthropic", 529), ("openai", 503)])
async def test_a_provider_that_keeps_failing_gets_three_requests_two_then_eight_seconds_apart(
    wire: str, status: int, database_url: str, standin: StandinProvider
) -> None:
    async with default_stack(database_url, standin) as s:
        # agent_a speaks Anthropic's wire, agent_b OpenAI's.
        agent = s.world.agent_a if wire == "anthropic" else s.world.agent_b
        standin.enqueue_fault("overloaded", model=agent.model, times=ALWAYS)
        s.clock.witness = lambda: len(standin.requests(agent.model))
        run = await run_of(s, agent)
        replies = await s.world.messages_by(agent.agent_id)
    attempts = [(a.number, a.status_code, a.error_class, a.retryable, a.wait_seconds) for a in run.model_attempts]
    assert attempts == [
        (1, status, "overloaded", True, 2.0),
        (2, status, "overloaded", True, 8.0),
        (3, status, "overloaded", True, 0.0),
    ]
    assert len(standin.requests(agent.model)) == 3
    # The Runtime waited 2 s after the first request and 8 s after the second, and not after the last.
    assert (s.clock.sleeps, s.clock.witnessed) == ([2.0, 8.0], [1, 2])
    assert run.status == common_pb2.RUN_STATUS_FAILED
    assert "after 3 requests" in run.error
    assert replies == []


async def test_an_owner_supplied_address_gets_exactly_one_request(database_url: str, standin: StandinProvider) -> None:
    async with default_stack(database_url, standin) as s:
        own = await s.world.register_own_model(standin.base_url)
        standin.enqueue_fault("overloaded", model=own.model, times=ALWAYS)
        run = await run_of(s, own)
    assert [(a.number, a.status_code, a.error_class, a.wait_seconds) for a in run.model_attempts] == [
        (1, 503, "overloaded", 0.0)
    ]
    assert len(standin.requests(own.model)) == 1
    assert s.clock.sleeps == []
    assert run.status == common_pb2.RUN_STATUS_FAILED


def test_a_runs_active_time_is_300_seconds_as_the_server_reads_it() -> None:
    env = runtime_env("127.0.0.1:1", "127.0.0.1:2", "http://127.0.0.1:3")
    assert RuntimeConfig.from_env(env).run_seconds == 300.0
    assert RuntimeConfig.from_env({**env, "QUAYUTEC_RUNTIME_RUN_SECONDS": "12.5"}).run_seconds == 12.5


async def test_the_server_stops_a_run_at_the_active_time_it_reads(database_url: str, standin: StandinProvider) -> None:
    """The setting read from the environment is the one a run is held to: a model that has not
    answered when the active time is over ends the run TIMED_OUT, with nothing posted."""
    async with default_stack(database_url, standin, QUAYUTEC_RUNTIME_RUN_SECONDS="0.5") as s:
        # The reply would come long after the active time (the stand-in lets go of it when it stops).
        standin.enqueue_reply("too late", model=s.world.model_a, delay_seconds=600)
        run = await run_of(s, s.world.agent_a)
        replies = await s.world.messages_by(s.world.agent_a.agent_id)
    assert run.status == common_pb2.RUN_STATUS_TIMED_OUT
    assert run.error == "stopped after 0.5 s of active time"
    assert replies == []
