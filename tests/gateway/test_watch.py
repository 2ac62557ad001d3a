"""WatchRoom over a real Gateway, Room and PostgreSQL: replay then live, exactly once across a
reconnect (to another replica), departures end the stream, private events stay private, and a
slow consumer is cut with RESOURCE_EXHAUSTED and resumes without loss."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from quayutec.v1 import common_pb2, gateway_pb2, room_pb2, room_pb2_grpc
from tests.gateway.conftest import NOWHERE
from tests.gateway.helpers import GatewayStub, create_room, register_agent
from tests.harness.channels import service_channel
from tests.harness.gateway import CompanyKey, authed_gateway, join_room, running_gateway

K = common_pb2
REPO = Path(__file__).resolve().parent.parent.parent
QUIET = {"QUAYUTEC_GATEWAY_DELIVERY_ENABLED": "false", "QUAYUTEC_GATEWAY_POST_RATE": "0"}


def auth(key: CompanyKey) -> tuple[tuple[str, str]]:
    # The harness's bearer interceptor covers unary calls; a stream carries its key itself.
    return (("authorization", f"Bearer {key.secret}"),)


def watch(gw: GatewayStub, key: CompanyKey, room_id: str, after: int | None = None) -> Any:
    request = gateway_pb2.WatchRoomRequest(room_id=room_id)
    if after is not None:
        request.after = after
    return gw.WatchRoom(request, metadata=auth(key), timeout=120)


async def caught_up(call: Any) -> int:
    """Reads the replay up to the first heartbeat (the stream is live from here); returns its cursor."""
    async for item in call:
        if item.events:
            raise AssertionError(f"an event before the first heartbeat of a watch from now: {item}")
        cursor: int = item.heartbeat.cursor
        return cursor
    raise AssertionError("the stream ended before its first heartbeat")


async def events_until(call: Any, last_body: str, into: list[common_pb2.RoomEvent]) -> None:
    """Appends the stream's events to ``into`` until the message with body ``last_body``."""
    async for item in call:
        for event in item.events:
            into.append(event)
            if event.message.body == last_body:
                assert event is item.events[-1], "events after the last one expected"
                return
    raise AssertionError(f"the stream ended before the message {last_body!r}")


async def post(gw: GatewayStub, room_id: str, body: str) -> common_pb2.Message:
    posted = await gw.PostMessage(gateway_pb2.PostMessageRequest(room_id=room_id, person="Ada", body=body), timeout=10)
    message: common_pb2.Message = posted.message
    return message


async def log_of(room_addr: str, room_id: str, company_id: str, after: int) -> list[common_pb2.RoomEvent]:
    """The Room's event log as ``company_id`` may see it, read directly (what every stream must match)."""
    events: list[common_pb2.RoomEvent] = []
    async with service_channel(room_addr, "gateway") as channel:
        room = room_pb2_grpc.RoomServiceStub(channel)
        while True:
            got = await room.ReadRoomEvents(
                room_pb2.RoomServiceReadRoomEventsRequest(room_id=room_id, company_id=company_id, after=after),
                timeout=10,
            )
            events.extend(e.event for e in got.entries)
            after = got.next_after
            if not got.more:
                return events


@asynccontextmanager
async def second_gateway(
    database_url: str, room_addr: str, key: CompanyKey | str, **env: str
) -> AsyncIterator[GatewayStub]:
    """Another Gateway replica on the same database (no delivery, no rate limit), and a stub with ``key``."""
    async with (
        running_gateway(database_url, room_addr, NOWHERE, **{**QUIET, **env}) as addr,
        authed_gateway(addr, key if isinstance(key, str) else key.secret) as gw,
    ):
        yield gw


async def test_a_scripted_session_is_seen_in_order_exactly_once_across_a_reconnect(
    database_url: str,
    room_addr: str,
    acme: CompanyKey,
    globex: CompanyKey,
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
) -> None:
    room = await create_room(acme_gw)
    agent = await register_agent(acme_gw, "scribe")
    call = watch(acme_gw, acme, room.room_id)
    start = await caught_up(call)
    seen: list[common_pb2.RoomEvent] = []

    await join_room(acme_gw, globex_gw, room.room_id)
    await post(acme_gw, room.room_id, "first")
    task = await acme_gw.SendTask(
        gateway_pb2.SendTaskRequest(room_id=room.room_id, person="Ada", to_agent_id=agent.agent_id, title="draft"),
        timeout=10,
    )
    await post(globex_gw, room.room_id, "from globex")
    await events_until(call, "from globex", seen)
    call.cancel()  # the connection drops here

    # While nobody watches, the room goes on.
    await acme_gw.UpdateTask(
        gateway_pb2.UpdateTaskRequest(
            room_id=room.room_id, task_id=task.task.task_id, person="Ada", note="done", status=K.TASK_STATUS_DONE
        ),
        timeout=10,
    )
    await acme_gw.UploadFile(
        gateway_pb2.UploadFileRequest(room_id=room.room_id, person="Ada", name="plan.txt", content=b"the plan"),
        timeout=10,
    )
    await post(globex_gw, room.room_id, "while away")

    # Resume after the last cursor received, on another replica; then live again.
    async with second_gateway(database_url, room_addr, acme) as other:
        resumed = watch(other, acme, room.room_id, after=seen[-1].cursor)
        await events_until(resumed, "while away", seen)
        await post(acme_gw, room.room_id, "back")
        await post(globex_gw, room.room_id, "last")
        await events_until(resumed, "last", seen)
        resumed.cancel()

    expected = await log_of(room_addr, room.room_id, acme.company_id, start)
    assert [e.cursor for e in seen] == [e.cursor for e in expected]  # in order, none missed, none twice
    assert seen == expected
    assert [e.kind for e in seen] == [
        K.ROOM_EVENT_KIND_MEMBER_JOINED,
        K.ROOM_EVENT_KIND_MESSAGE_POSTED,
        K.ROOM_EVENT_KIND_TASK_CREATED,
        K.ROOM_EVENT_KIND_MESSAGE_POSTED,
        K.ROOM_EVENT_KIND_TASK_CLOSED,
        K.ROOM_EVENT_KIND_FILE_UPLOADED,
        K.ROOM_EVENT_KIND_MESSAGE_POSTED,
        K.ROOM_EVENT_KIND_MESSAGE_POSTED,
        K.ROOM_EVENT_KIND_MESSAGE_POSTED,
    ]
    assert [e.message.body for e in seen if e.HasField("message")] == [
        "first",
        "from globex",
        "while away",
        "back",
        "last",
    ]


async def test_a_departed_companys_stream_ends(
    acme: CompanyKey,
    globex: CompanyKey,
    initech: CompanyKey,
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
    initech_gw: GatewayStub,
) -> None:
    room = await create_room(acme_gw)
    await join_room(acme_gw, globex_gw, room.room_id)
    await join_room(acme_gw, initech_gw, room.room_id)
    removed = watch(globex_gw, globex, room.room_id)
    leaving = watch(initech_gw, initech, room.room_id)
    staying = watch(acme_gw, acme, room.room_id)
    for call in (removed, leaving, staying):
        await caught_up(call)

    await acme_gw.RemoveMember(
        gateway_pb2.RemoveMemberRequest(room_id=room.room_id, company_id=globex.company_id), timeout=10
    )
    await initech_gw.LeaveRoom(gateway_pb2.LeaveRoomRequest(room_id=room.room_id), timeout=10)
    for call in (removed, leaving):
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async for item in call:
                assert all(e.kind != K.ROOM_EVENT_KIND_MESSAGE_POSTED for e in item.events)
        assert ended.value.code() == grpc.StatusCode.NOT_FOUND, ended.value.details()
        assert "no longer a member" in (ended.value.details() or "")

    # The member that stays sees both departures; a departed company cannot watch again.
    await post(acme_gw, room.room_id, "still here")
    seen: list[common_pb2.RoomEvent] = []
    await events_until(staying, "still here", seen)
    staying.cancel()
    assert [(e.kind, e.member.company_id) for e in seen[:2]] == [
        (K.ROOM_EVENT_KIND_MEMBER_LEFT, globex.company_id),
        (K.ROOM_EVENT_KIND_MEMBER_LEFT, initech.company_id),
    ]
    with pytest.raises(grpc.aio.AioRpcError) as again:
        async for _ in watch(globex_gw, globex, room.room_id, after=0):
            pass
    assert again.value.code() == grpc.StatusCode.NOT_FOUND


async def test_private_memory_never_reaches_another_companys_stream(
    room_addr: str, acme: CompanyKey, globex: CompanyKey, acme_gw: GatewayStub, globex_gw: GatewayStub
) -> None:
    room = await create_room(acme_gw)
    await join_room(acme_gw, globex_gw, room.room_id)
    agent = await register_agent(acme_gw, "memo")
    acme_watch = watch(acme_gw, acme, room.room_id)
    globex_watch = watch(globex_gw, globex, room.room_id)
    start = await caught_up(acme_watch)
    await caught_up(globex_watch)

    author = K.Author(kind=K.AUTHOR_KIND_AGENT, company_id=acme.company_id, agent_id=agent.agent_id)
    async with service_channel(room_addr, "runtime") as channel:  # agents remember through the Runtime
        rooms = room_pb2_grpc.RoomServiceStub(channel)
        for text, visibility in (("acme private", K.MEMORY_VISIBILITY_COMPANY), ("shared", K.MEMORY_VISIBILITY_ROOM)):
            await rooms.WriteMemory(
                room_pb2.RoomServiceWriteMemoryRequest(
                    room_id=room.room_id, author=author, text=text, visibility=visibility
                ),
                timeout=10,
            )
    await post(acme_gw, room.room_id, "end")

    by_acme: list[common_pb2.RoomEvent] = []
    by_globex: list[common_pb2.RoomEvent] = []
    await events_until(acme_watch, "end", by_acme)
    await events_until(globex_watch, "end", by_globex)
    acme_watch.cancel()
    globex_watch.cancel()
    assert [e.memory.text for e in by_acme if e.HasField("memory")] == ["acme private", "shared"]
    assert [e.memory.text for e in by_globex if e.HasField("memory")] == ["shared"]
    assert all("acme private" not in str(e) for e in by_globex)
    # Replaying from the start (the other path: the stream's own read) hides it just the same.
    replay: list[common_pb2.RoomEvent] = []
    replayed = watch(globex_gw, globex, room.room_id, after=start)
    await events_until(replayed, "end", replay)
    replayed.cancel()
    assert replay == by_globex


async def test_a_slow_consumer_is_cut_and_resumes_without_loss(
    database_url: str, room_addr: str, acme: CompanyKey, acme_gw: GatewayStub
) -> None:
    room = await create_room(acme_gw)
    bodies = [f"{i:03d} " + "x" * 60_000 for i in range(40)]
    # A small buffer, and a client whose flow-control window does not grow: the Gateway's writes to a
    # caller that stops reading block after a few large messages, and its buffer fills behind them.
    async with (
        running_gateway(database_url, room_addr, NOWHERE, QUAYUTEC_GATEWAY_WATCH_BUFFER_EVENTS="4", **QUIET) as addr,
        authed_gateway(addr, acme.secret, options=[("grpc.http2.bdp_probe", 0)]) as gw,
    ):
        call = watch(gw, acme, room.room_id)
        await caught_up(call)
        for body in bodies:  # the watcher reads nothing meanwhile
            await post(acme_gw, room.room_id, body)
        received: list[common_pb2.RoomEvent] = []
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            async for item in call:
                received.extend(item.events)
        assert cut.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, cut.value.details()
        assert "watch again with after = the cursor of the last event" in (cut.value.details() or "")
        assert len(received) < len(bodies)

        resumed = watch(gw, acme, room.room_id, after=received[-1].cursor if received else 0)
        await events_until(resumed, bodies[-1], received)
        resumed.cancel()
    assert [e.message.body for e in received] == bodies


async def test_the_watch_command_prints_events_as_they_happen(
    gateway_addr: str, acme: CompanyKey, acme_gw: GatewayStub
) -> None:
    room = await create_room(acme_gw)
    await post(acme_gw, room.room_id, "before the watch")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "QUAYUTEC_GATEWAY_ADDR": gateway_addr,
        "QUAYUTEC_API_KEY": acme.secret,
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        "watch",
        "--room",
        room.room_id,
        "--after",
        "0",
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(60):
            lines.append((await proc.stdout.readline()).decode())  # the replay
            await post(acme_gw, room.room_id, "live one")
            lines.append((await proc.stdout.readline()).decode())
    finally:
        proc.terminate()
        await proc.wait()
    assert lines[0].startswith("[1] message_posted #1 Ada (Acme): before the watch"), lines
    assert lines[1].startswith("[2] message_posted #2 Ada (Acme): live one"), lines


async def test_idle_streams_get_heartbeats_and_a_replica_bounds_its_streams(
    database_url: str, room_addr: str, acme: CompanyKey, acme_gw: GatewayStub
) -> None:
    room = await create_room(acme_gw)
    await post(acme_gw, room.room_id, "only one")
    settings = {"QUAYUTEC_GATEWAY_WATCH_HEARTBEAT_SECONDS": "0.1", "QUAYUTEC_GATEWAY_WATCH_MAX_STREAMS": "1"}
    async with second_gateway(database_url, room_addr, acme, **settings) as gw:
        call = watch(gw, acme, room.room_id, after=0)
        items = []
        async for item in call:
            items.append(item)
            if len(items) == 4:
                break
        # The replay, then the caught-up heartbeat, then idle heartbeats: all at the same cursor.
        assert [e.message.body for e in items[0].events] == ["only one"]
        assert [i.heartbeat.cursor for i in items[1:]] == [1, 1, 1]
        assert all(not i.events for i in items[1:])
        with pytest.raises(grpc.aio.AioRpcError) as full:
            async for _ in watch(gw, acme, room.room_id):
                pass
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "QUAYUTEC_GATEWAY_WATCH_MAX_STREAMS" in (full.value.details() or "")
        call.cancel()


async def test_watch_requests_are_checked(acme: CompanyKey, globex: CompanyKey, acme_gw: GatewayStub) -> None:
    room = await create_room(acme_gw)
    for room_id, after, code in (
        ("", None, grpc.StatusCode.INVALID_ARGUMENT),
        ("not-a-room", None, grpc.StatusCode.NOT_FOUND),
        (room.room_id, -1, grpc.StatusCode.INVALID_ARGUMENT),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in watch(acme_gw, acme, room_id, after=after):
                pass
        assert refused.value.code() == code, refused.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as outsider:
        async for _ in watch(acme_gw, globex, room.room_id, after=0):  # Globex's key: not a member
            pass
    assert outsider.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as anonymous:
        async for _ in acme_gw.WatchRoom(gateway_pb2.WatchRoomRequest(room_id=room.room_id), timeout=30):
            pass
    assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_list_rpcs_hand_out_a_resume_token_on_the_last_page_too(
    acme_gw: GatewayStub, globex_gw: GatewayStub
) -> None:
    room = await create_room(acme_gw)
    for body in ("one", "two", "three"):
        await post(acme_gw, room.room_id, body)

    async def page(token: str) -> gateway_pb2.ListMessagesResponse:
        got: gateway_pb2.ListMessagesResponse = await acme_gw.ListMessages(
            gateway_pb2.ListMessagesRequest(room_id=room.room_id, page_size=2, page_token=token), timeout=10
        )
        return got

    first = await page("")
    last = await page(first.next_page_token)
    assert [m.body for m in last.messages] == ["three"] and last.next_page_token == ""
    assert last.resume_page_token  # the last page says where to pick up later
    nothing_yet = await page(last.resume_page_token)
    assert not nothing_yet.messages and nothing_yet.resume_page_token == last.resume_page_token
    await post(acme_gw, room.room_id, "four")
    later = await page(last.resume_page_token)
    assert [m.body for m in later.messages] == ["four"]

    members = await acme_gw.ListMembers(gateway_pb2.ListMembersRequest(room_id=room.room_id), timeout=10)
    assert members.next_page_token == "" and members.resume_page_token
    await join_room(acme_gw, globex_gw, room.room_id)
    joined = await acme_gw.ListMembers(
        gateway_pb2.ListMembersRequest(room_id=room.room_id, page_token=members.resume_page_token), timeout=10
    )
    assert [m.company_id for m in joined.members] == [
        (await globex_gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)).company.company_id
    ]
    newest_first = await acme_gw.ListMessages(
        gateway_pb2.ListMessagesRequest(room_id=room.room_id, newest_first=True), timeout=10
    )
    assert newest_first.resume_page_token == ""  # nothing is ever added before the oldest


async def test_events_posted_while_a_busy_room_is_read_reach_a_watcher_in_one_response(
    database_url: str, room_addr: str, acme: CompanyKey
) -> None:
    """With QUAYUTEC_GATEWAY_WATCH_COALESCE_MS, a room read moments ago (and followed by at least
    WATCH_COALESCE_MIN_STREAMS streams: here one) is read again only after that long: messages posted
    meanwhile go to each watcher together, in one response (one send, not one each)."""
    slow = {
        **QUIET,
        "QUAYUTEC_GATEWAY_WATCH_COALESCE_MS": "3000",  # the room stays busy for 30 s after a read
        "QUAYUTEC_GATEWAY_WATCH_COALESCE_MIN_STREAMS": "1",
    }
    async with (
        running_gateway(database_url, room_addr, NOWHERE, **slow) as addr,
        authed_gateway(addr, acme.secret) as gw,
    ):
        room = await create_room(gw)
        call = gw.WatchRoom(gateway_pb2.WatchRoomRequest(room_id=room.room_id), metadata=auth(acme), timeout=60)
        await caught_up(call)
        await post(gw, room.room_id, "first")
        async for item in call:
            if any(e.message.body == "first" for e in item.events):
                break
        await post(gw, room.room_id, "second")
        await post(gw, room.room_id, "third")
        async for item in call:
            bodies = [e.message.body for e in item.events if e.kind == common_pb2.ROOM_EVENT_KIND_MESSAGE_POSTED]
            if bodies:
                assert bodies == ["second", "third"], bodies
                break
        call.cancel()


async def test_a_busy_room_few_streams_follow_is_read_at_once(
    database_url: str, room_addr: str, acme: CompanyKey
) -> None:
    """A room followed by fewer streams than QUAYUTEC_GATEWAY_WATCH_COALESCE_MIN_STREAMS (16 by default)
    is read at each notification even while busy: with a ten-minute COALESCE_MS, the next message
    still reaches the one watcher (a reply would otherwise wait that long on its path)."""
    busy_for_long = {**QUIET, "QUAYUTEC_GATEWAY_WATCH_COALESCE_MS": "600000"}
    async with (
        running_gateway(database_url, room_addr, NOWHERE, **busy_for_long) as addr,
        authed_gateway(addr, acme.secret) as gw,
    ):
        room = await create_room(gw)
        call = gw.WatchRoom(gateway_pb2.WatchRoomRequest(room_id=room.room_id), metadata=auth(acme), timeout=120)
        await caught_up(call)

        async def body_arrives(body: str) -> None:
            async for item in call:
                if any(e.message.body == body for e in item.events):
                    return

        await post(gw, room.room_id, "first")
        await asyncio.wait_for(body_arrives("first"), timeout=30)
        await post(gw, room.room_id, "second")  # the room was read moments ago: busy
        await asyncio.wait_for(body_arrives("second"), timeout=30)
        call.cancel()
