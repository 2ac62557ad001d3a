"""Runs per second and added latency per run (model time excluded; the stand-in answers at once),
ours beside anchors running the same steps on the same PostgreSQL.

``python bench/runs.py [--runs 300] [--warmup 20] [--concurrency 1,32] [--baseline dbos,floor[,restate]]
[--json PATH]``

Ours: Claims, Room and Runtime as processes (no Gateway: wakes are posted through RoomService and
handed to RuntimeService.StartRun by the bench). C workers each start a run and wait until its
ledger row has ended (one batched query on the runs table every millisecond), so C runs are in
flight. The anchors (``--baseline``, default ``dbos,floor``) run the same steps (claim, read the
room, call the stand-in over httpx, post the reply, record a ledger row: ``bench/run_steps.py``),
started by C workers, each on a room of its own with the same wake messages:

- ``dbos``: each step a ``@DBOS.step`` of one ``@DBOS.workflow``, started with
  ``DBOS.start_workflow_async``; its system tables in a second database on the same server.
- ``floor``: the same steps as plain calls in the bench's own process: no gRPC, no journal beyond
  the three commits (claim, reply, ledger row). What a Python implementation cannot beat.
- ``restate``: a Restate server (``RESTATE_VERSION`` of ``bench/restate_anchor.py``, installed from
  npm into the bench cache on first use) invoking a handler whose every step is a ``ctx.run``, in an
  SDK endpoint process; the bench POSTs to its ingress and waits for the answer. The Restate server
  tries to reach the internet at start, so with ``restate`` the whole bench re-runs itself in a
  loopback-only network namespace (``unshare --net``; it then needs its own embedded PostgreSQL, not
  ``DATABASE_URL``). Never in tests.

CPU per run (embedded PostgreSQL only): user + system CPU over the measured runs of PostgreSQL's
processes and of the system's own: ours, the Claims, Room and Runtime processes (not the bench's
driving and polling); DBOS and the floor, the bench's process, where they run (its driving included;
on the standard asyncio loop, where the services run uvloop); not measured for Restate. The stand-in
is left out everywhere.

It prints, per concurrency, ours/DBOS, ours/floor and ours/Restate runs/s (above 1: ours is faster;
ours/floor is at most about 1, the share of the floor ours reaches), and ours/anchor CPU per run where
both were measured (above 1: ours costs more). ``--json PATH`` also writes the
figures as one JSON object (for ``bench/compare.py``). The database is ``DATABASE_URL``'s server or
an embedded PostgreSQL in a tmp folder.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from math import isnan
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

import asyncpg
import httpx

from bench import restate_anchor
from bench.common import (
    ENDED_RUNS_QUERY,
    ROOT,
    BatchWatcher,
    BenchError,
    Figures,
    PostedWake,
    World,
    add_json_argument,
    base_env,
    create_database,
    create_migrated_database,
    drop_database,
    level_figures,
    make_room_world,
    model_ms,
    parse_concurrency,
    percentile,
    post_wakes,
    postgres_cpu_seconds,
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
from bench.run_steps import RunSteps, StepRunner, agent_run, direct
from bench.wakes import cpu_seconds
from quayutec.crypto import Fernet, MultiFernet
from quayutec.db import create_pool
from quayutec.ledger import run_id_for
from quayutec.sql import Queries
from quayutec.tls import GATEWAY
from quayutec.v1 import common_pb2, runtime_pb2, runtime_pb2_grpc

ROOM_WAIT_SECONDS = 600.0
OURS = "quayutec"
# CPU seconds used so far by the processes a system runs on (a difference of two readings is what it used).
CpuClock = Callable[[], float]
# The anchors, in the order they run, by their --baseline name: what the table calls them.
ANCHORS = {
    "dbos": "DBOS Transact",
    "floor": "floor (plain calls)",
    "restate": f"Restate {restate_anchor.RESTATE_VERSION}",
}
DEFAULT_ANCHORS = "dbos,floor"
POOL_SIZE = 10  # the bench's pool, which the DBOS workflow and the floor run on


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
    # CPU ms per measured run of the system's processes and PostgreSQL's (NaN when not measured).
    cpu_ms: float = float("nan")

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


def stack_cpu_seconds(stack: Any, admin_url: str) -> float:
    """The stack's service processes' and the embedded PostgreSQL's CPU seconds so far; NaN for
    ``DATABASE_URL``'s server (so no CPU figure is shown)."""
    readings = cpu_seconds(stack, admin_url)
    return float(sum(readings.values())) if "postgres" in readings else float("nan")


def postgres_cpu(admin_url: str) -> float:
    """The embedded PostgreSQL's CPU seconds so far; NaN for ``DATABASE_URL``'s (so no CPU figure is shown)."""
    seconds = postgres_cpu_seconds(admin_url)
    return float("nan") if seconds is None else seconds


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
    room: Any,
    runtime: Any,
    pool: asyncpg.Pool,
    world: World,
    concurrencies: list[int],
    runs: int,
    warmup: int,
    cpu_now: CpuClock,
) -> list[Level]:
    levels: list[Level] = []
    for c in concurrencies:
        wakes = await post_wakes(room, world, warmup + runs)
        await measure_ours(runtime, pool, world, wakes[:warmup], c)
        before = cpu_now()
        result, rows = await measure_ours(runtime, pool, world, wakes[warmup:], c)
        cpu = cpu_now() - before
        levels.append(ledger_level(OURS, c, result, rows))
        levels[-1].cpu_ms = cpu * 1000 / len(rows)
        print(f"  quayutec c={c}: {levels[-1].rate:.0f} runs/s", file=sys.stderr, flush=True)
    return levels


# -- the anchors ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AnchorWorld:
    """An anchor's room, agent and wake messages (posted through RoomService before Room stops), per level."""

    world: World
    wakes_per_level: list[list[PostedWake]]


async def measure_anchor(
    system: str,
    pool: asyncpg.Pool,
    side: AnchorWorld,
    concurrencies: list[int],
    warmup: int,
    start: Callable[[PostedWake], Awaitable[None]],
    cpu_now: CpuClock | None = None,
) -> list[Level]:
    """Each level: ``warmup`` unmeasured runs, then the rest; ``start(wake)`` returns when its run has ended.
    With ``cpu_now``, the CPU per run it counts over the measured runs."""
    world = side.world
    levels: list[Level] = []
    for c, wakes in zip(concurrencies, side.wakes_per_level, strict=True):

        async def one(wake: PostedWake) -> int:
            await start(wake)
            return 0

        await closed_loop(wakes[:warmup], c, one)
        before = cpu_now() if cpu_now is not None else float("nan")
        result = await closed_loop(wakes[warmup:], c, one)
        cpu = cpu_now() - before if cpu_now is not None else float("nan")
        run_ids = [run_id_for(world.agent_id, w.wake_id) for w in wakes[warmup:]]
        rows = await pool.fetch(ENDED_RUNS_QUERY, run_ids)
        if len(rows) != len(run_ids):
            raise BenchError(f"{ANCHORS[system]} recorded {len(rows)} ledger rows for {len(run_ids)} runs")
        levels.append(ledger_level(system, c, result, rows))
        levels[-1].cpu_ms = cpu * 1000 / len(rows)
        print(f"  {ANCHORS[system]} c={c}: {levels[-1].rate:.0f} runs/s", file=sys.stderr, flush=True)
    return levels


def define_dbos_workflow(steps: RunSteps) -> Callable[..., Coroutine[Any, Any, str]]:
    """Register a workflow of the run's steps, each a DBOS step (must run before DBOS is launched)."""
    from dbos import DBOS

    registered = {name: DBOS.step(name=f"qy_bench_{name}")(_function(step)) for name, step in steps.named().items()}

    async def do(name: str, step: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return await registered[name](*args)

    @DBOS.workflow(name="qy_bench_agent_run")
    async def dbos_agent_run(agent_id: str, wake_id: str, room_id: str, source_id: str) -> str:
        return await agent_run(do, steps, agent_id, wake_id, room_id, source_id)

    return dbos_agent_run


def _function(step: Callable[..., Awaitable[Any]]) -> Callable[..., Coroutine[Any, Any, Any]]:
    """A plain function calling ``step`` (DBOS marks the functions it registers; a bound method takes no marks)."""

    async def call(*args: Any) -> Any:
        return await step(*args)

    return call


async def bench_dbos(
    steps: RunSteps, system_url: str, side: AnchorWorld, concurrencies: list[int], warmup: int, cpu_now: CpuClock
) -> list[Level]:
    from dbos import DBOS

    workflow = define_dbos_workflow(steps)
    DBOS(
        config={
            "name": "quayutec-bench-runs",
            "system_database_url": system_url,
            "log_level": "WARNING",
            "sys_db_pool_size": 40,
        }
    )
    DBOS.launch()
    world = side.world
    try:

        async def start(wake: PostedWake) -> None:
            handle: Any = await DBOS.start_workflow_async(
                workflow, world.agent_id, wake.wake_id, world.room_id, wake.message_id
            )
            await handle.get_result()

        return await measure_anchor("dbos", steps.pool, side, concurrencies, warmup, start, cpu_now)
    finally:
        DBOS.destroy(destroy_registry=True)


async def bench_floor(
    steps: RunSteps, side: AnchorWorld, concurrencies: list[int], warmup: int, cpu_now: CpuClock
) -> list[Level]:
    world = side.world
    run: StepRunner = direct

    async def start(wake: PostedWake) -> None:
        await agent_run(run, steps, world.agent_id, wake.wake_id, world.room_id, wake.message_id)

    return await measure_anchor("floor", steps.pool, side, concurrencies, warmup, start, cpu_now)


async def bench_restate(
    steps: RunSteps,
    database_url: str,
    encryption_key: str,
    data_dir: Path,
    side: AnchorWorld,
    concurrencies: list[int],
    warmup: int,
) -> list[Level]:
    """Restate's server and SDK endpoint as processes (in this loopback-only namespace); C workers POST
    to its ingress and wait for each handler's answer."""
    world = side.world
    logs = data_dir / "logs"
    with (
        restate_anchor.restate_server(data_dir / "restate", logs / "restate-server.log") as server,
        restate_anchor.restate_endpoint(
            database_url, steps.standin_url, encryption_key, logs / "restate-endpoint.log"
        ) as endpoint_url,
    ):
        server.register(endpoint_url)
        limits = httpx.Limits(max_connections=max(concurrencies) + 4, max_keepalive_connections=max(concurrencies) + 4)
        async with httpx.AsyncClient(base_url=server.ingress_url, timeout=120, limits=limits) as ingress:

            async def start(wake: PostedWake) -> None:
                body = {
                    "agent_id": world.agent_id,
                    "wake_id": wake.wake_id,
                    "room_id": world.room_id,
                    "source_id": wake.message_id,
                }
                answer = await ingress.post(f"/{restate_anchor.SERVICE}/run", json=body)
                if answer.status_code != 200:
                    raise BenchError(f"Restate ingress answered {answer.status_code}: {answer.text[:500]}")

            return await measure_anchor("restate", steps.pool, side, concurrencies, warmup, start)


# -- the bench ------------------------------------------------------------------------------------------


def chosen_anchors(opts: argparse.Namespace) -> list[str]:
    """The --baseline anchors in their running order (BenchError for an unknown one)."""
    named = [a.strip() for a in opts.baseline.split(",") if a.strip() and a.strip() != "none"]
    unknown = sorted(set(named) - set(ANCHORS))
    if unknown:
        raise BenchError(f"unknown --baseline {', '.join(unknown)}: choose from {', '.join(ANCHORS)} or none")
    if opts.no_dbos:
        named = [a for a in named if a != "dbos"]
    return [a for a in ANCHORS if a in named]


async def amain(opts: argparse.Namespace) -> Figures:
    concurrencies = parse_concurrency(opts.concurrency)
    anchors = chosen_anchors(opts)
    started = time.monotonic()
    with scratch_dir("qy-bench-runs-") as data_dir, standin_process() as standin_url, postgres_server() as admin_url:
        url = await create_migrated_database(admin_url)
        system_url = await create_database(admin_url, "qy_bench_dbos")
        env = base_env(standin_url, data_dir)
        env["QUAYUTEC_RUNTIME_MAX_RUNS"] = str(2 * max(concurrencies) + 16)
        env["QUAYUTEC_GATEWAY_DELIVERY_ENABLED"] = "false"
        pool = await create_pool(url, min_size=2, max_size=POOL_SIZE)
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
                    # Each anchor's room gets the same wake messages, posted the same way, before we stop Room.
                    sides: dict[str, AnchorWorld] = {}
                    for anchor in anchors:
                        world = await make_room_world(room, f"{anchor}-{tag}")
                        wakes = [await post_wakes(room, world, opts.warmup + opts.runs) for _ in concurrencies]
                        sides[anchor] = AnchorWorld(world, wakes)
                    print(f"measuring ours ({opts.runs} runs per level) ...", file=sys.stderr, flush=True)
                    levels = await bench_ours(
                        room,
                        runtime,
                        pool,
                        ours_world,
                        concurrencies,
                        opts.runs,
                        opts.warmup,
                        lambda: stack_cpu_seconds(stack, admin_url),
                    )
            q = Queries(ROOT / "services" / "room" / "sql" / "queries.sql")
            key = env["QUAYUTEC_ENCRYPTION_KEY"]
            cipher = MultiFernet([Fernet(key.encode())])

            def in_process_cpu() -> float:
                return time.process_time() + postgres_cpu(admin_url)

            async with httpx.AsyncClient(timeout=30) as http:
                steps = RunSteps(pool, http, standin_url, cipher, q)
                for anchor in anchors:
                    print(f"measuring {ANCHORS[anchor]} on the same PostgreSQL ...", file=sys.stderr, flush=True)
                    if anchor == "dbos":
                        levels += await bench_dbos(
                            steps, system_url, sides[anchor], concurrencies, opts.warmup, in_process_cpu
                        )
                    elif anchor == "floor":
                        levels += await bench_floor(steps, sides[anchor], concurrencies, opts.warmup, in_process_cpu)
                    else:
                        levels += await bench_restate(
                            steps, url, key, data_dir, sides[anchor], concurrencies, opts.warmup
                        )
        finally:
            await pool.close()
            await drop_database(admin_url, url)
            await drop_database(admin_url, system_url)
    return report(levels, concurrencies, time.monotonic() - started)


def report(levels: list[Level], concurrencies: list[int], seconds: float) -> Figures:
    print(
        "\nRuns: stand-in model answering at once; added latency = ledger ended_at - started_at - model attempts"
        "\n(ms; started_at is set after the claim); client = from starting the run to seeing it ended.\n"
    )
    label = {OURS: OURS, **ANCHORS}
    print_table(
        [
            "system",
            "conc",
            "runs",
            "runs/s",
            "added p50",
            "added p99",
            "client p50",
            "client p99",
            "CPU ms/run",
            "refused",
            "failed",
        ],
        [
            [
                label[lv.system],
                lv.concurrency,
                lv.runs,
                lv.rate,
                percentile(lv.added_ms, 50),
                percentile(lv.added_ms, 99),
                percentile(lv.client_ms, 50),
                percentile(lv.client_ms, 99),
                lv.cpu_ms,
                lv.refused,
                lv.failed,
            ]
            for lv in levels
        ],
    )
    figures: Figures = {}
    for lv in levels:
        latencies = {"added": lv.added_ms, "client": lv.client_ms}
        figures |= level_figures(f"{lv.system} c={lv.concurrency}", "runs/s", lv.rate, latencies)
        figures[f"{lv.system} c={lv.concurrency} CPU ms per run"] = lv.cpu_ms
    by = {(lv.system, lv.concurrency): lv for lv in levels}
    print()
    for anchor in ANCHORS:
        ratios = []
        for c in concurrencies:
            if (anchor, c) in by and (OURS, c) in by:
                ratio = by[(OURS, c)].rate / by[(anchor, c)].rate
                figures[f"ours/{anchor} c={c} runs/s"] = ratio
                ratios.append(f"c={c}: {ratio:.2f}x")
        if ratios:
            print(f"throughput ours/{ANCHORS[anchor]}: {', '.join(ratios)}")
        costs = []
        for c in concurrencies:
            if (anchor, c) in by and (OURS, c) in by and not isnan(by[(anchor, c)].cpu_ms + by[(OURS, c)].cpu_ms):
                ratio = by[(OURS, c)].cpu_ms / by[(anchor, c)].cpu_ms
                figures[f"ours/{anchor} c={c} CPU per run"] = ratio
                costs.append(f"c={c}: {ratio:.2f}x")
        if costs:
            print(f"CPU per run ours/{ANCHORS[anchor]}: {', '.join(costs)}")
    print(f"bench took {seconds:.0f} s")
    if any(lv.failed for lv in levels):
        raise BenchError("some runs did not succeed (see the failed column); the figures are not comparable")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=300, help="measured runs per concurrency level (default 300)")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured runs before each level (default 20)")
    parser.add_argument("--concurrency", default="1,32", help="comma-separated concurrency levels (default 1,32)")
    parser.add_argument(
        "--baseline",
        default=DEFAULT_ANCHORS,
        help=f"comma-separated anchors beside ours: {', '.join(ANCHORS)} or none (default {DEFAULT_ANCHORS})",
    )
    parser.add_argument("--no-dbos", action="store_true", help="leave DBOS out of --baseline")
    parser.add_argument(restate_anchor.NAMESPACE_FLAG, action="store_true", help=argparse.SUPPRESS)
    add_json_argument(parser)
    opts = parser.parse_args()
    try:
        wants_restate = "restate" in chosen_anchors(opts)
        if wants_restate and not opts.in_loopback_netns:
            if os.environ.get("DATABASE_URL", "").strip():
                raise BenchError(
                    "--baseline restate runs in a network namespace of its own, on an embedded PostgreSQL:"
                    " unset DATABASE_URL"
                )
            restate_anchor.ensure_server()
            return restate_anchor.rerun_in_loopback_namespace([str(Path(__file__).resolve()), *sys.argv[1:]])
        if opts.in_loopback_netns:
            restate_anchor.enter_loopback_namespace()
    except BenchError as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        return 1
    return run_main(amain, opts)


if __name__ == "__main__":
    sys.exit(main())
