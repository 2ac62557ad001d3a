"""The Python client riding out what a real Gateway does to it, with its default retry policy: a
SIGKILL in the middle of a burst of keyed posts, outages of 8 s and 30 s under a keyed write and a
watch, its own close() under a watch and a call waiting to retry, and connection mistakes (TLS,
plaintext, a bad address) reported at once and named."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest

import quayutec_client
from quayutec_client import RetryPolicy, Tls, errors
from quayutec_client._proto import gateway_pb2
from quayutec_client._transport import RPCS
from quayutec_client.types import RoomEvent, RoomEventKind
from tests.clients.conftest import ClientFactory
from tests.harness.gateway import CompanyKey, self_signed_tls
from tests.harness.sdk_stack import SdkStack

MESSAGE_POSTED = RoomEventKind.ROOM_EVENT_KIND_MESSAGE_POSTED


async def test_a_gateway_killed_5_ms_into_a_burst_of_30_keyed_posts_lands_each_once(
    stack: SdkStack, acme: CompanyKey, connect: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="quayutec_client")
    client = connect(acme, retry=RetryPolicy())
    room = await client.create_room("burst")
    bodies = [f"burst {i}" for i in range(30)]
    posts = [asyncio.create_task(client.post_message(room.room_id, b, person="ana")) for b in bodies]
    await asyncio.sleep(0.005)
    await stack.gateway.kill()
    await stack.gateway.start()
    posted = await asyncio.gather(*posts)
    assert stack.gateway.kills == 1
    assert "PostMessage: UNAVAILABLE after attempt" in caplog.text, "the kill met posts under way"
    assert Counter(await stack.messages_in(room.room_id)) == Counter(bodies), "each lands, once"
    assert len({p.message.message_id for p in posted}) == 30


async def test_a_gateway_killed_5_ms_into_a_burst_of_30_room_creates_makes_each_room_once(
    stack: SdkStack, acme: CompanyKey, connect: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Each create_room carries an idempotency key made once per call: retried across the kill, no
    create is left "maybe" (an error while the room exists) and none lands twice."""
    caplog.set_level(logging.INFO, logger="quayutec_client")
    client = connect(acme, retry=RetryPolicy())
    names = [f"created {i}" for i in range(30)]
    creates = [asyncio.create_task(client.create_room(name)) for name in names]
    await asyncio.sleep(0.005)
    await stack.gateway.kill()
    await stack.gateway.start()
    made = await asyncio.gather(*creates)
    assert stack.gateway.kills == 1
    assert "CreateRoom: UNAVAILABLE after attempt" in caplog.text, "the kill met creates under way"
    rows = await stack.pool.fetch(
        "SELECT room_id, name FROM rooms WHERE created_by_company_id = $1", uuid.UUID(acme.company_id)
    )
    assert Counter(r["name"] for r in rows) == Counter(names), "each room exists, once"
    assert {str(r["room_id"]) for r in rows} == {m.room_id for m in made}


async def test_each_create_repeated_with_its_key_answers_the_first_object(
    stack: SdkStack, acme: CompanyKey, connect: ClientFactory
) -> None:
    client = connect(acme)
    other = connect(await stack.new_company())
    key = f"mine-{uuid.uuid4()}"
    room = await client.create_room("keyed", idempotency_key=key)
    assert (await client.create_room("keyed", idempotency_key=key)).room_id == room.room_id
    assert (await other.create_room("keyed", idempotency_key=key)).room_id != room.room_id
    assert [r.room_id async for r in client.rooms() if r.name == "keyed"] == [room.room_id]

    agent = await client.register_agent(
        "keyed", provider="anthropic", model="m", provider_key="sk-test", idempotency_key=key
    )
    again = await client.register_agent(
        "keyed", provider="anthropic", model="m", provider_key="sk-test", idempotency_key=key
    )
    assert again.agent_id == agent.agent_id
    assert [a.agent_id async for a in client.agents() if a.name == "keyed"] == [agent.agent_id]

    invited = (await other.who_am_i()).company_id
    invitation = await client.invite_company(room.room_id, invited, idempotency_key=key)
    repeat = await client.invite_company(room.room_id, invited, idempotency_key=key)
    assert repeat.invitation_id == invitation.invitation_id
    assert [i.invitation_id async for i in client.invitations(sent=True)] == [invitation.invitation_id]

    made = await client.create_api_key("keyed", idempotency_key=key)
    made_again = await client.create_api_key("keyed", idempotency_key=key)
    assert (made_again.key.key_id, made_again.secret) == (made.key.key_id, made.secret)
    session = await client.create_session_key(600, idempotency_key=key)
    session_again = await client.create_session_key(600, idempotency_key=key)
    assert (session_again.key_id, session_again.secret) == (session.key_id, session.secret)
    keys = [k.key_id async for k in client.api_keys(include_sessions=True)]
    assert keys.count(made.key.key_id) == 1 and keys.count(session.key_id) == 1


async def _outage_under_a_keyed_write_and_a_watch(
    stack: SdkStack, client: quayutec_client.Client, room_id: str, seconds: float, body: str
) -> None:
    """The Gateway down ``seconds`` while a keyed post waits to be sent and a watch is open: the post
    lands once, and the watch hands out the message after the restart."""
    async with client.watch(room_id) as watch:
        await stack.gateway.kill()
        post = asyncio.create_task(client.post_message(room_id, body, person="ana"))
        await asyncio.sleep(seconds)
        assert not post.done(), post
        await stack.gateway.start()
        posted = await post
        async with asyncio.timeout(60):  # a failsafe: a lost event would be waited for forever
            event: RoomEvent = await anext(aiter(watch))
            while event.kind != MESSAGE_POSTED:
                event = await anext(aiter(watch))
    assert event.message.message_id == posted.message.message_id
    assert (await stack.messages_in(room_id)).count(body) == 1


@pytest.mark.timeout(240)
async def test_the_default_policy_rides_out_8_s_and_30_s_of_gateway_downtime_under_a_keyed_write_and_a_watch(
    stack: SdkStack, acme: CompanyKey, connect: ClientFactory
) -> None:
    client = connect(acme, retry=RetryPolicy())
    room = await client.create_room("outages")
    await _outage_under_a_keyed_write_and_a_watch(stack, client, room.room_id, 8, "after 8 s")
    await _outage_under_a_keyed_write_and_a_watch(stack, client, room.room_id, 30, "after 30 s")
    assert stack.gateway.kills == 2


async def test_close_ends_a_watch_and_a_call_waiting_to_retry_with_closed(
    stack: SdkStack, acme: CompanyKey, connect: ClientFactory
) -> None:
    client = connect(acme, retry=RetryPolicy())
    room = await client.create_room("closing")
    watch = client.watch(room.room_id)
    await watch.__aenter__()
    reading = asyncio.create_task(anext(aiter(watch)))
    await stack.gateway.kill()
    waiting = asyncio.create_task(client.post_message(room.room_id, "never", person="ana"))
    await asyncio.sleep(0.5)  # the post is refused and waits to retry; the watch waits to reconnect
    await client.close()
    for task in (reading, waiting):
        with pytest.raises(errors.Closed) as closed:
            await task
        assert closed.value.code == grpc.StatusCode.CANCELLED and "closed" in closed.value.message
        assert len(closed.value.request_id) == 32  # the call's (or the watch's) x-request-id
    with pytest.raises(errors.Closed):
        await client.who_am_i()
    await stack.gateway.start()

    # Closed with the stream up and idle: the reader ends with Closed too (not a bare CancelledError).
    again = connect(acme)
    async with again.watch(room.room_id) as idle:
        reader = asyncio.create_task(anext(aiter(idle)))
        await asyncio.sleep(0.2)
        await again.close()
        with pytest.raises(errors.Closed):
            await reader


async def test_tls_and_protocol_mismatches_are_reported_at_once_naming_tls(
    stack: SdkStack, acme: CompanyKey, tmp_path: Path
) -> None:
    cert, key, pem = self_signed_tls(tmp_path)
    tls_env = {"QUAYUTEC_GATEWAY_TLS_CERT": str(cert), "QUAYUTEC_GATEWAY_TLS_KEY": str(key)}
    async with stack.extra_gateway(**tls_env) as tls_addr:
        mistakes = {
            "TLS to a plaintext port": quayutec_client.connect(stack.gateway_addr, acme.secret, tls=Tls(pem)),
            "an untrusted certificate": quayutec_client.connect(tls_addr, acme.secret),
            "a wrong server name": quayutec_client.connect(tls_addr, acme.secret, tls=Tls(pem, "other.invalid")),
            "plaintext to TLS": quayutec_client.connect(tls_addr, acme.secret, plaintext=True),
        }
        for what, client in mistakes.items():
            async with client:
                started = time.monotonic()
                with pytest.raises(errors.ConnectionFailed) as failed:
                    await client.who_am_i()
                took = time.monotonic() - started
                assert took <= 5, f"{what}: reported after {took:.1f} s"
                assert "TLS" in failed.value.message, (what, failed.value)
                assert isinstance(failed.value, errors.Unavailable)
                assert len(failed.value.request_id) == 32, failed.value.request_id
                with pytest.raises(errors.ConnectionFailed):  # a watch too, at once
                    await anext(aiter(client.watch(str(acme.company_id))))


def test_a_bad_address_is_refused_at_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad, says in (
        ("", "empty"),
        ("   ", "empty"),
        ("http://127.0.0.1:50051", "'127.0.0.1:50051') and plaintext=True"),
        ("https://gateway.example:443/", "is a URL"),
        ("127.0.0.1", "host:port"),
        ("127.0.0.1:0", "port from 1"),
        ("127.0.0.1:http", "port from 1"),
    ):
        with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
            quayutec_client.connect(bad, "qyk_a_b", plaintext=True)
    monkeypatch.delenv("QUAYUTEC_GATEWAY", raising=False)
    monkeypatch.delenv("QUAYUTEC_GATEWAY_ADDR", raising=False)
    monkeypatch.delenv("QUAYUTEC_API_KEY", raising=False)
    with pytest.raises(ValueError, match="QUAYUTEC_GATEWAY"):
        quayutec_client.connect(api_key="qyk_a_b")
    with pytest.raises(ValueError, match="QUAYUTEC_API_KEY"):
        quayutec_client.connect("127.0.0.1:50051")


async def test_the_address_and_key_come_from_the_environment(
    stack: SdkStack, acme: CompanyKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QUAYUTEC_GATEWAY", stack.gateway_addr)
    monkeypatch.setenv("QUAYUTEC_API_KEY", acme.secret)
    async with quayutec_client.connect(plaintext=True) as client:
        assert (await client.who_am_i()).company_id == acme.company_id
    monkeypatch.delenv("QUAYUTEC_GATEWAY")
    monkeypatch.setenv("QUAYUTEC_GATEWAY_ADDR", stack.gateway_addr)  # what `quayutec up` exports
    async with quayutec_client.connect(plaintext=True) as client:
        assert (await client.who_am_i()).company_id == acme.company_id


async def test_mistakes_are_refused_before_the_wire_with_the_gateways_own_messages(
    stack: SdkStack, acme: CompanyKey, connect: ClientFactory
) -> None:
    """Each bad request is refused by the client (InvalidArgument, attempts 0, nothing sent), and the
    Gateway, sent the same request past the client's checks, answers the same message."""
    client = connect(acme)
    room = await client.create_room("checks")
    r = room.room_id
    bad: list[tuple[str, Any, Any]] = [
        (
            "PostMessage",
            client.post_message(r, "", person="ana"),
            gateway_pb2.PostMessageRequest(room_id=r, person="ana"),
        ),
        (
            "PostMessage",
            client.post_message("", "hi", person="ana"),
            gateway_pb2.PostMessageRequest(person="ana", body="hi"),
        ),
        (
            "PostMessage",
            client.post_message(r, "hi", person=" "),
            gateway_pb2.PostMessageRequest(room_id=r, body="hi", person=" "),
        ),
        (
            "PostMessage",
            client.post_message(r, "x" * 70_000, person="ana"),
            gateway_pb2.PostMessageRequest(room_id=r, person="ana", body="x" * 70_000),
        ),
        (
            "PostMessage",
            client.post_message(r, "hi", person="ana", idempotency_key="k" * 300),
            gateway_pb2.PostMessageRequest(room_id=r, person="ana", body="hi", idempotency_key="k" * 300),
        ),
        (
            "PostMessage",
            client.post_message(r, "hi", person="ana", mentions=["a"] * 51),
            gateway_pb2.PostMessageRequest(room_id=r, person="ana", body="hi", mention_agent_ids=["a"] * 51),
        ),
        (
            "ListMessages",
            anext(client.messages(r, page_size=501)),
            gateway_pb2.ListMessagesRequest(room_id=r, page_size=501),
        ),
        ("ListRooms", anext(client.rooms(page_size=-1)), gateway_pb2.ListRoomsRequest(page_size=-1)),
        ("GetTask", client.get_task(r, ""), gateway_pb2.GetTaskRequest(room_id=r)),
        ("CreateRoom", client.create_room(""), gateway_pb2.CreateRoomRequest()),
        ("InviteCompany", client.invite_company(r, ""), gateway_pb2.InviteCompanyRequest(room_id=r)),
        ("GetRun", client.get_run(""), gateway_pb2.GetRunRequest()),
    ]
    channel = grpc.aio.insecure_channel(stack.gateway_addr)
    try:
        for method, call, raw in bad:
            with pytest.raises(errors.InvalidArgument) as refused:
                await call
            assert refused.value.attempts == 0, refused.value
            rpc = RPCS[method]
            with pytest.raises(grpc.aio.AioRpcError) as answered:
                await channel.unary_unary(
                    rpc.path,
                    request_serializer=rpc.request.SerializeToString,
                    response_deserializer=rpc.response.FromString,
                )(raw, metadata=(("authorization", f"Bearer {acme.secret}"),), timeout=30)
            assert answered.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, answered.value)
            assert refused.value.message == answered.value.details(), method
    finally:
        await channel.close()

    # An error the Gateway answers carries the id the call was sent with.
    with pytest.raises(errors.NotFound) as missing:
        await client.get_task(r, str(uuid.uuid4()))
    assert len(missing.value.request_id) == 32 and missing.value.trace_id == ""  # no OpenTelemetry context

    # Watch cursors, checked as the Gateway checks them, before anything is opened.
    with pytest.raises(errors.InvalidArgument, match=r"after must be a cursor \(0 or more\)"):
        client.watch(r, after=-1)
    with pytest.raises(errors.InvalidArgument, match=r"after\[0\]\.cursor must be 0 or more, got -5"):
        client.watch_rooms(after={r: -5})
    # A string where a list is expected is a TypeError (it would be one mention per character).
    with pytest.raises(TypeError, match="mentions must be a list"):
        await client.post_message(r, "hi", person="ana", mentions="id")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        client.watch_rooms(after=[(r, 1)])  # type: ignore[arg-type]


def test_a_client_made_outside_any_event_loop_works_under_a_later_asyncio_run() -> None:
    client = quayutec_client.connect("127.0.0.1:9", "qyk_a_b", plaintext=True, retry=quayutec_client.NO_RETRY)

    async def use() -> None:
        with pytest.raises(errors.Unavailable):  # nothing listens: the point is that it was sent at all
            await client.who_am_i()
        await client.close()

    asyncio.run(use())
