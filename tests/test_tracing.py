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

import grpc
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Decision, ParentBased
from opentelemetry.trace import SpanContext, StatusCode, TraceFlags

from quayutec.config import ConfigError
from quayutec.telemetry import (
    QUIET_ROOT_SPANS,
    SpanCapture,
    TelemetrySettings,
    _DoorTracer,
    _QuietPolling,
    setup_telemetry,
    stable_conventions,
)
from quayutec.v1 import common_pb2, gateway_pb2
from services.runtime.model import RETRY_WAIT_EVENT, RetryPolicy
from services.runtime.standin import StandinProvider
from tests.harness.otlp import Collector, Got, flushed_until
from tests.harness.stack import wake_stack

ENDED = (common_pb2.RUN_STATUS_SUCCEEDED, common_pb2.RUN_STATUS_FAILED, common_pb2.RUN_STATUS_TIMED_OUT)


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

    agent = gateway_pb2.RegisterAgentRequest(
        name="planner",
        provider=common_pb2.PROVIDER_ANTHROPIC,
        model=model,
        provider_key=key,
        system_prompt=system_prompt,
    )
    policy = RetryPolicy(default_waits=(0.01, 0.01))
    async with wake_stack(database_url, standin, policy=policy, agent=agent) as stack:
        posted, run = await stack.replied(f"@planner {prompt}")
        assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
        assert [a.status_code for a in run.model_attempts] == [429, 200]

        def settled(spans: list[Got]) -> bool:  # the delivery has settled the wake and its spans are out
            names = {s.name for s in spans if s.span.kind == Span.SPAN_KIND_SERVER}
            return "quayutec.v1.RoomService/SettleWakes" in names

        await flushed_until(received, export, settled)
    (wake_id,) = posted.wake_ids
    run_id = run.run_id

    await asyncio.to_thread(export.force_flush)
    spans = received.spans()

    # --- Runtime, Claims, Room and the model: one trace, the ledger's.
    # The wake's item of the batch's StartRuns call, started under the trace context the item carried.
    start_servers = [s for s in spans if s.name == "StartRun" and s.scope == "quayutec.runtime.start"]
    assert len(start_servers) == 1, [s.name for s in spans]
    trace_id = start_servers[0].trace_id
    assert run.trace_id == trace_id
    in_trace = [s for s in spans if s.trace_id == trace_id]
    server_services = {s.attr("rpc.method").split("/")[0] for s in in_trace if _server(s)}
    assert {"quayutec.v1.RuntimeService", "quayutec.v1.ClaimsService", "quayutec.v1.RoomService"} <= server_services
    in_trace_names = {s.name for s in in_trace}
    for name in (
        "quayutec.v1.ClaimsService/ClaimOnce",
        "quayutec.v1.RoomService/ReadRunContext",
        "quayutec.v1.RoomService/RecordRun",
        "quayutec.v1.RoomService/PostMessage",  # the reply
    ):
        assert name in in_trace_names, (name, sorted(in_trace_names))
    assert any(s.scope.startswith("opentelemetry.instrumentation.asyncpg") for s in in_trace)
    # Every span of this wake's calls is in that trace (this test makes no other such calls).
    per_wake = {
        "quayutec.v1.RuntimeService/StartRuns",  # a batch of one: in its only wake's trace
        "StartRun",
        "quayutec.v1.ClaimsService/ClaimOnce",
        "quayutec.v1.RoomService/ReadRunContext",
        "quayutec.v1.RoomService/RecordRun",
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
    assert (root.attr("quayutec.agent_id"), root.attr("quayutec.room_id")) == (stack.agent_id, stack.room_id)
    starts = [s for s in in_trace if s.name == "quayutec.v1.RuntimeService/StartRuns"]
    assert {s.span.kind for s in starts} == {Span.SPAN_KIND_CLIENT, Span.SPAN_KIND_SERVER}
    # The item's span hangs under the wake's delivery span and links to the call that carried it.
    assert start_servers[0].span.parent_span_id == root.span.span_id
    (call,) = [s for s in starts if _server(s)]
    assert [link.span_id for link in start_servers[0].span.links] == [call.span.span_id]
    assert "quayutec.v1.RoomService/SettleWakes" in in_trace_names
    (run_span,) = [s for s in spans if s.name == "run" and s.attr("quayutec.run_id") == run_id]
    assert run_span.trace_id == trace_id
    assert run_span.span.parent_span_id == start_servers[0].span.span_id
    assert run_span.attr("quayutec.company_id") == stack.company.company_id
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


def test_the_housekeeping_trace_ratio_is_a_fraction() -> None:
    assert TelemetrySettings.from_env("gateway", {}).housekeeping_ratio == 0.0
    assert (
        TelemetrySettings.from_env("gateway", {"QUAYUTEC_HOUSEKEEPING_TRACE_RATIO": "0.25"}).housekeeping_ratio == 0.25
    )
    with pytest.raises(ConfigError, match="QUAYUTEC_HOUSEKEEPING_TRACE_RATIO"):
        TelemetrySettings.from_env("gateway", {"QUAYUTEC_HOUSEKEEPING_TRACE_RATIO": "2"})


def test_idle_roots_and_database_spans_without_a_call_are_not_sampled() -> None:
    parent = trace.set_span_in_context(
        trace.NonRecordingSpan(SpanContext(1, 2, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED)))
    )
    database = {"db.system.name": "postgresql"}
    for ratio, idle_roots in ((0.0, Decision.DROP), (1.0, Decision.RECORD_AND_SAMPLE)):
        sampler = _QuietPolling(ParentBased(ALWAYS_ON), ratio)
        sampler.recording = True
        for name in QUIET_ROOT_SPANS:
            assert sampler.should_sample(None, 7, name).decision == idle_roots, name
            assert sampler.should_sample(parent, 7, name).decision == Decision.RECORD_AND_SAMPLE  # part of a call
        assert sampler.should_sample(None, 7, "LISTEN", attributes=database).decision == Decision.DROP
        assert sampler.should_sample(parent, 7, "SELECT", attributes=database).decision == Decision.RECORD_AND_SAMPLE
        assert sampler.should_sample(None, 7, "deliver wake").decision == Decision.RECORD_AND_SAMPLE


def test_the_gateway_trusts_a_callers_trace_context_only_when_told() -> None:
    assert not TelemetrySettings.from_env("gateway", {}).trust_caller_trace
    assert TelemetrySettings.from_env("gateway", {"QUAYUTEC_GATEWAY_TRUST_TRACEPARENT": "true"}).trust_caller_trace
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # of this test alone: the process's own is not touched
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    def served(trust: bool, flags: int) -> dict[str, ReadableSpan]:
        """The recorded server spans of a Gateway call and a Room call made under a caller's context."""
        exporter.clear()
        caller = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(flags))
        token = otel_context.attach(trace.set_span_in_context(trace.NonRecordingSpan(caller)))
        try:
            door = _DoorTracer(provider.get_tracer("test"), trust)
            for name in ("/quayutec.v1.GatewayService/PostMessage", "/quayutec.v1.RoomService/PostMessage"):
                with door.start_as_current_span(name, kind=trace.SpanKind.SERVER):
                    pass
        finally:
            otel_context.detach(token)
        return {s.name.split(".")[-1]: s for s in exporter.get_finished_spans()}

    # Not trusted: whatever the caller's flags, a root of ours, sampled by our sampler, linked to it.
    for flags in (0x00, 0x01):
        gateway = served(False, flags)["GatewayService/PostMessage"]
        assert gateway.parent is None and gateway.context.trace_id != 0xABC
        assert [(link.context.trace_id, link.context.span_id) for link in gateway.links] == [(0xABC, 0xDEF)]
        assert gateway.attributes is not None and gateway.attributes["quayutec.caller.trace_id"] == f"{0xABC:032x}"
    # Trusted: the caller's context is the parent, and its flags decide ("not sampled": nothing).
    assert served(True, 0x00) == {}
    trusted = served(True, 0x01)["GatewayService/PostMessage"]
    assert trusted.parent is not None and trusted.parent.span_id == 0xDEF and not trusted.links
    # Inside the stack (the Room) a caller's context is always the parent.
    for trust in (False, True):
        room = served(trust, 0x01)["RoomService/PostMessage"]
        assert room.parent is not None and room.parent.span_id == 0xDEF


def _grpc_span(code: grpc.StatusCode, status: StatusCode) -> ReadableSpan:
    return ReadableSpan(
        name="/quayutec.v1.GatewayService/GetRun",
        context=SpanContext(1, 2, is_remote=False),
        attributes={
            "rpc.system": "grpc",
            "rpc.service": "x",
            "rpc.method": "y",
            "rpc.grpc.status_code": code.value[0],
            "net.peer.port": "4711",
        },
        events=(Event("exception", {"exception.stacktrace": "Traceback ..."}),),
        kind=trace.SpanKind.SERVER,
        status=trace.Status(status),
    )


def test_expected_refusals_lose_their_exception_events_and_server_errors_keep_them() -> None:
    refused = stable_conventions(_grpc_span(grpc.StatusCode.NOT_FOUND, StatusCode.UNSET))
    failed = stable_conventions(_grpc_span(grpc.StatusCode.INTERNAL, StatusCode.ERROR))
    for span, code in ((refused, "NOT_FOUND"), (failed, "INTERNAL")):
        assert span.name == span.attributes["rpc.method"] == "quayutec.v1.GatewayService/GetRun"  # type: ignore[index]
        assert span.attributes is not None
        assert span.attributes["rpc.response.status_code"] == code == span.attributes["error.type"]
        assert span.attributes["network.peer.port"] == 4711
        assert not {"rpc.system", "rpc.service", "rpc.grpc.status_code", "net.peer.port"} & set(span.attributes)
    assert [e.name for e in refused.events] == []
    assert [e.name for e in failed.events] == ["exception"]
