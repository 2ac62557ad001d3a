"""The delivery loop starts each leased batch with one StartRuns call (real Room and Claims; a stand-in
Runtime, or the real one), and falls back to one StartRun per wake against a Runtime without it."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from quayutec.ledger import run_id_for
from quayutec.telemetry import SpanCapture
from quayutec.v1 import common_pb2, gateway_pb2, room_pb2_grpc
from services.runtime.standin import StandinProvider
from tests.gateway.conftest import NOWHERE
from tests.gateway.helpers import GatewayStub, eventually
from tests.gateway.runtime_standin import BatchingStandinRuntime, running_standin_runtime
from tests.gateway.test_delivery import FAST, pending, post_wakes, room_stub
from tests.harness.claims import running_claims
from tests.harness.gateway import authed_gateway, ended_run, make_company, running_gateway
from tests.harness.room import running_room
from tests.harness.runtime import running_runtime

__all__ = ["room_stub"]  # a fixture of the delivery tests, used here


async def _none_pending(room: room_pb2_grpc.RoomServiceStub) -> bool:
    return await pending(room) == 0


async def test_a_leased_batch_goes_in_one_start_runs_call_and_each_wake_is_delivered_once(
    database_url: str, room_addr: str, claims_addr: str, acme_gw: GatewayStub, room_stub: room_pb2_grpc.RoomServiceStub
) -> None:
    _, wake_ids = await post_wakes(acme_gw, agents=5, messages=8)
    async with running_standin_runtime(claims_addr, room_addr, batching=True) as (runtime_addr, runtime):
        assert isinstance(runtime, BatchingStandinRuntime)
        runtime.script(wake_ids[3], "RESOURCE_EXHAUSTED")  # that item alone is refused, then retried
        async with running_gateway(database_url, room_addr, runtime_addr, **FAST):
            await eventually(lambda: _none_pending(room_stub))
    # All 40 were due when the Gateway started: its first lease took them all, and one call carried them.
    assert sorted(runtime.batches[0]) == sorted(wake_ids)
    assert [b for b in runtime.batches[1:]] == [[wake_ids[3]]]
    by_wake: dict[str, list[str]] = {w: [] for w in wake_ids}
    for call in runtime.calls:
        by_wake[call.request.wake_id].append(call.answer)
    assert by_wake == {w: ["RESOURCE_EXHAUSTED", "ACCEPTED"] if w == wake_ids[3] else ["ACCEPTED"] for w in wake_ids}


async def test_a_runtime_without_start_runs_gets_one_start_run_per_wake(
    database_url: str,
    room_addr: str,
    claims_addr: str,
    acme_gw: GatewayStub,
    room_stub: room_pb2_grpc.RoomServiceStub,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="quayutec.gateway.delivery")
    room, first = await post_wakes(acme_gw, agents=3, messages=2)
    # The stand-in without batching registers only StartRun: StartRuns answers UNIMPLEMENTED.
    async with (
        running_standin_runtime(claims_addr, room_addr) as (runtime_addr, runtime),
        running_gateway(database_url, room_addr, runtime_addr, **FAST),
    ):
        await eventually(lambda: _none_pending(room_stub))
        agents = list({c.request.agent_id for c in runtime.calls})
        later = await acme_gw.PostMessage(
            gateway_pb2.PostMessageRequest(room_id=room.room_id, person="Ada", body="again", mention_agent_ids=agents),
            timeout=30,
        )
        await eventually(lambda: _none_pending(room_stub))
    wake_ids = [*first, *later.wake_ids]
    assert Counter(c.request.wake_id for c in runtime.calls) == Counter(wake_ids)
    assert {c.answer for c in runtime.calls} == {"ACCEPTED"}
    fallbacks = [r for r in caplog.records if "has no StartRuns" in r.getMessage()]
    assert len(fallbacks) == 1  # remembered: the second batch went per wake without asking again
    assert "UNIMPLEMENTED" not in " ".join(r.getMessage() for r in caplog.records if "not delivered" in r.getMessage())


def _attr(span: ReadableSpan, key: str) -> object:
    return (span.attributes or {}).get(key)


async def test_the_real_runtime_runs_each_wake_of_a_batch_once_in_its_own_trace(
    captured: tuple[InMemorySpanExporter, SpanCapture], database_url: str
) -> None:
    exporter, capture = captured
    tag = uuid.uuid4().hex[:8]
    with StandinProvider() as standin:
        # Servers made after telemetry is installed, so that their calls are traced.
        async with (
            running_claims(database_url) as claims_addr,
            running_room(database_url) as room_addr,
            running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as runtime_addr,
            # Posting through a Gateway that delivers nothing: the wakes wait to be leased together.
            running_gateway(
                database_url,
                room_addr,
                NOWHERE,
                QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false",
                QUAYUTEC_GATEWAY_POST_RATE="0",
            ) as gateway_addr,
        ):
            acme = await make_company(database_url, room_addr, f"Acme {tag}")
            async with authed_gateway(gateway_addr, acme.secret) as gw:
                room = (await gw.CreateRoom(gateway_pb2.CreateRoomRequest(name="launch"), timeout=10)).room
                agents = [
                    (
                        await gw.RegisterAgent(
                            gateway_pb2.RegisterAgentRequest(
                                name=f"agent{n}",
                                provider=common_pb2.PROVIDER_ANTHROPIC,
                                model=f"claude-batch-{tag}-{n}",
                                provider_key=f"sk-ant-{tag}",
                            ),
                            timeout=10,
                        )
                    ).agent
                    for n in range(4)
                ]
                wake_of: dict[str, str] = {}  # agent -> its wake
                for agent in agents:
                    posted = await gw.PostMessage(
                        gateway_pb2.PostMessageRequest(
                            room_id=room.room_id, person="ana", body="please", mention_agent_ids=[agent.agent_id]
                        ),
                        timeout=10,
                    )
                    (wake_of[agent.agent_id],) = posted.wake_ids
                runs: dict[str, common_pb2.Run] = {}
                async with running_gateway(database_url, room_addr, runtime_addr, **FAST):
                    for agent_id, wake_id in wake_of.items():
                        runs[wake_id] = await ended_run(gw, run_id_for(agent_id, wake_id))
        for agent in agents:
            assert len(standin.requests(agent.model)) == 1  # each wake ran once
    assert {r.status for r in runs.values()} == {common_pb2.RUN_STATUS_SUCCEEDED}
    await asyncio.to_thread(capture.force_flush)
    spans = exporter.get_finished_spans()
    trace_ids = set()
    for wake_id, run in runs.items():
        (root,) = [s for s in spans if s.name == "deliver wake" and _attr(s, "quayutec.wake_id") == wake_id]
        (run_span,) = [s for s in spans if s.name == "run" and _attr(s, "quayutec.run_id") == run.run_id]
        trace_id = format(root.context.trace_id, "032x")
        assert run.trace_id == trace_id
        assert run_span.context.trace_id == root.context.trace_id
        trace_ids.add(trace_id)
    assert len(trace_ids) == 4  # one trace per wake
    # The four were due when the delivering Gateway started: its first lease took them, one call started them.
    calls = [s for s in spans if s.name == "/quayutec.v1.RuntimeService/StartRuns" and s.kind == SpanKind.CLIENT]
    assert len(calls) == 1
    assert not [s for s in spans if s.name == "/quayutec.v1.RuntimeService/StartRun"]
