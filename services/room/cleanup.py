"""Delivered wakes leave the outbox on a schedule, so leasing and posting cost the same at any age.

A delivered wake's row is only kept for inspection: redelivery is stopped by the claim in Claims,
not by the row. Every interval the Room deletes rows delivered more than the kept time ago, in
batches (each its own short transaction, skipping rows another replica is deleting); a full batch is
followed at once by the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from quayutec.telemetry import record_housekeeping
from services.room.store import RoomStore

BATCH = 1000

_log = logging.getLogger("quayutec.room.cleanup")


class OutboxCleaner:
    """Deletes delivered wakes older than ``keep_seconds`` every ``interval_seconds`` until stopped."""

    def __init__(self, store: RoomStore, *, keep_seconds: int, interval_seconds: float, batch: int = BATCH) -> None:
        self._store = store
        self._keep = keep_seconds
        self._interval = interval_seconds
        self._batch = batch
        self._task: asyncio.Task[None] | None = None
        self.deleted = 0

    async def clean_once(self) -> int:
        """Delete every delivered wake past the kept time, batch by batch; how many were deleted."""
        total = 0
        while True:
            deleted = await self._store.delete_delivered_wakes(self._keep, self._batch)
            total += deleted
            if deleted < self._batch:
                break
        self.deleted += total
        return total

    def start(self) -> None:
        if self._interval > 0 and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="outbox-cleanup")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            started_ns = time.time_ns()
            try:
                deleted = await self.clean_once()
            except Exception as exc:  # the database may be away for a while; try again next interval
                _log.warning("deleting delivered wakes failed (%s); trying again in %g s", exc, self._interval)
            else:
                record_housekeeping("delete delivered wakes", started_ns, {"deleted": deleted})
                if deleted:
                    _log.info("deleted %d wakes delivered more than %d s ago", deleted, self._keep)
