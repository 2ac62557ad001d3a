"""Wakes with Jaeger slow or gone: post -> reply latency and wakes/s of the same bounded burst with
(a) no exporter, (b) exporting to a live Jaeger v2 (the baseline), (c) Jaeger stopped mid-run,
(d) a "Jaeger" that accepts connections and never answers; each as a ratio to (b) of the same round.

``python bench/jaeger_gone.py [--rounds 3] [--burst 30] [--bursts 3] [--json PATH]``

All four services run as processes on one PostgreSQL (``DATABASE_URL``'s server or an embedded one),
a fresh stack per scenario and round, exporting (b-d) with the standard OTEL_* variables and the
SDK's default queue and timeouts. Each measured burst posts ``--burst`` messages mentioning the agent
through the Gateway at once and waits for every reply; latency per wake = the reply's created_at
minus the posted message's (both stamped by PostgreSQL); wakes/s = the burst's wakes over the time
from its first post to its last reply. One unmeasured burst first. In (c) Jaeger is stopped while the
first measured burst is under way (and started again afterwards); in (d) the endpoint is a listening
socket of the bench that never accepts. The spans each scenario dropped are read from the services'
"spans dropped" warnings. The Jaeger binary is ``make jaeger-bin``'s (or QUAYUTEC_TEST_JAEGER_BIN).
First, the cost of the span processor's ``on_end`` (the SDK's BatchSpanProcessor alone and behind
quayutec.spanqueue.BoundedSpanQueue), in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

from bench.common import (
    BatchWatcher,
    Figures,
    add_json_argument,
    base_env,
    create_migrated_database,
    drop_database,
    percentile,
    post_mention,
    postgres_server,
    print_table,
    room_callers,
    run_main,
    running_stack,
    scratch_dir,
    standin_process,
    wait_for_room,
)
from bench.wakes import REPLIES_QUERY, GatewayWorld, make_gateway_world
from quayutec.db import create_pool
from quayutec.tls import GATEWAY
from tests.harness.jaeger import Jaeger, black_hole, jaeger_binary

SCENARIOS = ("no exporter", "live Jaeger", "Jaeger stopped", "black hole")
BASELINE = "live Jaeger"
ROOM_WAIT_SECONDS = 600.0
_DROPPED = re.compile(r"telemetry: \d+ spans dropped \([^)]*\) in the last \d+ s, (\d+) since start")


@dataclass
class Measured:
    scenario: str
    latency_ms: list[float] = field(default_factory=list)
    seconds: float = 0.0
    wakes: int = 0
    dropped: int = 0

    @property
    def rate(self) -> float:
        return self.wakes / self.seconds if self.seconds > 0 else float("nan")


def otel_env(endpoint: str | None) -> dict[str, str]:
    if endpoint is None:
        return {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none"}


async def one_burst(world: GatewayWorld, watcher: BatchWatcher, count: int, tag: str) -> tuple[list[float], float]:
    """``count`` posts at once, every reply awaited: latencies (ms) and the burst's seconds."""

    async def one(i: int) -> float:
        run_id, sent = await post_mention(world.client, world.room_id, world.agent_id, i, deadline=60)
        reply = await asyncio.wait_for(watcher.wait(run_id), timeout=120)
        return float((reply["created_at"] - sent).total_seconds() * 1000)

    started = time.perf_counter()
    latencies = await asyncio.gather(*(one(i) for i in range(count)))
    return list(latencies), time.perf_counter() - started


async def scenario(
    name: str,
    opts: argparse.Namespace,
    url: str,
    standin_url: str,
    data_dir: Path,
    jaeger: Jaeger,
) -> Measured:
    with black_hole() as hole:
        endpoint = {"no exporter": None, "black hole": hole}.get(name, jaeger.otlp_grpc)
        env = base_env(standin_url, data_dir)
        env.update(
            {
                "QUAYUTEC_GATEWAY_POST_RATE": "1000000",
                "QUAYUTEC_GATEWAY_POST_BURST": "1000000",
                "QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS": "0.05",
                "QUAYUTEC_RUNTIME_MAX_RUNS": str(2 * opts.burst + 16),
                **otel_env(endpoint),
            }
        )
        log_dir = data_dir / f"logs-{uuid.uuid4().hex[:6]}"
        pool = await create_pool(url, min_size=2, max_size=4)
        measured = Measured(name)
        try:
            async with running_stack(url, ("claims", "room", "runtime", "gateway"), env, log_dir) as stack:
                await wait_for_room(stack, ROOM_WAIT_SECONDS)
                async with room_callers(stack) as room, stack.channel("gateway", GATEWAY) as channel:
                    world = await make_gateway_world(room, pool, channel, uuid.uuid4().hex[:6])
                    with BatchWatcher(pool, REPLIES_QUERY, interval=0.002) as watcher:
                        await one_burst(world, watcher, opts.burst, "warmup")
                        for b in range(opts.bursts):
                            stopping = None
                            if name == "Jaeger stopped" and b == 0:
                                # Stopped while this burst is under way.
                                stopping = asyncio.get_running_loop().run_in_executor(None, jaeger.stop)
                            latencies, seconds = await one_burst(world, watcher, opts.burst, f"b{b}")
                            if stopping is not None:
                                await stopping
                            measured.latency_ms += latencies
                            measured.seconds += seconds
                            measured.wakes += len(latencies)
        finally:
            await pool.close()
            if name == "Jaeger stopped":
                jaeger.start()
        measured.dropped = dropped_spans(log_dir)
        return measured


def dropped_spans(log_dir: Path) -> int:
    """The spans the services said they dropped (each one's last "since start" count, summed)."""
    total = 0
    for log in log_dir.glob("*.log"):
        counts = [int(m.group(1)) for m in _DROPPED.finditer(log.read_text(errors="replace"))]
        total += max(counts, default=0)
    return total


def on_end_cost(rounds: int = 30, spans: int = 20_000) -> dict[str, float]:
    """Median ns per ``on_end`` of the SDK's BatchSpanProcessor and of BoundedSpanQueue around it,
    interleaved rounds (an exporter that takes everything; the worker never wakes meanwhile)."""
    os.environ["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] = str(spans)
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from quayutec.spanqueue import BoundedSpanQueue, SpanLosses

    class Null(SpanExporter):
        def export(self, batch: object) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    with TracerProvider().get_tracer("bench").start_as_current_span("ended") as span:
        pass

    def sdk() -> BatchSpanProcessor:
        return BatchSpanProcessor(Null(), max_queue_size=spans, schedule_delay_millis=1e8)

    def ours() -> BoundedSpanQueue:
        losses = SpanLosses(endpoint="bench", max_queue_size=spans, export_timeout_seconds=10)
        return BoundedSpanQueue(
            Null(), losses=losses, endpoint="bench", max_queue_size=spans, shutdown_seconds=1, schedule_delay_millis=1e8
        )

    makers: dict[str, Callable[[], BatchSpanProcessor | BoundedSpanQueue]] = {"SDK": sdk, "bounded": ours}
    times: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(rounds):
        for name, make in makers.items():
            processor = make()
            on_end = processor.on_end
            started = time.perf_counter()
            for _ in range(spans - 1):
                on_end(span)  # type: ignore[arg-type]
            times[name].append((time.perf_counter() - started) / (spans - 1) * 1e9)
            processor.shutdown()
    del os.environ["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"]
    return {name: statistics.median(values) for name, values in times.items()}


async def amain(opts: argparse.Namespace) -> Figures:
    started = time.monotonic()
    cost = on_end_cost()
    print(
        f"on_end: SDK BatchSpanProcessor {cost['SDK']:.0f} ns, behind BoundedSpanQueue {cost['bounded']:.0f} ns "
        f"(median of 30 interleaved rounds of 20000 spans)",
        file=sys.stderr,
    )
    rounds: list[dict[str, Measured]] = []
    jaeger = Jaeger(jaeger_binary(), max_traces=5000)
    jaeger.start()
    try:
        with (
            scratch_dir("qy-bench-jaeger-") as data_dir,
            standin_process() as standin_url,
            postgres_server() as admin_url,
        ):
            for r in range(opts.rounds):
                done: dict[str, Measured] = {}
                # Every other round runs the scenarios in the reverse order: on this machine a
                # scenario's place in the round moved its figures as much as the scenario did.
                for name in SCENARIOS if r % 2 == 0 else tuple(reversed(SCENARIOS)):
                    url = await create_migrated_database(admin_url)
                    try:
                        done[name] = await scenario(name, opts, url, standin_url, data_dir, jaeger)
                    finally:
                        await drop_database(admin_url, url)
                    m = done[name]
                    print(
                        f"  round {r + 1} {name}: {m.rate:.1f} wakes/s, p50 {percentile(m.latency_ms, 50):.0f} ms, "
                        f"{m.dropped} spans dropped",
                        file=sys.stderr,
                    )
                rounds.append(done)
    finally:
        jaeger.stop()
    return report(rounds, cost, opts, time.monotonic() - started)


def report(rounds: list[dict[str, Measured]], cost: dict[str, float], opts: argparse.Namespace, took: float) -> Figures:
    print(
        f"\nWakes with Jaeger slow or gone: {opts.bursts} bursts of {opts.burst} wakes posted at once per scenario, "
        f"{len(rounds)} rounds; ratios are to '{BASELINE}' of the same round.\n"
    )
    rows = []
    figures: Figures = {"on_end SDK ns": cost["SDK"], "on_end bounded ns": cost["bounded"]}
    ratios: dict[str, dict[str, list[float]]] = {n: {"p50": [], "p95": [], "rate": []} for n in SCENARIOS}
    for r, done in enumerate(rounds, 1):
        base = done[BASELINE]
        b50, b95 = percentile(base.latency_ms, 50), percentile(base.latency_ms, 95)
        for name in SCENARIOS:
            m = done[name]
            p50, p95 = percentile(m.latency_ms, 50), percentile(m.latency_ms, 95)
            ratios[name]["p50"].append(p50 / b50)
            ratios[name]["p95"].append(p95 / b95)
            ratios[name]["rate"].append(m.rate / base.rate)
            rows.append([r, name, m.wakes, m.rate, p50, p95, m.rate / base.rate, p50 / b50, p95 / b95, m.dropped])
    print_table(
        ["round", "scenario", "wakes", "wakes/s", "p50 ms", "p95 ms", "x rate", "x p50", "x p95", "spans dropped"],
        rows,
    )
    print(f"\nMedian over the rounds of each ratio to '{BASELINE}':\n")
    summary = []
    for name in SCENARIOS:
        med = {k: statistics.median(v) for k, v in ratios[name].items()}
        summary.append([name, med["rate"], med["p50"], med["p95"]])
        for k, v in med.items():
            figures[f"{name} / {BASELINE} {k}"] = v
    print_table(["scenario", "x wakes/s", "x p50", "x p95"], summary)
    print(f"\non_end per span: SDK {cost['SDK']:.0f} ns, bounded {cost['bounded']:.0f} ns")
    print(f"bench took {took:.0f} s")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the four scenarios (default 3)")
    parser.add_argument("--burst", type=int, default=30, help="wakes posted at once per burst (default 30)")
    parser.add_argument("--bursts", type=int, default=3, help="measured bursts per scenario (default 3)")
    add_json_argument(parser)
    return run_main(amain, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
