"""The Room's store: companies, rooms, members, invitations, departures, agents and their rights."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeAlias

import asyncpg

from quayutec.errors import AlreadyExists, FailedPrecondition, NotFound
from quayutec.v1 import common_pb2
from services.room import convert
from services.room.rules import Act, Facts, enforce
from services.room.store.base import (
    Page,
    Record,
    StoreBase,
    _Events,
    _page,
)

# Where a refusal's details are read: the transaction's connection, or the pool.
Reader: TypeAlias = asyncpg.Connection | asyncpg.Pool
# The unique index on each kind's names (compared trimmed, case ignored), and what a taken name answers.
_NAME_INDEX = {"room": "rooms_creator_name", "agent": "agents_company_name"}
_NAME_TAKEN = {
    "room": "your company already created a room named {which}; room names are unique among the rooms a "
    "company creates (case ignored): choose another name, or rename or use that room",
    "agent": "your company already has an agent named {which}; agent names are unique within a company "
    "(case ignored, retired agents included): choose another name, or rename that agent",
}


class Membership(StoreBase):
    """Companies, rooms, members, invitations, departures, agents and their rights."""

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
        same company answers the first room. ALREADY_EXISTS, naming it, when the company created a room
        of that name already (rooms_creator_name)."""
        if dedupe_key is not None:
            earlier = await self._pool.fetchrow(self._q["find_room_by_dedupe"], company_id, dedupe_key)
            if earlier is not None:
                return earlier
        try:
            row = await self._pool.fetchrow(self._q["create_room"], company_id, name, dedupe_key)
        except asyncpg.UniqueViolationError as exc:
            if exc.constraint_name != _NAME_INDEX["room"]:
                raise
            row = None
            if dedupe_key is not None:  # a concurrent create with the same key and name committed first
                row = await self._pool.fetchrow(self._q["find_room_by_dedupe"], company_id, dedupe_key)
            if row is None:
                raise await self._name_taken(self._pool, "room", company_id, name) from None
        if row is None and dedupe_key is not None:  # a concurrent create with the same key committed first
            row = await self._pool.fetchrow(self._q["find_room_by_dedupe"], company_id, dedupe_key)
        if row is None:
            raise NotFound(f"company {company_id} not found")
        return row

    async def _name_taken(self, conn: Reader, what: str, company_id: str, name: str) -> AlreadyExists:
        """ALREADY_EXISTS for ``name``, naming the ``what`` ("room" or "agent") of the company that has it."""
        taken = await conn.fetchrow(self._q[f"find_{what}_by_name"], company_id, name)
        which = f"{taken['name']!r} ({what} {taken[f'{what}_id']})" if taken is not None else repr(name)
        return AlreadyExists(_NAME_TAKEN[what].format(which=which))

    async def _rename(self, conn: asyncpg.Connection, what: str, object_id: str, company_id: str, name: str) -> Record:
        """The ``what`` ("room" or "agent") ``object_id`` of ``company_id`` named ``name``, in the caller's
        transaction (a savepoint, so a taken name leaves it usable to say which is taken)."""
        try:
            async with conn.transaction():
                return await conn.fetchrow(self._q[f"rename_{what}"], object_id, name)
        except asyncpg.UniqueViolationError as exc:
            if exc.constraint_name != _NAME_INDEX[what]:
                raise
            raise await self._name_taken(conn, what, company_id, name) from None

    async def rename_room(self, room_id: str, company_id: str, name: str) -> Record:
        """Room ``room_id`` renamed by ``company_id``, once the room's rules let it (its creator)."""
        async with self._pool.acquire() as conn, conn.transaction():
            await self._manage_room(conn, room_id, company_id)
            return await self._rename(conn, "room", room_id, company_id, name)

    async def archive_room(self, room_id: str, company_id: str) -> Record:
        """Room ``room_id`` archived by ``company_id`` (its creator), its pending invitations withdrawn."""
        async with self._pool.acquire() as conn, conn.transaction():
            await self._manage_room(conn, room_id, company_id)
            return await conn.fetchrow(self._q["archive_room"], room_id)

    async def _manage_room(self, conn: asyncpg.Connection, room_id: str, company_id: str) -> None:
        """The room's row locked (as invitations lock it), once the rules let ``company_id`` manage it."""
        room = await conn.fetchrow(self._q["lock_room_for_membership"], room_id)
        if room is None:
            raise NotFound(f"room {room_id} not found")
        member = bool(await conn.fetchval(self._q["is_member"], room_id, company_id))
        creator = str(room["created_by_company_id"])
        enforce(Act.MANAGE_ROOM, Facts(company_id, room_id, member=member, creator_id=creator))

    async def rename_agent(self, agent_id: str, company_id: str, name: str) -> Record:
        """Agent ``agent_id`` renamed by its own company (another company's agent: as an unknown id)."""
        async with self._pool.acquire() as conn, conn.transaction():
            await self._manage_agent(conn, agent_id, company_id)
            return await self._rename(conn, "agent", agent_id, company_id, name)

    async def retire_agent(self, agent_id: str, company_id: str) -> Record:
        """Agent ``agent_id`` retired by its own company: it wakes no more (the statement retire_agent)."""
        async with self._pool.acquire() as conn, conn.transaction():
            await self._manage_agent(conn, agent_id, company_id)
            return await conn.fetchrow(self._q["retire_agent"], agent_id)

    async def _manage_agent(self, conn: asyncpg.Connection, agent_id: str, company_id: str) -> None:
        owner = await conn.fetchval(self._q["lock_agent"], agent_id)
        enforce(Act.MANAGE_AGENT, Facts(company_id, object_id=agent_id, owner_id=str(owner or "")))

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
            enforce(Act.INVITE, Facts(inviter, room_id, member=member, archived=room["archived"]))
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
        try:
            row = await self._pool.fetchrow(
                self._q["register_agent"],
                *(company_id, name, provider, model, base_url, encrypted, system_prompt, dedupe_key),
            )
        except asyncpg.UniqueViolationError as exc:
            if exc.constraint_name != _NAME_INDEX["agent"]:
                raise
            row = None
            if dedupe_key is not None:  # a concurrent registration with the same key and name committed first
                row = await self._pool.fetchrow(self._q["find_agent_by_dedupe"], company_id, dedupe_key)
            if row is None:
                raise await self._name_taken(self._pool, "agent", company_id, name) from None
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
