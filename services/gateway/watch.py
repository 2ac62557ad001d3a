"""WatchRoom: a room's events as they happen, replayed from a cursor and then live, each exactly once.

One LISTEN connection per replica (notify.Listener on ``quayutec_room_events``) tells the ``RoomEventHub``
which room changed. Per watched room the hub keeps one *feed*: a single shared read of the room's new
events (every audience) into a ring of the most recent ones, so a notification costs one Room call
per room, not one per stream. Each stream takes what its company may see from the ring, after its own
cursor, pushed to it by the feed as soon as a read lands (no task of its own wakes per event); when
the ring cannot serve it (it replays, or fell behind the ring) it reads the Room itself, scoped to its
company. Reading by cursor is what makes the seam between replay and live free of gaps and
duplicates: a stream subscribes before its first read, takes only cursors after its own, and
whatever commits later reaches it by the feed or by its own next read.

Every stream has a bounded buffer. While it replays, reading waits for room in the buffer; once live,
a caller that lets the buffer fill is cut with RESOURCE_EXHAUSTED (it resumes from its last cursor).
Membership is re-checked by each of the stream's own reads (heartbeat interval, or the check interval
while the listener is down), and a "member left" event of the stream's own company ends it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from itertools import islice
from typing import Any

import grpc

from quayutec.errors import NotFound, ResourceExhausted
from quayutec.v1 import common_pb2, gateway_pb2, room_pb2
from services.gateway.config import WatchConfig

_log = logging.getLogger("quayutec.gateway.watch")

# Events, and bytes of them, a feed keeps of its room for streams to take from (all audiences). Live
# streams hold the same event objects in their buffers, not copies.
FEED_RING_EVENTS = 1024
FEED_RING_BYTES = 4 * 1024 * 1024
# Cursors one Room read covers.
READ_LIMIT = 500
# Most events, and bytes of them, one WatchRoomResponse carries (a caller that falls behind gets batches).
BATCH_EVENTS = 64
BATCH_BYTES = 1024 * 1024
# A membership check answered this recently serves every stream of the same company and room.
CHECK_REUSE_SECONDS = 1.0


@dataclass(frozen=True)
class _Entry:
    cursor: int
    event: common_pb2.RoomEvent
    audience: str  # "" for every member company
    size: int


class _Feed:
    """The shared read of one room's new events, and the live streams it pushes them to."""

    def __init__(self, hub: RoomEventHub, room_id: str) -> None:
        self.room_id = room_id
        self.ring: deque[_Entry] = deque()
        self.ring_bytes = 0
        self.cursor: int | None = None  # the newest cursor read; None until the first read succeeds
        self.streams: set[_Stream] = set()  # every stream of this room (replaying or live)
        self._hub = hub
        self._task: asyncio.Task[None] | None = None
        self._again = False

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
        for stream in list(self.streams):
            stream.from_feed()

    async def _read(self) -> None:
        while True:
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
    """Fans the replica's one LISTEN connection out to its WatchRoom streams (see the module doc)."""

    def __init__(
        self, room: Any, config: WatchConfig, *, room_timeout_seconds: float, listening: Callable[[], bool]
    ) -> None:
        self._room = room
        self.config = config
        self._timeout = room_timeout_seconds
        self._listening = listening
        self._feeds: dict[str, _Feed] = {}
        self._checks: dict[tuple[str, str], asyncio.Future[Any]] = {}
        self.streams = 0

    # -- the listener's callbacks ------------------------------------------------------------------

    def notified(self, room_id: str) -> None:
        feed = self._feeds.get(room_id)
        if feed is not None:
            feed.poke()

    def reconnected(self) -> None:
        """LISTEN took effect (again): anything may have committed meanwhile."""
        for feed in self._feeds.values():
            feed.poke()

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
            raise
        return response

    async def check_member(self, room_id: str, company_id: str) -> None:
        """NOT_FOUND unless the company is still a member; one Room call serves all the company's streams
        of the room that ask within CHECK_REUSE_SECONDS."""
        key = (room_id, company_id)
        check = self._checks.get(key)
        if check is None:
            check = asyncio.ensure_future(self.read(room_id, company_id, 0, from_now=True))
            self._checks[key] = check

            def forget(done: asyncio.Future[Any]) -> None:
                if not done.cancelled():
                    done.exception()  # retrieved here; each waiter sees it through the shield
                asyncio.get_running_loop().call_later(CHECK_REUSE_SECONDS, self._forget_check, key, done)

            check.add_done_callback(forget)
        await asyncio.shield(check)

    def _forget_check(self, key: tuple[str, str], check: asyncio.Future[Any]) -> None:
        if self._checks.get(key) is check:
            del self._checks[key]

    # -- streams -----------------------------------------------------------------------------------

    async def watch(
        self, room_id: str, company_id: str, after: int | None
    ) -> AsyncIterator[gateway_pb2.WatchRoomResponse]:
        """The stream's items: events, and heartbeats (caught up, and when idle). Raises to end it."""
        if self.streams >= self.config.max_streams:
            raise ResourceExhausted(
                f"this Gateway already serves {self.config.max_streams} room watches (QUAYUTEC_GATEWAY_WATCH_"
                "MAX_STREAMS); retry later or through another replica"
            )
        self.streams += 1
        feed = self._feeds.get(room_id)
        if feed is None:
            feed = self._feeds[room_id] = _Feed(self, room_id)
            feed.poke()
        stream = _Stream(self, feed, room_id, company_id)
        feed.streams.add(stream)
        producer = asyncio.create_task(stream.produce(after), name="room-watch")
        try:
            while True:
                if stream.failure is not None:
                    raise stream.failure
                if stream.buffer:
                    item = stream.next_response()
                    stream.drained.set()
                    yield item
                    continue
                stream.ready.clear()
                await stream.ready.wait()
        finally:
            producer.cancel()
            with contextlib.suppress(BaseException):
                await producer
            feed.streams.discard(stream)
            if not feed.streams and self._feeds.get(room_id) is feed:
                del self._feeds[room_id]
                feed.close()
            self.streams -= 1


def _heartbeat(cursor: int) -> gateway_pb2.WatchHeartbeat:
    beat = gateway_pb2.WatchHeartbeat(cursor=cursor)
    beat.sent_at.GetCurrentTime()
    return beat


class _Stream:
    """One WatchRoom stream: its cursor, its bounded buffer, and the task that replays and re-checks."""

    def __init__(self, hub: RoomEventHub, feed: _Feed, room_id: str, company_id: str) -> None:
        self._hub = hub
        self._feed = feed
        self._room_id = room_id
        self._company_id = company_id
        self._cursor = 0  # the newest cursor read (seen or skipped); what a heartbeat tells the caller
        self._live = False
        self._limit = hub.config.buffer_events
        # Events and heartbeats not yet sent (each event counts against the limit).
        self.buffer: deque[common_pb2.RoomEvent | gateway_pb2.WatchHeartbeat] = deque()
        self.ready = asyncio.Event()  # the caller's side: something to send, or the end
        self.drained = asyncio.Event()  # the replay's side: the caller took something
        self.failure: BaseException | None = None
        self._wake = asyncio.Event()  # this stream's own read is due (a gap, or the check interval)

    # -- the stream's own task ---------------------------------------------------------------------

    async def produce(self, after: int | None) -> None:
        try:
            await self._produce(after)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(exc)

    async def _produce(self, after: int | None) -> None:
        if after is None:
            got = await self._hub.read(self._room_id, self._company_id, 0, from_now=True)
            after = got.last_cursor
        self._cursor = after
        # Replay: the caller's pace paces the reads.
        while True:
            got = await self._hub.read(self._room_id, self._company_id, self._cursor)
            for entry in got.entries:
                while len(self.buffer) >= self._limit:
                    self.drained.clear()
                    await self.drained.wait()
                self._append(entry.event)
            self._cursor = got.next_after
            if not got.more:
                break
        self._append(_heartbeat(self._cursor))
        # Live: the feed pushes what it reads; this task only re-checks, and reads when the ring cannot serve.
        self._live = True
        self.from_feed()
        loop = asyncio.get_running_loop()
        checked = loop.time()
        while True:
            config = self._hub.config
            interval = config.heartbeat_seconds if self._hub.listening() else config.check_seconds
            due = checked + interval
            if loop.time() < due:
                timer = loop.call_at(due, self._wake.set)
                await self._wake.wait()
                timer.cancel()
            self._wake.clear()
            if loop.time() < due or not self._hub.listening():
                await self._read_own()  # a gap in the ring, or no notifications: read (and re-check membership)
            else:
                await self._hub.check_member(self._room_id, self._company_id)
            if loop.time() >= due:
                self._offer(_heartbeat(self._cursor))
                checked = loop.time()

    async def _read_own(self) -> None:
        while True:
            got = await self._hub.read(self._room_id, self._company_id, self._cursor)
            for entry in got.entries:
                self._take(entry.event.cursor, entry.event, entry.audience_company_id)
            self._cursor = max(self._cursor, got.next_after)
            if not got.more:
                return

    # -- pushed by the feed ------------------------------------------------------------------------

    def from_feed(self) -> None:
        """Takes the feed's new entries after this stream's cursor (live streams only)."""
        if not self._live or self.failure is not None:
            return
        entries = self._feed.after(self._cursor)
        if entries is None:
            self._wake.set()  # the ring cannot serve this cursor: the stream's task reads it
            return
        try:
            for entry in entries:
                self._take(entry.cursor, entry.event, entry.audience)
        except Exception as exc:
            self._fail(exc)

    # -- both ----------------------------------------------------------------------------------------

    def _take(self, cursor: int, event: common_pb2.RoomEvent, audience: str) -> None:
        if cursor <= self._cursor:
            return
        self._cursor = cursor
        if audience and audience != self._company_id:
            return
        if event.kind == common_pb2.ROOM_EVENT_KIND_MEMBER_LEFT and event.member.company_id == self._company_id:
            raise NotFound(f"room {self._room_id} not found: your company is no longer a member")
        self._offer(event)

    def _offer(self, item: common_pb2.RoomEvent | gateway_pb2.WatchHeartbeat) -> None:
        if len(self.buffer) >= self._limit:
            raise ResourceExhausted(
                f"this watch fell {self._limit} events behind the room (read faster, or raise "
                "QUAYUTEC_GATEWAY_WATCH_BUFFER_EVENTS); watch again with after = the cursor of the last event "
                "or heartbeat you received"
            )
        self._append(item)

    def _append(self, item: common_pb2.RoomEvent | gateway_pb2.WatchHeartbeat) -> None:
        self.buffer.append(item)
        self.ready.set()

    def next_response(self) -> gateway_pb2.WatchRoomResponse:
        """The next response from the (non-empty) buffer: a heartbeat, or the events before the next one."""
        first = self.buffer.popleft()
        if isinstance(first, gateway_pb2.WatchHeartbeat):
            return gateway_pb2.WatchRoomResponse(heartbeat=first)
        if not self.buffer:
            return gateway_pb2.WatchRoomResponse(events=[first])
        events = [first]
        size = first.ByteSize()
        while self.buffer and len(events) < BATCH_EVENTS:
            following = self.buffer[0]
            if isinstance(following, gateway_pb2.WatchHeartbeat):
                break
            size += following.ByteSize()
            if size > BATCH_BYTES:
                break
            self.buffer.popleft()
            events.append(following)
        return gateway_pb2.WatchRoomResponse(events=events)

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
            self._live = False
            self.ready.set()
