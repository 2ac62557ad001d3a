"""PostgreSQL LISTEN for the Room's "new wakes" notifications: the delivery loop polls at once
instead of at the end of its interval. Polling stays the fallback whenever the listener is down."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import asyncpg

_log = logging.getLogger("quayutec.gateway.notify")

CHANNEL = "quayutec_wakes"
RECONNECT_SECONDS = 2.0


class WakeListener:
    """Holds one pooled connection LISTENing on ``CHANNEL``; calls ``on_wakes`` for each notification."""

    def __init__(self, pool: asyncpg.Pool, on_wakes: Callable[[], None]) -> None:
        self._pool = pool
        self._on_wakes = on_wakes
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.listening = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="wake-listener")

    async def stop(self) -> None:
        """Stop listening and give the connection back; idempotent."""
        self._stopping.set()
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _notified(self, *_: Any) -> None:
        self._on_wakes()

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self._listen_once()
            except Exception as exc:
                _log.warning("listening for new wakes failed (%s); polling meanwhile", type(exc).__name__)
            self.listening.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=RECONNECT_SECONDS)

    async def _listen_once(self) -> None:
        conn = await self._pool.acquire()
        lost = asyncio.Event()
        conn.add_termination_listener(lambda _conn: lost.set())
        try:
            await conn.add_listener(CHANNEL, self._notified)
            self.listening.set()
            self._on_wakes()  # anything committed before LISTEN took effect
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
                    await conn.remove_listener(CHANNEL, self._notified)  # UNLISTEN before it goes back
            await self._pool.release(conn)
