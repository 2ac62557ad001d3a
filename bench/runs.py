"""Runs per second and added latency per run (model time excluded; the stand-in answers at once),
ours beside DBOS Transact running a workflow of the same steps on the same PostgreSQL.

``python bench/runs.py [--runs 300] [--warmup 20] [--concurrency 1,32] [--no-dbos]``

Ours: Claims, Room and Runtime as processes (no Gateway: wakes are posted through RoomService and
handed to RuntimeService.StartRun by the bench). C workers each start a run and wait until its
ledger row has ended (one batched query on the runs table every millisecond), so C runs are in
flight. DBOS: the same steps (claim, read the room, call the stand-in over httpx, post the reply,
record a ledger row), each a ``@DBOS.step`` of one ``@DBOS.workflow``, started with
``DBOS.start_workflow_async`` by C workers, its system tables in a second database on the same
server. The database is ``DATABASE_URL``'s server or an embedded PostgreSQL in a tmp folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

import asyncpg
import httpx

from bench.common import (
    ENDED_RUNS_QUERY,
    ROOT,
    BatchWatcher,
    BenchError,
    PostedWake,
    World,
    base_env,
    create_database,
    create_migrated_database,
    drop_database,
    make_room_world,
    model_ms,
    parse_concurrency,
    percentile,
    post_wakes,
    postgres_server,
    print_table,
    room_callers,
    run_main,
    running_stack,
    scratch_dir,
    standin_process,
    start_accepted,
    wait_for_room,
)
from quayutec.crypto import Fernet, MultiFernet
from quayutec.db import create_pool
from quayutec.ledger import run_id_for
from quayutec.sql import Queries
from quayutec.tls import GATEWAY
from quayutec.v1 import common_pb2, runtime_pb2, runtime_pb2_grpc
from services.runtime.model import DECLARED_ACTIONS, ChatMessage, ModelRequest, ModelTarget
from services.runtime.model import anthropic as anthropic_wire

MAX_KEY = 2**63 - 1
CLAIM_SQL = (
    "INSERT INTO agent_run_locks (agent_id, wake_id) VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING claimed_at"
)
ROOM_WAIT_SECONDS = 600.0


@dataclass
class Level:
    """What one system did at one concurrency."""

    system: str
    concurrency: int
    runs: int
    seconds: float
    added_ms: list[float]
    client_ms: list[float]
    refused: int = 0
    failed: int = 0

    @property
    def rate(self) -> float:
        return self.runs / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class WorkloadResult:
    seconds: float
    client_ms: list[float] = field(default_factory=list)
    refused: int = 0


async def closed_loop(items: Sequence[Any], concurrency: int, one: Callable[[Any], Awaitable[int]]) -> WorkloadResult:
    """``concurrency`` workers take the items in order; ``one(item)`` returns how often it was refused."""
    result = WorkloadResult(seconds=0.0)
    it = iter(items)

    async def worker() -> None:
        for item in it:
            t0 = time.perf_counter()
            result.refused += await one(item)
            result.client_ms.append((time.perf_counter() - t0) * 1000)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.seconds = time.perf_counter() - start
    return result


# -- ours -----------------------------------------------------------------------------------------------


async def start_run(runtime: Any, world: World, wake: PostedWake) -> tuple[str, int]:
    """StartRun, backing off and retrying on RESOURCE_EXHAUSTED; returns the run id and the refusals."""
    request = runtime_pb2.StartRunRequest(
        agent_id=world.agent_id,
        wake_id=wake.wake_id,
        room_id=world.room_id,
        wake_kind=common_pb2.WAKE_KIND_MESSAGE,
        wake_source_id=wake.message_id,
    )
    return await start_accepted(runtime, request)


async def measure_ours(
    runtime: Any, pool: asyncpg.Pool, world: World, wakes: Sequence[PostedWake], concurrency: int
) -> tuple[WorkloadResult, list[asyncpg.Record]]:
    rows: list[asyncpg.Record] = []
    with BatchWatcher(pool, ENDED_RUNS_QUERY) as watcher:

        async def one(wake: PostedWake) -> int:
            run_id, refused = await start_run(runtime, world, wake)
            rows.append(await watcher.wait(run_id))
            return refused

        result = await closed_loop(wakes, concurrency, one)
    return result, rows


def ledger_level(system: str, concurrency: int, result: WorkloadResult, rows: Sequence[asyncpg.Record]) -> Level:
    added = [(r["ended_at"] - r["started_at"]).total_seconds() * 1000 - model_ms(r["model_attempts"]) for r in rows]
    failed = sum(1 for r in rows if r["status"] != "succeeded")
    return Level(system, concurrency, len(rows), result.seconds, added, result.client_ms, result.refused, failed)


async def bench_ours(
    room: Any, runtime: Any, pool: asyncpg.Pool, world: World, concurrencies: list[int], runs: int, warmup: int
) -> list[Level]:
    levels: list[Level] = []
    for c in concurrencies:
        wakes = await post_wakes(room, world, warmup + runs)
        await measure_ours(runtime, pool, world, wakes[:warmup], c)
        result, rows = await measure_ours(runtime, pool, world, wakes[warmup:], c)
        levels.append(ledger_level("quayutec", c, result, rows))
        print(f"  quayutec c={c}: {levels[-1].rate:.0f} runs/s", file=sys.stderr, flush=True)
    return levels


# -- DBOS -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DbosSide:
    """What the DBOS workflow's steps use: the room database, the stand-in, the key cipher."""

    pool: asyncpg.Pool
    http: httpx.AsyncClient
    standin_url: str
    cipher: MultiFernet
    q: Queries
    recent_messages: int = 20


def define_dbos_workflow(side: DbosSide) -> Callable[..., Coroutine[Any, Any, str]]:
    """Register a workflow of the run's steps (must run before DBOS is launched)."""
    from dbos import DBOS

    q = side.q

    @DBOS.step()
    async def claim(agent_id: str, wake_id: str) -> bool:
        return await side.pool.fetchval(CLAIM_SQL, agent_id, wake_id) is not None

    @DBOS.step()
    async def read_room(agent_id: str, room_id: str, source_id: str) -> dict[str, Any]:
        agent = await side.pool.fetchrow(q["get_agent_credentials"], uuid.UUID(agent_id))
        key = side.cipher.decrypt(agent["provider_key_encrypted"]).decode()
        company_id = agent["company_id"]
        messages, tasks, memory = await asyncio.gather(
            side.pool.fetch(q["list_messages_newest_first"], uuid.UUID(room_id), MAX_KEY, side.recent_messages + 1),
            side.pool.fetch(q["list_tasks"], uuid.UUID(room_id), uuid.UUID(agent_id), "open", 0, 51),
            side.pool.fetch(q["list_memory"], uuid.UUID(room_id), company_id, MAX_KEY, 51),
        )
        recent = list(reversed(messages[: side.recent_messages]))
        wake_text = next((m["body"] for m in recent if str(m["message_id"]) == source_id), "")
        passages: list[str] = []
        if wake_text.strip():
            found = await side.pool.fetch(q["search_passages_all_terms"], uuid.UUID(room_id), wake_text, 5)
            if not found:
                found = await side.pool.fetch(q["search_passages_any_term"], uuid.UUID(room_id), wake_text, 5)
            passages = [p["text"] for p in found]
        lines = ["Recent messages:", *(f"- [{m['author_person']}] {m['body']}" for m in recent)]
        lines += [f"- task {t['task_id']}: {t['title']}" for t in tasks]
        lines += [f"- {m['text']}" for m in memory] + [f"- {p}" for p in passages]
        lines.append(f"You were woken by: {wake_text}" if wake_text else "You were woken.")
        return {
            "company_id": str(company_id),
            "model": agent["model"],
            "system": agent["system_prompt"],
            "key": key,
            "prompt": "\n".join(lines),
        }

    @DBOS.step()
    async def call_model(view: dict[str, Any]) -> dict[str, Any]:
        target = ModelTarget(provider="anthropic", model=view["model"], api_key=view["key"], base_url=side.standin_url)
        request = ModelRequest(
            system=view["system"],
            messages=(ChatMessage(role="user", content=view["prompt"]),),
            tools=DECLARED_ACTIONS,
            max_tokens=1024,
        )
        url, headers, body = anthropic_wire.build(target, request)
        t0 = time.perf_counter()
        response = await side.http.post(url, headers=headers, json=body)
        duration_ms = int((time.perf_counter() - t0) * 1000)
        response.raise_for_status()
        reply = anthropic_wire.parse(response.content)
        return {"text": reply.text, "duration_ms": duration_ms}

    @DBOS.step()
    async def post_reply(room_id: str, company_id: str, agent_id: str, run_id: str, text: str) -> str:
        # The Room's own two statements for a post (its checks, then the message), without its events.
        async with side.pool.acquire() as conn, conn.transaction():
            room_uuid, company_uuid, agent_uuid = uuid.UUID(room_id), uuid.UUID(company_id), uuid.UUID(agent_id)
            dedupe = f"run:{run_id}:reply"
            check = await conn.fetchrow(q["post_check"], room_uuid, company_uuid, agent_uuid, [], dedupe)
            if check["earlier"] is not None:
                return str(check["earlier"]["message_id"])
            message_id = uuid.uuid4()
            row = await conn.fetchrow(
                q["insert_message_with_wakes"],
                room_uuid,
                message_id,
                "agent",
                company_uuid,
                None,
                agent_uuid,
                text,
                [],
                run_id,
                dedupe,
                [],
                str(message_id),
            )
            return str(row["message_id"])

    @DBOS.step()
    async def record_run(row: dict[str, Any]) -> None:
        await side.pool.fetchrow(
            q["upsert_run_with_before"],
            row["run_id"],
            uuid.UUID(row["agent_id"]),
            uuid.UUID(row["company_id"]),
            uuid.UUID(row["room_id"]),
            row["wake_id"],
            "message",
            row["source_id"],
            "succeeded",
            "ended",
            row["posted_message_id"],
            "[]",
            json.dumps([{"number": 1, "status_code": 200, "duration_ms": str(row["model_ms"])}]),
            "",
            "",
            row["active_ms"],
            datetime.fromisoformat(row["started_at"]),
            datetime.now(UTC),
        )

    @DBOS.workflow()
    async def agent_run(agent_id: str, wake_id: str, room_id: str, source_id: str) -> str:
        run_id = run_id_for(agent_id, wake_id)
        if not await claim(agent_id, wake_id):
            return run_id
        started = time.monotonic()
        started_at = datetime.now(UTC).isoformat()  # after the claim, as our ledger's started_at
        view = await read_room(agent_id, room_id, source_id)
        reply = await call_model(view)
        posted = await post_reply(room_id, view["company_id"], agent_id, run_id, reply["text"])
        await record_run(
            {
                "run_id": run_id,
                "agent_id": agent_id,
                "company_id": view["company_id"],
                "room_id": room_id,
                "wake_id": wake_id,
                "source_id": source_id,
                "posted_message_id": posted,
                "model_ms": reply["duration_ms"],
                "active_ms": int((time.monotonic() - started) * 1000),
                "started_at": started_at,
            }
        )
        return run_id

    return agent_run


async def bench_dbos(
    side: DbosSide,
    system_url: str,
    world: World,
    wakes_per_level: list[list[PostedWake]],
    concurrencies: list[int],
    warmup: int,
) -> list[Level]:
    from dbos import DBOS

    workflow = define_dbos_workflow(side)
    DBOS(
        config={
            "name": "quayutec-bench-runs",
            "system_database_url": system_url,
            "log_level": "WARNING",
            "sys_db_pool_size": 40,
        }
    )
    DBOS.launch()
    levels: list[Level] = []
    try:
        for c, wakes in zip(concurrencies, wakes_per_level, strict=True):

            async def one(wake: PostedWake) -> int:
                handle: Any = await DBOS.start_workflow_async(
                    workflow, world.agent_id, wake.wake_id, world.room_id, wake.message_id
                )
                await handle.get_result()
                return 0

            await closed_loop(wakes[:warmup], c, one)
            result = await closed_loop(wakes[warmup:], c, one)
            run_ids = [run_id_for(world.agent_id, w.wake_id) for w in wakes[warmup:]]
            rows = await side.pool.fetch(ENDED_RUNS_QUERY, run_ids)
            if len(rows) != len(run_ids):
                raise BenchError(f"DBOS recorded {len(rows)} ledger rows for {len(run_ids)} workflows")
            levels.append(ledger_level("DBOS Transact", c, result, rows))
            print(f"  DBOS c={c}: {levels[-1].rate:.0f} runs/s", file=sys.stderr, flush=True)
    finally:
        DBOS.destroy(destroy_registry=True)
    return levels


# -- the bench ------------------------------------------------------------------------------------------


async def amain(opts: argparse.Namespace) -> None:
    concurrencies = parse_concurrency(opts.concurrency)
    started = time.monotonic()
    with scratch_dir("qy-bench-runs-") as data_dir, standin_process() as standin_url, postgres_server() as admin_url:
        url = await create_migrated_database(admin_url)
        system_url = await create_database(admin_url, "qy_bench_dbos")
        env = base_env(standin_url, data_dir)
        env["QUAYUTEC_RUNTIME_MAX_RUNS"] = str(2 * max(concurrencies) + 16)
        env["QUAYUTEC_GATEWAY_DELIVERY_ENABLED"] = "false"
        pool = await create_pool(url, min_size=2, max_size=10)
        try:
            async with running_stack(url, ("claims", "room", "runtime"), env, data_dir / "logs") as stack:
                await wait_for_room(stack, ROOM_WAIT_SECONDS)
                async with (
                    room_callers(stack) as room,
                    stack.channel("runtime", GATEWAY) as runtime_channel,
                ):
                    runtime = runtime_pb2_grpc.RuntimeServiceStub(runtime_channel)
                    tag = uuid.uuid4().hex[:6]
                    ours_world = await make_room_world(room, f"ours-{tag}")
                    dbos_world = await make_room_world(room, f"dbos-{tag}")
                    # The DBOS room gets the same wake messages, posted the same way, before we stop Room.
                    dbos_wakes = [await post_wakes(room, dbos_world, opts.warmup + opts.runs) for _ in concurrencies]
                    print(f"measuring ours ({opts.runs} runs per level) ...", file=sys.stderr, flush=True)
                    levels = await bench_ours(room, runtime, pool, ours_world, concurrencies, opts.runs, opts.warmup)
            if not opts.no_dbos:
                print("measuring DBOS Transact on the same PostgreSQL ...", file=sys.stderr, flush=True)
                q = Queries(ROOT / "services" / "room" / "sql" / "queries.sql")
                cipher = MultiFernet([Fernet(env["QUAYUTEC_ENCRYPTION_KEY"].encode())])
                async with httpx.AsyncClient(timeout=30) as http:
                    side = DbosSide(pool, http, standin_url, cipher, q)
                    levels += await bench_dbos(side, system_url, dbos_world, dbos_wakes, concurrencies, opts.warmup)
        finally:
            await pool.close()
            await drop_database(admin_url, url)
            await drop_database(admin_url, system_url)
    report(levels, concurrencies, time.monotonic() - started)


def report(levels: list[Level], concurrencies: list[int], seconds: float) -> None:
    print(
        "\nRuns: stand-in model answering at once; added latency = ledger ended_at - started_at - model attempts"
        "\n(ms; started_at is set after the claim); client = StartRun (or start_workflow_async) to run seen ended.\n"
    )
    print_table(
        ["system", "conc", "runs", "runs/s", "added p50", "added p99", "client p50", "client p99", "refused", "failed"],
        [
            [
                lv.system,
                lv.concurrency,
                lv.runs,
                lv.rate,
                percentile(lv.added_ms, 50),
                percentile(lv.added_ms, 99),
                percentile(lv.client_ms, 50),
                percentile(lv.client_ms, 99),
                lv.refused,
                lv.failed,
            ]
            for lv in levels
        ],
    )
    by = {(lv.system, lv.concurrency): lv for lv in levels}
    ratios = [
        f"c={c}: {by[('quayutec', c)].rate / by[('DBOS Transact', c)].rate:.2f}x"
        for c in concurrencies
        if ("DBOS Transact", c) in by and ("quayutec", c) in by
    ]
    if ratios:
        print(f"\nthroughput ours/DBOS: {', '.join(ratios)}  (target: at least 3x)")
    print(f"bench took {seconds:.0f} s")
    if any(lv.failed for lv in levels):
        raise BenchError("some runs did not succeed (see the failed column); the figures are not comparable")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=300, help="measured runs per concurrency level (default 300)")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured runs before each level (default 20)")
    parser.add_argument("--concurrency", default="1,32", help="comma-separated concurrency levels (default 1,32)")
    parser.add_argument("--no-dbos", action="store_true", help="measure ours only")
    return run_main(amain, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
