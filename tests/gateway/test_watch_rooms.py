"""Fair shares of a Gateway's streams, the company-wide WatchRooms stream and bad cursors, over a real
Gateway, Room and PostgreSQL.

One company cannot take every stream slot of a replica (another still gets one); WatchRooms follows
every room of its company in one stream, exactly once per room, across joins, departures and a
resume on another replica; cursors past a room's end are OUT_OF_RANGE with words.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import grpc
import pytest

from quayutec.v1 import common_pb2, gateway_pb2
from tests.gateway.helpers import GatewayStub, create_room
from tests.gateway.test_watch import REPO, auth, caught_up, log_of, post, second_gateway, watch
from tests.harness.gateway import CompanyKey, join_room

K = common_pb2


def watch_rooms(
    gw: GatewayStub, key: CompanyKey, after: dict[str, int] | None = None, *, unnamed_from_joining: bool = False
) -> Any:
    request = gateway_pb2.WatchRoomsRequest(
        after=[gateway_pb2.RoomCursor(room_id=r, cursor=c) for r, c in (after or {}).items()],
        unnamed_from_joining=unnamed_from_joining,
    )
    return gw.WatchRooms(request, metadata=auth(key), timeout=120)


async def next_heartbeat(call: Any) -> dict[str, int]:
    """Reads the stream's next item, which must be a heartbeat; returns its room cursors."""
    async for item in call:
        assert item.HasField("heartbeat"), f"events where a heartbeat was expected: {item}"
        return {r.room_id: r.cursor for r in item.heartbeat.rooms}
    raise AssertionError("the stream ended before a heartbeat")


class Watcher:
    """Reads a WatchRooms stream as a client does: every event, every heartbeat, and the cursor to resume
    each room from (its last event's, or the last heartbeat's)."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.events: list[common_pb2.RoomEvent] = []
        self.beats: list[dict[str, int]] = []
        self.cursors: dict[str, int] = {}

    async def until(self, done: Callable[[Watcher], bool]) -> None:
        if done(self):
            return
        async for item in self.call:
            for event in item.events:
                self.events.append(event)
                self.cursors[event.room_id] = event.cursor
            if item.HasField("heartbeat"):
                self.beats.append({r.room_id: r.cursor for r in item.heartbeat.rooms})
                self.cursors = dict(self.beats[-1])
            if done(self):
                return
        raise AssertionError("the stream ended early")

    def has(self, body: str) -> bool:
        return any(e.HasField("message") and e.message.body == body for e in self.events)


async def refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    return err.value


def per_room(events: Iterable[common_pb2.RoomEvent]) -> dict[str, list[int]]:
    rooms: dict[str, list[int]] = {}
    for event in events:
        rooms.setdefault(event.room_id, []).append(event.cursor)
    return rooms


async def test_one_company_cannot_take_every_stream_slot(
    database_url: str,
    room_addr: str,
    acme: CompanyKey,
    globex: CompanyKey,
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
) -> None:
    acme_room = await create_room(acme_gw)
    globex_room = await create_room(globex_gw)
    limits = {"QUAYUTEC_GATEWAY_MAX_STREAMS_PER_COMPANY": "3", "QUAYUTEC_GATEWAY_WATCH_MAX_STREAMS": "5"}
    async with second_gateway(database_url, room_addr, acme, **limits) as gw:
        mine = [watch(gw, acme, acme_room.room_id) for _ in range(2)] + [watch_rooms(gw, acme)]
        for call in mine[:2]:
            await caught_up(call)
        await next_heartbeat(mine[2])
        # The fourth stream of one key (WatchRoom or WatchRooms alike) is refused, naming the limit.
        for extra in (watch(gw, acme, acme_room.room_id), watch_rooms(gw, acme)):
            err = await refused(extra)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
            assert "QUAYUTEC_GATEWAY_MAX_STREAMS_PER_COMPANY = 3" in (err.details() or ""), err.details()
        # Another company still gets streams on the same replica.
        theirs = watch(gw, globex, globex_room.room_id)
        await caught_up(theirs)
        # A closed stream gives its slot back.
        mine[0].cancel()
        again = watch(gw, acme, acme_room.room_id, after=0)
        await caught_up(again)
        for call in (*mine[1:], theirs, again):
            call.cancel()


async def test_watch_rooms_follows_every_room_through_joins_departures_and_a_resume(
    database_url: str,
    room_addr: str,
    acme: CompanyKey,
    globex: CompanyKey,
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
) -> None:
    first = await create_room(acme_gw, "first")
    second = await create_room(acme_gw, "second")
    w = Watcher(watch_rooms(acme_gw, acme))
    await w.until(lambda w: bool(w.beats))
    start = w.beats[0]
    assert set(start) == {first.room_id, second.room_id} and not w.events

    await post(acme_gw, first.room_id, "one")
    await post(acme_gw, second.room_id, "two")
    await w.until(lambda w: w.has("one") and w.has("two"))

    # A room Acme joins while watching is followed from its joining, at once (no heartbeat interval).
    theirs = await create_room(globex_gw, "globex's")
    await post(globex_gw, theirs.room_id, "before acme joined")
    await join_room(globex_gw, acme_gw, theirs.room_id)
    await post(globex_gw, theirs.room_id, "welcome")
    await w.until(lambda w: w.has("welcome") and any(theirs.room_id in b for b in w.beats))
    in_theirs = [e for e in w.events if e.room_id == theirs.room_id]
    assert [e.kind for e in in_theirs] == [K.ROOM_EVENT_KIND_MEMBER_JOINED, K.ROOM_EVENT_KIND_MESSAGE_POSTED]
    assert in_theirs[0].member.company_id == acme.company_id
    # A room Acme makes while watching is followed from its start.
    made = await create_room(acme_gw, "made while watching")
    await post(acme_gw, made.room_id, "in the new room")
    await w.until(lambda w: w.has("in the new room"))

    # A room Acme leaves ends with its departure, and later heartbeats no longer list it.
    await acme_gw.LeaveRoom(gateway_pb2.LeaveRoomRequest(room_id=theirs.room_id), timeout=10)
    await post(globex_gw, theirs.room_id, "after acme left")
    await post(acme_gw, first.room_id, "three")
    await w.until(lambda w: w.has("three") and any(made.room_id in b and theirs.room_id not in b for b in w.beats))
    left = [e for e in w.events if e.room_id == theirs.room_id][-1]
    assert (left.kind, left.member.company_id) == (K.ROOM_EVENT_KIND_MEMBER_LEFT, acme.company_id)
    w.call.cancel()

    # While nobody watches, rooms go on; a resume (on another replica) from the cursors received
    # replays exactly what was missed.
    await post(acme_gw, second.room_id, "while away")
    await post(acme_gw, first.room_id, "also while away")
    async with second_gateway(database_url, room_addr, acme) as other:
        w.call = watch_rooms(other, acme, after=w.cursors)
        await w.until(lambda w: w.has("while away") and w.has("also while away"))
        await post(acme_gw, made.room_id, "live again")
        await w.until(lambda w: w.has("live again"))
        w.call.cancel()

    assert all("after acme left" not in str(e) and "before acme joined" not in str(e) for e in w.events)
    got = per_room(w.events)
    for room_id, begin in start.items():
        expected = await log_of(room_addr, room_id, acme.company_id, begin)
        assert got[room_id] == [e.cursor for e in expected], room_id  # in order, none missed, none twice
    made_log = await log_of(room_addr, made.room_id, acme.company_id, 0)
    assert got[made.room_id] == [e.cursor for e in made_log]


async def test_a_resume_from_joining_follows_a_room_joined_while_no_stream_was_open(
    acme: CompanyKey, globex: CompanyKey, acme_gw: GatewayStub, globex_gw: GatewayStub
) -> None:
    """Resumed with its cursors and unnamed_from_joining, a stream follows a room the company joined
    while no stream was open from its MEMBER_JOINED event, and the named rooms from their cursors;
    without the flag the unnamed room starts from now (what a first watch asks)."""
    mine = await create_room(acme_gw, "mine")
    w = Watcher(watch_rooms(acme_gw, acme))
    await w.until(lambda w: bool(w.beats))
    w.call.cancel()
    kept = dict(w.cursors)
    assert set(kept) == {mine.room_id}

    # While no stream is open: Acme joins Globex's room, which goes on.
    theirs = await create_room(globex_gw, "globex's")
    await post(globex_gw, theirs.room_id, "before acme joined")
    await join_room(globex_gw, acme_gw, theirs.room_id)
    await post(globex_gw, theirs.room_id, "while no stream was open")
    await post(acme_gw, mine.room_id, "in mine while away")

    w = Watcher(watch_rooms(acme_gw, acme, after=kept, unnamed_from_joining=True))
    await w.until(lambda w: bool(w.beats))
    assert set(w.beats[0]) == {mine.room_id, theirs.room_id}
    in_theirs = [e for e in w.events if e.room_id == theirs.room_id]
    assert [e.kind for e in in_theirs] == [K.ROOM_EVENT_KIND_MEMBER_JOINED, K.ROOM_EVENT_KIND_MESSAGE_POSTED]
    assert in_theirs[0].member.company_id == acme.company_id and not w.has("before acme joined")
    assert w.has("while no stream was open") and w.has("in mine while away")
    w.call.cancel()

    # Without the flag (a first watch's meaning), the room not named starts from now.
    w = Watcher(watch_rooms(acme_gw, acme, after=kept))
    await w.until(lambda w: bool(w.beats))
    assert [e.room_id for e in w.events] == [mine.room_id]
    w.call.cancel()


async def test_watch_rooms_bounds_its_rooms(
    database_url: str, room_addr: str, acme: CompanyKey, acme_gw: GatewayStub
) -> None:
    for name in ("a", "b", "c"):
        await create_room(acme_gw, name)
    async with second_gateway(database_url, room_addr, acme, QUAYUTEC_GATEWAY_WATCH_MAX_ROOMS="2") as gw:
        err = await refused(watch_rooms(gw, acme))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "QUAYUTEC_GATEWAY_WATCH_MAX_ROOMS = 2" in (err.details() or "")
    assert "WatchRoom" in (err.details() or "")


async def test_bad_cursors_are_refused_in_words(
    acme: CompanyKey, globex: CompanyKey, acme_gw: GatewayStub, globex_gw: GatewayStub
) -> None:
    room = await create_room(acme_gw)
    await post(acme_gw, room.room_id, "the only event")
    for after in (2, 5_000, 2**63 - 1):  # past the room's newest event (1)
        err = await refused(watch(acme_gw, acme, room.room_id, after=after))
        assert err.code() == grpc.StatusCode.OUT_OF_RANGE, err.details()
        assert f"after {after} is past the newest event" in (err.details() or "")
        assert "(cursor 1)" in (err.details() or "")
        err = await refused(watch_rooms(acme_gw, acme, after={room.room_id: after}))
        assert err.code() == grpc.StatusCode.OUT_OF_RANGE, err.details()
        assert room.room_id in (err.details() or "")
        # The room and its newest cursor in fields too, for a client to resume from.
        trailers = dict(err.trailing_metadata() or ())
        assert trailers["quayutec-room-id"] == room.room_id and trailers["quayutec-newest-cursor"] == "1", trailers
    for after_rooms, says in (
        ([gateway_pb2.RoomCursor(room_id="not-a-room", cursor=1)], "after[0].room_id must be a room id"),
        ([gateway_pb2.RoomCursor(room_id=room.room_id, cursor=-1)], "after[0].cursor must be 0 or more"),
        ([gateway_pb2.RoomCursor(room_id=room.room_id, cursor=1)] * 2, "twice"),
    ):
        call = acme_gw.WatchRooms(gateway_pb2.WatchRoomsRequest(after=after_rooms), metadata=auth(acme), timeout=30)
        err = await refused(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and says in (err.details() or ""), err.details()
    # The newest cursor itself is fine; a room the company is not in is skipped, not revealed.
    theirs = await create_room(globex_gw, "not acme's")
    call = watch_rooms(acme_gw, acme, after={room.room_id: 1, theirs.room_id: 0})
    assert await next_heartbeat(call) == {room.room_id: 1}
    call.cancel()


async def test_watch_rooms_without_rooms_waits_for_one(
    acme: CompanyKey, globex: CompanyKey, acme_gw: GatewayStub, globex_gw: GatewayStub
) -> None:
    w = Watcher(watch_rooms(globex_gw, globex))
    await w.until(lambda w: bool(w.beats))
    assert w.beats == [{}]
    room = await create_room(acme_gw)
    await join_room(acme_gw, globex_gw, room.room_id)
    await w.until(lambda w: bool(w.events))
    assert [(e.room_id, e.kind) for e in w.events] == [(room.room_id, K.ROOM_EVENT_KIND_MEMBER_JOINED)]
    w.call.cancel()


async def test_the_watch_all_command_prints_every_rooms_events(
    gateway_addr: str, acme: CompanyKey, acme_gw: GatewayStub
) -> None:
    first = await create_room(acme_gw, "first")
    second = await create_room(acme_gw, "second")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "QUAYUTEC_GATEWAY_ADDR": gateway_addr,
        "QUAYUTEC_API_KEY": acme.secret,
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "watch", "--all", cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(60):  # a failsafe
            # It watches from now: post until its first line shows it is subscribed.
            line = asyncio.ensure_future(proc.stdout.readline())
            n = 0
            while not line.done():
                n += 1
                await post(acme_gw, first.room_id, f"ping {n}")
                await asyncio.wait({line}, timeout=0.2)
            lines.append(line.result().decode())
            await post(acme_gw, second.room_id, "in the second room")
            while "in the second room" not in lines[-1]:
                lines.append((await proc.stdout.readline()).decode())
    finally:
        proc.terminate()
        await proc.wait()
    # Each line names its room (ids only with --json) and the author's company.
    assert lines[0].startswith("first: [") and "ping" in lines[0], lines
    assert lines[-1].startswith("second: [1] message_posted #1 Ada (Acme): in the second room"), lines
