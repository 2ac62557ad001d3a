"""The Room's PostgreSQL store: every write is one transaction; posts record their wakes in it (outbox).

One class per section of the room's data (``membership``, ``messages``, ``memory``, ``runs``, ``events``,
``wakes``, ``waitpoints``), each over ``base.StoreBase`` (the pool, the queries, the row types and the
helpers they share); ``RoomStore`` is all of them.
"""

from __future__ import annotations

from services.room.store.base import (
    MEMORY_LIMIT,
    OPEN_TASKS_LIMIT,
    PASSAGE_QUERY_BYTES,
    QUERIES_PATH,
    ROOM_AGENTS_LIMIT,
    SETTLE_WAKES_PATH,
    AuthorRef,
    Decided,
    EventsPage,
    HeldSpec,
    Page,
    Posted,
    Record,
    RunContext,
    RunFilters,
    RunRecord,
    TaskUpdated,
    WaitpointRows,
    WakeSettled,
    WakeToSettle,
    trace_ids_of,
)
from services.room.store.events import EventLog
from services.room.store.membership import Membership
from services.room.store.memory import MemoryAndFiles
from services.room.store.messages import MessagesAndTasks
from services.room.store.runs import RunLedger
from services.room.store.waitpoints import Waitpoints
from services.room.store.wakes import WakeOutbox


class RoomStore(Membership, MessagesAndTasks, MemoryAndFiles, RunLedger, EventLog, WakeOutbox, Waitpoints):
    """Rooms, members, agents and their rights, messages, tasks, memory, files, the run ledger, waitpoints
    and the wake outbox."""


__all__ = [
    "MEMORY_LIMIT",
    "OPEN_TASKS_LIMIT",
    "PASSAGE_QUERY_BYTES",
    "QUERIES_PATH",
    "ROOM_AGENTS_LIMIT",
    "SETTLE_WAKES_PATH",
    "AuthorRef",
    "Decided",
    "EventsPage",
    "HeldSpec",
    "Page",
    "Posted",
    "Record",
    "RoomStore",
    "RunContext",
    "RunFilters",
    "RunRecord",
    "TaskUpdated",
    "WaitpointRows",
    "WakeSettled",
    "WakeToSettle",
    "trace_ids_of",
]
