"""PostgreSQL side of Claims: one row per (agent, wake) in ``agent_run_locks``, never released.

``claim_once`` either sends its own ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` or, when
batching is on, joins the claims made concurrently in one statement (same at-most-once answer).
A claim keeps the claimant token of the call that made it: the same token asking again is
answered claimed=True again, so a caller that lost the first answer still acts, once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import asyncpg

from quayutec.errors import Unavailable
from quayutec.sql import Queries

QUERIES_PATH = Path(__file__).resolve().parent / "sql" / "queries.sql"

Pair = tuple[str, str]
# (agent_id, wake_id, claimant)
Request = tuple[str, str, str]


@dataclass(frozen=True)
class Claim:
    """The answer to a claim: ``claimed`` is true for the call that made it and for its claimant."""

    agent_id: str
    wake_id: str
    claimed: bool
    claimed_at: datetime


class ClaimStore:
    """Claims in PostgreSQL; ``batch_max`` > 1 combines concurrent ``claim_once`` calls.

    ``test_commit_delay_seconds`` (tests only) holds the transaction that makes a claim open that
    long before it commits, to stand in for a slow database.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        batch_max: int = 1,
        max_batches_in_flight: int = 1,
        acquire_timeout_seconds: float = 5.0,
        queries: Queries | None = None,
        test_commit_delay_seconds: float = 0.0,
    ) -> None:
        self._pool = pool
        self._queries = queries if queries is not None else Queries(QUERIES_PATH)
        self._acquire_timeout = acquire_timeout_seconds
        self._test_commit_delay = test_commit_delay_seconds
        self._batcher = _Batcher(self.claim_many, batch_max, max_batches_in_flight) if batch_max > 1 else None

    async def claim_once(self, agent_id: str, wake_id: str, claimant: str = "") -> Claim:
        """Claim one pair; an existing claim is answered with claimed=False (True for its own
        non-empty claimant) and its claimed_at."""
        if self._batcher is not None:
            return await self._batcher.submit((agent_id, wake_id, claimant))
        async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
            async with self._commit_scope(conn):
                claimed_at = await conn.fetchval(self._queries["claim_once"], agent_id, wake_id, claimant)
                if claimed_at is not None:
                    await self._delay_commit()
            if claimed_at is not None:
                return Claim(agent_id, wake_id, True, claimed_at)
            existing = await conn.fetchrow(self._queries["get_claim"], agent_id, wake_id)
        if existing is None:
            raise _unreadable(agent_id, wake_id)
        return Claim(agent_id, wake_id, _same_claimant(existing["claimant"], claimant), existing["claimed_at"])

    async def claim_many(self, requests: Sequence[Request]) -> list[Claim]:
        """Claim many pairs in one statement; answers in order. A pair repeated in ``requests`` is
        claimed=True at its first place and wherever its claimant (non-empty) asks again."""
        first: dict[Pair, str] = {}
        for agent_id, wake_id, claimant in requests:
            first.setdefault((agent_id, wake_id), claimant)
        unique = list(first)
        async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
            async with self._commit_scope(conn):
                rows = await conn.fetch(
                    self._queries["claim_many"],
                    [a for a, _ in unique],
                    [w for _, w in unique],
                    [first[p] for p in unique],
                )
                if rows:
                    await self._delay_commit()
            made = {(r["agent_id"], r["wake_id"]): r["claimed_at"] for r in rows}
            earlier: dict[Pair, tuple[datetime, str]] = {}
            if len(made) < len(unique):
                missing = [p for p in unique if p not in made]
                found = await conn.fetch(self._queries["get_claims"], [a for a, _ in missing], [w for _, w in missing])
                earlier = {(r["agent_id"], r["wake_id"]): (r["claimed_at"], r["claimant"]) for r in found}
        answers: list[Claim] = []
        for agent_id, wake_id, claimant in requests:
            pair = (agent_id, wake_id)
            at = made.pop(pair, None)
            if at is not None:  # the first place of a pair this statement claimed
                earlier[pair] = (at, first[pair])
                answers.append(Claim(agent_id, wake_id, True, at))
                continue
            stored = earlier.get(pair)
            if stored is None:
                raise _unreadable(agent_id, wake_id)
            answers.append(Claim(agent_id, wake_id, _same_claimant(stored[1], claimant), stored[0]))
        return answers

    async def get_claim(self, agent_id: str, wake_id: str) -> Claim | None:
        async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
            row = await conn.fetchrow(self._queries["get_claim"], agent_id, wake_id)
        if row is None:
            return None
        return Claim(agent_id, wake_id, False, row["claimed_at"])

    def _commit_scope(self, conn: asyncpg.Connection) -> AbstractAsyncContextManager[Any]:
        """Where a claim's one statement commits: by itself (one round trip; a lone statement is its
        own transaction, as durable as any), or, when tests hold the commit back, inside an explicit
        transaction that stays open for the delay."""
        if self._test_commit_delay > 0:
            return cast(AbstractAsyncContextManager[Any], conn.transaction())
        return nullcontext()

    async def _delay_commit(self) -> None:
        if self._test_commit_delay > 0:
            await asyncio.sleep(self._test_commit_delay)


def _same_claimant(stored: str, asking: str) -> bool:
    return bool(asking) and stored == asking


def _unreadable(agent_id: str, wake_id: str) -> Unavailable:
    # The insert saw a committed conflicting row, and rows are never deleted, so it must be there.
    return Unavailable(f"claim ({agent_id!r}, {wake_id!r}) conflicted but could not be read; retry")


class _Batcher:
    """Gathers the claims submitted within one event-loop tick (up to ``batch_max``) into one call of
    ``run``; at most ``max_in_flight`` batches run at once, and claims wait while they do."""

    def __init__(
        self, run: Callable[[Sequence[Request]], Awaitable[list[Claim]]], batch_max: int, max_in_flight: int
    ) -> None:
        self._run = run
        self._batch_max = batch_max
        self._max_in_flight = max(1, max_in_flight)
        self._pending: list[tuple[Request, asyncio.Future[Claim]]] = []
        self._in_flight = 0
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, pair: Request) -> Claim:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Claim] = loop.create_future()
        self._pending.append((pair, future))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._dispatch)
        return await future

    def _dispatch(self) -> None:
        self._scheduled = False
        while self._pending and self._in_flight < self._max_in_flight:
            batch = self._pending[: self._batch_max]
            del self._pending[: self._batch_max]
            # A caller that gave up before its batch left makes no claim (it got no answer).
            batch = [(pair, future) for pair, future in batch if not future.done()]
            if not batch:
                continue
            self._in_flight += 1
            task = asyncio.create_task(self._run_batch(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run_batch(self, batch: list[tuple[Request, asyncio.Future[Claim]]]) -> None:
        try:
            answers = await self._run([pair for pair, _ in batch])
        except BaseException as exc:
            for _, future in batch:
                if future.done():
                    continue
                if isinstance(exc, Exception):
                    future.set_exception(exc)
                else:
                    future.cancel()
            if not isinstance(exc, Exception):
                raise
        else:
            for (_, future), answer in zip(batch, answers, strict=True):
                if not future.done():
                    future.set_result(answer)
        finally:
            self._in_flight -= 1
            if self._pending and not self._scheduled:
                self._dispatch()
