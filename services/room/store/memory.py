"""The Room's store: shared memory, files and the passages searched in them."""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from quayutec.errors import NotFound
from quayutec.v1 import common_pb2
from services.room import convert
from services.room.rules import Act, Facts, enforce
from services.room.store.base import (
    _MAX_KEY,
    AuthorRef,
    Page,
    Record,
    RunRecord,
    StoreBase,
    _Events,
    _page,
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
