"""The model-call retry loop against a real stand-in provider: one test per row of
provider-errors.md, exact request counts and exact waits (a fake clock; nothing asserts timing)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any, Literal

import httpx
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode, Tracer

from services.runtime.model import (
    DECLARED_ACTIONS,
    RETRY_WAIT_EVENT,
    Attempt,
    ChatMessage,
    ModelOutcome,
    ModelRequest,
    ModelTarget,
    Provider,
    RetryPolicy,
    call_model,
    classify_response,
    make_http_client,
)
from services.runtime.standin import Fault, StandinProvider

KEY = "sk-test-SECRET-0123456789abcdefXYZ"
MODEL = "standin-model-1"
REQUEST = ModelRequest(
    system="You are agent A in room R.",
    messages=(ChatMessage("user", "Please summarise the open tasks."),),
    tools=DECLARED_ACTIONS,
    max_tokens=256,
)


@dataclass
class FakeClock:
    """Records every sleep and advances its own time; never actually sleeps."""

    now: float = 1000.0
    sleeps: list[float] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.log.append(f"sleep {seconds}")
        self.now += seconds

    def monotonic(self) -> float:
        return self.now


@pytest_asyncio.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with make_http_client(5.0, trust_env=False) as client:
        yield client


@pytest_asyncio.fixture
async def short_http() -> AsyncIterator[httpx.AsyncClient]:
    async with make_http_client(0.5, trust_env=False) as client:
        yield client


@pytest.fixture
def spans() -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def target(standin: StandinProvider, provider: Provider, *, owner_supplied: bool = False) -> ModelTarget:
    return ModelTarget(provider, MODEL, KEY, base_url=standin.base_url, owner_supplied=owner_supplied)


async def call(
    http: httpx.AsyncClient,
    tgt: ModelTarget,
    clock: FakeClock | None = None,
    tracer: Tracer | None = None,
    policy: RetryPolicy | None = None,
) -> tuple[ModelOutcome, FakeClock]:
    clock = clock or FakeClock()
    outcome = await call_model(http, tgt, REQUEST, policy=policy or RetryPolicy(), clock=clock, tracer=tracer)
    return outcome, clock


def anthropic_error(status: int, etype: str, message: str, **extra: Any) -> Fault:
    return Fault("raw", status=status, body={"type": "error", "error": {"type": etype, "message": message, **extra}})


def openai_error(status: int, etype: str | None, code: str | None, message: str = "refused") -> Fault:
    return Fault("raw", status=status, body={"error": {"message": message, "type": etype, "param": None, "code": code}})


FINAL: tuple[int, list[float]] = (1, [])
RETRIED: tuple[int, list[float]] = (3, [2.0, 8.0])

ROWS = [
    # Anthropic Messages
    ("anthropic", Fault("quota"), FINAL, "credit"),
    (
        "anthropic",
        anthropic_error(
            400,
            "invalid_request_error",
            "You have reached your specified API usage limits. You will regain access on 2026-12-01 at 00:00 UTC.",
        ),
        FINAL,
        "spend_limit",
    ),
    ("anthropic", anthropic_error(400, "invalid_request_error", "messages: field required"), FINAL, "malformed"),
    ("anthropic", Fault("key_rejected"), FINAL, "key_rejected"),
    ("anthropic", anthropic_error(402, "billing_error", "Payment required."), FINAL, "billing"),
    ("anthropic", anthropic_error(403, "permission_error", "Not allowed."), FINAL, "permission"),
    ("anthropic", Fault("unknown_model"), FINAL, "unknown_model"),
    (
        "anthropic",
        Fault("raw", status=413, body="<html><h1>413 Request Entity Too Large</h1></html>"),
        FINAL,
        "too_large",
    ),
    ("anthropic", Fault("spend_cap"), FINAL, "spend_limit"),
    ("anthropic", Fault("rate_limit"), RETRIED, "rate_limited"),
    ("anthropic", Fault("server_error"), RETRIED, "server_error"),
    ("anthropic", anthropic_error(504, "timeout_error", "Request timed out."), RETRIED, "server_error"),
    ("anthropic", anthropic_error(502, "api_error", "Bad gateway."), RETRIED, "server_error"),
    ("anthropic", Fault("overloaded"), RETRIED, "overloaded"),
    # OpenAI Chat Completions
    ("openai", openai_error(400, "invalid_request_error", None), FINAL, "malformed"),
    ("openai", Fault("key_rejected"), FINAL, "key_rejected"),
    ("openai", openai_error(403, "invalid_request_error", "unsupported_country_region_territory"), FINAL, "permission"),
    ("openai", Fault("unknown_model"), FINAL, "unknown_model"),
    ("openai", openai_error(422, "invalid_request_error", None), FINAL, "malformed"),
    ("openai", Fault("quota"), FINAL, "quota"),
    ("openai", openai_error(429, "insufficient_quota", None), FINAL, "quota"),
    ("openai", openai_error(429, "requests", "insufficient_quota"), FINAL, "quota"),
    ("openai", openai_error(429, "invalid_request_error", "credit_balance_exhausted"), FINAL, "credit"),
    ("openai", openai_error(429, "invalid_request_error", "organization_usage_limit_exceeded"), FINAL, "spend_limit"),
    ("openai", Fault("spend_cap"), FINAL, "spend_limit"),
    ("openai", openai_error(429, "invalid_request_error", "project_spend_limit_exceeded"), FINAL, "spend_limit"),
    (
        "openai",
        openai_error(
            429,
            "tokens",
            "rate_limit_exceeded",
            "Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 41000.",
        ),
        FINAL,
        "too_large",
    ),
    ("openai", Fault("rate_limit"), RETRIED, "rate_limited"),
    ("openai", openai_error(429, "requests", "slow_down"), RETRIED, "rate_limited"),
    ("openai", Fault("raw", status=429, body=None), RETRIED, "rate_limited"),
    ("openai", openai_error(408, None, None, "Request timeout"), RETRIED, "timeout"),
    ("openai", openai_error(409, None, None, "Conflict"), RETRIED, "conflict"),
    ("openai", Fault("server_error"), RETRIED, "server_error"),
    ("openai", openai_error(502, "server_error", None), RETRIED, "server_error"),
    ("openai", Fault("overloaded"), RETRIED, "overloaded"),
]


def row_id(row: tuple[str, Fault, tuple[int, list[float]], str]) -> str:
    provider, fault, _, error_class = row
    status = f"-{fault.status}" if fault.kind == "raw" else ""
    return f"{provider}-{fault.kind}{status}-{error_class}"


@pytest.mark.parametrize("row", ROWS, ids=[row_id(r) for r in ROWS])
async def test_table_row(
    http: httpx.AsyncClient, standin: StandinProvider, row: tuple[Provider, Fault, tuple[int, list[float]], str]
) -> None:
    provider, fault, (requests, waits), error_class = row
    standin.enqueue_fault(fault, times=3)
    outcome, clock = await call(http, target(standin, provider))
    assert outcome.reply is None
    assert len(standin.requests()) == requests
    assert clock.sleeps == waits
    assert [a.wait_seconds for a in outcome.attempts] == [*waits, 0.0]
    assert outcome.error_class == error_class
    assert [a.number for a in outcome.attempts] == list(range(1, requests + 1))
    assert all(a.error_class == error_class for a in outcome.attempts)
    assert outcome.attempts[-1].retryable == (requests > 1)


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_named_wait_is_taken_exactly(
    http: httpx.AsyncClient, standin: StandinProvider, provider: Provider
) -> None:
    standin.enqueue_fault("rate_limit", retry_after=3, times=3)
    outcome, clock = await call(http, target(standin, provider))
    assert len(standin.requests()) == 3
    assert clock.sleeps == [3.0, 3.0]
    assert outcome.error_class == "rate_limited"


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_named_wait_of_20_seconds_is_honoured(
    http: httpx.AsyncClient, standin: StandinProvider, provider: Provider
) -> None:
    standin.enqueue_fault("rate_limit", retry_after=20, times=3)
    _, clock = await call(http, target(standin, provider))
    assert len(standin.requests()) == 3
    assert clock.sleeps == [20.0, 20.0]


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_named_wait_over_20_seconds_stops(
    http: httpx.AsyncClient, standin: StandinProvider, provider: Provider
) -> None:
    standin.enqueue_fault("rate_limit", retry_after=21, times=3)
    outcome, clock = await call(http, target(standin, provider))
    assert len(standin.requests()) == 1
    assert clock.sleeps == []
    assert outcome.error_class == "retry_after_too_long"
    assert outcome.attempts[0].retryable is False
    assert "rate_limited" in outcome.attempts[0].detail


async def test_openai_reads_retry_after_ms_first(http: httpx.AsyncClient, standin: StandinProvider) -> None:
    standin.enqueue_fault("rate_limit", retry_after=7, retry_after_ms=1500, times=3)
    _, clock = await call(http, target(standin, "openai"))
    assert len(standin.requests()) == 3
    assert clock.sleeps == [1.5, 1.5]


async def test_openai_retry_after_ms_over_20_seconds_stops(http: httpx.AsyncClient, standin: StandinProvider) -> None:
    standin.enqueue_fault("rate_limit", retry_after=1, retry_after_ms=25000, times=3)
    outcome, clock = await call(http, target(standin, "openai"))
    assert len(standin.requests()) == 1
    assert clock.sleeps == []
    assert outcome.error_class == "retry_after_too_long"


async def test_anthropic_ignores_retry_after_ms(http: httpx.AsyncClient, standin: StandinProvider) -> None:
    standin.enqueue_fault("rate_limit", headers={"retry-after-ms": "1500"}, times=3)
    _, clock = await call(http, target(standin, "anthropic"))
    assert clock.sleeps == [2.0, 8.0]


@pytest.mark.parametrize("wire", ["anthropic", "openai"])
def test_retry_after_http_date(wire: Literal["anthropic", "openai"]) -> None:
    now = datetime(2026, 11, 5, 12, 0, 0, tzinfo=UTC)
    verdict = classify_response(wire, 429, {"retry-after": "Thu, 05 Nov 2026 12:00:05 GMT"}, b"", KEY, now=now)
    assert (verdict.error_class, verdict.retryable, verdict.named_wait) == ("rate_limited", True, 5.0)
    past = classify_response(wire, 429, {"retry-after": "Thu, 05 Nov 2026 11:00:00 GMT"}, b"", KEY, now=now)
    assert past.named_wait == 0.0
    garbled = classify_response(wire, 429, {"retry-after": "soon"}, b"", KEY, now=now)
    assert garbled.named_wait is None


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_retry_after_date_over_20_seconds_ahead_stops(
    http: httpx.AsyncClient, standin: StandinProvider, provider: Provider
) -> None:
    ahead = format_datetime(datetime.now(UTC) + timedelta(seconds=60), usegmt=True)
    standin.enqueue_fault("rate_limit", retry_after=ahead, times=3)
    outcome, clock = await call(http, target(standin, provider))
    assert len(standin.requests()) == 1
    assert clock.sleeps == []
    assert outcome.error_class == "retry_after_too_long"


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_a_trickled_body_times_out_at_the_model_timeout_and_is_retried(
    short_http: httpx.AsyncClient, standin: StandinProvider, provider: Provider
) -> None:
    # Each slice comes well within the client's 0.5 s read timeout; the whole body would take 2.7 s.
    standin.enqueue_reply("trickled", slice_seconds=0.3)
    standin.enqueue_reply("whole at once")
    outcome, clock = await call(short_http, target(standin, provider))
    assert outcome.reply is not None and outcome.reply.text == "whole at once"
    assert len(standin.requests()) == 2
    first = outcome.attempts[0]
    assert (first.error_class, first.retryable, first.status_code) == ("timeout", True, None)
    assert "within 0.5 s" in first.detail
    assert clock.sleeps == [2.0]


@pytest.mark.parametrize(("provider", "fault"), [("anthropic", "overloaded"), ("openai", "rate_limit")])
async def test_x_should_retry_false_is_final(
    http: httpx.AsyncClient, standin: StandinProvider, provider: Provider, fault: str
) -> None:
    standin.enqueue_fault(fault, headers={"x-should-retry": "false"}, times=3)
    outcome, clock = await call(http, target(standin, provider))
    assert len(standin.requests()) == 1
    assert clock.sleeps == []
    assert outcome.attempts[0].retryable is False


@pytest.mark.parametrize(("provider", "fault"), [("anthropic", "overloaded"), ("openai_compatible", "overloaded")])
async def test_owner_supplied_base_url_gets_exactly_one_request(
    http: httpx.AsyncClient, standin: StandinProvider, provider: Provider, fault: str
) -> None:
    standin.enqueue_fault(fault, times=3)
    outcome, clock = await call(http, target(standin, provider, owner_supplied=True))
    assert len(standin.requests()) == 1
    assert clock.sleeps == []
    assert outcome.error_class == "overloaded"
    assert outcome.attempts[0].wait_seconds == 0.0


async def test_owner_supplied_success(http: httpx.AsyncClient, standin: StandinProvider) -> None:
    outcome, _ = await call(http, target(standin, "openai_compatible", owner_supplied=True))
    assert outcome.reply is not None
    assert outcome.reply.text == (
        'Noted, you asked "Please summarise the open tasks."; I will take it from here and report back in this room.'
    )
    assert len(standin.requests()) == 1
    assert standin.requests()[0].body["max_tokens"] == 256


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_timeout_is_retried(short_http: httpx.AsyncClient, standin: StandinProvider, provider: Provider) -> None:
    standin.enqueue_fault("timeout", seconds=30, times=3)
    outcome, clock = await call(short_http, target(standin, provider))
    assert len(standin.requests()) == 3
    assert clock.sleeps == [2.0, 8.0]
    assert outcome.error_class == "timeout"
    assert all(a.status_code is None for a in outcome.attempts)


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_dropped_connection_is_retried(
    http: httpx.AsyncClient, standin: StandinProvider, provider: Provider
) -> None:
    standin.enqueue_fault("drop", times=3)
    outcome, clock = await call(http, target(standin, provider))
    assert len(standin.requests()) == 3
    assert clock.sleeps == [2.0, 8.0]
    assert outcome.error_class == "connection"


async def test_refused_connection_is_retried(http: httpx.AsyncClient) -> None:
    with StandinProvider() as gone:
        base = gone.base_url
    tgt = ModelTarget("anthropic", MODEL, KEY, base_url=base)
    outcome, clock = await call(http, tgt)
    assert [a.error_class for a in outcome.attempts] == ["connection"] * 3
    assert clock.sleeps == [2.0, 8.0]


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_success_after_one_overload(
    http: httpx.AsyncClient, standin: StandinProvider, provider: Provider
) -> None:
    standin.enqueue_fault("overloaded")
    standin.enqueue_reply("all good")
    outcome, clock = await call(http, target(standin, provider))
    assert outcome.reply is not None and outcome.reply.text == "all good"
    assert outcome.error_class is None and outcome.error is None
    assert len(standin.requests()) == 2
    assert clock.sleeps == [2.0]
    assert [(a.error_class, a.wait_seconds) for a in outcome.attempts] == [("overloaded", 2.0), ("ok", 0.0)]
    assert outcome.attempts[1].status_code == 200


@pytest.mark.parametrize(
    ("provider", "body"),
    [
        ("anthropic", "this is not json"),
        ("anthropic", {"type": "message", "content": "not a list"}),
        ("openai", {"choices": []}),
        ("openai", "<html>gateway</html>"),
    ],
)
async def test_unparseable_success_is_final_bad_reply(
    http: httpx.AsyncClient, standin: StandinProvider, provider: Provider, body: Any
) -> None:
    standin.enqueue_fault("raw", status=200, body=body, times=3)
    outcome, clock = await call(http, target(standin, provider))
    assert outcome.error_class == "bad_reply"
    assert len(standin.requests()) == 1
    assert clock.sleeps == []


async def test_openai_tool_call_with_bad_json_arguments_is_bad_reply(
    http: httpx.AsyncClient, standin: StandinProvider
) -> None:
    standin.enqueue_reply("", tool_calls=[{"name": "remember", "arguments": '{"text": "unterminated'}])
    outcome, _ = await call(http, target(standin, "openai"))
    assert outcome.error_class == "bad_reply"
    assert len(standin.requests()) == 1


TOOL_CALLS = [
    {"id": "call_1", "name": "remember", "arguments": {"text": "Acme prefers Fridays", "private": True}},
    {
        "id": "call_2",
        "name": "create_task",
        "arguments": {"to_agent_id": "agent-b", "title": "Quote", "body": "By Friday"},
    },
]


@pytest.mark.parametrize("provider", ["anthropic", "openai", "openai_compatible"])
async def test_tool_calls_are_parsed(http: httpx.AsyncClient, standin: StandinProvider, provider: Provider) -> None:
    standin.enqueue_reply("On it.", tool_calls=TOOL_CALLS)
    outcome, _ = await call(http, target(standin, provider))
    reply = outcome.reply
    assert reply is not None
    assert reply.text == "On it."
    assert [(c.id, c.name, c.arguments) for c in reply.tool_calls] == [
        (c["id"], c["name"], c["arguments"]) for c in TOOL_CALLS
    ]
    assert reply.stop_reason == ("tool_use" if provider == "anthropic" else "tool_calls")
    assert reply.input_tokens > 0 and reply.output_tokens > 0
    assert reply.response_model == MODEL


async def test_anthropic_wire_format(http: httpx.AsyncClient, standin: StandinProvider) -> None:
    await call(http, target(standin, "anthropic"))
    (record,) = standin.requests()
    assert record.path == "/v1/messages"
    assert record.headers["anthropic-version"] == "2023-06-01"
    assert record.headers["x-api-key"] == "REDACTED"
    assert record.body["system"] == REQUEST.system
    assert record.body["max_tokens"] == 256
    assert record.body["messages"] == [{"role": "user", "content": "Please summarise the open tasks."}]
    assert [t["name"] for t in record.body["tools"]] == ["remember", "create_task", "update_task", "close_task"]
    assert record.body["tools"][0]["input_schema"]["required"] == ["text", "private"]


async def test_openai_wire_format(http: httpx.AsyncClient, standin: StandinProvider) -> None:
    await call(http, target(standin, "openai"))
    (record,) = standin.requests()
    assert record.path == "/v1/chat/completions"
    assert record.headers["authorization"] == "Bearer REDACTED"
    assert record.body["messages"][0] == {"role": "system", "content": REQUEST.system}
    assert record.body["max_completion_tokens"] == 256
    tool = record.body["tools"][3]
    assert tool["type"] == "function"
    assert tool["function"]["name"] == "close_task"
    assert tool["function"]["parameters"]["properties"]["status"]["enum"] == ["done", "cancelled"]


async def test_on_attempt_is_awaited_before_each_wait(http: httpx.AsyncClient, standin: StandinProvider) -> None:
    standin.enqueue_fault("server_error", times=2)
    clock = FakeClock()
    seen: list[Attempt] = []

    async def on_attempt(attempt: Attempt) -> None:
        seen.append(attempt)
        clock.log.append(f"attempt {attempt.number}")

    outcome = await call_model(
        http, target(standin, "openai"), REQUEST, policy=RetryPolicy(), clock=clock, on_attempt=on_attempt
    )
    assert clock.log == ["attempt 1", "sleep 2.0", "attempt 2", "sleep 8.0", "attempt 3"]
    assert tuple(seen) == outcome.attempts
    assert outcome.reply is not None


async def test_policy_bounds_requests(http: httpx.AsyncClient, standin: StandinProvider) -> None:
    standin.enqueue_fault("overloaded", times=5)
    policy = RetryPolicy(max_requests=2, default_waits=(0.5,))
    outcome, clock = await call(http, target(standin, "anthropic"), policy=policy)
    assert len(standin.requests()) == 2
    assert clock.sleeps == [0.5]
    assert outcome.error == f"overloaded after 2 requests: {outcome.attempts[-1].detail}"


@pytest.mark.parametrize(
    "kwargs",
    [{"max_requests": 0}, {"default_waits": (2.0, -1.0)}, {"max_requests": 4}, {"max_named_wait_seconds": -1.0}],
)
def test_policy_is_validated(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


def _span_text(span: ReadableSpan) -> str:
    return json.dumps(
        {
            "name": span.name,
            "attributes": dict(span.attributes or {}),
            "events": [(e.name, dict(e.attributes or {})) for e in span.events],
            "status": span.status.description,
        },
        default=str,
    )


async def test_spans_per_attempt(
    http: httpx.AsyncClient, standin: StandinProvider, spans: tuple[Tracer, InMemorySpanExporter]
) -> None:
    tracer, exporter = spans
    standin.enqueue_fault("overloaded")
    outcome, _ = await call(http, target(standin, "anthropic"), tracer=tracer)
    assert outcome.reply is not None
    first, second = exporter.get_finished_spans()
    assert first.name == second.name == f"chat {MODEL}"
    a1, a2 = dict(first.attributes or {}), dict(second.attributes or {})
    assert a1["gen_ai.operation.name"] == "chat"
    assert a1["gen_ai.provider.name"] == "anthropic"
    assert a1["gen_ai.request.model"] == MODEL
    assert (a1["quayutec.model.attempt"], a2["quayutec.model.attempt"]) == (1, 2)
    assert a1["quayutec.model.error_class"] == a1["error.type"] == "overloaded"
    assert first.status.status_code == StatusCode.ERROR
    assert [(e.name, dict(e.attributes or {})) for e in first.events] == [
        (RETRY_WAIT_EVENT, {"quayutec.model.wait_seconds": 2.0})
    ]
    assert a2["quayutec.model.error_class"] == "ok"
    assert "error.type" not in a2
    assert a2["gen_ai.response.model"] == MODEL
    assert a2["gen_ai.usage.input_tokens"] == outcome.reply.input_tokens
    assert a2["gen_ai.usage.output_tokens"] == outcome.reply.output_tokens
    assert "Please summarise" not in _span_text(first) + _span_text(second)
    assert outcome.reply.text not in _span_text(second)


async def test_default_tracer_is_the_global_one(http: httpx.AsyncClient, standin: StandinProvider) -> None:
    outcome, _ = await call(http, target(standin, "openai"))
    assert outcome.reply is not None


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_key_never_leaks(
    http: httpx.AsyncClient, standin: StandinProvider, spans: tuple[Tracer, InMemorySpanExporter], provider: Provider
) -> None:
    tracer, exporter = spans
    tgt = target(standin, provider)
    assert KEY not in repr(tgt)
    outcomes = []
    standin.enqueue_fault("rate_limit", times=3)
    standin.enqueue_fault("drop", times=3)
    standin.enqueue_fault("key_rejected")
    standin.enqueue_fault(
        "raw", status=400, body={"type": "error", "error": {"message": f"bad header {KEY}", "type": "x"}}
    )
    for _ in range(4):
        outcomes.append((await call(http, tgt, tracer=tracer))[0])
    assert [o.error_class for o in outcomes] == ["rate_limited", "connection", "key_rejected", "malformed"]
    texts = [repr(o) for o in outcomes] + [_span_text(s) for s in exporter.get_finished_spans()]
    texts += [json.dumps(r.to_json()) for r in standin.requests()]
    assert len(standin.requests()) == 8
    assert texts
    for text in texts:
        assert KEY not in text
        assert KEY[-10:] not in text  # nor a recognisable tail of it
    assert all("[redacted]" in a.detail for a in outcomes[-1].attempts)
