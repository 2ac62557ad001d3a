"""PostgreSQL access of the Gateway: the ``api_keys`` table, through the named queries of sql/queries.sql."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

from quayutec.sql import Queries

QUERIES_PATH = Path(__file__).resolve().parent / "sql" / "queries.sql"
# A session key's row is kept this long after it expires (it answers "expired" until then), then removed.
SESSION_KEY_KEEP_SECONDS = 86_400


@dataclass(frozen=True)
class ApiKey:
    """One API key as listed (never its hash or secret)."""

    key_id: str
    company_id: str
    label: str
    created_at: datetime
    revoked_at: datetime | None
    # A session key's company key, and when it expires (both None for a company key).
    parent_key_id: str | None = None
    expires_at: datetime | None = None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True)
class StoredKeyHash:
    """What authentication needs of one key."""

    company_id: str
    key_hash: bytes
    revoked: bool
    expired: bool = False
    parent_key_id: str | None = None
    expires_at: datetime | None = None


def _api_key(row: Any) -> ApiKey:
    parent = row["parent_key_id"]
    return ApiKey(
        key_id=str(row["key_id"]),
        company_id=str(row["company_id"]),
        label=row["label"],
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
        parent_key_id=str(parent) if parent is not None else None,
        expires_at=row["expires_at"],
    )


class ApiKeyStore:
    """Inserts, looks up, revokes and lists API keys and session keys."""

    def __init__(self, pool: asyncpg.Pool, queries: Queries | None = None) -> None:
        self._pool = pool
        self._q = queries if queries is not None else Queries(QUERIES_PATH)
        # Told the id of each key this store revoked, once committed (the replica's key cache drops it).
        self.on_revoked: list[Callable[[str], None]] = []

    def _revoked(self, key_id: uuid.UUID) -> None:
        for hook in self.on_revoked:
            hook(str(key_id))

    async def insert_key(self, key_id: uuid.UUID, company_id: uuid.UUID, key_hash: bytes, label: str) -> ApiKey:
        row = await self._pool.fetchrow(self._q["insert_api_key"], key_id, company_id, key_hash, label)
        return _api_key(row)

    async def insert_session_key(
        self, key_id: uuid.UUID, key_hash: bytes, label: str, parent: uuid.UUID, ttl_seconds: int, most: int
    ) -> ApiKey | None:
        """The new session key of ``parent``; None when the parent is revoked or has ``most`` live ones."""
        row = await self._pool.fetchrow(
            self._q["insert_session_key"], key_id, key_hash, label, parent, float(ttl_seconds), most
        )
        return _api_key(row) if row is not None else None

    async def get_key_hash(self, key_id: uuid.UUID) -> StoredKeyHash | None:
        row = await self._pool.fetchrow(self._q["get_api_key"], key_id)
        if row is None:
            return None
        parent = row["parent_key_id"]
        return StoredKeyHash(
            company_id=str(row["company_id"]),
            key_hash=bytes(row["key_hash"]),
            revoked=bool(row["revoked"]),
            expired=bool(row["expired"]),
            parent_key_id=str(parent) if parent is not None else None,
            expires_at=row["expires_at"],
        )

    async def revoke_key(self, key_id: uuid.UUID) -> bool:
        revoked = await self._pool.fetchval(self._q["revoke_api_key"], key_id) is not None
        if revoked:
            self._revoked(key_id)
        return revoked

    async def dead_keys(self, key_ids: Iterable[str]) -> set[str]:
        """Of ``key_ids``, those unknown, revoked (or whose company key is) or expired."""
        ids = [uuid.UUID(k) for k in key_ids]
        if not ids:
            return set()
        rows = await self._pool.fetch(self._q["dead_keys"], ids)
        return {str(r["key_id"]) for r in rows}

    async def prune_session_keys(self, limit: int = 1000) -> int:
        """Removes up to ``limit`` session keys expired more than a day ago; how many went."""
        status: str = await self._pool.execute(self._q["prune_session_keys"], float(SESSION_KEY_KEEP_SECONDS), limit)
        return int(status.rpartition(" ")[2] or 0)

    async def insert_company_key(
        self, key_id: uuid.UUID, company_id: uuid.UUID, key_hash: bytes, label: str, most: int
    ) -> ApiKey | None:
        """A new company key, unless the company already has ``most`` live ones (None then)."""
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(self._q["lock_company_keys"], str(company_id))
            row = await conn.fetchrow(self._q["insert_company_key"], key_id, company_id, key_hash, label, most)
        return _api_key(row) if row is not None else None

    async def list_keys_page(
        self, company_id: uuid.UUID, *, sessions: bool, after: tuple[datetime, uuid.UUID] | None, limit: int
    ) -> list[ApiKey]:
        """Up to ``limit`` of the company's keys after ``after`` (created_at, key_id), oldest first."""
        start = after or (datetime.min.replace(tzinfo=UTC), uuid.UUID(int=0))
        rows = await self._pool.fetch(self._q["list_api_keys_page"], company_id, sessions, *start, limit)
        return [_api_key(r) for r in rows]

    async def revoke_company_key(self, key_id: uuid.UUID, company_id: uuid.UUID) -> ApiKey | None:
        """Revoke the company's key (at once; its session keys with it); None when it is not the company's."""
        row = await self._pool.fetchrow(self._q["revoke_company_key"], key_id, company_id)
        if row is None:
            return None
        self._revoked(key_id)
        return _api_key(row)

    async def list_keys(self, company_id: uuid.UUID, *, sessions: bool = False) -> list[ApiKey]:
        rows = await self._pool.fetch(self._q["list_api_keys"], company_id, sessions)
        return [_api_key(r) for r in rows]

    async def notify_company_rooms(self, company_id: str) -> None:
        await self._pool.execute(self._q["notify_company_rooms"], company_id)
