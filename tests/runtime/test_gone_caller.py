"""A statement whose caller is gone does not commit later (docs/durability.md, the crash table).

The Runtime, a process, is SIGKILLed while its run's first fenced ledger write (ReadRunContext's
statement, in the Room) waits on a row lock the test holds: the room's row, which the statement takes
for its run's event. The Room's call is cancelled when the Runtime's connection goes; its statement
must be cancelled in PostgreSQL too (quayutec.db.send_cancel_request, and the sessions'
client_connection_check_interval), so that when the test releases the lock nothing commits for the dead
process: no ledger row, and the next delivery takes the wake over and acts on it once. Before, the
statement waited on, committed the row for the dead delivery once the lock was released, and every
redelivery answered ALREADY_CLAIMED.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import grpc
import pytest

from quayutec.ledger import run_id_for
from quayutec.v1 import common_pb2, runtime_pb2
from services.runtime.standin import StandinProvider
from tests.harness.claims import running_claims
from tests.harness.ledger_check import ledger_disagreements
from tests.harness.room import running_room
from tests.harness.runtime import RuntimeProcess, running_runtime
from tests.runtime.world import make_world, runtime_stub, start_request

# Backends of this test's database other than the asking one: those waiting on a lock, and those
# running a statement at all.
_WAITING = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'
"""
_ACTIVE = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'active'
"""


@pytest.fixture
async def backends(database_url: str) -> AsyncIterator[tuple[str, str]]:
    async with running_claims(database_url) as claims_addr, running_room(database_url) as room_addr:
        yield claims_addr, room_addr


async def until(check: Callable[[], Awaitable[bool]], limit: float = 20.0) -> bool:
    """Whether ``check`` came true within ``limit`` s (polled; a bound, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not await check():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_a_runtime_killed_while_its_fenced_write_waits_on_a_lock_leaves_nothing_to_commit(
    backends: tuple[str, str], standin: StandinProvider, database_url: str
) -> None:
    claims_addr, room_addr = backends
    channels: list[grpc.aio.Channel] = []
    w = await make_world(room_addr, claims_addr, channels)
    standin.enqueue_reply("Acted on once.", model=w.model_a)
    db = await asyncpg.connect(database_url)
    holder = await asyncpg.connect(database_url)
    proc = RuntimeProcess(claims_addr, room_addr, standin.base_url)
    try:
        await proc.wait_ready()
        wake = (await w.post("@planner plan the launch", [w.agent_a.agent_id])).wakes[0]
        run_id = run_id_for(wake.agent_id, wake.wake_id)
        lock = holder.transaction()
        await lock.start()
        await holder.execute("SELECT 1 FROM rooms WHERE room_id = $1 FOR UPDATE", w.room_id)
        start = asyncio.ensure_future(runtime_stub(proc.addr, channels).StartRun(start_request(wake), timeout=60))
        # The run claimed the wake and its fenced write (ReadRunContext's statement) waits on the lock.
        assert await until(lambda: _count(db, _WAITING, 1)), "the run's first ledger write never waited on the lock"
        proc.kill()
        with contextlib.suppress(grpc.aio.AioRpcError):
            await start
        # The Room's call was cancelled with the Runtime's connection: its statement stops in PostgreSQL.
        stopped = await until(lambda: _count(db, _WAITING, 0))
        await lock.rollback()
        assert await until(lambda: _count(db, _ACTIVE, 0)), "a statement still runs after the lock's release"
        row = await db.fetchrow("SELECT status, attempt FROM runs WHERE run_id = $1", run_id)
        assert row is None, f"the dead delivery's write committed after the lock was released: {dict(row)}"
        assert stopped
    finally:
        proc.kill()
        with contextlib.suppress(asyncpg.InterfaceError):
            await holder.close()

    try:
        async with running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as fresh_addr:
            again = await runtime_stub(fresh_addr, channels).StartRun(start_request(wake))
            assert again.result == runtime_pb2.START_RUN_RESULT_ACCEPTED
            run = await w.wait_for_run(run_id)
        assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
        assert len(standin.requests(w.model_a)) == 1
        assert [m.body for m in await w.messages_by(w.agent_a.agent_id)] == ["Acted on once."]
        assert await ledger_disagreements(db, [w.room_id]) == []
    finally:
        await db.close()
        for channel in channels:
            await channel.close()


async def _count(db: asyncpg.Connection, query: str, expected: int) -> bool:
    return int(await db.fetchval(query)) == expected
