"""An OTLP/gRPC trace receiver inside the test (what Jaeger accepts), and this process's telemetry
exporting to it: every span the in-process services make arrives as it would at a collector."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from quayutec.telemetry import SpanCapture, configure_for_tests


@dataclass(frozen=True)
class Got:
    """One received span with its instrumentation scope and its resource's attributes."""

    scope: str
    span: Span
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def name(self) -> str:
        return self.span.name

    def attr(self, key: str) -> Any:
        for kv in self.span.attributes:
            if kv.key == key:
                return value_of(kv.value)
        return None

    def attribute_names(self) -> set[str]:
        return {kv.key for kv in self.span.attributes}

    def links_to(self, other: Got) -> bool:
        """Whether this span has a span link to ``other``."""
        return any(
            (link.trace_id, link.span_id) == (other.span.trace_id, other.span.span_id) for link in self.span.links
        )


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(value_of(v) for v in value.array_value.values)
    return getattr(value, kind) if kind else None


@dataclass
class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """The OTLP/gRPC trace receiver: keeps every export request as it came."""

    requests: list[trace_service_pb2.ExportTraceServiceRequest] = field(default_factory=list)

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[Got]:
        return [
            Got(
                scope_spans.scope.name,
                span,
                {kv.key: value_of(kv.value) for kv in resource_spans.resource.attributes},
            )
            for request in self.requests
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]

    def raw(self) -> bytes:
        return b"".join(request.SerializeToString() for request in self.requests)


@asynccontextmanager
async def otlp_collector() -> AsyncIterator[tuple[Collector, SpanCapture]]:
    """A receiver on an ephemeral port and this process's telemetry exporting to it over OTLP."""
    servicer = Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    # Installs the instrumentations: before any of the services' servers and channels exist.
    export = configure_for_tests(OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True))
    try:
        yield servicer, export
    finally:
        await asyncio.to_thread(export.close)
        await server.stop(None)


async def flushed_until(
    received: Collector, export: SpanCapture, done: Callable[[list[Got]], bool], *, rounds: int = 200
) -> list[Got]:
    """Flush and look again until ``done(spans)`` (at most ``rounds`` times: a failsafe, not a timing)."""
    for _ in range(rounds):
        await asyncio.to_thread(export.force_flush)
        spans = received.spans()
        if done(spans):
            return spans
        await asyncio.sleep(0.05)
    return received.spans()
