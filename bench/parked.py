"""Parked runs hold nothing in Runtime: its memory, fds, sockets and threads after parking N runs
beside the same figures after a warm-up; then the time from a decision to the continued run's write.

``python bench/parked.py [--runs 10000] [--warmup 200] [--decide 300] [--concurrency 32] [--json PATH]``

Claims, Room and Runtime run as processes (no Gateway: the bench posts wakes through RoomService
and hands them to RuntimeService.StartRun itself). The agent's company holds ``remember``, and the
stand-in (its own process) answers every request at once with a reply and one remember call, so
every run posts its reply and parks on a waitpoint. C workers each start a run and wait until its
waitpoint row exists. Runtime's RSS, open fds, inet sockets and threads are sampled (psutil) after
the warm-up and after the N measured runs, both with nothing executing. Then K parked runs are
decided, one at a time: Room DecideHeldAction(approve) completes the token and records its
DECISION wake, the bench delivers that wake with StartRun, and the latency is the memory line's
``created_at`` minus the held action's ``decided_at`` (both PostgreSQL's clock). No delivery-loop
polling is included: a Gateway would add its poll interval on top.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

import asyncpg

from bench.common import (
    BatchWatcher,
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
    percentile,
    post_wakes,
    postgres_server,
    print_table,
    queue_standin_replies,
    room_callers,
    run_main,
    running_stack,
    scratch_dir,
    standin_process,
    start_accepted,
    wait_for_room,
)
from quayutec.db import create_pool
from quayutec.tls import GATEWAY
from quayutec.v1 import common_pb2, room_pb2, runtime_pb2, runtime_pb2_grpc

MODEL = "bench-parked"
ROOM_WAIT_SECONDS = 600.0
SETTLE_SECONDS = 2.0  # after the last park, before sampling: the runs' tasks return, buffers drain
PROGRESS_EVERY = 1000

# A run is done with for this bench once its waitpoint exists (parked) or its row has ended (failed).
PARKED_OR_ENDED_QUERY = (
    "SELECT r.run_id, r.status, r.error, w.token::text AS token FROM runs r "
    "LEFT JOIN waitpoints w ON w.run_id = r.run_id "
    "WHERE r.run_id = ANY($1::text[]) AND (w.token IS NOT NULL OR r.ended_at IS NOT NULL)"
)
# A continued run's first write (its memory line), or its end without one.
WRITTEN_OR_ENDED_QUERY = (
    "SELECT r.run_id, r.status, r.error, m.created_at FROM runs r "
    "LEFT JOIN memory_lines m ON m.run_id = r.run_id "
    "WHERE r.run_id = ANY($1::text[]) AND (m.memory_id IS NOT NULL OR r.ended_at IS NOT NULL)"
)
DECISION_WAKE_QUERY = "SELECT wake_id::text FROM wake_outbox WHERE kind = 'decision' AND source_id = $1"
DECISION_TO_WRITE_QUERY = (
    "SELECT w.token::text AS token, h.decided_at, m.created_at, r.status FROM waitpoints w "
    "JOIN held_actions h ON h.token = w.token JOIN memory_lines m ON m.run_id = w.run_id "
    "JOIN runs r ON r.run_id = w.run_id WHERE w.token = ANY($1::uuid[])"
)
PENDING_QUERY = "SELECT count(*) FROM waitpoints WHERE company_id = $1 AND status = 'pending'"


@dataclass
class Parked:
    """What the parking phase left: run id -> token, failures and the samples taken on the way."""

    tokens: dict[str, str] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    refused: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class Decided:
    token: str
    decide_ms: float  # the DecideHeldAction call
    deliver_ms: float  # the decision wake looked up and StartRun accepted
    client_ms: float  # before DecideHeldAction to the memory line seen by the watcher


def start_request(
    world: World, wake_id: str, kind: common_pb2.WakeKind.ValueType, source_id: str
) -> runtime_pb2.StartRunRequest:
    return runtime_pb2.StartRunRequest(
        agent_id=world.agent_id, wake_id=wake_id, room_id=world.room_id, wake_kind=kind, wake_source_id=source_id
    )


async def workers(items: Sequence[Any], concurrency: int, one: Callable[[Any], Awaitable[None]]) -> None:
    """``concurrency`` workers taking ``items`` in order, each awaiting ``one(item)``."""
    queue = iter(items)

    async def worker() -> None:
        for item in queue:
            await one(item)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def park(
    runtime: Any,
    pool: asyncpg.Pool,
    world: World,
    wakes: Sequence[PostedWake],
    concurrency: int,
    on_progress: Callable[[int], None] | None = None,
) -> Parked:
    """Start a run per wake (C at once) and wait until each has parked (or ended)."""
    out = Parked()
    started = time.monotonic()
    with BatchWatcher(pool, PARKED_OR_ENDED_QUERY) as watcher:

        async def one(wake: PostedWake) -> None:
            request = start_request(world, wake.wake_id, common_pb2.WAKE_KIND_MESSAGE, wake.message_id)
            run_id, refused = await start_accepted(runtime, request)
            out.refused += refused
            row = await asyncio.wait_for(watcher.wait(run_id), 60)
            if row["token"] is None:
                out.failed.append(f"{row['status']}: {row['error']}")
            else:
                out.tokens[run_id] = row["token"]
            done = len(out.tokens) + len(out.failed)
            if on_progress is not None and done % PROGRESS_EVERY == 0:
                on_progress(done)

        await workers(wakes, concurrency, one)
    out.seconds = time.monotonic() - started
    return out


async def decide_and_continue(
    room: Any, runtime: Any, pool: asyncpg.Pool, world: World, tokens: Sequence[str], concurrency: int
) -> list[Decided]:
    """Approve each token's held action, deliver its DECISION wake, wait for the memory line."""
    out: list[Decided] = []
    with BatchWatcher(pool, WRITTEN_OR_ENDED_QUERY) as watcher:

        async def one(token: str) -> None:
            t0 = time.perf_counter()
            decided = await room.DecideHeldAction(
                room_pb2.RoomServiceDecideHeldActionRequest(
                    token=token, index=0, company_id=world.company_id, decided_by="bench", approve=True
                ),
                timeout=30,
            )
            t1 = time.perf_counter()
            if not decided.completed:
                raise BenchError(f"deciding the only held action of {token} did not complete it")
            wake_id = await pool.fetchval(DECISION_WAKE_QUERY, token)
            if wake_id is None:
                raise BenchError(f"the completed waitpoint {token} recorded no DECISION wake")
            run_id, _ = await start_accepted(
                runtime, start_request(world, wake_id, common_pb2.WAKE_KIND_DECISION, token)
            )
            t2 = time.perf_counter()
            row = await asyncio.wait_for(watcher.wait(run_id), 60)
            t3 = time.perf_counter()
            if row["created_at"] is None:
                raise BenchError(f"continued run {run_id} ended {row['status']} without its write: {row['error']}")
            out.append(Decided(token, (t1 - t0) * 1000, (t2 - t1) * 1000, (t3 - t0) * 1000))

        await workers(tokens, concurrency, one)
    return out


def mib(n: int) -> float:
    return n / (1024 * 1024)


def sample_row(label: str, parked: int, s: ProcessSample) -> list[object]:
    return [label, parked, mib(s.rss_bytes), s.fds, s.sockets, s.threads]


async def amain(opts: argparse.Namespace) -> Figures:
    if opts.runs < 1 or opts.warmup < 1 or opts.decide < 0 or opts.concurrency < 1 or opts.decide_concurrency < 1:
        raise BenchError("--runs, --warmup and the concurrencies must be positive, --decide not negative")
    if opts.decide > opts.runs:
        raise BenchError("--decide cannot be more than --runs")
    began = time.monotonic()
    with scratch_dir("qy-bench-parked-") as data_dir, standin_process() as standin_url, postgres_server() as admin_url:
        url = await create_migrated_database(admin_url)
        env = base_env(standin_url, data_dir)
        env["QUAYUTEC_RUNTIME_MAX_RUNS"] = str(opts.max_runs)
        pool = await create_pool(url, min_size=2, max_size=8)
        try:
            async with running_stack(url, ("claims", "room", "runtime"), env, data_dir / "logs") as stack:
                await wait_for_room(stack, ROOM_WAIT_SECONDS)
                pid = stack.procs["runtime"].pid
                async with (
                    room_callers(stack) as room,
                    stack.channel("runtime", GATEWAY) as runtime_channel,
                ):
                    runtime = runtime_pb2_grpc.RuntimeServiceStub(runtime_channel)
                    return await measure(opts, room, runtime, pool, standin_url, pid, began)
        finally:
            await pool.close()
            await drop_database(admin_url, url)


async def measure(
    opts: argparse.Namespace, room: Any, runtime: Any, pool: asyncpg.Pool, standin_url: str, pid: int, began: float
) -> Figures:
    world = await make_room_world(room, f"parked-{uuid.uuid4().hex[:6]}", model=MODEL)
    await room.SetAgentRights(
        room_pb2.RoomServiceSetAgentRightsRequest(
            rights=common_pb2.AgentRights(
                company_id=world.company_id, agent_id=world.agent_id, remember=common_pb2.ACTION_RIGHT_HOLD
            )
        )
    )
    total = opts.warmup + opts.runs
    remember = {"name": "remember", "arguments": {"text": "the launch moves to Friday", "private": False}}
    queue_standin_replies(standin_url, "Noted; I will remember it once approved.", [remember], model=MODEL, times=total)
    t = time.monotonic()
    wakes = await post_wakes(room, world, total)
    log(f"posted {total} wake messages in {time.monotonic() - t:.0f} s")

    warm = await park(runtime, pool, world, wakes[: opts.warmup], opts.concurrency)
    if warm.failed:
        raise BenchError(f"{len(warm.failed)} warm-up runs did not park; the first: {warm.failed[0]}")
    await asyncio.sleep(SETTLE_SECONDS)
    before = ProcessSample.of(pid)
    samples = [sample_row("after warm-up", opts.warmup, before)]
    log(f"warm-up: {opts.warmup} parked; Runtime RSS {mib(before.rss_bytes):.1f} MiB, {before.fds} fds")

    def progress(done: int) -> None:
        s = ProcessSample.of(pid)
        rate = done / (time.monotonic() - t_park)
        rss = mib(s.rss_bytes)
        log(f"  {done}/{opts.runs} parked ({rate:.0f}/s); RSS {rss:.1f} MiB, {s.fds} fds, {s.sockets} sockets")

    t_park = time.monotonic()
    measured = await park(runtime, pool, world, wakes[opts.warmup :], opts.concurrency, progress)
    await asyncio.sleep(SETTLE_SECONDS)
    after = ProcessSample.of(pid)
    samples.append(sample_row(f"after {opts.runs} more", total, after))
    pending_parked = int(await pool.fetchval(PENDING_QUERY, uuid.UUID(world.company_id)))

    tokens = list(measured.tokens.values())[: opts.decide]
    log(f"deciding {len(tokens)} parked runs ...")
    decided = await decide_and_continue(room, runtime, pool, world, tokens, opts.decide_concurrency)
    rows = await pool.fetch(DECISION_TO_WRITE_QUERY, [uuid.UUID(tok) for tok in tokens])
    latency = [(r["created_at"] - r["decided_at"]).total_seconds() * 1000 for r in rows]
    succeeded = sum(1 for r in rows if r["status"] == "succeeded")
    await asyncio.sleep(SETTLE_SECONDS)
    samples.append(sample_row(f"after {len(tokens)} continued", total, ProcessSample.of(pid)))
    pending_left = int(await pool.fetchval(PENDING_QUERY, uuid.UUID(world.company_id)))

    print(f"\nRuntime (pid {pid}) with nothing executing; sockets = inet connections; RSS in MiB.\n")
    print_table(["when", "parked", "RSS MiB", "fds", "sockets", "threads"], samples)
    print(
        f"\nafter/before: RSS {after.rss_bytes / before.rss_bytes:.3f}x ({mib(after.rss_bytes - before.rss_bytes):+.1f}"
        f" MiB for {opts.runs} more parked, {(after.rss_bytes - before.rss_bytes) / opts.runs:+.0f} B/run), "
        f"fds {after.fds}/{before.fds}, sockets {after.sockets}/{before.sockets}, "
        f"threads {after.threads}/{before.threads}"
    )
    print(
        f"parked {len(measured.tokens)} of {opts.runs} in {measured.seconds:.0f} s "
        f"({len(measured.tokens) / measured.seconds:.0f}/s, c={opts.concurrency}, {measured.refused} refused as full, "
        f"{len(measured.failed)} failed); waitpoints PENDING in the database: {pending_parked}"
        f" (warm-up + measured = {total})"
    )
    print(f"\nDecision to the continued run's first write, {len(decided)} runs, c={opts.decide_concurrency} (ms):\n")
    print_table(
        ["measure", "p50", "p99", "max"],
        [
            ["decided_at -> memory_lines.created_at (db)", *figures(latency)],
            ["client: DecideHeldAction call", *figures([d.decide_ms for d in decided])],
            ["client: wake lookup + StartRun", *figures([d.deliver_ms for d in decided])],
            ["client: before decide -> line seen", *figures([d.client_ms for d in decided])],
        ],
    )
    print(
        f"\ncontinued runs succeeded: {succeeded}/{len(tokens)}; waitpoints PENDING afterwards: {pending_left}"
        f"\nbench took {time.monotonic() - began:.0f} s"
    )
    if measured.failed:
        raise BenchError(f"{len(measured.failed)} runs did not park; the first: {measured.failed[0]}")
    if succeeded != len(tokens) or pending_parked != total or pending_left != total - len(tokens):
        raise BenchError("the database does not show every run parked and every decided run continued")
    return {
        "Runtime RSS MiB after warm-up": mib(before.rss_bytes),
        "Runtime RSS MiB after parking": mib(after.rss_bytes),
        "Runtime RSS after/before": after.rss_bytes / before.rss_bytes,
        "Runtime fds after parking": float(after.fds),
        "Runtime threads after parking": float(after.threads),
        "parked per s": len(measured.tokens) / measured.seconds,
        "decision to write p50 ms": percentile(latency, 50),
        "decision to write p99 ms": percentile(latency, 99),
    }


def figures(values: Sequence[float]) -> list[float]:
    return [percentile(values, 50), percentile(values, 99), max(values, default=float("nan"))]


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=10_000, help="runs parked after the warm-up (default 10000)")
    parser.add_argument("--warmup", type=int, default=200, help="runs parked before the first sample (default 200)")
    parser.add_argument("--decide", type=int, default=300, help="parked runs then decided and continued (default 300)")
    parser.add_argument("--concurrency", type=int, default=32, help="runs being parked at once (default 32)")
    parser.add_argument("--decide-concurrency", type=int, default=1, help="decisions in flight at once (default 1)")
    parser.add_argument("--max-runs", type=int, default=64, help="QUAYUTEC_RUNTIME_MAX_RUNS (default 64)")
    add_json_argument(parser)
    return run_main(amain, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
