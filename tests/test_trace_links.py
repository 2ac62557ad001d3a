"""Traces people can follow, checked from outside with an OTLP/gRPC receiver of our own (issue 27).

All four services run in this process and export to the receiver in the test. Each test pins one
promise of docs/operations.md ("Following a run in Jaeger"):
- a post and the wake it made reach each other: the post's spans name the message and wake ids,
  the wake's ``deliver wake`` span links to the post's span, and the reply is in the wake's trace;
- a parked run, its decision and its continuation reach each other by links, the ledger keeps
  both trace ids, and inside the continuation ``deliver wake``, ``StartRun`` and ``run`` name the
  same wake and run;
- an idle stack exports no trace at all, and housekeeping that acts is one span;
- every exported attribute name is a stable semantic-convention name (or one of ours).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import grpc
import pytest
from opentelemetry import trace
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from opentelemetry.trace import SpanContext, TraceFlags

from quayutec.ledger import run_id_for
from quayutec.telemetry import SpanCapture, service_version
from quayutec.v1 import common_pb2, gateway_pb2
from services.runtime.standin import StandinProvider
from tests.harness.gateway import ended_run, run_reaching
from tests.harness.otlp import Collector, Got, flushed_until
from tests.harness.stack import wake_stack
from tests.harness.walk import STEPS, walk

SERVER = Span.SPAN_KIND_SERVER


def one(spans: list[Got], name: str, **attributes: Any) -> Got:
    """The one span called ``name`` whose attributes (``quayutec_x`` for ``quayutec.x``) match."""
    wanted = {key.replace("_", ".", 1) if key.startswith("quayutec_") else key: v for key, v in attributes.items()}
    kind = wanted.pop("kind", None)
    found = [
        s
        for s in spans
        if s.name == name and all(s.attr(k) == v for k, v in wanted.items()) and kind in (None, s.span.kind)
    ]
    assert len(found) == 1, (name, wanted, sorted({s.name for s in spans}))
    return found[0]


def settled_wakes(count: int) -> Any:
    """Done when ``count`` SettleWakes calls have been received (each wake's delivery has ended)."""

    def done(spans: list[Got]) -> bool:
        return sum(1 for s in spans if s.name == "quayutec.v1.RoomService/SettleWakes" and s.span.kind == SERVER) >= (
            count
        )

    return done


async def test_a_post_and_its_wake_reach_each_other(
    collector: tuple[Collector, SpanCapture], standin: StandinProvider, database_url: str
) -> None:
    received, export = collector
    async with wake_stack(database_url, standin) as stack:
        standin.enqueue_reply("On it.", model=stack.model)
        posted, run = await stack.replied("@planner plan the launch")
        (wake_id,) = posted.wake_ids
        message_id = posted.message.message_id
        assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
        spans = await flushed_until(received, export, settled_wakes(1))

    # The post: the Gateway's call and the Room's write both name the message and the wake.
    by_post = dict(quayutec_message_id=message_id, quayutec_wake_ids=(wake_id,))
    gateway_post = one(spans, "quayutec.v1.GatewayService/PostMessage", **by_post)
    room_post = one(spans, "quayutec.v1.RoomService/PostMessage", **by_post)
    assert room_post.trace_id == gateway_post.trace_id
    assert room_post.span.parent_span_id == _client_of(spans, room_post).span.span_id

    # The wake: its own trace, whose root links back to the span whose transaction made it.
    delivery = one(spans, "deliver wake", quayutec_wake_id=wake_id)
    assert delivery.trace_id == run.trace_id != room_post.trace_id
    assert not delivery.span.parent_span_id
    assert delivery.links_to(room_post)
    assert delivery.attr("quayutec.run_id") == run.run_id

    # The reply: posted in the wake's trace, its span naming the reply's message id.
    reply = one(spans, "quayutec.v1.RoomService/PostMessage", quayutec_message_id=run.posted_message_id)
    assert reply.trace_id == run.trace_id
    assert reply.attr("quayutec.run_id") == run.run_id
    assert reply.attr("quayutec.wake_ids") is None  # the reply mentions no one: it woke no agent
    assert list(run.trace_ids) == [run.trace_id]


async def test_a_parked_run_its_decision_and_its_continuation_are_linked(
    collector: tuple[Collector, SpanCapture], standin: StandinProvider, database_url: str
) -> None:
    received, export = collector
    async with wake_stack(database_url, standin) as stack:
        await stack.gw.SetAgentRights(
            gateway_pb2.SetAgentRightsRequest(agent_id=stack.agent_id, remember=common_pb2.ACTION_RIGHT_HOLD),
            timeout=10,
        )
        remember = {"name": "remember", "arguments": {"text": "launch on Friday", "private": False}}
        standin.enqueue_reply("Noted.", [remember], model=stack.model)
        (wake_id,) = (await stack.post("@planner remember the launch day")).wake_ids
        run_id = run_id_for(stack.agent_id, wake_id)
        parked = await run_reaching(stack.gw, run_id, lambda r: r.status == common_pb2.RUN_STATUS_PARKED)
        approvals = (await stack.gw.ListApprovals(gateway_pb2.ListApprovalsRequest(), timeout=10)).waitpoints
        (approval,) = [a for a in approvals if a.run_id == run_id]
        assert approval.traceparent == ""  # internal: the Room keeps it, the public API never shows it
        await stack.gw.DecideApproval(
            gateway_pb2.DecideApprovalRequest(token=approval.token, index=0, person="ana", approve=True), timeout=10
        )
        run = await ended_run(stack.gw, run_id)
        assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
        spans = await flushed_until(received, export, settled_wakes(2))

    # The ledger keeps both traces, the first one as trace_id.
    first, continued = run.trace_ids
    assert first == run.trace_id == parked.trace_id != continued
    assert list(parked.trace_ids) == [first]

    parking = one(spans, "quayutec.v1.RoomService/CreateWaitpoint", quayutec_run_id=run_id)
    assert parking.trace_id == first
    decision = one(spans, "quayutec.v1.RoomService/DecideHeldAction", quayutec_run_id=run_id)
    assert decision.trace_id not in (first, continued)
    assert one(spans, "quayutec.v1.GatewayService/DecideApproval", quayutec_run_id=run_id).trace_id == (
        decision.trace_id
    )

    # The continuation's trace: its delivery links to the decision, its run to the parking.
    delivery = one(spans, "deliver wake", **{"quayutec.wake.kind": "decision"})
    decision_wake = delivery.attr("quayutec.wake_id")
    assert decision_wake != wake_id
    assert delivery.trace_id == continued
    assert delivery.links_to(decision)
    continuation = one(spans, "run", quayutec_run_id=run_id, quayutec_wake_id=decision_wake)
    assert continuation.trace_id == continued
    assert continuation.links_to(parking)
    # Inside it, the delivery, the Runtime's StartRun and the run name the same wake and run.
    start = one(spans, "StartRun", quayutec_wake_id=decision_wake)
    assert start.trace_id == continued
    for span in (delivery, start, continuation):
        assert (span.attr("quayutec.wake_id"), span.attr("quayutec.run_id")) == (decision_wake, run_id), span.name
    # The first run's spans name the first wake, and its run span links to nothing.
    first_run = one(spans, "run", quayutec_run_id=run_id, quayutec_wake_id=wake_id)
    assert first_run.trace_id == first and not first_run.span.links


def _client_of(spans: list[Got], server: Got) -> Got:
    """The client span whose call ``server`` served."""
    (client,) = [s for s in spans if s.span.span_id == server.span.parent_span_id]
    return client


# Housekeeping on a short leash, so 30 s idle see many passes of every loop: expiry and abandoned
# runs (Gateway), delivered wakes and old events (Room), key re-checks and LISTEN (Gateway).
BUSY_HOUSEKEEPING = {
    "QUAYUTEC_GATEWAY_EXPIRE_INTERVAL_SECONDS": "0.2",
    "QUAYUTEC_GATEWAY_KEY_RECHECK_SECONDS": "0.5",
}
BUSY_ROOM = {
    "QUAYUTEC_ROOM_DELIVERED_WAKES_KEEP_SECONDS": "0",
    "QUAYUTEC_ROOM_OUTBOX_CLEANUP_INTERVAL_SECONDS": "0.3",
    "QUAYUTEC_ROOM_EVENT_CLEANUP_SECONDS": "1",
}
IDLE_SECONDS = 30


async def test_an_idle_stack_exports_no_trace_and_housekeeping_that_acts_is_one_span(
    collector: tuple[Collector, SpanCapture], standin: StandinProvider, database_url: str
) -> None:
    received, export = collector
    async with wake_stack(database_url, standin, room_env=BUSY_ROOM, gateway_env=BUSY_HOUSEKEEPING) as stack:
        await asyncio.to_thread(export.force_flush)
        before = len(received.spans())  # setting the stack up (company, room, agent) made traces
        await asyncio.sleep(IDLE_SECONDS)  # idle: no request, only the loops
        await asyncio.to_thread(export.force_flush)
        idle = received.spans()[before:]
        assert idle == [], sorted({(s.scope, s.name) for s in idle})

        # Housekeeping that acts: the delivered wake is deleted, and that pass is one span.
        standin.enqueue_reply("On it.", model=stack.model)
        await stack.replied("@planner plan")

        def deleted(spans: list[Got]) -> bool:
            return any(s.name == "delete delivered wakes" for s in spans)

        spans = await flushed_until(received, export, deleted, rounds=600)
    cleanups = [s for s in spans if s.scope == "quayutec.housekeeping"]
    assert cleanups and {s.name for s in cleanups} == {"delete delivered wakes"}
    assert all(s.attr("quayutec.housekeeping.deleted") >= 1 for s in cleanups)
    assert all(not s.span.parent_span_id for s in cleanups)
    # No database span without a parent, ever (LISTEN, the loops' queries): each is part of a call.
    database = [s for s in spans if s.scope.startswith("opentelemetry.instrumentation.asyncpg")]
    assert database
    assert [s.name for s in database if not s.span.parent_span_id] == []


# The stable semantic-convention names our spans may carry (gRPC's are the RPC conventions' own),
# and the pre-stable ones that must never appear again.
STABLE_ATTRIBUTES = frozenset(
    {
        # gRPC (the stable RPC conventions)
        "rpc.system.name",
        "rpc.method",
        "rpc.response.status_code",
        "network.peer.address",
        "network.peer.port",
        "user_agent.original",
        # PostgreSQL (database conventions, stable)
        "db.system.name",
        "db.namespace",
        "db.query.text",
        "db.query.summary",
        "db.operation.name",
        "server.address",
        "server.port",
        "network.transport",
        "error.type",
        # HTTP client (stable)
        "http.request.method",
        "http.response.status_code",
        "url.full",
        "network.protocol.version",
        # the model call (GenAI conventions)
        "gen_ai.operation.name",
        "gen_ai.provider.name",
        "gen_ai.request.model",
        "gen_ai.response.model",
        "gen_ai.response.finish_reasons",
        "gen_ai.usage.input_tokens",
        "gen_ai.usage.output_tokens",
    }
)
PRE_STABLE = ("net.peer.", "net.host.", "http.method", "http.url", "http.status_code", "db.statement", "db.system")
# The pre-stable RPC names, which must never appear (rpc.system.name is not one of them).
PRE_STABLE_RPC = frozenset({"rpc.system", "rpc.service", "rpc.grpc.status_code", "rpc.user_agent"})


async def test_span_attributes_are_stable_convention_names(
    collector: tuple[Collector, SpanCapture], standin: StandinProvider, database_url: str
) -> None:
    received, export = collector
    async with wake_stack(database_url, standin) as stack:
        standin.enqueue_reply("On it.", model=stack.model)
        await stack.replied("@planner plan")
        spans = await flushed_until(received, export, settled_wakes(1))

    scopes = {s.scope.split(".")[-1] for s in spans}
    assert {"grpc", "asyncpg", "httpx"} <= scopes, scopes  # every instrumentation was seen
    names = {name for s in spans for name in s.attribute_names()}
    ours = {name for name in names if name.startswith("quayutec.")}
    assert names - ours <= STABLE_ATTRIBUTES, sorted(names - ours - STABLE_ATTRIBUTES)
    assert not [n for n in names if n.startswith(PRE_STABLE) and n != "db.system.name"]
    assert not names & PRE_STABLE_RPC
    # Every gRPC span has the stable names, with the stable types.
    rpc = [s for s in spans if s.attr("rpc.system.name") == "grpc"]
    assert rpc and {s.scope for s in rpc} == {"opentelemetry.instrumentation.grpc"}
    for s in rpc:
        assert s.attr("rpc.method") == s.name and "/" in s.name and s.name.startswith(("quayutec.v1.", "lf.a2a.")), (
            s.name
        )
        assert isinstance(s.attr("rpc.response.status_code"), str), s.name
        if s.span.kind == SERVER:
            assert isinstance(s.attr("network.peer.port"), int), s.name
        else:
            assert s.attr("server.address") == "127.0.0.1" and isinstance(s.attr("server.port"), int), s.name
    assert {s.attr("rpc.response.status_code") for s in rpc} >= {"OK"}
    # gRPC span names are "package.Service/Method", without the leading slash.
    assert not [s.name for s in spans if s.name.startswith("/")]
    assert "quayutec.v1.RoomService/ReadRunContext" in {s.name for s in spans}
    # Database spans are named by the named query they sent (a transaction's by its keyword).
    database = {s.name for s in spans if s.scope.startswith("opentelemetry.instrumentation.asyncpg")}
    named = {"room/post_message", "room/run_context_with_run", "claims/claim_many"}
    assert named <= database, sorted(database)
    assert not [n for n in database if "/" not in n and n not in ("BEGIN", "COMMIT", "ROLLBACK")], sorted(database)
    # Every span's resource names the service and its version (the installed package's).
    assert {s.resource.get("service.version") for s in spans} == {service_version()} != {"unknown"}
    assert all(s.resource.get("service.name") for s in spans)


WAKES = 10


async def test_each_of_concurrent_wakes_reaches_its_claim_start_and_settlement(
    collector: tuple[Collector, SpanCapture], standin: StandinProvider, database_url: str
) -> None:
    received, export = collector
    async with wake_stack(database_url, standin) as stack:
        # One post mentioning ten agents: ten wakes committed together, leased and delivered as one batch.
        agents = [stack.agent_id]
        for i in range(1, WAKES):
            agent = gateway_pb2.RegisterAgentRequest(
                name=f"helper{i}", provider=common_pb2.PROVIDER_ANTHROPIC, model=stack.model, provider_key="sk-ant-x"
            )
            agents.append((await stack.gw.RegisterAgent(agent, timeout=10)).agent.agent_id)
        standin.enqueue_reply("On it.", model=stack.model, times=WAKES)
        posted = await stack.gw.PostMessage(
            gateway_pb2.PostMessageRequest(
                room_id=stack.room_id, person="ana", body="everyone: plan the launch", mention_agent_ids=agents
            ),
            timeout=10,
        )
        wakes = dict(zip(posted.wake_ids, agents, strict=True))
        wake_ids = list(wakes)
        for wake_id, agent_id in wakes.items():
            run = await ended_run(stack.gw, run_id_for(agent_id, wake_id))
            assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error

        def delivered(spans: list[Got]) -> bool:  # each delivery's span ends after its settlement
            ended = {s.attr("quayutec.wake_id") for s in spans if s.name == "deliver wake"}
            return set(wake_ids) <= ended

        spans = await flushed_until(received, export, delivered)
    figures = walk(spans, wake_ids)
    print(f"\nthe walk: {figures.figures()}")
    assert figures.missing == {step: [] for step in STEPS}, figures.figures()
    assert figures.orphans == [], figures.orphans
    # Each batched call's span names the wakes it carried (one call each here: one leased batch), and
    # each wake's own trace shows it: the call is in that trace, or a span of that trace links to it.
    traces = {one(spans, "deliver wake", quayutec_wake_id=w).trace_id: w for w in wake_ids}
    for name in ("ClaimMany batch", "StartRuns batch", "SettleWakes batch"):
        (batch,) = [s for s in spans if s.name == name]
        assert set(batch.attr("quayutec.wake_ids")) == set(wake_ids), name
        shown = {traces[s.trace_id] for s in spans if s.trace_id in traces and s.links_to(batch)}
        assert shown | {traces[batch.trace_id]} == set(wake_ids), name
    # The servers of those calls name the wakes too.
    for name in ("ClaimsService/ClaimMany", "RuntimeService/StartRuns", "RoomService/SettleWakes"):
        server = one(spans, f"quayutec.v1.{name}", **{"rpc.response.status_code": "OK"}, kind=SERVER)
        assert set(server.attr("quayutec.wake_ids")) == set(wake_ids), name


def _remote(flags: int) -> trace.Span:
    """A caller's span we never receive: a trace and span id of its own, sampled (01) or not (00)."""
    return trace.NonRecordingSpan(
        SpanContext(
            trace_id=int(uuid.uuid4().hex, 16),
            span_id=int(uuid.uuid4().hex[:16], 16),
            is_remote=True,
            trace_flags=TraceFlags(flags),
        )
    )


@pytest.mark.parametrize("flags", [0x00, 0x01])
async def test_a_callers_traceparent_is_a_link_and_our_sampler_decides(
    collector: tuple[Collector, SpanCapture], standin: StandinProvider, database_url: str, flags: int
) -> None:
    received, export = collector
    async with wake_stack(database_url, standin) as stack:
        standin.enqueue_reply("On it.", model=stack.model)
        caller = _remote(flags)
        traceparent = (
            f"00-{caller.get_span_context().trace_id:032x}-{caller.get_span_context().span_id:016x}-{flags:02x}"
        )
        with suppress_instrumentation():  # the caller's own client is not ours: its traceparent goes as it is
            posted = await stack.gw.PostMessage(
                gateway_pb2.PostMessageRequest(
                    room_id=stack.room_id, person="ana", body="@planner plan", mention_agent_ids=[stack.agent_id]
                ),
                metadata=(("traceparent", traceparent),),
                timeout=10,
            )
        (wake_id,) = posted.wake_ids
        run = await ended_run(stack.gw, run_id_for(stack.agent_id, wake_id))
        assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
        spans = await flushed_until(received, export, settled_wakes(1))

    # The Gateway's span: a root of ours (sampled whatever the caller's flags), linked to the caller.
    door = one(spans, "quayutec.v1.GatewayService/PostMessage", quayutec_message_id=posted.message.message_id)
    assert door.span.kind == SERVER and not door.span.parent_span_id
    assert door.trace_id != f"{caller.get_span_context().trace_id:032x}"
    assert door.attr("quayutec.caller.trace_id") == f"{caller.get_span_context().trace_id:032x}"
    assert [(link.trace_id, link.span_id) for link in door.span.links] == [
        (caller.get_span_context().trace_id.to_bytes(16, "big"), caller.get_span_context().span_id.to_bytes(8, "big"))
    ]
    # The post's Room span is in our trace, and the wake it made links back to it.
    room_post = one(spans, "quayutec.v1.RoomService/PostMessage", quayutec_message_id=posted.message.message_id)
    assert room_post.trace_id == door.trace_id
    assert one(spans, "deliver wake", quayutec_wake_id=wake_id).links_to(room_post)
    # No span of ours lost its parent.
    assert walk(spans, [wake_id]).orphans == []


async def test_an_expected_refusal_is_a_status_not_an_exception(
    collector: tuple[Collector, SpanCapture], standin: StandinProvider, database_url: str
) -> None:
    received, export = collector
    async with wake_stack(database_url, standin) as stack:
        missing = str(uuid.uuid4())
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stack.gw.GetRun(gateway_pb2.GetRunRequest(run_id=missing), timeout=10)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND

        def answered(spans: list[Got]) -> bool:
            return len([s for s in spans if s.name == "quayutec.v1.GatewayService/GetRun"]) >= 2

        spans = await flushed_until(received, export, answered)
    calls = [s for s in spans if s.name == "quayutec.v1.GatewayService/GetRun"]
    assert {s.span.kind for s in calls} == {SERVER, Span.SPAN_KIND_CLIENT}
    for s in calls:
        assert s.attr("rpc.response.status_code") == "NOT_FOUND" == s.attr("error.type"), s.span.kind
        # The RPC conventions: an error of the client's call; the server's status is left unset.
        wanted = Status.STATUS_CODE_ERROR if s.span.kind == Span.SPAN_KIND_CLIENT else Status.STATUS_CODE_UNSET
        assert s.span.status.code == wanted, s.span.kind
        assert [e.name for e in s.span.events] == [], s.span.kind


async def test_an_expired_approvals_continuation_links_to_the_expiry(
    collector: tuple[Collector, SpanCapture], standin: StandinProvider, database_url: str
) -> None:
    received, export = collector
    gateway_env = {"QUAYUTEC_GATEWAY_EXPIRE_INTERVAL_SECONDS": "0.2"}
    async with wake_stack(database_url, standin, gateway_env=gateway_env) as stack:
        await stack.gw.SetAgentRights(
            gateway_pb2.SetAgentRightsRequest(agent_id=stack.agent_id, remember=common_pb2.ACTION_RIGHT_HOLD),
            timeout=10,
        )
        remember = {"name": "remember", "arguments": {"text": "launch on Friday", "private": False}}
        standin.enqueue_reply("Noted.", [remember], model=stack.model)
        (wake_id,) = (await stack.post("@planner remember the launch day")).wake_ids
        run_id = run_id_for(stack.agent_id, wake_id)
        await run_reaching(stack.gw, run_id, lambda r: r.status == common_pb2.RUN_STATUS_PARKED)
        # Nobody decides: the approval's time runs out.
        connection = await asyncpg.connect(database_url)
        try:
            await connection.execute(
                "UPDATE waitpoints SET expires_at = now() - interval '1 minute' WHERE run_id = $1", run_id
            )
        finally:
            await connection.close()
        run = await ended_run(stack.gw, run_id)
        spans = await flushed_until(received, export, settled_wakes(2))

    parking = one(spans, "quayutec.v1.RoomService/CreateWaitpoint", quayutec_run_id=run_id)
    expiry = one(spans, "expire approvals", quayutec_run_id=run_id)
    assert expiry.attr("quayutec.run_ids") == (run_id,)
    assert not expiry.span.parent_span_id and expiry.links_to(parking)
    # The continuation's delivery links to the expiry, its run to the parking, and its trace is the ledger's.
    delivery = one(spans, "deliver wake", **{"quayutec.wake.kind": "decision"})
    assert delivery.links_to(expiry)
    assert delivery.trace_id == run.trace_ids[-1]
    continuation = one(spans, "run", quayutec_run_id=run_id, quayutec_wake_id=delivery.attr("quayutec.wake_id"))
    assert continuation.links_to(parking)
    # The Gateway's housekeeping pass that expired it names the run.
    assert run_id in one(spans, "housekeeping", **{"quayutec.housekeeping.expired": 1}).attr("quayutec.run_ids")
