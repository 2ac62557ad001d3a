"""A replica that cannot reach its database says so in its gRPC health: NOT_SERVING while a probe
(one ``SELECT 1`` on a pooled connection, bounded) fails, SERVING again once one succeeds, so load
balancers and clients move to another replica meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import asyncpg

from quayutec.errors import is_connection_error

_log = logging.getLogger("quayutec.dbhealth")


class DatabaseHealth:
    """Probes ``pool`` every ``interval`` seconds (each probe bounded by ``timeout``) and calls
    ``set_serving(False)`` when it starts failing, ``set_serving(True)`` when it works again."""

    def __init__(self, pool: asyncpg.Pool, *, interval: float, timeout: float) -> None:
        self._pool = pool
        self._interval = interval
        self._timeout = timeout
        self._task: asyncio.Task[None] | None = None
        self.reachable = True

    async def probe(self) -> bool:
        """True when the database answers a ``SELECT 1`` within the timeout."""
        try:
            async with asyncio.timeout(self._timeout):
                async with self._pool.acquire(timeout=self._timeout) as conn:
                    await conn.fetchval("SELECT 1", timeout=self._timeout)
        except Exception as exc:
            if not (is_connection_error(exc) or isinstance(exc, TimeoutError)):
                _log.warning("database health probe failed: %r", exc)
            return False
        return True

    def start(self, set_serving: Callable[[bool], Awaitable[None]]) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(set_serving), name="database-health")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, set_serving: Callable[[bool], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(self._interval)
            reachable = await self.probe()
            if reachable != self.reachable:
                self.reachable = reachable
                state = "reached again: health SERVING" if reachable else "unreachable: health NOT_SERVING"
                _log.warning("database %s", state)
                await set_serving(reachable)
