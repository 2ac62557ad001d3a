"""API keys of companies and the server interceptor that turns a key into the calling company.

A key reads ``qyk_<key_id>_<random>``; only its SHA-256 is stored. Authentication looks the key up
by ``key_id`` and compares hashes in constant time on every call; the lookup is kept in memory while
the replica listens for revocations (services/gateway/keycache.py: a revocation's notification drops
the key at once, and nothing is kept while the listener is down), so a revoked key stops working at
once; a stream opened before is ended by ``OpenStreams`` (services/gateway/streams.py).
A session key (CreateSessionKey, what a console sign-in uses) is a key of the same form with a parent
company key and an expiry. Failed authentications are throttled per source address and per key id
(quayutec.throttle.AuthThrottle): beyond the burst they are answered RESOURCE_EXHAUSTED; a key is
always checked, so the right secret gets in whatever was guessed with its id or from its address.
A call's source address is its peer's, except on a call from the console (``source_address``): the
console passes on its browser's address, and only a caller whose verified certificate names the
console identity is believed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import hmac
import ipaddress
import logging
import re
import secrets
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
import grpc
from opentelemetry import trace

from quayutec.crypto import MultiFernet
from quayutec.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    WrappedHandlers,
    status_for,
    trailers_of,
)
from quayutec.throttle import AuthThrottle, ThrottleConfig, source_of
from quayutec.tls import CONSOLE, peer_identity
from services.gateway.keycache import KeyCache
from services.gateway.store import ApiKey, ApiKeyStore, StoredKeyHash, VerifiedPerson
from services.gateway.streams import OpenStream, OpenStreams

_log = logging.getLogger("quayutec.gateway.auth")

KEY_PREFIX = "qyk_"
MAX_LABEL_BYTES = 200
# A session key lives 1 minute to 7 days.
SESSION_TTL_SECONDS = (60, 7 * 86_400)
THROTTLE_SETTINGS = "QUAYUTEC_GATEWAY_AUTH_FAILURE_BURST / _RATE"
# Services reachable without a key: health checks and reflection.
# SignInService too: it is how a person signs in, before there is a key (services/gateway/signin.py).
UNAUTHENTICATED_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.", "/quayutec.v1.SignInService/")
# The metadata entry in which the console passes on the address of the browser it calls for.
CLIENT_ADDRESS_METADATA = "x-quayutec-client-address"
# The id a client names its call by (the SDKs send one on every attempt and put it in their errors):
# put on the call's server span as quayutec.caller.request_id, so a quoted id finds the call's trace.
REQUEST_ID_METADATA = "x-request-id"
REQUEST_ID_ATTRIBUTE = "quayutec.caller.request_id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
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


def _label(label: str) -> str:
    if len(label.encode("utf-8")) > MAX_LABEL_BYTES:
        raise InvalidArgument(f"label must be at most {MAX_LABEL_BYTES} bytes")
    return label


def _new_secret() -> tuple[uuid.UUID, str]:
    key_id = uuid.uuid4()
    return key_id, f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"


# For the sign-in provider's keys (services/gateway/signin.py).
hash_secret = _hash_secret
new_secret = _new_secret


async def create_api_key(pool: asyncpg.Pool, company_id: str, label: str) -> tuple[str, str]:
    """Make a key for ``company_id``; returns ``(key_id, secret)``. The secret is shown once, never stored."""
    company = _parse_uuid(company_id, "company_id")
    key_id, secret = _new_secret()
    await ApiKeyStore(pool).insert_key(key_id, company, _hash_secret(secret), _label(label))
    return str(key_id), secret


@dataclass(frozen=True)
class KeyedCreate:
    """A key creation's idempotency key (already namespaced by kind and company) and the cipher that
    seals its secret, so a repeat answers the same secret."""

    dedupe_key: str
    cipher: MultiFernet


async def _earlier_key(store: ApiKeyStore, company_id: str, keyed: KeyedCreate | None) -> tuple[ApiKey, str] | None:
    """The key an earlier call with the same idempotency key made, with its secret."""
    if keyed is None:
        return None
    found = await store.find_keyed(uuid.UUID(company_id), keyed.dedupe_key)
    if found is None:
        return None
    made, sealed = found
    return made, keyed.cipher.decrypt(sealed).decode("utf-8")


def _sealed(keyed: KeyedCreate | None, secret: str) -> tuple[str, bytes] | None:
    return (keyed.dedupe_key, keyed.cipher.encrypt(secret.encode("utf-8"))) if keyed is not None else None


async def create_session_key(
    store: ApiKeyStore,
    caller: Caller,
    ttl_seconds: int,
    label: str,
    *,
    most: int,
    keyed: KeyedCreate | None = None,
) -> tuple[ApiKey, str]:
    """A session key of the caller's company key, living ``ttl_seconds``; returns it and its secret.
    A repeat of ``keyed`` answers the first key, once the caller may make one."""
    low, high = SESSION_TTL_SECONDS
    if not low <= ttl_seconds <= high:
        raise InvalidArgument(f"ttl_seconds must be between {low} and {high} (7 days), got {ttl_seconds}")
    if caller.session:
        raise PermissionDenied("a session key cannot make another session key: call with your company's API key")
    earlier = await _earlier_key(store, caller.company_id, keyed)
    if earlier is not None:
        return earlier
    key_id, secret = _new_secret()
    try:
        made = await store.insert_session_key(
            key_id,
            _hash_secret(secret),
            _label(label),
            uuid.UUID(caller.key_id),
            ttl_seconds,
            most,
            _sealed(keyed, secret),
        )
    except asyncpg.UniqueViolationError:  # a concurrent call with the same key committed first
        earlier = await _earlier_key(store, caller.company_id, keyed)
        if earlier is None:
            raise
        return earlier
    if made is None:
        raise ResourceExhausted(
            f"this API key already has {most} live session keys (QUAYUTEC_GATEWAY_MAX_SESSION_KEYS); end some "
            "(EndSession) or wait until they expire"
        )
    return made, secret


async def create_company_key(
    store: ApiKeyStore, caller: Caller, label: str, *, most: int, keyed: KeyedCreate | None = None
) -> tuple[ApiKey, str]:
    """A new company key of the caller's company, made with a company key; returns it and its secret.
    A repeat of ``keyed`` answers the first key, once the caller may make one.

    A session key may not make one: a session is short-lived and ends with its sign-out or its company
    key, and a key it made would outlive both (a copied cookie turned into lasting access)."""
    if caller.session:
        raise PermissionDenied(
            "a session key cannot make an API key: call with a company API key (the console asks for one to confirm)"
        )
    earlier = await _earlier_key(store, caller.company_id, keyed)
    if earlier is not None:
        return earlier
    key_id, secret = _new_secret()
    try:
        made = await store.insert_company_key(
            key_id, uuid.UUID(caller.company_id), _hash_secret(secret), _label(label), most, _sealed(keyed, secret)
        )
    except asyncpg.UniqueViolationError:  # a concurrent call with the same key committed first
        earlier = await _earlier_key(store, caller.company_id, keyed)
        if earlier is None:
            raise
        return earlier
    if made is None:
        raise ResourceExhausted(
            f"your company already has {most} live API keys (QUAYUTEC_GATEWAY_MAX_API_KEYS); revoke one it no "
            "longer uses first"
        )
    return made, secret


async def end_session(store: ApiKeyStore, caller: Caller) -> None:
    """Revoke the caller's session key (the trigger notifies every replica, whose streams of it end)."""
    if not caller.session:
        raise FailedPrecondition(
            "EndSession ends a session key, and this call was made with a company API key: revoke that with "
            "`quayutec keys revoke <key id>`"
        )
    await store.revoke_key(uuid.UUID(caller.key_id))


async def revoke_api_key(pool: asyncpg.Pool, key_id: str) -> bool:
    """Revoke a key at once; True when it exists (now revoked), False when there is no such key."""
    try:
        parsed = uuid.UUID(key_id)
    except ValueError:
        return False
    return await ApiKeyStore(pool).revoke_key(parsed)


async def list_api_keys(pool: asyncpg.Pool, company_id: str, *, sessions: bool = False) -> list[ApiKey]:
    """The keys of one company, oldest first, revoked ones included (never hashes or secrets); its
    session keys too when ``sessions``."""
    return await ApiKeyStore(pool).list_keys(_parse_uuid(company_id, "company_id"), sessions=sessions)


@dataclass(frozen=True)
class Caller:
    """Who makes a call: the company, and the key it authenticated with."""

    company_id: str
    key_id: str
    # A session key (CreateSessionKey), and when it expires.
    session: bool = False
    expires_at: datetime | None = None
    # A session key's company key (the key that made it).
    parent_key_id: str | None = None
    # The person a sign-in through the company's provider verified (such session keys only).
    person: VerifiedPerson | None = None


class Authenticator:
    """Resolves an ``authorization`` metadata value to the caller whose live key it carries, throttling
    failed attempts per source address and per key id."""

    def __init__(
        self, store: ApiKeyStore, throttle: ThrottleConfig | None = None, cache: KeyCache | None = None
    ) -> None:
        self._store = store
        self._cache = cache
        self._throttle = AuthThrottle(
            throttle or ThrottleConfig(), _log, what="authentications", settings=THROTTLE_SETTINGS
        )

    async def caller_for(self, authorization: str | None, peer: str = "") -> Caller:
        subjects = [f"source:{source_of(peer)}"]
        secret = ""
        key_id: uuid.UUID | None = None
        if authorization:
            scheme, _, secret = authorization.strip().partition(" ")
            secret = secret.strip() if scheme.lower() == "bearer" else ""
            key_id = parse_key_id(secret)
        if key_id is not None:
            subjects.append(f"key:{key_id}")
        refused = self._throttle.refusal(subjects, str(key_id) if key_id else None)
        if refused is None:
            try:
                return await self._check(authorization, secret, key_id)
            except Unauthenticated:
                refused = self._throttle.failed(subjects)
                if refused is None:
                    raise
        wait_ms, sentence = refused
        raise ResourceExhausted(sentence, retry_after_ms=wait_ms)

    async def _check(self, authorization: str | None, secret: str, key_id: uuid.UUID | None) -> Caller:
        if not authorization:
            raise Unauthenticated(f"no API key: {_HOW_TO_AUTH}")
        if not secret:
            raise Unauthenticated(f"malformed authorization metadata: {_HOW_TO_AUTH}")
        if key_id is None:
            raise Unauthenticated(f"malformed API key (keys read qyk_<key id>_<secret>): {_HOW_TO_AUTH}")
        stored = await self._lookup(key_id)
        if stored is None or not hmac.compare_digest(stored.key_hash, _hash_secret(secret)):
            raise Unauthenticated(f"unknown API key: {_HOW_TO_AUTH}")
        if stored.revoked:
            raise Unauthenticated(f"this API key was revoked: {_HOW_TO_AUTH}")
        if stored.expired:
            raise Unauthenticated(f"this session key expired (sign in again): {_HOW_TO_AUTH}")
        return Caller(
            company_id=stored.company_id,
            key_id=str(key_id),
            session=stored.parent_key_id is not None,
            expires_at=stored.expires_at,
            parent_key_id=stored.parent_key_id,
            person=stored.person,
        )

    async def _lookup(self, key_id: uuid.UUID) -> StoredKeyHash | None:
        """The key's row as authentication needs it: from the cache when it holds it, else read (and kept)."""
        cache = self._cache
        if cache is None:
            return await self._store.get_key_hash(key_id)
        key = str(key_id)
        stored = cache.get(key)
        if stored is not None:
            return stored
        epoch = cache.epoch
        stored = await self._store.get_key_hash(key_id)
        if stored is not None:
            cache.put(key, stored, epoch)
        return stored


class CallerContext:
    """Carries the authenticated caller from the interceptor to the servicer of the same call."""

    def __init__(self) -> None:
        self._caller: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("quayutec_caller", default=None)

    def caller(self) -> Caller:
        """The caller; only callable inside an authenticated call."""
        caller = self._caller.get()
        if caller is None:
            raise Unauthenticated(f"no authenticated company: {_HOW_TO_AUTH}")
        return caller

    def company_id(self) -> str:
        """The calling company; only callable inside an authenticated call."""
        return self.caller().company_id

    def set(self, caller: Caller) -> contextvars.Token[Caller | None]:
        return self._caller.set(caller)

    def reset(self, token: contextvars.Token[Caller | None]) -> None:
        self._caller.reset(token)


def source_address(context: grpc.aio.ServicerContext) -> str:
    """The address a call counts against in the throttles: its peer's (``context.peer()``), or, when the
    peer's verified certificate names the console identity (which only the Gateway's console port, of
    mutual TLS, can carry), the browser address the console passes on in ``x-quayutec-client-address``.
    Anyone else's entry is ignored, so setting it gains nothing."""
    peer: str = context.peer()
    if peer_identity(context.auth_context()) != CONSOLE:
        return peer
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_ADDRESS_METADATA:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            try:
                return str(ipaddress.ip_address(text.strip()))
            except ValueError:
                return peer
    return peer


def _mark_request_id(metadata: Sequence[tuple[str, Any]] | None) -> None:
    """Put the caller's ``x-request-id`` on the current (server) span; an id longer than 64 characters or
    with other characters than letters, digits and ``._:-`` is left out rather than recorded."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    for key, value in metadata or ():
        if key == REQUEST_ID_METADATA:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            if _REQUEST_ID.fullmatch(text):
                span.set_attribute(REQUEST_ID_ATTRIBUTE, text)
            return


def _authorization(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Authenticates every call except health and reflection, before any handler code runs; registers
    every server stream with ``streams`` (the company's fair share; ended when its key is revoked)."""

    def __init__(self, authenticator: Authenticator, caller: CallerContext, streams: OpenStreams) -> None:
        self._authenticator = authenticator
        self._caller = caller
        self._streams = streams
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
            caller = await self._authenticate(method, context)
            token = self._caller.set(caller)
            try:
                return await inner(request, context)
            finally:
                self._caller.reset(token)

        return grpc.unary_unary_rpc_method_handler(
            authenticated,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    async def _authenticate(self, method: str, context: grpc.aio.ServicerContext) -> Caller:
        """The caller from its API key, or the call is aborted (UNAUTHENTICATED, RESOURCE_EXHAUSTED when
        throttled, or what failed). The caller's request id, when it sent a well-formed one, goes on the
        call's span first, refused calls included."""
        metadata = context.invocation_metadata()
        _mark_request_id(metadata)
        try:
            return await self._authenticator.caller_for(_authorization(metadata), source_address(context))
        except Exception as exc:
            await _abort(context, exc, f"authenticating {method}")
            raise  # abort raises; this line is never reached

    def _authenticated_stream(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """The same authentication for a server-streaming RPC, before its first item; the stream counts
        against its company's share and ends (UNAUTHENTICATED) when its key is revoked or expires."""
        inner = handler.unary_stream

        async def authenticated(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            caller = await self._authenticate(method, context)
            try:
                opened = self._streams.open(caller.company_id, caller.key_id, caller.expires_at)
            except ResourceExhausted as exc:
                await _abort(context, exc, method)
                raise
            token = self._caller.set(caller)
            try:
                produced = inner(request, context)
                if hasattr(produced, "__aiter__"):
                    relayed = self._items(produced.__aiter__(), opened, context, method)
                    try:
                        async for item in relayed:
                            yield item
                    finally:
                        await relayed.aclose()
                else:  # a handler that answers without items (one not implemented)
                    await produced
            finally:
                self._streams.close(opened)
                with contextlib.suppress(ValueError):  # closed from another context: that task ends anyway
                    self._caller.reset(token)

        return grpc.unary_stream_rpc_method_handler(
            authenticated,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    @staticmethod
    async def _items(
        items: AsyncIterator[Any], opened: OpenStream, context: grpc.aio.ServicerContext, method: str
    ) -> AsyncGenerator[Any, None]:
        """The handler's items until it ends, or until OpenStreams ends the stream (its key was revoked
        or expired): then the call is aborted with why, whether it was waiting for an item or sending one."""
        try:
            while True:
                opened.waiting = True
                try:
                    item = await items.__anext__()
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if opened.ended is None:
                        raise
                    opened.uncancel()  # ended by OpenStreams: the caller is told why, not "cancelled"
                    await _abort(context, opened.ended, method)
                    raise
                finally:
                    opened.waiting = False
                if opened.ended is not None:  # ended while the item before was being sent
                    await _abort(context, opened.ended, method)
                yield item
        finally:
            close = getattr(items, "aclose", None)
            if close is not None:
                await close()


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, what: str) -> None:
    """Abort the call with ``exc``'s status and trailers (a throttle's retry-after-ms); log what is
    neither the caller's fault nor a limit."""
    code, message = status_for(exc)
    if code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED):
        _log.warning("%s failed: %s", what, message, exc_info=exc)
    if trailers := trailers_of(exc):
        context.set_trailing_metadata(trailers)
    await context.abort(code, message)
