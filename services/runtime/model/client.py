"""The one retry loop for model calls: send, classify, record, wait, at most `max_requests` times."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpcore
import httpx
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from quayutec.egress import EgressPolicy, EgressRefused, EgressTransport, Resolver

from . import anthropic, openai
from .classify import Verdict, classify_exception, classify_response, sanitize
from .policy import Clock, RetryPolicy
from .pool import ShardedTransport
from .types import Attempt, BadReply, ModelOutcome, ModelReply, ModelRequest, ModelTarget

TRACER_NAME = "quayutec.runtime.model"
# One tracer for the process (a proxy until a provider is installed): get_tracer per call is costly.
_TRACER = trace.get_tracer(TRACER_NAME)
RETRY_WAIT_EVENT = "quayutec.model.retry_wait"
# The most of one answer's body that is read (QUAYUTEC_RUNTIME_MODEL_MAX_RESPONSE_BYTES).
DEFAULT_MAX_RESPONSE_BYTES = 4 * 1024 * 1024

OnAttempt = Callable[[Attempt], Awaitable[None]]


def make_http_client(
    timeout_seconds: float,
    transport: httpx.AsyncBaseTransport | None = None,
    *,
    trust_env: bool = True,
    max_connections: int = 100,
) -> httpx.AsyncClient:
    """The process's one shared client: explicit timeout, no redirects, no retries of its own.
    ``timeout_seconds`` bounds each phase and also the whole request (see ``_send_once``).

    ``max_connections`` is the Runtime's run cap: a run makes one model request at a time, so every
    run in flight has its connection and none waits on the pool (httpx's own default is 100 open
    and 20 kept alive, which would queue runs 101 and on behind the others' model time). Idle
    connections are kept as many and closed after httpx's keep-alive expiry (5 s), so a burst does
    not reconnect on its next request. The pool is split into shards (``pool.ShardedTransport``) so
    its per-request bookkeeping stays small at thousands of connections."""
    if timeout_seconds <= 0:
        raise ValueError("timeout_seconds must be positive")
    if max_connections < 1:
        raise ValueError("max_connections must be at least 1")
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_seconds),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        transport=transport or ShardedTransport(max_connections, trust_env=trust_env),
        follow_redirects=False,
        trust_env=trust_env,
    )


def make_owner_http_client(
    timeout_seconds: float,
    policy: EgressPolicy,
    *,
    max_connections: int,
    resolver: Resolver | None = None,
    dialer: httpcore.AsyncNetworkBackend | None = None,
) -> httpx.AsyncClient:
    """The client for owner-supplied base URLs: like ``make_http_client`` (one connection per run in
    flight, sharded) but every shard is an egress-guarded transport, and no proxy from the environment."""
    context = ssl.create_default_context()  # one, shared by the shards: loading the CA store is not free

    def guarded(limits: httpx.Limits) -> httpx.AsyncBaseTransport:
        return EgressTransport(policy, resolver=resolver, dialer=dialer, ssl_context=context, limits=limits)

    transport = ShardedTransport(max_connections, trust_env=False, shard=guarded)
    return make_http_client(timeout_seconds, transport, trust_env=False, max_connections=max_connections)


async def call_model(
    http: httpx.AsyncClient,
    target: ModelTarget,
    request: ModelRequest,
    *,
    policy: RetryPolicy,
    clock: Clock,
    on_attempt: OnAttempt | None = None,
    tracer: Tracer | None = None,
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
) -> ModelOutcome:
    """Call the model with bounded retries; every attempt is traced and handed to `on_attempt`
    (awaited before any wait, so the ledger has it even if the run dies while waiting). No answer's
    body is read past ``max_response_bytes``: a longer one ends the call as ``response_too_large``."""
    tracer = tracer or _TRACER
    budget = 1 if target.owner_supplied else policy.max_requests
    attempts: list[Attempt] = []
    for number in range(1, budget + 1):
        with tracer.start_as_current_span(
            f"chat {target.model}",
            kind=SpanKind.CLIENT,
            attributes=_request_attributes(target, number),
            record_exception=False,
        ) as span:
            started = clock.monotonic()
            status, reply, verdict = await _send_once(http, target, request, max_response_bytes)
            duration_ms = max(0.0, (clock.monotonic() - started) * 1000.0)
            error_class, retryable, wait = _decide(verdict, number, budget, policy)
            _annotate(span, status, reply, error_class, retryable, wait)
        attempt = Attempt(
            number=number,
            status_code=status,
            error_class=error_class,
            retryable=retryable,
            wait_seconds=wait or 0.0,
            detail=verdict.detail,
            duration_ms=duration_ms,
        )
        attempts.append(attempt)
        if on_attempt is not None:
            await on_attempt(attempt)
        if reply is not None:
            return ModelOutcome(reply=reply, attempts=tuple(attempts), error_class=None, error=None)
        if wait is None:
            break
        await clock.sleep(wait)
    last = attempts[-1]
    plural = "request" if len(attempts) == 1 else "requests"
    return ModelOutcome(
        reply=None,
        attempts=tuple(attempts),
        error_class=last.error_class,
        error=sanitize(f"{last.error_class} after {len(attempts)} {plural}: {last.detail}", target.api_key),
    )


@dataclass(frozen=True)
class _Wire:
    build: Callable[[ModelTarget, ModelRequest], tuple[str, dict[str, str], dict[str, object]]]
    parse: Callable[[bytes], ModelReply]
    name: str


_ANTHROPIC = _Wire(anthropic.build, anthropic.parse, "anthropic")
_OPENAI = _Wire(openai.build, openai.parse, "openai")


def _wire(target: ModelTarget) -> _Wire:
    return _ANTHROPIC if target.provider == "anthropic" else _OPENAI


async def _send_once(
    http: httpx.AsyncClient, target: ModelTarget, request: ModelRequest, max_bytes: int
) -> tuple[int | None, ModelReply | None, Verdict]:
    """One request. Returns (status, reply or None, verdict).

    httpx bounds each read; the client's timeout also bounds the whole request (connect, headers
    and the whole body), so a body that trickles in is a timeout too. The body is counted as it
    comes in and never read past ``max_bytes`` (nor decompressed: we ask for no content coding)."""
    wire = _wire(target)
    url, headers, body = wire.build(target, request)
    total = total_seconds(http)
    status: int | None = None
    try:
        async with (
            asyncio.timeout(total),
            http.stream("POST", url, headers={**headers, "accept-encoding": "identity"}, json=body) as response,
        ):
            status = response.status_code
            content = await read_capped(response, max_bytes)
    except EgressRefused as exc:
        # Nothing was sent: the address the host resolved to is not one we send requests to.
        return None, None, Verdict("egress_refused", False, None, sanitize(f"egress refused ({exc.rule}): {exc}", ""))
    except TimeoutError:
        return None, None, Verdict("timeout", True, None, f"TimeoutError: no whole answer within {total:g} s")
    except CodedBody as exc:
        return status, None, Verdict("bad_reply", False, None, sanitize(f"{status} bad_reply: {exc}", target.api_key))
    except (httpx.HTTPError, httpx.InvalidURL, UnicodeError) as exc:
        return None, None, classify_exception(exc, target.api_key)
    assert status is not None
    if content is None:
        # Final: the provider already did (and may bill) the work; asking again would fetch as much.
        detail = f"{status} response_too_large: the answer is longer than {max_bytes} bytes; the rest was not read"
        return status, None, Verdict("response_too_large", False, None, detail)
    if 200 <= status < 300:
        try:
            reply = wire.parse(content)
        except BadReply as exc:
            detail = sanitize(f"{status} bad_reply: {exc}", target.api_key)
            return status, None, Verdict("bad_reply", False, None, detail)
        return status, reply, Verdict("ok", False, None, f"{status} ok")
    verdict = classify_response(
        "anthropic" if wire is _ANTHROPIC else "openai",
        status,
        response.headers,
        content,
        target.api_key,
    )
    return status, None, verdict


class CodedBody(Exception):
    """The answer came with a content coding we did not ask for (we send ``accept-encoding: identity``)."""


async def read_capped(response: httpx.Response, limit: int) -> bytes | None:
    """The raw body, or None as soon as it is known to pass ``limit`` bytes: from its declared
    length before anything is read, else while it streams in (at most ``limit`` plus one network
    read is ever held). A compressed body is refused rather than inflated past any bound."""
    coding = response.headers.get("content-encoding", "").strip().lower()
    if coding not in ("", "identity"):
        raise CodedBody(f"the answer is {coding}-encoded; we ask for identity")
    declared = response.headers.get("content-length", "").strip()
    if declared.isdigit() and int(declared) > limit:
        return None
    parts: list[bytes] = []
    size = 0
    async for part in response.aiter_raw():
        size += len(part)
        if size > limit:
            return None
        parts.append(part)
    return b"".join(parts)


def total_seconds(http: httpx.AsyncClient) -> float | None:
    """The whole-request deadline: the longest of the client's phase timeouts (None: unbounded)."""
    phases = [t for t in (http.timeout.connect, http.timeout.read, http.timeout.write, http.timeout.pool) if t]
    return max(phases) if phases else None


def _decide(verdict: Verdict, number: int, budget: int, policy: RetryPolicy) -> tuple[str, bool, float | None]:
    """(error class, retryable, wait before the next request or None to stop)."""
    if not verdict.retryable or number >= budget:
        return verdict.error_class, verdict.retryable, None
    if verdict.named_wait is not None:
        if verdict.named_wait > policy.max_named_wait_seconds:
            return "retry_after_too_long", False, None
        return verdict.error_class, True, verdict.named_wait
    return verdict.error_class, True, policy.default_waits[number - 1]


def _request_attributes(target: ModelTarget, number: int) -> dict[str, str | int | bool]:
    return {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "anthropic" if target.provider == "anthropic" else "openai",
        "gen_ai.request.model": target.model,
        "quayutec.model.attempt": number,
        "quayutec.model.owner_supplied": target.owner_supplied,
    }


def _annotate(
    span: Span,
    status: int | None,
    reply: ModelReply | None,
    error_class: str,
    retryable: bool,
    wait: float | None,
) -> None:
    """Outcome attributes only: never the key, the prompt or the reply text."""
    if status is not None:
        span.set_attribute("http.response.status_code", status)
    span.set_attribute("quayutec.model.error_class", error_class)
    if reply is not None:
        if reply.response_model:
            span.set_attribute("gen_ai.response.model", reply.response_model)
        span.set_attribute("gen_ai.usage.input_tokens", reply.input_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", reply.output_tokens)
        if reply.stop_reason:
            span.set_attribute("gen_ai.response.finish_reasons", (reply.stop_reason,))
        return
    span.set_attribute("error.type", error_class)
    span.set_attribute("quayutec.model.retryable", retryable)
    span.set_status(Status(StatusCode.ERROR, error_class))
    if wait is not None:
        span.add_event(RETRY_WAIT_EVENT, {"quayutec.model.wait_seconds": wait})
