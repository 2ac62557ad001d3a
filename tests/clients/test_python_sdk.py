"""The Python client SDK (clients/python) against a real Gateway process, Room, Claims, Runtime and
model stand-in on loopback: the README flow, a write retried across a Gateway killed mid-call
posts once, a watch across two Gateway kills and a RESOURCE_EXHAUSTED cut yields every event once
and in order, paging, every typed error, TLS, the API key kept out of sight, and trace context."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import quayutec_client
from quayutec.telemetry import SpanCapture
from quayutec.v1 import gateway_pb2, gateway_pb2_grpc
from quayutec_client import NO_RETRY, RetryPolicy, Tls, errors
from quayutec_client._transport import RPCS, SAFETY, SERVICE
from quayutec_client.client import Client, rpc_methods
from quayutec_client.types import RoomEvent, RoomEventKind, RunStatus, RunStep
from tests.clients.conftest import ClientFactory
from tests.gateway.test_watch import log_of
from tests.harness.gateway import CompanyKey, running_gateway, self_signed_tls
from tests.harness.sdk_stack import SdkStack

MESSAGE_POSTED = RoomEventKind.ROOM_EVENT_KIND_MESSAGE_POSTED


def test_every_gateway_rpc_has_a_client_method() -> None:
    gateway_rpcs = {m.name for m in SERVICE.methods}
    wrapped = rpc_methods()
    assert set(wrapped) == gateway_rpcs, f"Gateway RPCs without a client method: {gateway_rpcs - set(wrapped)}"
    assert set(SAFETY) == gateway_rpcs, f"Gateway RPCs without a retry class: {gateway_rpcs ^ set(SAFETY)}"
    for name in wrapped.values():
        assert callable(getattr(Client, name)) and not name.startswith("_")
    assert set(RPCS) == gateway_rpcs


async def test_the_readme_flow_end_to_end(
    stack: SdkStack, acme: CompanyKey, bolt: CompanyKey, connect: ClientFactory
) -> None:
    a, b = connect(acme), connect(bolt)
    assert (await a.who_am_i()).name == "Acme"
    room = await a.create_room("launch")
    invitation = await a.invite_company(room.room_id, bolt.company_id)
    assert [i.invitation_id async for i in b.invitations()] == [invitation.invitation_id]
    joined = await b.accept_invitation(invitation.invitation_id)
    assert joined.member.company_id == bolt.company_id
    assert {m.company_id async for m in a.members(room.room_id)} == {acme.company_id, bolt.company_id}
    writer = await b.register_agent("writer", provider="anthropic", model="claude-sdk", provider_key="sk-sdk-test")
    assert [ag.agent_id async for ag in b.agents()] == [writer.agent_id]

    async with a.watch(room.room_id) as events:
        posted = await a.post_message(
            room.room_id, "@writer draft the launch note", person="ana", mentions=[writer.agent_id]
        )
        assert len(posted.wake_ids) == 1
        seen: list[RoomEvent] = []
        async for event in events:
            seen.append(event)
            if event.kind == MESSAGE_POSTED and event.message.author.agent_id == writer.agent_id:
                break
    assert next(e.message.message_id for e in seen if e.kind == MESSAGE_POSTED) == posted.message.message_id
    reply = seen[-1].message
    assert reply.run_id and reply.body

    sent = await a.send_task(room.room_id, to_agent_id=writer.agent_id, title="Write the note", person="ana")
    assert sent.task.to_agent_id == writer.agent_id and len(sent.wake_ids) == 1
    closed = await a.update_task(room.room_id, sent.task.task_id, person="ana", note="thanks", status="done")
    assert closed.status == quayutec_client.types.TaskStatus.TASK_STATUS_DONE

    run = await b.get_run(reply.run_id)
    for _ in range(600):  # a bound on polling, not a timing assertion
        if run.step == RunStep.RUN_STEP_ENDED:
            break
        await asyncio.sleep(0.05)
        run = await b.get_run(reply.run_id)
    assert run.status == RunStatus.RUN_STATUS_SUCCEEDED and run.posted_message_id == reply.message_id
    assert reply.run_id in {r.run_id async for r in b.runs(agent_id=writer.agent_id)}
    with pytest.raises(errors.NotFound):
        await a.get_run(reply.run_id)  # runs are seen only by the agent's company


async def test_a_write_retried_after_the_gateway_is_killed_mid_call_posts_once(
    stack: SdkStack, acme: CompanyKey, connect: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    client = connect(acme)
    room = await client.create_room("kill mid call")
    caplog.set_level(logging.INFO, logger="quayutec_client")
    # The Room stores the message and answers; its answer is held, the Gateway killed with the call
    # under way, then started again on the same port. The client sees UNAVAILABLE and sends the call
    # again with the same idempotency key.
    killer = stack.in_background(stack.kill_gateway_once_posted(room.room_id, "exactly once"))
    posted = await client.post_message(room.room_id, "exactly once", person="ana")
    await killer
    assert stack.gateway.kills == 1
    assert "PostMessage: UNAVAILABLE after attempt 1" in caplog.text
    assert await stack.messages_in(room.room_id) == ["exactly once"]
    assert [m.message_id async for m in client.messages(room.room_id)] == [posted.message.message_id]


async def test_a_write_without_an_idempotency_key_is_not_sent_again_after_an_unknown_outcome(
    stack: SdkStack, acme: CompanyKey, connect: ClientFactory
) -> None:
    """UploadFile takes no key: after a deadline the file may exist, so the client does not retry it
    (a second attempt would upload it twice); keyed writes in the same spot (a post, a create) are
    retried and land once."""
    client = connect(acme, retry=RetryPolicy(attempt_timeout=1, total_timeout=20, initial_backoff=0.05))
    room = await client.create_room("held")
    stack.proxy.hold()
    try:
        with pytest.raises(errors.DeadlineExceeded) as held:
            await client.upload_file(room.room_id, "once.txt", "uploaded once", person="ana")
    finally:
        stack.proxy.release()
    assert held.value.attempts == 1
    assert [f.name async for f in client.files(room.room_id)].count("once.txt") == 1

    stack.proxy.hold()
    release = asyncio.get_running_loop().call_later(2.5, stack.proxy.release)
    try:
        made = await client.create_room("made once")
    finally:
        release.cancel()
        stack.proxy.release()
    assert [r.room_id async for r in client.rooms() if r.name == "made once"] == [made.room_id]

    stack.proxy.hold()
    release = asyncio.get_running_loop().call_later(2.5, stack.proxy.release)
    try:
        posted = await client.post_message(room.room_id, "retried", person="ana")
    finally:
        release.cancel()
        stack.proxy.release()
    assert [m.message_id async for m in client.messages(room.room_id)] == [posted.message.message_id]


async def test_a_watch_across_two_gateway_kills_and_a_resource_exhausted_cut_yields_every_event_once_in_order(
    stack: SdkStack, acme: CompanyKey, connect: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="quayutec_client")
    writer = connect(acme)
    # A flow-control window that does not grow, so a watcher that stops reading is cut soon.
    watcher = connect(acme, channel_options=[("grpc.http2.bdp_probe", 0)])
    room = await writer.create_room("watched")
    posted: list[str] = []

    async def post(client: Client, bodies: list[str]) -> None:
        for body in bodies:
            await client.post_message(room.room_id, body, person="ana")
            posted.append(body)

    received: list[RoomEvent] = []
    watch = watcher.watch(room.room_id, after=0, idle_timeout=30)

    async def read_until(body: str) -> None:
        try:
            async with asyncio.timeout(120):  # a failsafe: a missed event would be waited for forever
                async for event in watch:
                    received.append(event)
                    if event.message.body == body:
                        return
        except TimeoutError:
            raise AssertionError(f"{body!r} never came; got {[e.message.body for e in received]}") from None

    async with stack.extra_gateway() as other_addr:
        other = connect(acme, addr=other_addr)
        await post(writer, [f"a{i}" for i in range(5)])
        await read_until("a4")

        # Kill one: the stream drops; what is posted meanwhile (through another Gateway) is replayed.
        await stack.gateway.kill()
        await post(other, [f"b{i}" for i in range(5)])
        await stack.gateway.start()
        await read_until("b4")

        # Kill two, in the middle of a batch the watcher is still reading.
        await post(writer, [f"c{i}" for i in range(10)])
        await read_until("c2")
        await stack.gateway.kill()
        await post(other, [f"d{i}" for i in range(5)])
        await stack.gateway.start()
        await read_until("d4")
    reconnects_before_cut = watch.reconnects

    # The cut: the watcher reads nothing while large messages arrive, its buffer at the Gateway
    # fills, and the Gateway ends the stream with RESOURCE_EXHAUSTED; the watch resumes by itself.
    await post(writer, [f"e{i:02d} " + "x" * 60_000 for i in range(40)])
    await read_until(posted[-1])
    await watch.close()

    assert stack.gateway.kills == 2
    assert "WatchRoom: RESOURCE_EXHAUSTED after attempt 1" in caplog.text
    assert watch.reconnects >= reconnects_before_cut + 1 >= 3
    assert [e.message.body for e in received if e.kind == MESSAGE_POSTED] == posted
    cursors = [e.cursor for e in received]
    assert cursors == sorted(set(cursors)), "an event came twice or out of order"
    log = await log_of(stack.room_addr, room.room_id, acme.company_id, 0)
    assert [(e.cursor, int(e.kind)) for e in received] == [(e.cursor, int(e.kind)) for e in log]
    assert watch.cursor == received[-1].cursor


async def test_a_watch_resumes_from_a_persisted_cursor(
    stack: SdkStack, acme: CompanyKey, connect: ClientFactory
) -> None:
    client = connect(acme)
    room = await client.create_room("persisted")
    for body in ("one", "two", "three"):
        await client.post_message(room.room_id, body, person="ana")
    async with client.watch(room.room_id, after=0) as first:
        async for event in first:
            if event.message.body == "two":
                break
        kept = first.cursor
    assert kept is not None
    async with client.watch(room.room_id, after=kept) as second:
        await client.post_message(room.room_id, "four", person="ana")
        bodies = []
        async for event in second:
            bodies.append(event.message.body)
            if event.message.body == "four":
                break
    assert bodies == ["three", "four"]


async def test_paging_over_a_thousand_messages(stack: SdkStack, acme: CompanyKey, connect: ClientFactory) -> None:
    client = connect(acme)
    room = await client.create_room("long")
    bodies = [f"m{i:04d}" for i in range(1003)]
    for start in range(0, len(bodies), 25):
        await asyncio.gather(*(client.post_message(room.room_id, b, person="ana") for b in bodies[start : start + 25]))
    listed = [m async for m in client.messages(room.room_id, page_size=7)]
    assert sorted(m.body for m in listed) == bodies and len({m.message_id for m in listed}) == len(bodies)
    assert [m.seq for m in listed] == sorted(m.seq for m in listed)
    newest = [m.seq async for m in client.messages(room.room_id, newest_first=True)]  # pages of 50
    assert newest == sorted((m.seq for m in listed), reverse=True)


async def test_every_typed_error(stack: SdkStack, acme: CompanyKey, bolt: CompanyKey, connect: ClientFactory) -> None:
    a, b = connect(acme, retry=NO_RETRY), connect(bolt, retry=NO_RETRY)
    room = await a.create_room("errors")
    invitation = await a.invite_company(room.room_id, bolt.company_id)
    await b.accept_invitation(invitation.invitation_id)

    async def expect(
        error: type[errors.QuayutecError], code: grpc.StatusCode, call: object, says: str
    ) -> errors.QuayutecError:
        with pytest.raises(error) as caught:
            await call  # type: ignore[misc]
        assert caught.value.code == code and says in caught.value.message, caught.value
        return caught.value

    await expect(
        errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, a.post_message(room.room_id, "", person="ana"), "body"
    )
    unknown = str(uuid.uuid4())
    await expect(errors.NotFound, grpc.StatusCode.NOT_FOUND, a.get_task(unknown, unknown), "")
    await expect(
        errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS, a.invite_company(room.room_id, bolt.company_id), "member"
    )
    await expect(
        errors.PermissionDenied,
        grpc.StatusCode.PERMISSION_DENIED,
        b.remove_member(room.room_id, acme.company_id),
        "creat",
    )
    await expect(errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, a.leave_room(room.room_id), "creator")
    stranger = connect(CompanyKey("", "", "", f"qyk_{uuid.uuid4()}_nope"))
    await expect(errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED, stranger.who_am_i(), "unknown API key")

    # OUT_OF_RANGE: the events after cursor 1 are no longer kept.
    forgotten = (await a.post_message(room.room_id, "soon forgotten", person="ana")).message
    async with a.watch(room.room_id, after=0) as replay:
        last = 0
        async for event in replay:
            last = event.cursor
            if event.message.message_id == forgotten.message_id:
                break
    await stack.expire_events(room.room_id, last)
    with pytest.raises(errors.CursorOutOfRange) as expired:
        await anext(aiter(a.watch(room.room_id, after=1)))
    assert expired.value.code == grpc.StatusCode.OUT_OF_RANGE and expired.value.attempts == 1
    assert (expired.value.room_id, expired.value.newest_cursor) == (room.room_id, None)
    assert errors.CursorExpired is errors.CursorOutOfRange  # the first releases' name

    # UNAVAILABLE: nothing listens at the first address, so no try was sent and none used up the
    # policy's three attempts, only its total time; the Gateway at the second cannot reach its Room.
    quick = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02, attempt_timeout=0.3, total_timeout=2)
    nowhere = connect(acme, addr="127.0.0.1:9", retry=quick)
    refused = await expect(errors.Unavailable, grpc.StatusCode.UNAVAILABLE, nowhere.who_am_i(), "Connection refused")
    assert refused.attempts > 3
    bounded = await expect(errors.Unavailable, grpc.StatusCode.UNAVAILABLE, nowhere.who_am_i(timeout=0.5), "refused")
    assert 1 < bounded.attempts < refused.attempts  # the call's timeout, not the policy's total time
    sent_once = connect(acme, addr="127.0.0.1:9", retry=NO_RETRY)
    assert (await expect(errors.Unavailable, grpc.StatusCode.UNAVAILABLE, sent_once.who_am_i(), "")).attempts == 1
    async with running_gateway(
        stack.database_url, "127.0.0.1:9", "127.0.0.1:9", QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false"
    ) as cut_off:
        lonely = connect(
            acme,
            addr=cut_off,
            retry=RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.02, attempt_timeout=5),
        )
        down = await expect(errors.Unavailable, grpc.StatusCode.UNAVAILABLE, lonely.get_task(room.room_id, unknown), "")
        assert down.attempts == 2


async def test_rate_limited_carries_the_advised_wait_and_retries_honour_it(
    stack: SdkStack, acme: CompanyKey, connect: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="quayutec_client")
    async with stack.extra_gateway(QUAYUTEC_GATEWAY_POST_RATE="1", QUAYUTEC_GATEWAY_POST_BURST="1") as limited:
        once = connect(acme, addr=limited, retry=NO_RETRY)
        room = await once.create_room("limited")
        await once.post_message(room.room_id, "first", person="ana")
        with pytest.raises(errors.RateLimited) as limit:
            await once.post_message(room.room_id, "second", person="ana")
        assert limit.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and limit.value.attempts == 1
        assert limit.value.retry_after is not None and 0 < limit.value.retry_after <= 1.0
        assert "rate limit" in limit.value.message

        impatient = once.with_retry(RetryPolicy(max_advised_wait=0.001))
        with pytest.raises(errors.RateLimited) as refused:
            await impatient.post_message(room.room_id, "not waited for", person="ana")
        assert refused.value.attempts == 1, "an advised wait over max_advised_wait is not waited"

        patient = once.with_retry(RetryPolicy(initial_backoff=0.01, max_backoff=0.02))
        for body in ("third", "fourth"):
            await patient.post_message(room.room_id, body, person="ana")
    assert "PostMessage: RESOURCE_EXHAUSTED after attempt 1" in caplog.text and "the Gateway advised" in caplog.text
    assert await stack.messages_in(room.room_id) == ["first", "third", "fourth"]


async def test_the_api_key_is_never_shown(
    stack: SdkStack, acme: CompanyKey, connect: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    client = connect(
        acme, retry=RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.02, attempt_timeout=0.3)
    )
    stack.proxy.hold()
    try:
        with pytest.raises(errors.DeadlineExceeded) as failed:
            await client.messages(str(uuid.uuid4())).__anext__()
    finally:
        stack.proxy.release()
    shown = [
        repr(client),
        str(client),
        repr(failed.value),
        str(failed.value),
        caplog.text,
        repr(client._transport.__dict__),
    ]
    assert "retrying" in caplog.text
    assert all(acme.secret not in text for text in shown)
    with pytest.raises(ValueError) as bad:
        quayutec_client.connect(stack.gateway_addr, "qyk_with a space", plaintext=True)
    assert "with a space" not in str(bad.value)


async def test_tls_is_on_unless_plaintext_is_asked_for(stack: SdkStack, acme: CompanyKey, tmp_path: Path) -> None:
    cert, key, pem = self_signed_tls(tmp_path)
    tls_env = {"QUAYUTEC_GATEWAY_TLS_CERT": str(cert), "QUAYUTEC_GATEWAY_TLS_KEY": str(key)}
    quick = RetryPolicy(max_attempts=1, attempt_timeout=2)
    async with stack.extra_gateway(**tls_env) as addr:
        port = addr.rpartition(":")[2]
        async with quayutec_client.connect(addr, acme.secret, tls=Tls(root_certificates=pem)) as trusted:
            assert (await trusted.who_am_i()).company_id == acme.company_id
        async with quayutec_client.connect(f"localhost:{port}", acme.secret, tls=Tls(root_certificates=pem)) as named:
            assert (await named.who_am_i()).company_id == acme.company_id
        for client in (
            quayutec_client.connect(addr, acme.secret, retry=quick),  # the system's roots do not know it
            quayutec_client.connect(addr, acme.secret, tls=Tls(pem, server_name="other.invalid"), retry=quick),
            quayutec_client.connect(addr, acme.secret, plaintext=True, retry=quick),
        ):
            async with client:
                with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
                    await client.who_am_i()
    with pytest.raises(ValueError, match="contradict"):
        quayutec_client.connect(addr, acme.secret, plaintext=True, tls=Tls(pem))


# Run in a process of its own: this one's gRPC channels are instrumented by OpenTelemetry already,
# which would send a trace context of its own.
_TRACED_CALL = """
import asyncio, os, sys
if sys.argv[1] == "without":
    sys.modules["opentelemetry"] = None  # as if it were not installed
import quayutec_client

async def main() -> None:
    async with quayutec_client.connect(os.environ["ADDR"], os.environ["KEY"], plaintext=True) as client:
        if sys.argv[1] == "without":
            await client.who_am_i()
            return
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider

        trace.set_tracer_provider(TracerProvider())
        with trace.get_tracer("caller").start_as_current_span("caller") as span:
            await client.who_am_i()
        print(f"{span.get_span_context().trace_id:032x} {span.get_span_context().span_id:016x}")

asyncio.run(main())
"""


async def test_the_callers_trace_context_reaches_the_gateway(
    stack: SdkStack, acme: CompanyKey, captured: tuple[InMemorySpanExporter, SpanCapture]
) -> None:
    exporter, capture = captured
    async with stack.extra_gateway() as addr:
        env = {**os.environ, "ADDR": addr, "KEY": acme.secret}
        runs = {}
        for mode in ("with", "without"):
            done = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-c", _TRACED_CALL, mode],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            runs[mode] = done.stdout.split()
        await asyncio.to_thread(capture.force_flush)
    served = [
        s for s in exporter.get_finished_spans() if s.name.endswith("/WhoAmI") and s.kind == trace.SpanKind.SERVER
    ]
    assert len(served) == 2, [s.name for s in exporter.get_finished_spans()]
    trace_id, span_id = runs["with"]
    # The Gateway starts a trace of its own either way; the caller's context, when sent, is a link.
    assert all(s.parent is None for s in served)
    traced, untraced = sorted(served, key=lambda s: not s.links)
    assert [(f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") for link in traced.links] == [
        (trace_id, span_id)
    ]
    assert traced.attributes is not None and traced.attributes["quayutec.caller.trace_id"] == trace_id
    assert f"{traced.context.trace_id:032x}" != trace_id
    assert not untraced.links, "no trace context is sent without OpenTelemetry"


async def test_a_quoted_request_id_finds_the_call_on_the_gateway(
    stack: SdkStack, acme: CompanyKey, connect: ClientFactory, captured: tuple[InMemorySpanExporter, SpanCapture]
) -> None:
    """The request id an error carries is on the Gateway's span of that call (quayutec.caller.request_id);
    a malformed one is left out."""
    exporter, capture = captured
    missing = str(uuid.uuid4())
    async with stack.extra_gateway() as addr:
        client = connect(acme, addr=addr)
        with pytest.raises(errors.NotFound) as refused:
            await client.get_message(missing, missing)
        async with grpc.aio.insecure_channel(addr) as channel:
            gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
            for bad in ("has a space", "x" * 65):
                await gateway.WhoAmI(
                    gateway_pb2.WhoAmIRequest(),
                    metadata=(("authorization", f"Bearer {acme.secret}"), ("x-request-id", bad)),
                )
        await asyncio.to_thread(capture.force_flush)
    request_id = refused.value.request_id
    assert len(request_id) == 32
    served = {s.name.rsplit("/", 1)[-1]: s for s in exporter.get_finished_spans() if s.kind == trace.SpanKind.SERVER}
    assert served["GetMessage"].attributes is not None
    assert served["GetMessage"].attributes.get("quayutec.caller.request_id") == request_id
    whoami = [
        s for s in exporter.get_finished_spans() if s.name.endswith("/WhoAmI") and s.kind == trace.SpanKind.SERVER
    ]
    assert len(whoami) == 2
    assert all("quayutec.caller.request_id" not in (s.attributes or {}) for s in whoami)


def test_idempotency_keys_and_request_ids_are_fresh_random_ids() -> None:
    from quayutec_client._transport import new_request_id

    keys = [quayutec_client.new_idempotency_key() for _ in range(2000)]
    assert len(set(keys)) == len(keys)
    for key in keys:
        parsed = uuid.UUID(key)
        assert str(parsed) == key and parsed.version == 4 and parsed.variant == uuid.RFC_4122
    ids = [new_request_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids) and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    # Every hex digit of a key's random part takes every value (not a constant or a counter).
    assert {key[0] for key in keys} == set("0123456789abcdef")


def test_retry_waits_grow_with_jitter_and_honour_the_advised_wait() -> None:
    import random

    policy = RetryPolicy(initial_backoff=0.1, max_backoff=1.0, multiplier=2.0)
    rng = random.Random(7)
    for retry, ceiling in ((1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)):
        waits = [policy.wait_before(retry, None, rng) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits) and len(set(waits)) > 100
    advised = [policy.wait_before(1, 3.0, rng) for _ in range(200)]
    assert all(3.0 <= w <= 3.6 for w in advised)
    for bad in ({"max_attempts": 0}, {"total_timeout": 0}, {"initial_backoff": 2.0, "max_backoff": 1.0}):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)


async def test_the_rest_of_the_surface_against_the_real_gateway(
    stack: SdkStack, acme: CompanyKey, bolt: CompanyKey, connect: ClientFactory
) -> None:
    """Every method the flows above do not call, once, with what it answers."""
    a, b = connect(acme), connect(bolt)
    room = await a.create_room("surface")
    declined = await b.decline_invitation((await a.invite_company(room.room_id, bolt.company_id)).invitation_id)
    assert declined.status == quayutec_client.types.InvitationStatus.INVITATION_STATUS_DECLINED
    assert [i.invitation_id async for i in b.invitations(status="declined")] == [declined.invitation_id]
    assert room.room_id in {r.room_id async for r in a.rooms()}

    uploaded = await a.upload_file(room.room_id, "notes.txt", "the launch is on Tuesday\n", person="ana")
    assert [f.file_id async for f in a.files(room.room_id)] == [uploaded.file_id]
    assert any("Tuesday" in p.text for p in await a.search_passages(room.room_id, "launch"))
    assert [line async for line in a.memory(room.room_id)] == []

    agent = await a.register_agent("helper", provider="openai", model="gpt-test", provider_key="sk-test")
    rights = await a.set_agent_rights(agent_id=agent.agent_id, remember="hold", close_task="deny")
    assert rights.remember == quayutec_client.types.ActionRight.ACTION_RIGHT_HOLD
    got = await a.get_agent_rights(agent.agent_id)
    assert got.effective.close_task == quayutec_client.types.ActionRight.ACTION_RIGHT_DENY
    # Only the rights named change (the request's field mask).
    again = await a.set_agent_rights(agent_id=agent.agent_id, create_task="hold")
    assert (again.remember, again.create_task) == (rights.remember, quayutec_client.types.ActionRight.ACTION_RIGHT_HOLD)
    cleared = await a.set_agent_rights(agent_id=agent.agent_id, close_task="deny", replace=True)
    assert cleared.remember == quayutec_client.types.ActionRight.ACTION_RIGHT_UNSPECIFIED
    with pytest.raises(ValueError, match="at least one right"):
        await a.set_agent_rights(agent_id=agent.agent_id)
    assert [w async for w in a.approvals()] == []
    with pytest.raises(errors.NotFound):
        await a.decide_approval(str(uuid.uuid4()), 0, person="ana", approve=True)

    sent = await a.send_task(room.room_id, to_agent_id=agent.agent_id, title="check", person="ana")
    assert [t.task_id async for t in a.tasks(room.room_id, to_agent_id=agent.agent_id)] == [sent.task.task_id]
    assert (await a.get_task(room.room_id, sent.task.task_id)).title == "check"

    other = await a.create_room("left")
    invitation = await a.invite_company(other.room_id, bolt.company_id)
    await b.accept_invitation(invitation.invitation_id)
    await b.leave_room(other.room_id)
    with pytest.raises(errors.NotFound):
        await b.get_task(other.room_id, sent.task.task_id)
    third = await a.create_room("removed")
    await b.accept_invitation((await a.invite_company(third.room_id, bolt.company_id)).invitation_id)
    await a.remove_member(third.room_id, bolt.company_id)
    assert {m.company_id async for m in a.members(third.room_id)} == {acme.company_id}
    with pytest.raises(ValueError, match="not one of"):
        await a.register_agent("x", provider="nonsense", model="m")


async def test_the_edges_an_outside_developer_meets(stack: SdkStack, acme: CompanyKey, connect: ClientFactory) -> None:
    """Issue 49: bad arguments refused before the wire, each naming its field with the Gateway's own
    words; a client used from a second event loop says the rule; a list resumes from a page token."""
    room_id = str(uuid.uuid4())
    # Before the wire: a client of a Gateway that is not there gets InvalidArgument, attempts 0 ...
    nowhere = quayutec_client.connect("127.0.0.1:9", acme.secret, plaintext=True, retry=NO_RETRY)
    try:
        refused: dict[str, str] = {}
        calls: dict[str, Callable[[], Awaitable[object]]] = {
            "CreateSessionKey": lambda: nowhere.create_session_key(5),
            "UploadFile": lambda: nowhere.upload_file(room_id, "a.txt", b"\xff\xfe", person="ana"),
        }
        for name, call in calls.items():
            with pytest.raises(errors.InvalidArgument) as sdk:
                await call()
            assert sdk.value.attempts == 0, sdk.value
            refused[name] = sdk.value.message
        with pytest.raises(errors.InvalidArgument) as watched:
            nowhere.watch_rooms(after={"x": 1})
        refused["WatchRooms"] = watched.value.message
        for bad, field in (
            (lambda: nowhere.post_message(room_id, 123, person="ana"), "body"),  # type: ignore[arg-type]
            (lambda: nowhere.runs(started_after="2026-01-01"), "started_after"),  # type: ignore[arg-type]
            (lambda: nowhere.messages(room_id, page_size="7"), "page_size"),  # type: ignore[arg-type]
        ):
            with pytest.raises(TypeError, match=rf"\b{field} must be "):
                await bad()  # type: ignore[misc]
    finally:
        await nowhere.close()
    # ... with the words the Gateway itself answers the same request with.
    async with grpc.aio.insecure_channel(stack.gateway_addr) as channel:
        gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
        auth = (("authorization", f"Bearer {acme.secret}"),)
        said = {}
        for name, request in {
            "CreateSessionKey": gateway.CreateSessionKey(
                gateway_pb2.CreateSessionKeyRequest(ttl_seconds=5), metadata=auth
            ),
            "UploadFile": gateway.UploadFile(
                gateway_pb2.UploadFileRequest(room_id=room_id, person="ana", name="a.txt", content=b"\xff\xfe"),
                metadata=auth,
            ),
        }.items():
            with pytest.raises(grpc.aio.AioRpcError) as direct:
                await request
            said[name] = direct.value.details()
        stream = gateway.WatchRooms(
            gateway_pb2.WatchRoomsRequest(after=[gateway_pb2.RoomCursor(room_id="x", cursor=1)]), metadata=auth
        )
        with pytest.raises(grpc.aio.AioRpcError) as direct:
            await stream.read()
        said["WatchRooms"] = direct.value.details()
    assert refused == said

    # One client per event loop: a client made outside any loop, used from two asyncio.run calls.
    def two_runs() -> tuple[str, str]:
        client = quayutec_client.connect(stack.gateway_addr, acme.secret, plaintext=True)
        first = asyncio.run(client.who_am_i())
        try:
            asyncio.run(client.who_am_i())
        except RuntimeError as exc:
            return first.name, str(exc)
        return first.name, "the second loop's call went through"

    name, second = await asyncio.to_thread(two_runs)
    assert name == "Acme"
    assert "one client per event loop" in second and "(closed)" in second, second

    # A list resumed from a page token, in another client: nothing missed, nothing twice.
    client = connect(acme)
    room = await client.create_room("paged")
    for i in range(7):
        await client.post_message(room.room_id, f"m{i}", person="ana")
    pages = client.messages(room.room_id, page_size=3)
    first_page = [(await anext(pages)).body for _ in range(3)]
    assert pages.page_token == "" and pages.next_page_token
    rest = [m.body async for m in connect(acme).messages(room.room_id, page_size=3, page_token=pages.next_page_token)]
    assert first_page + rest == [f"m{i}" for i in range(7)]
    again = [m.body async for m in client.messages(room.room_id, page_size=3, page_token=pages.page_token)]
    assert again == [f"m{i}" for i in range(7)]


async def test_names_renames_retirement_and_archiving(
    stack: SdkStack, acme: CompanyKey, bolt: CompanyKey, connect: ClientFactory
) -> None:
    """Issue 49: a taken name is the typed AlreadyExists naming the first; renames, retirement and
    archiving, each refused to another company as the Room's rules say."""
    a, b = connect(acme, retry=NO_RETRY), connect(bolt, retry=NO_RETRY)
    room = await a.create_room("names")
    with pytest.raises(errors.AlreadyExists) as taken:
        await a.create_room(" NAMES ")
    assert taken.value.code == grpc.StatusCode.ALREADY_EXISTS and room.room_id in taken.value.message
    agent = await a.register_agent("namer", provider="anthropic", model="m", provider_key="sk-test")
    with pytest.raises(errors.AlreadyExists) as twice:
        await a.register_agent("Namer", provider="anthropic", model="m", provider_key="sk-test")
    assert agent.agent_id in twice.value.message

    assert (await a.rename_room(room.room_id, "renamed")).name == "renamed"
    assert (await a.rename_agent(agent.agent_id, "renamer")).name == "renamer"
    with pytest.raises(errors.NotFound):
        await b.rename_agent(agent.agent_id, "theirs")
    with pytest.raises(errors.NotFound):
        await b.archive_room(room.room_id)
    with pytest.raises(errors.InvalidArgument, match="name"):
        await a.rename_agent(agent.agent_id, "  ")

    retired = await a.retire_agent(agent.agent_id)
    assert retired.HasField("retired_at")
    posted = await a.post_message(room.room_id, "hi", person="ana", mentions=[agent.agent_id])
    assert list(posted.wake_ids) == []

    archived = await a.archive_room(room.room_id)
    assert archived.HasField("archived_at")
    with pytest.raises(errors.FailedPrecondition, match="archived"):
        await a.post_message(room.room_id, "late", person="ana")
    assert [m.body async for m in a.messages(room.room_id)] == ["hi"]
