"""API keys of companies and the server interceptor that turns a key into the calling company.

A key reads ``qyk_<key_id>_<random>``; only its SHA-256 is stored. Authentication looks the key up
by ``key_id`` and compares hashes in constant time, once per call and without a cache, so a revoked
key stops working at once.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import asyncpg
import grpc

from quayutec.errors import InvalidArgument, Unauthenticated, WrappedHandlers, status_for
from services.gateway.store import ApiKey, ApiKeyStore

_log = logging.getLogger("quayutec.gateway.auth")

KEY_PREFIX = "qyk_"
MAX_LABEL_BYTES = 200
# Services reachable without a key: health checks and reflection.
UNAUTHENTICATED_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_HOW_TO_AUTH = "send metadata 'authorization: Bearer <api key>' with a key made by `quayutec` for your company"


def _hash_secret(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


def _parse_uuid(value: str, field: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except (ValueError, AttributeError, TypeError):
        raise InvalidArgument(f"{field} must be a uuid, got {value!r}") from None


def parse_key_id(secret: str) -> uuid.UUID | None:
    """The key id inside a secret, or None when it is not shaped like one of our keys."""
    if not secret.startswith(KEY_PREFIX):
        return None
    key_id, sep, random_part = secret[len(KEY_PREFIX) :].partition("_")
    if not sep or not random_part:
        return None
    try:
        parsed = uuid.UUID(key_id)
    except ValueError:
        return None
    return parsed if str(parsed) == key_id else None


async def create_api_key(pool: asyncpg.Pool, company_id: str, label: str) -> tuple[str, str]:
    """Make a key for ``company_id``; returns ``(key_id, secret)``. The secret is shown once, never stored."""
    company = _parse_uuid(company_id, "company_id")
    if len(label.encode("utf-8")) > MAX_LABEL_BYTES:
        raise InvalidArgument(f"label must be at most {MAX_LABEL_BYTES} bytes")
    key_id = uuid.uuid4()
    secret = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
    await ApiKeyStore(pool).insert_key(key_id, company, _hash_secret(secret), label)
    return str(key_id), secret


async def revoke_api_key(pool: asyncpg.Pool, key_id: str) -> bool:
    """Revoke a key at once; True when it exists (now revoked), False when there is no such key."""
    try:
        parsed = uuid.UUID(key_id)
    except ValueError:
        return False
    return await ApiKeyStore(pool).revoke_key(parsed)


async def list_api_keys(pool: asyncpg.Pool, company_id: str) -> list[ApiKey]:
    """The keys of one company, oldest first, revoked ones included (never hashes or secrets)."""
    return await ApiKeyStore(pool).list_keys(_parse_uuid(company_id, "company_id"))


class Authenticator:
    """Resolves an ``authorization`` metadata value to the company whose live key it carries."""

    def __init__(self, store: ApiKeyStore) -> None:
        self._store = store

    async def company_for(self, authorization: str | None) -> str:
        if not authorization:
            raise Unauthenticated(f"no API key: {_HOW_TO_AUTH}")
        scheme, _, secret = authorization.strip().partition(" ")
        secret = secret.strip()
        if scheme.lower() != "bearer" or not secret:
            raise Unauthenticated(f"malformed authorization metadata: {_HOW_TO_AUTH}")
        key_id = parse_key_id(secret)
        if key_id is None:
            raise Unauthenticated(f"malformed API key (keys read qyk_<key id>_<secret>): {_HOW_TO_AUTH}")
        stored = await self._store.get_key_hash(key_id)
        if stored is None or not hmac.compare_digest(stored.key_hash, _hash_secret(secret)):
            raise Unauthenticated(f"unknown API key: {_HOW_TO_AUTH}")
        if stored.revoked:
            raise Unauthenticated(f"this API key was revoked: {_HOW_TO_AUTH}")
        return stored.company_id


class CallerContext:
    """Carries the authenticated company from the interceptor to the servicer of the same call."""

    def __init__(self) -> None:
        self._company: contextvars.ContextVar[str | None] = contextvars.ContextVar("quayutec_caller", default=None)

    def company_id(self) -> str:
        """The calling company; only callable inside an authenticated call."""
        company = self._company.get()
        if company is None:
            raise Unauthenticated(f"no authenticated company: {_HOW_TO_AUTH}")
        return company

    def set(self, company_id: str) -> contextvars.Token[str | None]:
        return self._company.set(company_id)

    def reset(self, token: contextvars.Token[str | None]) -> None:
        self._company.reset(token)


def _authorization(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Authenticates every call except health and reflection, before any handler code runs."""

    def __init__(self, authenticator: Authenticator, caller: CallerContext) -> None:
        self._authenticator = authenticator
        self._caller = caller
        # The authenticating handler of each method, built once rather than per call.
        self._wrapped = WrappedHandlers()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(UNAUTHENTICATED_SERVICES):
            return handler
        return self._wrapped.get(method, handler, lambda: self._authenticated(handler, method))

    def _authenticated(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler | None:
        if handler.unary_stream is not None:
            return self._authenticated_stream(handler, method)
        if handler.unary_unary is None:
            return None  # every Gateway RPC is unary or server streaming; anything else is not served
        inner = handler.unary_unary

        async def authenticated(request: Any, context: grpc.aio.ServicerContext) -> Any:
            company_id = await self._authenticate(method, context)
            token = self._caller.set(company_id)
            try:
                return await inner(request, context)
            finally:
                self._caller.reset(token)

        return grpc.unary_unary_rpc_method_handler(
            authenticated,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    async def _authenticate(self, method: str, context: grpc.aio.ServicerContext) -> str:
        """The caller's company from its API key, or the call is aborted (UNAUTHENTICATED, or what failed)."""
        try:
            return await self._authenticator.company_for(_authorization(context.invocation_metadata()))
        except Exception as exc:
            code, message = status_for(exc)
            if code != grpc.StatusCode.UNAUTHENTICATED:
                _log.warning("authenticating %s failed: %s", method, message, exc_info=exc)
            await context.abort(code, message)
            raise  # abort raises; this line is never reached

    def _authenticated_stream(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """The same authentication for a server-streaming RPC (WatchRoom), before its first item."""
        inner = handler.unary_stream

        async def authenticated(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            company_id = await self._authenticate(method, context)
            token = self._caller.set(company_id)
            try:
                async for item in inner(request, context):
                    yield item
            finally:
                with contextlib.suppress(ValueError):  # closed from another context: that task ends anyway
                    self._caller.reset(token)

        return grpc.unary_stream_rpc_method_handler(
            authenticated,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
