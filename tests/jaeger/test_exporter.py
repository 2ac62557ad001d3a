"""Jaeger slow or gone never fails a wake: the four services as processes exporting through the
standard OTEL_* variables (tests.harness.traced_stack), first to a real Jaeger v2 stopped mid-load and
started again on the same ports, then to a "Jaeger" that accepts TCP connections and never answers.

Every wake is acted on once and its run succeeds; what the exporter could not send is counted
(quayutec.telemetry.spans_dropped{reason}, read here from an OTLP metrics receiver of the test) and
said in the services' logs; the queue stays within OTEL_BSP_MAX_QUEUE_SIZE (the gauge
quayutec.telemetry.spans_queued); export resumes when Jaeger is back; and each service stops on
SIGTERM within the bound docs/operations.md states. How fast the wakes go meanwhile is
bench/jaeger_gone.py's business: nothing here asserts on timing.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc

from quayutec.db import create_pool
from quayutec.ledger import run_id_for
from quayutec.settings import setting
from quayutec.spanqueue import DROPPED_METRIC, QUEUED_METRIC
from quayutec.v1 import common_pb2, gateway_pb2
from services.runtime.standin import StandinProvider
from services.stack import LocalStack
from tests.harness.jaeger import Jaeger, black_hole, jaeger_binary
from tests.harness.traced_stack import World, traced_stack, traced_world

BURST = 30
QUEUE = 64  # OTEL_BSP_MAX_QUEUE_SIZE here: small, so a burst overflows it
BATCH = 32
SHUTDOWN_SECONDS = 2.0
# docs/operations.md: a service stops within its GRACE_SECONDS (the gRPC drain) plus
# QUAYUTEC_TELEMETRY_SHUTDOWN_SECONDS plus about 2 s (the exporter's cancelled batch, the process exit).
STOP_BOUND = float(setting("QUAYUTEC_GATEWAY_GRACE_SECONDS").default or 0) + SHUTDOWN_SECONDS + 2.0
# Failsafe bounds of the polls below (not timings: a poll returns as soon as it sees what it waits for).
WAIT_LIMIT = 60.0
# Wakes posted after Jaeger is back, one after another, until one's trace arrives whole.
RESUME_ATTEMPTS = 8
DROPPED_LINE = re.compile(r"telemetry: (\d+) spans dropped \(([^)]*)\) in the last \d+ s, (\d+) since start")


def exporter_env(metrics_endpoint: str, **extra: str) -> dict[str, str]:
    """A small queue, our bounded shutdown, and metrics every 300 ms to the test's receiver."""
    return {
        "OTEL_BSP_MAX_QUEUE_SIZE": str(QUEUE),
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": str(BATCH),
        "QUAYUTEC_TELEMETRY_SHUTDOWN_SECONDS": str(SHUTDOWN_SECONDS),
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": metrics_endpoint,
        "OTEL_METRIC_EXPORT_INTERVAL": "300",
        **extra,
    }


class MetricsReceiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    """An OTLP/gRPC metrics receiver: the latest value of each of our telemetry metrics per service
    and attribute set, and every value the queue gauge ever had."""

    def __init__(self) -> None:
        self.latest: dict[tuple[str, str, tuple[tuple[str, str], ...]], int] = {}
        self.queued: list[tuple[str, int]] = []

    async def Export(
        self, request: metrics_service_pb2.ExportMetricsServiceRequest, context: Any
    ) -> metrics_service_pb2.ExportMetricsServiceResponse:
        for resource_metrics in request.resource_metrics:
            service = next(
                (kv.value.string_value for kv in resource_metrics.resource.attributes if kv.key == "service.name"), ""
            )
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.name not in (DROPPED_METRIC, QUEUED_METRIC):
                        continue
                    points = metric.sum.data_points if metric.HasField("sum") else metric.gauge.data_points
                    for point in points:
                        attrs = tuple(sorted((kv.key, kv.value.string_value) for kv in point.attributes))
                        value = int(point.as_int)
                        self.latest[(metric.name, service, attrs)] = value
                        if metric.name == QUEUED_METRIC:
                            self.queued.append((service, value))
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def dropped(self) -> dict[str, int]:
        """spans_dropped by reason, summed over the services (each a cumulative count)."""
        out: dict[str, int] = defaultdict(int)
        for (name, _service, attrs), value in self.latest.items():
            if name == DROPPED_METRIC:
                out[dict(attrs).get("reason", "")] += value
        return dict(out)


@asynccontextmanager
async def metrics_receiver() -> AsyncIterator[tuple[MetricsReceiver, str]]:
    receiver = MetricsReceiver()
    server = grpc.aio.server()
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(receiver, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield receiver, f"http://127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def burst(world: World, count: int, tag: str) -> list[str]:
    """``count`` posts mentioning the agent at once; the wake each made."""
    posted = await asyncio.gather(*(world.post(f"{tag} question {i}: what is the plan?") for i in range(count)))
    wakes = [w for p in posted for w in p.wake_ids]
    assert len(wakes) == count, f"{count} posts mentioning one agent made {len(wakes)} wakes"
    return wakes


async def assert_each_acted_on_once(world: World, pool: asyncpg.Pool, wakes: list[str]) -> list[common_pb2.Run]:
    """Every wake's run ended succeeded (GetRun), with one ledger row and one reply per wake."""
    runs = await asyncio.gather(*(world.ended(w) for w in wakes))
    succeeded = common_pb2.RUN_STATUS_SUCCEEDED
    failed = {r.run_id: common_pb2.RunStatus.Name(r.status) for r in runs if r.status != succeeded}
    assert not failed, f"runs that did not succeed: {failed}"
    rows = await pool.fetch(
        "SELECT wake_id, count(*) AS runs, count(*) FILTER (WHERE posted_message_id <> '') AS replies "
        "FROM runs WHERE wake_id = ANY($1::text[]) GROUP BY wake_id",
        wakes,
    )
    per_wake = {r["wake_id"]: (r["runs"], r["replies"]) for r in rows}
    assert per_wake == dict.fromkeys(wakes, (1, 1)), f"runs and replies per wake: {per_wake}"
    assert {r.run_id for r in runs} == {run_id_for(world.agent_id, w) for w in wakes}
    return list(runs)


def logs(stack: LocalStack) -> str:
    return "\n".join(
        (stack.log_dir / f"{name}.log").read_text(errors="replace")
        for name in ("gateway", "room", "claims", "runtime")
        if (stack.log_dir / f"{name}.log").exists()
    )


async def until(what: str, check: Any, limit: float = WAIT_LIMIT) -> Any:
    """Poll ``check()`` until it returns something true (bounded); that value."""
    deadline = time.monotonic() + limit
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen in {limit:g} s")
        await asyncio.sleep(0.2)


def dropped_lines(stack: LocalStack) -> list[tuple[int, dict[str, int], int]]:
    """Each "spans dropped" warning: its count, its counts by reason, the total since start."""
    found = []
    for m in DROPPED_LINE.finditer(logs(stack)):
        reasons = {part.split(" ")[0]: int(part.split(" ")[1]) for part in m.group(2).split(", ")}
        found.append((int(m.group(1)), reasons, int(m.group(3))))
    return found


async def has_trace(jaeger: Jaeger, trace_id: str, limit: float = 10.0) -> bool:
    """Whether Jaeger stores any span of ``trace_id`` within ``limit`` seconds (a failsafe bound)."""
    try:
        await jaeger.trace(trace_id, limit=limit)
    except AssertionError:
        return False
    return True


async def stop_each_within_bound(stack: LocalStack) -> dict[str, int]:
    """SIGTERM every service and wait for each to exit by itself, at most STOP_BOUND: the exit codes."""
    for proc in stack.procs.values():
        proc.send_signal(signal.SIGTERM)
    codes = {}
    for name, proc in stack.procs.items():
        try:
            codes[name] = await asyncio.to_thread(proc.wait, STOP_BOUND)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{name} still running {STOP_BOUND:g} s after SIGTERM (the documented bound):\n{logs(stack)[-3000:]}"
            ) from None
    return codes


@pytest.fixture
def own_jaeger() -> Iterator[Jaeger]:
    """A Jaeger of this test's own, to stop and start again on the same ports."""
    jaeger = Jaeger(jaeger_binary(), max_traces=1000)
    jaeger.start()
    try:
        yield jaeger
    finally:
        jaeger.stop()


async def test_wakes_succeed_while_jaeger_is_stopped_and_export_resumes_when_it_is_back(
    database_url: str, standin: StandinProvider, own_jaeger: Jaeger
) -> None:
    pool = await create_pool(database_url, min_size=1, max_size=2)
    try:
        async with (
            metrics_receiver() as (receiver, metrics_endpoint),
            traced_stack(
                database_url,
                standin,
                own_jaeger,
                extra_env=exporter_env(metrics_endpoint, OTEL_EXPORTER_OTLP_TIMEOUT="3"),
            ) as stack,
            traced_world(stack, standin) as world,
        ):
            # Exporting: a wake's trace reaches Jaeger.
            [first] = await burst(world, 1, "before")
            [run] = await assert_each_acted_on_once(world, pool, [first])
            assert run.trace_id
            await own_jaeger.trace(run.trace_id, until=lambda spans: any(s.name == "run" for s in spans))

            await asyncio.to_thread(own_jaeger.stop)  # the loop keeps serving the metrics receiver
            wakes = await burst(world, BURST, "stopped")
            await assert_each_acted_on_once(world, pool, wakes)

            # What could not be sent is said, and counted.
            lines = await until(
                "a 'spans dropped' warning naming a failed export",
                lambda: [line for line in dropped_lines(stack) if "export_failed" in line[1]],
            )
            assert all(count > 0 and total >= count for count, _, total in lines)
            assert "OTEL_BSP_MAX_QUEUE_SIZE=64" in logs(stack)
            dropped = await until("spans_dropped{export_failed}", lambda: receiver.dropped().get("export_failed"))
            assert dropped > 0
            assert receiver.queued and max(v for _, v in receiver.queued) <= QUEUE, receiver.queued

            # The same Jaeger again, on the same ports: the exporters send again (their backlog first:
            # a wake whose spans found a queue still full of it is not traced whole), and a new wake's
            # trace arrives whole: a wake after another until one does (bounded).
            await asyncio.to_thread(own_jaeger.start)
            names: set[str] = set()
            for attempt in range(RESUME_ATTEMPTS):
                [later] = await burst(world, 1, f"after-{attempt}")
                [run] = await assert_each_acted_on_once(world, pool, [later])
                spans = (
                    await own_jaeger.trace(
                        run.trace_id, until=lambda spans: {"deliver wake", "run"} <= {s.name for s in spans}, limit=10
                    )
                    if await has_trace(own_jaeger, run.trace_id)
                    else []
                )
                names = {s.name for s in spans}
                if {"deliver wake", "run"} <= names:
                    break
            assert {"deliver wake", "run"} <= names, f"no new wake's trace whole in Jaeger: last had {sorted(names)}"
            assert await until("'exporting spans ... again'", lambda: "telemetry: exporting spans to" in logs(stack))

            codes = await stop_each_within_bound(stack)
            assert codes == dict.fromkeys(codes, 0), codes
    finally:
        await pool.close()


async def test_wakes_succeed_against_a_jaeger_that_never_answers_and_the_queue_stays_bounded(
    database_url: str, standin: StandinProvider
) -> None:
    pool = await create_pool(database_url, min_size=1, max_size=2)
    try:
        with black_hole() as endpoint:
            async with (
                metrics_receiver() as (receiver, metrics_endpoint),
                # The exporter's own timeout stays the default (10 s a batch): a flush at shutdown
                # would take longer than the bound, so the bound is what ends it.
                traced_stack(database_url, standin, endpoint, extra_env=exporter_env(metrics_endpoint)) as stack,
                traced_world(stack, standin) as world,
            ):
                wakes = await burst(world, BURST, "hole")
                await assert_each_acted_on_once(world, pool, wakes)

                lines = await until(
                    "a 'spans dropped' warning naming a full queue",
                    lambda: [line for line in dropped_lines(stack) if "queue_full" in line[1]],
                )
                assert all(count > 0 for count, _, _ in lines)
                first = await until("spans_dropped{reason=queue_full}", lambda: receiver.dropped().get("queue_full"))

                # More load: the queue does not grow, the dropped count does.
                more = await burst(world, BURST, "hole-again")
                await assert_each_acted_on_once(world, pool, more)
                later = await until(
                    "spans_dropped{reason=queue_full} rising",
                    lambda: (n := receiver.dropped().get("queue_full", 0)) > first and n,
                )
                assert later > first
                assert receiver.queued and max(v for _, v in receiver.queued) <= QUEUE, receiver.queued
                assert any(v > 0 for _, v in receiver.queued), "the queue gauge never saw a span waiting"

                # Spans still queued (posts just made) while the exporter waits on the black hole: each
                # service stops within the bound all the same, and the ones that gave up say so.
                for i in range(3):
                    await world.acme.PostMessage(
                        gateway_pb2.PostMessageRequest(room_id=world.room_id, person="ana", body=f"note {i}")
                    )
                codes = await stop_each_within_bound(stack)
                assert codes == dict.fromkeys(codes, 0), (codes, logs(stack)[-6000:])
                assert "gave up exporting spans after" in logs(stack)
    finally:
        await pool.close()
