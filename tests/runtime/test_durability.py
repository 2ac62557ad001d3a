"""Durability under faults: a PostgreSQL restart and a Room process killed and restarted while 50
wakes are in flight, and a claim that commits after its caller's first deadline. Every wake is
acted on exactly once (none lost, none twice), counted from the database.

Each test prints its figures (wakes acted, lost, doubled; seconds to finish): run with ``-s``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import asyncpg
import grpc
import pytest

from quayutec.db import with_database
from quayutec.ledger import run_id_for
from quayutec.v1 import claims_pb2, common_pb2, runtime_pb2
from services.runtime.standin import StandinProvider
from services.stack import free_port
from tests.harness.channels import service_channel
from tests.harness.claims import claims_stub, running_claims
from tests.harness.gateway import running_gateway
from tests.harness.ledger_check import ledger_disagreements
from tests.harness.postgres import OwnPostgres
from tests.harness.room import TEST_ENCRYPTION_KEY, running_room
from tests.harness.runtime import RuntimeProcess, ServiceProcess, running_runtime
from tests.runtime import test_held as held
from tests.runtime.test_takeover import script_replies
from tests.runtime.world import World, make_world, runtime_stub, start_request

WAKES = 50
# Runs sit in their model call this long, so the fault meets them in flight.
MODEL_DELAY_SECONDS = 1.0
# Bound of one test's wait for its runs to end (not a timing assertion).
FINISH_LIMIT_SECONDS = 90.0
OUTAGE_SECONDS = 5.0
GATEWAY_ENV = {
    "QUAYUTEC_GATEWAY_BACKOFF_BASE_SECONDS": "0.2",
    "QUAYUTEC_GATEWAY_BACKOFF_CEILING_SECONDS": "1",
    "QUAYUTEC_GATEWAY_LEASE_SECONDS": "30",
}
# Each try of a Room or Claims call gives up soon, so a call caught by the fault is retried soon.
BACKEND_TIMEOUT_SECONDS = 2.0
ROOM_RETRY_SECONDS = 30.0


@pytest.fixture
async def own_database_url(own_postgres: OwnPostgres) -> str:
    """A fresh empty database on the module's own PostgreSQL; the services migrate it on start."""
    own_postgres.start()
    name = f"qd_{uuid.uuid4().hex[:16]}"
    conn = await asyncpg.connect(own_postgres.url)
    try:
        await conn.execute(f"CREATE DATABASE {name}")
    finally:
        await conn.close()
    return with_database(own_postgres.url, name)


class RoomProcess(ServiceProcess):
    """``python -m services.room`` on a fixed port, so a restarted one answers at the same address."""

    def __init__(self, database_url: str, port: int) -> None:
        self.addr = f"127.0.0.1:{port}"
        super().__init__(
            "room",
            {
                "DATABASE_URL": database_url,
                "QUAYUTEC_ROOM_LISTEN": self.addr,
                "QUAYUTEC_ROOM_GRACE_SECONDS": "1",
                "QUAYUTEC_ENCRYPTION_KEY": TEST_ENCRYPTION_KEY,
            },
        )


@dataclass(frozen=True)
class Figures:
    acted: int  # wakes with exactly one succeeded run, one reply and one memory line
    lost: int  # wakes with no ended run
    doubled: int  # wakes with more than one reply, memory line or model request
    seconds_to_finish: float  # from the first post until every run had ended
    model_requests: int
    claims: int

    def line(self, name: str) -> str:
        return (
            f"{name}: wakes {WAKES}, acted {self.acted}, lost {self.lost}, doubled {self.doubled}, "
            f"model requests {self.model_requests}, claims {self.claims}, finished in {self.seconds_to_finish:.1f} s"
        )


async def count_from_database(database_url: str, w: World, run_ids: list[str]) -> tuple[int, int, int, int]:
    """(acted once, lost, doubled, claims) from the tables themselves."""
    conn = await asyncpg.connect(database_url)
    try:
        runs = {
            r["run_id"]: r["status"]
            for r in await conn.fetch("SELECT run_id, status FROM runs WHERE run_id = ANY($1::text[])", run_ids)
        }
        replies = dict(
            await conn.fetch(
                "SELECT run_id, count(*) FROM messages WHERE run_id = ANY($1::text[]) GROUP BY run_id", run_ids
            )
        )
        memory = dict(
            await conn.fetch(
                "SELECT run_id, count(*) FROM memory_lines WHERE run_id = ANY($1::text[]) GROUP BY run_id", run_ids
            )
        )
        claims = await conn.fetchval(
            "SELECT count(*) FROM agent_run_locks WHERE agent_id = $1", str(w.agent_a.agent_id)
        )
        # Every run's ledger row names what the room holds of it (tests/harness/ledger_check.py).
        assert await ledger_disagreements(conn, [w.room_id]) == []
    finally:
        await conn.close()
    acted = lost = doubled = 0
    for run_id in run_ids:
        n_replies, n_memory = replies.get(run_id, 0), memory.get(run_id, 0)
        if n_replies > 1 or n_memory > 1:
            doubled += 1
        elif runs.get(run_id) == "succeeded" and (n_replies, n_memory) == (1, 1):
            acted += 1
        else:
            lost += 1
    return acted, lost, doubled, int(claims)


async def wait_all_ended(database_url: str, run_ids: list[str], limit: float) -> None:
    """Poll the runs table until every run has ended (bounded; reconnects while the database is back)."""
    deadline = time.monotonic() + limit
    while True:
        try:
            conn = await asyncpg.connect(database_url)
            try:
                ended = await conn.fetchval(
                    "SELECT count(*) FROM runs WHERE run_id = ANY($1::text[]) AND ended_at IS NOT NULL", run_ids
                )
            finally:
                await conn.close()
            if ended == len(run_ids):
                return
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"not every run ended within {limit} s")
        await asyncio.sleep(0.2)


async def fifty_wakes_through(
    database_url: str,
    room_addr: str,
    claims_addr: str,
    standin: StandinProvider,
    fault: Callable[[], Awaitable[None]],
) -> Figures:
    """50 wakes delivered by a real Gateway to a real Runtime; ``fault`` strikes while they are in
    flight (runs in their model call, others waiting to be delivered)."""
    channels: list[grpc.aio.Channel] = []
    w = await make_world(room_addr, claims_addr, channels)
    script_replies(standin, w, WAKES, MODEL_DELAY_SECONDS)
    try:
        async with (
            running_runtime(
                claims_addr,
                room_addr,
                standin_url=standin.base_url,
                backend_timeout_seconds=BACKEND_TIMEOUT_SECONDS,
                room_retry_seconds=ROOM_RETRY_SECONDS,
            ) as rt,
            running_gateway(database_url, room_addr, rt, **GATEWAY_ENV),
        ):
            started = time.monotonic()
            posted = await asyncio.gather(*(w.post(f"@planner note {i}", [w.agent_a.agent_id]) for i in range(WAKES)))
            run_ids = [run_id_for(p.wakes[0].agent_id, p.wakes[0].wake_id) for p in posted]
            await wait_for(lambda: len(standin.requests(w.model_a)) >= 10, limit=30.0)
            await fault()
            await wait_all_ended(database_url, run_ids, FINISH_LIMIT_SECONDS)
            finished = time.monotonic() - started
    finally:
        for channel in channels:
            await channel.close()
    acted, lost, doubled, claims = await count_from_database(database_url, w, run_ids)
    requests = len(standin.requests(w.model_a))
    if requests > WAKES:
        doubled = max(doubled, requests - WAKES)
    return Figures(acted, lost, doubled, finished, requests, claims)


async def wait_for(predicate: Callable[[], bool], limit: float) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


async def test_postgres_stopped_for_5_s_with_50_wakes_in_flight(
    own_postgres: OwnPostgres, own_database_url: str, standin: StandinProvider
) -> None:
    async def restart_postgres() -> None:
        await asyncio.to_thread(own_postgres.stop)
        await asyncio.sleep(OUTAGE_SECONDS)
        await asyncio.to_thread(own_postgres.start)

    async with (
        running_claims(own_database_url) as claims_addr,
        running_room(own_database_url) as room_addr,
    ):
        figures = await fifty_wakes_through(own_database_url, room_addr, claims_addr, standin, restart_postgres)
    print(figures.line("postgres stopped 5 s"))
    assert (figures.acted, figures.lost, figures.doubled) == (WAKES, 0, 0)
    assert (figures.claims, figures.model_requests) == (WAKES, WAKES)


async def test_room_killed_and_restarted_with_50_wakes_in_flight(database_url: str, standin: StandinProvider) -> None:
    port = free_port()
    room = RoomProcess(database_url, port)
    await room.wait_ready()
    rooms = [room]

    async def restart_room() -> None:
        rooms[-1].kill()
        await asyncio.sleep(1.0)
        again = RoomProcess(database_url, port)
        rooms.append(again)
        await again.wait_ready()

    try:
        async with running_claims(database_url) as claims_addr:
            figures = await fifty_wakes_through(database_url, room.addr, claims_addr, standin, restart_room)
    finally:
        for r in rooms:
            r.kill()
    print(figures.line("room killed and restarted"))
    assert (figures.acted, figures.lost, figures.doubled) == (WAKES, 0, 0)
    assert (figures.claims, figures.model_requests) == (WAKES, WAKES)


@pytest.fixture
async def slow_claims(database_url: str) -> AsyncIterator[tuple[str, str]]:
    """Claims whose claiming transaction commits 3 s late (test-only setting), and a Room."""
    async with (
        running_claims(database_url, test_commit_delay_seconds=3.0) as claims_addr,
        running_room(database_url) as room_addr,
    ):
        yield claims_addr, room_addr


async def test_a_claim_committed_after_the_first_deadline_is_acted_on_once(
    slow_claims: tuple[str, str], standin: StandinProvider
) -> None:
    claims_addr, room_addr = slow_claims
    channels: list[grpc.aio.Channel] = []
    w = await make_world(room_addr, claims_addr, channels)
    standin.enqueue_reply("Acted on once.", model=w.model_a)
    # Each ClaimOnce try has 1 s; the claim commits after 3 s, inside StartRun's 10 s.
    async with running_runtime(claims_addr, room_addr, standin_url=standin.base_url, backend_timeout_seconds=1.0) as rt:
        runtime = runtime_stub(rt, channels)
        wake = (await w.post("@planner go", [w.agent_a.agent_id])).wakes[0]
        started = await runtime.StartRun(start_request(wake), timeout=10)
        assert started.result == runtime_pb2.START_RUN_RESULT_ACCEPTED
        run = await w.wait_for_run(started.run_id)
        # Another delivery (another claimant) is refused: the wake was acted on by the first.
        again = await runtime.StartRun(start_request(wake), timeout=10)
        assert again.result == runtime_pb2.START_RUN_RESULT_ALREADY_CLAIMED
    assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
    assert [m.body for m in await w.messages_by(w.agent_a.agent_id)] == ["Acted on once."]
    assert len(standin.requests(w.model_a)) == 1
    async with service_channel(claims_addr, "runtime") as channel:
        claim = await claims_stub(channel).GetClaim(
            claims_pb2.GetClaimRequest(agent_id=wake.agent_id, wake_id=wake.wake_id), timeout=10
        )
    assert claim.wake_id == wake.wake_id
    for channel in channels:
        await channel.close()


async def kill_a_continuation_at(
    kill_at: str, w: World, claims_addr: str, room_addr: str, standin: StandinProvider, channels: list[grpc.aio.Channel]
) -> tuple[common_pb2.Run, common_pb2.Wake]:
    """Park a run whose create_task is held, approve it, and start the continuation on a Runtime
    process killed at ``kill_at``; the parked run and the decision wake."""
    await held.set_rights(w, create_task=held.HOLD)
    held.script(standin, w)
    async with running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as addr:
        run = await held.start_and_wait(w, runtime_stub(addr, channels), held.PARKED)
    assert [a.outcome for a in run.actions] == [held.DONE, held.HELD]
    wp = await held.waitpoint_of(w, run.run_id)
    assert (await held.decide(w, wp.token, 1, True)).completed
    (wake,) = await held.decision_wakes(w)

    proc = RuntimeProcess(claims_addr, room_addr, standin.base_url, failpoints=kill_at)
    try:
        await proc.wait_ready()
        # StartRun answers once the continuation's first ledger write (RUNNING) is recorded.
        started = asyncio.ensure_future(runtime_stub(proc.addr, channels).StartRun(start_request(wake), timeout=30))
        await proc.wait_for_line(f"failpoint {kill_at} reached")
        if kill_at != "continuation_claimed":
            # Past its first write the run waits at the failpoint: its ACCEPTED answer goes out
            # before the kill (killing at the printed line alone could beat the answer's bytes).
            answer = await started
            assert answer.result == runtime_pb2.START_RUN_RESULT_ACCEPTED
    finally:
        proc.kill()
    if kill_at == "continuation_claimed":
        with pytest.raises(grpc.aio.AioRpcError):  # killed before its first write: StartRun never answered
            await started
    return run, wake


async def test_a_continuation_killed_before_its_first_write_is_taken_over_and_finished(
    database_url: str, standin: StandinProvider
) -> None:
    """An approved held action's continuation is claimed, then its Runtime is killed before it
    records anything: of many concurrent redeliveries exactly one takes it over (its first write
    is the fence: PARKED to RUNNING) and does the approved action, once."""
    async with running_claims(database_url) as claims_addr, running_room(database_url) as room_addr:
        channels: list[grpc.aio.Channel] = []
        w = await make_world(room_addr, claims_addr, channels)
        run, wake = await kill_a_continuation_at("continuation_claimed", w, claims_addr, room_addr, standin, channels)
        assert (await w.run(run.run_id)).status == common_pb2.RUN_STATUS_PARKED

        async with running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as fresh:
            again = await asyncio.gather(
                *(runtime_stub(fresh, channels).StartRun(start_request(wake)) for _ in range(8))
            )
            ended = await w.wait_for_run(run.run_id, held.ENDED, limit=30)
        tasks = await w.tasks_for(w.agent_b.agent_id)
        for channel in channels:
            await channel.close()

    assert (
        sorted(a.result for a in again)
        == [runtime_pb2.START_RUN_RESULT_ACCEPTED] + [runtime_pb2.START_RUN_RESULT_ALREADY_CLAIMED] * 7
    )
    assert ended.status == common_pb2.RUN_STATUS_SUCCEEDED, ended.error
    assert [a.outcome for a in ended.actions] == [held.DONE, held.DONE]
    assert [t.title for t in tasks] == ["Copy"]  # the approved action, done once


async def test_a_continuation_killed_after_recording_running_is_ended_by_housekeeping(
    database_url: str, standin: StandinProvider
) -> None:
    """A continuation killed after it recorded RUNNING (past the fence): redeliveries are refused,
    and the Gateway's housekeeping ends the run FAILED with the approved action NOT_DONE; no run is
    left RUNNING or PARKED with a completed token."""
    async with running_claims(database_url) as claims_addr, running_room(database_url) as room_addr:
        channels: list[grpc.aio.Channel] = []
        w = await make_world(room_addr, claims_addr, channels)
        run, wake = await kill_a_continuation_at("continued", w, claims_addr, room_addr, standin, channels)
        dead = await w.run(run.run_id)
        assert dead.status == common_pb2.RUN_STATUS_RUNNING
        assert [a.outcome for a in dead.actions] == [held.DONE, common_pb2.ACTION_OUTCOME_PENDING]

        async with running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as fresh:
            again = await asyncio.gather(
                *(runtime_stub(fresh, channels).StartRun(start_request(wake)) for _ in range(8))
            )
            assert {a.result for a in again} == {runtime_pb2.START_RUN_RESULT_ALREADY_CLAIMED}
            assert (await w.run(run.run_id)).status == common_pb2.RUN_STATUS_RUNNING

            # Time passes with no progress (past any live run's active time)...
            conn = await asyncpg.connect(database_url)
            try:
                await conn.execute(
                    "UPDATE runs SET updated_at = now() - interval '700 seconds' WHERE run_id = $1", run.run_id
                )
            finally:
                await conn.close()
            # ... and the Gateway's housekeeping runs.
            housekeeping = {
                "QUAYUTEC_GATEWAY_EXPIRE_INTERVAL_SECONDS": "0.1",
                "QUAYUTEC_GATEWAY_ABANDON_AFTER_SECONDS": "600",
            }
            async with running_gateway(database_url, room_addr, fresh, **housekeeping):
                ended = await w.wait_for_run(run.run_id, held.ENDED, limit=30)
        tasks = await w.tasks_for(w.agent_b.agent_id)
        for channel in channels:
            await channel.close()

    assert (ended.status, ended.step) == (common_pb2.RUN_STATUS_FAILED, common_pb2.RUN_STEP_ENDED)
    assert ended.error.startswith("abandoned: no progress recorded for ") and ended.error.endswith("; not redone")
    assert [a.outcome for a in ended.actions] == [held.DONE, held.NOT_DONE]
    assert tasks == []  # the approved action was never done, nor redone
    conn = await asyncpg.connect(database_url)
    try:
        hanging = await conn.fetchval(
            "SELECT count(*) FROM runs AS r JOIN waitpoints AS wp ON wp.run_id = r.run_id"
            " WHERE r.status IN ('running', 'parked') AND wp.status <> 'pending'"
        )
    finally:
        await conn.close()
    assert hanging == 0
