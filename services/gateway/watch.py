"""WatchRoom: a room's events as they happen, replayed from a cursor and then live, each exactly once.

One LISTEN connection per replica (notify.Listener on ``quayutec_room_events``) tells the ``RoomEventHub``
which room changed. Per watched room the hub keeps one *feed*: a single shared read of the room's new
events (every audience) into a ring of the most recent ones, so a notification costs one Room call
per room, not one per stream. Each stream takes what its company may see from the ring, after its own
cursor; when the ring cannot serve it (it replays, or fell behind the ring) it reads the Room itself,
scoped to its company. Reading by cursor on every notification is what makes the seam between
replay and live free of gaps and duplicates: a stream subscribes before its first read, and whatever
commits later raises its signal again.

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

# Events a feed keeps of its room for streams to take from (all audiences).
FEED_RING_EVENTS = 1024
# Cursors one Room read covers.
READ_LIMIT = 500


@dataclass(frozen=True)
class _Entry:
    cursor: int
    event: common_pb2.RoomEvent
    audience: str  # "" for every member company


class _Feed:
    """The shared read of one room's new events, and the signals of the streams watching it."""

    def __init__(self, hub: RoomEventHub, room_id: str) -> None:
        self.room_id = room_id
        self.ring: deque[_Entry] = deque(maxlen=FEED_RING_EVENTS)
        self.cursor: int | None = None  # the newest cursor read; None until the first read succeeds
        self.signals: set[asyncio.Event] = set()
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

    def _signal(self) -> None:
        for signal in self.signals:
            signal.set()

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
                self.ring.clear()
            self._signal()
            if not self._again:
                return

    async def _read_new(self) -> None:
        if self.cursor is None:
            got = await self._hub.read(self.room_id, "", 0, from_now=True)
            self.cursor = got.last_cursor
            self.ring.clear()
            return
        while True:
            got = await self._hub.read(self.room_id, "", self.cursor)
            for entry in got.entries:
                if entry.event.cursor != self.cursor + 1:
                    self.ring.clear()  # not contiguous (cannot happen with a gap-free log): start over
                self.ring.append(_Entry(entry.event.cursor, entry.event, entry.audience_company_id))
                self.cursor = entry.event.cursor
            self.cursor = max(self.cursor, got.next_after)
            self._signal()
            if not got.more:
                return


class RoomEventHub:
    """Fans the replica's one LISTEN connection out to its WatchRoom streams (see the module doc)."""

    def __init__(
        self, room: Any, config: WatchConfig, *, room_timeout_seconds: float, listening: Callable[[], bool]
    ) -> None:
        self._room = room
        self._config = config
        self._timeout = room_timeout_seconds
        self._listening = listening
        self._feeds: dict[str, _Feed] = {}
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

    # -- streams -----------------------------------------------------------------------------------

    async def watch(
        self, room_id: str, company_id: str, after: int | None
    ) -> AsyncIterator[gateway_pb2.WatchRoomResponse]:
        """The stream's items: events, and heartbeats (caught up, and when idle). Raises to end it."""
        if self.streams >= self._config.max_streams:
            raise ResourceExhausted(
                f"this Gateway already serves {self._config.max_streams} room watches (QUAYUTEC_GATEWAY_WATCH_"
                "MAX_STREAMS); retry later or through another replica"
            )
        self.streams += 1
        feed = self._feeds.get(room_id)
        if feed is None:
            feed = self._feeds[room_id] = _Feed(self, room_id)
            feed.poke()
        signal = asyncio.Event()
        feed.signals.add(signal)
        queue: asyncio.Queue[gateway_pb2.WatchRoomResponse] = asyncio.Queue(maxsize=self._config.buffer_events)
        stream = _Stream(self, feed, signal, queue, room_id, company_id)
        producer = asyncio.create_task(stream.produce(after), name="room-watch")
        getter: asyncio.Future[gateway_pb2.WatchRoomResponse] | None = None
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, producer}, return_when=asyncio.FIRST_COMPLETED)
                failure = producer.exception() if producer.done() else None
                if failure is not None:
                    raise failure
                if not getter.done():  # pragma: no cover - the producer only ends by raising
                    raise RuntimeError("the watch ended without a reason")
                item = getter.result()
                getter = None
                yield item
        finally:
            if getter is not None:
                getter.cancel()
            producer.cancel()
            with contextlib.suppress(BaseException):
                await producer
            feed.signals.discard(signal)
            if not feed.signals and self._feeds.get(room_id) is feed:
                del self._feeds[room_id]
                feed.close()
            self.streams -= 1

    def listening(self) -> bool:
        return self._listening()

    @property
    def config(self) -> WatchConfig:
        return self._config


def _heartbeat(cursor: int) -> gateway_pb2.WatchRoomResponse:
    beat = gateway_pb2.WatchHeartbeat(cursor=cursor)
    beat.sent_at.GetCurrentTime()
    return gateway_pb2.WatchRoomResponse(heartbeat=beat)


class _Stream:
    """What one WatchRoom stream reads and offers to its caller's buffer."""

    def __init__(
        self,
        hub: RoomEventHub,
        feed: _Feed,
        signal: asyncio.Event,
        queue: asyncio.Queue[gateway_pb2.WatchRoomResponse],
        room_id: str,
        company_id: str,
    ) -> None:
        self._hub = hub
        self._feed = feed
        self._signal = signal
        self._queue = queue
        self._room_id = room_id
        self._company_id = company_id
        self._cursor = 0  # the newest cursor read (seen or skipped); what a heartbeat tells the caller

    async def produce(self, after: int | None) -> None:
        if after is None:
            got = await self._hub.read(self._room_id, self._company_id, 0, from_now=True)
            after = got.last_cursor
        self._cursor = after
        # Replay: the buffer's room paces the reads.
        while True:
            self._signal.clear()
            got = await self._hub.read(self._room_id, self._company_id, self._cursor)
            for entry in got.entries:
                await self._queue.put(gateway_pb2.WatchRoomResponse(event=entry.event))
            self._cursor = got.next_after
            if not got.more:
                break
        await self._queue.put(_heartbeat(self._cursor))
        await self._live()

    async def _live(self) -> None:
        loop = asyncio.get_running_loop()
        config = self._hub.config
        checked = loop.time()
        while True:
            interval = config.heartbeat_seconds if self._hub.listening() else config.check_seconds
            try:
                await asyncio.wait_for(self._signal.wait(), timeout=max(0.0, checked + interval - loop.time()))
            except TimeoutError:
                await self._read_own()  # re-checks membership, and catches anything a notification missed
                self._offer(_heartbeat(self._cursor))
                checked = loop.time()
                continue
            self._signal.clear()
            entries = self._feed.after(self._cursor)
            if entries is None:
                await self._read_own()
                continue
            for entry in entries:
                self._take(entry.event, entry.audience)

    async def _read_own(self) -> None:
        while True:
            got = await self._hub.read(self._room_id, self._company_id, self._cursor)
            for entry in got.entries:
                self._take(entry.event, entry.audience_company_id)
            self._cursor = max(self._cursor, got.next_after)
            if not got.more:
                return

    def _take(self, event: common_pb2.RoomEvent, audience: str) -> None:
        if event.cursor <= self._cursor:
            return
        self._cursor = event.cursor
        if audience and audience != self._company_id:
            return
        if event.kind == common_pb2.ROOM_EVENT_KIND_MEMBER_LEFT and event.member.company_id == self._company_id:
            raise NotFound(f"room {self._room_id} not found: your company is no longer a member")
        self._offer(gateway_pb2.WatchRoomResponse(event=event))

    def _offer(self, item: gateway_pb2.WatchRoomResponse) -> None:
        if self._queue.full():
            raise ResourceExhausted(
                f"this watch fell {self._queue.maxsize} events behind the room (read faster, or raise "
                "QUAYUTEC_GATEWAY_WATCH_BUFFER_EVENTS); watch again with after = the cursor of the last event "
                "or heartbeat you received"
            )
        self._queue.put_nowait(item)
