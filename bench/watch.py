"""Live rooms at scale: W concurrent WatchRoom streams on one Gateway replica.

``python bench/watch.py [--watchers 1000] [--posts 200] [--posters 4] [--watcher-procs 2] [--json PATH]``

Room and Gateway run as processes on one PostgreSQL (``DATABASE_URL``'s server or an embedded one);
the watchers run in ``--watcher-procs`` child processes of this script (so their reading does not
share an event loop with the posters). In one run:

1. PostMessage throughput with no watcher (P posters, closed loop, M messages).
2. W watchers open a stream each on one room and read until caught up; the Gateway's RSS before and
   after gives its memory per watcher.
3. PostMessage throughput again with all W watching, M messages; each watcher records, per message,
   receipt time minus the message's ``created_at`` (PostgreSQL's ``now()`` in the posting
   transaction, which is before its commit: an upper bound of commit-to-receipt latency), and
   every watcher must receive every message exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

import grpc

from bench.common import (
    BenchError,
    Figures,
    ProcessSample,
    add_json_argument,
    base_env,
    create_migrated_database,
    drop_database,
    percentile,
    postgres_server,
    print_table,
    run_main,
    running_stack,
    scratch_dir,
    standin_process,
    wait_for_room,
)
from quayutec.db import create_pool
from quayutec.tls import ADMIN, GATEWAY
from quayutec.v1 import gateway_pb2, room_pb2, room_pb2_grpc
from services.client import GatewayClient
from services.gateway.auth import create_api_key

ROOT = Path(__file__).resolve().parent.parent
ROOM_WAIT_SECONDS = 600.0
PHASE_SECONDS = 300.0  # the longest any phase may take
STREAMS_PER_CHANNEL = 100  # HTTP/2 streams per client connection
BODY_PREFIX = "bench-watch"


@dataclass
class Posted:
    count: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else float("nan")


async def post_messages(client: GatewayClient, room_id: str, count: int, posters: int, tag: str) -> Posted:
    jobs = iter(range(count))

    async def poster() -> None:
        for i in jobs:
            body = f"{BODY_PREFIX} {tag} {i}"
            await client.PostMessage(
                gateway_pb2.PostMessageRequest(room_id=room_id, person="bench", body=body), timeout=30
            )

    start = time.perf_counter()
    await asyncio.gather(*(poster() for _ in range(posters)))
    return Posted(count, time.perf_counter() - start)


# -- the watcher processes ----------------------------------------------------------------------------------


async def watchers_main(opts: argparse.Namespace) -> None:
    """A child: opens ``--count`` streams, says "ready" when all caught up, records latencies of the
    measured messages (tag ``--tag``) until each stream has ``--expect`` of them, prints a JSON line."""
    channels = [
        grpc.aio.insecure_channel(opts.addr)
        for _ in range((opts.count + STREAMS_PER_CHANNEL - 1) // STREAMS_PER_CHANNEL)
    ]
    latencies: list[float] = []
    counts = [0] * opts.count
    caught_up = 0
    all_caught_up = asyncio.Event()
    prefix = f"{BODY_PREFIX} {opts.tag} "

    async def one(i: int) -> None:
        nonlocal caught_up
        client = GatewayClient(channels[i // STREAMS_PER_CHANNEL], opts.key)
        call = client.WatchRoom(gateway_pb2.WatchRoomRequest(room_id=opts.room))
        seen_heartbeat = False
        async for item in call:
            if item.HasField("heartbeat"):
                if not seen_heartbeat:
                    seen_heartbeat = True
                    caught_up += 1
                    if caught_up == opts.count:
                        all_caught_up.set()
                continue
            received = time.time()
            for event in item.events:
                message = event.message
                if message.body.startswith(prefix):
                    latencies.append((received - message.created_at.ToDatetime(tzinfo=UTC).timestamp()) * 1000)
                    counts[i] += 1
            if counts[i] >= opts.expect:
                call.cancel()
                return

    tasks = [asyncio.create_task(one(i)) for i in range(opts.count)]
    await asyncio.wait_for(all_caught_up.wait(), timeout=PHASE_SECONDS)
    print("ready", flush=True)
    done, pending = await asyncio.wait(tasks, timeout=PHASE_SECONDS)
    for task in pending:
        task.cancel()
    errors = [repr(t.exception()) for t in done if not t.cancelled() and t.exception() is not None]
    print(json.dumps({"latencies_ms": latencies, "counts": counts, "errors": errors[:5]}), flush=True)
    for channel in channels:
        await channel.close()


def start_watchers(addr: str, key: str, room_id: str, count: int, expect: int, tag: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *(sys.executable, __file__, "--role", "watchers", "--addr", addr, "--key", key, "--room", room_id),
            *("--count", str(count), "--expect", str(expect), "--tag", tag),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )


async def read_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout=PHASE_SECONDS)
    if not line:
        raise BenchError(f"a watcher process ended early (exit {proc.wait()})")
    return line.strip()


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of the processes (0 for one that has ended)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


# -- the bench ----------------------------------------------------------------------------------------------


async def amain(opts: argparse.Namespace) -> Figures:
    started = time.monotonic()
    with scratch_dir("qy-bench-watch-") as data_dir, standin_process() as standin_url, postgres_server() as admin_url:
        url = await create_migrated_database(admin_url)
        env = base_env(standin_url, data_dir)
        env.update(
            {
                "QUAYUTEC_GATEWAY_POST_RATE": "1000000",
                "QUAYUTEC_GATEWAY_POST_BURST": "1000000",
                "QUAYUTEC_GATEWAY_DELIVERY_ENABLED": "false",
                "QUAYUTEC_GATEWAY_WATCH_MAX_STREAMS": str(opts.watchers + 10),
                # Every watcher is of one company: lift its fair share to the replica's limit.
                "QUAYUTEC_GATEWAY_MAX_STREAMS_PER_COMPANY": str(opts.watchers + 10),
            }
        )
        pool = await create_pool(url, min_size=1, max_size=2)
        procs: list[subprocess.Popen[str]] = []
        try:
            async with running_stack(url, ("room", "gateway"), env, data_dir / "logs") as stack:
                await wait_for_room(stack, ROOM_WAIT_SECONDS)
                gateway_pid = stack.procs["gateway"].pid
                async with (
                    stack.channel("room", ADMIN) as room_channel,
                    stack.channel("gateway", GATEWAY) as gateway_channel,
                ):
                    room = room_pb2_grpc.RoomServiceStub(room_channel)
                    company = (
                        await room.CreateCompany(
                            room_pb2.RoomServiceCreateCompanyRequest(name=f"bench-watch-{uuid.uuid4().hex[:6]}")
                        )
                    ).company
                    _, key = await create_api_key(pool, company.company_id, "bench")
                    client = GatewayClient(gateway_channel, key)
                    room_id = (await client.CreateRoom(gateway_pb2.CreateRoomRequest(name="watched"))).room.room_id

                    await post_messages(client, room_id, 20, opts.posters, "warmup")
                    without = await post_messages(client, room_id, opts.posts, opts.posters, "alone")
                    print(f"  no watchers: {without.rate:.0f} posts/s", file=sys.stderr)

                    before = ProcessSample.of(gateway_pid)
                    per_proc = [opts.watchers // opts.watcher_procs] * opts.watcher_procs
                    per_proc[0] += opts.watchers - sum(per_proc)
                    tag = uuid.uuid4().hex[:8]
                    procs = [start_watchers(stack.addr("gateway"), key, room_id, n, opts.posts, tag) for n in per_proc]
                    for proc in procs:
                        if await read_line(proc) != "ready":
                            raise BenchError("a watcher process did not get ready")
                    await asyncio.sleep(1.0)  # let the Gateway settle after the opening burst
                    after = ProcessSample.of(gateway_pid)
                    print(f"  {opts.watchers} watchers caught up", file=sys.stderr)

                    pids = {
                        "gateway": [gateway_pid],
                        "room": [stack.procs["room"].pid],
                        "watchers": [p.pid for p in procs],
                    }
                    cpu_before = {name: cpu_seconds(ps) for name, ps in pids.items()}
                    with_watchers = await post_messages(client, room_id, opts.posts, opts.posters, tag)
                    print(f"  with watchers: {with_watchers.rate:.0f} posts/s", file=sys.stderr)
                    results = [json.loads(await read_line(proc)) for proc in procs[:-1]]
                    cpu_after = {name: cpu_seconds(ps) for name, ps in pids.items()}
                    results.append(json.loads(await read_line(procs[-1])))
                    during = ProcessSample.of(gateway_pid)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(timeout=30)
            await pool.close()
            await drop_database(admin_url, url)

    latencies = [value for r in results for value in r["latencies_ms"]]
    counts = [c for r in results for c in r["counts"]]
    errors = [e for r in results for e in r["errors"]]
    complete = sum(1 for c in counts if c == opts.posts)
    print(
        f"\nWatchRoom at scale: {opts.watchers} watchers of one room on one Gateway replica, "
        f"{opts.posters} posters, {opts.posts} messages per phase ({datetime.now(UTC):%Y-%m-%d})\n"
    )
    gateway_cpu = cpu_after["gateway"] - cpu_before["gateway"]
    figures: Figures = {
        "PostMessage/s without watchers": without.rate,
        "PostMessage/s with watchers": with_watchers.rate,
        "with/without PostMessage/s": with_watchers.rate / without.rate,
        "delivery p50 ms": percentile(latencies, 50),
        "delivery p99 ms": percentile(latencies, 99),
        "Gateway RSS KiB per watcher": (after.rss_bytes - before.rss_bytes) / opts.watchers / 1024,
        "Gateway CPU us per delivery": gateway_cpu * 1e6 / max(1, len(latencies)),
    }
    print_table(
        ["measurement", "value"],
        [
            ["PostMessage/s without watchers", without.rate],
            ["PostMessage/s with watchers", with_watchers.rate],
            ["with / without", f"{with_watchers.rate / without.rate:.2f}"],
            ["delivery latency p50 ms (created_at -> receipt)", percentile(latencies, 50)],
            ["delivery latency p99 ms", percentile(latencies, 99)],
            ["deliveries", f"{len(latencies)} of {opts.watchers * opts.posts}"],
            ["watchers that got every message", f"{complete} of {opts.watchers}"],
            ["Gateway RSS before watchers MiB", before.rss_bytes / 2**20],
            ["Gateway RSS with watchers MiB", after.rss_bytes / 2**20],
            ["Gateway RSS per watcher KiB", (after.rss_bytes - before.rss_bytes) / opts.watchers / 1024],
            ["Gateway RSS after the posts MiB", during.rss_bytes / 2**20],
            *(
                [f"{name} CPU s while posting with watchers", cpu_after[name] - cpu_before[name]]
                for name in ("gateway", "room", "watchers")
            ),
            ["Gateway CPU us per delivery", figures["Gateway CPU us per delivery"]],
        ],
    )
    if errors:
        print(f"watcher errors (first): {errors}")
    print(f"bench took {time.monotonic() - started:.0f} s")
    if complete != opts.watchers:
        raise BenchError(f"only {complete} of {opts.watchers} watchers received every message")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--watchers", type=int, default=1000, help="concurrent WatchRoom streams (default 1000)")
    parser.add_argument("--posts", type=int, default=200, help="messages per measured phase (default 200)")
    parser.add_argument("--posters", type=int, default=4, help="concurrent posters (default 4)")
    parser.add_argument("--watcher-procs", type=int, default=2, help="processes the watchers run in (default 2)")
    parser.add_argument("--role", default="bench", choices=["bench", "watchers"], help=argparse.SUPPRESS)
    parser.add_argument("--addr", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--room", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--expect", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    add_json_argument(parser)
    opts = parser.parse_args()
    if opts.role == "watchers":
        return run_main(watchers_main, opts)
    if opts.watchers < 1 or opts.posts < 1 or opts.posters < 1 or not 1 <= opts.watcher_procs <= opts.watchers:
        raise SystemExit("--watchers, --posts, --posters and --watcher-procs must be positive (procs <= watchers)")
    return run_main(amain, opts)


if __name__ == "__main__":
    sys.exit(main())
