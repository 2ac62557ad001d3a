"""The Room's store: messages (with the wakes they record) and tasks with their updates."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import asyncpg

from quayutec.errors import FailedPrecondition, NotFound
from quayutec.telemetry import current_traceparent
from quayutec.v1 import common_pb2
from services.room import convert
from services.room.rules import Act, Facts, enforce
from services.room.store.base import (
    _MAX_KEY,
    _NO_RUN,
    _RUN_EVENT_ARGS,
    AuthorRef,
    Page,
    Posted,
    Record,
    RunRecord,
    StoreBase,
    TaskUpdated,
    _Events,
    _identified,
    _page,
    _run_args,
    _with_write_id,
)


class MessagesAndTasks(StoreBase):
    """Messages (with the wakes they record) and tasks with their updates."""

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
        lease_owner: str | None = None,
        lease_seconds: int = 0,
    ) -> Posted:
        """Appends a message with, in the same statement, a wake for each mentioned agent but the author, its
        event, and ``run``'s ledger row (with the message id as its posted_message_id) through the fence.
        With ``lease_owner`` the new wakes are written leased to it for ``lease_seconds`` (attempt 1, as
        lease_wakes leases); a repeat leases nothing.

        Round trips: 1 (post_message: the rules' facts, and the writes when the facts are those of a post
        the rules allow); a repeat with a ledger row 2 (the row with the earlier message's id, record_run).
        The rules are decided here, from the facts the statement returns; the statement writes only under
        facts they allow (tests/room/test_round_trips.py tries each refusal and finds nothing written)."""
        self._require_run_of(run, room_id, author)
        try:
            return await self._post_message(
                room_id, author, body, mention_agent_ids, run_id, dedupe_key, run, lease_owner, lease_seconds
            )
        except asyncpg.UniqueViolationError as exc:
            if dedupe_key is None or exc.constraint_name != "messages_room_dedupe_key":
                raise
        # A concurrent post with the same dedupe_key committed between our facts and our insert (which
        # waited for its room lock); the statement wrote nothing, and the retry finds that message.
        return await self._post_message(
            room_id, author, body, mention_agent_ids, run_id, dedupe_key, run, lease_owner, lease_seconds
        )

    async def _post_message(
        self,
        room_id: str,
        author: AuthorRef,
        body: str,
        mention_agent_ids: Sequence[str],
        run_id: str | None,
        dedupe_key: str | None,
        run: RunRecord | None,
        lease_owner: str | None = None,
        lease_seconds: int = 0,
    ) -> Posted:
        message_id = uuid.uuid4()
        ledger = _with_write_id(run, message_id)
        woken = [a for a in mention_agent_ids if a != author.agent_id]
        agent_id = author.agent_id if author.kind == "agent" else None
        row = await self._pool.fetchrow(
            self._q["post_message"],
            *(_NO_RUN if ledger is None else _run_args(ledger)),
            *_RUN_EVENT_ARGS,
            room_id,
            author.company_id or None,
            agent_id,
            list(mention_agent_ids),
            dedupe_key,
            message_id,
            author.kind,
            author.person,
            body,
            run_id,
            woken,
            str(message_id),
            current_traceparent(),
            author.verified_by,
            lease_owner,
            lease_seconds if lease_owner is not None else None,
        )
        if not row["room_found"]:
            raise NotFound(f"room {room_id} not found")
        author = _identified(author, row["agent_company_id"])
        earlier = row["earlier"]
        if earlier is not None:  # the author's right to write here first, then the answer
            repeat = str(earlier["author_company_id"])
            facts = Facts(author.company_id, room_id, member=row["member"], repeat_of_company_id=repeat)
            enforce(Act.POST_MESSAGE, facts, repeat=True)
            repeated = _with_write_id(run, earlier["message_id"])
            if repeated is not None:
                await self._record_run(self._pool, repeated)
            return Posted(earlier, list(row["earlier_wakes"]), True)
        companies = dict(zip(row["mentioned_agent_ids"], row["mentioned_company_ids"], strict=True))
        in_room = {str(a) for a, c in companies.items() if c in row["member_company_ids"]}
        missing = next((a for a in mention_agent_ids if a not in in_room), "")
        enforce(Act.POST_MESSAGE, Facts(author.company_id, room_id, member=row["member"], mention_not_in_room=missing))
        if row["message"] is None:  # the rules allow it, so the fence refused its ledger row: nothing was written
            if ledger is not None:
                await self._fenced_run(self._pool, row, ledger)
            raise FailedPrecondition(f"message not posted in room {room_id}: its ledger row was refused")
        return Posted(row["message"], list(row["wakes"]), False)

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
    ) -> Posted:
        """Records a task with, in the same statement, the assignee's wake (none when it assigned itself), its
        event and ``run``'s ledger row with the task id.

        Round trips: 1 (create_task, as post_message: the rules' facts, and the writes when they are those
        of a task the rules allow); a repeat with a ledger row 2 (record_run)."""
        self._require_run_of(run, room_id, author)
        try:
            return await self._create_task(room_id, author, to_agent_id, title, body, run_id, dedupe_key, run)
        except asyncpg.UniqueViolationError as exc:
            if dedupe_key is None or exc.constraint_name != "tasks_room_dedupe_key":
                raise
        # A concurrent create with the same dedupe_key committed first: this statement wrote nothing.
        return await self._create_task(room_id, author, to_agent_id, title, body, run_id, dedupe_key, run)

    async def _create_task(
        self,
        room_id: str,
        author: AuthorRef,
        to_agent_id: str,
        title: str,
        body: str,
        run_id: str | None,
        dedupe_key: str | None,
        run: RunRecord | None,
    ) -> Posted:
        task_id = uuid.uuid4()
        ledger = _with_write_id(run, task_id)
        agent_id = author.agent_id if author.kind == "agent" else None
        row = await self._pool.fetchrow(
            self._q["create_task"],
            *(_NO_RUN if ledger is None else _run_args(ledger)),
            *_RUN_EVENT_ARGS,
            room_id,
            author.company_id or None,
            agent_id,
            to_agent_id,
            dedupe_key,
            task_id,
            author.kind,
            author.person,
            title,
            body,
            run_id,
            [to_agent_id] if to_agent_id != agent_id else [],
            current_traceparent(),
            author.verified_by,
        )
        if not row["room_found"]:
            raise NotFound(f"room {room_id} not found")
        author = _identified(author, row["agent_company_id"])
        earlier = row["earlier"]
        if earlier is not None:  # the author's right to write here first, then the answer
            repeat = str(earlier["from_company_id"])
            facts = Facts(author.company_id, room_id, member=row["member"], repeat_of_company_id=repeat)
            enforce(Act.CREATE_TASK, facts, repeat=True)
            repeated = _with_write_id(run, earlier["task_id"])
            if repeated is not None:
                await self._record_run(self._pool, repeated)
            return Posted(earlier, list(row["earlier_wakes"]), True)
        facts = Facts(
            author.company_id,
            room_id,
            member=row["member"],
            assignee_id=to_agent_id,
            assignee_in_room=row["assignee_in_room"],
        )
        enforce(Act.CREATE_TASK, facts)
        if row["task"] is None:  # the rules allow it, so the fence refused its ledger row: nothing was written
            if ledger is not None:
                await self._fenced_run(self._pool, row, ledger)
            raise FailedPrecondition(f"task not created in room {room_id}: its ledger row was refused")
        return Posted(row["task"], list(row["wakes"]), False)

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
        is recorded in the same transaction with the update id.

        Round trips: BEGIN, the facts (update_task_facts: the task locked, the author's membership FOR
        SHARE, the earlier update), the update with the task's status (write_task_update), the ledger row
        when given, the event (the room row's lock, last), COMMIT."""
        agent_id = author.agent_id if author.kind == "agent" else None
        async with self._pool.acquire() as conn, conn.transaction():
            task = await conn.fetchrow(
                self._q["update_task_facts"], task_id, dedupe_key, author.company_id or None, agent_id
            )
            if task is None or (room_id is not None and str(task["room_id"]) != room_id):
                raise NotFound(f"task {task_id} not found")
            task_room = str(task["room_id"])
            self._require_run_of(run, task_room, author)
            author = _identified(author, task["agent_company_id"])
            events = _Events()
            earlier = task["earlier"]
            if earlier is not None:  # the author's right to write here first, then the answer
                repeat = str(earlier["author_company_id"])
                facts = Facts(author.company_id, task_room, member=task["member"], repeat_of_company_id=repeat)
                enforce(Act.UPDATE_TASK, facts, repeat=True)
                await self._record_write(conn, events, run, earlier["update_id"])
                await self._append_events(conn, events)
                updates = await conn.fetch(self._q["updates_of_tasks"], [task_id])
                return TaskUpdated(task, earlier, list(updates), True)
            facts = Facts(
                author.company_id,
                task_room,
                member=task["member"],
                task_id=task_id,
                sender_id=str(task["from_company_id"]),
                assignee_company_id=str(task["assignee_company_id"] or ""),
            )
            enforce(Act.UPDATE_TASK, facts)
            if task["status"] != "open":
                raise FailedPrecondition(f"task {task_id} is already {task['status']}")
            new_status = status or "open"
            written = await conn.fetchrow(
                self._q["write_task_update"], task_id, *author.columns(), note, new_status, run_id, dedupe_key
            )
            update, updates = written["added"], list(written["updates"])
            await self._record_write(conn, events, run, update["update_id"])
            kind = (
                common_pb2.ROOM_EVENT_KIND_TASK_UPDATED
                if new_status == "open"
                else common_pb2.ROOM_EVENT_KIND_TASK_CLOSED
            )
            events.add(task_room, kind, convert.task(written, updates))
            await self._append_events(conn, events)
            return TaskUpdated(written, update, updates, False)

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
