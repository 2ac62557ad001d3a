"""The Room's store: messages (with the wakes they record) and tasks with their updates."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import asyncpg

from quayutec.errors import FailedPrecondition, NotFound
from quayutec.telemetry import current_traceparent
from quayutec.v1 import common_pb2
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
            repeat_of, write_id = earlier["author_company_id"], earlier["message_id"]
            await self._answer_repeat(Act.POST_MESSAGE, author, room_id, row, repeat_of, run, write_id)
            return Posted(earlier, list(row["earlier_wakes"]), True)
        companies = dict(zip(row["mentioned_agent_ids"], row["mentioned_company_ids"], strict=True))
        in_room = {str(a) for a, c in companies.items() if c in row["member_company_ids"]}
        missing = next((a for a in mention_agent_ids if a not in in_room), "")
        facts = Facts(
            author.company_id, room_id, member=row["member"], mention_not_in_room=missing, archived=row["archived"]
        )
        enforce(Act.POST_MESSAGE, facts)
        if row["message"] is None:  # the rules allow it, so the fence refused its ledger row: nothing was written
            if ledger is not None:
                await self._fenced_run(self._pool, row, ledger)
            await self._archived_since(Act.POST_MESSAGE, facts)
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
            repeat_of, write_id = earlier["from_company_id"], earlier["task_id"]
            await self._answer_repeat(Act.CREATE_TASK, author, room_id, row, repeat_of, run, write_id)
            return Posted(earlier, list(row["earlier_wakes"]), True)
        facts = Facts(
            author.company_id,
            room_id,
            member=row["member"],
            assignee_id=to_agent_id,
            assignee_in_room=row["assignee_in_room"],
            archived=row["archived"],
        )
        enforce(Act.CREATE_TASK, facts)
        if row["task"] is None:  # the rules allow it, so the fence refused its ledger row: nothing was written
            if ledger is not None:
                await self._fenced_run(self._pool, row, ledger)
            await self._archived_since(Act.CREATE_TASK, facts)
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
        is recorded in the same statement with the update id.

        Round trips: 1 (update_task, as create_task: the rules' facts, with the task locked, and the writes
        when they are those of an update the rules allow); a repeat with a ledger row 2 (record_run). When
        another update of the task committed while the statement waited for the task's lock, it wrote
        nothing and is sent again in a transaction that locks the task first: 4 more (BEGIN, lock_task,
        update_task, COMMIT)."""
        # The ledger row's agent and action now; its room against the task's once the statement has read the
        # task (the statement writes no update with a row of another room).
        if run is not None:
            self._require_run_of(run, run.run.room_id, author)
        update_id = uuid.uuid4()
        ledger = _with_write_id(run, update_id)
        args = (
            *(_NO_RUN if ledger is None else _run_args(ledger)),
            *_RUN_EVENT_ARGS,
            task_id,
            author.company_id or None,
            author.agent_id if author.kind == "agent" else None,
            room_id,
            dedupe_key,
            update_id,
            author.kind,
            author.person,
            note,
            status or "open",
            run_id,
        )
        row = await self._pool.fetchrow(self._q["update_task"], *args)
        if row["stale"]:
            # Another update of the task committed while the statement waited for the task's lock, after the
            # snapshot it read the rest in: it wrote nothing. Sent again with the task locked first, its
            # snapshot follows every update before it.
            async with self._pool.acquire() as conn, conn.transaction():
                await conn.execute(self._q["lock_task"], task_id)
                row = await conn.fetchrow(self._q["update_task"], *args)
        return await self._task_updated(row, task_id, room_id, author, run, ledger)

    async def _task_updated(
        self,
        row: Record,
        task_id: str,
        room_id: str | None,
        author: AuthorRef,
        run: RunRecord | None,
        ledger: common_pb2.Run | None,
    ) -> TaskUpdated:
        """The rules' answer to an update_task statement's facts: the update it wrote, or the earlier one."""
        task = row["task"]
        if task is None or (room_id is not None and str(task["room_id"]) != room_id):
            raise NotFound(f"task {task_id} not found")
        task_room = str(task["room_id"])
        self._require_run_of(run, task_room, author)
        author = _identified(author, row["agent_company_id"])
        earlier = row["earlier"]
        if earlier is not None:  # the author's right to write here first, then the answer
            repeat_of, write_id = earlier["author_company_id"], earlier["update_id"]
            await self._answer_repeat(Act.UPDATE_TASK, author, task_room, row, repeat_of, run, write_id)
            return TaskUpdated(task, earlier, list(row["updates"]), True)
        facts = Facts(
            author.company_id,
            task_room,
            member=row["member"],
            task_id=task_id,
            sender_id=str(task["from_company_id"]),
            assignee_company_id=str(row["assignee_company_id"] or ""),
            archived=row["archived"],
        )
        enforce(Act.UPDATE_TASK, facts)
        if task["status"] != "open":
            raise FailedPrecondition(f"task {task_id} is already {task['status']}")
        if row["written"] is None:  # the rules allow it, so the fence refused its ledger row: nothing was written
            if ledger is not None:
                await self._fenced_run(self._pool, row, ledger)
            await self._archived_since(Act.UPDATE_TASK, facts)
            raise FailedPrecondition(f"task {task_id} not updated: its ledger row was refused")
        return TaskUpdated(row["written"], row["added"], list(row["updates"]), False)

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
