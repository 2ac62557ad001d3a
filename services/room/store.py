"""The Room's PostgreSQL store: every write is one transaction; posts record their wakes in it (outbox)."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

from quayutec.crypto import InvalidToken, MultiFernet
from quayutec.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, OutOfRange
from quayutec.ledger import mark_undone, run_id_for
from quayutec.sql import Queries
from quayutec.telemetry import current_traceparent, expiry_span
from quayutec.v1 import common_pb2
from services.room import convert
from services.room.rules import Act, Facts, enforce

QUERIES_PATH = Path(__file__).resolve().parent / "sql" / "queries.sql"
SETTLE_WAKES_PATH = Path(__file__).resolve().parent / "sql" / "settle_wakes.sql"
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

Record = Any  # asyncpg.Record; asyncpg is untyped here
# Called inside a posting transaction between its writes; tests use it to interrupt the transaction.
TransactionHook = Callable[[asyncpg.Connection], Awaitable[None]]


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
    """Events read after a cursor: (seq, kind, created_at, audience, detail or None when not visible)."""

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


class RoomStore:
    """Rooms, members, agents and their rights, messages, tasks, memory, files, the run ledger, waitpoints
    and the wake outbox."""

    def __init__(self, pool: asyncpg.Pool, cipher: MultiFernet, queries: Queries | None = None) -> None:
        self._pool = pool
        self._cipher = cipher
        self._q = queries if queries is not None else Queries(QUERIES_PATH)

    # -- companies, rooms, members --------------------------------------------------------------------------

    async def create_company(self, name: str) -> Record:
        try:
            return await self._pool.fetchrow(self._q["create_company"], name)
        except asyncpg.UniqueViolationError:
            raise AlreadyExists(f"a company named {name!r} already exists") from None

    async def get_company(self, company_id: str) -> Record:
        row = await self._pool.fetchrow(self._q["get_company"], company_id)
        if row is None:
            raise NotFound(f"company {company_id} not found")
        return row

    async def create_room(self, company_id: str, name: str, dedupe_key: str | None = None) -> Record:
        """A room with ``company_id`` its creator and first member; a repeat of ``dedupe_key`` from the
        same company answers the first room."""
        if dedupe_key is not None:
            earlier = await self._pool.fetchrow(self._q["find_room_by_dedupe"], company_id, dedupe_key)
            if earlier is not None:
                return earlier
        row = await self._pool.fetchrow(self._q["create_room"], company_id, name, dedupe_key)
        if row is None and dedupe_key is not None:  # a concurrent create with the same key committed first
            row = await self._pool.fetchrow(self._q["find_room_by_dedupe"], company_id, dedupe_key)
        if row is None:
            raise NotFound(f"company {company_id} not found")
        return row

    async def get_room(self, room_id: str, member_company_id: str | None = None) -> Record:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow(self._q["get_room"], room_id)
            if row is None or (
                member_company_id is not None
                and not await conn.fetchval(self._q["is_member"], room_id, member_company_id)
            ):
                raise NotFound(f"room {room_id} not found")
            return row

    async def list_rooms(self, company_id: str, after: int | None, limit: int) -> Page:
        rows = await self._pool.fetch(self._q["list_rooms"], company_id, after or 0, limit + 1)
        return _page(rows, limit, "pos")

    # -- invitations and departures (membership by consent) ------------------------------------------------

    async def create_invitation(
        self, room_id: str, company_id: str, inviter: str, dedupe_key: str | None = None
    ) -> Record:
        """A pending invitation of ``company_id`` by the member company ``inviter``; ALREADY_EXISTS for a
        member or a pending invitee. A repeat of ``dedupe_key`` from the same inviter answers the first
        invitation, once the inviter's right to invite here is checked."""
        try:
            return await self._create_invitation(room_id, company_id, inviter, dedupe_key)
        except asyncpg.UniqueViolationError as exc:
            if dedupe_key is None or exc.constraint_name != "room_invitations_inviter_dedupe_key":
                raise
        # A concurrent invite (into another room) with the same key committed first: the retry answers it.
        return await self._create_invitation(room_id, company_id, inviter, dedupe_key)

    async def _create_invitation(self, room_id: str, company_id: str, inviter: str, dedupe_key: str | None) -> Record:
        async with self._pool.acquire() as conn, conn.transaction():
            room = await conn.fetchrow(self._q["lock_room_for_membership"], room_id)
            if room is None:
                raise NotFound(f"room {room_id} not found")
            member = await conn.fetchval(self._q["is_member"], room_id, inviter)
            enforce(Act.INVITE, Facts(inviter, room_id, member=member))
            if dedupe_key is not None:
                earlier = await conn.fetchval(self._q["find_invitation_by_dedupe"], inviter, dedupe_key)
                if earlier is not None:
                    return await conn.fetchrow(self._q["get_invitation"], earlier)
            if not await conn.fetchval(self._q["company_exists"], company_id):
                raise NotFound(f"company {company_id} not found")
            if await conn.fetchval(self._q["is_member"], room_id, company_id):
                raise AlreadyExists(f"company {company_id} is already a member of room {room_id}")
            invitation_id = await conn.fetchval(self._q["insert_invitation"], room_id, company_id, inviter, dedupe_key)
            if invitation_id is None:
                pending = await conn.fetchval(self._q["find_pending_invitation"], room_id, company_id)
                raise AlreadyExists(
                    f"company {company_id} already has a pending invitation to room {room_id} ({pending}); "
                    "it becomes a member when it accepts"
                )
            return await conn.fetchrow(self._q["get_invitation"], invitation_id)

    async def list_invitations(
        self, company_id: str, status: str, after: int | None, limit: int, *, sent: bool = False
    ) -> Page:
        """The invitations to ``company_id`` in one status, or (``sent``) those it sent."""
        query = self._q["list_sent_invitations" if sent else "list_invitations"]
        rows = await self._pool.fetch(query, company_id, status, after or 0, limit + 1)
        return _page(rows, limit, "pos")

    async def list_room_invitations(
        self, room_id: str, company_id: str, status: str, after: int | None, limit: int
    ) -> Page:
        """The invitations into ``room_id`` in one status, for its creator."""
        async with self._pool.acquire() as conn:
            room = await conn.fetchrow(self._q["get_room"], room_id)
            if room is None:
                raise NotFound(f"room {room_id} not found")
            member = await conn.fetchval(self._q["is_member"], room_id, company_id)
            creator = str(room["created_by_company_id"])
            enforce(Act.MANAGE_INVITATIONS, Facts(company_id, room_id, member=member, creator_id=creator))
            rows = await conn.fetch(self._q["list_room_invitations"], room_id, status, after or 0, limit + 1)
        return _page(rows, limit, "pos")

    async def withdraw_invitation(self, invitation_id: str, company_id: str) -> Record:
        """A pending invitation withdrawn by the room's creator or its sender; withdrawing again changes
        nothing."""
        async with self._pool.acquire() as conn, conn.transaction():
            invitation = await conn.fetchrow(self._q["lock_invitation"], invitation_id)
            if invitation is None:
                raise NotFound(f"invitation {invitation_id} not found")
            room_id = str(invitation["room_id"])
            room = await conn.fetchrow(self._q["get_room"], room_id)
            member = await conn.fetchval(self._q["lock_membership"], room_id, company_id)
            facts = Facts(
                company_id,
                room_id,
                member=bool(member),
                creator_id=str(room["created_by_company_id"]),
                object_id=invitation_id,
                owner_id=str(invitation["invited_by_company_id"]),
            )
            enforce(Act.MANAGE_INVITATIONS, facts)
            if invitation["status"] in ("accepted", "declined"):
                raise FailedPrecondition(f"invitation {invitation_id} was already {invitation['status']}")
            await conn.execute(self._q["respond_invitation"], invitation_id, "withdrawn")
            return await conn.fetchrow(self._q["get_invitation"], invitation_id)

    async def accept_invitation(self, invitation_id: str, company_id: str) -> tuple[Record, Record]:
        """The invitation accepted and the company's membership, in one transaction; a repeat while still
        a member answers the same."""
        async with self._pool.acquire() as conn, conn.transaction():
            invitation = await self._lock_own_invitation(conn, invitation_id, company_id)
            room_id = invitation["room_id"]
            if invitation["status"] == "declined":
                raise FailedPrecondition(
                    f"invitation {invitation_id} was declined; a member of the room must invite you again"
                )
            if invitation["status"] == "withdrawn":
                raise FailedPrecondition(
                    f"invitation {invitation_id} was withdrawn (by the room's creator or its sender, or its sender "
                    "left the room); a member of the room must invite you again"
                )
            joined = False
            if invitation["status"] == "pending":
                await conn.execute(self._q["respond_invitation"], invitation_id, "accepted")
                await conn.execute(self._q["add_member"], room_id, company_id)
                joined = True
            member = await conn.fetchrow(self._q["get_member"], room_id, company_id)
            if joined and member is not None:
                events = _Events()
                events.add(str(room_id), common_pb2.ROOM_EVENT_KIND_MEMBER_JOINED, convert.member(member))
                await self._append_events(conn, events)  # the room row last (membership rows, then the room)
            if member is None:
                raise FailedPrecondition(
                    f"invitation {invitation_id} was accepted and your company has left room {room_id} since; "
                    "a member of the room must invite you again"
                )
            return await conn.fetchrow(self._q["get_invitation"], invitation_id), member

    async def decline_invitation(self, invitation_id: str, company_id: str) -> Record:
        """The invitation declined; declining again changes nothing."""
        async with self._pool.acquire() as conn, conn.transaction():
            invitation = await self._lock_own_invitation(conn, invitation_id, company_id)
            if invitation["status"] == "accepted":
                raise FailedPrecondition(
                    f"invitation {invitation_id} was already accepted; to leave the room, use LeaveRoom"
                )
            if invitation["status"] == "pending":
                await conn.execute(self._q["respond_invitation"], invitation_id, "declined")
            return await conn.fetchrow(self._q["get_invitation"], invitation_id)

    async def _lock_own_invitation(self, conn: asyncpg.Connection, invitation_id: str, company_id: str) -> Record:
        """The invitation, locked, once the room's rules let ``company_id`` answer it (unknown and
        addressed to another company are one refusal)."""
        row = await conn.fetchrow(self._q["lock_invitation"], invitation_id)
        owner = "" if row is None else str(row["company_id"])
        enforce(Act.ANSWER_INVITATION, Facts(company_id, object_id=invitation_id, owner_id=owner))
        return row

    async def leave_room(self, room_id: str, company_id: str) -> int:
        """Ends the company's membership; returns how many of its pending waitpoints in the room expired."""
        async with self._pool.acquire() as conn, conn.transaction():
            room = await conn.fetchrow(self._q["get_room"], room_id)
            if room is None:
                raise NotFound(f"room {room_id} not found")
            member = await conn.fetchval(self._q["is_member"], room_id, company_id)
            enforce(Act.LEAVE, Facts(company_id, room_id, member=member, creator_id=str(room["created_by_company_id"])))
            expired = await self._end_membership(conn, room_id, company_id)
            if expired is None:  # a concurrent departure committed first
                raise NotFound(f"room {room_id} not found")
            return expired

    async def remove_member(self, room_id: str, company_id: str, removed_by_company_id: str) -> int:
        """The creator ends another company's membership; returns how many of its pending waitpoints expired."""
        async with self._pool.acquire() as conn, conn.transaction():
            room = await conn.fetchrow(self._q["get_room"], room_id)
            if room is None:
                raise NotFound(f"room {room_id} not found")
            member = await conn.fetchval(self._q["is_member"], room_id, removed_by_company_id)
            creator = str(room["created_by_company_id"])
            facts = Facts(removed_by_company_id, room_id, member=member, creator_id=creator, target_id=company_id)
            enforce(Act.REMOVE_MEMBER, facts)
            expired = None
            if await conn.fetchval(self._q["is_member"], room_id, company_id):
                expired = await self._end_membership(conn, room_id, company_id)
            if expired is None:
                raise NotFound(f"company {company_id} is not a member of room {room_id}")
            return expired

    async def _end_membership(self, conn: asyncpg.Connection, room_id: str, company_id: str) -> int | None:
        """Deletes the membership and expires the company's pending waitpoints in the room (with their
        decision wakes), in the caller's transaction; None when it had no membership left to delete.

        Lock order: the membership row first (the delete waits for writes that hold it FOR SHARE, see
        lock_membership, to commit), the room row (the MEMBER_LEFT event's cursor) last."""
        if await conn.fetchrow(self._q["delete_member"], room_id, company_id) is None:
            return None
        await conn.execute(self._q["withdraw_invitations_sent_by"], room_id, company_id)
        expired = int(await conn.fetchval(self._q["expire_waitpoints_of_company_in_room"], room_id, company_id))
        events = _Events()
        left = common_pb2.RoomMember(room_id=room_id, company_id=company_id)
        events.add(room_id, common_pb2.ROOM_EVENT_KIND_MEMBER_LEFT, left)
        await self._append_events(conn, events)
        return expired

    async def list_members(self, room_id: str, after: int | None, limit: int) -> Page:
        async with self._pool.acquire() as conn:
            await self._require_room(conn, room_id)
            rows = await conn.fetch(self._q["list_members"], room_id, after or 0, limit + 1)
        return _page(rows, limit, "pos")

    # -- agents ---------------------------------------------------------------------------------------------

    async def register_agent(
        self,
        *,
        company_id: str,
        name: str,
        provider: str,
        model: str,
        base_url: str | None,
        provider_key: str | None,
        system_prompt: str,
        dedupe_key: str | None = None,
    ) -> Record:
        """Stores the agent with its provider key encrypted (Fernet); the plaintext never reaches the database.
        A repeat of ``dedupe_key`` from the same company answers the first agent."""
        if dedupe_key is not None:
            earlier = await self._pool.fetchrow(self._q["find_agent_by_dedupe"], company_id, dedupe_key)
            if earlier is not None:
                return earlier
        encrypted = self._cipher.encrypt(provider_key.encode("utf-8")) if provider_key else None
        row = await self._pool.fetchrow(
            self._q["register_agent"], company_id, name, provider, model, base_url, encrypted, system_prompt, dedupe_key
        )
        if row is None and dedupe_key is not None:  # a concurrent registration with the same key committed first
            row = await self._pool.fetchrow(self._q["find_agent_by_dedupe"], company_id, dedupe_key)
        if row is None:
            raise NotFound(f"company {company_id} not found")
        return row

    async def get_agent(self, agent_id: str) -> Record:
        row = await self._pool.fetchrow(self._q["get_agent"], agent_id)
        if row is None:
            raise NotFound(f"agent {agent_id} not found")
        return row

    async def get_agent_credentials(self, agent_id: str) -> tuple[Record, str]:
        """The agent and its decrypted provider key ("" when none is stored)."""
        row = await self._pool.fetchrow(self._q["get_agent_credentials"], agent_id)
        if row is None:
            raise NotFound(f"agent {agent_id} not found")
        return row, self._provider_key(row)

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

    async def list_agents(self, company_id: str, after: int | None, limit: int) -> Page:
        rows = await self._pool.fetch(self._q["list_agents"], company_id, after or 0, limit + 1)
        return _page(rows, limit, "pos")

    async def list_room_agents(
        self, room_id: str, company_id: str | None, after: int | None, limit: int, reader: str | None = None
    ) -> Page:
        """The agents of the room's member companies (of ``company_id`` alone when given); with
        ``reader``, once the room's rule lets that company see them (what it sees of each is the
        servicer's, by the same rule)."""
        async with self._pool.acquire() as conn:
            if reader is not None:
                member = bool(await conn.fetchval(self._q["is_member"], room_id, reader))
                enforce(Act.SEE_ROOM_AGENTS, Facts(reader, room_id, member=member))
            rows = await conn.fetch(self._q["list_room_agents"], room_id, after or 0, limit + 1, company_id)
        return _page(rows, limit, "pos")

    # -- messages -------------------------------------------------------------------------------------------

    async def post_message(
        self,
        *,
        room_id: str,
        author: AuthorRef,
        body: str,
        mention_agent_ids: Sequence[str],
        run_id: str | None,
        dedupe_key: str | None,
        run: RunRecord | None = None,
        between_writes: TransactionHook | None = None,
    ) -> Posted:
        """Appends a message and, in the same transaction, a wake for each mentioned agent but the author
        (and ``run``'s ledger row, with the message id as its posted_message_id).

        Round trips: BEGIN, the checks (post_check), the ledger row when given, the message with its wakes
        (which takes the room row's lock), its events, COMMIT. ``between_writes`` runs after the message
        and its wakes, before their events."""
        self._require_run_of(run, room_id, author)
        try:
            return await self._post_message(
                room_id, author, body, mention_agent_ids, run_id, dedupe_key, run, between_writes
            )
        except asyncpg.UniqueViolationError as exc:
            if dedupe_key is None or exc.constraint_name != "messages_room_dedupe_key":
                raise
        # A concurrent post with the same dedupe_key committed between our check and our insert (which
        # waited for its room lock); this transaction rolled back whole, and the retry finds that message.
        return await self._post_message(room_id, author, body, mention_agent_ids, run_id, dedupe_key, run, None)

    async def _post_message(
        self,
        room_id: str,
        author: AuthorRef,
        body: str,
        mention_agent_ids: Sequence[str],
        run_id: str | None,
        dedupe_key: str | None,
        run: RunRecord | None,
        between_writes: TransactionHook | None,
    ) -> Posted:
        async with self._pool.acquire() as conn, conn.transaction():
            check = await conn.fetchrow(
                self._q["post_check"],
                room_id,
                author.company_id or None,
                author.agent_id if author.kind == "agent" else None,
                list(mention_agent_ids),
                dedupe_key,
            )
            if not check["room_found"]:
                raise NotFound(f"room {room_id} not found")
            events = _Events()
            author = _identified(author, check["agent_company_id"])
            earlier = check["earlier"]
            if earlier is not None:  # the author's right to write here first, then the answer
                repeat = str(earlier["author_company_id"])
                facts = Facts(author.company_id, room_id, member=check["member"], repeat_of_company_id=repeat)
                enforce(Act.POST_MESSAGE, facts, repeat=True)
                await self._record_write(conn, events, run, earlier["message_id"])
                await self._append_events(conn, events)
                return Posted(earlier, list(check["earlier_wakes"]), True)
            companies = dict(zip(check["mentioned_agent_ids"], check["mentioned_company_ids"], strict=True))
            in_room = {str(a) for a, c in companies.items() if c in check["member_company_ids"]}
            missing = next((a for a in mention_agent_ids if a not in in_room), "")
            facts = Facts(author.company_id, room_id, member=check["member"], mention_not_in_room=missing)
            enforce(Act.POST_MESSAGE, facts)
            message_id = uuid.uuid4()
            # The ledger row before the message: no lock on the room row is held while it is written.
            await self._record_write(conn, events, run, message_id)
            woken = [a for a in mention_agent_ids if a != author.agent_id]
            row = await conn.fetchrow(
                self._q["insert_message_with_wakes"],
                room_id,
                message_id,
                *author.columns(),
                body,
                list(mention_agent_ids),
                run_id,
                dedupe_key,
                woken,
                str(message_id),
                current_traceparent(),
                author.verified_by,
            )
            if between_writes is not None:
                await between_writes(conn)
            events.add(room_id, common_pb2.ROOM_EVENT_KIND_MESSAGE_POSTED, convert.message(row))
            await self._append_events(conn, events)
            return Posted(row, list(row["wakes"]), False)

    async def list_messages(self, room_id: str, after: int | None, limit: int, *, newest_first: bool) -> Page:
        async with self._pool.acquire() as conn:
            await self._require_room(conn, room_id)
            if newest_first:
                rows = await conn.fetch(
                    self._q["list_messages_newest_first"], room_id, _MAX_KEY if after is None else after, limit + 1
                )
            else:
                rows = await conn.fetch(self._q["list_messages_oldest_first"], room_id, after or 0, limit + 1)
        return _page(rows, limit, "seq")

    async def get_message(self, room_id: str, message_id: str) -> Record:
        row = await self._pool.fetchrow(self._q["get_message"], room_id, message_id)
        if row is None:
            raise NotFound(f"message {message_id} not found in room {room_id}")
        return row

    # -- tasks ----------------------------------------------------------------------------------------------

    async def create_task(
        self,
        *,
        room_id: str,
        author: AuthorRef,
        to_agent_id: str,
        title: str,
        body: str,
        run_id: str | None,
        dedupe_key: str | None,
        run: RunRecord | None = None,
        between_writes: TransactionHook | None = None,
    ) -> Posted:
        """Records a task and, in the same transaction, the assignee's wake (none when it assigned itself)
        and ``run``'s ledger row with the task id."""
        self._require_run_of(run, room_id, author)
        async with self._pool.acquire() as conn, conn.transaction():
            await self._require_room(conn, room_id)
            events = _Events()
            if dedupe_key is not None:
                earlier = await self._earlier_task(conn, room_id, dedupe_key)
                if earlier is not None:  # the author's right to write here first, then the answer
                    facts = Facts("", repeat_of_company_id=str(earlier.row["from_company_id"]))
                    await self._admit_author(conn, room_id, author, Act.CREATE_TASK, facts, repeat=True)
                    await self._record_write(conn, events, run, earlier.row["task_id"])
                    await self._append_events(conn, events)
                    return earlier
            assignee = await conn.fetchrow(self._q["lock_assignee_in_room"], to_agent_id, room_id)
            in_room = assignee is not None and bool(assignee["member"])
            facts = Facts(author.company_id, assignee_id=to_agent_id, assignee_in_room=in_room)
            author = await self._admit_author(conn, room_id, author, Act.CREATE_TASK, facts)
            row = await conn.fetchrow(
                self._q["insert_task"],
                room_id,
                *author.columns(),
                to_agent_id,
                title,
                body,
                run_id,
                dedupe_key,
                author.verified_by,
            )
            if row is None:  # a concurrent create with the same dedupe_key committed first
                earlier = await self._earlier_task(conn, room_id, dedupe_key)
                if earlier is None:  # pragma: no cover - the conflict row cannot vanish
                    raise AlreadyExists(f"a task with dedupe_key {dedupe_key!r} already exists")
                repeat = str(earlier.row["from_company_id"])
                facts = Facts(author.company_id, room_id, member=True, repeat_of_company_id=repeat)
                enforce(Act.CREATE_TASK, facts, repeat=True)
                await self._record_write(conn, events, run, earlier.row["task_id"])
                await self._append_events(conn, events)
                return earlier
            if between_writes is not None:
                await between_writes(conn)
            woken = [to_agent_id] if to_agent_id != author.agent_id else []
            traceparent = current_traceparent()
            wakes = await conn.fetch(self._q["insert_wakes"], woken, room_id, "task", str(row["task_id"]), traceparent)
            await self._record_write(conn, events, run, row["task_id"])
            events.add(room_id, common_pb2.ROOM_EVENT_KIND_TASK_CREATED, convert.task(row))
            await self._append_events(conn, events)
            return Posted(row, list(wakes), False)

    async def _earlier_task(self, conn: asyncpg.Connection, room_id: str, dedupe_key: str | None) -> Posted | None:
        row = await conn.fetchrow(self._q["find_task_by_dedupe"], room_id, dedupe_key)
        if row is None:
            return None
        wakes = await conn.fetch(self._q["wakes_of_source"], str(row["task_id"]), "task")
        return Posted(row, list(wakes), True)

    async def update_task(
        self,
        *,
        task_id: str,
        room_id: str | None,
        author: AuthorRef,
        note: str,
        status: str | None,
        run_id: str | None,
        dedupe_key: str | None,
        run: RunRecord | None = None,
    ) -> TaskUpdated:
        """Adds a note and optionally closes the task; a closed task stays closed. ``run``'s ledger row
        is recorded in the same transaction with the update id."""
        async with self._pool.acquire() as conn, conn.transaction():
            task = await conn.fetchrow(self._q["lock_task"], task_id)
            if task is None or (room_id is not None and str(task["room_id"]) != room_id):
                raise NotFound(f"task {task_id} not found")
            self._require_run_of(run, str(task["room_id"]), author)
            events = _Events()
            if dedupe_key is not None:
                earlier = await conn.fetchrow(self._q["find_task_update_by_dedupe"], task_id, dedupe_key)
                if earlier is not None:  # the author's right to write here first, then the answer
                    facts = Facts("", repeat_of_company_id=str(earlier["author_company_id"]))
                    await self._admit_author(conn, str(task["room_id"]), author, Act.UPDATE_TASK, facts, repeat=True)
                    await self._record_write(conn, events, run, earlier["update_id"])
                    await self._append_events(conn, events)
                    updates = await conn.fetch(self._q["updates_of_tasks"], [task_id])
                    return TaskUpdated(task, earlier, list(updates), True)
            facts = Facts(
                author.company_id,
                task_id=task_id,
                sender_id=str(task["from_company_id"]),
                assignee_company_id=str(task["assignee_company_id"] or ""),
            )
            author = await self._admit_author(conn, str(task["room_id"]), author, Act.UPDATE_TASK, facts)
            if task["status"] != "open":
                raise FailedPrecondition(f"task {task_id} is already {task['status']}")
            new_status = status or "open"
            update = await conn.fetchrow(
                self._q["insert_task_update"], task_id, *author.columns(), note, new_status, run_id, dedupe_key
            )
            task = await conn.fetchrow(self._q["set_task_status"], task_id, new_status)
            await self._record_write(conn, events, run, update["update_id"])
            updates = await conn.fetch(self._q["updates_of_tasks"], [task_id])
            kind = (
                common_pb2.ROOM_EVENT_KIND_TASK_UPDATED
                if new_status == "open"
                else common_pb2.ROOM_EVENT_KIND_TASK_CLOSED
            )
            events.add(str(task["room_id"]), kind, convert.task(task, updates))
            await self._append_events(conn, events)
            return TaskUpdated(task, update, list(updates), False)

    async def get_task(self, task_id: str, room_id: str | None) -> tuple[Record, list[Record]]:
        async with self._pool.acquire() as conn:
            task = await conn.fetchrow(self._q["get_task"], task_id)
            if task is None or (room_id is not None and str(task["room_id"]) != room_id):
                raise NotFound(f"task {task_id} not found")
            updates = await conn.fetch(self._q["updates_of_tasks"], [task_id])
        return task, list(updates)

    async def list_tasks(
        self, room_id: str, to_agent_id: str | None, status: str | None, after: int | None, limit: int
    ) -> tuple[Page, dict[str, list[Record]]]:
        """A page of tasks and the updates of each, keyed by task_id."""
        async with self._pool.acquire() as conn:
            await self._require_room(conn, room_id)
            rows = await conn.fetch(self._q["list_tasks"], room_id, to_agent_id, status, after or 0, limit + 1)
            page = _page(rows, limit, "pos")
            updates: dict[str, list[Record]] = {str(r["task_id"]): [] for r in page.rows}
            if updates:
                for u in await conn.fetch(self._q["updates_of_tasks"], list(updates)):
                    updates[str(u["task_id"])].append(u)
        return page, updates

    # -- memory ---------------------------------------------------------------------------------------------

    async def write_memory(
        self,
        *,
        room_id: str,
        author: AuthorRef,
        text: str,
        visibility: str,
        run_id: str | None,
        dedupe_key: str | None,
        run: RunRecord | None = None,
    ) -> tuple[Record, bool]:
        """Appends a memory line (or finds the earlier one) and records ``run``'s ledger row with its id."""
        self._require_run_of(run, room_id, author)
        async with self._pool.acquire() as conn, conn.transaction():
            await self._require_room(conn, room_id)
            events = _Events()
            row = None
            if dedupe_key is not None:
                row = await conn.fetchrow(self._q["find_memory_by_dedupe"], room_id, dedupe_key)
            deduplicated = row is not None
            if row is not None:  # the author's right to write here first, then the answer
                facts = Facts("", repeat_of_company_id=str(row["author_company_id"]))
                await self._admit_author(conn, room_id, author, Act.WRITE_MEMORY, facts, repeat=True)
            else:
                author = await self._admit_author(conn, room_id, author, Act.WRITE_MEMORY)
                row = await conn.fetchrow(
                    self._q["insert_memory"], room_id, *author.columns(), text, visibility, run_id, dedupe_key
                )
                if row is None:  # a concurrent write with the same dedupe_key committed first
                    row = await conn.fetchrow(self._q["find_memory_by_dedupe"], room_id, dedupe_key)
                    deduplicated = True
                    repeat = str(row["author_company_id"])
                    facts = Facts(author.company_id, room_id, member=True, repeat_of_company_id=repeat)
                    enforce(Act.WRITE_MEMORY, facts, repeat=True)
                else:
                    audience = author.company_id if visibility == "company" else None
                    line = convert.memory_line(row)
                    events.add(room_id, common_pb2.ROOM_EVENT_KIND_MEMORY_WRITTEN, line, audience)
            await self._record_write(conn, events, run, row["memory_id"])
            await self._append_events(conn, events)
            return row, deduplicated

    async def list_memory(
        self, room_id: str, reader_company_id: str, query: str | None, before: int | None, limit: int
    ) -> Page:
        """Lines the reader company may read (room-wide, or private to it), newest first."""
        async with self._pool.acquire() as conn:
            if not await conn.fetchval(self._q["is_member"], room_id, reader_company_id):
                raise NotFound(f"room {room_id} not found")
            key = _MAX_KEY if before is None else before
            if query:
                rows = await conn.fetch(self._q["search_memory"], room_id, reader_company_id, key, limit + 1, query)
            else:
                rows = await conn.fetch(self._q["list_memory"], room_id, reader_company_id, key, limit + 1)
        return _page(rows, limit, "pos")

    # -- files and passages ---------------------------------------------------------------------------------

    async def upload_file(
        self,
        *,
        room_id: str,
        author: AuthorRef,
        name: str,
        content_type: str,
        content: bytes,
        passages: Sequence[str],
    ) -> Record:
        async with self._pool.acquire() as conn, conn.transaction():
            await self._require_room(conn, room_id)
            author = await self._admit_author(conn, room_id, author, Act.UPLOAD_FILE)
            row = await conn.fetchrow(
                self._q["insert_file"],
                room_id,
                *author.columns(),
                name,
                content_type,
                content,
                len(content),
                len(passages),
            )
            await conn.execute(
                self._q["insert_passages"], row["file_id"], room_id, list(range(len(passages))), list(passages)
            )
            events = _Events()
            events.add(room_id, common_pb2.ROOM_EVENT_KIND_FILE_UPLOADED, convert.file(row))
            await self._append_events(conn, events)
            return row

    async def list_files(self, room_id: str, after: int | None, limit: int) -> Page:
        async with self._pool.acquire() as conn:
            await self._require_room(conn, room_id)
            rows = await conn.fetch(self._q["list_files"], room_id, after or 0, limit + 1)
        return _page(rows, limit, "pos")

    async def search_passages(self, room_id: str, query: str, limit: int) -> list[Record]:
        """Best first; when no passage has every term, those with any term, ranked by how well they match."""
        async with self._pool.acquire() as conn:
            await self._require_room(conn, room_id)
            return await self._search_passages(conn, room_id, query, limit)

    async def _search_passages(self, conn: asyncpg.Connection, room_id: str, query: str, limit: int) -> list[Record]:
        rows = await conn.fetch(self._q["search_passages_all_terms"], room_id, query, limit)
        if not rows:
            rows = await conn.fetch(self._q["search_passages_any_term"], room_id, query, limit)
        return list(rows)

    # -- a run's view of its room ---------------------------------------------------------------------------

    async def read_run_context(
        self,
        *,
        agent_id: str,
        room_id: str,
        wake_kind: str,
        wake_source_id: str | None,
        recent_messages: int,
        max_passages: int,
        run: common_pb2.Run | None = None,
    ) -> RunContext:
        """Everything a run reads of its room, in one statement (one snapshot); with ``run``, that ledger row
        (and its room event, when its status changes) is recorded in the same transaction, before the read.

        Round trips: 1 without ``run``; with it BEGIN, the ledger row, the read, the event (when there is
        one), COMMIT. The room row is locked only by the event, after the read and just before COMMIT, so
        posts in the room neither wait on the read nor make it fail."""
        args = (
            agent_id,
            room_id,
            recent_messages,
            wake_kind,
            wake_source_id if wake_kind in ("message", "task") else None,
            max_passages,
            ROOM_AGENTS_LIMIT,
            OPEN_TASKS_LIMIT,
            MEMORY_LIMIT,
            PASSAGE_QUERY_BYTES,
        )
        if run is None:
            return self._run_context(await self._pool.fetchrow(self._q["run_context"], *args), agent_id, room_id)
        async with self._pool.acquire() as conn, conn.transaction():
            events = _Events()
            await self._upsert_run(conn, events, run)
            context = self._run_context(await conn.fetchrow(self._q["run_context"], *args), agent_id, room_id)
            await self._append_events(conn, events)
            return context

    def _run_context(self, row: Record | None, agent_id: str, room_id: str) -> RunContext:
        if row is None:
            raise NotFound(f"agent {agent_id} not found")
        if not row["member"]:
            raise NotFound(f"room {room_id} not found (or the company of agent {agent_id} is not a member)")
        provider_key = self._provider_key(row)
        updates: dict[str, list[Record]] = {str(t["task_id"]): [] for t in row["open_tasks"]}
        for u in row["task_updates"]:
            updates[str(u["task_id"])].append(u)
        return RunContext(
            agent=row,
            provider_key=provider_key,
            company_default={f: row[f"default_{f}"] for f in convert.RIGHT_FIELDS},
            agent_rights={f: row[f"own_{f}"] for f in convert.RIGHT_FIELDS},
            room_agents=list(row["room_agents"]),
            messages=list(reversed(row["messages"])),
            open_tasks=list(row["open_tasks"]),
            task_updates=updates,
            memory=list(row["memory"]),
            wake_text=row["wake_text"] or "",
            passages=list(row["passages"]),
        )

    # -- the room event log --------------------------------------------------------------------------------

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

    # -- the run ledger -------------------------------------------------------------------------------------

    async def record_run(self, run: common_pb2.Run) -> Record:
        """Upserts the run's row (and its room event, when its status changes) in one transaction; an ended
        row may only be rewritten unchanged. Round trips: BEGIN, the row, the event (when any), COMMIT."""
        async with self._pool.acquire() as conn, conn.transaction():
            events = _Events()
            row = await self._upsert_run(conn, events, run)
            await self._append_events(conn, events)
            return row

    async def _upsert_run(self, conn: asyncpg.Connection, events: _Events, run: common_pb2.Run) -> Record:
        """Upserts the row, fenced by ``run.attempt`` (ALREADY_EXISTS when another attempt's run holds
        it); its room event, when its status changes, goes to ``events``."""
        row = await conn.fetchrow(self._q["upsert_run_with_before"], *_run_args(run))
        if row is not None:
            self._run_event(events, row, row["status_before"])
            return row
        stored = await conn.fetchrow(self._q["get_run"], run.run_id)
        if stored is not None and stored["attempt"] != run.attempt:
            raise _held_by_another(run.run_id)
        if stored is None or not _same_run(convert.run(stored), run):
            raise FailedPrecondition(f"run {run.run_id} has ended; its ledger row can no longer change")
        return stored

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
        if record is None:
            return
        run = common_pb2.Run()
        run.CopyFrom(record.run)
        if record.action_index is None:
            run.posted_message_id = str(write_id)
        else:
            action = _action_of(run, record.action_index)
            action.outcome = common_pb2.ACTION_OUTCOME_DONE
            action.result_id = str(write_id)
        await self._upsert_run(conn, events, run)

    async def get_run(self, run_id: str) -> tuple[Record, WaitpointRows | None]:
        """The run's ledger row, and its waitpoint when it parked."""
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow(self._q["get_run"], run_id)
            if row is None:
                raise NotFound(f"run {run_id} not found")
            waitpoint = await conn.fetchrow(self._q["find_waitpoint_of_run"], run_id)
            return row, None if waitpoint is None else await self._waitpoint_rows(conn, waitpoint)

    async def list_runs(
        self,
        agent_id: str | None,
        company_id: str | None,
        before: int | None,
        limit: int,
        filters: RunFilters | None = None,
    ) -> Page:
        """Runs newest first, of one agent or of one company's agents, narrowed by ``filters``."""
        key = _MAX_KEY if before is None else before
        f = filters or RunFilters()
        narrowed = (f.room_id, f.status, f.started_after, f.started_before)
        if agent_id is not None:
            rows = await self._pool.fetch(
                self._q["list_runs_of_agent"], agent_id, company_id, key, limit + 1, *narrowed
            )
        else:
            rows = await self._pool.fetch(self._q["list_runs_of_company"], company_id, key, limit + 1, *narrowed)
        return _page(rows, limit, "pos")

    # -- the wake outbox ------------------------------------------------------------------------------------

    async def lease_wakes(self, lease_owner: str, max_wakes: int, lease_seconds: int) -> list[Record]:
        """Leases due pending wakes not leased (or lease expired), oldest due first; no two owners get one."""
        rows = await self._pool.fetch(self._q["lease_wakes"], lease_owner, max_wakes, lease_seconds)
        return sorted(rows, key=lambda r: (r["due_at"], r["created_at"], str(r["wake_id"])))

    async def delete_delivered_wakes(self, keep_seconds: int, limit: int) -> int:
        """Deletes up to ``limit`` wakes delivered more than ``keep_seconds`` ago; how many it deleted."""
        status = await self._pool.execute(self._q["delete_delivered_wakes"], keep_seconds, limit)
        return int(status.split()[-1])

    async def settle_wake(
        self, wake_id: str, lease_owner: str, *, delivered: bool, retry_after_ms: int, last_error: str
    ) -> Any:
        """Ends the lease: delivered, or due again after ``retry_after_ms``. Returns when it was settled."""
        async with self._pool.acquire() as conn:
            if delivered:
                settled = await conn.fetchval(self._q["settle_wake_delivered"], wake_id, lease_owner)
            else:
                settled = await conn.fetchval(
                    self._q["settle_wake_retry"], wake_id, lease_owner, retry_after_ms, last_error
                )
            if settled is not None:
                return settled
            state = await conn.fetchrow(self._q["get_wake_lease"], wake_id)
        if state is None:
            raise NotFound(f"wake {wake_id} not found")
        if state["delivered_at"] is not None and state["lease_owner"] == lease_owner and delivered:
            return state["delivered_at"]  # a repeated DELIVERED from the same owner
        if state["delivered_at"] is not None:
            raise FailedPrecondition(f"wake {wake_id} was already delivered")
        raise FailedPrecondition(f"the lease on wake {wake_id} is no longer held by {lease_owner!r}")

    async def settle_wakes(self, items: Sequence[WakeToSettle]) -> list[WakeSettled]:
        """``settle_wake`` for many wakes in one statement (distinct wake ids, in canonical form); one result
        per item, in order.

        The items go to the statement in wake id order, so two batches meeting on a row take rows in one
        order. Only a lease's owner settles, so two batches meet only on a lease that changed hands."""
        ordered = sorted(items, key=lambda i: i.wake_id)
        rows = await self._pool.fetch(
            _SETTLE_WAKES_SQL,
            [i.wake_id for i in ordered],
            [i.lease_owner for i in ordered],
            [i.delivered for i in ordered],
            [i.retry_after_ms for i in ordered],
            [i.last_error for i in ordered],
        )
        by_id: dict[str, WakeSettled] = {}
        for row in rows:
            wake_id = str(row["wake_id"])
            if row["settled_at"] is not None:
                by_id[wake_id] = WakeSettled(wake_id, row["settled_at"])
            elif not row["known"]:
                by_id[wake_id] = WakeSettled(wake_id, None, f"wake {wake_id} not found")
            elif row["delivered_at"] is not None and row["held_by"] == row["lease_owner"] and row["delivered"]:
                by_id[wake_id] = WakeSettled(wake_id, row["delivered_at"])  # a repeated DELIVERED from the owner
            elif row["delivered_at"] is not None:
                by_id[wake_id] = WakeSettled(wake_id, None, f"wake {wake_id} was already delivered")
            else:
                error = f"the lease on wake {wake_id} is no longer held by {row['lease_owner']!r}"
                by_id[wake_id] = WakeSettled(wake_id, None, error)
        return [by_id[i.wake_id] for i in items]

    async def count_pending_wakes(self) -> Record:
        return await self._pool.fetchrow(self._q["count_pending_wakes"])

    # -- agent rights ---------------------------------------------------------------------------------------

    async def set_agent_rights(self, company_id: str, agent_id: str | None, rights: Mapping[str, str | None]) -> Record:
        """Sets the rights named in ``rights`` (None: not set here) of the company's default (``agent_id``
        None) or of one agent's rules, in one statement; the rights it does not name keep what is stored."""
        values = [rights.get(f) for f in convert.RIGHT_FIELDS]
        async with self._pool.acquire() as conn, conn.transaction():
            await self._require_rights_owner(conn, company_id, agent_id)
            return await conn.fetchrow(self._q["upsert_agent_rights"], company_id, agent_id, *values, list(rights))

    async def get_agent_rights(self, company_id: str, agent_id: str | None) -> tuple[Record | None, Record | None]:
        """The company's default rules and the agent's own (None where nothing is stored)."""
        async with self._pool.acquire() as conn:
            await self._require_rights_owner(conn, company_id, agent_id)
            default = await conn.fetchrow(self._q["get_agent_rights"], company_id, None)
            agent = await conn.fetchrow(self._q["get_agent_rights"], company_id, agent_id) if agent_id else None
        return default, agent

    async def _require_rights_owner(self, conn: asyncpg.Connection, company_id: str, agent_id: str | None) -> None:
        if not await conn.fetchval(self._q["company_exists"], company_id):
            raise NotFound(f"company {company_id} not found")
        if agent_id is not None:
            owner = await conn.fetchval(self._q["agent_company"], agent_id)
            enforce(Act.SET_RIGHTS, Facts(company_id, object_id=agent_id, owner_id=str(owner or "")))

    # -- waitpoints -----------------------------------------------------------------------------------------

    async def create_waitpoint(
        self, run_id: str, held: Sequence[HeldSpec], expires_in_seconds: int, run: common_pb2.Run | None
    ) -> WaitpointRows:
        """Parks the run: its ledger row (PARKED) and a new token with its held actions, in one transaction.

        A run that already has a waitpoint gets it back unchanged.
        """
        async with self._pool.acquire() as conn, conn.transaction():
            existing = await conn.fetchrow(self._q["find_waitpoint_of_run"], run_id)
            if existing is not None:
                return await self._waitpoint_rows(conn, existing)
            if run is not None:
                parked = await conn.fetchrow(self._q["upsert_run_with_before"], *_run_args(run))
            else:
                parked = await conn.fetchrow(self._q["park_run"], run_id)
            if parked is None:
                stored = await conn.fetchrow(self._q["get_run"], run_id)
                if stored is None:
                    raise NotFound(f"run {run_id} not found")
                if run is not None and stored["attempt"] != run.attempt:
                    raise _held_by_another(run_id)
                raise FailedPrecondition(f"run {run_id} has ended; it cannot park")
            agent_id, room_id = str(parked["agent_id"]), str(parked["room_id"])
            company_id = await conn.fetchval(self._q["agent_company"], agent_id)
            if company_id is None:
                raise NotFound(f"agent {agent_id} of run {run_id} not found")
            await self._require_room(conn, room_id)
            row = await conn.fetchrow(
                self._q["insert_waitpoint"],
                run_id,
                agent_id,
                company_id,
                room_id,
                expires_in_seconds,
                current_traceparent(),
            )
            if row is None:  # a concurrent CreateWaitpoint for this run committed first
                return await self._waitpoint_rows(conn, await conn.fetchrow(self._q["find_waitpoint_of_run"], run_id))
            await conn.execute(
                self._q["insert_held_actions"],
                row["token"],
                [h.index for h in held],
                [h.kind for h in held],
                [h.arguments_json for h in held],
            )
            rows = await self._waitpoint_rows(conn, row)
            owner = str(company_id)
            events = _Events()
            events.add(room_id, common_pb2.ROOM_EVENT_KIND_RUN_PARKED, convert.run(parked), owner)
            approval = convert.waitpoint(rows.waitpoint, rows.held)
            events.add(room_id, common_pb2.ROOM_EVENT_KIND_APPROVAL_AWAITING, approval, owner)
            await self._append_events(conn, events)
            return rows

    async def get_waitpoint(self, token: str) -> WaitpointRows:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow(self._q["get_waitpoint"], token)
            if row is None:
                raise NotFound(f"waitpoint {token} not found")
            return await self._waitpoint_rows(conn, row)

    async def list_waitpoints(
        self, company_id: str, status: str, after: int | None, limit: int
    ) -> tuple[Page, dict[str, list[Record]]]:
        """A page of the company's waitpoints in one status, oldest first, and the held actions of each."""
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(self._q["list_waitpoints"], company_id, status, after or 0, limit + 1)
            page = _page(rows, limit, "pos")
            held: dict[str, list[Record]] = {str(r["token"]): [] for r in page.rows}
            if held:
                for h in await conn.fetch(self._q["held_actions_of"], list(held)):
                    held[str(h["token"])].append(h)
        return page, held

    async def decide_held_action(
        self, token: str, index: int, company_id: str, decided_by: str, *, approve: bool, verified_by: str | None = None
    ) -> Decided:
        """Records the owning company's decision; the one that leaves nothing pending completes the token
        and records its DECISION wake. The token's row lock makes concurrent decisions take turns."""
        async with self._pool.acquire() as conn:
            async with conn.transaction():
                wp = await conn.fetchrow(self._q["lock_waitpoint"], token)
                owner = "" if wp is None else str(wp["company_id"])
                enforce(Act.DECIDE_APPROVAL, Facts(company_id, object_id=token, owner_id=owner))
                if wp["status"] == "expired":
                    raise FailedPrecondition(f"waitpoint {token} has expired")
                if wp["status"] == "pending" and wp["past_expiry"]:
                    await conn.execute(self._q["expire_waitpoint"], token)
                    await self._record_decision_wake(conn, wp)
                    decided = None  # committed below, then refused
                else:
                    decided = await self._decide(conn, wp, index, decided_by, approve, verified_by)
            if decided is None:
                raise FailedPrecondition(f"waitpoint {token} has expired")
            return decided

    async def _decide(
        self,
        conn: asyncpg.Connection,
        wp: Record,
        index: int,
        decided_by: str,
        approve: bool,
        verified_by: str | None = None,
    ) -> Decided:
        token = wp["token"]
        rows = await self._waitpoint_rows(conn, wp)
        action = next((h for h in rows.held if h["action_index"] == index), None)
        if action is None:
            raise NotFound(f"waitpoint {token} holds no action with index {index}")
        wanted = "approved" if approve else "denied"
        if action["decision"] == wanted:
            return Decided(rows, completed=False, already_decided=True)
        if action["decision"] != "pending":
            raise FailedPrecondition(f"action {index} of waitpoint {token} was already {action['decision']}")
        await conn.execute(self._q["decide_held_action"], token, index, wanted, decided_by, verified_by)
        completed = await conn.fetchval(self._q["complete_waitpoint_if_decided"], token) is not None
        if completed:
            await self._record_decision_wake(conn, wp)
        rows = await self._waitpoint_rows(conn, await conn.fetchrow(self._q["get_waitpoint"], token))
        return Decided(rows, completed=completed, already_decided=False)

    async def abandon_stale_runs(self, older_than_seconds: int, limit: int) -> int:
        """Ends as FAILED the runs that made no progress for ``older_than_seconds``: RUNNING rows
        untouched that long, and PARKED rows whose waitpoint was completed or expired that long ago
        but which never continued. Their unfinished actions are marked NOT_DONE; nothing is redone."""
        ended = 0
        async with self._pool.acquire() as conn:
            candidates = await conn.fetch(self._q["stale_running_runs"], older_than_seconds, limit)
            for candidate in candidates:
                async with conn.transaction():
                    row = await conn.fetchrow(
                        self._q["lock_unchanged_run"], candidate["run_id"], candidate["updated_at"]
                    )
                    if row is None:  # it moved on, or another sweeper has it
                        continue
                    run = convert.run(row)
                    detail = f"abandoned: no progress recorded for {candidate['idle_seconds']} s"
                    mark_undone(run, detail)
                    run.status = common_pb2.RUN_STATUS_FAILED
                    run.step = common_pb2.RUN_STEP_ENDED
                    run.error = f"{detail}; not redone"
                    run.ended_at.GetCurrentTime()
                    events = _Events()
                    await self._upsert_run(conn, events, run)
                    await self._append_events(conn, events)
                    ended += 1
        return ended

    async def record_not_started_runs(self, older_than_seconds: int, limit: int) -> tuple[int, int]:
        """Writes a NOT_STARTED row for the run of each wake created ``older_than_seconds`` ago, delivered
        at least once and still pending, that has no row (its deliveries stopped before the room read:
        nothing was done; it is delivered again). Each wake is looked at once. Returns (written, looked at)."""
        async with self._pool.acquire() as conn, conn.transaction():
            wakes = await conn.fetch(self._q["unchecked_undelivered_wakes"], older_than_seconds, limit)
            if not wakes:
                return 0, 0
            wake_ids = [str(w["wake_id"]) for w in wakes]
            rows = await conn.fetch(
                self._q["insert_not_started_runs"],
                [run_id_for(str(w["agent_id"]), str(w["wake_id"])) for w in wakes],
                wake_ids,
                [_not_started_error(w["delivery_attempts"], w["last_error"]) for w in wakes],
            )
            await conn.execute(self._q["mark_wakes_run_checked"], wake_ids)
            events = _Events()
            for row in rows:
                self._run_event(events, row, None)
            await self._append_events(conn, events)
        return len(rows), len(wakes)

    async def expire_waitpoints(self, limit: int) -> tuple[int, list[str]]:
        """Marks up to ``limit`` pending tokens past their expiry EXPIRED, each with its DECISION wake;
        returns how many and their runs. The expiry is a span of its own (``expiry_span``), whose trace
        context the wakes keep, so each continuation links to it."""
        async with self._pool.acquire() as conn, conn.transaction():
            due = await conn.fetch(self._q["due_waitpoints"], limit)
            if not due:
                return 0, []
            run_ids = [str(row["run_id"]) for row in due]
            with expiry_span(run_ids, [str(row["traceparent"]) for row in due]):
                tokens = [row["token"] for row in due]
                expired = await conn.fetchval(self._q["expire_due_waitpoints"], tokens, current_traceparent())
        return int(expired), run_ids

    async def _record_decision_wake(self, conn: asyncpg.Connection, wp: Record) -> None:
        token, traceparent = str(wp["token"]), current_traceparent()
        await conn.execute(self._q["insert_wakes"], [wp["agent_id"]], wp["room_id"], "decision", token, traceparent)

    async def _waitpoint_rows(self, conn: asyncpg.Connection, row: Record) -> WaitpointRows:
        held = await conn.fetch(self._q["held_actions_of"], [row["token"]])
        return WaitpointRows(row, list(held))

    # -- shared checks --------------------------------------------------------------------------------------

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
        facts = replace(facts or Facts(""), company_id=author.company_id, room_id=room_id, member=member)
        enforce(act, facts, repeat=repeat)
        return author


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
    return list(dict.fromkeys(t for t in (run.trace_id, *run.trace_ids) if t))


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
    current = common_pb2.Run()
    current.CopyFrom(stored)
    current.ClearField("updated_at")
    return candidate == current
