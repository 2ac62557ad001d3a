"""One wake, one trace: a real OTLP/gRPC receiver in the test and all four services in-process.

The receiver implements the OTLP TraceService (what Jaeger accepts). The test posts a message
through the public Gateway, the stand-in provider answers 429 once and then a reply, and the test
checks the exported spans: one trace from the delivery through StartRuns (the wake's own "StartRun"
item span in the Runtime, under the traceparent its item carried), the claim, the room calls
and both model attempts; the ledger's trace id is that trace; no key, prompt or reply anywhere.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from quayutec.config import ConfigError
from quayutec.ledger import run_id_for
from quayutec.telemetry import (
    SpanCapture,
    TelemetrySettings,
    configure_for_tests,
    setup_telemetry,
)
from quayutec.v1 import common_pb2, gateway_pb2
from services.runtime.model import RETRY_WAIT_EVENT, RetryPolicy
from services.runtime.standin import StandinProvider
from tests.harness.claims import running_claims
from tests.harness.gateway import authed_gateway, ended_run, make_company, running_gateway
from tests.harness.room import running_room
from tests.harness.runtime import running_runtime

ENDED = (common_pb2.RUN_STATUS_SUCCEEDED, common_pb2.RUN_STATUS_FAILED, common_pb2.RUN_STATUS_TIMED_OUT)


@dataclass(frozen=True)
class Got:
    """One received span with its instrumentation scope."""

    scope: str
    span: Span

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def name(self) -> str:
        return self.span.name

    def attr(self, key: str) -> Any:
        for kv in self.span.attributes:
            if kv.key == key:
                return _value(kv.value)
        return None


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
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
            Got(scope_spans.scope.name, span)
            for request in self.requests
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]

    def raw(self) -> bytes:
        return b"".join(request.SerializeToString() for request in self.requests)


@pytest.fixture
async def collector() -> AsyncIterator[tuple[Collector, SpanCapture]]:
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


@pytest.fixture
def standin() -> Iterator[StandinProvider]:
    with StandinProvider() as provider:
        yield provider


async def test_one_wake_is_one_trace_across_the_services(
    collector: tuple[Collector, SpanCapture], standin: StandinProvider, database_url: str
) -> None:
    received, export = collector
    tag = uuid.uuid4().hex[:8]
    model = f"claude-trace-{tag}"
    key = f"sk-ant-TRACEKEY-{tag}"
    prompt = f"PROMPTSECRET-{tag}"
    system_prompt = f"SYSPROMPTSECRET-{tag}"
    reply = f"REPLYSECRET-{tag}"
    standin.enqueue_fault("rate_limit", model)
    standin.enqueue_reply(reply, model=model)

    async with (
        running_claims(database_url) as claims_addr,
        running_room(database_url) as room_addr,
        running_runtime(
            claims_addr, room_addr, standin_url=standin.base_url, policy=RetryPolicy(default_waits=(0.01, 0.01))
        ) as runtime_addr,
        running_gateway(
            database_url,
            room_addr,
            runtime_addr,
            QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS="0.05",
            QUAYUTEC_GATEWAY_POST_RATE="0",
        ) as gateway_addr,
    ):
        acme = await make_company(database_url, room_addr, "Acme")
        async with authed_gateway(gateway_addr, acme.secret) as gw:
            room = (await gw.CreateRoom(gateway_pb2.CreateRoomRequest(name="launch"), timeout=10)).room
            agent = (
                await gw.RegisterAgent(
                    gateway_pb2.RegisterAgentRequest(
                        name="planner",
                        provider=common_pb2.PROVIDER_ANTHROPIC,
                        model=model,
                        provider_key=key,
                        system_prompt=system_prompt,
                    ),
                    timeout=10,
                )
            ).agent
            posted = await gw.PostMessage(
                gateway_pb2.PostMessageRequest(
                    room_id=room.room_id,
                    person="ana",
                    body=f"@planner {prompt}",
                    mention_agent_ids=[agent.agent_id],
                ),
                timeout=10,
            )
            (wake_id,) = posted.wake_ids
            run_id = run_id_for(agent.agent_id, wake_id)
            run = await ended_run(gw, run_id)
            assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
            assert [a.status_code for a in run.model_attempts] == [429, 200]

            def settled() -> bool:
                names = {s.name for s in received.spans() if s.span.kind == Span.SPAN_KIND_SERVER}
                return "/quayutec.v1.RoomService/SettleWakes" in names

            for _ in range(200):  # until the delivery has settled the wake and its spans are out
                await asyncio.to_thread(export.force_flush)
                if settled():
                    break
                await asyncio.sleep(0.05)

    await asyncio.to_thread(export.force_flush)
    spans = received.spans()

    # --- Runtime, Claims, Room and the model: one trace, the ledger's.
    # The wake's item of the batch's StartRuns call, started under the trace context the item carried.
    start_servers = [s for s in spans if s.name == "StartRun" and s.scope == "quayutec.runtime.start"]
    assert len(start_servers) == 1, [s.name for s in spans]
    trace_id = start_servers[0].trace_id
    assert run.trace_id == trace_id
    in_trace = [s for s in spans if s.trace_id == trace_id]
    server_services = {s.attr("rpc.service") for s in in_trace if _server(s)}
    assert {"quayutec.v1.RuntimeService", "quayutec.v1.ClaimsService", "quayutec.v1.RoomService"} <= server_services
    in_trace_names = {s.name for s in in_trace}
    for name in (
        "/quayutec.v1.ClaimsService/ClaimOnce",
        "/quayutec.v1.RoomService/ReadRunContext",
        "/quayutec.v1.RoomService/RecordRun",
        "/quayutec.v1.RoomService/PostMessage",  # the reply
    ):
        assert name in in_trace_names, (name, sorted(in_trace_names))
    assert any(s.scope.startswith("opentelemetry.instrumentation.asyncpg") for s in in_trace)
    # Every span of this wake's calls is in that trace (this test makes no other such calls).
    per_wake = {
        "/quayutec.v1.RuntimeService/StartRuns",  # a batch of one: in its only wake's trace
        "StartRun",
        "/quayutec.v1.ClaimsService/ClaimOnce",
        "/quayutec.v1.RoomService/ReadRunContext",
        "/quayutec.v1.RoomService/RecordRun",
        f"chat {model}",
    }
    assert {s.trace_id for s in spans if s.name in per_wake} == {trace_id}

    attempts = sorted(
        (s for s in in_trace if s.name == f"chat {model}"), key=lambda s: int(s.attr("quayutec.model.attempt"))
    )
    assert [a.attr("quayutec.model.attempt") for a in attempts] == [1, 2]
    for attempt in attempts:
        assert attempt.span.kind == Span.SPAN_KIND_CLIENT
        assert attempt.attr("gen_ai.operation.name") == "chat"
        assert attempt.attr("gen_ai.provider.name") == "anthropic"
        assert attempt.attr("gen_ai.request.model") == model
    first, second = attempts
    assert first.attr("http.response.status_code") == 429
    assert first.attr("quayutec.model.error_class") == "rate_limited"
    assert first.span.status.code == Status.STATUS_CODE_ERROR
    assert [e.name for e in first.span.events] == [RETRY_WAIT_EVENT]
    assert second.attr("http.response.status_code") == 200
    assert second.attr("gen_ai.usage.output_tokens") is not None
    assert not second.span.events

    # --- Nothing secret anywhere in anything exported, and no query parameters.
    raw = received.raw()
    for secret in (key, prompt, system_prompt, reply):
        assert secret.encode() not in raw, f"{secret} was exported"
    assert all(s.attr("db.statement.parameters") is None for s in spans)

    # --- Patches pending in delivery.py and run.py: the delivery root and the run's own span.
    (root,) = [s for s in spans if s.name == "deliver wake" and s.attr("quayutec.wake_id") == wake_id]
    assert root.trace_id == trace_id
    assert not root.span.parent_span_id
    assert (root.attr("quayutec.agent_id"), root.attr("quayutec.room_id")) == (agent.agent_id, room.room_id)
    starts = [s for s in in_trace if s.name == "/quayutec.v1.RuntimeService/StartRuns"]
    assert {s.span.kind for s in starts} == {Span.SPAN_KIND_CLIENT, Span.SPAN_KIND_SERVER}
    # The item's span hangs under the wake's delivery span and links to the call that carried it.
    assert start_servers[0].span.parent_span_id == root.span.span_id
    (call,) = [s for s in starts if _server(s)]
    assert [link.span_id for link in start_servers[0].span.links] == [call.span.span_id]
    assert "/quayutec.v1.RoomService/SettleWakes" in in_trace_names
    (run_span,) = [s for s in spans if s.name == "run" and s.attr("quayutec.run_id") == run_id]
    assert run_span.trace_id == trace_id
    assert run_span.span.parent_span_id == start_servers[0].span.span_id
    assert run_span.attr("quayutec.company_id") == acme.company_id
    assert start_servers[0].attr("quayutec.wake_id") == wake_id
    assert all(a.span.trace_id == run_span.span.trace_id for a in attempts)


def _server(s: Got) -> bool:
    return s.span.kind == Span.SPAN_KIND_SERVER


def test_setup_is_idempotent() -> None:
    assert setup_telemetry("claims", env={}) is setup_telemetry("room", env={})


@pytest.mark.parametrize(
    ("env", "traces", "metrics"),
    [
        ({}, "none", "none"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317"}, "otlp", "otlp"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://jaeger:4317"}, "otlp", "none"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_METRICS_EXPORTER": "none"}, "otlp", "none"),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, "otlp", "none"),
        ({"OTEL_METRICS_EXPORTER": "otlp"}, "none", "otlp"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}, "none", "otlp"),
    ],
)
def test_exporters_follow_the_standard_variables(env: dict[str, str], traces: str, metrics: str) -> None:
    settings = TelemetrySettings.from_env("gateway", env)
    assert (settings.traces_exporter, settings.metrics_exporter) == (traces, metrics)


def test_service_name_and_resource_attributes() -> None:
    assert TelemetrySettings.from_env("room", {}).service_name == "quayutec-room"
    settings = TelemetrySettings.from_env(
        "room", {"OTEL_SERVICE_NAME": "rooms-eu", "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,a=b%2Cc"}
    )
    assert settings.service_name == "rooms-eu"
    assert settings.resource_attributes == {"deployment.environment": "prod", "a": "b,c"}
    assert TelemetrySettings.from_env("room", {"OTEL_SDK_DISABLED": "true"}).disabled


def test_an_unknown_exporter_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER"):
        TelemetrySettings.from_env("room", {"OTEL_TRACES_EXPORTER": "zipkin"})
