"""The Room's store: the wake outbox: leases, settlements and cleanup of delivered wakes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from quayutec.errors import FailedPrecondition, NotFound
from services.room.store.base import (
    _SETTLE_WAKES_SQL,
    Record,
    StoreBase,
    WakeSettled,
    WakeToSettle,
)


class WakeOutbox(StoreBase):
    """The wake outbox: leases, settlements and cleanup of delivered wakes."""

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
