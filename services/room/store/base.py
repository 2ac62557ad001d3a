"""What every section of the Room's store shares: the pool and queries, the row types, the room events a
transaction appends, the ledger row a write records, and the rules' checks of an author."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

from quayutec.crypto import InvalidToken, MultiFernet
from quayutec.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from quayutec.jaeger import trace_ids as unique_trace_ids
from quayutec.sql import Queries
from quayutec.v1 import common_pb2
from services.room import convert
from services.room.rules import Act, Facts, enforce

QUERIES_PATH = Path(__file__).resolve().parent.parent / "sql" / "queries.sql"
SETTLE_WAKES_PATH = Path(__file__).resolve().parent.parent / "sql" / "settle_wakes.sql"
_SETTLE_WAKES_SQL = Queries(SETTLE_WAKES_PATH)["settle_wakes"]


@dataclass(frozen=True)
class WakeToSettle:
    """One item of ``settle_wakes``: the arguments of ``settle_wake``."""

    wake_id: str
    lease_owner: str
    delivered: bool
    retry_after_ms: int = 0
    last_error: str = ""


@dataclass(frozen=True)
class WakeSettled:
    """What ``settle_wakes`` made of one item: when it was settled, or why not."""

    wake_id: str
    settled_at: Any | None
    error: str = ""


# The largest bigint: the "before" key of a newest-first listing's first page.
_MAX_KEY = 2**63 - 1

# The oneof field of RoomEvent.detail for each kind of changed resource.
_EVENT_FIELDS: dict[type, str] = {
    common_pb2.Message: "message",
    common_pb2.Task: "task",
    common_pb2.MemoryLine: "memory",
    common_pb2.File: "file",
    common_pb2.RoomMember: "member",
    common_pb2.Run: "run",
    common_pb2.Waitpoint: "approval",
}
_RUN_ENDED = ("succeeded", "failed", "timed_out")
# A run's ledger write that moves into one of these statuses is a room event (for its company only).
_RUN_EVENTS = {
    "not_started": common_pb2.ROOM_EVENT_KIND_RUN_NOT_STARTED,
    "running": common_pb2.ROOM_EVENT_KIND_RUN_STARTED,
    "parked": common_pb2.ROOM_EVENT_KIND_RUN_PARKED,
    **{status: common_pb2.ROOM_EVENT_KIND_RUN_ENDED for status in _RUN_ENDED},
}

# record_run's $20 and $21: those statuses, and the kind of each one's event as stored.
_RUN_EVENT_ARGS = (
    list(_RUN_EVENTS),
    [convert.enum_to_text(common_pb2.RoomEventKind, k, "ROOM_EVENT_KIND_") for k in _RUN_EVENTS.values()],
)

# The ledger row's parameters of a fenced write (record_run's $1..$19) when the write records none.
_NO_RUN: tuple[None, ...] = (None,) * 19

Record = Any  # asyncpg.Record; asyncpg is untyped here


@dataclass(frozen=True)
class AuthorRef:
    """Who writes: kind 'person' or 'agent'; an agent author's company may be left empty (it is looked up)."""

    kind: str
    company_id: str
    person: str | None = None
    agent_id: str | None = None
    # The issuer that verified the person at sign-in (None: the company's service stated the name).
    verified_by: str | None = None

    def columns(self) -> tuple[str, str, str | None, str | None]:
        return self.kind, self.company_id, self.person, self.agent_id


@dataclass(frozen=True)
class Page:
    """One page of rows and the key to continue after, or None on the last page."""

    rows: list[Record]
    next_key: int | None


@dataclass(frozen=True)
class Posted:
    """The result of a deduplicated write: the row, its wakes, and whether it was an earlier one."""

    row: Record
    wakes: list[Record]
    deduplicated: bool


@dataclass(frozen=True)
class TaskUpdated:
    """The task as it now stands, the update written (or the earlier one), and all its updates."""

    task: Record
    update: Record
    updates: list[Record]
    deduplicated: bool


@dataclass(frozen=True)
class HeldSpec:
    """One held action to park: its index in the run's ledger row, kind name and arguments."""

    index: int
    kind: str
    arguments_json: str


@dataclass(frozen=True)
class WaitpointRows:
    """A waitpoint row and its held actions in index order."""

    waitpoint: Record
    held: list[Record]


@dataclass(frozen=True)
class Decided:
    """The waitpoint after a decision, whether this decision completed it, and whether it changed nothing."""

    rows: WaitpointRows
    completed: bool
    already_decided: bool


@dataclass(frozen=True)
class RunRecord:
    """A ledger row to record in a write's transaction, with the write's id filled in: into
    ``posted_message_id`` (a reply) or into the declared action with index ``action_index``."""

    run: common_pb2.Run
    action_index: int | None = None


@dataclass(frozen=True)
class RunFilters:
    """What ListRuns narrows to (None: not narrowed): a room, a status (as stored), a start-time range."""

    room_id: str | None = None
    status: str | None = None
    started_after: datetime | None = None
    started_before: datetime | None = None


@dataclass(frozen=True)
class RunContext:
    """What a run reads of its room in one consistent view (see ReadRunContext)."""

    agent: Record
    provider_key: str
    company_default: Mapping[str, str | None]  # each right as stored, None where not set
    agent_rights: Mapping[str, str | None]
    room_agents: list[Record]
    messages: list[Record]  # oldest first
    open_tasks: list[Record]
    task_updates: dict[str, list[Record]]
    memory: list[Record]  # newest first
    wake_text: str
    passages: list[Record]


@dataclass(frozen=True)
class EventsPage:
    """Events read after a cursor (read_room_events rows: seq, kind, created_at, audience_company_id,
    visible, and where visible what changed: detail, message, run, memory, or task with task_updates; see
    ``convert.room_event``)."""

    rows: list[Record]
    next_after: int
    more: bool
    last_cursor: int


# ReadRunContext's fixed bounds (the Runtime's view of a room).
ROOM_AGENTS_LIMIT = 200
OPEN_TASKS_LIMIT = 50
MEMORY_LIMIT = 50
PASSAGE_QUERY_BYTES = 1000  # validate.MAX_QUERY_BYTES: a longer wake text is searched by its start


@dataclass
class _Events:
    """The room events of one transaction, appended together by its last statement before COMMIT
    (``RoomStore._append_events``): the room row's lock, which the event cursor takes, is taken last and
    held only to COMMIT, so writes in one room wait on each other for that long only."""

    rows: list[tuple[str, str, bytes, str | None]] = field(default_factory=list)

    def add(self, room_id: str, kind: int, detail: Any, audience_company_id: str | None = None) -> None:
        """One event of ``room_id``; ``audience_company_id`` limits it to one company."""
        event = common_pb2.RoomEvent(kind=kind)  # type: ignore[arg-type]
        getattr(event, _EVENT_FIELDS[type(detail)]).CopyFrom(detail)
        kind_text = convert.enum_to_text(common_pb2.RoomEventKind, kind, "ROOM_EVENT_KIND_")
        self.rows.append((room_id, kind_text, event.SerializeToString(), audience_company_id))


def _page(rows: Sequence[Record], limit: int, key: str) -> Page:
    if len(rows) > limit:
        kept = list(rows[:limit])
        return Page(kept, int(kept[-1][key]))
    return Page(list(rows), None)


class StoreBase:
    """The pool, the cipher and the queries, and the helpers several sections use."""

    def __init__(self, pool: asyncpg.Pool, cipher: MultiFernet, queries: Queries | None = None) -> None:
        self._pool = pool
        self._cipher = cipher
        self._q = queries if queries is not None else Queries(QUERIES_PATH)

    def _provider_key(self, row: Record) -> str:
        """The decrypted key of an agent row ("" when none is stored); FAILED_PRECONDITION if undecryptable."""
        token = row["provider_key_encrypted"]
        if token is None:
            return ""
        try:
            return self._cipher.decrypt(bytes(token)).decode("utf-8")
        except InvalidToken:
            raise FailedPrecondition(
                f"the provider key of agent {row['agent_id']} cannot be decrypted with the configured "
                "QUAYUTEC_ENCRYPTION_KEY"
            ) from None

    async def _append_events(self, conn: asyncpg.Connection, events: _Events) -> None:
        """Appends ``events`` in the caller's transaction, one statement per room, with the room's next
        cursors; the room row's lock this takes is held to commit, so call it last, just before COMMIT.
        Events of an unknown room are dropped (the write's own checks refuse an unknown room)."""
        by_room: dict[str, list[tuple[str, bytes, str | None]]] = {}
        for room_id, kind, detail, audience in events.rows:
            by_room.setdefault(room_id, []).append((kind, detail, audience))
        for room_id, rows in by_room.items():
            kinds, details, audiences = zip(*rows, strict=True)
            await conn.execute(self._q["append_room_events"], room_id, list(kinds), list(details), list(audiences))
        events.rows.clear()

    async def _upsert_run(self, conn: asyncpg.Connection, events: _Events, run: common_pb2.Run) -> Record:
        """Upserts the row, fenced by ``run.attempt`` (ALREADY_EXISTS when another attempt's run holds
        it); its room event, when its status changes, goes to ``events``."""
        row = await conn.fetchrow(self._q["upsert_run_with_before"], *_run_args(run))
        if row is not None:
            self._run_event(events, row, row["status_before"])
            return row
        return _unchanged_by(await conn.fetchrow(self._q["get_run"], run.run_id), run)

    async def _record_run(self, conn: asyncpg.Connection | asyncpg.Pool, run: common_pb2.Run) -> Record:
        """Writes ``run``'s row through the fence with its room event in one statement (record_run): the row
        as ``_fenced_run`` answers it."""
        row = await conn.fetchrow(self._q["record_run"], *_run_args(run), *_RUN_EVENT_ARGS)
        return await self._fenced_run(conn, row, run)

    async def _answer_repeat(
        self,
        act: Act,
        author: AuthorRef,
        room_id: str,
        row: Record,
        repeat_of: Any,
        run: RunRecord | None,
        write_id: Any,
    ) -> None:
        """A repeat of an earlier write (its dedupe key held by company ``repeat_of``'s write ``write_id``;
        ``row["member"]``: the author's company is a member): the author's right to write here first (the
        rules checked on a repeat), then ``run``'s ledger row with the earlier write's id (record_run)."""
        facts = Facts(author.company_id, room_id, member=row["member"], repeat_of_company_id=str(repeat_of))
        enforce(act, facts, repeat=True)
        repeated = _with_write_id(run, write_id)
        if repeated is not None:
            await self._record_run(self._pool, repeated)

    async def _fenced_run(self, conn: asyncpg.Connection | asyncpg.Pool, row: Record, run: common_pb2.Run) -> Record:
        """The ledger row a fenced write (record_run, run_context_with_run, post_message) made of ``run``: the
        row written, or, when the fence refused it, the stored row if the write would leave it unchanged;
        ALREADY_EXISTS when another attempt's run holds the row, FAILED_PRECONDITION when it has ended. The
        refusal is told from the row as the statement saw it before (stored); only when that cannot explain
        it (the row was written after the statement's snapshot) is the row read again."""
        if row["run"] is not None:
            return row["run"]
        stored = row["stored"]
        if stored is None or (stored["attempt"] == run.attempt and stored["ended_at"] is None):
            stored = await conn.fetchrow(self._q["get_run"], run.run_id)
        return _unchanged_by(stored, run)

    @staticmethod
    def _run_event(events: _Events, row: Record, status_before: str | None) -> None:
        """The room event of a ledger row whose status became ``row["status"]`` (its company's only)."""
        kind = _RUN_EVENTS.get(row["status"])
        if kind is not None and status_before != row["status"] and row["company_id"]:
            events.add(str(row["room_id"]), kind, convert.run(row), str(row["company_id"]))

    async def _record_write(
        self, conn: asyncpg.Connection, events: _Events, record: RunRecord | None, write_id: Any
    ) -> None:
        """Upserts ``record``'s row with the write's id filled in (in the write's transaction)."""
        run = _with_write_id(record, write_id)
        if run is not None:
            await self._upsert_run(conn, events, run)

    async def _waitpoint_rows(self, conn: asyncpg.Connection, row: Record) -> WaitpointRows:
        held = await conn.fetch(self._q["held_actions_of"], [row["token"]])
        return WaitpointRows(row, list(held))

    @staticmethod
    def _require_run_of(record: RunRecord | None, room_id: str, author: AuthorRef) -> None:
        """A ledger row recorded with a write is of the write's room and, for an agent author, of that agent."""
        if record is None:
            return
        if record.run.room_id != room_id:
            raise InvalidArgument(f"run.room_id {record.run.room_id} is not the write's room {room_id}")
        if author.kind == "agent" and record.run.agent_id != author.agent_id:
            raise InvalidArgument(f"run.agent_id {record.run.agent_id} is not the author agent {author.agent_id}")
        if record.action_index is not None:
            _action_of(record.run, record.action_index)

    async def _archived_since(self, act: Act, facts: Facts) -> None:
        """A write its facts allowed but that wrote nothing: when the room was archived after its facts
        were read (its UPDATE of the room row, waiting for the archiving, found it archived), the rule
        `room-open` refuses it; otherwise the caller says why (its ledger row was refused)."""
        if await self._pool.fetchval(self._q["room_archived"], facts.room_id):
            enforce(act, replace(facts, archived=True))

    async def _require_room(self, conn: asyncpg.Connection, room_id: str) -> None:
        if not await conn.fetchval(self._q["room_exists"], room_id):
            raise NotFound(f"room {room_id} not found")

    async def _admit_author(
        self,
        conn: asyncpg.Connection,
        room_id: str,
        author: AuthorRef,
        act: Act,
        facts: Facts | None = None,
        *,
        repeat: bool = False,
    ) -> AuthorRef:
        """The author with its company filled in, once the room's rules allow it ``act`` (``facts``: what
        else the act's rules look at; ``repeat``: the rules a repeat of an earlier write answers to). Its
        membership row stays locked FOR SHARE to the end of the caller's transaction (see
        lock_membership), so the rule it passed holds until the write commits."""
        if author.kind == "agent":
            author = _identified(author, await conn.fetchval(self._q["agent_company"], author.agent_id))
        member = bool(await conn.fetchval(self._q["lock_membership"], room_id, author.company_id))
        archived = bool(await conn.fetchval(self._q["room_archived"], room_id))
        facts = replace(
            facts or Facts(""), company_id=author.company_id, room_id=room_id, member=member, archived=archived
        )
        enforce(act, facts, repeat=repeat)
        return author


def _with_write_id(record: RunRecord | None, write_id: Any) -> common_pb2.Run | None:
    """``record``'s ledger row with the write's id filled in: into posted_message_id (a reply) or into its
    declared action (done, with the id as its result); None without a record."""
    if record is None:
        return None
    run = common_pb2.Run()
    run.CopyFrom(record.run)
    if record.action_index is None:
        run.posted_message_id = str(write_id)
    else:
        action = _action_of(run, record.action_index)
        action.outcome = common_pb2.ACTION_OUTCOME_DONE
        action.result_id = str(write_id)
    return run


def _identified(author: AuthorRef, agent_company: Any) -> AuthorRef:
    """The author with its company filled in: an agent author's own company as stored (``agent_company``,
    None when the agent is unknown: NOT_FOUND; INVALID_ARGUMENT when the request named another company)."""
    if author.kind != "agent":
        return author
    if agent_company is None:
        raise NotFound(f"author agent {author.agent_id} not found")
    if author.company_id and author.company_id != str(agent_company):
        raise InvalidArgument(f"author agent {author.agent_id} does not belong to company {author.company_id}")
    return replace(author, company_id=str(agent_company))


def _unchanged_by(stored: Record | None, run: common_pb2.Run) -> Record:
    """``stored``, the row a fenced write of ``run`` left alone, when the write would not change it;
    ALREADY_EXISTS when another attempt's run holds it, FAILED_PRECONDITION when it has ended."""
    if stored is not None and stored["attempt"] != run.attempt:
        raise _held_by_another(run.run_id)
    if stored is None or not _same_run(convert.run(stored), run):
        raise FailedPrecondition(f"run {run.run_id} has ended; its ledger row can no longer change")
    return stored


def _held_by_another(run_id: str) -> AlreadyExists:
    """A ledger write refused by the fence: another delivery's run holds the row."""
    return AlreadyExists(
        f"run {run_id} is held by another delivery's run (the one that read the room); this run stops without acting"
    )


def _not_started_error(attempts: int, last_error: str | None) -> str:
    """What a NOT_STARTED row says: why the wake's run has not started, and what happens next."""
    times = "once" if attempts == 1 else f"{attempts} times"
    last = f"; the last delivery got {last_error}" if last_error else ""
    return (
        f"not started: the wake was delivered {times} and no run has read the room{last}; nothing was done; "
        "the wake is delivered again and the run that then reads the room takes this row over"
    )


def _passage_query(wake_text: str) -> str:
    """The wake's text cut to SearchPassages' query limit (whole characters only)."""
    return wake_text.encode("utf-8")[:PASSAGE_QUERY_BYTES].decode("utf-8", errors="ignore")


def _action_of(run: common_pb2.Run, index: int) -> common_pb2.DeclaredAction:
    action = next((a for a in run.actions if a.index == index), None)
    if action is None:
        raise InvalidArgument(f"run.actions has no action with index {index} (run_action_index)")
    return action


def trace_ids_of(run: common_pb2.Run) -> list[str]:
    """Every trace id ``run`` names, its first (trace_id) first, each once."""
    return unique_trace_ids(run.trace_id, run.trace_ids)


def _run_args(run: common_pb2.Run) -> tuple[Any, ...]:
    """The ``upsert_run_with_before`` parameters of a ledger row."""
    trace_ids = trace_ids_of(run)
    started = run.started_at.ToDatetime(tzinfo=UTC) if run.HasField("started_at") else None
    ended = run.ended_at.ToDatetime(tzinfo=UTC) if run.HasField("ended_at") else None
    return (
        run.run_id,
        run.agent_id,
        run.company_id or None,
        run.room_id,
        run.wake_id,
        convert.enum_to_text(common_pb2.WakeKind, run.wake_kind, convert.WAKE_KIND_PREFIX),
        run.wake_source_id,
        convert.enum_to_text(common_pb2.RunStatus, run.status, convert.RUN_STATUS_PREFIX),
        convert.enum_to_text(common_pb2.RunStep, run.step, convert.RUN_STEP_PREFIX),
        run.posted_message_id,
        convert.messages_json(run.actions),
        convert.messages_json(run.model_attempts),
        run.error,
        trace_ids[0] if trace_ids else "",
        run.active_ms,
        started,
        ended,
        run.attempt,
        trace_ids,
    )


def _same_run(stored: common_pb2.Run, incoming: common_pb2.Run) -> bool:
    """Whether ``incoming`` would leave the stored row as it is (ignoring updated_at and defaults filled in)."""
    candidate = common_pb2.Run()
    candidate.CopyFrom(incoming)
    candidate.ClearField("updated_at")
    if not candidate.company_id:
        candidate.company_id = stored.company_id
    # The ledger keeps every trace id it was given, the first as trace_id.
    merged = list(dict.fromkeys([*trace_ids_of(stored), *trace_ids_of(candidate)]))
    candidate.trace_id = merged[0] if merged else ""
    candidate.trace_ids[:] = merged
    if not candidate.HasField("started_at"):
        candidate.started_at.CopyFrom(stored.started_at)
    for ts in (candidate.started_at, candidate.ended_at):
        ts.nanos -= ts.nanos % 1000  # PostgreSQL keeps microseconds
    if not incoming.HasField("ended_at"):
        candidate.ClearField("ended_at")
    keep_recorded_writes(stored, candidate)
    current = common_pb2.Run()
    current.CopyFrom(stored)
    current.ClearField("updated_at")
    return candidate == current


def keep_recorded_writes(stored: common_pb2.Run, incoming: common_pb2.Run) -> None:
    """``incoming`` as a write of it leaves the stored row (the SQL fragment kept_run_writes, which the
    Room's every ledger write applies): the stored posted_message_id when the write names none, each action stored
    ACTION_OUTCOME_DONE (with its result id) in place of the write's action of that index unless the
    write records it done itself, and an action
    only the stored row has. Nothing a committed write recorded is dropped by a later write."""
    if not incoming.posted_message_id:
        incoming.posted_message_id = stored.posted_message_id
    kept = {a.index: a for a in stored.actions}
    merged: dict[int, common_pb2.DeclaredAction] = {a.index: a for a in incoming.actions}
    for index, action in kept.items():
        if index not in merged or (
            action.outcome == common_pb2.ACTION_OUTCOME_DONE and merged[index].outcome != common_pb2.ACTION_OUTCOME_DONE
        ):
            merged[index] = action
    actions = []
    for index in sorted(merged):
        action = common_pb2.DeclaredAction()
        action.CopyFrom(merged[index])
        actions.append(action)
    incoming.ClearField("actions")
    incoming.actions.extend(actions)
