"""Cost as tables grow: PostMessage, LeaseWakes + SettleWake, ReadRunContext and the Gateway's
housekeeping (AbandonStaleRuns) with 0, 100k and 1M rows already in each big table.

``python bench/tables.py [--sizes 0,100000,1000000] [--calls 200] [--json PATH]``

The Room runs as a process on one PostgreSQL (``DATABASE_URL``'s server or an embedded one). At each
size the tables are filled up to that many rows with ``generate_series`` (one INSERT per table):
delivered wakes in the outbox, messages in the very room that is read and posted to, and ended runs
in the ledger. Then, through RoomService, one caller at a time: ``calls`` posts mentioning the
agent, leasing those wakes ten at a time and settling each delivered, ``calls`` ReadRunContext
and 20 AbandonStaleRuns. Each figure is printed beside the empty database's (ratio = this size /
0 rows). At the largest size the hot queries are EXPLAINed (ANALYZE, inside a transaction rolled
back, so nothing changes).
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

import asyncpg

from bench.common import (
    BenchError,
    Figures,
    World,
    add_json_argument,
    base_env,
    create_migrated_database,
    drop_database,
    make_room_world,
    percentile,
    postgres_server,
    print_table,
    room_callers,
    run_main,
    running_stack,
    scratch_dir,
    wait_for_room,
)
from quayutec.db import create_pool
from quayutec.sql import Queries
from quayutec.v1 import common_pb2, room_pb2
from services.room.store import (
    MEMORY_LIMIT,
    OPEN_TASKS_LIMIT,
    PASSAGE_QUERY_BYTES,
    QUERIES_PATH,
    ROOM_AGENTS_LIMIT,
)

ROOM_WAIT_SECONDS = 600.0
LEASE_BATCH = 10
HOUSEKEEPING_CALLS = 20

FILL_WAKES = """
INSERT INTO wake_outbox (agent_id, room_id, kind, source_id, created_at, due_at, delivery_attempts, delivered_at)
SELECT $1, $2, 'message', 'fill-' || g, now() - interval '2 hours', now() - interval '2 hours', 1,
    now() - interval '1 hour'
FROM generate_series($3::bigint + 1, $4::bigint) AS g
"""
FILL_MESSAGES = """
WITH base AS (SELECT last_seq FROM rooms WHERE room_id = $1)
INSERT INTO messages (room_id, seq, author_kind, author_company_id, author_person, body, created_at)
SELECT $1, base.last_seq + g, 'person', $2, 'filler', 'an earlier message number ' || g, now() - interval '1 hour'
FROM base, generate_series(1, $3::bigint) AS g
"""
BUMP_SEQ = "UPDATE rooms SET last_seq = last_seq + $2 WHERE room_id = $1"
FILL_RUNS = """
INSERT INTO runs (run_id, agent_id, company_id, room_id, wake_id, wake_kind, status, step, started_at, ended_at)
SELECT 'fill-run-' || g, $1, $2, $3, 'fill-' || g, 'message', 'succeeded', 'ended', now() - interval '1 hour',
    now() - interval '1 hour'
FROM generate_series($4::bigint + 1, $5::bigint) AS g
"""


async def fill(url: str, world: World, have: int, want: int) -> float:
    """Bring each big table from ``have`` to ``want`` filler rows; seconds it took (one connection
    of its own: the services' pools bound each statement's time, a million-row INSERT takes longer)."""
    if want <= have:
        return 0.0
    t0 = time.perf_counter()
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(FILL_WAKES, uuid.UUID(world.agent_id), uuid.UUID(world.room_id), have, want)
        async with conn.transaction():
            await conn.execute(FILL_MESSAGES, uuid.UUID(world.room_id), uuid.UUID(world.company_id), want - have)
            await conn.execute(BUMP_SEQ, uuid.UUID(world.room_id), want - have)
        await conn.execute(
            FILL_RUNS,
            uuid.UUID(world.agent_id),
            uuid.UUID(world.company_id),
            uuid.UUID(world.room_id),
            have,
            want,
        )
        await conn.execute("ANALYZE wake_outbox; ANALYZE messages; ANALYZE runs")
    finally:
        await conn.close()
    return time.perf_counter() - t0


async def timed(count: int, call: Callable[[int], Awaitable[Any]]) -> list[float]:
    out = []
    for i in range(count):
        t0 = time.perf_counter()
        await call(i)
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def measure(room: Any, world: World, calls: int) -> dict[str, list[float]]:
    author = common_pb2.Author(kind=common_pb2.AUTHOR_KIND_PERSON, company_id=world.company_id, person="bench")
    wakes: list[common_pb2.Wake] = []

    async def post(i: int) -> None:
        posted = await room.PostMessage(
            room_pb2.RoomServicePostMessageRequest(
                room_id=world.room_id, author=author, body=f"@agent question {i}", mention_agent_ids=[world.agent_id]
            ),
            timeout=30,
        )
        if len(posted.wakes) != 1:
            raise BenchError(f"a post mentioning one agent recorded {len(posted.wakes)} wakes")

    async def lease(i: int) -> None:
        got = await room.LeaseWakes(
            room_pb2.RoomServiceLeaseWakesRequest(lease_owner="bench", max_wakes=LEASE_BATCH, lease_seconds=60),
            timeout=30,
        )
        wakes.extend(got.wakes)

    async def settle(i: int) -> None:
        await room.SettleWake(
            room_pb2.RoomServiceSettleWakeRequest(
                wake_id=wakes[i].wake_id, lease_owner="bench", settlement=room_pb2.WAKE_SETTLEMENT_DELIVERED
            ),
            timeout=30,
        )

    async def read(i: int) -> None:
        await room.ReadRunContext(
            room_pb2.RoomServiceReadRunContextRequest(
                agent_id=world.agent_id,
                room_id=world.room_id,
                recent_messages=20,
                wake_kind=common_pb2.WAKE_KIND_MESSAGE,
                wake_source_id="",
                # As a run does: the claimed ledger row is recorded by the same call.
                run=common_pb2.Run(
                    run_id=f"bench-read-{uuid.uuid4().hex}",
                    agent_id=world.agent_id,
                    room_id=world.room_id,
                    wake_id=str(uuid.uuid4()),
                    wake_kind=common_pb2.WAKE_KIND_MESSAGE,
                    status=common_pb2.RUN_STATUS_RUNNING,
                    step=common_pb2.RUN_STEP_CLAIMED,
                ),
            ),
            timeout=30,
        )

    async def housekeeping(i: int) -> None:
        await room.AbandonStaleRuns(
            room_pb2.RoomServiceAbandonStaleRunsRequest(older_than_seconds=600, limit=100), timeout=30
        )

    figures = {"PostMessage": await timed(calls, post)}
    figures["LeaseWakes (10)"] = await timed(-(-calls // LEASE_BATCH), lease)
    if len(wakes) != calls:
        raise BenchError(f"leasing found {len(wakes)} of the {calls} wakes just posted")
    figures["SettleWake"] = await timed(len(wakes), settle)
    figures["ReadRunContext"] = await timed(calls, read)
    figures["AbandonStaleRuns"] = await timed(HOUSEKEEPING_CALLS, housekeeping)
    return figures


async def explain(pool: asyncpg.Pool, world: World) -> None:
    """EXPLAIN ANALYZE of the hot queries, each in a transaction rolled back."""
    q = Queries(QUERIES_PATH)
    room_id, agent_id, company_id = (uuid.UUID(x) for x in (world.room_id, world.agent_id, world.company_id))
    message_id = uuid.uuid4()
    author = ("person", company_id, "bench", None)
    insert_args = (
        room_id, message_id, *author, "explained", [agent_id], None, None, [agent_id], str(message_id), "", None
    )  # fmt: skip
    run_context_args = (
        agent_id,
        room_id,
        20,
        "message",
        None,
        5,
        ROOM_AGENTS_LIMIT,
        OPEN_TASKS_LIMIT,
        MEMORY_LIMIT,
        PASSAGE_QUERY_BYTES,
    )
    # What PostMessage, ReadRunContext, LeaseWakes and the Gateway's housekeeping send, as they send it.
    plans: list[tuple[str, str, tuple[Any, ...]]] = [
        ("post_check", q["post_check"], (room_id, company_id, None, [agent_id], "explained")),
        (
            "insert_message_with_wakes",
            q["insert_message_with_wakes"],
            insert_args,
        ),
        ("run_context", q["run_context"], run_context_args),
        ("lease_wakes", q["lease_wakes"], ("explain", 10, 60)),
        ("count_pending_wakes", q["count_pending_wakes"], ()),
        ("list_messages_newest_first", q["list_messages_newest_first"], (room_id, 2**62, 20)),
        ("stale_running_runs", q["stale_running_runs"], (600, 100)),
        ("delete_delivered_wakes", q["delete_delivered_wakes"], (1800, 1000)),
    ]
    async with pool.acquire() as conn:
        for name, sql, args in plans:
            tr = conn.transaction()
            await tr.start()
            try:
                explained = await conn.prepare(f"EXPLAIN (ANALYZE, COSTS OFF, SUMMARY ON) {sql}")
                # A query gains parameters at its end (the traceparent did): an older tree's, which
                # bench/compare.py runs this bench on, takes the first ones.
                rows = await explained.fetch(*args[: len(explained.get_parameters())])
            finally:
                await tr.rollback()
            print(f"\n-- {name}")
            for row in rows:
                print(f"   {row[0]}")


async def amain(opts: argparse.Namespace) -> Figures:
    started = time.monotonic()
    try:
        sizes = sorted({int(s) for s in opts.sizes.split(",") if s.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 0 or opts.calls < LEASE_BATCH:
        raise BenchError(f"--sizes needs non-negative integers (e.g. 0,100000,1000000); --calls >= {LEASE_BATCH}")
    results: list[tuple[int, float, dict[str, list[float]]]] = []
    with scratch_dir("qy-bench-tables-") as data_dir, postgres_server() as admin_url:
        url = await create_migrated_database(admin_url)
        pool = await create_pool(url, min_size=1, max_size=2)
        try:
            env = base_env("http://127.0.0.1:9", data_dir)  # no model is called
            async with running_stack(url, ("room",), env, data_dir / "logs") as stack:
                await wait_for_room(stack, ROOM_WAIT_SECONDS)
                async with room_callers(stack) as room:
                    world = await make_room_world(room, uuid.uuid4().hex[:6])
                    await measure(room, world, LEASE_BATCH)  # warm up
                    have = 0
                    for size in sizes:
                        load_s = await fill(url, world, have, size)
                        have = max(have, size)
                        print(f"  {size} rows in each table (loaded in {load_s:.0f} s) ...", file=sys.stderr)
                        results.append((size, load_s, await measure(room, world, opts.calls)))
                    await explain(pool, world)
        finally:
            await pool.close()
            await drop_database(admin_url, url)
    return report(results, time.monotonic() - started)


def report(results: list[tuple[int, float, dict[str, list[float]]]], seconds: float) -> Figures:
    print("\nRoom calls, one at a time, with N filler rows in wake_outbox (delivered), messages (same room), runs.\n")
    base = results[0][2]
    rows = []
    figures: Figures = {}
    for size, _, calls in results:
        for name, values in calls.items():
            p50, p99 = percentile(values, 50), percentile(values, 99)
            rows.append([name, size, len(values), p50, p99, p50 / percentile(base[name], 50)])
            figures[f"{name} {size} rows p50 ms"] = p50
            figures[f"{name} {size} rows p99 ms"] = p99
    print_table(["call", "rows", "calls", "p50 ms", "p99 ms", f"p50 / {results[0][0]} rows"], rows)
    print(f"bench took {seconds:.0f} s")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="0,100000,1000000", help="filler rows per table (default 0,100000,1000000)")
    parser.add_argument("--calls", type=int, default=200, help="calls of each kind per size (default 200)")
    add_json_argument(parser)
    return run_main(amain, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
