"""The "quayutec" instruments, read through an in-memory reader on a meter of the test's own."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from quayutec.telemetry import METER_NAME, Metrics, run_outcome
from quayutec.v1 import common_pb2, room_pb2_grpc
from tests.harness.channels import service_channel
from tests.harness.room import running_room


def _points(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], Any]]]:
    data = reader.get_metrics_data()
    found: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    if data is None:
        return found
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    found.setdefault(metric.name, []).append(
                        (dict(point.attributes or {}), getattr(point, "value", None))
                    )
    return found


def _metrics(*, observe_wakes: bool = False) -> tuple[Metrics, InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter(METER_NAME)
    return Metrics(meter, observe_wakes=observe_wakes), reader


def test_counters_carry_their_labels() -> None:
    metrics, reader = _metrics()
    metrics.run_started()
    metrics.run_started()
    metrics.run_ended(run_outcome(common_pb2.RUN_STATUS_SUCCEEDED))
    metrics.run_ended(run_outcome(common_pb2.RUN_STATUS_TIMED_OUT))
    metrics.claim_refused()
    metrics.run_taken_over()
    metrics.unrecorded_claim()
    metrics.unrecorded_claim()
    metrics.model_request("anthropic", "rate_limited")
    metrics.model_request("anthropic", "ok")
    metrics.model_request("anthropic", "ok")
    points = _points(reader)
    assert points["quayutec.runs.started"] == [({}, 2)]
    assert sorted(points["quayutec.runs.ended"], key=str) == [
        ({"outcome": "succeeded"}, 1),
        ({"outcome": "timed_out"}, 1),
    ]
    assert points["quayutec.claims.refused"] == [({}, 1)]
    assert points["quayutec.runs.taken_over"] == [({}, 1)]
    assert points["quayutec.wakes.unrecorded_claims"] == [({}, 2)]
    assert sorted(points["quayutec.model.requests"], key=str) == [
        ({"provider": "anthropic", "error_class": "ok"}, 2),
        ({"provider": "anthropic", "error_class": "rate_limited"}, 1),
    ]


def test_wake_gauges_report_the_latest_backlog_and_nothing_before() -> None:
    metrics, reader = _metrics(observe_wakes=True)
    assert "quayutec.wakes.pending" not in _points(reader)
    metrics.set_wake_backlog(7, 1500)
    metrics.set_wake_backlog(3, 250)
    points = _points(reader)
    assert points["quayutec.wakes.pending"] == [({}, 3)]
    assert points["quayutec.wakes.delivery_lag_ms"] == [({}, 250)]


async def test_the_backlog_is_read_from_the_room_at_most_every_interval(database_url: str) -> None:
    metrics, reader = _metrics(observe_wakes=True)
    async with running_room(database_url) as room_addr, service_channel(room_addr, "gateway") as channel:
        room = room_pb2_grpc.RoomServiceStub(channel)
        await metrics.refresh_wake_backlog(room, rpc_timeout_seconds=10.0, every_seconds=3600)
        assert _points(reader)["quayutec.wakes.pending"] == [({}, 0)]
        metrics.set_wake_backlog(5, 10)
        await metrics.refresh_wake_backlog(room, rpc_timeout_seconds=10.0, every_seconds=3600)
        assert _points(reader)["quayutec.wakes.pending"] == [({}, 5)]  # not asked again within the interval
        await metrics.refresh_wake_backlog(room, rpc_timeout_seconds=10.0, every_seconds=0)
        assert _points(reader)["quayutec.wakes.pending"] == [({}, 0)]


def test_the_operations_guide_lists_exactly_the_metrics_we_export_and_how_to_turn_them_on() -> None:
    """Issue 49: one list of metrics, true to the code (quayutec/); and since deploy/k8s turns metrics
    off, the guide says how to turn them on."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    # Every instrument of ours: made by name in quayutec/ (telemetry.py's Metrics), or named by a constant
    # (spanqueue.py's span counters).
    code = "".join(f.read_text() for f in sorted((repo / "quayutec").glob("*.py")))
    made = set(re.findall(r'create_\w+\(\s*"(quayutec\.[a-z_.]+)"', code))
    made |= set(re.findall(r'^[A-Z_]+_METRIC = "(quayutec\.[a-z_.]+)"', code, re.M))
    guide = (repo / "docs" / "operations.md").read_text()
    section = guide[guide.index("## What to monitor") :]
    section = section[: section.index("\n## ")]
    table = [line for line in section.splitlines() if line.startswith("| `quayutec.")]
    listed = {name for line in table for name in re.findall(r"`(quayutec\.[a-z_.]+)[`{]", line.split(" | ")[0])}
    assert len(made) >= 8 and listed == made
    assert not re.search(r"`quayutec\.(runs|claims|wakes)\.", (repo / "README.md").read_text())  # one list only
    configmap = (repo / "deploy" / "k8s" / "base" / "configmap.yaml").read_text()
    if re.search(r'OTEL_METRICS_EXPORTER: "none"', configmap):
        assert "set it to\n`otlp`" in section or "set it to `otlp`" in section
