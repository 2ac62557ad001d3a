"""PostgreSQL failovers on the multi-host bed's highly available database (three hosts under
Patroni; tests/cluster/ha.py), and what synchronous replication costs a wake.

``python bench/failover.py [--wakes 25] [--rounds 2] [--delay-ms 0] [--skip-faults]`` (as root: it
runs itself inside ``unshare --net --mount --pid``, as ``python -m scripts.cluster`` does).

1. The cost: wakes posted one at a time through host a's Gateway, post→reply measured on a
   WatchRoom stream, alternately with synchronous replication (``synchronous_mode_strict``, what the
   services need) and asynchronous, ``rounds`` times ``wakes`` each; p50 and p99 of each and their
   ratio. ``--delay-ms`` adds that much one way between hosts (every SQL statement and the
   replication pay it).
2. The faults of tests/cluster/failover.py, each with 100 wakes in flight and 20 posted during it,
   counted from the surviving database: the primary killed (synchronous); the synchronous standby
   killed, then the primary; and the negative control: asynchronous replication with the standbys'
   replication link cut, then the primary killed (what synchronous replication prevents). Each
   prints wakes once / twice / not done / claims without a ledger row / never claimed /
   acknowledged posts missing, seconds without a primary, the longest wait for a post, seconds
   until every wake was done.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

from scripts.cluster import NAMESPACES
from tests.cluster.bed import Bed, interfaces, new_root
from tests.cluster.failover import (
    kill_primary,
    lose_sync_standby_then_primary,
    negative_control,
    post_to_reply_ms,
    under_load,
)
from tests.cluster.world import world_on

INSIDE = "QUAYUTEC_FAILOVER_BENCH_INSIDE"
# A wake whose post was lost never ends: the negative control counts after this long.
NEGATIVE_SETTLE_SECONDS = 45.0


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def cost(bed: Bed, opts: argparse.Namespace) -> None:
    assert bed.ha_db is not None
    ha = bed.ha_db
    took: dict[bool, list[float]] = {True: [], False: []}
    bed.set_delay(opts.delay_ms)
    try:
        async with world_on(bed, "cost") as world:
            world.script_standins(times=2 * opts.rounds * opts.wakes + 10, delay_seconds=0.0, remember=True)
            n = 0
            for _ in range(opts.rounds):
                for synchronous in (True, False):
                    await asyncio.to_thread(ha.set_synchronous, synchronous)
                    await asyncio.to_thread(ha.wait_healthy, 60)
                    took[synchronous] += await post_to_reply_ms(world, n, opts.wakes)
                    n += opts.wakes
    finally:
        bed.set_delay(0)
        await asyncio.to_thread(ha.set_synchronous, True)
        await asyncio.to_thread(ha.wait_healthy, 60)
    figures = {s: (statistics.median(v), percentile(v, 99)) for s, v in took.items()}
    print(f"post->reply, {opts.rounds} x {opts.wakes} wakes each, {opts.delay_ms:g} ms one way between hosts:")
    for synchronous, name in ((True, "synchronous (strict)"), (False, "asynchronous")):
        p50, p99 = figures[synchronous]
        print(f"  {name:22s} p50 {p50:7.1f} ms   p99 {p99:7.1f} ms")
    (s50, s99), (a50, a99) = figures[True], figures[False]
    print(f"  synchronous / asynchronous: p50 x{s50 / a50:.2f}, p99 x{s99 / a99:.2f}", flush=True)


async def faults(bed: Bed) -> None:
    for name, label, fault, settle in (
        ("pg-kill", "primary killed (synchronous)", kill_primary, True),
        ("pg-sync-first", "sync standby killed, then the primary", lose_sync_standby_then_primary, True),
        ("pg-async", "NEGATIVE CONTROL: asynchronous, replication cut, primary killed", negative_control, False),
    ):
        limit = 150.0 if settle else NEGATIVE_SETTLE_SECONDS
        run = await under_load(bed, name, fault, settle=settle, settle_limit=limit, label=label)
        print("\n" + run.line(), flush=True)


async def amain(opts: argparse.Namespace) -> int:
    bed = Bed(new_root(), ha=True)
    try:
        await bed.start()
        await cost(bed, opts)
        if not opts.skip_faults:
            await faults(bed)
    finally:
        bed.stop()
        if os.environ.get("QUAYUTEC_BED_KEEP") != "1":
            bed.remove_files()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--wakes", type=int, default=25, help="wakes per round and replication mode")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one way between hosts while measuring the cost")
    parser.add_argument("--skip-faults", action="store_true")
    opts = parser.parse_args()
    if os.environ.get(INSIDE) != "1" or interfaces() != ["lo"]:
        if os.geteuid() != 0:
            raise SystemExit("the bed makes network namespaces and devices: run it as root")
        argv = [*NAMESPACES, "--kill-child", "--", sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
        return subprocess.call(argv, env={**os.environ, INSIDE: "1"}, cwd=Path(__file__).resolve().parent.parent)
    return asyncio.run(amain(opts))


if __name__ == "__main__":
    sys.exit(main())
