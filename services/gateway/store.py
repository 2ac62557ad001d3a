"""PostgreSQL access of the Gateway: the ``api_keys`` table, through the named queries of sql/queries.sql."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg

from quayutec.sql import Queries

QUERIES_PATH = Path(__file__).resolve().parent / "sql" / "queries.sql"


@dataclass(frozen=True)
class ApiKey:
    """One API key as listed (never its hash or secret)."""

    key_id: str
    company_id: str
    label: str
    created_at: datetime
    revoked_at: datetime | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True)
class StoredKeyHash:
    """What authentication needs of one key."""

    company_id: str
    key_hash: bytes
    revoked: bool


def _api_key(row: Any) -> ApiKey:
    return ApiKey(
        key_id=str(row["key_id"]),
        company_id=str(row["company_id"]),
        label=row["label"],
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
    )


class ApiKeyStore:
    """Inserts, looks up, revokes and lists API keys."""

    def __init__(self, pool: asyncpg.Pool, queries: Queries | None = None) -> None:
        self._pool = pool
        self._q = queries if queries is not None else Queries(QUERIES_PATH)

    async def insert_key(self, key_id: uuid.UUID, company_id: uuid.UUID, key_hash: bytes, label: str) -> ApiKey:
        row = await self._pool.fetchrow(self._q["insert_api_key"], key_id, company_id, key_hash, label)
        return _api_key(row)

    async def get_key_hash(self, key_id: uuid.UUID) -> StoredKeyHash | None:
        row = await self._pool.fetchrow(self._q["get_api_key"], key_id)
        if row is None:
            return None
        return StoredKeyHash(
            company_id=str(row["company_id"]), key_hash=bytes(row["key_hash"]), revoked=row["revoked_at"] is not None
        )

    async def revoke_key(self, key_id: uuid.UUID) -> bool:
        return await self._pool.fetchval(self._q["revoke_api_key"], key_id) is not None

    async def list_keys(self, company_id: uuid.UUID) -> list[ApiKey]:
        rows = await self._pool.fetch(self._q["list_api_keys"], company_id)
        return [_api_key(r) for r in rows]
