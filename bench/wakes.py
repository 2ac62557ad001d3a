"""Wakes per second from a posted message to a posted reply, end to end through the Gateway (the
stand-in answering at once), beside the Gateway's post-only rate at the same concurrency.

``python bench/wakes.py [--wakes 200] [--warmup 10] [--concurrency 1,32] [--poll-interval 0.05] [--json PATH]``

All four services run as processes on one PostgreSQL (``DATABASE_URL``'s server or an embedded
one). P posters each post a message mentioning the agent through Gateway PostMessage and wait for
its reply (closed loop: P wakes in flight). Latency per wake = the reply's created_at minus the
posted message's created_at (both stamped by PostgreSQL). CPU per wake (and per post of the post-only
baseline) = each service process's user + system CPU over the measured wakes (posts), divided by
their number, and the same for all of the embedded PostgreSQL's processes (not shown with
``DATABASE_URL``; it includes the bench's own reply polling). ``QY_BENCH_PROFILE=runtime,room`` runs
the named services under cProfile for where it goes. The reply is found by its run_id
(run_id_for(agent, wake)) through its ledger row, with one batched query every 2 ms.
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
import grpc

from bench.common import (
    BatchWatcher,
    Figures,
    add_json_argument,
    base_env,
    create_migrated_database,
    drop_database,
    level_figures,
    parse_concurrency,
    percentile,
    post_mention,
    postgres_cpu_seconds,
    postgres_server,
    print_table,
    room_callers,
    run_main,
    running_stack,
    scratch_dir,
    standin_process,
    wait_for_room,
)
from quayutec.db import create_pool
from quayutec.tls import GATEWAY
from quayutec.v1 import common_pb2, gateway_pb2, room_pb2
from services.client import GatewayClient
from services.gateway.auth import create_api_key

# By primary keys (the ledger row names its reply in the reply's own transaction): messages has no
# index on run_id, and a scan of it on every poll would put the bench's own load on PostgreSQL.
REPLIES_QUERY = (
    "SELECT r.run_id, m.created_at FROM runs r JOIN messages m ON m.message_id = NULLIF(r.posted_message_id, '')::uuid "
    "WHERE r.run_id = ANY($1::text[])"
)
ROOM_WAIT_SECONDS = 600.0


@dataclass
class Measured:
    kind: str
    concurrency: int
    count: int
    seconds: float
    latency_ms: list[float] = field(default_factory=list)
    cpu_ms_per_item: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else float("nan")


@dataclass(frozen=True)
class GatewayWorld:
    client: GatewayClient
    room_id: str
    agent_id: str


async def make_gateway_world(room: Any, pool: asyncpg.Pool, channel: grpc.aio.Channel, tag: str) -> GatewayWorld:
    """A company with an API key (admin path), then its room and agent through the Gateway."""
    company = (await room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name=f"bench-{tag}"))).company
    _, key = await create_api_key(pool, company.company_id, "bench")
    client = GatewayClient(channel, key)
    made = (await client.CreateRoom(gateway_pb2.CreateRoomRequest(name=f"wakes-{tag}"))).room
    agent = (
        await client.RegisterAgent(
            gateway_pb2.RegisterAgentRequest(
                name="bench-agent",
                provider=common_pb2.PROVIDER_ANTHROPIC,
                model="bench-model",
                provider_key="sk-bench-not-a-real-key",
                system_prompt="You answer briefly.",
            )
        )
    ).agent
    return GatewayWorld(client, made.room_id, agent.agent_id)


async def closed_loop(count: int, concurrency: int, one: Callable[[int], Awaitable[float | None]]) -> Measured:
    """``concurrency`` posters share ``count`` jobs; ``one(i)`` returns a latency in ms or None."""
    jobs = iter(range(count))
    latencies: list[float] = []

    async def poster() -> None:
        for i in jobs:
            latency = await one(i)
            if latency is not None:
                latencies.append(latency)

    start = time.perf_counter()
    await asyncio.gather(*(poster() for _ in range(concurrency)))
    return Measured("", concurrency, count, time.perf_counter() - start, latencies)


async def post_only(world: GatewayWorld, count: int, concurrency: int) -> Measured:
    async def one(i: int) -> float:
        t0 = time.perf_counter()
        await world.client.PostMessage(
            gateway_pb2.PostMessageRequest(room_id=world.room_id, person="bench", body=f"status note {i}"),
            timeout=30,
        )
        return (time.perf_counter() - t0) * 1000

    measured = await closed_loop(count, concurrency, one)
    measured.kind = "post only (no mention)"
    return measured


async def end_to_end(world: GatewayWorld, watcher: BatchWatcher, count: int, concurrency: int) -> Measured:
    async def one(i: int) -> float:
        run_id, sent = await post_mention(world.client, world.room_id, world.agent_id, i, deadline=30)
        reply = await asyncio.wait_for(watcher.wait(run_id), timeout=60)
        return float((reply["created_at"] - sent).total_seconds() * 1000)

    measured = await closed_loop(count, concurrency, one)
    measured.kind = "end to end (post -> reply)"
    return measured


async def amain(opts: argparse.Namespace) -> Figures:
    concurrencies = parse_concurrency(opts.concurrency)
    started = time.monotonic()
    results: list[Measured] = []
    with scratch_dir("qy-bench-wakes-") as data_dir, standin_process() as standin_url, postgres_server() as admin_url:
        url = await create_migrated_database(admin_url)
        env = base_env(standin_url, data_dir)
        env.update(
            {
                "QUAYUTEC_GATEWAY_POST_RATE": "1000000",
                "QUAYUTEC_GATEWAY_POST_BURST": "1000000",
                "QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS": str(opts.poll_interval),
                "QUAYUTEC_RUNTIME_MAX_RUNS": str(2 * max(concurrencies) + 16),
            }
        )
        pool = await create_pool(url, min_size=2, max_size=4)
        try:
            names = ("claims", "room", "runtime", "gateway")
            async with running_stack(url, names, env, data_dir / "logs") as stack:
                await wait_for_room(stack, ROOM_WAIT_SECONDS)
                async with (
                    room_callers(stack) as room,
                    stack.channel("gateway", GATEWAY) as gateway_channel,
                ):
                    tag = uuid.uuid4().hex[:6]
                    with BatchWatcher(pool, REPLIES_QUERY, interval=0.002) as watcher:
                        for c in concurrencies:
                            # A fresh room per level, so every level starts from the same room size.
                            world = await make_gateway_world(room, pool, gateway_channel, f"{tag}-{c}")
                            await end_to_end(world, watcher, opts.warmup, c)
                            before = cpu_seconds(stack, admin_url)
                            e2e = await end_to_end(world, watcher, opts.wakes, c)
                            after = cpu_seconds(stack, admin_url)
                            e2e.cpu_ms_per_item = cpu_ms_each(before, after, opts.wakes)
                            before = cpu_seconds(stack, admin_url)
                            base = await post_only(world, opts.wakes, c)
                            after = cpu_seconds(stack, admin_url)
                            base.cpu_ms_per_item = cpu_ms_each(before, after, opts.wakes)
                            results += [e2e, base]
                            print(f"  c={c}: {e2e.rate:.0f} wakes/s, {base.rate:.0f} posts/s", file=sys.stderr)
        finally:
            await pool.close()
            await drop_database(admin_url, url)
    return report(results, concurrencies, opts.poll_interval, time.monotonic() - started)


def cpu_seconds(stack: Any, admin_url: str) -> dict[str, float]:
    """User + system CPU seconds each service process has used so far, and the embedded PostgreSQL
    ("postgres", all its processes) when the bench started one."""
    import psutil

    out = {}
    for name, proc in stack.procs.items():
        times = psutil.Process(proc.pid).cpu_times()
        out[name] = times.user + times.system
    postgres = postgres_cpu_seconds(admin_url)
    if postgres is not None:
        out["postgres"] = postgres
    return out


def cpu_ms_each(before: dict[str, float], after: dict[str, float], count: int) -> dict[str, float]:
    """CPU ms per measured item of each process, from two ``cpu_seconds`` readings."""
    return {n: (after[n] - before[n]) * 1000 / count for n in sorted(after)}


def report(results: Sequence[Measured], concurrencies: list[int], poll: float, seconds: float) -> Figures:
    print(
        f"\nWakes through the Gateway (stand-in answering at once; Gateway delivery polls every {poll:g} s)."
        "\nEnd to end: latency = reply created_at - posted created_at; post only: PostMessage round trip.\n"
    )
    print_table(
        ["measurement", "posters", "count", "per s", "p50 ms", "p99 ms"],
        [
            [m.kind, m.concurrency, m.count, m.rate, percentile(m.latency_ms, 50), percentile(m.latency_ms, 99)]
            for m in results
        ],
    )
    figures: Figures = {}
    for m in results:
        what = f"{'wake' if m.kind.startswith('end') else 'post'} c={m.concurrency}"
        figures |= level_figures(what, "per s", m.rate, {"": m.latency_ms})
        for name, ms in m.cpu_ms_per_item.items():
            figures[f"{what} CPU ms {name}"] = ms
        if m.cpu_ms_per_item:
            services = sum(ms for name, ms in m.cpu_ms_per_item.items() if name != "postgres")
            figures[f"{what} CPU ms services"] = services
            if "postgres" in m.cpu_ms_per_item:
                figures[f"{what} CPU ms all"] = sum(m.cpu_ms_per_item.values())
    pairs = {(m.kind.split(" ")[0], m.concurrency): m for m in results}
    ratios = []
    for c in concurrencies:
        ratio = pairs[("end", c)].rate / pairs[("post", c)].rate
        figures[f"wake/post c={c} per s"] = ratio
        ratios.append(f"c={c}: {ratio:.2f}")
    print(f"\nend-to-end / post-only: {', '.join(ratios)}")
    cpu = [m for m in results if m.cpu_ms_per_item]
    if cpu:
        names = sorted(n for n in cpu[0].cpu_ms_per_item if n != "postgres")
        db = ["postgres"] if "postgres" in cpu[0].cpu_ms_per_item else []
        print(
            "\nCPU ms per end-to-end wake (and per post of the post-only baseline), by service process and, with"
            "\nthe embedded database, PostgreSQL's processes (user + system over the measured wakes or posts):\n"
        )
        print_table(
            ["measurement", "posters", *names, "services", *db, *(["all"] if db else [])],
            [
                [
                    "per wake" if m.kind.startswith("end") else "per post",
                    m.concurrency,
                    *(m.cpu_ms_per_item[n] for n in names),
                    sum(m.cpu_ms_per_item[n] for n in names),
                    *(m.cpu_ms_per_item[n] for n in db),
                    *([sum(m.cpu_ms_per_item.values())] if db else []),
                ]
                for m in cpu
            ],
        )
    print(f"bench took {seconds:.0f} s")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--wakes", type=int, default=200, help="measured wakes (and posts) per level (default 200)")
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured wakes before each level (default 10)")
    parser.add_argument("--concurrency", default="1,32", help="comma-separated numbers of posters (default 1,32)")
    parser.add_argument(
        "--poll-interval", type=float, default=0.05, help="Gateway delivery poll interval in s (default 0.05)"
    )
    add_json_argument(parser)
    return run_main(amain, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
