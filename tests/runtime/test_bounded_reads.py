"""What the Runtime reads from a model provider is bounded: a body past the cap
(QUAYUTEC_RUNTIME_MODEL_MAX_RESPONSE_BYTES) is counted as it streams in, never read further, and
ends the call as a final ``response_too_large`` attempt; a real Runtime process fed a body far
past the cap keeps its memory."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
import pytest_asyncio

from quayutec.egress import EgressPolicy
from quayutec.ledger import run_id_for
from quayutec.v1 import common_pb2, runtime_pb2
from services.runtime.model import (
    DEFAULT_MAX_RESPONSE_BYTES,
    ModelOutcome,
    ModelTarget,
    Provider,
    RetryPolicy,
    call_model,
    make_http_client,
    make_owner_http_client,
)
from services.runtime.standin import HUGE_CHUNK, Fault, StandinProvider
from tests.harness.claims import running_claims
from tests.harness.room import running_room
from tests.harness.runtime import RuntimeProcess
from tests.runtime.test_model_retries import KEY, MODEL, REQUEST, FakeClock
from tests.runtime.world import make_world, runtime_stub, start_request

MIB = 1024 * 1024
# A reply the Anthropic wire accepts, sent whole under a content-length by a `raw` fault.
REPLY_BODY = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": MODEL,
    "content": [{"type": "text", "text": "fits"}],
    "stop_reason": "end_turn",
    "usage": {"input_tokens": 1, "output_tokens": 1},
}


@pytest_asyncio.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with make_http_client(30.0, trust_env=False) as client:
        yield client


async def bytes_sent(standin: StandinProvider, limit: float = 30.0) -> int:
    """What the stand-in's (first) huge answer wrote before it ended: it ends when the client hangs
    up, a moment after the call returned (bounded wait, a failsafe)."""
    deadline = asyncio.get_running_loop().time() + limit
    while not (sent := standin.huge_bytes_sent()):
        assert asyncio.get_running_loop().time() < deadline, "the stand-in is still sending"
        await asyncio.sleep(0.02)
    return sent[0]


def target(standin: StandinProvider, provider: Provider, *, owner_supplied: bool = False) -> ModelTarget:
    return ModelTarget(provider, MODEL, KEY, base_url=standin.base_url, owner_supplied=owner_supplied)


async def call_capped(http: httpx.AsyncClient, standin: StandinProvider, cap: int) -> ModelOutcome:
    """One Anthropic call to the stand-in reading at most ``cap`` bytes of the answer."""
    return await call_model(
        http, target(standin, "anthropic"), REQUEST, policy=RetryPolicy(), clock=FakeClock(), max_response_bytes=cap
    )


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
@pytest.mark.parametrize(("status", "declare_length"), [(200, False), (200, True), (500, False)])
async def test_a_body_past_the_cap_is_one_final_attempt(
    http: httpx.AsyncClient, standin: StandinProvider, provider: Provider, status: int, declare_length: bool
) -> None:
    """Chunked or with a declared length, a success or a retryable status: one request, not retried
    (our own base URL would get three), and the provider stopped sending long before the end."""
    size = 64 * MIB
    standin.enqueue_fault("huge", status=status, size=size, declare_length=declare_length, times=3)
    outcome = await call_model(
        http, target(standin, provider), REQUEST, policy=RetryPolicy(), clock=(clock := FakeClock())
    )
    assert outcome.reply is None and outcome.error_class == "response_too_large"
    assert len(standin.requests()) == 1 and clock.sleeps == []
    (attempt,) = outcome.attempts
    assert (attempt.error_class, attempt.retryable, attempt.status_code) == ("response_too_large", False, status)
    assert f"longer than {DEFAULT_MAX_RESPONSE_BYTES} bytes" in attempt.detail
    assert await bytes_sent(standin) < size, "the Runtime read the whole body"


async def test_the_cap_counts_streamed_bytes_exactly(http: httpx.AsyncClient, standin: StandinProvider) -> None:
    """A chunked body of exactly the cap is read whole (and is not a reply); one byte more is refused."""
    cap = 5 * HUGE_CHUNK + 123
    standin.enqueue_fault("huge", status=200, size=cap)
    assert (await call_capped(http, standin, cap)).error_class == "bad_reply"
    standin.enqueue_fault("huge", status=200, size=cap + 1)
    assert (await call_capped(http, standin, cap)).error_class == "response_too_large"


async def test_a_declared_length_over_the_cap_is_refused_unread(
    http: httpx.AsyncClient, standin: StandinProvider
) -> None:
    body = json.dumps(REPLY_BODY).encode()
    standin.enqueue_fault(Fault("raw", status=200, body=REPLY_BODY), times=2)
    fits = await call_capped(http, standin, len(body))
    assert fits.reply is not None and fits.reply.text == "fits"
    over = await call_capped(http, standin, len(body) - 1)
    assert over.reply is None and over.error_class == "response_too_large"


async def test_a_compressed_body_is_refused_not_inflated(http: httpx.AsyncClient, standin: StandinProvider) -> None:
    """We ask for identity; a body coded anyway could inflate past any cap, so it is a bad reply."""
    standin.enqueue_fault(Fault("raw", status=200, body=REPLY_BODY, headers={"content-encoding": "gzip"}))
    outcome = await call_capped(http, standin, DEFAULT_MAX_RESPONSE_BYTES)
    assert outcome.error_class == "bad_reply"
    assert "gzip-encoded" in outcome.attempts[0].detail
    assert standin.requests()[0].headers["accept-encoding"] == "identity"


async def test_an_owner_supplied_address_is_capped_too(standin: StandinProvider) -> None:
    """The egress-guarded client (owner-supplied base URLs) reads through the same cap."""
    policy = EgressPolicy.parse("127.0.0.1/32")
    async with make_owner_http_client(30.0, policy, max_connections=4) as owner_http:
        standin.enqueue_fault("huge", status=200, size=64 * MIB)
        outcome = await call_model(
            owner_http,
            target(standin, "openai_compatible", owner_supplied=True),
            REQUEST,
            policy=RetryPolicy(),
            clock=FakeClock(),
        )
    assert outcome.error_class == "response_too_large"
    assert await bytes_sent(standin) < 64 * MIB


def _peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM, Linux), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/{pid}/status has no VmHWM")


async def test_a_runtime_fed_a_huge_body_keeps_its_memory(database_url: str, standin: StandinProvider) -> None:
    """The issue's reproduction, bounded: a real Runtime process's run meets a 256 MiB answer. Its
    peak resident memory grows by far less than the body (without the cap it grew by more than the
    body), and the run ends FAILED with one `response_too_large` attempt in its ledger."""
    size = 256 * MIB
    channels: list[grpc.aio.Channel] = []
    async with running_claims(database_url) as claims_addr, running_room(database_url) as room_addr:
        w = await make_world(room_addr, claims_addr, channels)
        proc = RuntimeProcess(claims_addr, room_addr, standin.base_url)
        try:
            await proc.wait_ready()
            runtime = runtime_stub(proc.addr, channels)
            # A first, ordinary run loads everything a run uses before the peak is taken.
            warm = (await w.post("@planner warm up", [w.agent_a.agent_id])).wakes[0]
            assert (await runtime.StartRun(start_request(warm))).result == runtime_pb2.START_RUN_RESULT_ACCEPTED
            assert (await w.wait_for_run(run_id_for(warm.agent_id, warm.wake_id))).status == (
                common_pb2.RUN_STATUS_SUCCEEDED
            )
            before = _peak_rss(proc.proc.pid)
            rss_before = psutil.Process(proc.proc.pid).memory_info().rss
            standin.enqueue_fault("huge", status=200, size=size, model=w.model_a, times=3)
            wake = (await w.post("@planner answer at length", [w.agent_a.agent_id])).wakes[0]
            assert (await runtime.StartRun(start_request(wake))).result == runtime_pb2.START_RUN_RESULT_ACCEPTED
            run = await w.wait_for_run(run_id_for(wake.agent_id, wake.wake_id))
            grown = _peak_rss(proc.proc.pid) - before
            rss_after = psutil.Process(proc.proc.pid).memory_info().rss
        finally:
            proc.kill()
            for channel in channels:
                await channel.close()
    assert grown < 32 * MIB, f"peak RSS grew by {grown / MIB:.0f} MiB reading a {size // MIB} MiB body"
    assert rss_after - rss_before < 32 * MIB
    assert run.status == common_pb2.RUN_STATUS_FAILED
    assert [(a.error_class, a.retryable) for a in run.model_attempts] == [("response_too_large", False)]
    assert len(standin.requests(w.model_a)) == 2  # the warm-up and the one huge answer: not retried
    assert await bytes_sent(standin) < size
