"""The Room's store: waitpoints: held actions, the companies' decisions and their expiry."""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from quayutec.errors import FailedPrecondition, NotFound
from quayutec.telemetry import current_traceparent, expiry_span
from quayutec.v1 import common_pb2
from services.room import convert
from services.room.rules import Act, Facts, enforce
from services.room.store.base import (
    Decided,
    HeldSpec,
    Page,
    Record,
    StoreBase,
    WaitpointRows,
    _Events,
    _held_by_another,
    _page,
    _run_args,
)


class Waitpoints(StoreBase):
    """Waitpoints: held actions, the companies' decisions and their expiry."""

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
