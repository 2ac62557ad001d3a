"""OpenTelemetry for the four services: providers, OTLP export, instrumentation, ids on spans, metrics.

``setup_telemetry`` runs once per process before any server, channel or pool exists (the gRPC
instrumentors patch their creation). When the standard ``OTEL_*`` variables name a trace exporter it
installs the gRPC, asyncpg and httpx instrumentations, so trace context flows through every hop and
each wake is one trace; with none, nothing is instrumented, recorded or exported (configure every
service the same way). Span attributes carry ids only: never a prompt, a reply or a key.

Traces people can follow (docs/operations.md): a wake keeps the trace context of the span that
created it and its ``deliver wake`` span links to it; a continuation's run links to the span that
parked it, and its delivery to the decision or the expiry (``expiry_span``). A batched call
(``batch_span``) links to every wake it carries and each of them back to it. The Gateway's door
starts traces of its own: a caller's traceparent is a link (``_DoorTracer``). Housekeeping makes no
trace while idle: polling and housekeeping RPCs are not sampled as roots (but for
QUAYUTEC_HOUSEKEEPING_TRACE_RATIO of them), a database span without a parent is never recorded, and
a housekeeping pass that changed something is recorded afterwards as a span of its own.
Attribute names follow the stable semantic conventions: the instrumentations' own opt-in
(OTEL_SEMCONV_STABILITY_OPT_IN, ``http,database`` unless set) and, for gRPC, whose instrumentation has
none, the stable RPC names, types and span names written at the end of each span
(``stable_conventions``, which also names database spans by their named query).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import grpc
from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanContext, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

from quayutec.config import ConfigError, env_bool, env_float, env_int
from quayutec.settings import setting
from quayutec.spanqueue import BoundedSpanQueue, SpanLosses
from quayutec.sql import query_name
from quayutec.v1 import common_pb2, room_pb2

_log = logging.getLogger("quayutec.telemetry")

METER_NAME = "quayutec"
DELIVERY_TRACER = "quayutec.gateway.delivery"
RUN_TRACER = "quayutec.runtime.run"
# Attribute namespace for our ids; the only values of ours that go on spans.
ID_PREFIX = "quayutec."
# RPCs a loop sends every few hundred milliseconds or seconds: as the root of a trace they are not
# sampled (but for QUAYUTEC_HOUSEKEEPING_TRACE_RATIO of them), so an idle stack does not fill Jaeger
# with polls and housekeeping (and the Room follows the flag). A pass that acted is recorded after the
# fact (``record_housekeeping``).
QUIET_ROOT_SPANS = frozenset(
    {
        "/quayutec.v1.RoomService/LeaseWakes",
        "/quayutec.v1.RoomService/CountPendingWakes",
        "/quayutec.v1.RoomService/ExpireWaitpoints",
        "/quayutec.v1.RoomService/AbandonStaleRuns",
        "/quayutec.v1.RoomService/RecordNotStartedRuns",
    }
)
HOUSEKEEPING_TRACER = "quayutec.housekeeping"
# The Python distribution whose version is the resource's service.version.
DISTRIBUTION = "quayutec-rooms"
# The instrumentations' stable-conventions opt-in, unless the operator sets OTEL_SEMCONV_STABILITY_OPT_IN.
SEMCONV_OPT_IN = "OTEL_SEMCONV_STABILITY_OPT_IN"
# gRPC's instrumentation has no opt-in: its pre-stable attribute names become the stable ones (or go).
_GRPC_STABLE_NAMES: Mapping[str, str | None] = {
    "net.peer.ip": "network.peer.address",
    "net.peer.port": "network.peer.port",
    "net.peer.name": None,  # "localhost" on a Unix socket: network.peer.address says it
    "rpc.user_agent": "user_agent.original",
}
# The pre-stable gRPC names the stable ones replace (rpc.service and rpc.method become one rpc.method).
_GRPC_PRE_STABLE = frozenset({"rpc.system", "rpc.service", "rpc.method", "rpc.grpc.status_code"})
_GRPC_CODE_NAMES: Mapping[int, str] = {code.value[0]: code.name for code in grpc.StatusCode}
# Answers a caller is expected to get now and then: span status and ``error.type``, no exception
# event with a stack trace. Server errors (UNKNOWN, INTERNAL, UNAVAILABLE, DEADLINE_EXCEEDED,
# UNIMPLEMENTED, DATA_LOSS) keep theirs.
EXPECTED_REFUSALS = frozenset(
    {
        "CANCELLED",
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNAUTHENTICATED",
    }
)
# The services whose calls come from outside (the Gateway's door): an incoming traceparent is a link.
DOOR_SERVICES = ("quayutec.v1.GatewayService", "lf.a2a.v1.A2AService")
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
    # The fraction of idle polling and housekeeping RPCs traced as roots of their own (0: none).
    housekeeping_ratio: float = 0.0
    # Whether an incoming traceparent at the Gateway's door is the parent of its span (else a link).
    trust_caller_trace: bool = False
    # Most spans waiting for export (OTEL_BSP_MAX_QUEUE_SIZE), one export's time (OTEL_EXPORTER_OTLP_TIMEOUT,
    # in seconds as this SDK reads it), and the longest spent exporting at shutdown.
    max_queue_size: int = 2048
    export_timeout_seconds: float = 10.0
    shutdown_seconds: float = 5.0

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
            housekeeping_ratio=_housekeeping_ratio(env),
            trust_caller_trace=env_bool(env, setting("QUAYUTEC_GATEWAY_TRUST_TRACEPARENT")),
            max_queue_size=env_int(env, setting("OTEL_BSP_MAX_QUEUE_SIZE"), minimum=1),
            export_timeout_seconds=env_float(env, setting("OTEL_EXPORTER_OTLP_TIMEOUT")),
            shutdown_seconds=env_float(env, setting("QUAYUTEC_TELEMETRY_SHUTDOWN_SECONDS")),
        )


def _housekeeping_ratio(env: Mapping[str, str]) -> float:
    name = "QUAYUTEC_HOUSEKEEPING_TRACE_RATIO"
    ratio = env_float(env, setting(name), minimum=0.0)
    if ratio > 1.0:
        raise ConfigError(f"{name} must be between 0 and 1, got {ratio:g}")
    return ratio


def service_version() -> str:
    """The installed package's version (service.version), or "unknown" when run from an uninstalled tree."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


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
        delegates = self._delegates
        if not delegates:
            return
        span = stable_conventions(span)
        for processor in delegates:
            processor.on_end(span)

    def shutdown(self) -> None:
        for processor in self._delegates:
            processor.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return all(processor.force_flush(timeout_millis) for processor in self._delegates)


def stable_conventions(span: ReadableSpan) -> ReadableSpan:
    """A gRPC span with the stable RPC conventions: span name ``pkg.Service/Method`` (no leading
    slash), ``rpc.system.name``, ``rpc.method`` fully qualified, ``rpc.response.status_code`` as the
    code's name (``error.type`` too when not OK), ``network.peer.port`` an int; an expected refusal
    (EXPECTED_REFUSALS) keeps its status and attributes but no exception event. Any other span as it is."""
    attributes = span.attributes or {}
    if attributes.get("rpc.system") != "grpc":
        if "db.system.name" in attributes:
            return _named_query(span, attributes)
        return span
    renamed: dict[str, Any] = {"rpc.system.name": "grpc", "rpc.method": span.name.lstrip("/")}
    for key, value in attributes.items():
        if key in _GRPC_PRE_STABLE:
            continue
        if key in _GRPC_STABLE_NAMES:
            new = _GRPC_STABLE_NAMES[key]
            if new is not None:
                renamed.setdefault(new, value)
        else:
            renamed[key] = value
    if "network.peer.port" in renamed:
        try:
            renamed["network.peer.port"] = int(renamed["network.peer.port"])
        except (TypeError, ValueError):
            del renamed["network.peer.port"]
    code = _GRPC_CODE_NAMES.get(attributes.get("rpc.grpc.status_code"), "UNKNOWN")  # type: ignore[arg-type]
    if code == "OK" and not span.status.is_ok:
        code = "UNKNOWN"  # an exception the servicer did not map: gRPC answers UNKNOWN
    renamed["rpc.response.status_code"] = code
    events = span.events
    if code != "OK":
        renamed.setdefault("error.type", code)
        if code in EXPECTED_REFUSALS:
            events = tuple(event for event in events if event.name != "exception")
    return ReadableSpan(
        name=span.name.lstrip("/"),
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=renamed,
        events=events,
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


def _named_query(span: ReadableSpan, attributes: Mapping[str, Any]) -> ReadableSpan:
    """A database span named by the named query it sent (``room/post_check``, also its
    ``db.query.summary``), or by its keyword for a transaction's ``BEGIN;``/``COMMIT;``/``ROLLBACK;``."""
    text = attributes.get("db.query.text")
    name = query_name(text) if isinstance(text, str) else None
    if name is None:
        if span.name.rstrip(";") == span.name:
            return span
        name = span.name.rstrip(";").upper()
    return ReadableSpan(
        name=name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes={**attributes, "db.query.summary": name},
        events=span.events,
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


class _QuietPolling(Sampler):
    """Drops the root spans of polling and housekeeping RPCs (QUIET_ROOT_SPANS; ``ratio`` of them are
    kept) and every database span without a parent (LISTEN, the cleanup loops); everything else
    goes to ``inner``.

    While nothing would receive spans (no exporter, no processor), every span is dropped: trace ids
    are still made and propagated (the ledger records them), but no span is recorded, which keeps
    an unexported process as fast as an untraced one.
    """

    def __init__(self, inner: Sampler, ratio: float = 0.0) -> None:
        self._inner = inner
        self._quiet = TraceIdRatioBased(ratio) if ratio > 0 else None
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
        if not trace.get_current_span(parent_context).get_span_context().is_valid:
            if attributes and ("db.system" in attributes or "db.system.name" in attributes):
                return self._drop  # a database span of no call: a loop's query, never a trace of its own
            if name in QUIET_ROOT_SPANS:
                if self._quiet is None:
                    return self._drop
                return self._quiet.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)
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
        _instrument(self.settings.trust_caller_trace)

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
        """Flush and stop within QUAYUTEC_TELEMETRY_SHUTDOWN_SECONDS (spans, then metrics in what is
        left of it, each given up when the collector does not take them in time); safe to call twice."""
        if self._shut_down:
            return
        self._shut_down = True
        seconds = self.settings.shutdown_seconds
        deadline = time.monotonic() + seconds
        meters: threading.Thread | None = None
        if self.meter_provider is not None:  # its last export, beside the spans' flush
            meters = threading.Thread(
                target=_shutdown_meters,
                args=(self.meter_provider, seconds),
                name="quayutec-metrics-shutdown",
                daemon=True,
            )
            meters.start()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()  # each BoundedSpanQueue keeps to shutdown_seconds
        if meters is not None:
            meters.join(max(0.0, deadline - time.monotonic()))


def _shutdown_meters(provider: MeterProvider, seconds: float) -> None:
    try:
        provider.shutdown(timeout_millis=seconds * 1000)
    except Exception as exc:  # the SDK raises when a reader's last export did not finish in time
        _log.warning(
            "telemetry: the last metrics export did not finish within QUAYUTEC_TELEMETRY_SHUTDOWN_SECONDS=%g: %s",
            seconds,
            str(exc).replace("\n", " "),
        )


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
                {
                    "service.namespace": "quayutec",
                    "service.version": service_version(),
                    **settings.resource_attributes,
                    "service.name": settings.service_name,
                }
            )
            telemetry._sampler = _QuietPolling(_env_sampler(), settings.housekeeping_ratio)
            telemetry.tracer_provider = TracerProvider(
                resource=resource, sampler=telemetry._sampler, span_limits=_span_limits(env)
            )
            telemetry.tracer_provider.add_span_processor(telemetry._processors)
            exporter = _span_exporter(settings)
            if exporter is not None:
                telemetry.add_span_processor(export_queue(exporter, settings))
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


def export_queue(exporter: SpanExporter, settings: TelemetrySettings) -> BoundedSpanQueue:
    """The batch span processor in front of ``exporter``: its queue bounded by OTEL_BSP_MAX_QUEUE_SIZE,
    every span lost counted in quayutec.telemetry.spans_dropped{reason} and a warning, its shutdown
    bounded (quayutec.spanqueue)."""
    endpoint = settings.traces_endpoint or settings.traces_exporter
    losses = SpanLosses(
        endpoint=endpoint,
        max_queue_size=settings.max_queue_size,
        export_timeout_seconds=settings.export_timeout_seconds,
    )
    try:
        return BoundedSpanQueue(
            exporter,
            losses=losses,
            endpoint=endpoint,
            max_queue_size=settings.max_queue_size,
            shutdown_seconds=settings.shutdown_seconds,
        )
    except ValueError as exc:  # the SDK's own check of its OTEL_BSP_* values
        raise ConfigError(
            f"OTEL_BSP_MAX_QUEUE_SIZE={settings.max_queue_size} with the other OTEL_BSP_* settings: {exc} "
            "(set OTEL_BSP_MAX_EXPORT_BATCH_SIZE at most OTEL_BSP_MAX_QUEUE_SIZE)"
        ) from None


def _span_limits(env: Mapping[str, str] | None) -> SpanLimits:
    """The SDK's limits (from OTEL_SPAN_*), but room for a link per item of our largest batch."""
    env = os.environ if env is None else env
    return SpanLimits(max_links=None if env.get(setting("OTEL_SPAN_LINK_COUNT_LIMIT").name) else MAX_LINKS)


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


def _instrument(trust_caller_trace: bool = False) -> None:
    """gRPC aio server and client (context in metadata), asyncpg (statements, never parameters) and
    httpx; each once. Installed when something receives spans: without a receiver they are pure cost.
    The gRPC server's spans come from ``_DoorTracerProvider`` (the Gateway's door decides its own
    traces) and each gRPC client span is told its server's address (``_ServerAddress``)."""
    # Read once, by the first instrumentation that asks: set before any is imported and installed.
    os.environ.setdefault(SEMCONV_OPT_IN, str(setting(SEMCONV_OPT_IN).default))
    from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

    # No request or response hooks: message bodies never reach a span.
    server = GrpcAioInstrumentorServer(filter_=_traced)  # type: ignore[no-untyped-call]
    if not server.is_instrumented_by_opentelemetry:
        server.instrument(tracer_provider=_DoorTracerProvider(trust_caller_trace))
    client = GrpcAioInstrumentorClient(filter_=_traced)  # type: ignore[no-untyped-call]
    if not client.is_instrumented_by_opentelemetry:
        client.instrument()
        _tell_client_spans_their_server()
    instrumentors: list[Any] = [
        AsyncPGInstrumentor(capture_parameters=False),  # type: ignore[no-untyped-call]
        HTTPXClientInstrumentor(),
    ]
    for instrumentor in instrumentors:
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument()


class _DoorTracerProvider(trace.TracerProvider):
    """The gRPC server instrumentation's tracers: the installed provider's, behind ``_DoorTracer``."""

    def __init__(self, trust_caller_trace: bool) -> None:
        self._trust = trust_caller_trace

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: Attributes | None = None,
    ) -> trace.Tracer:
        inner = trace.get_tracer_provider().get_tracer(
            instrumenting_module_name, instrumenting_library_version, schema_url, attributes
        )
        return _DoorTracer(inner, self._trust)


class _DoorTracer(trace.Tracer):
    """Server spans of the Gateway's door (DOOR_SERVICES) start a trace of ours: a caller's
    traceparent becomes a link to its span (its trace id in ``quayutec.caller.trace_id``) and our
    sampler decides, so a caller's flags never switch our tracing off and its span, which we never
    receive, is never our span's missing parent. Unless the operator trusts callers' contexts."""

    def __init__(self, inner: trace.Tracer, trust_caller_trace: bool) -> None:
        self._inner = inner
        self._trust = trust_caller_trace

    def start_span(
        self, name: str, context: otel_context.Context | None = None, *args: Any, **kwargs: Any
    ) -> trace.Span:
        return self._inner.start_span(name, context, *args, **kwargs)

    @contextmanager
    def start_as_current_span(  # type: ignore[override]
        self,
        name: str,
        context: otel_context.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        **kwargs: Any,
    ) -> Iterator[trace.Span]:
        caller = trace.get_current_span(context).get_span_context()
        if not self._trust and caller.is_valid and caller.is_remote and name.lstrip("/").startswith(DOOR_SERVICES):
            context = otel_context.Context()
            links = [*(links or ()), Link(caller, {f"{ID_PREFIX}link": "caller"})]
            attributes = {**(attributes or {}), f"{ID_PREFIX}caller.trace_id": trace.format_trace_id(caller.trace_id)}
        with self._inner.start_as_current_span(
            name, context=context, kind=kind, attributes=attributes, links=links, **kwargs
        ) as span:
            yield span


def _server_of(target: str) -> tuple[str, int | None]:
    """``server.address`` and ``server.port`` of a channel target (``host:port``, ``[::1]:port``,
    ``dns:///host:port``, ``unix:/path``)."""
    if target.startswith(("unix:", "unix-abstract:")):
        return target.split(":", 1)[1], None
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        target = target.removeprefix(scheme)
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or (host.count(":") and not host.startswith("[")):
        return target.strip("[]"), None
    return host.strip("[]"), int(port)


class _ServerAddress(
    grpc.aio.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.aio.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.aio.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.aio.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """Runs inside the instrumentation's client span (the last interceptor of a channel): puts the
    channel's ``server.address`` and ``server.port`` on it."""

    def __init__(self, target: str) -> None:
        address, port = _server_of(target)
        self._attributes: dict[str, Any] = {"server.address": address}
        if port is not None:
            self._attributes["server.port"] = port

    def _mark(self) -> None:
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes(self._attributes)

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        self._mark()
        return await continuation(client_call_details, request)

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        self._mark()
        return await continuation(client_call_details, request)

    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        self._mark()
        return await continuation(client_call_details, request_iterator)

    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        self._mark()
        return await continuation(client_call_details, request_iterator)


def _tell_client_spans_their_server() -> None:
    """Wrap the instrumented channel factories so each channel's last interceptor is ``_ServerAddress``."""
    for name in ("insecure_channel", "secure_channel"):
        instrumented = getattr(grpc.aio, name)

        def channel(target: str, *args: Any, _instrumented: Any = instrumented, **kwargs: Any) -> Any:
            kwargs["interceptors"] = [*(kwargs.get("interceptors") or ()), _ServerAddress(target)]
            return _instrumented(target, *args, **kwargs)

        setattr(grpc.aio, name, channel)


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
    message_id: str = "",
    task_id: str = "",
    wake_ids: Sequence[str] = (),
) -> None:
    """Put our ids on ``span`` (the current span by default) as ``quayutec.<name>`` (a list of ids:
    ``quayutec.<name>s``, at most BATCH_IDS_NAMED of them); empty ones are skipped."""
    target = span if span is not None else trace.get_current_span()
    if not target.is_recording():
        return
    ids = {
        "company_id": company_id,
        "agent_id": agent_id,
        "room_id": room_id,
        "wake_id": wake_id,
        "run_id": run_id,
        "message_id": message_id,
        "task_id": task_id,
    }
    for name, value in ids.items():
        if value:
            target.set_attribute(ID_PREFIX + name, value)
    if wake_ids:
        target.set_attribute(ID_PREFIX + "wake_ids", list(wake_ids[:BATCH_IDS_NAMED]))


_tracecontext = TraceContextTextMapPropagator()


def current_traceparent() -> str:
    """The W3C traceparent of the current span when it is recorded and sampled, else "": what a row
    created under it (a wake, a waitpoint) keeps so a later span can link back to it."""
    span = trace.get_current_span()
    ctx = span.get_span_context()
    if not (ctx.is_valid and ctx.trace_flags.sampled and span.is_recording()):
        return ""
    carrier: dict[str, str] = {}
    _tracecontext.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def link_to(traceparent: str) -> Link | None:
    """A span link to the span ``traceparent`` names; None for an empty or malformed one."""
    if not traceparent:
        return None
    extracted = _tracecontext.extract({"traceparent": traceparent}, context=otel_context.Context())
    ctx: SpanContext = trace.get_current_span(extracted).get_span_context()
    return Link(ctx) if ctx.is_valid else None


# Got once: the SDK builds a new tracer on every get_tracer call (a few % of the Runtime's CPU when
# it was asked per run). These are proxies until a provider is installed, then use that provider's.
_DELIVERY = trace.get_tracer(DELIVERY_TRACER)
_RUN = trace.get_tracer(RUN_TRACER)


@contextmanager
def wake_delivery_span(wake: common_pb2.Wake) -> Iterator[trace.Span]:
    """The root span of one wake's trace ("deliver wake"): StartRun, the run and its calls hang under
    it. It links to the span whose transaction made the wake (the post, task, decision or expiry)."""
    created_by = link_to(wake.traceparent)
    links = [created_by] if created_by is not None else []
    with _DELIVERY.start_as_current_span(
        "deliver wake",
        context=otel_context.Context(),  # a trace of its own, whatever the poll loop is inside
        kind=SpanKind.PRODUCER,
        links=links or None,
        attributes={
            "quayutec.wake.kind": common_pb2.WakeKind.Name(wake.kind).removeprefix("WAKE_KIND_").lower(),
            "quayutec.wake.delivery_attempts": wake.delivery_attempts,
        },
        record_exception=False,
    ) as span:
        annotate(span, agent_id=wake.agent_id, room_id=wake.room_id, wake_id=wake.wake_id)
        yield span


# Most ids a batched call's span names (``quayutec.batch.size`` gives the count; its links reach all).
BATCH_IDS_NAMED = 100
# Most links one span keeps (the SDK's default, 128, is less than our largest batches).
MAX_LINKS = 1000
BATCH_TRACER = "quayutec.batch"
_BATCH = trace.get_tracer(BATCH_TRACER)


@contextmanager
def batch_span(
    name: str, contexts: Sequence[otel_context.Context], *, wake_ids: Sequence[str] = (), run_ids: Sequence[str] = ()
) -> Iterator[trace.Span]:
    """The span of one batched call (``name``; the call's client span is its child), current while
    it lasts: in the trace of the first item submitted from a recorded span, linked to the span every
    item was submitted from, naming the items' wakes and runs (at most BATCH_IDS_NAMED of each). So
    each wake's trace reaches the call that carried it, whichever item went first."""
    links: list[Link] = []
    callers: list[trace.Span] = []
    seen: set[tuple[int, int]] = set()
    parent = contexts[0] if contexts else otel_context.Context()
    chosen = False
    for ctx in contexts:
        span = trace.get_current_span(ctx)
        sc = span.get_span_context()
        if not sc.is_valid or (sc.trace_id, sc.span_id) in seen:
            continue
        seen.add((sc.trace_id, sc.span_id))
        links.append(Link(sc))
        if not chosen and span.is_recording():
            parent, chosen = ctx, True
        elif span.is_recording():
            callers.append(span)
    attributes: dict[str, Any] = {f"{ID_PREFIX}batch.size": len(contexts)}
    if wake_ids:
        attributes[f"{ID_PREFIX}wake_ids"] = [w for w in wake_ids[:BATCH_IDS_NAMED] if w]
    if run_ids:
        attributes[f"{ID_PREFIX}run_ids"] = [r for r in run_ids[:BATCH_IDS_NAMED] if r]
    with _BATCH.start_as_current_span(
        name, context=parent, kind=SpanKind.INTERNAL, links=links[:MAX_LINKS] or None, attributes=attributes
    ) as span:
        # And back: each other caller's span (still open, it awaits the call) links to the call's span,
        # so the wake's own trace shows the call that carried it.
        for caller in callers:
            caller.add_link(span.get_span_context(), {f"{ID_PREFIX}link": "batch"})
        yield span


@contextmanager
def run_span(
    *, run_id: str, agent_id: str = "", room_id: str = "", wake_id: str = "", continues: str = ""
) -> Iterator[trace.Span]:
    """The span of one background run ("run"), a child of the StartRun that claimed it. A
    continuation names in ``continues`` the traceparent of the span that parked the run: linked."""
    parked = link_to(continues)
    with _RUN.start_as_current_span(
        "run", kind=SpanKind.INTERNAL, links=[parked] if parked is not None else None
    ) as span:
        annotate(span, agent_id=agent_id, room_id=room_id, wake_id=wake_id, run_id=run_id)
        yield span


_HOUSEKEEPING = trace.get_tracer(HOUSEKEEPING_TRACER)


def record_housekeeping(name: str, started_ns: int, counts: Mapping[str, int], *, run_ids: Sequence[str] = ()) -> None:
    """A housekeeping pass that changed something, recorded after the fact as a trace of its own
    (``name``, from ``started_ns`` to now, each count as ``quayutec.housekeeping.<key>``, the runs it
    touched as ``quayutec.run_ids``); a pass that changed nothing records nothing. Its calls were not
    traced (QUIET_ROOT_SPANS)."""
    if not any(counts.values()):
        return
    attributes: dict[str, Any] = {f"{ID_PREFIX}housekeeping.{key}": value for key, value in counts.items()}
    if run_ids:
        attributes[f"{ID_PREFIX}run_ids"] = list(run_ids[:BATCH_IDS_NAMED])
    span = _HOUSEKEEPING.start_span(
        name, context=otel_context.Context(), kind=SpanKind.INTERNAL, start_time=started_ns, attributes=attributes
    )
    span.end()


@contextmanager
def expiry_span(run_ids: Sequence[str], parked: Sequence[str]) -> Iterator[trace.Span]:
    """The span of one expiry of approvals ("expire approvals"), a trace of its own, current while
    it lasts: linked to the span that parked each run (``parked``: their traceparents), naming the
    runs (at most BATCH_IDS_NAMED). The decision wakes it writes keep its trace context, so each
    continuation's delivery links to it. Started only when something expires: idle passes make none."""
    links = [link for link in map(link_to, parked) if link is not None]
    with _HOUSEKEEPING.start_as_current_span(
        "expire approvals",
        context=otel_context.Context(),
        kind=SpanKind.INTERNAL,
        links=links[:MAX_LINKS] or None,
        attributes={f"{ID_PREFIX}run_ids": list(run_ids[:BATCH_IDS_NAMED]), f"{ID_PREFIX}batch.size": len(run_ids)},
    ) as span:
        if len(run_ids) == 1:
            annotate(span, run_id=run_ids[0])
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
