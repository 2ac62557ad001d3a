"""Room events as async iterators that resume by themselves: after a dropped stream, a Gateway restart
or RESOURCE_EXHAUSTED they watch again after the last cursors they received, so no event is missed and
none is repeated. ``RoomWatch`` follows one room (WatchRoom) and its ``cursor`` is the position to
persist; ``RoomsWatch`` follows every room of your company (WatchRooms) and its ``cursors`` (room id
to cursor) are."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self

import grpc

from quayutec_client._proto import common_pb2, gateway_pb2
from quayutec_client._transport import Transport, identified, new_request_id
from quayutec_client.errors import QuayutecError, Unavailable, connection_failure
from quayutec_client.retry import RetryPolicy

_log = logging.getLogger("quayutec_client")


class _ResumingStream:
    """One server stream opened again, as the policy allows, whenever it fails with UNAVAILABLE,
    DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED, ends without a status, or stays silent for
    ``idle_timeout`` seconds; each answer goes to ``_take``, and ``_open`` says where to resume."""

    _method = ""

    def __init__(self, transport: Transport, policy: RetryPolicy, idle_timeout: float) -> None:
        if idle_timeout <= 0:
            raise ValueError("idle_timeout must be positive")
        self.reconnects = 0
        # Sent as x-request-id on every stream of this watch, and in its errors.
        self.request_id = new_request_id()
        self._transport = transport
        self._policy = policy
        self._idle_timeout = idle_timeout
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._pending: deque[Any] = deque()  # received, not yet handed out
        self._closed = False

    def _open(self) -> grpc.aio.UnaryStreamCall:
        raise NotImplementedError

    def _take(self, response: Any) -> None:
        raise NotImplementedError

    def _resumes_after(self) -> str:
        """Where the next stream starts, for the log."""
        raise NotImplementedError

    async def _next(self) -> Any:
        """The next item received (reading, and reconnecting, while there is none); the iteration ends
        once the watch is closed."""
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            await self._identified_receive()
        return self._pending.popleft()

    async def _identified_receive(self) -> None:
        try:
            await self._receive()
        except QuayutecError as error:
            identified(error, self.request_id, self._transport.metadata())
            raise

    async def close(self) -> None:
        """Stop watching; the iteration ends."""
        self._closed = True
        self._drop()

    async def __aenter__(self) -> Self:
        """Opens the stream and waits for its first answer, so that a watch from now sees everything
        that happens once the block has begun."""
        if self._call is None and not self._pending:
            await self._identified_receive()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _drop(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def _receive(self) -> None:
        """Read the next answer into the pending items, reconnecting as the policy allows. Closed when
        the client is closed under it."""
        transport = self._transport
        started = transport.clock()
        failures = tries = closed_early = 0
        while not self._closed:
            if transport.closed:
                raise transport.closed_error(self._method, failures)
            if self._call is None:
                self._call = self._open()
            error: QuayutecError
            tries += 1
            was_sent = True
            try:
                response: Any = await asyncio.wait_for(self._call.read(), self._idle_timeout)
            except grpc.aio.AioRpcError as exc:
                self._call = None
                if transport.closed:
                    raise transport.closed_error(self._method, failures) from exc
                error, was_sent = transport.failure(exc, self._method, tries, closed_early)
                closed_early = 0 if was_sent or connection_failure(exc) != "closed" else closed_early + 1
            except TimeoutError:
                self._drop()
                error = Unavailable(
                    grpc.StatusCode.UNAVAILABLE,
                    f"nothing, not even a heartbeat, for {self._idle_timeout:g} s",
                    method=self._method,
                    attempts=tries,
                )
            except asyncio.CancelledError:
                self._call = None
                task = asyncio.current_task()
                if transport.closed and not (task is not None and task.cancelling()):
                    raise transport.closed_error(self._method, failures) from None
                raise
            else:
                if response is grpc.aio.EOF:  # ended without a status: the Gateway went away
                    self._call = None
                    if transport.closed:
                        raise transport.closed_error(self._method, failures)
                    error = Unavailable(
                        grpc.StatusCode.UNAVAILABLE, "the stream ended", method=self._method, attempts=tries
                    )
                else:
                    self._take(response)
                    return
            failures += was_sent
            wait = transport.retry_wait(self._policy, error, failures if was_sent else 0, started, retry=tries)
            if wait is None:
                raise error
            self.reconnects += 1
            _log.info("%s resumes %s", self._method, self._resumes_after())
            await transport.pause(wait, self._method, failures)


class RoomWatch(_ResumingStream):
    """Iterate with ``async for event in watch``; each ``RoomEvent`` comes once, in room order.

    ``cursor`` is the cursor of the last event handed to you (or of a heartbeat after it): store it
    once you have handled an event, and pass it back as ``after`` to carry on after a restart of your
    own. Before the first event or heartbeat of a watch from now it is None. Used as
    ``async with client.watch(room) as events``, the stream is open when the block begins (so "from
    now" is then); a bare ``async for`` opens it at the first iteration.

    A stream that fails with UNAVAILABLE, DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED, ends without a
    status, or stays silent for ``idle_timeout`` seconds (the Gateway sends heartbeats when idle) is
    opened again after ``cursor``, with the backoff of ``policy``; the policy's attempts and total time
    bound the reconnects between two answers. Other errors end the iteration as typed errors
    (NotFound when the company is no longer a member, Unauthenticated when the key was revoked,
    CursorOutOfRange when ``after`` is older than the events kept or past the room's newest event).
    """

    _method = "WatchRoom"

    def __init__(
        self, transport: Transport, policy: RetryPolicy, room_id: str, *, after: int | None, idle_timeout: float
    ) -> None:
        super().__init__(transport, policy, idle_timeout)
        self.room_id = room_id
        self.cursor = after

    def __aiter__(self) -> RoomWatch:
        return self

    async def __anext__(self) -> common_pb2.RoomEvent:
        event: common_pb2.RoomEvent = await self._next()
        self.cursor = event.cursor
        return event

    def _open(self) -> grpc.aio.UnaryStreamCall:
        request = gateway_pb2.WatchRoomRequest(room_id=self.room_id)
        if self.cursor is not None:
            request.after = self.cursor
        return self._transport.stream("WatchRoom", request, self.request_id)

    def _resumes_after(self) -> str:
        return f"of room {self.room_id} after cursor {self.cursor}"

    def _take(self, response: gateway_pb2.WatchRoomResponse) -> None:
        last = self.cursor if self.cursor is not None else -1
        if self._pending:
            last = self._pending[-1].cursor
        for event in response.events:
            if event.cursor > last:  # never twice, even if a stream repeated itself
                self._pending.append(event)
                last = event.cursor
        if response.HasField("heartbeat") and not self._pending:
            self.cursor = max(self.cursor or 0, response.heartbeat.cursor)


def _moved(cursors: Mapping[str, int], heartbeat: gateway_pb2.WatchRoomsHeartbeat) -> dict[str, int]:
    """The rooms a heartbeat lists, at its cursors (never behind ``cursors``): rooms it no longer lists
    were left, rooms new to it were joined."""
    return {r.room_id: max(r.cursor, cursors.get(r.room_id, r.cursor)) for r in heartbeat.rooms}


class RoomsWatch(_ResumingStream):
    """Iterate with ``async for event in watch``: the events of every room of your company, each once
    and in its room's order (rooms interleave; ``event.room_id`` says which).

    ``cursors`` maps each room followed to the cursor of its last event handed to you (or of a
    heartbeat after it): store it (or the event's room and cursor) once you have handled an event,
    and pass it back as ``after`` to carry on after a restart of your own. A room your company joins
    while watching is followed from its joining (its MEMBER_JOINED event of your company comes first)
    and enters ``cursors`` then; a room it leaves ends with its MEMBER_LEFT event and leaves
    ``cursors`` at the next heartbeat.

    Without ``after`` the watch starts from now (in ``async with``, when the block begins) and
    ``cursors`` fills at the Gateway's first heartbeat. With ``after``, the rooms it names resume after
    their cursors and every other room of your company starts from its joining, so nothing of a room
    joined while you were away is missed; a named room your company has left is dropped. (The Gateway
    looks for the joining among a room's newest 500 events; a room joined longer ago starts at the
    oldest of those.)

    It reconnects as ``RoomWatch`` does (after the last cursors received; rooms joined while the
    stream was down are followed from their joining too). Other errors end the iteration as typed
    errors: Unauthenticated when the key was revoked or expired, RateLimited when more rooms than one
    stream follows, CursorOutOfRange (with its ``room_id``) when a cursor is older than the events kept
    or past its room's newest event, InvalidArgument when ``after`` is malformed.
    """

    _method = "WatchRooms"

    def __init__(
        self,
        transport: Transport,
        policy: RetryPolicy,
        *,
        after: Mapping[str, int] | None,
        idle_timeout: float,
    ) -> None:
        super().__init__(transport, policy, idle_timeout)
        # What was handed out (the caller's position) and what was received (where a stream resumes).
        self._cursors: dict[str, int] = dict(after or {})
        self._received: dict[str, int] = dict(self._cursors)
        # From the first heartbeat on (or with the caller's cursors), a room not named was joined since.
        self._from_joining = after is not None

    @property
    def cursors(self) -> dict[str, int]:
        """Room id -> the cursor to resume that room after (a copy)."""
        return dict(self._cursors)

    def __aiter__(self) -> RoomsWatch:
        return self

    async def __anext__(self) -> common_pb2.RoomEvent:
        while isinstance(item := await self._next(), gateway_pb2.WatchRoomsHeartbeat):
            self._cursors = _moved(self._cursors, item)
        event: common_pb2.RoomEvent = item
        self._cursors[event.room_id] = event.cursor
        return event

    def _open(self) -> grpc.aio.UnaryStreamCall:
        request = gateway_pb2.WatchRoomsRequest(
            after=[gateway_pb2.RoomCursor(room_id=room, cursor=cursor) for room, cursor in self._received.items()],
            unnamed_from_joining=self._from_joining,
        )
        return self._transport.stream("WatchRooms", request, self.request_id)

    def _resumes_after(self) -> str:
        return f"after the cursors of {len(self._received)} rooms"

    def _take(self, response: gateway_pb2.WatchRoomsResponse) -> None:
        for event in response.events:
            if event.cursor > self._received.get(event.room_id, -1):  # never twice, even if a stream repeated
                self._received[event.room_id] = event.cursor
                self._pending.append(event)
        if response.HasField("heartbeat"):
            self._received = _moved(self._received, response.heartbeat)
            self._from_joining = True
            if self._pending:  # it applies once the events before it are handed out
                self._pending.append(response.heartbeat)
            else:
                self._cursors = _moved(self._cursors, response.heartbeat)
