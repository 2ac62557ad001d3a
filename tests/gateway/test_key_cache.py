"""The Gateway's key cache (services/gateway/keycache.py, off by default): a call's key is not looked up
again while the replica listens for revocations; a key revoked through the replica is refused at once,
one revoked elsewhere once its notification lands; with no listener the cache fails closed (every call
looks its key up).

The probe of the cache is a key row deleted behind the Gateway's back (no notification): a kept key
still answers, a key looked up per call does not. Nothing here asserts on timing; waits are failsafes.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import grpc

from quayutec.v1 import gateway_pb2
from services.gateway.auth import create_api_key, revoke_api_key
from services.gateway.config import KeyCacheConfig
from services.gateway.keycache import KeyCache
from services.gateway.store import StoredKeyHash
from tests.gateway.conftest import NOWHERE
from tests.gateway.helpers import expect_error
from tests.gateway.test_ratelimit import Clock
from tests.gateway.test_watch import QUIET
from tests.harness.gateway import CompanyKey, authed_gateway, running_gateway

FAILSAFE_SECONDS = 30
# The cache on, keeping a key longer than any failsafe here: only a revocation (or a lost listener) drops it.
KEPT = {**QUIET, "QUAYUTEC_GATEWAY_KEY_CACHE_SIZE": "100", "QUAYUTEC_GATEWAY_KEY_CACHE_SECONDS": "3600"}


async def listening_for_revocations(pool: asyncpg.Pool) -> None:
    """Until a connection of this database LISTENs on quayutec_keys_revoked (failsafe-bounded)."""
    async with asyncio.timeout(FAILSAFE_SECONDS):
        while not await pool.fetchval(  # noqa: ASYNC110 - the wait is in PostgreSQL
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle'"
            " AND query LIKE 'LISTEN%quayutec_keys_revoked%'"
        ):
            await asyncio.sleep(0.05)


async def delete_key_row(pool: asyncpg.Pool, key_id: str) -> None:
    """Removes a key's row without revoking it (no notification): only a kept lookup still knows it."""
    assert await pool.execute("DELETE FROM api_keys WHERE key_id = $1", uuid.UUID(key_id)) == "DELETE 1"


async def answers_once_its_row_is_gone(
    database_url: str, room_addr: str, pool: asyncpg.Pool, acme: CompanyKey, env: dict[str, str]
) -> bool:
    """Whether a Gateway with ``env`` still answers a key used twice once its row is deleted (no notification)."""
    key_id, secret = await create_api_key(pool, acme.company_id, "probe")
    async with running_gateway(database_url, room_addr, NOWHERE, **env) as addr, authed_gateway(addr, secret) as gw:
        if env.get("QUAYUTEC_GATEWAY_KEY_NOTIFY") != "false":
            await listening_for_revocations(pool)
        for _ in range(2):
            assert (await gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)).company.company_id == acme.company_id
        await delete_key_row(pool, key_id)
        try:
            who = await gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "unknown API key" in (err.details() or "")
            return False
        assert who.company.company_id == acme.company_id
        # A wrong secret with the same key id is still refused: the kept hash is compared on every call.
        async with authed_gateway(addr, secret[:-4] + "AAAA") as forged:
            await expect_error(grpc.StatusCode.UNAUTHENTICATED, forged.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10))
        return True


async def test_a_key_is_kept_while_revocations_are_listened_for(
    database_url: str, room_addr: str, pool: asyncpg.Pool, acme: CompanyKey
) -> None:
    # Answered from memory: the row is gone and no lookup was made.
    assert await answers_once_its_row_is_gone(database_url, room_addr, pool, acme, KEPT)


async def test_with_no_revocation_listener_every_call_looks_its_key_up(
    database_url: str, room_addr: str, pool: asyncpg.Pool, acme: CompanyKey
) -> None:
    deaf = {**KEPT, "QUAYUTEC_GATEWAY_KEY_NOTIFY": "false"}
    assert not await answers_once_its_row_is_gone(database_url, room_addr, pool, acme, deaf)
    # And by default (no cache) every call looks its key up too.
    assert not await answers_once_its_row_is_gone(database_url, room_addr, pool, acme, QUIET)


async def test_a_kept_key_revoked_elsewhere_is_refused_once_notified(
    database_url: str, room_addr: str, pool: asyncpg.Pool, acme: CompanyKey
) -> None:
    key_id, secret = await create_api_key(pool, acme.company_id, "revoked by the CLI")
    async with running_gateway(database_url, room_addr, NOWHERE, **KEPT) as addr, authed_gateway(addr, secret) as gw:
        await listening_for_revocations(pool)
        for _ in range(2):
            await gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)
        assert await revoke_api_key(pool, key_id)  # another process's revoke: only its notification drops it
        async with asyncio.timeout(FAILSAFE_SECONDS):  # kept an hour otherwise
            while True:
                try:
                    await gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in (err.details() or "")
                    break
                await asyncio.sleep(0.01)


async def test_revoking_a_company_key_here_refuses_its_kept_session_key_at_once(
    database_url: str, room_addr: str, pool: asyncpg.Pool, acme: CompanyKey
) -> None:
    key_id, secret = await create_api_key(pool, acme.company_id, "signs in")
    async with (
        running_gateway(database_url, room_addr, NOWHERE, **KEPT) as addr,
        authed_gateway(addr, secret) as company,
        authed_gateway(addr, acme.secret) as admin,
    ):
        await listening_for_revocations(pool)
        made = await company.CreateSessionKey(gateway_pb2.CreateSessionKeyRequest(ttl_seconds=600), timeout=10)
        async with authed_gateway(addr, made.secret) as session:
            for _ in range(2):
                await session.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)
            await admin.RevokeApiKey(gateway_pb2.RevokeApiKeyRequest(key_id=key_id), timeout=10)
            await expect_error(
                grpc.StatusCode.UNAUTHENTICATED, session.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10), "revoked"
            )


def _stored(parent: str | None = None, expires_at: datetime | None = None) -> StoredKeyHash:
    return StoredKeyHash(
        company_id=str(uuid.uuid4()), key_hash=b"h" * 32, revoked=False, parent_key_id=parent, expires_at=expires_at
    )


def test_the_cache_fails_closed_and_forgets_when_the_listener_was_down() -> None:
    listening = [True]
    cache = KeyCache(KeyCacheConfig(size=10, seconds=60), lambda: listening[0])
    cache.put("a", _stored(), cache.epoch)
    assert cache.get("a") is not None
    listening[0] = False
    assert cache.get("a") is None  # not used while nothing tells it of revocations
    listening[0] = True
    assert cache.get("a") is None and len(cache) == 0  # and forgotten: revocations meanwhile were missed


def test_a_lookup_overtaken_by_a_revocation_or_a_reconnect_is_not_kept() -> None:
    cache = KeyCache(KeyCacheConfig(size=10, seconds=60), lambda: True)
    started = cache.epoch
    cache.revoked(str(uuid.uuid4()))  # any revocation lands while the lookup is in flight
    cache.put("a", _stored(), started)
    assert cache.get("a") is None
    started = cache.epoch
    cache.clear()  # the listener reconnected meanwhile
    cache.put("a", _stored(), started)
    assert cache.get("a") is None


def test_revoking_a_company_key_drops_its_session_keys() -> None:
    cache = KeyCache(KeyCacheConfig(size=10, seconds=60), lambda: True)
    cache.put("company", _stored(), cache.epoch)
    cache.put("session", _stored(parent="company"), cache.epoch)
    cache.put("other", _stored(parent="elsewhere"), cache.epoch)
    cache.revoked("company")
    assert cache.get("company") is None and cache.get("session") is None
    assert cache.get("other") is not None


def test_the_cache_is_bounded_in_keys_and_time_and_checks_expiry() -> None:
    clock = Clock()
    cache = KeyCache(KeyCacheConfig(size=2, seconds=30), lambda: True, clock=clock)
    for key in ("a", "b"):
        cache.put(key, _stored(), cache.epoch)
    assert cache.get("a") is not None  # "a" used last: "b" goes first
    cache.put("c", _stored(), cache.epoch)
    assert len(cache) == 2 and cache.get("b") is None and cache.get("a") is not None
    clock.now += 30
    assert cache.get("a") is None and cache.get("c") is None
    expired = _stored(expires_at=datetime.now(UTC) - timedelta(seconds=1))
    cache.put("session", expired, cache.epoch)
    assert cache.get("session") is None
    assert KeyCache(KeyCacheConfig(size=0), lambda: True).get("a") is None
