"""StartRuns on real servers (Claims, Room, Runtime, the stand-in provider): one call starts a batch of
wakes, each item exactly as StartRun would, answered item by item in request order."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from quayutec.ledger import run_id_for
from quayutec.telemetry import SpanCapture
from quayutec.v1 import claims_pb2, claims_pb2_grpc, common_pb2, room_pb2_grpc, runtime_pb2
from services.runtime.backend import RetryingRoom
from services.runtime.claims_client import ClaimsClient
from services.runtime.model import RealClock, RetryPolicy
from services.runtime.run import RunExecutor
from services.runtime.servicer import MAX_START_RUNS_ITEMS, RuntimeServicer
from services.runtime.standin import StandinProvider
from tests.harness.channels import service_channel
from tests.harness.claims import running_claims
from tests.harness.room import running_room
from tests.harness.runtime import runtime_config
from tests.runtime.test_runs import Stack, _stack, wake_a
from tests.runtime.world import held_replies, start_request

ACCEPTED = runtime_pb2.START_RUN_RESULT_ACCEPTED
ALREADY_CLAIMED = runtime_pb2.START_RUN_RESULT_ALREADY_CLAIMED
OK = grpc.StatusCode.OK.value[0]
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def items(
    *requests: runtime_pb2.StartRunRequest, traceparents: list[str] | None = None
) -> runtime_pb2.StartRunsRequest:
    parents = traceparents or [""] * len(requests)
    return runtime_pb2.StartRunsRequest(
        items=[runtime_pb2.StartRunsItem(request=r, traceparent=t) for r, t in zip(requests, parents, strict=True)]
    )


@pytest.fixture
async def backends(database_url: str) -> AsyncIterator[tuple[str, str]]:
    async with running_claims(database_url) as claims_addr, running_room(database_url) as room_addr:
        yield claims_addr, room_addr


@pytest.fixture
async def stack(backends: tuple[str, str], standin: StandinProvider) -> AsyncIterator[Stack]:
    async for s in _stack(backends, standin):
        yield s


async def wakes(s: Stack, count: int) -> list[common_pb2.Wake]:
    """``count`` wakes, alternating between the world's two agents (one message each)."""
    made: list[common_pb2.Wake] = []
    for n in range(count):
        agent = s.world.agent_a if n % 2 == 0 else s.world.agent_b
        posted = await s.world.post(f"@{agent.name} job {n}", [agent.agent_id])
        made.extend(posted.wakes)
    assert len(made) == count
    return made


async def claimed(s: Stack, wake: common_pb2.Wake) -> bool:
    try:
        await s.world.claims.GetClaim(claims_pb2.GetClaimRequest(agent_id=wake.agent_id, wake_id=wake.wake_id))
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND
        return False
    return True


async def test_each_item_is_answered_in_request_order_and_runs_once(stack: Stack) -> None:
    batch = await wakes(stack, 6)
    response = await stack.runtime.StartRuns(items(*(start_request(w) for w in batch)))
    assert [a.error_code for a in response.answers] == [OK] * 6
    assert [a.response.result for a in response.answers] == [ACCEPTED] * 6
    assert [a.response.run_id for a in response.answers] == [run_id_for(w.agent_id, w.wake_id) for w in batch]
    for wake in batch:
        run = await stack.world.wait_for_run(run_id_for(wake.agent_id, wake.wake_id))
        assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
        assert run.wake_id == wake.wake_id
    # The same batch again, in another order: every item already claimed, nothing runs twice.
    again = await stack.runtime.StartRuns(items(*(start_request(w) for w in reversed(batch))))
    assert [(a.response.result, a.response.run_id) for a in again.answers] == [
        (ALREADY_CLAIMED, run_id_for(w.agent_id, w.wake_id)) for w in reversed(batch)
    ]
    requests = len(stack.standin.requests(stack.world.model_a)) + len(stack.standin.requests(stack.world.agent_b.model))
    assert requests == 6


async def test_a_mixed_batch_is_answered_item_by_item_and_nothing_invalid_starts(stack: Stack) -> None:
    new, before, decision = await wakes(stack, 3)
    assert (await stack.runtime.StartRun(start_request(before))).result == ACCEPTED
    no_wake_id = runtime_pb2.StartRunRequest(agent_id=new.agent_id, wake_id="", room_id=new.room_id)
    # A DECISION wake names its waitpoint token; without one it is refused before claiming.
    no_token = start_request(decision)
    no_token.wake_kind = common_pb2.WAKE_KIND_DECISION
    no_token.wake_source_id = ""
    response = await stack.runtime.StartRuns(items(no_wake_id, start_request(new), no_token, start_request(before)))
    first, second, third, fourth = response.answers
    assert (first.error_code, "wake_id" in first.error_message) == (INVALID_ARGUMENT, True)
    assert (second.error_code, second.response.result) == (OK, ACCEPTED)
    assert second.response.run_id == run_id_for(new.agent_id, new.wake_id)
    assert (third.error_code, "wake_source_id" in third.error_message) == (INVALID_ARGUMENT, True)
    assert (fourth.error_code, fourth.response.result, fourth.response.row_held) == (OK, ALREADY_CLAIMED, True)
    assert not second.response.row_held
    assert fourth.response.run_id == run_id_for(before.agent_id, before.wake_id)
    assert not await claimed(stack, decision)  # the invalid item claimed nothing
    for wake in (new, before):
        run = await stack.world.wait_for_run(run_id_for(wake.agent_id, wake.wake_id))
        assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error


async def test_an_empty_or_oversized_call_is_refused_and_starts_nothing(stack: Stack) -> None:
    (wake,) = await wakes(stack, 1)
    with pytest.raises(grpc.aio.AioRpcError) as empty:
        await stack.runtime.StartRuns(runtime_pb2.StartRunsRequest())
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    oversized = [start_request(wake)] * (MAX_START_RUNS_ITEMS + 1)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stack.runtime.StartRuns(items(*oversized))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(MAX_START_RUNS_ITEMS) in (refused.value.details() or "")
    assert not await claimed(stack, wake)
    assert stack.standin.requests(stack.world.model_a) == []


async def test_a_full_runtime_refuses_only_the_items_over_its_limit(
    backends: tuple[str, str], standin: StandinProvider
) -> None:
    async for s in _stack(backends, standin, max_runs=2):
        batch = [await wake_a(s, f"@planner job {n}") for n in range(4)]
        # The first two runs stay in their model calls until the call has been answered and checked.
        with held_replies(s.standin, s.world.model_a) as release:
            response = await s.runtime.StartRuns(items(*(start_request(w) for w in batch)))
            codes = [a.error_code for a in response.answers]
            assert codes == [OK, OK, RESOURCE_EXHAUSTED, RESOURCE_EXHAUSTED]
            assert [a.response.result for a in response.answers[:2]] == [ACCEPTED, ACCEPTED]
            assert all("limit 2" in a.error_message for a in response.answers[2:])
            assert [await claimed(s, w) for w in batch] == [True, True, False, False]
            release.set()
            for wake in batch[:2]:
                await s.world.wait_for_run(run_id_for(wake.agent_id, wake.wake_id))
        # Delivered again once the runs have ended, the refused items start.
        later = await s.runtime.StartRuns(items(*(start_request(w) for w in batch[2:])))
        assert [(a.error_code, a.response.result) for a in later.answers] == [(OK, ACCEPTED), (OK, ACCEPTED)]
        for wake in batch[2:]:
            run = await s.world.wait_for_run(run_id_for(wake.agent_id, wake.wake_id))
            assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error


@pytest.fixture
async def traced_stack(
    captured: tuple[InMemorySpanExporter, SpanCapture], backends: tuple[str, str], standin: StandinProvider
) -> AsyncIterator[Stack]:
    """A stack whose servers exist after telemetry is installed (their calls are traced)."""
    async for s in _stack(backends, standin):
        yield s


async def test_each_item_runs_in_the_trace_its_traceparent_names(
    captured: tuple[InMemorySpanExporter, SpanCapture], traced_stack: Stack
) -> None:
    exporter, capture = captured
    s = traced_stack
    batch = await wakes(s, 3)
    trace_ids = [secrets.token_hex(16) for _ in batch]
    parents = [f"00-{t}-{secrets.token_hex(8)}-01" for t in trace_ids]
    response = await s.runtime.StartRuns(items(*(start_request(w) for w in batch), traceparents=parents))
    assert [a.response.result for a in response.answers] == [ACCEPTED] * 3
    runs = [await s.world.wait_for_run(a.response.run_id) for a in response.answers]
    assert [r.trace_id for r in runs] == trace_ids  # the ledger names each wake's own trace
    await asyncio.to_thread(capture.force_flush)
    spans = exporter.get_finished_spans()

    def attr(span: ReadableSpan, key: str) -> object:
        return (span.attributes or {}).get(key)

    for wake, trace_id, parent, run in zip(batch, trace_ids, parents, runs, strict=True):
        (start,) = [sp for sp in spans if sp.name == "StartRun" and attr(sp, "quayutec.wake_id") == wake.wake_id]
        (run_span,) = [sp for sp in spans if sp.name == "run" and attr(sp, "quayutec.run_id") == run.run_id]
        assert format(start.context.trace_id, "032x") == trace_id
        assert start.parent is not None and format(start.parent.span_id, "016x") == parent.split("-")[2]
        assert format(run_span.context.trace_id, "032x") == trace_id
        assert run_span.parent is not None and run_span.parent.span_id == start.context.span_id


class GatedClaims:
    """The real Claims stub behind a gate: each ClaimOnce / ClaimMany waits for ``gate`` (``asked``
    is set when one has arrived), then goes to Claims as it was sent (``answered`` once it has)."""

    def __init__(self, stub: claims_pb2_grpc.ClaimsServiceStub) -> None:
        self._stub = stub
        self.gate = asyncio.Event()
        self.asked = asyncio.Event()
        self.answered = asyncio.Event()

    async def ClaimOnce(self, request: claims_pb2.ClaimOnceRequest, **kwargs: Any) -> Any:
        return await self._pass("ClaimOnce", request, kwargs)

    async def ClaimMany(self, request: claims_pb2.ClaimManyRequest, **kwargs: Any) -> Any:
        return await self._pass("ClaimMany", request, kwargs)

    async def _pass(self, method: str, request: Any, kwargs: dict[str, Any]) -> Any:
        self.asked.set()
        await self.gate.wait()
        answer = await getattr(self._stub, method)(request, **kwargs)
        self.answered.set()
        return answer


class CallContext:
    """What StartRuns reads of its gRPC context: the time left of the call."""

    def time_remaining(self) -> float:
        return 30.0


async def test_a_cancelled_call_starts_none_of_its_items(stack: Stack, backends: tuple[str, str]) -> None:
    claims_addr, room_addr = backends
    batch = await wakes(stack, 2)
    async with (
        service_channel(claims_addr, "runtime") as claims_channel,
        service_channel(room_addr, "runtime") as room_channel,
        httpx.AsyncClient() as http,
    ):
        gated = GatedClaims(claims_pb2_grpc.ClaimsServiceStub(claims_channel))
        claims = ClaimsClient(gated)
        executor = RunExecutor(
            config=runtime_config(claims_addr, room_addr),
            claims=claims,
            room=RetryingRoom(room_pb2_grpc.RoomServiceStub(room_channel), retry_seconds=1.0),
            http=http,
            owner_http=http,
            policy=RetryPolicy(),
            clock=RealClock(),
        )
        servicer = RuntimeServicer(executor)
        call = asyncio.create_task(servicer.StartRuns(items(*(start_request(w) for w in batch)), CallContext()))
        await gated.asked.wait()  # the items' claims have left and wait at the gate
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        gated.gate.set()  # the claims now commit, after their callers were cancelled
        await gated.answered.wait()
        await claims.close()
        assert [await claimed(stack, w) for w in batch] == [True, True]  # claimed, never to be acted on again
        # ... and not started: no run in the Runtime, none in the ledger, no model request.
        await executor.shutdown(1.0)
        assert executor._active == 0
    for wake in batch:
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stack.world.run(run_id_for(wake.agent_id, wake.wake_id))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert stack.standin.requests(stack.world.model_a) == []
