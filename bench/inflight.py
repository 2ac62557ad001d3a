"""Many runs in flight on one Runtime: a burst of wakes posted at once through the Gateway while the
stand-in model takes seconds to answer.

``python bench/inflight.py [--wakes 2000] [--model-seconds 2,10] [--baseline-wakes 200] [--rooms 10] [--json PATH]
[--no-runtime-alone]``

All four services run as processes on one PostgreSQL (``DATABASE_URL``'s server or an embedded
one), with the Runtime's default settings. Each scenario gets a fresh database and stack: ``rooms``
companies (each with a room and an agent) made through the Gateway, then ``wakes`` messages
mentioning the agents posted through Gateway PostMessage at once (at most 256 calls open), and the
stand-in answering each model request after ``model seconds``. Figures:

- drain: the last reply's created_at minus the first posted message's created_at (PostgreSQL
  clocks), and wakes/s = wakes / drain;
- peak in flight: most runs rows started and not ended, sampled every 100 ms;
- Runtime RSS and open fds at that peak, minus the idle Runtime's before the burst, per run in flight;
- post-to-reply minus the run's model time (the ledger's model attempt durations), p50 and p99.

"Runtime alone" (``--no-runtime-alone`` skips it) measures one Runtime without the Gateway's
delivery path: the wakes are posted through RoomService first (not timed), then StartRun is called
for all of them at once with the longest model time; "sent" is then the StartRun call.

The baseline, in the same run, is the previous default cap (``QUAYUTEC_RUNTIME_MAX_RUNS=32``) with
the first model latency on ``baseline wakes`` wakes (0 skips it); the ratios compare wakes/s.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

import asyncpg
import httpx

from bench.common import (
    BenchError,
    Figures,
    PostedWake,
    ProcessSample,
    World,
    add_json_argument,
    base_env,
    create_migrated_database,
    drop_database,
    make_room_world,
    model_ms,
    percentile,
    post_mention,
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
from bench.wakes import GatewayWorld, make_gateway_world
from quayutec.db import create_pool
from quayutec.tls import GATEWAY
from quayutec.v1 import common_pb2, runtime_pb2, runtime_pb2_grpc
from services.runtime.capacity import raise_fd_limit

ROOM_WAIT_SECONDS = 600.0
POST_PARALLEL = 256
SAMPLE_SECONDS = 0.1
STALL_SECONDS = 30.0
# By primary keys (a ledger row names its reply in the reply's own transaction): messages has no
# index on run_id, and scanning it on every poll would load PostgreSQL with the bench's own work.
REPLIES_DONE = "SELECT count(*) FROM runs WHERE run_id = ANY($1::text[]) AND posted_message_id <> ''"
RESULTS = (
    "SELECT r.run_id, m.created_at, r.model_attempts FROM runs r "
    "JOIN messages m ON m.message_id = NULLIF(r.posted_message_id, '')::uuid WHERE r.run_id = ANY($1::text[])"
)
IN_FLIGHT = "SELECT count(*) FROM runs WHERE ended_at IS NULL"


@dataclass
class Scenario:
    label: str
    model_seconds: float
    wakes: int
    max_runs: int | None  # None: the Runtime's default
    direct: bool = False  # StartRun straight to the Runtime (no Gateway)
    drain_s: float = float("nan")
    peak_in_flight: int = 0
    rss_per_run_kib: float = float("nan")
    fds_per_run: float = float("nan")
    idle_rss_mib: float = float("nan")
    peak_rss_mib: float = float("nan")
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    post_s: float = float("nan")
    answered: int = 0

    @property
    def rate(self) -> float:
        return self.answered / self.drain_s if self.drain_s > 0 else float("nan")


class Sampler:
    """Every 100 ms: runs in flight (database) and the Runtime process's RSS and fds; keeps the peak."""

    def __init__(self, pool: asyncpg.Pool, pid: int) -> None:
        self._pool = pool
        self._pid = pid
        self.peak = 0
        self.at_peak: ProcessSample | None = None
        self.max_rss = 0
        self._task: asyncio.Task[None] | None = None

    def __enter__(self) -> Sampler:
        self._task = asyncio.create_task(self._loop())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            in_flight = int(await self._pool.fetchval(IN_FLIGHT))
            sample = await asyncio.to_thread(ProcessSample.of, self._pid)
            self.max_rss = max(self.max_rss, sample.rss_bytes)
            if in_flight >= self.peak:
                self.peak, self.at_peak = in_flight, sample
            await asyncio.sleep(SAMPLE_SECONDS)


async def run_scenario(scenario: Scenario, admin_url: str, standin_url: str, rooms: int, data_dir: Path) -> None:
    url = await create_migrated_database(admin_url)
    env = base_env(standin_url, data_dir)
    env.update({"QUAYUTEC_GATEWAY_POST_RATE": "1000000", "QUAYUTEC_GATEWAY_POST_BURST": "1000000"})
    if scenario.max_runs is not None:
        env["QUAYUTEC_RUNTIME_MAX_RUNS"] = str(scenario.max_runs)
    pool = await create_pool(url, min_size=2, max_size=4)
    names = ("claims", "room", "runtime") if scenario.direct else ("claims", "room", "runtime", "gateway")
    try:
        async with running_stack(url, names, env, data_dir / "logs") as stack:
            await wait_for_room(stack, ROOM_WAIT_SECONDS)
            async with room_callers(stack) as room:
                tag = uuid.uuid4().hex[:6]
                if scenario.direct:
                    async with stack.channel("runtime", GATEWAY) as channel:
                        worlds = [await make_room_world(room, f"{tag}-{i}") for i in range(rooms)]
                        per_room = -(-(scenario.wakes + 1) // rooms)
                        wakes = [await post_wakes(room, w, per_room, parallel=64) for w in worlds]
                        warm = [w[-1:] for w in wakes]
                        runtime = runtime_pb2_grpc.RuntimeServiceStub(channel)
                        await burst(runtime_sender(runtime, worlds, warm), rooms, pool)
                        send = runtime_sender(runtime, worlds, wakes)
                        await measure(scenario, stack, pool, standin_url, send)
                else:
                    async with stack.channel("gateway", GATEWAY) as channel:
                        gateway_worlds = [
                            await make_gateway_world(room, pool, channel, f"{tag}-{i}") for i in range(rooms)
                        ]
                        # Warm up every path (connections, caches) with answers at once, one wake per room.
                        await burst(gateway_sender(gateway_worlds), rooms, pool)
                        await measure(scenario, stack, pool, standin_url, gateway_sender(gateway_worlds))
    finally:
        await pool.close()
        await drop_database(admin_url, url)


async def measure(scenario: Scenario, stack: Any, pool: asyncpg.Pool, standin_url: str, send: Send) -> None:
    _queue_delayed(standin_url, scenario.model_seconds, scenario.wakes)
    pid = stack.procs["runtime"].pid
    idle = ProcessSample.of(pid)
    with Sampler(pool, pid) as sampler:
        results, post_s = await burst(send, scenario.wakes, pool)
    fill(scenario, results, idle, sampler, post_s)


def _queue_delayed(standin_url: str, seconds: float, times: int) -> None:
    body = {"text": "Noted.", "model": "bench-model", "times": times, "delay_seconds": seconds}
    answer = httpx.post(f"{standin_url}/_standin/reset", json={}, timeout=10)
    answer = httpx.post(f"{standin_url}/_standin/replies", json=body, timeout=10)
    if answer.status_code != 200:
        raise BenchError(f"the stand-in refused the delayed replies: {answer.status_code} {answer.text}")


Send = Callable[[int], Awaitable[tuple[str, datetime]]]


def gateway_sender(worlds: list[GatewayWorld]) -> Send:
    """Post wake ``i`` through Gateway PostMessage; its run id and the message's created_at."""

    async def send(i: int) -> tuple[str, datetime]:
        world = worlds[i % len(worlds)]
        return await post_mention(world.client, world.room_id, world.agent_id, i, deadline=120)

    return send


def runtime_sender(runtime: Any, worlds: list[World], wakes: list[list[PostedWake]]) -> Send:
    """StartRun of pending wake ``i`` straight to the Runtime; its run id and when it was sent."""

    async def send(i: int) -> tuple[str, datetime]:
        world = worlds[i % len(worlds)]
        wake = wakes[i % len(worlds)][i // len(worlds)]
        sent = datetime.now(UTC)
        request = runtime_pb2.StartRunRequest(
            agent_id=world.agent_id,
            wake_id=wake.wake_id,
            room_id=world.room_id,
            wake_kind=common_pb2.WAKE_KIND_MESSAGE,
            wake_source_id=wake.message_id,
        )
        run_id, _ = await start_accepted(runtime, request)
        return run_id, sent

    return send


async def burst(send: Send, count: int, pool: asyncpg.Pool) -> tuple[list[tuple[datetime, datetime, float]], float]:
    """Send ``count`` wakes at once (at most POST_PARALLEL calls open) and wait for every reply; per
    wake (sent, reply created_at, model ms), and the seconds the sending took."""
    sem = asyncio.Semaphore(POST_PARALLEL)
    posted: dict[str, datetime] = {}

    async def one(i: int) -> None:
        async with sem:
            run_id, sent = await send(i)
        posted[run_id] = sent

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(count)))
    post_s = time.perf_counter() - t0
    keys = list(posted)
    # Until every wake is answered, or none more is for STALL_SECONDS (a wake whose run failed or
    # was lost shows as unanswered in the table instead of hanging the bench).
    answered, changed = 0, time.monotonic()
    while answered < len(keys) and time.monotonic() - changed < STALL_SECONDS:
        await asyncio.sleep(0.25)
        now = int(await pool.fetchval(REPLIES_DONE, keys))
        if now != answered:
            answered, changed = now, time.monotonic()
    rows = await pool.fetch(RESULTS, keys)
    if not rows:
        raise BenchError(f"none of {len(keys)} wakes was answered")
    return [(posted[r["run_id"]], r["created_at"], model_ms(r["model_attempts"])) for r in rows], post_s


def fill(
    s: Scenario, results: list[tuple[datetime, datetime, float]], idle: ProcessSample, sampler: Sampler, post_s: float
) -> None:
    first = min(p for p, _, _ in results)
    last = max(r for _, r, _ in results)
    s.drain_s = (last - first).total_seconds()
    s.answered = len(results)
    s.post_s = post_s
    added = [(r - p).total_seconds() * 1000 - m for p, r, m in results]
    s.p50_ms, s.p99_ms = percentile(added, 50), percentile(added, 99)
    s.peak_in_flight = sampler.peak
    s.idle_rss_mib = idle.rss_bytes / 2**20
    s.peak_rss_mib = sampler.max_rss / 2**20
    at = sampler.at_peak
    if at is not None and sampler.peak > 0:
        s.rss_per_run_kib = (at.rss_bytes - idle.rss_bytes) / 1024 / sampler.peak
        s.fds_per_run = (at.fds - idle.fds) / sampler.peak


async def amain(opts: argparse.Namespace) -> Figures:
    started = time.monotonic()
    limit = raise_fd_limit()  # the services inherit it (the Runtime raises its own too)
    latencies = [float(x) for x in opts.model_seconds.split(",") if x.strip()]
    if not latencies or min(latencies) < 0 or opts.wakes < 1 or opts.rooms < 1:
        raise BenchError("--model-seconds needs non-negative numbers; --wakes and --rooms at least 1")
    scenarios: list[Scenario] = []
    if opts.baseline_wakes > 0:
        scenarios.append(Scenario("baseline MAX_RUNS=32", latencies[0], opts.baseline_wakes, 32))
    scenarios += [Scenario("defaults", m, opts.wakes, None) for m in latencies]
    if opts.runtime_alone:
        scenarios.append(Scenario("Runtime alone, StartRun", max(latencies), opts.wakes, None, direct=True))
    with scratch_dir("qy-bench-inflight-") as data_dir, standin_process() as standin_url, postgres_server() as admin:
        for s in scenarios:
            print(f"  {s.label}: {s.wakes} wakes, model {s.model_seconds:g} s ...", file=sys.stderr)
            await run_scenario(s, admin, standin_url, opts.rooms, data_dir)
            print(f"    drained in {s.drain_s:.1f} s, peak {s.peak_in_flight} in flight", file=sys.stderr)
    return report(scenarios, limit, time.monotonic() - started)


def report(scenarios: list[Scenario], fd_limit: int, seconds: float) -> Figures:
    print(
        "\nWakes posted at once through the Gateway, the stand-in answering after the model time."
        "\nDrain = last reply - first post (PostgreSQL clocks); added = post-to-reply minus the run's model time;"
        f"\nper run = (Runtime at peak - idle Runtime) / peak in flight. Open-file limit: {fd_limit}.\n"
    )
    print_table(
        [
            "scenario",
            "model s",
            "wakes",
            "unanswered",
            "posting s",
            "drain s",
            "wakes/s",
            "peak in flight",
            "idle RSS MiB",
            "peak RSS MiB",
            "RSS KiB/run",
            "fds/run",
            "added p50 ms",
            "added p99 ms",
        ],
        [
            [
                s.label,
                s.model_seconds,
                s.wakes,
                s.wakes - s.answered,
                s.post_s,
                s.drain_s,
                s.rate,
                s.peak_in_flight,
                s.idle_rss_mib,
                s.peak_rss_mib,
                s.rss_per_run_kib,
                s.fds_per_run,
                s.p50_ms,
                s.p99_ms,
            ]
            for s in scenarios
        ],
    )
    figures: Figures = {}
    for s in scenarios:
        name = f"{s.label} model {s.model_seconds:g} s"
        figures[f"{name} drain s"] = s.drain_s
        figures[f"{name} wakes/s"] = s.rate
        figures[f"{name} peak in flight"] = float(s.peak_in_flight)
        figures[f"{name} RSS KiB/run"] = s.rss_per_run_kib
        figures[f"{name} fds/run"] = s.fds_per_run
        figures[f"{name} added p50 ms"] = s.p50_ms
        figures[f"{name} added p99 ms"] = s.p99_ms
    base = next((s for s in scenarios if s.max_runs == 32), None)
    if base is not None:
        same = [s for s in scenarios if s.max_runs is None and s.model_seconds == base.model_seconds]
        for s in same:
            print(
                f"\nwakes/s, defaults / baseline (model {s.model_seconds:g} s): {s.rate / base.rate:.2f}; "
                f"peak in flight {s.peak_in_flight} vs {base.peak_in_flight}"
            )
    print(f"bench took {seconds:.0f} s")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--wakes", type=int, default=2000, help="wakes posted at once per scenario (default 2000)")
    parser.add_argument("--model-seconds", default="2,10", help="comma-separated stand-in latencies (default 2,10)")
    parser.add_argument(
        "--baseline-wakes", type=int, default=200, help="wakes of the MAX_RUNS=32 baseline (default 200; 0 skips)"
    )
    parser.add_argument(
        "--runtime-alone",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also StartRun the wakes straight to the Runtime at the longest model time (default on)",
    )
    parser.add_argument("--rooms", type=int, default=10, help="rooms (each with its agent) the wakes spread over")
    add_json_argument(parser)
    return run_main(amain, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
