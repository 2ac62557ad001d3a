"""Our traces read back from a real Jaeger v2 (2.12.0) through its own query API: what a refused
call, an A2A task and a person's WatchRoom stream look like there; the searches docs/operations.md
tells users to make ("What each search finds"), each run as the Jaeger UI makes it; the ``/api/v3``
search, services and operations; and that nothing Jaeger stores holds a key, a prompt or a message.

One stack (the four services as processes, exporting to the session's Jaeger through the standard
``OTEL_*`` variables) serves the whole module: the fixture drives every flow once, records the ids a
user would hold (a run id, a wake id, an error's request id, a task id, ...), and stops the stack,
which flushes every span. The tests then only read Jaeger, polling with a bound until a trace is
stored. Run with ``-s`` to see what Jaeger returned for each flow.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import secrets
import shlex
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import httpx
import pytest
import pytest_asyncio
from a2a.types import a2a_pb2
from opentelemetry.instrumentation.utils import suppress_instrumentation

import quayutec_client
from quayutec.ledger import run_id_for
from quayutec.tls import GATEWAY as GATEWAY_IDENTITY
from quayutec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from quayutec_client.errors import NotFound
from services.gateway.a2a import tenant_of
from services.gateway.auth import KEY_PREFIX
from services.runtime.standin import StandinProvider
from tests.conftest import create_test_database, drop_test_database
from tests.gateway.test_a2a import a2a_client, send_once
from tests.harness.gateway import ended_run, run_reaching
from tests.harness.jaeger import Jaeger, JSpan, rfc3339, spans_of
from tests.harness.traced_stack import SERVICE_NAMES, World, traced_stack, traced_world

pytestmark = pytest.mark.asyncio(loop_scope="module")

REPO = Path(__file__).resolve().parent.parent.parent
# The docs' excerpt of a real answer: a JSON block after this marker.
DOCS_EXCERPT = re.compile(r"<!-- jaeger-excerpt -->\n```json\n(.*?)```", re.S)
# The docs' example queries: a shell block after this marker.
DOCS_QUERIES = re.compile(r"<!-- jaeger-queries -->\n```sh\n(.*?)```", re.S)

GATEWAY, ROOM, RUNTIME = "quayutec-gateway", "quayutec-room", "quayutec-runtime"
SERVER, CLIENT = "server", "client"
# OTLP's status codes, as the query API answers them.
UNSET, ERROR = 0, 2
# The marker every secret and text of the secrets flow carries: a string no span may hold.
MARK = f"qysecret{secrets.token_hex(6)}"
BOUND = 30.0  # the longest a read of ours waits for the services (a failsafe, not a timing)


@dataclass
class Seen:
    """What the flows left a user holding, to search Jaeger by."""

    started: datetime
    room_id: str = ""
    agent_id: str = ""
    vault_id: str = ""
    # The batch post: one post mentioning two agents (two wakes, started in one StartRuns).
    batch_message_id: str = ""
    batch_wake_ids: list[str] = field(default_factory=list)
    batch_runs: list[common_pb2.Run] = field(default_factory=list)
    # A held action approved (a decision trace) and one that ran out (an expiry trace).
    approved_run: common_pb2.Run | None = None
    expired_run: common_pb2.Run | None = None
    # Refusals: another company's post into Acme's private room (the SDK's error), and a bad argument.
    refused_request_id: str = ""
    refused_message: str = ""
    bad_argument_caller: tuple[str, str] = ("", "")  # the traceparent's trace id and span id
    # A2A.
    task_id: str = ""
    a2a_message_id: str = ""
    # A person's WatchRoom stream, and the post made while it was open.
    watch_caller: tuple[str, str] = ("", "")
    watch_request_id: str = ""
    watched_message_id: str = ""
    # The secrets: what went in, and that it went where it was meant to (so its absence means something).
    markers: dict[str, str] = field(default_factory=dict)


def traceparent() -> tuple[str, str, str]:
    """A caller's W3C trace context: (trace id, span id, header)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


async def until_ended(world: World, run_id: str) -> common_pb2.Run:
    return await ended_run(world.acme, run_id)


async def _flows(world: World, standin: StandinProvider, database_url: str, seen: Seen) -> None:
    async with world.stack.channel("gateway", GATEWAY_IDENTITY) as channel:
        await _flows_on(world, standin, database_url, seen, channel)


async def _flows_on(
    world: World, standin: StandinProvider, database_url: str, seen: Seen, channel: grpc.aio.Channel
) -> None:
    gw = world.acme
    seen.room_id, seen.agent_id = world.room_id, world.agent_id
    tag = uuid.uuid4().hex[:6]

    # Secrets flow: an agent whose provider key and system prompt carry the marker, a post whose body
    # does, and a model reply that does. The same post mentions the world's agent too: two wakes.
    seen.markers = {
        "company API key": world.acme_key,
        "the key's secret part": world.acme_key[len(KEY_PREFIX) + 37 :],
        "other company's API key": world.bolt_key,
        "provider key": f"sk-ant-{MARK}-providerkey",
        "system prompt": f"You guard the {MARK}-prompt vault.",
        "message body": f"{MARK}-body open the vault",
        "model reply": f"{MARK}-reply the vault is open",
    }
    vault = (
        await gw.RegisterAgent(
            gateway_pb2.RegisterAgentRequest(
                name=f"vault-{tag}",
                provider=common_pb2.PROVIDER_ANTHROPIC,
                model=f"vault-{tag}",
                provider_key=seen.markers["provider key"],
                system_prompt=seen.markers["system prompt"],
            )
        )
    ).agent
    seen.vault_id = vault.agent_id
    standin.enqueue_reply(seen.markers["model reply"], model=vault.model)
    posted = await gw.PostMessage(
        gateway_pb2.PostMessageRequest(
            room_id=world.room_id,
            person="ana",
            body=seen.markers["message body"],
            mention_agent_ids=[world.agent_id, vault.agent_id],
        )
    )
    seen.batch_message_id = posted.message.message_id
    seen.batch_wake_ids = list(posted.wake_ids)
    agents = [world.agent_id, vault.agent_id]
    seen.batch_runs = [await until_ended(world, run_id_for(a, w)) for a, w in zip(agents, posted.wake_ids, strict=True)]
    # The markers went where they were meant to: the provider was asked with the prompt and the body
    # (and the key, in its header), and the reply is in the room.
    (asked,) = standin.requests(vault.model)
    assert seen.markers["system prompt"] in json.dumps(asked.body)
    assert seen.markers["message body"] in json.dumps(asked.body)
    assert "x-api-key" in asked.headers
    vault_run = seen.batch_runs[1]
    reply = await gw.GetMessage(
        gateway_pb2.GetMessageRequest(room_id=world.room_id, message_id=vault_run.posted_message_id)
    )
    assert seen.markers["model reply"] in reply.message.body

    # A held action approved, and one that runs out.
    await gw.SetAgentRights(
        gateway_pb2.SetAgentRightsRequest(agent_id=world.agent_id, remember=common_pb2.ACTION_RIGHT_HOLD)
    )
    remember = {"name": "remember", "arguments": {"text": "launch on Friday", "private": False}}
    parked = []
    for _ in range(2):
        standin.enqueue_reply("Noted.", [remember], model=world.model)
        (wake_id,) = (await world.post("@planner remember the launch day")).wake_ids
        run_id = run_id_for(world.agent_id, wake_id)
        await run_reaching(gw, run_id, lambda r: r.status == common_pb2.RUN_STATUS_PARKED)
        parked.append(run_id)
    approvals = (await gw.ListApprovals(gateway_pb2.ListApprovalsRequest())).waitpoints
    (approval,) = [a for a in approvals if a.run_id == parked[0]]
    await gw.DecideApproval(
        gateway_pb2.DecideApprovalRequest(token=approval.token, index=0, person="ana", approve=True)
    )
    connection = await asyncpg.connect(database_url)
    try:
        await connection.execute(
            "UPDATE waitpoints SET expires_at = now() - interval '1 minute' WHERE run_id = $1", parked[1]
        )
    finally:
        await connection.close()
    seen.approved_run = await until_ended(world, parked[0])
    seen.expired_run = await until_ended(world, parked[1])

    # Refusals. Bolt (through the Python SDK) posts into a room of Acme's it is not in: the Room says no.
    private = (await gw.CreateRoom(gateway_pb2.CreateRoomRequest(name=f"private-{tag}"))).room
    async with quayutec_client.connect(world.stack.addr("gateway"), world.bolt_key, plaintext=True) as bolt:
        with pytest.raises(NotFound) as refused:
            await bolt.post_message(private.room_id, "let us in", person="bo")
    seen.refused_request_id, seen.refused_message = refused.value.request_id, refused.value.message
    assert seen.refused_request_id
    # A bad argument, refused by the Gateway itself, from a caller with a trace context of its own.
    trace_id, span_id, header = traceparent()
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    # The caller's own client is not ours: earlier tests of the session may have instrumented this
    # process's gRPC clients, which would put this process's trace context in place of the caller's.
    with pytest.raises(grpc.aio.AioRpcError) as bad, suppress_instrumentation():
        await stub.PostMessage(
            gateway_pb2.PostMessageRequest(
                room_id=world.room_id, person="ana", body="hi", mention_agent_ids=["nobody"]
            ),
            metadata=(("authorization", f"Bearer {world.acme_key}"), ("traceparent", header)),
            timeout=10,
        )
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    seen.bad_argument_caller = (trace_id, span_id)

    # An A2A task: Bolt sends work to Acme's agent (non-blocking), then reads the task until the run is over.
    seen.a2a_message_id = str(uuid.uuid4())
    message = a2a_pb2.Message(
        message_id=seen.a2a_message_id, role=a2a_pb2.ROLE_USER, parts=[a2a_pb2.Part(text="summarise the offer")]
    )
    addr = world.stack.addr("gateway")
    async with a2a_client(addr, tenant_of(world.room_id, world.agent_id), world.bolt_key) as (client, card):
        task = await send_once(card, world.bolt_key, message, wait=False)
        seen.task_id = task.id
        # The client retries the same message: the same task comes back.
        assert (await send_once(card, world.bolt_key, message, wait=False)).id == task.id
        waiting = {a2a_pb2.TASK_STATE_SUBMITTED, a2a_pb2.TASK_STATE_WORKING}
        for _ in range(int(BOUND / 0.1)):  # a bound on polling, not a timing assertion
            got = await client.get_task(a2a_pb2.GetTaskRequest(id=task.id))
            if got.status.state not in waiting:
                break
            await asyncio.sleep(0.1)
        assert got.status.state == a2a_pb2.TASK_STATE_INPUT_REQUIRED, got.status  # answered, still open
        # Subscribed to, then cancelled: the subscription ends with the task.
        followed: list[Any] = []
        first = asyncio.Event()

        async def follow() -> None:
            async for event in client.subscribe(a2a_pb2.SubscribeToTaskRequest(id=task.id)):
                followed.append(event)
                first.set()

        subscription = asyncio.create_task(follow())
        await asyncio.wait_for(first.wait(), BOUND)
        canceled = await client.cancel_task(a2a_pb2.CancelTaskRequest(id=task.id))
        assert canceled.status.state == a2a_pb2.TASK_STATE_CANCELED
        await asyncio.wait_for(subscription, BOUND)

    # A person's WatchRoom stream: opened (from cursor 0), a post made while it is open and seen on
    # it, then closed by the watcher.
    trace_id, span_id, header = traceparent()
    seen.watch_caller, seen.watch_request_id = (trace_id, span_id), f"watch-{tag}"
    with suppress_instrumentation():  # as above: the caller's traceparent goes as it is
        call = stub.WatchRoom(
            gateway_pb2.WatchRoomRequest(room_id=world.room_id, after=0),
            metadata=(
                ("authorization", f"Bearer {world.acme_key}"),
                ("traceparent", header),
                ("x-request-id", seen.watch_request_id),
            ),
        )
    # The stream is open once it answers (it replays the room's events from cursor 0).
    await asyncio.wait_for(call.read(), BOUND)
    watched = await gw.PostMessage(gateway_pb2.PostMessageRequest(room_id=world.room_id, person="ana", body="watch me"))
    seen.watched_message_id = watched.message.message_id

    async def until_seen() -> None:
        for _ in range(10_000):  # a bound on the events read
            if seen.watched_message_id in str(await call.read()):
                return
        raise AssertionError("the post never came on the stream")

    await asyncio.wait_for(until_seen(), BOUND)
    call.cancel()


@pytest.fixture(scope="module")
def module_standin() -> Iterator[StandinProvider]:
    with StandinProvider() as provider:
        yield provider


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def seen(template_ready: str, jaeger: Jaeger, module_standin: StandinProvider) -> AsyncIterator[Seen]:
    """Every flow once on one traced stack, stopped (its spans flushed) before the tests read Jaeger."""
    url = await create_test_database(template_ready)
    got = Seen(started=datetime.now(UTC))
    try:
        env = {"QUAYUTEC_GATEWAY_EXPIRE_INTERVAL_SECONDS": "0.2"}
        async with traced_stack(url, module_standin, jaeger, extra_env=env) as stack:
            async with traced_world(stack, module_standin) as world:
                await _flows(world, module_standin, url, got)
        # The services flushed their spans as they stopped; Jaeger has written every one it took.
        counts = await jaeger.stored_all()
        print(f"\n[Jaeger's span counters after the flows] {counts}")
        assert counts["accepted"] <= counts["sent"] + counts["failed"], counts
        yield got
    finally:
        await drop_test_database(template_ready, url)


# Reading Jaeger.


async def trace_with(jaeger: Jaeger, service: str, tags: Mapping[str, str]) -> tuple[str, list[JSpan]]:
    """The one trace the UI's tag search finds for ``tags`` on ``service``, read whole."""
    found = await jaeger.search_tags(service, tags)
    for _ in range(int(BOUND / 0.2)):  # a bound on polling, not a timing assertion
        if found:
            break
        await asyncio.sleep(0.2)
        found = await jaeger.search_tags(service, tags)
    assert len(found) == 1, (service, tags, found)
    return found[0], await jaeger.trace(found[0])


def named(spans: list[JSpan], name: str, kind: str = "", **attributes: Any) -> list[JSpan]:
    return [
        s
        for s in spans
        if s.name == name and (not kind or s.kind == kind) and all(s.attr(k) == v for k, v in attributes.items())
    ]


def show(title: str, spans: list[JSpan], keys: tuple[str, ...] = ()) -> None:
    """Print what Jaeger returned (for the report: run with -s)."""
    print(f"\n[{title}] {len(spans)} spans, services {sorted({s.service for s in spans})}")
    for s in spans:
        attrs = {k: v for k, v in s.attributes.items() if k.startswith("quayutec.") or k in keys}
        print(f"  {s.name} [{s.service} {s.kind}] status={s.status_code} events={[e.name for e in s.events]} {attrs}")


# Flow 5: a refused call.


async def test_a_refused_call_carries_its_status_and_no_exception(jaeger: Jaeger, seen: Seen) -> None:
    # The id the SDK's error names finds the Gateway's span of the call.
    _, spans = await trace_with(jaeger, GATEWAY, {"quayutec.caller.request_id": seen.refused_request_id})
    show("refused: another company's post", spans, ("rpc.response.status_code", "error.type"))
    (door,) = named(spans, "quayutec.v1.GatewayService/PostMessage", SERVER)
    (to_room,) = named(spans, "quayutec.v1.RoomService/PostMessage", CLIENT)
    (room,) = named(spans, "quayutec.v1.RoomService/PostMessage", SERVER)
    assert door.attr("quayutec.caller.request_id") == seen.refused_request_id
    assert room.service == ROOM and door.service == GATEWAY
    # The Room refuses the write (PERMISSION_DENIED); the Gateway, finding the room is not Bolt's
    # (the Room's GetRoom: NOT_FOUND), answers as for a room that does not exist, and says so.
    (looked_up,) = named(spans, "quayutec.v1.RoomService/GetRoom", SERVER)
    for span, code in (
        (door, "NOT_FOUND"),
        (to_room, "PERMISSION_DENIED"),
        (room, "PERMISSION_DENIED"),
        (looked_up, "NOT_FOUND"),
    ):
        assert span.attr("rpc.response.status_code") == code == span.attr("error.type"), span
        assert span.events == (), span
    assert "not found" in seen.refused_message
    # The RPC conventions: the client's span is an error, the servers' status is left unset.
    assert (door.status_code, to_room.status_code, room.status_code) == (UNSET, ERROR, UNSET)
    # Nothing under the refusal wrote anything: no span of the Room's write beyond its checks.
    assert "let us in" not in json.dumps([s.attributes for s in spans])


async def test_a_bad_argument_is_refused_by_the_gateway_alone(jaeger: Jaeger, seen: Seen) -> None:
    caller_trace, caller_span = seen.bad_argument_caller
    _, spans = await trace_with(jaeger, GATEWAY, {"quayutec.caller.trace_id": caller_trace})
    show("refused: a bad argument", spans, ("rpc.response.status_code", "error.type"))
    (door,) = named(spans, "quayutec.v1.GatewayService/PostMessage", SERVER)
    # Refused before the Room was asked: the trace has no Room span, only the Gateway's own key check.
    assert {s.service for s in spans} == {GATEWAY} and not [s for s in spans if "RoomService" in s.name]
    assert door.attr("rpc.response.status_code") == "INVALID_ARGUMENT" == door.attr("error.type")
    assert door.events == () and door.status_code == UNSET
    # The caller's trace context is a link, not a parent: the Gateway's span is the root of our trace.
    assert door.parent_span_id == "" and door.trace_id != caller_trace
    assert [(link.trace_id, link.span_id) for link in door.links] == [(caller_trace, caller_span)]


# Flow 6: an A2A task, and a person's WatchRoom stream.


async def test_an_a2a_task_is_found_by_its_task_id_and_message_id(jaeger: Jaeger, seen: Seen) -> None:
    found = await jaeger.search_tags(GATEWAY, {"quayutec.task_id": seen.task_id})
    spans = [s for trace_id in found for s in await jaeger.trace(trace_id)]
    show("A2A: search quayutec.task_id", spans)
    calls = {s.name for s in spans if s.attr("quayutec.task_id") == seen.task_id and s.kind == SERVER}
    a2a = "lf.a2a.v1.A2AService/"
    assert calls == {a2a + m for m in ("SendMessage", "GetTask", "SubscribeToTask", "CancelTask")}, calls
    sends = named(spans, a2a + "SendMessage", SERVER)
    assert len(sends) == 2  # the send and its retry, each a trace of its own
    for send in sends:
        assert send.attr("quayutec.a2a.message_id") == seen.a2a_message_id
        assert send.attr("rpc.response.status_code") == "OK"
    # The room task's write is under the Gateway's call: the Room's CreateTask (the retry's finds the
    # task made), in the sends' traces.
    created = named(spans, "quayutec.v1.RoomService/CreateTask", SERVER)
    assert created and {c.trace_id for c in created} <= {send.trace_id for send in sends}
    # The subscription is one span that ended with the task.
    (subscribed,) = named(spans, a2a + "SubscribeToTask", SERVER)
    (cancel,) = named(spans, a2a + "CancelTask", SERVER)
    assert subscribed.start_ns < cancel.start_ns and subscribed.end_ns > cancel.end_ns

    # The caller's messageId finds the SendMessage that made the task, and its retry: nothing else.
    found = await jaeger.search_tags_until(GATEWAY, {"quayutec.a2a.message_id": seen.a2a_message_id}, sends[0].trace_id)
    assert sorted(found) == sorted(send.trace_id for send in sends)
    tagged = [s for t in found for s in await jaeger.trace(t) if s.attr("quayutec.a2a.message_id")]
    assert {s.name for s in tagged} == {a2a + "SendMessage"}
    assert await jaeger.search_tags(GATEWAY, {"quayutec.task_id": str(uuid.uuid4())}) == []


async def test_a_watch_room_stream_is_one_span_that_ends_with_the_stream(jaeger: Jaeger, seen: Seen) -> None:
    caller_trace, caller_span = seen.watch_caller
    _, spans = await trace_with(jaeger, GATEWAY, {"quayutec.caller.trace_id": caller_trace})
    show("WatchRoom", spans, ("rpc.response.status_code", "error.type", "rpc.method"))
    (watch,) = named(spans, "quayutec.v1.GatewayService/WatchRoom", SERVER)
    assert watch.attr("quayutec.caller.request_id") == seen.watch_request_id
    assert [(link.trace_id, link.span_id) for link in watch.links] == [(caller_trace, caller_span)]
    # The watcher closed it: the span ends then, recorded as a stream that ended (OK: the gRPC
    # instrumentation does not see the watcher's cancel as an error), with no exception event.
    assert watch.attr("rpc.response.status_code") == "OK" and watch.attr("error.type") is None, watch.attributes
    assert watch.events == () and watch.status_code == UNSET
    # It ended after the post made while it was open (both recorded by the Gateway's own clock).
    _, posted = await trace_with(jaeger, GATEWAY, {"quayutec.message_id": seen.watched_message_id})
    (post,) = named(posted, "quayutec.v1.GatewayService/PostMessage", SERVER)
    assert watch.start_ns < post.start_ns and watch.end_ns > post.end_ns


# Flow 7 and the docs' table "What each search finds": the UI's tag search, per id.


async def test_search_by_wake_id_finds_the_wakes_trace(jaeger: Jaeger, seen: Seen) -> None:
    run = seen.batch_runs[0]
    wake_id = seen.batch_wake_ids[0]
    for service in (GATEWAY, RUNTIME):
        found = await jaeger.search_tags_until(service, {"quayutec.wake_id": wake_id}, run.trace_id)
        print(f"\n[search quayutec.wake_id on {service}] {found}")
        assert found == [run.trace_id], (service, found)
    spans = await jaeger.trace(run.trace_id)
    show("the wake's trace", spans)
    names = {s.name for s in spans}
    assert {"deliver wake", "StartRun", "run"} <= names
    for name in ("deliver wake", "StartRun", "run"):
        assert {s.attr("quayutec.wake_id") for s in named(spans, name)} == {wake_id}, name
    # A made-up wake id finds nothing.
    assert await jaeger.search_tags(GATEWAY, {"quayutec.wake_id": str(uuid.uuid4())}) == []
    # The batched calls sit in one wake's trace; the other wake's trace links to each of them.
    first, other = seen.batch_runs
    batch_trace = await jaeger.trace(first.trace_id)
    batches = {name: named(batch_trace, name) for name in ("StartRuns batch", "ClaimMany batch", "SettleWakes batch")}
    if not all(batches.values()):
        first, other = other, first
        batch_trace = await jaeger.trace(first.trace_id)
        batches = {name: named(batch_trace, name) for name in batches}
    other_spans = await jaeger.trace(other.trace_id)
    (delivery,) = named(other_spans, "deliver wake")
    (start,) = named(other_spans, "StartRun")
    for name, linker in (("StartRuns batch", delivery), ("SettleWakes batch", delivery), ("ClaimMany batch", start)):
        (batch,) = batches[name]
        assert linker.links_to(batch), name


async def other_trace_on_room(jaeger: Jaeger, run: common_pb2.Run, what: str) -> list[JSpan]:
    """The one trace besides the run's own that quayutec-room's search by the run id finds, read whole."""
    found = await jaeger.search_tags_until(ROOM, {"quayutec.run_id": run.run_id}, run.trace_ids[0])
    others = set(found) - set(run.trace_ids)
    print(f"[search quayutec.run_id ({what}) on {ROOM}] {len(found)} traces, {len(others)} not the run's own")
    (other,) = others
    return await jaeger.trace(other)


async def test_search_by_run_id_finds_every_trace_of_the_run(jaeger: Jaeger, seen: Seen) -> None:
    assert seen.approved_run is not None and seen.expired_run is not None
    approved, expired = seen.approved_run, seen.expired_run
    assert len(approved.trace_ids) == 2 and len(expired.trace_ids) == 2  # the wake's and the continuation's
    runs = {"approved": approved, "expired": expired}

    # quayutec-runtime: the wake's and the continuation's traces, exactly the ledger's.
    for what, run in runs.items():
        found = await jaeger.search_tags_until(RUNTIME, {"quayutec.run_id": run.run_id}, run.trace_ids[-1])
        print(f"\n[search quayutec.run_id ({what}) on {RUNTIME}] {len(found)} traces")
        assert sorted(found) == sorted(run.trace_ids), (what, found)

    # quayutec-room: besides the run's own traces (its room writes), the decision's trace ...
    decided = await other_trace_on_room(jaeger, approved, "approved")
    show("the decision's trace", decided)
    by_run = {"quayutec.run_id": approved.run_id}
    assert named(decided, "quayutec.v1.RoomService/DecideHeldAction", SERVER, **by_run)
    assert named(decided, "quayutec.v1.GatewayService/DecideApproval", SERVER, **by_run)
    decision_trace = decided[0].trace_id
    # ... and the expiry that expired only this run.
    expiry = await other_trace_on_room(jaeger, expired, "expired")
    show("the expiry's trace", expiry)
    (expire,) = named(expiry, "expire approvals", **{"quayutec.run_id": expired.run_id})
    assert expire.attr("quayutec.run_ids") == (expired.run_id,) and expire.scope == "quayutec.housekeeping"
    # quayutec-gateway finds the wake's and the continuation's (deliver wake) and the decision's.
    found = await jaeger.search_tags_until(GATEWAY, {"quayutec.run_id": approved.run_id}, decision_trace)
    assert sorted(found) == sorted([*approved.trace_ids, decision_trace])
    # A made-up run id finds nothing, on any service.
    for service in SERVICE_NAMES:
        assert await jaeger.search_tags(service, {"quayutec.run_id": str(uuid.uuid4())}) == [], service


async def test_search_by_room_id_finds_the_rooms_traces(jaeger: Jaeger, seen: Seen) -> None:
    run = seen.batch_runs[0]
    found = await jaeger.search_tags_until(RUNTIME, {"quayutec.room_id": seen.room_id}, run.trace_id)
    print(f"\n[search quayutec.room_id on {RUNTIME}] {len(found)} traces")
    assert run.trace_id in found
    # Every trace it found is about that room: a span of the Runtime's names it.
    for trace_id in found:
        spans = await jaeger.trace(trace_id)
        assert any(s.attr("quayutec.room_id") == seen.room_id for s in spans if s.service == RUNTIME), trace_id
    # A made-up room id finds nothing.
    assert await jaeger.search_tags(RUNTIME, {"quayutec.room_id": str(uuid.uuid4())}) == []


async def test_search_by_message_id_finds_the_post_and_the_reply(jaeger: Jaeger, seen: Seen) -> None:
    # The post's trace: the Gateway's and the Room's PostMessage, naming the wakes it made.
    post_trace, spans = await trace_with(jaeger, GATEWAY, {"quayutec.message_id": seen.batch_message_id})
    show("search quayutec.message_id (the post)", spans)
    for kind_name in ("quayutec.v1.GatewayService/PostMessage", "quayutec.v1.RoomService/PostMessage"):
        (span,) = named(spans, kind_name, SERVER)
        assert span.attr("quayutec.message_id") == seen.batch_message_id
        assert sorted(span.attr("quayutec.wake_ids")) == sorted(seen.batch_wake_ids)
    # The reply's message id finds the wake's trace (the Room's PostMessage of the reply, with the run id).
    run = seen.batch_runs[0]
    found = await jaeger.search_tags_until(ROOM, {"quayutec.message_id": run.posted_message_id}, run.trace_id)
    assert found == [run.trace_id] != [post_trace]
    # Only on quayutec-room: the reply is the Runtime's call to the Room, no Gateway span names it.
    assert await jaeger.search_tags(GATEWAY, {"quayutec.message_id": run.posted_message_id}) == []
    # The post is found on quayutec-room too.
    assert await jaeger.search_tags(ROOM, {"quayutec.message_id": seen.batch_message_id}) == [post_trace]
    (reply,) = named(await jaeger.trace(run.trace_id), "quayutec.v1.RoomService/PostMessage", SERVER)
    assert reply.attr("quayutec.run_id") == run.run_id
    assert await jaeger.search_tags(GATEWAY, {"quayutec.message_id": str(uuid.uuid4())}) == []


async def test_search_by_operation_finds_batches_and_expiries(jaeger: Jaeger, seen: Seen) -> None:
    """The docs' rows "operation ...": the UI's search by service and operation, which is also what
    the /api/v3/traces search offers (with its time bounds)."""
    assert seen.expired_run is not None
    wakes = set(seen.batch_wake_ids)
    for service, operation in (
        (GATEWAY, "StartRuns batch"),
        (RUNTIME, "ClaimMany batch"),
        (GATEWAY, "SettleWakes batch"),
    ):
        spans = await jaeger.find(service, operation=operation, since=datetime.now(UTC) - seen.started)
        batches = [s for s in named(spans, operation) if wakes <= set(s.attr("quayutec.wake_ids") or ())]
        print(f"\n[v3 search {service} / {operation}] {len(spans)} spans; batch spans naming our wakes: {len(batches)}")
        (batch,) = batches
        assert batch.attr("quayutec.batch.size") == 2
        assert {link.trace_id for link in batch.links} | {batch.trace_id} == {r.trace_id for r in seen.batch_runs}
    spans = await jaeger.find(ROOM, operation="expire approvals", since=datetime.now(UTC) - seen.started)
    expiries = named(spans, "expire approvals")
    print(
        f"\n[v3 search {ROOM} / expire approvals] {len(expiries)} expiries:",
        [s.attr("quayutec.run_ids") for s in expiries],
    )
    assert [s.attr("quayutec.run_ids") for s in expiries] == [(seen.expired_run.run_id,)]
    # An operation nobody made finds nothing.
    assert await jaeger.find(ROOM, operation="no such operation") == []


# The /api/v3 query API itself, as docs/operations.md shows it.


async def test_v3_services_operations_and_the_searchs_required_parameters(jaeger: Jaeger, seen: Seen) -> None:
    services = await jaeger.services()
    print(f"\n[/api/v3/services] {services}")
    assert set(SERVICE_NAMES) <= set(services)
    operations = await jaeger.operations(GATEWAY)
    print(f"[/api/v3/operations?service={GATEWAY}] {len(operations)} operations, e.g. {sorted(operations)[:6]}")
    assert ("deliver wake", "producer") in operations
    assert ("quayutec.v1.GatewayService/PostMessage", "server") in operations
    assert ("expire approvals", "internal") in await jaeger.operations(ROOM)

    now = datetime.now(UTC)
    window = {
        "query.service_name": GATEWAY,
        "query.start_time_min": rfc3339(now - timedelta(hours=1)),
        "query.start_time_max": rfc3339(now + timedelta(minutes=1)),
    }
    async with httpx.AsyncClient(base_url=jaeger.query, timeout=10.0) as client:
        answers = {
            "no num_traces (its default, 0)": await client.get("/api/v3/traces", params=window),
            "num_traces=0": await client.get("/api/v3/traces", params={**window, "query.num_traces": "0"}),
            "no start_time_min": await client.get(
                "/api/v3/traces",
                params={k: v for k, v in window.items() if k != "query.start_time_min"} | {"query.num_traces": "5"},
            ),
            "no start_time_max": await client.get(
                "/api/v3/traces",
                params={k: v for k, v in window.items() if k != "query.start_time_max"} | {"query.num_traces": "5"},
            ),
        }
        depth = "search depth must be greater than 0"
        bounds = "query.start_time_min and query.start_time_max are required"
        wanted = {
            "no num_traces (its default, 0)": (500, depth),
            "num_traces=0": (500, depth),
            "no start_time_min": (400, bounds),
            "no start_time_max": (400, bounds),
        }
        for what, answer in answers.items():
            print(f"[/api/v3/traces, {what}] {answer.status_code} {answer.text[:160]}")
            code, text = wanted[what]
            assert answer.status_code == code and text in answer.text, (what, answer.status_code, answer.text[:300])
        # With every required parameter it answers, and the search depth bounds the traces returned.
        one = await client.get("/api/v3/traces", params={**window, "query.num_traces": "1"})
        assert one.status_code == 200
        assert len({s.trace_id for s in spans_of(one.json())}) == 1
        # 2.12's /api/v3/traces search ignores attributes: a made-up wake id still finds traces, so the
        # docs send users to the UI's search (/api/traces with tags) for ids.
        made_up = {**window, "query.num_traces": "5", "query.attributes.quayutec.wake_id": str(uuid.uuid4())}
        ignored = await client.get("/api/v3/traces", params=made_up)
        print(
            f"[/api/v3/traces with query.attributes of a made-up id] {ignored.status_code}, "
            f"{len({s.trace_id for s in spans_of(ignored.json())}) if ignored.status_code == 200 else 0} traces"
        )
        assert ignored.status_code == 200 and spans_of(ignored.json())


async def test_the_docs_query_forms_answer_as_the_docs_say(jaeger: Jaeger, seen: Seen) -> None:
    """Each form of query docs/operations.md gives, run as written there, answering as it says."""
    run, wake_id = seen.batch_runs[0], seen.batch_wake_ids[0]
    await jaeger.search_tags_until(GATEWAY, {"quayutec.wake_id": wake_id}, run.trace_id)

    def ids(answer: httpx.Response) -> list[str]:
        assert answer.status_code == 200, answer.text[:300]
        return [t["traceID"] for t in answer.json()["data"]]

    now_us = int(datetime.now(UTC).timestamp() * 1e6)
    started_us = int(seen.started.timestamp() * 1e6)
    async with httpx.AsyncClient(base_url=jaeger.query, timeout=10.0) as client:
        tags = {"service": GATEWAY, "tags": json.dumps({"quayutec.wake_id": wake_id})}
        by_json = await client.get("/api/traces", params=tags)
        # `tag=key:value` is the same filter as `tags` (JSON).
        by_tag = await client.get("/api/traces", params={"service": GATEWAY, "tag": f"quayutec.wake_id:{wake_id}"})
        assert ids(by_json) == ids(by_tag) == [run.trace_id]
        # `start` and `end` in microseconds: a window holding the run finds it, one before it nothing.
        inside = await client.get("/api/traces", params={**tags, "start": str(started_us), "end": str(now_us)})
        before = {**tags, "start": str(started_us - 3_600_000_000), "end": str(started_us - 1)}
        assert ids(inside) == [run.trace_id] and ids(await client.get("/api/traces", params=before)) == []
        # Nothing matching: 200 with "data": [].
        made_up = {"service": GATEWAY, "tags": json.dumps({"quayutec.wake_id": str(uuid.uuid4())})}
        nothing = await client.get("/api/traces", params=made_up)
        assert nothing.status_code == 200 and nothing.json()["data"] == [], nothing.text[:300]
        no_service = await client.get("/api/traces", params={"tags": tags["tags"]})
        print(f"\n[/api/traces without service] {no_service.status_code} {no_service.text[:160]}")
        assert no_service.status_code >= 400 and "service" in no_service.text
        # The answer is Jaeger's own model: spans with references, tags and a processID, the
        # processes naming the services; a link is a FOLLOWS_FROM reference.
        (found,) = by_json.json()["data"]
        services = {p["serviceName"] for p in found["processes"].values()}
        assert services == set(SERVICE_NAMES), services
        (delivery,) = [s for s in found["spans"] if s["operationName"] == "deliver wake"]
        assert {"quayutec.wake_id": wake_id}.items() <= {t["key"]: t["value"] for t in delivery["tags"]}.items()
        post_trace = (await jaeger.search_tags(ROOM, {"quayutec.message_id": seen.batch_message_id}))[0]
        (room_post,) = named(await jaeger.trace(post_trace), "quayutec.v1.RoomService/PostMessage", SERVER)
        assert {"refType": "FOLLOWS_FROM", "traceID": post_trace, "spanID": room_post.span_id} in delivery["references"]
        print(f"[/api/traces, the wake's trace] {len(found['spans'])} spans; deliver wake's references:")
        print("  " + json.dumps(delivery["references"]))
        # The same link in /api/v3: in `links`, with its attributes.
        (v3_delivery,) = named(await jaeger.trace(run.trace_id), "deliver wake")
        (link,) = [link for link in v3_delivery.links if link.trace_id == post_trace]
        print(f"[/api/v3/traces/{{id}}, deliver wake's link to the post] {link}")

        # /api/v3/traces/{id}: 404 "No traces found" for a trace Jaeger does not have.
        missing = await client.get(f"/api/v3/traces/{secrets.token_hex(16)}")
        assert missing.status_code == 404 and "No traces found" in missing.text, missing.text[:300]
        # The v3 search by duration: every deliver wake is shorter than an hour, none longer.
        window = {
            "query.service_name": GATEWAY,
            "query.operation_name": "deliver wake",
            "query.start_time_min": rfc3339(seen.started - timedelta(minutes=1)),
            "query.start_time_max": rfc3339(datetime.now(UTC) + timedelta(minutes=1)),
            "query.num_traces": "100",
        }
        short = await client.get("/api/v3/traces", params={**window, "query.duration_max": "1h"})
        assert run.trace_id in {s.trace_id for s in spans_of(short.json())}
        long = await client.get("/api/v3/traces", params={**window, "query.duration_min": "1h"})
        assert long.status_code == 404 and "No traces found" in long.text, long.text[:300]
    # /api/v3/operations with span_kind: that kind only.
    servers = await jaeger.operations(GATEWAY, span_kind="server")
    assert servers and {kind for _, kind in servers} == {"server"}
    assert ("quayutec.v1.GatewayService/PostMessage", "server") in servers
    assert "deliver wake" not in {name for name, _ in servers}


def docs_commands() -> list[str]:
    """The commands of the docs' example block, each continued line joined, comments and the
    variables' assignments left out (the test gives the variables its own values)."""
    match = DOCS_QUERIES.search((REPO / "docs" / "operations.md").read_text())
    assert match, "docs/operations.md has no example queries (<!-- jaeger-queries --> and a sh block)"
    commands = [c.strip() for c in match.group(1).replace("\\\n", " ").splitlines()]
    return [c for c in commands if c and not c.startswith("#") and not re.match(r"^[A-Z]+=", c)]


async def test_every_query_the_docs_give_finds_the_wakes_trace(jaeger: Jaeger, seen: Seen) -> None:
    run, wake_id = seen.batch_runs[0], seen.batch_wake_ids[0]
    await jaeger.search_tags_until(GATEWAY, {"quayutec.wake_id": wake_id}, run.trace_id)
    values = {
        "$JAEGER": jaeger.query,
        "$WAKE": wake_id,
        "$TRACE": run.trace_id,
        "$START": rfc3339(seen.started - timedelta(minutes=1)),
        "$END": rfc3339(datetime.now(UTC) + timedelta(minutes=1)),
    }
    commands = docs_commands()
    assert len(commands) >= 3, commands
    async with httpx.AsyncClient(timeout=10.0) as client:
        for command in commands:
            for name, value in values.items():
                command = command.replace(name, value)
            words = shlex.split(command)
            assert words[0] == "curl" and "$" not in command, command
            (url,) = [w for w in words if w.startswith("http")]
            pairs = [words[i + 1] for i, w in enumerate(words) if w == "--data-urlencode"]
            # --data-urlencode without -G would be a POST: the docs' commands are GETs.
            assert not pairs or any(w.startswith("-") and "G" in w for w in words[1:]), command
            params = {key: value for key, _, value in (p.partition("=") for p in pairs)}
            assert len(params) == len(pairs), command
            answer = await client.get(url, params=params)
            print(f"\n[docs: {command[:110]}] {answer.status_code}, {len(answer.text)} bytes")
            assert answer.status_code == 200, (command, answer.text[:300])
            assert run.trace_id in answer.text, command


def excerpt(answer: Mapping[str, Any], span_name: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """``answer`` (a ``/api/v3/traces/{id}`` answer) trimmed to the span ``span_name`` of its
    resource, with only the attributes ``keys``."""
    for resource_spans in answer["result"]["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            for span in scope_spans["spans"]:
                if span["name"] != span_name:
                    continue
                resource = resource_spans["resource"]
                kept = [a for a in span["attributes"] if a["key"] in keys]
                return {
                    "result": {
                        "resourceSpans": [
                            {
                                "resource": {
                                    "attributes": [a for a in resource["attributes"] if a["key"] == "service.name"]
                                },
                                "scopeSpans": [
                                    {
                                        "scope": scope_spans["scope"],
                                        "spans": [
                                            {
                                                **{k: span[k] for k in ("traceId", "spanId", "name", "kind")},
                                                **{k: span[k] for k in ("startTimeUnixNano", "endTimeUnixNano")},
                                                "attributes": kept,
                                                "links": span.get("links", [])[:1],
                                            }
                                        ],
                                    }
                                ],
                            }
                        ]
                    }
                }
    raise AssertionError(f"no span {span_name!r} in the answer")


def within(part: Any, whole: Any) -> bool:
    """Whether ``part`` (the docs' excerpt) has the shape of ``whole`` (a real answer): every key of
    each object found in the real one, a list's items each matching some item, scalars of one type."""
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and within(v, whole[k]) for k, v in part.items())
    if isinstance(part, list):
        return isinstance(whole, list) and all(any(within(p, w) for w in whole) for p in part)
    return type(part) is type(whole)


async def test_the_docs_excerpt_has_the_shape_of_a_real_answer(jaeger: Jaeger, seen: Seen) -> None:
    run = seen.batch_runs[0]
    await jaeger.trace(run.trace_id)
    answer = await jaeger.raw_trace(run.trace_id)
    keys = ("quayutec.wake_id", "quayutec.run_id", "quayutec.wake.kind")
    trimmed = excerpt(answer, "deliver wake", keys)
    print("\n[the docs' excerpt, from this run's deliver wake]\n" + json.dumps(trimmed, indent=2))
    assert within(trimmed, answer)
    docs = (REPO / "docs" / "operations.md").read_text()
    match = DOCS_EXCERPT.search(docs)
    if match is None:
        pytest.fail("docs/operations.md has no excerpt of a real answer (<!-- jaeger-excerpt --> and a json block)")
    written = json.loads(match.group(1))
    assert within(written, answer), "the docs' excerpt is not the shape of what Jaeger answers"
    # And it is a deliver wake, with the ids the docs name on it.
    (span,) = written["result"]["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert span["name"] == "deliver wake"
    assert {a["key"] for a in span["attributes"]} <= set(keys) and span["links"]


# Flow 8: no secret, key, prompt or message text anywhere Jaeger stores.


def strings_of(span: JSpan) -> Iterator[tuple[str, str]]:
    """Every key and value of a span, its events, its links and its resource, as text (bytes
    values decoded too)."""

    def walk(where: str, value: Any) -> Iterator[tuple[str, str]]:
        if isinstance(value, dict):
            for k, v in value.items():
                yield where, str(k)
                yield from walk(f"{where}.{k}", v)
        elif isinstance(value, tuple | list):
            for v in value:
                yield from walk(where, v)
        else:
            yield where, str(value)
            if isinstance(value, str):
                try:
                    yield f"{where} (base64)", base64.b64decode(value, validate=True).decode("utf-8", "replace")
                except ValueError:
                    pass

    yield "name", span.name
    yield from walk("attributes", span.attributes)
    yield from walk("resource", span.resource)
    for event in span.events:
        yield "event", event.name
        yield from walk(f"event {event.name}", event.attributes)
    for link in span.links:
        yield from walk("link", link.attributes)


async def test_nothing_jaeger_stores_holds_a_secret_or_a_text(jaeger: Jaeger, seen: Seen) -> None:
    markers = seen.markers
    # The flow's own traces, read whole: the batch post's, each wake's, the decision's and expiry's.
    flow_traces = {r.trace_id for r in seen.batch_runs}
    flow_traces |= set(await jaeger.search_tags(GATEWAY, {"quayutec.message_id": seen.batch_message_id}))
    assert len(flow_traces) == 3
    answers: list[str] = []
    spans: list[JSpan] = []
    async with httpx.AsyncClient(base_url=jaeger.query, timeout=30.0) as client:
        for trace_id in sorted(flow_traces):
            await jaeger.trace(trace_id)
            answer = await client.get(f"/api/v3/traces/{trace_id}")
            answers.append(answer.text)
            spans += spans_of(answer.json())
        # Every trace of every quayutec service in the window, through both searches.
        since = datetime.now(UTC) - seen.started + timedelta(minutes=1)
        for service in SERVICE_NAMES:
            window = {
                "query.service_name": service,
                "query.start_time_min": rfc3339(datetime.now(UTC) - since),
                "query.start_time_max": rfc3339(datetime.now(UTC) + timedelta(minutes=1)),
                "query.num_traces": "1000",
            }
            answer = await client.get("/api/v3/traces", params=window)
            assert answer.status_code == 200, answer.text[:300]
            answers.append(answer.text)
            spans += spans_of(answer.json())
            ui = await client.get("/api/traces", params={"service": service, "lookback": "1h", "limit": "1000"})
            assert ui.status_code == 200, ui.text[:300]
            answers.append(ui.text)
    traces = {s.trace_id for s in spans}
    unique = len({(s.trace_id, s.span_id) for s in spans})
    print(
        f"\n[secrets scan] {unique} spans ({len(spans)} read) of {len(traces)} traces, "
        f"{sum(len(s.events) for s in spans)} events, {sum(len(s.links) for s in spans)} links, "
        f"{sum(len(a) for a in answers)} bytes of answers; markers: {sorted(markers)}"
    )
    assert flow_traces <= traces
    # The scan reads what it should: the flow's ids are there (so a marker would be found, too).
    texts = [(where, text) for s in spans for where, text in strings_of(s)]
    assert any(seen.batch_message_id in text for _, text in texts)
    assert any(seen.refused_request_id in text for _, text in texts)
    for what, marker in markers.items():
        holding = sorted({where for where, text in texts if marker in text})
        assert holding == [], (what, holding)
        assert not [a for a in answers if marker in a], what
    assert not [a for a in answers if MARK in a]
