"""The Room's store: the run ledger (a run's view of its room, its rows) and the housekeeping that ends or
records runs."""

from __future__ import annotations

from quayutec.errors import FailedPrecondition, NotFound
from quayutec.ledger import mark_undone, run_id_for
from quayutec.v1 import common_pb2
from services.room import convert
from services.room.store.base import (
    _MAX_KEY,
    _RUN_EVENT_ARGS,
    MEMORY_LIMIT,
    OPEN_TASKS_LIMIT,
    PASSAGE_QUERY_BYTES,
    ROOM_AGENTS_LIMIT,
    Page,
    Record,
    RunContext,
    RunFilters,
    StoreBase,
    WaitpointRows,
    _Events,
    _not_started_error,
    _page,
    _run_args,
)


class RunLedger(StoreBase):
    """The run ledger: a run's view of its room, its rows, and the housekeeping that ends or records runs."""

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
        (and its room event, when its status changes) is written through the fence in the same statement,
        and the room is read only when the fence let it be written.

        Round trips: 1 (run_context, or run_context_with_run). The room row is locked only by the run's
        event, after the ledger row; posts in the room neither wait on the read nor make it fail."""
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
        row = await self._pool.fetchrow(self._q["run_context_with_run"], *_run_args(run), *_RUN_EVENT_ARGS, *args)
        if not row["agent_found"]:
            raise NotFound(f"agent {agent_id} not found")
        if not row["admitted"]:
            raise NotFound(f"room {room_id} not found (or the company of agent {agent_id} is not a member)")
        if row["run"] is None:
            await self._fenced_run(self._pool, row, run)  # refused: raises (a refused run reads nothing)
            raise FailedPrecondition(f"run {run.run_id} has ended; it cannot read the room")
        return self._run_context(row, agent_id, room_id)

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

    async def record_run(self, run: common_pb2.Run) -> Record:
        """Upserts the run's row through the fence, with its room event when its status changes; an ended
        row may only be rewritten unchanged. Round trips: 1 (record_run), 2 when the row was written by
        another after the statement's snapshot and the refusal needs it read."""
        return await self._record_run(self._pool, run)

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
                    await self._record_run(conn, run)
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
