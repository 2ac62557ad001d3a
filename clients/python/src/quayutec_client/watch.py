"""A room's events as an async iterator that resumes by itself: after a dropped stream, a Gateway
restart or RESOURCE_EXHAUSTED it watches again after the last cursor it saw, so no event is missed
and none is repeated. ``cursor`` is the position to persist."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from types import TracebackType
from typing import Any

import grpc

from quayutec_client._proto import common_pb2, gateway_pb2
from quayutec_client._transport import Transport
from quayutec_client.errors import Unavailable, error_for
from quayutec_client.retry import RetryPolicy

_log = logging.getLogger("quayutec_client")


class RoomWatch:
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
    (NotFound when the company is no longer a member, CursorExpired when ``after`` is older than the
    events kept).
    """

    def __init__(
        self, transport: Transport, policy: RetryPolicy, room_id: str, *, after: int | None, idle_timeout: float
    ) -> None:
        if idle_timeout <= 0:
            raise ValueError("idle_timeout must be positive")
        self.room_id = room_id
        self.cursor = after
        self.reconnects = 0
        self._transport = transport
        self._policy = policy
        self._idle_timeout = idle_timeout
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._pending: deque[common_pb2.RoomEvent] = deque()
        self._closed = False

    def __aiter__(self) -> RoomWatch:
        return self

    async def __anext__(self) -> common_pb2.RoomEvent:
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            await self._receive()
        event = self._pending.popleft()
        self.cursor = event.cursor
        return event

    async def close(self) -> None:
        """Stop watching; the iteration ends."""
        self._closed = True
        self._drop()

    async def __aenter__(self) -> RoomWatch:
        """Opens the stream and waits for its first answer, so that a watch from now sees everything
        that happens once the block has begun."""
        if self._call is None and not self._pending:
            await self._receive()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _open(self) -> grpc.aio.UnaryStreamCall:
        request = gateway_pb2.WatchRoomRequest(room_id=self.room_id)
        if self.cursor is not None:
            request.after = self.cursor
        return self._transport.stream("WatchRoom", request)

    def _drop(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def _receive(self) -> None:
        """Read the next answer into the pending events, reconnecting as the policy allows."""
        started = self._transport.clock()
        failures = 0
        while not self._closed:
            if self._call is None:
                self._call = self._open()
            try:
                response: Any = await asyncio.wait_for(self._call.read(), self._idle_timeout)
            except grpc.aio.AioRpcError as exc:
                self._call = None
                failures += 1
                error = error_for(exc, method="WatchRoom", attempts=failures)
            except TimeoutError:
                self._drop()
                failures += 1
                error = Unavailable(
                    grpc.StatusCode.UNAVAILABLE,
                    f"nothing, not even a heartbeat, for {self._idle_timeout:g} s",
                    method="WatchRoom",
                    attempts=failures,
                )
            else:
                if response is grpc.aio.EOF:  # ended without a status: the Gateway went away
                    self._call = None
                    failures += 1
                    error = Unavailable(
                        grpc.StatusCode.UNAVAILABLE, "the stream ended", method="WatchRoom", attempts=failures
                    )
                else:
                    self._take(response)
                    return
            wait = self._transport.retry_wait(self._policy, error, failures, started)
            if wait is None:
                raise error
            self.reconnects += 1
            _log.info("watch of room %s resumes after cursor %s", self.room_id, self.cursor)
            await self._transport.sleep(wait)

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
