"""OpenTelemetry for the four services: providers, OTLP export, instrumentation, ids on spans, metrics.

``setup_telemetry`` runs once per process before any server, channel or pool exists (the gRPC
instrumentors patch their creation). When the standard ``OTEL_*`` variables name a trace exporter it
installs the gRPC, asyncpg and httpx instrumentations, so trace context flows through every hop and
each wake is one trace; with none, nothing is instrumented, recorded or exported (configure every
service the same way). Span attributes carry ids only: never a prompt, a reply or a key.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Decision, ParentBased, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind
from opentelemetry.util.types import Attributes

from quayutec.config import ConfigError
from quayutec.v1 import common_pb2, room_pb2

_log = logging.getLogger("quayutec.telemetry")

METER_NAME = "quayutec"
DELIVERY_TRACER = "quayutec.gateway.delivery"
RUN_TRACER = "quayutec.runtime.run"
# Attribute namespace for our ids; the only values of ours that go on spans.
ID_PREFIX = "quayutec."
# RPCs a loop sends every few hundred milliseconds: as the root of a trace they are not sampled,
# so an idle Gateway does not fill Jaeger with LeaseWakes traces (and the Room follows the flag).
QUIET_ROOT_SPANS = frozenset(
    {
        "/quayutec.v1.RoomService/LeaseWakes",
        "/quayutec.v1.RoomService/CountPendingWakes",
    }
)
# Services never traced: probes, reflection, and OTLP itself (a collector in-process, in tests).
_UNTRACED_SERVICE_PREFIXES = ("grpc.health.", "grpc.reflection.", "opentelemetry.proto.")
_TRUE = frozenset({"1", "true", "yes", "on"})


@dataclass(frozen=True)
class TelemetrySettings:
    """What ``setup_telemetry`` reads from the standard ``OTEL_*`` variables."""

    disabled: bool
    service_name: str
    resource_attributes: Mapping[str, str]
    traces_exporter: str  # "otlp", "console" or "none"
    traces_endpoint: str | None
    metrics_exporter: str  # "otlp", "console" or "none"
    metrics_endpoint: str | None

    @classmethod
    def from_env(cls, service_name: str, env: Mapping[str, str] | None = None) -> TelemetrySettings:
        env = os.environ if env is None else env
        general = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or None
        traces_endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip() or general
        metrics_endpoint = env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "").strip() or general
        return cls(
            disabled=env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE,
            service_name=env.get("OTEL_SERVICE_NAME", "").strip() or f"quayutec-{service_name}",
            resource_attributes=_parse_resource_attributes(env.get("OTEL_RESOURCE_ATTRIBUTES", "")),
            traces_exporter=_exporter_choice(env, "OTEL_TRACES_EXPORTER", traces_endpoint),
            traces_endpoint=traces_endpoint,
            metrics_exporter=_exporter_choice(env, "OTEL_METRICS_EXPORTER", metrics_endpoint),
            metrics_endpoint=metrics_endpoint,
        )


def _exporter_choice(env: Mapping[str, str], name: str, endpoint: str | None) -> str:
    """Explicit choice wins; unset means OTLP when an endpoint is set, otherwise nothing."""
    raw = env.get(name, "").strip().lower()
    if not raw:
        return "otlp" if endpoint else "none"
    if raw not in ("otlp", "console", "none"):
        raise ConfigError(f"{name} must be otlp, console or none, got {raw!r}")
    return raw


def _parse_resource_attributes(raw: str) -> dict[str, str]:
    attributes: dict[str, str] = {}
    for item in raw.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            attributes[unquote(key.strip())] = unquote(value.strip())
    return attributes


class _SwitchableProcessor(SpanProcessor):
    """The provider's one processor; delegates to a list that can grow and shrink (tests attach theirs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._delegates: tuple[SpanProcessor, ...] = ()

    def add(self, processor: SpanProcessor) -> None:
        with self._lock:
            self._delegates = (*self._delegates, processor)

    def remove(self, processor: SpanProcessor) -> None:
        with self._lock:
            self._delegates = tuple(p for p in self._delegates if p is not processor)

    def attached(self) -> bool:
        return bool(self._delegates)

    def on_start(self, span: Span, parent_context: otel_context.Context | None = None) -> None:
        for processor in self._delegates:
            processor.on_start(span, parent_context=parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        for processor in self._delegates:
            processor.on_end(span)

    def shutdown(self) -> None:
        for processor in self._delegates:
            processor.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return all(processor.force_flush(timeout_millis) for processor in self._delegates)


class _QuietPolling(Sampler):
    """Drops the root spans of polling RPCs (QUIET_ROOT_SPANS); everything else goes to ``inner``.

    While nothing would receive spans (no exporter, no processor), every span is dropped: trace ids
    are still made and propagated (the ledger records them), but no span is recorded, which keeps
    an unexported process as fast as an untraced one.
    """

    def __init__(self, inner: Sampler) -> None:
        self._inner = inner
        self._drop = SamplingResult(Decision.DROP)
        self.recording = False

    def should_sample(
        self,
        parent_context: otel_context.Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        if not self.recording:
            return self._drop
        if name in QUIET_ROOT_SPANS and not trace.get_current_span(parent_context).get_span_context().is_valid:
            return self._drop
        return self._inner.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"QuietPolling{{{self._inner.get_description()}}}"


def _env_sampler() -> Sampler:
    """The sampler OTEL_TRACES_SAMPLER names (parent-based always-on by default)."""
    try:
        from opentelemetry.sdk.trace.sampling import _get_from_env_or_default

        return _get_from_env_or_default()
    except Exception:  # pragma: no cover - private helper of the SDK; fall back to its default
        return ParentBased(ALWAYS_ON)


@dataclass
class Telemetry:
    """The process's providers; ``shutdown()`` flushes what is buffered and stops exporting."""

    settings: TelemetrySettings
    tracer_provider: TracerProvider | None
    meter_provider: MeterProvider | None
    _processors: _SwitchableProcessor = field(default_factory=_SwitchableProcessor)
    _sampler: _QuietPolling | None = None
    _shut_down: bool = False

    def add_span_processor(self, processor: SpanProcessor) -> Callable[[], None]:
        """Attach ``processor`` to every span from now on; returns a function that detaches it."""
        self._processors.add(processor)
        if self._sampler is not None:
            self._sampler.recording = True
        _instrument()

        def detach() -> None:
            # With nothing left to receive them, spans are dropped again (and runs record no trace id).
            self._processors.remove(processor)
            if self._sampler is not None and not self._processors.attached():
                self._sampler.recording = False

        return detach

    def force_flush(self, timeout_millis: int = 10_000) -> bool:
        ok = self.tracer_provider.force_flush(timeout_millis) if self.tracer_provider else True
        if self.meter_provider is not None:
            ok = self.meter_provider.force_flush(timeout_millis) and ok
        return ok

    def shutdown(self) -> None:
        """Flush and stop; safe to call twice."""
        if self._shut_down:
            return
        self._shut_down = True
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()


# OpenTelemetry's providers and instrumentations are process-wide, so their one owner is too.
_installed: Telemetry | None = None
_install_lock = threading.Lock()


def setup_telemetry(service_name: str, env: Mapping[str, str] | None = None) -> Telemetry:
    """Install tracing, metrics and instrumentation once per process; later calls return the first."""
    global _installed
    with _install_lock:
        if _installed is not None:
            return _installed
        settings = TelemetrySettings.from_env(service_name, env)
        telemetry = Telemetry(settings, None, None)
        if not settings.disabled:
            resource = Resource.create(
                {"service.namespace": "quayutec", **settings.resource_attributes, "service.name": settings.service_name}
            )
            telemetry._sampler = _QuietPolling(_env_sampler())
            telemetry.tracer_provider = TracerProvider(resource=resource, sampler=telemetry._sampler)
            telemetry.tracer_provider.add_span_processor(telemetry._processors)
            exporter = _span_exporter(settings)
            if exporter is not None:
                telemetry.add_span_processor(BatchSpanProcessor(exporter))
            trace.set_tracer_provider(telemetry.tracer_provider)
            reader = _metric_reader(settings)
            if reader is not None:
                telemetry.meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
                metrics.set_meter_provider(telemetry.meter_provider)
        _installed = telemetry
        _log.debug(
            "telemetry for %s: traces %s, metrics %s",
            settings.service_name,
            settings.traces_exporter,
            settings.metrics_exporter,
        )
        return telemetry


def _span_exporter(settings: TelemetrySettings) -> SpanExporter | None:
    if settings.traces_exporter == "console":
        return ConsoleSpanExporter()
    if settings.traces_exporter != "otlp":
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    # Headers, certificates, compression and timeout come from OTEL_EXPORTER_OTLP_* themselves.
    return OTLPSpanExporter(endpoint=settings.traces_endpoint)


def _metric_reader(settings: TelemetrySettings) -> MetricReader | None:
    if settings.metrics_exporter == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

        return PeriodicExportingMetricReader(ConsoleMetricExporter())
    if settings.metrics_exporter != "otlp":
        return None
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    # The export interval comes from OTEL_METRIC_EXPORT_INTERVAL (60 s by default).
    return PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=settings.metrics_endpoint))


def _untraced(details: Any) -> bool:
    method = details.method.decode() if isinstance(details.method, bytes) else str(details.method or "")
    return method.lstrip("/").startswith(_UNTRACED_SERVICE_PREFIXES)


def _traced(details: Any) -> bool:
    return not _untraced(details)


def _instrument() -> None:
    """gRPC aio server and client (context in metadata), asyncpg (statements, never parameters) and
    httpx; each once. Installed when something receives spans: without a receiver they are pure cost."""
    from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

    # No request or response hooks: message bodies never reach a span.
    instrumentors: list[Any] = [
        GrpcAioInstrumentorServer(filter_=_traced),  # type: ignore[no-untyped-call]
        GrpcAioInstrumentorClient(filter_=_traced),  # type: ignore[no-untyped-call]
        AsyncPGInstrumentor(capture_parameters=False),  # type: ignore[no-untyped-call]
        HTTPXClientInstrumentor(),
    ]
    for instrumentor in instrumentors:
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument()


@dataclass
class SpanCapture:
    """A span exporter attached to the process's tracer provider for one test."""

    telemetry: Telemetry
    processor: BatchSpanProcessor
    detach: Callable[[], None]

    def force_flush(self, timeout_millis: int = 10_000) -> bool:
        """Blocks until exported: from an event loop serving the receiver, call it in a thread."""
        return self.processor.force_flush(timeout_millis)

    def close(self) -> None:
        self.detach()
        self.processor.shutdown()  # type: ignore[no-untyped-call]


def configure_for_tests(span_exporter: SpanExporter, metric_reader: MetricReader | None = None) -> SpanCapture:
    """Install telemetry (exporting nothing by itself) and attach ``span_exporter`` through a
    BatchSpanProcessor; ``metric_reader`` becomes the global meter provider's, first call only."""
    telemetry = setup_telemetry("tests", env={})
    if telemetry.tracer_provider is None:
        raise RuntimeError("telemetry is disabled in this process")
    if metric_reader is not None:
        if telemetry.meter_provider is not None:
            raise RuntimeError("a meter provider is already installed; build Metrics on your own meter")
        telemetry.meter_provider = MeterProvider(
            resource=telemetry.tracer_provider.resource, metric_readers=[metric_reader]
        )
        metrics.set_meter_provider(telemetry.meter_provider)
    processor = BatchSpanProcessor(span_exporter, schedule_delay_millis=100)
    return SpanCapture(telemetry, processor, telemetry.add_span_processor(processor))


def annotate(
    span: trace.Span | None = None,
    *,
    company_id: str = "",
    agent_id: str = "",
    room_id: str = "",
    wake_id: str = "",
    run_id: str = "",
) -> None:
    """Put our ids on ``span`` (the current span by default) as ``quayutec.<name>``; empty ones are skipped."""
    target = span if span is not None else trace.get_current_span()
    ids = {"company_id": company_id, "agent_id": agent_id, "room_id": room_id, "wake_id": wake_id, "run_id": run_id}
    for name, value in ids.items():
        if value:
            target.set_attribute(ID_PREFIX + name, value)


# Got once: the SDK builds a new tracer on every get_tracer call (a few % of the Runtime's CPU when
# it was asked per run). These are proxies until a provider is installed, then use that provider's.
_DELIVERY = trace.get_tracer(DELIVERY_TRACER)
_RUN = trace.get_tracer(RUN_TRACER)


@contextmanager
def wake_delivery_span(wake: common_pb2.Wake) -> Iterator[trace.Span]:
    """The root span of one wake's trace ("deliver wake"): StartRun, the run and its calls hang under it."""
    current = trace.get_current_span().get_span_context()
    with _DELIVERY.start_as_current_span(
        "deliver wake",
        context=otel_context.Context(),  # a trace of its own, whatever the poll loop is inside
        kind=SpanKind.PRODUCER,
        links=[Link(current)] if current.is_valid else None,
        attributes={
            "quayutec.wake.kind": common_pb2.WakeKind.Name(wake.kind).removeprefix("WAKE_KIND_").lower(),
            "quayutec.wake.delivery_attempts": wake.delivery_attempts,
        },
        record_exception=False,
    ) as span:
        annotate(span, agent_id=wake.agent_id, room_id=wake.room_id, wake_id=wake.wake_id)
        yield span


@contextmanager
def run_span(*, run_id: str, agent_id: str = "", room_id: str = "", wake_id: str = "") -> Iterator[trace.Span]:
    """The span of one background run ("run"), a child of the StartRun that claimed it."""
    with _RUN.start_as_current_span("run", kind=SpanKind.INTERNAL) as span:
        annotate(span, agent_id=agent_id, room_id=room_id, wake_id=wake_id, run_id=run_id)
        yield span


def run_outcome(status: common_pb2.RunStatus.ValueType) -> str:
    """``RUN_STATUS_TIMED_OUT`` -> ``timed_out``: the outcome label of quayutec.runs.ended."""
    return common_pb2.RunStatus.Name(status).removeprefix("RUN_STATUS_").lower()


class Metrics:
    """Our instruments on meter "quayutec" (the global one by default; no-op until a provider exists).

    The wake gauges read the latest numbers given to ``set_wake_backlog``. OpenTelemetry keeps the
    callbacks of the first registration of a gauge name per meter, so create one Metrics per process.
    """

    def __init__(self, meter: Meter | None = None, *, observe_wakes: bool = False) -> None:
        self._own_meter = meter is not None
        meter = meter or metrics.get_meter(METER_NAME)
        self._observe_wakes = observe_wakes
        self._runs_started = meter.create_counter(
            "quayutec.runs.started", unit="{run}", description="Runs started after a granted claim"
        )
        self._runs_ended = meter.create_counter(
            "quayutec.runs.ended", unit="{run}", description="Runs ended, by outcome"
        )
        self._claims_refused = meter.create_counter(
            "quayutec.claims.refused", unit="{claim}", description="StartRun calls whose claim was refused"
        )
        self._runs_taken_over = meter.create_counter(
            "quayutec.runs.taken_over",
            unit="{run}",
            description="Runs that took a wake over whose claim's own run never read the room",
        )
        self._unrecorded_claims = meter.create_counter(
            "quayutec.wakes.unrecorded_claims",
            unit="{wake}",
            description="ALREADY_CLAIMED answers for a wake whose run has no ledger row (delivered again)",
        )
        self._model_requests = meter.create_counter(
            "quayutec.model.requests", unit="{request}", description="Model requests, by provider and error class"
        )
        self._lock = threading.Lock()
        self._pending: int | None = None
        self._lag_ms: int | None = None
        self._backlog_read_at: float | None = None
        if observe_wakes:
            meter.create_observable_gauge(
                "quayutec.wakes.pending",
                callbacks=[self._observe_pending],
                unit="{wake}",
                description="Wakes recorded and not yet delivered",
            )
            meter.create_observable_gauge(
                "quayutec.wakes.delivery_lag_ms",
                callbacks=[self._observe_lag],
                unit="ms",
                description="Age of the oldest pending wake",
            )

    def run_started(self) -> None:
        self._runs_started.add(1)

    def run_ended(self, outcome: str) -> None:
        self._runs_ended.add(1, {"outcome": outcome})

    def claim_refused(self) -> None:
        self._claims_refused.add(1)

    def run_taken_over(self) -> None:
        self._runs_taken_over.add(1)

    def unrecorded_claim(self) -> None:
        self._unrecorded_claims.add(1)

    def model_request(self, provider: str, error_class: str) -> None:
        self._model_requests.add(1, {"provider": provider, "error_class": error_class})

    def set_wake_backlog(self, pending: int, oldest_pending_age_ms: int) -> None:
        with self._lock:
            self._pending = pending
            self._lag_ms = oldest_pending_age_ms
            self._backlog_read_at = time.monotonic()

    async def refresh_wake_backlog(self, room: Any, *, rpc_timeout_seconds: float, every_seconds: float = 10.0) -> None:
        """Ask the Room (a RoomServiceStub) for the backlog at most every ``every_seconds``;
        a failure keeps the last numbers and is logged at debug level only."""
        if not self._exporting_backlog():
            return
        last = self._backlog_read_at
        if last is not None and time.monotonic() - last < every_seconds:
            return
        self._backlog_read_at = time.monotonic()
        try:
            counted = await room.CountPendingWakes(
                room_pb2.RoomServiceCountPendingWakesRequest(), timeout=rpc_timeout_seconds
            )
        except Exception as exc:
            _log.debug("counting pending wakes failed: %s", exc)
            return
        self.set_wake_backlog(int(counted.pending), int(counted.oldest_pending_age_ms))

    def _exporting_backlog(self) -> bool:
        """Only worth a Room call when the gauges exist and something reads them."""
        return self._observe_wakes and (self._own_meter or isinstance(metrics.get_meter_provider(), MeterProvider))

    def _observe_pending(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            return [] if self._pending is None else [Observation(self._pending)]

    def _observe_lag(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            return [] if self._lag_ms is None else [Observation(self._lag_ms)]
