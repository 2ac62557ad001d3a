"""PostgreSQL access of the Gateway: the ``api_keys`` table, through the named queries of sql/queries.sql."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
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
class VerifiedPerson:
    """A person as the company's OpenID provider vouched for them at sign-in (a session key carries it)."""

    issuer: str
    subject: str
    name: str
    email: str = ""
    # The ID token named an email but said it is not verified (email_verified false): ``email`` is
    # empty then, and a company that admits only some email domains refuses the sign-in.
    email_unverified: bool = False


# Providers are found by company name without regard to case: one name, one provider.
PROVIDER_NAME_INDEX = "sign_in_providers_name_idx"


class ProviderNameTaken(Exception):
    """Another company whose name differs from this one's only in case has a sign-in provider."""


@dataclass(frozen=True)
class StoredKeyHash:
    """What authentication needs of one key."""

    company_id: str
    key_hash: bytes
    revoked: bool
    expired: bool = False
    parent_key_id: str | None = None
    expires_at: datetime | None = None
    person: VerifiedPerson | None = None


@dataclass(frozen=True)
class ProviderRow:
    """A company's OpenID provider as stored (the client secret still sealed)."""

    company_id: str
    company_name: str
    issuer: str
    client_id: str
    client_secret_sealed: bytes = field(repr=False)
    email_domains: tuple[str, ...]
    allow_api_key_sign_in: bool
    key_id: str
    updated_at: datetime


def _provider(row: Any) -> ProviderRow:
    return ProviderRow(
        company_id=str(row["company_id"]),
        company_name=row["company_name"],
        issuer=row["issuer"],
        client_id=row["client_id"],
        client_secret_sealed=bytes(row["client_secret_sealed"]),
        email_domains=tuple(row["email_domains"]),
        allow_api_key_sign_in=bool(row["allow_api_key_sign_in"]),
        key_id=str(row["key_id"]),
        updated_at=row["updated_at"],
    )


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
        self,
        key_id: uuid.UUID,
        key_hash: bytes,
        label: str,
        parent: uuid.UUID,
        ttl_seconds: int,
        most: int,
        keyed: tuple[str, bytes] | None = None,
    ) -> ApiKey | None:
        """The new session key of ``parent``; None when the parent is revoked or has ``most`` live ones.
        ``keyed``: the call's dedupe key and sealed secret, stored for its repeats (find_keyed)."""
        dedupe_key, sealed = keyed or (None, None)
        row = await self._pool.fetchrow(
            self._q["insert_session_key"],
            key_id,
            key_hash,
            label,
            parent,
            float(ttl_seconds),
            most,
            dedupe_key,
            sealed,
        )
        return _api_key(row) if row is not None else None

    async def find_keyed(self, company_id: uuid.UUID, dedupe_key: str) -> tuple[ApiKey, bytes] | None:
        """The key ``company_id`` made with ``dedupe_key``, and its sealed secret (None when none)."""
        row = await self._pool.fetchrow(self._q["find_keyed_key"], company_id, dedupe_key)
        return (_api_key(row), bytes(row["secret_sealed"])) if row is not None else None

    async def get_key_hash(self, key_id: uuid.UUID) -> StoredKeyHash | None:
        row = await self._pool.fetchrow(self._q["get_api_key"], key_id)
        if row is None:
            return None
        parent = row["parent_key_id"]
        person = None
        if row["person_subject"] is not None:
            person = VerifiedPerson(
                issuer=row["person_issuer"],
                subject=row["person_subject"],
                name=row["person_name"] or "",
                email=row["person_email"] or "",
            )
        return StoredKeyHash(
            company_id=str(row["company_id"]),
            key_hash=bytes(row["key_hash"]),
            revoked=bool(row["revoked"]),
            expired=bool(row["expired"]),
            parent_key_id=str(parent) if parent is not None else None,
            expires_at=row["expires_at"],
            person=person,
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
        self,
        key_id: uuid.UUID,
        company_id: uuid.UUID,
        key_hash: bytes,
        label: str,
        most: int,
        keyed: tuple[str, bytes] | None = None,
    ) -> ApiKey | None:
        """A new company key, unless the company already has ``most`` live ones (None then).
        ``keyed``: the call's dedupe key and sealed secret, stored for its repeats (find_keyed)."""
        dedupe_key, sealed = keyed or (None, None)
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(self._q["lock_company_keys"], str(company_id))
            row = await conn.fetchrow(
                self._q["insert_company_key"], key_id, company_id, key_hash, label, most, dedupe_key, sealed
            )
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

    # -- sign-in providers (services/gateway/signin.py) ------------------------------------------------

    async def insert_person_session_key(
        self,
        key_id: uuid.UUID,
        key_hash: bytes,
        label: str,
        parent: uuid.UUID,
        ttl_seconds: int,
        most: int,
        person: VerifiedPerson,
    ) -> ApiKey | None:
        """A session key of a provider sign-in, carrying ``person``; None when the provider's key is
        revoked or has ``most`` live session keys."""
        row = await self._pool.fetchrow(
            self._q["insert_person_session_key"],
            key_id,
            key_hash,
            label,
            parent,
            float(ttl_seconds),
            most,
            person.issuer,
            person.subject,
            person.name,
            person.email,
        )
        return _api_key(row) if row is not None else None

    async def sign_in_provider(self, company_id: uuid.UUID) -> ProviderRow | None:
        row = await self._pool.fetchrow(self._q["get_sign_in_provider"], company_id)
        return _provider(row) if row is not None else None

    async def find_sign_in_provider(self, *, company_name: str = "", domain: str = "") -> ProviderRow | None:
        """The provider of the company named ``company_name`` (any case), or serving email ``domain``."""
        if company_name:
            row = await self._pool.fetchrow(self._q["find_sign_in_provider_by_name"], company_name)
        else:
            row = await self._pool.fetchrow(self._q["find_sign_in_provider_by_domain"], domain)
        return _provider(row) if row is not None else None

    async def set_sign_in_provider(
        self, provider: ProviderRow, key_hash: bytes, label: str
    ) -> tuple[ProviderRow | None, list[str]]:
        """Saves the company's provider under a new company key (the one before, if any, is revoked: its
        sign-ins end). Returns it, or (None, the domains another company's provider already serves)."""
        company = uuid.UUID(provider.company_id)
        domains = list(provider.email_domains)
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                await conn.execute(self._q["lock_sign_in_provider"], provider.company_id)
                taken = [r["domain"] for r in await conn.fetch(self._q["domains_of_others"], company, domains)]
                if taken:
                    return None, taken
                before = await conn.fetchrow(self._q["get_sign_in_provider"], company)
                await conn.execute(self._q["insert_api_key"], uuid.UUID(provider.key_id), company, key_hash, label)
                row = await conn.fetchrow(
                    self._q["upsert_sign_in_provider"],
                    company,
                    provider.company_name,
                    provider.issuer,
                    provider.client_id,
                    provider.client_secret_sealed,
                    domains,
                    provider.allow_api_key_sign_in,
                    uuid.UUID(provider.key_id),
                )
                await conn.execute(self._q["clear_sign_in_domains"], company)
                await conn.execute(self._q["insert_sign_in_domains"], company, domains)
                if before is not None:
                    await conn.fetchval(self._q["revoke_api_key"], before["key_id"])
        except asyncpg.UniqueViolationError as exc:
            if exc.constraint_name == PROVIDER_NAME_INDEX:
                raise ProviderNameTaken(provider.company_name) from None
            # Another company's provider took one of these domains at the same moment.
            taken = [r["domain"] for r in await self._pool.fetch(self._q["domains_of_others"], company, domains)]
            return None, taken or domains
        if before is not None:
            self._revoked(before["key_id"])
        return _provider(row), []

    async def remove_sign_in_provider(self, company_id: uuid.UUID) -> bool:
        """Removes the company's provider and revokes its key (its sign-ins end); False when none was set."""
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(self._q["lock_sign_in_provider"], str(company_id))
            key_id = await conn.fetchval(self._q["delete_sign_in_provider"], company_id)
            if key_id is not None:
                await conn.fetchval(self._q["revoke_api_key"], key_id)
        if key_id is None:
            return False
        self._revoked(key_id)
        return True
