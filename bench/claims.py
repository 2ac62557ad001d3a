"""Claims throughput: gRPC ClaimOnce against a real Claims server vs raw asyncpg inserts, same database.

Two gRPC rows per server variant and concurrency: "ClaimOnce per call" (each worker sends its own
ClaimOnce over 4 channels) and "Runtime client, ClaimMany" (the workers claim through the Runtime's
coalescing ``ClaimsClient`` on one channel, as the Runtime does: concurrent claims leave together in
one ClaimMany, one call in flight). Each is set beside a raw figure measured just before it.

``python bench/claims.py [--seconds 5] [--concurrency 1,64] [--default-only] [--no-coalesced] [--experiments]
[--mtls-cost [--rounds 3]] [--json PATH]``.
The database is ``DATABASE_URL`` (a scratch database is created on it and dropped) or an embedded PostgreSQL in a
tmp folder. The server runs as a separate process (``python -m services.claims``), so client load
and server do not share an event loop. Every claim is a distinct pair; every one must be claimed.
The server serves mutual TLS and the client claims as the Runtime, as in production.
``--mtls-cost [--rounds 3]`` instead runs the same server twice, with mutual TLS and in plaintext
without authorization (how it ran before mutual TLS), measures them in turns and prints the
median mTLS/plaintext ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: make quayutec and services importable

import asyncpg  # noqa: E402
import grpc  # noqa: E402

from bench.common import (  # noqa: E402
    Figures,
    add_json_argument,
    create_database,
    drop_database,
    parse_concurrency,
    postgres_server,
    run_main,
)
from quayutec.db import create_pool  # noqa: E402
from quayutec.migrate import CLAIMS as CLAIMS_COMPONENT  # noqa: E402
from quayutec.migrate import migrate  # noqa: E402
from quayutec.tls import Identity, MtlsConfig, ensure_dev_pki, load_identity  # noqa: E402
from quayutec.v1 import claims_pb2, claims_pb2_grpc  # noqa: E402
from services.runtime.claims_client import ClaimsClient  # noqa: E402
from services.stack import free_port, wait_serving  # noqa: E402

RAW_INSERT = (
    "INSERT INTO agent_run_locks (agent_id, wake_id) VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING claimed_at"
)
CHANNELS = 4
RAW_POOL_MAX = 10


@dataclass(frozen=True)
class Variant:
    """One way to run the Claims server: its environment and whether it runs on uvloop (the
    service itself runs on the default asyncio loop)."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    uvloop: bool = False
    # Server processes on the port. Our servers bind a port alone (quayutec/server.py EXCLUSIVE_PORTS):
    # a second process on it is refused at start, so this stays 1 (the two-process variants are gone).
    processes: int = 1
    # No mutual TLS and no per-RPC authorization (the server as it was before them), to measure their cost.
    plaintext: bool = False


DEFAULT_VARIANTS = (
    Variant("default (batched)"),
    Variant("batch off", {"QUAYUTEC_CLAIMS_BATCH_MAX": "1"}),
)
# The server without its identity: GrpcServer then serves plaintext with no authorization interceptor.
PLAINTEXT_SERVER = (
    "import asyncio, services.claims.server as s; s.load_identity = lambda *a, **k: None; asyncio.run(s.main())"
)
EXPERIMENT_VARIANTS = (
    Variant("batched, uvloop", uvloop=True),
    Variant("batch off, uvloop", {"QUAYUTEC_CLAIMS_BATCH_MAX": "1"}, uvloop=True),
    Variant("batched, pool 2", {"QUAYUTEC_CLAIMS_DB_POOL_MAX": "2"}),
    Variant("batched, pool 20", {"QUAYUTEC_CLAIMS_DB_POOL_MAX": "20"}),
    Variant("batched, 4 in flight", {"QUAYUTEC_CLAIMS_BATCH_IN_FLIGHT": "4"}),
    Variant("batched, 2 in flight", {"QUAYUTEC_CLAIMS_BATCH_IN_FLIGHT": "2"}),
    Variant("batched, 10 in flight", {"QUAYUTEC_CLAIMS_BATCH_IN_FLIGHT": "10"}),
    Variant("batched, max 16", {"QUAYUTEC_CLAIMS_BATCH_MAX": "16"}),
    Variant("batch off, pool 20", {"QUAYUTEC_CLAIMS_BATCH_MAX": "1", "QUAYUTEC_CLAIMS_DB_POOL_MAX": "20"}),
)


async def create_scratch_database(admin_url: str) -> str:
    url = await create_database(admin_url)
    pool = await create_pool(url, min_size=1, max_size=1)
    try:
        await migrate(pool, (CLAIMS_COMPONENT,))
    finally:
        await pool.close()
    return url


async def run_workers(concurrency: int, seconds: float, work: Callable[[str, int], Awaitable[bool]]) -> float:
    """Runs ``concurrency`` loops of ``work(worker, n)`` for ``seconds``; returns successful calls/s."""
    prefix = uuid.uuid4().hex[:8]
    deadline = time.perf_counter() + seconds

    async def loop(worker: int) -> int:
        done = 0
        key = f"bench-{prefix}-{worker}"
        while time.perf_counter() < deadline:
            if not await work(key, done):
                raise RuntimeError(f"{key}/{done} was not claimed: pairs are distinct, every claim must win")
            done += 1
        return done

    start = time.perf_counter()
    counts = await asyncio.gather(*(loop(w) for w in range(concurrency)))
    return sum(counts) / (time.perf_counter() - start)


async def raw_rate(url: str, concurrency: int, seconds: float, *, statement_cache_size: int = 100) -> float:
    pool = await asyncpg.create_pool(url, min_size=1, max_size=RAW_POOL_MAX, statement_cache_size=statement_cache_size)
    try:

        async def insert(agent_id: str, n: int) -> bool:
            return await pool.fetchval(RAW_INSERT, agent_id, f"raw-{n}") is not None

        return await run_workers(concurrency, seconds, insert)
    finally:
        await pool.close()


def claims_channel(addr: str, identity: Identity | None) -> grpc.aio.Channel:
    """A channel to the Claims server: mutual TLS as ``identity``, or plaintext when None."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    if identity is None:
        return grpc.aio.insecure_channel(addr, options=options)
    return grpc.aio.secure_channel(
        addr, identity.channel_credentials(), options=[*options, ("grpc.ssl_target_name_override", "claims")]
    )


async def grpc_rate(addr: str, concurrency: int, seconds: float, identity: Identity | None) -> float:
    channels = [claims_channel(addr, identity) for _ in range(CHANNELS)]
    try:
        stubs = [claims_pb2_grpc.ClaimsServiceStub(c) for c in channels]

        async def claim(agent_id: str, n: int) -> bool:
            stub = stubs[hash(agent_id) % CHANNELS]
            request = claims_pb2.ClaimOnceRequest(agent_id=agent_id, wake_id=f"grpc-{n}")
            answer = await stub.ClaimOnce(request, timeout=30)
            return bool(answer.claimed)

        await run_workers(concurrency, min(0.5, seconds), claim)  # warm up channels and the server's pool
        return await run_workers(concurrency, seconds, claim)
    finally:
        for c in channels:
            await c.close()


async def coalesced_rate(addr: str, concurrency: int, seconds: float, identity: Identity | None) -> float:
    """Claims/s through the Runtime's coalescing client over ClaimMany, on one channel as the Runtime."""
    channel = claims_channel(addr, identity)
    client = ClaimsClient(claims_pb2_grpc.ClaimsServiceStub(channel))
    try:

        async def claim(agent_id: str, n: int) -> bool:
            request = claims_pb2.ClaimOnceRequest(agent_id=agent_id, wake_id=f"many-{n}", claimant=agent_id)
            answer = await client.ClaimOnce(request, timeout=30)
            return bool(answer.claimed)

        await run_workers(concurrency, min(0.5, seconds), claim)  # warm up the channel and the server's pool
        return await run_workers(concurrency, seconds, claim)
    finally:
        await client.close()
        await channel.close()


@contextmanager
def claims_process(url: str, variant: Variant, data_dir: Path) -> Iterator[str]:
    """A Claims server in its own process, with ``variant``'s settings; yields its address."""
    port = free_port()
    env = {
        **os.environ,
        **variant.env,
        "DATABASE_URL": url,
        "QUAYUTEC_CLAIMS_LISTEN": f"127.0.0.1:{port}",
        "QUAYUTEC_DATA_DIR": str(data_dir),
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    if os.environ.get("QY_BENCH_PROFILE"):
        command = [sys.executable, "-m", "cProfile", "-o", os.environ["QY_BENCH_PROFILE"], "-m", "services.claims"]
    elif variant.plaintext:
        command = [sys.executable, "-c", PLAINTEXT_SERVER]
    elif variant.uvloop:
        command = [sys.executable, "-c", "import uvloop; from services.claims.server import main; uvloop.run(main())"]
    else:
        command = [sys.executable, "-m", "services.claims"]
    log = tempfile.TemporaryFile("w+")
    processes = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log) for _ in range(variant.processes)]
    try:
        yield f"127.0.0.1:{port}"
    except BaseException:
        log.seek(0)
        print(f"Claims server log ({variant.name}):\n{log.read()[-4000:]}", file=sys.stderr)
        raise
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()


async def bench(
    url: str,
    concurrencies: list[int],
    seconds: float,
    variants: tuple[Variant, ...],
    data_dir: Path,
    *,
    coalesced: bool = True,
) -> Figures:
    # The machine may be shared: each gRPC figure is set beside a raw figure measured just before it.
    caches: list[tuple[int, float, float]] = []
    for c in concurrencies:
        caches.append((c, await raw_rate(url, c, seconds), await raw_rate(url, c, seconds, statement_cache_size=0)))
    rows: list[tuple[str, int, float, float]] = []
    ensure_dev_pki(data_dir / "pki")  # the bench is the admin tooling of its data folder
    for variant in variants:
        identity = None if variant.plaintext else load_identity("runtime", MtlsConfig.dev(data_dir / "pki"))
        with claims_process(url, variant, data_dir) as addr:
            await wait_serving(
                addr,
                limit=30.0,
                what=f"the Claims server at {addr}",
                internal=None if variant.plaintext else "claims",
                mtls=MtlsConfig.dev(data_dir / "pki"),
            )
            for c in concurrencies:
                raw = await raw_rate(url, c, seconds)
                rows.append(
                    (f"{variant.name}: ClaimOnce per call", c, await grpc_rate(addr, c, seconds, identity), raw)
                )
                if coalesced:
                    raw = await raw_rate(url, c, seconds)
                    rate = await coalesced_rate(addr, c, seconds, identity)
                    rows.append((f"{variant.name}: Runtime client, ClaimMany", c, rate, raw))
        print(f"  measured {variant.name}", file=sys.stderr, flush=True)

    print(f"\nClaims bench: {seconds:g} s per measurement, distinct pairs, {os.cpu_count()} CPUs")
    print(
        f"{'raw asyncpg INSERT ... ON CONFLICT':<36} {'conc':>5} {'cache on/s':>10} {'cache off/s':>11} {'off/on':>7}"
    )
    for c, on, off in caches:
        print(f"{'  statement_cache_size 100 vs 0':<36} {c:>5} {on:>10.0f} {off:>11.0f} {off / on:>7.2f}")
    print(f"\n{'gRPC (mTLS), server variant: client':<52} {'conc':>5} {'claims/s':>10} {'raw/s':>11} {'gRPC/raw':>8}")
    figures: Figures = {}
    for name, c, rate, raw in rows:
        print(f"{name:<52} {c:>5} {rate:>10.0f} {raw:>11.0f} {rate / raw:>8.2f}")
        figures[f"{name} c={c} claims/s"] = rate
        figures[f"{name} c={c} raw/s"] = raw
        figures[f"{name} c={c} gRPC/raw"] = rate / raw
    for c, on, off in caches:
        figures[f"raw statement cache off/on c={c}"] = off / on
    return figures


async def mtls_cost(url: str, concurrencies: list[int], seconds: float, data_dir: Path, rounds: int) -> Figures:
    """The same Claims server with mutual TLS and in plaintext, both running, measured in turns
    (mTLS, plaintext, mTLS, ...) so drift on a shared machine hits both alike; the median ratio."""
    pki = MtlsConfig.dev(data_dir / "pki")
    ensure_dev_pki(pki.pki_dir)  # the bench is the admin tooling of its data folder
    identity = load_identity("runtime", pki)
    rows: list[tuple[str, int, list[float]]] = []
    for base in DEFAULT_VARIANTS:
        plain = replace(base, name=f"{base.name}, plaintext", plaintext=True)
        with claims_process(url, base, data_dir) as tls_addr, claims_process(url, plain, data_dir) as plain_addr:
            await wait_serving(
                tls_addr, limit=30.0, what=f"the Claims server at {tls_addr}", internal="claims", mtls=pki
            )
            await wait_serving(plain_addr, limit=30.0, what=f"the plaintext Claims server at {plain_addr}")
            for c in concurrencies:
                ratios = []
                for _ in range(rounds):
                    with_tls = await grpc_rate(tls_addr, c, seconds, identity)
                    ratios.append(with_tls / await grpc_rate(plain_addr, c, seconds, None))
                rows.append((base.name, c, sorted(ratios)))
        print(f"  measured mTLS cost of {base.name}", file=sys.stderr, flush=True)
    print(f"\nmutual TLS vs plaintext: ClaimOnce/s ratio, {rounds} alternating rounds of {seconds:g} s")
    print(f"{'server variant':<36} {'conc':>5} {'median':>7} {'min':>6} {'max':>6}")
    figures: Figures = {}
    for name, c, ratios in rows:
        print(f"{name:<36} {c:>5} {statistics.median(ratios):>7.2f} {ratios[0]:>6.2f} {ratios[-1]:>6.2f}")
        figures[f"{name} c={c} mTLS/plaintext"] = statistics.median(ratios)
    return figures


async def amain(opts: argparse.Namespace) -> Figures:
    concurrencies = parse_concurrency(opts.concurrency)
    variants: tuple[Variant, ...] = DEFAULT_VARIANTS[:1] if opts.default_only else DEFAULT_VARIANTS
    variants += EXPERIMENT_VARIANTS if opts.experiments else ()
    with postgres_server() as admin_url, tempfile.TemporaryDirectory(prefix="qy-bench-claims-") as data_dir:
        url = await create_scratch_database(admin_url)
        try:
            if opts.mtls_cost:
                return await mtls_cost(url, concurrencies, opts.seconds, Path(data_dir), opts.rounds)
            return await bench(
                url, concurrencies, opts.seconds, variants, Path(data_dir), coalesced=not opts.no_coalesced
            )
        finally:
            await drop_database(admin_url, url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each measurement (default 3)")
    parser.add_argument("--concurrency", default="1,64", help="comma-separated concurrency levels (default 1,64)")
    parser.add_argument("--default-only", action="store_true", help="only the default server (not batch off)")
    parser.add_argument(
        "--no-coalesced", action="store_true", help="only ClaimOnce per call, not the Runtime's client over ClaimMany"
    )
    parser.add_argument("--experiments", action="store_true", help="also measure loop, pool and batch variants")
    parser.add_argument(
        "--mtls-cost",
        action="store_true",
        help="instead: the same server with mTLS and in plaintext, measured in turns; the mTLS/plaintext ratio",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per level with --mtls-cost")
    add_json_argument(parser)
    opts = parser.parse_args()
    raise SystemExit(run_main(amain, opts))


if __name__ == "__main__":
    main()
