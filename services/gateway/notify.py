"""PostgreSQL LISTEN, one connection per listener per Gateway replica: the Room's "new wakes" (the
delivery loop polls at once instead of at the end of its interval); and, on one other connection, the
Room's "room events" (payload: the room id; watch streams read their room's new events), the
Gateway's "keys revoked" (payload: the key id; that key's open streams end) and "company rooms"
(payload: a company id that joined or made a room; its WatchRooms streams follow it). Polling and
periodic re-checks stay the fallback whenever a listener is down."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import asyncpg

_log = logging.getLogger("quayutec.gateway.notify")

CHANNEL = "quayutec_wakes"
ROOM_EVENTS_CHANNEL = "quayutec_room_events"
COMPANY_ROOMS_CHANNEL = "quayutec_company_rooms"
RECONNECT_SECONDS = 2.0


class Listener:
    """Holds one pooled connection LISTENing on each channel of ``channels``; calls the channel's
    function with the payload of each notification, and ``on_listening()`` each time LISTEN takes
    effect (anything committed before)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        channels: Mapping[str, Callable[[str], None]],
        on_listening: Callable[[], None],
    ) -> None:
        self._pool = pool
        self._channels = dict(channels)
        self._channel = ", ".join(self._channels)
        self._on_listening = on_listening
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.listening = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"listener-{self._channel}")

    async def stop(self) -> None:
        """Stop listening and give the connection back; idempotent."""
        self._stopping.set()
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _notified(self, _conn: Any, _pid: int, channel: str, payload: str) -> None:
        self._channels[channel](payload)

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self._listen_once()
            except Exception as exc:
                _log.warning("listening on %s failed (%s); polling meanwhile", self._channel, type(exc).__name__)
            self.listening.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=RECONNECT_SECONDS)

    async def _listen_once(self) -> None:
        conn = await self._pool.acquire()
        lost = asyncio.Event()
        conn.add_termination_listener(lambda _conn: lost.set())
        try:
            for channel in self._channels:
                await conn.add_listener(channel, self._notified)
            self.listening.set()
            self._on_listening()  # anything committed before LISTEN took effect
            waiters = {asyncio.ensure_future(lost.wait()), asyncio.ensure_future(self._stopping.wait())}
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
        finally:
            if lost.is_set() or conn.is_closed():
                conn.terminate()
            else:
                with contextlib.suppress(Exception):
                    for channel in self._channels:
                        await conn.remove_listener(channel, self._notified)  # UNLISTEN before it goes back
            await self._pool.release(conn)


class WakeListener(Listener):
    """LISTEN ``quayutec_wakes``; calls ``on_wakes`` for each notification and after (re)connecting."""

    def __init__(self, pool: asyncpg.Pool, on_wakes: Callable[[], None]) -> None:
        super().__init__(pool, {CHANNEL: lambda _payload: on_wakes()}, on_wakes)
