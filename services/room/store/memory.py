"""The Room's store: shared memory, files and the passages searched in them."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import asyncpg

from quayutec.errors import FailedPrecondition, NotFound
from quayutec.v1 import common_pb2
from services.room import convert
from services.room.rules import Act, Facts, enforce
from services.room.store.base import (
    _MAX_KEY,
    _NO_RUN,
    _RUN_EVENT_ARGS,
    AuthorRef,
    Page,
    Record,
    RunRecord,
    StoreBase,
    _Events,
    _identified,
    _page,
    _run_args,
    _with_write_id,
)


class MemoryAndFiles(StoreBase):
    """Shared memory, files and the passages searched in them."""

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
        """Appends a memory line (or finds the earlier one) with its event and ``run``'s ledger row with its id.

        Round trips: 1 (write_memory, as post_message: the rules' facts, and the writes when they are those
        of a write the rules allow); a repeat with a ledger row 2 (record_run)."""
        self._require_run_of(run, room_id, author)
        try:
            return await self._write_memory(room_id, author, text, visibility, run_id, dedupe_key, run)
        except asyncpg.UniqueViolationError as exc:
            if dedupe_key is None or exc.constraint_name != "memory_lines_room_dedupe_key":
                raise
        # A concurrent write with the same dedupe_key committed first: this statement wrote nothing.
        return await self._write_memory(room_id, author, text, visibility, run_id, dedupe_key, run)

    async def _write_memory(
        self,
        room_id: str,
        author: AuthorRef,
        text: str,
        visibility: str,
        run_id: str | None,
        dedupe_key: str | None,
        run: RunRecord | None,
    ) -> tuple[Record, bool]:
        memory_id = uuid.uuid4()
        ledger = _with_write_id(run, memory_id)
        row = await self._pool.fetchrow(
            self._q["write_memory"],
            *(_NO_RUN if ledger is None else _run_args(ledger)),
            *_RUN_EVENT_ARGS,
            room_id,
            author.company_id or None,
            author.agent_id if author.kind == "agent" else None,
            dedupe_key,
            memory_id,
            author.kind,
            author.person,
            text,
            visibility,
            run_id,
        )
        if not row["room_found"]:
            raise NotFound(f"room {room_id} not found")
        author = _identified(author, row["agent_company_id"])
        earlier = row["earlier"]
        if earlier is not None:  # the author's right to write here first, then the answer
            repeat_of, write_id = earlier["author_company_id"], earlier["memory_id"]
            await self._answer_repeat(Act.WRITE_MEMORY, author, room_id, row, repeat_of, run, write_id)
            return earlier, True
        facts = Facts(author.company_id, room_id, member=row["member"], archived=row["archived"])
        enforce(Act.WRITE_MEMORY, facts)
        if row["line"] is None:  # the rules allow it, so the fence refused its ledger row: nothing was written
            if ledger is not None:
                await self._fenced_run(self._pool, row, ledger)
            await self._archived_since(Act.WRITE_MEMORY, facts)
            raise FailedPrecondition(f"memory line not written in room {room_id}: its ledger row was refused")
        return row["line"], False

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
