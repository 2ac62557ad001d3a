"""Our traces read back from a real Jaeger v2's own query API (issue 44, flows 1 to 4).

The four services run as processes exporting to the session's Jaeger through the standard OTEL_*
variables (tests.harness.traced_stack), one stack for the whole module. Each test drives a flow, reads
its traces with ``GET /api/v3/traces/{id}`` (and ``/api/v3/services``), and checks the promises of
docs/operations.md ("Following a run in Jaeger"): the span tree drawn there, no missing parent, the
links between a post and its wake, a batch and its wakes, a parked run and its decision or expiry,
and how a retried model attempt is marked. Run with ``-s`` to see what Jaeger returned.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
import pytest_asyncio

from quayutec.ledger import run_id_for
from quayutec.v1 import common_pb2, gateway_pb2
from services.runtime.standin import StandinProvider
from tests.conftest import create_test_database, drop_test_database
from tests.harness.gateway import run_reaching
from tests.harness.jaeger import Jaeger, JSpan, got_of
from tests.harness.traced_stack import SERVICE_NAMES, World, traced_stack, traced_world
from tests.harness.walk import STEPS, walk

pytestmark = pytest.mark.asyncio(loop_scope="module")

# The Gateway's expiry pass runs often, so an approval whose time ran out is expired at once (flow 3).
STACK_ENV = {"QUAYUTEC_GATEWAY_EXPIRE_INTERVAL_SECONDS": "0.2"}
DATABASE_SCOPE = "opentelemetry.instrumentation.asyncpg"
GRPC_SCOPE = "opentelemetry.instrumentation.grpc"
REMEMBER = {"name": "remember", "arguments": {"text": "launch on Friday", "private": False}}
WAKES = 10


@dataclass
class Flows:
    world: World
    standin: StandinProvider
    database_url: str
    jaeger: Jaeger

    async def agent(self, name: str, model: str) -> str:
        """Another agent of Acme's, on a model of its own (its scripted answers are its own)."""
        request = gateway_pb2.RegisterAgentRequest(
            name=f"{name}-{uuid.uuid4().hex[:6]}",
            provider=common_pb2.PROVIDER_ANTHROPIC,
            model=model,
            provider_key="sk-ant-traced-not-a-real-key",
        )
        agent_id: str = (await self.world.acme.RegisterAgent(request, timeout=10)).agent.agent_id
        return agent_id

    async def post(self, body: str, agents: Sequence[str]) -> gateway_pb2.PostMessageResponse:
        request = gateway_pb2.PostMessageRequest(
            room_id=self.world.room_id, person="ana", body=body, mention_agent_ids=list(agents)
        )
        posted: gateway_pb2.PostMessageResponse = await self.world.acme.PostMessage(request, timeout=10)
        return posted

    async def ended(self, agent_id: str, wake_id: str) -> common_pb2.Run:
        return await run_reaching(
            self.world.acme, run_id_for(agent_id, wake_id), lambda r: r.step == common_pb2.RUN_STEP_ENDED, "end"
        )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def flows(template_ready: str, jaeger: Jaeger) -> AsyncIterator[Flows]:
    """One traced stack (four processes) and its world for every flow of this module."""
    url = await create_test_database(template_ready)
    try:
        with StandinProvider() as standin:
            async with (
                traced_stack(url, standin, jaeger, extra_env=STACK_ENV) as stack,
                traced_world(stack, standin) as world,
            ):
                yield Flows(world, standin, url, jaeger)
    finally:
        await drop_test_database(template_ready, url)


# Reading what Jaeger returned.


def label(span: JSpan) -> str:
    return f"{span.name} [{span.service.removeprefix('quayutec-')} {span.kind}]"


def orphans(spans: Iterable[JSpan]) -> list[str]:
    """Spans whose parent is not in what Jaeger returned."""
    spans = list(spans)
    ids = {s.span_id for s in spans}
    return [label(s) for s in spans if s.parent_span_id and s.parent_span_id not in ids]


def tree(spans: Sequence[JSpan], *, database: bool = False) -> list[str]:
    """The trace as indented lines (children sorted by label), database spans left out unless asked."""
    kept = [s for s in spans if database or not s.scope.startswith(DATABASE_SCOPE)]
    ids = {s.span_id for s in kept}
    children: dict[str, list[JSpan]] = {}
    for s in kept:
        parent = s.parent_span_id if s.parent_span_id in ids else ""
        children.setdefault(parent, []).append(s)
    lines: list[str] = []

    def draw(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=label):
            lines.append("    " * depth + label(s))
            draw(s.span_id, depth + 1)

    draw("", 0)
    return lines


def parse_tree(text: str) -> list[str]:
    """An indented tree written as ``tree`` draws it, in the same order (children sorted)."""
    rows = [line for line in text.strip("\n").splitlines() if line.strip()]
    indent = min(len(r) - len(r.lstrip()) for r in rows)
    parsed: list[tuple[int, str, list[Any]]] = []
    stack: list[tuple[int, list[Any]]] = [(-1, parsed)]
    for row in rows:
        depth = (len(row) - len(row.lstrip()) - indent) // 4
        node: tuple[int, str, list[Any]] = (depth, row.strip(), [])
        while stack[-1][0] >= depth:
            stack.pop()
        stack[-1][1].append(node)
        stack.append((depth, node[2]))
    lines: list[str] = []

    def draw(nodes: list[Any], depth: int) -> None:
        for _, text_, kids in sorted(nodes, key=lambda n: n[1]):
            lines.append("    " * depth + text_)
            draw(kids, depth + 1)

    draw(parsed, 0)
    return lines


def one(spans: Iterable[JSpan], name: str, **attributes: Any) -> JSpan:
    """The one span called ``name`` whose attributes (``quayutec_x`` for ``quayutec.x``) match."""
    wanted = {key.replace("_", ".", 1) if key.startswith("quayutec_") else key: v for key, v in attributes.items()}
    kind = wanted.pop("kind", None)
    spans = list(spans)
    found = [
        s for s in spans if s.name == name and kind in (None, s.kind) and all(s.attr(k) == v for k, v in wanted.items())
    ]
    assert len(found) == 1, (
        f"Jaeger returned {len(found)} spans {name} {wanted}; names: {sorted({label(s) for s in spans})}"
    )
    return found[0]


def unanswered(spans: Iterable[JSpan]) -> list[str]:
    """gRPC client spans with no server span under them in what Jaeger returned."""
    spans = list(spans)
    served = {s.parent_span_id for s in spans if s.kind == "server"}
    return [label(s) for s in spans if s.scope == GRPC_SCOPE and s.kind == "client" and s.span_id not in served]


def has(*names: str) -> Callable[[list[JSpan]], bool]:
    """Done when every one of ``names`` is there, no span's parent is missing and every call's server
    span has arrived (each service exports on its own: a client's span may be stored before its server's)."""

    def done(spans: list[JSpan]) -> bool:
        present = {s.name for s in spans}
        return all(n in present for n in names) and not orphans(spans) and not unanswered(spans)

    return done


def per_service(spans: Iterable[JSpan]) -> dict[str, int]:
    return dict(sorted(Counter(s.service for s in spans).items()))


def show(title: str, spans: Sequence[JSpan]) -> None:
    links = sum(len(s.links) for s in spans)
    print(f"\n{title}: {len(spans)} spans {per_service(spans)}, {links} links, orphans {orphans(spans)}")
    print("\n".join("    " + line for line in tree(spans)))


async def linked(jaeger: Jaeger, span: JSpan, name: str) -> tuple[JSpan, list[JSpan]]:
    """The span called ``name`` that ``span`` links to, in the other trace Jaeger returns (and that trace)."""
    targets = {(link.trace_id, link.span_id) for link in span.links}
    for trace_id in sorted({t for t, _ in targets if t != span.trace_id}):
        other = await jaeger.trace(
            trace_id, until=lambda spans: any((s.trace_id, s.span_id) in targets for s in spans) and has()(spans)
        )
        found = [s for s in other if (s.trace_id, s.span_id) in targets and s.name == name]
        if found:
            return found[0], other
    raise AssertionError(f"{label(span)} links to {sorted(targets)}: no span {name} among them in Jaeger")


# Flow 1: one wake from a person's post to the reply.


def call(method: str, client: str, server: str, depth: int) -> list[str]:
    """A gRPC call as ``tree`` draws it: the client's span, the server's under it."""
    name = f"quayutec.v1.{method}"
    return ["    " * depth + f"{name} [{client} client]", "    " * (depth + 1) + f"{name} [{server} server]"]


def wake_tree(run: Sequence[str], start: Sequence[str] = ()) -> list[str]:
    """docs/operations.md's "One wake's span tree" (a batch of one, database spans left out), as
    ``tree`` draws it: ``run`` the children of ``run`` (``chat <model>`` an attempt with its POST, any
    other name a Room call), ``start`` the Room calls StartRun makes besides the claim."""
    lines = ["deliver wake [gateway producer]", "    StartRun [runtime internal]"]
    lines += call("ClaimsService/ClaimOnce", "runtime", "claims", 2)
    for method in start:
        lines += call(f"RoomService/{method}", "runtime", "room", 2)
    lines.append("        run [runtime internal]")
    for item in run:
        if item.startswith("chat "):
            lines += [f"            {item} [runtime client]", "                POST [runtime client]"]
        else:
            lines += call(f"RoomService/{item}", "runtime", "room", 3)
    lines += call("RoomService/SettleWakes", "gateway", "room", 1)
    lines += call("RuntimeService/StartRuns", "gateway", "runtime", 1)
    return parse_tree("\n".join(lines))


async def test_one_wake_from_a_post_to_the_reply(flows: Flows) -> None:
    world, jaeger = flows.world, flows.jaeger
    flows.standin.enqueue_reply("On it.", model=world.model)
    posted = await world.post("@planner plan the launch")
    (wake_id,) = posted.wake_ids
    run = await flows.ended(world.agent_id, wake_id)
    assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error

    spans = await jaeger.trace(run.trace_id, until=has("deliver wake", "StartRun", "run", f"chat {world.model}"))
    show(f"flow 1, the wake's trace {run.trace_id}", spans)
    services = await jaeger.services()
    print(f"flow 1, /api/v3/services: {sorted(services)}")

    # Every service is a Jaeger service, and the wake's trace has spans of all four.
    assert set(SERVICE_NAMES) <= set(services), f"Jaeger's services: {services}"
    assert set(per_service(spans)) == set(SERVICE_NAMES), f"the wake's spans per service: {per_service(spans)}"
    # The tree is the one the docs draw, and no span's parent is missing (database spans included).
    wanted = wake_tree([f"chat {world.model}", "ReadRunContext", "PostMessage"])
    assert tree(spans) == wanted, "\n".join(tree(spans))
    assert orphans(spans) == [], orphans(spans)
    assert unanswered(spans) == [], unanswered(spans)
    assert [s.name for s in spans if s.scope.startswith(DATABASE_SCOPE) and not s.parent_span_id] == []

    # The wake's ids: the root names the wake and the run, as do StartRun and run.
    delivery = one(spans, "deliver wake", quayutec_wake_id=wake_id)
    assert not delivery.parent_span_id, "deliver wake is the root of the wake's trace"
    for name in ("deliver wake", "StartRun", "run"):
        span = one(spans, name)
        assert (span.attr("quayutec.wake_id"), span.attr("quayutec.run_id")) == (wake_id, run.run_id), label(span)
    # The reply is in the wake's trace: the Room's PostMessage with the reply's message id and the run.
    reply = one(spans, "quayutec.v1.RoomService/PostMessage", kind="server")
    assert reply.attr("quayutec.message_id") == run.posted_message_id
    assert reply.attr("quayutec.run_id") == run.run_id

    # The post <-> wake link: deliver wake links to the Room's PostMessage of the post, in the post's trace.
    room_post, post_trace = await linked(jaeger, delivery, "quayutec.v1.RoomService/PostMessage")
    show(f"flow 1, the post's trace {room_post.trace_id} (linked from deliver wake)", post_trace)
    assert room_post.trace_id != run.trace_id
    assert room_post.kind == "server" and room_post.service == "quayutec-room"
    assert room_post.attr("quayutec.message_id") == posted.message.message_id
    assert room_post.attr("quayutec.wake_ids") == (wake_id,)
    door = one(post_trace, "quayutec.v1.GatewayService/PostMessage", kind="server")
    assert door.attr("quayutec.message_id") == posted.message.message_id
    assert door.attr("quayutec.wake_ids") == (wake_id,)
    assert orphans(post_trace) == [], orphans(post_trace)


# Flow 2: a batched StartRuns of ten wakes.

BATCHES = {
    "StartRuns batch": "quayutec.v1.RuntimeService/StartRuns",
    "ClaimMany batch": "quayutec.v1.ClaimsService/ClaimMany",
    "SettleWakes batch": "quayutec.v1.RoomService/SettleWakes",
}


async def test_a_batch_of_ten_wakes_each_complete_and_linked_both_ways(flows: Flows) -> None:
    world, jaeger = flows.world, flows.jaeger
    agents = [world.agent_id] + [await flows.agent(f"helper{i}", world.model) for i in range(1, WAKES)]
    flows.standin.enqueue_reply("On it.", model=world.model, times=WAKES)
    # One post mentioning ten agents: ten wakes committed together, leased together, started in one call.
    posted = await flows.post("everyone: plan the launch", agents)
    wakes = dict(zip(posted.wake_ids, agents, strict=True))
    runs = {wake_id: await flows.ended(agent_id, wake_id) for wake_id, agent_id in wakes.items()}
    assert {w: r.status for w, r in runs.items()} == dict.fromkeys(wakes, common_pb2.RUN_STATUS_SUCCEEDED)

    traces: dict[str, list[JSpan]] = {}
    for wake_id, run in runs.items():
        traces[wake_id] = await jaeger.trace(run.trace_id, until=has("deliver wake", "StartRun", "run"))
    spans = [s for t in traces.values() for s in t]
    print(f"\nflow 2: {WAKES} wakes, {len(spans)} spans in {len(traces)} traces {per_service(spans)}")
    for wake_id, trace_spans in traces.items():
        names = Counter(s.name for s in trace_spans if not s.scope.startswith(DATABASE_SCOPE))
        print(
            f"    wake {wake_id[:8]}: {len(trace_spans)} spans {per_service(trace_spans)}, "
            f"{sum(len(s.links) for s in trace_spans)} links, {dict(names)}"
        )

    # Each wake's trace: its own deliver wake (the root), StartRun and run, naming the wake; no orphan.
    for wake_id, trace_spans in traces.items():
        for name in ("deliver wake", "StartRun", "run"):
            span = one(trace_spans, name, quayutec_wake_id=wake_id)
            assert span.attr("quayutec.run_id") == runs[wake_id].run_id, label(span)
        assert not one(trace_spans, "deliver wake").parent_span_id
        assert orphans(trace_spans) == [], (wake_id, orphans(trace_spans))

    # Each wake reaches its claim, its start and its settlement (the walk of tests/harness/walk.py).
    figures = walk([got_of(s) for s in spans], list(wakes))
    print(f"flow 2, the walk over Jaeger's answer: {figures.figures()}")
    assert figures.missing == {step: [] for step in STEPS}, figures.figures()
    assert figures.orphans == [], figures.orphans

    # The batch spans: one each, in a wake's trace, naming all ten wakes, linking to each wake's span;
    # each other wake's span links back to it.
    trace_of = {run.trace_id: wake_id for wake_id, run in runs.items()}
    for name, server_name in BATCHES.items():
        found = [s for s in spans if s.name == name]
        assert len(found) == 1, f"Jaeger returned {len(found)} spans {name}"
        (batch,) = found
        home = trace_of[batch.trace_id]
        linked_to = {trace_of.get(link.trace_id) for link in batch.links}
        linking_back = {trace_of[s.trace_id] for s in spans if s.links_to(batch)}
        print(
            f"flow 2, {name} in wake {home[:8]}'s trace: batch.size {batch.attr('quayutec.batch.size')}, "
            f"{len(batch.links)} links to {len(linked_to)} wakes' traces, {len(linking_back)} wakes linking back"
        )
        assert set(batch.attr("quayutec.wake_ids")) == set(wakes), name
        assert batch.attr("quayutec.batch.size") == WAKES, name
        assert linked_to | {home} == set(wakes), f"{name} links to {len(linked_to)} wakes' traces"
        assert linking_back | {home} == set(wakes), f"{len(linking_back)} wakes link back to {name}"
        # The call it made is under it, its server naming the ten wakes too.
        server = one(traces[home], server_name, kind="server")
        assert set(server.attr("quayutec.wake_ids")) == set(wakes), server_name


# Flow 3: a held action approved, and one expired.


async def test_a_held_action_approved_and_one_expired_each_continuation_linked(flows: Flows) -> None:
    world, jaeger = flows.world, flows.jaeger
    model = f"held-{uuid.uuid4().hex[:6]}"
    keeper = await flows.agent("keeper", model)
    await world.acme.SetAgentRights(
        gateway_pb2.SetAgentRightsRequest(agent_id=keeper, remember=common_pb2.ACTION_RIGHT_HOLD), timeout=10
    )
    flows.standin.enqueue_reply("Noted.", [REMEMBER], model=model, times=2)
    (approved_wake,) = (await flows.post("@keeper remember the launch day", [keeper])).wake_ids
    (expired_wake,) = (await flows.post("@keeper remember the venue", [keeper])).wake_ids
    approved_id, expired_id = run_id_for(keeper, approved_wake), run_id_for(keeper, expired_wake)
    for run_id in (approved_id, expired_id):
        await run_reaching(world.acme, run_id, lambda r: r.status == common_pb2.RUN_STATUS_PARKED, "park")

    # One is approved by a person of the company.
    approvals = (await world.acme.ListApprovals(gateway_pb2.ListApprovalsRequest(), timeout=10)).waitpoints
    (approval,) = [a for a in approvals if a.run_id == approved_id]
    await world.acme.DecideApproval(
        gateway_pb2.DecideApprovalRequest(token=approval.token, index=0, person="ana", approve=True), timeout=10
    )
    approved = await flows.ended(keeper, approved_wake)
    # Nobody decides the other: its time runs out, and the Gateway's expiry pass expires it.
    connection = await asyncpg.connect(flows.database_url)
    try:
        await connection.execute(
            "UPDATE waitpoints SET expires_at = now() - interval '1 minute' WHERE run_id = $1", expired_id
        )
    finally:
        await connection.close()
    expired = await flows.ended(keeper, expired_wake)
    assert approved.status == common_pb2.RUN_STATUS_SUCCEEDED, approved.error
    assert [a.outcome for a in approved.actions] == [common_pb2.ACTION_OUTCOME_DONE], approved.actions
    assert [a.outcome for a in expired.actions] == [common_pb2.ACTION_OUTCOME_NOT_DONE], expired.actions
    assert len(approved.trace_ids) == len(expired.trace_ids) == 2, (approved.trace_ids, expired.trace_ids)

    # A continuation's tree is the wake's from deliver wake down, with no room read or model call:
    # StartRun reads the waitpoint, run reads the row, records RUNNING, does the approved writes (the
    # last one carrying the ended row) and ends (a RecordRun of its own when nothing is written).
    outcomes = (
        (approved, "quayutec.v1.RoomService/DecideHeldAction", "WriteMemory"),
        (expired, "expire approvals", "RecordRun"),
    )
    for run, cause_name, last in outcomes:
        first_trace, continued_trace = run.trace_ids
        first = await jaeger.trace(
            first_trace, until=has("deliver wake", "run", "quayutec.v1.RoomService/CreateWaitpoint")
        )
        continued = await jaeger.trace(continued_trace, until=has("deliver wake", "StartRun", "run"))
        show(f"flow 3, run {run.run_id[:8]}'s first trace (parked)", first)
        show(f"flow 3, run {run.run_id[:8]}'s continuation ({cause_name})", continued)
        # The parked run's first trace: its declared action recorded before the reply, then the parking.
        parked = wake_tree([f"chat {model}", "ReadRunContext", "RecordRun", "PostMessage", "CreateWaitpoint"])
        assert tree(first) == parked, "\n".join(tree(first))
        parking = one(first, "quayutec.v1.RoomService/CreateWaitpoint", kind="server", quayutec_run_id=run.run_id)

        # The continuation's delivery links to the decision or the expiry, in a trace of its own.
        delivery = one(continued, "deliver wake", **{"quayutec.wake.kind": "decision"})
        cause, cause_trace = await linked(jaeger, delivery, cause_name)
        show(f"flow 3, the trace of {cause_name}", cause_trace)
        assert cause.trace_id not in (first_trace, continued_trace)
        decision_wake = delivery.attr("quayutec.wake_id")
        assert decision_wake not in (approved_wake, expired_wake)
        # Inside it, deliver wake, StartRun and run name the decision's wake and the parked run;
        # its run links to the parking.
        for name in ("deliver wake", "StartRun", "run"):
            span = one(continued, name)
            assert (span.attr("quayutec.wake_id"), span.attr("quayutec.run_id")) == (decision_wake, run.run_id), name
        assert one(continued, "run").links_to(parking), "the continuation's run links to CreateWaitpoint"
        # The same tree from deliver wake down, with no room read and no model call.
        wanted = wake_tree(["GetRun", "RecordRun", last], start=["GetWaitpoint"])
        assert tree(continued) == wanted, "\n".join(tree(continued))
        assert orphans(first) == orphans(continued) == orphans(cause_trace) == []

        if cause_name == "expire approvals":
            assert cause.scope == "quayutec.housekeeping" and cause.service == "quayutec-room", label(cause)
            assert cause.attr("quayutec.run_ids") == (run.run_id,)
            assert not cause.parent_span_id and cause.links_to(parking), "expire approvals links to CreateWaitpoint"
        else:
            assert cause.attr("quayutec.run_id") == run.run_id
            door = one(cause_trace, "quayutec.v1.GatewayService/DecideApproval", kind="server")
            assert door.attr("quayutec.run_id") == run.run_id


# Flow 4: a model answering 429, then the answer.


async def test_a_rate_limited_model_attempt_then_success(flows: Flows) -> None:
    jaeger = flows.jaeger
    model = f"busy-{uuid.uuid4().hex[:6]}"
    agent = await flows.agent("busy", model)
    flows.standin.enqueue_fault("rate_limit", model, retry_after=0.1)
    flows.standin.enqueue_reply("On it.", model=model)
    (wake_id,) = (await flows.post("@busy plan the launch", [agent])).wake_ids
    run = await flows.ended(agent, wake_id)
    assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
    assert [a.status_code for a in run.model_attempts] == [429, 200]

    def two_attempts(spans: list[JSpan]) -> bool:
        return has("run")(spans) and sum(1 for s in spans if s.name == f"chat {model}") == 2

    spans = await jaeger.trace(run.trace_id, until=two_attempts)
    show(f"flow 4, the wake's trace {run.trace_id}", spans)
    attempts = sorted((s for s in spans if s.name == f"chat {model}"), key=lambda s: s.attr("quayutec.model.attempt"))
    for s in attempts:
        print(
            f"    {label(s)}: status {s.status_code}, "
            f"{ {k: v for k, v in s.attributes.items() if not k.startswith('gen_ai.usage')} }, "
            f"events {[(e.name, e.attributes) for e in s.events]}"
        )
    assert [s.attr("quayutec.model.attempt") for s in attempts] == [1, 2], [label(s) for s in attempts]
    run_span = one(spans, "run")
    assert all(s.parent_span_id == run_span.span_id for s in attempts), "each attempt is a child of run"
    for s in attempts:
        assert [label(c) for c in spans if c.parent_span_id == s.span_id] == ["POST [runtime client]"]

    # The first attempt, as the docs say: an error status, error.type rate_limited, the 429, retryable,
    # and the wait before the next attempt as an event; never the provider's error text.
    failed, answered = attempts
    assert failed.status_code == 2, f"the 429 attempt's status code in Jaeger: {failed.status_code}"
    assert failed.attr("error.type") == "rate_limited" == failed.attr("quayutec.model.error_class")
    assert failed.attr("http.response.status_code") == 429
    assert failed.attr("quayutec.model.retryable") is True
    assert [(e.name, e.attributes) for e in failed.events] == [
        ("quayutec.model.retry_wait", {"quayutec.model.wait_seconds": 0.1})
    ]
    assert not any("rate limit" in str(v).lower() for v in failed.attributes.values())
    # The second: no error, the 200 and the usage.
    assert answered.status_code == 0 and answered.attr("error.type") is None
    assert answered.attr("http.response.status_code") == 200
    assert answered.attr("quayutec.model.error_class") == "ok"
    assert isinstance(answered.attr("gen_ai.usage.output_tokens"), int)
    # The ledger row is written before the wait (the run shows the 429 even if it dies waiting).
    recorded = [
        s for s in spans if s.name == "quayutec.v1.RoomService/RecordRun" and s.parent_span_id == run_span.span_id
    ]
    assert len(recorded) == 1, sorted(label(s) for s in spans)
    assert failed.end_ns <= recorded[0].start_ns <= answered.start_ns
    assert orphans(spans) == []
