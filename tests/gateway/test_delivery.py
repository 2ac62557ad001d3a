"""The wake delivery loop against a real Room, a real Claims and a stand-in Runtime server.

Each test posts through the public Gateway (delivery off there), then lets one or more delivering
Gateway replicas lease the wakes from the Room and StartRun them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from quayutec.v1 import claims_pb2, claims_pb2_grpc, common_pb2, gateway_pb2, room_pb2, room_pb2_grpc, runtime_pb2
from services.stack import free_port
from tests.gateway.helpers import GatewayStub, create_room, eventually, register_agent
from tests.gateway.runtime_standin import record_first_row, running_standin_runtime
from tests.harness.channels import mtls_env, service_channel
from tests.harness.gateway import authed_gateway, make_company, running_gateway
from tests.harness.room import running_room

REPO = Path(__file__).resolve().parent.parent.parent

# Fast loops for tests; the lease is long unless a test is about lease expiry.
FAST = {
    "QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS": "0.02",
    "QUAYUTEC_GATEWAY_BACKOFF_BASE_SECONDS": "0.05",
    "QUAYUTEC_GATEWAY_BACKOFF_CEILING_SECONDS": "0.4",
    "QUAYUTEC_GATEWAY_POST_RATE": "0",
}


# StartRun's deadline where a test hangs a call on purpose: a hang meets it, an answered call never does.
HUNG_CALL_SECONDS = "5"
# Leases of tests that stop a replica mid-call: they outlast the whole first half of the test, and
# the test then ends them itself (expire_leases) as time would, instead of waiting for them.
LONG_LEASE = {"QUAYUTEC_GATEWAY_LEASE_SECONDS": "120", "QUAYUTEC_GATEWAY_START_RUN_TIMEOUT_SECONDS": "110"}


@pytest.fixture
async def room_stub(room_addr: str) -> AsyncIterator[room_pb2_grpc.RoomServiceStub]:
    async with service_channel(room_addr, "gateway") as channel:
        yield room_pb2_grpc.RoomServiceStub(channel)


async def pending(room: room_pb2_grpc.RoomServiceStub) -> int:
    response = await room.CountPendingWakes(room_pb2.RoomServiceCountPendingWakesRequest(), timeout=10)
    return int(response.pending)


async def post_wakes(gw: GatewayStub, agents: int, messages: int) -> tuple[common_pb2.Room, list[str]]:
    """A room with ``agents`` agents and ``messages`` messages mentioning them all: agents*messages wakes."""
    room = await create_room(gw)
    agent_ids = [(await register_agent(gw, f"agent-{n}")).agent_id for n in range(agents)]
    wake_ids: list[str] = []
    for n in range(messages):
        posted = await gw.PostMessage(
            gateway_pb2.PostMessageRequest(
                room_id=room.room_id, person="Ada", body=f"message {n}", mention_agent_ids=agent_ids
            ),
            timeout=30,
        )
        wake_ids.extend(posted.wake_ids)
    assert len(wake_ids) == agents * messages
    return room, wake_ids


async def test_wakes_are_delivered_once_with_their_source(
    database_url: str, room_addr: str, claims_addr: str, acme_gw: GatewayStub, room_stub: room_pb2_grpc.RoomServiceStub
) -> None:
    room = await create_room(acme_gw)
    a, b = await register_agent(acme_gw, "a"), await register_agent(acme_gw, "b")
    posted = await acme_gw.PostMessage(
        gateway_pb2.PostMessageRequest(
            room_id=room.room_id, person="Ada", body="hi both", mention_agent_ids=[a.agent_id, b.agent_id]
        ),
        timeout=10,
    )
    sent = await acme_gw.SendTask(
        gateway_pb2.SendTaskRequest(room_id=room.room_id, person="Ada", to_agent_id=b.agent_id, title="do it"),
        timeout=10,
    )
    assert await pending(room_stub) == 3
    async with (
        running_standin_runtime(claims_addr, room_addr) as (runtime_addr, runtime),
        running_gateway(database_url, room_addr, runtime_addr, **FAST),
    ):
        await eventually(lambda: _none_pending(room_stub))
    seen = {
        (c.request.wake_id, c.request.agent_id, c.request.room_id, c.request.wake_kind, c.request.wake_source_id)
        for c in runtime.calls
    }
    message_id, task_id = posted.message.message_id, sent.task.task_id
    assert {(agent, kind, source) for _, agent, _, kind, source in seen} == {
        (a.agent_id, common_pb2.WAKE_KIND_MESSAGE, message_id),
        (b.agent_id, common_pb2.WAKE_KIND_MESSAGE, message_id),
        (b.agent_id, common_pb2.WAKE_KIND_TASK, task_id),
    }
    assert {room_id for _, _, room_id, _, _ in seen} == {room.room_id}
    assert {c.request.wake_id for c in runtime.calls} == {*posted.wake_ids, *sent.wake_ids}
    assert [c.answer for c in runtime.calls] == ["ACCEPTED"] * 3


async def _none_pending(room: room_pb2_grpc.RoomServiceStub) -> bool:
    return await pending(room) == 0


async def test_already_claimed_is_delivered(
    database_url: str, room_addr: str, claims_addr: str, acme_gw: GatewayStub, room_stub: room_pb2_grpc.RoomServiceStub
) -> None:
    _, wake_ids = await post_wakes(acme_gw, agents=2, messages=1)
    async with service_channel(claims_addr, "runtime") as channel:
        claims = claims_pb2_grpc.ClaimsServiceStub(channel)
        leased = await room_stub.LeaseWakes(
            room_pb2.RoomServiceLeaseWakesRequest(lease_owner="test", max_wakes=1, lease_seconds=1), timeout=10
        )
        first = leased.wakes[0]
        # Claimed before, and its run recorded (as if a Runtime took it and the settle was lost); the
        # lease lapses.
        await claims.ClaimOnce(claims_pb2.ClaimOnceRequest(agent_id=first.agent_id, wake_id=first.wake_id))
    # As a Runtime's run records it with its room read.
    async with service_channel(room_addr, "runtime") as channel:
        request = runtime_pb2.StartRunRequest(
            agent_id=first.agent_id, wake_id=first.wake_id, room_id=first.room_id, wake_kind=first.kind
        )
        await record_first_row(room_pb2_grpc.RoomServiceStub(channel), request, "the claimant")
    async with (
        running_standin_runtime(claims_addr, room_addr) as (runtime_addr, runtime),
        running_gateway(database_url, room_addr, runtime_addr, **FAST),
    ):
        await eventually(lambda: _none_pending(room_stub))
    answers = {c.request.wake_id: c.answer for c in runtime.calls}
    assert answers == {
        first.wake_id: "ALREADY_CLAIMED",
        next(w for w in wake_ids if w != first.wake_id): "ACCEPTED",
    }


async def test_refusals_and_timeouts_are_retried_until_claimed(
    database_url: str, room_addr: str, claims_addr: str, acme_gw: GatewayStub, room_stub: room_pb2_grpc.RoomServiceStub
) -> None:
    _, wake_ids = await post_wakes(acme_gw, agents=3, messages=1)
    async with running_standin_runtime(claims_addr, room_addr) as (runtime_addr, runtime):
        runtime.script(wake_ids[0], "UNAVAILABLE", "RESOURCE_EXHAUSTED", "HANG")
        runtime.script(wake_ids[1], "RESOURCE_EXHAUSTED")
        # The hung call ends at StartRun's deadline. It is far longer than any answered call takes
        # even on a loaded machine, so only the scripted hang ever meets it: the sequence is exact.
        async with running_gateway(
            database_url, room_addr, runtime_addr, **FAST, QUAYUTEC_GATEWAY_START_RUN_TIMEOUT_SECONDS=HUNG_CALL_SECONDS
        ):
            await eventually(lambda: _none_pending(room_stub))
    by_wake: dict[str, list[str]] = {w: [] for w in wake_ids}
    for call in runtime.calls:
        by_wake[call.request.wake_id].append(call.answer)
    assert by_wake == {
        wake_ids[0]: ["UNAVAILABLE", "RESOURCE_EXHAUSTED", "HANG", "ACCEPTED"],
        wake_ids[1]: ["RESOURCE_EXHAUSTED", "ACCEPTED"],
        wake_ids[2]: ["ACCEPTED"],
    }


async def test_runtime_down_for_a_while_then_up_delivers_every_wake_once(
    database_url: str,
    room_addr: str,
    claims_addr: str,
    acme_gw: GatewayStub,
    room_stub: room_pb2_grpc.RoomServiceStub,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="quayutec.gateway.delivery")
    _, wake_ids = await post_wakes(acme_gw, agents=5, messages=4)
    port = free_port()  # nothing listens here yet: the Runtime is down
    async with running_gateway(database_url, room_addr, f"127.0.0.1:{port}", **FAST):

        def failed_wakes() -> set[str]:
            return {
                w for w in wake_ids for r in caplog.records if w in r.getMessage() and "not delivered" in r.getMessage()
            }

        async def each_failed_twice() -> bool:
            failures = Counter(
                w for r in caplog.records if "not delivered" in r.getMessage() for w in wake_ids if w in r.getMessage()
            )
            return len(failures) == len(wake_ids) and min(failures.values()) >= 2

        await eventually(each_failed_twice)
        assert failed_wakes() == set(wake_ids)
        assert await pending(room_stub) == len(wake_ids)  # still pending while Runtime is down
        async with running_standin_runtime(claims_addr, room_addr, port=port) as (_, runtime):
            await eventually(lambda: _none_pending(room_stub))
    assert Counter(c.request.wake_id for c in runtime.calls) == Counter(wake_ids)
    assert {c.answer for c in runtime.calls} == {"ACCEPTED"}


async def test_room_down_then_up_the_loop_keeps_polling(
    database_url: str, claims_addr: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quayutec.gateway.delivery")
    room_listen = f"127.0.0.1:{free_port()}"
    async with running_room(database_url, QUAYUTEC_ROOM_LISTEN=room_listen) as room_addr:
        acme = await make_company(database_url, room_addr, "Acme")
        async with (
            running_gateway(database_url, room_addr, "127.0.0.1:9", QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false") as gw,
            authed_gateway(gw, acme.secret) as acme_gw,
        ):
            _, wake_ids = await post_wakes(acme_gw, agents=3, messages=2)
    # The Room is down now.
    async with (
        running_standin_runtime(claims_addr, room_addr) as (runtime_addr, runtime),
        running_gateway(database_url, room_addr, runtime_addr, **FAST),
    ):

        async def lease_failed_thrice() -> bool:
            return sum("leasing wakes failed" in r.getMessage() for r in caplog.records) >= 3

        await eventually(lease_failed_thrice)
        assert not runtime.calls
        async with (
            running_room(database_url, QUAYUTEC_ROOM_LISTEN=room_listen),
            service_channel(room_addr, "gateway") as channel,
        ):
            await eventually(lambda: _none_pending(room_pb2_grpc.RoomServiceStub(channel)))
    assert Counter(c.request.wake_id for c in runtime.calls) == Counter(wake_ids)


async def test_two_replicas_deliver_a_thousand_wakes_once_each(
    database_url: str, room_addr: str, claims_addr: str, acme_gw: GatewayStub, room_stub: room_pb2_grpc.RoomServiceStub
) -> None:
    replica = {**FAST, "QUAYUTEC_GATEWAY_DELIVERY_BATCH_SIZE": "25", "QUAYUTEC_GATEWAY_DELIVERY_CONCURRENCY": "25"}
    async with (
        running_standin_runtime(claims_addr, room_addr) as (runtime_addr, runtime),
        running_gateway(database_url, room_addr, runtime_addr, **replica),
        running_gateway(database_url, room_addr, runtime_addr, **replica),
    ):
        started = time.monotonic()
        _, wake_ids = await post_wakes(acme_gw, agents=50, messages=20)
        await runtime.wait_until(lambda: len(runtime.calls) >= len(wake_ids), within=120)
        await eventually(lambda: _none_pending(room_stub), within=60)
        elapsed = time.monotonic() - started
    logging.getLogger(__name__).warning("1000 wakes posted and delivered by two replicas in %.2f s", elapsed)
    # Every wake was started exactly once (so settled once: a lost settle would redeliver it).
    assert len(runtime.calls) == 1000
    assert Counter(c.request.wake_id for c in runtime.calls) == Counter(wake_ids)
    assert runtime.answers("ACCEPTED") == Counter(wake_ids)
    # Both replicas took part (each has its own connection to the Runtime).
    assert len({c.peer for c in runtime.calls}) >= 2


async def expire_leases(pool: asyncpg.Pool, wake_ids: list[str]) -> None:
    """End the leases of ``wake_ids`` now, as their expiry would (a replica that stopped holding them
    never settles them)."""
    expired = await pool.execute(
        "UPDATE wake_outbox SET lease_expires_at = now() - interval '1 second'"
        " WHERE wake_id = ANY($1::uuid[]) AND delivered_at IS NULL AND lease_expires_at > now()",
        wake_ids,
    )
    assert expired == f"UPDATE {len(wake_ids)}", f"not every wake was still leased: {expired}"


def assert_each_claimed_once_after_the_first_replica(runtime: Any, wake_ids: list[str]) -> None:
    """Even wakes were claimed by the first replica's calls (then hung), odd ones never reached a
    claim; the second replica found the even ones ALREADY_CLAIMED and claimed the odd ones."""
    claimed_by_first = {c.request.wake_id for c in runtime.calls if c.answer == "CLAIMED_THEN_HANG"}
    assert claimed_by_first == set(wake_ids[0::2])
    assert runtime.answers("ALREADY_CLAIMED") == Counter(wake_ids[0::2])
    assert runtime.answers("ACCEPTED") == Counter(wake_ids[1::2])
    # Each wake was claimed exactly once overall.
    assert runtime.answers("ACCEPTED") + Counter(claimed_by_first) == Counter(wake_ids)


async def test_replica_stopped_mid_delivery_loses_nothing(
    database_url: str,
    room_addr: str,
    claims_addr: str,
    acme_gw: GatewayStub,
    room_stub: room_pb2_grpc.RoomServiceStub,
    pool: asyncpg.Pool,
) -> None:
    _, wake_ids = await post_wakes(acme_gw, agents=10, messages=2)
    leases = {
        **FAST,
        **LONG_LEASE,
        "QUAYUTEC_GATEWAY_DELIVERY_STOP_GRACE_SECONDS": "0",
        "QUAYUTEC_GATEWAY_GRACE_SECONDS": "0",
    }
    async with running_standin_runtime(claims_addr, room_addr) as (runtime_addr, runtime):
        # Half the wakes hang before Runtime claims them, half after: the replica is stopped mid-call.
        for n, wake_id in enumerate(wake_ids):
            runtime.script(wake_id, "HANG" if n % 2 else "CLAIM_THEN_HANG")
        async with running_gateway(database_url, room_addr, runtime_addr, **leases):
            await runtime.wait_until(lambda: len(runtime.calls) == len(wake_ids))
        # Stopped while holding every lease; nothing was settled.
        assert await pending(room_stub) == len(wake_ids)
        await expire_leases(pool, wake_ids)
        async with running_gateway(database_url, room_addr, runtime_addr, **leases):
            await eventually(lambda: _none_pending(room_stub))
    assert_each_claimed_once_after_the_first_replica(runtime, wake_ids)


async def test_gateway_process_killed_mid_delivery_loses_and_doubles_nothing(
    database_url: str,
    room_addr: str,
    claims_addr: str,
    acme_gw: GatewayStub,
    room_stub: room_pb2_grpc.RoomServiceStub,
    pool: asyncpg.Pool,
) -> None:
    _, wake_ids = await post_wakes(acme_gw, agents=10, messages=2)
    leases = {**FAST, **LONG_LEASE}
    async with running_standin_runtime(claims_addr, room_addr) as (runtime_addr, runtime):
        for n, wake_id in enumerate(wake_ids):
            runtime.script(wake_id, "HANG" if n % 2 else "CLAIM_THEN_HANG")
        env = {
            **os.environ,
            **leases,
            "PYTHONPATH": str(REPO),
            "DATABASE_URL": database_url,
            "QUAYUTEC_GATEWAY_LISTEN": f"127.0.0.1:{free_port()}",
            "QUAYUTEC_ROOM_ADDR": room_addr,
            "QUAYUTEC_RUNTIME_ADDR": runtime_addr,
            **mtls_env("gateway"),
        }
        gateway = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.gateway",
            cwd=REPO,
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            await runtime.wait_until(lambda: len(runtime.calls) == len(wake_ids))
        finally:
            gateway.send_signal(signal.SIGKILL)  # a crash: no drain, no settle, leases left behind
            await gateway.wait()
        assert await pending(room_stub) == len(wake_ids)
        await expire_leases(pool, wake_ids)
        async with running_gateway(database_url, room_addr, runtime_addr, **leases):
            await eventually(lambda: _none_pending(room_stub))
    assert_each_claimed_once_after_the_first_replica(runtime, wake_ids)
