"""The Room's store: reading and pruning the room event log (writers append through ``StoreBase._append_events``)."""

from __future__ import annotations

from quayutec.errors import NotFound, OutOfRange
from services.room.store.base import (
    EventsPage,
    StoreBase,
)


class EventLog(StoreBase):
    """Reading and pruning the room event log (writers append through ``StoreBase._append_events``)."""

    async def read_events(
        self, room_id: str, company_id: str | None, after: int, limit: int, *, retention_hours: float
    ) -> EventsPage:
        """Events after ``after``, oldest first, with the detail only where ``company_id`` may see it (all
        when None). NOT_FOUND unless the company is a member; OUT_OF_RANGE when retention removed some."""
        async with self._pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            bounds = await conn.fetchrow(self._q["room_event_bounds"], room_id)
            if bounds is None or (
                company_id is not None and not await conn.fetchval(self._q["is_member"], room_id, company_id)
            ):
                raise NotFound(f"room {room_id} not found")
            pruned = int(bounds["events_pruned_through"])
            if after < pruned:
                raise OutOfRange(
                    f"events of room {room_id} up to cursor {pruned} were removed (events are kept "
                    f"{retention_hours:g} hours); resume after cursor {pruned} or later, or reload the room "
                    "with the List RPCs and watch from now"
                )
            rows = list(await conn.fetch(self._q["read_room_events"], room_id, after, company_id, limit))
        next_after = int(rows[-1]["seq"]) if rows else after
        return EventsPage(rows, next_after, len(rows) == limit, int(bounds["last_event_seq"]))

    async def last_event_cursor(self, room_id: str, company_id: str | None) -> int:
        """The room's newest committed cursor (a watch from now); NOT_FOUND unless the company is a member."""
        async with self._pool.acquire() as conn:
            bounds = await conn.fetchrow(self._q["room_event_bounds"], room_id)
            if bounds is None or (
                company_id is not None and not await conn.fetchval(self._q["is_member"], room_id, company_id)
            ):
                raise NotFound(f"room {room_id} not found")
            return int(bounds["last_event_seq"])

    async def prune_events(self, older_than_seconds: float, limit: int) -> int:
        """Removes up to ``limit`` events older than the retention, recording the newest cursor removed."""
        return int(await self._pool.fetchval(self._q["prune_room_events"], older_than_seconds, limit))
