"""WatchRoom and WatchRooms: room events as they happen, replayed from a cursor and then live, each exactly once.

One LISTEN connection per replica (notify.Listener on ``quayutec_room_events``) tells the ``RoomEventHub``
which room changed. Per watched room the hub keeps one *feed*: a single shared read of the room's new
events (every audience) into a ring of the most recent ones, so a notification costs one Room call
per room, not one per stream. Each stream follows its room (WatchRoom) or every room of its company
(WatchRooms) with one *follow* per room: it takes what its company may see from the ring, after its
own cursor in that room, pushed to it by the feed as soon as a read lands (no task of its own wakes
per event); when the ring cannot serve it (it replays, or fell behind the ring) the stream reads the
Room itself, scoped to its company. Reading by cursor is what makes the seam between replay and live
free of gaps and duplicates: a follow subscribes before its first read, takes only cursors after its
own, and whatever commits later reaches it by the feed or by its own next read.

A busy room (read less than a second ago) is read ``QUAYUTEC_GATEWAY_WATCH_COALESCE_MS`` after its
notification, so what is posted meanwhile goes to every stream in one response: with many watchers the
cost is per send (a write to each stream's socket), not per event. A quiet room's event is read at once,
and so is a room followed by fewer than ``QUAYUTEC_GATEWAY_WATCH_COALESCE_MIN_STREAMS`` streams: for a
few watchers a batch saves little, and the delay would sit on every reply's path (a person posting and
waiting for the agent's answer would wait the whole delay on it).

Every stream has one bounded buffer. While it replays, reading waits for room in the buffer; once
live, a caller that lets the buffer fill is cut with RESOURCE_EXHAUSTED (it resumes from its last
cursors). A cursor past the room's newest event is OUT_OF_RANGE.

Membership: a WatchRoom re-checks it by each of its own reads (heartbeat interval, or the check
interval while the listener is down), and a "member left" event of its own company ends it at once.
A WatchRooms stream lists its company's rooms again at each heartbeat interval and whenever a
``quayutec_company_rooms`` notification names its company (the Gateway sends one when a company
joins or makes a room); a room joined is followed from its MEMBER_JOINED event of the company (found
among the room's newest events), a room left ends with that MEMBER_LEFT event and is dropped. A stream
resumed with ``unnamed_from_joining`` starts the rooms its cursors do not name the same way, so a room
joined while no stream was open is not missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any

import grpc

from quayutec.errors import NotFound, OutOfRange, ResourceExhausted
from quayutec.v1 import common_pb2, gateway_pb2, room_pb2
from services.gateway.config import WatchConfig

_log = logging.getLogger("quayutec.gateway.watch")

# Events, and bytes of them, a feed keeps of its room for streams to take from (all audiences). Live
# streams hold the same event objects in their buffers, not copies.
FEED_RING_EVENTS = 1024
FEED_RING_BYTES = 4 * 1024 * 1024
# A room whose events were read this recently (or 10 coalesce_ms, if longer) is busy: its next read waits
# WatchConfig.coalesce_ms.
ACTIVE_SECONDS = 1.0
# Cursors one Room read covers; also how far back a newly joined room is searched for the join.
READ_LIMIT = 500
# Most events, and bytes of them, one response carries (a caller that falls behind gets batches).
BATCH_EVENTS = 64
BATCH_BYTES = 1024 * 1024
# A membership check or room listing answered this recently serves every stream of the same company.
CHECK_REUSE_SECONDS = 1.0
# Room calls one WatchRooms stream makes at once while it starts.
START_CONCURRENCY = 16
ROOMS_PAGE = 500

Item = common_pb2.RoomEvent | gateway_pb2.WatchHeartbeat | gateway_pb2.WatchRoomsHeartbeat


@dataclass(frozen=True)
class _Entry:
    cursor: int
    event: common_pb2.RoomEvent
    audience: str  # "" for every member company
    size: int


class _Feed:
    """The shared read of one room's new events, and the live follows it pushes them to."""

    def __init__(self, hub: RoomEventHub, room_id: str) -> None:
        self.room_id = room_id
        self.ring: deque[_Entry] = deque()
        self.ring_bytes = 0
        self.cursor: int | None = None  # the newest cursor read; None until the first read succeeds
        self.follows: set[_Follow] = set()  # every follow of this room (replaying or live)
        self._hub = hub
        self._task: asyncio.Task[None] | None = None
        self._again = False
        self._last_read = 0.0  # monotonic time the latest read of new events began

    def poke(self) -> None:
        """Read what is new (again after the current read, if one is under way)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._read(), name=f"room-feed-{self.room_id}")
        else:
            self._again = True

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def after(self, cursor: int) -> list[_Entry] | None:
        """The ring's entries after ``cursor``; None when the ring cannot tell (the stream reads itself)."""
        if self.cursor is None:
            return None
        if cursor >= self.cursor:
            return []
        if not self.ring or self.ring[0].cursor > cursor + 1:
            return None
        return list(islice(self.ring, cursor + 1 - self.ring[0].cursor, None))

    def _keep(self, entry: _Entry) -> None:
        self.ring.append(entry)
        self.ring_bytes += entry.size
        while len(self.ring) > FEED_RING_EVENTS or (self.ring_bytes > FEED_RING_BYTES and len(self.ring) > 1):
            self.ring_bytes -= self.ring.popleft().size

    def _clear(self) -> None:
        self.ring.clear()
        self.ring_bytes = 0

    def _push(self) -> None:
        for follow in list(self.follows):
            follow.from_feed()

    async def _read(self) -> None:
        while True:
            # A room read less than ACTIVE_SECONDS ago is read coalesce_ms after its notification: what
            # is posted meanwhile goes to every stream in the same response. A quiet room's event is read
            # at once, and so is a room few streams follow (a batch would save them little, at that delay).
            now = time.monotonic()
            config = self._hub.config
            coalesce = config.coalesce_ms / 1000
            if (
                self.cursor is not None
                and len(self.follows) >= config.coalesce_min_streams
                and now - self._last_read < max(ACTIVE_SECONDS, 10 * coalesce)
            ):
                await asyncio.sleep(coalesce)
            self._last_read = now
            self._again = False
            try:
                await self._read_new()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Streams fall back to their own reads (which report the error to their callers).
                _log.warning("reading new events of room %s failed (%s)", self.room_id, type(exc).__name__)
                self.cursor = None
                self._clear()
                self._push()
            if not self._again:
                return

    async def _read_new(self) -> None:
        if self.cursor is None:
            got = await self._hub.read(self.room_id, "", 0, from_now=True)
            self.cursor = got.last_cursor
            self._clear()
            self._push()
            return
        while True:
            got = await self._hub.read(self.room_id, "", self.cursor)
            for entry in got.entries:
                event = entry.event
                if event.cursor != self.cursor + 1:
                    self._clear()  # not contiguous (cannot happen with a gap-free log): start over
                self._keep(_Entry(event.cursor, event, entry.audience_company_id, event.ByteSize()))
                self.cursor = event.cursor
            self.cursor = max(self.cursor, got.next_after)
            self._push()
            if not got.more:
                return


class RoomEventHub:
    """Fans the replica's one LISTEN connection out to its WatchRoom and WatchRooms streams (see the module doc)."""

    def __init__(
        self, room: Any, config: WatchConfig, *, room_timeout_seconds: float, listening: Callable[[], bool]
    ) -> None:
        self._room = room
        self.config = config
        self._timeout = room_timeout_seconds
        self._listening = listening
        self._feeds: dict[str, _Feed] = {}
        self._checks: dict[tuple[str, str], asyncio.Future[Any]] = {}
        self._listings: dict[str, asyncio.Future[list[str]]] = {}
        self._rooms_streams: dict[str, set[_RoomsStream]] = {}
        self.streams = 0

    # -- the listener's callbacks ------------------------------------------------------------------

    def notified(self, room_id: str) -> None:
        feed = self._feeds.get(room_id)
        if feed is not None:
            feed.poke()

    def rooms_changed(self, company_id: str) -> None:
        """The company joined or made a room: its WatchRooms streams list their rooms again now."""
        company_id = company_id.strip()
        self._listings.pop(company_id, None)
        for stream in list(self._rooms_streams.get(company_id, ())):
            stream.relist()

    def reconnected(self) -> None:
        """LISTEN took effect (again): anything may have committed meanwhile."""
        self._listings.clear()
        for feed in self._feeds.values():
            feed.poke()
        for streams in self._rooms_streams.values():
            for stream in streams:
                stream.relist()

    def listening(self) -> bool:
        return self._listening()

    # -- Room reads --------------------------------------------------------------------------------

    async def read(
        self, room_id: str, company_id: str, after: int, *, from_now: bool = False
    ) -> room_pb2.RoomServiceReadRoomEventsResponse:
        try:
            response: room_pb2.RoomServiceReadRoomEventsResponse = await self._room.ReadRoomEvents(
                room_pb2.RoomServiceReadRoomEventsRequest(
                    room_id=room_id, company_id=company_id, after=after, from_now=from_now, limit=READ_LIMIT
                ),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise NotFound(f"room {room_id} not found") from None
            if exc.code() == grpc.StatusCode.OUT_OF_RANGE:  # older than the events kept: say of which room
                raise OutOfRange(exc.details() or "cursor out of range", room_id=room_id) from None
            raise
        return response

    async def check_member(self, room_id: str, company_id: str) -> None:
        """NOT_FOUND unless the company is still a member; one Room call serves all the company's streams
        of the room that ask within CHECK_REUSE_SECONDS."""
        await self._shared(
            self._checks, (room_id, company_id), lambda: self.read(room_id, company_id, 0, from_now=True)
        )

    async def company_rooms(self, company_id: str) -> list[str]:
        """The ids of the company's rooms, oldest membership first; RESOURCE_EXHAUSTED beyond max_rooms.
        One listing serves every stream of the company that asks within CHECK_REUSE_SECONDS."""
        rooms: list[str] = await self._shared(self._listings, company_id, lambda: self._list_rooms(company_id))
        return rooms

    async def _list_rooms(self, company_id: str) -> list[str]:
        most = self.config.max_rooms
        rooms: list[str] = []
        token = ""
        while True:
            got = await self._room.ListRooms(
                room_pb2.RoomServiceListRoomsRequest(company_id=company_id, page_size=ROOMS_PAGE, page_token=token),
                timeout=self._timeout,
            )
            rooms.extend(r.room_id for r in got.rooms)
            if len(rooms) > most:
                raise ResourceExhausted(
                    f"your company is a member of more than {most} rooms, more than one WatchRooms stream follows "
                    f"(QUAYUTEC_GATEWAY_WATCH_MAX_ROOMS = {most}); watch single rooms with WatchRoom, or leave rooms "
                    "you no longer use"
                )
            token = got.next_page_token
            if not token:
                return rooms

    async def _shared(self, table: dict[Any, asyncio.Future[Any]], key: Any, call: Callable[[], Any]) -> Any:
        """The answer of ``call``, shared by every caller of the same key within CHECK_REUSE_SECONDS."""
        shared = table.get(key)
        if shared is None:
            shared = asyncio.ensure_future(call())
            table[key] = shared

            def forget(done: asyncio.Future[Any]) -> None:
                if not done.cancelled():
                    done.exception()  # retrieved here; each waiter sees it through the shield
                asyncio.get_running_loop().call_later(CHECK_REUSE_SECONDS, self._forget, table, key, done)

            shared.add_done_callback(forget)
        return await asyncio.shield(shared)

    @staticmethod
    def _forget(table: dict[Any, asyncio.Future[Any]], key: Any, shared: asyncio.Future[Any]) -> None:
        if table.get(key) is shared:
            del table[key]

    async def join_start(self, room_id: str, company_id: str) -> int:
        """Where a room the company joined while watching starts: just before the company's newest
        MEMBER_JOINED event among the room's last READ_LIMIT events (else the oldest of those)."""
        last = (await self.read(room_id, company_id, 0, from_now=True)).last_cursor
        start = max(0, last - READ_LIMIT)
        try:
            got = await self.read(room_id, company_id, start)
        except OutOfRange:
            return last  # the window reaches before what is kept: from now
        for entry in reversed(got.entries):
            event = entry.event
            if event.kind == common_pb2.ROOM_EVENT_KIND_MEMBER_JOINED and event.member.company_id == company_id:
                return int(event.cursor) - 1
        return start

    # -- follows and feeds -------------------------------------------------------------------------

    def _attach(self, follow: _Follow) -> _Feed:
        feed = self._feeds.get(follow.room_id)
        if feed is None:
            feed = self._feeds[follow.room_id] = _Feed(self, follow.room_id)
            feed.poke()
        feed.follows.add(follow)
        return feed

    def _detach(self, follow: _Follow) -> None:
        feed = follow.feed
        feed.follows.discard(follow)
        if not feed.follows and self._feeds.get(feed.room_id) is feed:
            del self._feeds[feed.room_id]
            feed.close()

    def _count_stream(self) -> None:
        if self.streams >= self.config.max_streams:
            raise ResourceExhausted(
                f"this Gateway replica already serves {self.config.max_streams} room watches (the replica-wide "
                f"limit, QUAYUTEC_GATEWAY_WATCH_MAX_STREAMS = {self.config.max_streams}); retry later or through "
                "another replica"
            )
        self.streams += 1

    # -- streams -----------------------------------------------------------------------------------

    async def watch(
        self, room_id: str, company_id: str, after: int | None
    ) -> AsyncIterator[gateway_pb2.WatchRoomResponse]:
        """WatchRoom's items: events, and heartbeats (caught up, and when idle). Raises to end it."""
        self._count_stream()
        stream = _RoomStream(self, room_id, company_id)
        try:
            async for response in stream.sink.responses(lambda: stream.produce(after)):
                yield response
        finally:
            self._detach(stream.follow)
            self.streams -= 1

    async def watch_rooms(
        self, company_id: str, after: Mapping[str, int], *, unnamed_from_joining: bool = False
    ) -> AsyncIterator[gateway_pb2.WatchRoomsResponse]:
        """WatchRooms' items: events of every room of the company, and heartbeats listing each room's cursor.
        Rooms not in ``after`` start from now, or from the company's joining with ``unnamed_from_joining``."""
        self._count_stream()
        stream = _RoomsStream(self, company_id)
        self._rooms_streams.setdefault(company_id, set()).add(stream)
        try:
            async for response in stream.sink.responses(lambda: stream.produce(dict(after), unnamed_from_joining)):
                yield response
        finally:
            streams = self._rooms_streams.get(company_id)
            if streams is not None:
                streams.discard(stream)
                if not streams:
                    del self._rooms_streams[company_id]
            for follow in list(stream.follows.values()):
                self._detach(follow)
            self.streams -= 1


def _heartbeat(cursor: int) -> gateway_pb2.WatchHeartbeat:
    beat = gateway_pb2.WatchHeartbeat(cursor=cursor)
    beat.sent_at.GetCurrentTime()
    return beat


class _Sink:
    """The caller's side of one stream: a bounded buffer of events and heartbeats, and how it ends."""

    def __init__(self, limit: int, response: Callable[..., Any]) -> None:
        self._limit = limit
        self._response = response
        # Events and heartbeats not yet sent (each event counts against the limit).
        self.buffer: deque[Item] = deque()
        self.ready = asyncio.Event()  # the caller's side: something to send, or the end
        self.drained = asyncio.Event()  # the replay's side: the caller took something
        self.failure: BaseException | None = None

    async def responses(self, producer: Callable[[], Awaitable[None]]) -> AsyncIterator[Any]:
        """The stream's responses while ``producer()`` (run as its own task) fills the buffer; raises its end."""
        task = asyncio.create_task(self._run(producer), name="room-watch")
        try:
            while True:
                if self.failure is not None:
                    raise self.failure
                if self.buffer:
                    response = self.next_response()
                    self.drained.set()
                    yield response
                    continue
                self.ready.clear()
                await self.ready.wait()
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def _run(self, producer: Callable[[], Awaitable[None]]) -> None:
        try:
            await producer()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.fail(exc)

    async def put(self, item: Item) -> None:
        """Append, waiting for room in the buffer (replay: the caller's pace paces the reads)."""
        while len(self.buffer) >= self._limit:
            self.drained.clear()
            await self.drained.wait()
        self.append(item)

    def offer(self, item: Item) -> None:
        """Append now (live), or end the stream when the caller let the buffer fill."""
        if len(self.buffer) >= self._limit:
            raise ResourceExhausted(
                f"this watch fell {self._limit} events behind (read faster, or raise "
                "QUAYUTEC_GATEWAY_WATCH_BUFFER_EVENTS); watch again with after = the cursor of the last event "
                "or heartbeat you received"
            )
        self.append(item)

    def append(self, item: Item) -> None:
        self.buffer.append(item)
        self.ready.set()

    def next_response(self) -> Any:
        """The next response from the (non-empty) buffer: a heartbeat, or the events before the next one."""
        first = self.buffer.popleft()
        if not isinstance(first, common_pb2.RoomEvent):
            return self._response(heartbeat=first)
        events = [first]
        size = first.ByteSize()
        while self.buffer and len(events) < BATCH_EVENTS:
            following = self.buffer[0]
            if not isinstance(following, common_pb2.RoomEvent):
                break
            size += following.ByteSize()
            if size > BATCH_BYTES:
                break
            self.buffer.popleft()
            events.append(following)
        return self._response(events=events)

    def fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
            self.ready.set()


class _Follow:
    """One room followed by one stream: the stream's cursor in it, fed by the room's feed once live."""

    def __init__(
        self,
        hub: RoomEventHub,
        room_id: str,
        company_id: str,
        sink: _Sink,
        *,
        wake: Callable[[], None],
        left: Callable[[_Follow, common_pb2.RoomEvent], None],
    ) -> None:
        self.room_id = room_id
        self._hub = hub
        self._company_id = company_id
        self._sink = sink
        self._wake = wake
        self._left = left
        self.cursor = 0  # the newest cursor read (seen or skipped); what a heartbeat tells the caller
        self.live = False
        self.gap = False  # the ring could not serve this follow: the stream's task reads it
        self.gone = False  # the company left the room (WatchRooms drops the follow)
        self.feed = hub._attach(self)  # subscribed before the first read

    async def replay(self) -> None:
        """Reads after the cursor until caught up, waiting for room in the buffer (not live yet)."""
        while True:
            got = await self._read()
            for entry in got.entries:
                await self._sink.put(entry.event)
            self.cursor = max(self.cursor, got.next_after)
            if not got.more:
                return

    async def read_own(self) -> None:
        """A live read of its own (a gap in the ring, or no notifications); re-checks membership too."""
        self.gap = False
        while True:
            got = await self._read()
            for entry in got.entries:
                self._take(entry.event.cursor, entry.event, entry.audience_company_id)
            self.cursor = max(self.cursor, got.next_after)
            if not got.more:
                return

    async def _read(self) -> room_pb2.RoomServiceReadRoomEventsResponse:
        got = await self._hub.read(self.room_id, self._company_id, self.cursor)
        if self.cursor > got.last_cursor:
            raise OutOfRange(
                f"after {self.cursor} is past the newest event of room {self.room_id} (cursor {got.last_cursor}): "
                "resume after a cursor you received, or watch from now",
                room_id=self.room_id,
                newest_cursor=got.last_cursor,
            )
        return got

    def from_feed(self) -> None:
        """Takes the feed's new entries after this follow's cursor (live follows only)."""
        if not self.live or self._sink.failure is not None:
            return
        entries = self.feed.after(self.cursor)
        if entries is None:
            self.gap = True
            self._wake()  # the ring cannot serve this cursor: the stream's task reads it
            return
        try:
            for entry in entries:
                self._take(entry.cursor, entry.event, entry.audience)
        except Exception as exc:
            self._sink.fail(exc)

    def _take(self, cursor: int, event: common_pb2.RoomEvent, audience: str) -> None:
        if cursor <= self.cursor or self.gone:
            return
        self.cursor = cursor
        if audience and audience != self._company_id:
            return
        if event.kind == common_pb2.ROOM_EVENT_KIND_MEMBER_LEFT and event.member.company_id == self._company_id:
            self._left(self, event)
            return
        self._sink.offer(event)


class _Pacer:
    """When a stream's task runs next: when woken (a gap in the ring, a change of rooms), else when its
    interval is due (the heartbeat interval, or the check interval while the listener is down)."""

    def __init__(self, hub: RoomEventHub, wake: asyncio.Event) -> None:
        self._hub = hub
        self._wake = wake
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()

    async def next_round(self, *, at_once: bool = False) -> bool:
        """Waits for the next round; True when the interval is due (a heartbeat, a re-check)."""
        config = self._hub.config
        due = self._last + (config.heartbeat_seconds if self._hub.listening() else config.check_seconds)
        if self._loop.time() < due and not at_once:
            timer = self._loop.call_at(due, self._wake.set)
            await self._wake.wait()
            timer.cancel()
        self._wake.clear()
        return self._loop.time() >= due

    def beat(self) -> None:
        """A heartbeat went out: the next is an interval from now."""
        self._last = self._loop.time()


class _RoomStream:
    """One WatchRoom stream: one follow, and the task that replays, re-checks and heartbeats."""

    def __init__(self, hub: RoomEventHub, room_id: str, company_id: str) -> None:
        self._hub = hub
        self._room_id = room_id
        self._company_id = company_id
        self.sink = _Sink(hub.config.buffer_events, gateway_pb2.WatchRoomResponse)
        self._wake = asyncio.Event()
        self.follow = _Follow(hub, room_id, company_id, self.sink, wake=self._wake.set, left=self._left)

    def _left(self, follow: _Follow, event: common_pb2.RoomEvent) -> None:
        raise NotFound(f"room {self._room_id} not found: your company is no longer a member")

    async def produce(self, after: int | None) -> None:
        follow = self.follow
        if after is None:
            after = (await self._hub.read(self._room_id, self._company_id, 0, from_now=True)).last_cursor
        follow.cursor = after
        await follow.replay()
        self.sink.append(_heartbeat(follow.cursor))
        # Live: the feed pushes what it reads; this task only re-checks, and reads when the ring cannot serve.
        follow.live = True
        follow.from_feed()
        pacer = _Pacer(self._hub, self._wake)
        while True:
            due = await pacer.next_round()
            if not due or not self._hub.listening():
                await follow.read_own()  # a gap in the ring, or no notifications: read (and re-check membership)
            else:
                await self._hub.check_member(self._room_id, self._company_id)
            if due:
                self.sink.offer(_heartbeat(follow.cursor))
                pacer.beat()


class _RoomsStream:
    """One WatchRooms stream: a follow per room of its company, and the task that replays, lists the
    company's rooms again (joins and departures), reads gaps and heartbeats."""

    def __init__(self, hub: RoomEventHub, company_id: str) -> None:
        self._hub = hub
        self._company_id = company_id
        self.sink = _Sink(hub.config.buffer_events, gateway_pb2.WatchRoomsResponse)
        self.follows: dict[str, _Follow] = {}
        self._wake = asyncio.Event()
        self._relist = False

    def relist(self) -> None:
        self._relist = True
        self._wake.set()

    def _left(self, follow: _Follow, event: common_pb2.RoomEvent) -> None:
        self.sink.offer(event)  # the room's last event on this stream
        follow.gone = True
        follow.live = False
        self._wake.set()

    def _follow(self, room_id: str) -> _Follow:
        follow = _Follow(self._hub, room_id, self._company_id, self.sink, wake=self._wake.set, left=self._left)
        self.follows[room_id] = follow
        return follow

    def _drop(self, room_id: str) -> None:
        follow = self.follows.pop(room_id, None)
        if follow is not None:
            self._hub._detach(follow)

    def _heartbeat(self) -> gateway_pb2.WatchRoomsHeartbeat:
        beat = gateway_pb2.WatchRoomsHeartbeat(
            rooms=[gateway_pb2.RoomCursor(room_id=f.room_id, cursor=f.cursor) for f in self.follows.values()]
        )
        beat.sent_at.GetCurrentTime()
        return beat

    async def _start(self, follows: list[_Follow], start: Callable[[_Follow], Any]) -> None:
        """Sets each follow's first cursor with ``start`` (a few Room calls at once); a room the company
        is no longer a member of is dropped."""
        limit = asyncio.Semaphore(START_CONCURRENCY)

        async def one(follow: _Follow) -> None:
            async with limit:
                try:
                    follow.cursor = await start(follow)
                except NotFound:
                    self._drop(follow.room_id)

        await asyncio.gather(*(one(f) for f in follows))

    async def _now(self, follow: _Follow) -> int:
        return int((await self._hub.read(follow.room_id, self._company_id, 0, from_now=True)).last_cursor)

    async def _checked(self, follow: _Follow) -> int:
        """The follow's cursor, once a read after it has found it in range (else OutOfRange)."""
        await follow._read()
        return follow.cursor

    async def _joined(self, follow: _Follow) -> int:
        return await self._hub.join_start(follow.room_id, self._company_id)

    async def _replay(self, follows: list[_Follow]) -> None:
        for follow in follows:
            if follow.room_id not in self.follows:
                continue
            try:
                await follow.replay()
            except NotFound:
                self._drop(follow.room_id)

    async def produce(self, after: dict[str, int], unnamed_from_joining: bool) -> None:
        rooms = await self._hub.company_rooms(self._company_id)
        follows = [self._follow(room_id) for room_id in rooms]
        named = [f for f in follows if f.room_id in after]
        for follow in named:
            follow.cursor = after[follow.room_id]
        unnamed = [f for f in follows if f.room_id not in after]
        # Every named cursor is checked before any event is sent: one out of range (older than the
        # events kept, or past its room's newest) ends the stream with OUT_OF_RANGE and nothing else.
        await self._start(named, self._checked)
        await self._start(unnamed, self._joined if unnamed_from_joining else self._now)
        await self._replay(follows)
        self.sink.append(self._heartbeat())
        self._go_live(follows)
        pacer = _Pacer(self._hub, self._wake)
        while True:
            due = await pacer.next_round(at_once=self._relist)
            changed = False
            for follow in [f for f in self.follows.values() if f.gone]:
                self._drop(follow.room_id)
                changed = True
            listening = self._hub.listening()
            for follow in [f for f in self.follows.values() if f.gap or not listening]:
                try:
                    await follow.read_own()
                except NotFound:
                    self._drop(follow.room_id)
                    changed = True
            if self._relist or due:
                self._relist = False
                changed = await self._sync_rooms() or changed
            if changed or due:
                self.sink.offer(self._heartbeat())
                pacer.beat()

    def _go_live(self, follows: list[_Follow]) -> None:
        for follow in follows:
            if follow.room_id in self.follows:
                follow.live = True
                follow.from_feed()

    async def _sync_rooms(self) -> bool:
        """Follows the rooms the company joined and drops those it left; True when anything changed."""
        rooms = await self._hub.company_rooms(self._company_id)
        listed = set(rooms)
        gone = [room_id for room_id in self.follows if room_id not in listed]
        for room_id in gone:
            self._drop(room_id)
        joined = [self._follow(room_id) for room_id in rooms if room_id not in self.follows]
        await self._start(joined, self._joined)
        await self._replay(joined)
        self._go_live(joined)
        return bool(gone or joined)
