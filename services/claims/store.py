"""PostgreSQL side of Claims: one row per (agent, wake) in ``agent_run_locks``, never released.

``claim_once`` either sends its own ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` or, when
batching is on, joins the claims made concurrently in one statement (same at-most-once answer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import asyncpg

from quayutec.errors import Unavailable
from quayutec.sql import Queries

QUERIES_PATH = Path(__file__).resolve().parent / "sql" / "queries.sql"

Pair = tuple[str, str]


@dataclass(frozen=True)
class Claim:
    """The answer to a claim: ``claimed`` is true only for the call that made it."""

    agent_id: str
    wake_id: str
    claimed: bool
    claimed_at: datetime


class ClaimStore:
    """Claims in PostgreSQL; ``batch_max`` > 1 combines concurrent ``claim_once`` calls."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        batch_max: int = 1,
        max_batches_in_flight: int = 1,
        acquire_timeout_seconds: float = 5.0,
        queries: Queries | None = None,
    ) -> None:
        self._pool = pool
        self._queries = queries if queries is not None else Queries(QUERIES_PATH)
        self._acquire_timeout = acquire_timeout_seconds
        self._batcher = _Batcher(self.claim_many, batch_max, max_batches_in_flight) if batch_max > 1 else None

    async def claim_once(self, agent_id: str, wake_id: str) -> Claim:
        """Claim one pair; an existing claim is answered with claimed=False and its claimed_at."""
        if self._batcher is not None:
            return await self._batcher.submit((agent_id, wake_id))
        async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
            claimed_at = await conn.fetchval(self._queries["claim_once"], agent_id, wake_id)
            if claimed_at is not None:
                return Claim(agent_id, wake_id, True, claimed_at)
            existing = await conn.fetchval(self._queries["get_claim"], agent_id, wake_id)
        return Claim(agent_id, wake_id, False, _existing(existing, agent_id, wake_id))

    async def claim_many(self, pairs: Sequence[Pair]) -> list[Claim]:
        """Claim many pairs in one statement; answers in order, and a pair repeated in ``pairs``
        is claimed=True at most once (its first place)."""
        unique = list(dict.fromkeys(pairs))
        agents = [a for a, _ in unique]
        wakes = [w for _, w in unique]
        async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
            rows = await conn.fetch(self._queries["claim_many"], agents, wakes)
            made = {(r["agent_id"], r["wake_id"]): r["claimed_at"] for r in rows}
            earlier: dict[Pair, datetime] = {}
            if len(made) < len(unique):
                missing = [p for p in unique if p not in made]
                found = await conn.fetch(self._queries["get_claims"], [a for a, _ in missing], [w for _, w in missing])
                earlier = {(r["agent_id"], r["wake_id"]): r["claimed_at"] for r in found}
        answers: list[Claim] = []
        for pair in pairs:
            at = made.pop(pair, None)
            if at is not None:
                earlier[pair] = at
                answers.append(Claim(pair[0], pair[1], True, at))
            else:
                answers.append(Claim(pair[0], pair[1], False, _existing(earlier.get(pair), *pair)))
        return answers

    async def get_claim(self, agent_id: str, wake_id: str) -> Claim | None:
        async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
            claimed_at = await conn.fetchval(self._queries["get_claim"], agent_id, wake_id)
        if claimed_at is None:
            return None
        return Claim(agent_id, wake_id, False, claimed_at)


def _existing(claimed_at: datetime | None, agent_id: str, wake_id: str) -> datetime:
    # The insert saw a committed conflicting row, and rows are never deleted, so it must be there.
    if claimed_at is None:
        raise Unavailable(f"claim ({agent_id!r}, {wake_id!r}) conflicted but could not be read; retry")
    return claimed_at


class _Batcher:
    """Gathers the claims submitted within one event-loop tick (up to ``batch_max``) into one call of
    ``run``; at most ``max_in_flight`` batches run at once, and claims wait while they do."""

    def __init__(
        self, run: Callable[[Sequence[Pair]], Awaitable[list[Claim]]], batch_max: int, max_in_flight: int
    ) -> None:
        self._run = run
        self._batch_max = batch_max
        self._max_in_flight = max(1, max_in_flight)
        self._pending: list[tuple[Pair, asyncio.Future[Claim]]] = []
        self._in_flight = 0
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, pair: Pair) -> Claim:
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

    async def _run_batch(self, batch: list[tuple[Pair, asyncio.Future[Claim]]]) -> None:
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
