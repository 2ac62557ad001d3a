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
        """Events after ``after``, oldest first, with what changed only where ``company_id`` may see it (all
        when None). NOT_FOUND unless the company is a member; OUT_OF_RANGE when retention removed some.

        Round trips: 1 (read_room_events: the room's cursors, the membership and the events, one snapshot)."""
        rows = await self._pool.fetch(self._q["read_room_events"], room_id, after, company_id, limit)
        if not rows or not rows[0]["member"]:
            raise NotFound(f"room {room_id} not found")
        pruned = int(rows[0]["events_pruned_through"])
        if after < pruned:
            raise OutOfRange(
                f"events of room {room_id} up to cursor {pruned} were removed (events are kept "
                f"{retention_hours:g} hours); resume after cursor {pruned} or later, or reload the room "
                "with the List RPCs and watch from now"
            )
        events = [r for r in rows if r["seq"] is not None]
        next_after = int(events[-1]["seq"]) if events else after
        return EventsPage(events, next_after, len(events) == limit, int(rows[0]["last_event_seq"]))

    async def last_event_cursor(self, room_id: str, company_id: str | None) -> int:
        """The room's newest committed cursor (a watch from now); NOT_FOUND unless the company is a member.
        Round trips: 1 (read_room_events reading no event)."""
        rows = await self._pool.fetch(self._q["read_room_events"], room_id, 0, company_id, 0)
        if not rows or not rows[0]["member"]:
            raise NotFound(f"room {room_id} not found")
        return int(rows[0]["last_event_seq"])

    async def prune_events(self, older_than_seconds: float, limit: int) -> int:
        """Removes up to ``limit`` events older than the retention, recording the newest cursor removed."""
        return int(await self._pool.fetchval(self._q["prune_room_events"], older_than_seconds, limit))
